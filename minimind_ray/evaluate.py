"""The ``eval`` verb: loss and perplexity of any weights on a held-out split.

The held-out split is the data pipeline's (sequences whose sample-id hash falls under
``data.eval_fraction``), so a run's eval split is never trained on. The loss is the
same objective and the same sums the training loop's evaluation uses
(minimind_ray/engine/evaluate.py), on one process, in eval mode.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from minimind_ray.engine.evaluate import eval_metrics, eval_sums


def evaluate_weights(weights: str, data: Optional[str] = None, preset: Optional[str] = None,
                     batches: int = 0, micro_batch_size: int = 8,
                     device: Optional[str] = None) -> Dict[str, float]:
    """Evaluate ``weights`` on ``data`` (a prepared dir), or on the eval split of the run they came from."""
    from minimind_ray.config import RunConfig
    from minimind_ray.data.stream import PreparedDataset, TrainStream
    from minimind_ray.engine.objectives import build_objective
    from minimind_ray.store.weights import build_inference_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, lw = build_inference_model(weights, preset, device=device)
    run_cfg = lw.run_cfg or RunConfig()
    if data is None:
        if lw.meta is None:
            raise ValueError("--data is needed for a bare .pth")
        data = lw.meta.prepared_dir
        split, frac = "eval", run_cfg.data.eval_fraction
        if frac <= 0:
            raise ValueError(f"the run of {weights} has no eval split (data.eval_fraction=0); pass --data")
    else:
        split, frac = "train", 0.0  # a separate held-out set: all of it
    ds = PreparedDataset(data, eval_fraction=frac)
    if ds.format not in ("pretrain", "sft"):
        raise ValueError(f"{data}: eval loss is defined for pretrain/sft data, not {ds.format!r}")
    objective = build_objective(dataclasses.replace(run_cfg, train=dataclasses.replace(run_cfg.train, stage=ds.format)))
    stream = TrainStream(ds, split=split, global_batch_size=micro_batch_size, micro_batch_size=micro_batch_size,
                         world_size=1, rank=0, seed=0, shuffle=False, prefetch_steps=0)
    try:
        loss_sum, weight = eval_sums(model, objective, stream.eval_batches(), limit=batches, device=device)
    finally:
        stream.close()
    return {**eval_metrics(loss_sum, weight), "eval_units": weight}
