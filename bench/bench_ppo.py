"""The PPO demo's measured result (not a test), through the ``eval`` verb (minimind_ray/evals).

  1. a demo SFT model on the held-out sorting prompts (demo:sort_heldout: multisets no training file holds, and the
     length 7 that none has): greedy accuracy, and pass@1 / pass@8 of 8 samples at the recipe's temperature;
  2. ``minimind-ray ppo --config pipelines/configs/demo_ppo.yaml train.init_from=<SFT run>`` (the driver), timed;
  3. the same evaluation of the PPO actor, and the run's reward curve from MLflow in 10-step means.

Usage:  .venv/bin/python bench/bench_ppo.py --sft runs/<demo-sft-run> [--ppo runs/<ppo-run>] [overrides...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scores(weights: str, cfg, samples: int = 8) -> dict:
    from minimind_ray.evals.config import EvalTaskConfig
    from minimind_ray.evals.run import evaluate_task

    p = cfg.train.ppo
    task = EvalTaskConfig(task="gen", data="demo:sort_heldout", chat_template=True, samples=samples,
                          max_new_tokens=p.max_gen_len, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          batch_size=50)
    return evaluate_task(weights, task, cache_dir=cfg.data.cache_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory) PPO starts from")
    ap.add_argument("--ppo", help="an existing PPO run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_ppo.yaml")
    ap.add_argument("overrides", nargs="*", help="applied to the PPO recipe, e.g. train.max_steps=20")
    args = ap.parse_args()

    from minimind_ray.config import load_config

    cfg = load_config(args.config, [f"train.init_from={args.sft}", *args.overrides])
    before = scores(args.sft, cfg)
    ppo_dir, wall = args.ppo, None
    if ppo_dir is None:
        from minimind_ray.raytrain.driver import run

        t0 = time.time()
        res = run(cfg)
        wall = time.time() - t0
        ppo_dir, run_id, uri = res.run_dir, res.mlflow_run_id, res.tracking_uri
    else:
        from minimind_ray.store.checkpoint import newest_complete

        meta = newest_complete(ppo_dir).meta()
        run_id = meta.mlflow_run_id
        uri = meta.config["tracking"]["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{os.path.abspath('mlflow.db')}"
    after = scores(ppo_dir, cfg)
    print(f"\n==== held-out sorting prompts (demo:sort_heldout), SFT -> PPO; sampled at T={cfg.train.ppo.temperature}, "
          f"8 samples ====")
    print(f"{'subject':<16} {'n':>5}   {'greedy':>15}   {'pass@1':>15}   {'pass@8':>15}")
    for s in list(before["subjects"]) + ["all"]:
        b = before if s == "all" else before["subjects"][s]
        a = after if s == "all" else after["subjects"][s]
        row = "   ".join(f"{b[k]:>6.1%} -> {a[k]:>6.1%}" for k in ("greedy_acc", "pass@1", "pass@k"))
        print(f"{s:<16} {b['n']:>5}   {row}")
    if wall is not None:
        print(f"\nPPO run: {cfg.train.max_steps} steps in {wall:.0f} s wall (Ray's start, prepare, training, export)")
    if run_id:
        from mlflow.tracking import MlflowClient

        from minimind_ray.tracking.names import history

        client = MlflowClient(uri)
        keys = ("rl/reward", "rl/value", "rl/value_loss", "rl/policy_loss", "rl/kl", "rl/approx_kl", "rl/clip_fraction",
                "rl/updates", "rl/completion_len", "rl/rollout_s", "perf/step_time_s")
        curve = {k.split("/", 1)[1]: dict(history(client, run_id, k)) for k in keys}
        steps = sorted(curve["reward"])
        print("\nsteps    reward  value   value_loss  policy_loss  kl      approx_kl  clip   updates  len   rollout_s  "
              "step_s")
        for lo in range(0, len(steps), 10):
            block = steps[lo:lo + 10]
            m = {k: sum(v.get(s, float("nan")) for s in block) / len(block) for k, v in curve.items()}
            print(f"{block[0]:>3}-{block[-1]:<4} {m['reward']:6.3f}  {m['value']:6.3f}  {m['value_loss']:10.4f}  "
                  f"{m['policy_loss']:11.4f}  {m['kl']:.4f}  {m['approx_kl']:9.4f}  {m['clip_fraction']:5.3f}  "
                  f"{m['updates']:7.2f}  {m['completion_len']:4.1f}  {m['rollout_s']:9.2f}  {m['step_time_s']:6.2f}")


if __name__ == "__main__":
    main()
