"""The grpo stage on the shared engine: real Ray, 2 gloo workers, tiny preset, real MLflow.

An uninterrupted run samples its completions in the workers. A second run, launched as a user would launch it
(``minimind-ray grpo`` from a directory of its own, with a reward term in that user's own module), samples on a
pool of Ray rollout actors and has a crash injected at step 5 (rank 1): it resumes from its step-4 checkpoint
and must end with the first run's weights, bit for bit, having earned the same reward at every step: every
completion samples from a seed of its own (step, prompt, index) whoever samples it, and the frozen reference is
rebuilt from ``init_from``. The run logs GRPO's metrics to MLflow and exports a model the inference verbs load.
RLOO (issue 48), on the same Ray session, data and tiny model, is held to the same: its actor-pool run with a crash
ends equal to its in-worker run and exports.
"""
from __future__ import annotations

import pytest
import torch

from minimind_ray.config import load_config
from minimind_ray.model.minimind import build_model

from .helpers import final_weights, loss_history, new_shared_with_base_weights, run_tiny, sample_record

pytestmark = pytest.mark.integration

STEPS = 6
GRPO = ("train.stage=grpo", "data.format=prompt", "data.max_seq_len=48", "train.lr=3e-3", "train.warmup_steps=1",
        "train.log_interval=1", "train.grpo.num_generations=4", "train.grpo.max_gen_len=8",
        "train.grpo.temperature=1.0", "train.grpo.beta=0.1",
        # a length-proportional module:function term (imported by the workers) so that groups' rewards differ
        "train.grpo.rewards=[{name: exact_answer}, {name: 'tests.unit.test_grpo_rewards:double_length', weight: 0.01}]")
CRASH = ("train.fail_at_step=5", "train.fail_mode=raise", "train.fail_rank=1")
METRICS = ("rl/reward", "rl/reward_std", "rl/reward_exact_answer", "rl/reward_double_length",
           "rl/reward_double_length_std", "rl/kl", "rl/clip_fraction", "rl/completion_len", "rl/truncated_fraction",
           "rl/zero_std_fraction", "rl/rollout_s", "perf/step_time_s")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return new_shared_with_base_weights(tmp_path_factory, "grpo")


def run_grpo(shared, name, *overrides):
    return run_tiny(shared, name, f"train.init_from={shared['base_pth']}", *GRPO, *overrides, steps=STEPS,
                    ckpt_every=2)


@pytest.fixture(scope="module")
def clean(ray_session, shared):
    """The uninterrupted run, with the in-worker sampler: what the other runs of this module must equal."""
    return run_grpo(shared, "grpo-clean")


def test_a_reward_model_on_a_ray_actor_scores_as_in_the_worker(ray_session, tmp_path):
    """``placement: actor``: one named actor per run, shared by every rank that asks, same scores."""
    import ray

    from minimind_ray.rl.rewards import RewardConfig
    from minimind_ray.rl.rewards import build_rewards
    from tests.unit.test_grpo_rewards import PROMPT, make_classifier_dir

    d = str(make_classifier_dir(tmp_path / "rm"))
    (in_worker,) = build_rewards([RewardConfig("reward_model", path=d)])
    on_actor = RewardConfig("reward_model", path=d, args={"placement": "actor", "actor_cpus": 0})
    (rank0,) = build_rewards([on_actor], run_name="t-actor")
    (rank1,) = build_rewards([on_actor], run_name="t-actor")
    assert rank0.fn.name == rank1.fn.name == "minimind-reward-t-actor-0"
    completions = ["12 plus 7 equals 19.", "no", "19"]
    want = in_worker([PROMPT] * 3, completions, ["19"] * 3)
    assert rank0([PROMPT] * 3, completions, ["19"] * 3) == pytest.approx(want, abs=1e-6)
    assert rank1([PROMPT] * 3, completions, ["19"] * 3) == pytest.approx(want, abs=1e-6)
    ray.kill(ray.get_actor("minimind-reward-t-actor-0"))


def test_a_users_run_on_rollout_actors_crashes_resumes_and_equals_the_uninterrupted_run(ray_session, shared, clean,
                                                                                        tmp_path):
    """As a new user would: ``my_rewards.py`` in a directory of its own, ``PYTHONPATH=.``, ``minimind-ray grpo``
    with ``train.grpo.rollout=actors`` on 2 workers, on the running cluster (``RAY_ADDRESS``). The module reaches
    the workers (runtime_env py_modules and the driver's PYTHONPATH), the two rollout actors sample what the workers
    sampled in the clean run (the same reward, term for term, under another name), rank 1 raises at step 5 and the
    group restarts from step 4 with new actors, and the run ends with the clean run's weights, bit for bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from minimind_ray.generate import generate_text
    from minimind_ray.model.sampling import SamplingParams
    from minimind_ray.store.checkpoint import newest_complete
    from minimind_ray.store.weights import build_inference_model
    from minimind_ray.tokenizer import resolve_tokenizer

    (tmp_path / "my_rewards.py").write_text(
        "def double_length(prompts, completions, answers, factor=2.0):\n"
        "    return [factor * len(c) for c in completions]\n")
    repo = Path(__file__).resolve().parents[2]
    name = "grpo-actors-crash"
    overrides = [f"name={name}", f"train.max_steps={STEPS}", "checkpoint.interval=2", "train.global_batch_size=16",
                 "train.micro_batch_size=4", f"data.cache_dir={shared['cache']}",
                 f"checkpoint.storage_path={tmp_path / 'runs'}", f"tracking.uri={shared['mlflow']}",
                 f"train.sample_log_dir={shared['base'] / 'samples' / name}",
                 "train.collective_timeout_s=60", f"train.init_from={shared['base_pth']}",
                 *[o for o in GRPO if not o.startswith("train.grpo.rewards=")],
                 "train.grpo.rewards=[{name: exact_answer}, {name: 'my_rewards:double_length', weight: 0.01}]",
                 "train.grpo.rollout=actors", "train.grpo.rollout_actors=2", "train.grpo.rollout_actor_cpus=0.5",
                 *CRASH]
    env = {**os.environ, "PYTHONPATH": ".", "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    cli = Path(sys.executable).with_name("minimind-ray")
    proc = subprocess.run([str(cli), "grpo", "--config", str(repo / "pipelines/configs/tiny.yaml"), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "No module named 'my_rewards'" not in proc.stdout + proc.stderr

    _, attempts = sample_record(shared, name)
    assert attempts == {0, 4}, f"expected one restart from step 4, saw attempts {attempts}"
    run_dir = tmp_path / "runs" / name
    ckpt = newest_complete(str(run_dir))
    assert ckpt.meta().step == STEPS
    w, w_clean = ckpt.model_state(), final_weights(clean)
    assert set(w) == set(build_model(load_config("pipelines/configs/tiny.yaml").model).state_dict())  # no reference
    assert all(torch.equal(v, w_clean[k]) for k, v in w.items())
    base = torch.load(shared["base_pth"], weights_only=True)
    assert any(not torch.equal(v, base[k]) for k, v in w.items()), "GRPO did not change the policy"

    # one MLflow run, every step once, the clean run's rewards, and every GRPO metric at every step
    from mlflow.tracking import MlflowClient

    client = MlflowClient(shared["mlflow"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.`minimind.run_name` = '{name}'")
    run_id = run.info.run_id
    for key in ("rl/reward", "rl/reward_double_length"):
        assert loss_history(shared, run_id, key) == loss_history(shared, clean.mlflow_run_id, key), key
    for key in METRICS:
        hist = loss_history(shared, run_id, key)
        assert [s for s, _ in hist] == list(range(1, STEPS + 1)), key
    lengths = [v for _, v in loss_history(shared, run_id, "rl/completion_len")]
    assert all(1 <= v <= 8 for v in lengths)
    assert all(v >= 0 for _, v in loss_history(shared, run_id, "rl/kl"))

    # the export is MiniMind's grpo_<hidden>.pth, and the inference verbs load the run
    exported_pth = run_dir / "export" / "grpo_64.pth"
    assert exported_pth.exists(), sorted(p.name for p in (run_dir / "export").iterdir())
    model, lw = build_inference_model(str(run_dir))
    assert all(torch.equal(v, w[k]) for k, v in model.state_dict().items())  # the trained policy, not the base
    tok = resolve_tokenizer(lw.run_config["data"]["tokenizer"], str(shared["cache"]), lw.model_cfg.generation)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    policy = build_model(lw.model_cfg)
    policy.load_state_dict(w)
    reply = generate_text(model, tok, "What is 1 plus 2?", greedy)
    assert reply == generate_text(policy.eval(), tok, "What is 1 plus 2?", greedy)
    exported, _ = build_inference_model(str(exported_pth), preset="tiny")  # MiniMind's fp16 file loads too
    assert all(torch.allclose(v.float(), w[k], atol=1e-2) for k, v in exported.state_dict().items())


def test_a_reward_plug_in_that_raises_ends_the_run_after_one_attempt_in_one_line(ray_session, shared, tmp_path):
    """Issue 47: a user's reward term that raises is the user's mistake, not a fault. As a user runs it (their module,
    ``minimind-ray grpo`` on the running cluster): exit 2, one line naming the plug-in and its error, no traceback on
    the console, one attempt (the controller saw one failure), and the traceback kept in the run's error.log."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from minimind_ray.raytrain.faults import worker_failures_since

    (tmp_path / "my_rewards.py").write_text("def broken(prompts, completions, answers):\n    raise KeyError('gt')\n")
    repo = Path(__file__).resolve().parents[2]
    overrides = ["name=grpo-broken-reward", "train.max_steps=4", "checkpoint.interval=2", "train.global_batch_size=16",
                 "train.micro_batch_size=4", f"data.cache_dir={shared['cache']}",
                 f"checkpoint.storage_path={tmp_path / 'runs'}", f"tracking.uri={shared['mlflow']}",
                 f"train.init_from={shared['base_pth']}", *[o for o in GRPO if not o.startswith("train.grpo.rewards=")],
                 "train.grpo.rewards=[{name: 'my_rewards:broken'}]"]
    env = {**os.environ, "PYTHONPATH": ".", "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    cli = Path(sys.executable).with_name("minimind-ray")
    proc = subprocess.run([str(cli), "grpo", "--config", str(repo / "pipelines/configs/tiny.yaml"), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "grpo-broken-reward"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: reward plug-in my_rewards:broken: KeyError: 'gt' \(rank [01] at step 1; not retried: the same input "
        rf"would fail again; traceback: {re.escape(str(run_dir / 'error.log'))}\)", errors[0]), errors
    assert worker_failures_since(str(run_dir), 0) == 1  # one attempt: no restart
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and "raise KeyError('gt')" in log


RLOO = ("train.stage=rloo", "data.format=prompt", "data.max_seq_len=48", "train.lr=3e-3", "train.warmup_steps=1",
        "train.log_interval=1", "train.rloo.num_generations=4", "train.rloo.max_gen_len=8", "train.rloo.beta=0.1",
        "train.rloo.rewards=[{name: exact_answer}, {name: 'tests.unit.test_grpo_rewards:double_length', weight: 0.01}]")


def test_rloo_trains_on_two_workers_through_the_actor_pool_resumes_bit_for_bit_and_exports(ray_session, shared):
    """Issue 48: RLOO, added as one module (stages/rloo.py) and one registry name, on the demo's sorting prompts and
    2 Ray Train workers. A run whose completions the workers sample, and one whose completions a pool of 2 rollout
    actors samples and whose rank 1 raises at step 3 (the group restarts from the step-2 checkpoint, with new actors):
    the same reward at every step and the same weights at the end, bit for bit; the second exports MiniMind's
    rloo_<hidden>.pth, which loads as the trained policy."""
    from minimind_ray.store.weights import build_inference_model

    def run_rloo(name, *overrides):
        return run_tiny(shared, name, f"train.init_from={shared['base_pth']}", *RLOO, *overrides, steps=4,
                        ckpt_every=2)

    clean = run_rloo("rloo-clean")
    pool = run_rloo("rloo-pool", "train.rollout.engine=actors", "train.rollout.actors=2",
                    "train.rollout.actor_cpus=0.5", "train.fail_at_step=3", "train.fail_mode=raise", "train.fail_rank=1")
    _, attempts = sample_record(shared, "rloo-pool")
    assert attempts == {0, 2}, f"expected one restart from step 2, saw attempts {attempts}"
    w, w_clean = final_weights(pool), final_weights(clean)
    assert set(w) == set(w_clean) and all(torch.equal(v, w_clean[k]) for k, v in w.items())
    base = torch.load(shared["base_pth"], weights_only=True)
    assert any(not torch.equal(v, base[k]) for k, v in w.items()), "RLOO did not change the policy"
    for key in ("rl/reward", "rl/reward_double_length", "rl/kl"):
        hist = loss_history(shared, pool.mlflow_run_id, key)
        assert [s for s, _ in hist] == [1, 2, 3, 4] and hist == loss_history(shared, clean.mlflow_run_id, key), key
    exported = pool.exports["pth"]
    assert exported.endswith("/rloo_64.pth"), pool.exports
    model, _ = build_inference_model(exported, preset="tiny")
    assert all(torch.allclose(v.float(), w[k], atol=1e-2) for k, v in model.state_dict().items())  # fp16, as MiniMind
