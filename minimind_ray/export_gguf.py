"""Export a trained model as one GGUF file for llama.cpp and ollama, written by the ``gguf`` package
(llama.cpp's own writer), with the tokenizer and its chat template inside.

The layouts are those of the HF export (export.py), as llama.cpp's architectures name them:

* dense, no QK-norm (minimind2)  -> ``llama``. llama.cpp's ``llama`` rotates adjacent pairs of each head's
  dims (its "normal" RoPE), MiniMind the two halves (``rotate_half``), so each head's rows of ``q_proj`` and
  ``k_proj`` are reordered: the pair (j, j + head_dim/2) becomes (2j, 2j + 1). Attention scores, and so
  the logits, are unchanged: q and k get the same order.
* dense, QK-norm (minimind3)     -> ``qwen3`` (half-split RoPE, ``attn_q_norm``/``attn_k_norm``), as is.
* MoE, minimind3 layout          -> ``qwen3moe``: each layer's experts stacked into one tensor per projection
  (``ffn_gate_exps``...), the router as ``ffn_gate_inp``; llama.cpp renormalises the top-k weights, so
  ``norm_topk_prob`` must be on (MiniMind's default).
* MoE, minimind2 layout          -> refused, see :func:`gguf_architecture`.

Tensor names come from gguf's own map of each architecture (a tensor it has no place for is an error, not a
silent drop). 2-D weights are written as float16 (``dtype``) or float32; norms always as float32, as
llama.cpp's converter writes them. A tied ``lm_head`` is left out: llama.cpp reads ``token_embd`` for it.

The tokenizer: MiniMind's tokenizers (and the built-in one) are byte-level BPE with GPT-2's pre-tokenizer,
which is GGUF's ``gpt2`` model with pre-tokenizer ``gpt-2``: the vocabulary in id order, the merges, special
tokens as control tokens (``<think>``-like added tokens as user-defined), bos/eos/pad from
tokenizer_config.json and no automatic bos (MiniMind's templates write ``<|im_start|>`` themselves).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from minimind_ray.model.config import ModelConfig, holds_lora
from minimind_ray.fsio import atomic_write
from minimind_ray.model.minimind import clean_state_dict, unwrap_model
from minimind_ray.model.rope import YARN

DTYPES = {torch.float16: np.float16, torch.float32: np.float32}
# MiniMind's tokenizers: <|endoftext|> = 0 (pad), <|im_start|> = 1 (bos), <|im_end|> = 2 (eos)
MINIMIND_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def gguf_architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture whose forward is this model's, or NotImplementedError saying why none is."""
    if not cfg.use_moe:
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.generation == "minimind2":
        raise NotImplementedError(
            "GGUF export of a minimind2-layout MoE is not supported: llama.cpp has no architecture that computes "
            "it. Its shared experts are added unweighted and its top-k weights renormalised; llama.cpp's "
            "deepseek (v1) adds shared experts but does not renormalise, qwen2moe gates its shared expert by a "
            "sigmoid, and qwen3moe/mixtral have no shared experts. Export the MiniMind .pth or the HF folder's "
            "dense models instead.")
    if not cfg.qk_norm:
        raise NotImplementedError("GGUF export of a minimind3-layout MoE needs qk_norm=True (llama.cpp's qwen3moe "
                                  "applies QK-norm)")
    if not cfg.norm_topk_prob:
        raise NotImplementedError("GGUF export of an MoE needs norm_topk_prob=True: llama.cpp's qwen3moe "
                                  "renormalises the top-k routing weights")
    return "qwen3moe"


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads * head_dim, in) rows of q_proj/k_proj from MiniMind's half-split RoPE order to llama.cpp's
    adjacent pairs: within each head, row j and row j + head_dim/2 become rows 2j and 2j + 1."""
    out, inp = w.shape
    head_dim = out // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, inp).transpose(1, 2).reshape(out, inp)


def gguf_tensors(model: nn.Module, dtype: torch.dtype = torch.float16) -> Dict[str, np.ndarray]:
    """{GGUF tensor name: the array written}: the model's weights in llama.cpp's layout and names."""
    import gguf

    raw = unwrap_model(model)
    if holds_lora(raw.state_dict()):
        raise ValueError("model has LoRA adapters: merge_lora(model) before exporting to GGUF")
    if dtype not in DTYPES:
        raise ValueError(f"GGUF export dtype {dtype} is not one of {', '.join(map(str, DTYPES))}")
    cfg: ModelConfig = raw.cfg
    arch = gguf_architecture(cfg)
    sd = {k: v.detach().float().cpu() for k, v in clean_state_dict(raw.state_dict()).items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if arch == "llama":
        for i in range(cfg.num_hidden_layers):
            for proj, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
                key = f"model.layers.{i}.self_attn.{proj}.weight"
                sd[key] = interleave_rope_rows(sd[key], heads)
    if arch == "qwen3moe":  # experts {j} of each projection -> one (num_experts, out, in) tensor
        for i in range(cfg.num_hidden_layers):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                prefix = f"model.layers.{i}.mlp.experts."
                sd[f"{prefix}{proj}.weight"] = torch.stack(
                    [sd.pop(f"{prefix}{j}.{proj}.weight") for j in range(cfg.num_experts)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out = {}
    for key, t in sd.items():
        name = names.get_name(key, try_suffixes=(".weight",))
        if name is None:
            raise ValueError(f"GGUF {arch}: no place for tensor {key!r} in llama.cpp's layout")
        out[name] = t.numpy().astype(DTYPES[dtype] if t.dim() > 1 else np.float32)
    return out


# --------------------------------------------------------------------------- tokenizer


def _byte_level_bpe(tok: dict, where: Path) -> None:
    """Refuse tokenizers GGUF's gpt2 model would tokenize differently (naming the file)."""
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") != "BPE" or [p.get("type") for p in pres] != ["ByteLevel"] or \
            not pres[0].get("use_regex", True) or pres[0].get("add_prefix_space") or tok.get("normalizer"):
        raise ValueError(f"{where}: GGUF export needs a byte-level BPE tokenizer with GPT-2's pre-tokenizer and no "
                         f"normalizer (MiniMind's); this one has model {model.get('type')!r}, pre-tokenizer "
                         f"{[p.get('type') for p in pres]}, normalizer {tok.get('normalizer')}")


def gguf_vocab(tokenizer_dir, vocab_size: int) -> dict:
    """tokens (id order, padded to the model's vocab_size), token types, merges, special ids, chat template."""
    import gguf

    tokenizer_dir = Path(tokenizer_dir)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    _byte_level_bpe(tok, tokenizer_dir / "tokenizer.json")
    by_id: Dict[int, Tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in tok["model"]["vocab"].items()}
    for a in tok.get("added_tokens", []):
        by_id[a["id"]] = (a["content"], gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    if max(by_id) >= vocab_size:
        raise ValueError(f"{tokenizer_dir}: token id {max(by_id)} does not fit the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]  # rows no token uses
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    config_file = tokenizer_dir / "tokenizer_config.json"
    tcfg = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    template = tcfg.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").exists():
        template = (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    ids = {t: i for i, (t, _) in by_id.items()}
    special = dict(MINIMIND_SPECIAL_IDS)
    for role in ("bos", "eos", "pad"):  # the tokens tokenizer_config.json names, by id
        token = tcfg.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            special[f"{role}_token_id"] = ids[token]
    return {"tokens": [t for t, _ in tokens], "types": [int(k) for _, k in tokens], "merges": merges,
            "special": special, "chat_template": template}


# --------------------------------------------------------------------------- the file


def _write(path: str, cfg: ModelConfig, arch: str, tensors: Dict[str, np.ndarray], vocab: dict, dtype, name: str):
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == torch.float16 else gguf.LlamaFileType.ALL_F32)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.inference_rope_scaling and cfg.max_position_embeddings > YARN["original_max_position_embeddings"]:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # llama.cpp's own YaRN (not checked against ours)
        w.add_rope_scaling_factor(YARN["factor"])
        w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    s = vocab["special"]
    w.add_bos_token_id(s["bos_token_id"])
    w.add_eos_token_id(s["eos_token_id"])
    w.add_pad_token_id(s["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if vocab["chat_template"]:
        w.add_chat_template(vocab["chat_template"])
    for tensor_name, array in tensors.items():
        w.add_tensor(tensor_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def export_gguf(model: nn.Module, tokenizer_dir, out_path, dtype: torch.dtype = torch.float16,
                name: Optional[str] = None) -> str:
    """Write ``out_path`` (a .gguf file) for llama.cpp / ollama: never half a file (temp name, then rename)."""
    raw = unwrap_model(model)
    cfg: ModelConfig = raw.cfg
    arch = gguf_architecture(cfg)  # the reason comes before any work
    missing = [f for f in ("tokenizer.json",) if not (Path(tokenizer_dir) / f).exists()]
    if missing:
        raise FileNotFoundError(f"tokenizer folder {tokenizer_dir} lacks {missing}")
    tensors = gguf_tensors(raw, dtype)
    vocab = gguf_vocab(tokenizer_dir, cfg.vocab_size)
    label = name or f"minimind-{cfg.preset}"
    atomic_write(out_path, lambda tmp: _write(tmp, cfg, arch, tensors, vocab, dtype, label))
    return str(out_path)


def read_gguf_tensors(path) -> Dict[str, np.ndarray]:
    """{name: array} as gguf's reader returns them (numpy shapes, the writer's row-major order)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: Dict[str, np.ndarray] = {}
    for t in reader.tensors:
        out[t.name] = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
    return out


def token_strings(path) -> List[str]:
    """The vocabulary a GGUF file carries (tokenizer.ggml.tokens), for checks."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
