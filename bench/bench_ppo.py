"""The PPO demo's measured result (not a test), through the ``eval`` verb (minimind_ray/evals).

  1. a demo SFT model on the held-out sorting prompts (demo:sort_heldout: multisets no training file holds, and the
     length 7 that none has): greedy accuracy, and pass@1 / pass@8 of 8 samples at the recipe's temperature;
  2. ``minimind-ray ppo --config pipelines/configs/demo_ppo.yaml train.init_from=<SFT run>`` (the driver), timed;
  3. the same evaluation of the PPO actor, and the run's reward curve from MLflow in 10-step means.

Usage:  .venv/bin/python bench/bench_ppo.py --sft runs/<demo-sft-run> [--ppo runs/<ppo-run>] [overrides...]
"""
from __future__ import annotations

import argparse

from common import gen_scores, rl_report, rl_run, score_table

from minimind_ray.config import load_config

KEYS = ("rl/reward", "rl/value", "rl/value_loss", "rl/policy_loss", "rl/kl", "rl/approx_kl", "rl/clip_fraction",
        "rl/updates", "rl/completion_len", "rl/rollout_s", "perf/step_time_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory) PPO starts from")
    ap.add_argument("--ppo", help="an existing PPO run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_ppo.yaml")
    ap.add_argument("overrides", nargs="*", help="applied to the PPO recipe, e.g. train.max_steps=20")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"train.init_from={args.sft}", *args.overrides])

    def scores(weights):
        return gen_scores(weights, cfg.train.ppo, cfg.data.cache_dir, "demo:sort_heldout", 8, batch_size=50)

    before, run = scores(args.sft), rl_run(cfg, args.ppo)
    score_table(f"held-out sorting prompts (demo:sort_heldout), SFT -> PPO; sampled at T={cfg.train.ppo.temperature}, "
                f"8 samples", before, scores(run.run_dir), 8)
    rl_report("PPO", cfg, run, KEYS, 10)


if __name__ == "__main__":
    main()
