"""Bad input that used to crash a prepare task (issue 11, data items), without Ray: each case
is a counted skip with its reason and ``file:line``, or a one-line error naming the file."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minimind_ray.config import DataConfig
from minimind_ray.data import formats, sources
from minimind_ray.data.prepare import DataError, plan_chunks, read_manifest
from minimind_ray.data.sources import iter_lines, resolve_sources
from tests.unit.test_formats import _run_local, tok  # noqa: F401  (tok is a fixture)

OK = [json.dumps({"text": f"The sky is blue, line {i}."}).encode() for i in range(6)]


def _jsonl(path, lines, newline_at_end=True):
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline_at_end else b""))
    return str(path)


def _counts(merged):
    return {reason: entry["count"] for reason, entry in merged["skipped"].items()}


def test_lone_surrogate_is_counted_as_bad_text(tok, tmp_path):
    # valid JSON whose string is not valid Unicode: the tokenizer would raise TypeError for the whole batch
    pretrain = _jsonl(tmp_path / "p.jsonl", [OK[0], b'{"text": "\\ud800"}', OK[1], b'{"text": "a\\udfffb"}', OK[2]])
    cfg = DataConfig(format="pretrain", max_seq_len=16)
    _, merged = _run_local([pretrain], tmp_path / "out", tok, cfg)
    assert _counts(merged) == {"bad_text": 2}
    assert merged["skipped"]["bad_text"]["samples"] == [f"{pretrain}:2", f"{pretrain}:4"]
    assert merged["counts"]["records"] == 3 and merged["counts"]["lines"] == 5

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\ud800"}]
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    sft = _jsonl(tmp_path / "s.jsonl", [json.dumps({"conversations": c}).encode() for c in (good, conv, good)])
    _, merged = _run_local([sft], tmp_path / "out-sft", tok, DataConfig(format="sft", max_seq_len=64))
    assert merged["skipped"]["bad_text"]["samples"] == [f"{sft}:2"] and merged["counts"]["records"] == 2


def test_lone_surrogate_is_named_in_strict_mode(tok, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [OK[0], OK[1], b'{"text": "\\ud800"}'])
    cfg = DataConfig(format="pretrain", max_seq_len=16, bad_records="strict")
    with pytest.raises(DataError, match=rf"^{path}:3: bad_text: .*surrogate"):
        _run_local([path], tmp_path / "out", tok, cfg)


def test_deeply_nested_json_is_bad_json(tok, tmp_path):
    deep = b'{"text": "a", "meta": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with pytest.raises(formats.BadRecord) as e:
        formats.parse_line(deep)
    assert e.value.reason == "bad_json" and "deep" in e.value.detail
    path = _jsonl(tmp_path / "p.jsonl", [OK[0], deep, OK[1]])
    _, merged = _run_local([path], tmp_path / "out", tok, DataConfig(format="pretrain", max_seq_len=16))
    assert merged["skipped"]["bad_json"]["samples"] == [f"{path}:2"] and merged["counts"]["records"] == 2


def _truncated_gz(path, n_lines):
    lines = [json.dumps({"text": f"Record number {i} says hello."}).encode() for i in range(n_lines)]
    whole = gzip.compress(b"\n".join(lines) + b"\n")
    path.write_bytes(whole[: len(whole) // 2])
    return str(path)


def test_truncated_gzip_keeps_the_records_before_the_cut(tok, tmp_path):
    cut = _truncated_gz(tmp_path / "cut.jsonl.gz", 60_000)
    after = _jsonl(tmp_path / "z-after.jsonl", OK)  # sorted after: prepare goes on with it
    cfg = DataConfig(format="pretrain", max_seq_len=16)
    _, merged = _run_local([cut, after], tmp_path / "out", tok, cfg)
    assert _counts(merged) == {"truncated_file": 1}
    (sample,) = merged["skipped"]["truncated_file"]["samples"]
    assert sample.startswith(f"{cut}:")
    kept = merged["counts"]["records"] - len(OK)
    assert 1000 < kept < 60_000  # the complete lines before the cut, not the partial one after it
    assert merged["counts"]["lines"] == merged["counts"]["records"] and sample == f"{cut}:{kept + 1}"


def test_plain_text_named_gz_is_a_truncated_file(tok, tmp_path):
    fake = _jsonl(tmp_path / "fake.jsonl.gz", OK)
    good = _jsonl(tmp_path / "good.jsonl", OK)
    _, merged = _run_local([fake, good], tmp_path / "out", tok, DataConfig(format="pretrain", max_seq_len=16))
    assert merged["skipped"]["truncated_file"]["samples"] == [f"{fake}:1"]
    assert merged["counts"]["records"] == len(OK)


def test_truncated_gzip_in_strict_mode_names_the_file(tok, tmp_path):
    cut = _truncated_gz(tmp_path / "cut.jsonl.gz", 60_000)
    cfg = DataConfig(format="pretrain", max_seq_len=16, bad_records="strict")
    with pytest.raises(DataError, match=rf"^{cut}:\d+: truncated_file: "):
        _run_local([cut], tmp_path / "out", tok, cfg)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 50])
def test_utf8_bom_at_the_start_of_a_file_is_accepted(tok, tmp_path, chunk_bytes):
    plain = _jsonl(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + OK[0], *OK[1:]])
    zipped = tmp_path / "bom.jsonl.gz"
    zipped.write_bytes(gzip.compress(b"\xef\xbb\xbf" + b"\n".join(OK)))
    cfg = DataConfig(format="pretrain", max_seq_len=16, chunk_bytes=chunk_bytes)
    _, merged = _run_local([plain, str(zipped)], tmp_path / "out", tok, cfg)
    assert merged["skipped"] == {} and merged["counts"]["records"] == 2 * len(OK)


def test_an_overlong_line_is_dropped_while_streaming(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_READ_BLOCK", 64)  # the long line spans many reads
    huge = b'{"text": "' + b"x" * 5000 + b'"}'
    path = _jsonl(tmp_path / "p.jsonl", [OK[0], huge, OK[1], huge], newline_at_end=False)
    (sf,), _ = resolve_sources([path])
    got = list(iter_lines(sf, max_line_bytes=400))
    assert got[0] == OK[0] and got[2] == OK[1]
    assert [type(x) for x in got] == [bytes, sources.OverlongLine, bytes, sources.OverlongLine]
    assert got[1].nbytes == got[3].nbytes == len(huge)
    assert list(iter_lines(sf)) == [OK[0], huge, OK[1], huge]  # no limit: unchanged


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 100])
def test_records_over_max_record_chars_are_too_long(tok, tmp_path, chunk_bytes):
    limit = 100
    lines = [
        OK[0],
        json.dumps({"text": "y" * 1000}).encode(),  # 1000 bytes > 4 x limit: dropped while streaming
        OK[1],
        json.dumps({"text": "z" * 150}).encode(),  # 161 characters: found after decoding
        json.dumps({"text": "中" * 60}, ensure_ascii=False).encode(),  # 72 characters in 192 bytes: kept
        OK[2],
    ]
    path = _jsonl(tmp_path / "p.jsonl", lines)
    cfg = DataConfig(format="pretrain", max_seq_len=16, max_record_chars=limit, chunk_bytes=chunk_bytes)
    _, merged = _run_local([path], tmp_path / "out", tok, cfg)
    assert _counts(merged) == {"too_long": 2}
    assert merged["skipped"]["too_long"]["samples"] == [f"{path}:2", f"{path}:4"]
    assert merged["counts"]["records"] == 4 and merged["counts"]["lines"] == 6

    strict = DataConfig(format="pretrain", max_seq_len=16, max_record_chars=limit, bad_records="strict")
    with pytest.raises(DataError, match=rf"^{path}:2: too_long: .*data.max_record_chars=100"):
        _run_local([path], tmp_path / "strict", tok, strict)


def test_parquet_rows_over_max_record_chars_are_too_long(tok, tmp_path):
    p = tmp_path / "src.parquet"
    pq.write_table(pa.table({"text": ["short", "w" * 500, "short too"]}), p)
    cfg = DataConfig(format="pretrain", max_seq_len=16, max_record_chars=100)
    _, merged = _run_local([str(p)], tmp_path / "out", tok, cfg)
    assert merged["skipped"]["too_long"]["samples"] == [f"{p}:2"] and merged["counts"]["records"] == 2


def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path):
    p = tmp_path / "not.parquet"
    p.write_bytes(b'{"text": "I am jsonl"}\n')
    files, _ = resolve_sources([str(p)])
    with pytest.raises(DataError, match=rf"^{p}: not a readable Parquet file"):
        plan_chunks(files, 1 << 20)


@pytest.mark.parametrize("content, what", [
    ('{"version": 1, "format": ', "not valid JSON"),
    ("[]", "not a JSON object"),
    ('{"version": 1, "format": "pretrain"}', "lacks"),
])
def test_a_corrupt_manifest_is_named(tmp_path, content, what):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(DataError, match=rf"^{tmp_path}/manifest.json: .*{what}"):
        read_manifest(str(tmp_path))
    assert (tmp_path / "manifest.json").read_text() == content  # refused, not removed
