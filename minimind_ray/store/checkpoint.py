"""The checkpoint directory: its layout, its typed meta record, atomic writes, verified reads.

One directory per ``ray.train.report(..., checkpoint=...)``::

    model.pth          the model as a MiniMind state dict (fp32, MiniMind's keys;
                       LoRA runs add MiniMind's ``*.lora.A/B.weight`` keys)
    train_state.pt     optimizer + scheduler state (torch.save, weights_only-loadable)
    meta.json          :class:`CheckpointMeta`: step, epoch, data position, world size, MLflow run id, config
    rng/rank_<r>.pt    RNG states of every rank (each rank writes its own)
    <part>.pth         a model a stage trains beside the policy (PPO: critic.pth, MiniMind's CriticModel keys)
    COMPLETE.json      written last by rank 0: the file list with sizes, the ranks, the step

Under ``train.parallelism=fsdp`` the weights and AdamW's state are sharded (``store/sharded.py``: DCP files under
``sharded/``, every rank's listed in COMPLETE.json) instead of ``model.pth`` and train_state.pt's optimizer; the rest
is the same. Either layout resumes under either parallelism at any world size, and :meth:`StoredCheckpoint.model_state`
reads whole weights from both (export, eval, serve, ``train.init_from``).

Every rank writes into its own local staging directory; Ray Train uploads them all into the
same storage directory. A checkpoint without a readable ``COMPLETE.json``, or whose files do
not match it, is refused by :func:`open_checkpoint` instead of being loaded half-written.
Reads go through ``pyarrow.fs``, so a checkpoint on ``s3://``/``gs://`` is read file by
file, never copied whole.
"""
from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.fs as pafs
import torch

from minimind_ray.fsio import (filesystem, is_uri, redact, redact_obj, torch_save_atomic, write_bytes_atomic,
                               write_json_atomic)
from minimind_ray.store import sharded as sharded_store
from minimind_ray.store.sharded import METADATA as SHARDED_METADATA, read_whole_model

COMPLETE = "COMPLETE.json"
MODEL = "model.pth"
TRAIN_STATE = "train_state.pt"
META = "meta.json"
RNG_DIR = "rng"
PREFIX = "checkpoint_"  # Ray Train's directory names inside a run directory


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and why (a URI's credentials redacted)."""

    def __init__(self, msg: str):
        super().__init__(redact(str(msg)))


@dataclass
class CheckpointMeta:
    """``meta.json``: what a restart needs besides the tensors. Keys are the on-disk names."""

    step: int  # optimizer steps done
    epoch: int
    data_state: Dict[str, Any]  # TrainStream.state_dict(): world-size independent
    world_size: int  # ranks that wrote it (rng/rank_<r>.pt for r < world_size)
    stage: str
    total_steps: int
    config: Dict[str, Any]  # the run's config as a plain dict (minimind_ray.config.to_dict)
    prepared_dir: str  # the prepared data it trained on
    mlflow_run_id: Optional[str] = None
    adapters: Optional[Dict[str, Any]] = None  # the LoRA adapters its stage put on the model (Stage.adapters), or None
    # what the run reported to Ray Train with this checkpoint (step, loss, ...): a group that restores the last step
    # from a checkpoint Ray never registered reports it again (raytrain/worker.py)
    reported: Dict[str, Any] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)  # keys this code does not know, kept on a round trip

    def to_json(self) -> Dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if d["adapters"] is None:  # a run without adapters writes meta.json as before they were recorded
            del d["adapters"]
        return {**d, **self.extra}

    @classmethod
    def from_json(cls, d: Any, where: str = "meta.json") -> "CheckpointMeta":
        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise CheckpointError(f"{where}: missing {missing}")
        return cls(**{k: d[k] for k in names if k in d}, extra={k: v for k, v in d.items() if k not in names})

# --------------------------------------------------------------------------- writing


def write_rank_files(ckpt_dir, rank: int, rng: Dict[str, Any]) -> Dict[str, int]:
    """What every rank contributes: its RNG state. Every rank calls it together (a collective when distributed):
    returns every rank's files with their sizes, for rank 0's COMPLETE.json. On object storage an upload keeps no
    order, so COMPLETE.json may arrive before another rank's file: only a record of that file's size lets a reader
    tell a whole checkpoint from a cut one."""
    import torch.distributed as dist

    name = f"{RNG_DIR}/rank_{rank}.pt"
    torch_save_atomic(rng, Path(ckpt_dir) / name)
    mine = {name: (Path(ckpt_dir) / name).stat().st_size}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: size for files in everyone for n, size in files.items()}


def write_shared_files(ckpt_dir, *, model_state: Optional[Dict[str, torch.Tensor]], train_state: Dict[str, Any],
                       meta: CheckpointMeta, part_states: Optional[Dict[str, Dict[str, torch.Tensor]]] = None,
                       sharded_files: Optional[Dict[str, int]] = None,
                       rank_files: Optional[Dict[str, int]] = None) -> None:
    """Rank 0 writes the shared state (and each part's weights, ``<name>.pth``), then the COMPLETE marker listing
    every file of every rank with its size: ``rank_files`` (:func:`write_rank_files`' answer; by default the RNG
    files in this directory). A sharded checkpoint has no ``model_state`` here but every rank's ``sharded_files``
    (store/sharded.py:write_sharded, written before)."""
    from minimind_ray.model.minimind import clean_state_dict  # lazy: omegaconf, yaml, only when this runs

    ckpt_dir = Path(ckpt_dir)
    parts = {f"{name}.pth": sd for name, sd in (part_states or {}).items()}
    weights = [(MODEL, model_state)] if model_state is not None else []
    for name, sd in [*weights, *parts.items()]:
        torch_save_atomic({k: v.detach().cpu() for k, v in clean_state_dict(sd).items()}, ckpt_dir / name)
    torch_save_atomic(train_state, ckpt_dir / TRAIN_STATE)
    write_json_atomic(ckpt_dir / META, redact_obj(meta.to_json()))  # a URI's credentials never reach storage
    files = {name: (ckpt_dir / name).stat().st_size for name in (*(n for n, _ in weights), TRAIN_STATE, META, *parts)}
    files.update(sharded_files or {})
    if rank_files is None:
        rank_files = {f"{RNG_DIR}/{p.name}": p.stat().st_size for p in sorted((ckpt_dir / RNG_DIR).glob("rank_*.pt"))}
    files.update(rank_files)
    write_json_atomic(ckpt_dir / COMPLETE, {"files": files, "rng_ranks": list(range(meta.world_size)),
                                            "step": meta.step})


# --------------------------------------------------------------------------- reading


def _read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def _unreadable(where: str, e: BaseException) -> CheckpointError:
    """``<where>: unreadable (<error>: <its first line>)``. DCP wraps each rank's error in a CheckpointException (a
    BaseException, whose text starts with the ranks): the first rank's own error is named instead."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    return CheckpointError(f"{where}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


def _dcp_error():
    """DCP's CheckpointException, which ``except Exception`` does not catch (lazy: torch.distributed.checkpoint takes
    seconds to import, which nothing that only lists checkpoints should pay)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _torch_load(fs, path: str, where: str):
    try:
        return torch.load(io.BytesIO(_read_bytes(fs, path)), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a half-copied pickle, pickled code
        raise _unreadable(where, e) from e


def _complete_record(fs, root: str, where: str) -> Dict[str, Any]:
    """The COMPLETE record, checked for shape: a malformed one is a refusal, not a crash."""
    try:
        rec = json.loads(_read_bytes(fs, f"{root}/{COMPLETE}"))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(f"{where}: no readable {COMPLETE}; the checkpoint was not finished and is not used") from e
    ok = (isinstance(rec, dict) and isinstance(rec.get("files"), dict) and isinstance(rec.get("step"), int)
          and isinstance(rec.get("rng_ranks"), list) and all(isinstance(r, int) for r in rec["rng_ranks"])
          and all(isinstance(n, str) and isinstance(s, int) for n, s in rec["files"].items())
          and all(n in rec["files"] for n in (TRAIN_STATE, META))
          and (MODEL in rec["files"] or SHARDED_METADATA in rec["files"]))
    if not ok:
        raise CheckpointError(f"{where}: malformed {COMPLETE} (expected files, rng_ranks and step); checkpoint refused")
    return rec


@dataclass
class StoredCheckpoint:
    """A checkpoint directory that :func:`open_checkpoint` verified; reads its parts on demand."""

    path: str  # the directory, on ``fs``
    fs: pafs.FileSystem
    record: Dict[str, Any]  # COMPLETE.json
    location: str  # how to name it to a user: a local path or a URI

    @property
    def step(self) -> int:
        return int(self.record["step"])

    def meta(self) -> CheckpointMeta:
        where = f"{self.location}/{META}"
        try:
            d = json.loads(_read_bytes(self.fs, f"{self.path}/{META}"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where}: unreadable ({e})") from e
        return CheckpointMeta.from_json(d, where)

    @property
    def sharded(self) -> bool:
        """Written under train.parallelism=fsdp: weights and AdamW in ``sharded/`` (store/sharded.py)."""
        return SHARDED_METADATA in self.record["files"]

    def model_state(self) -> Dict[str, torch.Tensor]:
        """The whole weights under MiniMind's keys, whichever layout (a sharded one is read by this process alone)."""
        from minimind_ray.model.minimind import clean_state_dict  # lazy: omegaconf, yaml, only when this runs

        if self.sharded:
            try:
                return clean_state_dict(read_whole_model(self.fs, self.path))
            except (Exception, _dcp_error()) as e:  # a shard that is not DCP's, metadata that names code
                raise _unreadable(f"{self.location}/sharded", e) from e
        return clean_state_dict(_torch_load(self.fs, f"{self.path}/{MODEL}", f"{self.location}/{MODEL}"))

    def load_sharded(self, state: Dict[str, Any]) -> None:
        """Fill ``state`` (engine/parallel.py:sharded_state's shape: this rank's slices, or whole tensors) from a
        sharded checkpoint; every rank of a process group calls it together."""
        if not self.sharded:
            raise CheckpointError(f"{self.location}: holds model.pth, not sharded state")
        try:
            sharded_store.load_sharded(self.fs, self.path, state)
        except _dcp_error() as e:  # every rank gets it (DCP gathers the failures): each raises the same refusal
            raise _unreadable(f"{self.location}/sharded", e) from e

    def train_state(self) -> Dict[str, Any]:
        return _torch_load(self.fs, f"{self.path}/{TRAIN_STATE}", f"{self.location}/{TRAIN_STATE}")

    def has_part(self, name: str) -> bool:
        return f"{name}.pth" in self.record["files"]

    def part_state(self, name: str) -> Dict[str, torch.Tensor]:
        """The weights of a model trained beside the policy (``critic``), verified like every listed file."""
        if not self.has_part(name):
            raise CheckpointError(f"{self.location}: holds no {name}.pth (not written by a stage that trains a {name})")
        return _torch_load(self.fs, f"{self.path}/{name}.pth", f"{self.location}/{name}.pth")

    def rng(self, rank: int) -> Optional[Dict[str, Any]]:
        """This rank's RNG state, or None when the checkpoint came from a smaller world."""
        if rank not in self.record["rng_ranks"]:
            return None
        return _torch_load(self.fs, f"{self.path}/{RNG_DIR}/rank_{rank}.pt", f"{self.location}/{RNG_DIR}/rank_{rank}.pt")


def open_checkpoint(location, filesystem_=None, deep: bool = False, where: Optional[str] = None) -> StoredCheckpoint:
    """Verify a checkpoint once and return a reader for it.

    ``location`` is a local path or a storage URI (or a path on ``filesystem_``, named ``where`` to users). Every
    file listed in ``COMPLETE.json`` (every rank's, since issue 49) must be there at its size, and every rank's RNG
    file must exist: an upload to object storage keeps no order, and a checkpoint whose listed files are not all
    there is never restored. ``deep`` also loads every RNG file (a checkpoint written before COMPLETE.json listed
    them, which Ray never registered: a crash may have cut its upload short)."""
    if filesystem_ is not None:
        fs, root = filesystem_, str(location)
    else:
        fs, root = filesystem(location)
    root = root.rstrip("/")
    where = where or str(location)
    rec = _complete_record(fs, root, where)
    names = list(rec["files"])
    for name, info in zip(names, fs.get_file_info([f"{root}/{n}" for n in names])):
        if info.type != pafs.FileType.File or info.size != rec["files"][name]:
            raise CheckpointError(f"{where}: {name} missing or of the wrong size; checkpoint refused")
    rng_paths = [f"{root}/{RNG_DIR}/rank_{r}.pt" for r in rec["rng_ranks"]]
    for r, info in zip(rec["rng_ranks"], fs.get_file_info(rng_paths)):
        if info.type != pafs.FileType.File:
            raise CheckpointError(f"{where}: {RNG_DIR}/rank_{r}.pt missing; checkpoint refused")
    if deep:
        for r, p in zip(rec["rng_ranks"], rng_paths):
            _torch_load(fs, p, f"{where}/{RNG_DIR}/rank_{r}.pt")
    return StoredCheckpoint(root, fs, rec, where)


def is_checkpoint(location) -> bool:
    """Does ``location`` look like a checkpoint directory (has a COMPLETE marker)? Not verified."""
    fs, root = filesystem(location)
    return fs.get_file_info(f"{root.rstrip('/')}/{COMPLETE}").type == pafs.FileType.File


# --------------------------------------------------------------------------- a run's checkpoints


def _checkpoint_dirs(run_dir, fs=None) -> Tuple[Any, list]:
    """(filesystem, FileInfo of every checkpoint_* directory) of a run directory; none if it is absent. ``fs``: the
    run directory's filesystem when the caller resolved it already (``run_dir`` is then a path on it)."""
    fs, root = (fs, str(run_dir)) if fs is not None else filesystem(run_dir)
    try:
        entries = fs.get_file_info(pafs.FileSelector(root.rstrip("/"), allow_not_found=True))
    except OSError:
        return fs, []
    return fs, [e for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith(PREFIX)]


def checkpoints_in(run_dir, fs=None) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint_* directory of a run with a well-formed COMPLETE marker,
    newest first; paths are on the run directory's filesystem. Markers only: open each before use."""
    fs, entries = _checkpoint_dirs(run_dir, fs)
    found = []
    for e in entries:
        try:
            found.append((_complete_record(fs, e.path, e.path)["step"], e.path))
        except CheckpointError:
            continue  # unfinished or malformed: never a candidate
    return sorted(found, reverse=True)


def newest_complete(run_dir, deep: bool = False, newer_than: int = -1) -> Optional[StoredCheckpoint]:
    """The newest checkpoint of a run that verifies (skipping broken ones), newer than ``newer_than``. The run
    directory's filesystem is resolved once, for the listing and every checkpoint opened."""
    fs, root = filesystem(run_dir)
    uri = is_uri(run_dir)
    for step, path in checkpoints_in(root, fs):
        if step <= newer_than:
            break
        # named to users as a URI they can pass back
        where = f"{str(run_dir).rstrip('/')}/{Path(path).name}" if uri else path
        try:
            return open_checkpoint(path, fs, deep=deep, where=where)
        except CheckpointError:
            continue
    return None


def choose_restore(registered: Optional[Tuple[str, Any]], run_dir: Optional[str]) -> Optional[StoredCheckpoint]:
    """The checkpoint a (re)started run resumes from: the newest complete one.

    ``registered`` is (path, filesystem) of the checkpoint Ray Train registered, or None. Ray
    registers a checkpoint only once its controller has collected every rank's report, which it
    polls for every couple of seconds. A worker killed hard in between (SIGKILL, OOM, a lost node)
    takes the newest checkpoint's registration with it, although every rank had uploaded its
    files; Ray then names the one before, and the restart would cost two checkpoint intervals.
    So the run directory is searched too, and a newer checkpoint that verifies deeply (every file
    at its size, every rank's RNG file readable) wins. Ray's ``num_to_keep`` does not know such a
    checkpoint; :func:`prune_untracked` removes it when the run ends."""
    chosen, reg_step = None, -1
    if registered is not None:
        try:
            chosen = open_checkpoint(registered[0], registered[1])
            reg_step = chosen.step
        except CheckpointError as e:  # a newer one may still do; if none does, this refusal stands
            if run_dir is None:
                raise
            refusal = e
    if run_dir:
        newer = newest_complete(run_dir, deep=True, newer_than=reg_step)
        if newer is not None:
            why = (f"newer than the checkpoint Ray registered (step {reg_step if reg_step >= 0 else 'none'})"
                   if registered is None or chosen is not None else f"Ray's registered checkpoint is unusable: {refusal}")
            print(redact(f"[minimind-ray] resuming from {newer.location} (step {newer.step}), {why}"), flush=True)
            return newer
    if registered is not None and chosen is None:
        raise refusal
    return chosen


def latest_checkpoint(run_dir, deep: bool = False):
    """The newest complete checkpoint_* directory of a run directory (no Ray needed), or None.
    A local ``run_dir`` gives a Path; a URI gives the URI of the checkpoint."""
    found = newest_complete(run_dir, deep)
    if found is None:
        return None
    return found.location if is_uri(run_dir) else Path(found.path)


def prune_untracked(run_dir, kept_names) -> List[str]:
    """Delete the checkpoint_* directories of a finished run that Ray does not keep: ones a hard crash
    kept it from registering (see :func:`choose_restore`) and uploads a crash cut short. Ray's own
    ``num_to_keep`` pruning only knows what it registered. Returns the names removed."""
    fs, entries = _checkpoint_dirs(run_dir)
    kept, removed = set(kept_names), []
    for e in entries:
        if e.base_name not in kept:
            try:
                fs.delete_dir(e.path)
            except OSError as err:  # storage trouble must not fail a finished run; say so and go on
                print(redact(f"[minimind-ray] could not remove {e.path}: {err}"), flush=True)
                continue
            removed.append(e.base_name)
    return sorted(removed)


LATEST_SUFFIX = "-latest"


def mark_latest(run_dir: str, stage: str) -> Optional[str]:
    """``<storage>/<stage>-latest``: the newest finished run of a stage beside it, for chaining stages without copying
    run names (``train.init_from=runs/pretrain-latest``). On local storage a relative symlink, replaced atomically; on
    object storage, which has no links, a pointer object ``<stage>-latest.json`` (``{"run": <name>}``, one PUT: whole
    or absent) that :func:`follow_latest` reads wherever a ``-latest`` path is accepted. None where it cannot be
    made (a directory of that name, a store that refuses the write)."""
    import os

    if is_uri(run_dir):
        parent, name = str(run_dir).rstrip("/").rsplit("/", 1)
        pointer = f"{parent}/{stage}{LATEST_SUFFIX}.json"
        try:
            write_bytes_atomic(pointer, json.dumps({"run": name, "stage": stage}).encode())
        except (OSError, ValueError) as e:  # the store refused it, or a URI pyarrow cannot open (ArrowInvalid)
            print(redact(f"[minimind-ray] could not write {pointer}: {e}"), flush=True)
            return None
        return f"{parent}/{stage}{LATEST_SUFFIX}"
    run = Path(run_dir)
    link, tmp = run.parent / f"{stage}{LATEST_SUFFIX}", run.parent / f".{stage}{LATEST_SUFFIX}.{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run.name)
        os.replace(tmp, link)
    except OSError:
        if tmp.is_symlink():
            tmp.unlink()
        return None
    return str(link)


def follow_latest(location: str) -> str:
    """``<storage>/<stage>-latest`` (or its ``.json``) on object storage -> the run directory its pointer object names;
    anything else as it is (a local ``-latest`` is a symlink the filesystem follows). A pointer that names no
    run is an error naming the pointer."""
    location = str(location)
    if not is_uri(location):
        return location
    base = location.rstrip("/")
    if base.endswith(f"{LATEST_SUFFIX}.json"):
        pointer = base
    elif base.endswith(LATEST_SUFFIX):
        pointer = base + ".json"
    else:
        return location
    fs, path = filesystem(pointer)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return location
    try:
        run = json.loads(_read_bytes(fs, path))["run"]
        if not isinstance(run, str) or not run or "/" in run:
            raise ValueError(f"run {run!r} is not a run name")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer}: not a -latest pointer ({type(e).__name__}: {e})") from e
    return f"{pointer.rsplit('/', 1)[0]}/{run}"
