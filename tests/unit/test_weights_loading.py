"""Weights from every source the project writes, and the ones it must refuse (issue 11, items 14, 16-18):
store/weights.py, with no training code running."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from minimind_ray.config import ModelConfig, load_config, to_dict
from minimind_ray.engine.state import RNGState
from minimind_ray.export import _export_model, export_from_source
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store import checkpoint as ckpt_io
from minimind_ray.store.pth import WeightsError, save_pth
from minimind_ray.store.weights import build_inference_model, load_model_weights, load_weights

torch.set_num_threads(2)
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / "tokenizer"
WEIGHTS_LOG = "minimind_ray.store.weights"


def model(preset: str = "tiny", seed: int = 1, **overrides):
    return build_model(ModelConfig(**{**preset_values(preset), **overrides}), seed=seed).eval()


def write_checkpoint(ck: Path, overrides=(), step: int = 1) -> Path:
    """A checkpoint as the training loop writes it, of a tiny model with the config ``overrides``."""
    cfg = load_config(None, ["data.train_path=[demo]", "model.preset=tiny", *overrides])
    m = build_model(cfg.model, seed=2)
    ckpt_io.write_rank_files(ck, 0, RNGState().state_dict())
    ckpt_io.write_shared_files(ck, model_state=m.state_dict(), train_state={}, meta=ckpt_io.CheckpointMeta(
        step=step, epoch=0, data_state={}, world_size=1, stage="pretrain", total_steps=step, config=to_dict(cfg),
        prepared_dir=str(ck / "no-data")))
    return ck


def assert_same_weights(loaded: torch.nn.Module, want: dict):
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k


# --------------------------------------------------------------------------- item 16: every export loads back


@pytest.mark.parametrize("preset,hf_arch", [("tiny", "LlamaForCausalLM"), ("tiny3", "Qwen3ForCausalLM"),
                                            ("tiny3-moe", "Qwen3MoeForCausalLM")])
def test_item16_every_export_format_loads_back_as_the_same_model(tmp_path, preset, hf_arch):
    ours = model(preset)
    paths = _export_model(ours, tmp_path, "pretrain", ("minimind", "safetensors", "hf"), str(TOKENIZER))
    assert json.loads((Path(paths["hf"]) / "config.json").read_text())["architectures"] == [hf_arch]
    fp32 = ours.state_dict()
    fp16 = {k: v.half().float() for k, v in fp32.items()}
    for fmt, want in (("safetensors", fp32), ("pth", fp16), ("hf", fp16)):
        loaded, lw = build_inference_model(paths[fmt])
        assert_same_weights(loaded, want)  # the tied lm_head is back: strict load, both keys
        mine = {k: v for k, v in dataclasses.asdict(loaded.cfg).items() if k != "preset"}
        assert mine == {k: v for k, v in dataclasses.asdict(ours.cfg).items() if k != "preset"}, fmt
    assert lw.tokenizer_dir == paths["hf"]  # the HF folder's own tokenizer comes with it


def test_item16_an_hf_folder_exports_again_with_its_own_tokenizer(tmp_path):
    paths = _export_model(model("tiny3"), tmp_path / "a", "pretrain", ("hf",), str(TOKENIZER))
    again = export_from_source(paths["hf"], tmp_path / "b", formats=("hf", "safetensors"))
    assert (Path(again["hf"]) / "tokenizer.json").exists()
    a, _ = build_inference_model(paths["hf"])
    b, _ = build_inference_model(again["safetensors"])
    assert_same_weights(b, a.state_dict())


def test_item16_safetensors_without_recorded_config_are_matched_by_shape(tmp_path):
    """The HF folder's model.safetensors taken out of its folder: no config, the lm_head re-tied, preset by shapes."""
    paths = _export_model(model("tiny"), tmp_path, "pretrain", ("hf",), str(TOKENIZER))
    lone = tmp_path / "lone.safetensors"
    lone.write_bytes((Path(paths["hf"]) / "model.safetensors").read_bytes())
    loaded, lw = build_inference_model(str(lone))
    assert lw.model_cfg.preset == "tiny" and not lw.recorded
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


# --------------------------------------------------------------------------- item 17: non-float weights


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_item17_integer_weights_are_refused_naming_tensor_and_dtype(tmp_path, dtype):
    sd = {k: (v * 100).to(dtype) for k, v in model().state_dict().items()}
    torch.save(sd, tmp_path / "q.pth")
    with pytest.raises(WeightsError, match=rf"q\.pth: tensor 'model\.embed_tokens\.weight' has dtype "
                                           rf"{str(dtype).removeprefix('torch.')}; only floating-point"):
        load_weights(str(tmp_path / "q.pth"))


def test_item17_non_float_safetensors_and_one_int8_tensor_among_floats_are_refused(tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.clone() for k, v in model().state_dict().items() if k != "lm_head.weight"}
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int8)
    save_file(sd, str(tmp_path / "q.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor 'model\.norm\.weight' has dtype int8"):
        load_weights(str(tmp_path / "q.safetensors"))


def test_item17_bf16_and_fp16_weights_still_load(tmp_path):
    ours = model()
    for dtype in (torch.bfloat16, torch.float16):
        save_pth(ours, str(tmp_path / "w.pth"), dtype=dtype)
        loaded, _ = build_inference_model(str(tmp_path / "w.pth"))
        assert_same_weights(loaded, {k: v.to(dtype) for k, v in ours.state_dict().items()})


# --------------------------------------------------------------------------- item 14: unreadable files, named


def test_item14_a_truncated_pth_is_an_error_naming_the_file(tmp_path):
    save_pth(model(), str(tmp_path / "w.pth"))
    data = (tmp_path / "w.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=rf"^{tmp_path}/cut\.pth: not a readable PyTorch \.pth \(RuntimeError: "):
        load_weights(str(tmp_path / "cut.pth"))
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(WeightsError, match=r"cut\.safetensors: not a readable safetensors file"):
        load_weights(str(tmp_path / "cut.safetensors"))


def test_item14_a_pth_that_is_not_a_state_dict_and_an_unknown_preset_are_named(tmp_path):
    torch.save({"model": model().state_dict(), "step": 3}, tmp_path / "resume.pth")  # a trainer's resume file
    with pytest.raises(WeightsError, match=r"resume\.pth: 'model' holds a value of type OrderedDict, not a tensor"):
        load_weights(str(tmp_path / "resume.pth"))
    save_pth(model(), str(tmp_path / "w.pth"))
    with pytest.raises(ValueError, match=r"^preset: unknown preset 'tiny4'; known: "):
        load_weights(str(tmp_path / "w.pth"), preset="tiny4")
    with pytest.raises(WeightsError, match=r"w\.pth: do not fit model preset 'tiny3'"):
        build_inference_model(str(tmp_path / "w.pth"), preset="tiny3")


# --------------------------------------------------------------------------- item 18: rope_theta / rms_norm_eps


def test_item18_inference_takes_the_checkpoints_rope_theta_and_eps_and_warns_about_the_preset(tmp_path, caplog):
    ck = write_checkpoint(tmp_path / "run" / "checkpoint_000001", ["model.rope_theta=10000", "model.rms_norm_eps=1e-6"])
    with caplog.at_level(logging.WARNING, logger=WEIGHTS_LOG):
        loaded, _ = build_inference_model(str(ck), preset="tiny")  # the preset says 1e6 and 1e-5
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "model.rope_theta=10000.0 (preset: 1000000.0)" in warning
    assert "model.rms_norm_eps=1e-06 (preset: 1e-05)" in warning
    assert (loaded.cfg.rope_theta, loaded.cfg.rms_norm_eps) == (10000.0, 1e-6)
    assert loaded.model.norm.eps == 1e-6
    want = build_model(dataclasses.replace(loaded.cfg))
    assert torch.equal(loaded.model.freqs_cos, want.model.freqs_cos)  # the RoPE table of theta 1e4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=WEIGHTS_LOG):
        build_inference_model(str(ck))  # no preset assumed: nothing to warn about
    assert not caplog.records


def test_item18_an_hf_folder_with_its_own_rope_theta_is_built_with_it(tmp_path, caplog):
    paths = _export_model(model("tiny3", rope_theta=5e5), tmp_path, "pretrain", ("hf",), str(TOKENIZER))
    with caplog.at_level(logging.WARNING, logger=WEIGHTS_LOG):
        loaded, _ = build_inference_model(paths["hf"], preset="tiny3")
    assert loaded.cfg.rope_theta == 5e5
    assert "model.rope_theta=500000.0 (preset: 1000000.0)" in caplog.text


def test_item18_training_keeps_its_own_config_and_warns_naming_the_fields(tmp_path, caplog):
    ck = write_checkpoint(tmp_path / "run" / "checkpoint_000001", ["model.rope_theta=10000"])
    target = model("tiny", seed=7)  # rope_theta 1e6, as the new run's config says
    table = target.model.freqs_cos.clone()
    with caplog.at_level(logging.WARNING, logger=WEIGHTS_LOG):
        load_model_weights(target, str(ck))
    assert "model.rope_theta=1000000.0 (the weights were trained with 10000.0)" in caplog.text
    assert target.cfg.rope_theta == 1e6 and torch.equal(target.model.freqs_cos, table)
    assert torch.equal(target.lm_head.weight, ckpt_io.open_checkpoint(ck).model_state()["lm_head.weight"])


def test_item4_weights_from_a_uri_are_read_in_place_and_only_the_used_checkpoint(tmp_path, monkeypatch):
    """Issue 11, item 4: weights named by a URI (here file://) of a run directory were copied whole, every
    checkpoint, into /tmp/mmr-weights-* and never removed. Now the newest complete checkpoint's model file
    is read through the URI's filesystem: nothing is written to the temp directory, and no other file of
    the run (older checkpoints, training state, RNG) is read."""
    import tempfile

    run = tmp_path / "run"
    older = write_checkpoint(run / "checkpoint_2026-01-01_00-00-01.000000")
    newer = write_checkpoint(run / "checkpoint_2026-01-01_00-00-02.000000", step=2)
    read = []
    real = ckpt_io._torch_load
    monkeypatch.setattr(ckpt_io, "_torch_load", lambda fs, path, where: read.append(where) or real(fs, path, where))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    m, lw = build_inference_model(f"file://{run}")
    assert read == [f"file://{newer}/model.pth"], read
    assert list(scratch.iterdir()) == []
    assert lw.checkpoint.step == 2 and older.exists()
    want = torch.load(newer / "model.pth", weights_only=True)
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items() if k in want)
