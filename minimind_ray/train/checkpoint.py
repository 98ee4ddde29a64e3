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

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

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


def verify(ckpt_dir: Path) -> Dict[str, Any]:
    """The COMPLETE record, after checking every listed file is there at its size."""
    ckpt_dir = Path(ckpt_dir)
    marker = ckpt_dir / COMPLETE
    if not marker.exists():
        raise CheckpointError(f"{ckpt_dir}: no {COMPLETE}; the checkpoint was not finished and is not used")
    rec = json.loads(marker.read_text())
    for name, size in rec["files"].items():
        p = ckpt_dir / name
        if not p.exists() or p.stat().st_size != size:
            raise CheckpointError(f"{ckpt_dir}: {name} missing or of the wrong size; checkpoint refused")
    for r in rec["rng_ranks"]:
        if not (ckpt_dir / "rng" / f"rank_{r}.pt").exists():
            raise CheckpointError(f"{ckpt_dir}: rng/rank_{r}.pt missing; checkpoint refused")
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


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint_* directory of a Ray Train run directory (no Ray needed)."""
    run_dir = Path(run_dir)
    cands = []
    for d in run_dir.glob("checkpoint_*"):
        try:
            rec = verify(d)
        except CheckpointError:
            continue
        cands.append((rec["step"], d))
    return max(cands)[1] if cands else None
