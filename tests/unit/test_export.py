"""Exports: MiniMind .pth naming/round trip, and HF folders that load in transformers with no custom code."""
from __future__ import annotations

import json

import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.model.config import LoRAConfig
from minimind_ray.export import export_hf, export_minimind_pth
from minimind_ray.model.lora import apply_lora, load_lora
from minimind_ray.model.minimind import build_model
from minimind_ray.store.pth import load_pth
from minimind_ray.model.presets import preset_values

torch.set_num_threads(2)

ATOL = 1e-4  # fp32 logits, ours vs transformers' (measured: 0 exactly without YaRN, ~1e-6 with it)


def model(preset: str, seed: int = 0, **overrides):
    return build_model(ModelConfig(**{**preset_values(preset), **overrides}), seed=seed).eval()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE with MiniMind's special tokens at ids 0/1/2.

    Its vocabulary is smaller than the model's 6400 rows, which transformers accepts;
    only the files' presence and the special ids matter to the export.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world", "the quick brown fox", "jumps over the lazy dog"] * 4, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return d


@pytest.mark.parametrize("preset,overrides,arch", [
    ("tiny", {}, "LlamaForCausalLM"),
    ("tiny", {"inference_rope_scaling": True}, "LlamaForCausalLM"),
    ("tiny3", {}, "Qwen3ForCausalLM"),
    ("tiny3-moe", {}, "Qwen3MoeForCausalLM"),
    ("tiny3-moe", {"num_experts_per_tok": 2}, "Qwen3MoeForCausalLM"),
])
def test_hf_export_matches_our_logits(tmp_path, tokenizer_dir, preset, overrides, arch):
    from transformers import AutoModelForCausalLM

    ours = model(preset, **overrides)
    out = export_hf(ours, tokenizer_dir, tmp_path / "hf")
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == arch
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = torch.randint(0, 6400, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, ours(x).logits, atol=ATOL, rtol=0)


def test_hf_export_folder_contents(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    export_hf(model("tiny3"), tokenizer_dir, out, dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 2
    # every file readable by others as any new file here (issue 38: model.safetensors was 0600, save_file's own mode)
    plain = tmp_path / "plain"
    plain.write_text("")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(plain.stat().st_mode & 0o777)}, modes


def test_minimind2_moe_hf_export_is_refused_with_a_reason(tmp_path, tokenizer_dir):
    with pytest.raises(NotImplementedError, match="shared experts"):
        export_hf(model("tiny-moe"), tokenizer_dir, tmp_path / "hf")


@pytest.mark.parametrize("preset,name", [("tiny", "pretrain_64.pth"), ("tiny-moe", "pretrain_64_moe.pth")])
def test_minimind_pth_naming_and_strict_round_trip(tmp_path, preset, name):
    ours = model(preset)
    path = export_minimind_pth(ours, tmp_path, prefix="pretrain")
    assert path == str(tmp_path / name)
    fresh = model(preset, seed=1)
    load_pth(fresh, path, strict=True)
    x = torch.randint(0, 6400, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).logits, ours(x).logits, atol=2e-2, rtol=0)  # fp16 weights


def test_lora_model_exports_adapters_only(tmp_path):
    ours = model("tiny")
    apply_lora(ours, LoRAConfig(rank=4))
    path = export_minimind_pth(ours, tmp_path, prefix="lora_identity")
    assert path.endswith("lora_identity_64.pth")
    sd = torch.load(path, weights_only=True)
    assert sd and all(".lora." in k for k in sd)
    load_lora(ours, path)
