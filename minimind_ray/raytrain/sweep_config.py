"""A sweep's YAML (``minimind-ray sweep --config``): a base recipe, a search space over its fields, the metric,
the scheduler. Read and checked here, before Ray starts; raytrain/sweep.py runs it (docs/sweeps.md)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from minimind_ray.config_checks import (ConfigError, check_bounds, config_field as _f, conform, need,
                                        omegaconf_message, read_yaml)
from minimind_ray.evals.config import task_name

SPACE_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
# Fields a trial may not change: what names and stores the trial (the sweep decides), what is tracked where, and
# what shapes the prepared data (it is prepared once, before the trials: Ray Data inside a trial would run in the
# trial's placement group)
FIXED_PREFIXES = ("name", "resume", "tracking", "checkpoint.storage_path", "cluster.address", "data.train_path",
                  "data.format", "data.tokenizer", "data.max_seq_len", "data.pack", "data.cache_dir", "data.block_rows",
                  "data.chunk_bytes", "data.bad_records", "data.max_record_chars", "model.generation")
HELD_OUT_METRICS = {"eval_loss": "eval_loss", "eval/loss": "eval_loss"}  # the workers report it as eval_loss


@dataclass
class SchedulerConfig:
    """Which trials go on (Ray Tune's schedulers; the time unit is the optimizer step)."""

    kind: str = _f("asha", "asha: stop weak trials early (Tune's ASHAScheduler over the metric at each eval step) | "
                           "fifo: every trial runs to its end")
    grace_period: int = _f(10, "asha: optimizer steps a trial trains before it can be stopped", ge=1)
    max_steps: Optional[int] = _f(None, "asha: the longest trial, in optimizer steps (its max_t); None = the base "
                                        "recipe's train.max_steps", ge=1)
    reduction_factor: float = _f(2.0, "asha: at each rung the best 1/reduction_factor of the trials go on", gt=1)


@dataclass
class SweepConfig:
    """One sweep: trials of a base recipe, each an ordinary run named <name>-<trial id> (resume: auto)."""

    name: str = _f("", "the sweep's name: its trials are the runs <name>-<trial id>, its parent MLflow run is <name>, "
                       "Tune's state is <checkpoint.storage_path>/<name>; running it again resumes it")
    recipe: str = _f("", "the base recipe (a training YAML) every trial starts from")
    overrides: List[str] = _f([], "dotted overrides of the base recipe, for every trial (e.g. train.max_steps=200)")
    space: Dict[str, Any] = _f({}, "config field -> {choice: [..]} | {grid: [..]} | {uniform: [lo, hi]} | "
                                   "{loguniform: [lo, hi]} | {randint: [lo, hi]} (hi excluded)")
    num_samples: int = _f(1, "trials drawn from the space; with grid entries, num_samples per grid point", ge=1)
    metric: str = _f("eval_loss", "what is compared: eval_loss (the held-out split, reported each "
                                  "train.eval_interval) or eval/<task>/<metric> of eval.tasks (scheduler fifo: "
                                  "that score is known only after the trial)")
    mode: str = _f("min", "min | max: which end of the metric is best")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_concurrent_trials: Optional[int] = _f(None, "trials at once; None = as many as the cluster holds, computed from "
                                                    "a trial's workers, its side tasks and trial_cpus", ge=1)
    trial_cpus: float = _f(0.25, "CPUs reserved for each trial's own process (the driver of its TorchTrainer)", gt=0)
    max_failures: int = _f(2, "a failed trial is started again this often; it resumes from its checkpoint", ge=0)
    seed: Optional[int] = _f(0, "seed of the draws from the space (None: another draw each time)")


RECIPE_SECTIONS = ("model", "data", "train", "checkpoint", "tracking", "cluster", "eval")


def load_sweep(path: str, overrides: Optional[List[str]] = None) -> SweepConfig:
    """The sweep YAML plus dotted overrides: of its own fields (``num_samples=8``), or of the base recipe for every
    trial (``checkpoint.storage_path=/mnt/runs``: a key in a recipe section, appended to ``overrides``)."""
    schema = OmegaConf.structured(SweepConfig)
    own = [o for o in overrides or [] if o.split("=", 1)[0].split(".")[0] not in RECIPE_SECTIONS]
    recipe = [o for o in overrides or [] if o not in own]
    try:
        merged = OmegaConf.merge(schema, read_yaml(path, schema), conform(schema, OmegaConf.from_dotlist(own)))
        sweep: SweepConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's errors on the overrides
        raise ConfigError(f"{path}: {omegaconf_message(e)}") from None
    sweep.overrides = [*sweep.overrides, *recipe]
    check_bounds(sweep)
    check_bounds(sweep.scheduler, "scheduler.")
    need(bool(sweep.name) and all(c.isalnum() or c in "-_." for c in sweep.name), "name",
         f"{path}: a sweep needs a name of letters, digits and - _ . (got {sweep.name!r})")
    need(bool(sweep.recipe), "recipe", f"{path}: no base recipe given")
    need(sweep.mode in ("min", "max"), "mode", "must be min or max")
    need(sweep.scheduler.kind in ("asha", "fifo"), "scheduler.kind", "must be asha or fifo")
    need(bool(sweep.space), "space", f"{path}: an empty search space")
    for key, spec in sweep.space.items():
        check_dimension(key, spec)
    return sweep


def check_dimension(key: str, spec: Any) -> None:
    where = f"space.{key}"
    need(isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in SPACE_KINDS, where,
         f"must be one of {{{'|'.join(SPACE_KINDS)}: ...}}, got {spec!r}")
    kind, values = next(iter(spec.items()))
    need(isinstance(values, list) and bool(values), where, f"{kind} takes a list, got {values!r}")
    need(not any(key == p or key.startswith(p + ".") for p in FIXED_PREFIXES), where,
         "a trial may not change this field (its name, storage, tracking or what the prepared data is made of: "
         "the data is prepared once, before the trials)")
    if kind in ("uniform", "loguniform", "randint"):
        need(len(values) == 2 and all(isinstance(v, (int, float)) for v in values) and values[0] < values[1], where,
             f"{kind} takes [low, high] with low < high, got {values}")
    if kind == "loguniform":
        need(values[0] > 0, where, "loguniform needs low > 0")


def reported_metric(sweep: SweepConfig) -> Optional[str]:
    """The metric's key in the workers' reports (what ASHA sees), or None when it is a validation score."""
    return HELD_OUT_METRICS.get(sweep.metric)


def check_against_recipe(sweep: SweepConfig, base) -> None:
    """What the sweep asks of its base recipe (a loaded RunConfig): every space key a field, the metric produced."""
    from minimind_ray.config import field_help  # lazy: pyarrow, only when this runs

    fields = {name for name, _, _ in field_help()}
    for key in sweep.space:
        need(key in fields, f"space.{key}", "not a config field (see minimind-ray pretrain --help)")
    metric = reported_metric(sweep)
    if metric:
        need(base.data.eval_fraction > 0, "metric", f"{sweep.metric} needs a held-out split: set "
                                                    "data.eval_fraction > 0 in the base recipe or its overrides")
        if sweep.scheduler.kind == "asha":
            need(base.train.eval_interval > 0, "metric", "ASHA compares trials at each evaluation: set "
                                                         "train.eval_interval > 0 (in optimizer steps)")
    else:
        names = {task_name(t) for t in base.eval.tasks}
        parts = sweep.metric.split("/")
        need(len(parts) == 3 and parts[0] == "eval" and parts[1] in names, "metric",
             f"{sweep.metric!r} is neither eval_loss nor eval/<task>/<metric> of the recipe's eval.tasks ({sorted(names)})")
        need(sweep.scheduler.kind == "fifo", "scheduler.kind",
             f"asha cannot stop on {sweep.metric}: eval.tasks score a checkpoint after the workers reported it, so "
             "Tune sees the score only when the trial ends; use scheduler.kind=fifo or metric=eval_loss")
    if sweep.scheduler.kind == "asha":
        need(sweep.scheduler.max_steps is not None or base.train.max_steps is not None, "scheduler.max_steps",
             "the base recipe trains by epochs: give scheduler.max_steps (ASHA's longest trial, in optimizer steps)")


def trial_overrides(params: Dict[str, Any]) -> List[str]:
    """A trial's sampled values as dotted overrides (lists and strings in JSON, which OmegaConf reads back)."""
    out = []
    for k, v in sorted(params.items()):
        if isinstance(v, float) and math.isfinite(v):
            out.append(f"{k}={v!r}")
        elif isinstance(v, (bool, int, float)) or v is None:
            out.append(f"{k}={json.dumps(v)}")
        else:
            out.append(f"{k}={json.dumps(v)}" if not isinstance(v, str) else f"{k}={v}")
    return out
