"""RL learns (issue 34): GRPO, PPO, the agent stage and RLOO (issue 48) each run on the engine (one rank, no Ray) from a
randomly initialised tiny model, on a reward it can learn in a couple of dozen steps: the share of a completion's
characters that are ASCII punctuation. About 1% of a random completion's characters are (99 of MiniMind2's 6400
tokens hold one); a policy that finds the reward ends near 100% (or at the share of the token it settled on: 1/2 at
worst in the measured seeds). PPO's critic must learn too: its value loss falls and its values end at the returns.

The mean reward of the last K steps must beat that of the first K by MARGIN. Measured over 5 seeds
(tests/soak/test_rl_margins.py; docs/testing.md has the table): the smallest margin was 0.49 (GRPO, PPO) and 0.67
(agent); with the advantages' sign flipped or the rewards shuffled across completions it was at most +0.11, and with
PPO's value loss's sign flipped the critic's values ended 5 to 7 away from the returns (0.06 at most when right).
RLOO, measured the same way with this module's learning_curve (seeds 0-4): 0.98 at the smallest; with its
leave-one-out advantages negated, or computed from shuffled rewards (seeds 0-2), +0.002 at most.
The sorting demo's figure in docs/rl.md is measured by bench/bench_grpo.py, not here."""
from __future__ import annotations

import string
from typing import List, Optional

import pytest
import torch

from tests.conftest import minimind_tokenizer_dir

STEPS, K = 24, 5
MARGIN = 0.25  # half the smallest margin measured over 5 seeds
PUNCTUATION = frozenset(string.punctuation)
STAGES = ("grpo", "ppo", "agent", "rloo")


def punctuation_share(text: str) -> float:
    return sum(c in PUNCTUATION for c in text) / max(len(text), 1)


def punctuation_reward(prompts, completions, answers) -> List[float]:
    """A GRPO/PPO reward term (``module:function``)."""
    return [punctuation_share(c) for c in completions]


def punctuation_reward_of_turns(trajectories) -> List[float]:
    """The agent stage's reward term: the share over everything the policy wrote, every turn."""
    return [punctuation_share("".join(t.turns)) for t in trajectories]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """{"prompt": prepared prompts (64 sums), "agent": prepared agent_rl records (6 sums, no tools offered: a prompt a
    quarter as long, and a random model calls no tool anyway)}."""
    from minimind_ray.tokenizer import load_tokenizer
    from tests.unit.test_agent import _records
    from tests.unit.test_grpo import prepare_locally

    tok = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    sums = [{"prompt": f"What is {a} plus {b}?", "answer": a + b} for a in range(8) for b in range(8)]
    prompt_dir, _ = prepare_locally(sums, tmp_path_factory.mktemp("prompts"), tok)
    agent_dir, _ = prepare_locally(_records(tools=False), tmp_path_factory.mktemp("agent"), tok, fmt="agent_rl", max_seq_len=320)
    return {"prompt": prompt_dir, "agent": agent_dir}


def stage_config(stage: str, base: str, seed: int, steps: int = STEPS):
    """A fast learner: lr 3e-2, no KL to the reference, temperature 1, completions of 8 tokens."""
    from minimind_ray.config import load_config

    me = __name__
    common = ["data.train_path=[demo]", "model.preset=tiny", f"train.init_from={base}", f"train.max_steps={steps}",
              "train.lr=3e-2", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "cluster.num_workers=1", "train.log_interval=1",
              f"checkpoint.interval={steps}", f"train.seed={seed}"]
    grpo = ["train.grpo.num_generations=4", "train.grpo.max_gen_len=8", "train.grpo.temperature=1.0",
            "train.grpo.beta=0"]
    if stage == "grpo":
        own = ["train.stage=grpo", "data.format=prompt", "data.max_seq_len=48", "train.global_batch_size=4",
               "train.micro_batch_size=4", *grpo, f"train.grpo.rewards=[{{name: '{me}:punctuation_reward'}}]"]
    elif stage == "rloo":  # GRPO's groups, no scaling by their std: the advantages normalised over the batch instead
        own = ["train.stage=rloo", "data.format=prompt", "data.max_seq_len=48", "train.global_batch_size=4",
               "train.micro_batch_size=4", "train.rloo.num_generations=4", "train.rloo.max_gen_len=8",
               "train.rloo.temperature=1.0", "train.rloo.beta=0", "train.rloo.normalize_advantages=true",
               f"train.rloo.rewards=[{{name: '{me}:punctuation_reward'}}]"]
    elif stage == "ppo":  # one completion per prompt: 16 prompts a step
        own = ["train.stage=ppo", "data.format=prompt", "data.max_seq_len=48", "train.global_batch_size=16",
               "train.micro_batch_size=16", "train.ppo.max_gen_len=8", "train.ppo.temperature=1.0",
               "train.ppo.critic_lr=1e-3", "train.ppo.kl_coef=0", "train.ppo.early_stop_kl=null",
               f"train.ppo.rewards=[{{name: '{me}:punctuation_reward'}}]"]
    else:
        own = ["train.stage=agent", "data.format=agent_rl", "data.max_seq_len=320", "train.global_batch_size=2",
               "train.micro_batch_size=2", *(o.replace("train.grpo.", "train.agent.") for o in grpo),
               "train.agent.loss_type=grpo", "train.agent.max_total_len=420",
               f"train.agent.rewards=[{{name: '{me}:punctuation_reward_of_turns'}}]"]
    return load_config(None, common + own)


def learning_curve(stage: str, prepared: dict, base_dir, seed: int = 0, steps: int = STEPS,
                   metrics: Optional[dict] = None) -> List[float]:
    """Each step's mean reward over its completions, from a tiny model initialised with ``seed``; ``metrics``, when
    given, receives every step's metrics."""
    from minimind_ray.config import load_config
    from minimind_ray.engine.loop import Hooks, run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import save_pth

    base = f"{base_dir}/base-{seed}.pth"
    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=seed), base,
             dtype=torch.float32)
    cfg = stage_config(stage, base, seed, steps)
    by_step = {} if metrics is None else metrics

    class Metrics(Hooks):
        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            by_step[step] = metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: a second thread costs more CPU than it saves time
    state = TrainState.build(cfg, prepared["agent" if stage == "agent" else "prompt"])
    try:
        run(state, Metrics())
    finally:
        state.stream.close()
        torch.set_num_threads(threads)
    assert sorted(by_step) == list(range(1, steps + 1))
    return [by_step[s]["reward"] for s in range(1, steps + 1)]


def mean(xs) -> float:
    return sum(xs) / len(xs)


def margin(curve: List[float]) -> float:
    return mean(curve[-K:]) - mean(curve[:K])


@pytest.mark.parametrize("stage", STAGES)
def test_rl_learns_a_reward_the_tiny_model_can_reach(stage, prompts, tmp_path):
    metrics = {}
    curve = learning_curve(stage, prompts, tmp_path, metrics=metrics)
    assert margin(curve) > MARGIN, [round(r, 3) for r in curve]
    if stage == "ppo":  # the critic learns too: its squared error falls, its values end at the returns
        first, last = (range(1, K + 1), range(STEPS - K + 1, STEPS + 1))
        value_loss = [mean([metrics[s]["value_loss"] for s in steps]) for steps in (first, last)]
        assert 0 <= value_loss[1] < value_loss[0] / 5, value_loss
        gap = mean([abs(metrics[s]["value"] - metrics[s]["returns"]) for s in last])
        assert gap < 0.15, [(round(metrics[s]["value"], 3), round(metrics[s]["returns"], 3)) for s in last]
