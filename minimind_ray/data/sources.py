"""Where training data lives: paths, directories, globs and URIs resolved to files.

Every path goes through ``pyarrow.fs`` so that a local path, ``file://``, ``s3://``,
``gs://``, ``hdfs://`` ... all work the same way (``FileSystem.from_uri``). Files are
described by :class:`SourceFile` (URI, size, mtime), which the manifest records; the
prepare cache is keyed by their content (:func:`content_digests`).

Reading is always streamed: :func:`iter_lines` reads one byte range of a jsonl file in
fixed-size blocks, so no process ever holds a whole dataset. :func:`plan_ranges` cuts a
large jsonl file into newline-aligned byte ranges (one Ray task each) by reading only a
few bytes around each nominal cut. A gzip file cannot be seeked, so it is one range.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow.fs as pafs

from minimind_ray.fsio import filesystem, is_uri

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_READ_BLOCK = 8 << 20  # bytes per read when streaming lines
_PROBE_BLOCK = 64 << 10  # bytes per read when looking for the newline after a cut
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark, written by some Windows tools


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


def content_digests(files: Sequence[SourceFile], threads: int = 4) -> Dict[str, str]:
    """sha256 of each file's bytes, by URI: what the prepare cache is keyed by, so that an edit
    is seen even when it keeps the size and restores the mtime. Every byte is read once
    (about 2-2.5 s per GiB on one core here, docs/data.md); files are hashed in parallel threads
    (pyarrow reads and hashlib release the GIL)."""
    def digest(sf: SourceFile) -> str:
        fs, path = filesystem(sf.uri)
        h = hashlib.sha256()
        with fs.open_input_file(path) as f:
            while True:
                block = f.read(_READ_BLOCK)
                if not block:
                    break
                h.update(block)
        return h.hexdigest()

    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        return dict(zip((sf.uri for sf in files), pool.map(digest, files)))


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


class OverlongLine:
    """Yielded by :func:`iter_lines` in place of a line longer than ``max_line_bytes``: the
    line was dropped while streaming, never assembled in memory; its place keeps line numbers right."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class TruncatedFile(Exception):
    """A compressed source ends early or is not gzip at all. Raised by :func:`iter_lines` after
    the complete lines before the break; ``lost_bytes`` counts the partial line dropped there."""

    def __init__(self, uri: str, detail: str, lost_bytes: int):
        super().__init__(f"{uri}: {detail}")
        self.uri, self.detail, self.lost_bytes = uri, detail, lost_bytes


class _BrokenGzip(Exception):
    pass


def _gunzip(raw) -> Iterator[bytes]:
    """Decompressed blocks (at most _READ_BLOCK bytes each, whatever the compression ratio) of
    a gzip stream, members one after another; _BrokenGzip once the data stops being gzip or
    ends mid-stream, after every byte that could be decompressed before that point."""
    d, started = zlib.decompressobj(16 + zlib.MAX_WBITS), False
    while True:
        data = raw.read(_READ_BLOCK)
        if not data:
            break
        while data:
            started = True
            try:
                out = d.decompress(data, _READ_BLOCK)
            except zlib.error as e:
                raise _BrokenGzip(f"not gzip data from here on ({e})") from None
            if out:
                yield out
            data = d.unconsumed_tail
            if d.eof:  # a member ended; anything after it starts the next member
                data, d = d.unused_data, zlib.decompressobj(16 + zlib.MAX_WBITS)
                started = bool(data)
    if started and not d.eof:
        raise _BrokenGzip("the gzip stream ends early (a truncated file?)")


def _blocks(sf: SourceFile, start: int, end: int) -> Iterator[bytes]:
    fs, path = filesystem(sf.uri)
    if sf.kind == "jsonl.gz":
        with fs.open_input_stream(path, compression=None) as raw:  # not "detect": decompressed here
            yield from _gunzip(raw)
        return
    with fs.open_input_file(path) as f:
        f.seek(start)
        remaining = (sf.size if end < 0 else end) - start
        while remaining > 0:
            buf = f.read(min(_READ_BLOCK, remaining))
            if not buf:
                break
            remaining -= len(buf)
            yield buf


def iter_lines(sf: SourceFile, start: int = 0, end: int = -1,
               max_line_bytes: Optional[int] = None) -> Iterator[Union[bytes, OverlongLine]]:
    """The lines (without their newline) of bytes [start, end) of a jsonl(.gz) file.

    ``start`` must be a line start (see :func:`plan_ranges`); ``end=-1`` means to the end.
    A final line without a newline is yielded too; a trailing newline yields nothing.
    A UTF-8 byte order mark at the start of the file is dropped (read as ``utf-8-sig``).
    With ``max_line_bytes``, a line that grows past it while being read is dropped up to its
    newline and an :class:`OverlongLine` is yielded instead, so memory stays within about
    ``max_line_bytes`` + one read block whatever the data holds. (Shorter lines are yielded
    whole even if they arrived in one block longer than the limit.) A .jsonl.gz that breaks
    off, or is not gzip, raises :class:`TruncatedFile` after its last complete line.
    """
    carry = b""  # the start of the current line: the bytes after the last newline
    skipped = -1  # >= 0 while dropping an over-long line: its bytes so far
    first = start == 0
    blocks = _blocks(sf, start, end)
    try:
        while True:
            try:
                buf = next(blocks, None)
            except _BrokenGzip as e:
                raise TruncatedFile(sf.uri, str(e), max(skipped, 0) + len(carry)) from None
            if buf is None:
                break
            if first:
                first = False
                if buf.startswith(_BOM):
                    buf = buf[len(_BOM):]
            if skipped >= 0:
                j = buf.find(b"\n")
                if j < 0:
                    skipped += len(buf)
                    continue
                yield OverlongLine(skipped + j)
                skipped, buf = -1, buf[j + 1:]
            parts = (carry + buf).split(b"\n")
            carry = parts.pop()
            yield from parts
            if max_line_bytes is not None and len(carry) > max_line_bytes:
                skipped, carry = len(carry), b""
        if skipped >= 0:
            yield OverlongLine(skipped)
        elif carry:
            yield carry
    finally:
        blocks.close()  # the file, also when the reader stops early


def iter_records(sf: SourceFile, start: int = 0, end: int = -1,
                 max_line_bytes: Optional[int] = None) -> Iterator[Union[bytes, OverlongLine, dict]]:
    """The records of part of a source: raw lines (bytes, unparsed) of bytes [start, end) of a
    jsonl(.gz) file (see :func:`iter_lines` for ``max_line_bytes``), or rows (dicts) of row groups
    [start, end) of a Parquet file. ``end=-1``: to the end."""
    if sf.kind != "parquet":
        yield from iter_lines(sf, start, end, max_line_bytes)
        return
    import pyarrow.parquet as pq

    fs, path = filesystem(sf.uri)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        groups = range(start, pf.num_row_groups if end < 0 else end)
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups):
            yield from batch.to_pylist()
