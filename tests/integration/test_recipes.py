"""Every 26M recipe runs as a user would run it (issue 15): from a working directory that holds only
MiniMind-format data under the recipe's own relative paths (``data/*.jsonl``, ``out/*.pth``), with
MiniMind's tokenizer fetched by name (through the test mirror), to step 2, with CPU overrides only.

The chain is the user's (pretrain through Ray Train, the later stages on the in-process engine each worker
runs): pretrain -> its exported ``pretrain_512.pth`` starts SFT -> SFT's
``full_sft_512.pth`` starts LoRA, DPO, SimPO, KTO and distillation (whose teacher, ``full_sft_768.pth``, is a
freshly initialised 104M minimind2 here). Sequences are cut to 64 tokens so a 26M step costs seconds.

The minimind-3 recipes (MiniMind @ d65ef2c) chain the same way under MiniMind's current file names, with the
MoE SFT as distillation's teacher; they train on the engine in-process (see MINIMIND3_CHAIN for why), and
their numbers are checked against MiniMind's trainer defaults."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minimind_ray.config import from_dict
from minimind_ray.config import ConfigError, load_config, resolve_run
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.config import ModelConfig
from minimind_ray.store.checkpoint import open_checkpoint
from minimind_ray.store.pth import read_pth, save_pth
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
    # KTO's data as kto_26m.yaml says to make it from dpo.jsonl: each chosen conversation desirable, each rejected not
    (d / "kto.jsonl").write_text("".join(json.dumps({"conversations": r[k], "label": k == "chosen"}) + "\n"
                                         for r in dpo for k in ("chosen", "rejected")))


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
    spec = resolve_run(str(REPO / "pipelines" / "configs" / f"{recipe}.yaml"),
                       CPU + [f"checkpoint.storage_path={workdir / 'runs'}", f"data.cache_dir={workdir / 'cache'}",
                              *extra])
    res = run(spec)
    ck = open_checkpoint(res.checkpoint_dir)
    assert ck.step == 2, recipe
    return res, ck


def test_every_26m_recipe_runs_from_a_user_directory(ray_session, workdir, monkeypatch):
    res, ck = _run(workdir, "pretrain_26m", monkeypatch)
    meta = ck.meta()
    assert from_dict(meta.config).model.preset == "minimind2-small" and from_dict(meta.config).data.tokenizer == "minimind2"
    assert sorted(ck.model_state()) == sorted(build_model(ModelConfig(**preset_values("minimind2-small"))).state_dict())
    shutil.copy(res.exports["pth"], workdir / "out" / "pretrain_512.pth")

    # SFT, LoRA, DPO and distillation from the exports before them on one in-process engine (the code every Ray
    # Train worker runs): the Ray layer does not depend on the stage, and pretrain above ran it; a worker group's
    # start costs 10-60 s on 2 cores, four times over
    cfg, state, pth = _train_in_process(workdir, "sft_26m", "data.eval_fraction=0", "train.global_batch_size=2")
    assert state.step == 2 and pth.name == "full_sft_512.pth" and cfg.train.init_from == "out/pretrain_512.pth"
    shutil.copy(pth, workdir / "out" / "full_sft_512.pth")
    save_pth(build_model(ModelConfig(**preset_values("minimind2")), seed=3), str(workdir / "out" / "full_sft_768.pth"))

    for recipe, export_as in (("lora_26m", "lora_512.pth"), ("dpo_26m", "dpo_512.pth"),
                              ("simpo_26m", "simpo_512.pth"), ("kto_26m", "kto_512.pth"),
                              ("distill_26m", "full_dist_512.pth")):
        rows = ["train.micro_batch_size=2"] if recipe == "kto_26m" else []  # KTO's KL pairs: 2 rows a micro-batch
        cfg, state, pth = _train_in_process(workdir, recipe, "data.eval_fraction=0", "train.global_batch_size=2", *rows)
        assert state.step == 2 and cfg.model.preset == "minimind2-small" and pth.name == export_as, recipe
        if recipe == "lora_26m":  # MiniMind's LoRA file: the adapters alone
            assert read_pth(str(pth)) and all(".lora." in k for k in read_pth(str(pth)))
        if recipe == "distill_26m":  # the teacher: the 104M minimind2 from out/full_sft_768.pth, frozen
            teacher = state.objective.teacher
            assert teacher.cfg.hidden_size == 768 and not any(p.requires_grad for p in teacher.parameters())


# The minimind-3 chain (MiniMind @ d65ef2c): its data files' names, its weights' names, the MoE SFT as the
# distillation teacher. Each recipe trains 2 steps of its stage on one in-process engine (TrainState + the
# engine's loop, the code every Ray Train worker runs), not through Ray Train: the Ray layer does not depend
# on the recipe and the 26M chain above runs it; starting a Ray Train worker group costs 10-60 s on 2 cores,
# eight times over. The data is prepared by the real Ray Data job, the exports are MiniMind's .pth files.
MINIMIND3_CHAIN = (("pretrain_minimind3", "pretrain_768.pth"), ("sft_minimind3", "full_sft_768.pth"),
                   ("pretrain_minimind3_moe", "pretrain_768_moe.pth"), ("sft_minimind3_moe", "full_sft_768_moe.pth"),
                   ("lora_minimind3", "lora_768.pth"), ("dpo_minimind3", "dpo_768.pth"),
                   ("grpo_minimind3", "grpo_768.pth"), ("distill_minimind3", "full_dist_768.pth"),
                   ("ppo_minimind3", "ppo_actor_768.pth"), ("agent_minimind3", "agent_768.pth"))
# Runtime-only overrides (train.max_steps, micro_batch_size, the cluster), plus what a 64M/198M CPU step must
# cut: one sequence per step instead of up to 1024, 64 tokens each. The dense chain's models have 2 of their 8
# layers (SHALLOW: every dense recipe alike, so each starts from the export before it); the MoE pretrain and SFT
# keep theirs, as the distillation's teacher is built from its preset (minimind3-moe, 8 layers).
CPU3 = ["cluster.use_gpu=false", "cluster.num_workers=1", "train.max_steps=2", "train.global_batch_size=1",
        "train.micro_batch_size=1", "data.max_seq_len=64", "train.log_interval=1", "tracking.enabled=false"]
# GRPO: 8 new tokens per completion instead of 1024; the recipe's fourth reward term is MiniMind's
# internlm2-1_8b-reward (1.8B parameters, remote code), which no CI machine has: its three rule terms stay.
GRPO_CPU = ["train.grpo.max_gen_len=8",
            "train.grpo.rewards=[{name: length}, {name: think_format}, {name: repetition}]"]
# PPO and the agent stage likewise (the agent's trajectories up to 96 tokens; its reward terms without the model)
PPO_CPU = ["train.ppo.max_gen_len=8", "train.ppo.rewards=[{name: length}, {name: think_format}, {name: repetition}]"]
AGENT_CPU = ["train.agent.max_gen_len=8", "train.agent.max_total_len=96",
             "train.agent.rewards=[{name: tool_tags}, {name: tool_calls}, {name: reply_format}, {name: gt_answer}, "
             "{name: unfinished}, {name: repetition}]"]
CPU_RL = {"grpo": GRPO_CPU, "ppo_": PPO_CPU, "agent": AGENT_CPU}
SHALLOW = ["model.num_hidden_layers=2"]


def _write_minimind3_data(d: Path) -> None:
    """Small samples under the file names of MiniMind's minimind-3 trainers (pretrain_t2t_mini, sft_t2t_mini,
    lora_medical, dpo, rlaif)."""
    _write_minimind_data(d)
    (d / "pretrain_hq.jsonl").rename(d / "pretrain_t2t_mini.jsonl")
    (d / "sft_mini_512.jsonl").rename(d / "sft_t2t_mini.jsonl")
    (d / "lora_identity.jsonl").rename(d / "lora_medical.jsonl")
    rlaif = [{"conversations": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                {"role": "assistant", "content": ""}]} for i in range(8)]
    (d / "rlaif.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rlaif))
    from minimind_ray.rl.tools import BUILTIN_TOOLS

    system = {"role": "system", "content": "", "tools": json.dumps([BUILTIN_TOOLS["calculate_math"][1]])}
    agent = [{"conversations": [system, {"role": "user", "content": f"{i} + {i} = ?"}, {"role": "assistant",
                                "content": f"{2 * i}"}], "gt": [2 * i]} for i in range(8)]  # MiniMind's agent_rl
    (d / "agent_rl.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in agent))


def _train_in_process(workdir: Path, recipe: str, *extra):
    """2 steps of ``recipe`` from ``workdir`` on one in-process engine; (config, state, its MiniMind .pth)."""
    import random

    from minimind_ray.data.prepare import ensure_prepared
    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.export import export_minimind_pth
    from minimind_ray.stages import get_stage
    from minimind_ray.tokenizer import resolve_tokenizer

    cfg = load_config(str(REPO / "pipelines" / "configs" / f"{recipe}.yaml"),
                      CPU3 + [f"data.cache_dir={workdir / 'cache'}", *extra])
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    prepared = ensure_prepared(cfg.data, tok)  # the SFT-format recipes share one prepared directory
    threads, py_rng = torch.get_num_threads(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):  # the engine seeds and sizes this process as its own
            state = TrainState.build(cfg, prepared)
            run(state)
    finally:
        torch.set_num_threads(threads)
        random.setstate(py_rng)
    # as the driver's export names it: a LoRA run's adapters are MiniMind's lora_<hidden>.pth
    prefix = "lora" if cfg.train.stage == "lora" else get_stage(cfg.train.stage).export_prefix
    return cfg, state, Path(export_minimind_pth(state.model, workdir / "export" / recipe, prefix=prefix))


# MiniMind's trainer defaults at d65ef2c (trainer/train_*.py argparse): epochs, batch_size (per GPU),
# accumulation_steps, learning_rate, max_seq_len, data_path, from_weight; and each stage's own numbers.
MINIMIND3_DEFAULTS = {
    "pretrain_minimind3": (2, 32, 8, 5e-4, 340, "pretrain_t2t_mini.jsonl", None),
    "pretrain_minimind3_moe": (2, 32, 8, 5e-4, 340, "pretrain_t2t_mini.jsonl", None),
    "sft_minimind3": (2, 16, 1, 1e-5, 768, "sft_t2t_mini.jsonl", "pretrain_768.pth"),
    "sft_minimind3_moe": (2, 16, 1, 1e-5, 768, "sft_t2t_mini.jsonl", "pretrain_768_moe.pth"),
    "lora_minimind3": (10, 32, 1, 1e-4, 340, "lora_medical.jsonl", "full_sft_768.pth"),
    "dpo_minimind3": (1, 4, 1, 4e-8, 1024, "dpo.jsonl", "full_sft_768.pth"),
    "grpo_minimind3": (1, 2, 1, 3e-7, 768, "rlaif.jsonl", "full_sft_768.pth"),
    "distill_minimind3": (6, 32, 1, 5e-6, 340, "sft_t2t_mini.jsonl", "full_sft_768.pth"),
    "ppo_minimind3": (1, 2, 1, 3e-7, 768, "rlaif.jsonl", "full_sft_768.pth"),
    "agent_minimind3": (1, 2, 1, 3e-7, 1024, "agent_rl.jsonl", "full_sft_768.pth"),
}
RL_RECIPES = ("grpo_minimind3", "ppo_minimind3", "agent_minimind3")  # a cosine to lr/10 over optimizer steps


def test_minimind3_recipes_hold_minimind_defaults():
    """The numbers a MiniMind user knows, as MiniMind's trainers run under torchrun on 4 GPUs (the recipes'
    cluster): global batch = 4 x batch_size x accumulation_steps; torch AdamW's defaults (MiniMind passes lr only)."""
    from omegaconf import OmegaConf

    for recipe, (epochs, batch, accum, lr, seq, data, init) in MINIMIND3_DEFAULTS.items():
        r = OmegaConf.to_container(OmegaConf.load(REPO / "pipelines" / "configs" / f"{recipe}.yaml"))
        t, d = r["train"], r["data"]
        assert (t["epochs"], t["micro_batch_size"], t["global_batch_size"], t["lr"], d["max_seq_len"]) == (
            epochs, batch, 4 * batch * accum, lr, seq) and r["cluster"]["num_workers"] == 4, recipe
        assert d["train_path"] == [f"data/{data}"] and t.get("init_from") == (init and f"out/{init}"), recipe
        assert (t["beta2"], t["weight_decay"], t["grad_clip"], d["tokenizer"]) == (0.999, 0.01, 1.0, "minimind3")
        assert r["model"]["preset"] == ("minimind3-moe" if recipe.endswith("_moe") else "minimind3"), recipe
        if recipe not in RL_RECIPES:  # the RL trainers: a cosine to lr/10 over optimizer steps (CosineAnnealingLR)
            assert (t["lr_schedule"], t["warmup_steps"]) == ("minimind", 0), recipe
    for name in ("dpo_26m", "dpo_minimind3"):  # MiniMind's DPO beta since d65ef2c, in both generations' recipes
        assert OmegaConf.load(REPO / "pipelines" / "configs" / f"{name}.yaml").train.dpo.beta == 0.15
    g = OmegaConf.load(REPO / "pipelines" / "configs" / "grpo_minimind3.yaml").train
    assert (g.grpo.num_generations, g.grpo.max_gen_len, g.grpo.beta, g.grpo.loss_type, g.grpo.epsilon,
            g.grpo.epsilon_high, g.min_lr_ratio) == (6, 1024, 0.1, "cispo", 0.2, 5.0, 0.1)
    p = OmegaConf.load(REPO / "pipelines" / "configs" / "ppo_minimind3.yaml").train
    assert (p.ppo.critic_lr, p.ppo.clip_epsilon, p.ppo.vf_coef, p.ppo.kl_coef, p.ppo.gamma, p.ppo.lam,
            p.ppo.cliprange_value, p.ppo.ppo_update_iters, p.ppo.early_stop_kl, p.ppo.max_gen_len, p.min_lr_ratio) == (
        5e-7, 0.2, 0.5, 0.02, 1.0, 0.95, 0.2, 2, 0.25, 1024, 0.1)
    a = OmegaConf.load(REPO / "pipelines" / "configs" / "agent_minimind3.yaml").train
    assert (a.agent.num_generations, a.agent.max_gen_len, a.agent.beta, a.agent.loss_type, a.agent.epsilon_high,
            a.agent.max_turns, a.agent.max_total_len, a.agent.reward_clip, a.min_lr_ratio) == (
        4, 768, 0.1, "cispo", 5.0, 3, 2500, 3.0, 0.1)
    dist = OmegaConf.load(REPO / "pipelines" / "configs" / "distill_minimind3.yaml").train.distill
    assert (dist.teacher_preset, dist.teacher_weights, dist.alpha, dist.temperature) == (
        "minimind3-moe", "out/full_sft_768_moe.pth", 0.5, 1.5)
    assert OmegaConf.load(REPO / "pipelines" / "configs" / "pretrain_minimind3.yaml").data.pack is False  # pad mode


def test_every_minimind3_recipe_trains_from_a_user_directory(ray_session, tmp_path, monkeypatch):
    _write_minimind3_data(tmp_path / "data")
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)  # the recipes' relative data/ and out/ paths are the user's
    for recipe, export_as in MINIMIND3_CHAIN:
        rl = next((v for k, v in CPU_RL.items() if recipe.startswith(k)), ())
        cfg, state, pth = _train_in_process(tmp_path, recipe, *rl, *([] if recipe.endswith("_moe") else SHALLOW))
        assert state.step == 2 and cfg.data.tokenizer == "minimind3", recipe
        assert state.model.cfg.preset == ("minimind3-moe" if recipe.endswith("_moe") else "minimind3"), recipe
        assert pth.name == export_as, recipe  # MiniMind's name for what this stage writes
        shutil.copy(pth, tmp_path / "out" / export_as)  # what the next recipe starts from
        if recipe == "lora_minimind3":  # MiniMind's LoRA file: the adapters alone
            assert read_pth(str(pth)) and all(".lora." in k for k in read_pth(str(pth)))
        if recipe == "distill_minimind3":  # the teacher is the MoE SFT's export, frozen
            teacher = state.objective.teacher
            assert teacher.cfg.use_moe and not any(p.requires_grad for p in teacher.parameters())


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
