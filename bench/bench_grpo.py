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
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scores(weights: str, cfg, data: str, limit=None, samples: int = 16) -> dict:
    from minimind_ray.evals.config import EvalTaskConfig
    from minimind_ray.evals.run import evaluate_task

    g = cfg.train.grpo
    task = EvalTaskConfig(task="gen", data=data, chat_template=True, samples=samples, max_new_tokens=g.max_gen_len,
                          temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, limit=limit, batch_size=25)
    return evaluate_task(weights, task, cache_dir=cfg.data.cache_dir)


def table(title: str, before: dict, after: dict) -> None:
    print(f"\n==== {title} ====")
    print(f"{'subject':<16} {'n':>5}   {'greedy':>15}   {'pass@1':>15}   {'pass@16':>15}")
    for s in list(before["subjects"]) + ["all"]:
        b = before if s == "all" else before["subjects"][s]
        a = after if s == "all" else after["subjects"][s]
        row = "   ".join(f"{b[k]:>6.1%} -> {a[k]:>6.1%}" for k in ("greedy_acc", "pass@1", "pass@k"))
        print(f"{s:<16} {b['n']:>5}   {row}")


def reward_curve(tracking_uri: str, run_id: str) -> dict:
    from mlflow.tracking import MlflowClient

    from minimind_ray.tracking.names import history

    client = MlflowClient(tracking_uri)
    keys = ("rl/reward", "rl/reward_permutation_answer", "rl/reward_std", "rl/zero_std_fraction", "rl/kl",
            "rl/entropy", "rl/clip_fraction", "rl/completion_len", "rl/rollout_s", "perf/step_time_s")
    return {k.split("/", 1)[1]: dict(history(client, run_id, k)) for k in keys}


def train(cfg):
    from minimind_ray.raytrain.driver import run

    t0 = time.time()
    res = run(cfg)
    return res, time.time() - t0


def bench_rollouts(args, base_overrides) -> None:
    """Steps of the recipe with each rollout engine, one after another in this run."""
    from minimind_ray.config import load_config

    from minimind_ray.raytrain.driver import connect_ray

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
        res, wall = train(cfg)
        curve = reward_curve(res.tracking_uri, res.mlflow_run_id)
        steps = sorted(curve["step_time_s"])[1:]  # the first step holds the workers' and actors' start
        step = statistics.mean(curve["step_time_s"][s] for s in steps)
        roll = statistics.mean(curve["rollout_s"][s] for s in steps)
        rows.append((label, step, roll, wall))
    base = rows[0][1]
    print(f"\n==== GRPO step time, {args.steps} steps (the first left out), demo preset, 2 workers ====")
    print(f"{'rollouts':<22} {'step (s)':>9} {'vs in-worker':>12} {'rollout (s)':>11} {'rollout share':>13} {'wall (s)':>9}")
    for label, step, roll, wall in rows:
        print(f"{label:<22} {step:>9.2f} {step / base:>11.2f}x {roll:>11.2f} {roll / step:>12.0%} {wall:>9.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory) GRPO starts from")
    ap.add_argument("--grpo", help="an existing GRPO run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_grpo.yaml")
    ap.add_argument("--rollouts", action="store_true", help="time the rollout engines instead")
    ap.add_argument("--steps", type=int, default=12, help="--rollouts: steps per engine")
    ap.add_argument("overrides", nargs="*", help="applied to the GRPO recipe, e.g. train.max_steps=20")
    args = ap.parse_args()

    from minimind_ray.config import load_config

    overrides = [f"train.init_from={args.sft}", *args.overrides]
    if args.rollouts:
        return bench_rollouts(args, overrides)
    cfg = load_config(args.config, overrides)
    before = {"held": scores(args.sft, cfg, "demo:sort_heldout"), "train": scores(args.sft, cfg, "demo:prompt", 200)}
    grpo_dir, wall = args.grpo, None
    if grpo_dir is None:
        res, wall = train(cfg)
        grpo_dir, run_id, uri = res.checkpoint_dir, res.mlflow_run_id, res.tracking_uri
    else:  # an existing run: its MLflow run and tracking URI are in its newest checkpoint
        from minimind_ray.store.checkpoint import newest_complete

        meta = newest_complete(grpo_dir).meta()
        run_id = meta.mlflow_run_id
        uri = meta.config["tracking"]["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{os.path.abspath('mlflow.db')}"
    after = {"held": scores(grpo_dir, cfg, "demo:sort_heldout"), "train": scores(grpo_dir, cfg, "demo:prompt", 200)}
    T = cfg.train.grpo.temperature
    table(f"held-out sorting prompts (demo:sort_heldout), SFT -> GRPO; sampled at T={T}, 16 samples", before["held"],
          after["held"])
    table(f"200 of the GRPO training prompts (demo:prompt), SFT -> GRPO", before["train"], after["train"])
    if wall is not None:
        print(f"\nGRPO run: {cfg.train.max_steps} steps in {wall:.0f} s wall (Ray start, prepare, training, evaluation, "
              f"export); run {run_id}")
    if run_id:
        curve = reward_curve(uri, run_id)
        print("\nstep  reward  perm    std    zero-std  kl      entropy  clip   len   rollout_s  step_s")
        for s in sorted(curve["reward"]):
            r = {k: v.get(s, float("nan")) for k, v in curve.items()}
            print(f"{s:>4}  {r['reward']:6.3f}  {r['reward_permutation_answer']:5.3f}  {r['reward_std']:5.3f}  "
                  f"{r['zero_std_fraction']:8.2f}  {r['kl']:.4f}  {r['entropy']:7.3f}  {r['clip_fraction']:5.3f}  "
                  f"{r['completion_len']:4.1f}  {r['rollout_s']:9.2f}  {r['step_time_s']:6.2f}")


if __name__ == "__main__":
    main()
