"""One benchmark task on one model: what the ``eval`` verb, validation during training, the pipeline and the
benchmarks call (docs/evaluation.md). The task's kind is a class of the registry (evals/registry.py); this module
runs it on a :class:`Target` and reports the summary.

A kind that scores questions (all but ``loss``) goes through :meth:`Target.score_items`:

    items  = kind.load_items(tokenizer)                  (prompts as lm-eval builds them; bad rows counted)
    batches of batch_size items, a subject at a time, longest first (fixed for a task: the same whatever the workers)
    each batch -> kind.score(model, batch, index)        here, or on Ray tasks (parallel.score_on_ray)
    summary = kind.summarise(items, results)             (mc: acc, acc_norm, stderr; gen: greedy_acc, pass@k; ...)
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Dict, List, Optional

import torch

from minimind_ray.data.demo import resolve_demo_path
from minimind_ray.engine.step import autocast_for
from minimind_ray.evals.config import EvalTaskConfig, task_name, validate_task
from minimind_ray.evals.parallel import score_on_ray
from minimind_ray.evals.registry import EvalTask, task_for
from minimind_ray.generate import tokenizer_for_weights
from minimind_ray.store.weights import build_inference_model, load_weights
from minimind_ray.evals.kinds import aggregate_mc, pass_at_k  # noqa: F401  (their address before the registry)
from minimind_ray.evals.toolcall import aggregate_toolcall, judge_tool_call  # noqa: F401  (likewise)


def resolve_data(task: EvalTaskConfig, cache_dir: str = "data_cache") -> EvalTaskConfig:
    """The task with ``demo:<name>`` paths made real files of the built-in corpus."""
    import dataclasses
    import os

    def real(p):
        return resolve_demo_path(p, "", os.path.abspath(cache_dir)) if p and p.startswith("demo:") else p

    return dataclasses.replace(task, data=real(task.data), fewshot_data=real(task.fewshot_data))


def make_batches(lengths: List[int], batch_size: int, subjects: Optional[List[str]] = None) -> List[List[int]]:
    """Item indices in batches, a subject at a time (its few-shot prompts share their prefix: scoring.choice_logprobs
    computes it once per batch), longest contexts first (less padding, and the slowest batches start first)."""
    subject = (lambda i: subjects[i]) if subjects else (lambda i: "")
    order = sorted(range(len(lengths)), key=lambda i: (subject(i), -lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class Target:
    """What a task is evaluated on: the weights (loaded on first use, unless given), their tokenizer, the device,
    and how a kind's questions are scored (:meth:`score_items`: here, or over ``workers`` Ray tasks)."""

    def __init__(self, weights: str, *, preset: Optional[str] = None, tokenizer: Optional[str] = None,
                 device: str = "cpu", workers: int = 0, rope_scaling: Optional[dict] = None, model=None, tok=None,
                 loaded=None, log_samples: bool = False):
        self.weights, self.preset, self.tokenizer_spec, self.device = weights, preset, tokenizer, device
        self.workers, self.rope_scaling, self.log_samples = workers, rope_scaling, log_samples
        self.loading_s = 0.0  # time spent loading weights and tokenizer: not the task's own
        self._model, self._tok, self._loaded = model, tok, loaded

    @property
    def model(self):
        if self._model is None:
            t0 = time.perf_counter()
            self._model, self._loaded = build_inference_model(self.weights, self.preset, device=self.device,
                                                              rope_scaling=self.rope_scaling)
            self.loading_s += time.perf_counter() - t0
        return self._model

    @property
    def loaded(self):
        """The weights' store.weights.LoadedWeights (what they record: their run, checkpoint, tokenizer)."""
        if self._loaded is None and self._model is None:
            self.model  # noqa: B018 - builds the model, and records what its weights hold
        elif self._loaded is None:  # a model given without its record: read it again

            t0 = time.perf_counter()
            self._loaded = load_weights(self.weights, self.preset)
            self.loading_s += time.perf_counter() - t0
        return self._loaded

    @property
    def tokenizer(self):
        if self._tok is None:
            loaded = self.loaded
            t0 = time.perf_counter()
            self._tok = tokenizer_for_weights(loaded, self.tokenizer_spec)
            self.loading_s += time.perf_counter() - t0
        return self._tok

    def score_items(self, kind: EvalTask) -> dict:
        """The kind's questions scored in batches; the summary with the bad rows met (and, with ``log_samples``,
        one record per question under ``samples``)."""
        model, tok = self.model, self.tokenizer
        items, bad = kind.load_items(tok)
        encoded = kind.encode(items, tok)
        batches = make_batches([kind.length(e) for e in encoded], kind.cfg.batch_size,
                               [getattr(it, "subject", "") for it in items])
        jobs = [[encoded[i] for i in b] for b in batches]
        if self.workers:
            results = score_on_ray(self.weights, self.preset, kind.cfg, jobs, tok.eos_id, tok.pad_id, self.workers,
                                   rope_scaling=self.rope_scaling)
        else:
            autocast = autocast_for("auto", torch.device(self.device))
            results = [kind.score(model, job, i, eos_id=tok.eos_id, pad_id=tok.pad_id, device=self.device,
                                  autocast=autocast) for i, job in enumerate(jobs)]
        per_item: list = [None] * len(items)
        for b, rows in zip(batches, results):
            for i, row in zip(b, rows):
                per_item[i] = row
        summary = kind.summarise(items, per_item, tok)
        summary.update({"bad_records": bad.report(), "bad_samples": dict(bad.samples)})
        summary.update(getattr(bad, "shot_report", dict)())  # subjects skipped or short of shots (tasks.BadRows)
        if self.log_samples:
            summary["samples_log"] = [{"doc_id": i, **r} for i, r in enumerate(kind.samples(items, summary))]
        return summary


def evaluate_task(weights: str, task: EvalTaskConfig, *, preset: Optional[str] = None,
                  tokenizer: Optional[str] = None, device: Optional[str] = None, workers: int = 0,
                  cache_dir: str = "data_cache", model=None, tok=None, rope_scaling: Optional[dict] = None,
                  loaded=None, log_samples: bool = False) -> dict:
    """Score ``weights`` (anything store/weights loads) on ``task``; the result as the ``eval`` verb prints and
    ``--out`` writes it. ``workers`` > 0 shards the batches over that many Ray tasks (one CPU each). ``model``
    and ``tok``: an already loaded model and tokenizer (validation during training passes them, and ``loaded``,
    their store.weights.LoadedWeights); ``rope_scaling``: YaRN at inference, as the inference verbs take it
    (store/weights.py:rope_scaling_spec). ``log_samples``: the result's ``samples_log`` holds one record per
    question (the prompt, each choice's log-likelihood, the pick and the gold; for gen the completions and
    their verdicts), as lm-eval's ``--log_samples``."""
    task = resolve_data(task, cache_dir)
    validate_task(task)
    kind = task_for(task)
    target = Target(weights, preset=preset, tokenizer=tokenizer, workers=workers, rope_scaling=rope_scaling,
                    device=device or ("cuda" if torch.cuda.is_available() else "cpu"), model=model, tok=tok,
                    loaded=loaded, log_samples=log_samples)
    t0 = time.perf_counter()
    summary = kind.evaluate(target)
    seconds = time.perf_counter() - t0 - target.loading_s
    n = summary.get("n")
    return {"task": task_name(task), "kind": task.task, **summary, "seconds": seconds,
            "questions_per_s": n / seconds if n is not None and seconds > 0 else None, "config": asdict(task)}


def result_notes(result: dict) -> Dict[str, str]:
    """What a result says besides its scores, as MLflow tags: ``eval/<name>/skipped_subjects`` (the subjects left
    out for want of dev rows for the shots) and ``eval/<name>/short_shots`` ("law 2 of 5"), each only when there is
    one (the reasons: the result's ``skipped_subjects`` and ``short_shots``)."""
    name, notes = result["task"], {}
    if result.get("skipped_subjects"):
        notes[f"eval/{name}/skipped_subjects"] = ", ".join(result["skipped_subjects"])[:5000]
    if result.get("short_shots"):
        notes[f"eval/{name}/short_shots"] = ", ".join(f"{s} {v['used']} of {v['asked']}"
                                                       for s, v in result["short_shots"].items())[:5000]
    return notes


def metric_items(result: dict) -> Dict[str, float]:
    """The result's headline scores as MLflow metrics: ``eval/<name>/acc`` etc. (its kind's ``metrics``)."""
    name = result["task"]
    kind = task_for(EvalTaskConfig(**result["config"]))
    return {f"eval/{name}/{k}": float(v) for k, v in kind.metrics(result).items() if v is not None}
