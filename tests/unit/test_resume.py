"""Resume by re-running (issue 15): a run's default name is its identity, and ``resume`` decides what
happens to a run found in storage. No Ray: storage is written with the store's own functions."""
from __future__ import annotations

import dataclasses

import pytest

from minimind_ray.config import ConfigError, load_config, run_identity, to_dict
from minimind_ray.engine.state import RNGState
from minimind_ray.raytrain.resume import RunFinished, decide_run
from minimind_ray.store import checkpoint as ck


def _cfg(*overrides):
    return load_config("pipelines/configs/tiny.yaml", ["train.max_steps=12", *overrides])


def _checkpoint(storage, cfg, step, total):
    d = storage / (cfg.name or run_identity(cfg)) / f"checkpoint_2026-11-30_00-00-{step:02d}.000000"
    ck.write_rank_files(d, 0, RNGState().state_dict())
    ck.write_shared_files(d, model_state={}, train_state={}, meta=ck.CheckpointMeta(
        step=step, epoch=0, data_state={}, world_size=1, stage="pretrain", total_steps=total, config=to_dict(cfg),
        prepared_dir="/nowhere"))


def test_identity_ignores_runtime_settings_and_follows_the_training_ones():
    base = run_identity(_cfg())
    assert base.startswith("pretrain-") and len(base) == len("pretrain-") + 10
    for runtime in ("cluster.num_workers=1", "tracking.uri=http://elsewhere:5000", "train.log_interval=7",
                    "cluster.max_failures=9", "checkpoint.interval=3", "train.max_steps=500",
                    "train.micro_batch_size=2", "data.cache_dir=/tmp/other", "train.precision=bf16"):
        assert run_identity(_cfg(runtime)) == base, runtime
    # a defining field written at its default is the run left as it was: so is a field a later version adds
    from minimind_ray.config import RunConfig

    assert run_identity(_cfg(f"train.seed={RunConfig().train.seed}", f"data.pack={RunConfig().data.pack}")) == base
    for defining in ("train.lr=3e-3", "train.seed=7", "model.hidden_size=96", "data.max_seq_len=32",
                     "train.global_batch_size=32", "train.stage=sft", "data.shuffle=false"):
        overrides = [defining] + (["data.format=sft"] if defining == "train.stage=sft" else [])
        assert run_identity(_cfg(*overrides)) != base, defining


def test_a_new_run_then_an_unfinished_one_is_resumed(tmp_path):
    cfg = _cfg()
    name, plan = decide_run(cfg, str(tmp_path))
    assert name == run_identity(cfg) and plan.startswith("starting run")
    _checkpoint(tmp_path, cfg, 4, 12)
    name2, plan = decide_run(cfg, str(tmp_path))
    assert name2 == name and "resuming run" in plan and "from step 4 of 12" in plan
    with pytest.raises(ConfigError, match="resume: must"):
        decide_run(dataclasses.replace(cfg, resume="must"), str(tmp_path / "elsewhere"))


def test_a_finished_run_leaves_the_user_a_clear_choice(tmp_path):
    cfg = _cfg()
    _checkpoint(tmp_path, cfg, 12, 12)
    with pytest.raises(RunFinished, match=r"finished at step 12 .*raise train.max_steps above 12.*resume=never"):
        decide_run(cfg, str(tmp_path))
    name, plan = decide_run(_cfg("train.max_steps=20"), str(tmp_path))  # train further: same run, same name
    assert name == run_identity(cfg) and "further" in plan and "step 12" in plan
    name, plan = decide_run(dataclasses.replace(cfg, resume="never"), str(tmp_path))  # start anew: a new name
    assert name.startswith(run_identity(cfg) + "-") and "left as it is" in plan
    assert (tmp_path / run_identity(cfg)).is_dir()  # nothing deleted



def test_resume_never_under_an_explicit_existing_name_is_refused(tmp_path):
    _checkpoint(tmp_path, _cfg("name=mine"), 3, 12)
    with pytest.raises(ConfigError, match="already exists"):
        decide_run(_cfg("name=mine", "resume=never"), str(tmp_path))
    assert (tmp_path / "mine").is_dir()


def test_an_explicit_name_keeps_working(tmp_path):
    cfg = _cfg("name=my-run")
    assert decide_run(cfg, str(tmp_path)) == ("my-run", "starting run my-run")


def test_the_same_command_after_a_finished_run_is_a_no_op_that_says_where_its_results_are(tmp_path, capsys):
    """Issue 38: running a finished command again exits 0 and names the run directory, its export and its MLflow
    run, before Ray starts; --fresh starts anew; resume=must still refuses."""
    from minimind_ray.cli import build_parser, main
    from minimind_ray.raytrain.train_verb import load_run_config

    argv = ["pretrain", "--config", "pipelines/configs/tiny.yaml", "train.max_steps=12",
            f"checkpoint.storage_path={tmp_path}"]
    cfg = _cfg(f"checkpoint.storage_path={tmp_path}")
    run_dir = tmp_path / run_identity(cfg)
    d = run_dir / "checkpoint_2026-11-30_00-00-12.000000"
    ck.write_rank_files(d, 0, RNGState().state_dict())
    ck.write_shared_files(d, model_state={}, train_state={}, meta=ck.CheckpointMeta(
        step=12, epoch=0, data_state={}, world_size=1, stage="pretrain", total_steps=12, config=to_dict(cfg),
        prepared_dir="/nowhere", mlflow_run_id="0123abcd"))
    (run_dir / "export").mkdir()
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith(f"[minimind-ray] {run_dir.name} already finished at step 12: {run_dir}, "
                              f"{run_dir / 'export'}, MLflow 0123abcd; raise train.max_steps above 12"), out
    assert load_run_config(build_parser().parse_args([*argv, "--fresh"]), "pretrain").resume == "never"
    with pytest.raises(ConfigError, match="resume: must, but run .* finished at step 12") as e:
        decide_run(dataclasses.replace(cfg, resume="must"), str(tmp_path))
    assert not isinstance(e.value, RunFinished)


def test_a_stage_latest_link_chains_stages_without_copying_run_names(tmp_path):
    """Issue 38: runs/<stage>-latest names the newest finished run of a stage; train.init_from takes it."""
    first, second = _cfg("name=pre-a"), _cfg("name=pre-b")
    _checkpoint(tmp_path, first, 12, 12)
    _checkpoint(tmp_path, second, 12, 12)
    link = ck.mark_latest(str(tmp_path / "pre-a"), "pretrain")
    assert link == str(tmp_path / "pretrain-latest") and ck.newest_complete(link).location.startswith(link)
    assert ck.mark_latest(str(tmp_path / "pre-b"), "pretrain") == link  # re-pointed to the newer run
    assert (tmp_path / "pretrain-latest").resolve() == (tmp_path / "pre-b").resolve()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary link left
    chained = load_config(None, ["data.train_path=[demo]", "train.stage=sft", f"train.init_from={link}"])
    assert chained.train.init_from == link and chained.data.format == "sft"
    (tmp_path / "sft-latest").mkdir()  # a run of that name is never replaced
    assert ck.mark_latest(str(tmp_path / "pre-b"), "sft") is None and (tmp_path / "sft-latest").is_dir()
    # in a bucket, which has no links, it is a pointer object: tests/unit/test_object_storage.py
