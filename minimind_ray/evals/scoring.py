"""Scoring a model on prepared items: log-likelihoods of choices, and exact match of generated completions.

Multiple choice (lm-eval's method): a choice's score is the sum of log p over its continuation tokens given
the context. Tokens are split as lm-eval's ``_encode_pair`` splits them: trailing whitespace of the context
moves to the continuation, the context is ``encode(context)`` and the continuation is
``encode(context + continuation)`` after that many tokens. The context of a question is computed once: one
forward over a batch of right-padded contexts fills one row of a static KV cache (model/kv_cache.py) per
question, each question's row is copied into its other choices' rows, and one more forward over the
right-padded continuations gives every choice's log-probs.

Generation: greedy and sampled completions of a batch of left-padded prompts with the KV cache
(:class:`minimind_ray.rl.rollout.TorchRollout`), each batch sampling from its own seeded generator, so what a
prompt gets does not depend on how the prompts are spread over workers.
"""
from __future__ import annotations

import contextlib
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

from minimind_ray.model.kv_cache import KVCache
from minimind_ray.model.prefix_cache import PrefixCache
from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.rollout import TorchRollout

Encoded = Tuple[List[int], List[List[int]]]  # (context ids, each choice's continuation ids)


def encode_pair(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids) exactly as lm-eval's HF model splits a request."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def encode_question(tokenizer, context: str, continuations: Sequence[str]) -> Encoded:
    """One question's context ids and its choices' continuation ids. lm-eval encodes the context once per
    pair; it is the same string, so the ids are the same for every choice."""
    pairs = [encode_pair(tokenizer, context, c) for c in continuations]
    return pairs[0][0], [cont for _, cont in pairs]


def _left_pad(rows: List[List[int]], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


SHARED_PREFIX_MIN = 64  # tokens: a batch whose contexts share at least this many computes them once (few-shot)


def common_prefix(rows: List[List[int]]) -> List[int]:
    """The longest list of tokens every row starts with."""
    first = rows[0]
    n = min(len(r) for r in rows)
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return first[:n]


@torch.no_grad()
def choice_logprobs(model, batch: List[Encoded], pad_id: int = 0, device="cpu", autocast=None) -> List[List[float]]:
    """For each question of ``batch``, the summed log p of each choice's continuation given its context.

    When the batch's contexts share a long prefix (a subject's description and k shots: most of a few-shot
    prompt), that prefix is computed once for the batch and each question only adds its own tokens
    (:func:`_shared_prefix_logprobs`); otherwise the contexts run as one left-padded batch."""
    limit = model.cfg.max_position_embeddings
    longest = max(len(c) for _, conts in batch for c in conts)
    if any(len(c) == 0 for _, conts in batch for c in conts):
        raise ValueError("a choice has no continuation tokens (an empty choice text)")
    contexts = [ctx[-(limit - longest):] for ctx, _ in batch]  # lm-eval also cuts from the left
    was_training = model.training
    model.eval()
    try:
        shared = common_prefix(contexts)[:min(len(c) for c in contexts) - 1]  # every context keeps a token of its own
        if len(batch) > 1 and len(shared) >= SHARED_PREFIX_MIN:
            with (autocast or contextlib.nullcontext)():
                return _shared_prefix_logprobs(model, shared, [(c, conts) for c, (_, conts) in zip(contexts, batch)],
                                               pad_id, device)
        with (autocast or contextlib.nullcontext)():
            ids, _ = _continuations(contexts, pad_id, device)  # (Q, P): right-padded
            owner = torch.tensor([q for q, (_, conts) in enumerate(batch) for _ in conts], device=ids.device)  # (N,)
            rows = [[] for _ in batch]  # each question's cache rows, one per choice
            for i, q in enumerate(owner.tolist()):
                rows[q].append(i)
            lengths = [len(c) for c in contexts]
            cache = KVCache.for_model(model, slots=len(owner), capacity=max(lengths) + longest)
            out = model(ids, kv_cache=cache, slots=[r[0] for r in rows], input_lengths=lengths,
                        logits_at=torch.tensor(lengths, device=ids.device) - 1)
            first = F.log_softmax(out.logits[:, -1].float(), dim=-1)  # (Q, V): predicts each continuation's 1st token
            for r in rows:
                cache.fork(r[0], r[1:])
            cont_ids, cont_mask = _continuations([c for _, cs in batch for c in cs], pad_id, ids.device)  # (N, L)
            rest = model(cont_ids, kv_cache=cache, input_lengths=cont_mask.sum(1).tolist()).logits.float()  # (N, L, V)
        logp = torch.cat([first.index_select(0, owner).unsqueeze(1), F.log_softmax(rest[:, :-1], dim=-1)], dim=1)
        token_logp = logp.gather(-1, cont_ids.unsqueeze(-1)).squeeze(-1) * cont_mask  # (N, L)
        sums = token_logp.sum(dim=1).double().tolist()
    finally:
        model.train(was_training)
    out_rows, i = [], 0
    for _, cs in batch:
        out_rows.append(sums[i:i + len(cs)])
        i += len(cs)
    return out_rows


def _continuations(conts: List[List[int]], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The choices' continuation ids (N, L), right-padded with ``pad_id``, and their mask."""
    width = max(len(c) for c in conts)
    ids = torch.full((len(conts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(conts):
        ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, :len(c)] = 1
    return ids.to(device), mask.to(device)


def _shared_prefix_logprobs(model, shared: List[int], batch: List[Encoded], pad_id: int, device) -> List[List[float]]:
    """The few-shot path of :func:`choice_logprobs`: the shared prefix once into cache row 0, then per question its
    own tokens after it (row 0 is rewound to the prefix for the next question), copied into one row per choice."""
    choices = max(len(conts) for _, conts in batch)
    cache = KVCache.for_model(model, slots=1 + choices, capacity=max(len(c) for c, _ in batch) + max(
        len(x) for _, conts in batch for x in conts))
    model(torch.tensor([shared], device=device), kv_cache=cache, logits_at=torch.tensor([len(shared) - 1],
                                                                                         device=device))
    out = []
    for ctx, conts in batch:
        cache.rewind(0, len(shared))
        own = model(torch.tensor([ctx[len(shared):]], device=device), kv_cache=cache, slots=[0],
                    logits_at=torch.tensor([len(ctx) - len(shared) - 1], device=device))
        first = F.log_softmax(own.logits[0, -1].float(), dim=-1)  # predicts each continuation's first token
        ids, mask = _continuations(conts, pad_id, device)
        n = ids.shape[0]
        cache.fork(0, range(1, n + 1))
        rest = model(ids, kv_cache=cache, slots=range(1, n + 1), input_lengths=mask.sum(1).tolist()
                     ).logits.float()  # (n, L, V)
        logp = torch.cat([first.expand(n, -1).unsqueeze(1), F.log_softmax(rest[:, :-1], dim=-1)], dim=1)
        out.append((logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask).sum(dim=1).double().tolist())
    return out


@torch.no_grad()
def generate_batch(model, prompts: List[List[int]], *, max_new_tokens: int, samples: int, temperature: float,
                   top_p: float, top_k: int, eos_id: int, pad_id: int, seed: int, device="cpu",
                   autocast=None, prefix_cache_mb: float = 0.0) -> Tuple[List[List[int]], List[List[List[int]]]]:
    """(the greedy completion of each prompt, ``samples`` sampled completions of each), as token ids without
    their EOS. The sampled ones draw from a generator seeded with ``seed``. With ``prefix_cache_mb``, one prefix
    cache for the batch: the sampled pass takes the prompts the greedy pass computed from it."""
    engine = TorchRollout(autocast, PrefixCache.of_mib(prefix_cache_mb))
    engine.update_policy(model, 0)
    ids, mask = _left_pad(prompts, pad_id, device)

    def completions(rows_ids, rows_mask, params, generator=None) -> List[List[int]]:
        roll = engine.generate(rows_ids, rows_mask, params, generator=generator)
        out = []
        for row, keep in zip(roll.completion_ids.tolist(), roll.completion_mask.tolist()):
            toks = [t for t, k in zip(row, keep) if k]
            out.append(toks[:-1] if toks and toks[-1] == eos_id else toks)
        return out

    greedy = completions(ids, mask, SamplingParams(max_new_tokens, 0.0, eos_id=eos_id, pad_id=pad_id))
    sampled: List[List[List[int]]] = [[] for _ in prompts]
    if samples:
        gen = torch.Generator(device=ids.device).manual_seed(seed)
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, eos_id, pad_id)
        flat = completions(ids.repeat_interleave(samples, 0), mask.repeat_interleave(samples, 0), params, gen)
        sampled = [flat[i * samples:(i + 1) * samples] for i in range(len(prompts))]
    return greedy, sampled
