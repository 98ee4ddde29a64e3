"""Find and load trained weights from anywhere a user may point: no training code runs.

Accepted sources:
  * a MiniMind ``.pth`` (ours or MiniMind's own; the architecture is inferred from the
    tensor shapes, or given with ``preset``);
  * a checkpoint directory (``checkpoint_*`` with COMPLETE.json and meta.json);
  * a Ray Train run directory (its newest complete checkpoint);
  * a storage URI of any of these (``s3://...``, ``gs://...``, ``file://...``): read through
    pyarrow.fs file by file, with nothing copied to local disk.
A checkpoint is verified once per load.
"""
from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Dict, Optional

import pyarrow.fs as pafs
import torch

from minimind_ray.config import ModelConfig, RunConfig
from minimind_ray.fsio import filesystem
from minimind_ray.model.minimind import clean_state_dict
from minimind_ray.model.presets import PRESETS, preset_values
from minimind_ray.store.checkpoint import (CheckpointMeta, StoredCheckpoint, is_checkpoint, newest_complete,
                                           open_checkpoint)


@dataclass
class LoadedWeights:
    state_dict: Dict[str, torch.Tensor]
    model_cfg: ModelConfig
    run_cfg: Optional[RunConfig]  # present when the source was a checkpoint
    checkpoint: Optional[StoredCheckpoint]  # the verified checkpoint it came from
    meta: Optional[CheckpointMeta] = None


def resolve_checkpoint(source: str) -> Optional[StoredCheckpoint]:
    """The verified checkpoint a source names (itself, or a run directory's newest complete one),
    or None when the source is a file."""
    fs, path = filesystem(source)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return None
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{source}: no such file or directory")
    if is_checkpoint(source):
        return open_checkpoint(source)
    latest = newest_complete(source)
    if latest is None:
        raise FileNotFoundError(f"{source}: no complete checkpoint_* directory and not a .pth file")
    return latest


def infer_model_config(sd: Dict[str, torch.Tensor]) -> ModelConfig:
    """The preset whose parameter shapes match this state dict exactly."""
    from minimind_ray.model.minimind import build_model

    want = {k: tuple(v.shape) for k, v in sd.items()}
    for name in PRESETS:
        mc = ModelConfig(**preset_values(name))
        with torch.device("meta"):
            m = build_model(mc)
        base = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        if all(want.get(k) == s for k, s in base.items()) and all(k in base or ".lora." in k for k in want):
            return mc
    raise ValueError("the weights match no known preset; pass --preset (see minimind_ray/model/presets.py)")


def _read_file(source: str) -> Dict[str, torch.Tensor]:
    fs, path = filesystem(source)
    with fs.open_input_stream(path) as f:
        data = f.read()
    return clean_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def load_weights(source: str, preset: Optional[str] = None) -> LoadedWeights:
    ck = resolve_checkpoint(str(source))
    if ck is not None:
        meta = ck.meta()
        run_cfg = meta.run_config()
        return LoadedWeights(ck.model_state(), run_cfg.model, run_cfg, ck, meta)
    sd = _read_file(str(source))
    mc = ModelConfig(**preset_values(preset)) if preset else infer_model_config(sd)
    return LoadedWeights(sd, mc, None, None)


def apply_weights(model, lw: LoadedWeights, merge_lora: bool = True):
    """Load ``lw`` into a model built from its config. LoRA adapters in the weights are attached
    (with the run's LoRA config, or the rank read off the tensors), then folded in unless ``merge_lora`` is False."""
    from minimind_ray.config import LoRAConfig
    from minimind_ray.model.lora import apply_lora, merge_lora as merge

    sd = {k: v.float() for k, v in lw.state_dict.items()}
    if any(".lora." in k for k in sd):
        lcfg = lw.run_cfg.train.lora if lw.run_cfg else LoRAConfig(
            rank=next(v.shape[0] for k, v in sd.items() if k.endswith("lora.A.weight")))
        apply_lora(model, lcfg)
        model.load_state_dict(sd, strict=True)
        return merge(model) if merge_lora else model
    model.load_state_dict(sd, strict=True)
    return model


def load_model_weights(model: torch.nn.Module, source: str, strict: bool = True) -> None:
    """Weights from any source into an existing model (``train.init_from``, a DPO reference, a
    distillation teacher). LoRA adapters in the source are merged first when ``model`` has none."""
    from minimind_ray.store.pth import load_pth

    lw = load_weights(source, preset=model.cfg.preset)
    sd = lw.state_dict
    if any(".lora." in k for k in sd) and not any(".lora." in k for k in model.state_dict()):
        sd = apply_weights(copy.deepcopy(model), lw, merge_lora=True).state_dict()
    load_pth(model, sd, strict=strict)


def build_inference_model(source: str, preset: Optional[str] = None, merge_lora: bool = True,
                          device: str = "cpu"):
    """(model in eval mode, LoadedWeights). LoRA adapters in the weights are merged (or kept)."""
    from minimind_ray.model.minimind import build_model

    lw = load_weights(source, preset)
    model = apply_weights(build_model(lw.model_cfg), lw, merge_lora=merge_lora)
    return model.to(device).eval(), lw
