"""``minimind-ray sweep``: the verb of raytrain/sweep.py, a Ray Tune search over a recipe's fields (docs/sweeps.md).
Its own module so that building the CLI's parser imports neither torch nor Ray.

    minimind-ray sweep --config pipelines/configs/sweep_tiny.yaml [num_samples=8] [checkpoint.storage_path=...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from minimind_ray.raytrain.sweep_config import load_sweep

HELP = "Ray Tune search over a recipe's fields, ASHA stopping weak trials; running it again resumes it (docs/sweeps.md)"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", required=True, help="sweep YAML (pipelines/configs/sweep_*.yaml)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides of the sweep's own fields (num_samples=8) or of its base "
                                                 "recipe for every trial (checkpoint.storage_path=/mnt/runs)")


def run(args) -> int:
    from minimind_ray.raytrain.sweep import print_sweep, run_sweep  # lazy: torch, Ray, only when this runs

    sweep = load_sweep(args.config, args.overrides)
    out = run_sweep(sweep, Path(args.config).read_text())
    print_sweep(out, sweep)
    return 0 if out.best else 1
