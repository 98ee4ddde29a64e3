"""The GRPO demo's measured result (not a test): exact-answer accuracy on held-out arithmetic, before and after.

  1. accuracy of a demo SFT model on the held-out questions of the built-in corpus ("What is a plus b?"
     for every pair of 0..99 the corpus never adds, in either order: data/demo.py:ARITHMETIC_HELDOUT),
     greedy and sampled (at the recipe's temperature, as in training: the mean of --samples draws per question);
  2. `minimind-ray grpo --config pipelines/configs/demo_grpo.yaml train.init_from=<SFT run>` (the same
     driver call), timed;
  3. the same accuracy of the GRPO model, and the run's reward curve and rollout/update split from MLflow.

Usage:  .venv/bin/python bench/bench_grpo.py --sft runs/<demo-sft-run> [--grpo runs/<grpo-run>] [overrides...]
With --grpo an existing GRPO run is measured instead of training a new one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch


def question_batch(cfg, tokenizer, which: str, limit: int = 200):
    """Questions as the training data renders them (formats.Encoder 'prompt'), left-padded: 'heldout' (pairs
    the corpus never adds) or 'train' (the first ``limit`` of the GRPO prompts, pairs the corpus does add)."""
    from minimind_ray.data.demo import ARITHMETIC_HELDOUT, write_demo_corpus
    from minimind_ray.data.formats import Encoder, collate

    demo = write_demo_corpus(os.path.join(os.path.abspath(cfg.data.cache_dir), "demo"))
    path = demo["prompt"] if which == "train" else os.path.join(os.path.dirname(demo["prompt"]), ARITHMETIC_HELDOUT)
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f][:limit]
    enc = Encoder("prompt", tokenizer, cfg.data.max_seq_len)
    assert not enc.add(records), "held-out questions must fit data.max_seq_len"
    rows = enc.take(final=True)
    return records, collate("prompt", rows, np.arange(len(records)), tokenizer.pad_id, cfg.data.max_seq_len)


def accuracy(weights: str, cfg, samples: int, max_new_tokens: int, which: str = "heldout", seed: int = 0):
    """(greedy accuracy, sampled accuracy, an example reply, questions) of the weights on a question set."""
    from minimind_ray.rl.rewards import is_correct
    from minimind_ray.rl.rollout import SamplingParams, TorchRollout
    from minimind_ray.store.weights import build_inference_model
    from minimind_ray.tokenizer import resolve_tokenizer

    model, _ = build_inference_model(weights, cfg.model.preset)  # the preset serves a bare .pth
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)
    records, batch = question_batch(cfg, tok, which)
    engine = TorchRollout()
    engine.update_policy(model, 0)

    def replies(n: int, **sampling):
        roll = engine.generate(batch["prompt_ids"].repeat_interleave(n, 0), batch["prompt_mask"].repeat_interleave(n, 0),
                               SamplingParams(max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id, **sampling))
        return [tok.decode(ids[m].tolist(), skip_special_tokens=True)
                for ids, m in zip(roll.completion_ids, roll.completion_mask)]

    answers = [str(r["answer"]) for r in records]
    greedy = replies(1, top_k=1)  # one candidate per step: argmax decoding
    torch.manual_seed(seed)
    sampled = replies(samples, temperature=cfg.train.grpo.temperature)
    g = sum(is_correct(c, a) for c, a in zip(greedy, answers)) / len(answers)
    s = sum(is_correct(c, answers[i // samples]) for i, c in enumerate(sampled)) / len(sampled)
    return g, s, f"{records[0]['prompt']} -> {greedy[0]!r}", len(records)


def reward_curve(tracking_uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)

    def hist(key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    return {k: hist(k) for k in ("reward", "reward_exact_answer", "reward_std", "zero_std_fraction", "kl",
                                 "completion_len", "truncated_fraction", "rollout_s", "step_time_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory) GRPO starts from")
    ap.add_argument("--grpo", help="an existing GRPO run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_grpo.yaml")
    ap.add_argument("--samples", type=int, default=8, help="sampled replies per question (the recipe's temperature)")
    ap.add_argument("overrides", nargs="*", help="applied to the GRPO recipe, e.g. train.max_steps=20")
    args = ap.parse_args()

    from minimind_ray.config import load_config

    cfg = load_config(args.config, [f"train.init_from={args.sft}", *args.overrides])
    gen_len = cfg.train.grpo.max_gen_len
    before = accuracy(args.sft, cfg, args.samples, gen_len)
    before_train = accuracy(args.sft, cfg, args.samples, gen_len, "train")
    grpo_dir, wall = args.grpo, None
    if grpo_dir is None:
        from minimind_ray.raytrain.driver import run

        t0 = time.time()
        res = run(cfg)
        wall = time.time() - t0
        grpo_dir, run_id, uri = res.checkpoint_dir, res.mlflow_run_id, res.tracking_uri
    else:  # an existing run: its MLflow run and tracking URI are in its newest checkpoint
        from minimind_ray.store.checkpoint import newest_complete

        meta = newest_complete(grpo_dir).meta()
        run_id = meta.mlflow_run_id  # MLflow's default store when the run named none: ./mlflow.db
        uri = meta.config["tracking"]["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{os.path.abspath('mlflow.db')}"
    after = accuracy(grpo_dir, cfg, args.samples, gen_len)
    after_train = accuracy(grpo_dir, cfg, args.samples, gen_len, "train")

    for title, b, a in ((f"{before[3]} held-out questions (pairs the demo corpus never adds)", before, after),
                        (f"{before_train[3]} of the GRPO prompts (pairs the demo corpus adds)", before_train, after_train)):
        print(f"\n==== exact-answer accuracy on {title} ====")
        print(f"{'model':<10} {'greedy':>8} {'sampled T=' + str(cfg.train.grpo.temperature):>12}   example (greedy)")
        for name, (g, s, example, _) in (("SFT", b), ("GRPO", a)):
            print(f"{name:<10} {g:>8.1%} {s:>12.1%}   {example}")
    if wall is not None:
        print(f"\nGRPO run: {cfg.train.max_steps} steps in {wall:.0f} s wall (Ray start, prepare, training, export); "
              f"run {run_id}")
    if run_id:
        curve = reward_curve(uri, run_id)
        print("\nstep  reward  exact  group-std  zero-std  kl      len   cut   rollout_s  step_s")
        rows = {k: dict(v) for k, v in curve.items()}
        for s in sorted(rows["reward"]):
            r = {k: rows[k].get(s, float("nan")) for k in rows}
            print(f"{s:>4}  {r['reward']:6.3f}  {r['reward_exact_answer']:5.3f}  {r['reward_std']:9.3f}  "
                  f"{r['zero_std_fraction']:8.2f}  {r['kl']:.4f}  {r['completion_len']:4.1f}  "
                  f"{r['truncated_fraction']:4.2f}  {r['rollout_s']:9.2f}  {r['step_time_s']:6.2f}")
        roll = statistics.mean(v for _, v in curve["rollout_s"])
        step = statistics.mean(v for _, v in curve["step_time_s"])
        print(f"\nmean per step: {step:.2f} s, of which rollout (generation + rewards + reference) {roll:.2f} s "
              f"({roll / step:.0%}) and update (forward/backward/optimizer, metrics) {step - roll:.2f} s")


if __name__ == "__main__":
    main()
