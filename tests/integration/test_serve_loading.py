"""What `minimind-ray serve` loads, without Ray: the weight kinds that need more than a run directory
(an HF export folder with its own tokenizer, a separate LoRA file merged in, a bare .pth that needs a
tokenizer), a run's relative tokenizer pinned by the driver, and the one-line refusals before Ray starts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.model.config import LoRAConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.serve.model_io import check_source, load_served_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_dir():
    from tests.conftest import minimind_tokenizer_dir

    return str(minimind_tokenizer_dir("minimind2"))


def same_weights(a, b, atol=0.0):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), atol=atol, rtol=0), k


def test_an_hf_export_folder_serves_with_its_own_tokenizer(tmp_path, tok_dir):
    from minimind_ray.export import export_hf

    model = build_model(ModelConfig(**preset_values("tiny3")), seed=2)
    folder = export_hf(model, tok_dir, tmp_path / "hf", dtype=torch.float32)
    served = load_served_model(folder)
    same_weights(served.model, model)
    assert served.model.cfg.qk_norm and served.model.cfg.generation == "minimind3"
    assert served.tokenizer.path == str(tmp_path / "hf") and served.name == "hf"


def test_a_separate_lora_file_is_merged_into_the_weights(tmp_path, tok_dir):
    from minimind_ray.model.lora import apply_lora, merge_lora, save_lora
    from minimind_ray.store.pth import save_pth

    base = build_model(ModelConfig(**preset_values("tiny")), seed=3)
    save_pth(base, str(tmp_path / "base.pth"), dtype=torch.float32)
    apply_lora(base, LoRAConfig(rank=4))
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora.B." in name:
                p.normal_(std=0.05)  # a trained adapter: B is zero only at init
    save_lora(base, str(tmp_path / "lora_tiny.pth"), dtype=torch.float32)
    want = merge_lora(base)
    served = load_served_model(str(tmp_path / "base.pth"), tokenizer=tok_dir, lora=str(tmp_path / "lora_tiny.pth"))
    same_weights(served.model, want, atol=1e-6)
    assert not any(".lora." in k for k in served.model.state_dict())


def test_weights_without_a_tokenizer_and_missing_sources_are_one_line_errors(tmp_path):
    from minimind_ray.store.pth import save_pth

    save_pth(build_model(ModelConfig(**preset_values("tiny")), seed=1), str(tmp_path / "bare.pth"))
    with pytest.raises(ValueError, match="bare.pth: these weights carry no tokenizer; pass --tokenizer"):
        load_served_model(str(tmp_path / "bare.pth"))
    with pytest.raises(FileNotFoundError, match="nope: no such file or directory"):
        check_source(str(tmp_path / "nope"))


def test_a_runs_relative_tokenizer_is_pinned_to_an_absolute_folder_in_the_driver(tmp_path, tok_dir, monkeypatch):
    """A run trained with data.tokenizer / data.cache_dir relative to its working directory: replicas run
    elsewhere, so the driver hands them the folder resolved where the user runs the command."""
    import shutil

    from minimind_ray.config import load_config, to_dict
    from minimind_ray.engine.state import RNGState
    from minimind_ray.serve.model_io import pin_tokenizer
    from minimind_ray.store import checkpoint as ckpt_io

    shutil.copytree(tok_dir, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(REPO / "pipelines" / "configs" / "tiny.yaml"), ["data.tokenizer=tok", "data.cache_dir=cache"])
    model = build_model(cfg.model, seed=5)
    ck = tmp_path / "runs" / "r" / "checkpoint_000001"
    ckpt_io.write_rank_files(ck, 0, RNGState().state_dict())
    ckpt_io.write_shared_files(ck, model_state=model.state_dict(), train_state={},
                               meta=ckpt_io.CheckpointMeta(step=1, epoch=0, data_state={}, world_size=1,
                                                           stage="pretrain", total_steps=1, config=to_dict(cfg),
                                                           prepared_dir=None))
    assert pin_tokenizer("runs/r", None) == str(tmp_path / "tok")
    assert pin_tokenizer("runs/r", "tok") == str(tmp_path / "tok")  # a relative --tokenizer too
    assert pin_tokenizer("runs/r", "minimind3") == "minimind3"  # a name means the same everywhere


def test_a_latest_link_serves_under_its_runs_name_with_the_context_it_trained_at(tmp_path, tok_dir, monkeypatch):
    """Issue 47: `serve runs/sft-latest` names the model after the run the link points to, not `sft-latest`, and
    says the context the run trained at (data.max_seq_len) beside the one the RoPE table reaches."""
    from minimind_ray.config import load_config, to_dict
    from minimind_ray.engine.state import RNGState
    from minimind_ray.serve.model_io import default_name
    from minimind_ray.store import checkpoint as ckpt_io

    cfg = load_config(str(REPO / "pipelines" / "configs" / "tiny.yaml"), [f"data.tokenizer={tok_dir}"])
    model = build_model(cfg.model, seed=5)
    run = tmp_path / "runs" / "sft-20261204-0a1b2c"
    ck = run / "checkpoint_000001"
    ckpt_io.write_rank_files(ck, 0, RNGState().state_dict())
    ckpt_io.write_shared_files(ck, model_state=model.state_dict(), train_state={},
                               meta=ckpt_io.CheckpointMeta(step=1, epoch=0, data_state={}, world_size=1, stage="sft",
                                                           total_steps=1, config=to_dict(cfg), prepared_dir=None))
    link = ckpt_io.mark_latest(str(run), "sft")
    assert link == str(tmp_path / "runs" / "sft-latest")
    monkeypatch.chdir(tmp_path)
    for source in (link, "runs/sft-latest/", os.path.abspath(link)):
        assert default_name(source) == "sft-20261204-0a1b2c", source
    served = load_served_model(link)
    assert served.name == "sft-20261204-0a1b2c"
    assert (served.context, served.trained_context) == (cfg.model.max_position_embeddings, cfg.data.max_seq_len)
    assert served.trained_context == 64 < served.context
    from minimind_ray.export import export_hf

    hf = load_served_model(export_hf(model, tok_dir, tmp_path / "hf", dtype=torch.float32))
    assert hf.trained_context is None and hf.context == cfg.model.max_position_embeddings  # an HF folder: unknown
