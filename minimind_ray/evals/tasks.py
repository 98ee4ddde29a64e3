"""Benchmark files -> the questions a model is scored on: what the task kinds share (their modules,
evals/registry.py:TASKS, build the prompts as lm-eval builds them).

- the item records: :class:`MCItem` (a question and its choices), :class:`GenItem` (a prompt and its answer),
  :class:`ToolCallItem` (a conversation, its tools and the call a right reply makes);
- the readers: C-Eval/CMMLU CSVs (:func:`letter_rows`, :func:`letter_subjects`, :func:`subject_names`) and jsonl
  files (:func:`jsonl_records`, one record parser per kind), each bad row following the bad-record policy
  (:class:`BadRows`): counted per reason with ``file:line`` samples (``skip``) or a
  :class:`~minimind_ray.data.manifest.DataError` naming file, line and field (``strict``);
- the prompts: lm-eval's ``fewshot_context`` (:class:`PromptBuilder`): raw text is ``description + shots +
  question``, each shot ``question + target_delimiter + answer + fewshot_delimiter``; with the chat template the
  description is the system turn, shots and question one user turn, and the continuation carries no delimiter;
  and the k shots of a jsonl task (:func:`jsonl_contexts`).

A subject's name in a description comes from ``subject_mapping.json`` in the folder when there is one (C-Eval's own
file: ``{"accountant": ["Accountant", "注册会计师", "Other"], ...}``, or ``{"agronomy": "农学"}``), else from the
file name with ``_`` turned into a space (``poem_author`` -> "poem author"): :func:`subject_name`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import string
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from minimind_ray.data.formats import BadRecord, parse_line
from minimind_ray.data.manifest import DataError
from minimind_ray.evals.config import EvalTaskConfig, task_name
from minimind_ray.evals.registry import task_for

LETTERS = string.ascii_uppercase
REASONS = {
    "bad_row": "a CSV row whose fields do not match the header",
    "missing_field": "the row lacks its question (or prompt/answer)",
    "missing_choice": "a choice is missing or empty (or fewer than two choices)",
    "bad_answer": "the answer is not one of the choices",
    "wrong_type": "a field has the wrong type",
    "bad_text": "text that is not valid Unicode (a lone surrogate)",
    "bad_json": "a line that is not valid JSON",
    "empty_line": "a blank line",
    "not_utf8": "bytes that are not UTF-8",
    "too_long": "a line over the size limit",
}
MAX_LINE_CHARS = 1_000_000


@dataclass
class MCItem:
    """One multiple-choice question, ready to score: the context and each choice's continuation."""

    subject: str
    context: str
    continuations: List[str]
    choices: List[str]  # the choice strings, for acc_norm's length (lm-eval: len of the choice)
    gold: int
    where: str  # file:line


@dataclass
class GenItem:
    subject: str
    context: str
    answer: str
    where: str


@dataclass
class ToolCallItem:
    subject: str
    context: str  # the conversation with its tools, through the chat template, ending in the generation prompt
    tools: List[dict]
    tool: Optional[str]  # the tool a right reply calls; None: a right reply calls none
    arguments: Optional[dict]  # the arguments a right call passes (None: any valid ones)
    where: str


class BadRows:
    """The bad-record policy for benchmark files: count per reason with a few file:line samples, or stop; and what
    the shots lacked: the subjects left out for want of dev rows (``skipped``), and those given fewer shots than
    asked (``short``), whatever the policy (:meth:`shot_report`)."""

    def __init__(self, policy: str):
        self.policy, self.counts, self.samples = policy, Counter(), defaultdict(list)
        self.skipped: Dict[str, str] = {}  # subject -> why it has no shots ('dev/x_dev.csv: no such file (...)')
        self.short: Dict[str, dict] = {}  # subject -> {asked, used, file}

    def bad(self, where: str, reason: str, detail: str) -> None:
        if self.policy == "strict":
            raise DataError(f"{where}: {detail} ({reason}; eval bad_records=strict)")
        self.counts[reason] += 1
        if len(self.samples[reason]) < 3:
            self.samples[reason].append(f"{where}: {detail}")

    def report(self) -> Dict[str, int]:
        return dict(sorted(self.counts.items()))

    def skip_subject(self, subject: str, why: str) -> None:
        self.skipped[subject] = why

    def short_shots(self, subject: str, asked: int, used: int, path: str) -> None:
        self.short[subject] = {"asked": asked, "used": used, "file": path}

    def shot_report(self) -> dict:
        """``skipped_subjects`` and ``short_shots`` of the result, each only when there is one."""
        return {k: dict(v) for k, v in (("skipped_subjects", self.skipped), ("short_shots", self.short)) if v}


def check_text(values: Dict[str, str]) -> None:
    """A BadRecord ``bad_text`` for a field that holds a lone surrogate (no UTF-8 for it)."""
    for k, v in values.items():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord("bad_text", f"field '{k}' holds a lone surrogate") from None


def load_items(cfg: EvalTaskConfig, tokenizer) -> Tuple[list, BadRows]:
    """The task's questions (MCItem, GenItem, ToolCallItem, or a user kind's own), in file order, and the bad
    rows met: its kind's ``load_items`` (evals/registry.py)."""
    return task_for(cfg).load_items(tokenizer)


# --------------------------------------------------------------------------- the files


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start})") from None


def letter_rows(path: str, bad: BadRows, question_col: str, answer_col: str) -> List[Tuple[dict, str]]:
    """The rows of a C-Eval/CMMLU CSV as ({question, A, B, C, D, answer}, 'file:line'), bad ones left out."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    header = next(reader, None)
    if header is None:
        raise DataError(f"{path}: empty file (a header {question_col},A,B,C,D,{answer_col} is needed)")
    cols = {name.strip(): i for i, name in enumerate(header)}
    missing = [c for c in (question_col, "A", "B", "C", "D", answer_col) if c not in cols]
    if missing:
        raise DataError(f"{path}:1: header lacks column(s) {missing}; got {header}")
    rows = []
    start = 2
    for row in reader:
        where, start = f"{path}:{start}", reader.line_num + 1
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            bad.bad(where, "bad_row", f"{len(row)} fields, the header has {len(header)}")
            continue
        rec = {"question": row[cols[question_col]], **{x: row[cols[x]] for x in "ABCD"},
               "answer": row[cols[answer_col]].strip()}
        if not rec["question"].strip():
            bad.bad(where, "missing_field", f"field '{question_col}' is empty")
            continue
        empty = [x for x in "ABCD" if not rec[x].strip()]
        if empty:
            bad.bad(where, "missing_choice", f"field '{empty[0]}' (a choice) is empty")
            continue
        if rec["answer"] not in ("A", "B", "C", "D"):
            bad.bad(where, "bad_answer", f"field '{answer_col}' is {rec['answer']!r}, not one of A, B, C, D")
            continue
        rows.append((rec, where))
    return rows


def jsonl_records(path: str, bad: BadRows, parse: Callable[[dict], dict]) -> List[Tuple[dict, str]]:
    """The records of a jsonl file as (``parse(record)``, 'file:line'); ``parse`` raises BadRecord for a bad one
    (mc: {question, choices, answer} -> gold; gen: {prompt, answer}; toolcall: {prompt or messages, tools, ...})."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            if not raw.strip():
                continue
            try:
                out.append((parse(parse_line(raw, MAX_LINE_CHARS)), where))
            except BadRecord as e:
                bad.bad(where, e.reason, e.detail)
    return out


def subject_names(folder: str) -> Optional[Dict[str, str]]:
    """The subjects' names of ``folder/subject_mapping.json`` (None: the folder has none)."""
    path = os.path.join(folder, "subject_mapping.json")
    if not os.path.exists(path):
        return None
    try:
        raw = json.loads(read_text(path))
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    names = {}
    for key, value in raw.items():  # C-Eval: [english, chinese, category]; or a plain name
        names[key] = value[1] if isinstance(value, list) and len(value) > 1 else str(value)
    return names


def subject_name(subject: str, names: Optional[Dict[str, str]]) -> str:
    """A subject's name in a description: subject_mapping.json's, else the file name with '_' as a space."""
    return (names or {}).get(subject, subject.replace("_", " "))


def letter_subjects(cfg: EvalTaskConfig, scored: str, suffix: str, dev_suffix: str) -> List[Tuple[str, str, str]]:
    """(subject, scored file, dev file) of a C-Eval or CMMLU folder: ``<scored>/<subject><suffix>`` and
    ``dev/<subject><dev_suffix>``, the config's ``subjects`` or every one there."""
    folder = cfg.data
    d = os.path.join(folder, scored)
    if not os.path.isdir(d):
        raise DataError(f"{folder}: no {scored}/ folder ({cfg.task} layout: {scored}/<subject>{suffix})")
    found = sorted(f[:-len(suffix)] for f in os.listdir(d) if f.endswith(suffix))
    wanted = cfg.subjects or found
    unknown = sorted(set(wanted) - set(found))
    if unknown:
        raise DataError(f"{folder}: no {scored}/<subject>{suffix} for subject(s) {unknown}; found {found}")
    if not wanted:
        raise DataError(f"{folder}: no {scored}/<subject>{suffix} files")
    return [(s, os.path.join(d, s + suffix), os.path.join(folder, "dev", s + dev_suffix)) for s in wanted]


# --------------------------------------------------------------------------- prompts


class PromptBuilder:
    """lm-eval's ``fewshot_context`` for one task: raw text, or the chat template."""

    def __init__(self, cfg: EvalTaskConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer

    def context(self, description: str, shots: List[Tuple[str, str]], question: str) -> str:
        c = self.cfg
        body = "".join(q + c.target_delimiter + a + c.fewshot_delimiter for q, a in shots) + question
        if not c.chat_template:
            return description + body
        messages = ([{"role": "system", "content": description}] if description else []) + \
            [{"role": "user", "content": body}]
        return self.tok.apply_chat_template(messages, add_generation_prompt=True)

    def continuation(self, answer: str) -> str:
        return answer if self.cfg.chat_template else self.cfg.target_delimiter + answer


def jsonl_contexts(cfg: EvalTaskConfig, tokenizer, parse: Callable[[dict], dict], template: str,
                   shot_answer: Callable[[dict], str]) -> Tuple[List[Tuple[dict, str, str, str]], BadRows]:
    """Each record of a jsonl task with shots (mc, gen) as (record, subject, context, 'file:line'), its context
    ``template`` filled from the record after the first ``shots`` records of ``fewshot_data`` (or of the same
    file without the record itself, lm-eval's rule when shots and questions share a split), each answered with
    ``shot_answer(record)``; and the bad rows met."""
    if not os.path.isfile(cfg.data):
        raise DataError(f"{cfg.data}: no such file (task {cfg.task} reads a jsonl file)")
    bad = BadRows(cfg.bad_records)
    build = PromptBuilder(cfg, tokenizer)
    records = jsonl_records(cfg.data, bad, parse)
    shot_pool = records if not cfg.fewshot_data else jsonl_records(cfg.fewshot_data, BadRows("skip"), parse)
    subject = task_name(cfg)
    available = len(shot_pool) - (0 if cfg.fewshot_data else 1)  # from the same file: never the question itself
    if cfg.shots and available < cfg.shots:  # as lm-eval's first_n: the shots there are (said in the result)
        if available <= 0:
            raise DataError(f"{cfg.fewshot_data or cfg.data}: {cfg.shots} shots asked, no usable record to take "
                            f"them from")
        bad.short_shots(subject, cfg.shots, available, cfg.fewshot_data or cfg.data)
    description = cfg.description or ""
    out = []
    for i, (rec, where) in enumerate(records[:cfg.limit] if cfg.limit else records):
        try:
            text = template.format(**rec)
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(f"{where}: doc_to_text {template!r} cannot be filled from this record ({e!r})") from None
        pool = [r for j, (r, _) in enumerate(shot_pool) if cfg.fewshot_data or j != i][:cfg.shots]
        shots = [(template.format(**r), shot_answer(r)) for r in pool]
        out.append((rec, rec.get("subject", subject), build.context(description, shots, text), where))
    return out, bad
