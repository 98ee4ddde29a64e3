"""What the built-in task kinds share, as lm-eval's output types: choices scored by log-likelihood
(:class:`ChoiceTask`: ``ceval``, ``cmmlu``, ``mc``), C-Eval/CMMLU's folder of letter questions (:class:`LetterTask`),
and completions generated and judged (:class:`GenerationTask`: ``gen``, ``toolcall``); and the statistics
(lm-eval's ``mean_stderr``, the unbiased pass@k).

Per question (ChoiceTask): pred = argmax(sum log p), pred_norm = argmax(sum log p / len(choice)) -> acc, acc_norm,
their stderr; per subject and over the whole task (weighted by subject size, as lm-eval's C-Eval group).
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

from minimind_ray.config_checks import ConfigError
from minimind_ray.data.manifest import DataError
from minimind_ray.evals.registry import EvalTask
from minimind_ray.evals.scoring import choice_logprobs, encode_question, generate_batch
from minimind_ray.evals.tasks import BadRows, MCItem, PromptBuilder, letter_rows, letter_subjects, subject_name, \
    subject_names


def mean_stderr(values: List[float]) -> Optional[float]:
    """lm-eval's ``mean_stderr``: the sample standard deviation (n - 1) over sqrt(n)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def argmax(xs: List[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # the first of equal maxima, as numpy's argmax


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. (2021): 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def aggregate_mc(items: List[MCItem], logprobs: List[List[float]]) -> dict:
    per_subject: Dict[str, List[tuple]] = {}
    details = []
    for it, lls in zip(items, logprobs):
        pred = argmax(lls)
        pred_norm = argmax([ll / len(c) for ll, c in zip(lls, it.choices)])
        per_subject.setdefault(it.subject, []).append((pred == it.gold, pred_norm == it.gold))
        details.append({"where": it.where, "subject": it.subject, "gold": it.gold, "pred": pred,
                        "pred_norm": pred_norm, "logprobs": lls})
    hits = [h for rows in per_subject.values() for h in rows]
    acc, acc_norm = [float(a) for a, _ in hits], [float(b) for _, b in hits]
    n = len(hits)
    return {"acc": sum(acc) / n if n else None, "acc_norm": sum(acc_norm) / n if n else None,
            "acc_stderr": mean_stderr(acc), "acc_norm_stderr": mean_stderr(acc_norm), "n": n,
            "subjects": {s: {"acc": sum(a for a, _ in r) / len(r), "acc_norm": sum(b for _, b in r) / len(r),
                             "n": len(r)} for s, r in sorted(per_subject.items())},
            "details": details}


def fmt(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


class ChoiceTask(EvalTask):
    """Questions with choices (MCItem), each choice scored by the summed log-likelihood of its continuation
    (evals/scoring.py: lm-eval's token split, the context computed once per question)."""

    def encode(self, items, tokenizer):
        return [encode_question(tokenizer, it.context, it.continuations) for it in items]

    def length(self, encoded) -> int:
        return len(encoded[0])

    def score(self, model, batch, batch_index, *, eos_id, pad_id, device, autocast=None):
        return choice_logprobs(model, batch, pad_id=pad_id, device=device, autocast=autocast)

    def summarise(self, items, results, tokenizer):
        return aggregate_mc(items, results)

    def metrics(self, summary):
        return {k: summary[k] for k in ("acc", "acc_norm") if summary.get(k) is not None}

    def samples(self, items, summary):
        return [{"where": d["where"], "subject": d["subject"], "prompt": it.context, "choices": it.choices,
                 "continuations": it.continuations, "logprobs": d["logprobs"], "pick": d["pred"],
                 "pick_norm": d["pred_norm"], "gold": d["gold"], "acc": float(d["pred"] == d["gold"]),
                 "acc_norm": float(d["pred_norm"] == d["gold"])} for it, d in zip(items, summary["details"])]

    def table(self, res):
        lines = [f"{'subject':<40} {'n':>6} {'acc':>8} {'acc_norm':>8}"]
        lines += [f"{s:<40} {r['n']:>6} {fmt(r['acc']):>8} {fmt(r['acc_norm']):>8}" for s, r in res["subjects"].items()]
        lines.append(f"{'all (' + res['task'] + ')':<40} {res['n']:>6} {fmt(res['acc']):>8} "
                     f"{fmt(res['acc_norm']):>8}   stderr {fmt(res['acc_stderr'])}")
        return "\n".join(lines)


class LetterTask(ChoiceTask):
    """A benchmark folder of four-choice questions, one CSV per subject (C-Eval's and CMMLU's layouts): the
    letters `` A`` .. `` D`` scored after lm-eval's prompt, the shots the first rows of the dev split. A kind
    gives its layout in the class attributes."""

    scored_dir = "val"  # <scored_dir>/<subject><scored_suffix> are scored, dev/<subject><dev_suffix> give shots
    scored_suffix = "_val.csv"
    dev_suffix = "_dev.csv"
    question_col, answer_col = "question", "answer"
    description = ""  # lm-eval's description, '{subject}' standing for the subject's name
    lm_eval_task = ""
    question = "{question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\n答案："

    @classmethod
    def check(cls, cfg, where=""):
        super().check(cfg, where)
        if cfg.fewshot_data:
            raise ConfigError(f"{where}fewshot_data: {cfg.task} takes its shots from the folder's dev split")

    @classmethod
    def default_name(cls, cfg):
        return cfg.task

    def load_items(self, tokenizer):
        cfg = self.cfg
        bad = BadRows(cfg.bad_records)
        build = PromptBuilder(cfg, tokenizer)
        names = subject_names(cfg.data)
        items = []
        subjects = letter_subjects(cfg, self.scored_dir, self.scored_suffix, self.dev_suffix)
        for subject, scored, dev in subjects:
            template = self.description if cfg.description is None else cfg.description
            description = template.format(subject=subject_name(subject, names))
            shots = []
            if cfg.shots:
                dev_rows = self.dev_rows(dev)
                if isinstance(dev_rows, str):  # no shots for it: skipped, and said (docs/evaluation.md)
                    bad.skip_subject(subject, f"{dev}: {dev_rows} ({cfg.shots} shots come from the dev split)")
                    continue
                if len(dev_rows) < cfg.shots:  # lm-eval's first_n gives what there is: so do we, and say so
                    bad.short_shots(subject, cfg.shots, len(dev_rows), dev)
                shots = [(self.letter_text(r), r["answer"]) for r, _ in dev_rows[:cfg.shots]]
            rows = letter_rows(scored, bad, self.question_col, self.answer_col)
            for rec, where in rows[:cfg.limit] if cfg.limit else rows:
                items.append(MCItem(subject, build.context(description, shots, self.letter_text(rec)),
                                    [build.continuation(x) for x in "ABCD"], list("ABCD"), "ABCD".index(rec["answer"]),
                                    where))
        if len(bad.skipped) == len(subjects):
            raise DataError(f"{cfg.data}: no subject has dev rows for {cfg.shots} shots: "
                            + ", ".join(f"{s} ({why})" for s, why in bad.skipped.items()))
        return items, bad

    def dev_rows(self, dev: str):
        """A subject's usable dev rows (bad ones left out), or why it has none: 'no such file', 'empty file',
        'no usable dev row'."""
        if not os.path.exists(dev):
            return "no such file"
        if os.path.getsize(dev) == 0:
            return "empty file"
        rows = letter_rows(dev, BadRows("skip"), self.question_col, self.answer_col)
        return rows or "no usable dev row"

    def letter_text(self, rec: dict) -> str:
        return self.question.format(**{**rec, "question": rec["question"].strip()})

    def summarise(self, items, results, tokenizer):
        """The accuracies, and how the description named each subject (``description``, ``subject_names``)."""
        cfg = self.cfg
        names = subject_names(cfg.data)
        whose = "the config's description" if cfg.description is not None else f"lm-eval's {self.lm_eval_task} " \
                                                                                  f"description"
        if names is None:
            how = (f"no subject_mapping.json in {cfg.data}: each subject is named from its file name with '_' "
                   f"turned into a space (poem_author -> 'poem author')")
        else:
            how = f"subjects named from {os.path.join(cfg.data, 'subject_mapping.json')}"
        subjects = sorted({it.subject for it in items})
        return {**aggregate_mc(items, results), "description": f"{whose}; {how}",
                "subject_names": {s: subject_name(s, names) for s in subjects}}


class GenerationTask(EvalTask):
    """Prompts completed greedily and, with ``samples``, by sampling (evals/scoring.py:generate_batch: the KV-cache
    sampler of the RL rollouts, each batch drawing from a generator seeded by the task's seed and the batch's
    index); ``summarise`` gets each item's (greedy text, [sampled texts])."""

    def encode(self, items, tokenizer):
        return [tokenizer.encode(it.context) for it in items]

    def length(self, encoded) -> int:
        return len(encoded)

    def score(self, model, batch, batch_index, *, eos_id, pad_id, device, autocast=None):
        c = self.cfg
        greedy, sampled = generate_batch(model, batch, max_new_tokens=c.max_new_tokens, samples=c.samples,
                                         temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, eos_id=eos_id,
                                         pad_id=pad_id, seed=c.seed * 1_000_003 + batch_index, device=device,
                                         autocast=autocast, prefix_cache_mb=c.prefix_cache_mb)
        return list(zip(greedy, sampled))

    def summarise(self, items, results, tokenizer):
        greedy = [tokenizer.decode(g, skip_special_tokens=True) for g, _ in results]
        sampled = [[tokenizer.decode(x, skip_special_tokens=True) for x in s] for _, s in results]
        return self.judge(items, greedy, sampled)

    def judge(self, items: list, greedy: List[str], sampled: List[List[str]]) -> dict:
        raise NotImplementedError
