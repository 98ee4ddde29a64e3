"""Rollouts on a pool of Ray actors (issue 21, part 3; rl/actors.py), driven by the engine on the session's real Ray
without Ray Train (one rank: the pool's logic is the same at any world size, and a Train run of it with 2 workers is
in test_grpo.py): the pool samples exactly what the in-worker sampler samples, a killed actor is made again and its
request retried with the same result, and overlapped generation (one step off-policy) restores bit for bit."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_grpo import grpo_config, prepared  # noqa: F401 (the prepared prompts and base weights)

pytestmark = pytest.mark.integration

ACTORS = ("train.grpo.rollout=actors", "train.grpo.rollout_actors=2", "train.grpo.rollout_actor_cpus=0.5")


def train(cfg, path, hooks=None):
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState

    class Rewards(Hooks):
        def __init__(self):
            self.reward = {}

        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            self.reward[step] = metrics["reward"]

    state, seen = TrainState.build(cfg, path), hooks or Rewards()
    run(state, seen)
    state.stream.close()
    return state, seen


def same_weights(a, b) -> bool:
    a, b = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def in_worker(prepared):
    path, base = prepared
    return train(grpo_config(base, "name=t-in-worker"), path)


def test_the_pool_samples_what_the_worker_samples_and_survives_a_killed_actor(ray_session, prepared, in_worker):
    import ray

    from minimind_ray.engine.loop import Hooks
    from minimind_ray.rl.actors import actor_name

    class KillAtStep3(Hooks):
        def __init__(self):
            self.reward, self.killed_pid = {}, None

        def before_step(self, step):
            if step == 3:
                victim = ray.get_actor(actor_name("t-actors", 0))
                self.killed_pid = ray.get(victim.pid.remote())
                ray.kill(victim, no_restart=True)

        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            self.reward[step] = metrics["reward"]

    path, base = prepared
    state, seen = train(grpo_config(base, "name=t-actors", *ACTORS), path, KillAtStep3())
    assert seen.reward == in_worker[1].reward
    assert same_weights(state, in_worker[0])
    assert state.objective.plan.engine.recreated >= 1
    assert ray.get(ray.get_actor(actor_name("t-actors", 0)).pid.remote()) != seen.killed_pid


def test_overlapped_rollouts_are_one_step_off_policy_and_restore_bit_for_bit(ray_session, prepared, in_worker,
                                                                             tmp_path):
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    path, base = prepared
    cfg = grpo_config(base, "name=t-overlap", *ACTORS, "train.grpo.rollout_overlap=true")
    straight, seen = train(cfg, path)
    # step 1 and each step after a checkpoint (steps 1 and 4 with checkpoints every 3) generate from the current
    # weights, as the in-worker run does; step 2 samples from the weights before step 1's update: other rollouts
    assert seen.reward[1] == in_worker[1].reward[1] and seen.reward[2] != in_worker[1].reward[2]
    assert not same_weights(straight, in_worker[0])

    class StopAt3(Hooks):
        def on_checkpoint(self, step, metrics):
            if step == 3:
                first.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=path)
                raise KeyboardInterrupt

    first = TrainState.build(cfg, path)
    with pytest.raises(KeyboardInterrupt):
        run(first, StopAt3())
    first.stream.close()
    resumed = TrainState.build(cfg, path)
    resumed.restore(open_checkpoint(tmp_path / "ck"))
    run(resumed)
    resumed.stream.close()
    assert same_weights(resumed, straight)
