"""Every 26M recipe runs as a user would run it (issue 15): from a working directory that holds only
MiniMind-format data under the recipe's own relative paths (``data/*.jsonl``, ``out/*.pth``), with
MiniMind's tokenizer fetched by name (through the test mirror), to step 2, with CPU overrides only.

The chain is the user's: pretrain -> its exported ``pretrain_512.pth`` starts SFT -> SFT's
``full_sft_512.pth`` starts LoRA, DPO and distillation (whose teacher, ``full_sft_768.pth``, is a
freshly initialised 104M minimind2 here). Sequences are cut to 64 tokens so a 26M step costs seconds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minimind_ray.config import ConfigError, load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.config import ModelConfig
from minimind_ray.store.checkpoint import open_checkpoint
from minimind_ray.store.pth import save_pth
from tests.conftest import cli_stderr

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

TOPICS = ["the sea", "a mountain", "rice", "the moon", "a library", "trains", "tea", "rain"]


def _conversation(i: int, answer: str):
    return [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} ({i})."},
            {"role": "assistant", "content": answer}]


def _write_minimind_data(d: Path) -> None:
    """Small samples in the formats of MiniMind's pretrain_hq / sft_mini_512 / lora / dpo files."""
    d.mkdir(parents=True)
    texts = [f"{TOPICS[i % 8]} is a topic worth reading about; item {i} says it plainly. 这是第{i}条。" for i in range(48)]
    (d / "pretrain_hq.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    sft = [{"conversations": _conversation(i, f"It is about {TOPICS[i % 8]}, number {i}.")} for i in range(24)]
    (d / "sft_mini_512.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sft))
    (d / "lora_identity.jsonl").write_text("".join(
        json.dumps({"conversations": [{"role": "user", "content": f"Who are you? ({i})"},
                                      {"role": "assistant", "content": "I am MiniMind."}]}) + "\n" for i in range(16)))
    dpo = [{"chosen": _conversation(i, "A short, correct answer."), "rejected": _conversation(i, "No.")}
           for i in range(16)]
    (d / "dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dpo))


CPU = ["cluster.use_gpu=false", "cluster.num_workers=1", "cluster.cpus_per_worker=1", "train.max_steps=2",
       "train.global_batch_size=2", "train.micro_batch_size=1", "data.max_seq_len=64", "data.eval_fraction=0",
       "train.log_interval=1", "checkpoint.interval=2", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    w = tmp_path_factory.mktemp("user")
    _write_minimind_data(w / "data")
    (w / "out").mkdir()
    return w


def _run(workdir: Path, recipe: str, monkeypatch, *extra):
    from minimind_ray.raytrain.driver import run

    monkeypatch.chdir(workdir)  # the recipe's relative data/ and out/ paths are the user's
    cfg = load_config(str(REPO / "pipelines" / "configs" / f"{recipe}.yaml"),
                      CPU + [f"checkpoint.storage_path={workdir / 'runs'}", f"data.cache_dir={workdir / 'cache'}",
                             *extra])
    res = run(cfg)
    ck = open_checkpoint(res.checkpoint_dir)
    assert ck.step == 2, recipe
    return res, ck


def test_every_26m_recipe_runs_from_a_user_directory(ray_session, workdir, monkeypatch):
    res, ck = _run(workdir, "pretrain_26m", monkeypatch)
    meta = ck.meta()
    assert meta.run_config().model.preset == "minimind2-small" and meta.run_config().data.tokenizer == "minimind2"
    assert sorted(ck.model_state()) == sorted(build_model(ModelConfig(**preset_values("minimind2-small"))).state_dict())
    shutil.copy(res.exports["pth"], workdir / "out" / "pretrain_512.pth")

    res, _ = _run(workdir, "sft_26m", monkeypatch)
    shutil.copy(res.exports["pth"], workdir / "out" / "full_sft_512.pth")
    save_pth(build_model(ModelConfig(**preset_values("minimind2")), seed=3), str(workdir / "out" / "full_sft_768.pth"))

    for recipe in ("lora_26m", "dpo_26m", "distill_26m"):
        res, ck = _run(workdir, recipe, monkeypatch)
        if recipe == "lora_26m":
            assert any(".lora." in k for k in ck.model_state())


def test_gpu_settings_on_a_cluster_without_gpus_stop_before_any_worker(ray_session, workdir, monkeypatch, capsys):
    """nccl, or use_gpu=true, on this CPU-only cluster: a one-line error naming the field, exit code 2,
    and no worker was started (no checkpoint directory, no Ray Train run in storage)."""
    from minimind_ray.cli import main

    monkeypatch.chdir(workdir)
    recipe = str(REPO / "pipelines" / "configs" / "pretrain_26m.yaml")
    common = CPU[1:] + [f"checkpoint.storage_path={workdir / 'gpu-runs'}", f"data.cache_dir={workdir / 'cache'}",
                        "cluster.resource_timeout_s=1"]
    for bad, field in (("cluster.backend=nccl", "cluster.backend"), ("cluster.use_gpu=true", "cluster.use_gpu")):
        extra = [bad] + (["cluster.use_gpu=false"] if "backend" in bad else [])
        assert main(["pretrain", "--config", recipe, *common, *extra]) == 2
        err = cli_stderr(capsys).splitlines()
        assert len(err) == 1 and err[0].startswith(f"config error: {field}:"), err
    assert not (workdir / "gpu-runs").exists() or not any((workdir / "gpu-runs").rglob("checkpoint_*"))
    with pytest.raises(ConfigError):
        load_config(recipe, ["cluster.backend=mpi"])
