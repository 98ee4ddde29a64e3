"""Everything a run's files can decide, decided before Ray starts (docs/reliability.md, "Mistakes and faults"):
the first of the driver's steps (raytrain/driver.py:run), on the run resolved once (config.py:resolve: its config
validated, ``train.init_from``'s architecture taken or refused, its stage's record), which it reads and never rebuilds.
Each refusal is one line naming the field or file.

* **The run's storage**, when it is a bucket: reachable (store/reach.py), or one line naming
  ``checkpoint.storage_path`` and the endpoint.
* **The other weights a stage starts from** (a DPO reference; a distillation teacher, whose architecture is its own):
  whole (store/inspect.py), and the reference of the run's architecture.
* **The tokenizer**: fetched or found here, not in the workers, and its vocabulary checked against the model's, and
  against the one ``train.init_from`` trained with: another vocabulary is refused unless
  ``data.allow_tokenizer_change=true`` (a refused run never becomes ``<stage>-latest``).
* **What a local Ray can hold**, when this run starts its own: training workers against cores and GPUs, their memory
  estimate against the machine's (``cluster.check_local_fit``). On a cluster the placement is Ray's, bounded by
  ``cluster.resource_timeout_s`` as before.
* **The data**, a look and not a read: the first records of each file (at most :data:`LOOK_RECORDS` of each of the
  first :data:`LOOK_FILES`); a file none of whose first records fits the stage's format is refused, with the counts by
  reason. Everything else about the data is prepare's, as before (data.bad_records).

No Ray here; nothing is written. Everything above takes well under a second on a tiny run, apart from a first fetch of
MiniMind's tokenizer, which the run needs anyway.
"""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import psutil
import pyarrow.fs as pafs

from minimind_ray.cluster_config import worker_threads
from minimind_ray.config import RunConfig, RunSpec, weights_info
from minimind_ray.config_checks import ConfigError
from minimind_ray.data.formats import FORMATS, BadRecord, check_record, parse_line
from minimind_ray.data.sources import OverlongLine, iter_records, resolve_sources
from minimind_ray.engine.memory import GiB, estimate
from minimind_ray.fsio import filesystem, join, redact
from minimind_ray.store.inspect import WeightsInfo, architecture, differences, inspect_weights
from minimind_ray.store.reach import check_storage
from minimind_ray.store.weights import resolve_checkpoint
from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

LOOK_RECORDS = 1000  # the first records of a file that the look reads
LOOK_FILES = 16  # the files it looks at (prepare reads them all, as before)
CPU_OVERSUBSCRIPTION = 2  # training workers' threads per core a local Ray may hold


@dataclass
class Checked:
    """What the check decided: the resolved tokenizer, and the lines to say at the start."""

    tokenizer: Any
    lines: List[str] = field(default_factory=list)


def check_before_ray(run: RunSpec, local_ray: bool) -> Checked:
    """The checks of the module's docstring, in order, on the resolved run; raises ConfigError (or the tokenizer's
    fetch error)."""
    cfg = run.cfg
    check_storage(cfg.checkpoint.storage_path)  # a store that is down would read as an empty one (store/reach.py)
    check_parents(run)
    tokenizer = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    lines = check_vocabulary(run, tokenizer)
    if local_ray and cfg.cluster.check_local_fit:
        check_local_fit(cfg)
    look_at_data(cfg)
    return Checked(tokenizer, lines)


# --------------------------------------------------------------------------- weights


def check_parents(run: RunSpec) -> None:
    """The other weights the stage starts from (its record's ``parents``): whole, and of the run's architecture unless
    the stage says the parent has its own (a distillation teacher)."""
    cfg, stage = run.cfg, run.stage
    for parent, source in stage.parents(cfg).items():
        if not source:
            continue
        where = f"train.{stage.name} {parent}"
        info = weights_info(source, where)
        if parent in stage.own_architecture:
            continue
        diff = differences(cfg.model, info.model, info.recorded)
        if diff:
            fields = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in list(diff.items())[:4])
            raise ConfigError(f"{where}: {redact(source)} is {info.describe()}; the run's model is "
                              f"{architecture(cfg.model)} ({fields}): they must be the same architecture")


# --------------------------------------------------------------------------- tokenizer


def check_vocabulary(run: RunSpec, tokenizer) -> List[str]:
    """The tokenizer's ids fit the embedding; a tokenizer whose vocabulary differs from the one ``train.init_from``
    trained with is refused (its ids mean other tokens: issue 54), unless ``data.allow_tokenizer_change`` (a vocabulary
    extension). One that differs in its chat template or special-token names only is said, not refused: a new template
    is a deliberate change. Returns the lines to say."""
    cfg, written_model = run.cfg, any(k.startswith("model.") for k in run.written)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the "
                          f"model's vocab_size {cfg.model.vocab_size}"
                          + (" (train.init_from's)" if cfg.train.init_from and not written_model else ""))
    if not cfg.train.init_from:
        return []
    recorded = _recorded_tokenizer(cfg.train.init_from)
    if not recorded or recorded.get("tokenizer_hash") in (None, tokenizer.hash()):
        return []
    source, theirs = redact(cfg.train.init_from), recorded.get("tokenizer_path") or "its data's manifest"
    vocab = _recorded_vocab_hash(recorded)
    if vocab == tokenizer.vocab_hash():
        return [f"data.tokenizer={cfg.data.tokenizer} has the vocabulary train.init_from {source} trained with "
                f"({theirs}), with another chat template or special-token names"]
    differs = ("a vocabulary other than" if vocab else "another tokenizer (its vocabulary unknown: no longer readable) "
               "than")
    said = (f"train.init_from {source} was trained with {differs} data.tokenizer={cfg.data.tokenizer} "
            f"({theirs}, hash {recorded['tokenizer_hash'][:12]}; given: hash {tokenizer.hash()[:12]}): its ids mean "
            f"other tokens")
    if cfg.data.allow_tokenizer_change:
        return [f"WARNING: {said}; trained anyway (data.allow_tokenizer_change=true)"]
    raise ConfigError(f"data.tokenizer: {said}; use the tokenizer it trained with, or set "
                      f"data.allow_tokenizer_change=true for a deliberate change (a vocabulary extension)")


def _recorded_tokenizer(source: str) -> Optional[dict]:
    """The manifest of the data a run or checkpoint trained on (its tokenizer's hash and path), when still readable."""
    try:
        info = inspect_weights(source)
        prepared = (info.run_config or {}).get("data") and _prepared_dir(info)
        if not prepared:
            return None
        fs, path = filesystem(join(prepared, "manifest.json"))
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except Exception:  # a courtesy: the manifest may be gone with its cache
        return None


def _recorded_vocab_hash(manifest: dict) -> Optional[str]:
    """The vocabulary hash of the tokenizer a manifest names: recorded (data prepared since issue 54), or read from
    the tokenizer it names while that is still there; None when neither."""
    if manifest.get("tokenizer_vocab_hash"):
        return manifest["tokenizer_vocab_hash"]
    try:
        return load_tokenizer(manifest["tokenizer_path"]).vocab_hash()
    except Exception:  # gone with its cache, or a bucket's copy no longer there
        return None


def _prepared_dir(info: WeightsInfo) -> Optional[str]:
    return resolve_checkpoint(info.source).meta().prepared_dir


# --------------------------------------------------------------------------- a local Ray


def check_local_fit(cfg: RunConfig) -> None:
    """Refuse a worker group that the Ray this run starts on this machine cannot hold: more workers' threads than
    :data:`CPU_OVERSUBSCRIPTION` per core, GPU workers beyond its GPUs, or a memory estimate beyond its memory."""
    cl, n = cfg.cluster, cfg.cluster.num_workers
    cores = os.cpu_count() or 1
    gpus = _local_gpus()
    use_gpu = bool(gpus) if cl.use_gpu is None else cl.use_gpu
    override = "or set cluster.address to a cluster (cluster.check_local_fit=false starts them anyway)"
    if use_gpu and n > gpus:
        field_name = "cluster.use_gpu" if not gpus else "cluster.num_workers"
        raise ConfigError(f"{field_name}: {n} GPU worker(s), and this machine has {gpus} GPU(s): "
                          f"{'set cluster.use_gpu=false' if not gpus else f'use cluster.num_workers<={gpus}'}, "
                          f"{override}")
    threads = worker_threads(cfg)
    most = max(1, CPU_OVERSUBSCRIPTION * cores // threads)
    if not use_gpu and n > most:
        raise ConfigError(f"cluster.num_workers: {n} training workers of {threads} thread(s) on a local Ray with "
                          f"{cores} core(s); at most {most} fit ({CPU_OVERSUBSCRIPTION} threads per core): use "
                          f"cluster.num_workers<={most}, {override}")
    if use_gpu:
        return  # a GPU's memory is for the estimate against the GPU itself (raytrain/oom.py:warn_if_short)
    total = psutil.virtual_memory().total
    est = estimate(cfg, device_type="cpu").total
    if est * n > total:
        fit = int(total // est)
        raise ConfigError(f"cluster.num_workers: {n} workers need about {est * n / GiB:.1f} GiB by the memory "
                          f"estimate ({est / GiB:.1f} GiB each), more than this machine's {total / GiB:.1f} GiB: "
                          + (f"use cluster.num_workers<={fit}, or " if fit else "")
                          + f"lower train.micro_batch_size or data.max_seq_len, {override}")


def _local_gpus() -> int:
    """GPUs a local Ray would see (CUDA_VISIBLE_DEVICES applies); 0 without a CUDA build of torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --------------------------------------------------------------------------- a look at the data


def look_at_data(cfg: RunConfig) -> None:
    """Refuse a file none of whose first :data:`LOOK_RECORDS` records is a ``data.format`` record, with the counts
    by reason (and the format it does read as, when one does). Built-in data and prepared directories are skipped."""
    d = cfg.data
    specs = [p for p in d.train_path if p != "demo" and not p.startswith("demo:") and not _is_prepared(p)]
    if not specs:
        return
    try:
        files, _ = resolve_sources(specs)
    except (OSError, ValueError):
        return  # prepare says what is wrong with a path, as before
    for sf in files[:LOOK_FILES]:
        bad = _look(sf, d.format, d.max_record_chars)
        if bad is not None:
            _refuse(cfg, sf.uri, *bad)


def _look(sf, fmt: str, max_chars: int):
    """None when one of the file's first records is a ``fmt`` record; else (records seen, reasons, the first problem,
    the formats they read as)."""
    reasons, fits, first, seen = collections.Counter(), collections.Counter(), None, 0
    # a line is never assembled past 4 bytes a character of data.max_record_chars (UTF-8's most)
    for n, raw in enumerate(iter_records(sf, max_line_bytes=4 * max_chars), start=1):
        if n > LOOK_RECORDS:
            break
        seen, rec = n, None
        try:
            if isinstance(raw, OverlongLine):
                raise BadRecord("too_long", f"a line of {raw.nbytes} bytes")
            rec = raw if isinstance(raw, dict) else parse_line(raw, max_chars)
            check_record(fmt, rec, max_chars)
            return None
        except BadRecord as e:
            reasons[e.reason] += 1
            first = first or f"line {n}: {e.detail}"
            if rec is not None:
                fits.update(_formats_it_reads_as(rec, fmt))
    return (seen, reasons, first, fits) if seen else None


def _refuse(cfg, uri, seen, reasons, first, fits) -> None:
    counts = ", ".join(f"{r}: {c}" for r, c in reasons.most_common())
    hint = ""
    if fits:
        other = fits.most_common(1)[0][0]
        hint = f"; they read as {other} records (data.format={other}, or the verb that trains on them)"
    raise ConfigError(f"data.train_path: {redact(uri)}: none of its first {seen} records is a {cfg.data.format} record "
                      f"(data.format={cfg.data.format}, the {cfg.train.stage} verb's) ({counts}; {first}){hint}")


def _formats_it_reads_as(rec: Dict[str, Any], fmt: str) -> List[str]:
    out = []
    for other in FORMATS:
        if other == fmt:
            continue
        try:
            check_record(other, rec)
            out.append(other)
        except (BadRecord, ValueError):
            pass
    return out


def _is_prepared(path: str) -> bool:
    try:
        fs, p = filesystem(join(path, "manifest.json"))
        return fs.get_file_info(p).type == pafs.FileType.File
    except Exception:  # a glob or an unreachable URI: not a prepared directory
        return False
