"""A micro-batch's completions, sampled and scored, for an algorithm that samples a group of completions per prompt
(rl/plan.py:GroupPlan: GRPO, RLOO) or one (PPO, with its critic): :func:`rollout_micro_batch` gives ``num_generations``
completions of each prompt, their rewards (DAPO's dynamic sampling of all-equal groups, the truncation mask), the
behaviour policy's and the frozen reference's per-token log-probs and the metric sums of the micro-batch;
:func:`score_rollouts` the reward terms' values of sampled completions; :func:`run_tokenizer` the tokenizer the
prompts were prepared with, which turns completions into the rewards' text.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.advantages import group_std
from minimind_ray.rl.logprobs import completion_logprobs, eos_mask
from minimind_ray.rl.rewards import RewardTerm, score
from minimind_ray.rl.rollout import RolloutEngine, row_seeds


def run_tokenizer(cfg, manifest: dict):
    """The tokenizer the prompts were prepared with, to turn completions into text for the rewards:
    the manifest's path when it is a URI or this machine has it (a path the driver wrote is on no other node of a
    cluster without a shared disk), else ``data.tokenizer`` resolved here; checked by hash."""
    # lazy: pyarrow, tokenizers, only when this runs
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

    path = manifest.get("tokenizer_path")
    if path and ("://" in path or os.path.exists(path)):  # a bucket's tokenizer (issue 49) loads on any node
        tok = load_tokenizer(path)
    else:
        tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    if tok.hash() != manifest.get("tokenizer_hash"):
        raise ValueError(f"data.tokenizer: {tok.path} (hash {tok.hash()[:12]}) is not the tokenizer the prompts were "
                         f"prepared with ({path}, hash {str(manifest.get('tokenizer_hash'))[:12]})")
    return tok


def _texts(tokenizer, mb: Dict[str, Tensor], completion_ids: Tensor, mask: Tensor,
           group_size: int) -> Tuple[List[str], List[str], List[str]]:
    """(prompts, completions, answers), one entry per completion (prompt-major, as sampled)."""
    prompt_ids, prompt_mask = mb["prompt_ids"].cpu(), mb["prompt_mask"].cpu().bool()
    prompts = [tokenizer.decode(row[m].tolist()) for row, m in zip(prompt_ids, prompt_mask)]
    answers = [bytes(row[:n].tolist()).decode("utf-8") for row, n in zip(mb["answer_utf8"].cpu(),
                                                                            mb["answer_len"].tolist())]
    ids, keep = completion_ids.cpu(), mask.cpu().bool()
    completions = [tokenizer.decode(row[k].tolist(), skip_special_tokens=True) for row, k in zip(ids, keep)]
    return ([p for p in prompts for _ in range(group_size)], completions,
            [a for a in answers for _ in range(group_size)])


def _widen(t: Tensor, width: int, value) -> Tensor:
    """``t`` (N, R) padded on the right with ``value`` to ``width`` columns."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)], 1)


def rollout_micro_batch(mb: Dict[str, Tensor], *, engine: RolloutEngine, params: SamplingParams,
                        group_size: int, rewards: List[RewardTerm], tokenizer, reference=None, autocast=None,
                        device: torch.device = torch.device("cpu"), seed: int = 0, step: int = 0,
                        dynamic_rounds: int = 0, mask_truncated: bool = False, pending=None) -> Dict[str, Tensor]:
    """One prepared micro-batch of B prompts -> the B * group_size completions an algorithm's loss trains on.

    Each completion samples from its own seed (rollout.row_seeds of seed, step, prompt id, index). ``pending``:
    the micro-batch's rollout generated ahead (an actor pool's overlap), else it is generated here. With
    ``dynamic_rounds`` (DAPO), groups whose rewards are all equal are sampled again (new seeds) up to that many
    rounds, and those still equal are dropped (their completions carry no loss). With ``mask_truncated`` a
    completion cut at max_new_tokens carries no loss.

    Keys: ``input_ids`` / ``attention_mask`` (N, P + R): the left-padded prompt then the completion;
    ``completion_mask`` (N, R) through each EOS; ``old_logp`` (N, R) the behaviour policy's log-probs;
    ``ref_logp`` (N, R) the reference's (when there is one); ``rewards`` (N,) (the objective turns them into
    ``advantages``); and ``metric_<name>`` scalars, sums over the completions that the engine's interval meter
    turns into means.
    """
    G = group_size
    prompt_ids = mb["prompt_ids"].to(device).repeat_interleave(G, dim=0)
    prompt_mask = mb["prompt_mask"].to(device).repeat_interleave(G, dim=0)
    roll = pending if pending is not None else engine.generate(
        prompt_ids, prompt_mask, params, seeds=row_seeds(seed, step, mb["sample_ids"], G).to(device))
    ids, valid, logp, truncated = roll.completion_ids, roll.completion_mask, roll.logprobs.float(), roll.truncated
    total, per_term = score_rollouts(tokenizer, rewards, mb, ids, eos_mask(ids, params.eos_id, valid), G)
    resampled = torch.zeros(mb["prompt_ids"].shape[0], dtype=torch.bool, device=device)
    for round_ in range(1, dynamic_rounds + 1):
        flat = group_std(total, G).view(-1, G)[:, 0].le(1e-6)  # (B,): a group that teaches nothing
        if not bool(flat.any()):
            break
        groups = flat.nonzero().squeeze(1)
        rows = (groups[:, None] * G + torch.arange(G, device=device)).reshape(-1)
        again = engine.generate(prompt_ids[rows], prompt_mask[rows], params,
                                seeds=row_seeds(seed, step, mb["sample_ids"][groups.cpu()], G, round_).to(device))
        width = max(ids.shape[1], again.completion_ids.shape[1])
        ids, valid, logp = (_widen(x, width, v) for x, v in ((ids, params.pad_id), (valid, False), (logp, 0.0)))
        ids[rows], valid[rows] = _widen(again.completion_ids, width, params.pad_id), _widen(again.completion_mask,
                                                                                             width, False)
        logp[rows], truncated = _widen(again.logprobs.float(), width, 0.0), truncated.clone()
        truncated[rows] = again.truncated
        sub_mb = {k: v[groups.to(v.device)] for k, v in mb.items()}
        sub_total, sub_terms = score_rollouts(tokenizer, rewards, sub_mb, again.completion_ids,
                                      eos_mask(again.completion_ids, params.eos_id, again.completion_mask), G)
        total[rows] = sub_total
        for label in per_term:
            per_term[label][rows] = sub_terms[label]
        resampled[groups] = True
    mask = eos_mask(ids, params.eos_id, valid)
    dropped = torch.zeros_like(resampled)
    if dynamic_rounds:
        dropped = group_std(total, G).view(-1, G)[:, 0].le(1e-6)
        mask = mask * (~dropped).repeat_interleave(G)[:, None]
    if mask_truncated:
        mask = mask * (~truncated)[:, None]
    batch = {"input_ids": torch.cat([prompt_ids, ids], dim=1),
             "attention_mask": torch.cat([prompt_mask.long(), eos_mask(ids, params.eos_id, valid).long()], dim=1),
             "completion_mask": mask, "old_logp": logp * mask, "rewards": total}
    if reference is not None:
        with torch.no_grad(), (autocast or contextlib.nullcontext)():
            batch["ref_logp"], _ = completion_logprobs(reference, batch["input_ids"], batch["attention_mask"],
                                                       mask.shape[1])
    spread = group_std(total, G)
    metrics = {"reward": total.sum(), "reward_std": spread.sum(),
               "zero_std_fraction": spread.le(1e-6).float().sum(),  # groups that teach nothing this step
               "completion_len": eos_mask(ids, params.eos_id, valid).sum(),
               "truncated_fraction": truncated.float().sum()}
    if dynamic_rounds:  # per group, times its completions: the meter's mean over completions is a share of groups
        metrics["resampled_fraction"] = resampled.float().sum() * G
        metrics["dropped_fraction"] = dropped.float().sum() * G
    for label, values in per_term.items():
        metrics[f"reward_{label}"], metrics[f"reward_{label}_std"] = values.sum(), group_std(values, G).sum()
    batch.update({f"metric_{k}": v.double() for k, v in metrics.items()})
    return batch


def score_rollouts(tokenizer, rewards: List[RewardTerm], mb: Dict[str, Tensor], ids: Tensor, mask: Tensor,
           group_size: int) -> Tuple[Tensor, Dict[str, Tensor]]:
    """(total reward per completion (N,), each term's values by label), as float32 tensors on ids' device."""
    prompts, completions, answers = _texts(tokenizer, mb, ids, mask, group_size)
    total, per_term = score(rewards, prompts, completions, answers)
    as_t = lambda v: torch.tensor(v, dtype=torch.float32, device=ids.device)  # noqa: E731
    return as_t(total), {k: as_t(v) for k, v in per_term.items()}


