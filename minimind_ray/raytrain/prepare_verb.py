"""``minimind-ray prepare``: tokenize a recipe's jsonl shards once into Parquet and a manifest with Ray Data
(data/prepare.py), on the Ray a run would use; a training run then reuses the cache.

    minimind-ray prepare --config pipelines/configs/tiny.yaml [--out DIR] [data.train_path=...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minimind_ray.raytrain.train_verb import add_config_arguments, load_run_config

HELP = "tokenize jsonl shards once into Parquet + manifest (Ray Data)"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    add_config_arguments(sp)
    sp.add_argument("--out", help="output cache directory (default data.cache_dir)")


def run(args) -> int:
    from minimind_ray.data.manifest import skipped_records  # lazy: pyarrow, only when this runs
    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, pyarrow, only when this runs
    from minimind_ray.raytrain.session import connect_ray  # lazy: pyarrow, Ray, only when this runs
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs

    cfg = load_run_config(args)
    if args.out:
        cfg.data.cache_dir = args.out
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)  # before Ray: fails fast
    connect_ray(cfg, dashboard=False)  # Ray Data alone: no Ray Train cleaner polls the state API
    out = ensure_prepared(cfg.data, tok)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    print(f"prepared: {out}")
    print(f"skipped {skipped_records(out)}")
    print(json.dumps({k: manifest.get(k) for k in ("format", "counts", "skipped")}, indent=1, ensure_ascii=False))
    return 0
