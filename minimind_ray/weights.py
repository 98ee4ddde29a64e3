"""Find and load trained weights from anywhere a user may point: no training code runs.

Accepted sources:
  * a MiniMind ``.pth`` (ours or MiniMind's own; the architecture is inferred from the
    tensor shapes, or given with ``preset``);
  * a checkpoint directory (``checkpoint_*`` with COMPLETE.json and meta.json);
  * a Ray Train run directory (its newest complete checkpoint);
  * a storage URI of either (``s3://...``, ``gs://...``), copied locally with pyarrow.fs.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from minimind_ray.config import ModelConfig, RunConfig, from_dict
from minimind_ray.model.presets import PRESETS, preset_values
from minimind_ray.train import checkpoint as ckpt_io


@dataclass
class LoadedWeights:
    state_dict: Dict[str, torch.Tensor]
    model_cfg: ModelConfig
    run_cfg: Optional[RunConfig]  # present when the source was a checkpoint
    checkpoint_dir: Optional[Path]


def _localize(source: str) -> Path:
    """Copy a storage URI to a temp dir (pyarrow.fs understands s3://, gs://, hdfs://, file://)."""
    if "://" not in source:
        return Path(source)
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(source)
    dst = Path(tempfile.mkdtemp(prefix="mmr-weights-"))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        pafs.copy_files(path, str(dst / Path(path).name), source_filesystem=fs)
        return dst / Path(path).name
    pafs.copy_files(path, str(dst), source_filesystem=fs)
    return dst


def _checkpoint_dir(local: Path, source: str) -> Optional[Path]:
    """The verified checkpoint directory a localized source names, or None when it is a bare .pth."""
    if local.is_file():
        return None
    if (local / ckpt_io.COMPLETE).exists():
        ckpt_io.verify(local)
        return local
    latest = ckpt_io.latest_checkpoint(local)  # the newest one that verifies
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


def load_weights(source: str, preset: Optional[str] = None) -> LoadedWeights:
    from minimind_ray.model.minimind import clean_state_dict

    local = _localize(source)  # a URI is copied down once
    ck = _checkpoint_dir(local, source)
    if ck is not None:
        meta = ckpt_io.read_meta(ck)
        run_cfg = from_dict(meta["config"])
        sd = torch.load(ck / ckpt_io.MODEL, map_location="cpu", weights_only=True)
        return LoadedWeights(clean_state_dict(sd), run_cfg.model, run_cfg, ck)
    sd = clean_state_dict(torch.load(local, map_location="cpu", weights_only=True))
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


def build_inference_model(source: str, preset: Optional[str] = None, merge_lora: bool = True,
                          device: str = "cpu"):
    """(model in eval mode, LoadedWeights). LoRA adapters in the weights are merged (or kept)."""
    from minimind_ray.model.minimind import build_model

    lw = load_weights(source, preset)
    model = apply_weights(build_model(lw.model_cfg), lw, merge_lora=merge_lora)
    return model.to(device).eval(), lw
