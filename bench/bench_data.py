"""Data-path benchmark (not a test): is the data path ever the bottleneck?

(a) prepare: tokens/s of the whole Ray Data prepare job (read jsonl, check, tokenize, pack, write Parquet,
    manifest) against HF tokenizers' ``encode_batch`` on the same texts in memory. Goal: ratio >= 0.8.
(b) stream: tokens/s one worker's TrainStream delivers from the prepared shards against the tokens/s a training
    step of the 26M model (minimind2-small, seq 512) consumes on this CPU. Goal: ratio >= 20.

Both sides of (a) use every core (the tokenizer's own thread pool; the Ray Data job). From the repository root:

    .venv/bin/python bench/bench_data.py                                   # ~1.5 min on 2 cores
    .venv/bin/python bench/bench_data.py --docs 200000 --files 8 --cli     # 9M tokens in 8 files

The default corpus (800k documents, 36M tokens) makes the fixed cost of a Ray Data job (printed separately) a small
share, as on MiniMind's GB-sized sets; with ``--docs 200000`` (9M tokens, 4 s of tokenizing) it shows in (a).
``--files N`` splits the corpus into N jsonl files of equal size (many small shards) and prepares their directory.
``--cli`` also times the whole ``minimind-ray prepare`` in a fresh process (Python's and Ray's start, hashing the
sources, the job, Ray's shutdown) against ``encode_batch``: the cost a user sees.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from common import REPO, fresh_model, local_ray, table

from minimind_ray.config import DataConfig
from minimind_ray.data.demo import write_demo_corpus
from minimind_ray.data.prepare import prepare
from minimind_ray.data.stream import PreparedDataset, TrainStream
from minimind_ray.tokenizer import resolve_tokenizer


def split_corpus(corpus: str, out_dir: str, n_files: int) -> str:
    """The corpus as ``n_files`` jsonl files of consecutive lines, as many in each (the demo corpus's documents are
    mixed: the files' sizes differ by under 1%), in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(corpus, "rb") as f:
        lines = f.readlines()
    for part in range(n_files):
        with open(os.path.join(out_dir, f"part-{part:03d}.jsonl"), "wb") as out:
            out.writelines(lines[part * len(lines) // n_files:(part + 1) * len(lines) // n_files])
    return out_dir


def direct_encode(tok, source: str):
    """(seconds, tokens) of HF's own encode_batch (its thread pool) on every text of ``source``, in memory."""
    files = sorted(os.path.join(source, f) for f in os.listdir(source)) if os.path.isdir(source) else [source]
    texts = [json.loads(line)["text"] for path in files for line in open(path, encoding="utf-8")]
    t = time.perf_counter()
    encoded = tok._hf.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - t, sum(len(e.ids) for e in encoded)


def time_cli(source: str, tok_dir: str, out: str, chunk_bytes: int) -> float:
    """Wall seconds of the whole ``minimind-ray prepare`` command in a fresh process, as a user runs it."""
    cmd = [sys.executable, "-m", "minimind_ray.cli", "prepare", "--out", out, f"data.train_path=[{source}]",
           f"data.tokenizer={tok_dir}", "data.format=pretrain", "data.max_seq_len=512", f"data.chunk_bytes={chunk_bytes}"]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t


def bench_prepare(tok, source: str, work: str, chunk_bytes: int, repeat: int) -> dict:
    """(a): the same texts through encode_batch directly, then through prepare(), ``repeat``
    times in alternation (on a shared machine the load drifts; each pair sees about the same)."""
    cfg = DataConfig(format="pretrain", max_seq_len=512, chunk_bytes=chunk_bytes)
    warm = write_demo_corpus(os.path.join(work, "warm"), n_pretrain=2000, n_sft=10, n_dpo=10)["pretrain"]
    prepare([warm], os.path.join(work, "warm-prepared"), tok, cfg)  # start Ray Data's workers first
    t = time.perf_counter()
    prepare([warm], os.path.join(work, "warm-prepared-2"), tok, cfg)  # a job with almost no work: its fixed cost
    small_s = time.perf_counter() - t
    pairs = []
    for i in range(repeat):
        direct_s, n_tokens = direct_encode(tok, source)
        t = time.perf_counter()
        out = prepare([source], os.path.join(work, f"prepared-{i}"), tok, cfg)
        pairs.append((direct_s, time.perf_counter() - t))
    direct_s, prepare_s = statistics.median(d for d, _ in pairs), statistics.median(p for _, p in pairs)
    return {"tokens": n_tokens, "direct_tps": n_tokens / direct_s, "prepare_tps": n_tokens / prepare_s,
            "direct_s": direct_s, "prepare_s": prepare_s, "small_job_s": small_s, "prepared": out, "pairs": pairs}


def bench_stream(prepared: str, world: int, repeats: int = 3) -> float:
    """(b): input tokens/s rank 0 of ``world`` gets from next_step() over one whole epoch,
    from a cold start: every row group is opened and decoded once, as on real data larger
    than the reader's cache. No prefetch thread: this is the cost of producing the batches.
    Best of ``repeats`` fresh streams (the machine is shared)."""
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        st = TrainStream(PreparedDataset(prepared), global_batch_size=64, micro_batch_size=16, world_size=world,
                         rank=0, seed=0, prefetch_steps=0)
        tokens = sum(b["input_ids"].numel() for _ in range(st.steps_per_epoch) for b in st.next_step())
        best = max(best, tokens / (time.perf_counter() - t))
        st.close()
    return best


def bench_model(micro: int, seq: int, steps: int) -> float:
    """Input tokens/s of forward+backward of minimind2-small (26M) on this CPU."""
    model = fresh_model("minimind2-small")
    x = torch.randint(3, 6400, (micro, seq + 1))
    times = []
    for i in range(steps + 1):  # the first step warms up allocators and kernels
        t = time.perf_counter()
        logits = model(x[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t)
    return micro * seq / (sum(times) / len(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=800_000,
                    help="pretrain documents in the benchmark corpus (800k: 36M tokens, 150 MB)")
    ap.add_argument("--files", type=int, default=1, help="split the corpus into this many jsonl files of equal size")
    ap.add_argument("--chunk-mb", type=float, default=0,
                    help="data.chunk_bytes in MiB (0: the corpus size / (4 x CPUs), at least 1 MiB)")
    ap.add_argument("--cli", action="store_true", help="also time the whole `minimind-ray prepare` command")
    ap.add_argument("--prepare-only", action="store_true", help="measure (a) only: skip the stream and model parts")
    ap.add_argument("--repeat", type=int, default=1, help="(a): alternate encode_batch and prepare this many times; "
                                                          "the table shows medians, each pair is printed")
    ap.add_argument("--tokenizer", default="minimind2",
                    help="data.tokenizer: minimind2 | minimind3 (fetched by name; offline: "
                         "MINIMIND_RAY_TOKENIZER_MIRROR), builtin or a directory")
    ap.add_argument("--model-steps", type=int, default=3, help="timed forward/backward steps of the 26M model")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch of the model step")
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
        tok = resolve_tokenizer(args.tokenizer, os.path.join(work, "cache"))
        corpus = write_demo_corpus(os.path.join(work, "corpus"), n_pretrain=args.docs, n_sft=10, n_dpo=10)["pretrain"]
        source = corpus if args.files == 1 else split_corpus(corpus, os.path.join(work, "split"), args.files)
        size = sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source)) \
            if os.path.isdir(source) else os.path.getsize(source)
        chunk_bytes = int(args.chunk_mb * (1 << 20)) or max(1 << 20, size // (4 * cpus))
        cli_s = None
        if args.cli:  # before this process starts its own Ray
            tok_dir = os.path.join(work, "tok")
            tok.save(tok_dir)
            cli_s = time_cli(source, tok_dir, os.path.join(work, "cli-cache"), chunk_bytes)
        ray = local_ray(cpus, log_to_driver=False)
        a = bench_prepare(tok, source, work, chunk_bytes, args.repeat)
        if not args.prepare_only:
            stream1 = bench_stream(a["prepared"], world=1)
            stream2 = bench_stream(a["prepared"], world=2)
        ray.shutdown()
    if not args.prepare_only:
        model_tps = bench_model(args.micro, args.seq, args.model_steps)

    print(f"\nhost: {cpus} CPUs, load average {os.getloadavg()[0]:.1f}; tokenizer {tok.path} (vocab {tok.vocab_size}); "
          f"corpus {args.docs} docs, {a['tokens']:,} tokens, {size / 2**20:.1f} MiB in {args.files} file(s), "
          f"chunk_bytes {chunk_bytes / 2**20:.1f} MiB")
    rows = [(f"(a) prepare job on {cpus} CPUs", f"{a['prepare_tps']:,.0f}", "HF encode_batch on the same texts",
             f"{a['direct_tps']:,.0f}", f"{a['prepare_tps'] / a['direct_tps']:.2f}", ">= 0.8")]
    if not args.prepare_only:
        step = f"minimind2-small fwd+bwd, seq {args.seq}, micro {args.micro}"
        rows += [(f"(b) TrainStream, world {w} (rank 0)", f"{tps:,.0f}", step if w == 1 else "same",
                  f"{model_tps:,.0f}", f"{tps / model_tps:,.0f}x", ">= 20x") for w, tps in ((1, stream1), (2, stream2))]
    table(("measure", "tokens/s", "baseline", "baseline tokens/s", "ratio", "goal"), rows)
    if args.repeat > 1:
        print("pairs (encode_batch s, prepare s -> ratio): " + ", ".join(
            f"({d:.1f}, {p:.1f} -> {d / p:.2f})" for d, p in a["pairs"]))
    print(f"\nprepare: {a['prepare_s']:.1f} s for the corpus (encode_batch alone: {a['direct_s']:.1f} s); "
          f"a warm job of 2,000 documents: {a['small_job_s']:.2f} s (the fixed cost of a job)")
    if cli_s is not None:
        print(f"whole command `minimind-ray prepare` (fresh process, Ray start and stop): {cli_s:.1f} s, "
              f"{a['direct_s'] / cli_s:.2f} of encode_batch's speed ({a['direct_s']:.1f} s)")


if __name__ == "__main__":
    main()
