"""One benchmark task on one model: read the files, score in batches (in this process or on Ray workers),
aggregate to accuracies. What the ``eval`` verb, validation during training, the pipeline and the benchmarks
call (docs/evaluation.md).

    items  = tasks.load_items(task, tokenizer)            (prompts as lm-eval builds them; bad rows counted)
    batches of batch_size items, in order of context length (fixed for a task: the same whatever the workers)
    each batch -> scoring.choice_logprobs (mc) / scoring.generate_batch (gen, toolcall)  here, or parallel.score_on_ray
    per question: pred = argmax(sum log p), pred_norm = argmax(sum log p / len(choice)) -> acc, acc_norm, stderr
    per tool-use prompt: the reply's first <tool_call>: the tool named, its arguments valid (and as expected)
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Dict, List, Optional

import torch

from minimind_ray.evals.config import EvalTaskConfig, task_name, validate_task
from minimind_ray.evals.scoring import encode_question, score_batch
from minimind_ray.evals.tasks import GenItem, MCItem, ToolCallItem, load_items


def resolve_data(task: EvalTaskConfig, cache_dir: str = "data_cache") -> EvalTaskConfig:
    """The task with ``demo:<name>`` paths made real files of the built-in corpus."""
    import dataclasses
    import os

    from minimind_ray.data.demo import resolve_demo_path

    def real(p):
        return resolve_demo_path(p, "", os.path.abspath(cache_dir)) if p and p.startswith("demo:") else p

    return dataclasses.replace(task, data=real(task.data), fewshot_data=real(task.fewshot_data))


def encode_items(items: list, tokenizer, kind: str) -> list:
    if kind in ("gen", "toolcall"):
        return [tokenizer.encode(it.context) for it in items]
    return [encode_question(tokenizer, it.context, it.continuations) for it in items]


def make_batches(encoded: list, kind: str, batch_size: int, subjects: Optional[List[str]] = None) -> List[List[int]]:
    """Item indices in batches, a subject at a time (its few-shot prompts share their prefix: scoring.choice_logprobs
    computes it once per batch), longest contexts first (less padding, and the slowest batches start first)."""
    length = (lambda i: len(encoded[i])) if kind in ("gen", "toolcall") else (lambda i: len(encoded[i][0]))
    subject = (lambda i: subjects[i]) if subjects else (lambda i: "")
    order = sorted(range(len(encoded)), key=lambda i: (subject(i), -length(i), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _stderr(values: List[float]) -> Optional[float]:
    """lm-eval's ``mean_stderr``: the sample standard deviation (n - 1) over sqrt(n)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _argmax(xs: List[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # the first of equal maxima, as numpy's argmax


def aggregate_mc(items: List[MCItem], logprobs: List[List[float]]) -> dict:
    per_subject: Dict[str, List[tuple]] = {}
    details = []
    for it, lls in zip(items, logprobs):
        pred = _argmax(lls)
        pred_norm = _argmax([ll / len(c) for ll, c in zip(lls, it.choices)])
        per_subject.setdefault(it.subject, []).append((pred == it.gold, pred_norm == it.gold))
        details.append({"where": it.where, "subject": it.subject, "gold": it.gold, "pred": pred,
                        "pred_norm": pred_norm, "logprobs": lls})
    hits = [h for rows in per_subject.values() for h in rows]
    acc, acc_norm = [float(a) for a, _ in hits], [float(b) for _, b in hits]
    n = len(hits)
    return {"acc": sum(acc) / n if n else None, "acc_norm": sum(acc_norm) / n if n else None,
            "acc_stderr": _stderr(acc), "acc_norm_stderr": _stderr(acc_norm), "n": n,
            "subjects": {s: {"acc": sum(a for a, _ in r) / len(r), "acc_norm": sum(b for _, b in r) / len(r),
                             "n": len(r)} for s, r in sorted(per_subject.items())},
            "details": details}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. (2021): 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def aggregate_gen(items: List[GenItem], greedy: List[str], sampled: List[List[str]], task: EvalTaskConfig) -> dict:
    from minimind_ray.rl.rewards import is_correct

    k = task.k or task.samples
    details, g_hits, p1, pk = [], [], [], []
    for it, g, s in zip(items, greedy, sampled):
        ok = is_correct(g, it.answer)
        c = sum(is_correct(x, it.answer) for x in s)
        g_hits.append(float(ok))
        if task.samples:
            p1.append(c / len(s))
            pk.append(pass_at_k(len(s), c, k))
        details.append({"where": it.where, "subject": it.subject, "answer": it.answer, "greedy": g,
                        "greedy_correct": ok, "samples": s, "samples_correct": c})
    n = len(items)
    out = {"greedy_acc": sum(g_hits) / n if n else None, "greedy_acc_stderr": _stderr(g_hits), "n": n,
           "details": details}
    if task.samples:
        out.update({"pass@1": sum(p1) / n if n else None, "pass@k": sum(pk) / n if n else None, "k": k,
                    "samples": task.samples})
    by_subject: Dict[str, List[int]] = {}
    for i, it in enumerate(items):
        by_subject.setdefault(it.subject, []).append(i)
    out["subjects"] = {s: {"greedy_acc": sum(g_hits[i] for i in rows) / len(rows), "n": len(rows),
                           **({"pass@1": sum(p1[i] for i in rows) / len(rows),
                               "pass@k": sum(pk[i] for i in rows) / len(rows)} if task.samples else {})}
                       for s, rows in sorted(by_subject.items())}
    return out


def _same_value(got, want) -> bool:
    """An argument as expected: numbers equal, texts equal but for case and spacing ("3+4" is "3 + 4")."""
    if isinstance(want, str) and isinstance(got, str):
        return "".join(got.split()).casefold() == "".join(want.split()).casefold()
    if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    return got == want


def judge_tool_call(item: ToolCallItem, reply: str) -> dict:
    """What the reply's first call gets right: ``called``, ``name`` (the expected tool, or no call when none is
    expected), ``valid`` (its arguments suit the tool's schema, rl/tools.py:check_arguments), ``match`` (they equal
    the expected arguments, when given), and ``exact``: all of these."""
    from minimind_ray.rl.tools import check_arguments, parse_tool_calls, tool_schemas

    calls, bad = parse_tool_calls(reply)
    first = calls[0] if calls else None
    if item.tool is None:
        return {"called": bool(calls), "bad_blocks": bad, "name": not calls and not bad, "exact": not calls and not bad}
    name = first is not None and first["name"] == item.tool
    why = check_arguments(tool_schemas(item.tools)[item.tool], first["arguments"]) if name else "wrong or no tool"
    match = (name and isinstance(first["arguments"], dict) and set(first["arguments"]) == set(item.arguments)
             and all(_same_value(first["arguments"][k], v) for k, v in item.arguments.items())
             ) if item.arguments is not None else None
    return {"called": bool(calls), "bad_blocks": bad, "name": name, "valid": why is None, "invalid_reason": why,
            "match": match, "exact": name and why is None and match is not False}


def aggregate_toolcall(items: List[ToolCallItem], greedy: List[str], sampled: List[List[str]], task) -> dict:
    """acc: the greedy reply right in every respect (judge_tool_call's ``exact``); name_acc, args_valid (over the
    prompts that expect a call), args_match (over those with expected arguments), call_rate; pass@1 / pass@k of
    ``exact`` over the samples."""
    judged = [judge_tool_call(it, g) for it, g in zip(items, greedy)]
    k = task.k or task.samples

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    def scores(rows):
        want = [i for i in rows if items[i].tool is not None]
        out = {"acc": mean([float(judged[i]["exact"]) for i in rows]), "n": len(rows),
               "name_acc": mean([float(judged[i]["name"]) for i in rows]),
               "args_valid": mean([float(judged[i]["valid"]) for i in want]),
               "args_match": mean([float(judged[i]["match"]) for i in want if items[i].arguments is not None]),
               "call_rate": mean([float(judged[i]["called"]) for i in rows])}
        if task.samples:
            hits = [sum(judge_tool_call(items[i], x)["exact"] for x in sampled[i]) for i in rows]
            out.update({"pass@1": mean([c / task.samples for c in hits]),
                        "pass@k": mean([pass_at_k(task.samples, c, k) for c in hits])})
        return out

    by_subject: Dict[str, List[int]] = {}
    for i, it in enumerate(items):
        by_subject.setdefault(it.subject, []).append(i)
    out = {**scores(range(len(items))), "acc_stderr": _stderr([float(j["exact"]) for j in judged]),
           "subjects": {s: scores(rows) for s, rows in sorted(by_subject.items())},
           "details": [{"where": it.where, "subject": it.subject, "tool": it.tool, "reply": g, **j}
                       for it, g, j in zip(items, greedy, judged)]}
    if task.samples:
        out.update({"k": k, "samples": task.samples})
    return out


def evaluate_task(weights: str, task: EvalTaskConfig, *, preset: Optional[str] = None,
                  tokenizer: Optional[str] = None, device: Optional[str] = None, workers: int = 0,
                  cache_dir: str = "data_cache", model=None, tok=None, rope_scaling: Optional[dict] = None) -> dict:
    """Score ``weights`` (anything store/weights loads) on ``task``; the result as the ``eval`` verb prints and
    ``--out`` writes it. ``workers`` > 0 shards the batches over that many Ray tasks (one CPU each). ``model``
    and ``tok``: an already loaded model and tokenizer (validation during training passes them); ``rope_scaling``:
    YaRN at inference, as the inference verbs take it (store/weights.py:rope_scaling_spec)."""
    from minimind_ray.engine.step import autocast_for
    from minimind_ray.generate import tokenizer_for_weights
    from minimind_ray.store.weights import build_inference_model

    task = resolve_data(task, cache_dir)
    validate_task(task)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None:
        model, lw = build_inference_model(weights, preset, device=device, rope_scaling=rope_scaling)
        tok = tok or tokenizer_for_weights(lw, tokenizer)
    t0 = time.perf_counter()
    items, bad = load_items(task, tok)
    encoded = encode_items(items, tok, task.task)
    batches = make_batches(encoded, task.task, task.batch_size, [getattr(it, "subject", "") for it in items])
    jobs = [[encoded[i] for i in b] for b in batches]
    if workers:
        from minimind_ray.evals.parallel import score_on_ray

        results = score_on_ray(weights, preset, task, jobs, tok.eos_id, tok.pad_id, workers, rope_scaling=rope_scaling)
    else:
        autocast = autocast_for("auto", torch.device(device))
        results = [score_batch(model, task, job, i, tok.eos_id, tok.pad_id, device, autocast)
                   for i, job in enumerate(jobs)]
    seconds = time.perf_counter() - t0
    out = {"task": task_name(task), "kind": task.task}
    if task.task in ("gen", "toolcall"):
        greedy, sampled = [None] * len(items), [None] * len(items)
        for b, (g, s) in zip(batches, results):
            for i, gi, si in zip(b, g, s):
                greedy[i] = tok.decode(gi, skip_special_tokens=True)
                sampled[i] = [tok.decode(x, skip_special_tokens=True) for x in si]
        out.update((aggregate_gen if task.task == "gen" else aggregate_toolcall)(items, greedy, sampled, task))
    else:
        logprobs = [None] * len(items)
        for b, rows in zip(batches, results):
            for i, row in zip(b, rows):
                logprobs[i] = row
        out.update(aggregate_mc(items, logprobs))
    out.update({"bad_records": bad.report(), "bad_samples": dict(bad.samples), "seconds": seconds,
                "questions_per_s": len(items) / seconds if seconds > 0 else None, "config": asdict(task)})
    return out


def metric_items(result: dict) -> Dict[str, float]:
    """The result's headline scores as MLflow metrics: ``eval/<name>/acc`` etc. (MLflow allows no '@' in a
    name: pass@k is ``pass_at_<k>``)."""
    name = result["task"]
    if result["kind"] == "gen":
        keys = {"greedy_acc": result.get("greedy_acc"), "pass_at_1": result.get("pass@1"),
                f"pass_at_{result.get('k')}": result.get("pass@k")}
    elif result["kind"] == "toolcall":
        keys = {k: result.get(k) for k in ("acc", "name_acc", "args_valid", "args_match", "call_rate")}
    else:
        keys = {"acc": result.get("acc"), "acc_norm": result.get("acc_norm")}
    return {f"eval/{name}/{k}": float(v) for k, v in keys.items() if v is not None}
