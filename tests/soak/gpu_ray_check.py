"""The GPU path through Ray Train, on one lent GPU, in one device call (issue 25): a table, and a verdict.

Parts, in this order (``--parts``; each is skipped, and says so, once ``--budget-s`` is spent):

  env      torch, CUDA, NCCL, the GPU; which Ray (the carried wheel) and where it was imported from
  speed    ``minimind-ray pretrain`` (the CLI, Ray Train ``TorchTrainer``, 1 worker, ``use_gpu``, NCCL, bf16)
           against the bare engine (``minimind_ray.engine``, this process, no Ray) on the same GPU, data and
           settings, compile off and on, side by side: tokens/s and MFU over the same window of steps, peak
           memory against the estimate (engine/memory.py), the extra seconds of each checkpoint
  restore  deterministic algorithms (tests/soak/gpu_site/sitecustomize.py in the workers): a fault-free run and one
           whose worker raises at a step (``train.faults``) and is restored from its checkpoint on CUDA; the
           restored step, the seconds from the fault to the first step after, final weights equal or not
  oom      a micro-batch the GPU cannot hold (by the estimate, about 1.3x its memory): exit code 2, one line,
           the worker group started once
  profile  torch.profiler over a few bare-engine steps (bf16, compiled): the kernel table and a trace under --out,
           the top 5 kernels, the share of device time by kind of kernel, and how busy the device was
  mfu      the MFU candidates (tests/soak/gpu_mfu.py), before/after in this call on the bare engine (switches of one
           run; the product code is untouched): fused AdamW, larger micro-batches, SDPA ``enable_gqa`` instead of
           ``repeat_kv`` copies, all three together, CUDA graphs (compile mode reduce-overhead), the loss on bf16
           logits; tokens/s and MFU against the baseline's, and each row's per-step loss against an fp32 eager run
           of the same steps and batch. A candidate that fails to run is a row of the table, not a failure
  fsdp     FSDP2 on CUDA (issue 36), sharded over the one rank one GPU allows (NCCL takes one rank per GPU; the
           memory FSDP saves needs 2+ GPUs): ``minimind-ray pretrain ... train.parallelism=fsdp`` with a fault,
           restored from its sharded (DCP) checkpoint, and with activation checkpointing (and compile), against the DDP
           pipeline (bf16 autocast) of the same steps: tokens/s, the final loss (bf16 weights under FSDP's
           MixedPrecisionPolicy vs autocast); the bare engine on a process group of one: peak memory against the
           estimate, and the 0.5B preset's tokens/s and peak with activation checkpointing

One table is printed and written to ``--out`` (``$OUT`` on the device): gpu_ray_check.md, .json, the
profile files and the pipelines' log tails. Then the verdict (``failures``): a part that failed, a restore not
bit-equal, an out-of-memory run that did not end in one line with exit 2; the exit code is 1 when there is one.
An MFU candidate that does not run (CUDA graphs refusing the step, say) is a result, not a failure.
tests/soak/test_gpu.py runs it under pytest (marker ``soak``).

On the device (no Ray there; the carried wheels, see tests/soak/gpu_ray_check.sh)::

    tests/soak/gpu_ray_check.sh           # = python3 -m tests.soak.gpu_ray_check --out $OUT --budget-s 400

On CPU here, the same code path with tiny sizes (preset tiny, seq 64, gloo, fp32, no compile)::

    .venv/bin/python -m tests.soak.gpu_ray_check --cpu --out /tmp/gpu-ray-smoke
    .venv/bin/python -m tests.soak.gpu_ray_check --cpu --parts env,mfu --out /tmp/mfu-rehearsal   # one part
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minimind_ray.config import load_config
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.memory import GiB, estimate
from minimind_ray.engine.metrics import peak_flops
from minimind_ray.engine.state import TrainState
from tests.soak.gpu_mfu import VARIANTS, Candidate, profile_run

REPO = Path(__file__).resolve().parents[2]
PARTS = ("env", "speed", "restore", "oom", "profile", "mfu", "fsdp")  # issue 51: FSDP2 if it fits, after the MFU rows


class Setup:
    """Sizes and settings of the two modes (GPU: the issue's; --cpu: a smoke test of the same code)."""

    def __init__(self, args):
        self.cpu, self.out, self.t0, self.budget = args.cpu, Path(args.out), time.time(), args.budget_s
        self.work = Path(tempfile.mkdtemp(prefix="gpu-ray-check-"))
        self.device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
        self.micro = args.micro or (8 if args.cpu else 64)
        self.seq = 64 if args.cpu else 512
        self.steps = args.steps or (50 if args.cpu else 80)
        self.log_every = 10
        self.rows, self.results, self.logs = [], {}, []

    def data_overrides(self):
        """What decides the prepared data: the same in every run, so all of them reuse one prepare."""
        return ["data.train_path=[demo]", "data.tokenizer=builtin", f"data.max_seq_len={self.seq}",
                "data.eval_fraction=0", f"data.cache_dir={self.work}/cache"]

    def overrides(self, micro=None, **train):
        micro = micro or self.micro
        base = [f"model.preset={'tiny' if self.cpu else 'minimind2-small'}", *self.data_overrides(),
                f"checkpoint.storage_path={self.work}/runs",
                "tracking.enabled=false", f"train.global_batch_size={micro}", f"train.micro_batch_size={micro}",
                "train.epochs=1000", "train.warmup_steps=10", f"train.log_interval={self.log_every}",
                f"train.precision={'fp32' if self.cpu else 'bf16'}", "cluster.num_workers=1",
                f"cluster.use_gpu={'false' if self.cpu else 'true'}", f"cluster.backend={'gloo' if self.cpu else 'nccl'}",
                f"cluster.cpus_per_worker={1 if self.cpu else 4}", "cluster.max_failures=3",
                "train.threads_per_worker=1" if self.cpu else "train.threads_per_worker=4"]
        return base + [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in train.items()]

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def row(self, *cells):
        self.rows.append(cells)
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def window(times: dict, every: int, last: int):
    """(first, last) steps of the timed window: just after two log steps, where the loop had synchronised
    with the device (metrics are read once per log interval), after the first interval (warm-up, compile)."""
    starts = [s for s in sorted(times) if s % every == 1 and s > every and s <= last]
    return (starts[0], starts[-1]) if len(starts) >= 2 else (None, None)


def mfu_of(tok_s: float, cfg, device) -> float:
    from minimind_ray.model.minimind import build_model

    peak = peak_flops(device)
    if not peak:
        return float("nan")
    with torch.device("meta"):
        fpt = build_model(cfg.model).flops_per_token(cfg.data.max_seq_len)
    return tok_s * fpt / peak


class Stamps(Hooks):
    """What the Ray worker's sample log records (raytrain/faults.py:SampleLog), for the bare engine: the wall
    time when each step's batches arrive, the losses and the peak memory."""

    def __init__(self):
        self.t, self.loss, self.peak = {}, {}, 0.0

    def on_batches(self, step, batches):
        self.t[step] = time.time()

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.loss.update(per_step_loss)
        self.peak = max(self.peak, metrics["peak_mem_gb"])


def engine_run(s: Setup, prepared: str, compile_: bool, steps=None, profile_steps: int = 0, variant: str = "baseline",
               precision=None, micro=None):
    """Train ``steps`` on the bare engine in this process; tokens/s over the log-synchronised window. ``variant``:
    an MFU candidate's switches (tests/soak/gpu_mfu.py); ``precision``, ``micro``: in place of the Setup's."""
    steps = steps or s.steps
    micro = micro or s.micro * VARIANTS[variant].get("micro_x", 1)
    over = s.overrides(micro=micro, max_steps=steps, compile=compile_)
    cfg = load_config(None, over + ([f"train.precision={precision}"] if precision else []))
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if compile_:  # compiled afresh, as in a new process: no recompile limit reached, no batch size made dynamic
        torch._dynamo.reset()
    hooks = Stamps()
    with Candidate(variant) as switches:  # its module-level switches on while the model is built and trained
        state = TrainState.build(cfg, prepared, device=s.device)
        switches.on_state(state)
        if profile_steps:
            return profile_run(s, state, profile_steps)
        run(state, hooks)
        note = switches.verify()
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    a, b = window(hooks.t, s.log_every, steps)
    tok_s = (b - a) * micro * s.seq / (hooks.t[b] - hooks.t[a]) if a else float("nan")
    est = estimate(cfg, micro, s.device.type)
    peak = torch.cuda.max_memory_allocated() / GiB if s.device.type == "cuda" else hooks.peak
    del state
    return {"tok_s": tok_s, "mfu": mfu_of(tok_s, cfg, s.device), "peak_gib": peak,
            "estimate_gib": (est.total - (est.parts["runtime"] if s.device.type == "cuda" else 0)) / GiB,
            "loss": hooks.loss, "window": (a, b), "micro": micro, "note": note}


def pipeline(s: Setup, name: str, *over, extra_pythonpath=None, expect_rc=0):
    """``minimind-ray pretrain`` in a subprocess that joins this script's Ray; timings from its sample log."""
    samples = s.work / "samples" / name
    over = list(over) + [f"name={name}", f"train.sample_log_dir={samples}"]
    env = {**os.environ, "RAY_ADDRESS": s.ray_address, "PYTHONUNBUFFERED": "1"}
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_pythonpath), env.get("PYTHONPATH", "")])
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "pretrain", *over], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=max(60, int(s.left()) + 60))
    wall = time.time() - t0
    s.logs.append(f"==== {name}: exit {p.returncode}, {wall:.0f} s\n" + (p.stdout + p.stderr)[-6000:])
    if p.returncode != expect_rc:
        raise RuntimeError(f"{name}: exit code {p.returncode}, expected {expect_rc}: {(p.stdout + p.stderr)[-3000:]}")
    rows = []
    for f in samples.glob("rank*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return {"rows": rows, "wall": wall, "stdout": p.stdout, "stderr": p.stderr,
            "run_dir": s.work / "runs" / name}


def rank0_times(rows, attempt=None):
    return {r["step"]: r["t"] for r in rows if r["rank"] == 0 and (attempt is None or r["attempt"] == attempt)}


def part_env(s: Setup):
    import ray

    from minimind_ray.raytrain.driver import connect_ray

    cfg = load_config(None, s.overrides(max_steps=1))
    connect_ray(cfg, dashboard=not s.cpu)  # one local Ray for the whole script; the CLI runs join it
    s.ray_address = ray.get_runtime_context().gcs_address
    jars = (Path(ray.__file__).parent / "jars").exists()
    dev = torch.cuda.get_device_name(0) if not s.cpu else f"cpu ({os.cpu_count()} cores)"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if not s.cpu else "-"
    s.results["env"] = {"torch": torch.__version__, "device": dev, "nccl": nccl, "ray": ray.__version__,
                        "ray_from": ray.__file__, "ray_jars": jars, "python": sys.version.split()[0]}
    s.row("env", f"torch {torch.__version__}, {dev}, NCCL {nccl}", f"Ray {ray.__version__} from {ray.__file__}"
          f" (jars {'present' if jars else 'stripped'})", "", "")
    # the data, prepared once by the CLI (Ray Data) on this Ray; every later run reuses it
    prep = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "prepare", *s.data_overrides()],
                          cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "RAY_ADDRESS": s.ray_address}, timeout=600)
    if prep.returncode != 0:
        raise RuntimeError(f"prepare failed: {(prep.stdout + prep.stderr)[-3000:]}")
    s.prepared = re.search(r"^prepared: (.+)$", prep.stdout, re.M).group(1).strip()


def part_speed(s: Setup):
    ckpt_every = 50 if not s.cpu else 20
    compiles = (False, True) if not s.cpu or s.compile_on_cpu else (False,)
    for compile_ in compiles:
        e = engine_run(s, s.prepared, compile_)
        p = pipeline(s, f"speed-compile-{compile_}", *s.overrides(max_steps=s.steps, compile=compile_),
                     f"checkpoint.interval={ckpt_every}")
        t = rank0_times(p["rows"])
        a, b = e["window"]
        tok_s = (b - a) * s.micro * s.seq / (t[b] - t[a]) if a and b in t and a in t else float("nan")
        cfg = load_config(None, s.overrides(max_steps=s.steps, compile=compile_))
        gaps = {k: t[k + 1] - t[k] for k in t if k + 1 in t and k > s.log_every}
        logged = [g for k, g in gaps.items() if k % s.log_every == 0 and k % ckpt_every != 0]
        ckpt = [gaps[k] - statistics.median(logged) for k in gaps if k % ckpt_every == 0] if logged else []
        pm = mfu_of(tok_s, cfg, s.device)
        s.results[f"speed_compile_{compile_}"] = {"engine": {k: v for k, v in e.items() if k != "loss"},
                                                  "pipeline_tok_s": tok_s, "pipeline_mfu": pm,
                                                  "checkpoint_s": ckpt, "pipeline_wall_s": p["wall"]}
        s.row(f"speed, compile {'on' if compile_ else 'off'}",
              f"pipeline {tok_s:,.0f} tok/s ({pm:.1%} MFU) / engine {e['tok_s']:,.0f} ({e['mfu']:.1%}) = "
              f"{tok_s / e['tok_s']:.3f}", f"steps {a}-{b} of {s.steps}, {s.micro} x {s.seq}",
              f"peak {e['peak_gib']:.2f} GiB (estimate {e['estimate_gib']:.2f})",
              "checkpoints: " + ", ".join(f"{c:+.2f} s" for c in ckpt))


def part_restore(s: Setup):
    site = Path(__file__).resolve().parent / "gpu_site"  # torch.use_deterministic_algorithms(True) in every worker it reaches
    steps, every, fault = 40, 10, 25
    over = s.overrides(max_steps=steps) + [f"checkpoint.interval={every}"]
    marks = Path(tempfile.gettempdir()) / "gpu_site_deterministic"
    shutil.rmtree(marks, ignore_errors=True)
    straight = pipeline(s, "restore-straight", *over, extra_pythonpath=site)
    faulted = pipeline(s, "restore-fault", *over, f"train.faults=[{fault}:raise:0]", extra_pythonpath=site)
    from minimind_ray.store.checkpoint import MODEL, newest_complete

    def weights(run_dir):
        ck = newest_complete(str(run_dir))
        return torch.load(Path(ck.location) / MODEL, map_location="cpu", weights_only=True)

    a, b = weights(straight["run_dir"]), weights(faulted["run_dir"])
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    attempts = sorted({r["attempt"] for r in faulted["rows"]})
    restored = max(attempts)
    before, after = rank0_times(faulted["rows"], 0), rank0_times(faulted["rows"], restored)
    recovery = after[restored + 1] - before[fault - 1] if (restored + 1) in after and (fault - 1) in before else None
    s.results["restore"] = {"equal": equal, "max_abs_diff": diff, "attempts": attempts, "restored_from": restored,
                            "recovery_s": recovery, "deterministic_worker_processes": len(list(marks.glob("*")))}
    s.row("restore on " + s.device.type, f"fault at step {fault} -> restored from step {restored}, "
          f"{recovery:.1f} s to the next step" if recovery else f"attempts {attempts}",
          f"final weights bit-equal to the fault-free run: {equal} (max |dw| {diff:.1e})",
          f"deterministic algorithms in {s.results['restore']['deterministic_worker_processes']} Ray worker "
          f"processes", "")


def part_oom(s: Setup):
    """A micro-batch the device cannot hold: the CLI must end at once with one line and exit code 2."""
    if s.cpu:  # the host refuses an allocation twice its memory (tests/integration/test_oom.py's way)
        with open("/proc/meminfo") as f:
            mem = sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("MemTotal", "SwapTotal")))
        micro = -(-2 * mem // (s.seq * (1 << 20) * 4))
        over = s.overrides(micro=micro, max_steps=2) + ["model.vocab_size=1048576", "model.hidden_size=32",
                                                        "model.num_attention_heads=2", "model.num_key_value_heads=1",
                                                        "model.intermediate_size=64"]
    else:  # about 1.3x the GPU's memory by the estimate
        total = torch.cuda.get_device_properties(0).total_memory
        cfg = load_config(None, s.overrides(micro=64, max_steps=2))
        per = (estimate(cfg, 64, "cuda").total - estimate(cfg, 32, "cuda").total) / 32
        micro = min(1856, 64 * -(-int(1.3 * total / per) // 64))  # the corpus holds 1902 sequences of 512
        over = s.overrides(micro=micro, max_steps=2)
    t0 = time.time()
    p = pipeline(s, "oom", *over, expect_rc=2)
    lines = [ln for ln in p["stderr"].splitlines() if ln.startswith("error:")]
    starts = p["stdout"].count("[minimind-ray] world 1 on")
    detected = len(list((p["run_dir"] / ".faults").glob("detected-*.json")))
    tracebacks = [ln for ln in p["stderr"].splitlines() if "Traceback" in ln and "PlacementGroupCleaner" not in ln]
    ok = len(lines) == 1 and "train.micro_batch_size=" in lines[0] and starts == 1 and not tracebacks
    s.results["oom"] = {"micro": micro, "line": lines, "worker_starts": starts, "failures_seen": detected,
                        "seconds": time.time() - t0, "ok": ok}
    s.row("out of memory", f"micro-batch {micro} x {s.seq}: exit 2 in {time.time() - t0:.0f} s, "
          f"{len(lines)} error line, worker group started {starts}x", (lines or ["(no line)"])[0][:400], "", "")


def fsdp_engine_run(s: Setup, preset: str, micro: int, steps: int, checkpointing: str) -> dict:
    """The bare engine under train.parallelism=fsdp in this process, on a process group of one (what a one-worker
    Ray Train run has): tokens/s over the log-synchronised window, peak memory against the estimate."""
    import torch.distributed as dist

    over = s.overrides(micro=micro, max_steps=steps, parallelism="fsdp", activation_checkpointing=checkpointing)
    cfg = load_config(None, over + [f"model.preset={preset}"])
    dist.init_process_group("gloo" if s.cpu else "nccl", init_method=f"file://{s.work}/pg-{preset}-{checkpointing}",
                            rank=0, world_size=1)
    try:
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        state = TrainState.build(cfg, s.prepared, device=s.device)
        hooks = Stamps()
        run(state, hooks)
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        assert state.sharded
        del state
    finally:
        dist.destroy_process_group()
    a, b = window(hooks.t, s.log_every, steps)
    tok_s = (b - a) * micro * s.seq / (hooks.t[b] - hooks.t[a]) if a else float("nan")
    est = estimate(cfg, micro, s.device.type, 1)
    peak = torch.cuda.max_memory_allocated() / GiB if s.device.type == "cuda" else hooks.peak
    return {"tok_s": tok_s, "mfu": mfu_of(tok_s, cfg, s.device), "peak_gib": peak, "micro": micro,
            "estimate_gib": (est.total - (est.parts["runtime"] if s.device.type == "cuda" else 0)) / GiB,
            "last_loss": hooks.loss.get(steps)}


def part_fsdp(s: Setup):
    from minimind_ray.store.checkpoint import newest_complete

    steps, every, fault = 40, 10, 25

    def final(p):
        ck = newest_complete(str(p["run_dir"]))
        return ck, ck.meta().reported.get("loss")

    def tok_s(p, attempt=None):
        t = rank0_times(p["rows"], attempt)
        a, b = (min(k for k in t if k > 2 * s.log_every), max(t)) if len(t) > 2 * s.log_every + 2 else (None, None)
        return (b - a) * s.micro * s.seq / (t[b] - t[a]) if a and b > a else float("nan")

    over = [f"checkpoint.interval={every}"]
    ddp = pipeline(s, "fsdp-ddp-reference", *s.overrides(max_steps=steps), *over)
    faulted = pipeline(s, "fsdp-fault", *s.overrides(max_steps=steps, parallelism="fsdp"), *over,
                       f"train.faults=[{fault}:raise:0]")
    # on the GPU also compiled: each block compiled in place before it is sharded (no CPU test runs that)
    ac = pipeline(s, "fsdp-ac", *s.overrides(max_steps=steps, parallelism="fsdp", activation_checkpointing="blocks",
                                             compile=not s.cpu), *over)
    (ck_ddp, loss_ddp), (ck_fsdp, loss_fsdp), (_, loss_ac) = final(ddp), final(faulted), final(ac)
    attempts = sorted({r["attempt"] for r in faulted["rows"]})
    res = {"ddp_tok_s": tok_s(ddp), "fsdp_tok_s": tok_s(faulted, 0), "fsdp_ac_tok_s": tok_s(ac),
           "loss_ddp": loss_ddp, "loss_fsdp": loss_fsdp, "loss_fsdp_ac": loss_ac, "sharded": ck_fsdp.sharded,
           "restored_from": max(attempts), "attempts": attempts}
    s.row(f"fsdp on {s.device.type} (1 rank)", f"pipeline tok/s: ddp {res['ddp_tok_s']:,.0f}, fsdp "
          f"{res['fsdp_tok_s']:,.0f}, fsdp+checkpointing{'' if s.cpu else '+compile'} {res['fsdp_ac_tok_s']:,.0f}",
          f"final loss ddp {loss_ddp:.4f} / fsdp {loss_fsdp:.4f} (fault at {fault}, restored from step "
          f"{res['restored_from']}, sharded {ck_fsdp.sharded}) / fsdp+ac {loss_ac:.4f}", "", "")
    small = fsdp_engine_run(s, "tiny" if s.cpu else "minimind2-small", s.micro, 30, "none")
    big_preset = "demo" if s.cpu else "minimind2-0.5b"
    big = fsdp_engine_run(s, big_preset, max(1, s.micro // 4), 30, "blocks") if s.left() > 90 else None
    res["engine"] = {"small": small, "big": big}
    s.results["fsdp"] = res
    s.row("fsdp engine (1 rank)", f"{small['tok_s']:,.0f} tok/s ({small['mfu']:.1%} MFU)",
          f"micro {small['micro']} x {s.seq}", f"peak {small['peak_gib']:.2f} GiB (estimate {small['estimate_gib']:.2f})",
          "" if big is None else f"{big_preset} + checkpointing: {big['tok_s']:,.0f} tok/s ({big['mfu']:.1%} MFU), "
          f"micro {big['micro']}, peak {big['peak_gib']:.2f} GiB (estimate {big['estimate_gib']:.2f})")


def part_profile(s: Setup):
    summary = engine_run(s, s.prepared, compile_=not s.cpu, steps=20, profile_steps=5)
    s.results["profile"] = summary
    s.row("profile (5 steps, bf16, compiled)" if not s.cpu else "profile (5 steps, CPU)",
          "top 5: " + "; ".join(f"{k} {us:.0f} us/step" for k, us in summary["top"][:5]),
          f"device busy {summary['busy']:.0%} of the steps' wall time ({summary['step_ms']:.1f} ms a step)",
          "profile_kernels.txt", "; ".join(f"{k} {v:.0%}" for k, v in summary["shares"].items()))


def part_mfu(s: Setup):
    """Each MFU candidate (tests/soak/gpu_mfu.py) on the bare engine, against the baseline of this call."""
    compile_, steps = not s.cpu, (60 if not s.cpu else 30)
    res = s.results["mfu"] = {}
    refs = {}  # micro-batch -> an fp32 eager run of the same steps: what each candidate's loss is held against

    def reference(micro):
        if micro not in refs:
            try:
                refs[micro] = engine_run(s, s.prepared, compile_=False, steps=steps, precision="fp32", micro=micro)
            except Exception as e:
                refs[micro] = {"loss": {}, "error": f"{type(e).__name__}: {e}"[:2000]}
            res[f"fp32_eager_micro_{micro}"] = {k: v for k, v in refs[micro].items() if k != "loss"}
        return refs[micro]

    for name, spec in VARIANTS.items():
        if s.cpu and spec.get("cuda_only"):
            s.row(f"mfu: {name}", "n/a on CPU", spec["what"], "", "")
            continue
        if s.left() < 45:
            s.row(f"mfu: {name}", f"skipped: {s.left():.0f} s of the budget left", spec["what"], "", "")
            continue
        try:
            r = engine_run(s, s.prepared, compile_=compile_, steps=steps, variant=name)
        except Exception as e:  # a candidate that does not run is a result too, not the check's failure
            res[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            s.row(f"mfu: {name}", f"FAILED: {type(e).__name__}: {str(e)[:300]}", spec["what"], "", "")
            continue
        if s.cpu and name == "baseline":  # fp32 eager already: its own reference
            refs.setdefault(r["micro"], r)
        ref = reference(r["micro"]) if s.left() > 60 or r["micro"] in refs else {"loss": {}}
        common = sorted(set(r["loss"]) & set(ref["loss"]))
        dl = max(abs(r["loss"][k] - ref["loss"][k]) for k in common) if common else float("nan")
        base = res.get("baseline", {}).get("tok_s")
        res[name] = {**{k: v for k, v in r.items() if k != "loss"}, "max_loss_diff_vs_fp32": dl,
                     "vs_baseline": r["tok_s"] / base if base else None}
        mfu = "MFU n/a (no peak FLOP/s known)" if r["mfu"] != r["mfu"] else f"{r['mfu']:.1%} MFU"
        s.row(f"mfu: {name}", f"{r['tok_s']:,.0f} tok/s, {mfu}" +
              (f", {r['tok_s'] / base:.2f}x the baseline" if base and name != "baseline" else ""),
              f"{spec['what']}; micro {r['micro']} x {s.seq}", f"peak {r['peak_gib']:.2f} GiB",
              f"loss vs fp32 eager: max diff {dl:.1e} over steps 1-{steps}" + (f"; {r['note']}" if r["note"] else ""))


def failures(results: dict) -> list:
    """The check's verdict: one line per part that failed or gave the wrong answer (none: it passed)."""
    bad = [f"{part}: {r['error'][:300]}" for part, r in results.items() if isinstance(r, dict) and "error" in r]
    if "equal" in results.get("restore", {}) and not results["restore"]["equal"]:
        bad.append(f"restore: the final weights differ from the fault-free run's (max |dw| "
                   f"{results['restore']['max_abs_diff']:.1e})")
    if "ok" in results.get("oom", {}) and not results["oom"]["ok"]:
        bad.append(f"oom: not one line with exit 2 after one worker start: {results['oom']}")
    if "sharded" in results.get("fsdp", {}) and not results["fsdp"]["sharded"]:
        bad.append("fsdp: the checkpoint is not sharded")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-ray-check-out"))
    ap.add_argument("--cpu", action="store_true", help="smoke mode: the same code path, tiny sizes, on CPU")
    ap.add_argument("--cpu-compile", action="store_true", help="--cpu with torch.compile too (minutes on 2 cores)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting parts and MFU rows after this")
    ap.add_argument("--micro", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.cpu:
        assert torch.cuda.is_available(), "no CUDA device: use --cpu for the smoke mode"
    s = Setup(args)
    s.compile_on_cpu = args.cpu_compile
    s.out.mkdir(parents=True, exist_ok=True)
    print("| part | result | detail | memory | notes |\n|---|---|---|---|---|", flush=True)
    wanted = [p for p in PARTS if p in args.parts.split(",")]
    for name in ["env"] + [p for p in wanted if p != "env"]:
        if name != "env" and s.left() < 30:
            s.row(name, f"skipped: {s.left():.0f} s of the budget left", "", "", "")
            continue
        try:
            globals()[f"part_{name}"](s)
        except Exception as e:  # one part's failure must not lose the others' figures
            s.results[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
            s.row(name, f"FAILED: {type(e).__name__}: {str(e)[:300]}", "", "", "")
            if name == "env":
                break
    table = ["| part | result | detail | memory | notes |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in s.rows]
    text = "\n".join(table) + f"\n\nwall {time.time() - s.t0:.0f} s; work dir {s.work}\n"
    (s.out / "gpu_ray_check.md").write_text(text)
    (s.out / "gpu_ray_check.json").write_text(json.dumps(s.results, indent=1, default=str))
    (s.out / "pipeline_logs.txt").write_text("\n\n".join(s.logs)[-4_000_000:])
    bad = failures(s.results)
    print("\n" + text + "\nverdict: " + ("passed" if not bad else "FAILED\n  " + "\n  ".join(bad)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
