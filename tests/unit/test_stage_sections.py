"""What a stage's record says about the sections of ``train:`` (issue 56): the weights paths it starts from are made
absolute for the workers, a field of a section the run's stage does not read is refused before Ray (in a pipeline's
step too), and a training verb's --help lists the shared fields and its own stage's sections only."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from minimind_ray.cli import build_parser
from minimind_ray.config import ConfigError, RunConfig, load_config
from minimind_ray.pipeline.config import load_pipeline
from minimind_ray.pipeline.run import run_pipeline
from minimind_ray.raytrain.driver import absolute_weight_paths
from minimind_ray.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
WITH_PARENTS = [s for s in STAGES.values() if s.parent_fields]


def test_the_stages_that_start_from_other_weights_are_known():
    assert {s.name for s in WITH_PARENTS} == {"dpo", "distill", "kto"}


@pytest.mark.parametrize("stage", WITH_PARENTS, ids=lambda s: s.name)
def test_every_parent_path_reaches_the_workers_absolute(stage, tmp_path, monkeypatch):
    """The workers run in another directory: a relative reference (KTO's was left relative, and a run failed on its
    workers after a minute, saying that a path that exists does not exist) or teacher is made absolute, as init_from."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    section = getattr(RunConfig().train, stage.name)
    fields = {f: "weights/parent.pth" for _, f in stage.parent_fields}
    train = dataclasses.replace(RunConfig().train, stage=stage.name, init_from="weights/init.pth",
                                **{stage.name: dataclasses.replace(section, **fields)})
    out = absolute_weight_paths(train, stage)
    cfg = RunConfig(train=out)
    assert out.init_from == str(tmp_path / "weights" / "init.pth")
    assert stage.parents(cfg) == {p: str(tmp_path / "weights" / "parent.pth") for p, _ in stage.parent_fields}
    assert absolute_weight_paths(dataclasses.replace(train, init_from="s3://bucket/w.pth"), stage).init_from == \
        "s3://bucket/w.pth"  # a URI is left as it is


def _refusal(recipe: str, overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(REPO / "pipelines" / "configs" / recipe), list(overrides))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_field_of_another_stages_section_is_refused_naming_the_runs_own():
    msg = _refusal("demo_rloo.yaml", ["train.grpo.rewards=[{name: exact_answer}]"])
    assert msg.startswith("train.grpo.rewards: a field of the grpo stage's section, which the rloo stage does not read")
    assert msg.endswith("did you mean train.rloo.rewards?")


def test_a_field_no_section_of_the_run_has_says_what_it_reads():
    msg = _refusal("demo_sft.yaml", ["train.dpo.beta=0.3"])
    assert msg.startswith("train.dpo.beta: a field of the dpo stage's section, which the sft stage does not read")
    assert msg.endswith("leave it out"), msg


def test_a_shared_section_is_refused_on_a_stage_that_does_not_read_it():
    msg = _refusal("demo_sft.yaml", ["train.rollout.engine=actors"])
    assert msg.startswith("train.rollout.engine: a field of the section of grpo, ppo, agent, rloo"), msg


def test_the_sections_a_stage_reads_are_accepted():
    for recipe in sorted((REPO / "pipelines" / "configs").glob("*.yaml")):  # no recipe sets another stage's field
        if not recipe.name.startswith(("sweep", "pipeline")):
            from minimind_ray.config import refuse_other_stages_field

            refuse_other_stages_field(load_config(str(recipe), check=False))


def test_a_pipeline_step_with_another_stages_field_is_refused_before_any_step_runs(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(f"name: p\nsteps:\n  - {{name: sft, recipe: {REPO}/pipelines/configs/demo_sft.yaml, "
                    f"overrides: [train.grpo.beta=0.5]}}\n")
    with pytest.raises(ConfigError, match=r"^pipeline step 'sft': train\.grpo\.beta: a field of the grpo stage's"):
        run_pipeline(load_pipeline(str(path)), [f"checkpoint.storage_path={tmp_path}/runs", "tracking.enabled=false"])
    assert not (tmp_path / "runs").exists()  # nothing started


def _help(verb: str) -> str:
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[verb].format_help()


def test_a_training_verbs_help_lists_its_own_sections_not_the_others():
    rloo, agent, sft = _help("rloo"), _help("agent"), _help("sft")
    assert "train.rloo.rewards=" in rloo and "train.rollout.engine=" in rloo and "train.lr=" in rloo
    assert "train.grpo." not in rloo and "train.dpo." not in rloo
    assert "train.agent.max_turns=" in agent and "train.agent.num_generations=" in agent and "train.grpo." not in agent
    assert "train.rollout." not in sft and "train.lr=" in sft and "data.format=" in sft
