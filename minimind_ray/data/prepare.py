"""The prepare job: raw jsonl/parquet -> tokenized, formatted Parquet shards + manifest.

Tokenizing is the only heavy, parallel part of the data path, so it runs once, as a
Ray Data job, before training; training then reads compact uint16 Parquet (see
stream.py for why training does not stream through Ray Data itself).

Layout of a prepared directory::

    part-00000.parquet   one shard per input chunk: columns sample_id (int64) + the
    part-00003.parquet   format's list columns (formats.Encoder); row groups of
    ...                  exactly data.block_rows rows (the last one of a shard shorter)
    manifest.json        written LAST and atomically: its presence means "complete"

Chunks: every jsonl file is cut into newline-aligned byte ranges of about
``data.chunk_bytes`` (a .jsonl.gz is one chunk: gzip cannot seek; a parquet source is
cut by row groups). Each chunk is one Ray Data task that streams its lines, checks,
renders, tokenizes in batches (HF tokenizers, Rust) and writes its shard, so no process
ever holds more than a batch of records. A task knows line numbers only relative to
its chunk; the driver turns them into real file line numbers from the line counts
every task reports, so messages say ``file:line`` as an editor would.

Sample ids: row r of the shard of chunk c has ``sample_id = c * 2**32 + r``. Ids are
global, unique and stable, and every reader can compute them from the manifest alone
(the eval split needs no pass over the data); they are not contiguous because a
chunk's row count is only known after its task has tokenized it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple, Union

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from minimind_ray.data import formats
from minimind_ray.data.sources import SourceFile, iter_records, plan_ranges, resolve_sources
from minimind_ray.fsio import filesystem, join

MANIFEST = "manifest.json"
PREPARED_VERSION = 1  # bump when the layout or a format's rows change: old caches are then not reused
SAMPLE_ID_STRIDE = 1 << 32  # sample_id = chunk index * stride + row in shard
MAX_SAMPLES = 5  # file:line examples kept per reason
_BATCH_RECORDS = 512  # records tokenized per encode_batch call


class DataError(ValueError):
    """Bad data under the strict policy, unusable prepared data, or no data at all."""


@dataclass(frozen=True)
class Chunk:
    """One Ray Data task's share: bytes [start, end) of a jsonl file, or row groups
    [start, end) of a parquet file."""

    index: int
    source: SourceFile
    start: int
    end: int


def plan_chunks(files: List[SourceFile], chunk_bytes: int) -> List[Chunk]:
    """Cut files into chunks of about ``chunk_bytes`` (files with no bytes are left out)."""
    chunks: List[Chunk] = []
    for sf in files:
        if sf.size == 0:
            continue
        if sf.kind == "parquet":
            fs, path = filesystem(sf.uri)
            with fs.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
            start, acc = 0, 0
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                if acc >= chunk_bytes or g == meta.num_row_groups - 1:
                    chunks.append(Chunk(len(chunks), sf, start, g + 1))
                    start, acc = g + 1, 0
        else:
            chunks += [Chunk(len(chunks) + i, sf, a, b) for i, (a, b) in enumerate(plan_ranges(sf, chunk_bytes))]
    return chunks


def _chunk_items(chunk: Chunk) -> Iterator[Tuple[int, Union[bytes, dict]]]:
    """(line or row number within the chunk, raw line or parquet row)."""
    return enumerate(iter_records(chunk.source, chunk.start, chunk.end), 1)


class _ShardWriter:
    """Writes one shard in row groups of exactly ``block_rows`` rows, to a temporary name
    renamed on close, so that a retried task never leaves a half-written shard."""

    def __init__(self, out_dir: str, chunk_index: int, encoder: formats.Encoder, block_rows: int):
        self.fs, root = filesystem(out_dir)
        self.name = f"part-{chunk_index:05d}.parquet"
        self.path = f"{root}/{self.name}"
        self.tmp = f"{self.path}.tmp-{os.getpid()}-{time.time_ns()}"
        self.base_id = chunk_index * SAMPLE_ID_STRIDE
        self.encoder, self.block_rows = encoder, block_rows
        self.pending: Dict[str, List[np.ndarray]] = {c: [] for c in encoder.columns}
        self.rows = 0
        self.tokens = 0
        self._writer = None

    def add(self, rows: Dict[str, List[np.ndarray]], final: bool = False) -> None:
        for c, values in rows.items():
            self.pending[c] += values
            if c.endswith("ids"):
                self.tokens += sum(len(v) for v in values)
        while len(self.pending[self.encoder.columns[0]]) >= self.block_rows or (
                final and self.pending[self.encoder.columns[0]]):
            self._write_group()

    def _write_group(self) -> None:
        import pyarrow as pa

        n = min(self.block_rows, len(self.pending[self.encoder.columns[0]]))
        schema = self.encoder.schema()
        arrays = [pa.array(np.arange(self.base_id + self.rows, self.base_id + self.rows + n, dtype=np.int64))]
        for c in self.encoder.columns:
            arrays.append(formats.to_arrow(self.pending[c][:n], self.encoder.dtype_of(c)))
            self.pending[c] = self.pending[c][n:]
        if self._writer is None:
            self._sink = self.fs.open_output_stream(self.tmp)
            self._writer = pq.ParquetWriter(self._sink, schema, compression="zstd")
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=n)
        self.rows += n

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self.fs.move(self.tmp, self.path)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self.fs.delete_file(self.tmp)


def process_chunk(chunk: Chunk, tokenizer, data_cfg, out_dir: str) -> dict:
    """Turn one chunk into one shard; return what the driver needs for the manifest.

    Pure except for writing the shard, and independent of Ray (it is what the Ray
    Data job maps over the chunks; tests call it directly). Line numbers in the
    result are relative to the chunk; ``lines`` lets the driver make them absolute.
    Under ``strict`` it stops at the first bad record and writes nothing.
    """
    strict = data_cfg.bad_records == "strict"
    enc = formats.Encoder(data_cfg.format, tokenizer, data_cfg.max_seq_len, data_cfg.pack)
    writer = _ShardWriter(out_dir, chunk.index, enc, data_cfg.block_rows)
    issues: Dict[str, dict] = {}
    summary = {"chunk": chunk.index, "lines": 0, "records": 0, "error": None}

    def note(reason: str, line: int, detail: str) -> None:
        entry = issues.setdefault(reason, {"count": 0, "lines": []})
        entry["count"] += 1
        if len(entry["lines"]) < MAX_SAMPLES:
            entry["lines"].append(line)
        if strict and reason != "truncated" and summary["error"] is None:
            summary["error"] = {"reason": reason, "line": line, "detail": detail}

    def flush(batch: List[dict], lines: List[int], final: bool) -> None:
        dropped = 0
        for i, reason, detail in enc.add(batch):
            note(reason, lines[i], detail)
            dropped += reason != "truncated"
        summary["records"] += len(batch) - dropped
        rows = enc.take(final)
        if summary["error"] is None:
            writer.add(rows or {c: [] for c in enc.columns}, final)

    batch: List[dict] = []
    lines: List[int] = []
    for line, item in _chunk_items(chunk):
        summary["lines"] = line
        try:
            rec = formats.parse_line(item) if isinstance(item, bytes) else item
            formats.check_record(data_cfg.format, rec)
        except formats.BadRecord as e:
            note(e.reason, line, e.detail)
        else:
            batch.append(rec)
            lines.append(line)
            if len(batch) >= _BATCH_RECORDS:
                flush(batch, lines, False)
                batch, lines = [], []
        if summary["error"] is not None:
            break
    if summary["error"] is None:
        flush(batch, lines, True)
    if summary["error"] is None:
        writer.close()
    else:
        writer.abort()
    summary.update(file=writer.name if writer.rows else None, rows=writer.rows, tokens=writer.tokens,
                   dropped_tail_tokens=enc.dropped_tail_tokens, issues=issues)
    return summary


def merge_summaries(chunks: List[Chunk], results: List[dict], file_issues: List[Tuple[str, str]]) -> dict:
    """Combine the per-chunk summaries of :func:`process_chunk` (in chunk order) into the
    manifest's counts, shards, skipped and truncated entries.

    Chunk-relative line numbers become file line numbers here: a chunk's first line is
    1 + the lines of the chunks before it in the same file. Under ``strict``, raises
    DataError for the first bad record in file order.
    """
    first_line, next_line = {}, {}
    for c, r in zip(chunks, results):
        first_line[c.index] = next_line.get(c.source.uri, 1)
        next_line[c.source.uri] = first_line[c.index] + r["lines"]

    def where(c: Chunk, line: int) -> str:
        return f"{c.source.uri}:{first_line[c.index] + line - 1}"

    for c, r in zip(chunks, results):
        if r["error"]:
            e = r["error"]
            raise DataError(f"{where(c, e['line'])}: {e['reason']}: {e['detail']} (data.bad_records=strict)")
    issues: Dict[str, dict] = {}

    def add(reason: str, count: int, places: List[str]) -> None:
        entry = issues.setdefault(reason, {"count": 0, "samples": []})
        entry["count"] += count
        entry["samples"] += places[: MAX_SAMPLES - len(entry["samples"])]

    for reason, spec in file_issues:
        add(reason, 1, [spec])
    for c, r in zip(chunks, results):
        for reason, e in r["issues"].items():
            add(reason, e["count"], [where(c, ln) for ln in e["lines"]])
    return {
        "counts": {
            "lines": sum(r["lines"] for r in results),
            "records": sum(r["records"] for r in results),
            "tokens": sum(r["tokens"] for r in results),
            "sequences": sum(r["rows"] for r in results),
            "dropped_tail_tokens": sum(r["dropped_tail_tokens"] for r in results),
        },
        "shards": [{"file": r["file"], "index": r["chunk"], "rows": r["rows"]} for r in results if r["file"]],
        "skipped": dict(sorted((k, v) for k, v in issues.items() if k != "truncated")),
        "truncated": issues.get("truncated", {"count": 0, "samples": []}),
    }


def _clear(out_dir: str) -> None:
    """Remove what an earlier prepare left in ``out_dir``: the manifest first, so that a
    crash from here on leaves a directory that is visibly incomplete."""
    fs, root = filesystem(out_dir)
    fs.create_dir(root, recursive=True)
    for info in sorted(fs.get_file_info(pafs.FileSelector(root)), key=lambda i: i.base_name != MANIFEST):
        if info.type == pafs.FileType.File and (info.base_name == MANIFEST or info.base_name.startswith("part-")):
            fs.delete_file(info.path)


def _write_manifest(out_dir: str, manifest: dict) -> None:
    fs, root = filesystem(out_dir)
    tmp = f"{root}/{MANIFEST}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(manifest, indent=1, ensure_ascii=False).encode())
    fs.move(tmp, f"{root}/{MANIFEST}")  # os.replace on a local filesystem: atomic


def read_manifest(path: str) -> dict:
    """The manifest of a prepared directory (local path or URI); FileNotFoundError if absent."""
    fs, root = filesystem(path)
    with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
        return json.loads(f.read())


def is_prepared(path: str) -> bool:
    fs, root = filesystem(path)
    return fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File


def _run_chunk(row: dict, tokenizer, data_cfg, out_dir: str) -> dict:
    c = json.loads(row["chunk"])
    chunk = Chunk(c["index"], SourceFile(**c["source"]), c["start"], c["end"])
    return {"summary": json.dumps(process_chunk(chunk, tokenizer, data_cfg, out_dir))}


def prepare(sources: List[str], out_dir: str, tokenizer, data_cfg) -> str:
    """Tokenize and format ``sources`` into ``out_dir`` with a Ray Data job; return out_dir.

    Needs Ray initialised (or lets Ray Data start a local one). Bad records are
    counted per reason with up to 5 ``file:line`` samples (policy ``skip``) or fail
    the job naming the first one in file order (``strict``). The manifest is written
    last; ``ensure_prepared`` reuses a directory only if it has one.
    """
    import ray

    fmt, strict = data_cfg.format, data_cfg.bad_records == "strict"
    if fmt not in formats.FORMATS:
        raise ValueError(f"data.format: unknown format {fmt!r}; one of {formats.FORMATS}")
    files, missing = resolve_sources(sources)
    file_issues = [("missing_file", m) for m in missing] + [("empty_file", f.uri) for f in files if f.size == 0]
    if strict and file_issues:
        reason, where = file_issues[0]
        raise DataError(f"{where}: {reason}: {formats.REASONS[reason]} (data.bad_records=strict)")
    chunks = plan_chunks(files, data_cfg.chunk_bytes)
    if not chunks:
        raise DataError(f"data.train_path: no data in {list(sources)}")
    _clear(out_dir)

    items = [{"chunk": json.dumps({"index": c.index, "source": dataclasses.asdict(c.source),
                                   "start": c.start, "end": c.end})} for c in chunks]
    t0 = time.time()
    rows = ray.data.from_items(items, override_num_blocks=len(items)).map(
        _run_chunk, fn_kwargs={"tokenizer": tokenizer, "data_cfg": data_cfg, "out_dir": out_dir}).take_all()
    results = sorted((json.loads(r["summary"]) for r in rows), key=lambda s: s["chunk"])
    elapsed = time.time() - t0

    try:
        merged = merge_summaries(chunks, results, file_issues)
    except DataError:
        fs, root = filesystem(out_dir)
        for r in results:
            if r["file"]:
                fs.delete_file(f"{root}/{r['file']}")
        raise
    if not merged["shards"]:
        raise DataError(f"data.train_path: no usable records in {list(sources)}; skipped: "
                        f"{ {r: e['count'] for r, e in merged['skipped'].items()} }")
    manifest = {
        "version": PREPARED_VERSION,
        **row_settings(data_cfg),
        "tokenizer_hash": tokenizer.hash(),
        "tokenizer_path": tokenizer.path,
        "vocab_size": tokenizer.vocab_size,
        "id_dtype": np.dtype(formats.id_dtype(tokenizer.vocab_size)).name,
        "block_rows": data_cfg.block_rows,
        "chunk_bytes": data_cfg.chunk_bytes,
        "bad_records": data_cfg.bad_records,
        "sources": [{"uri": f.uri, "size": f.size, "mtime_ns": f.mtime_ns} for f in files],
        **merged,
        "prepare_seconds": round(elapsed, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_manifest(out_dir, manifest)
    return out_dir


def row_settings(data_cfg) -> dict:
    """The settings that shape the prepared rows, as the manifest records them and a run must match.
    Packing applies to pretrain only, so it is recorded as it takes effect."""
    return {"format": data_cfg.format, "max_seq_len": data_cfg.max_seq_len,
            "pack": bool(data_cfg.pack and data_cfg.format == "pretrain")}


def check_manifest(manifest: dict, path: str, data_cfg, tokenizer) -> None:
    """Refuse prepared data that does not match the run: the ids would mean other tokens,
    or the rows would have another shape than the config asks for."""
    if manifest.get("version") != PREPARED_VERSION:
        raise DataError(f"prepared data {path} has layout version {manifest.get('version')}, this code reads "
                        f"{PREPARED_VERSION}: prepare it again from the raw files")
    if manifest["tokenizer_hash"] != tokenizer.hash():
        raise DataError(
            f"prepared data {path} was tokenized with tokenizer hash {manifest['tokenizer_hash']} "
            f"({manifest.get('tokenizer_path')}), but data.tokenizer {tokenizer.path!r} has hash {tokenizer.hash()}: "
            f"prepare the raw data again with this tokenizer, or set data.tokenizer to the one it was made with")
    for field, want in row_settings(data_cfg).items():
        if manifest[field] != want:
            raise DataError(f"prepared data {path} has {field}={manifest[field]!r} but data.{field}={want!r}")


def ensure_prepared(data_cfg, tokenizer) -> str:
    """The prepared directory for ``data.train_path``, preparing it if needed.

    - a prepared directory (has manifest.json): checked against the tokenizer and the
      config (:func:`check_manifest`), used as is;
    - raw files (``'demo'`` = the built-in corpus of ``data.format``): prepared into
      ``data.cache_dir/<format>-<key>``, where the key hashes the source files (URI,
      size, mtime), the tokenizer hash and every setting that changes the rows; a
      complete earlier result with the same key is reused.
    Returns an absolute path (Ray workers run in another cwd).
    """
    paths = list(data_cfg.train_path)
    if len(paths) == 1 and paths[0] != "demo" and is_prepared(paths[0]):
        path = paths[0] if "://" in paths[0] else os.path.abspath(paths[0])
        check_manifest(read_manifest(path), path, data_cfg, tokenizer)
        return path
    cache = data_cfg.cache_dir if "://" in data_cfg.cache_dir else os.path.abspath(data_cfg.cache_dir)
    if "demo" in paths:
        from minimind_ray.data.demo import write_demo_corpus

        demo = write_demo_corpus(join(cache, "demo"))
        paths = [demo[data_cfg.format] if p == "demo" else p for p in paths]
    files, missing = resolve_sources(paths)
    key = hashlib.sha256(json.dumps({
        "version": PREPARED_VERSION, "sources": [dataclasses.asdict(f) for f in files], "missing": missing,
        "tokenizer": tokenizer.hash(), **row_settings(data_cfg), "block_rows": data_cfg.block_rows,
        "chunk_bytes": data_cfg.chunk_bytes, "bad_records": data_cfg.bad_records,
    }, sort_keys=True).encode()).hexdigest()
    out = join(cache, f"{data_cfg.format}-{key[:16]}")
    if is_prepared(out):
        check_manifest(read_manifest(out), out, data_cfg, tokenizer)
        return out
    return prepare(paths, out, tokenizer, data_cfg)
