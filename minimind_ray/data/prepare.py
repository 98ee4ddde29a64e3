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
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from minimind_ray.data import formats
from minimind_ray.data.manifest import (  # noqa: F401  (read_manifest, is_prepared: re-exported)
    MANIFEST, PREPARED_VERSION, DataError, check_manifest, is_prepared, read_manifest, row_settings, verify_shards,
    write_manifest)
from minimind_ray.data.sources import (OverlongLine, SourceFile, TruncatedFile, content_digests, iter_records,
                                       plan_ranges, resolve_sources)
from minimind_ray.fsio import filesystem, is_uri, join

log = logging.getLogger(__name__)

SAMPLE_ID_STRIDE = 1 << 32  # sample_id = chunk index * stride + row in shard
MAX_SAMPLES = 5  # file:line examples kept per reason
_BATCH_RECORDS = 512  # records tokenized per encode_batch call
# a UTF-8 character is at most 4 bytes: a line longer than this many bytes per allowed character
# is certainly too long, so the reader drops it unread (memory stays bounded)
_MAX_BYTES_PER_CHAR = 4


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
            try:
                with fs.open_input_file(path) as f:
                    meta = pq.ParquetFile(f).metadata
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{sf.uri}: not a readable Parquet file ({e})") from None
            start, acc = 0, 0
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                if acc >= chunk_bytes or g == meta.num_row_groups - 1:
                    chunks.append(Chunk(len(chunks), sf, start, g + 1))
                    start, acc = g + 1, 0
        else:
            chunks += [Chunk(len(chunks) + i, sf, a, b) for i, (a, b) in enumerate(plan_ranges(sf, chunk_bytes))]
    return chunks


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
        self.bytes = 0
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
            self.bytes = self.fs.get_file_info(self.path).size  # the manifest records it: see verify_shards

    def abort(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
                self._sink.close()
            finally:
                self.fs.delete_file(self.tmp)


def _record(item, fmt: str, max_chars: int) -> dict:
    """A checked record from what the reader yielded, or BadRecord."""
    if isinstance(item, OverlongLine):
        raise formats.BadRecord("too_long", f"a line of {item.nbytes} bytes, so over {max_chars} characters "
                                            f"> data.max_record_chars={max_chars} (dropped unread)")
    if isinstance(item, bytes):
        rec = formats.parse_line(item, max_chars)
        formats.check_record(fmt, rec)  # the whole line was within max_chars
    else:  # a Parquet row
        rec = item
        formats.check_record(fmt, rec, max_chars)
    return rec


def _read(chunk: Chunk, max_line_bytes: int):
    """The chunk's records (see sources.iter_records); a read failure other than a broken gzip
    (e.g. a corrupt Parquet row group) becomes a DataError naming the file."""
    n = 0
    try:
        for n, item in enumerate(iter_records(chunk.source, chunk.start, chunk.end, max_line_bytes), 1):
            yield item
    except (pa.ArrowException, OSError) as e:
        part = f"{'row groups' if chunk.source.kind == 'parquet' else 'bytes'} [{chunk.start}, {chunk.end})"
        raise DataError(f"{chunk.source.uri}: unreadable after record {n} of {part} ({e})") from None


def process_chunk(chunk: Chunk, tokenizer, data_cfg, out_dir: str) -> dict:
    """Turn one chunk into one shard; return what the driver needs for the manifest.

    Pure except for writing the shard, and independent of Ray (it is what the Ray
    Data job maps over the chunks; tests call it directly). Line numbers in the
    result are relative to the chunk; ``lines`` lets the driver make them absolute.
    Under ``strict`` it stops at the first bad record and writes nothing; on an
    exception it leaves no temporary file behind.
    """
    strict = data_cfg.bad_records == "strict"
    max_chars = data_cfg.max_record_chars
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
    try:
        try:
            for line, item in enumerate(_read(chunk, _MAX_BYTES_PER_CHAR * max_chars), 1):
                summary["lines"] = line
                try:
                    rec = _record(item, data_cfg.format, max_chars)
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
        except TruncatedFile as e:  # the lines before the break were read: keep them, count the file
            note("truncated_file", summary["lines"] + 1,
                 f"{e.detail}; a partial line of {e.lost_bytes} bytes after it dropped")
        if summary["error"] is None:
            flush(batch, lines, True)
    except BaseException:
        writer.abort()
        raise
    if summary["error"] is None:
        writer.close()
    else:
        writer.abort()
    written = summary["error"] is None and writer.rows > 0
    summary.update(file=writer.name if written else None, rows=writer.rows, bytes=writer.bytes,
                   tokens=writer.tokens, dropped_tail_tokens=enc.dropped_tail_tokens, issues=issues)
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
        "shards": [{"file": r["file"], "index": r["chunk"], "rows": r["rows"], "bytes": r["bytes"]}
                   for r in results if r["file"]],
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


def _run_chunk(row: dict, tokenizer, data_cfg, out_dir: str) -> dict:
    c = json.loads(row["chunk"])
    chunk = Chunk(c["index"], SourceFile(**c["source"]), c["start"], c["end"])
    try:
        summary = process_chunk(chunk, tokenizer, data_cfg, out_dir)
    except DataError as e:  # an unreadable file: returned, because Ray's wrapping would lose the one-line message
        summary = {"chunk": chunk.index, "unreadable": str(e)}
    return {"summary": json.dumps(summary)}


def prepare(sources: List[str], out_dir: str, tokenizer, data_cfg, digests: Optional[Dict[str, str]] = None) -> str:
    """Tokenize and format ``sources`` into ``out_dir`` with a Ray Data job; return out_dir.

    Needs Ray initialised (or lets Ray Data start a local one). Bad records are
    counted per reason with up to 5 ``file:line`` samples (policy ``skip``) or fail
    the job naming the first one in file order (``strict``). The manifest is written
    last; ``ensure_prepared`` reuses a directory only if it has one. ``digests``
    (sha256 by source URI, when the caller has them) are recorded in the manifest.
    """
    import ray

    fmt, strict = data_cfg.format, data_cfg.bad_records == "strict"
    if fmt not in formats.FORMATS:
        raise ValueError(f"data.format: unknown format {fmt!r}; one of {formats.FORMATS}")
    if data_cfg.max_record_chars < 1:
        raise ValueError(f"data.max_record_chars: must be >= 1, got {data_cfg.max_record_chars}")
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
        unreadable = [r["unreadable"] for r in results if "unreadable" in r]
        if unreadable:
            raise DataError(unreadable[0])
        merged = merge_summaries(chunks, results, file_issues)
    except DataError:
        fs, root = filesystem(out_dir)
        for r in results:
            if r.get("file"):
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
        "max_record_chars": data_cfg.max_record_chars,
        "sources": [{"uri": f.uri, "size": f.size, "mtime_ns": f.mtime_ns,
                     **({"sha256": digests[f.uri]} if digests and f.uri in digests else {})} for f in files],
        **merged,
        "prepare_seconds": round(elapsed, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_manifest(out_dir, manifest)
    return out_dir


def _cache_key(files: List[SourceFile], missing: List[str], digests: Dict[str, str], tokenizer, data_cfg) -> str:
    """What decides the prepared rows: the sources' URIs and content (sha256, not mtime: an edit
    that keeps the size and restores the mtime is still seen), the tokenizer and every setting."""
    return hashlib.sha256(json.dumps({
        "version": PREPARED_VERSION, "sources": [[f.uri, f.size, digests[f.uri]] for f in files], "missing": missing,
        "tokenizer": tokenizer.hash(), **row_settings(data_cfg), "block_rows": data_cfg.block_rows,
        "chunk_bytes": data_cfg.chunk_bytes, "bad_records": data_cfg.bad_records,
        "max_record_chars": data_cfg.max_record_chars,
    }, sort_keys=True).encode()).hexdigest()


def ensure_prepared(data_cfg, tokenizer) -> str:
    """The prepared directory for ``data.train_path``, preparing it if needed.

    - a prepared directory (has manifest.json): checked (the manifest parses, every shard it
      lists is there with its recorded size, the tokenizer and row settings match the config)
      and used as is; anything wrong is a DataError naming the file, and nothing is changed;
    - raw files (``'demo'`` = the built-in corpus of ``data.format``): prepared into
      ``data.cache_dir/<format>-<key>``, where the key hashes the source files (URI, size,
      sha256 of the content), the tokenizer hash and every setting that changes the rows.
      A complete earlier result with the same key is reused if it passes the same checks;
      one that does not (a shard deleted, a corrupt manifest) is prepared again.
    Returns an absolute path (Ray workers run in another cwd).
    """
    paths = list(data_cfg.train_path)
    if len(paths) == 1 and paths[0] != "demo" and is_prepared(paths[0]):
        path = paths[0] if is_uri(paths[0]) else os.path.abspath(paths[0])
        manifest = read_manifest(path)
        check_manifest(manifest, path, data_cfg, tokenizer)
        verify_shards(path, manifest)
        return path
    cache = data_cfg.cache_dir if is_uri(data_cfg.cache_dir) else os.path.abspath(data_cfg.cache_dir)
    if "demo" in paths:
        from minimind_ray.data.demo import write_demo_corpus

        demo = write_demo_corpus(join(cache, "demo"))
        paths = [demo[data_cfg.format] if p == "demo" else p for p in paths]
    files, missing = resolve_sources(paths)
    digests = content_digests(files)
    out = join(cache, f"{data_cfg.format}-{_cache_key(files, missing, digests, tokenizer, data_cfg)[:16]}")
    if is_prepared(out):
        try:
            manifest = read_manifest(out)
            check_manifest(manifest, out, data_cfg, tokenizer)
            verify_shards(out, manifest)
            return out
        except DataError as e:  # our own cache: make it again rather than train on it
            log.warning("prepared cache is unusable, preparing it again: %s", e)
    return prepare(paths, out, tokenizer, data_cfg, digests=digests)
