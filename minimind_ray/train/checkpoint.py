"""Checkpoint layout, atomic writes and validated loads.

A checkpoint directory (one per ``ray.train.report(..., checkpoint=...)``) holds::

    model.pth          the model as a MiniMind state dict (fp32, MiniMind's keys;
                       LoRA runs add MiniMind's ``*.lora.A/B.weight`` keys)
    train_state.pt     optimizer + scheduler state (torch.save, weights_only-loadable)
    meta.json          step, epoch, data-iterator state, world size, MLflow run id, config
    rng/rank_<r>.pt    RNG states of every rank (each rank writes its own)
    COMPLETE.json      written last by rank 0: the file list with sizes

Every rank writes into its own local staging directory; Ray Train uploads them all
into the same storage directory and registers the checkpoint only after every rank
reported. A checkpoint without ``COMPLETE.json``, or whose files do not match it, is
refused by :func:`verify` instead of being loaded half-written.
"""
from __future__ import annotations

import io
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from minimind_ray.model.minimind import clean_state_dict, load_pth

COMPLETE = "COMPLETE.json"
MODEL = "model.pth"
TRAIN_STATE = "train_state.pt"
META = "meta.json"


class CheckpointError(RuntimeError):
    pass


def _atomic_write_bytes(path: Path, write_fn) -> None:
    """Write through a temp file in the same directory, then rename: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def torch_save_atomic(obj: Any, path: Path) -> None:
    _atomic_write_bytes(Path(path), lambda tmp: torch.save(obj, tmp))


def json_save_atomic(obj: Any, path: Path) -> None:
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=str)
    _atomic_write_bytes(Path(path), w)


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available():  # this rank's device only: a restart may see a different set of GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_rank_files(ckpt_dir: Path, rank: int) -> None:
    """What every rank contributes: its RNG state."""
    torch_save_atomic(rng_state(), Path(ckpt_dir) / "rng" / f"rank_{rank}.pt")


def write_rank0_files(ckpt_dir: Path, *, model_state: Dict[str, torch.Tensor], optimizer, scheduler,
                      meta: Dict[str, Any], world_size: int) -> None:
    """Rank 0 writes the shared state, then the COMPLETE marker listing every file."""
    ckpt_dir = Path(ckpt_dir)
    torch_save_atomic({k: v.detach().cpu() for k, v in clean_state_dict(model_state).items()}, ckpt_dir / MODEL)
    torch_save_atomic({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                      ckpt_dir / TRAIN_STATE)
    json_save_atomic(meta, ckpt_dir / META)
    files = {name: (ckpt_dir / name).stat().st_size for name in (MODEL, TRAIN_STATE, META)}
    json_save_atomic({"files": files, "rng_ranks": list(range(world_size)), "step": meta["step"]},
                     ckpt_dir / COMPLETE)


def _fs_path(location) -> Tuple[Any, str]:
    """(pyarrow filesystem, path) for a local path or a storage URI (s3://, gs://, file://, ...)."""
    from minimind_ray.data.sources import filesystem

    return filesystem(str(location))


def _read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def verify(ckpt_dir, deep: bool = False, filesystem=None) -> Dict[str, Any]:
    """The COMPLETE record, after checking every listed file is there at its size.

    ``ckpt_dir`` is a local path or a storage URI (or a path on ``filesystem``). ``deep`` also
    loads every rank's RNG file, whose size rank 0 cannot know: use it for a checkpoint that Ray
    never registered, whose upload a crash may have cut short."""
    import pyarrow.fs as pafs

    fs, root = (filesystem, str(ckpt_dir)) if filesystem is not None else _fs_path(ckpt_dir)
    root = root.rstrip("/")
    try:
        rec = json.loads(_read_bytes(fs, f"{root}/{COMPLETE}"))
    except (FileNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{ckpt_dir}: no readable {COMPLETE}; the checkpoint was not finished and is not used") from e
    names = list(rec["files"])
    infos = fs.get_file_info([f"{root}/{n}" for n in names])
    for name, info in zip(names, infos):
        if info.type != pafs.FileType.File or info.size != rec["files"][name]:
            raise CheckpointError(f"{ckpt_dir}: {name} missing or of the wrong size; checkpoint refused")
    rng_paths = [f"{root}/rng/rank_{r}.pt" for r in rec["rng_ranks"]]
    for r, info in zip(rec["rng_ranks"], fs.get_file_info(rng_paths)):
        if info.type != pafs.FileType.File:
            raise CheckpointError(f"{ckpt_dir}: rng/rank_{r}.pt missing; checkpoint refused")
    if deep:
        for r, p in zip(rec["rng_ranks"], rng_paths):
            try:
                torch.load(io.BytesIO(_read_bytes(fs, p)), map_location="cpu", weights_only=True)
            except Exception as e:  # a truncated zip, a half-copied pickle
                raise CheckpointError(f"{ckpt_dir}: rng/rank_{r}.pt unreadable ({e}); checkpoint refused") from e
    return rec


def read_meta(ckpt_dir: Path) -> Dict[str, Any]:
    return json.loads((Path(ckpt_dir) / META).read_text())


def load_train_state(ckpt_dir: Path) -> Dict[str, Any]:
    return torch.load(Path(ckpt_dir) / TRAIN_STATE, map_location="cpu", weights_only=True)


def load_rng(ckpt_dir: Path, rank: int) -> Optional[Dict[str, Any]]:
    """This rank's RNG state, or None when the checkpoint came from a smaller world."""
    p = Path(ckpt_dir) / "rng" / f"rank_{rank}.pt"
    return torch.load(p, map_location="cpu", weights_only=True) if p.exists() else None


def load_model_weights(model: torch.nn.Module, source: str, strict: bool = True) -> None:
    """Weights from any source ``minimind_ray.weights`` understands (a ``.pth``, a checkpoint or run
    directory, a storage URI). LoRA adapters in the source are merged first when ``model`` has none."""
    import copy

    from minimind_ray.weights import apply_weights, load_weights

    lw = load_weights(source, preset=model.cfg.preset)
    sd = lw.state_dict
    if any(".lora." in k for k in sd) and not any(".lora." in k for k in model.state_dict()):
        sd = apply_weights(copy.deepcopy(model), lw, merge_lora=True).state_dict()
    load_pth(model, sd, strict=strict)


def _checkpoint_dirs(run_dir) -> Tuple[Any, list]:
    """(filesystem, FileInfo of every checkpoint_* directory) of a run directory; none if it is absent."""
    import pyarrow.fs as pafs

    fs, root = _fs_path(run_dir)
    try:
        entries = fs.get_file_info(pafs.FileSelector(root.rstrip("/"), allow_not_found=True))
    except OSError:
        return fs, []
    return fs, [e for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith("checkpoint_")]


def checkpoints_in(run_dir) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint_* directory of a run that has a COMPLETE marker, newest
    first; paths are on the run directory's filesystem. Markers only: :func:`verify` each before use."""
    fs, entries = _checkpoint_dirs(run_dir)
    found = []
    for e in entries:
        try:
            step = json.loads(_read_bytes(fs, f"{e.path}/{COMPLETE}"))["step"]
        except (FileNotFoundError, OSError, ValueError, KeyError):
            continue
        found.append((int(step), e.path))
    return sorted(found, reverse=True)


def _newest_verified(run_dir, deep: bool, newer_than: int) -> Optional[Tuple[int, str]]:
    fs, _ = _fs_path(run_dir)
    for step, path in checkpoints_in(run_dir):
        if step <= newer_than:
            break
        try:
            verify(path, deep=deep, filesystem=fs)
        except CheckpointError:
            continue
        return step, path
    return None


def latest_checkpoint(run_dir, deep: bool = False):
    """The newest complete checkpoint_* directory of a Ray Train run directory (no Ray needed),
    or None. A local ``run_dir`` gives a Path; a URI gives the path on its filesystem."""
    found = _newest_verified(run_dir, deep, -1)
    if found is None:
        return None
    return Path(found[1]) if "://" not in str(run_dir) else found[1]


def restore_point(registered, run_dir: Optional[str], rank: int, world: int):
    """The checkpoint a (re)started worker group resumes from: the newest complete one.

    Ray registers a checkpoint only once its controller has collected every rank's report, which
    it polls for every couple of seconds. A worker killed hard in between (SIGKILL, OOM, a lost
    node) takes the newest checkpoint's registration with it, although every rank had uploaded its
    files; ``ray.train.get_checkpoint()`` then names the one before, and the restart would cost two
    checkpoint intervals. So the run directory is searched too, and a newer checkpoint that
    verifies (every file at its size, every rank's RNG file readable) wins. Rank 0 decides and
    broadcasts, so that every rank restores the same step.
    Ray's ``num_to_keep`` does not know such a checkpoint; :func:`prune_untracked` removes it when the
    run ends."""
    from ray.train import Checkpoint

    choice = None
    if rank == 0 and run_dir:
        reg_step = -1
        if registered is not None:
            try:
                reg_step = verify(registered.path, filesystem=registered.filesystem)["step"]
            except CheckpointError:
                pass  # a newer one may still do; if none does, the restore refuses it with this error
        newer = _newest_verified(run_dir, deep=True, newer_than=reg_step)
        if newer is not None:
            choice = newer[1]
            print(f"[minimind-ray] resuming from {choice} (step {newer[0]}), newer than the "
                  f"checkpoint Ray registered (step {reg_step if reg_step >= 0 else 'none'})", flush=True)
    if world > 1:
        import torch.distributed as dist

        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    if choice is None:
        return registered
    fs, _ = _fs_path(run_dir)
    return Checkpoint(choice, filesystem=fs)


def prune_untracked(run_dir, kept_names) -> List[str]:
    """Delete the checkpoint_* directories of a finished run that Ray does not keep: ones a hard crash
    kept it from registering (see :func:`restore_point`) and uploads a crash cut short. Ray's own
    ``num_to_keep`` pruning only knows what it registered. Returns the names removed."""
    fs, entries = _checkpoint_dirs(run_dir)
    kept, removed = set(kept_names), []
    for e in entries:
        if e.base_name not in kept:
            try:
                fs.delete_dir(e.path)
            except OSError as err:  # storage trouble must not fail a finished run; say so and go on
                print(f"[minimind-ray] could not remove {e.path}: {err}", flush=True)
                continue
            removed.append(e.base_name)
    return sorted(removed)
