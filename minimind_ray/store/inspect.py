"""What a weights source is, read cheaply before a run starts: its kind, whether it is whole, its architecture.

:func:`inspect_weights` answers for every source :mod:`minimind_ray.store.weights` loads (a run directory, a
checkpoint, an HF export folder, a ``.pth``, a ``.safetensors``; a local path or a URI) without loading the tensors
where the source records its architecture: a checkpoint's ``meta.json``, an HF ``config.json``, a safetensors
header (its metadata, or its tensors' shapes). A bare ``.pth`` records nothing: its shapes are read (memory-mapped
when local) and matched to a preset, as loading it would. It is asked before Ray starts (``train.init_from`` when the
run is resolved, config.py:resolve; a stage's other weights in preflight.py): an ``init_from`` of another architecture,
or one with no complete checkpoint, is then refused in a second instead of failing every worker.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, Optional

import pyarrow.fs as pafs
import torch

from minimind_ray.fsio import filesystem, is_uri, join
from minimind_ray.model.config import ModelConfig, holds_lora, is_lora_key
from minimind_ray.model.minimind import resolve_config
from minimind_ray.store.pth import WeightsError, read_pth
from minimind_ray.store.weights import (HF_CONFIG, SAFETENSORS_CONFIG_KEY, is_hf_folder, read_bytes,
                                        infer_model_config, model_config_from_hf, model_config_of, resolve_checkpoint)

# What the weights' tensors are shaped by: two models that differ here cannot load each other's weights
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "intermediate_size", "qk_norm", "use_moe")
MOE_SHAPE_FIELDS = ("num_experts", "n_shared_experts", "moe_intermediate_size")
# What changes every output without a shape of its own: compared only where the weights record it
RECORDED_FIELDS = ("generation", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
MOE_RECORDED_FIELDS = ("num_experts_per_tok", "norm_topk_prob")


@dataclass(frozen=True)
class WeightsInfo:
    source: str
    kind: str  # run | checkpoint | hf | safetensors | pth
    model: ModelConfig  # the architecture: recorded, or the preset the shapes fit
    recorded: bool  # ``model`` is what the weights recorded (not only their shapes)
    lora: bool = False  # holds LoRA adapters (merged when the weights are loaded into a model without them)
    step: Optional[int] = None  # a checkpoint's step
    run_config: Optional[Dict[str, Any]] = None  # the config a checkpoint recorded

    def what(self) -> str:
        """``a run at step 20``: what holds the weights."""
        what = {"run": "a run", "checkpoint": "a checkpoint", "hf": "an HF export", "safetensors": "a safetensors file",
                "pth": "a .pth file"}[self.kind]
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{what}{at}{' with LoRA adapters' if self.lora else ''}"

    def describe(self) -> str:
        """``tiny (hidden 64, 2 layers, 4 heads, vocab 6400), a run at step 20``."""
        return f"{architecture(self.model)}, {self.what()}"


def architecture(m: ModelConfig) -> str:
    """``tiny (hidden 64, 2 layers, 4 heads, vocab 6400)``."""
    r = resolve_config(m)
    moe = f", MoE {r.num_experts}x" if r.use_moe else ""
    named = m.preset if m.preset not in ("hf", "") else "no preset"
    return (f"{named} (hidden {r.hidden_size}, {r.num_hidden_layers} layers, {r.num_attention_heads} heads, "
            f"vocab {r.vocab_size}{moe})")


def differences(want: ModelConfig, have: ModelConfig, recorded: bool) -> Dict[str, tuple]:
    """{field: (this run's, the weights')} of the fields that make ``have``'s weights unusable as ``want``'s: the
    shapes always, what shapes nothing only when the weights recorded it (``recorded``)."""
    a, b = resolve_config(want), resolve_config(have)
    fields = list(SHAPE_FIELDS) + (list(RECORDED_FIELDS) if recorded else [])
    if a.use_moe and b.use_moe:
        fields += list(MOE_SHAPE_FIELDS) + (list(MOE_RECORDED_FIELDS) if recorded else [])
    return {f: (getattr(a, f), getattr(b, f)) for f in fields if getattr(a, f) != getattr(b, f)}


def _safetensors_header(source: str) -> Dict[str, Any]:
    """The JSON header of a safetensors file: its tensors' dtypes and shapes, and its metadata; two small reads."""
    fs, path = filesystem(source)
    with fs.open_input_file(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{source}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise WeightsError(f"{source}: not a safetensors file (a header of {n} bytes)")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise WeightsError(f"{source}: not a safetensors file ({e})") from None


def _shapes(header: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Meta tensors of the header's shapes (no memory): what infer_model_config matches against the presets."""
    return {k: torch.empty(v["shape"], device="meta") for k, v in header.items() if k != "__metadata__"}


def _pth_state(source: str) -> Dict[str, torch.Tensor]:
    """A .pth's tensors: memory-mapped when the file is local (only the shapes are used), else read whole."""
    if not is_uri(source):
        try:
            sd = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            return sd.get("model", sd) if isinstance(sd, dict) and isinstance(sd.get("model"), dict) else sd
        except Exception:  # an old, non-zip .pth cannot be mapped: read it as loading would, with its checks
            pass
    return read_pth(source, read_bytes(source))


def inspect_weights(source: str) -> WeightsInfo:
    """The :class:`WeightsInfo` of a source; FileNotFoundError, CheckpointError or WeightsError (each naming the
    source) when it is not there, not whole, or no weights this project can load."""
    source = str(source)
    fs, path = filesystem(source)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{source}: no such file or directory")
    if info.type == pafs.FileType.Directory and is_hf_folder(source):
        hf = json.loads(read_bytes(join(source, HF_CONFIG)))
        return WeightsInfo(source, "hf", model_config_from_hf(hf, join(source, HF_CONFIG)), recorded=True)
    if info.type == pafs.FileType.Directory:
        ck = resolve_checkpoint(source)  # verified: every listed file there at its size
        meta = ck.meta()
        kind = "checkpoint" if ck.location.rstrip("/") == source.rstrip("/") else "run"
        lora = holds_lora(_checkpoint_keys(ck))
        return WeightsInfo(source, kind, model_config_of(meta.config), recorded=True, lora=lora, step=meta.step,
                           run_config=meta.config)
    if source.endswith(".safetensors"):
        header = _safetensors_header(source)
        recorded = (header.get("__metadata__") or {}).get(SAFETENSORS_CONFIG_KEY)
        shapes = _shapes(header)
        lora = holds_lora(shapes)
        if recorded:
            known = {f.name for f in dataclasses.fields(ModelConfig)}
            mc = ModelConfig(**{k: v for k, v in json.loads(recorded).items() if k in known})
            return WeightsInfo(source, "safetensors", mc, recorded=True, lora=lora)
        return WeightsInfo(source, "safetensors", _infer(shapes, source), recorded=False, lora=lora)
    sd = _pth_state(source)
    return WeightsInfo(source, "pth", _infer(sd, source), recorded=False, lora=holds_lora(sd))


def _infer(sd: Dict[str, torch.Tensor], source: str) -> ModelConfig:
    base = {k: v for k, v in sd.items() if not is_lora_key(k)}
    if not base:
        raise WeightsError(f"{source}: holds LoRA adapters only ({len(sd)} '*.lora.*' tensors), no base weights: "
                           f"merge them first (minimind-ray merge-lora) or give the LoRA run's directory")
    return infer_model_config(sd, source)


def _checkpoint_keys(ck) -> list:
    """The weight names of a checkpoint's model.pth, from the zip's index (the tensors are not read) when local."""
    if ck.sharded or is_uri(ck.location):
        return []
    try:
        return list(torch.load(f"{ck.path}/model.pth", map_location="cpu", weights_only=True, mmap=True))
    except Exception:
        return []
