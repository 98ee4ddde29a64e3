"""How far GRPO, PPO and the agent stage move a random tiny model on tests/unit/test_rl_learns.py's reward (the share
of ASCII punctuation in a completion), over seeds: the measured figures behind that test's MARGIN (docs/testing.md).

Each run is the test's own (the engine on one rank, no Ray, the test's config); per stage it prints each seed's margin
(mean reward of the last K steps minus that of the first K) and the smallest, mean and largest over the seeds.
Run it again with a mutation applied by hand (a flipped advantage sign, rewards shuffled across completions, PPO's
value loss with its sign flipped) to see the margin that the test's assertion must refuse.

Usage:  .venv/bin/python bench/bench_rl_learns.py [--seeds 5] [--stages grpo,ppo,agent]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--stages", default="grpo,ppo,agent")
    args = ap.parse_args()
    os.environ.setdefault("MINIMIND_RAY_TOKENIZER_MIRROR", str(Path(__file__).resolve().parents[2] / "shared" / "minimind"))
    from minimind_ray.tokenizer import load_tokenizer
    from minimind_ray.tokenizer_fetch import fetch_tokenizer
    from tests.unit.test_agent import _records
    from tests.unit.test_grpo import prepare_locally
    from tests.unit.test_rl_learns import K, MARGIN, STEPS, learning_curve, margin, mean

    with tempfile.TemporaryDirectory(prefix="bench-rl-learns-") as tmp:
        tok = load_tokenizer(fetch_tokenizer("minimind2", cache_dir=tmp))
        sums = [{"prompt": f"What is {a} plus {b}?", "answer": a + b} for a in range(8) for b in range(8)]
        (Path(tmp) / "p").mkdir()
        (Path(tmp) / "a").mkdir()
        prepared = {"prompt": prepare_locally(sums, Path(tmp) / "p", tok)[0],
                    "agent": prepare_locally(_records(tools=False), Path(tmp) / "a", tok, fmt="agent_rl",
                                             max_seq_len=320)[0]}
        print(f"{STEPS} steps, margin = mean of the last {K} steps' rewards - mean of the first {K}; the test asks "
              f"> {MARGIN}")
        for stage in args.stages.split(","):
            margins = []
            for seed in range(args.seeds):
                t0 = time.process_time()
                metrics = {}
                curve = learning_curve(stage, prepared, tmp, seed=seed, metrics=metrics)
                margins.append(margin(curve))
                critic = ""
                if stage == "ppo":
                    first, last = range(1, K + 1), range(STEPS - K + 1, STEPS + 1)
                    loss = [mean([metrics[s]["value_loss"] for s in steps]) for steps in (first, last)]
                    gap = mean([abs(metrics[s]["value"] - metrics[s]["returns"]) for s in last])
                    critic = f"; value loss {loss[0]:.4f} -> {loss[1]:.4f}, |value - return| at the end {gap:.3f}"
                print(f"{stage:6s} seed {seed}: margin {margins[-1]:+.3f}{critic}  ({time.process_time() - t0:.1f} "
                      f"CPU s; rewards {' '.join(f'{r:.2f}' for r in curve[::3])} ...)", flush=True)
            print(f"{stage:6s} over {len(margins)} seeds: min {min(margins):+.3f}, mean "
                  f"{sum(margins) / len(margins):+.3f}, max {max(margins):+.3f}")


if __name__ == "__main__":
    main()
