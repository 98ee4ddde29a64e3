"""GRPO and CISPO as MiniMind's ``trainer/train_grpo.py`` (d65ef2c) defines them, with the options of verl, TRL
and DAPO (docs/rl.md), in pieces GRPO's plan (minimind_ray/rl/grpo_step.py:GRPOPlan, on the plan base rl/plan.py) calls:

* :func:`rollout_micro_batch` (in ``Objective.prepare``): ``num_generations`` completions of each
  prompt, their rewards (dynamic sampling of all-equal groups, truncation masks), the behaviour policy's
  and the frozen reference's per-token log-probs, and the metric sums of the micro-batch;
* :func:`group_advantages`: the reward minus its group's mean (or the leave-one-out mean), over the group's,
  the global batch's or no std;
* :func:`grpo_loss_sum` (in ``Objective.loss_sum``): per token ``-(min(r A, clip(r, 1-eps, 1+eps_high) A) -
  beta KL)`` (grpo) or ``-(sg(min(r, eps_high)) A log p - beta KL)`` (cispo), with r = p / p_behaviour
  and KL Schulman's k1, k2 or k3 (MiniMind: k3 ``exp(ref - log p) - (ref - log p) - 1``), aggregated by
  ``loss_agg`` (MiniMind: averaged over each completion's tokens through its EOS and summed over
  completions). The engine divides by the all-reduced :func:`loss_units`, so the step's loss is the mean
  ``loss_agg`` names at any world size.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.rewards import RewardTerm, score
from minimind_ray.rl.rollout import RolloutEngine, row_seeds, token_logprobs

ADV_EPS = 1e-4  # MiniMind's: (r - mean) / (std + 1e-4); a group of equal rewards gets advantage 0


def group_std(values: Tensor, group_size: int) -> Tensor:
    """The population std of each group of ``group_size`` consecutive values, repeated for each member (N,)."""
    grouped = values.view(-1, group_size)
    return grouped.std(dim=1, unbiased=False, keepdim=True).expand_as(grouped).reshape(-1)


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", kind: str = "grpo",
                     batch_std: Optional[float] = None) -> Tensor:
    """Advantages of consecutive groups of ``group_size`` rewards (N,): the reward minus its group's mean
    (``kind='grpo'``) or minus the mean of the group's other members (``'rloo'``, leave-one-out: G/(G-1) times
    the former), divided by the group's std + 1e-4 (``scale='group'``, MiniMind), by the global batch's std +
    1e-4 (``'batch'``, ``batch_std``) or not at all (``'none'``, Dr. GRPO)."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if kind == "rloo":
        centred = centred * (group_size / (group_size - 1))
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centred = centred / (batch_std + ADV_EPS)
    return centred.reshape(-1)


def eos_mask(completion_ids: Tensor, eos_id: int, valid: Optional[Tensor] = None) -> Tensor:
    """1.0 on each completion's tokens up to and including its first EOS (every token when it has none),
    0.0 after it and wherever ``valid`` (N, R) is False (an engine's padding)."""
    valid = torch.ones_like(completion_ids, dtype=torch.bool) if valid is None else valid.bool()
    is_eos = completion_ids.eq(eos_id) & valid
    last = completion_ids.shape[1] - 1
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], last,
                                                                                       dtype=torch.long))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return ((positions[None, :] <= first[:, None]) & valid).float()


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token: exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """KL(policy || reference) per token by Schulman's k1 (log p - log ref, unbiased, may be negative), k2
    ((log p - log ref)^2 / 2) or k3 (:func:`k3_kl`) estimator, on tokens sampled from the policy."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    raise ValueError(f"train.grpo.kl_estimator: unknown {estimator!r}; one of ('k1', 'k2', 'k3')")


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor, loss_type: str,
                   epsilon: float, epsilon_high: float, beta: float, clip_high: Optional[float] = None,
                   kl_estimator: str = "k3") -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, clipped, kl), each (N, R). ``clipped``: the token's ratio was cut off (cispo: above
    ``epsilon_high``; grpo: the clipped term was the smaller one and differs). grpo clips the ratio to
    [1 - epsilon, 1 + (clip_high or epsilon)] (DAPO's clip-higher when clip_high > epsilon)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    if loss_type == "cispo":
        gain = torch.clamp(ratio, max=epsilon_high).detach() * adv * logp
        clipped = ratio.detach() > epsilon_high
    elif loss_type == "grpo":
        high = epsilon if clip_high is None else clip_high
        unclipped, clipped_gain = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv
        gain = torch.min(unclipped, clipped_gain)
        clipped = (clipped_gain < unclipped).detach()
    else:
        raise ValueError(f"train.grpo.loss_type: unknown {loss_type!r}; one of ('cispo', 'grpo')")
    kl = kl_estimate(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
    return -(gain - beta * kl), clipped, kl


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` (N, R) over each row's masked-in tokens (N,); 0 for a row with none."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)


def aggregate_loss(loss: Tensor, mask: Tensor, mode: str, max_gen_len: int) -> Tensor:
    """The micro-batch's share of the step's loss, a sum the engine divides by :func:`loss_units`' all-reduced
    total: ``seq-mean`` sums each completion's token mean (MiniMind), ``token-mean`` sums every token (the mean
    over all tokens of the global batch, verl), ``seq-sum-norm`` sums each completion's token sum over
    ``max_gen_len`` (Dr. GRPO's constant normaliser, no length bias)."""
    if mode == "seq-mean":
        return sequence_mean(loss, mask).sum()
    if mode == "token-mean":
        return (loss * mask).sum()
    if mode == "seq-sum-norm":
        return (loss * mask).sum() / max_gen_len
    raise ValueError(f"train.grpo.loss_agg: unknown {mode!r}; one of ('seq-mean', 'token-mean', 'seq-sum-norm')")


def loss_units(mask: Tensor, mode: str) -> int:
    """What the step's loss is a mean over: completion tokens (token-mean) or completions that carry any token."""
    return int(mask.sum()) if mode == "token-mean" else int(mask.sum(dim=1).gt(0).sum())


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_len: int,
                        with_entropy: bool = False):
    """(log p of each of the last ``completion_len`` tokens (N, R) float32, the forward's MoE aux loss), and with
    ``with_entropy`` the policy's entropy at each of those positions (N, R), without gradient."""
    out = model(input_ids, attention_mask=attention_mask)
    logits = out.logits[:, -completion_len - 1:-1]  # the positions that predict the completion
    logp = token_logprobs(logits, input_ids[:, -completion_len:])
    if not with_entropy:
        return logp, out.aux_loss
    with torch.no_grad():
        lf = logits.float()
        entropy = torch.logsumexp(lf, dim=-1) - (torch.softmax(lf, dim=-1) * lf).sum(dim=-1)
    return logp, out.aux_loss, entropy


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
    """One prepared micro-batch of B prompts -> the B * group_size completions ``grpo_loss_sum`` trains on.

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


def grpo_loss_sum(model, batch: Dict[str, Tensor], grpo_cfg, beta: Optional[float] = None
                  ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """(loss summed as ``loss_agg`` says, MoE aux loss, metric sums): see the module docstring. ``beta``: the KL
    weight now (an adaptive controller's), else the config's. The per-update metrics (clip_fraction, kl,
    entropy) are scaled by 1 / num_iterations, so that summed over the step's passes they are a mean."""
    g, mask = grpo_cfg, batch["completion_mask"]
    logp, aux, entropy = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], mask.shape[1],
                                             with_entropy=True)
    ref = batch.get("ref_logp")
    loss, clipped, kl = per_token_loss(logp, batch["old_logp"], ref, batch["advantages"], g.loss_type, g.epsilon,
                                       g.epsilon_high, g.beta if beta is None else beta, g.clip_high, g.kl_estimator)
    extras = {k[len("metric_"):]: v for k, v in batch.items() if k.startswith("metric_")}
    per_pass = 1.0 / g.num_iterations
    extras["clip_fraction"] = sequence_mean(clipped.float(), mask).sum() * per_pass
    extras["entropy"] = sequence_mean(entropy, mask).sum() * per_pass
    if ref is not None:
        extras["kl"] = sequence_mean(kl.detach(), mask).sum() * per_pass
    return aggregate_loss(loss, mask, g.loss_agg, g.max_gen_len), aux, extras
