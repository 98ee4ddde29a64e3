"""Record formats and the bad-record policy, without Ray: the same functions the prepare job
maps over its chunks (process_chunk) and merges on the driver (merge_summaries)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minimind_ray.config import DataConfig
from minimind_ray.data import formats
from minimind_ray.data.formats import BadRecord, Encoder, collate
from minimind_ray.data.prepare import DataError, merge_summaries, plan_chunks, process_chunk
from minimind_ray.data.sources import iter_lines, resolve_sources
from minimind_ray.tokenizer import load_tokenizer, train_tokenizer
from tests.conftest import minimind_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small tokenizer trained in a fraction of a second (vocab 600)."""
    from minimind_ray.data.demo import write_demo_corpus

    d = tmp_path_factory.mktemp("tok")
    demo = write_demo_corpus(str(d / "demo"), n_pretrain=500, n_sft=100, n_dpo=20)
    return train_tokenizer(list(demo.values()), str(d / "tok"), vocab_size=600)


def _docs(tok, texts):
    return [np.array([tok.bos_id, *tok.encode(t), tok.eos_id]) for t in texts]


def test_pretrain_packing_covers_every_token_exactly_once(tok):
    texts = [f"Document {i}: " + "The capital of France is Paris. " * (i % 7) for i in range(40)]
    enc = Encoder("pretrain", tok, max_seq_len=16)
    rows = []
    for lo in range(0, len(texts), 7):  # several add() calls: windows continue across batches
        assert enc.add([{"text": t} for t in texts[lo:lo + 7]]) == []  # pack mode never truncates
        rows += (enc.take() or {"ids": []})["ids"]
    rows += (enc.take(final=True) or {"ids": []})["ids"]
    stream = np.concatenate(_docs(tok, texts))
    assert [len(r) for r in rows[:-1]] == [17] * (len(rows) - 1)  # windows of max_seq_len + 1
    assert 2 <= len(rows[-1]) <= 17
    assert np.array_equal(np.concatenate(rows), stream[: len(stream) - enc.dropped_tail_tokens])
    # a batch of windows: input w[:-1], targets w[1:]; the partial last window padded with -100
    b = collate("pretrain", {"ids": rows[-2:]}, np.array([7, 8]), pad_id=0, max_seq_len=16)
    assert b["input_ids"].shape == (2, 16) and b["input_ids"].dtype == b["targets"].dtype
    assert b["input_ids"][0].tolist() == rows[-2][:-1].tolist() and b["targets"][0].tolist() == rows[-2][1:].tolist()
    n = len(rows[-1]) - 1
    assert b["targets"][1, :n].tolist() == rows[-1][1:].tolist() and (b["targets"][1, n:] == -100).all()
    assert b["sample_ids"].tolist() == [7, 8]


def test_pretrain_pad_mode_is_minimind(tok):
    enc = Encoder("pretrain", tok, max_seq_len=8, pack=False)
    long, short = "1 plus 2 equals 3. " * 5, "Hi"
    assert enc.add([{"text": long}, {"text": short}]) == [(0, "truncated", "longer than max_seq_len=8")]
    rows = enc.take(final=True)["ids"]
    assert rows[0].tolist() == [tok.bos_id, *tok.encode(long)[:6], tok.eos_id]
    assert rows[1].tolist() == [tok.bos_id, *tok.encode(short), tok.eos_id]
    b = collate("pretrain", {"ids": rows}, np.array([0, 1]), pad_id=tok.pad_id, max_seq_len=8)
    assert b["input_ids"].shape == (2, 8)
    n = len(rows[1]) - 1
    assert (b["targets"][1, n:] == -100).all() and (b["input_ids"][1, n:] == tok.pad_id).all()


def test_sft_labels_match_minimind_on_a_hand_checked_example():
    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    conv = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"},
            {"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": "2"}]
    enc = Encoder("sft", tok, max_seq_len=64)
    assert enc.add([{"conversations": conv}]) == []
    rows = enc.take(final=True)
    ids, mask = rows["ids"][0], rows["mask"][0]
    # checked by hand against MiniMind's generate_labels: '<|im_start|>assistant\n' is [1, 1078, 538, 501, 201];
    # each span runs from after it through '<|im_end|>\n' = [2, 201]
    assert len(ids) == 48
    assert np.flatnonzero(mask).tolist() == [25, 26, 27, 28, 45, 46, 47]
    assert ids[mask == 1].tolist() == [5134, 2207, 2, 201, 20, 2, 201]  # 你好 ！ <|im_end|> \n 2 <|im_end|> \n
    b = collate("sft", rows, np.array([0]), pad_id=0, max_seq_len=64)
    assert b["input_ids"].shape == (1, 48)  # 47 inputs, rounded up to a multiple of 8
    t = b["targets"][0]
    assert np.flatnonzero(t.numpy() != -100).tolist() == [24, 25, 26, 27, 44, 45, 46]
    assert t[24].item() == 5134 and t[46].item() == 201
    # truncated inside the second answer: its span runs to the cut, pads never train
    enc = Encoder("sft", tok, max_seq_len=46)
    assert enc.add([{"conversations": conv}]) == [(0, "truncated", "longer than max_seq_len=46")]
    assert np.flatnonzero(enc.take(final=True)["mask"][0]).tolist() == [25, 26, 27, 28, 45]


def test_sft_without_an_assistant_turn_has_no_labels(tok):
    enc = Encoder("sft", tok, max_seq_len=64)
    issues = enc.add([{"conversations": [{"role": "user", "content": "hello"}]}])
    assert [(i, r) for i, r, _ in issues] == [(0, "no_labels")]
    assert enc.take(final=True) is None


def test_dpo_rows_and_batch_shapes(tok):
    recs = [{"chosen": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": c}],
             "rejected": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": r}]}
            for c, r in [("2 plus 2 equals 4.", "5"), ("Four.", "2 plus 2 equals 5, I think, or maybe 6.")]]
    enc = Encoder("dpo", tok, max_seq_len=256)
    assert enc.add(recs) == []
    rows = enc.take(final=True)
    assert sorted(rows) == ["chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"]
    b = collate("dpo", rows, np.array([3, 4]), pad_id=0, max_seq_len=256)
    longest = max(len(r) - 1 for k in ("chosen_ids", "rejected_ids") for r in rows[k])
    T = b["chosen_input_ids"].shape[1]
    assert T % 8 == 0 and longest <= T < longest + 8
    for side in ("chosen", "rejected"):
        assert b[f"{side}_input_ids"].shape == b[f"{side}_targets"].shape == (2, T)
        for i in range(2):
            labelled = b[f"{side}_targets"][i][b[f"{side}_targets"][i] != -100].tolist()
            answer = recs[i][side][1]["content"]
            assert tok.decode(labelled) == answer + "<|im_end|>\n"


@pytest.mark.parametrize("line, reason", [
    (b"", "empty_line"), (b"   ", "empty_line"), (b'{"text": "abc', "bad_json"), (b'\xff{"text": "a"}', "not_utf8"),
    (b"[1, 2]", "wrong_type"),
])
def test_parse_line_reasons(line, reason):
    with pytest.raises(BadRecord) as e:
        formats.parse_line(line)
    assert e.value.reason == reason


@pytest.mark.parametrize("fmt, rec, reason, where", [
    ("pretrain", {"txt": "a"}, "missing_field", "'text'"),
    ("pretrain", {"text": 5}, "wrong_type", "'text' is int"),
    ("sft", {"conversations": "hi"}, "wrong_type", "'conversations'"),
    ("sft", {"conversations": [{"role": "user"}]}, "missing_field", "conversations[0].content"),
    ("sft", {"conversations": [{"role": "robot", "content": "x"}]}, "wrong_type", "conversations[0].role"),
    ("dpo", {"chosen": []}, "missing_field", "'rejected'"),
    ("dpo", {"chosen": [], "rejected": [{"role": "user", "content": 1}]}, "wrong_type", "rejected[0].content"),
])
def test_check_record_names_the_field(fmt, rec, reason, where):
    with pytest.raises(BadRecord) as e:
        formats.check_record(fmt, rec)
    assert e.value.reason == reason and where in e.value.detail


# every bad case, one per line; the numbers are the file's real line numbers
BAD_LINES = [
    b'{"text": "The sky is blue."}',  # 1 ok
    b"",  # 2 empty_line
    b'{"text": "The grass is',  # 3 bad_json (truncated)
    b'{"txt": "The snow is white."}',  # 4 missing_field
    b'{"text": 42}',  # 5 wrong_type
    b'{"text": "caf\xe9"}',  # 6 not_utf8 (latin-1)
    b'["The sky is blue."]',  # 7 wrong_type
    b'{"text": "A dog says woof."}',  # 8 ok
    b"   ",  # 9 empty_line
    b'{"text": "' + b"1 plus 1 equals 2. " * 20 + b'"}',  # 10 ok, truncated (pad mode)
    b'{"text": null}',  # 11 missing_field
    b'{"text": "A cat says meow."}',  # 12 ok, no final newline
]
EXPECTED = {"empty_line": [2, 9], "bad_json": [3], "missing_field": [4, 11], "wrong_type": [5, 7], "not_utf8": [6]}


def write_bad_file(d):
    """A jsonl holding every bad case, plus an empty file; returns (bad, empty, missing) paths."""
    bad, empty = d / "bad.jsonl", d / "empty.jsonl"
    bad.write_bytes(b"\n".join(BAD_LINES))
    empty.write_bytes(b"")
    return str(bad), str(empty), str(d / "missing.jsonl")


def _run_local(paths, out, tok, cfg):
    """prepare() without Ray: plan, process every chunk in this process, merge."""
    out.mkdir()
    files, missing = resolve_sources(paths)
    file_issues = [("missing_file", m) for m in missing] + [("empty_file", f.uri) for f in files if f.size == 0]
    chunks = plan_chunks(files, cfg.chunk_bytes)
    return chunks, merge_summaries(chunks, [process_chunk(c, tok, cfg, str(out)) for c in chunks], file_issues)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 40])  # one chunk, or a chunk every few lines
def test_bad_records_counted_per_reason_with_real_line_numbers(tok, tmp_path, chunk_bytes):
    bad, empty, missing = write_bad_file(tmp_path)
    cfg = DataConfig(format="pretrain", max_seq_len=16, pack=False, chunk_bytes=chunk_bytes, block_rows=2)
    chunks, merged = _run_local([bad, empty, missing], tmp_path / "out", tok, cfg)
    assert (len(chunks) > 3) == (chunk_bytes == 40)
    skipped = merged["skipped"]
    assert {r: e["count"] for r, e in skipped.items()} == {
        **{r: len(v) for r, v in EXPECTED.items()}, "missing_file": 1, "empty_file": 1}
    for reason, lines in EXPECTED.items():
        assert skipped[reason]["samples"] == [f"{bad}:{n}" for n in lines]
    assert skipped["missing_file"]["samples"] == [missing] and skipped["empty_file"]["samples"] == [empty]
    assert merged["truncated"] == {"count": 1, "samples": [f"{bad}:10"]}
    assert merged["counts"]["records"] == 4 and merged["counts"]["sequences"] == 4
    assert merged["counts"]["lines"] == len(BAD_LINES)


def test_strict_names_the_first_bad_line(tok, tmp_path):
    bad, _, _ = write_bad_file(tmp_path)
    cfg = DataConfig(format="pretrain", max_seq_len=16, pack=False, chunk_bytes=40, bad_records="strict")
    with pytest.raises(DataError, match=rf"^{bad}:2: empty_line"):
        _run_local([bad], tmp_path / "out", tok, cfg)


def test_byte_ranges_split_on_newlines(tmp_path):
    p = tmp_path / "x.jsonl"
    lines = [json.dumps({"text": "a" * (i % 13)}).encode() for i in range(200)]
    p.write_bytes(b"\n".join(lines) + b"\n")
    (sf,), _ = resolve_sources([str(p)])
    chunks = plan_chunks([sf], 100)
    assert len(chunks) > 10 and chunks[0].start == 0 and chunks[-1].end == sf.size
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert [ln for c in chunks for ln in iter_lines(sf, c.start, c.end)] == lines


def test_parquet_source_rows_are_records(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "src.parquet"
    pq.write_table(pa.table({"text": ["The sky is blue.", None, "A cat says meow."] * 4}), p, row_group_size=3)
    cfg = DataConfig(format="pretrain", max_seq_len=16, chunk_bytes=1)  # one chunk per row group
    chunks, merged = _run_local([str(p)], tmp_path / "out", tok, cfg)
    assert len(chunks) == 4
    assert merged["counts"]["records"] == 8 and merged["counts"]["lines"] == 12
    assert merged["skipped"]["missing_field"]["samples"] == [f"{p}:{n}" for n in (2, 5, 8, 11)]
