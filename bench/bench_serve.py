"""Serving benchmark (not a test): the Ray Serve app with continuous batching against the same requests
served one by one by the plain ``generate`` loop, one side-by-side table.

  one-by-one   minimind_ray.generate.generate_tokens in this process, request after request
  serve, N     the Serve app (1 replica, max batch 16) with N concurrent streaming clients (1, 4, 16)
               pulling the same requests from a shared queue over HTTP/SSE

Both sides: the same weights, prompts, thread count (--threads), greedy decoding of exactly
--max-tokens tokens per request (``ignore_eos``: every request costs the same).

Figures per row: total generated tokens/s, p50/p99 time to first token (TTFT: from sending the
request to its first text; one-by-one: prefill and first token of a request alone, no waiting for
the others), p50 inter-token latency (per request (last - first token time) / (tokens - 1), then
the median over requests), tokens/s relative to one-by-one (the mean of a one-by-one run
before and one after the Serve runs: on a shared machine the load drifts), and the CPU seconds
all processes involved spent per 1000 generated tokens (this process, and for Serve also the
replica, proxy, controller and other Ray processes it started; a figure the machine's other load
disturbs much less than tokens/s). A second table splits the Serve rows' CPU by process.

Usage:  .venv/bin/python bench/bench_serve.py [--weights RUN|PTH] [--tokenizer T] [--preset demo]
        [--clients 1,4,16] [--requests 32] [--max-tokens 64] [--threads 1] [--stream-interval-ms MS]
        [--serve-env NAME=VALUE ...] [--before REV]
``--before REV`` runs the script of commit REV first, on that commit's code, then this checkout's: both tables,
then their rows side by side.
The load average is printed beside the rows; ``--serve-env`` sets environment variables of the Ray processes
(Serve's own switches). Without --weights: a fresh model of --preset (the demo's size) and the built-in tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from common import BASE_REV, REPO, cpu_by_process, cpu_spent, export_tree, fresh_weights, table
from ray import serve

from minimind_ray.serve import serve_verb
from minimind_ray.serve.engine import Engine, GenRequest
from minimind_ray.serve.model_io import generate_tokens, load_served_model, render_prompt
from minimind_ray.serve.options import ServeOptions
from minimind_ray.tokenizer import resolve_tokenizer

PROMPTS = ["What is the capital of France?", "What is 12 plus 7?", "中国的首都是哪里？", "Who are you?",
           "Tell me about the sun.", "Write one sentence about rivers.", "What is 3 times 4?",
           "Name a colour of the sky."]
# the Ray processes this one started, by a text of their command line (common.cpu_by_process)
ROLES = (("replica", "ServeReplica"), ("proxy", "ProxyActor"), ("controller", "ServeController"))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(name, results, wall, cpu_s):
    tokens = sum(r["tokens"] for r in results)
    return {"mode": name, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 2),
            "tok_per_s": tokens / wall, "cpu_s_per_1k": 1000 * cpu_s / tokens,
            "ttft_p50_ms": 1000 * pct([r["ttft"] for r in results], 50),
            "ttft_p99_ms": 1000 * pct([r["ttft"] for r in results], 99),
            "itl_p50_ms": 1000 * statistics.median(r["itl"] for r in results)}


def one_by_one(served, prompt_ids, max_tokens):
    """Each request alone through generate_tokens, one after another."""
    results = []
    t_start = time.perf_counter()
    for ids in prompt_ids:
        t0 = time.perf_counter()
        times = [time.perf_counter() for _ in generate_tokens(served.model, torch.tensor([ids]), max_tokens,
                                                              temperature=0.0, eos_token_id=None)]
        results.append({"tokens": len(times), "ttft": times[0] - t0,
                        "itl": (times[-1] - times[0]) / max(len(times) - 1, 1)})
    return results, time.perf_counter() - t_start


def engine_alone(served, prompt_ids, max_tokens, n_clients):
    """The batching engine in this process, no HTTP, no Ray: ``n_clients`` requests in flight at a time.
    What batching gains before any serving overhead."""
    engine = Engine(served.model, served.tokenizer.eos_id, 16, 1 << 20)
    pending, results, lock, done = list(prompt_ids), [], threading.Lock(), threading.Event()
    t_start = time.perf_counter()

    def submit_next():
        with lock:
            if not pending:
                return
            ids = pending.pop(0)
        t0, times = time.perf_counter(), []

        def on_event(event):
            if event[0] == "token":
                times.append(time.perf_counter())
                return
            results.append({"tokens": len(times), "ttft": times[0] - t0,
                            "itl": (times[-1] - times[0]) / max(len(times) - 1, 1)})
            if len(results) == len(prompt_ids):
                done.set()
            submit_next()

        engine.submit(GenRequest(prompt_ids=ids, max_new_tokens=max_tokens, on_event=on_event, stop_at_eos=False))

    for _ in range(n_clients):
        submit_next()
    done.wait()
    wall = time.perf_counter() - t_start
    engine.close()
    return results, wall


async def serve_clients(url, model, messages_list, n_clients, max_tokens):
    """``n_clients`` streaming clients pulling requests from one queue until it is empty."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for m in messages_list:
        queue.put_nowait(m)
    results = []

    async def client(session):
        while not queue.empty():
            messages = queue.get_nowait()
            body = {"model": model, "messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        tokens = ev["usage"]["completion_tokens"]
                    if any(c["delta"].get("content") for c in ev.get("choices", [])):
                        last = time.perf_counter()
                        first = first or last
            results.append({"tokens": tokens, "ttft": first - t0, "itl": (last - first) / max(tokens - 1, 1)})

    t_start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(client(session) for _ in range(n_clients)))
    return results, time.perf_counter() - t_start


def before_after(rev: str, argv: list) -> int:
    """``--before REV``: this script of commit ``rev`` on that commit's code (exported with git archive), then this
    checkout's, each in a process of its own with ``--json``; both outputs, then their rows side by side."""
    rest = [a for i, a in enumerate(argv) if not a.startswith("--before") and (i == 0 or argv[i - 1] != "--before")]
    tmp, loads, rows = Path(tempfile.mkdtemp(prefix="bench-serve-")), [os.getloadavg()[0]], {}
    for side, tree in (("before", export_tree(rev)), ("after", REPO)):
        print(f"\n======== {side}: {tree / 'bench' / 'bench_serve.py'} {' '.join(rest)}", flush=True)
        subprocess.run([sys.executable, str(tree / "bench" / "bench_serve.py"), *rest, "--json", str(tmp / side)],
                       check=True, env={**os.environ, "PYTHONPATH": str(tree)})
        rows[side] = {r["mode"]: r for r in json.loads((tmp / side).read_text())}
        loads.append(os.getloadavg()[0])
    print(f"\nbench_serve.py {' '.join(rest)}: before = {rev}, after = this checkout; load average (1 min) "
          + " -> ".join(f"{x:.1f}" for x in loads) + "\n")
    base = {s: (r["one-by-one"]["tok_per_s"] + r.get("one-by-one, again", r["one-by-one"])["tok_per_s"]) / 2
            for s, r in rows.items()}
    table(("mode", "before tok/s", "after tok/s", "before vs one-by-one", "after vs one-by-one",
           "TTFT p50 / p99 ms before", "after"),
          [(mode, f"{b['tok_per_s']:.0f}", f"{r['tok_per_s']:.0f}", f"{b['tok_per_s'] / base['before']:.2f}x",
            f"{r['tok_per_s'] / base['after']:.2f}x", f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f}",
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}")
           for mode, r in rows["after"].items() if (b := rows["before"].get(mode))])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", help="run dir, checkpoint or .pth (default: a fresh --preset model)")
    ap.add_argument("--tokenizer", help="tokenizer for a bare .pth (default: the built-in one)")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--stream-interval-ms", type=float, default=None, help="the server's (default: its default)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the Ray processes (e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--before", metavar="REV", help=f"also this script of commit REV (e.g. {BASE_REV}, the commit "
                                                      "before the static KV cache) on its own code, side by side")
    args = ap.parse_args(argv)
    if args.before:
        return before_after(args.before, sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for kv in args.serve_env:  # before Ray starts: its processes inherit this environment
        name, _, value = kv.partition("=")
        os.environ[name] = value
    loads = {"start": os.getloadavg()[0]}
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    weights, tokenizer = args.weights, args.tokenizer
    if not weights:
        weights, tokenizer = fresh_weights(args.preset, tmp), resolve_tokenizer("builtin", str(tmp / "cache")).path
    torch.set_num_threads(args.threads)
    served = load_served_model(weights, tokenizer=tokenizer)
    tok = served.tokenizer
    messages_list = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.requests)]
    prompt_ids = [tok.encode(render_prompt(tok, m)) for m in messages_list]
    print(f"stream interval: {args.stream_interval_ms if args.stream_interval_ms is not None else 'default'} ms")
    print(f"model {served.name}: {sum(p.numel() for p in served.model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.requests} requests x {args.max_tokens} tokens, prompts {min(map(len, prompt_ids))}-"
          f"{max(map(len, prompt_ids))} tokens, {args.threads} torch thread(s), {os.cpu_count()} CPUs", flush=True)

    def measured(name, run, *a):
        before = cpu_by_process(ROLES, me="client")
        results, wall = run(*a)
        cpu = cpu_spent(before, cpu_by_process(ROLES, me="client"))
        row = summarize(name, results, wall, sum(cpu.values()))
        print(f"{name}: {row['tok_per_s']:.0f} tok/s", flush=True)
        return row, cpu

    one_by_one(served, prompt_ids[:2], 8)  # warm-up
    rows = [measured("one-by-one", one_by_one, served, prompt_ids, args.max_tokens)[0]]
    clients = [int(c) for c in args.clients.split(",")]
    for n in clients:
        rows.append(measured(f"engine alone, {n} at a time", engine_alone, served, prompt_ids, args.max_tokens, n)[0])
    del served
    loads["before serve"] = os.getloadavg()[0]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = ServeOptions(weights=str(Path(weights).resolve()), tokenizer=tokenizer, port=port, threads=args.threads,
                        max_batch=args.max_batch, max_tokens_cap=max(args.max_tokens, 16), cpus_per_replica=1,
                        model_name="bench", **({} if args.stream_interval_ms is None else
                                               {"stream_interval_ms": args.stream_interval_ms})).validate()
    for attempt in range(3):  # on a loaded machine Ray's raylet can miss its fixed 30 s start-up window
        try:
            serve_verb.connect(opts)
            break
        except Exception as e:  # noqa: BLE001
            print(f"ray.init failed ({e}); retrying", flush=True)
            ray.shutdown()
    url = serve_verb.deploy(opts, quiet=True)
    cpu_rows = []
    try:
        asyncio.run(serve_clients(url, "bench", messages_list[:4], 2, 8))  # warm-up
        for n in clients:
            row, cpu = measured(f"serve, {n} client{'s' if n > 1 else ''}",
                                lambda k: asyncio.run(serve_clients(url, "bench", messages_list, k, args.max_tokens)),
                                n)
            rows.append(row)
            cpu_rows.append((row["mode"], row["tokens"], row["wall_s"], cpu))
    finally:
        serve.shutdown()
        ray.shutdown()
    loads["after serve"] = os.getloadavg()[0]
    # the same one-by-one run again: on a shared machine the load drifts, so the ratio uses both
    served = load_served_model(weights, tokenizer=tokenizer)
    rows.append(measured("one-by-one, again", one_by_one, served, prompt_ids, args.max_tokens)[0])

    loads["end"] = os.getloadavg()[0]
    base = (rows[0]["tok_per_s"] + rows[-1]["tok_per_s"]) / 2
    print("\nload average (1 min): " + ", ".join(f"{k} {v:.1f}" for k, v in loads.items())
          + (f"; serve env: {' '.join(args.serve_env)}" if args.serve_env else ""))
    print()
    table(("mode", "tokens/s", "vs one-by-one (mean of both)", "TTFT p50 ms", "TTFT p99 ms", "inter-token p50 ms",
           "CPU s per 1000 tokens", "tokens per CPU s"),
          [(r["mode"], f"{r['tok_per_s']:.0f}", f"{r['tok_per_s'] / base:.2f}x", f"{r['ttft_p50_ms']:.1f}",
            f"{r['ttft_p99_ms']:.1f}", f"{r['itl_p50_ms']:.2f}", f"{r['cpu_s_per_1k']:.2f}",
            f"{1000 / r['cpu_s_per_1k']:.0f}") for r in rows])
    roles = ["replica", "proxy", "client", "controller", "other ray"]
    print(f"\nCPU seconds per 1000 generated tokens, by process (wall seconds x {os.cpu_count()} cores = available):")
    per = [(mode, {k: 1000 * v / tokens for k, v in cpu.items()}, 1000 * wall * (os.cpu_count() or 1) / tokens)
           for mode, tokens, wall, cpu in cpu_rows]
    table(("mode", *roles, "total", "available"), [
        (mode, *(f"{p.get(r, 0.0):.2f}" for r in roles), f"{sum(p.values()):.2f}", f"{avail:.2f}")
        for mode, p, avail in per])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
