"""One chunk of a source -> one shard: read, check, encode, write. What a prepare task runs.

A chunk is bytes [start, end) of a jsonl file (newline-aligned), a whole .jsonl.gz, or row
groups [start, end) of a Parquet file (see ``prepare.plan_chunks``). :func:`process_chunk`
streams its records, applies the bad-record policy (formats.REASONS), tokenizes in batches
and writes ``part-<chunk index>.parquet``, so no process holds more than a batch of records
or one line of at most ``4 x data.max_record_chars`` bytes. It needs no Ray: the prepare job
maps it over the chunks, and tests call it directly.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from minimind_ray.data import formats
from minimind_ray.data.manifest import DataError
from minimind_ray.data.sources import OverlongLine, SourceFile, TruncatedFile, iter_records
from minimind_ray.fsio import filesystem

SAMPLE_ID_STRIDE = 1 << 32  # sample_id = chunk index * stride + row in shard
MAX_SAMPLES = 5  # file:line examples kept per reason
_BATCH_RECORDS = 512  # records tokenized per encode_batch call
# a UTF-8 character is at most 4 bytes: a line longer than this many bytes per allowed character
# is certainly too long, so the reader drops it unread (memory stays bounded)
_MAX_BYTES_PER_CHAR = 4


@dataclass(frozen=True)
class Chunk:
    """The input of one shard: bytes [start, end) of a jsonl file, or row groups [start, end)
    of a parquet file (a .jsonl.gz: the whole file). ``nbytes`` estimates its work for
    grouping chunks into tasks: jsonl bytes, Parquet uncompressed bytes, gzip compressed bytes."""

    index: int
    source: SourceFile
    start: int
    end: int
    nbytes: int = 0


class _ShardWriter:
    """Writes one shard in row groups of exactly ``block_rows`` rows, to a temporary name
    renamed on close, so that a retried task never leaves a half-written shard."""

    def __init__(self, out_dir: str, chunk_index: int, encoder: formats.RowEncoder, block_rows: int):
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
