"""Where training data lives: paths, directories, globs and URIs resolved to files.

Every path goes through ``pyarrow.fs`` so that a local path, ``file://``, ``s3://``,
``gs://``, ``hdfs://`` ... all work the same way (``FileSystem.from_uri``). Files are
described by :class:`SourceFile` (URI, size, mtime), which is what the prepare cache
key and the manifest record.

Reading is always streamed: :func:`iter_lines` reads one byte range of a jsonl file in
fixed-size blocks, so no process ever holds a whole dataset. :func:`plan_ranges` cuts a
large jsonl file into newline-aligned byte ranges (one Ray task each) by reading only a
few bytes around each nominal cut. A gzip file cannot be seeked, so it is one range.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple, Union

import pyarrow.fs as pafs

from minimind_ray.fsio import filesystem, is_uri

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_READ_BLOCK = 8 << 20  # bytes per read when streaming lines
_PROBE_BLOCK = 64 << 10  # bytes per read when looking for the newline after a cut


@dataclass(frozen=True)
class SourceFile:
    """One input file. ``uri`` re-opens it anywhere (driver or Ray worker)."""

    uri: str
    size: int
    mtime_ns: int
    kind: str  # 'jsonl' | 'jsonl.gz' | 'parquet'


def _kind(path: str) -> str:
    for suffix in SUFFIXES:
        if path.endswith(suffix):
            return suffix[1:]
    return ""


def _to_uri(spec: str, path: str) -> str:
    """Rebuild a URI for a path found inside the filesystem of ``spec``."""
    if not is_uri(spec):
        return path
    scheme = spec.split("://", 1)[0]
    return f"{scheme}://{path.lstrip('/')}" if scheme != "file" else f"file://{path}"


def _source(spec: str, info: pafs.FileInfo) -> SourceFile:
    return SourceFile(uri=_to_uri(spec, info.path), size=int(info.size or 0),
                      mtime_ns=int(info.mtime_ns or 0), kind=_kind(info.path))


def resolve_sources(specs: Union[str, Sequence[str]]) -> Tuple[List[SourceFile], List[str]]:
    """Expand paths, directories (recursively) and globs into data files.

    Returns (files, missing): files in a stable order (the order of ``specs``, sorted
    within a directory or glob, duplicates removed); ``missing`` lists the specs that
    matched nothing, which ``prepare`` counts as ``missing_file``. A file with an
    unsupported suffix is an error: it is a typo, not bad data.
    """
    if isinstance(specs, str):
        specs = [specs]
    files: List[SourceFile] = []
    missing: List[str] = []
    seen = set()
    for spec in specs:
        fs, path = filesystem(spec)
        if any(ch in path for ch in "*?["):
            base = path
            while any(ch in base for ch in "*?["):
                base = os.path.dirname(base)
            try:
                infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            except FileNotFoundError:
                infos = []
            found = sorted((i for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, path)
                            and _kind(i.path)), key=lambda i: i.path)
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
                found = sorted((i for i in infos if i.type == pafs.FileType.File and _kind(i.path)),
                               key=lambda i: i.path)
            elif info.type == pafs.FileType.File:
                if not _kind(path):
                    raise ValueError(f"data.train_path: {spec}: unsupported file type (expected one of {SUFFIXES})")
                found = [info]
            else:
                found = []
        if not found:
            missing.append(spec)
        for info in found:
            sf = _source(spec, info)
            if sf.uri not in seen:
                seen.add(sf.uri)
                files.append(sf)
    return files, missing


def plan_ranges(sf: SourceFile, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Newline-aligned byte ranges [start, end) covering a jsonl file.

    Each range is at least ``chunk_bytes`` long: its end moves forward from
    start+chunk_bytes to just after the next newline, so every line lies wholly inside
    one range. Only a few KB around each cut are read.
    """
    if sf.kind != "jsonl" or sf.size <= chunk_bytes:
        return [(0, sf.size)]
    fs, path = filesystem(sf.uri)
    cuts = [0]
    with fs.open_input_file(path) as f:
        while cuts[-1] + chunk_bytes < sf.size:
            pos = cuts[-1] + chunk_bytes - 1  # the byte before the nominal cut may be the newline
            f.seek(pos)
            cut = None
            while cut is None:
                buf = f.read(_PROBE_BLOCK)
                if not buf:
                    break
                j = buf.find(b"\n")
                if j >= 0:
                    cut = pos + j + 1
                pos += len(buf)
            if cut is None or cut >= sf.size:
                break
            cuts.append(cut)
    cuts.append(sf.size)
    return list(zip(cuts[:-1], cuts[1:]))


def iter_lines(sf: SourceFile, start: int = 0, end: int = -1) -> Iterator[bytes]:
    """The lines (without their newline) of bytes [start, end) of a jsonl(.gz) file.

    ``start`` must be a line start (see :func:`plan_ranges`); ``end=-1`` means to the end.
    A final line without a newline is yielded too; a trailing newline yields nothing.
    """
    fs, path = filesystem(sf.uri)
    if sf.kind == "jsonl.gz":
        stream, remaining = fs.open_input_stream(path, compression="gzip"), -1
    else:
        stream = fs.open_input_file(path)
        stream.seek(start)
        remaining = (sf.size if end < 0 else end) - start
    carry = b""
    with stream:
        while remaining != 0:
            buf = stream.read(_READ_BLOCK if remaining < 0 else min(_READ_BLOCK, remaining))
            if not buf:
                break
            if remaining > 0:
                remaining -= len(buf)
            parts = (carry + buf).split(b"\n")
            carry = parts.pop()
            yield from parts
    if carry:
        yield carry


def iter_records(sf: SourceFile, start: int = 0, end: int = -1) -> Iterator[Union[bytes, dict]]:
    """The records of part of a source: raw lines (bytes, unparsed) of bytes [start, end) of a
    jsonl(.gz) file, or rows (dicts) of row groups [start, end) of a Parquet file. ``end=-1``: to the end."""
    if sf.kind != "parquet":
        yield from iter_lines(sf, start, end)
        return
    import pyarrow.parquet as pq

    fs, path = filesystem(sf.uri)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        groups = range(start, pf.num_row_groups if end < 0 else end)
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups):
            yield from batch.to_pylist()
