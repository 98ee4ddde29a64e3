"""Rollouts: sampling completions of a batch of prompts from the current policy.

:class:`RolloutEngine` is the small interface the grpo objective talks to; :class:`TorchRollout`
is the one used by default: each training worker samples for its own prompts with its own copy of
the policy, in batches, with the model's KV cache. Another engine (a pool of Ray actors, vLLM,
SGLang) implements the same two methods; docs/rl.md says what that takes.

Layout of a batch: prompts arrive left-padded (``prompt_mask`` marks their tokens), and completions come back
in one block after them. Inside, each prompt is moved to the start of its row (right padding) and decoded in
its own row of the static KV cache (model/kv_cache.py) from position 0, exactly as the prompt alone would be:
one write per token, no copy of the cache. Tokens are picked by the one sampler (model/sampling.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from minimind_ray.model.kv_cache import KVCache
from minimind_ray.model.prefix_cache import PrefixCache
from minimind_ray.model.sampling import SamplingParams, sample_tokens
from minimind_ray.rl.constraints import RowsConstraint


@dataclass
class Rollout:
    """The completions of N prompt rows (R = the longest completion)."""

    completion_ids: Tensor  # (N, R) sampled tokens, pad_id after a completion's EOS
    completion_mask: Tensor  # (N, R) bool: a sampled token (through the EOS, inclusive)
    logprobs: Tensor  # (N, R) float32: the behaviour policy's log p(token) at temperature 1; 0 where masked
    truncated: Tensor  # (N,) bool: ended at max_new_tokens without an EOS


class RolloutEngine:
    """What the grpo objective needs from whatever generates its completions."""

    def update_policy(self, model: torch.nn.Module, step: int) -> None:
        """The weights to sample from for optimizer step ``step`` (called before its rollouts)."""
        raise NotImplementedError

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None, seeds: Optional[Tensor] = None) -> Rollout:
        """Sample one completion for each row of ``prompt_ids`` (N, P), left-padded: from each row's ``seeds``
        (row_seeds) when given, else from ``generator``, else from the engine's own random source."""
        raise NotImplementedError

    def generate_many(self, requests: List[Tuple[Tensor, Tensor, SamplingParams, Tensor]]) -> List[Rollout]:
        """The rollouts of several requests ``(prompt_ids, prompt_mask, params, seeds)`` (a step's micro-batches),
        each as :meth:`generate` gives it; an engine may run them together. Here: one after another."""
        return [self.generate(ids, mask, params, seeds=seeds) for ids, mask, params, seeds in requests]


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) under ``logits`` (..., V) at temperature 1, in float32: the logit minus the logsumexp
    (no normalised (..., V) tensor is built). Rollouts, reference and loss all use this one function."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# splitmix64's constants as signed int64: torch's int64 arithmetic wraps as uint64's does
_GOLDEN, _MIX1, _MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser, elementwise on int64 (the logical right shifts as masked arithmetic ones)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def row_seeds(seed: int, step: int, sample_ids: Tensor, group_size: int, round_: int = 0) -> Tensor:
    """One seed per completion row (B * group_size,), from the run's seed, the step, each prompt's sample id
    (global: the same on any rank or world size), the completion's index in its group and a resampling round.
    Sampling from these instead of a process's random stream makes a completion independent of which worker
    or rollout actor generates it and of what else is in its batch."""
    ids = sample_ids.to(torch.int64).repeat_interleave(group_size) * group_size + torch.arange(
        group_size, dtype=torch.int64, device=sample_ids.device).repeat(sample_ids.shape[0])
    base = mix64(torch.tensor(((seed * 1_000_003 + step) * 1_009 + round_) & (2 ** 62 - 1), dtype=torch.int64,
                              device=sample_ids.device) * _GOLDEN)
    return mix64(ids * _GOLDEN + base)


def counter_uniform(seeds: Tensor, t: int) -> Tensor:
    """A uniform number in (0, 1) per row for token ``t``: a hash of (row seed, t), float64."""
    bits = mix64(seeds + torch.tensor(t + 1, dtype=torch.int64, device=seeds.device) * _GOLDEN)
    return (((bits >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0 ** -53


class TorchRollout(RolloutEngine):
    """Batched sampling in this process with a static KV cache: one forward over the prompts, then
    one forward of one token per row until every row has sent its EOS or ``max_new_tokens`` is reached.
    The model runs in eval mode without gradients (its mode is restored); no collectives, so each rank
    samples on its own. The grpo objective passes each row's seed (:func:`row_seeds`): a completion is then
    a function of the weights, its prompt and its seed, so a restarted run samples exactly what an
    uninterrupted one did, and a rollout actor what a worker would have."""

    def __init__(self, autocast=None, prefix_cache: Optional[PrefixCache] = None, grammars=None):
        self.model = None
        self.autocast = autocast
        self.prefix_cache = prefix_cache  # train.rollout.prefix_cache_mb: prompt prefixes shared within a step
        self.grammars = grammars  # a GrammarCompiler for the run's tokenizer when the stage constrains its rollouts

    def update_policy(self, model: torch.nn.Module, step: int) -> None:
        self.model = model  # the training module itself: no copy, always the current weights
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # keys of the weights before the update (check_weights would see it too)

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None, seeds: Optional[Tensor] = None) -> Rollout:
        return sample_completions(self.model, prompt_ids, prompt_mask, params, self.autocast, generator, seeds,
                                  self.prefix_cache, self.grammars)

    def generate_many(self, requests: List[Tuple[Tensor, Tensor, SamplingParams, Tensor]]) -> List[Rollout]:
        """All the requests' rows in one batch (:func:`merge_requests`): a decode step's forward reads the weights
        once for every row of the step instead of once per micro-batch."""
        merged = merge_requests(requests, self.model.cfg.max_position_embeddings)
        if merged is None:
            return super().generate_many(requests)
        ids, mask, params, seeds = merged
        return split_rollout(self.generate(ids, mask, params, seeds=seeds), [r[0].shape[0] for r in requests])


def merge_requests(requests: List[Tuple[Tensor, Tensor, SamplingParams, Tensor]], max_positions: int):
    """Several rollout requests as one: their rows left-padded to one width, each with its own seed (so a row
    samples what it would in its own request, up to float rounding); None when they cannot be one (one request,
    other params, no seeds, or a width that would cut the token budget)."""
    params = requests[0][2] if requests else None
    width = max((ids.shape[1] for ids, *_ in requests), default=0)
    if (len(requests) < 2 or any(p != params or s is None for _, _, p, s in requests)
            or width + params.max_new_tokens > max_positions):
        return None
    ids = torch.cat([F.pad(i, (width - i.shape[1], 0), value=params.pad_id) for i, *_ in requests])
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0), value=0) for _, m, *_ in requests])
    return ids, mask, params, torch.cat([s for *_, s in requests])


def split_rollout(roll: Rollout, sizes: List[int]) -> List[Rollout]:
    """A merged request's rollout back into one per request (``sizes`` rows each), each as long as its own
    longest completion, as the request alone would have come back."""
    out, lo = [], 0
    for n in sizes:
        part = [t[lo:lo + n] for t in (roll.completion_ids, roll.completion_mask, roll.logprobs)]
        R = max(int(part[1].sum(dim=1).max()), 1)
        out.append(Rollout(*(t[:, :R] for t in part), truncated=roll.truncated[lo:lo + n]))
        lo += n
    return out


@torch.no_grad()
def sample_completions(model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, autocast=None,
                       generator: Optional[torch.Generator] = None, seeds: Optional[Tensor] = None,
                       prefix_cache: Optional[PrefixCache] = None, grammars=None) -> Rollout:
    """TorchRollout's work, for any holder of a model (a training worker, a rollout actor); with
    ``prefix_cache`` the prompts' prefixes held there are copied in instead of computed (:func:`_prefill`). With
    ``params.grammar`` (a constrained rollout, rl/constraints.py) each row samples only what the grammar allows,
    compiled by ``grammars`` (a GrammarCompiler for the prompts' tokenizer); its log-probs stay the model's own."""
    n, p_len = prompt_ids.shape
    if params.repetition_penalty != 1.0:
        raise ValueError(f"repetition_penalty={params.repetition_penalty}: the batched sampler has none (1.0)")
    if params.grammar is not None and grammars is None:
        raise ValueError("a constrained rollout (params.grammar) needs the sampler's grammar compiler")
    rules = RowsConstraint(grammars, params.grammar, n) if params.grammar is not None else None
    budget = min(params.max_new_tokens, model.cfg.max_position_embeddings - p_len)
    if budget < 1:
        raise ValueError(f"prompts of {p_len} tokens leave no room under max_position_embeddings="
                         f"{model.cfg.max_position_embeddings}")
    ids, lengths = right_aligned(prompt_ids, prompt_mask)
    was_training = model.training
    model.eval()
    try:
        with (autocast or contextlib.nullcontext)():
            cache = KVCache.for_model(model, slots=n, max_len=p_len + budget, capacity=p_len + budget)
            logits = _prefill(model, cache, ids, lengths, prefix_cache)  # (N, V)
            alive = torch.ones(n, dtype=torch.bool, device=prompt_ids.device)
            tokens, logps, masks = [], [], []
            for t in range(budget):
                nxt = sample_tokens(logits if rules is None else rules.masked(logits, alive), params.temperature,
                                    params.top_p, params.top_k, generator,
                                    None if seeds is None else counter_uniform(seeds, t))
                logp = token_logprobs(logits, nxt)  # the unconstrained model's (docs/rl.md, "Constrained rollouts")
                if rules is not None:
                    rules.advance(nxt, alive)
                nxt = torch.where(alive, nxt, torch.full_like(nxt, params.pad_id))
                tokens.append(nxt)
                logps.append(torch.where(alive, logp, torch.zeros_like(logp)))
                masks.append(alive)
                alive = alive & nxt.ne(params.eos_id)
                if t == budget - 1 or not bool(alive.any()):
                    break
                logits = model(nxt[:, None], kv_cache=cache).logits[:, -1].float()  # a finished row: pads, unread
    finally:
        model.train(was_training)
    return Rollout(completion_ids=torch.stack(tokens, 1), completion_mask=torch.stack(masks, 1),
                   logprobs=torch.stack(logps, 1).float(), truncated=alive)


def _prefill_cached(model, cache: KVCache, ids: Tensor, lengths, owners: List[int], pc: PrefixCache) -> Tensor:
    """The owners' prompts prefilled through the prefix cache -> their logits (U, V), in ``owners``' order."""
    pc.check_weights(model)
    prompts = [ids[r, :lengths[r]].tolist() for r in owners]
    out = [None] * len(owners)
    for wave in pc.waves(prompts):
        rows = [owners[i] for i in wave]
        starts = [pc.load(cache, r, prompts[i]) for r, i in zip(rows, wave)]
        rest = [lengths[r] - s for r, s in zip(rows, starts)]
        cols = torch.arange(max(rest), device=ids.device)
        at = (torch.tensor(starts, device=ids.device)[:, None] + cols).clamp_max(ids.shape[1] - 1)
        wave_ids = ids[rows].gather(1, at)  # each row's rest from column 0 (past it: pads, unread)
        logits = model(wave_ids, kv_cache=cache, slots=rows, input_lengths=rest,
                       logits_at=torch.tensor(rest, device=ids.device) - 1).logits[:, -1].float()
        for j, (r, i) in enumerate(zip(rows, wave)):
            pc.save(cache, r, prompts[i])
            out[i] = logits[j]
    return torch.stack(out)


def right_aligned(prompt_ids: Tensor, prompt_mask: Tensor):
    """Left-padded prompts (N, P) -> the same prompts from column 0, right-padded, and each one's length (host
    ints): what a row of the KV cache starts from. A mask that is not a left padding is refused."""
    n, p_len = prompt_ids.shape
    lengths = prompt_mask.long().sum(dim=1)  # (N,)
    cols = torch.arange(p_len, device=prompt_ids.device)
    if not torch.equal(prompt_mask.bool(), cols[None, :] >= (p_len - lengths)[:, None]):
        raise ValueError("prompt_mask: prompts must be left-padded (each row's tokens at its end, in one run)")
    ids = prompt_ids.gather(1, (cols[None, :] + (p_len - lengths)[:, None]) % p_len)  # (N, P): rolled left
    return ids, lengths.tolist()


def _prefill(model, cache: KVCache, ids: Tensor, lengths, prefix_cache: Optional[PrefixCache] = None) -> Tensor:
    """Right-aligned prompts (N, P) into cache rows 0..N-1 -> the logits after each prompt (N, V), float32. A
    prompt repeated in the batch (a GRPO group: one prompt, G completions) is computed once, in its first row,
    and copied into the others' rows. With ``prefix_cache``, distinct prompts that start alike (a system prompt,
    a few-shot prefix) compute their shared blocks once: in waves (PrefixCache.waves), each prompt's held prefix
    copied in and only its rest computed."""
    keyed = torch.cat([ids, torch.tensor(lengths, device=ids.device)[:, None]], dim=1)
    _, inverse = torch.unique(keyed, dim=0, return_inverse=True)  # (N,): rows with one id are one prompt
    inverse = inverse.tolist()
    first = {}
    for row, u in enumerate(inverse):
        first.setdefault(u, row)
    owners = sorted(first.values())  # each distinct prompt's first row
    if prefix_cache is None:
        fresh = [lengths[r] for r in owners]
        out = model(ids[owners], kv_cache=cache, slots=owners, input_lengths=fresh,
                    logits_at=torch.tensor(fresh, device=ids.device) - 1).logits[:, -1].float()  # (U, V)
    else:
        out = _prefill_cached(model, cache, ids, lengths, owners, prefix_cache)
    for u, row in first.items():
        cache.fork(row, [r for r, v in enumerate(inverse) if v == u and r != row])
    where = {row: i for i, row in enumerate(owners)}
    return out[[where[first[u]] for u in inverse]]
