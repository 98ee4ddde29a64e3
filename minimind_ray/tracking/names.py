"""Metric names in MLflow: grouped by a prefix, one chart section each; in this order of interest (the run's chart
view, tracking/ui.py, shows them so; MLflow 3.17's run page sorts them by name, docs/tracking.md):

    train/  loss, loss_interval, lr, grad_norm, aux_loss, epoch, and a stage's own sums (DPO margins, distillation ce/kl)
    eval/   loss, ppl, bpb (the held-out split) and eval/<task>/<metric> (benchmark tasks, minimind_ray/evals)
    rl/     an RL stage's reward and its terms, kl, clip_fraction, completion_len, rollout_s, ...
    perf/   tokens_per_s, mfu, step_time_s, data_wait_s, allreduce_s, comm_fraction
    sys/    peak_mem_gb, world_size (MLflow's own sampler writes system/*)

Runs logged before 2026-12-01 used the bare names (``loss``, ``tokens_per_s``, ...); :func:`history` reads both.
"""
from __future__ import annotations

from typing import List, Tuple

PERF = {"tokens_per_s", "tokens_per_s_per_worker", "mfu", "step_time_s", "data_wait_s", "allreduce_s", "comm_fraction"}
SYS = {"peak_mem_gb", "world_size", "total_steps"}
TRAIN = {"loss", "loss_interval", "aux_loss", "lr", "grad_norm", "epoch"}
HELD_OUT = {"eval_loss": "eval/loss", "eval_ppl": "eval/ppl", "eval_bpb": "eval/bpb"}


def metric_name(key: str, group: str = "train") -> str:
    """The MLflow name of one of the loop's metrics (a name that has a prefix already is kept); ``group`` is where a
    stage's own metrics go: its record's metric_group, train or rl (stages/stage.py)."""
    if "/" in key:
        return key
    if key in HELD_OUT:
        return HELD_OUT[key]
    for prefix, names in (("perf", PERF), ("sys", SYS), ("train", TRAIN)):
        if key in names:
            return f"{prefix}/{key}"
    return f"{group}/{key}"


def legacy_name(name: str) -> str:
    """The bare name a run logged before the prefixes (``train/loss`` -> ``loss``, ``eval/loss`` -> ``eval_loss``)."""
    old = {v: k for k, v in HELD_OUT.items()}
    return old.get(name, name.split("/", 1)[1] if name.count("/") == 1 else name)


def history(client, run_id: str, name: str) -> List[Tuple[int, float]]:
    """(step, value) of a metric, by its grouped name or, for an older run, its bare one."""
    points = client.get_metric_history(run_id, name) or client.get_metric_history(run_id, legacy_name(name))
    return sorted((m.step, m.value) for m in points)
