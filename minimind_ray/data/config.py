"""The data room's configuration (``data:``), its record formats, and the one rule of how a global batch splits.
minimind_ray/config.py composes it; the data room's modules read it from here."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Tuple

from minimind_ray.config_checks import ConfigError, config_field as _f, need
from minimind_ray.data.demo import DEMO_FILES
from minimind_ray.data.formats import FORMATS, describe  # the one format list: the registry of data/formats/
from minimind_ray.fsio import is_uri

PROMPT_FORMATS: Tuple[str, ...] = ("rlaif", "prompt")  # single-turn prompts (grpo, ppo)


@dataclass
class DataConfig:
    """Where the data is and how records become token sequences."""

    format: str = _f("pretrain", f"record format: {describe()}; not given: the verb's own (its stage's first format: docs/data.md, 'Sources')")
    train_path: List[str] = _f([], "one or a list of jsonl(.gz)/parquet files, directories, globs or URIs (data.train_path=x.jsonl or '[a.jsonl,b.jsonl]'); or a prepared directory with manifest.json; 'demo' = the built-in corpus (its file of data.format), 'demo:<name>' = one of its files (tool_sft, mc_eval, ...)")
    tokenizer: str = _f("auto", "'auto' = MiniMind's tokenizer of model.generation; 'minimind2' | 'minimind3' (fetched by name, sha256-checked; offline: MINIMIND_RAY_TOKENIZER_MIRROR); 'builtin' = trained on the demo corpus; or a directory with tokenizer.json")
    allow_tokenizer_change: bool = _f(False, "train with a data.tokenizer whose vocabulary differs from the one train.init_from trained with (a vocabulary extension); refused otherwise, its ids would mean other tokens")
    max_seq_len: int = _f(512, "tokens per training sequence", ge=8)
    pack: bool = _f(True, "pretrain: pack documents into full windows (False = MiniMind pad mode)")
    bad_records: str = _f("skip", "bad input policy: 'skip' (count per reason) or 'strict' (fail at the first, naming file:line)")
    cache_dir: str = _f("data_cache", "where raw jsonl is prepared (tokenized once) before training")
    eval_fraction: float = _f(0.0, "fraction of sequences held out for evaluation (chosen by sample id hash)", ge=0, lt=1)
    block_rows: int = _f(1024, "rows per Parquet row group in prepared data (the unit of reading)", ge=1)
    shuffle: bool = _f(True, "reshuffle every epoch with a seed derived from (seed, epoch)")
    shuffle_window_blocks: int = _f(16, "row groups mixed together by the within-window shuffle", ge=1)
    prefetch_steps: int = _f(2, "optimizer steps of batches a worker reads ahead in a background thread", ge=0)
    chunk_bytes: int = _f(32 << 20, "prepare: jsonl byte-range per Ray task", ge=1)
    max_record_chars: int = _f(1_000_000, "prepare: a longer record (its jsonl line; a Parquet row's text fields) is skipped, counted as too_long", ge=1)


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that the global batch is the same at every world size;
    ConfigError when it does not split evenly (the one place this rule is written)."""
    per_step = world_size * micro_batch_size
    if micro_batch_size < 1 or global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {global_batch_size} is not divisible by "
            f"world size {world_size} x train.micro_batch_size {micro_batch_size}")
    return global_batch_size // per_step


def validate_data(d: DataConfig) -> None:
    """The data section's own rules: a known format and policy, training data that exists."""
    need(d.format in FORMATS, "data.format", f"unknown format {d.format!r}; one of {FORMATS}")
    need(d.bad_records in ("skip", "strict"), "data.bad_records", "must be 'skip' or 'strict'")
    need(bool(d.train_path), "data.train_path", "no training data given (use 'demo' for the built-in corpus)")
    for p in d.train_path:
        if p == "demo" or is_uri(p) or any(ch in p for ch in "*?["):
            continue
        if p.startswith("demo:"):
            need(p[len("demo:"):] in DEMO_FILES, "data.train_path",
                 f"{p}: no such demo file; one of {', '.join('demo:' + n for n in DEMO_FILES)}")
            continue
        need(os.path.exists(p), "data.train_path", f"path does not exist: {p}")
