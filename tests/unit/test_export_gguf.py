"""GGUF export (``export --format gguf``): read back with gguf's own reader, every tensor equals the model's
weight in llama.cpp's layout (derived here independently), the metadata and tokenizer are the model's and
MiniMind's, the q/k row order keeps attention scores under llama.cpp's adjacent-pair RoPE, and layouts
llama.cpp cannot compute are refused with the reason. Running the file in llama.cpp: tests/soak/test_gguf.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.model.config import LoRAConfig
from minimind_ray.export_gguf import export_gguf, read_gguf_tensors, token_strings
from minimind_ray.model.lora import apply_lora
from minimind_ray.model.minimind import build_model
from minimind_ray.model.rope import rope_tables
from minimind_ray.model.presets import preset_values
from minimind_ray.store.pth import save_pth
from tests.conftest import minimind_tokenizer_dir

torch.set_num_threads(2)


def model(preset: str, seed: int = 0, **overrides):
    return build_model(ModelConfig(**{**preset_values(preset), **overrides}), seed=seed).eval()


def adjacent_pair_rows(head_dim: int, n_heads: int) -> list:
    """Row order llama.cpp's llama needs: new row 2j of a head is old row j, new row 2j+1 is old row j + hd/2."""
    half = head_dim // 2
    return [h * head_dim + (j // 2) + (j % 2) * half for h in range(n_heads) for j in range(head_dim)]


def expected_tensors(m, arch: str):
    """{gguf name: array} written out by hand from the model's state dict (fp16 matrices, fp32 norms)."""
    c, sd = m.cfg, {k: v.detach().float() for k, v in m.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q = q[adjacent_pair_rows(c.head_dim, c.num_attention_heads)]
            k = k[adjacent_pair_rows(c.head_dim, c.num_key_value_heads)]
        out.update({b + "attn_q.weight": q, b + "attn_k.weight": k, b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                    b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                    b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
                    b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
        if arch != "llama":
            out[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if arch == "qwen3moe":
            out[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
            for proj, name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                out[b + name + ".weight"] = torch.stack([sd[f"{p}mlp.experts.{j}.{proj}.weight"]
                                                         for j in range(c.num_experts)])
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                out[b + name + ".weight"] = sd[p + f"mlp.{proj}.weight"]
    return {n: t.numpy().astype(np.float16 if t.dim() > 1 else np.float32) for n, t in out.items()}


@pytest.mark.parametrize("preset,arch,generation,yarn", [
    ("tiny", "llama", "minimind2", False), ("tiny3", "qwen3", "minimind3", False),
    ("tiny3-moe", "qwen3moe", "minimind3", False), ("tiny3", "qwen3", "minimind3", True)])
def test_gguf_round_trip_every_tensor_and_the_tokenizer(tmp_path, preset, arch, generation, yarn):
    import gguf

    from minimind_ray.model.minimind import YARN

    tok_dir = minimind_tokenizer_dir(generation)
    m = model(preset, inference_rope_scaling=yarn)
    path = export_gguf(m, tok_dir, tmp_path / "m.gguf")
    got, want = read_gguf_tensors(path), expected_tensors(m, arch)
    assert sorted(got) == sorted(want)  # no tensor missing, none extra (the tied lm_head is token_embd)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape and np.array_equal(got[name], w), name
    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields[key]
        return bytes(f.parts[f.data[0]]).decode() if f.types[0] == gguf.GGUFValueType.STRING else f.parts[f.data[0]][0]

    def array(key):
        f = r.fields[key]
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]

    c = m.cfg
    assert field("general.architecture") == arch
    assert (field(f"{arch}.block_count"), field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count"),
            field(f"{arch}.attention.head_count_kv"), field(f"{arch}.context_length"),
            field(f"{arch}.feed_forward_length")) == (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                                        c.num_key_value_heads, c.max_position_embeddings,
                                                        c.intermediate_size)
    assert field(f"{arch}.rope.freq_base") == pytest.approx(c.rope_theta)
    assert field(f"{arch}.rope.dimension_count") == c.head_dim == c.hidden_size // c.num_attention_heads
    scaling = {k for k in r.fields if k.startswith(f"{arch}.rope.scaling.")}
    if yarn:  # llama.cpp's YaRN with MiniMind's factor over its original context (model/rope.py:YARN)
        assert (field(f"{arch}.rope.scaling.type"), field(f"{arch}.rope.scaling.factor"),
                field(f"{arch}.rope.scaling.original_context_length")) == (
                    "yarn", YARN["factor"], YARN["original_max_position_embeddings"])
        assert c.max_position_embeddings > YARN["original_max_position_embeddings"]
    else:
        assert not scaling, scaling
    assert field(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps)
    if arch == "qwen3moe":
        assert (field("qwen3moe.expert_count"), field("qwen3moe.expert_used_count")) == (c.num_experts,
                                                                                         c.num_experts_per_tok)
    hf_tok = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {i: t for t, i in hf_tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in hf_tok["added_tokens"]}
    assert token_strings(path) == [vocab[i] for i in range(6400)]
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id"),
            field("tokenizer.ggml.padding_token_id")) == (1, 2, 0)
    assert field("tokenizer.chat_template") == json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf_tok["model"]["merges"]]
    assert array("tokenizer.ggml.merges") == merges and len(merges) > 6000 - 256  # every merge, in rank order
    # token types: MiniMind's special tokens are control tokens, its other added tokens user-defined, the rest
    # normal; ids no token uses (none in MiniMind's 6400) would be unused
    added = {a["id"]: a for a in hf_tok["added_tokens"]}
    want_types = [(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
                  if i in added else gguf.TokenType.NORMAL for i in range(6400)]
    assert array("tokenizer.ggml.token_type") == [int(t) for t in want_types]
    assert [vocab[i] for i in range(6400) if want_types[i] == gguf.TokenType.CONTROL][:3] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_the_llama_row_order_keeps_attention_scores_under_adjacent_pair_rope():
    """llama.cpp's llama rotates dims (2j, 2j+1) together; MiniMind rotates (j, j + hd/2). Scores of the
    reordered q/k under the former equal those of the original q/k under the latter, at every position."""
    hd, heads, T = 16, 4, 40
    cos, sin = rope_tables(hd, T, 1e6)  # (T, hd), the model's own half-split tables
    q, k = torch.randn(T, heads, hd, dtype=torch.float64), torch.randn(T, heads, hd, dtype=torch.float64)

    def half_split(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos[:, None].double() + torch.cat([-x2, x1], -1) * sin[:, None].double()

    def adjacent(x):  # angle of pair j = that of half-split dim j
        c, s = cos[:, None, : hd // 2].double(), sin[:, None, : hd // 2].double()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * c - odd * s, even * s + odd * c], -1).flatten(-2)

    order = adjacent_pair_rows(hd, 1)
    want = torch.einsum("thd,shd->hts", half_split(q), half_split(k))
    got = torch.einsum("thd,shd->hts", adjacent(q[..., order]), adjacent(k[..., order]))
    assert torch.allclose(got, want, atol=1e-10)
    assert not torch.allclose(torch.einsum("thd,shd->hts", adjacent(q), adjacent(k)), want, atol=1e-3)  # control


def test_layouts_llama_cpp_cannot_compute_are_refused_with_the_reason(tmp_path):
    from minimind_ray.export import export_from_source

    tok_dir = minimind_tokenizer_dir("minimind2")
    save_pth(model("tiny-moe"), str(tmp_path / "moe.pth"))
    with pytest.raises(ValueError, match="minimind2-layout MoE is not supported: llama.cpp has no architecture"):
        export_from_source(str(tmp_path / "moe.pth"), tmp_path / "out", formats=("minimind", "gguf"),
                           tokenizer=str(tok_dir))
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(NotImplementedError, match="norm_topk_prob=True"):
        export_gguf(model("tiny3-moe", norm_topk_prob=False), minimind_tokenizer_dir("minimind3"), tmp_path / "x.gguf")
    lora = model("tiny")
    apply_lora(lora, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="merge_lora"):
        export_gguf(lora, tok_dir, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_export_verb_writes_the_gguf_beside_the_pth(tmp_path, capsys):
    from minimind_ray.cli import main

    save_pth(model("tiny"), str(tmp_path / "tiny.pth"))
    tok_dir = minimind_tokenizer_dir("minimind2")
    assert main(["export", str(tmp_path / "tiny.pth"), "--out", str(tmp_path / "out"), "--format", "minimind,gguf",
                 "--tokenizer", str(tok_dir)]) == 0
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert printed["gguf"] == str(tmp_path / "out" / "pretrain_64.gguf") and printed["pth"].endswith("pretrain_64.pth")
    assert read_gguf_tensors(printed["gguf"])["token_embd.weight"].shape == (6400, 64)
    assert main(["export", str(tmp_path / "tiny.pth"), "--out", str(tmp_path / "o2"), "--format", "gguf"]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
