"""Export a trained model as a MiniMind ``.pth`` and as a Hugging Face folder.

The HF folder needs no custom code: MiniMind's dense and minimind3-MoE layouts are
exactly standard architectures, so their weights map one to one (what MiniMind's
``scripts/convert_model.py`` does at 83e52f6 and d65ef2c):

* dense, no QK-norm (minimind2)  -> ``LlamaForCausalLM``
* dense, QK-norm (minimind3)     -> ``Qwen3ForCausalLM``
* MoE, minimind3 layout          -> ``Qwen3MoeForCausalLM``. Experts are written one
  tensor per expert (``mlp.experts.{j}.gate_proj.weight``, the layout of Qwen3-MoE
  checkpoints on the Hub); transformers 5 fuses them into ``gate_up_proj`` /
  ``down_proj`` while loading, and 4.x reads them as they are.
* MoE, minimind2 layout          -> not supported, see :func:`hf_architecture`.

Writing needs only ``torch`` and ``safetensors``; ``transformers`` is only needed to
read the result.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from minimind_ray.config import RunConfig, run_config_of
from minimind_ray.fsio import atomic_write, torch_save_atomic, write_text_atomic
from minimind_ray.model.config import ModelConfig, holds_lora
from minimind_ray.model.lora import ADAPTER_FILE_PREFIX, merge_lora, save_lora
from minimind_ray.model.minimind import clean_state_dict, unwrap_model
from minimind_ray.model.rope import YARN
from minimind_ray.stages import get_stage
from minimind_ray.store.checkpoint import open_checkpoint
from minimind_ray.store.pth import save_pth
from minimind_ray.store.weights import SAFETENSORS_CONFIG_KEY, build_inference_model, model_config_json

# The files of an HF tokenizer folder that travel with the model (the first two are required).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# MiniMind's tokenizers: <|endoftext|> = 0 (pad), <|im_start|> = 1 (bos), <|im_end|> = 2 (eos).
DEFAULT_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# What `export --format` accepts: MiniMind's fp16 .pth, an HF transformers folder, safetensors with MiniMind's keys,
# one GGUF file for llama.cpp / ollama (export_gguf.py).
FORMATS = ("minimind", "hf", "safetensors", "gguf")


def _has_lora(model: nn.Module) -> bool:
    return holds_lora(name for name, _ in model.named_parameters())


def export_minimind_pth(model: nn.Module, out_dir, prefix: str = "pretrain") -> str:
    """Write ``{out_dir}/{prefix}_{hidden_size}[_moe].pth``, MiniMind's trainer naming (a stage's ``export_prefix``).

    A model carrying LoRA adapters is written as MiniMind's LoRA trainer writes it: the
    adapter weights only (``merge_lora`` first for a full model).
    """
    raw = unwrap_model(model)
    cfg: ModelConfig = raw.cfg
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(str(out_dir), f"{prefix}_{cfg.hidden_size}{'_moe' if cfg.use_moe else ''}.pth")
    if _has_lora(raw):
        save_lora(raw, path)
    else:
        save_pth(raw, path)
    return path


# --------------------------------------------------------------------------- Hugging Face


def hf_architecture(cfg: ModelConfig) -> Tuple[str, str]:
    """(transformers class name, model_type) whose forward equals ours, or NotImplementedError saying why not."""
    if not cfg.use_moe:
        return ("Qwen3ForCausalLM", "qwen3") if cfg.qk_norm else ("LlamaForCausalLM", "llama")
    if cfg.generation == "minimind2":
        raise NotImplementedError(
            "HF export of a minimind2-layout MoE is not supported: no transformers class computes it exactly. "
            "It adds its shared experts unweighted, renormalises top-k weights only when k > 1 and has no "
            "QK-norm; Qwen2-MoE scales its shared expert by a learned sigmoid gate, DeepSeek-V2/V3 use MLA "
            "attention, Qwen3-MoE applies QK-norm, and Mixtral/Qwen3-MoE have no shared experts. "
            "Export the MiniMind .pth instead (export_minimind_pth).")
    if not cfg.qk_norm:
        raise NotImplementedError("HF export of a minimind3-layout MoE needs qk_norm=True (Qwen3-MoE applies QK-norm)")
    return "Qwen3MoeForCausalLM", "qwen3_moe"


def _rope_scaling(cfg: ModelConfig) -> Optional[dict]:
    """MiniMind's YaRN as HF's legacy ``rope_scaling``; None when the table is unscaled
    (MiniMind only scales when max_position_embeddings exceeds the original 2048)."""
    if not cfg.inference_rope_scaling or cfg.max_position_embeddings <= YARN["original_max_position_embeddings"]:
        return None
    return {"rope_type": "yarn", **YARN}


def hf_config(cfg: ModelConfig, dtype: torch.dtype, special_ids: Dict[str, int]) -> dict:
    """config.json for :func:`hf_architecture`. RoPE uses the legacy ``rope_theta`` /
    ``rope_scaling`` keys, which transformers 4.x reads and 5.x converts (as MiniMind's converter does)."""
    arch, model_type = hf_architecture(cfg)
    c = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        **special_ids,
    }
    if model_type == "llama":
        c.update(mlp_bias=False, pretraining_tp=1)
    else:
        c.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
    if model_type == "qwen3_moe":
        c.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.aux_loss_alpha,
                 output_router_logits=False)
    return c


def _special_ids(tokenizer_dir: Path) -> Dict[str, int]:
    """bos/eos/pad ids named by tokenizer_config.json, looked up in tokenizer.json; MiniMind's ids otherwise."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tcfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab_model = tok.get("model", {}).get("vocab", {})
    out = dict(DEFAULT_SPECIAL_IDS)
    for field in ("bos", "eos", "pad"):
        token = tcfg.get(f"{field}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            tid = vocab.get(token, vocab_model.get(token) if isinstance(vocab_model, dict) else None)
            if tid is not None:
                out[f"{field}_token_id"] = tid
    return out


def _write_safetensors(raw: nn.Module, path: Path, metadata: Dict[str, str],
                       dtype: Optional[torch.dtype] = None) -> str:
    """The model's clean state dict as safetensors, written to a temp name and renamed. A tied
    lm_head is left out (safetensors cannot hold shared tensors; loaders re-tie it)."""
    from safetensors.torch import save_file

    sd = clean_state_dict(raw.state_dict())
    if raw.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tensors = {k: (v.detach().to(dtype) if dtype else v.detach()).cpu().contiguous() for k, v in sd.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return str(path)


def export_hf(model: nn.Module, tokenizer_dir, out_dir, dtype: Optional[torch.dtype] = None) -> str:
    """Write an HF transformers folder (config.json, model.safetensors, tokenizer files) that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads with no custom code.

    ``dtype``: weight dtype on disk; None keeps the model's. Tied embeddings are
    stored once, as ``model.embed_tokens.weight`` (safetensors cannot hold shared
    tensors; the loader re-ties lm_head from ``tie_word_embeddings``).
    """
    raw = unwrap_model(model)
    if _has_lora(raw):
        raise ValueError("model has LoRA adapters: merge_lora(model) before exporting to HF")
    cfg: ModelConfig = raw.cfg
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"tokenizer folder {tokenizer_dir} lacks {missing}")
    dtype = dtype or next(iter(raw.state_dict().values())).dtype
    config = hf_config(cfg, dtype, _special_ids(tokenizer_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_safetensors(raw, out_dir / "model.safetensors", {"format": "pt"}, dtype)
    write_text_atomic(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return str(out_dir)


# --------------------------------------------------------------------------- from a run


def _export_model(model: nn.Module, out_dir: Path, stage: str, formats, tokenizer_dir: Optional[str],
                  lora: str = "merge") -> Dict[str, str]:
    """Write the requested formats of one in-memory model. LoRA: adapters alone (``lora='separate'``,
    MiniMind's lora_*.pth) or folded into the base weights first (``'merge'``)."""
    if "hf" in formats and tokenizer_dir is None:
        raise ValueError("the HF export needs a tokenizer folder: pass --tokenizer (or drop 'hf' from --format)")
    if "gguf" in formats:  # refused before anything is written: the file would have no model or no tokenizer
        from minimind_ray.export_gguf import gguf_architecture  # lazy: numpy, only when this runs

        if tokenizer_dir is None:
            raise ValueError("the GGUF export carries the tokenizer: pass --tokenizer (or drop 'gguf' from --format)")
        try:
            gguf_architecture(unwrap_model(model).cfg)
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, str] = {}
    if _has_lora(model):
        paths["lora"] = export_minimind_pth(model, out_dir, prefix=ADAPTER_FILE_PREFIX)
        if lora == "separate":
            return paths
        model = merge_lora(model)
    if "minimind" in formats:
        paths["pth"] = export_minimind_pth(model, out_dir, prefix=stage)
    if "safetensors" in formats:  # the ModelConfig travels in the metadata, so the file loads back as it was
        raw = unwrap_model(model)
        paths["safetensors"] = _write_safetensors(raw, out_dir / "model.safetensors", {
            "format": "pt", "layout": "minimind", SAFETENSORS_CONFIG_KEY: model_config_json(raw.cfg)})
    if "hf" in formats:
        try:
            paths["hf"] = export_hf(model, tokenizer_dir, out_dir / "hf", dtype=torch.float16)
        except NotImplementedError as e:
            paths["hf_skipped"] = str(e)
    if "gguf" in formats:
        from minimind_ray.export_gguf import export_gguf  # lazy: numpy, only when this runs

        cfg = unwrap_model(model).cfg
        paths["gguf"] = export_gguf(model, tokenizer_dir, out_dir / f"{stage}_{cfg.hidden_size}"
                                    f"{'_moe' if cfg.use_moe else ''}.gguf", dtype=torch.float16)
    return paths


def export_run_checkpoint(cfg, ckpt_dir: str, out_dir: Path) -> Dict[str, str]:
    """What the driver writes after training: MiniMind .pth + safetensors (+ LoRA weights) of the
    final checkpoint (a local path or URI), named as MiniMind's trainers name them (``full_sft`` for SFT)."""
    model, _ = build_inference_model(str(ckpt_dir), merge_lora=False)
    stage = get_stage(cfg.train.stage).export_prefix
    paths = _export_model(model, Path(out_dir), stage, ("minimind", "safetensors"), None)
    paths.update(export_parts(cfg, ckpt_dir, Path(out_dir), unwrap_model(model).cfg))
    return paths


def export_parts(cfg, ckpt_dir: str, out_dir: Path, model_cfg: ModelConfig) -> Dict[str, str]:
    """The models a stage trains beside the policy, as MiniMind-named fp16 ``.pth`` files (PPO:
    ``ppo_critic_<hidden>[_moe].pth``, the state dict of MiniMind's ``CriticModel``: ``model.*``, ``lm_head``,
    ``value_head``; MiniMind itself keeps it as ``critic_model`` inside its ``ppo_actor_<hidden>_resume.pth``)."""
    parts = get_stage(cfg.train.stage).parts
    if not parts:
        return {}

    stored, paths = open_checkpoint(str(ckpt_dir)), {}
    suffix = f"{model_cfg.hidden_size}{'_moe' if model_cfg.use_moe else ''}"
    for name, prefix in parts:
        path = out_dir / f"{prefix}_{suffix}.pth"
        torch_save_atomic({k: v.to(torch.float16) for k, v in stored.part_state(name).items()}, path)
        paths[name] = str(path)
    return paths


def export_from_source(source: str, out, formats=("minimind", "hf"), preset: Optional[str] = None,
                       tokenizer: Optional[str] = None, lora: str = "merge") -> Dict[str, str]:
    """Export any weights (``.pth``, ``.safetensors``, HF export folder, checkpoint dir, Ray Train run dir or
    storage URI) with no training code running. The tokenizer defaults to the run's own (an HF folder's own)."""
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:  # before any reading: a typo must not export nothing and succeed
        raise ValueError(f"export format(s) {unknown or list(formats)} unknown; choose from {', '.join(FORMATS)}")
    model, lw = build_inference_model(source, preset, merge_lora=False)
    tok_dir = tokenizer or lw.tokenizer_dir
    run_cfg = run_config_of(lw.run_config)  # weights with no run recorded are named as the default stage's
    prefix = get_stage((run_cfg or RunConfig()).train.stage).export_prefix
    if run_cfg is not None:
        if tok_dir is None:
            from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs

            tok_dir = resolve_tokenizer(run_cfg.data.tokenizer, run_cfg.data.cache_dir, run_cfg.model.generation).path
    return _export_model(model, Path(out), prefix, formats, tok_dir, lora=lora)
