"""The prefix cache: keys and values of prompt prefixes seen before, copied into a new request's KV cache row.

Every decode path (the serving engine, ``generate``/``chat``, RL rollouts and the ``gen``/``toolcall`` evaluations
through them) may hold one :class:`PrefixCache`. A prompt is cut into blocks of ``block_size`` tokens, and block i
is named by a hash of block i-1's name and block i's tokens (a chain of block hashes, as vLLM's automatic prefix
caching names them): two prompts share block i's name exactly when they share their first (i+1) x block_size
tokens, so a name stands for the keys and values of those positions, which depend on nothing else (causal
attention; RoPE at absolute positions 0..n-1).

* :meth:`PrefixCache.load` finds the longest chain of a prompt's blocks held here and copies their keys and values
  into the request's row of the static cache (model/kv_cache.py: ``KVCache.write_row``), setting the row's length:
  the forward that follows computes only the rest, at positions n.., with the mask of any row that continues
  (the same RoPE tables, YaRN included, and the same attention). At most ``len(prompt) - 1`` tokens are taken,
  so the last prompt token is always computed: its logits pick the first new token.
* :meth:`PrefixCache.save` stores the full blocks of a prefilled row that are not held yet (each block's own
  positions, copied out of the row).
* Memory: ``budget_bytes`` bounds the keys and values held; storing past it evicts the least recently used
  blocks first. A block is touched (made recent) after its descendants, so a chain is evicted from its end and no
  block outlives its parent by recency alone. A block bigger than the whole budget is not stored.
* Weights: the cached keys and values are only valid for the weights that computed them. :meth:`clear` empties the
  cache (an RL weight sync, a LoRA swap, a reload), and :meth:`check_weights` does it by itself when any
  parameter of the model was replaced or written in place since the last call (torch's version counter of each
  parameter tensor moves on every in-place write: an optimizer step, ``load_state_dict``, a LoRA merge).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from minimind_ray.model.kv_cache import KVCache

DEFAULT_BLOCK = 16  # tokens per block: vLLM's default; a prompt shorter than one block is never cached


@dataclass
class _Block:
    k: Tensor  # (L, nkv, block, hs)
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def _stamp(p: Tensor) -> tuple:
    """What changes when a parameter is replaced or written: its identity, its storage (none for a sharded DTensor's
    wrapper) and its version counter (none for an inference tensor)."""
    try:
        ptr = p.data_ptr()
    except RuntimeError:
        ptr = None
    return id(p), ptr, None if p.is_inference() else p._version


class PrefixCache:
    """Blocks of cached prompt keys and values, at most ``budget_bytes`` of them (see the module docstring)."""

    def __init__(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK):
        if budget_bytes < 0 or block_size < 1:
            raise ValueError(f"prefix cache: budget {budget_bytes} bytes and block {block_size} tokens must be "
                             f">= 0 and >= 1")
        self.budget_bytes, self.block_size = int(budget_bytes), int(block_size)
        self._blocks: "OrderedDict[bytes, _Block]" = OrderedDict()  # name -> block, least recently used first
        self.bytes_used = 0
        self.queried_tokens = 0  # prompt tokens looked up (each load)
        self.hit_tokens = 0  # of them, copied from the cache instead of computed
        self.evicted_blocks = 0
        self.clears = 0
        self._weights: Optional[Tuple] = None  # check_weights' fingerprint of the model last seen

    @classmethod
    def of_mib(cls, mib: float, block_size: int = DEFAULT_BLOCK) -> Optional["PrefixCache"]:
        """A cache of ``mib`` MiB, or None for 0 (no prefix cache): what the ``--prefix-cache-mb`` flags make."""
        return cls(int(mib * 2 ** 20), block_size) if mib and mib > 0 else None

    # ------------------------------------------------------------------ names

    def names(self, tokens: Sequence[int]) -> List[bytes]:
        """The chain of names of ``tokens``' full blocks."""
        out, parent, bs = [], b"", self.block_size
        for i in range(len(tokens) // bs):
            parent = hashlib.blake2b(parent + array("q", tokens[i * bs:(i + 1) * bs]).tobytes(),
                                     digest_size=16).digest()
            out.append(parent)
        return out

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``' leading blocks are held (no copy, nothing touched), up to the last token."""
        n = 0
        for name in self.names(tokens[:len(tokens) - 1]):
            if name not in self._blocks:
                break
            n += 1
        return n

    def waves(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
        """The indices of ``prompts`` (prefilled together) in prefills one after another: a prompt whose first
        block not held here is also an earlier prompt's (a new prefix arriving twice at once) waits for the next
        wave, by which the earlier one has stored it, so that a new prefix is computed once. A wave counts what
        the waves before it will have stored (every full block of their prompts)."""
        chains = [self.names(p[:len(p) - 1]) for p in prompts]
        stored: set = set()  # names the earlier waves store

        def first_new(i: int) -> Optional[bytes]:
            return next((n for n in chains[i] if n not in self._blocks and n not in stored), None)

        out, pending = [], list(range(len(prompts)))
        while pending:
            wave, later, seen = [], [], set()
            for i in pending:
                new = first_new(i)
                (later if new is not None and new in seen else wave).append(i)
                seen.add(new)
            out.append(wave)
            for i in wave:
                stored.update(self.names(prompts[i]))
            pending = later
        return out

    # ------------------------------------------------------------------ use

    def load(self, cache: KVCache, slot: int, tokens: Sequence[int]) -> int:
        """Copy the longest held prefix of ``tokens`` (whole blocks, the last token excluded) into row ``slot`` of
        ``cache`` (an empty row) and set its length; -> the number of positions copied (0: a miss)."""
        self.queried_tokens += len(tokens)
        names = self.names(tokens[:len(tokens) - 1])[:self.cached_blocks(tokens)]
        if not names:
            return 0
        blocks = [self._blocks[n] for n in names]
        for name in reversed(names):  # the chain's end least recent: evicted before its parents
            self._blocks.move_to_end(name)
        n = len(names) * self.block_size
        cache.write_row(slot, [b.k for b in blocks], [b.v for b in blocks])
        self.hit_tokens += n
        return n

    def save(self, cache: KVCache, slot: int, tokens: Sequence[int]) -> int:
        """Store the full blocks of ``tokens`` that row ``slot`` of ``cache`` holds (its first ``lengths[slot]``
        positions, computed from these tokens) and this cache does not; -> the blocks stored."""
        held = min(len(tokens), cache.lengths[slot])
        names = self.names(tokens[:held])
        stored = 0
        for i, name in enumerate(names):
            if name in self._blocks:
                continue
            k, v = cache.read_row(slot, i * self.block_size, (i + 1) * self.block_size)
            block = _Block(k, v)
            if block.nbytes > self.budget_bytes or not self._make_room(block.nbytes, names[:i]):
                break  # a later block without this one could never be reached
            self._blocks[name] = block
            self.bytes_used += block.nbytes
            stored += 1
        for name in reversed(names):  # the chain's end least recent, as load leaves it
            if name in self._blocks:
                self._blocks.move_to_end(name)
        return stored

    def _make_room(self, nbytes: int, keep: List[bytes]) -> bool:
        """Evict least recently used blocks until ``nbytes`` more fit (never one of ``keep``, the new block's
        parents); False when they cannot fit."""
        keep_set = set(keep)
        victims = iter([n for n in self._blocks if n not in keep_set])
        while self.bytes_used + nbytes > self.budget_bytes:
            name = next(victims, None)
            if name is None:
                return False
            self.bytes_used -= self._blocks.pop(name).nbytes
            self.evicted_blocks += 1
        return True

    # ------------------------------------------------------------------ weights

    def clear(self) -> None:
        """Forget every block: the weights that computed them changed."""
        if self._blocks:
            self.clears += 1
        self._blocks.clear()
        self.bytes_used = 0

    def check_weights(self, model) -> None:
        """Empty the cache when ``model``'s parameters are not the ones it was filled with: another tensor, or
        one written in place since (its version counter moved). Cheap: one pass over the parameter list. A
        parameter made under ``torch.inference_mode`` has no version counter: only its identity is compared (such a
        tensor can be written in place only inside inference mode; :meth:`clear` is the way for that)."""
        seen = tuple(_stamp(p) for p in model.parameters())
        if seen != self._weights:
            self.clear()
            self._weights = seen

    # ------------------------------------------------------------------ figures

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def stats(self) -> dict:
        return {"prefix_cache_blocks": self.blocks, "prefix_cache_bytes": self.bytes_used,
                "prefix_cache_budget_bytes": self.budget_bytes, "prefix_cache_queried_tokens": self.queried_tokens,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_hit_rate": round(self.hit_rate(), 4),
                "prefix_cache_evicted_blocks": self.evicted_blocks, "prefix_cache_clears": self.clears}
