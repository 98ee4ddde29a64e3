"""The one training loop, run by every Ray Train worker (``train_loop_per_worker``).

Flow of one worker::

    restore  <- the newest complete checkpoint (Ray's, or a newer one in storage that a crash kept
                Ray from registering): model, optimizer, scheduler, data position, RNG, MLflow run id
    stream   <- TrainStream(prepared data)     this rank's slice of each global batch, exactly once
    each step: all-reduce the step's loss weight -> micro-steps (no_sync but the last) -> clip -> AdamW
    every log_interval: one all-reduce of the interval's sums ; rank 0 -> MLflow and the driver's console
    every checkpoint.interval and at the end: ray.train.report(metrics, checkpoint)  (a barrier: only then)

What differs per stage (loss, frozen parts, extra models) lives in objectives.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from minimind_ray.config import RunConfig, from_dict, to_dict, worker_threads
from minimind_ray.train import checkpoint as ckpt_io
from minimind_ray.train.metrics import CommTimer, Meter, device_name, peak_flops, peak_memory_gb
from minimind_ray.train.objectives import Objective, build_objective


# --------------------------------------------------------------------------- pieces


def lr_lambda(cfg: RunConfig, total_steps: int):
    """Multiplier of the peak lr at optimizer step t (0-based)."""
    t = cfg.train
    if t.lr_schedule == "minimind":  # MiniMind's own: lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))
        return lambda s: 0.1 + 0.45 * (1.0 + math.cos(math.pi * s / max(total_steps, 1)))
    warmup = min(t.warmup_steps, max(1, total_steps // 10))

    def cosine(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, total_steps - warmup)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return cosine


def pick_device(cfg: RunConfig) -> torch.device:
    """This worker's GPU when the run uses GPUs (Ray maps its GPU ids through CUDA_VISIBLE_DEVICES), else CPU."""
    if cfg.cluster.use_gpu is not False and torch.cuda.is_available():
        from ray.train.torch import get_device

        device = get_device()
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def autocast_for(cfg: RunConfig, device: torch.device):
    """bf16 autocast on CUDA, fp32 on CPU (unless the config forces one)."""
    p = cfg.train.precision
    use_bf16 = p == "bf16" or (p == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class FaultInjector:
    """Fails once at a configured step (``train.fail_at_step``), so recovery is testable.

    "Once" is remembered in a marker file under the run directory: the restarted
    worker group passes the same step again and must not fail a second time."""

    def __init__(self, cfg: RunConfig, run_dir: Optional[str], rank: int):
        t = cfg.train
        self.rank, self.cfg = rank, t
        self.marker_dir = Path(run_dir) if run_dir and "://" not in run_dir else None

    def _first_time(self, what: str, step: int) -> bool:
        if self.marker_dir is None:
            return True
        marker = self.marker_dir / f".fault_{what}_{step}"
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(time.time()))
        return True

    def maybe_fail(self, step: int) -> None:
        t = self.cfg
        if t.fail_at_step != step or self.rank != t.fail_rank or not self._first_time("fail", step):
            return
        print(f"[fault-injection] rank {self.rank}: {t.fail_mode} at step {step}", flush=True)
        if t.fail_mode == "raise":
            raise RuntimeError(f"injected failure at step {step} (train.fail_at_step)")
        if t.fail_mode == "exit":
            os._exit(13)
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe_hang(self, step: int) -> None:
        t = self.cfg
        if t.hang_at_step == step and self.rank == t.fail_rank and self._first_time("hang", step):
            print(f"[fault-injection] rank {self.rank}: hanging at step {step}", flush=True)
            while True:  # the others block in the next collective until its timeout fires
                time.sleep(60)


class SampleLog:
    """Debug record, per step and rank, of the sample ids trained on and when the step's data arrived.

    ``attempt`` is the step this worker group started from (0, or the restored checkpoint's
    step), so replays after a restart can be told apart. Used by the exactly-once tests and
    by bench/bench_train.py for recovery and checkpoint timings."""

    def __init__(self, directory: Optional[str], rank: int, world: int, attempt: int):
        self.f, self.attempt = None, attempt
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.f = open(Path(directory) / f"rank{rank}.jsonl", "a")
        self.rank, self.world = rank, world

    def write(self, step: int, batches: List[Dict[str, torch.Tensor]]) -> None:
        if self.f is None:
            return
        ids = torch.cat([b["sample_ids"] for b in batches]).tolist()
        self.f.write(json.dumps({"step": step, "rank": self.rank, "world": self.world,
                                 "attempt": self.attempt, "t": time.time(), "ids": ids}) + "\n")
        self.f.flush()


# --------------------------------------------------------------------------- the loop


def train_loop_per_worker(config: Dict[str, Any]) -> None:
    import ray.train
    from ray.train import Checkpoint

    from minimind_ray.data.stream import PreparedDataset, TrainStream
    from minimind_ray.model.minimind import build_model

    cfg: RunConfig = from_dict(config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(worker_threads(cfg))
    device = pick_device(cfg)
    autocast = autocast_for(cfg, device)

    # ---- model, stage plug-in, restore
    model = build_model(cfg.model, seed=cfg.train.seed)  # the same init on every rank (build_model forks the RNG)
    torch.manual_seed(cfg.train.seed + rank)  # dropout and sampling differ per rank
    random.seed(cfg.train.seed + rank)
    objective: Objective = build_objective(cfg)
    # Ray's registered checkpoint, or a newer complete one a hard crash kept Ray from registering
    restored = ckpt_io.restore_point(ray.train.get_checkpoint(), config.get("run_dir"), rank, world)
    meta: Optional[Dict[str, Any]] = None
    if cfg.train.init_from:  # also on restore: DPO's reference is a copy of the *initial* weights
        ckpt_io.load_model_weights(model, cfg.train.init_from, strict=True)
    objective.setup(model, device)  # freezes / builds frozen models from the initial weights
    train_state = rng = None
    if restored is not None:
        with restored.as_directory() as d:
            ckpt_io.verify(Path(d))
            meta = ckpt_io.read_meta(Path(d))
            ckpt_io.load_model_weights(model, d, strict=True)
            train_state = ckpt_io.load_train_state(Path(d))
            rng = ckpt_io.load_rng(Path(d), rank)
    model.to(device)
    raw_model = model

    comm: Optional[CommTimer] = None
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None,
                    forward_sync_buffers=False, gradient_as_bucket_view=True)  # RoPE tables are equal on all ranks
        comm = CommTimer()
        model.register_comm_hook(None, comm.hook)
    fwd_model = torch.compile(model) if cfg.train.compile else model

    params = [p for p in raw_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                                  weight_decay=cfg.train.weight_decay)

    # ---- data
    dataset = PreparedDataset(config["prepared_dir"], eval_fraction=cfg.data.eval_fraction)
    stream = TrainStream(dataset, split="train", global_batch_size=cfg.train.global_batch_size,
                         micro_batch_size=cfg.train.micro_batch_size, world_size=world, rank=rank,
                         seed=cfg.train.seed, shuffle=cfg.data.shuffle,
                         shuffle_window_blocks=cfg.data.shuffle_window_blocks,
                         prefetch_steps=cfg.data.prefetch_steps)
    n_micro = stream.accumulation_steps
    total_steps = cfg.train.max_steps or cfg.train.epochs * stream.steps_per_epoch
    if total_steps <= 0:
        raise ValueError(f"{config['prepared_dir']}: {dataset.num_sequences('train')} training sequences "
                         f"make no full global batch of {cfg.train.global_batch_size}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))

    start_step = 0
    run_id = config.get("mlflow_run_id")
    if meta is not None:
        optimizer.load_state_dict(train_state["optimizer"])
        scheduler.load_state_dict(train_state["scheduler"])
        stream.load_state_dict(meta["data_state"])
        start_step = meta["step"]
        run_id = meta.get("mlflow_run_id") or run_id
        if rng is not None:
            ckpt_io.set_rng_state(rng)
        if rank == 0:
            print(f"[minimind-ray] restored step {start_step} (saved by {meta['world_size']} workers, "
                  f"now {world}; accumulation {n_micro})", flush=True)

    logger = None
    if rank == 0 and run_id and cfg.tracking.enabled:
        from minimind_ray.tracking import RunLogger

        logger = RunLogger(config["tracking_uri"], run_id, timeout_s=cfg.tracking.timeout_s,
                           system_metrics=cfg.tracking.system_metrics)

    sink = config.get("progress_sink")
    faults = FaultInjector(cfg, config.get("run_dir"), rank)
    samples = SampleLog(cfg.train.sample_log_dir, rank, world, attempt=start_step)
    flops_per_token = raw_model.flops_per_token(cfg.data.max_seq_len)
    peak = peak_flops(device)
    meter = Meter()
    per_step: List[tuple] = []  # (step, local loss sum, global weight, local aux) since the last report
    eval_split = dataset.num_sequences("eval") > 0
    if rank == 0:
        print(f"[minimind-ray] world {world} on {device_name(device)}, {raw_model.num_parameters()/1e6:.2f}M params, "
              f"{stream.steps_per_epoch} steps/epoch ({stream.dropped_per_epoch} sequences/epoch dropped to "
              f"equalise ranks), {total_steps} steps, accumulation {n_micro}", flush=True)

    model.train()
    comm_warned = False
    for step in range(start_step + 1, total_steps + 1):
        faults.maybe_fail(step)
        t_step = time.perf_counter()
        batches = stream.next_step()
        t_data = time.perf_counter() - t_step
        samples.write(step, batches)

        # the step's loss is a mean over the *global* batch: all-reduce its weight first
        w_local = sum(objective.weight(b) for b in batches)
        w = torch.full((), float(w_local), device=device, dtype=torch.float64)  # a fill, no host->device copy
        faults.maybe_hang(step)
        if world > 1:
            dist.all_reduce(w)
        w = w.clamp_min(1.0)
        scale = (world / w).float()  # DDP averages gradients over ranks; undo that to sum, then divide

        # sums stay on the device: no host sync per micro-step (they are read once per log interval)
        loss_local = torch.zeros((), device=device, dtype=torch.float64)
        aux_local = torch.zeros((), device=device, dtype=torch.float64)
        extra_sums: Dict[str, torch.Tensor] = {}
        tokens_local = 0
        for i, mb in enumerate(batches):
            mb = to_device(mb, device)
            sync = world == 1 or i == n_micro - 1
            with (contextlib.nullcontext() if sync else model.no_sync()), autocast():
                loss_sum, aux, extra = objective.loss_sum(fwd_model, mb)
                loss = loss_sum * scale + aux / n_micro
            loss.backward()
            loss_local += loss_sum.detach().double()
            aux_local += aux.detach().double() / n_micro
            tokens_local += objective.tokens(mb)
            for k, v in extra.items():
                extra_sums[k] = extra_sums.get(k, 0.0) + v.detach().double()
        if cfg.train.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
        optimizer.step()
        lr = scheduler.get_last_lr()[0]  # the lr this step used
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        meter.steps += 1
        meter.tokens += tokens_local
        meter.data_wait += t_data
        for k, v in extra_sums.items():
            meter.add(k, v)
        per_step.append((step, loss_local, w, aux_local))

        is_log = step % cfg.train.log_interval == 0 or step == total_steps
        is_ckpt = step % cfg.checkpoint.interval == 0 or step == total_steps
        is_eval = eval_split and ((cfg.train.eval_interval and step % cfg.train.eval_interval == 0)
                                  or step == total_steps)
        if not (is_log or is_ckpt or is_eval):
            continue

        meter.comm_busy = comm.collect() if comm is not None else 0.0
        metrics = _reduce_interval(meter, per_step, world, device, step, total_steps, stream.steps_per_epoch, lr,
                                   grad_norm, flops_per_token, peak)
        per_step_losses = metrics.pop("_per_step_loss")
        if is_eval:
            metrics.update(evaluate(raw_model, objective, dataset, cfg, world, rank, device, autocast))
            model.train()
        if rank == 0:
            if sink is not None:  # fire-and-forget: the driver's console view
                sink.push.remote({**metrics, "checkpoint": is_ckpt})
            if metrics.get("comm_fraction", 0.0) > cfg.train.comm_warn_fraction and not comm_warned:
                comm_warned = True  # once per worker group: the metric itself is logged every interval
                print(f"[minimind-ray] WARNING: all-reduce took {metrics['comm_fraction']:.0%} of step time "
                      f"(> {cfg.train.comm_warn_fraction:.0%}) at step {step}; see metric comm_fraction", flush=True)
            if logger is not None:
                for s, l in per_step_losses:
                    logger.log_metrics({"loss": l}, step=s)
                logger.log_metrics({k: v for k, v in metrics.items() if k not in ("loss", "step")}, step=step)
        meter.reset()
        per_step.clear()

        if is_ckpt:
            if rank == 0 and step == total_steps and logger is not None:
                metrics["tracking_summary"] = json.dumps(logger.close())
                logger = None
            if logger is not None:
                # points up to this checkpoint must not wait in the queue: a crash after it replays only later steps
                logger.flush(timeout_s=cfg.tracking.timeout_s)
            with tempfile.TemporaryDirectory(prefix="mmr-ckpt-") as tmp:
                ckpt_io.write_rank_files(Path(tmp), rank)
                if rank == 0:
                    ckpt_io.write_rank0_files(
                        Path(tmp), model_state=raw_model.state_dict(), optimizer=optimizer, scheduler=scheduler,
                        world_size=world,
                        meta={"step": step, "epoch": (step - 1) // stream.steps_per_epoch,
                              "data_state": stream.state_dict(), "world_size": world, "mlflow_run_id": run_id,
                              "stage": cfg.train.stage, "total_steps": total_steps,
                              "config": to_dict(cfg), "prepared_dir": config["prepared_dir"]})
                # the only ray.train.report of the loop: it is a barrier, so it comes with a checkpoint
                # (a few keys: every metric already went to MLflow, and Ray logs what it is given)
                brief = {k: metrics[k] for k in ("step", "epoch", "loss", "eval_loss", "tracking_summary") if k in metrics}
                ray.train.report(brief, checkpoint=Checkpoint.from_directory(tmp))

    stream.close()
    if logger is not None:
        logger.close()


def _reduce_interval(meter: Meter, per_step, world, device, step, total_steps, steps_per_epoch, lr,
                     grad_norm, flops_per_token, peak) -> Dict[str, Any]:
    """One all-reduce of everything the interval summed, then the metrics dict (one host sync per interval)."""
    k = len(per_step)
    extra_keys = sorted(meter.sums)
    host = torch.tensor([meter.tokens, meter.data_wait, meter.comm_busy], dtype=torch.float64)
    vec = torch.cat([torch.stack([l for _, l, _, _ in per_step]), torch.stack([a for _, _, _, a in per_step]),
                     host.to(device)] + [meter.sums[x].reshape(1).to(device) for x in extra_keys])
    if world > 1:
        dist.all_reduce(vec)
    vec = vec.cpu()
    weights_per_step = torch.stack([w for _, _, w, _ in per_step]).cpu()
    elapsed = max(time.perf_counter() - meter.t_start, 1e-9)  # wall time of the interval (the .cpu() synced)
    losses = [(per_step[i][0], float(vec[i] / weights_per_step[i])) for i in range(k)]
    aux = [float(vec[k + i]) / world for i in range(k)]
    tokens, data_wait, comm_busy = (float(x) for x in vec[2 * k:2 * k + 3])
    step_time = elapsed / max(meter.steps, 1)
    tok_s = tokens / elapsed
    weights = float(weights_per_step.sum())
    m: Dict[str, Any] = {
        "step": step,
        "total_steps": total_steps,
        "epoch": (step - 1) // steps_per_epoch,
        "loss": losses[-1][1],
        "loss_interval": sum(float(vec[i]) for i in range(k)) / max(weights, 1.0),
        "aux_loss": aux[-1],
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tok_s,
        "tokens_per_s_per_worker": tok_s / world,
        "mfu": (tok_s * flops_per_token / (peak * world)) if peak else float("nan"),
        "step_time_s": step_time,
        "data_wait_s": data_wait / world / max(meter.steps, 1),
        "allreduce_s": comm_busy / world / max(meter.steps, 1),
        "comm_fraction": (comm_busy / world / max(meter.steps, 1)) / max(step_time, 1e-9),
        "peak_mem_gb": peak_memory_gb(device),
        "world_size": world,
    }
    for i, x in enumerate(extra_keys):
        m[x] = float(vec[2 * k + 3 + i]) / max(weights, 1.0)
    m["_per_step_loss"] = losses
    return m


def evaluate(raw_model, objective: Objective, dataset, cfg: RunConfig, world, rank, device, autocast) -> Dict[str, float]:
    """Loss and perplexity on the held-out split: each rank takes its share, sums are all-reduced."""
    from minimind_ray.data.stream import TrainStream
    from minimind_ray.evaluate import eval_metrics, eval_sums

    ev = TrainStream(dataset, split="eval", global_batch_size=cfg.train.micro_batch_size * world,
                     micro_batch_size=cfg.train.micro_batch_size, world_size=world, rank=rank,
                     seed=cfg.train.seed, shuffle=False, prefetch_steps=0)
    try:
        loss_sum, weight = eval_sums(raw_model, objective, ev.eval_batches(), limit=cfg.train.eval_batches,
                                     device=device, autocast=autocast)
    finally:
        ev.close()
    t = torch.tensor([loss_sum, weight], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return eval_metrics(float(t[0]), float(t[1]))
