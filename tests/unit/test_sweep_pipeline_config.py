"""The sweep and pipeline YAMLs without Ray: what is refused (naming the field) before anything starts, a trial's
values as overrides, how many trials fit at once, and the shipped YAMLs load."""
from __future__ import annotations

from pathlib import Path

import pytest

from minimind_ray.config import ConfigError, load_config
from minimind_ray.pipeline.config import load_pipeline, step_digest
from minimind_ray.raytrain.sweep import base_config, concurrency, trial_resources
from minimind_ray.raytrain.sweep_config import load_sweep, trial_overrides


def _sweep(tmp_path, text):
    p = tmp_path / "sweep.yaml"
    p.write_text("name: s\nrecipe: pipelines/configs/tiny.yaml\n" + text)
    return str(p)


def test_the_shipped_sweeps_load_against_their_recipes():
    for path in ("pipelines/configs/sweep_tiny.yaml", "pipelines/configs/sweep_demo.yaml"):
        s = load_sweep(path)
        base = base_config(s).cfg
        assert base.train.max_steps and base.data.eval_fraction > 0 and base.train.eval_interval > 0
    s = load_sweep("pipelines/configs/sweep_tiny.yaml", ["num_samples=2", "checkpoint.storage_path=/tmp/x"])
    assert s.num_samples == 2 and s.overrides[-1] == "checkpoint.storage_path=/tmp/x"  # a recipe key goes to overrides


@pytest.mark.parametrize("text, field", [
    ("space: {train.lr: {between: [1, 2]}}\n", "space.train.lr"),
    ("space: {train.lr: {uniform: [3, 1]}}\n", "space.train.lr"),
    ("space: {train.lr: {loguniform: [0, 1]}}\n", "space.train.lr"),
    ("space: {data.max_seq_len: {choice: [32, 64]}}\n", "space.data.max_seq_len"),
    ("space: {name: {choice: [a, b]}}\n", "space.name"),
    ("space: {}\n", "space"),
    ("space: {train.lr: {choice: [1]}}\nscheduler: {kind: hyperband}\n", "scheduler.kind"),
])
def test_a_bad_sweep_is_refused_naming_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_sweep(_sweep(tmp_path, text))


def test_what_the_sweep_asks_of_its_recipe_is_checked(tmp_path):
    no_split = load_sweep(_sweep(tmp_path, "space: {train.lr: {choice: [1.0e-3]}}\n"))
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        base_config(no_split)
    typo = load_sweep(_sweep(tmp_path, "space: {train.learning_rate: {choice: [1.0e-3]}}\n"
                                       "overrides: [data.eval_fraction=0.1, train.eval_interval=2]\n"))
    with pytest.raises(ConfigError, match="not a config field"):
        base_config(typo)
    asha_on_validation = load_sweep(_sweep(tmp_path, "space: {train.lr: {choice: [1.0e-3]}}\nmetric: eval/mc_eval/acc\n"
                                                     "overrides: ['eval.tasks=[{task: mc, data: \"demo:mc_eval\"}]']\n"))
    with pytest.raises(ConfigError, match="asha cannot stop on eval/mc_eval/acc"):
        base_config(asha_on_validation)


def test_a_trial_s_values_become_overrides_the_recipe_reads_back():
    params = {"train.lr": 3e-4, "train.warmup_steps": 10, "train.compile": False, "train.faults": ["5:slow:0:1"]}
    cfg = load_config("pipelines/configs/tiny.yaml", trial_overrides(params))
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.compile, cfg.train.faults) == (3e-4, 10, False,
                                                                                            ["5:slow:0:1"])


def test_trials_at_once_are_computed_from_what_one_trial_holds():
    s = load_sweep("pipelines/configs/sweep_tiny.yaml")
    need = trial_resources(s, base_config(s))
    assert need == {"trial": 0.25, "CPU": 1.25}  # its process + 1 worker of 1 CPU
    assert concurrency(s, need, {"CPU": 4.0}) == 3 and concurrency(s, need, {"CPU": 1.0}) == 1
    wide = load_sweep("pipelines/configs/sweep_tiny.yaml", ["space={cluster.num_workers: {choice: [1, 2]}}"])
    assert trial_resources(wide, base_config(wide))["CPU"] == 2.25  # the largest draw counts
    assert concurrency(load_sweep("pipelines/configs/sweep_tiny.yaml", ["max_concurrent_trials=5"]), need,
                       {"CPU": 4.0}) == 5


def _pipe(tmp_path, steps):
    p = tmp_path / "pipe.yaml"
    p.write_text("name: p\nsteps:\n" + steps)
    return str(p)


@pytest.mark.parametrize("steps, field", [
    ("  - {name: a, kind: pretrian, recipe: pipelines/configs/tiny.yaml}\n", r"steps\[0\].kind"),
    ("  - {name: pretrain}\n", r"steps\[0\].recipe"),
    ("  - {name: eval, tasks: [{task: mc, data: x}]}\n", r"steps\[0\].model"),
    ("  - {name: pretrain, recipe: pipelines/configs/tiny.yaml}\n  - {name: serve}\n"
     "  - {name: eval, tasks: [{task: mc, data: x}]}\n", r"steps\[1\].kind"),
    ("  - {name: pretrain, recipe: pipelines/configs/tiny.yaml}\n"
     "  - {name: sft, recipe: pipelines/configs/demo_sft.yaml, init_from: pretrian}\n", r"steps\[1\].init_from"),
    ("  - {name: pretrain, recipe: pipelines/configs/tiny.yaml}\n  - {name: pretrain, recipe: x}\n",
     r"steps\[1\].name"),
])
def test_a_bad_pipeline_is_refused_naming_the_field(tmp_path, steps, field):
    with pytest.raises(ConfigError, match=field):
        load_pipeline(_pipe(tmp_path, steps))


def test_the_demo_pipeline_loads_and_a_stage_s_digest_follows_its_settings():
    p = load_pipeline("pipelines/configs/pipeline_demo.yaml")
    assert [s.name for s in p.steps] == ["prepare", "pretrain", "sft", "grpo", "eval", "register"]
    sft = p.steps[2]
    assert step_digest(sft, p, []) == step_digest(sft, p, [])
    assert step_digest(sft, p, ["train.lr=1e-4"]) != step_digest(sft, p, [])
    assert step_digest(sft, p, [], upstream="a") != step_digest(sft, p, [], upstream="b")  # an earlier step changed


def test_a_pipeline_written_with_stages_loads_with_a_notice_and_its_finished_steps_stay_finished(tmp_path, capsys):
    """Issue 48: a pipeline's parts are steps (a training stage is one kind of step); the older YAML key stages: is
    read as steps: with one line, a pipeline.json written then resumes, and a step's digest is what it was (the
    demo's sft step: its digest computed by the code before the rename)."""
    import json

    from minimind_ray.pipeline.run import _read_state

    old = tmp_path / "old.yaml"
    old.write_text(Path("pipelines/configs/pipeline_demo.yaml").read_text().replace("\nsteps:\n", "\nstages:\n"))
    p = load_pipeline(str(old))
    assert capsys.readouterr().err.strip().splitlines() == [
        f"[minimind-ray] notice: {old}: 'stages:' is now 'steps:' (read as steps)"]
    assert [s.name for s in p.steps] == ["prepare", "pretrain", "sft", "grpo", "eval", "register"]
    assert step_digest(p.steps[2], p, []) == "27936ef0d3c5adbc"
    state = tmp_path / "pipeline.json"
    state.write_text(json.dumps({"stages": {"prepare": {"digest": "d", "prepared_dir": "x"}}}))
    assert _read_state(str(state))["steps"]["prepare"]["prepared_dir"] == "x"
