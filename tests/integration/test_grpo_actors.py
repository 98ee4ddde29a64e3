"""Rollouts on a pool of Ray actors (issue 21, part 3; rl/actors.py), driven by the engine on the session's real Ray
without Ray Train (one rank: the pool's logic is the same at any world size, and a Train run of it with 2 workers is
in test_grpo.py): the pool samples exactly what the in-worker sampler samples, a killed actor is made again and its
request retried with the same result, and overlapped generation (one step off-policy) restores bit for bit."""
from __future__ import annotations

import pytest
import torch

from minimind_ray.engine import Hooks
from tests.unit.test_grpo import grpo_config, prepared  # noqa: F401 (the prepared prompts and base weights)

pytestmark = pytest.mark.integration

ACTORS = ("train.grpo.rollout=actors", "train.grpo.rollout_actors=2", "train.grpo.rollout_actor_cpus=0.5")


def train(cfg, path, hooks=None):
    from minimind_ray.engine import Hooks, TrainState, run

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

    from minimind_ray.engine import Hooks
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


class Recorder:
    """Per step of a run: the weights it started from, its prompt micro-batches and the completions it trained on
    (what the grpo objective's prepare returned: the prompt then the completion in ``input_ids``)."""

    def __init__(self, state):
        from minimind_ray.engine import Hooks

        self.weights, self.prompts, self.completions, self.reward = {}, {}, {}, {}
        rec, prepare = self, state.objective.prepare

        def recorded(st, batches, step):
            out = prepare(st, batches, step)
            rec.completions[step] = [b["input_ids"][:, -b["completion_mask"].shape[1]:].clone() for b in out]
            return out

        state.objective.prepare = recorded  # the objective's own prepare, its output kept

        class Hook(Hooks):
            def before_step(self, step):
                rec.weights[step] = {k: v.detach().clone() for k, v in state.model.state_dict().items()}

            def on_batches(self, step, batches):
                rec.prompts[step] = batches

            def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
                rec.reward[step] = metrics["reward"]

        self.hooks = Hook()


def in_worker_samples(state, weights, step, prompts):
    """What the in-worker sampler (a run that gives the rollout engine its weights every step) samples at ``step``
    from ``weights``: each micro-batch's completions, from the same per-row seeds."""
    import copy

    from minimind_ray.rl.rollout import TorchRollout, row_seeds

    model = copy.deepcopy(state.model)
    model.load_state_dict(weights)
    engine, plan, G = TorchRollout(), state.objective.plan, state.cfg.train.grpo.num_generations
    engine.update_policy(model, step)
    return [engine.generate(mb["prompt_ids"].repeat_interleave(G, 0), mb["prompt_mask"].repeat_interleave(G, 0),
                            plan._params(), seeds=row_seeds(state.cfg.train.seed, step, mb["sample_ids"], G)
                            ).completion_ids for mb in prompts]


def same(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_overlapped_rollouts_are_one_step_off_policy_and_restore_bit_for_bit(ray_session, prepared, in_worker,
                                                                             tmp_path):
    """rl/policy_step.py: with rollout_overlap, step t+1's rollouts are sent during step t from the weights step t
    sampled with, unless step t is a checkpoint step. Checked step by step against the in-worker sampler: step k
    samples what it samples from step k-1's weights (one step stale), and steps 1 and 4 (after the checkpoint of
    step 3) from their own; a run restored from step 3 samples step 4 from the restored weights, as the
    uninterrupted run did, and ends with its weights."""
    from minimind_ray.engine import TrainState, run
    from minimind_ray.store.checkpoint import open_checkpoint

    path, base = prepared
    cfg = grpo_config(base, "name=t-overlap", *ACTORS, "train.grpo.rollout_overlap=true")
    straight = TrainState.build(cfg, path)
    seen = Recorder(straight)
    run(straight, seen.hooks)
    straight.stream.close()
    assert sorted(seen.completions) == list(range(1, 7))
    sampled_from = {1: 1, 2: 1, 3: 2, 4: 4, 5: 4, 6: 5}  # step -> the step whose starting weights it samples with
    for step, source in sampled_from.items():
        want = in_worker_samples(straight, seen.weights[source], step, seen.prompts[step])
        assert same(seen.completions[step], want), f"step {step} did not sample from step {source}'s weights"
        if source != step:  # and not from its own: the check can tell one step's weights from the next
            assert not same(seen.completions[step], in_worker_samples(straight, seen.weights[step], step,
                                                                     seen.prompts[step])), step
    assert seen.reward[1] == in_worker[1].reward[1] and seen.reward[2] != in_worker[1].reward[2]  # the in-worker run
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
    after = Recorder(resumed)
    run(resumed, after.hooks)
    resumed.stream.close()
    assert sorted(after.completions) == [4, 5, 6]
    assert all(torch.equal(after.weights[4][k], seen.weights[4][k]) for k in seen.weights[4])
    assert same(after.completions[4], in_worker_samples(resumed, after.weights[4], 4, after.prompts[4]))
    assert all(same(after.completions[s], seen.completions[s]) for s in (4, 5, 6))
    assert same_weights(resumed, straight)
