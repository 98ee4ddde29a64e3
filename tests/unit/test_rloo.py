"""RLOO (stages/rloo.py, issue 48) without Ray: its advantages and loss against values computed by hand, its checks,
and the engine's rloo stage saving and restoring bit for bit (2 workers through the rollout actors, with a crash and an
export: tests/integration/test_grpo.py; on the actor pool with overlap: tests/integration/test_grpo_actors.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from minimind_ray.config import ConfigError, load_config
from minimind_ray.rl.advantages import group_advantages, leave_one_out
from minimind_ray.stages.rloo import RLOOConfig, RLOOPlan, kl_penalised, sequence_loss
from tests.unit.test_grpo import prepared  # noqa: F401 (the prepared prompts and base weights)

LN_HALF = math.log(0.5)


def rloo_config(init_from, *extra):
    return load_config(None, [
        "data.train_path=[demo]", "model.preset=tiny", "train.stage=rloo", "data.format=prompt", "data.max_seq_len=48",
        f"train.init_from={init_from}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=6",
        "train.lr=3e-3", "train.warmup_steps=1", "train.log_interval=1", "checkpoint.interval=3",
        "train.rloo.num_generations=3", "train.rloo.max_gen_len=8", "train.rloo.beta=0.1",
        # a length-proportional term (any module:function works) so that every group's rewards differ
        "train.rloo.rewards=[{name: exact_answer}, {name: 'tests.unit.test_grpo_rewards:double_length', weight: 0.01}]",
        *extra])


def toy_batch():
    """Two prompts of k = 3 completions, two tokens each. Per token log p - log ref, under the mask:
    row 0: 0.2 + 0.4, row 1: 0.2 (its second token masked out), row 2: -0.1 + 0.1, row 3: 0, row 4: 1 + 1,
    row 5: 0.3 (second token masked out); the reference's log-probs are -1 everywhere."""
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.float32)
    diff = torch.tensor([[0.2, 0.4], [0.2, 9.0], [-0.1, 0.1], [0.0, 0.0], [1.0, 1.0], [0.3, 0.3]])
    ref = torch.full((6, 2), -1.0)
    return {"rewards": torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0]), "completion_mask": mask,
            "old_logp": (ref + diff) * mask, "ref_logp": ref}  # old_logp as a rollout stores it: 0 off the mask


def test_rloo_advantages_by_hand():
    b = toy_batch()
    # the KL penalty, beta 0.5 x the completion's summed log p - log ref: 0.6, 0.2, 0, 0, 2, 0.3
    r = kl_penalised(b["rewards"], b["old_logp"], b["ref_logp"], b["completion_mask"], beta=0.5)
    assert r.tolist() == pytest.approx([0.7, -0.1, 0.5, 2.0, 1.0, -1.15], abs=1e-6)
    # each reward minus the mean of the other two of its prompt: 0.7 - (-0.1 + 0.5) / 2 = 0.5, ...
    want = [0.5, -0.7, 0.2, 2.075, 0.575, -2.65]
    assert leave_one_out(r, 3).tolist() == pytest.approx(want, abs=1e-6)
    # the same as GRPO's advantage 'rloo' (G / (G - 1) x the reward minus its group's mean) without scaling
    assert group_advantages(r, 3, "none", "rloo").tolist() == pytest.approx(want, abs=1e-6)

    # the plan: the KL-penalised leave-one-out advantages, and each completion's token-mean KL as a metric sum
    plan = RLOOPlan(cfg=None, section=RLOOConfig(num_generations=3, beta=0.5))
    batch, world1 = toy_batch(), SimpleNamespace(world=1)
    plan.advantages(world1, [batch])
    assert batch["advantages"].tolist() == pytest.approx(want, abs=1e-6)
    assert float(batch["metric_kl"]) == pytest.approx(0.3 + 0.2 + 0.0 + 0.0 + 1.0 + 0.3, abs=1e-6)
    # normalised over the global batch: mean 0 (a group's leave-one-out advantages sum to 0), Bessel's std
    plan = RLOOPlan(cfg=None, section=RLOOConfig(num_generations=3, beta=0.5, normalize_advantages=True))
    halves = [{k: v[:3] for k, v in toy_batch().items()}, {k: v[3:] for k, v in toy_batch().items()}]
    plan.advantages(world1, halves)
    std = math.sqrt((0.5 ** 2 + 0.7 ** 2 + 0.2 ** 2 + 2.075 ** 2 + 0.575 ** 2 + 2.65 ** 2) / 5)
    got = halves[0]["advantages"].tolist() + halves[1]["advantages"].tolist()
    assert got == pytest.approx([a / (std + 1e-4) for a in want], abs=1e-6)
    # no reference (beta 0): the rewards as they are, no KL metric
    plan = RLOOPlan(cfg=None, section=RLOOConfig(num_generations=3, beta=0.0))
    batch = {k: v for k, v in toy_batch().items() if k != "ref_logp"}
    plan.advantages(world1, [batch])
    assert batch["advantages"].tolist() == pytest.approx([0.75, -0.75, 0.0, 1.5, 1.5, -3.0], abs=1e-6)
    assert "metric_kl" not in batch


def _one(logp, old, adv, mask=(1.0, 1.0)):
    return (torch.tensor([logp], requires_grad=True), torch.tensor([old]), torch.tensor([list(mask)]),
            torch.tensor([adv]))


def test_rloo_loss_clips_the_whole_completions_ratio_by_hand():
    # two tokens, p 0.5 and 0.5 now, 0.5 and 0.25 when sampled: the completion's ratio is 2
    logp, old, mask, adv = _one([LN_HALF, LN_HALF], [LN_HALF, math.log(0.25)], 1.5)
    loss, clipped = sequence_loss(logp, old, mask, adv, 0.2, None)
    assert loss.item() == pytest.approx(-1.2 * 1.5, abs=1e-6) and clipped.tolist() == [True]  # min(3.0, 1.8)
    loss.sum().backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]  # the clipped term carries no gradient
    # A < 0: min(-2, -1.2) = -2 is the unclipped term; d/dlog p of each token = -A x ratio = 2
    logp, old, mask, adv = _one([LN_HALF, LN_HALF], [LN_HALF, math.log(0.25)], -1.0)
    loss, clipped = sequence_loss(logp, old, mask, adv, 0.2, None)
    assert loss.item() == pytest.approx(2.0, abs=1e-6) and clipped.tolist() == [False]
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([2.0, 2.0], abs=1e-6)
    # epsilon_high 1.5: ratio 2 is inside [0.8, 2.5], REINFORCE's -ratio x A
    logp, old, mask, adv = _one([LN_HALF, LN_HALF], [LN_HALF, math.log(0.25)], 1.5)
    loss, clipped = sequence_loss(logp, old, mask, adv, 0.2, 1.5)
    assert loss.item() == pytest.approx(-3.0, abs=1e-6) and clipped.tolist() == [False]
    # a token off the mask counts in neither the ratio nor the gradient
    logp, old, mask, adv = _one([LN_HALF, 5.0], [LN_HALF, 0.0], 0.5, mask=(1.0, 0.0))
    loss, _ = sequence_loss(logp, old, mask, adv, 0.2, None)
    loss.sum().backward()
    assert loss.item() == pytest.approx(-0.5, abs=1e-6) and logp.grad[0].tolist() == pytest.approx([-0.5, 0.0])


def test_rloo_config_is_checked():
    base = ["data.train_path=[demo]", "model.preset=tiny", "train.stage=rloo", "train.init_from=."]
    for extra, field in ((["train.rloo.num_generations=1"], "train.rloo.num_generations"),
                         (["train.rloo.max_gen_len=40000"], "train.rloo.max_gen_len"),
                         (["train.rloo.epsilon=1.5"], "train.rloo.epsilon"),
                         (["train.rloo.rewards=[{name: no_such_reward}]"], r"train.rloo.rewards\[0\].name"),
                         (["data.eval_fraction=0.1"], "data.eval_fraction")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, base + extra)
    with pytest.raises(ConfigError, match=r"train\.init_from"):
        load_config(None, ["data.train_path=[demo]", "train.stage=rloo"])
    assert load_config(None, base).data.format == "rlaif"  # the verb's own format, as grpo's


def test_rloo_stage_saves_and_restores_bit_for_bit(prepared, tmp_path):
    """Two passes of two mini-batches over each step's rollouts, advantages normalised over the batch, a reference: a
    run stopped at its step-3 checkpoint and restored samples the same completions (each from its own seed), earns
    the same rewards and ends with the same weights; the reference is the initial weights, never the checkpoint's."""
    from minimind_ray.engine.loop import run
    from tests.unit.test_engine import MetricsByStep
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint
    from minimind_ray.store.pth import read_pth

    path, base = prepared
    cfg = rloo_config(base, "train.rloo.num_iterations=2", "train.rloo.mini_batches=2",
                      "train.rloo.normalize_advantages=true")
    straight, seen = TrainState.build(cfg, path), MetricsByStep()
    run(straight, seen)
    straight.stream.close()
    m, init = seen.by_step[6], read_pth(base)
    for key in ("reward", "reward_std", "reward_exact_answer", "reward_double_length", "kl", "clip_fraction",
                "completion_len", "truncated_fraction", "rollout_s"):
        assert key in m and math.isfinite(m[key]), key
    assert m["kl"] > 0 and max(seen.by_step[s]["clip_fraction"] for s in seen.by_step) > 0  # the 2nd pass clips
    assert any(not torch.equal(v, init[k]) for k, v in straight.model.state_dict().items())

    class StopAt3(MetricsByStep):
        def on_checkpoint(self, step, metrics):
            if step == 3:
                first.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=path)
                raise KeyboardInterrupt

    first = TrainState.build(cfg, path)
    with pytest.raises(KeyboardInterrupt):
        run(first, StopAt3())
    first.stream.close()
    resumed, after = TrainState.build(cfg, path), MetricsByStep()
    resumed.restore(open_checkpoint(tmp_path / "ck"))
    run(resumed, after)
    resumed.stream.close()
    assert {s: after.by_step[s]["reward"] for s in (4, 5, 6)} == {s: seen.by_step[s]["reward"] for s in (4, 5, 6)}
    sa, sb = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(v, init[k]) for k, v in resumed.objective.reference.state_dict().items())
