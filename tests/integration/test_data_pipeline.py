"""The data path end to end on a real (shared) Ray: prepare with Ray Data, then read with
TrainStream as the training workers do. Stream tests need no Ray themselves; they share
the data prepared here. Kept small: the whole file runs in well under a minute."""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from minimind_ray.config import DataConfig
from minimind_ray.data.demo import write_demo_corpus
from minimind_ray.data.manifest import skipped_records
from minimind_ray.data.prepare import DataError, ensure_prepared, plan_chunks, prepare, read_manifest
from minimind_ray.data.sources import iter_lines, resolve_sources
from minimind_ray.data.stream import PreparedDataset, TrainStream
from minimind_ray.tokenizer import Tokenizer, resolve_tokenizer
from tests.unit.test_formats import BAD_LINES, EXPECTED, write_bad_file

pytestmark = pytest.mark.integration

G, MICRO = 24, 4  # divisible by world sizes 1, 2, 3 at micro-batch 4


@pytest.fixture(scope="module")
def env(ray_session, tmp_path_factory):
    cache = tmp_path_factory.mktemp("data_cache")
    tok = resolve_tokenizer("builtin", str(cache))
    demo = write_demo_corpus(str(cache / "small"), n_pretrain=3000, n_sft=400, n_dpo=150)
    cfg = DataConfig(format="pretrain", train_path=[demo["pretrain"]], cache_dir=str(cache), max_seq_len=32,
                     block_rows=16, chunk_bytes=64 << 10)
    return {"tok": tok, "demo": demo, "cache": cache, "cfg": cfg, "pretrain": ensure_prepared(cfg, tok)}


def _stream(path, world, rank, eval_fraction=0.1, **kw):
    kw = {"seed": 7, "shuffle_window_blocks": 4, "prefetch_steps": 0, **kw}
    return TrainStream(PreparedDataset(path, eval_fraction), global_batch_size=G, micro_batch_size=MICRO,
                       world_size=world, rank=rank, **kw)


def _ids(step):
    return [i for mb in step for i in mb["sample_ids"].tolist()]


def test_manifest_matches_the_shards(env):
    m = read_manifest(env["pretrain"])
    assert m["format"] == "pretrain" and m["pack"] and m["tokenizer_hash"] == env["tok"].hash()
    assert m["counts"]["records"] == m["counts"]["lines"] == 3000 and m["skipped"] == {}
    assert len(m["shards"]) >= 3  # the 64 KB chunks became several shards
    rows = tokens = 0
    for s in m["shards"]:
        f = pq.ParquetFile(os.path.join(env["pretrain"], s["file"]))
        assert str(f.schema_arrow.field("ids").type) == "list<element: uint16>"
        sizes = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        assert sizes[:-1] == [16] * (len(sizes) - 1) and 0 < sizes[-1] <= 16 and sum(sizes) == s["rows"]
        t = f.read()
        assert t.column("sample_id").to_pylist() == [s["index"] * 2 ** 32 + r for r in range(s["rows"])]
        rows += s["rows"]
        tokens += sum(len(x) for x in t.column("ids").to_pylist())
    assert (rows, tokens) == (m["counts"]["sequences"], m["counts"]["tokens"])


def test_packing_covers_every_token_exactly_once(env):
    tok, m = env["tok"], read_manifest(env["pretrain"])
    files, _ = resolve_sources(env["cfg"].train_path)
    expected = []
    for c in plan_chunks(files, env["cfg"].chunk_bytes):  # each chunk packs its own documents
        stream = [t for line in iter_lines(c.source, c.start, c.end)
                  for t in [tok.bos_id, *tok.encode(json.loads(line)["text"]), tok.eos_id]]
        expected += stream[: len(stream) - (len(stream) % 33 == 1)]  # a 1-token tail is counted, not stored
    stored = [t for s in m["shards"] for row in pq.read_table(os.path.join(env["pretrain"], s["file"]))
              .column("ids").to_pylist() for t in row]
    assert stored == expected
    assert m["counts"]["tokens"] + m["counts"]["dropped_tail_tokens"] == sum(
        len(tok.encode(json.loads(ln)["text"])) + 2 for ln in open(env["demo"]["pretrain"], "rb"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_train_sample_exactly_once_per_epoch(env, world):
    streams = [_stream(env["pretrain"], world, r) for r in range(world)]
    ds = streams[0].dataset
    train_ids = set(ds.sample_ids[ds.positions("train")].tolist())
    assert len({st.steps_per_epoch for st in streams}) == 1
    steps = streams[0].steps_per_epoch
    seen = []
    for _ in range(steps):
        for st in streams:
            batches = st.next_step()
            assert len(batches) == G // (world * MICRO) and all(len(b["sample_ids"]) == MICRO for b in batches)
            seen += _ids(batches)
    assert len(seen) == len(set(seen)) == steps * G
    assert set(seen) <= train_ids and len(train_ids - set(seen)) == streams[0].dropped_per_epoch == len(train_ids) % G
    assert all(st.epoch == 1 and st.step_in_epoch == 0 for st in streams)
    for st in streams:
        st.close()


def test_global_batches_do_not_depend_on_world_size(env):
    one = _stream(env["pretrain"], 1, 0)
    three = [_stream(env["pretrain"], 3, r) for r in range(3)]
    for _ in range(5):
        assert _ids(one.next_step()) == [i for st in three for i in _ids(st.next_step())]


def test_each_epoch_is_reshuffled_and_reproducible(env):
    def two_epochs(seed):
        st = _stream(env["pretrain"], 1, 0, seed=seed)
        out = [[i for _ in range(st.steps_per_epoch) for i in _ids(st.next_step())] for _ in range(2)]
        st.close()
        return out

    e0, e1 = two_epochs(7)
    assert e0 != e1
    dropped = _stream(env["pretrain"], 1, 0).dropped_per_epoch
    assert len(set(e0) ^ set(e1)) <= 2 * dropped  # the same pool but for each epoch's dropped tail
    assert two_epochs(7) == [e0, e1]
    assert two_epochs(8)[0] != e0
    first = _ids(_stream(env["pretrain"], 1, 0, shuffle=False).next_step())
    assert first == sorted(first)  # data.shuffle=False: file order


@pytest.mark.parametrize("world_after", [2, 3])
def test_resume_continues_with_the_next_unseen_batch(env, world_after):
    before = [_stream(env["pretrain"], 2, r, prefetch_steps=2) for r in range(2)]
    k = 5
    consumed = [i for _ in range(k) for st in before for i in _ids(st.next_step())]
    sd = before[0].state_dict()
    assert sd == before[1].state_dict()  # rank-independent
    assert (sd["epoch"], sd["step_in_epoch"], sd["samples_consumed"]) == (0, k, k * G)
    for st in before:
        st.close()
    after = [_stream(env["pretrain"], world_after, r, prefetch_steps=2) for r in range(world_after)]
    for st in after:
        st.load_state_dict(json.loads(json.dumps(sd)))  # survives a JSON round trip (checkpoint metadata)
    rest = [i for _ in range(after[0].steps_per_epoch - k) for st in after for i in _ids(st.next_step())]
    assert not set(consumed) & set(rest)
    full = _stream(env["pretrain"], 1, 0)
    epoch = [i for _ in range(full.steps_per_epoch) for i in _ids(full.next_step())]
    assert sorted(consumed + rest) == sorted(epoch) and consumed == epoch[: k * G]
    for st in after:
        st.close()


def test_resume_refuses_another_global_batch(env):
    st = _stream(env["pretrain"], 1, 0)
    other = TrainStream(st.dataset, global_batch_size=2 * G, micro_batch_size=MICRO, world_size=1, rank=0, seed=7,
                        shuffle_window_blocks=4)
    with pytest.raises(ValueError, match="global_batch_size"):
        other.load_state_dict(st.state_dict())
    with pytest.raises(ValueError, match="global_batch_size 25 is not divisible"):
        TrainStream(st.dataset, global_batch_size=25, micro_batch_size=MICRO, world_size=2, rank=0, seed=7)


def test_eval_split_is_held_out_and_read_once(env):
    ds = PreparedDataset(env["pretrain"], eval_fraction=0.1)
    train, held = set(ds.sample_ids[ds.positions("train")].tolist()), set(ds.sample_ids[ds.positions("eval")].tolist())
    n = ds.manifest["counts"]["sequences"]
    assert not train & held and len(train) + len(held) == n and 0.05 < len(held) / n < 0.15
    assert set(PreparedDataset(env["pretrain"], 0.1).sample_ids[ds.positions("eval")].tolist()) == held
    ids = []
    for r in range(2):
        st = TrainStream(ds, split="eval", global_batch_size=G, micro_batch_size=MICRO, world_size=2, rank=r, seed=1)
        ids += [i for b in st.eval_batches() for i in b["sample_ids"].tolist()]
    assert len(ids) == len(set(ids)) == len(held)
    train_ids = {i for _ in range(3) for i in _ids(_stream(env["pretrain"], 1, 0).next_step())}
    assert not train_ids & set(ids)


@pytest.mark.parametrize("fmt", ["sft", "dpo"])
def test_sft_and_dpo_batches(env, fmt):
    cfg = DataConfig(format=fmt, train_path=[env["demo"][fmt]], cache_dir=str(env["cache"]), max_seq_len=64)
    path = ensure_prepared(cfg, env["tok"])
    m = read_manifest(path)
    assert m["counts"]["sequences"] == m["counts"]["records"] == m["counts"]["lines"]
    st = TrainStream(PreparedDataset(path), global_batch_size=8, micro_batch_size=4, world_size=1, rank=0, seed=0)
    for b in st.next_step():
        sides = [""] if fmt == "sft" else ["chosen_", "rejected_"]
        T = b[sides[0] + "input_ids"].shape[1]
        assert T % 8 == 0 and T <= 64
        for s in sides:
            x, y = b[s + "input_ids"], b[s + "targets"]
            assert x.shape == y.shape == (4, T)
            labelled = y != -100
            assert labelled.any(dim=1).all()
            # every labelled row ends its answer with <|im_end|>\n, unless max_seq_len cut it: a stored row holds at
            # most 64 tokens, so its last target (index 62) is labelled only when the answer went on past the row
            for row in range(4):
                cut = int(labelled[row].nonzero().max()) == 64 - 2
                assert cut or env["tok"].decode(y[row][labelled[row]].tolist()).endswith("<|im_end|>\n")
    st.close()


def test_bad_input_counted_with_real_line_numbers(env, tmp_path):
    bad, empty, missing = write_bad_file(tmp_path)
    cfg = DataConfig(format="pretrain", max_seq_len=16, pack=False, chunk_bytes=40, block_rows=2)
    m = read_manifest(prepare([bad, empty, missing], str(tmp_path / "out"), env["tok"], cfg))
    assert {r: e["count"] for r, e in m["skipped"].items()} == {
        **{r: len(v) for r, v in EXPECTED.items()}, "missing_file": 1, "empty_file": 1}
    for reason, lines in EXPECTED.items():
        assert m["skipped"][reason]["samples"] == [f"{bad}:{n}" for n in lines]
    assert m["truncated"] == {"count": 1, "samples": [f"{bad}:10"]}
    assert m["counts"]["lines"] == len(BAD_LINES) and m["counts"]["records"] == 4
    # what a run says on its console and as its MLflow tag data/skipped (issue 38): the first in file order
    assert skipped_records(str(tmp_path / "out")) == (
        f"10 of 14 records (bad_json: 1, empty_file: 1, empty_line: 2, missing_field: 2, missing_file: 1, not_utf8: 1, "
        f"wrong_type: 2; first at {bad}:2)")
    strict = DataConfig(format="pretrain", max_seq_len=16, pack=False, chunk_bytes=40, bad_records="strict")
    with pytest.raises(DataError, match=rf"{bad}:2: empty_line"):
        prepare([bad], str(tmp_path / "strict"), env["tok"], strict)
    assert not os.path.exists(tmp_path / "strict" / "manifest.json")
    assert not [f for f in os.listdir(tmp_path / "strict") if f.startswith("part-")]


def test_prepared_data_is_reused_and_checked(env):
    path, cfg, tok = env["pretrain"], env["cfg"], env["tok"]
    before = os.path.getmtime(os.path.join(path, "manifest.json"))
    assert ensure_prepared(cfg, tok) == path  # same sources, tokenizer, settings: reused
    assert os.path.getmtime(os.path.join(path, "manifest.json")) == before
    direct = DataConfig(format="pretrain", train_path=[path], max_seq_len=32)
    assert ensure_prepared(direct, tok) == path
    other = Tokenizer(tok._hf, {**tok.config, "chat_template": "{{ messages }}"})
    with pytest.raises(DataError) as e:
        ensure_prepared(direct, other)
    assert tok.hash() in str(e.value) and other.hash() in str(e.value) and path in str(e.value)
    with pytest.raises(DataError, match="max_seq_len=32 but data.max_seq_len=64"):
        ensure_prepared(DataConfig(format="pretrain", train_path=[path], max_seq_len=64), tok)


def test_uris_and_globs_work_like_paths(env, tmp_path):
    src_dir = os.path.dirname(env["demo"]["sft"])
    cfg = DataConfig(format="sft", max_seq_len=64, chunk_bytes=32 << 10)
    out = prepare([f"file://{src_dir}/sf*.jsonl"], f"file://{tmp_path}/out", env["tok"], cfg)
    m = read_manifest(out)
    assert [s["uri"] for s in m["sources"]] == [f"file://{env['demo']['sft']}"]
    assert m["counts"]["records"] == 400 and len(m["shards"]) > 1
    st = TrainStream(PreparedDataset(out), global_batch_size=8, micro_batch_size=8, world_size=1, rank=0, seed=0)
    assert st.steps_per_epoch == 50 and st.next_step()[0]["input_ids"].shape[0] == 8
    st.close()


def test_small_files_packed_into_tasks_give_the_shards_of_one_chunk_at_a_time(env, tmp_path):
    """Packing chunks into tasks changes who writes a shard, never what it holds: the Ray job's
    output equals process_chunk run here on each chunk alone (ids, rows, counts, line numbers)."""
    import ray

    from minimind_ray.data.prepare import plan_tasks
    from tests.unit.test_formats import _run_local

    src = tmp_path / "many"
    src.mkdir()
    for k in range(24):
        lines = [json.dumps({"text": f"File {k} line {i}: the sky is blue."}) for i in range(10)]
        if k == 5:
            lines[6] = '{"text": '  # bad_json at many/f05.jsonl:7
        (src / f"f{k:02d}.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(format="pretrain", max_seq_len=32, block_rows=4)
    chunks, local = _run_local([str(src)], tmp_path / "local", env["tok"], cfg)
    tasks = plan_tasks(chunks, cfg.chunk_bytes, int(ray.cluster_resources()["CPU"]))
    assert len(chunks) == 24 and len(tasks) < len(chunks)  # files really share tasks
    m = read_manifest(prepare([str(src)], str(tmp_path / "ray"), env["tok"], cfg))
    assert m["counts"] == local["counts"] and m["counts"]["records"] == 239
    assert m["skipped"] == local["skipped"] == {"bad_json": {"count": 1, "samples": [f"{src}/f05.jsonl:7"]}}
    assert [(s["file"], s["index"], s["rows"]) for s in m["shards"]] == \
        [(s["file"], s["index"], s["rows"]) for s in local["shards"]]
    for s in m["shards"]:
        assert pq.read_table(tmp_path / "ray" / s["file"]).equals(pq.read_table(tmp_path / "local" / s["file"]))
