"""GRPO and CISPO as MiniMind's ``trainer/train_grpo.py`` (d65ef2c) defines them, in pieces the grpo
objective (minimind_ray/engine/objectives.py:GRPOObjective) calls:

* :func:`rollout_micro_batch` (in ``Objective.prepare``): ``num_generations`` completions of each
  prompt, their rewards, the advantages normalised within each prompt's group, the behaviour policy's
  and the frozen reference's per-token log-probs, and the metric sums of the micro-batch;
* :func:`grpo_loss_sum` (in ``Objective.loss_sum``): per token ``-(min(r A, clip(r, 1-eps, 1+eps) A) -
  beta KL)`` (grpo) or ``-(sg(min(r, eps_high)) A log p - beta KL)`` (cispo), with r = p / p_behaviour
  and KL the k3 estimate ``exp(ref - log p) - (ref - log p) - 1``; averaged over each completion's
  tokens through its EOS and summed over completions. The engine divides by the all-reduced number of
  completions, so the step's loss is MiniMind's mean over completions at any world size.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from minimind_ray.rl.rewards import RewardTerm, score
from minimind_ray.rl.rollout import RolloutEngine, SamplingParams, token_logprobs

ADV_EPS = 1e-4  # MiniMind's: (r - mean) / (std + 1e-4); a group of equal rewards gets advantage 0


def group_std(values: Tensor, group_size: int) -> Tensor:
    """The population std of each group of ``group_size`` consecutive values, repeated for each member (N,)."""
    grouped = values.view(-1, group_size)
    return grouped.std(dim=1, unbiased=False, keepdim=True).expand_as(grouped).reshape(-1)


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """(r - mean of its group) / (std of its group + 1e-4) for consecutive groups of ``group_size`` (N,)."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    return ((grouped - mean) / (std + ADV_EPS)).reshape(-1)


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


def per_token_loss(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor, loss_type: str,
                   epsilon: float, epsilon_high: float, beta: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, clipped, kl), each (N, R). ``clipped``: the token's ratio was cut off (cispo: above
    ``epsilon_high``; grpo: the clipped term was the smaller one and differs)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    if loss_type == "cispo":
        gain = torch.clamp(ratio, max=epsilon_high).detach() * adv * logp
        clipped = ratio.detach() > epsilon_high
    elif loss_type == "grpo":
        unclipped, clipped_gain = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv
        gain = torch.min(unclipped, clipped_gain)
        clipped = (clipped_gain < unclipped).detach()
    else:
        raise ValueError(f"train.grpo.loss_type: unknown {loss_type!r}; one of ('cispo', 'grpo')")
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    return -(gain - beta * kl), clipped, kl


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` (N, R) over each row's masked-in tokens (N,); 0 for a row with none."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> Tuple[Tensor, Tensor]:
    """(log p of each of the last ``completion_len`` tokens (N, R) float32, the forward's MoE aux loss)."""
    out = model(input_ids, attention_mask=attention_mask)
    logits = out.logits[:, -completion_len - 1:-1]  # the positions that predict the completion
    return token_logprobs(logits, input_ids[:, -completion_len:]), out.aux_loss


def run_tokenizer(cfg, manifest: dict):
    """The tokenizer the prompts were prepared with, to turn completions into text for the rewards:
    the manifest's path when this machine has it, else ``data.tokenizer`` resolved here; checked by hash."""
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

    path = manifest.get("tokenizer_path")
    if path and os.path.exists(path):
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


def rollout_micro_batch(mb: Dict[str, Tensor], *, engine: RolloutEngine, params: SamplingParams,
                        group_size: int, rewards: List[RewardTerm], tokenizer, reference=None, autocast=None,
                        device: torch.device = torch.device("cpu")) -> Dict[str, Tensor]:
    """One prepared micro-batch of B prompts -> the B * group_size completions ``grpo_loss_sum`` trains on.

    Keys: ``input_ids`` / ``attention_mask`` (N, P + R): the left-padded prompt then the completion;
    ``completion_mask`` (N, R) through each EOS; ``old_logp`` (N, R) the behaviour policy's log-probs;
    ``ref_logp`` (N, R) the reference's (when there is one); ``advantages`` (N,); and ``metric_<name>``
    scalars, sums over the completions that the engine's interval meter turns into means.
    """
    prompt_ids = mb["prompt_ids"].to(device).repeat_interleave(group_size, dim=0)
    prompt_mask = mb["prompt_mask"].to(device).repeat_interleave(group_size, dim=0)
    roll = engine.generate(prompt_ids, prompt_mask, params)
    mask = eos_mask(roll.completion_ids, params.eos_id, roll.completion_mask)
    prompts, completions, answers = _texts(tokenizer, mb, roll.completion_ids, mask, group_size)
    total, per_term = score(rewards, prompts, completions, answers)
    reward = torch.tensor(total, dtype=torch.float32, device=device)
    batch = {"input_ids": torch.cat([prompt_ids, roll.completion_ids], dim=1),
             "attention_mask": torch.cat([prompt_mask.long(), mask.long()], dim=1),
             "completion_mask": mask, "old_logp": roll.logprobs.float() * mask,
             "advantages": group_advantages(reward, group_size)}
    if reference is not None:
        with torch.no_grad(), (autocast or contextlib.nullcontext)():
            batch["ref_logp"], _ = completion_logprobs(reference, batch["input_ids"], batch["attention_mask"],
                                                       mask.shape[1])
    spread = group_std(reward, group_size)
    metrics = {"reward": reward.sum(), "reward_std": spread.sum(),
               "zero_std_fraction": spread.le(1e-6).float().sum(),  # groups that teach nothing this step
               "completion_len": mask.sum(), "truncated_fraction": roll.truncated.float().sum()}
    for label, values in per_term.items():
        v = torch.tensor(values, dtype=torch.float32, device=device)
        metrics[f"reward_{label}"], metrics[f"reward_{label}_std"] = v.sum(), group_std(v, group_size).sum()
    batch.update({f"metric_{k}": v.double() for k, v in metrics.items()})
    return batch


def grpo_loss_sum(model, batch: Dict[str, Tensor], grpo_cfg) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """(loss summed over the completions, MoE aux loss, metric sums): see the module docstring."""
    g, mask = grpo_cfg, batch["completion_mask"]
    logp, aux = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], mask.shape[1])
    ref = batch.get("ref_logp")
    loss, clipped, kl = per_token_loss(logp, batch["old_logp"], ref, batch["advantages"], g.loss_type, g.epsilon,
                                       g.epsilon_high, g.beta)
    extras = {k[len("metric_"):]: v for k, v in batch.items() if k.startswith("metric_")}
    extras["clip_fraction"] = sequence_mean(clipped.float(), mask).sum()
    if ref is not None:
        extras["kl"] = sequence_mean(kl.detach(), mask).sum()
    return sequence_mean(loss, mask).sum(), aux, extras
