"""PPO without Ray (issue 24, part 1; docs/rl.md): GAE, the per-token rewards and the clipped policy and value losses
against values worked out by hand, MiniMind's critic layout, and the engine's ppo stage: the early stop on KL,
two ranks over plain gloo equal to one, a checkpoint with the critic that restores bit for bit, and the export."""
from __future__ import annotations

import math
import os

import pytest
import torch

from minimind_ray.config import ConfigError, load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.rl.advantages import gae, token_rewards, whiten
from minimind_ray.rl.critic import CriticModel
from minimind_ray.rl.losses import ppo_token_losses
from tests.unit.test_grpo import prepared  # noqa: F401 (fixture: prompts "What is a plus b?" and a tiny base model)

LN_HALF, LN_QUARTER = math.log(0.5), math.log(0.25)


def close(t, expected, atol=1e-6):
    torch.testing.assert_close(t.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_gae_and_returns_by_hand():
    # row 0: three tokens, reward 1 on the last; row 1: two tokens (a garbage value after its end), reward 2
    values = torch.tensor([[0.5, 0.2, -0.1], [0.4, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rewards = torch.tensor([[0.0, 0, 1], [0, 2, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0: d2 = 1 - (-0.1) = 1.1; d1 = -0.1 - 0.2 = -0.3 -> A1 = -0.3 + 0.95 * 1.1 = 0.745;
    #        d0 = 0.2 - 0.5 = -0.3 -> A0 = -0.3 + 0.95 * 0.745 = 0.40775
    # row 1: V after the end counts 0: d1 = 2 - 0.3 = 1.7 = A1; d0 = 0.3 - 0.4 -> A0 = -0.1 + 0.95 * 1.7 = 1.515
    close(adv, [[0.40775, 0.745, 1.1], [1.515, 1.7, 0.0]])
    close(ret, [[0.90775, 0.945, 1.0], [1.915, 2.0, 0.0]])
    # gamma 0.9, lambda 0.5: d2 = 1.1; d1 = 0.9 * -0.1 - 0.2 = -0.29 -> A1 = -0.29 + 0.45 * 1.1 = 0.205;
    #                        d0 = 0.9 * 0.2 - 0.5 = -0.32 -> A0 = -0.32 + 0.45 * 0.205 = -0.22775
    adv, _ = gae(rewards[:1], values[:1], mask[:1], gamma=0.9, lam=0.5)
    close(adv, [[-0.22775, 0.205, 1.1]])
    # lambda 1: the Monte-Carlo return minus the value; lambda 0: the one-step TD error
    close(gae(rewards, values, mask, 1.0, 1.0)[0][0], [0.5, 0.8, 1.1])
    close(gae(rewards, values, mask, 1.0, 0.0)[0][0], [-0.3, -0.3, 1.1])


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    scores = torch.tensor([1.5, -2.0])
    assert token_rewards(scores, mask).tolist() == [[0, 0, 1.5, 0], [-2.0, 0, 0, 0]]
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 9.0, 9.0]])
    close(token_rewards(scores, mask, kl, 0.1), [[-0.01, -0.02, 1.47, 0], [-2.05, 0, 0, 0]])


def _tok(x, grad=False):
    return torch.tensor([[x]], requires_grad=grad)


def test_clipped_policy_and_value_losses_by_hand():
    # ratio 2 (p 0.5 against the rollout's 0.25), eps 0.2. A = 1.5: max(-3, -1.2 * 1.5) = -1.8, the clipped branch
    # (no gradient from the policy term); A = -1: max(2, 1.2) = 2, unclipped, d/dlogp = -A * ratio = 2
    for adv, loss, grad in ((1.5, -1.8, 0.0), (-1.0, 2.0, 2.0)):
        logp = _tok(LN_HALF, grad=True)
        t = ppo_token_losses(logp, _tok(LN_QUARTER), _tok(LN_QUARTER), _tok(adv), _tok(0.0), _tok(0.0), _tok(0.0),
                             0.2, 0.2)
        assert t["policy"].item() == pytest.approx(loss, abs=1e-6)
        t["policy"].sum().backward()
        assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
        assert t["approx_kl"].item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)  # (log 2)^2 / 2
        assert t["clipped"].item() == 1.0  # |2 - 1| > 0.2
        assert t["kl"].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)  # k3: exp(-ln 2) + ln 2 - 1
    # value loss, cliprange 0.2, old value 0.5: V = 1.0, return 2 -> max((1-2)^2, (0.7-2)^2) / 2 = 0.845, the clipped
    # branch, no gradient; V = 0.6 inside the range -> 0.98, gradient V - R = -1.4; V = 0.0, return 0.45 ->
    # max(0.2025, (0.3 - 0.45)^2) / 2 = 0.10125, the unclipped branch, gradient -0.45
    for v, ret, loss, grad in ((1.0, 2.0, 0.845, 0.0), (0.6, 2.0, 0.98, -1.4), (0.0, 0.45, 0.10125, -0.45)):
        value = _tok(v, grad=True)
        t = ppo_token_losses(_tok(0.0), _tok(0.0), None, _tok(0.0), value, _tok(0.5), _tok(ret), 0.2, 0.2)
        assert t["value"].item() == pytest.approx(loss, abs=1e-6) and t["kl"].item() == 0.0
        t["value"].sum().backward()
        assert value.grad.item() == pytest.approx(grad, abs=1e-6)
    # the ratio at 1 (the first update of a step): the loss is -A, nothing clipped, no approximate KL
    t = ppo_token_losses(_tok(-1.0), _tok(-1.0), None, _tok(0.7), _tok(0.0), _tok(0.0), _tok(0.0), 0.2, 0.2)
    assert (t["policy"].item(), t["clipped"].item(), t["approx_kl"].item()) == (pytest.approx(-0.7), 0.0, 0.0)


def test_whitening_uses_the_given_moments_and_keeps_masked_tokens_at_zero():
    a = torch.tensor([[1.0, 3.0, 7.0], [5.0, 100.0, 100.0]])
    m = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    w = whiten(a, m, mean=3.0, var=4.0)  # the global batch's moments (PPOPlan all-reduces them)
    close(w, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("preset", ["tiny", "tiny3-moe"])
def test_critic_has_minimind_keys_and_values_on_the_twice_normed_trunk(preset):
    from tests.unit.test_model import cfg_of, minimind_keys

    policy = build_model(cfg_of(preset), seed=1)
    before = torch.get_rng_state()
    critic = CriticModel(policy, seed=7)
    assert torch.equal(torch.get_rng_state(), before)  # the value head's init leaves the RNG alone
    h = policy.cfg.hidden_size  # MiniMind's CriticModel: the causal LM's keys in its order, then the value head
    assert [(k, tuple(v.shape)) for k, v in critic.state_dict().items()] == minimind_keys(policy.cfg) + [
        ("value_head.weight", (1, h)), ("value_head.bias", (1,))]
    assert torch.equal(critic.value_head.weight, CriticModel(policy, seed=7).value_head.weight)
    assert critic.model.embed_tokens.weight is critic.lm_head.weight  # the copy keeps MiniMind's tie
    assert critic.model.embed_tokens.weight is not policy.model.embed_tokens.weight  # a copy, not the policy
    seen = {}
    policy.lm_head.register_forward_hook(lambda mod, inp, out: seen.update(h=inp[0]))  # the policy's normed trunk
    ids = torch.randint(3, 6400, (2, 9))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # left padding, as the rollouts have
    with torch.no_grad():
        policy(ids, attention_mask=attention)
        want = critic.value_head(policy.model.norm(seen["h"])).squeeze(-1)  # MiniMind: model.norm on normed states
        torch.testing.assert_close(critic(ids, attention), want, atol=1e-5, rtol=0)


def ppo_config(init_from, *extra):
    return load_config(None, [
        "data.train_path=[demo]", "model.preset=tiny", "train.stage=ppo", "data.format=prompt", "data.max_seq_len=48",
        f"train.init_from={init_from}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=4",
        "train.lr=3e-3", "train.warmup_steps=1", "train.log_interval=1", "checkpoint.interval=2",
        "train.ppo.max_gen_len=8", "train.ppo.temperature=1.0", "train.ppo.critic_lr=1e-3", "train.ppo.early_stop_kl=null",
        "train.ppo.rewards=[{name: exact_answer}, {name: 'tests.unit.test_grpo_rewards:double_length', weight: 0.01}]",
        *extra])


def _run(cfg, prepared_dir):
    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState
    from tests.unit.test_engine import MetricsByStep

    state, seen = TrainState.build(cfg, prepared_dir), MetricsByStep()
    run(state, seen)
    return state, seen


def test_ppo_config_needs_its_fields():
    for extra, field in ((["train.ppo.kl_penalty=both"], "train.ppo.kl_penalty"),
                         (["train.ppo.gamma=1.5"], "train.ppo.gamma"),
                         (["train.ppo.max_gen_len=40000"], "train.ppo.max_gen_len")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=ppo", "data.format=prompt",
                               "train.init_from=.", *extra])
    with pytest.raises(ConfigError, match=r"train\.init_from"):
        load_config(None, ["data.train_path=[demo]", "train.stage=ppo", "data.format=prompt"])


def test_early_stop_on_kl_drops_the_update_and_the_rest_of_the_step(prepared):
    """lr 3e-3 moves the policy far in one update; with early_stop_kl 1e-6 the second pass's update (ratio no longer
    1) is dropped, so the run takes exactly the steps of a run with one pass: the same weights, actor and critic."""
    prepared_dir, base = prepared
    stopped, seen = _run(ppo_config(base, "train.max_steps=2", "train.ppo.early_stop_kl=1e-6"), prepared_dir)
    one_pass, _ = _run(ppo_config(base, "train.max_steps=2", "train.ppo.ppo_update_iters=1"), prepared_dir)
    assert [seen.by_step[s]["updates"] for s in (1, 2)] == [1.0, 1.0]
    assert [seen.by_step[s]["early_stopped"] for s in (1, 2)] == [1.0, 1.0]
    for a, b in ((stopped.model, one_pass.model), (stopped.parts["critic"].model, one_pass.parts["critic"].model)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    _, free = _run(ppo_config(base, "train.max_steps=1", "train.ppo.mini_batches=2", "train.ppo.kl_penalty=reward"),
                   prepared_dir)
    assert free.by_step[1]["updates"] == 4.0 and free.by_step[1]["early_stopped"] == 0.0  # 2 passes x 2 mini-batches
    assert free.by_step[1]["kl"] > 0  # the KL in the rewards is still measured against the reference


def test_ppo_stage_saves_and_restores_bit_for_bit(prepared, tmp_path):
    """Actor, critic, both optimizers and schedules, the data position and the sampling seeds are in the checkpoint:
    a run stopped after step 2 and restored takes the same steps, with the same rewards, as one that never stopped."""
    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint
    from minimind_ray.store.pth import read_pth
    from tests.unit.test_engine import MetricsByStep

    prepared_dir, base = prepared
    cfg = ppo_config(base)
    straight, seen = _run(cfg, prepared_dir)
    init = read_pth(base)
    m = seen.by_step[4]
    for key in ("reward", "reward_exact_answer", "reward_double_length", "value", "returns", "policy_loss",
                "value_loss", "kl", "approx_kl", "clip_fraction", "completion_len", "truncated_fraction", "rollout_s"):
        assert key in m and math.isfinite(m[key]), key
    assert m["updates"] == 2.0 and 1 <= m["completion_len"] <= 8 and m["kl"] > 0  # the policy left the reference
    assert any(not torch.equal(v, init[k]) for k, v in straight.model.state_dict().items())
    critic = straight.parts["critic"].model.state_dict()
    assert not torch.equal(critic["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])

    class StopAt2(MetricsByStep):
        def on_checkpoint(self, step, metrics):
            if step == 2:
                first.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=prepared_dir)
                raise KeyboardInterrupt

    first, before = TrainState.build(cfg, prepared_dir), StopAt2()
    with pytest.raises(KeyboardInterrupt):
        run(first, before)
    first.stream.close()
    stored = open_checkpoint(tmp_path / "ck")
    assert stored.has_part("critic") and "parts" in stored.train_state()
    resumed, after = TrainState.build(cfg, prepared_dir), MetricsByStep()
    resumed.restore(stored)
    run(resumed, after)
    assert {s: before.by_step[s]["reward"] for s in (1, 2)} == {s: seen.by_step[s]["reward"] for s in (1, 2)}
    assert {s: after.by_step[s]["reward"] for s in (3, 4)} == {s: seen.by_step[s]["reward"] for s in (3, 4)}
    for a, b in ((straight.model, resumed.model), (straight.parts["critic"].model, resumed.parts["critic"].model)):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = (s.parts["critic"].optimizer.state_dict()["state"] for s in (straight, resumed))
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)
    # the reference is the initial weights on both sides, never the checkpoint's
    assert all(torch.equal(v, init[k]) for k, v in resumed.objective.reference.state_dict().items())


def test_export_writes_the_actor_and_minimind_critic(prepared, tmp_path):
    from minimind_ray.export import export_run_checkpoint
    from minimind_ray.store.pth import read_pth
    from tests.unit.test_model import minimind_keys

    prepared_dir, base = prepared
    cfg = ppo_config(base, "train.max_steps=1", "train.ppo.ppo_update_iters=1")
    state, _ = _run(cfg, prepared_dir)
    state.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=prepared_dir)
    paths = export_run_checkpoint(cfg, str(tmp_path / "ck"), tmp_path / "out")
    assert os.path.basename(paths["pth"]) == "ppo_actor_64.pth" and os.path.basename(paths["critic"]) == "ppo_critic_64.pth"
    critic = torch.load(paths["critic"], weights_only=True)
    assert [(k, tuple(v.shape)) for k, v in critic.items()] == minimind_keys(state.model.cfg) + [
        ("value_head.weight", (1, 64)), ("value_head.bias", (1,))]
    assert all(v.dtype == torch.float16 for v in critic.values())  # MiniMind saves its weights in half precision
    torch.testing.assert_close(critic["value_head.weight"].float(),
                               state.parts["critic"].model.value_head.weight.detach(), atol=1e-3, rtol=1e-3)
    assert [k for k in read_pth(paths["pth"])] == [k for k, _ in minimind_keys(state.model.cfg)]


def _rank_main(rank: int, world: int, init_file: str, prepared_dir: str, base: str, out: str) -> None:
    import torch.distributed as dist

    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state = TrainState.build(ppo_config(base, "train.max_steps=1", "train.micro_batch_size=1",
                                            "train.ppo.early_stop_kl=0.05"), prepared_dir, rank=rank, world=world)
        run(state)
        if rank == 0:
            torch.save({"actor": state.model.state_dict(), "critic": state.parts["critic"].model.state_dict()}, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_plain_gloo_match_one_rank(prepared, tmp_path):
    """Every completion samples from its own seed, whitening and the early-stop KL are all-reduced and the critic has
    a DDP wrapper of its own: two ranks (one prompt per micro-batch each, accumulation 2) end where one rank does."""
    import torch.multiprocessing as mp

    prepared_dir, base = prepared
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), prepared_dir, base, str(tmp_path / "w2.pt")),
                           nprocs=2, start_method="spawn")
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.__setitem__("OMP_NUM_THREADS", old)
    one, _ = _run(ppo_config(base, "train.max_steps=1", "train.micro_batch_size=1", "train.ppo.early_stop_kl=0.05"),
                  prepared_dir)
    w2 = torch.load(tmp_path / "w2.pt", weights_only=True)
    for name, model in (("actor", one.model), ("critic", one.parts["critic"].model)):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(w2[name][k], v, atol=1e-4, rtol=0, msg=f"{name}.{k}")


def test_the_edges_the_hand_cases_above_leave_out():
    """Cases mutation testing found unchecked (docs/testing.md): a ratio below the clip range, a value clipped from
    below, whitening a batch of equal advantages, one-token completions, token_rewards' defaults and a mask of any
    dtype, which critic parameters train, and the critic's length limit."""
    from minimind_ray.config import ModelConfig
    from minimind_ray.model.presets import preset_values

    # ratio 0.5 (p 0.25 against 0.5), A = -1, eps 0.2: max(0.5, 0.8) = 0.8, the clipped branch
    t = ppo_token_losses(_tok(LN_QUARTER), _tok(LN_HALF), None, _tok(-1.0), _tok(0.0), _tok(0.0), _tok(0.0), 0.2, 0.2)
    assert t["policy"].item() == pytest.approx(0.8, abs=1e-6) and t["clipped"].item() == 1.0
    # V = 0 against the rollout's 0.5 (cliprange 0.2: clipped up to 0.3), return -1: max(1, 1.69) / 2 = 0.845
    t = ppo_token_losses(_tok(0.0), _tok(0.0), None, _tok(0.0), _tok(0.0), _tok(0.5), _tok(-1.0), 0.2, 0.2)
    assert t["value"].item() == pytest.approx(0.845, abs=1e-6)
    # variance 0 (a batch of equal advantages): the 1e-8 is added, so the scale is 1e4, real and finite
    w = whiten(torch.tensor([[2.0, 3.0]]), torch.ones(1, 2), mean=2.0, var=0.0)
    assert w.dtype == torch.float32 and w.tolist() == [[0.0, 1e4]]
    # one-token completions: the advantage is the reward minus the value, the return the reward
    adv, ret = gae(torch.tensor([[1.0], [0.5]]), torch.tensor([[0.25], [0.5]]), torch.ones(2, 1), 1.0, 0.95)
    close(adv, [[0.75], [0.0]])
    close(ret, [[1.0], [0.5]])
    # token_rewards: no KL term unless both the KL and its weight are given; float rewards from any mask dtype
    scores, mask, kl = torch.tensor([1.5, -2.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.full((2, 3), 0.5)
    plain = [[0.0, 1.5, 0.0], [-2.0, 0.0, 0.0]]
    for args in ((), (kl,), (None, 0.1), (kl, 0.0)):
        got = token_rewards(scores, mask, *args)
        assert got.dtype == torch.float32 and got.tolist() == plain, args
    # the critic trains every parameter but an untied lm_head, which it never uses (DDP would stall on it)
    for tied in (True, False):
        policy = build_model(ModelConfig(**{**preset_values("tiny"), "tie_word_embeddings": tied,
                                            "max_position_embeddings": 24}), seed=1)
        critic = CriticModel(policy, seed=7)
        frozen = [n for n, p in critic.named_parameters() if not p.requires_grad]
        assert frozen == ([] if tied else ["lm_head.weight"]), (tied, frozen)
    assert critic(torch.randint(3, 6400, (1, 24))).shape == (1, 24)  # the whole RoPE table
    with pytest.raises(ValueError, match="sequence of 25 tokens exceeds max_position_embeddings=24"):
        critic(torch.randint(3, 6400, (1, 25)))
