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
cut by row groups). Each chunk becomes one shard (shard.process_chunk: stream its lines,
check, render, tokenize in batches with HF tokenizers, write), so no process ever holds
more than a batch of records. A chunk knows line numbers only relative to itself; the
driver turns them into real file line numbers from the line counts every chunk reports,
so messages say ``file:line`` as an editor would.

Tasks: small chunks (small files) are packed into one Ray Data task, up to
``data.chunk_bytes`` and to about two tasks per CPU of the cluster (:func:`plan_tasks`),
so a directory of many small files does not pay a task's start for each; the tokenizer is
rebuilt once per worker process, not once per task. Packing decides only which process
writes a shard, never what it holds: the prepared output is the same for any packing.

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
import math
import os
import pickle
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from minimind_ray.console import QuietFilter, quiet_handlers, verbose
from minimind_ray.data import formats
from minimind_ray.data.demo import resolve_demo_path
from minimind_ray.data.sources import SourceFile, content_digests, plan_ranges, resolve_sources
from minimind_ray.fsio import filesystem, is_uri, join
from minimind_ray.memory_errors import MONITOR_MARK, read_oom
from minimind_ray.data.manifest import (  # noqa: F401  (read_manifest, is_prepared, verify_shards: re-exported)
    MANIFEST, PREPARED_VERSION, DataError, check_manifest, is_prepared, read_manifest, row_settings, verify_shards,
    write_manifest)
from minimind_ray.data.shard import (  # noqa: F401  (SAMPLE_ID_STRIDE, process_chunk: re-exported)
    MAX_SAMPLES, SAMPLE_ID_STRIDE, Chunk, process_chunk)

log = logging.getLogger(__name__)
_TASKS_PER_CPU = 2  # packing small chunks stops at this many tasks per CPU: enough to even out unequal tasks


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
                    chunks.append(Chunk(len(chunks), sf, start, g + 1, acc))
                    start, acc = g + 1, 0
        else:
            chunks += [Chunk(len(chunks) + i, sf, a, b, b - a) for i, (a, b) in enumerate(plan_ranges(sf, chunk_bytes))]
    return chunks


def plan_tasks(chunks: List[Chunk], chunk_bytes: int, cpus: int) -> List[List[Chunk]]:
    """Chunks packed into Ray tasks: consecutive chunks share a task while their bytes stay
    within ``chunk_bytes`` and within 1/(2 x cpus) of all the bytes (so that every CPU still
    gets about two tasks to even out unequal ones). Largest task first: the last task to
    start is a small one. A chunk of ``chunk_bytes`` or more is a task of its own."""
    target = min(chunk_bytes, math.ceil(sum(c.nbytes for c in chunks) / (_TASKS_PER_CPU * max(1, cpus))))
    tasks: List[List[Chunk]] = []
    size = 0
    for c in chunks:
        if tasks and size + c.nbytes <= target:
            tasks[-1].append(c)
            size += c.nbytes
        else:
            tasks.append([c])
            size = c.nbytes
    return sorted(tasks, key=lambda t: -sum(c.nbytes for c in t))


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


_WORKER_TOKENIZERS: Dict[str, object] = {}  # in each Ray worker process: tokenizer hash -> tokenizer


class _TokenizerOnce:
    """Carries a tokenizer to the prepare tasks as pickled bytes and builds it once per worker
    process (tasks reuse their worker processes), instead of once per task."""

    def __init__(self, tokenizer):
        self.key, self.blob = tokenizer.hash(), pickle.dumps(tokenizer)

    def get(self):
        tok = _WORKER_TOKENIZERS.get(self.key)
        if tok is None:
            tok = _WORKER_TOKENIZERS[self.key] = pickle.loads(self.blob)
        return tok


def _run_task(row: dict, tokenizer: _TokenizerOnce, data_cfg, out_dir: str) -> dict:
    """One Ray Data task: the chunks of one row of the plan, each into its shard."""
    summaries = []
    for c in json.loads(row["chunks"]):
        chunk = Chunk(c["index"], SourceFile(**c["source"]), c["start"], c["end"], c["nbytes"])
        try:
            summaries.append(process_chunk(chunk, tokenizer.get(), data_cfg, out_dir))
        except DataError as e:  # an unreadable file: returned, because Ray's wrapping would lose the one-line message
            summaries.append({"chunk": chunk.index, "unreadable": str(e)})
    return {"summaries": json.dumps(summaries)}


def _run_job(chunks: List[Chunk], tokenizer, data_cfg, out_dir: str) -> List[dict]:
    """The Ray Data job: every chunk through process_chunk, packed into tasks; summaries in chunk order."""
    import ray

    # without a Ray yet, Ray Data starts a local one with every CPU of this machine
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else (os.cpu_count() or 1)
    rows = [{"chunks": json.dumps([dataclasses.asdict(c) for c in task])}
            for task in plan_tasks(chunks, data_cfg.chunk_bytes, cpus)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
        _run_task, fn_kwargs={"tokenizer": _TokenizerOnce(tokenizer), "data_cfg": data_cfg, "out_dir": out_dir})
    # This job is one operator of CPU-bound tasks. Ray Data's per-operator reservation held it
    # to about one running task out of two CPUs while it ramped up (measured: 8 one-second tasks
    # took 6.1 s instead of 4.2 s on 2 CPUs; docs/data.md); nothing else runs here to reserve for.
    ds.context.op_resource_reservation_enabled = False
    console = [h for h in logging.getLogger("ray.data").handlers  # its console handler, not its log file's
               if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    quiet = _NoOutOfMemoryTraceback()
    for h in console:
        h.addFilter(quiet)
    if not verbose():  # its progress and INFO lines to ray-data.log only, unless --verbose (console.py)
        ds.context.enable_progress_bars = False
    quieted = quiet_handlers("ray.data")
    try:
        rows_out = ds.take_all()
    except Exception as e:
        _raise_if_out_of_memory(e, data_cfg, len(chunks))
        raise
    finally:
        for h in console:
            h.removeFilter(quiet)
        for h in quieted:
            h.filters = [f for f in h.filters if not isinstance(f, QuietFilter)]
    summaries = [s for r in rows_out for s in json.loads(r["summaries"])]
    return sorted(summaries, key=lambda s: s["chunk"])


class _NoOutOfMemoryTraceback(logging.Filter):
    """Ray Data logs a failed job with its traceback, twice, on the console. An out-of-memory failure is
    said in one line by the DataError below: keep Ray Data's log lines, drop their tracebacks (its log
    file, ray-data.log, keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and MONITOR_MARK in str(record.exc_info[1]):
            if record.getMessage().startswith("Full stack trace"):
                return False  # a record that is nothing but the traceback
            record.exc_info, record.exc_text = None, None
        return True


def _raise_if_out_of_memory(error: BaseException, data_cfg, n_chunks: int) -> None:
    """A prepare task that Ray's memory monitor killed more often than ``RAY_task_oom_retries`` (set by
    ``ray_settings.py``, before Ray is imported; Ray's own default retries without end) fails the job: say so in
    one line, with the memory seen and the settings that size a task."""
    seen = next((s for s in (read_oom(str(x)) for x in (error, getattr(error, "cause", None)) if x is not None)
                 if s is not None), None)
    if seen is None:
        return
    retries = os.environ.get("RAY_task_oom_retries", "unbounded")
    raise DataError(
        f"out of memory while preparing {n_chunks} chunk(s): {seen.describe()}, after {retries} retries of the "
        f"task; lower data.block_rows={data_cfg.block_rows} (rows a task holds before writing them) or "
        f"data.chunk_bytes={data_cfg.chunk_bytes} (input bytes per task), or free memory on the node") from None


def prepare(sources: List[str], out_dir: str, tokenizer, data_cfg, digests: Optional[Dict[str, str]] = None) -> str:
    """Tokenize and format ``sources`` into ``out_dir`` with a Ray Data job; return out_dir.

    Needs Ray initialised (or lets Ray Data start a local one). Bad records are
    counted per reason with up to 5 ``file:line`` samples (policy ``skip``) or fail
    the job naming the first one in file order (``strict``). The manifest is written
    last; ``ensure_prepared`` reuses a directory only if it has one. ``digests``
    (sha256 by source URI, when the caller has them) are recorded in the manifest.
    """
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

    t0 = time.time()
    results = _run_job(chunks, tokenizer, data_cfg, out_dir)
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
        "tokenizer_vocab_hash": tokenizer.vocab_hash(),  # what train.init_from's later runs compare (preflight.py)
        "tokenizer_path": getattr(tokenizer, "source", tokenizer.path),  # a bucket's URI, not the driver's copy
        "vocab_size": tokenizer.vocab_size,
        "token_bytes": tokenizer.token_bytes(),  # bits per byte (engine/evaluate.py): the bytes each id spells
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
    if len(paths) == 1 and not paths[0].startswith("demo") and is_prepared(paths[0]):
        path = paths[0] if is_uri(paths[0]) else os.path.abspath(paths[0])
        manifest = read_manifest(path)
        check_manifest(manifest, path, data_cfg, tokenizer)
        verify_shards(path, manifest)
        return path
    cache = data_cfg.cache_dir if is_uri(data_cfg.cache_dir) else os.path.abspath(data_cfg.cache_dir)
    if any(p == "demo" or p.startswith("demo:") for p in paths):
        paths = [resolve_demo_path(p, data_cfg.format, cache) for p in paths]
    files, missing = resolve_sources(paths)
    digests = content_digests(files)
    out = join(cache, f"{data_cfg.format}-{_cache_key(files, missing, digests, tokenizer, data_cfg)[:16]}")
    if is_prepared(out):
        try:
            manifest = read_manifest(out)
            check_manifest(manifest, out, data_cfg, tokenizer)
            verify_shards(out, manifest)
            if "token_bytes" not in manifest:  # our own cache, made before they were recorded: add them (bits per byte)
                write_manifest(out, {**manifest, "token_bytes": tokenizer.token_bytes()})
            return out
        except DataError as e:  # our own cache: make it again rather than train on it
            log.warning("prepared cache is unusable, preparing it again: %s", e)
    return prepare(paths, out, tokenizer, data_cfg, digests=digests)
