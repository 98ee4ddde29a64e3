"""Data-path benchmark (not a test): is the data path ever the bottleneck?

(a) prepare: tokens/s of the whole Ray Data prepare job (read jsonl, check, tokenize,
    pack, write Parquet, manifest) against calling HF tokenizers' ``encode_batch``
    directly on the same texts already in memory. Goal: ratio >= 0.8, i.e. the job
    adds at most 20% over the bare tokenizer.
(b) stream: tokens/s one worker's TrainStream delivers from the prepared shards against
    the tokens/s a training step of the 26M model (preset minimind2-small, seq 512)
    consumes on this CPU (a few forward/backward passes). Goal: ratio >= 20.

Both sides of (a) use every core: the direct call through the tokenizer's own thread
pool, prepare through one Ray task per chunk. Run from the repository root:

    .venv/bin/python bench/bench_data.py            # ~1.5 min on 2 cores

The default corpus (800k documents, 36M tokens) is large enough that the fixed cost of a
Ray Data job (printed separately) is a small share, as it is on MiniMind's GB-sized sets;
with ``--docs 200000`` (9M tokens, about 4 s of tokenizing here) that cost shows in (a).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tokenizer(spec: str, cache: str):
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer

    if spec == "auto":
        shared = REPO.parent / "shared" / "minimind" / "minimind2"
        return load_tokenizer(str(shared)) if (shared / "tokenizer.json").exists() else resolve_tokenizer("builtin", cache)
    return resolve_tokenizer(spec, cache)


def bench_prepare(tok, corpus: str, work: str, cpus: int) -> dict:
    """(a): the same texts through encode_batch directly, then through prepare()."""
    from minimind_ray.config import DataConfig
    from minimind_ray.data.demo import write_demo_corpus
    from minimind_ray.data.prepare import prepare

    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    t = time.perf_counter()
    encoded = tok._hf.encode_batch(texts, add_special_tokens=False)  # HF's own call, its thread pool
    direct_s = time.perf_counter() - t
    n_tokens = sum(len(e.ids) for e in encoded)
    del encoded, texts

    size = os.path.getsize(corpus)
    cfg = DataConfig(format="pretrain", max_seq_len=512, chunk_bytes=max(1 << 20, size // (4 * cpus)))
    warm = write_demo_corpus(os.path.join(work, "warm"), n_pretrain=2000, n_sft=10, n_dpo=10)["pretrain"]
    prepare([warm], os.path.join(work, "warm-prepared"), tok, cfg)  # start Ray Data's workers first
    t = time.perf_counter()
    prepare([warm], os.path.join(work, "warm-prepared-2"), tok, cfg)  # a job with almost no work: its fixed cost
    small_s = time.perf_counter() - t
    t = time.perf_counter()
    out = prepare([corpus], os.path.join(work, "prepared"), tok, cfg)
    prepare_s = time.perf_counter() - t
    return {"tokens": n_tokens, "direct_tps": n_tokens / direct_s, "prepare_tps": n_tokens / prepare_s,
            "direct_s": direct_s, "prepare_s": prepare_s, "small_job_s": small_s, "prepared": out}


def bench_stream(prepared: str, world: int, repeats: int = 3) -> float:
    """(b): input tokens/s rank 0 of ``world`` gets from next_step() over one whole epoch,
    from a cold start: every row group is opened and decoded once, as on real data larger
    than the reader's cache. No prefetch thread: this is the cost of producing the batches.
    Best of ``repeats`` fresh streams (the machine is shared)."""
    import torch  # noqa: F401  (a training worker has it loaded; keep its import out of the timing)

    from minimind_ray.data.stream import PreparedDataset, TrainStream

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
    import torch
    import torch.nn.functional as F

    from minimind_ray.config import ModelConfig
    from minimind_ray.model.minimind import build_model
    from minimind_ray.model.presets import preset_values

    model = build_model(ModelConfig(**preset_values("minimind2-small")), seed=0)
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
    ap.add_argument("--tokenizer", default="minimind2",
                    help="data.tokenizer: minimind2 | minimind3 (fetched by name; offline: "
                         "MINIMIND_RAY_TOKENIZER_MIRROR), builtin or a directory")
    ap.add_argument("--model-steps", type=int, default=3, help="timed forward/backward steps of the 26M model")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch of the model step")
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()

    import ray

    from minimind_ray.data.demo import write_demo_corpus

    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}})
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
        tok = _tokenizer(args.tokenizer, os.path.join(work, "cache"))
        corpus = write_demo_corpus(os.path.join(work, "corpus"), n_pretrain=args.docs, n_sft=10, n_dpo=10)["pretrain"]
        a = bench_prepare(tok, corpus, work, cpus)
        stream1 = bench_stream(a["prepared"], world=1)
        stream2 = bench_stream(a["prepared"], world=2)
    ray.shutdown()
    model_tps = bench_model(args.micro, args.seq, args.model_steps)

    print(f"\nhost: {cpus} CPUs, load average {os.getloadavg()[0]:.1f}; tokenizer {tok.path} (vocab {tok.vocab_size}); "
          f"corpus {args.docs} docs, {a['tokens']:,} tokens")
    print("| measure | tokens/s | baseline | baseline tokens/s | ratio | goal |")
    print("|---|---:|---|---:|---:|---:|")
    print(f"| (a) prepare job, {cpus} Ray tasks | {a['prepare_tps']:,.0f} | HF encode_batch on the same texts | "
          f"{a['direct_tps']:,.0f} | {a['prepare_tps'] / a['direct_tps']:.2f} | >= 0.8 |")
    print(f"| (b) TrainStream, world 1 (rank 0) | {stream1:,.0f} | minimind2-small fwd+bwd, seq {args.seq}, "
          f"micro {args.micro} | {model_tps:,.0f} | {stream1 / model_tps:,.0f}x | >= 20x |")
    print(f"| (b) TrainStream, world 2 (rank 0) | {stream2:,.0f} | same | {model_tps:,.0f} | "
          f"{stream2 / model_tps:,.0f}x | >= 20x |")
    print(f"\nprepare: {a['prepare_s']:.1f} s for the corpus (encode_batch alone: {a['direct_s']:.1f} s); "
          f"a warm job of 2,000 documents: {a['small_job_s']:.2f} s (the fixed cost of a job)")


if __name__ == "__main__":
    main()
