"""``minimind-ray pipeline``: the verb of pipeline/run.py, steps from data to a served model as one job that a
rerun resumes (docs/pipeline.md). Its own module so that building the CLI's parser imports neither torch nor Ray.

    minimind-ray pipeline --config pipelines/configs/pipeline_demo.yaml [checkpoint.storage_path=...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from minimind_ray.pipeline.config import load_pipeline
from minimind_ray.stages import STAGES

HELP = (f"steps from data to a served model (prepare, training stages: {', '.join(STAGES)}; eval, register, serve) "
        f"as one resumable job (docs/pipeline.md)")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", required=True, help="pipeline YAML (pipelines/configs/pipeline_*.yaml)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides for every training step, e.g. "
                                                 "checkpoint.storage_path=/mnt/runs")


def run(args) -> int:
    from minimind_ray.pipeline.run import print_pipeline, run_pipeline  # lazy: torch, Ray, only when this runs

    pipe = load_pipeline(args.config)
    out = run_pipeline(pipe, list(args.overrides), Path(args.config).read_text())
    print_pipeline(out)
    return 0
