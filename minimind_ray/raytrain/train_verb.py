"""The training verbs, one per stage of the registry (``minimind-ray pretrain``, ``sft``, ...): a YAML recipe and
dotted overrides in, resolved once into the run (:func:`minimind_ray.config.resolve_run`, the verb's stage given as a
value), one run of :func:`minimind_ray.raytrain.driver.run`, and the summary of where its results are.

    minimind-ray pretrain --config pipelines/configs/tiny.yaml cluster.num_workers=2 train.max_steps=50

Like every verb it is ``add_arguments(parser)`` and ``run(args) -> exit code``; cli.py gives each stage's verb the
stage's help line.
"""
from __future__ import annotations

import argparse
from typing import List, Optional


def fields_epilog(stage: Optional[str] = None) -> str:
    """The config fields with their defaults and help lines: the end of each training verb's ``--help``. Those of
    ``stage``: the shared ones and the sections its record reads, not the other stages' (``None``: every field)."""
    from minimind_ray.config import field_help  # lazy: pyarrow, only when this runs
    from minimind_ray.stages import other_sections  # lazy: with config, only when this runs

    hidden = tuple(f"train.{name}." for name in (other_sections(stage) if stage else ()))
    rows = [f"  {name}={default!r}\n      {help}" for name, default, help in field_help() if not name.startswith(hidden)]
    return "config fields (override as key=value):\n" + "\n".join(rows)


def add_config_arguments(sp: argparse.ArgumentParser) -> None:
    """A recipe and its dotted overrides: the training verbs' and ``prepare``'s (read by :func:`resolve_command`,
    :func:`load_run_config`)."""
    sp.add_argument("--config", help="YAML recipe (pipelines/configs/*.yaml)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")


def add_arguments(sp: argparse.ArgumentParser, stage: Optional[str] = None) -> None:
    """``stage``: the verb's stage (cli.py gives each stage's verb its name), whose fields its --help lists."""
    sp.epilog = fields_epilog(stage)  # the config fields, laid out as written
    sp.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_arguments(sp)
    sp.add_argument("--fresh", action="store_true",
                    help="start a new run even if this command's run exists (resume=never: a new run name; "
                         "nothing is deleted). Without it the same command resumes a stopped run, trains a "
                         "finished one further when train.max_steps grew, and is a no-op otherwise")


def command_overrides(args) -> List[str]:
    """The command line's dotted overrides, with ``--fresh`` as resume=never."""
    return [*args.overrides, *(["resume=never"] if getattr(args, "fresh", False) else [])]


def load_run_config(args, stage: Optional[str] = None):
    """The config of ``--config`` and the overrides, validated (``prepare``'s); ``stage`` (a training verb's name) sets
    train.stage and ``--fresh`` resume=never, both before the user's overrides are checked."""
    from minimind_ray.config import load_config  # lazy: pyarrow, only when this runs

    return load_config(args.config, command_overrides(args), stage=stage)


def resolve_command(args):
    """A training verb's run, resolved once (config.py:resolve_run): the recipe, the verb's stage as a value (never a
    ``train.stage=`` string), the overrides and ``--fresh``."""
    from minimind_ray.config import resolve_run  # lazy: pyarrow, only when this runs

    return resolve_run(args.config, command_overrides(args), stage=args.verb)


def run(args) -> int:
    from minimind_ray.raytrain.driver import run as run_training  # lazy: pyarrow, torch, Ray, only when this runs
    from minimind_ray.raytrain.resume import RunFinished  # lazy: pyarrow, only when this runs

    spec = resolve_command(args)
    try:
        res = run_training(spec)
    except RunFinished as done:  # the same command again: a no-op that says where the results are
        print(done.line(), flush=True)
        return 0
    print_run_summary(res)
    return 0


def print_run_summary(res) -> None:
    """Where a finished run's results are (a driver.RunResult): its directory, last checkpoint, exports, the latest
    link the next stage chains from, and its MLflow run with the URL of its page and charts."""
    from minimind_ray.fsio import redact  # lazy: pyarrow, only when this runs

    lines = ["\n==== results ====", f"run name:        {res.name}", f"run directory:   {res.run_dir}",
             f"last checkpoint: {res.checkpoint_dir}", *(f"export ({k}): {v}" for k, v in res.exports.items())]
    if getattr(res, "latest", None):  # the next stage starts from it: train.init_from=runs/pretrain-latest
        lines.append(f"latest link:     {res.latest}  (train.init_from={res.latest} chains the next stage)")
    if res.mlflow_run_id:
        lines.append(f"MLflow run id:   {res.mlflow_run_id}  (tracking URI {res.tracking_uri})")
        if res.tracking_uri and res.tracking_uri.startswith("sqlite:///"):
            lines.append(f"MLflow UI:       make ui   (or: mlflow ui --backend-store-uri {res.tracking_uri} --host 127.0.0.1)")
        from minimind_ray.tracking.runs import run_page_url  # lazy: pyarrow, only when this runs
        from minimind_ray.tracking.ui import run_charts_url  # lazy: pyarrow, only when this runs

        page = run_page_url(res.tracking_uri, res.mlflow_run_id)
        if page:  # the 'Model training' view: MLflow 3's UI opens in its GenAI view unless told
            lines.append(f"MLflow run page: {page}")
        charts = run_charts_url(res.tracking_uri, res.mlflow_run_id)
        if charts:  # the run's charts with the loss first (MLflow's own tab orders its sections by name)
            lines.append(f"MLflow charts:   {charts}")
    print("\n".join(redact(line) for line in lines))  # a URI's credentials are never printed
