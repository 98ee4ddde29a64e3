"""Worker-side batches from prepared Parquet: exact, deterministic, resumable.

Why not Ray Data's ``streaming_split`` (what Ray Train's ``get_dataset_shard`` uses)?
It hands blocks to ranks dynamically, so the same sample lands on a different rank
from run to run; ``equal=True`` silently drops rows (ray #63285); its shuffle buffers
yield short batches (ray #66085); and its iterators cannot resume mid-epoch after a
failure (ray #37633, #48224). (Ray 2.60's split iterator differs from 2.58's only in a statistic.)
Training needs the opposite: every sample exactly once per epoch, the same order on a rerun, and a resume that
continues with the next unseen batch even on a different number of workers. So Ray Data does the heavy,
parallel part once (tokenizing in prepare.py) and each worker reads the prepared
Parquet here with plain pyarrow, following one global order:

* The order of an epoch is a pure function of (seed, epoch): shuffle the row groups,
  then shuffle rows within windows of ``shuffle_window_blocks`` consecutive row groups
  of that shuffled order. Windows bound the memory a reader needs (the row groups of
  about two windows) while mixing rows of distant parts of the corpus.
* Global batch s is positions [s*G, (s+1)*G) of that order. Rank r of W takes the r-th
  contiguous G/W slice of it and splits it into micro-batches. The union over ranks is
  exactly the global batch, whatever W is; the N % G positions left at the end of an
  epoch are dropped and reported (``dropped_per_epoch``), never silently.
* Resume is arithmetic: (epoch, step_in_epoch) gives the positions; only the row groups
  holding them are read (their locations come from the manifest's row counts).
* Held-out eval rows are chosen by a hash of their sample_id, computed from the
  manifest alone; they are never in the training order, whatever the seed.

The cost of a rank-independent order: every rank reads every row group of the
epoch (it needs some rows of each window), i.e. W times the bytes of a rank-sharded
reader. Prepared data is compact uint16, so this stays far below what a training step
consumes (docs/data.md has the figures). A background thread keeps ``prefetch_steps``
optimizer steps of micro-batches ready.
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional

import numpy as np
import pyarrow.parquet as pq

from minimind_ray.data import formats
from minimind_ray.data.manifest import read_manifest
from minimind_ray.data.shard import SAMPLE_ID_STRIDE
from minimind_ray.fsio import filesystem

def _unit_hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id, mapped to [0, 1): a fixed, seed-independent coin per sample."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class PreparedDataset:
    """A prepared directory (local path or URI): its manifest, its row groups, its split.

    Rows are addressed by a global position 0..N-1 (shards in manifest order, rows in
    file order). Row groups ("blocks") are the unit of reading.
    """

    def __init__(self, path: str, eval_fraction: float = 0.0):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
        self.path = path
        self.manifest: dict = read_manifest(path)
        self.format: str = self.manifest["format"]
        self.max_seq_len: int = self.manifest["max_seq_len"]
        self.eval_fraction = eval_fraction
        self.columns = formats.COLUMNS[self.format]
        block_rows = self.manifest["block_rows"]
        shards = self.manifest["shards"]
        starts, shard_of, group_of, ids = [0], [], [], []
        for i, s in enumerate(shards):
            for g, lo in enumerate(range(0, s["rows"], block_rows)):
                starts.append(starts[-1] + min(block_rows, s["rows"] - lo))
                shard_of.append(i)
                group_of.append(g)
            ids.append(s["index"] * SAMPLE_ID_STRIDE + np.arange(s["rows"], dtype=np.int64))
        self.block_start = np.asarray(starts, dtype=np.int64)  # block b holds positions [start[b], start[b+1])
        self.block_shard = np.asarray(shard_of, dtype=np.int64)
        self.block_group = np.asarray(group_of, dtype=np.int64)
        self.sample_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)  # by position
        held_out = _unit_hash(self.sample_ids) < eval_fraction
        self._positions = {"train": np.flatnonzero(~held_out), "eval": np.flatnonzero(held_out)}

    @property
    def token_bytes(self) -> Optional[List[int]]:
        """The UTF-8 bytes each token id spells (bits per byte, engine/evaluate.py), as prepare recorded them from
        the tokenizer; None for data prepared before they were recorded."""
        return self.manifest.get("token_bytes")

    @property
    def num_blocks(self) -> int:
        return len(self.block_shard)

    def num_sequences(self, split: str = "train") -> int:
        return len(self.positions(split))

    def positions(self, split: str) -> np.ndarray:
        """Global positions of a split, ascending."""
        if split not in self._positions:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return self._positions[split]

    def block_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.block_start, positions, side="right") - 1

    def epoch_order(self, split: str, seed: int, epoch: int, shuffle: bool = True,
                    window_blocks: int = 16) -> np.ndarray:
        """The positions of ``split`` in the order of this epoch: a pure function of the
        arguments (numpy's PCG64 seeded with (seed, epoch)), the same on every rank."""
        pos = self.positions(split)
        if not shuffle:
            return pos
        rng = np.random.default_rng([seed % (1 << 64), epoch])
        rank_of_block = np.empty(self.num_blocks, dtype=np.int64)
        rank_of_block[rng.permutation(self.num_blocks)] = np.arange(self.num_blocks)
        window = rank_of_block[self.block_of(pos)] // max(1, window_blocks)
        return pos[np.lexsort((rng.random(len(pos)), window))]

    def shard_path(self, shard: int) -> str:
        return f"{self.path.rstrip('/')}/{self.manifest['shards'][shard]['file']}"


class _BlockReader:
    """Decoded row groups, least recently used evicted beyond ``capacity`` (but never a
    block the current request needs). Rows are numpy views into the decoded columns."""

    def __init__(self, dataset: PreparedDataset, capacity: int):
        self.ds, self.capacity = dataset, capacity
        self._files: Dict[int, tuple] = {}  # shard -> (open file, ParquetFile)
        self._cache: "OrderedDict[int, dict]" = OrderedDict()

    def _load(self, b: int) -> dict:
        shard = int(self.ds.block_shard[b])
        if shard not in self._files:
            fs, path = filesystem(self.ds.shard_path(shard))
            handle = fs.open_input_file(path)
            self._files[shard] = (handle, pq.ParquetFile(handle))
        table = self._files[shard][1].read_row_group(int(self.ds.block_group[b]), columns=["sample_id"] + self.ds.columns)
        block = {"sample_id": table.column("sample_id").to_numpy()}
        for c in self.ds.columns:
            arr = table.column(c).combine_chunks()
            block[c] = (arr.offsets.to_numpy(), arr.values.to_numpy())
        return block

    def rows(self, positions: np.ndarray):
        """(column -> list of row arrays, sample ids) of these positions, in their order."""
        blocks = self.ds.block_of(positions)
        needed = np.unique(blocks)
        for b in needed.tolist():
            if b not in self._cache:
                self._cache[b] = self._load(b)
            self._cache.move_to_end(b)
        while len(self._cache) > max(self.capacity, len(needed)):
            self._cache.popitem(last=False)
        rows: Dict[str, List[np.ndarray]] = {c: [] for c in self.ds.columns}
        sample_ids = np.empty(len(positions), dtype=np.int64)
        in_block = positions - self.ds.block_start[blocks]  # row index inside each position's row group
        for i, (r, b) in enumerate(zip(in_block.tolist(), blocks.tolist())):
            block = self._cache[b]
            sample_ids[i] = block["sample_id"][r]
            for c in self.ds.columns:
                offsets, values = block[c]
                rows[c].append(values[offsets[r]:offsets[r + 1]])
        return rows, sample_ids

    def close(self) -> None:
        self._cache.clear()
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class TrainStream:
    """This rank's micro-batches, one optimizer step at a time (see the module docstring).

    ``next_step()`` returns the ``accumulation_steps`` micro-batches of this rank for
    the next global batch and moves to the next (reshuffled) epoch by itself.
    ``state_dict()`` is the same on every rank and does not depend on the world size:
    load it into a stream built for any world size (same global batch size and seed)
    and the next step is the next unseen global batch.
    """

    def __init__(self, dataset: PreparedDataset, *, split: str = "train", global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int, seed: int, shuffle: bool = True,
                 shuffle_window_blocks: int = 16, prefetch_steps: int = 2, pad_id: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if micro_batch_size < 1 or global_batch_size % (world_size * micro_batch_size):
            raise ValueError(f"train.global_batch_size {global_batch_size} is not divisible by world size "
                             f"{world_size} x train.micro_batch_size {micro_batch_size}")
        self.dataset, self.split = dataset, split
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.shuffle, self.shuffle_window_blocks = shuffle, shuffle_window_blocks
        self.prefetch_steps, self.pad_id = prefetch_steps, pad_id
        self.accumulation_steps: int = global_batch_size // (world_size * micro_batch_size)
        self.num_samples = dataset.num_sequences(split)
        self.steps_per_epoch: int = self.num_samples // global_batch_size
        self.dropped_per_epoch: int = self.num_samples % global_batch_size
        if split == "train" and self.steps_per_epoch == 0:
            raise ValueError(f"train.global_batch_size {global_batch_size} is larger than the {self.num_samples} "
                             f"training sequences of {dataset.path}")
        self.epoch = 0
        self.step_in_epoch = 0
        self._reader = _BlockReader(dataset, capacity=2 * max(1, shuffle_window_blocks) + 2)
        self._peek_reader: Optional[_BlockReader] = None
        self._order: Optional[tuple] = None
        self._thread: Optional[threading.Thread] = None
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ producing

    def _epoch_order(self, epoch: int) -> np.ndarray:
        cached = self._order  # (epoch, order), replaced as a whole: safe to read from either thread
        if cached is None or cached[0] != epoch:
            cached = (epoch, self.dataset.epoch_order(self.split, self.seed, epoch, self.shuffle,
                                                      self.shuffle_window_blocks))
            self._order = cached
        return cached[1]

    def step_positions(self, epoch: int, step: int) -> np.ndarray:
        """The global positions this rank trains on at (epoch, step), in micro-batch order."""
        per_rank = self.global_batch_size // self.world_size
        lo = step * self.global_batch_size + self.rank * per_rank
        return self._epoch_order(epoch)[lo:lo + per_rank]

    def _make_step(self, epoch: int, step: int, reader: Optional["_BlockReader"] = None) -> List[dict]:
        mine = self.step_positions(epoch, step)
        rows, sample_ids = (reader or self._reader).rows(mine)
        mb = self.micro_batch_size
        return [formats.collate(self.dataset.format, {c: v[i * mb:(i + 1) * mb] for c, v in rows.items()},
                                sample_ids[i * mb:(i + 1) * mb], self.pad_id, self.dataset.max_seq_len)
                for i in range(self.accumulation_steps)]

    def _next_position(self, epoch: int, step: int):
        return (epoch + 1, 0) if step + 1 >= self.steps_per_epoch else (epoch, step + 1)

    def _put(self, item) -> bool:
        """Queue ``item`` unless asked to stop first (never blocks a stop)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, epoch: int, step: int) -> None:
        try:
            while self._put((epoch, step, self._make_step(epoch, step))):
                epoch, step = self._next_position(epoch, step)
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(e)

    def _stop_producer(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None
            self._stop = threading.Event()

    # ------------------------------------------------------------------ public

    def next_step(self) -> List[Dict[str, "object"]]:
        """The micro-batches of this rank for the next optimizer step (tensors, see formats.collate)."""
        if self.steps_per_epoch == 0:
            raise ValueError(f"split {self.split!r} has {self.num_samples} sequences, fewer than one global batch "
                             f"of {self.global_batch_size}")
        if self.prefetch_steps <= 0:
            batches = self._make_step(self.epoch, self.step_in_epoch)
        else:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.prefetch_steps)
                self._thread = threading.Thread(target=self._produce, args=(self.epoch, self.step_in_epoch),
                                                name=f"TrainStream-rank{self.rank}", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._stop_producer()
                raise item
            epoch, step, batches = item
            assert (epoch, step) == (self.epoch, self.step_in_epoch), "prefetch thread out of step"
        self.epoch, self.step_in_epoch = self._next_position(self.epoch, self.step_in_epoch)
        return batches

    def peek(self) -> List[Dict[str, "object"]]:
        """The micro-batches the next ``next_step()`` will return, without moving (a reader of its own: the
        prefetch thread may be reading at the same time). RL's overlapped rollouts read one step ahead."""
        if self._peek_reader is None:
            self._peek_reader = _BlockReader(self.dataset, capacity=2 * max(1, self.shuffle_window_blocks) + 2)
        return self._make_step(self.epoch, self.step_in_epoch, self._peek_reader)

    def state_dict(self) -> dict:
        """Where the run is in the data, in world-size-independent terms."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "samples_consumed": (self.epoch * self.steps_per_epoch + self.step_in_epoch) * self.global_batch_size,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "shuffle_window_blocks": self.shuffle_window_blocks,
            "split": self.split,
            "num_samples": self.num_samples,
            "tokenizer_hash": self.dataset.manifest["tokenizer_hash"],
        }

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``. Everything that decides the global order must match;
        the world size and micro-batch size may differ."""
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "shuffle", "shuffle_window_blocks", "split", "num_samples",
                    "tokenizer_hash"):
            if key in sd and sd[key] != mine[key]:
                raise ValueError(f"data state mismatch on {key!r}: saved {sd[key]!r}, now {mine[key]!r}; the saved "
                                 f"position would not mean the same samples")
        if not 0 <= sd["step_in_epoch"] < self.steps_per_epoch:
            raise ValueError(f"saved step_in_epoch {sd['step_in_epoch']} is outside [0, {self.steps_per_epoch})")
        self._stop_producer()
        self.epoch, self.step_in_epoch = int(sd["epoch"]), int(sd["step_in_epoch"])

    def eval_batches(self) -> Iterator[dict]:
        """This rank's share of the split, once, in a fixed order (ascending position), as
        micro-batches of ``micro_batch_size`` (the last one may be shorter). Shares differ
        by at most one row, so ranks may get one batch more or fewer: accumulate loss sums
        and token counts locally and all-reduce once at the end."""
        share = np.array_split(self.dataset.positions(self.split), self.world_size)[self.rank]
        reader = _BlockReader(self.dataset, capacity=4)
        try:
            for lo in range(0, len(share), self.micro_batch_size):
                rows, sample_ids = reader.rows(share[lo:lo + self.micro_batch_size])
                yield formats.collate(self.dataset.format, rows, sample_ids, self.pad_id, self.dataset.max_seq_len)
        finally:
            reader.close()

    def close(self) -> None:
        self._stop_producer()
        self._reader.close()
        if self._peek_reader is not None:
            self._peek_reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
