"""Prepare on a real (shared) Ray against stale caches and bad input (issue 11, data items):
the cache is keyed by content and checked before use; bad files are counted or named."""
from __future__ import annotations

import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from minimind_ray.config import DataConfig
from minimind_ray.data.prepare import DataError, ensure_prepared, prepare, read_manifest, verify_shards
from tests.unit.test_formats import tok  # noqa: F401  (a module fixture: a tokenizer trained in a second)

pytestmark = pytest.mark.integration


def _corpus(path, n=300, colour="blue"):
    path.write_text("".join(json.dumps({"text": f"The sky is {colour}, says line {i}."}) + "\n" for i in range(n)))
    return str(path)


def _cfg(tmp_path, src, **kw):
    return DataConfig(format="pretrain", train_path=[src], cache_dir=str(tmp_path / "cache"), max_seq_len=16,
                      block_rows=8, chunk_bytes=4 << 10, **kw)


def _shards(path):
    return sorted(f for f in os.listdir(path) if f.startswith("part-"))


def _first_text(path, tok):
    m = read_manifest(path)
    return tok.decode(pq.read_table(os.path.join(path, m["shards"][0]["file"])).column("ids")[0].as_py())


def test_a_same_size_edit_with_the_mtime_restored_is_prepared_again(ray_session, tok, tmp_path):
    src = _corpus(tmp_path / "src.jsonl")
    cfg = _cfg(tmp_path, src)
    first = ensure_prepared(cfg, tok)
    assert "blue" in _first_text(first, tok)
    before = os.stat(src)
    _corpus(tmp_path / "src.jsonl", colour="gray")  # same length: "blue" -> "gray"
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(src)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = ensure_prepared(cfg, tok)
    assert second != first and "gray" in _first_text(second, tok)
    digests = [s["sha256"] for p in (first, second) for s in read_manifest(p)["sources"]]
    assert len(set(digests)) == 2
    assert ensure_prepared(cfg, tok) == second  # unchanged content: reused


def test_a_cache_dir_with_a_deleted_or_changed_shard_is_prepared_again(ray_session, tok, tmp_path):
    cfg = _cfg(tmp_path, _corpus(tmp_path / "src.jsonl"))
    path = ensure_prepared(cfg, tok)
    shards = _shards(path)
    assert len(shards) >= 3
    os.remove(os.path.join(path, shards[1]))
    assert ensure_prepared(cfg, tok) == path
    assert _shards(path) == shards
    verify_shards(path, read_manifest(path))

    victim = os.path.join(path, shards[2])
    with open(victim, "r+b") as f:  # cut short, as an interrupted copy would leave it
        f.truncate(os.path.getsize(victim) // 2)
    assert ensure_prepared(cfg, tok) == path
    verify_shards(path, read_manifest(path))

    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"version": 1, "shards": [')
    assert ensure_prepared(cfg, tok) == path
    assert read_manifest(path)["counts"]["records"] == 300


def test_a_prepared_dir_given_directly_is_refused_when_damaged_and_left_alone(ray_session, tok, tmp_path):
    cached = ensure_prepared(_cfg(tmp_path, _corpus(tmp_path / "src.jsonl")), tok)
    user = str(tmp_path / "user-prepared")
    shutil.copytree(cached, user)
    direct = DataConfig(format="pretrain", train_path=[user], max_seq_len=16)
    assert ensure_prepared(direct, tok) == user
    shards = _shards(user)

    os.remove(os.path.join(user, shards[0]))
    with pytest.raises(DataError, match=rf"^{user}/{shards[0]}: shard listed in manifest.json is missing"):
        ensure_prepared(direct, tok)
    with open(os.path.join(user, shards[1]), "ab") as f:
        f.write(b"\0")
    shutil.copy(os.path.join(cached, shards[0]), user)
    with pytest.raises(DataError, match=rf"^{user}/{shards[1]}: \d+ bytes, but manifest.json recorded \d+"):
        ensure_prepared(direct, tok)
    with open(os.path.join(user, "manifest.json"), "w") as f:
        f.write("[]")
    with pytest.raises(DataError, match=rf"^{user}/manifest.json: not a JSON object"):
        ensure_prepared(direct, tok)
    assert _shards(user) == shards and open(os.path.join(user, "manifest.json")).read() == "[]"  # nothing removed


def test_bad_files_are_counted_or_named_by_the_ray_job(ray_session, tok, tmp_path):
    ok = [json.dumps({"text": f"A cat says meow {i}."}).encode() for i in range(4)]
    d = tmp_path / "src"
    d.mkdir()
    (d / "a-bom.jsonl").write_bytes(b"\xef\xbb\xbf" + b"\n".join(ok))
    (d / "b-surrogate.jsonl").write_bytes(b"\n".join([ok[0], b'{"text": "\\udc00"}', ok[1]]))
    (d / "c-deep.jsonl").write_bytes(b"\n".join([ok[0], b"[" * 50_000 + b"]" * 50_000]))
    (d / "d-long.jsonl").write_bytes(b"\n".join([ok[0], json.dumps({"text": "w" * 200_000}).encode(), ok[1]]))
    whole = gzip.compress(b"\n".join(ok * 2000))
    (d / "e-cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (d / "f-plain.jsonl.gz").write_bytes(b"\n".join(ok))
    cfg = DataConfig(format="pretrain", max_seq_len=16, max_record_chars=150_000)  # the deep line (100,000 characters) is within
    m = read_manifest(prepare([str(d)], str(tmp_path / "out"), tok, cfg))
    skipped = {reason: e["samples"] for reason, e in m["skipped"].items()}
    cut, plain = skipped.pop("truncated_file")
    assert cut.startswith(f"{d}/e-cut.jsonl.gz:") and plain == f"{d}/f-plain.jsonl.gz:1"
    kept_before_the_cut = int(cut.rsplit(":", 1)[1]) - 1
    assert m["counts"]["records"] == 4 + 2 + 1 + 2 + kept_before_the_cut and kept_before_the_cut > 1000
    assert skipped == {"bad_text": [f"{d}/b-surrogate.jsonl:2"], "bad_json": [f"{d}/c-deep.jsonl:2"],
                       "too_long": [f"{d}/d-long.jsonl:2"]}
    assert m["max_record_chars"] == 150_000

    strict = DataConfig(format="pretrain", max_seq_len=16, bad_records="strict")
    with pytest.raises(DataError, match=rf"^{d}/e-cut.jsonl.gz:\d+: truncated_file: "):
        prepare([str(d / "e-cut.jsonl.gz")], str(tmp_path / "strict"), tok, strict)
    assert os.listdir(tmp_path / "strict") == []


def test_unreadable_parquet_is_named(ray_session, tok, tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b'{"text": "not parquet"}\n')
    cfg = DataConfig(format="pretrain", max_seq_len=16)
    with pytest.raises(DataError, match=rf"^{fake}: not a readable Parquet file"):
        prepare([str(fake)], str(tmp_path / "out1"), tok, cfg)

    broken = tmp_path / "broken.parquet"  # a valid footer over a row group whose page header is garbage
    pq.write_table(pa.table({"text": [f"The sky is blue {i}." for i in range(2000)]}), broken, row_group_size=1000)
    page = pq.ParquetFile(broken).metadata.row_group(1).column(0)
    data = bytearray(broken.read_bytes())
    start = page.dictionary_page_offset or page.data_page_offset
    data[start:start + 32] = b"\xff" * 32
    broken.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^{broken}: unreadable"):
        prepare([str(broken)], str(tmp_path / "out2"), tok, cfg)
    assert not [f for f in os.listdir(tmp_path / "out2") if "tmp" in f]
