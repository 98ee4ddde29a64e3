"""Held-out loss and perplexity: the training objective summed over target units, in eval mode.

The held-out split is the data pipeline's (sequences whose sample-id hash falls under
``data.eval_fraction``), so a run's eval split is never trained on. During training each rank
evaluates its share and the sums are all-reduced; the ``eval`` verb runs the same sums on one
process (the ``loss`` task, minimind_ray/evals/loss.py).
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterable, Tuple

import torch
import torch.distributed as dist

from minimind_ray.stages.objective import Objective
from minimind_ray.engine.step import to_device


@torch.no_grad()
def eval_sums(model, objective: Objective, batches: Iterable[Dict[str, torch.Tensor]], limit: int = 0,
              device="cpu", autocast=None) -> Tuple[float, float]:
    """(loss summed over loss units, number of units) on up to ``limit`` micro-batches (0 = all)."""
    model.eval()
    loss_sum = weight = 0.0
    for i, mb in enumerate(batches):
        if limit and i >= limit:
            break
        mb = to_device(mb, torch.device(device))
        with (autocast or contextlib.nullcontext)():
            l, _, _ = objective.loss_sum(model, mb)
        loss_sum += float(l)
        weight += objective.weight(mb)
    return loss_sum, weight


def eval_metrics(loss_sum: float, weight: float) -> Dict[str, float]:
    loss = loss_sum / max(weight, 1.0)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def evaluate_state(state) -> Dict[str, float]:
    """Eval loss of a TrainState's model on its eval split: each rank takes its share, sums are all-reduced.
    Leaves the model in eval mode; the caller puts it back to train mode."""
    from minimind_ray.data.stream import TrainStream

    cfg = state.cfg
    ev = TrainStream(state.dataset, split="eval", global_batch_size=cfg.train.micro_batch_size * state.world,
                     micro_batch_size=cfg.train.micro_batch_size, world_size=state.world, rank=state.rank,
                     seed=cfg.train.seed, shuffle=False, prefetch_steps=0)
    try:
        loss_sum, weight = eval_sums(state.model, state.objective, ev.eval_batches(), limit=cfg.train.eval_batches,
                                     device=state.device, autocast=state.autocast)
    finally:
        ev.close()
    t = torch.tensor([loss_sum, weight], dtype=torch.float64, device=state.device)
    if state.world > 1:
        dist.all_reduce(t)
    return eval_metrics(float(t[0]), float(t[1]))
