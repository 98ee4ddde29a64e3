"""data/stream.py on its own: the epoch's global order, each rank's slice of it, resume at any world size, the
held-out split and the reader's cache. No Ray, no model: the prepared data of tests/fixtures/checkpoint_v1 (982
packed rows of 32 tokens in row groups of 16), and a two-shard copy of it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minimind_ray.data.shard import SAMPLE_ID_STRIDE
from minimind_ray.data.stream import PreparedDataset, TrainStream, _unit_hash

PREPARED = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / "prepared"
N, BLOCK = 982, 16


@pytest.fixture(scope="module")
def ds():
    return PreparedDataset(str(PREPARED))


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    """The fixture's rows as two shards (500 + 482 rows: the first shard's last row group is short), sample ids
    numbered per shard as prepare numbers them."""
    out = tmp_path_factory.mktemp("two-shards")
    table = pq.read_table(PREPARED / "part-00000.parquet")
    manifest = json.loads((PREPARED / "manifest.json").read_text())
    shards = []
    for index, (lo, hi) in enumerate([(0, 500), (500, N)]):
        part = table.slice(lo, hi - lo)
        ids = pa.array(index * SAMPLE_ID_STRIDE + np.arange(hi - lo, dtype=np.int64))
        part = part.set_column(part.schema.get_field_index("sample_id"), "sample_id", ids)
        name = f"part-{index:05d}.parquet"
        pq.write_table(part, out / name, row_group_size=BLOCK)
        shards.append({"file": name, "index": index, "rows": hi - lo})
    (out / "manifest.json").write_text(json.dumps({**manifest, "shards": shards}))
    return PreparedDataset(str(out))


def _stream(ds, **kw):
    args = dict(global_batch_size=32, micro_batch_size=4, world_size=1, rank=0, seed=7, prefetch_steps=0)
    return TrainStream(ds, **{**args, **kw})


def _epoch_positions(ds, world: int, epoch: int = 0, **kw) -> np.ndarray:
    """Every rank's positions of every step of an epoch, in (step, rank) order."""
    streams = [_stream(ds, world_size=world, rank=r, micro_batch_size=32 // (world * 2), **kw) for r in range(world)]
    steps = streams[0].steps_per_epoch
    return np.concatenate([s.step_positions(epoch, k) for k in range(steps) for s in streams])


def test_the_blocks_of_one_and_of_two_shards_address_the_same_rows(ds, two_shards):
    assert ds.num_blocks == 62 and list(ds.block_start[:3]) == [0, 16, 32] and ds.block_start[-1] == N
    assert two_shards.num_blocks == 32 + 31  # 500 = 31 x 16 + 4: the first shard ends with a short group
    assert list(two_shards.block_start[30:34]) == [480, 496, 500, 516]
    assert list(two_shards.block_shard[30:34]) == [0, 0, 1, 1] and list(two_shards.block_group[30:34]) == [30, 31, 0, 1]
    assert two_shards.sample_ids[499] == 499 and two_shards.sample_ids[500] == SAMPLE_ID_STRIDE
    assert list(two_shards.block_of(np.array([0, 15, 16, 499, 500, 981]))) == [0, 0, 1, 31, 32, 62]
    a, b = _stream(ds, shuffle=False), _stream(two_shards, shuffle=False)
    for step in (0, 15, 16):  # step 15 spans the two shards' seam
        x, y = a._make_step(0, step), b._make_step(0, step)
        assert all((p["input_ids"] == q["input_ids"]).all() for p, q in zip(x, y))
    assert b._make_step(0, 15)[5]["sample_ids"].tolist() == [SAMPLE_ID_STRIDE + i for i in range(4)]  # rows 500-503
    assert two_shards.shard_path(1) == f"{two_shards.path}/part-00001.parquet"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_row_once_per_epoch_in_the_same_global_order_at_any_world_size(ds, world):
    order = _epoch_positions(ds, world)
    steps = N // 32
    assert len(order) == steps * 32 and len(set(order.tolist())) == len(order)  # no row twice
    assert np.array_equal(order, ds.epoch_order("train", 7, 0)[:steps * 32])  # the global order, cut by rank
    assert np.array_equal(order, _epoch_positions(ds, 1))
    s = _stream(ds, world_size=world, rank=world - 1, micro_batch_size=32 // (world * 2))
    assert (s.steps_per_epoch, s.dropped_per_epoch, s.accumulation_steps) == (steps, N - steps * 32, 2)


def test_the_order_is_a_function_of_seed_and_epoch_and_windows_bound_the_mixing(ds):
    base = ds.epoch_order("train", 7, 0)
    assert sorted(base.tolist()) == list(range(N)) and not np.array_equal(base, np.arange(N))
    assert np.array_equal(base, PreparedDataset(str(PREPARED)).epoch_order("train", 7, 0))  # any process, any rank
    for other in (ds.epoch_order("train", 8, 0), ds.epoch_order("train", 7, 1)):
        assert not np.array_equal(base, other) and sorted(other.tolist()) == list(range(N))
    assert np.array_equal(ds.epoch_order("train", 7, 0, shuffle=False), np.arange(N))
    # one block per window: each block's rows come together, the blocks in a shuffled order
    blocks = ds.block_of(ds.epoch_order("train", 7, 0, window_blocks=1))
    runs = blocks[np.r_[True, blocks[1:] != blocks[:-1]]]
    assert len(runs) == ds.num_blocks and sorted(runs.tolist()) == list(range(ds.num_blocks))
    # windows of 4 blocks: the first 4 x 16 positions come from 4 blocks, and rows are mixed inside them
    first = ds.block_of(ds.epoch_order("train", 7, 0, window_blocks=4)[:64])
    assert len(set(first.tolist())) == 4 and len(np.flatnonzero(first[1:] != first[:-1])) > 8
    assert np.array_equal(ds.epoch_order("train", 7, 0, window_blocks=0), ds.epoch_order("train", 7, 0, window_blocks=1))
    assert np.array_equal(ds.epoch_order("train", 7 + (1 << 64), 0), base)  # the seed is taken mod 2^64


def test_a_resume_continues_with_the_next_unseen_batch_at_another_world_size(ds):
    two = [_stream(ds, world_size=2, rank=r, micro_batch_size=8) for r in range(2)]
    for _ in range(5):
        for s in two:
            s.next_step()
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert (state["epoch"], state["step_in_epoch"], state["samples_consumed"]) == (0, 5, 160)
    one = _stream(ds, micro_batch_size=16)
    one.load_state_dict(state)
    got = [i for mb in one.next_step() for i in mb["sample_ids"].tolist()]
    want = [i for s in two for mb in s.next_step() for i in mb["sample_ids"].tolist()]
    assert got == want and len(got) == 32
    assert one.state_dict()["samples_consumed"] == 192


def test_epochs_roll_over_and_prefetching_changes_nothing(ds):
    plain, ahead = _stream(ds), _stream(ds, prefetch_steps=2)
    steps = plain.steps_per_epoch
    seen = []
    for k in range(steps + 2):
        p, a = plain.next_step(), ahead.next_step()
        assert [mb["sample_ids"].tolist() for mb in p] == [mb["sample_ids"].tolist() for mb in a]
        seen.append(np.concatenate([mb["sample_ids"].numpy() for mb in p]))
    assert (plain.epoch, plain.step_in_epoch) == (1, 2)
    assert plain.state_dict()["samples_consumed"] == (steps + 2) * 32
    assert np.array_equal(seen[steps], ds.sample_ids[ds.epoch_order("train", 7, 1)[:32]])  # epoch 1's own order
    # a resume moves a prefetching stream: its producer is restarted at the new position
    ahead.load_state_dict({**ahead.state_dict(), "epoch": 0, "step_in_epoch": 3})
    assert np.array_equal(np.concatenate([mb["sample_ids"].numpy() for mb in ahead.next_step()]), seen[3])
    ahead.close()


def test_peek_shows_the_next_step_without_moving(ds):
    s = _stream(ds, prefetch_steps=1)
    s.next_step()
    peeked = s.peek()
    assert (s.epoch, s.step_in_epoch) == (0, 1)
    assert [mb["sample_ids"].tolist() for mb in peeked] == [mb["sample_ids"].tolist() for mb in s.next_step()]
    s.close()


def test_batches_hold_the_stored_rows_shifted_into_targets(ds):
    s = _stream(ds, shuffle=False)
    mbs = s.next_step()
    assert len(mbs) == 8 and mbs[0]["input_ids"].shape == (4, 32)
    table = pq.read_table(PREPARED / "part-00000.parquet")
    row0 = np.asarray(table.column("ids")[0].as_py())
    assert mbs[0]["input_ids"][0].tolist() == row0[:-1].tolist() and mbs[0]["targets"][0].tolist() == row0[1:].tolist()
    assert mbs[1]["sample_ids"].tolist() == [4, 5, 6, 7]


def test_a_saved_position_that_would_mean_other_samples_is_refused_naming_the_key(ds):
    s = _stream(ds)
    state = s.state_dict()
    for key, value in [("seed", 8), ("global_batch_size", 64), ("shuffle", False), ("shuffle_window_blocks", 4),
                       ("split", "eval"), ("num_samples", 10), ("tokenizer_hash", "abc")]:
        with pytest.raises(ValueError, match=f"data state mismatch on '{key}': saved {value!r}"):
            s.load_state_dict({**state, key: value})
    for step in (-1, s.steps_per_epoch):
        with pytest.raises(ValueError, match=rf"saved step_in_epoch {step} is outside \[0, 30\)"):
            s.load_state_dict({**state, "step_in_epoch": step})
    s.load_state_dict({"epoch": 2, "step_in_epoch": 29})  # an older record without the keys: taken as it is
    assert (s.epoch, s.step_in_epoch) == (2, 29)


def test_a_stream_that_cannot_be_built_says_which_setting(ds):
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        _stream(ds, world_size=2, rank=2)
    with pytest.raises(ValueError, match="rank -1 is not in a world of size 2"):
        _stream(ds, world_size=2, rank=-1)
    with pytest.raises(ValueError, match="rank 0 is not in a world of size 0"):
        _stream(ds, world_size=0, rank=0)
    with pytest.raises(ValueError, match="global_batch_size 32 is not divisible by world size 3 x "
                                         "train.micro_batch_size 4"):
        _stream(ds, world_size=3)
    with pytest.raises(ValueError, match="micro_batch_size 0"):
        _stream(ds, micro_batch_size=0)
    with pytest.raises(ValueError, match=f"global_batch_size 1024 is larger than the {N} training sequences"):
        _stream(ds, global_batch_size=1024, micro_batch_size=1024)
    _stream(ds, global_batch_size=N - 1, micro_batch_size=N - 1)  # one step fits
    small_eval = _stream(PreparedDataset(str(PREPARED), eval_fraction=0.01), split="eval")
    with pytest.raises(ValueError, match="split 'eval' has .* sequences, fewer than one global batch of 32"):
        small_eval.next_step()
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=f"data.eval_fraction must be in \\[0, 1\\), got {bad}"):
            PreparedDataset(str(PREPARED), eval_fraction=bad)
    with pytest.raises(ValueError, match="split must be 'train' or 'eval', got 'test'"):
        ds.positions("test")


def test_the_held_out_split_is_chosen_by_sample_id_alone(ds, two_shards):
    held = PreparedDataset(str(PREPARED), eval_fraction=0.2)
    train, ev = held.positions("train"), held.positions("eval")
    assert len(train) + len(ev) == N and not set(train.tolist()) & set(ev.tolist())
    assert 0.15 < len(ev) / N < 0.25 and held.num_sequences("eval") == len(ev)
    assert np.array_equal(ev, np.flatnonzero(_unit_hash(held.sample_ids) < 0.2))
    assert set(held.epoch_order("train", 3, 0).tolist()) == set(train.tolist())  # never trained on, any seed
    assert len(ds.positions("eval")) == 0 and ds.num_sequences() == N
    h = _unit_hash(np.arange(100_000, dtype=np.int64))
    assert h.min() >= 0 and h.max() < 1 and abs(h.mean() - 0.5) < 0.01  # a fair coin per id
    assert len(set(_unit_hash(np.array([0, 1, 2, SAMPLE_ID_STRIDE])).tolist())) == 4


@pytest.mark.parametrize("world", [1, 3])
def test_eval_batches_cover_the_split_once_across_ranks(world):
    held = PreparedDataset(str(PREPARED), eval_fraction=0.2)
    ev = held.positions("eval")
    got = []
    for r in range(world):
        s = TrainStream(held, split="eval", global_batch_size=3 * 5, micro_batch_size=5, world_size=world, rank=r,
                        seed=0, prefetch_steps=0)
        batches = list(s.eval_batches())
        assert all(len(b["sample_ids"]) == 5 for b in batches[:-1]) and 1 <= len(batches[-1]["sample_ids"]) <= 5
        got.extend(np.concatenate([b["sample_ids"].numpy() for b in batches]).tolist())
    assert got == held.sample_ids[ev].tolist()  # ascending position, each row once


def test_the_reader_keeps_at_most_its_capacity_of_decoded_blocks(ds):
    s = _stream(ds, shuffle_window_blocks=1)
    capacity = s._reader.capacity
    assert capacity == 4
    for _ in range(12):
        s.next_step()
        assert len(s._reader._cache) <= capacity
    # a request that needs more blocks than the capacity keeps them all while it is served
    rows, ids = s._reader.rows(np.arange(0, N, BLOCK)[:10])
    assert len(s._reader._cache) == 10 and ids.tolist() == list(range(0, 160, BLOCK))
    s.close()
    assert s._reader._cache == {} and s._reader._files == {}


def test_an_error_in_the_prefetch_thread_reaches_the_caller(ds, tmp_path):
    copy = tmp_path / "prepared"
    shutil.copytree(PREPARED, copy)
    s = _stream(PreparedDataset(str(copy)), prefetch_steps=2)
    (copy / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(Exception, match="(?i)parquet"):
        s.next_step()
    assert s._thread is None  # the producer stopped; a retry starts a new one
    s.close()


# --------------------------------------------------------------------------- what data/stream.py's surviving mutants
# showed untested (issue 34)


def _splitmix64_unit(i: int) -> float:
    """The reference: splitmix64's finaliser in Python integers, its top 53 bits as a fraction."""
    m = (1 << 64) - 1
    z = (i + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def test_the_held_out_coin_is_splitmix64():
    """The split must not change between versions (a changed hash would move rows between train and eval of a
    resumed run), so it is pinned to the reference, id by id."""
    ids = [0, 1, 2, 981, SAMPLE_ID_STRIDE, 7 * SAMPLE_ID_STRIDE + 12345, (1 << 62) + 3]
    got = _unit_hash(np.array(ids, dtype=np.int64))
    assert got.dtype == np.float64 and got.tolist() == [_splitmix64_unit(i) for i in ids]


def test_an_empty_manifest_and_the_recorded_settings(tmp_path, ds):
    empty = tmp_path / "empty"
    empty.mkdir()
    manifest = json.loads((PREPARED / "manifest.json").read_text())
    (empty / "manifest.json").write_text(json.dumps({**manifest, "shards": []}))
    none = PreparedDataset(str(empty), eval_fraction=0.5)
    assert none.sample_ids.dtype == np.int64 and len(none.sample_ids) == 0 and none.num_blocks == 0
    assert none.num_sequences("train") == none.num_sequences("eval") == 0 and none.eval_fraction == 0.5
    assert PreparedDataset(str(PREPARED) + "/").shard_path(0) == f"{PREPARED}/part-00000.parquet"
    rows, ids = _stream(ds)._reader.rows(np.array([3, 700]))
    assert ids.dtype == np.int64 and ids.tolist() == [3, 700]
    # the defaults a training run gets: two steps prefetched, pad 0, a cache of two windows and two blocks
    s = TrainStream(ds, global_batch_size=32, micro_batch_size=1, world_size=1, rank=0, seed=0)
    assert (s.prefetch_steps, s.pad_id, s.shuffle_window_blocks, s._reader.capacity) == (2, 0, 16, 34)
    s.load_state_dict({**s.state_dict(), "step_in_epoch": 0})  # the first step of an epoch is a position too
    assert s.step_in_epoch == 0


def test_one_step_of_prefetch_runs_in_a_daemon_thread_and_peek_reads_on_its_own(ds):
    s = _stream(ds, prefetch_steps=1)
    s.next_step()
    assert s._thread is not None and s._thread.daemon and s._thread.name == "TrainStream-rank0"
    s.close()
    plain = _stream(ds)  # no prefetch thread: still, peek leaves the stream's reader alone
    plain.peek()
    assert plain._reader._cache == {} and plain._peek_reader is not None and plain._peek_reader.capacity == 34
    narrow = _stream(ds, shuffle_window_blocks=1)
    narrow.peek()
    assert narrow._peek_reader.capacity == 4  # two windows of one block, and two


def test_a_full_queue_makes_the_producer_wait_not_stop(ds, monkeypatch):
    """The producer's put times out every 0.1 s to look for a stop; a timeout on a full queue must be tried again.
    A queue whose first put times out stands in for a consumer slower than the timeout (no sleeping here)."""
    import queue as queue_mod
    from types import SimpleNamespace

    from minimind_ray.data import stream as stream_mod

    class SlowConsumer(queue_mod.Queue):
        timed_out = False

        def put(self, item, block=True, timeout=None):
            if not SlowConsumer.timed_out:
                SlowConsumer.timed_out = True
                raise queue_mod.Full
            super().put(item, block, timeout)

    monkeypatch.setattr(stream_mod, "queue", SimpleNamespace(Queue=SlowConsumer, Full=queue_mod.Full))
    s = _stream(ds, prefetch_steps=1)
    first = s.next_step()  # with the producer stopped by the timeout, this would wait for ever
    assert SlowConsumer.timed_out and len(first) == 8
    s.close()
