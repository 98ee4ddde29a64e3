"""The one training loop of one rank, from the state's step to its last step.

    each step:        hooks.before_step -> this rank's batches -> hooks.on_batches -> train_step
    every log/eval/checkpoint step: one all-reduce of the interval's sums (one host sync),
                      evaluation when due, hooks.on_metrics (rank 0 logs it somewhere)
    every checkpoint step and the last: hooks.on_checkpoint (the caller saves ``state`` and hands it over)

Whoever runs the loop supplies the :class:`Hooks`: the Ray worker (minimind_ray/raytrain/worker.py)
reports checkpoints to Ray Train and metrics to MLflow; a unit test or a benchmark passes none.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from minimind_ray.store.config import checkpoint_due
from minimind_ray.engine.evaluate import evaluate_state
from minimind_ray.engine.metrics import IntervalMeter, device_name, peak_flops
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step


class Hooks:
    """No-op callbacks; subclass and override what you need. Every rank calls every hook."""

    def before_step(self, step: int) -> None:
        """Before the step's data is read (fault injection lives here)."""

    def on_batches(self, step: int, batches: List[dict]) -> None:
        """This rank's micro-batches of the step, before they train."""

    def on_metrics(self, step: int, metrics: Dict[str, Any], per_step_loss: List[Tuple[int, float]],
                   is_checkpoint: bool) -> None:
        """The interval's metrics (the same on every rank) and every step's global mean loss."""

    def on_checkpoint(self, step: int, metrics: Dict[str, Any]) -> None:
        """A checkpoint is due after this step (``state.save`` writes this rank's part)."""

    def preemption_notice(self, step: int) -> bool:
        """After the step, on every rank, the same answer everywhere: is a node of this run about to be taken away
        (raytrain/preemption.py asks Ray)? True: this step is logged and checkpointed, then on_preempted, then
        the loop ends, so a restart from that checkpoint loses no step."""
        return False

    def on_preempted(self, step: int) -> None:
        """The checkpoint of this step is saved after a notice (the Ray worker waits here for Ray Train's restart)."""


def schedule(cfg, step: int, total_steps: int, has_eval: bool) -> Tuple[bool, bool, bool]:
    """(log, checkpoint, evaluate) at this step. A step whose checkpoint is validated is a checkpoint step."""
    last = step == total_steps
    is_log = step % cfg.train.log_interval == 0 or last
    is_ckpt = checkpoint_due(cfg, step, total_steps)
    is_eval = has_eval and ((cfg.train.eval_interval and step % cfg.train.eval_interval == 0) or last)
    return is_log, is_ckpt, bool(is_eval)


def run(state: TrainState, hooks: Optional[Hooks] = None) -> None:
    """Train ``state`` from ``state.step + 1`` through ``state.total_steps``."""
    hooks = hooks or Hooks()
    cfg, stream = state.cfg, state.stream
    flops_per_token = state.model.flops_per_token(cfg.data.max_seq_len)
    peak = peak_flops(state.device)
    has_eval = state.dataset.num_sequences("eval") > 0
    meter = IntervalMeter()
    if state.rank == 0:
        wrapper = "fsdp (sharded)" if state.sharded else "ddp" if state.world > 1 else "one worker"
        if cfg.train.activation_checkpointing != "none":
            wrapper += f", activation checkpointing of {cfg.train.activation_checkpointing}"
        print(f"[minimind-ray] world {state.world} on {device_name(state.device)}, {wrapper}, "
              f"{state.model.num_parameters() / 1e6:.2f}M params, {stream.steps_per_epoch} steps/epoch "
              f"({stream.dropped_per_epoch} sequences/epoch left out: the last, partial global batch of "
              f"{stream.global_batch_size}, at any world size), {state.total_steps} steps, "
              f"accumulation {stream.accumulation_steps}", flush=True)
    state.model.train()
    comm_warned = False
    for step in range(state.step + 1, state.total_steps + 1):
        hooks.before_step(step)
        t0 = time.perf_counter()
        batches = stream.next_step()
        data_wait = time.perf_counter() - t0
        hooks.on_batches(step, batches)
        out = train_step(state, batches, step)
        meter.add(out, data_wait)

        is_log, is_ckpt, is_eval = schedule(cfg, step, state.total_steps, has_eval)
        preempted = hooks.preemption_notice(step)  # a drain notice: log and checkpoint this step, then stop
        if preempted:
            is_log = is_ckpt = True
        if not (is_log or is_ckpt or is_eval):
            continue
        metrics = meter.reduce(world=state.world, device=state.device, step=step, total_steps=state.total_steps,
                               steps_per_epoch=stream.steps_per_epoch, lr=out.lr, grad_norm=out.grad_norm,
                               flops_per_token=flops_per_token, peak=peak,
                               comm_busy=state.comm.collect() if state.comm is not None else 0.0)
        per_step_loss = metrics.pop("_per_step_loss")
        if is_eval:
            metrics.update(evaluate_state(state))
            state.model.train()
        if state.rank == 0 and metrics["comm_fraction"] > cfg.train.comm_warn_fraction and not comm_warned:
            comm_warned = True  # once per worker group: the metric itself is logged every interval
            print(f"[minimind-ray] WARNING: all-reduce took {metrics['comm_fraction']:.0%} of step time "
                  f"(> {cfg.train.comm_warn_fraction:.0%}) at step {step}; see metric comm_fraction", flush=True)
        hooks.on_metrics(step, metrics, per_step_loss, is_ckpt)
        meter.reset()
        if is_ckpt:
            hooks.on_checkpoint(step, metrics)
        if preempted:
            hooks.on_preempted(step)
            break
    stream.close()
