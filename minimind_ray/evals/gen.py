"""``gen``: a jsonl of ``{"prompt", "answer"}`` (the GRPO ``prompt`` format; docs/evaluation.md). Each prompt (after
its shots, as ``mc``'s) is completed greedily and, with ``samples: n``, n times by sampling; a completion is right
when rl/rewards.py ``is_correct`` says so (a number against the reply's last number, a text against the whole
reply, case, spacing and a final full stop aside): ``greedy_acc``, ``pass@1`` (the mean share of right samples),
``pass@k`` (the unbiased estimator of Chen et al., 2021).
"""
from __future__ import annotations

from typing import Dict, List

from minimind_ray.data.formats import BadRecord
from minimind_ray.evals.kinds import GenerationTask, fmt, mean_stderr, pass_at_k
from minimind_ray.evals.tasks import GenItem, check_text, jsonl_contexts
from minimind_ray.rl.rewards import is_correct


def gen_record(rec: dict) -> dict:
    """{prompt, answer: a text or number} -> the record, its answer as a text."""
    prompt, answer = rec.get("prompt"), rec.get("answer")
    if prompt is None or answer is None:
        raise BadRecord("missing_field", f"field '{'prompt' if prompt is None else 'answer'}' missing")
    if not isinstance(prompt, str) or not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise BadRecord("wrong_type", "'prompt' must be a text and 'answer' a text or number")
    if not prompt.strip():
        raise BadRecord("missing_field", "field 'prompt' is empty")
    check_text({"prompt": prompt, "answer": str(answer)})
    return {**rec, "answer": str(answer)}


def aggregate_gen(items: List[GenItem], greedy: List[str], sampled: List[List[str]], task) -> dict:
    k = task.k or task.samples
    details, g_hits, p1, pk = [], [], [], []
    for it, g, s in zip(items, greedy, sampled):
        ok = is_correct(g, it.answer)
        verdicts = [is_correct(x, it.answer) for x in s]
        c = sum(verdicts)
        g_hits.append(float(ok))
        if task.samples:
            p1.append(c / len(s))
            pk.append(pass_at_k(len(s), c, k))
        details.append({"where": it.where, "subject": it.subject, "answer": it.answer, "greedy": g,
                        "greedy_correct": ok, "samples": s, "samples_correct": c, "sample_verdicts": verdicts})
    n = len(items)
    out = {"greedy_acc": sum(g_hits) / n if n else None, "greedy_acc_stderr": mean_stderr(g_hits), "n": n,
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


class Generation(GenerationTask):
    """A jsonl of {prompt, answer}: greedy and sampled completions, exact match (greedy_acc, pass@1, pass@k)."""

    def load_items(self, tokenizer):
        cfg = self.cfg
        rows, bad = jsonl_contexts(cfg, tokenizer, gen_record, cfg.doc_to_text or "{prompt}", lambda r: r["answer"])
        return [GenItem(subject, context, rec["answer"], where) for rec, subject, context, where in rows], bad

    def judge(self, items, greedy, sampled):
        return aggregate_gen(items, greedy, sampled, self.cfg)

    def metrics(self, summary):
        keys = {"greedy_acc": summary.get("greedy_acc"), "pass_at_1": summary.get("pass@1"),
                f"pass_at_{summary.get('k')}": summary.get("pass@k")}
        return {k: float(v) for k, v in keys.items() if v is not None}

    def samples(self, items, summary):
        return [{"where": d["where"], "subject": d["subject"], "prompt": it.context, "answer": d["answer"],
                 "greedy": d["greedy"], "greedy_correct": d["greedy_correct"], "samples": d["samples"],
                 "sample_verdicts": d["sample_verdicts"]} for it, d in zip(items, summary["details"])]

    def table(self, res):
        cols = "greedy_acc pass@1 pass@k".split()
        rows = [(s, r["n"], [r.get(c) for c in cols]) for s, r in res["subjects"].items()] if len(
            res["subjects"]) > 1 else []
        rows.append((f"all ({res['task']})", res["n"], [res.get(c) for c in cols]))
        head = f"{'subject':<28} {'n':>6} {'greedy_acc':>10} {'pass@1':>8} {'pass@' + str(res.get('k', 'k')):>8}"
        return "\n".join([head] + [f"{name:<28} {n:>6} {fmt(v[0]):>10} {fmt(v[1]):>8} {fmt(v[2]):>8}"
                                   for name, n, v in rows])
