"""The margin of tests/unit/test_rl_learns.py over seeds: how far GRPO, PPO and the agent stage move a random tiny
model on that test's reward (the share of ASCII punctuation in a completion), each seed's run the test's own (the
engine on one rank, no Ray, the test's config; seed 0 is the test's). Per stage it prints each seed's margin (mean
reward of the last K steps minus that of the first K) and the smallest, mean and largest, and fails when a seed's
margin does not beat the test's MARGIN: the test would then pass or fail by its seed. docs/testing.md has the table.

Run it again with a mutation applied by hand (a flipped advantage sign, rewards shuffled across completions, PPO's
value loss with its sign flipped) to see the margins that the test's assertion must refuse.

    .venv/bin/python -m pytest -m soak -s tests/soak/test_rl_margins.py [--rl-seeds 5] [-k grpo]
"""
from __future__ import annotations

import time

import pytest

from tests.unit.test_rl_learns import K, MARGIN, STAGES, STEPS, learning_curve, margin, mean, prompts  # noqa: F401

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]


@pytest.mark.parametrize("stage", STAGES)
def test_every_seed_beats_the_margin_of_test_rl_learns(stage, prompts, tmp_path, request):  # noqa: F811
    margins = []
    print(f"\n{STEPS} steps, margin = mean of the last {K} steps' rewards - mean of the first {K}; the test asks "
          f"> {MARGIN}")
    for seed in range(request.config.getoption("--rl-seeds", 5)):
        t0, metrics = time.process_time(), {}
        curve = learning_curve(stage, prompts, tmp_path, seed=seed, metrics=metrics)
        margins.append(margin(curve))
        critic = ""
        if stage == "ppo":
            first, last = range(1, K + 1), range(STEPS - K + 1, STEPS + 1)
            loss = [mean([metrics[s]["value_loss"] for s in steps]) for steps in (first, last)]
            gap = mean([abs(metrics[s]["value"] - metrics[s]["returns"]) for s in last])
            critic = f"; value loss {loss[0]:.4f} -> {loss[1]:.4f}, |value - return| at the end {gap:.3f}"
        print(f"{stage:6s} seed {seed}: margin {margins[-1]:+.3f}{critic}  ({time.process_time() - t0:.1f} "
              f"CPU s; rewards {' '.join(f'{r:.2f}' for r in curve[::3])} ...)", flush=True)
    print(f"{stage:6s} over {len(margins)} seeds: min {min(margins):+.3f}, mean {mean(margins):+.3f}, "
          f"max {max(margins):+.3f}")
    assert min(margins) > MARGIN, f"{stage}: seeds at or under the test's margin {MARGIN}: {margins}"
