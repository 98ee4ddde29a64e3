"""The prefix cache (model/prefix_cache.py), on vs off, side by side in one process (not a test).

Three measures, each in alternating rounds (off, on, off, on, ...: a shared machine's load falls on both sides
alike), each side's best round:

  ttft     the serving engine (serve/engine.py, no HTTP): time to first token of a chat whose prompt is a
           SYSTEM-token system prompt and a short question, and of a second one with the same system prompt and
           another question; second / first. With the cache the second copies the system prompt's blocks.
  streams  16 streams sharing that system prompt (each its own question), all queued at once, MAX_NEW tokens each:
           generated tokens / wall seconds, cache on vs off. With the cache the first stream's prefill computes
           the shared blocks and the other 15 copy them (PrefixCache.waves), then decoding is the same.
  rollout  GRPO's rollouts of one step of one worker (rl/rollout.py: sample_completions, per-row seeds) on the demo
           task's shape (16 sorting prompts x 8 completions, 10 tokens, temperature 1; bench_rollout.py's demo
           case), as the demo has them and with a system turn of about ROLLOUT_SYSTEM tokens before each; the cache is
           emptied before each step (a weight update does so); the samples' digest on both sides.

The models are freshly initialised (speed does not depend on what the weights learned): minimind2-small (26M) for
ttft and streams, the demo preset for rollout. Times are wall seconds on ``--threads`` torch threads.

Usage:  .venv/bin/python bench/bench_prefix_cache.py [--measures ttft,streams,rollout] [--rounds 3]
                                                     [--threads 1] [--system 1500] [--device cpu]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import fresh_model, load, table

MAX_NEW = 32  # streams: tokens generated per stream
STREAMS = 16
ROLLOUT_SYSTEM = 200  # the rollout's second case: a system turn of about this many tokens (175 in the demo tokenizer)


def words(n: int, seed: int):
    import torch

    return torch.randint(3, 6000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_run(model, prompts, cached: bool, device: str, max_new: int, together: bool):
    """The prompts on a fresh serving engine: one after another (each waits for the one before), or all submitted
    at once -> (each request's (CPU, wall) seconds to its first token, the whole run's (CPU, wall) seconds, tokens
    generated, each request's cached tokens). CPU seconds are the process's: the engine thread does all the work
    meanwhile, and they count what this process computed, not what the other processes of a shared machine did."""
    from minimind_ray.model.prefix_cache import PrefixCache  # lazy: torch, after common put this checkout first
    from minimind_ray.serve.engine import Engine, GenRequest  # lazy: the same

    engine = Engine(model, eos_id=-1, max_batch=STREAMS, context=model.cfg.max_position_embeddings, device=device,
                    prefix_cache=PrefixCache(512 * 2 ** 20) if cached else None)
    first, done, count = [None] * len(prompts), [threading.Event() for _ in prompts], [0]

    def now():
        return time.process_time(), time.perf_counter()

    def on_event(i, event, t0):
        if event[0] == "token":
            count[0] += 1
            if first[i] is None:
                first[i] = tuple(b - a for a, b in zip(t0, now()))
        else:
            done[i].set()

    try:
        start, reqs = now(), []
        for i, p in enumerate(prompts):
            reqs.append(GenRequest(prompt_ids=p, max_new_tokens=max_new, stop_at_eos=False,
                                   on_event=lambda e, i=i, t0=now(): on_event(i, e, t0)))
            if not together:
                engine.submit(reqs[-1])
                done[i].wait()
        if together:
            for r in reqs:
                engine.submit(r)
            for d in done:
                d.wait()
        return first, tuple(b - a for a, b in zip(start, now())), count[0], [r.cached_tokens for r in reqs]
    finally:
        engine.close()


def rollout_step(model, prompts, cached: bool, step: int, pad: int, eos: int, new_tokens: int = 10):
    """One GRPO step's rollouts (16 prompts x 8 completions, ``new_tokens`` tokens) -> ((CPU, wall) seconds, digest
    of the samples, the prompts' width). With one new token it is the prefill's cost (and one sampling)."""
    import torch

    from minimind_ray.model.prefix_cache import PrefixCache  # lazy: torch, after common put this checkout first
    from minimind_ray.rl.rollout import SamplingParams, row_seeds, sample_completions  # lazy: the same

    group, per_step = 8, 16
    first = (step * per_step) % (len(prompts) - per_step)
    rows = [p for p in prompts[first:first + per_step] for _ in range(group)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_id=eos, pad_id=pad)
    seeds = row_seeds(1234, step, torch.arange(first, first + per_step), group)
    pc = PrefixCache(256 * 2 ** 20) if cached else None  # a new step: new weights, an empty cache
    c0, w0 = time.process_time(), time.perf_counter()
    roll = sample_completions(model, ids, mask, params, seeds=seeds, prefix_cache=pc)
    seconds = (time.process_time() - c0, time.perf_counter() - w0)
    digest = hashlib.sha256(json.dumps([roll.completion_ids.tolist(), roll.completion_mask.tolist()]).encode())
    return seconds, digest.hexdigest()[:12], width


def demo_prompts(n: int, system: int):
    """``n`` demo sorting prompts in the demo tokenizer's chat template; with ``system`` > 0, a system turn of
    about that many tokens before each (the same for all)."""
    import random

    from minimind_ray.data.demo import SORT_LENGTHS, sort_prompt  # lazy: after common put this checkout first
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: the same

    tok = resolve_tokenizer("builtin", tempfile.mkdtemp(prefix="bench-prefix-"))
    rng = random.Random(0)
    sys_text = " ".join(f"Rule {i}: keep every digit, sort them in order, answer with the digits only."
                        for i in range(max(system // 45, 1)))  # about 45 tokens a rule
    out = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.choice(SORT_LENGTHS))]
        turns = ([{"role": "system", "content": sys_text}] if system else []) + \
            [{"role": "user", "content": sort_prompt(digits)}]
        out.append(tok.encode(tok.apply_chat_template(turns, add_generation_prompt=True)))
    return out, tok.eos_id, tok.pad_id


def cpu_wall(x) -> str:
    return f"{x[0]:.3f} ({x[1]:.3f})"


def bench_ttft(model, system, args) -> None:
    prompts = [system + words(12, 1), system + words(12, 2)]
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        for cached in (False, True):
            first, _, _, hits = engine_run(model, prompts, cached, args.device, 1, together=False)
            runs[cached].append((first, hits))
    rows = []
    for cached in (False, True):  # each request's best round, by CPU seconds
        a = min((f[0] for f, _ in runs[cached]), key=lambda t: t[0])
        b = min((f[1] for f, _ in runs[cached]), key=lambda t: t[0])
        rows.append(("on" if cached else "off", cpu_wall(a), cpu_wall(b), f"{b[0] / a[0]:.3f} ({b[1] / a[1]:.3f})",
                     runs[cached][0][1][1]))
    print(f"time to first token, minimind2-small, a {len(system)}-token system prompt + 12 tokens; the second "
          f"request with another question:\n")
    table(("prefix cache", "1st TTFT CPU s (wall)", "2nd TTFT CPU s (wall)", "2nd / 1st", "2nd cached tokens"), rows)
    print()


def bench_streams(model, system, args) -> None:
    prompts = [system + words(12, 10 + i) for i in range(STREAMS)]
    best = {}
    for _ in range(args.rounds):
        for cached in (False, True):
            _, spent, tokens, hits = engine_run(model, prompts, cached, args.device, MAX_NEW, together=True)
            if cached not in best or spent[0] < best[cached][0][0]:
                best[cached] = (spent, tokens, sum(hits))
    off = best[False]
    print(f"{STREAMS} streams submitted at once, a {len(system)}-token shared system prompt + 12 tokens each, "
          f"{MAX_NEW} tokens generated each:\n")
    table(("prefix cache", "CPU s (wall)", "tokens / CPU s (wall s)", "cached prompt tokens", "speed-up"),
          [(name, cpu_wall(x[0]), f"{x[1] / x[0][0]:.1f} ({x[1] / x[0][1]:.1f})", x[2],
            f"{off[0][0] / x[0][0]:.2f}x ({off[0][1] / x[0][1]:.2f}x)")
           for name, x in (("off", off), ("on", best[True]))])
    print()


def bench_rollout(args) -> None:
    model = fresh_model("demo").to(args.device).eval()
    rows = []
    for system in (0, ROLLOUT_SYSTEM):
        prompts, eos, pad = demo_prompts(200, system)
        best, digests, width = {}, {False: [], True: []}, 0
        for r in range(args.rounds):
            for cached in (False, True):
                for new_tokens in (10, 1):
                    total = (0.0, 0.0)
                    for step in range(3):
                        seconds, digest, width = rollout_step(model, prompts, cached, step, pad, eos, new_tokens)
                        total = (total[0] + seconds[0], total[1] + seconds[1])
                        if r == 0 and new_tokens == 10:
                            digests[cached].append(digest)
                    best[cached, new_tokens] = min(best.get((cached, new_tokens), total), total)
        off, on = best[False, 10], best[True, 10]
        rows.append(("demo" + (" + a shared system prompt" if system else ""), f"{width} + 10",
                     cpu_wall((off[0] / 3, off[1] / 3)), cpu_wall((on[0] / 3, on[1] / 3)),
                     f"{1 - on[0] / off[0]:.0%} ({1 - on[1] / off[1]:.0%})",
                     f"{best[False, 1][0] / 3:.3f} -> {best[True, 1][0] / 3:.3f}",
                     "yes" if digests[True] == digests[False] else "NO"))
    print("GRPO rollouts of one step of one worker (16 prompts x 8 completions, 10 tokens, temperature 1), demo "
          "preset, per step over 3 steps:\n")
    table(("case", "prompt width + completion", "off CPU s (wall)", "on CPU s (wall)", "lower by",
           "of it, prefill + 1st token: off -> on CPU s", "same samples"), rows)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measures", default="ttft,streams,rollout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--system", type=int, default=1500, help="tokens of the shared system prompt (ttft, streams)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    measures = args.measures.split(",")
    print(f"{load()}; {args.threads} torch thread(s) on {args.device}; best of {args.rounds} alternating rounds\n")
    if "ttft" in measures or "streams" in measures:
        model = fresh_model("minimind2-small").to(args.device).eval()
        system = words(args.system, 0)
        if "ttft" in measures:
            bench_ttft(model, system, args)
        if "streams" in measures:
            bench_streams(model, system, args)
    if "rollout" in measures:
        bench_rollout(args)
    print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
