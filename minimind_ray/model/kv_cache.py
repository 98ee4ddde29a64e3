"""The KV cache of decoding: one preallocated buffer for keys and one for values, written in place.

Every place that generates text (``generate``/``chat``, the serving engine, RL rollouts, the ``gen`` and
``toolcall`` evaluations, multiple-choice scoring) keeps its keys and values here::

    k, v: (L, slots, nkv, capacity + 1, hs)   L layers, one row ("slot") per sequence, heads-major
    lengths[slot]                             positions cached in that row (host ints)

A forward with ``kv_cache=`` gives each batch row its own slot (``slots``, default 0..B-1) and its own start
position, ``lengths[slot]``: row b's new tokens sit at positions ``lengths[b] + t``, their keys and values are
written there (``index_put_``: nothing else moves), and the row attends to its first ``lengths[b] + t + 1``
cached positions. A token costs one write and a read of the keys it attends to: no copy of the cache, so the
cost of token t no longer grows with t through copies (gpt-fast's static cache and HF's ``StaticCache`` work
the same way; ours tracks a length per row, so rows of any length share one batch). Heads-major, as SDPA and
HF's caches lay keys out: each (row, kv head)'s keys are one contiguous (positions, hs) matrix, which attention
reads with no copy, and a CPU decode step's attention multiplies as keys x queries (model/minimind.py).

Rows join and leave without touching the others: :meth:`KVCache.alloc` hands out free slots (the lowest first)
and :meth:`KVCache.release` gives them back (length 0; the stale keys stay, masked, until overwritten).
:meth:`KVCache.fork` copies one row into others (n samples of one prompt after one prefill);
:meth:`KVCache.write_row` fills a row from a prefix cache hit and :meth:`KVCache.read_row` copies positions out for it
(model/prefix_cache.py).

Batches may be right-padded: ``input_lengths[b]`` of the T new tokens of row b are real and only they advance
its length. The pads' keys land past the row's length (or in the extra sink position when they would pass the
capacity), where no real query of the row can see them. Real tokens always fit: ``capacity`` grows on demand
(doubling, up to ``max_len``), the one time the buffers are copied, so that a cache sized for the context
limit costs only what is used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

_MIN_CAPACITY = 64  # positions: the first allocation's floor (a growth copies everything, so start with room)


class KVCache:
    """Keys and values of ``slots`` sequences of up to ``max_len`` positions each (see the module docstring).

    The buffers are allocated at the first write, in the dtype and on the device of the keys written (the model's,
    or autocast's), with ``capacity`` positions: the first forward's need (at least 64), or ``capacity`` when given.
    """

    def __init__(self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 capacity: Optional[int] = None):
        self.num_layers, self.slots, self.max_len = num_layers, slots, max_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.capacity = min(capacity or 0, max_len)
        self.k: Optional[Tensor] = None  # (L, slots, nkv, capacity + 1, hs); the last position is the pads' sink
        self.v: Optional[Tensor] = None
        self.lengths: List[int] = [0] * slots
        self._free: List[int] = list(range(slots))  # kept sorted: alloc takes the lowest

    @classmethod
    def for_model(cls, model, slots: int, max_len: Optional[int] = None, capacity: Optional[int] = None) -> "KVCache":
        """A cache shaped for ``model`` (a MiniMindForCausalLM, its config resolved); ``max_len`` defaults to
        the model's ``max_position_embeddings`` (and may not exceed it)."""
        c = model.cfg
        limit = c.max_position_embeddings if max_len is None else min(max_len, c.max_position_embeddings)
        return cls(c.num_hidden_layers, slots, limit, c.num_key_value_heads, c.head_dim, capacity)

    # ------------------------------------------------------------------ rows

    def alloc(self, n: int = 1) -> List[int]:
        """``n`` free slots (the lowest), empty; a ValueError when fewer are free."""
        if n > len(self._free):
            raise ValueError(f"KV cache: {n} slots asked, {len(self._free)} of {self.slots} free")
        taken, self._free = self._free[:n], self._free[n:]
        for s in taken:
            self.lengths[s] = 0
        return taken

    def release(self, slots: Sequence[int]) -> None:
        """Give ``slots`` back: their length drops to 0; no other row is touched."""
        for s in slots:
            self.lengths[s] = 0
        self._free = sorted(set(self._free) | set(slots))

    def in_use(self) -> List[int]:
        free = set(self._free)
        return [s for s in range(self.slots) if s not in free]

    def rewind(self, slot: int, length: int) -> None:
        """Forget row ``slot``'s positions from ``length`` on (the next forward writes over them)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"rewind: {length} is not within the row's {self.lengths[slot]} positions")
        self.lengths[slot] = length

    def fork(self, src: int, dsts: Sequence[int]) -> None:
        """Copy row ``src`` (its ``lengths[src]`` cached positions) into each row of ``dsts``."""
        n = self.lengths[src]
        if self.k is not None and dsts:
            idx = torch.tensor(list(dsts), device=self.k.device)
            self.k[:, idx, :, :n] = self.k[:, src, :, :n].unsqueeze(1)
            self.v[:, idx, :, :n] = self.v[:, src, :, :n].unsqueeze(1)
        for d in dsts:
            self.lengths[d] = n

    def write_row(self, slot: int, ks: Sequence[Tensor], vs: Sequence[Tensor]) -> None:
        """Row ``slot`` := the positions of ``ks``/``vs`` (pieces (L, nkv, n_i, hs) laid end to end, from position
        0), its length their total: a prefix cache hit (model/prefix_cache.py). No other row is touched."""
        n = sum(k.shape[2] for k in ks)
        self._reserve(n)
        if self.k is None:
            self._allocate(ks[0])
        at = 0
        for k, v in zip(ks, vs):
            m = k.shape[2]
            self.k[:, slot, :, at:at + m] = k.to(self.k.dtype)
            self.v[:, slot, :, at:at + m] = v.to(self.v.dtype)
            at += m
        self.lengths[slot] = n

    def read_row(self, slot: int, start: int, end: int):
        """Copies of row ``slot``'s keys and values at positions start..end-1, each (L, nkv, end - start, hs)."""
        if not 0 <= start <= end <= self.lengths[slot]:
            raise ValueError(f"read_row: {start}..{end} is not within the row's {self.lengths[slot]} positions")
        return self.k[:, slot, :, start:end].clone(), self.v[:, slot, :, start:end].clone()

    # ------------------------------------------------------------------ one forward

    def step(self, B: int, T: int, slots: Optional[Sequence[int]], input_lengths: Optional[Sequence[int]],
             device: torch.device) -> "CacheStep":
        """The plan of one forward of B rows of T new tokens (what ``MiniMindForCausalLM.forward`` calls);
        ``slots`` None = rows 0..B-1."""
        rows = list(range(B)) if slots is None else [int(s) for s in slots]
        if len(rows) != B or any(not 0 <= s < self.slots for s in rows):
            raise ValueError(f"slots: {B} slots of 0..{self.slots - 1} expected, got {rows}")
        return CacheStep(self, rows, T, input_lengths, device)

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` positions per row: grow the buffers (double, up to max_len) when short."""
        if needed > self.max_len:
            raise ValueError(f"sequence of {needed} tokens exceeds the KV cache's {self.max_len} positions "
                             f"(max_position_embeddings or the context limit)")
        if needed <= self.capacity:
            return
        new = min(self.max_len, max(needed, 2 * self.capacity, _MIN_CAPACITY))
        if self.k is not None:  # the one copy of the whole cache, log2(max_len) times at most
            self.k, self.v = (self._grown(buf, new) for buf in (self.k, self.v))
        self.capacity = new

    def _grown(self, buf: Tensor, capacity: int) -> Tensor:
        L, slots, nkv, _, hs = buf.shape
        out = buf.new_zeros((L, slots, nkv, capacity + 1, hs))
        out[:, :, :, :self.capacity] = buf[:, :, :, :self.capacity]
        return out

    def _allocate(self, like: Tensor) -> None:
        # zeros, not empty: a masked key still enters attention as weight 0 x value, and 0 x NaN would be NaN
        shape = (self.num_layers, self.slots, self.kv_heads, self.capacity + 1, self.head_dim)
        self.k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros(shape, dtype=like.dtype, device=like.device)


@dataclass
class _Rows:
    """Batch row b -> cache slot: a contiguous range (read as a view) or an index (read as a gather)."""

    index: Tensor  # (B,) long
    first: Optional[int]  # slots are first..first+B-1: slice instead of gathering

    def read(self, buf: Tensor, S: int) -> Tensor:  # buf (slots, nkv, capacity + 1, hs) -> (B, nkv, S, hs)
        if self.first is not None:
            return buf[self.first:self.first + self.index.shape[0], :, :S]
        return buf[:, :, :S].index_select(0, self.index)


class CacheStep:
    """One forward's positions, mask and writes, computed once and shared by every layer.

    positions (B, T): where each new token sits (its RoPE angle); S: the key positions attended (the longest row
    after this step); mask (B, 1, T, S): True where a query may see a key (its own row, at or before it), or None
    when every row sees all S keys (one new token per row, rows of one length); ``fresh``: every row starts empty,
    so attention needs only the new keys, causally (no cache read).
    """

    def __init__(self, cache: KVCache, rows: List[int], T: int, input_lengths: Optional[Sequence[int]],
                 device: torch.device):
        self.cache, self.rows_list, self.T = cache, rows, T
        B = len(rows)
        starts = [cache.lengths[s] for s in rows]
        self.n_new = [T] * B if input_lengths is None else [int(n) for n in input_lengths]
        if len(self.n_new) != B or any(not 0 <= n <= T for n in self.n_new):
            raise ValueError(f"input_lengths: {B} values in 0..{T} expected, got {self.n_new}")
        cache._reserve(max(s + n for s, n in zip(starts, self.n_new)))
        first = rows[0] if rows == list(range(rows[0], rows[0] + B)) else None
        self.rows = _Rows(torch.tensor(rows, device=device), first)
        start = torch.tensor(starts, device=device)
        self.positions = start[:, None] + torch.arange(T, device=device)  # (B, T)
        self.write_pos = self.positions.clamp_max(cache.capacity)  # a pad past the capacity goes to the sink
        self.fresh = not any(starts)
        self.S = T if self.fresh else min(max(starts) + T, cache.capacity)
        self.mask = None
        self._grouped: Optional[tuple] = None  # (n_rep, the mask repeated for it): grouped_mask's
        if not self.fresh and not (T == 1 and len(set(starts)) == 1):
            keys = torch.arange(self.S, device=device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # (B, 1, T, S)

    def grouped_mask(self, n_rep: int) -> Optional[Tensor]:
        """The mask with each query row repeated for the n_rep query heads of a kv head, (B, 1, n_rep*T, S), row
        r*T + t as ``t``'s (model/minimind.py: ``_grouped_attention``); made once per forward, not per layer."""
        if self.mask is None:
            return None
        if self._grouped is None or self._grouped[0] != n_rep:
            self._grouped = (n_rep, self.mask.repeat(1, 1, n_rep, 1))
        return self._grouped[1]

    def update(self, layer: int, k: Tensor, v: Tensor):
        """Write this step's keys/values (B, T, nkv, hs) of ``layer`` in place; -> (keys, values, is_causal)
        the layer attends to, (B, nkv, S, hs): views of the cache, or the new ones themselves when ``fresh``."""
        c = self.cache
        if c.k is None:
            c._allocate(k)
        kc, vc = c.k[layer], c.v[layer]  # (slots, nkv, capacity + 1, hs)
        index = (self.rows.index[:, None], self.write_pos)
        kc.transpose(1, 2).index_put_(index, k.to(kc.dtype))  # through a (slots, capacity + 1, nkv, hs) view
        vc.transpose(1, 2).index_put_(index, v.to(vc.dtype))
        if self.fresh:
            return k.transpose(1, 2), v.transpose(1, 2), self.T > 1
        return self.rows.read(kc, self.S), self.rows.read(vc, self.S), False

    def advance(self) -> None:
        for s, n in zip(self.rows_list, self.n_new):
            self.cache.lengths[s] += n
