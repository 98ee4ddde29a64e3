"""The GRPO options of verl, TRL and DAPO (issue 21, part 2; docs/rl.md), each against values worked out by hand,
and the engine running them: several optimizer updates per rollout batch, dynamic sampling, truncation masks, the
adaptive KL controller restored from a checkpoint, and per-row sampling seeds. No Ray."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from minimind_ray.rl.advantages import group_advantages
from minimind_ray.rl.losses import aggregate_loss, kl_estimate, loss_units, per_token_loss, sequence_mean
from minimind_ray.rl.rollout import SamplingParams, TorchRollout, row_seeds
from minimind_ray.stages.grpo import AdaptiveKL, GRPOPlan
from tests.unit.test_grpo import _left_pad, _one_token, grpo_config, prepared, tiny  # noqa: F401 (fixtures)

LN_HALF = math.log(0.5)


def test_advantages_rloo_batch_and_unscaled_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 1.0])  # two groups of three
    # group means 1/3 and 5/3; leave-one-out: r_i - mean of the other two = 3/2 * (r_i - group mean)
    assert group_advantages(r, 3, scale="none").tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 4 / 3, -2 / 3, -2 / 3])
    assert group_advantages(r, 3, scale="none", kind="rloo").tolist() == pytest.approx([1.0, -0.5, -0.5, 2.0, -1.0, -1.0])
    assert group_advantages(r, 3, scale="none", kind="rloo")[0] == pytest.approx(1.0 - (0.0 + 0.0) / 2)
    # the batch's std (given: the engine all-reduces it) divides every group alike
    std = float(r.std(unbiased=False))
    assert group_advantages(r, 3, scale="batch", batch_std=std).tolist() == pytest.approx(
        [x / (std + 1e-4) for x in [2 / 3, -1 / 3, -1 / 3, 4 / 3, -2 / 3, -2 / 3]])
    # the group's std (MiniMind's): group 1's population std is sqrt(2)/3
    assert group_advantages(r, 3)[0].item() == pytest.approx((2 / 3) / (math.sqrt(2) / 3 + 1e-4), abs=1e-6)


def test_kl_estimators_and_their_gradients_by_hand():
    logp = torch.tensor([LN_HALF], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    d = LN_HALF - math.log(0.25)  # log p - log ref = ln 2
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-d) + d - 1)  # exp(ref - logp) - ... - 1
    kl_estimate(logp, ref, "k2").sum().backward()
    assert logp.grad.item() == pytest.approx(d)  # d/dlogp of (logp - ref)^2 / 2
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_clip_higher_widens_only_the_upper_clip():
    # ratio 1.25 with A > 0: clipped at 1.2 by epsilon 0.2, not by clip_high 0.28 (DAPO's values)
    logp, old, _, adv = _one_token(math.log(0.5), math.log(0.4), 0.0, 1.0)
    loss, clipped, _ = per_token_loss(logp, old, None, adv, "grpo", 0.2, 5.0, 0.0)
    assert loss.item() == pytest.approx(-1.2) and clipped.tolist() == [[True]]
    loss, clipped, _ = per_token_loss(logp, old, None, adv, "grpo", 0.2, 5.0, 0.0, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and clipped.tolist() == [[False]]
    # ratio 0.75 with A < 0: the lower clip is still 1 - epsilon = 0.8 -> min(-0.75, -0.8) = -0.8
    logp, old, _, adv = _one_token(math.log(0.3), math.log(0.4), 0.0, -1.0)
    loss, _, _ = per_token_loss(logp, old, None, adv, "grpo", 0.2, 5.0, 0.0, clip_high=0.28)
    assert loss.item() == pytest.approx(0.8)


def test_loss_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the third completion was dropped
    assert aggregate_loss(loss, mask, "seq-mean", 8).item() == 2.0 + 4.0  # token means, summed
    assert aggregate_loss(loss, mask, "token-mean", 8).item() == 1 + 2 + 3 + 4  # every token
    assert aggregate_loss(loss, mask, "seq-sum-norm", 8).item() == pytest.approx((6 + 4) / 8)  # over max_gen_len
    assert loss_units(mask, "seq-mean") == loss_units(mask, "seq-sum-norm") == 2  # completions with a token
    assert loss_units(mask, "token-mean") == 4
    assert sequence_mean(loss, mask).tolist() == [2.0, 4.0, 0.0]


def test_adaptive_kl_moves_beta_toward_the_target_by_hand():
    c = AdaptiveKL(0.1, target=0.05, horizon=10)
    c.update(0.1)  # KL twice the target: error clipped to +0.2 -> beta * (1 + 0.2 / 10)
    assert c.beta == pytest.approx(0.1 * 1.02)
    c.update(0.04)  # error -0.2 exactly -> * 0.98
    assert c.beta == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = AdaptiveKL(0.1, target=None, horizon=10)
    fixed.update(5.0)
    assert fixed.beta == 0.1
    again = AdaptiveKL(0.1, target=0.05, horizon=10)
    again.load_state_dict(c.state_dict())
    assert again.beta == c.beta


def test_per_row_seeds_make_a_row_independent_of_its_batch(tiny):
    """What lets a rollout actor sample what the worker would: a row's sampled tokens depend on its seed and its
    prompt, not on the other rows of the batch or their order."""
    prompts = [[1, 300, 301, 302], [1, 400], [1, 500, 501, 502, 503, 504]]
    eng = TorchRollout()
    eng.update_policy(tiny, 1)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, eos_id=2, pad_id=0)
    seeds = row_seeds(1337, 4, torch.tensor([7, 8, 9]), 1)
    together = eng.generate(*_left_pad(prompts), params, seeds=seeds)
    for i in (2, 0, 1):
        alone = eng.generate(*_left_pad([prompts[i]]), params, seeds=seeds[i:i + 1])
        n = int(alone.completion_mask.sum())
        assert together.completion_ids[i, :n].tolist() == alone.completion_ids[0, :n].tolist()
    other_step = eng.generate(*_left_pad(prompts), params, seeds=row_seeds(1337, 5, torch.tensor([7, 8, 9]), 1))
    assert not torch.equal(other_step.completion_ids, together.completion_ids)


def _run(cfg, prepared_dir, hooks=None):
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState

    class Keep(Hooks):
        def __init__(self):
            self.metrics = {}

        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            self.metrics[step] = metrics

    state, seen = TrainState.build(cfg, prepared_dir), hooks or Keep()
    run(state, seen)
    return state, seen


def test_several_updates_per_rollout_batch_move_the_ratio_and_clip(prepared):
    """num_iterations 2 x mini_batches 2: four AdamW steps per step, the same rollouts trained twice; in the second
    pass the ratio to the behaviour policy is no longer 1, so a tight clip acts (it cannot in the first)."""
    path, base = prepared
    one, seen1 = _run(grpo_config(base, "train.max_steps=2", "train.grpo.loss_type=grpo", "train.grpo.epsilon=0.01"),
                      path)
    four, seen4 = _run(grpo_config(base, "train.max_steps=2", "train.grpo.loss_type=grpo", "train.grpo.epsilon=0.01",
                                   "train.grpo.num_iterations=2", "train.grpo.mini_batches=2"), path)
    adam_steps = lambda s: int(next(iter(s.optimizer.state.values()))["step"])  # noqa: E731
    assert adam_steps(one) == 2 and adam_steps(four) == 8
    assert all(m["clip_fraction"] == 0.0 for m in seen1.metrics.values())  # one pass: ratio 1 exactly
    assert all(m["clip_fraction"] > 0.0 for m in seen4.metrics.values())
    # the rollout metrics are per completion whatever the split: the same first step's rewards on both sides
    assert seen4.metrics[1]["reward"] == pytest.approx(seen1.metrics[1]["reward"], abs=1e-12)
    assert one.scheduler.last_epoch == four.scheduler.last_epoch == 2  # the lr schedule moves once per step
    for s in (one, four):
        s.stream.close()


def test_dynamic_sampling_and_truncation_masks(prepared):
    """exact_answer alone on sums the tiny model never gets right: every group's rewards are all 0, so dynamic
    sampling resamples every group and then drops them all (no loss, no gradient); with mask_truncated every
    completion that reached max_gen_len carries no loss either."""
    from minimind_ray.engine.state import TrainState
    from minimind_ray.engine.step import train_step

    path, base = prepared
    cfg = grpo_config(base, "train.grpo.rewards=[{name: exact_answer}]", "train.grpo.dynamic_sampling=2")
    state = TrainState.build(cfg, path)
    out = train_step(state, state.stream.next_step(), 1)
    assert float(out.extras["resampled_fraction"] / out.metric_weight) == 1.0
    assert float(out.extras["dropped_fraction"] / out.metric_weight) == 1.0
    assert float(out.weight) == 1.0  # no completion left to learn from (clamped at 1)
    assert all(p.grad is None for p in state.params)  # zero_grad(set_to_none) after a step of zero gradient
    state.stream.close()
    cut = TrainState.build(grpo_config(base, "train.grpo.mask_truncated=true", "train.grpo.max_gen_len=2"), path)
    batches = cut.objective.prepare(cut, cut.stream.next_step(), 1)
    for b in batches:
        ends = b["input_ids"][:, -2:]
        finished = (ends == cut.objective.tokenizer.eos_id).any(dim=1)
        assert torch.equal(b["completion_mask"].sum(dim=1) > 0, finished)  # only completions that ended train
    cut.stream.close()


def test_the_adaptive_beta_is_checkpointed_with_the_run(prepared, tmp_path):
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    path, base = prepared
    cfg = grpo_config(base, "train.grpo.kl_target=1e-6", "train.grpo.kl_horizon=2")
    straight, seen = _run(cfg, path)
    betas = [seen.metrics[s]["beta"] for s in sorted(seen.metrics)]
    assert betas[0] == pytest.approx(0.1) and betas[-1] > betas[0]  # KL above a tiny target: beta grows
    assert 0.0 <= seen.metrics[6]["entropy"] <= math.log(6400)

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
    assert resumed.objective.kl.beta == first.objective.kl.beta != 0.1
    run(resumed)
    assert resumed.objective.kl.beta == straight.objective.kl.beta
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- one micro-batch's rollout, by hand


class _Letters:
    """A tokenizer for the scripted rollouts: id i is chr(ord('a') + i - 5); 0 (pad) and 2 (EOS) are special."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if skip_special_tokens and i in (0, 2) else chr(ord("a") + i - 5) for i in ids)


class _Scripted:
    """A rollout engine that returns the given rollouts in turn and records what it was asked."""

    def __init__(self, *rollouts):
        self.rollouts, self.calls = list(rollouts), []

    def generate(self, prompt_ids, prompt_mask, params, seeds):
        self.calls.append((prompt_ids.clone(), seeds.clone()))
        self.given = getattr(self, "given", []) + [(prompt_mask.clone(), params)]
        return self.rollouts.pop(0)


def _roll(rows, truncated):
    from minimind_ray.rl.rollout import Rollout

    ids = torch.tensor(rows)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):  # through the first EOS, or every token
        end = row.index(2) + 1 if 2 in row else len(row)
        valid[i, :end] = True
    return Rollout(completion_ids=ids, completion_mask=valid, logprobs=-0.5 * valid.float(),
                   truncated=torch.tensor(truncated))


def _micro_batch():
    return {"prompt_ids": torch.tensor([[0, 9, 10], [11, 12, 13]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "answer_utf8": torch.tensor([[52, 0], [55, 56]]), "answer_len": torch.tensor([1, 2]),
            "sample_ids": torch.tensor([40, 41])}


def _terms(seen):
    from minimind_ray.rl.rewards import RewardTerm

    def length(prompts, completions, answers):
        seen.append((prompts, completions, answers))
        return [len(c) for c in completions]

    return [RewardTerm("len", 0.5, length, {}), RewardTerm("one", 2.0, lambda p, c, a: [1.0] * len(c), {})]


def _rollout(engine, mb=None, seen=None, **kw):
    """rollout_micro_batch on the scripted pieces: 2 prompts x 2 completions of up to 4 tokens, the two reward
    terms (their calls appended to ``seen``)."""
    from minimind_ray.rl.completions import rollout_micro_batch

    kw = {"params": SamplingParams(max_new_tokens=4), **kw}
    return rollout_micro_batch(_micro_batch() if mb is None else mb, engine=engine, group_size=2,
                               rewards=_terms([] if seen is None else seen), tokenizer=_Letters(), **kw)


def _metrics(out) -> dict:
    return {k[len("metric_"):]: float(v) for k, v in out.items() if k.startswith("metric_")}


def test_a_micro_batchs_rollout_resamples_a_flat_group_and_sums_its_metrics_by_hand():
    """2 prompts x 2 completions; the second prompt's two are cut at 4 tokens with equal rewards (a flat group), so
    one dynamic-sampling round samples that group again (wider: 5 tokens). Every key, by hand."""
    engine = _Scripted(_roll([[5, 6, 2, 0], [5, 5, 5, 5], [7, 7, 7, 7], [7, 7, 7, 7]], [False, True, True, True]),
                       _roll([[8, 2, 0, 0, 0], [8, 8, 8, 2, 0]], [False, False]))
    seen = []
    params = SamplingParams(max_new_tokens=5, eos_id=2, pad_id=0)
    mb = _micro_batch()
    out = _rollout(engine, mb, seen, params=params, seed=3, step=9, dynamic_rounds=2)
    # what the engine and the rewards were given; the second round found no flat group and sampled nothing
    (ids0, seeds0), (ids1, seeds1) = engine.calls
    assert ids0.tolist() == [[0, 9, 10], [0, 9, 10], [11, 12, 13], [11, 12, 13]] and ids1.tolist() == ids0[2:].tolist()
    (mask0, params0), (mask1, params1) = engine.given
    assert mask0.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]] and mask1.tolist() == mask0[2:].tolist()
    assert params0 is params and params1 is params
    assert torch.equal(seeds0, row_seeds(3, 9, mb["sample_ids"], 2))
    assert torch.equal(seeds1, row_seeds(3, 9, mb["sample_ids"][1:], 2, 1))
    assert seen[0] == (["ef", "ef", "ghi", "ghi"], ["ab", "aaaa", "cccc", "cccc"], ["4", "4", "78", "78"])
    assert seen[1:] == [(["ghi", "ghi"], ["d", "ddd"], ["78", "78"])]
    # the batch: prompts then completions, widened to the resampled width (a cut completion's pad is no token)
    assert out["input_ids"].tolist() == [[0, 9, 10, 5, 6, 2, 0, 0], [0, 9, 10, 5, 5, 5, 5, 0],
                                         [11, 12, 13, 8, 2, 0, 0, 0], [11, 12, 13, 8, 8, 8, 2, 0]]
    assert out["input_ids"].dtype == torch.int64 and out["completion_mask"].dtype == torch.float32
    mask = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert out["completion_mask"].tolist() == mask
    assert out["attention_mask"].tolist() == [[0, 1, 1] + m for m in mask[:2]] + [[1, 1, 1] + m for m in mask[2:]]
    assert out["old_logp"].tolist() == [[-0.5 * v for v in m] for m in mask]
    assert out["rewards"].tolist() == [3.0, 4.0, 2.5, 3.5]  # 0.5 x length + 2 x 1
    assert "ref_logp" not in out
    metrics = _metrics(out)
    assert all(v.dtype == torch.float64 for k, v in out.items() if k.startswith("metric_"))
    assert metrics == {"reward": 13.0, "reward_std": 0.5 * 2 + 0.5 * 2, "zero_std_fraction": 0.0,
                       "completion_len": 13.0, "truncated_fraction": 1.0, "resampled_fraction": 2.0,
                       "dropped_fraction": 0.0, "reward_len": 10.0, "reward_len_std": 1.0 * 2 + 1.0 * 2,
                       "reward_one": 4.0, "reward_one_std": 0.0}


def test_a_group_still_flat_after_its_rounds_is_dropped_and_truncation_masked():
    first = [[5, 6, 2, 0], [5, 2, 0, 0], [7, 7, 7, 7], [7, 7, 7, 7]]
    engine = _Scripted(_roll(first, [False, False, True, True]), _roll([[8, 8], [9, 9]], [True, True]))
    out = _rollout(engine, dynamic_rounds=1)
    assert out["input_ids"][2:, 3:].tolist() == [[8, 8, 0, 0], [9, 9, 0, 0]]  # narrower: padded to the batch's width
    assert out["completion_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert out["attention_mask"][2:, 3:].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]  # the tokens stay visible
    metrics = _metrics(out)
    assert (metrics["dropped_fraction"], metrics["resampled_fraction"], metrics["truncated_fraction"],
            metrics["zero_std_fraction"]) == (2.0, 2.0, 2.0, 2.0)
    assert torch.equal(engine.calls[0][1], row_seeds(0, 0, _micro_batch()["sample_ids"], 2))  # seed 0, step 0
    # by default a cut completion trains like any other
    out = _rollout(_Scripted(_roll(first, [False, False, True, True])))
    assert out["completion_mask"][2:].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    # no dynamic sampling: one call, no resample/drop metrics, and mask_truncated takes the cut completions out
    engine = _Scripted(_roll(first, [False, False, True, True]))
    out = _rollout(engine, mask_truncated=True)
    assert len(engine.calls) == 1 and "metric_dropped_fraction" not in out and "metric_resampled_fraction" not in out
    assert out["completion_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert float(out["metric_completion_len"]) == 3 + 2 + 4 + 4 and float(out["metric_truncated_fraction"]) == 2.0
    # a pending rollout (an actor pool's overlap) is used instead of generating
    engine = _Scripted()
    out = _rollout(engine, pending=_roll(first, [False] * 4))
    assert engine.calls == [] and out["rewards"].tolist() == [3.0, 2.5, 4.0, 4.0]


def test_unknown_options_are_named():
    from minimind_ray.rl.losses import aggregate_loss, kl_estimate, per_token_loss

    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"train.grpo.kl_estimator: unknown 'k4'; one of \('k1', 'k2', 'k3'\)"):
        kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match=r"train.grpo.loss_type: unknown 'ppo'; one of \('cispo', 'grpo'\)"):
        per_token_loss(x, x, None, torch.zeros(1), "ppo", 0.2, 5.0, 0.0)
    with pytest.raises(ValueError, match=r"train.grpo.loss_agg: unknown 'sum'; one of \('seq-mean', 'token-mean', "
                                         r"'seq-sum-norm'\)"):
        aggregate_loss(x, x, "sum", 2)


def test_tokens_an_engine_marks_invalid_reach_neither_the_rewards_nor_the_loss():
    """An engine's rows may stop before max_new_tokens without an EOS (its padding): ``completion_mask`` of the
    rollout, not the EOS alone, says which tokens were sampled."""
    from minimind_ray.rl.rollout import Rollout

    ids = torch.tensor([[5, 6, 2, 0], [7, 7, 9, 9], [5, 2, 0, 0], [6, 2, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    seen = []
    out = _rollout(_Scripted(), seen=seen,
                   pending=Rollout(ids, valid, -0.5 * valid.float(), torch.zeros(4, dtype=torch.bool)))
    assert seen[0][1] == ["ab", "cc", "a", "b"]  # not "cceecc"
    assert out["completion_mask"][1].tolist() == [1, 1, 0, 0] and out["attention_mask"][1, 3:].tolist() == [1, 1, 0, 0]
    assert float(out["metric_completion_len"]) == 3 + 2 + 2 + 2


def test_the_references_log_probs_under_its_autocast(tiny):
    from minimind_ray.rl.logprobs import completion_logprobs

    entered = []

    @contextlib.contextmanager
    def autocast():
        entered.append(torch.is_grad_enabled())
        yield

    first = [[5, 6, 2, 0], [5, 2, 0, 0], [7, 7, 7, 7], [7, 8, 7, 7]]
    out = _rollout(_Scripted(_roll(first, [False, False, True, True])), reference=tiny, autocast=autocast)
    assert entered == [False]  # once, without gradient
    want, _ = completion_logprobs(tiny, out["input_ids"], out["attention_mask"], 4)
    assert out["ref_logp"].shape == (4, 4) and torch.equal(out["ref_logp"], want)
    plain = _rollout(_Scripted(_roll(first, [False, False, True, True])), reference=tiny)  # no autocast: as it is
    assert torch.equal(plain["ref_logp"], want)


def test_small_pieces_at_their_edges():
    from minimind_ray.rl.completions import _widen
    from minimind_ray.rl.logprobs import eos_mask

    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    wide = _widen(x, 5, 7)
    assert wide.tolist() == [[1, 2, 3, 7, 7], [4, 5, 6, 7, 7]] and wide.dtype == torch.int64
    assert _widen(x, 3, 7) is x and _widen(x, 2, 7) is x
    assert _widen(x.int(), 4, 0).dtype == torch.int32  # the tensor's own dtype, whatever the value's
    assert eos_mask(torch.tensor([[5], [2]]), 2).tolist() == [[1.0], [1.0]]  # one-token completions
    assert eos_mask(torch.tensor([[5, 2, 5], [5, 5, 5]]), 2).tolist() == [[1, 1, 0], [1, 1, 1]]
    r = torch.tensor([1.0, 0.0, 2.0, 2.0])
    assert torch.equal(group_advantages(r, 2), group_advantages(r, 2, "group", "grpo"))  # the defaults: MiniMind's
    a, b = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    assert torch.equal(kl_estimate(a, b), kl_estimate(a, b, "k3"))
    # cispo marks a ratio as clipped only above epsilon_high; the KL estimator asked for is the one used
    zero = torch.zeros(1, 2)
    _, clipped, _ = per_token_loss(zero, zero, None, torch.ones(1), "cispo", 0.2, 1.0, 0.0)
    assert clipped.tolist() == [[False, False]]  # ratio exactly 1.0 = epsilon_high
    _, _, kl = per_token_loss(a[None], a[None], b[None], torch.ones(1), "grpo", 0.2, 0.2, 0.1, kl_estimator="k1")
    assert torch.equal(kl, (a - b)[None])


def test_completion_logprobs_are_the_positions_that_predict_the_completion(tiny):
    from minimind_ray.rl.logprobs import completion_logprobs

    ids = torch.tensor([[0, 9, 10, 5, 6, 2], [11, 12, 13, 7, 7, 7]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = tiny(ids, attention_mask=attn)
    logits = out.logits[:, 2:5]  # positions 2..4 predict tokens 3..5
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 3:, None]).squeeze(-1)
    logp, aux = completion_logprobs(tiny, ids, attn, 3)
    assert logp.shape == (2, 3) and torch.allclose(logp, want, atol=1e-6) and torch.equal(aux, out.aux_loss)
    logp2, aux2, entropy = completion_logprobs(tiny, ids, attn, 3, with_entropy=True)
    p = torch.softmax(logits.float(), -1)
    assert torch.equal(logp2, logp) and torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-5)
    assert not entropy.requires_grad


def grpo_loss_sum(model, batch, section, beta=None):
    """GRPO's plan's loss_sum at ``beta`` (the adaptive controller's now), else the section's."""
    from types import SimpleNamespace

    plan = GRPOPlan(SimpleNamespace(name="test"), SimpleNamespace(kl_target=None, kl_horizon=1, **vars(section)))
    plan.kl.beta = section.beta if beta is None else beta
    return plan.loss_sum(model, batch)


def test_grpo_loss_sum_wires_the_pieces_by_hand(tiny):
    """GRPO's loss_sum = aggregate_loss(per_token_loss(completion_logprobs(...))), with the step's metric sums passed
    through, per-pass metrics divided by num_iterations, the KL metric only with a reference, and an adaptive beta
    taking the config's place."""
    from types import SimpleNamespace

    from minimind_ray.rl.logprobs import completion_logprobs

    ids = torch.tensor([[0, 9, 10, 5, 6, 2], [11, 12, 13, 7, 7, 7]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    with torch.no_grad():
        logp, _ = completion_logprobs(tiny, ids, attn, 3)
    old = logp + torch.tensor([[0.5, -0.5, 0.0], [0.0, 0.3, -0.3]])  # ratios e^-0.5, e^0.5, 1, ...: some clip
    ref = logp - 0.2
    batch = {"input_ids": ids, "attention_mask": attn, "completion_mask": mask, "old_logp": old, "ref_logp": ref,
             "advantages": torch.tensor([1.0, -0.5]), "metric_reward": torch.tensor(3.0, dtype=torch.float64)}
    cfg = SimpleNamespace(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.1, clip_high=0.28,
                          kl_estimator="k2", num_iterations=2, loss_agg="token-mean", max_gen_len=3)
    for beta in (None, 0.7):
        loss, aux, extras = grpo_loss_sum(tiny, batch, cfg, beta=beta)
        lp, _, ent = completion_logprobs(tiny, ids, attn, 3, with_entropy=True)
        tok, clipped, kl = per_token_loss(lp, old, ref, batch["advantages"], "grpo", 0.2, 0.28,
                                          0.1 if beta is None else beta, 0.28, "k2")
        assert torch.allclose(loss, aggregate_loss(tok, mask, "token-mean", 3), atol=1e-6) and loss.requires_grad
        assert set(extras) == {"reward", "clip_fraction", "entropy", "kl"} and float(extras["reward"]) == 3.0
        assert 0 < float(extras["clip_fraction"]) and torch.allclose(
            extras["clip_fraction"], sequence_mean(clipped.float(), mask).sum() / 2)
        assert torch.allclose(extras["entropy"], sequence_mean(ent, mask).sum() / 2)
        assert torch.allclose(extras["kl"], sequence_mean(kl, mask).sum() / 2) and not extras["kl"].requires_grad
        assert torch.equal(aux, tiny(ids, attention_mask=attn).aux_loss)
    del batch["ref_logp"]
    loss, _, extras = grpo_loss_sum(tiny, batch, cfg)
    tok, _, _ = per_token_loss(lp, old, None, batch["advantages"], "grpo", 0.2, 0.28, 0.1, 0.28, "k2")
    assert "kl" not in extras and torch.allclose(loss, aggregate_loss(tok, mask, "token-mean", 3), atol=1e-6)
    # cispo reads epsilon_high; seq-sum-norm divides by max_gen_len
    cispo = SimpleNamespace(**{**vars(cfg), "loss_type": "cispo", "epsilon_high": 1.2, "loss_agg": "seq-sum-norm"})
    loss, _, _ = grpo_loss_sum(tiny, batch, cispo)
    tok, _, _ = per_token_loss(lp, old, None, batch["advantages"], "cispo", 0.2, 1.2, 0.1, 0.28, "k2")
    assert torch.allclose(loss, (tok * mask).sum() / 3, atol=1e-6)


def test_the_tokenizer_of_the_prompts_is_the_manifests_and_checked_by_hash(tmp_path):
    from types import SimpleNamespace

    from minimind_ray.rl.completions import run_tokenizer
    from minimind_ray.tokenizer import load_tokenizer
    from tests.conftest import minimind_tokenizer_dir

    path = str(minimind_tokenizer_dir("minimind2"))
    tok = load_tokenizer(path)
    cfg = SimpleNamespace(data=SimpleNamespace(tokenizer=path, cache_dir=str(tmp_path)),
                          model=SimpleNamespace(generation="minimind2"))
    assert run_tokenizer(cfg, {"tokenizer_path": path, "tokenizer_hash": tok.hash()}).hash() == tok.hash()
    # prepared on another machine: the path is not here, data.tokenizer is resolved instead
    assert run_tokenizer(cfg, {"tokenizer_path": str(tmp_path / "gone"), "tokenizer_hash": tok.hash()}).path == tok.path
    with pytest.raises(ValueError) as e:
        run_tokenizer(cfg, {"tokenizer_path": path, "tokenizer_hash": "f" * 64})
    assert str(e.value) == (f"data.tokenizer: {tok.path} (hash {tok.hash()[:12]}) is not the tokenizer the prompts "
                            f"were prepared with ({path}, hash ffffffffffff)")


def test_a_resampled_rows_invalid_tokens_stay_out_of_its_reward_and_short_prompts_count_their_groups():
    from minimind_ray.rl.rollout import Rollout

    again = Rollout(torch.tensor([[8, 8, 9, 9], [8, 2, 0, 0]]), torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]]).bool(),
                    torch.zeros(2, 4), torch.zeros(2, dtype=torch.bool))
    seen = []
    mb = {**_micro_batch(), "prompt_ids": torch.tensor([[9], [11]]), "prompt_mask": torch.tensor([[1], [1]])}
    out = _rollout(_Scripted(_roll([[5, 6, 2, 0], [5, 2, 0, 0], [7, 7, 7, 7], [7, 7, 7, 7]],
                                   [False, False, True, True]), again), mb, seen, dynamic_rounds=1)
    assert seen[1][1] == ["dd", "d"]  # not "ddee"
    assert float(out["metric_resampled_fraction"]) == 2.0  # one group of two, with prompts of one token
