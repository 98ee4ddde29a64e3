"""One run resolved once (issue 56, part 3): the command line becomes one frozen RunSpec (config.py:resolve_run), its
config validated once, after train.init_from's architecture is adopted, and its stage's record looked up once; the
checks before Ray (preflight.py), the driver's WorkerSpec and the workers read it and never rebuild or validate it
again. No Ray: the driver's own steps that need none."""
from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path

import pytest

from minimind_ray import config
from minimind_ray.config import RunSpec, resolve_run
from minimind_ray.preflight import check_before_ray
from minimind_ray.raytrain.driver import absolute_weight_paths
from minimind_ray.raytrain.spec import WorkerSpec
from minimind_ray.stages import STAGES

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"


@pytest.fixture
def validations(monkeypatch):
    """Each config that config.validate is given, in order."""
    seen, validate = [], config.validate

    def counted(cfg):
        seen.append(cfg)
        return validate(cfg)

    monkeypatch.setattr(config, "validate", counted)
    return seen


def test_no_module_holds_validate_but_config_itself():
    """What the counter above sees is every validation: no module of the project calls validate under its own name."""
    import minimind_ray.pipeline.run  # noqa: F401  (every room that resolves a run: loaded)
    import minimind_ray.raytrain.sweep  # noqa: F401

    holders = [name for name, module in list(sys.modules.items()) if name.startswith("minimind_ray.")
               and name != "minimind_ray.config" and getattr(module, "validate", None) is config.validate]
    assert holders == []


def test_a_command_is_validated_once_with_init_from_s_architecture_and_read_as_resolved(validations, tmp_path):
    ckpt = FIXTURE / "checkpoint_step4"  # tiny's shape at hidden 32; the sft verb's default preset is hidden 512
    run = resolve_run(None, ["data.train_path=[demo]", f"data.tokenizer={FIXTURE / 'tokenizer'}",
                             f"train.init_from={ckpt}", f"checkpoint.storage_path={tmp_path / 'runs'}"], stage="sft")
    checked = check_before_ray(run, local_ray=False)  # the driver's first step: files only, on the resolved run
    # what the driver then decides goes into its own copy, in the one WorkerSpec the workers receive
    cfg = dataclasses.replace(run.cfg, name="r", train=absolute_weight_paths(run.cfg.train, run.stage))
    spec = WorkerSpec(cfg=cfg, stage=run.stage, storage=str(tmp_path / "runs"), run_dir=str(tmp_path / "runs" / "r"),
                      prepared_dir=str(tmp_path / "prepared"), use_gpu=False)
    arrived = pickle.loads(pickle.dumps(spec))  # as Ray hands it to every worker

    assert len(validations) == 1  # once per command: not again before Ray, in the driver or in the spec
    assert validations[0] is run.cfg and validations[0].model.hidden_size == 32  # the weights' architecture, first
    assert run.lines and "from train.init_from=" in run.lines[0] and checked.tokenizer is not None
    assert run.stage is STAGES["sft"] and arrived.stage is STAGES["sft"]  # looked up once; travels as its name
    assert arrived.cfg.model == run.cfg.model and "model.hidden_size" not in run.written
    assert "train.init_from" in run.written and "train.lr" not in run.written  # what the user wrote, not defaults


def test_the_run_spec_is_frozen_and_the_user_s_config_is_not_edited():
    ckpt = FIXTURE / "checkpoint_step4"
    composed = config.load_config(None, ["data.train_path=[demo]", f"data.tokenizer={FIXTURE / 'tokenizer'}",
                                         f"train.init_from={ckpt}"], check=False, stage="sft")
    run = config.resolve(composed)
    assert isinstance(run, RunSpec) and composed.model.hidden_size == 512 and run.cfg.model.hidden_size == 32
    for name, value in (("cfg", composed), ("stage", STAGES["pretrain"]), ("written", frozenset()), ("lines", ())):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(run, name, value)


def test_a_config_mistake_is_said_before_the_weights_it_names(validations, tmp_path):
    """An init_from that does not exist is the config's own mistake, as the user wrote it (validate's 'not found'),
    not the weights' reader's; one validation all the same."""
    with pytest.raises(config.ConfigError, match=r"^train.init_from: not found: "):
        resolve_run(None, ["data.train_path=[demo]", f"train.init_from={tmp_path / 'gone'}"], stage="sft")
    assert len(validations) == 1
