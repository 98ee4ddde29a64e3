"""What a prepared directory holds, and the checks before anything trains on it.

A prepared directory is ``part-NNNNN.parquet`` shards plus ``manifest.json``, written last
(see prepare.py). The manifest is the only index: readers find shards, row counts and the
settings the rows were made with there. So it is checked before use: it must parse and hold
the fields readers need (:func:`read_manifest`), every shard it lists must be there with
the size it had when written (:func:`verify_shards`), and the tokenizer and row settings
must match the run (:func:`check_manifest`). Each refusal is one :class:`DataError` line
naming the file and what is wrong; nothing here deletes anything.
"""
from __future__ import annotations

import json
from typing import Dict

import pyarrow.fs as pafs

from minimind_ray.data.formats import get_format
from minimind_ray.fsio import filesystem, join, write_bytes_atomic

MANIFEST = "manifest.json"
PREPARED_VERSION = 1  # bump when the layout or a format's rows change: old caches are then not reused
# the fields a reader of the manifest relies on (stream.PreparedDataset, check_manifest)
REQUIRED = ("version", "format", "max_seq_len", "pack", "tokenizer_hash", "block_rows", "shards")


class DataError(ValueError):
    """Bad data under the strict policy, unusable prepared data, or no data at all."""


def read_manifest(path: str) -> dict:
    """The manifest of a prepared directory (local path or URI); FileNotFoundError if absent,
    DataError naming the file if it is not a manifest (not JSON, not an object, fields missing)."""
    fs, root = filesystem(path)
    where = join(path, MANIFEST)
    with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e}); prepare the data again") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{where}: not a JSON object but a {type(manifest).__name__}; prepare the data again")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise DataError(f"{where}: lacks the field(s) {missing}; prepare the data again")
    shards = manifest["shards"]
    if not isinstance(shards, list) or not all(
            isinstance(s, dict) and {"file", "index", "rows"} <= s.keys() for s in shards):
        raise DataError(f"{where}: field 'shards' is not a list of {{file, index, rows}}; prepare the data again")
    return manifest


def write_manifest(out_dir: str, manifest: dict) -> None:
    """Atomically: its presence means "complete", so it must never be half-written."""
    write_bytes_atomic(join(out_dir, MANIFEST), json.dumps(manifest, indent=1, ensure_ascii=False).encode())


def is_prepared(path: str) -> bool:
    fs, root = filesystem(path)
    return fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File


def verify_shards(path: str, manifest: dict) -> None:
    """Refuse a prepared directory whose shards are not the ones the manifest lists: a shard
    missing, or of another byte size than when it was written (manifests from before sizes
    were recorded: another row count, from the shard's Parquet footer). One listing of the
    directory, plus one footer read per shard for old manifests only."""
    import pyarrow.parquet as pq

    fs, root = filesystem(path)
    sizes: Dict[str, int] = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(root))
                             if i.type == pafs.FileType.File}
    for s in manifest["shards"]:
        where = join(path, s["file"])
        if s["file"] not in sizes:
            raise DataError(f"{where}: shard listed in {MANIFEST} is missing; prepare the data again")
        if "bytes" in s:
            if sizes[s["file"]] != s["bytes"]:
                raise DataError(f"{where}: {sizes[s['file']]} bytes, but {MANIFEST} recorded {s['bytes']}: "
                                f"the shard was changed; prepare the data again")
            continue
        with fs.open_input_file(f"{root}/{s['file']}") as f:
            rows = pq.ParquetFile(f).metadata.num_rows
        if rows != s["rows"]:
            raise DataError(f"{where}: {rows} rows, but {MANIFEST} recorded {s['rows']}; prepare the data again")


def row_settings(data_cfg) -> dict:
    """The settings that shape the prepared rows, as the manifest records them and a run must match.
    Packing applies to the formats that pack (pretrain) only, so it is recorded as it takes effect."""
    return {"format": data_cfg.format, "max_seq_len": data_cfg.max_seq_len,
            "pack": bool(data_cfg.pack and get_format(data_cfg.format).packs)}


def check_tokenizer(manifest: dict, path: str, tokenizer_hash: str, whose: str, remedy: str) -> None:
    """Refuse prepared data of another layout version, or tokenized with another tokenizer than
    ``whose`` (hash ``tokenizer_hash``): its ids would mean other tokens. Training and ``eval --data``
    both apply it."""
    if manifest.get("version") != PREPARED_VERSION:
        raise DataError(f"prepared data {path} has layout version {manifest.get('version')}, this code reads "
                        f"{PREPARED_VERSION}: prepare it again from the raw files")
    if manifest["tokenizer_hash"] != tokenizer_hash:
        raise DataError(
            f"prepared data {path} was tokenized with tokenizer hash {manifest['tokenizer_hash']} "
            f"({manifest.get('tokenizer_path')}), but {whose} has hash {tokenizer_hash}: {remedy}")


def check_manifest(manifest: dict, path: str, data_cfg, tokenizer) -> None:
    """Refuse prepared data that does not match the run: the ids would mean other tokens,
    or the rows would have another shape than the config asks for."""
    check_tokenizer(manifest, path, tokenizer.hash(), f"data.tokenizer {tokenizer.path!r}",
                    "prepare the raw data again with this tokenizer, or set data.tokenizer to the one it was made with")
    for field, want in row_settings(data_cfg).items():
        if manifest[field] != want:
            raise DataError(f"prepared data {path} has {field}={manifest[field]!r} but data.{field}={want!r}")


def skipped_records(prepared_dir: str) -> str:
    """What a prepare left out, from the manifest: ``1 of 12,345 records (bad_json: 1; first at pretrain_bad.jsonl:6)``,
    or ``0 of 12,345 records``. A run says it on the console and as its MLflow tag ``data/skipped``."""
    manifest = read_manifest(prepared_dir)
    skipped = manifest.get("skipped") or {}
    n = sum(int(e.get("count", 0)) for e in skipped.values())
    total = n + int((manifest.get("counts") or {}).get("records", 0))
    if not n:
        return f"0 of {total:,} records"
    reasons = ", ".join(f"{r}: {int(e.get('count', 0)):,}" for r, e in skipped.items())
    places = [p for e in skipped.values() for p in e.get("samples") or []]

    def order(place: str):  # file:line in file order; a whole file's issue (missing_file) after them
        uri, _, line = place.rpartition(":")
        return (0, uri, int(line)) if line.isdigit() else (1, place, 0)

    first = min(places, key=order, default=None)
    return f"{n:,} of {total:,} records ({reasons}{f'; first at {first}' if first else ''})"
