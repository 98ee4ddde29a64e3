"""The GRPO demo's measured result (not a test), through the ``eval`` verb (minimind_ray/evals).

  1. a demo SFT model on the held-out sorting prompts (demo:sort_heldout: multisets of the trained lengths that no
     training file holds, and the length 7 that none has) and on 200 of the GRPO training prompts: greedy accuracy,
     sampled pass@1 and pass@16 at the recipe's temperature, per length;
  2. ``minimind-ray grpo --config pipelines/configs/demo_grpo.yaml train.init_from=<SFT run>`` (the same driver
     call), timed;
  3. the same evaluation of the GRPO model, and the run's reward curve from MLflow.

``--rollouts`` instead times a few steps of the recipe three ways, side by side: in-worker sampling, a pool of
rollout actors, and the pool with overlapped generation; each with its rollout share of the step.

Usage:  .venv/bin/python bench/bench_grpo.py --sft runs/<demo-sft-run> [--grpo runs/<grpo-run>] [overrides...]
        .venv/bin/python bench/bench_grpo.py --sft runs/<demo-sft-run> --rollouts [--steps 12]
"""
from __future__ import annotations

import argparse
import statistics

from common import curve, gen_scores, rl_report, rl_run, score_table, table, timed

from minimind_ray.config import load_config
from minimind_ray.raytrain.driver import connect_ray, run

KEYS = ("rl/reward", "rl/reward_permutation_answer", "rl/reward_std", "rl/zero_std_fraction", "rl/kl", "rl/entropy",
        "rl/clip_fraction", "rl/completion_len", "rl/rollout_s", "perf/step_time_s")


def scores(weights: str, cfg) -> dict:
    """The held-out sorting prompts and 200 of the GRPO training prompts, scored (16 samples each)."""
    return {"held": gen_scores(weights, cfg.train.grpo, cfg.data.cache_dir, "demo:sort_heldout", 16),
            "train": gen_scores(weights, cfg.train.grpo, cfg.data.cache_dir, "demo:prompt", 16, 200)}


def bench_rollouts(args, base_overrides) -> None:
    """Steps of the recipe with each rollout engine, one after another in this run."""
    # one local Ray for the three runs, started with room for the largest (the workers and the 2 rollout actors):
    # a Ray the in-worker run started would hold no CPUs for the actors, which would wait for them forever
    connect_ray(load_config(args.config, [*base_overrides, "train.grpo.rollout=actors", "train.grpo.rollout_actors=2"]))
    rows = []
    for label, extra in (("in-worker sampling", []),
                         ("rollout actors (2)", ["train.grpo.rollout=actors", "train.grpo.rollout_actors=2"]),
                         ("actors + overlap", ["train.grpo.rollout=actors", "train.grpo.rollout_actors=2",
                                               "train.grpo.rollout_overlap=true"])):
        cfg = load_config(args.config, [*base_overrides, f"train.max_steps={args.steps}", "resume=never",
                                        f"checkpoint.interval={args.steps}", *extra])
        res, wall = timed(run, cfg)
        c = curve(res.tracking_uri, res.mlflow_run_id, KEYS)
        steps = sorted(c["step_time_s"])[1:]  # the first step holds the workers' and actors' start
        step = statistics.mean(c["step_time_s"][s] for s in steps)
        roll = statistics.mean(c["rollout_s"][s] for s in steps)
        rows.append((label, step, roll, wall))
    base = rows[0][1]
    print(f"\n==== GRPO step time, {args.steps} steps (the first left out), demo preset, 2 workers ====")
    table(("rollouts", "step (s)", "vs in-worker", "rollout (s)", "rollout share", "wall (s)"),
          [(label, f"{step:.2f}", f"{step / base:.2f}x", f"{roll:.2f}", f"{roll / step:.0%}", f"{wall:.0f}")
           for label, step, roll, wall in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory) GRPO starts from")
    ap.add_argument("--grpo", help="an existing GRPO run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_grpo.yaml")
    ap.add_argument("--rollouts", action="store_true", help="time the rollout engines instead")
    ap.add_argument("--steps", type=int, default=12, help="--rollouts: steps per engine")
    ap.add_argument("overrides", nargs="*", help="applied to the GRPO recipe, e.g. train.max_steps=20")
    args = ap.parse_args()
    overrides = [f"train.init_from={args.sft}", *args.overrides]
    if args.rollouts:
        return bench_rollouts(args, overrides)
    cfg = load_config(args.config, overrides)
    before, run = scores(args.sft, cfg), rl_run(cfg, args.grpo)
    after = scores(run.run_dir, cfg)
    score_table(f"held-out sorting prompts (demo:sort_heldout), SFT -> GRPO; sampled at T={cfg.train.grpo.temperature}"
                ", 16 samples", before["held"], after["held"], 16)
    score_table("200 of the GRPO training prompts (demo:prompt), SFT -> GRPO", before["train"], after["train"], 16)
    rl_report("GRPO", cfg, run, KEYS)


if __name__ == "__main__":
    main()
