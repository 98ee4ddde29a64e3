"""A mistake is not a fault (issue 47), at the engine level: no Ray.

* failures.py: how the Train controller classes one failed attempt from every rank's error (a fault, the user's
  mistake, an error), and the policy that ends a run on a mistake or on an error that recurs;
* config.py:resolve, the run resolved once: train.init_from's architecture adopted when the user wrote none and
  refused, naming both, when one written differs; an init_from with no complete checkpoint;
* preflight.py: what files decide before Ray starts: a reference of another architecture; a worker group a local Ray
  cannot hold; a data file none of whose first records fits.
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from minimind_ray.config import ConfigError, load_config, resolve, resolve_run, run_identity
from minimind_ray.failures import (ERROR, FAULT, MISTAKE, STEP_ATTR, FailurePolicy, Mistake, RunStopped, classify,
                                   normalise, plugin_call, reading)
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.model.config import ModelConfig
from minimind_ray.preflight import LOOK_RECORDS, check_local_fit, check_parents, look_at_data
from minimind_ray.store.pth import save_pth

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"


def at_step(e: BaseException, step: int) -> BaseException:
    setattr(e, STEP_ATTR, step)  # what raytrain/worker.py attaches before the error leaves the worker
    return e


def through_ray(e: BaseException) -> BaseException:
    """The exception as the controller receives it: pickled across processes."""
    return pickle.loads(pickle.dumps(e))


# --------------------------------------------------------------------------- classing a failed attempt


def test_a_mistake_ends_the_run_at_once_and_says_the_field_rank_and_step():
    with pytest.raises(Mistake) as raised:
        with reading("train.init_from=runs/x"):
            raise RuntimeError("Error(s) in loading state_dict:\n\tsize mismatch for lm_head.weight")
    e = through_ray(at_step(raised.value, 0))
    with pytest.raises(RunStopped) as stop:
        FailurePolicy().decide({1: e})
    assert stop.value.verdict.kind == MISTAKE and stop.value.verdict.rank == 1
    line = str(stop.value)
    assert "\n" not in line and line.startswith("train.init_from=runs/x: RuntimeError: Error(s) in loading")
    assert "rank 1 at step 0; not retried" in line
    assert FailurePolicy(retry_mistakes=True).decide({1: e}).kind == MISTAKE  # cluster.retry_mistakes: retried


def test_an_error_is_retried_once_and_ends_the_run_when_the_next_attempt_fails_the_same_way():
    policy = FailurePolicy()
    first = through_ray(at_step(KeyError("answer at 0x7f3a2c10 pid=4411"), 5))
    assert policy.decide({0: first}).kind == ERROR  # retried
    elsewhere = through_ray(at_step(KeyError("answer at 0x7f3a2c10 pid=4411"), 6))
    assert policy.decide({0: elsewhere}).kind == ERROR  # another step: another failure, retried again
    again = through_ray(at_step(KeyError("answer at 0x55d0e1f0 pid=5120"), 6))  # other pid and address: the same
    with pytest.raises(RunStopped, match=r"rank 0 failed the same way twice at step 6: KeyError"):
        policy.decide({0: again})


def test_faults_are_never_stopped_and_win_over_a_mistake_beside_them():
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    policy = FailurePolicy()
    died = WorkerHealthCheckFailedError("worker died", failure=RuntimeError("actor died"))
    peer = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4521")
    injected = RuntimeError("injected failure at step 3 (train.faults)")
    timeout = RuntimeError("Timed out waiting 10000ms for send operation to complete")
    storage = ConnectionResetError("AWS Error NETWORK_CONNECTION during GetObject")
    for _ in range(3):  # the same fault again and again stays a fault: cluster.max_failures decides
        for errors in ({1: died}, {0: at_step(peer, 6)}, {0: at_step(injected, 3)}, {0: timeout}, {0: storage},
                       {0: Mistake("train.init_from=x", "no such file"), 1: died}):
            assert policy.decide({r: through_ray(e) for r, e in errors.items()}).kind == FAULT


def test_reading_keeps_transient_storage_errors_faults_and_plugin_calls_become_mistakes():
    with pytest.raises(ConnectionResetError):  # a flaky bucket, retried like a fault
        with reading("train.init_from=s3://b/run"):
            raise ConnectionResetError("reset")
    with pytest.raises(Mistake, match=r"^train.init_from=s3://b/run: FileNotFoundError: s3://b/run: no such file"):
        with reading("train.init_from=s3://b/run"):
            raise FileNotFoundError("s3://b/run: no such file")
    with pytest.raises(Mistake, match=r"^reward plug-in m:f: ZeroDivisionError: division by zero$"):
        with plugin_call("reward plug-in m:f"):
            1 / 0
    with pytest.raises(TimeoutError):  # a plug-in's network call that timed out: transient
        with plugin_call("reward plug-in m:f"):
            raise TimeoutError("api.example.com")


def test_a_reward_plug_in_that_raises_is_the_users_mistake_and_a_built_in_rule_is_not():
    from minimind_ray.rl.rewards import RewardConfig, build_rewards

    (term,) = build_rewards([RewardConfig("tests.unit.test_mistakes:broken_reward")])
    with pytest.raises(Mistake, match=r"^reward plug-in tests.unit.test_mistakes:broken_reward: KeyError: 'gt'"):
        term(["p"], ["c"], ["a"])
    with pytest.raises(Mistake, match=r"cannot load reward 'tests.unit.nowhere:f'"):
        build_rewards([RewardConfig("tests.unit.nowhere:f")])
    (rule,) = build_rewards([RewardConfig("exact_answer")])
    assert rule(["p"], ["3"], ["3"]) == [1.0]


def broken_reward(prompts, completions, answers):
    raise KeyError("gt")


def test_normalising_a_message_drops_what_differs_between_attempts_only():
    assert normalise("pid=12 at 0xdeadbeef on 10.1.2.3:6379 after 3.5 s at 2026-12-06 07:01:02") == \
        normalise("pid=9 at 0x1234 on 10.1.2.4:6380 after 12 s at 2026-12-07 08:11:12")
    assert normalise("step 3: bad token 17") != normalise("step 4: bad token 17")


def test_a_worker_exception_keeps_its_step_when_pickled():
    e = through_ray(at_step(ValueError("x"), 7))
    assert getattr(e, STEP_ATTR) == 7
    assert classify({0: e}).signature == ("ValueError", "x", 7)


# --------------------------------------------------------------------------- before Ray: the weights


def _cfg(*overrides):
    """An sft config as the command line composes it, not yet resolved (config.py:resolve validates it)."""
    base = ["data.train_path=[demo]", "train.stage=sft", f"data.tokenizer={FIXTURE / 'tokenizer'}"]
    return load_config(None, [*base, *overrides], check=False)


def test_init_from_gives_the_architecture_when_no_model_field_is_written_and_the_identity_is_stable():
    ckpt = str(FIXTURE / "checkpoint_step4")
    cfg = _cfg(f"train.init_from={ckpt}")
    assert cfg.model.hidden_size == 512  # the default preset, until the check reads the weights
    adopted = resolve(cfg)
    m = adopted.cfg.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.vocab_size) == (32, 2, 2, 320)
    assert cfg.model.hidden_size == 512  # the user's config is not modified
    assert adopted.lines == (f"model: tiny (hidden 32, 2 layers, 2 heads, vocab 320), from train.init_from={ckpt} "
                             f"(a checkpoint at step 4); no model.* was given, so not the default minimind2-small",)
    again = resolve(_cfg(f"train.init_from={ckpt}")).cfg
    assert run_identity(again) == run_identity(adopted.cfg)  # the same command finds the same run
    # a model field that shapes nothing is the user's and stays; the architecture is still the weights'
    kept = resolve(_cfg(f"train.init_from={ckpt}", "model.dropout=0.1")).cfg
    assert kept.model.dropout == 0.1 and kept.model.hidden_size == 32


def test_a_written_architecture_that_differs_from_init_from_is_refused_naming_both(tmp_path):
    ckpt = str(FIXTURE / "checkpoint_step4")
    with pytest.raises(ConfigError) as e:
        resolve(_cfg(f"train.init_from={ckpt}", "model.preset=tiny"))
    msg = str(e.value)
    assert msg.startswith(f"train.init_from: {ckpt} is tiny (hidden 32, 2 layers, 2 heads, vocab 320), a checkpoint "
                          f"at step 4; this run asks tiny (hidden 64, 2 layers, 4 heads, vocab 6400) (hidden_size 64 "
                          f"vs 32"), msg
    assert msg.endswith("drop model.preset to train the weights' own architecture, or make them equal")
    # the same architecture written out is fine: a bare .pth of tiny under model.preset=tiny
    pth = tmp_path / "tiny.pth"
    save_pth(build_model(ModelConfig(**preset_values("tiny")), seed=0), str(pth))
    cfg = _cfg(f"train.init_from={pth}", "model.preset=tiny")
    assert resolve(cfg).cfg is cfg


def test_an_init_from_without_weights_or_with_adapters_only_is_refused_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^train.init_from: .*empty: no complete checkpoint_\* directory"):
        resolve(_cfg(f"train.init_from={tmp_path / 'empty'}"))
    torch.save({"model.layers.0.self_attn.q_proj.lora.A.weight": torch.zeros(4, 64)}, tmp_path / "lora.pth")
    with pytest.raises(ConfigError, match=r"holds LoRA adapters only .* merge them first"):
        resolve(_cfg(f"train.init_from={tmp_path / 'lora.pth'}"))
    # a checkpoint cut short: a file of COMPLETE.json's list missing
    cut = tmp_path / "run" / "checkpoint_000000"
    shutil.copytree(FIXTURE / "checkpoint_step4", cut)
    (cut / "train_state.pt").unlink()
    with pytest.raises(ConfigError, match=r"^train.init_from: .*no complete checkpoint_\* directory"):
        resolve(_cfg(f"train.init_from={tmp_path / 'run'}"))


def test_a_reference_of_another_architecture_is_refused_and_a_teacher_needs_only_be_whole(tmp_path):
    pth = tmp_path / "tiny.pth"
    save_pth(build_model(ModelConfig(**preset_values("tiny")), seed=0), str(pth))
    ckpt = str(FIXTURE / "checkpoint_step4")
    dpo = resolve_run(None, ["data.train_path=[demo]", "train.stage=dpo", "model.preset=tiny",
                             f"train.dpo.reference={ckpt}"])
    with pytest.raises(ConfigError, match=r"^train.dpo reference: .* the run's model is tiny \(hidden 64"):
        check_parents(dpo)
    distill = resolve_run(None, ["data.train_path=[demo]", "train.stage=distill", "model.preset=tiny",
                                 f"train.distill.teacher_weights={ckpt}"])
    check_parents(distill)  # a teacher of its own architecture (train.distill.teacher_preset) is the user's choice
    (tmp_path / "nothing").mkdir()
    gone = resolve_run(None, ["data.train_path=[demo]", "train.stage=distill", "model.preset=tiny",
                              f"train.distill.teacher_weights={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match=r"^train.distill teacher: .*nothing: no complete checkpoint"):
        check_parents(gone)


# --------------------------------------------------------------------------- before Ray: a local Ray, the data


def test_more_workers_than_a_local_ray_can_hold_are_refused_naming_the_largest_count_that_fits():
    import os

    most = 2 * os.cpu_count()
    tiny = lambda *o: load_config("pipelines/configs/tiny.yaml",  # noqa: E731
                                  ["train.micro_batch_size=1", "train.global_batch_size=64", *o])
    with pytest.raises(ConfigError, match=rf"^cluster.num_workers: 64 training workers .* at most {most} fit .* "
                                          rf"use cluster.num_workers<={most}"):
        check_local_fit(tiny("cluster.num_workers=64"))
    check_local_fit(tiny("cluster.num_workers=2"))  # make demo's size
    check_local_fit(tiny(f"cluster.num_workers={most}"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^cluster.use_gpu: 2 GPU worker\(s\), and this machine has 0 GPU"):
            check_local_fit(tiny("cluster.use_gpu=true"))
    # one worker's memory estimate beyond the machine's memory (the 1B preset at 4 x 32k tokens): refused
    with pytest.raises(ConfigError, match=r"^cluster.num_workers: 1 workers need about .* GiB by the memory estimate"):
        check_local_fit(load_config(None, ["data.train_path=[demo]", "model.preset=minimind2-1b",
                                           "data.max_seq_len=32768", "cluster.num_workers=1",
                                           "train.micro_batch_size=4", "train.global_batch_size=4"]))


def _jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_file_none_of_whose_first_records_fits_the_format_is_refused_with_its_counts(tmp_path):
    texts = _jsonl(tmp_path / "pretrain.jsonl", [{"text": f"doc {i}"} for i in range(50)])
    with pytest.raises(ConfigError) as e:
        look_at_data(load_config(None, [f"data.train_path={texts}", "train.stage=sft"]))
    assert str(e.value) == (f"data.train_path: {texts}: none of its first 50 records is a sft record (data.format=sft, "
                            f"the sft verb's) (missing_field: 50; line 1: field 'conversations' missing); they read as "
                            f"pretrain records (data.format=pretrain, or the verb that trains on them)")
    look_at_data(load_config(None, [f"data.train_path={texts}", "train.stage=pretrain"]))
    # one good record among bad ones is prepare's to count (data.bad_records), not a refusal
    chat = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"text": "x"}] * 10 + [chat])
    look_at_data(load_config(None, [f"data.train_path={mixed}", "train.stage=sft"]))
    # the look stops at the first LOOK_RECORDS records: a good record after them is not seen
    late = _jsonl(tmp_path / "late.jsonl", [{"text": "x"}] * LOOK_RECORDS + [chat])
    with pytest.raises(ConfigError, match=rf"none of its first {LOOK_RECORDS} records is a sft record"):
        look_at_data(load_config(None, [f"data.train_path={late}", "train.stage=sft"]))


def test_a_pipeline_checks_the_next_training_step_against_the_weights_a_step_just_made(tmp_path):
    """The demo pipeline's sft step (demo_sft.yaml writes model.preset: demo) starting from a pretrain result of
    another architecture is refused when the pretrain step ends, before the steps between them."""
    from minimind_ray.pipeline.config import load_pipeline
    from minimind_ray.pipeline.run import _Context, check_the_next_training_step

    pipe = load_pipeline("pipelines/configs/pipeline_demo.yaml")
    ctx = _Context(pipe, [f"checkpoint.storage_path={tmp_path}"], str(tmp_path), None, "e")
    pretrain = next(s for s in pipe.steps if s.name == "pretrain")
    ctx.results["pretrain"], ctx.last_trained = {"checkpoint_dir": str(FIXTURE / "checkpoint_step4")}, "pretrain"
    with pytest.raises(ConfigError, match=r"^step sft \(starts from step pretrain\): train.init_from: .* is tiny "
                                          r"\(hidden 32, .*; this run asks demo \(hidden 128"):
        check_the_next_training_step(ctx, pretrain)
    grpo = next(s for s in pipe.steps if s.name == "grpo")
    check_the_next_training_step(ctx, grpo)  # the last training step: nothing after it


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_a_reference_that_does_not_load_is_the_users_mistake_naming_its_field(stage):
    """In a worker (the check before Ray refuses it first): weights of another architecture as a stage's reference
    fail its set-up as a Mistake that names the field, so the controller ends the run instead of retrying it."""
    from minimind_ray.stages import build_objective

    ref = FIXTURE / "checkpoint_step4"  # hidden 32: not tiny's
    cfg = load_config(None, ["data.train_path=[demo]", f"train.stage={stage}", "model.preset=tiny",
                             "train.micro_batch_size=2", "train.global_batch_size=4", f"train.{stage}.reference={ref}"])
    with pytest.raises(Mistake, match=rf"^train.{stage}.reference={ref}: RuntimeError: .*size mismatch"):
        build_objective(cfg).setup(build_model(cfg.model), torch.device("cpu"))
