"""Decode cost per token against its position, before and after the static KV cache (not a test).

For each position p (64, 512, 2048) and batch (1, 16): a freshly initialised model of --preset (minimind2-small,
26M) prefills prompts of p tokens, then decodes --steps more tokens, each step timed between two tokens'
arrivals in CPU seconds of the thread that runs the model (``time.thread_time``: on a shared machine wall time
mostly measures the other processes); a point's figure is batch / the median step, tokens per CPU second:

  batch 1    ``generate_tokens`` (the ``minimind-ray generate`` loop), one prompt
  batch 16   the serving engine (``serve/engine.py``) with 16 requests of p-token prompts, timed once all 16 run

Both functions exist before and after, so the same worker runs on both: "before" is the commit before issue 35
(``--before``, default b090f53: the cache grown with ``torch.cat`` per token, ``repeat_kv``), "after" this checkout,
in alternating rounds (common.before_after), each point's best round (the least disturbed on a shared machine).

``--kernels`` instead times this checkout's two CPU attentions of a cached step alone (``_grouped_attention``:
SDPA, and keys x queries, each forced), every layer of --preset over its own cache-shaped buffers of random keys
and values, for each batch x keys in --kernel-shapes, beside one read of those bytes (``sum``: this CPU's stream
rate, the floor of any kernel). Where the two cross is model/minimind.py's ``_KEYS_FIRST``.

Usage:  .venv/bin/python bench/bench_decode.py [--positions 64,512,2048] [--batches 1,16] [--steps 16]
                                               [--rounds 2] [--threads 1] [--before REV]
        .venv/bin/python bench/bench_decode.py --kernels [--kernel-shapes 16x64,16x2048] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from common import before_after, fresh_model, table, worker_main


def _batch1(model, p: int, steps: int) -> float:
    import torch

    from minimind_ray.generate import generate_tokens  # lazy: the worker's --src first (worker below)

    prompt = torch.randint(3, 6400, (1, p), generator=torch.Generator().manual_seed(p))
    stamps = [time.thread_time() for _ in generate_tokens(model, prompt, steps + 1, temperature=0.0,
                                                          eos_token_id=None)]
    return 1 / statistics.median(b - a for a, b in zip(stamps, stamps[1:]))  # the first came with the prefill


def _batched(model, p: int, steps: int, batch: int) -> float:
    import torch

    from minimind_ray.serve.engine import Engine, GenRequest  # lazy: the worker's --src first (worker below)

    engine = Engine(model, eos_id=2, max_batch=batch, context=p + steps + 2)
    g = torch.Generator().manual_seed(p)
    firsts, stamps, done = [], [], threading.Event()

    def on_event(i, event):
        if event[0] == "token":
            if i == 0:  # on the engine thread, which runs the model
                stamps.append(time.thread_time())
            firsts.append(i) if len(firsts) < batch and i not in firsts else None
        elif i == 0:
            done.set()

    joined_at = None
    try:
        with engine._cond:  # the loop takes this lock to pick up work: all rows are queued before it looks
            for i in range(batch):
                engine.submit(GenRequest(prompt_ids=torch.randint(3, 6400, (p,), generator=g).tolist(),
                                         max_new_tokens=steps + batch + 1, stop_at_eos=False,
                                         on_event=lambda e, i=i: on_event(i, e)))
        while len(firsts) < batch:  # every row has had its prefill: from the next token of row 0 on, all decode
            time.sleep(0.001)
        joined_at = len(stamps)
        assert done.wait(3600)
    finally:
        engine.close()
    timed = stamps[joined_at:joined_at + steps + 1]
    return batch / statistics.median(b - a for a, b in zip(timed, timed[1:]))


def worker(args) -> dict:
    """One side's points, on the code of the tree ``args.src`` (an earlier commit's, or this checkout's)."""
    model = fresh_model(args.preset).eval()
    _batch1(model, 16, 4)  # warm-up
    out = {}
    for b in [int(x) for x in args.batches.split(",")]:
        for p in [int(x) for x in args.positions.split(",")]:
            out[f"{b}@{p}"] = _batch1(model, p, args.steps) if b == 1 else _batched(model, p, args.steps, b)
    return out


def kernels(args) -> None:
    """The table of --kernels (see the module docstring), this checkout only, in this process."""
    import torch

    import minimind_ray.model.minimind as mm  # lazy: no minimind_ray at the top (a worker's --src comes first)

    torch.set_num_threads(args.threads)
    model = fresh_model(args.preset).eval()
    attn, c, threshold = model.model.layers[0].self_attn, model.cfg, mm._KEYS_FIRST

    def ms(fn, repeat=6) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t) / repeat * 1e3

    print(f"\n{args.preset}: one cached step's attention over its {c.num_hidden_layers} layers, one new token per row, "
          f"{args.threads} torch thread(s), mean of 6 after a warm-up (ms)\n")
    rows = []
    for shape in args.kernel_shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        kv = [torch.randn(2, B, c.num_key_value_heads, S + 1, c.head_dim) for _ in range(c.num_hidden_layers)]
        q = torch.randn(B, 1, c.num_attention_heads, c.head_dim)
        views = [(buf[0, :, :, :S], buf[1, :, :, :S]) for buf in kv]  # (B, nkv, S, hs): the cache's read

        def attend(keys_first: bool) -> None:
            mm._KEYS_FIRST = 0 if keys_first else 1 << 62
            with torch.no_grad():
                for k, v in views:
                    attn._grouped_attention(q, k, v, None)

        read = ms(lambda: [(k.sum(), v.sum()) for k, v in views])
        sdpa, keys_first = ms(lambda: attend(False)), ms(lambda: attend(True))
        nbytes = sum(k.numel() + v.numel() for k, v in views) * 4
        rows.append((f"{B} x {S}", f"{nbytes / 1e6:.0f} MB", f"{read:.2f} ({nbytes / read / 1e6:.1f} GB/s)",
                     f"{sdpa:.2f}", f"{keys_first:.2f}", f"{sdpa / keys_first:.2f}x"))
    mm._KEYS_FIRST = threshold
    table(("batch x keys", "KV bytes", "read them (sum)", "SDPA", "keys x queries", "SDPA / keys x queries"), rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimind2-small")
    ap.add_argument("--positions", default="64,512,2048")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=None, help="the commit to compare with (default: common.BASE_REV)")
    ap.add_argument("--kernels", action="store_true", help="time the two CPU attention kernels alone (no --before)")
    ap.add_argument("--kernel-shapes", default="16x64,16x128,16x256,2x2048,16x512,16x2048",
                    help="batch x keys of --kernels")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args, worker)
    if args.kernels:
        kernels(args)
        return 0

    passed = ["--preset", args.preset, "--positions", args.positions, "--batches", args.batches, "--steps",
              str(args.steps), "--threads", str(args.threads)]
    rev, best, loads = before_after(__file__, passed, args.threads, args.rounds, args.before, score=lambda v: v,
                                    show=lambda v: f"{v:.1f}")
    positions = [int(x) for x in args.positions.split(",")]
    print(f"\n{args.preset}, tokens per CPU second = batch / the median of {args.steps} decode steps' CPU time, "
          f"{args.threads} torch thread(s), best of {args.rounds} rounds; before = {rev}, after = this checkout; "
          f"load average (1 min) {loads}\n")
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for p in positions:
            k, k0 = f"{b}@{p}", f"{b}@{positions[0]}"
            bb, aa = best["before"][k], best["after"][k]
            rows.append((b, p, f"{bb:.1f}", f"{aa:.1f}", f"{aa / bb:.2f}x", f"{best['before'][k0] / bb:.2f}x",
                         f"{best['after'][k0] / aa:.2f}x"))
    table(("batch", "position", "before tok/CPU s", "after tok/CPU s", "after / before",
           f"cost per token vs position {positions[0]}: before", "after"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
