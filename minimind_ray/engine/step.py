"""One optimizer step of one rank: the same for every stage, every world size, with or without Ray.

    batches = objective.prepare(batches)                             (RL: rollouts, rewards; else as is)
    for each update of objective.update_plan(batches)                (one, but GRPO's and PPO's passes x mini-batches)
        weight  = all-reduce(sum of the micro-batches' loss units)  (target tokens, pairs, completions)
        for each micro-batch (no_sync on all but the last):
            loss = objective.loss_sum(mb) * world / weight + aux / n_micro ; backward
        objective.keep_update? else drop this and every later update (PPO's early stop on KL)
        clip the global gradient norm ; AdamW                      (and each trained part's: PPO's critic)
    scheduler(s) ; objective.end_step (GRPO's adaptive KL)

DDP averages gradients over ranks; scaling each rank's summed loss by ``world / weight``
turns that average into the gradient of the mean over the *global* batch, so a 1-worker
and a 2-worker run at the same global batch take the same steps.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from minimind_ray.engine.parallel import clip_sharded_grad_norm


def lr_lambda(train_cfg, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step t (0-based); ``train_cfg`` is a TrainConfig."""
    t = train_cfg
    if t.lr_schedule == "minimind":  # MiniMind's own: lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))
        return lambda s: 0.1 + 0.45 * (1.0 + math.cos(math.pi * s / max(total_steps, 1)))
    warmup = min(t.warmup_steps, max(1, total_steps // 10))

    def cosine(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, total_steps - warmup)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return cosine


def check_precision(precision: str, device_type: str, bf16_supported: bool, device_name: str = "") -> None:
    """bf16 needs a GPU that computes in it (compute capability 8.0+: A100, H100, L4, RTX 30xx and newer).
    On older GPUs (V100, T4) ``train.precision=bf16`` is refused rather than emulated slowly; ``auto``
    falls back to fp32 there. There is no fp16 + loss-scaling mode."""
    if precision == "bf16" and device_type == "cuda" and not bf16_supported:
        from minimind_ray.config_checks import ConfigError  # lazy: omegaconf, yaml, only when this runs

        raise ConfigError(f"train.precision: bf16 needs a GPU with bf16 (compute capability 8.0 or newer); "
                          f"{device_name or 'this GPU'} has none: use train.precision=fp32 (or auto)")


def bf16_compute(precision: str, device: torch.device) -> bool:
    """Whether the run computes in bf16: on CUDA GPUs that have it (or when asked), else fp32. DDP gets it from
    autocast (:func:`autocast_for`), FSDP from its mixed-precision policy (engine/parallel.py)."""
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if device.type == "cuda":
        check_precision(precision, device.type, bf16_ok, torch.cuda.get_device_name(device))
    return precision == "bf16" or (precision == "auto" and device.type == "cuda" and bf16_ok)


def autocast_for(precision: str, device: torch.device):
    """A context-manager factory: bf16 autocast on CUDA GPUs that have bf16 (or when asked), fp32 otherwise."""
    if bf16_compute(precision, device):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class StepOutput:
    """What one step leaves for the interval metrics. Tensors stay on the device (no host sync)."""

    step: int
    loss_sum: torch.Tensor  # this rank's loss summed over its units (float64), averaged over the step's passes
    weight: torch.Tensor  # the global batch's loss units (all-reduced, float64, >= 1), counted over one pass
    aux: torch.Tensor  # this rank's MoE aux loss, averaged over micro-steps (float64)
    extras: Dict[str, torch.Tensor]  # objective-specific sums (DPO margins, distillation CE/KL, ...)
    tokens: int  # tokens this rank's forward passes processed
    grad_norm: torch.Tensor
    lr: float  # the lr this step used
    metric_weight: torch.Tensor = None  # what ``extras`` are means over (all-reduced); None = ``weight``


def _no_sync(state, parts, sync: bool):
    """No gradient all-reduce on this micro-batch: DDP's no_sync of the policy and of every trained part. FSDP
    reduce-scatters every micro-batch (engine/parallel.py: skipping it would hold whole gradients)."""
    if sync or getattr(state, "sharded", False):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for m in [state.ddp_model, *(part.ddp_model for part in parts)]:
        stack.enter_context(m.no_sync())
    return stack


def _global_units(obj, micro_batches, world: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the update's loss units (>= 1), its metric units), summed over ranks in one all-reduce (float64)."""
    local = [float(sum(obj.weight(b) for b in micro_batches)), float(sum(obj.metric_weight(b) for b in micro_batches))]
    units = torch.tensor(local, device=device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(units)
    return units[0].clamp_min(1.0), units[1]


def train_step(state, batches: List[Dict[str, torch.Tensor]], step: int) -> StepOutput:
    """Run optimizer step ``step`` (1-based) of ``state`` (a TrainState) on this rank's micro-batches.

    An objective may make several optimizer updates of one step (``Objective.update_plan``: GRPO's passes
    over its rollouts and their mini-batches); each is a mean over its own all-reduced loss units, and the lr
    schedule moves once per step (verl's rule)."""
    obj, world, device = state.objective, state.world, state.device
    batches = obj.prepare(state, batches, step)  # RL stages generate their rollouts here; others: as they are
    passes = obj.update_plan(batches)
    n_updates = sum(len(p) for p in passes)
    loss_local = torch.zeros((), device=device, dtype=torch.float64)
    aux_local = torch.zeros((), device=device, dtype=torch.float64)
    weight = metric_weight = None
    extras: Dict[str, torch.Tensor] = {}
    tokens_local = 0
    clip = state.cfg.train.grad_clip
    parts = list(getattr(state, "parts", {}).values())  # models trained beside the policy (PPO's critic)
    grad_norm, stopped = torch.zeros((), device=device), False
    for p, updates in enumerate(passes):
        if stopped:
            break
        for micro_batches in updates:
            w, mw = _global_units(obj, micro_batches, world, device)  # the update's mean is over the global batch
            if p == 0:
                weight = w if weight is None else weight + w
                metric_weight = mw if metric_weight is None else metric_weight + mw
            scale = (world / w).float()  # DDP averages gradients over ranks; undo that to sum, then divide
            n_micro = len(micro_batches)
            for i, mb in enumerate(micro_batches):
                mb = to_device(mb, device)
                sync = world == 1 or i == n_micro - 1
                with _no_sync(state, parts, sync), state.autocast():
                    loss_sum, aux, extra = obj.loss_sum(state.forward_model, mb)
                    loss = loss_sum * scale + aux / n_micro
                loss.backward()
                loss_local += loss_sum.detach().double() / len(passes)
                aux_local += aux.detach().double() / n_micro / n_updates
                tokens_local += obj.tokens(mb)
                for k, v in extra.items():
                    extras[k] = extras.get(k, 0.0) + v.detach().double()
            if not obj.keep_update(state):  # the same answer on every rank: no rank steps alone
                for opt in [state.optimizer, *(part.optimizer for part in parts)]:
                    opt.zero_grad(set_to_none=True)
                stopped = True
                break
            clip_norm = clip_sharded_grad_norm if getattr(state, "sharded", False) else torch.nn.utils.clip_grad_norm_
            grad_norm = clip_norm(state.params, clip if clip > 0 else float("inf"))
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            for part in parts:  # clipped on its own, as MiniMind clips actor and critic
                torch.nn.utils.clip_grad_norm_(part.params, clip if clip > 0 else float("inf"))
                part.optimizer.step()
                part.optimizer.zero_grad(set_to_none=True)
    lr = state.scheduler.get_last_lr()[0]  # the lr this step used
    state.scheduler.step()
    for part in parts:
        part.scheduler.step()
    state.step = step
    out = StepOutput(step, loss_local, weight, aux_local, extras, tokens_local, grad_norm, lr, metric_weight)
    obj.end_step(state, out)
    return out
