"""Standalone evaluation: loss and perplexity of any weights on a held-out split.

The held-out split is the data pipeline's (sequences whose sample-id hash falls under
``data.eval_fraction``), so a run's eval split is never trained on. The loss is the
same objective the training loop uses, summed over target tokens and divided by
their count, in eval mode.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterable, Optional, Tuple

import torch

from minimind_ray.train.objectives import Objective


@torch.no_grad()
def eval_sums(model, objective: Objective, batches: Iterable[Dict[str, torch.Tensor]], limit: int = 0,
              device="cpu", autocast=None) -> Tuple[float, float]:
    """(loss summed over loss units, number of units) on up to ``limit`` micro-batches (0 = all)."""
    model.eval()
    loss_sum = weight = 0.0
    for i, mb in enumerate(batches):
        if limit and i >= limit:
            break
        mb = {k: v.to(device) for k, v in mb.items()}
        with (autocast or contextlib.nullcontext)():
            l, _, _ = objective.loss_sum(model, mb)
        loss_sum += float(l)
        weight += objective.weight(mb)
    return loss_sum, weight


def eval_metrics(loss_sum: float, weight: float) -> Dict[str, float]:
    loss = loss_sum / max(weight, 1.0)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def evaluate_weights(weights: str, data: Optional[str] = None, preset: Optional[str] = None,
                     batches: int = 0, micro_batch_size: int = 8,
                     device: Optional[str] = None) -> Dict[str, float]:
    """Evaluate ``weights`` on ``data`` (a prepared dir), or on the eval split of the run they came from."""
    from minimind_ray.config import RunConfig
    from minimind_ray.data.stream import PreparedDataset, TrainStream
    from minimind_ray.train.checkpoint import read_meta
    from minimind_ray.train.objectives import build_objective
    from minimind_ray.weights import build_inference_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, lw = build_inference_model(weights, preset, device=device)
    run_cfg = lw.run_cfg or RunConfig()
    if data is None:
        if lw.checkpoint_dir is None:
            raise ValueError("--data is needed for a bare .pth")
        data = read_meta(lw.checkpoint_dir)["prepared_dir"]
        split, frac = "eval", run_cfg.data.eval_fraction
        if frac <= 0:
            raise ValueError(f"the run of {weights} has no eval split (data.eval_fraction=0); pass --data")
    else:
        split, frac = "train", 0.0  # a separate held-out set: all of it
    ds = PreparedDataset(data, eval_fraction=frac)
    if ds.format not in ("pretrain", "sft"):
        raise ValueError(f"{data}: eval loss is defined for pretrain/sft data, not {ds.format!r}")
    run_cfg.train.stage = ds.format
    objective = build_objective(run_cfg)
    stream = TrainStream(ds, split=split, global_batch_size=micro_batch_size, micro_batch_size=micro_batch_size,
                         world_size=1, rank=0, seed=0, shuffle=False, prefetch_steps=0)
    try:
        loss_sum, weight = eval_sums(model, objective, stream.eval_batches(), limit=batches, device=device)
    finally:
        stream.close()
    return {**eval_metrics(loss_sum, weight), "eval_units": weight}
