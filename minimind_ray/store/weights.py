"""Find and load trained weights from anywhere a user may point: no training code runs.

Accepted sources:
  * a MiniMind ``.pth`` (ours or MiniMind's own; the architecture is inferred from the
    tensor shapes, or given with ``preset``);
  * the project's ``.safetensors`` (``export --format safetensors``: MiniMind's keys, a tied
    ``lm_head`` stored once and re-tied here; the model config it records in its metadata);
  * an HF export folder (``export --format hf``: ``config.json`` + ``model.safetensors``, Llama /
    Qwen3 / Qwen3-MoE, whose key names are MiniMind's own; its tokenizer files travel with it);
  * a checkpoint directory (``checkpoint_*`` with COMPLETE.json and meta.json);
  * a Ray Train run directory (its newest complete checkpoint);
  * a storage URI of any of these (``s3://...``, ``gs://...``, ``file://...``): read through
    pyarrow.fs file by file, with nothing copied to local disk.
A checkpoint is verified once per load. Weights that cannot be used as they are (a truncated file,
int8 or other non-float tensors, shapes no preset has) are a :class:`WeightsError` naming the file.

rope_theta and rms_norm_eps shape no tensor, so only what the weights recorded (a checkpoint's
meta.json, an HF config.json, our safetensors metadata) can tell them; a bare ``.pth`` records
nothing and gets its preset's values. When the recorded values differ from the config the loading
side assumed, a warning names the fields, and then: the inference verbs (generate, chat, eval,
export, serve) use the recorded values; training (``train.init_from``, a DPO reference, a
distillation teacher) keeps the run's own config, since changing them there may be deliberate.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import pyarrow.fs as pafs
import torch

from minimind_ray.fsio import filesystem, is_uri, join
from minimind_ray.model.config import LoRAConfig, ModelConfig, holds_lora, is_lora_key
from minimind_ray.model.lora import adapter_rank, apply_lora, merge_adapters, merge_lora as merge
from minimind_ray.model.minimind import build_model, clean_state_dict, unwrap_model
from minimind_ray.model.presets import PRESETS, preset_values
from minimind_ray.model.rope import YARN, rope_tables
from minimind_ray.store.checkpoint import (CheckpointMeta, StoredCheckpoint, follow_latest, is_checkpoint,
                                           newest_complete, open_checkpoint)
from minimind_ray.store.pth import WeightsError, check_float_tensors, load_pth, one_line, read_pth

log = logging.getLogger(__name__)

# ModelConfig fields that no tensor shape reveals but that change every output.
UNSHAPED_FIELDS = ("rope_theta", "rms_norm_eps")
# The metadata key of our .safetensors that holds the ModelConfig as JSON (export.py writes it).
SAFETENSORS_CONFIG_KEY = "minimind_config"
HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"
# HF model_type -> (generation, qk_norm, MoE) of the layouts export.hf_architecture writes
HF_LAYOUTS = {"llama": ("minimind2", False, False), "qwen3": ("minimind3", True, False),
              "qwen3_moe": ("minimind3", True, True)}


@dataclass
class LoadedWeights:
    state_dict: Dict[str, torch.Tensor]
    model_cfg: ModelConfig
    run_config: Optional[Dict[str, Any]]  # the run's recorded config (a plain dict) when the source was a checkpoint
    checkpoint: Optional[StoredCheckpoint]  # the verified checkpoint it came from
    meta: Optional[CheckpointMeta] = None
    recorded: bool = False  # model_cfg is what the weights recorded, not a preset's values
    tokenizer_dir: Optional[str] = None  # an HF export folder's own tokenizer (local folders only)
    source: str = ""  # how to name the weights in a message


def model_config_of(run_config: Dict[str, Any]) -> ModelConfig:
    """The ModelConfig a run recorded (its config's ``model`` section), keeping only the fields this code knows."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in run_config["model"].items() if k in known})


def resolve_checkpoint(source: str) -> Optional[StoredCheckpoint]:
    """The verified checkpoint a source names (itself, or a run directory's newest complete one),
    or None when the source is a file. ``<storage>/<stage>-latest`` in a bucket is its pointer's run."""
    source = follow_latest(source)
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
        raise FileNotFoundError(f"{source}: no complete checkpoint_* directory, no HF export "
                                f"({HF_CONFIG} + {HF_WEIGHTS}) and not a .pth or .safetensors file")
    return latest


def preset_config(name: str) -> ModelConfig:
    try:
        return ModelConfig(**preset_values(name))
    except KeyError as e:  # the message names the preset and lists the known ones
        raise ValueError(f"preset: {e.args[0]}") from None


def infer_model_config(sd: Dict[str, torch.Tensor], where: str = "the weights") -> ModelConfig:
    """The preset whose parameter shapes match this state dict exactly."""
    want = {k: tuple(v.shape) for k, v in sd.items()}
    for name in PRESETS:
        mc = ModelConfig(**preset_values(name))
        with torch.device("meta"):
            m = build_model(mc)
        base = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        if all(want.get(k) == s for k, s in base.items()) and all(k in base or is_lora_key(k) for k in want):
            return mc
    raise WeightsError(f"{where}: the weights match no known preset; pass --preset (see minimind_ray/model/presets.py)")


# --------------------------------------------------------------------------- files


def read_bytes(source: str) -> bytes:
    fs, path = filesystem(source)
    with fs.open_input_stream(path) as f:
        return f.read()


def _retie(sd: Dict[str, torch.Tensor], tied: bool) -> Dict[str, torch.Tensor]:
    """safetensors cannot hold shared tensors, so a tied lm_head is stored once, as the embedding."""
    if tied and "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def _read_safetensors(source: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, the file's metadata): read from bytes, so a URI works like a path."""
    from safetensors.torch import load

    data = read_bytes(source)
    try:
        tensors = load(data)
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])  # the format's own header
    except Exception as e:  # a truncated or foreign file
        raise WeightsError(f"{source}: not a readable safetensors file ({one_line(e)})") from e
    return clean_state_dict(tensors), header.get("__metadata__") or {}


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The ModelConfig of an HF config.json that export.hf_config wrote (the inverse mapping)."""
    layout = HF_LAYOUTS.get(hf.get("model_type"))
    if layout is None:
        raise WeightsError(f"{where}: model_type {hf.get('model_type')!r} is not a layout this project exports "
                           f"({', '.join(HF_LAYOUTS)})")
    generation, qk_norm, moe = layout
    rope_theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))  # transformers 4 / 5
    values = {k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "vocab_size", "intermediate_size", "rms_norm_eps",
                                 "max_position_embeddings", "tie_word_embeddings") if hf.get(k) is not None}
    if rope_theta is not None:
        values["rope_theta"] = float(rope_theta)
    if moe:
        values.update(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                      moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=hf["norm_topk_prob"],
                      aux_loss_alpha=hf.get("router_aux_loss_coef", 0.0), n_shared_experts=0, seq_aux=False)
    try:
        return ModelConfig(preset="hf", generation=generation, qk_norm=qk_norm, use_moe=moe,
                           inference_rope_scaling=bool(hf.get("rope_scaling")), **values)
    except (KeyError, TypeError) as e:
        raise WeightsError(f"{where}: not a config.json of an HF export ({one_line(e)})") from None


def is_hf_folder(source: str) -> bool:
    fs, path = filesystem(source)
    infos = fs.get_file_info([f"{path.rstrip('/')}/{HF_CONFIG}", f"{path.rstrip('/')}/{HF_WEIGHTS}"])
    return all(i.type == pafs.FileType.File for i in infos)


def _read_hf_folder(source: str) -> LoadedWeights:
    where = join(source, HF_CONFIG)
    try:
        hf = json.loads(read_bytes(where))
    except ValueError as e:
        raise WeightsError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise WeightsError(f"{where}: not a JSON object")
    mc = model_config_from_hf(hf, where)
    sd, _ = _read_safetensors(join(source, HF_WEIGHTS))  # MiniMind's keys are HF's for these layouts
    tok = source if not is_uri(source) and _exists(join(source, "tokenizer.json")) else None
    return LoadedWeights(_retie(sd, mc.tie_word_embeddings), mc, None, None, recorded=True, tokenizer_dir=tok)


def _exists(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type == pafs.FileType.File


def _recorded_config(meta: Dict[str, str], where: str) -> Optional[ModelConfig]:
    if SAFETENSORS_CONFIG_KEY not in meta:
        return None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in json.loads(meta[SAFETENSORS_CONFIG_KEY]).items() if k in known})
    except (ValueError, TypeError, AttributeError) as e:
        raise WeightsError(f"{where}: unreadable {SAFETENSORS_CONFIG_KEY!r} metadata ({one_line(e)})") from None


def _read_file(source: str, assumed: Optional[ModelConfig]) -> LoadedWeights:
    """A .pth or .safetensors file. Our safetensors record their ModelConfig; other files get the
    ``assumed`` config, or the preset their shapes fit."""
    if source.endswith(".safetensors"):
        sd, meta = _read_safetensors(source)
        mc = _recorded_config(meta, source)
        if mc is not None:
            return LoadedWeights(_retie(sd, mc.tie_word_embeddings), mc, None, None, recorded=True)
        sd = _retie(sd, True)  # written without the config: tied unless it holds an lm_head
    else:
        sd = read_pth(source, read_bytes(source))
    return LoadedWeights(sd, assumed or infer_model_config(sd, source), None, None)


def _load(source: str, assumed: Optional[ModelConfig]) -> LoadedWeights:
    source = follow_latest(source)  # <storage>/<stage>-latest in a bucket: the run its pointer names
    fs, path = filesystem(source)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{source}: no such file or directory")
    if info.type == pafs.FileType.Directory and is_hf_folder(source):
        lw = _read_hf_folder(source)
    elif info.type == pafs.FileType.Directory:
        ck = resolve_checkpoint(source)
        meta = ck.meta()
        lw = LoadedWeights(ck.model_state(), model_config_of(meta.config), meta.config, ck, meta, recorded=True)
    else:
        lw = _read_file(source, assumed)
    check_float_tensors(lw.state_dict, source)
    lw.source = source
    return lw


def unshaped_differences(recorded: ModelConfig, assumed: ModelConfig) -> Dict[str, Tuple[float, float]]:
    """{field: (recorded, assumed)} for the UNSHAPED_FIELDS that differ."""
    return {f: (getattr(recorded, f), getattr(assumed, f)) for f in UNSHAPED_FIELDS
            if getattr(recorded, f) != getattr(assumed, f)}


def load_weights(source: str, preset: Optional[str] = None) -> LoadedWeights:
    """Weights for an inference verb. ``preset`` is for a bare .pth; weights that record their own
    config are built with it, and a ``preset`` whose rope_theta/rms_norm_eps differ is warned about."""
    source = str(source)
    assumed = preset_config(preset) if preset else None  # an unknown preset fails before any reading
    lw = _load(source, assumed)
    if assumed is not None and lw.recorded:
        diff = unshaped_differences(lw.model_cfg, assumed)
        if diff:
            log.warning("%s: using the values the weights were trained with, not preset %r's: %s", source, preset,
                        ", ".join(f"model.{f}={r!r} (preset: {a!r})" for f, (r, a) in diff.items()))
    return lw


def recorded_adapters(lw: LoadedWeights) -> Optional[Dict[str, Any]]:
    """The settings of the LoRA adapters the weights' run put on its model, as its checkpoint recorded them:
    meta.json's ``adapters`` (what its stage's record said, stages/stage.py:Stage.adapters); in a checkpoint written
    before meta.json held them, its stage's own section (``train.<stage>``: the one stage that put adapters on a model
    keeps them there). None: not a checkpoint."""
    if lw.meta is not None and lw.meta.adapters is not None:
        return lw.meta.adapters
    train = (lw.run_config or {}).get("train", {})
    return train.get(train.get("stage"))


def apply_weights(model, lw: LoadedWeights, merge_lora: bool = True):
    """Load ``lw`` into a model built from its config. LoRA adapters in the weights are attached
    (with the settings their run recorded, or the rank read off the tensors), then folded in unless ``merge_lora`` is
    False."""
    sd = {k: v.float() for k, v in lw.state_dict.items()}
    has_lora = holds_lora(sd)
    if has_lora:
        recorded = recorded_adapters(lw)
        lcfg = LoRAConfig(**recorded) if recorded else LoRAConfig(rank=adapter_rank(sd, lw.source or "weights"))
        apply_lora(model, lcfg)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # missing/unexpected keys or other shapes: weights of another architecture
        raise WeightsError(f"{lw.source or 'weights'}: do not fit model preset {lw.model_cfg.preset!r}: "
                           f"{' '.join(str(e).split())[:400]}") from None
    return merge(model) if has_lora and merge_lora else model


def load_model_weights(model: torch.nn.Module, source: str, strict: bool = True) -> None:
    """Weights from any source into an existing model (``train.init_from``, a DPO reference, a
    distillation teacher). LoRA adapters in the source are merged first when ``model`` has none.
    The model keeps its own config; recorded rope_theta/rms_norm_eps that differ are warned about."""
    lw = _load(str(source), assumed=model.cfg)
    diff = unshaped_differences(lw.model_cfg, model.cfg) if lw.recorded else {}
    if diff:
        log.warning("%s: trained with other settings than this model's, which are kept: %s", source,
                    ", ".join(f"model.{f}={a!r} (the weights were trained with {r!r})" for f, (r, a) in diff.items()))
    sd = lw.state_dict
    if holds_lora(sd) and not holds_lora(model.state_dict()):
        sd = apply_weights(copy.deepcopy(model), lw, merge_lora=True).state_dict()
    load_pth(model, sd, strict=strict)


def build_inference_model(source: str, preset: Optional[str] = None, merge_lora: bool = True,
                          device: str = "cpu", rope_scaling: Optional[dict] = None):
    """(model in eval mode, LoadedWeights). LoRA adapters in the weights are merged (or kept).
    ``rope_scaling`` (from :func:`rope_scaling_spec`): YaRN on or off at inference; None = as the weights record."""
    lw = load_weights(source, preset)
    model = apply_weights(build_model(lw.model_cfg), lw, merge_lora=merge_lora)
    if rope_scaling is not None:
        set_rope_scaling(model, rope_scaling)
    return model.to(device).eval(), lw


# --------------------------------------------------------------------------- RoPE scaling at inference

ROPE_SCALING_TYPES = ("yarn", "none")


def rope_scaling_spec(kind: Optional[str], factor: Optional[float] = None,
                      original_max_position_embeddings: Optional[int] = None) -> Optional[dict]:
    """What the inference verbs' ``--rope-scaling`` means, in MiniMind's own ``rope_scaling`` keys.

    ``yarn``: MiniMind's ``inference_rope_scaling`` (YaRN, ``factor`` 16 over ``original_max_position_embeddings``
    2048, beta_fast 32, beta_slow 1, attention_factor 1), either number replaceable; ``none``: plain RoPE even
    where the weights recorded YaRN; None: the weights' own setting. A ValueError names the flag at fault."""
    if kind is None:
        if factor is not None or original_max_position_embeddings is not None:
            raise ValueError("--factor/--original-max-position-embeddings need --rope-scaling yarn")
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"--rope-scaling: {kind!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
    if kind == "none":
        if factor is not None or original_max_position_embeddings is not None:
            raise ValueError("--factor/--original-max-position-embeddings only apply to --rope-scaling yarn")
        return {"type": "none"}

    spec = {"type": "yarn", **YARN}
    if factor is not None:
        if not factor >= 1:
            raise ValueError(f"--factor: must be >= 1 (the context is stretched by it), got {factor}")
        spec["factor"] = float(factor)
    if original_max_position_embeddings is not None:
        if original_max_position_embeddings < 1:
            raise ValueError(f"--original-max-position-embeddings: must be >= 1, got {original_max_position_embeddings}")
        spec["original_max_position_embeddings"] = int(original_max_position_embeddings)
    return spec


def set_rope_scaling(model, spec: dict):
    """Rebuild the model's RoPE tables for ``spec`` (:func:`rope_scaling_spec`), in place; returns the model.

    The tables are the model's only position-dependent state, so this is all YaRN changes (MiniMind builds
    them the same way when ``inference_rope_scaling`` is set). ``model.cfg.inference_rope_scaling`` follows,
    and ``model.rope_scaling`` keeps the numbers used (None = plain RoPE). As in MiniMind, YaRN changes
    nothing unless the table (max_position_embeddings) is longer than the original context."""
    if not isinstance(spec, dict) or "type" not in spec:  # e.g. a Serve config file's rope_scaling
        raise ValueError(f"rope_scaling: {spec!r} is not a mapping with a 'type' (yarn or none)")
    spec = rope_scaling_spec(spec["type"], spec.get("factor"), spec.get("original_max_position_embeddings"))
    raw = unwrap_model(model)
    yarn = None if spec["type"] == "none" else {k: v for k, v in spec.items() if k != "type"}
    cfg = raw.cfg
    if yarn is not None and cfg.max_position_embeddings <= yarn["original_max_position_embeddings"]:
        raise ValueError(f"--original-max-position-embeddings {yarn['original_max_position_embeddings']} is not "
                         f"below the model's max_position_embeddings {cfg.max_position_embeddings}: YaRN would "
                         f"change nothing")
    m = raw.model
    cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, yarn)
    m.freqs_cos.copy_(cos.to(m.freqs_cos.dtype))
    m.freqs_sin.copy_(sin.to(m.freqs_sin.dtype))
    raw.cfg = dataclasses.replace(cfg, inference_rope_scaling=yarn is not None)
    raw.rope_scaling = yarn
    return model


def model_config_json(cfg: ModelConfig) -> str:
    """What our .safetensors records under SAFETENSORS_CONFIG_KEY."""
    return json.dumps(dataclasses.asdict(cfg))


def merge_lora_file(base: str, lora: str, out: str, preset: Optional[str] = None, alpha: Optional[float] = None) -> str:
    """``minimind-ray merge-lora``: the base weights with a file of adapters (MiniMind's lora_*.pth) folded in, saved
    as a MiniMind .pth at ``out``."""
    from minimind_ray.store.pth import save_pth  # lazy: only the merge-lora verb writes one

    model, _ = build_inference_model(base, preset, merge_lora=False)
    save_pth(merge_adapters(model, read_pth(lora), alpha, f"--lora {lora}"), out)
    return out

