"""GRPO/CISPO without Ray: the loss, advantages and EOS mask against hand-computed values, the batched
KV-cache sampler, and the engine's grpo stage saving and restoring bit for bit."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from minimind_ray.config import load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.rl.advantages import group_advantages, group_std
from minimind_ray.rl.logprobs import eos_mask
from minimind_ray.rl.losses import k3_kl, per_token_loss, sequence_mean
from minimind_ray.model.sampling import sample_tokens
from minimind_ray.rl.rollout import SamplingParams, TorchRollout, token_logprobs
from minimind_ray.tokenizer import load_tokenizer
from tests.conftest import minimind_tokenizer_dir

LN_HALF = math.log(0.5)


def test_group_advantages_and_std_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.5, population std 0.5 -> +-0.5 / 0.5001; group 2: all equal -> 0;
    # group 3: mean 0.75, std sqrt(27/16) = 1.299038 -> (3 - 0.75) / 1.299138, (0 - 0.75) / 1.299138
    h = 0.5 / 0.5001
    expected = [h, -h, -h, h, 0, 0, 0, 0, 2.25 / 1.2991381, -0.75 / 1.2991381, -0.75 / 1.2991381, -0.75 / 1.2991381]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert group_std(rewards, 4).tolist() == pytest.approx([0.5] * 4 + [0.0] * 4 + [1.2990381] * 4, abs=1e-6)


def test_eos_mask_ends_each_completion_at_its_first_eos():
    eos = 2
    ids = torch.tensor([[5, 2, 7, 2],    # EOS at 1: tokens 0..1
                        [5, 6, 7, 8],    # no EOS: every token
                        [2, 0, 0, 0],    # EOS first
                        [9, 9, 0, 0]])   # an engine's padding (valid False) after two tokens, no EOS
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    assert eos_mask(ids, eos, valid).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert eos_mask(ids, eos)[0].tolist() == [1, 1, 0, 0]


def _one_token(logp, old, ref, adv):
    return (torch.tensor([[logp]], requires_grad=True), torch.tensor([[old]]), torch.tensor([[ref]]),
            torch.tensor([adv]))


def test_grpo_loss_clips_the_ratio_by_hand():
    # ratio 2 (p 0.5 vs behaviour 0.25), A = 1.5, eps 0.2: min(3.0, 1.2 * 1.5 = 1.8) = 1.8 (clipped)
    # k3 KL with ref p = 0.25: d = ln 0.5 -> 0.5 - ln 0.5 - 1 = 0.1931472; beta 0.1
    logp, old, ref, adv = _one_token(LN_HALF, math.log(0.25), math.log(0.25), 1.5)
    loss, clipped, kl = per_token_loss(logp, old, ref, adv, "grpo", 0.2, 5.0, 0.1)
    assert kl.item() == pytest.approx(0.1931472, abs=1e-6)
    assert loss.item() == pytest.approx(-(1.8 - 0.01931472), abs=1e-6)
    assert clipped.tolist() == [[True]]
    loss.sum().backward()
    # the clipped term carries no policy gradient: only the KL's d/dlogp = -(exp(d) - 1) = 0.5, times beta
    assert logp.grad.item() == pytest.approx(0.1 * 0.5, abs=1e-6)
    # A < 0 and ratio 2: min(-2, -1.2) = -2 is the unclipped term, with gradient -(ratio * A) = 2
    logp, old, _, adv = _one_token(LN_HALF, math.log(0.25), 0.0, -1.0)
    loss, clipped, _ = per_token_loss(logp, old, None, adv, "grpo", 0.2, 5.0, 0.1)
    assert loss.item() == pytest.approx(2.0, abs=1e-6) and clipped.tolist() == [[False]]
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(2.0, abs=1e-6)


def test_cispo_loss_clamps_the_ratio_and_keeps_the_gradient_by_hand():
    # ratio 2 < epsilon_high 5: loss = -(2 * 1.5 * ln 0.5 - 0.1 * 0.1931472) = 2.0987562; d/dlogp = -3 + 0.05
    logp, old, ref, adv = _one_token(LN_HALF, math.log(0.25), math.log(0.25), 1.5)
    loss, clipped, _ = per_token_loss(logp, old, ref, adv, "cispo", 0.2, 5.0, 0.1)
    assert loss.item() == pytest.approx(2.0987562, abs=1e-6) and clipped.tolist() == [[False]]
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-3.0 + 0.05, abs=1e-6)
    # ratio 8 is clamped to 5 (a clipped token), and still passes a gradient: -5 * 1.5
    logp, old, _, adv = _one_token(LN_HALF, math.log(1 / 16), 0.0, 1.5)
    loss, clipped, _ = per_token_loss(logp, old, None, adv, "cispo", 0.2, 5.0, 0.0)
    assert loss.item() == pytest.approx(-5 * 1.5 * LN_HALF, abs=1e-5) and clipped.tolist() == [[True]]
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-7.5, abs=1e-5)


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -2.0, -0.1])
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0, 0.0]
    assert (k3_kl(logp, logp + torch.tensor([0.3, -0.7, 1.2])) > 0).all()


def test_sequence_mean_averages_each_completion_over_its_own_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert sequence_mean(x, mask).tolist() == [2.0, 4.0, 0.0]


# --------------------------------------------------------------------------- the sampler


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(None, ["data.train_path=[demo]", "model.preset=tiny"])
    return build_model(cfg.model, seed=3).eval()


def _left_pad(prompts, pad=0):
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    return ids, mask


def test_batched_left_padded_greedy_rollout_equals_each_prompt_alone(tiny):
    prompts = [[1, 300, 301, 302, 303, 304, 305], [1, 400, 401], [1, 500, 501, 502, 503]]
    eng = TorchRollout()
    eng.update_policy(tiny, 1)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1, eos_id=2, pad_id=0)
    together = eng.generate(*_left_pad(prompts), params)
    for i, p in enumerate(prompts):
        alone = eng.generate(*_left_pad([p]), params)
        n = int(alone.completion_mask.sum())
        assert together.completion_ids[i, :n].tolist() == alone.completion_ids[0, :n].tolist()
        torch.testing.assert_close(together.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=0)


class EosLeaning(torch.nn.Module):
    """The tiny model with EOS (id 2) made likely, so that some rows stop early and some do not."""

    def __init__(self, inner, bias):
        super().__init__()
        self.inner, self.cfg, self.bias = inner, inner.cfg, bias

    def forward(self, *args, **kw):
        out = self.inner(*args, **kw)
        out.logits[..., 2] += self.bias
        return out


def test_rollout_logprobs_are_the_policys_and_rows_stop_at_eos(tiny):
    ids, mask = _left_pad([[1, 300, 301, 302], [1, 400]] * 8)
    policy = EosLeaning(tiny, bias=6.5).eval()  # about 1 in 10 per token against 6400 near-uniform logits
    eng = TorchRollout()
    eng.update_policy(policy, 1)
    torch.manual_seed(0)
    roll = eng.generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=2, pad_id=0))
    full = torch.cat([ids, roll.completion_ids], 1)
    attention = torch.cat([mask, roll.completion_mask.long()], 1)
    with torch.no_grad():
        logits = policy(full, attention_mask=attention).logits[:, ids.shape[1] - 1:-1]
    expected = token_logprobs(logits, roll.completion_ids) * roll.completion_mask
    torch.testing.assert_close(roll.logprobs, expected, atol=1e-5, rtol=0)
    lengths = roll.completion_mask.sum(1)
    assert lengths.min() < 12 and roll.truncated.any(), (lengths, roll.truncated)  # both kinds of row
    for row, m, cut in zip(roll.completion_ids, roll.completion_mask, roll.truncated):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()  # a prefix
        assert (row[n:] == 0).all()  # pads after the end
        assert bool(cut) == (row[n - 1].item() != 2)  # cut at max_new_tokens exactly when there is no EOS
        assert 2 not in row[:n - 1].tolist()


def test_a_steps_micro_batches_sampled_as_one_batch_equal_each_sampled_alone(tiny):
    """TorchRollout.generate_many (a GRPO or PPO step's micro-batches): rows of several requests, of other prompt
    widths, in one batch, cut back per request; each rollout as long as its own longest completion."""
    from minimind_ray.rl.rollout import row_seeds

    policy = EosLeaning(tiny, bias=8.5).eval()  # EOS about one token in three
    eng = TorchRollout()
    eng.update_policy(policy, 1)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=2, pad_id=0)
    requests = []
    for i, prompts in enumerate(([[1, 300, 301, 302], [1, 400]] * 3, [[1, 500, 501, 502, 503, 504, 505]] * 2)):
        ids, mask = _left_pad(prompts)
        requests.append((ids, mask, params, row_seeds(7, 1, torch.arange(i * 10, i * 10 + len(prompts)), 1)))
    together = eng.generate_many(requests)
    for (ids, mask, _, seeds), got in zip(requests, together):
        alone = eng.generate(ids, mask, params, seeds=seeds)
        assert got.completion_ids.tolist() == alone.completion_ids.tolist()
        assert got.completion_mask.tolist() == alone.completion_mask.tolist()
        assert got.truncated.tolist() == alone.truncated.tolist()
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    widths = [r.completion_ids.shape[1] for r in together]
    assert min(widths) < max(widths), widths  # cut back to each request's own longest completion


def test_sample_tokens_top_k_and_top_p_keep_only_the_head():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2000))
    torch.manual_seed(1)
    assert set(sample_tokens(logits, 1.0, top_k=2).tolist()) == {0, 1}
    assert set(sample_tokens(logits, 1.0, top_p=0.6).tolist()) == {0, 1}  # 0.5 < 0.6: the crossing token stays
    assert set(sample_tokens(logits, 1.0, top_p=0.4).tolist()) == {0}
    assert set(sample_tokens(logits, 1.0).tolist()) == {0, 1, 2, 3}


# --------------------------------------------------------------------------- the engine's stage


def prepare_locally(records, tmp_path, tok, fmt="prompt", max_seq_len=48):
    """A prepared directory without Ray: the prepare job's per-chunk function, merged, plus its manifest."""
    from minimind_ray.config import DataConfig
    from minimind_ray.data.manifest import PREPARED_VERSION, row_settings, write_manifest
    from minimind_ray.data.prepare import merge_summaries, plan_chunks, process_chunk
    from minimind_ray.data.sources import resolve_sources

    src = tmp_path / "tasks.jsonl"
    src.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    cfg = DataConfig(format=fmt, max_seq_len=max_seq_len, block_rows=16)
    out = tmp_path / "prepared"
    out.mkdir()
    files, _ = resolve_sources([str(src)])
    chunks = plan_chunks(files, cfg.chunk_bytes)
    merged = merge_summaries(chunks, [process_chunk(c, tok, cfg, str(out)) for c in chunks], [])
    write_manifest(str(out), {"version": PREPARED_VERSION, **row_settings(cfg), "tokenizer_hash": tok.hash(),
                              "tokenizer_path": tok.path, "block_rows": cfg.block_rows, **merged})
    return str(out), merged


def grpo_config(init_from, *extra):
    return load_config(None, [
        "data.train_path=[demo]", "model.preset=tiny", "train.stage=grpo", "data.format=prompt", "data.max_seq_len=48",
        f"train.init_from={init_from}",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=6", "train.lr=3e-3",
        "train.warmup_steps=1", "train.log_interval=1", "checkpoint.interval=3", "train.grpo.num_generations=3",
        "train.grpo.max_gen_len=8", "train.grpo.temperature=1.0",
        # a length-proportional term (any module:function works) so that every group's rewards differ
        "train.grpo.rewards=[{name: exact_answer}, {name: 'tests.unit.test_grpo_rewards:double_length', weight: 0.01}]",
        *extra])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    records = [{"prompt": f"What is {a} plus {b}?", "answer": a + b} for a, b in zip(range(0, 40, 3), range(20))]
    d = tmp_path_factory.mktemp("grpo")
    path, merged = prepare_locally(records, d, tok)
    assert merged["counts"]["records"] == len(records)
    from minimind_ray.store.pth import save_pth

    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=5),
             str(d / "base.pth"), dtype=torch.float32)
    return path, str(d / "base.pth")


def test_grpo_stage_saves_and_restores_bit_for_bit(prepared, tmp_path):
    """The sampling RNG is the process's, which checkpoints hold: a run stopped after step 3 and restored
    samples the same completions, earns the same rewards and ends with the same weights."""
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint

    class Rewards(Hooks):
        def __init__(self):
            self.reward, self.metrics = {}, {}

        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            self.reward[step] = metrics["reward"]
            self.metrics = metrics

    prepared, base = prepared
    cfg = grpo_config(base)
    straight, seen = TrainState.build(cfg, prepared), Rewards()
    init = {k: v.clone() for k, v in straight.model.state_dict().items()}
    run(straight, seen)
    assert sorted(seen.reward) == list(range(1, 7))
    for key in ("reward", "reward_std", "reward_exact_answer", "reward_double_length", "kl", "clip_fraction",
                "completion_len", "truncated_fraction", "zero_std_fraction", "rollout_s"):
        assert key in seen.metrics and math.isfinite(seen.metrics[key]), key
    assert 1 <= seen.metrics["completion_len"] <= 8 and 0 <= seen.metrics["truncated_fraction"] <= 1
    assert 0 < seen.metrics["rollout_s"] < seen.metrics["step_time_s"]  # the rollout is a part of the step
    assert any(not torch.equal(v, init[k]) for k, v in straight.model.state_dict().items())

    class StopAt3(Rewards):
        def on_checkpoint(self, step, metrics):
            if step == 3:
                first.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=prepared)
                raise KeyboardInterrupt

    first, before = TrainState.build(cfg, prepared), StopAt3()
    with pytest.raises(KeyboardInterrupt):
        run(first, before)
    first.stream.close()
    resumed, after = TrainState.build(cfg, prepared), Rewards()
    resumed.restore(open_checkpoint(tmp_path / "ck"))
    run(resumed, after)
    assert {**before.reward, **after.reward} == seen.reward
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the frozen reference is the initial weights (init_from) on both sides, never the checkpoint's
    from minimind_ray.store.pth import read_pth

    assert all(torch.equal(v, init[k]) for k, v in resumed.objective.reference.state_dict().items())
    assert all(torch.equal(v, init[k]) for k, v in read_pth(base).items())


def test_grpo_step_weight_is_the_number_of_completions(prepared):
    from minimind_ray.engine.state import TrainState
    from minimind_ray.engine.step import train_step

    prepared, base = prepared
    state = TrainState.build(grpo_config(base, "train.grpo.beta=0"), prepared)
    assert state.objective.reference is None  # beta 0: no reference model is kept
    out = train_step(state, state.stream.next_step(), 1)
    assert float(out.weight) == 4 * 3  # global batch of 4 prompts, 3 completions each
    assert "kl" not in out.extras and dataclasses.is_dataclass(state.cfg.train.grpo)
    state.stream.close()
