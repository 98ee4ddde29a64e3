"""Held-out loss, perplexity and bits per byte: the training objective summed over target units, in eval mode.

The held-out split is the data pipeline's (sequences whose sample-id hash falls under
``data.eval_fraction``), so a run's eval split is never trained on. During training each rank
evaluates its share and the sums are all-reduced; the ``eval`` verb runs the same sums on one
process (the ``loss`` task, minimind_ray/evals/loss.py).

Bits per byte (``eval_bpb``, nanochat's measure): the cross-entropy summed over the target tokens, in nats, over the
UTF-8 bytes those tokens spell, divided by ln 2. A loss per token depends on how much text a token holds, so it
compares models of one tokenizer only; bits per byte is per unit of text, so it compares models whose tokenizers
differ (MiniMind2's and minimind-3's 6,400-token vocabularies) on the same text. The bytes of each id come from the
prepared data (its manifest's ``token_bytes``, written by the tokenizer at prepare time) or from the tokenizer
itself (tokenizer.py:Tokenizer.token_bytes); special tokens spell no bytes, and their loss counts (a document's end
is information about the text). Defined for a stage whose loss is the cross-entropy (its record's ``cross_entropy``:
pretrain, SFT, LoRA): other objectives' losses are not nats per token.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from minimind_ray.engine.step import to_device
from minimind_ray.stages import get_stage
from minimind_ray.stages.objective import Objective


@dataclass
class EvalSums:
    loss_sum: float = 0.0  # the objective's loss summed over its units (nats, for the cross-entropy)
    weight: float = 0.0  # loss units (target tokens, pairs)
    text_bytes: float = 0.0  # UTF-8 bytes the targets spell; 0 when unknown (no bits per byte then)
    batches: int = 0  # micro-batches evaluated


@torch.no_grad()
def eval_sums(model, objective: Objective, batches: Iterable[Dict[str, torch.Tensor]], limit: int = 0,
              device="cpu", autocast=None, token_bytes: Optional[Sequence[int]] = None) -> EvalSums:
    """The sums on up to ``limit`` micro-batches (0 = all). ``token_bytes``: the UTF-8 bytes of each token id
    (bits per byte; given only where the objective's loss is the cross-entropy of the batches' ``targets``), or
    None."""
    model.eval()
    sums = EvalSums()
    table = None
    if token_bytes is not None:
        table = torch.as_tensor(token_bytes, dtype=torch.int64, device=torch.device(device))
    for i, mb in enumerate(batches):
        if limit and i >= limit:
            break
        mb = to_device(mb, torch.device(device))
        with (autocast or contextlib.nullcontext)():
            l, _, _ = objective.loss_sum(model, mb)
        sums.loss_sum += float(l)
        sums.weight += objective.weight(mb)
        sums.batches += 1
        if table is not None:
            targets = mb["targets"]
            sums.text_bytes += float(table[targets[targets.ne(-100)]].sum())
    return sums


def bits_per_byte(loss_sum_nats: float, text_bytes: float) -> float:
    """Summed cross-entropy in nats over the bytes of the text it predicted, in bits."""
    return loss_sum_nats / (math.log(2) * text_bytes)


def eval_metrics(sums: EvalSums) -> Dict[str, float]:
    loss = sums.loss_sum / max(sums.weight, 1.0)
    out = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
    if sums.text_bytes > 0:
        out["eval_bpb"] = bits_per_byte(sums.loss_sum, sums.text_bytes)
    return out


def evaluate_state(state) -> Dict[str, float]:
    """Eval loss of a TrainState's model on its eval split: each rank takes its share, sums are all-reduced.
    Leaves the model in eval mode; the caller puts it back to train mode."""
    from minimind_ray.data.stream import TrainStream  # lazy: numpy, omegaconf, pyarrow, yaml, only when this runs

    cfg = state.cfg
    mb = cfg.train.micro_batch_size
    ev = TrainStream(state.dataset, split="eval", global_batch_size=mb * state.world,
                     micro_batch_size=mb, world_size=state.world, rank=state.rank,
                     seed=cfg.train.seed, shuffle=False, prefetch_steps=0)
    token_bytes = state.dataset.token_bytes if get_stage(cfg.train.stage).cross_entropy else None
    try:
        sums = eval_sums(state.model, state.objective, ev.eval_batches(), limit=cfg.train.eval_batches,
                         device=state.device, autocast=state.autocast, token_bytes=token_bytes)
    finally:
        ev.close()
    if getattr(state, "sharded", False):
        _match_forwards(state, sums.batches)
    t = torch.tensor([sums.loss_sum, sums.weight, sums.text_bytes], dtype=torch.float64, device=state.device)
    if state.world > 1:
        dist.all_reduce(t)
    return eval_metrics(EvalSums(float(t[0]), float(t[1]), float(t[2])))


def _match_forwards(state, done: int) -> None:
    """Under FSDP a forward is a collective (each block's weights are all-gathered), so every rank must run as many
    as the others. Shares of the split differ by one row at most, so a rank may have one micro-batch fewer than
    rank 0 (which has the most): it runs a one-token forward for each it lacks, its output unused."""
    n, world, mb, limit = state.dataset.num_sequences("eval"), state.world, state.cfg.train.micro_batch_size, \
        state.cfg.train.eval_batches
    most = -(-(n // world + (n % world > 0)) // mb)  # rank 0's share, in micro-batches
    most = min(most, limit) if limit else most
    with torch.no_grad():
        for _ in range(most - done):
            state.model(torch.zeros((1, 1), dtype=torch.long, device=state.device))
