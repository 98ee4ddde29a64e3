"""Rollouts on a pool of Ray actors (issue 21, part 3; rl/actors.py), driven by the engine on the session's real Ray
without Ray Train (one rank: the pool's logic is the same at any world size, and a Train run of it with 2 workers is
in test_grpo.py): the pool samples exactly what the in-worker sampler samples, under a constraint too (the actors
given the tokenizer's JSON: rl/constraints.py), a killed actor is made again and its request retried with the same
result, and overlapped generation (one step off-policy) restores bit for bit."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_agent import agent_prepared  # noqa: F401 (the agent_rl prompts and base weights)
from tests.unit.test_grpo import grpo_config, prepared  # noqa: F401 (the prepared prompts and base weights)

pytestmark = pytest.mark.integration

ACTORS = ("train.rollout.engine=actors", "train.rollout.actors=2", "train.rollout.actor_cpus=0.5")


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


def constrained(tmp_path, *extra):
    """train.grpo.json_schema: every completion JSON (an object of one small integer) or cut at max_gen_len."""
    import json

    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "integer", "maximum": 99}},
                                  "required": ["answer"], "additionalProperties": False}))
    return (f"train.grpo.json_schema={schema}", "train.grpo.max_gen_len=12", *extra)


def test_the_pool_samples_what_the_worker_samples_and_survives_a_killed_actor(ray_session, prepared, tmp_path):
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
    in_worker = train(grpo_config(base, *constrained(tmp_path, "name=t-in-worker-constrained")), path)
    state, seen = train(grpo_config(base, *constrained(tmp_path, "name=t-actors", *ACTORS)), path, KillAtStep3())
    assert seen.reward == in_worker[1].reward
    assert same_weights(state, in_worker[0])
    assert state.objective.engine.recreated >= 1
    assert ray.get(ray.get_actor(actor_name("t-actors", 0)).pid.remote()) != seen.killed_pid


class Recorder:
    """Per step of a run: the weights it started from, its prompt micro-batches and the completions it trained on
    (what the grpo objective's prepare returned: the prompt then the completion in ``input_ids``)."""

    def __init__(self, state):
        from minimind_ray.engine.loop import Hooks

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
    engine, plan, G = TorchRollout(), state.objective, state.cfg.train.grpo.num_generations
    engine.update_policy(model, step)
    return [engine.generate(mb["prompt_ids"].repeat_interleave(G, 0), mb["prompt_mask"].repeat_interleave(G, 0),
                            plan.params(), seeds=row_seeds(state.cfg.train.seed, step, mb["sample_ids"], G)
                            ).completion_ids for mb in prompts]


def same(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_overlapped_rollouts_are_one_step_off_policy_and_restore_bit_for_bit(ray_session, prepared, in_worker,
                                                                             tmp_path):
    """rl/plan.py: with train.rollout.overlap, step t+1's rollouts are sent during step t from the weights step t
    sampled with, unless step t is a checkpoint step. Checked step by step against the in-worker sampler: step k
    samples what it samples from step k-1's weights (one step stale), and steps 1 and 4 (after the checkpoint of
    step 3) from their own; a run restored from step 3 samples step 4 from the restored weights, as the
    uninterrupted run did, and ends with its weights."""
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    path, base = prepared
    cfg = grpo_config(base, "name=t-overlap", *ACTORS, "train.rollout.overlap=true")
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


POOL = ("train.rollout.engine=actors", "train.rollout.actors=2", "train.rollout.actor_cpus=0.5")


def reply_length(trajectories, **kwargs):
    """An agent reward term (module:function): the characters of each trajectory's replies."""
    return [float(sum(len(r) for r in t.turns)) for t in trajectories]


def _stopped_and_restored(cfg, path, at: int, ckpt):
    """The run stopped at its step-``at`` checkpoint (as a crash would), restored from it and finished."""
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    class Stop(Hooks):
        def on_checkpoint(self, step, metrics):
            if step == at:
                first.save(ckpt, mlflow_run_id=None, prepared_dir=path)
                raise KeyboardInterrupt

    first = TrainState.build(cfg, path)
    with pytest.raises(KeyboardInterrupt):
        run(first, Stop())
    first.stream.close()
    resumed = TrainState.build(cfg, path)
    resumed.restore(open_checkpoint(ckpt))
    run(resumed)
    resumed.stream.close()
    return resumed


@pytest.mark.parametrize("stage", ["ppo", "agent"])
def test_ppo_and_the_agent_on_the_actor_pool(ray_session, prepared, agent_prepared, stage, tmp_path):
    """Issue 33: one rollout engine (train.rollout) for every RL stage. PPO and the agent stage on a pool of 2 actors
    sample exactly what the worker's own sampler samples (the same rewards each step, the same final weights); with
    overlap (step t+1's completions, or the agent's first turns, generated during step t's update) the run is one step
    off-policy, and a run stopped at its step-2 checkpoint and restored ends bit for bit where the straight one does."""
    from tests.unit.test_agent import agent_config
    from tests.unit.test_ppo import ppo_config

    if stage == "ppo":
        path, base = prepared
        cfg = lambda *extra: ppo_config(base, *extra)  # noqa: E731
    else:  # a term that differs within a group (the demo terms do not, on a random policy): the policy moves
        path, base, _ = agent_prepared
        cfg = lambda *extra: agent_config(  # noqa: E731
            base, "train.agent.rewards=[{name: 'tests.integration.test_grpo_actors:reply_length', weight: 0.01}]",
            *extra)
    worker_state, worker = train(cfg(f"name=t-{stage}-worker"), path)
    pool_state, pool = train(cfg(f"name=t-{stage}-pool", *POOL), path)
    assert pool.reward == worker.reward and same_weights(pool_state, worker_state)
    assert pool_state.objective.engine.calls > 0  # the actors generated, not the worker
    overlap = cfg(f"name=t-{stage}-overlap", *POOL, "train.rollout.overlap=true")
    straight, seen = train(overlap, path)
    assert seen.reward[1] == worker.reward[1]  # step 1 samples from the weights of its own step
    assert not same_weights(straight, worker_state)  # step 4 came from the weights before step 3's update
    assert same_weights(_stopped_and_restored(overlap, path, 2, tmp_path / "ck"), straight)


def test_a_pool_the_cluster_cannot_place_fails_in_its_timeout_naming_the_field(ray_session, prepared):
    """Actors asking more CPUs than the session's Ray has: one line naming train.rollout.actors and what each asked,
    after train.rollout.placement_timeout_s, not an actor pending for ever (raytrain/faults.py stops the run on it)."""
    import time

    from minimind_ray.rl.actors import ActorRollout, RolloutActorsNotPlaced

    path, base = prepared
    cfg = grpo_config(base, "name=t-unplaceable", "train.rollout.engine=actors", "train.rollout.actors=2",
                      "train.rollout.actor_cpus=64", "train.rollout.placement_timeout_s=1.5")
    t0 = time.monotonic()
    with pytest.raises(RolloutActorsNotPlaced, match=r"^train\.rollout\.actors: 2 of 2 rollout actor\(s\) of 64 CPU "
                                                      r"/ 0 GPU each could not be placed within 1\.5 s"):
        ActorRollout(cfg, rank=0, world=1)
    assert time.monotonic() - t0 < 30
