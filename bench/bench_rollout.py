"""GRPO rollout time per step, before and after the static KV cache (not a test), and whether the samples are
the same.

What one training worker generates in one GRPO step, with the in-worker sampler (``rl/rollout.py``
``TorchRollout``), each completion from its own seed (``row_seeds``), as the step asks for it: before, one
``generate`` per micro-batch; after, ``generate_many`` of the step's micro-batches (rl/plan.py: the plan base), which runs
them as one batch:

  demo             the demo recipe (demo_grpo.yaml): 16 sorting prompts x 8 completions, max_gen_len 10,
                   temperature 1, one micro-batch per worker and step
  minimind2-small  grpo_26m.yaml's shape with max_gen_len 256: 4 micro-batches of 2 prompts x 6 completions,
                   temperature 0.8

The prompts are the demo's sorting prompts in the demo tokenizer's chat template; the models are freshly initialised
(such a model seldom ends a completion early: every row runs to max_gen_len, the longest case). "before" is the
commit before issue 35 (``--before``), "after" this checkout, in alternating rounds (common.before_after): each
side's best round, and whether both sampled the same tokens. Time is the process's CPU seconds (one torch thread;
on a shared machine wall time mostly measures the other processes), the wall seconds beside it.

Usage:  .venv/bin/python bench/bench_rollout.py [--cases demo,minimind2-small] [--steps 3] [--rounds 2]
                                                [--threads 1] [--before REV]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from common import before_after, fresh_model, table, worker_main

CASES = {  # preset, prompts per micro-batch, completions per prompt, micro-batches per step, max_gen_len, temperature
    "demo": ("demo", 16, 8, 1, 10, 1.0),
    "minimind2-small": ("minimind2-small", 2, 6, 4, 256, 0.8),
}


def prompt_ids(n: int, cache_dir: str):
    """``n`` demo sorting prompts, chat-templated and encoded with the demo tokenizer."""
    import random

    from minimind_ray.data.demo import SORT_LENGTHS, sort_prompt  # lazy: the worker's --src first (worker below)
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: the same

    tok = resolve_tokenizer("builtin", cache_dir)
    rng = random.Random(0)
    out = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.choice(SORT_LENGTHS))]
        text = tok.apply_chat_template([{"role": "user", "content": sort_prompt(digits)}], add_generation_prompt=True)
        out.append(tok.encode(text))
    return out, tok.eos_id, tok.pad_id


def worker(args) -> dict:
    """One side's steps, on the code of the tree ``args.src`` (an earlier commit's, or this checkout's)."""
    import torch

    from minimind_ray.rl.rollout import SamplingParams, TorchRollout, row_seeds  # lazy: after --src is first

    shared = json.loads(Path(args.prompts).read_text())
    out = {}
    for name in args.cases.split(","):
        preset, per_mb, group, mbs, gen_len, temperature = CASES[name]
        model = fresh_model(preset).eval()
        engine = TorchRollout()
        engine.update_policy(model, 0)
        params = SamplingParams(max_new_tokens=gen_len, temperature=temperature, eos_id=shared["eos"],
                                pad_id=shared["pad"])
        digest, seconds = hashlib.sha256(), []
        for step in range(args.steps + 1):  # step 0 warms up
            requests = []
            for mb in range(mbs):
                first = ((step * mbs + mb) * per_mb) % (len(shared["prompts"]) - per_mb)
                rows = [p for p in shared["prompts"][first:first + per_mb] for _ in range(group)]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), shared["pad"], dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
                requests.append((ids, mask, params, row_seeds(1234, step, torch.arange(first, first + per_mb), group)))
            t0, c0 = time.perf_counter(), time.process_time()
            if hasattr(engine, "generate_many"):
                rolls = engine.generate_many(requests)
            else:  # the version before issue 35: one micro-batch at a time
                rolls = [engine.generate(ids, mask, p, seeds=seeds) for ids, mask, p, seeds in requests]
            if step:
                seconds.append((time.process_time() - c0, time.perf_counter() - t0))
            for roll in rolls:
                digest.update(json.dumps([roll.completion_ids.tolist(), roll.completion_mask.tolist()]).encode())
        cpu, wall = min(seconds)
        out[name] = {"s_per_step": cpu, "wall_s": wall, "samples": digest.hexdigest()[:16]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="demo,minimind2-small")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (the best counts)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=None, help="the commit to compare with (default: common.BASE_REV)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args, worker)

    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    prompts, eos, pad = prompt_ids(200, str(tmp / "cache"))
    (tmp / "prompts.json").write_text(json.dumps({"prompts": prompts, "eos": eos, "pad": pad}))
    passed = ["--cases", args.cases, "--steps", str(args.steps), "--threads", str(args.threads), "--prompts",
              str(tmp / "prompts.json")]
    rev, best, loads = before_after(__file__, passed, args.threads, args.rounds, args.before,
                                    score=lambda v: -v["s_per_step"], show=lambda v: f"{v['s_per_step']:.2f} CPU s")
    print(f"\nrollout CPU seconds (wall) per GRPO step of one worker, best of {args.rounds} rounds x {args.steps} "
          f"steps, {args.threads} torch thread(s); before = {rev}, after = this checkout; load average (1 min) "
          f"{loads}\n")
    rows = []
    for name in args.cases.split(","):
        _, per_mb, group, mbs, gen_len, _ = CASES[name]
        b, a = best["before"][name], best["after"][name]
        rows.append((name, f"{per_mb * group * mbs} x {gen_len}", f"{b['s_per_step']:.2f} ({b['wall_s']:.2f})",
                     f"{a['s_per_step']:.2f} ({a['wall_s']:.2f})", f"{1 - a['s_per_step'] / b['s_per_step']:.0%}",
                     "yes" if a["samples"] == b["samples"] else "NO"))
    table(("case", "completions x tokens per step", "before CPU s (wall)", "after CPU s (wall)", "lower by",
           "same samples"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
