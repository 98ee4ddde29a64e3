"""Benchmark files -> the prompts a model is scored on, built as lm-eval builds them.

Four tasks (docs/evaluation.md):

``ceval``  C-Eval's layout: ``val/<subject>_val.csv`` (scored) and ``dev/<subject>_dev.csv`` (shots), columns
           ``id,question,A,B,C,D,answer``. lm-eval's ``ceval-valid`` template: the description
           "以下是中国关于<subject>的单项选择题，请选出其中的正确答案。" then each question as
           ``<question>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\n答案：``, the letters `` A`` .. `` D`` scored as continuations.
``cmmlu``  CMMLU's layout: ``test/<subject>.csv`` and ``dev/<subject>.csv``, columns ``,Question,A,B,C,D,Answer``;
           lm-eval's ``cmmlu`` template (description "以下是关于<subject>的单项选择题，请直接给出正确答案的选项。").
``mc``     jsonl ``{"question", "choices": [...], "answer": index or letter}`` (any number of choices): the
           choice texts are scored after ``Question: <question>\\nAnswer:`` (lm-eval's ARC layout).
``gen``    jsonl ``{"prompt", "answer"}`` (the GRPO ``prompt`` format): completions are generated and checked.
``toolcall`` jsonl ``{"prompt" or "messages", "tools": [OpenAI function schemas], "tool": name or null, "arguments"}``:
           the conversation and its tools through the chat template; the reply's ``<tool_call>`` is checked (the
           tool named, its arguments against the tool's schema and, when given, against ``arguments``; ``tool:
           null`` expects no call). MiniMind's scripts/eval_toolcall.py shows its cases; this scores them.

Prompts follow lm-eval's ``fewshot_context``: raw text is ``description + shots + question``, each shot
``question + target_delimiter + answer + fewshot_delimiter``; with the chat template the description is the
system turn, shots and question one user turn, and the continuation carries no delimiter. The subject's
name in a description comes from ``subject_mapping.json`` in the folder when there is one (C-Eval's own
file: ``{"accountant": ["Accountant", "注册会计师", "Other"], ...}``, or ``{"agronomy": "农学"}``), else from the
file name.

Bad rows follow the bad-record policy: counted per reason with ``file:line`` samples (``skip``) or a
:class:`~minimind_ray.data.manifest.DataError` naming file, line and field (``strict``).
"""
from __future__ import annotations

import csv
import io
import json
import os
import string
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from minimind_ray.data.formats import BadRecord, parse_line
from minimind_ray.data.manifest import DataError
from minimind_ray.evals.config import EvalTaskConfig, task_name

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
CEVAL_DESCRIPTION = "以下是中国关于{subject}的单项选择题，请选出其中的正确答案。\n\n"  # lm-eval ceval-valid
CMMLU_DESCRIPTION = "以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n"  # lm-eval cmmlu
LETTER_QUESTION = "{question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\n答案："
MC_QUESTION = "Question: {question}\nAnswer:"
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
    """The bad-record policy for benchmark files: count per reason with a few file:line samples, or stop."""

    def __init__(self, policy: str):
        self.policy, self.counts, self.samples = policy, Counter(), defaultdict(list)

    def bad(self, where: str, reason: str, detail: str) -> None:
        if self.policy == "strict":
            raise DataError(f"{where}: {detail} ({reason}; eval bad_records=strict)")
        self.counts[reason] += 1
        if len(self.samples[reason]) < 3:
            self.samples[reason].append(f"{where}: {detail}")

    def report(self) -> Dict[str, int]:
        return dict(sorted(self.counts.items()))


def _check_text(values: Dict[str, str]) -> None:
    for k, v in values.items():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord("bad_text", f"field '{k}' holds a lone surrogate") from None


# --------------------------------------------------------------------------- the files


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start})") from None


def letter_rows(path: str, bad: BadRows, question_col: str, answer_col: str) -> List[Tuple[dict, str]]:
    """The rows of a C-Eval/CMMLU CSV as ({question, A, B, C, D, answer}, 'file:line'), bad ones left out."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
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


def jsonl_records(path: str, bad: BadRows, kind: str) -> List[Tuple[dict, str]]:
    """mc: {question, choices: [>= 2 strings], answer: 0-based index or a letter} -> (question, choices, gold);
    gen: {prompt, answer: string or number} -> (prompt, answer). Each with its 'file:line'."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            if not raw.strip():
                continue
            try:
                rec = parse_line(raw, MAX_LINE_CHARS)
                out.append(({"mc": _mc_record, "gen": _gen_record, "toolcall": _toolcall_record}[kind](rec), where))
            except BadRecord as e:
                bad.bad(where, e.reason, e.detail)
    return out


def _mc_record(rec: dict) -> dict:
    q, choices, answer = rec.get("question"), rec.get("choices"), rec.get("answer")
    if q is None:
        raise BadRecord("missing_field", "field 'question' missing")
    if not isinstance(q, str) or not q.strip():
        raise BadRecord("wrong_type" if not isinstance(q, str) else "missing_field", "field 'question' is not a text")
    if not isinstance(choices, list) or len(choices) < 2:
        raise BadRecord("missing_choice", "field 'choices' is not a list of at least two choices")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c.strip():
            raise BadRecord("missing_choice", f"field 'choices[{i}]' is {c!r}, not a text")
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in LETTERS:
        gold = LETTERS.index(answer.strip().upper())
    elif isinstance(answer, int) and not isinstance(answer, bool):
        gold = answer
    else:
        raise BadRecord("bad_answer", f"field 'answer' is {answer!r}: a choice index (0-based) or letter is needed")
    if not 0 <= gold < len(choices):
        raise BadRecord("bad_answer", f"field 'answer' {answer!r} is not among the {len(choices)} choices")
    _check_text({"question": q, **{f"choices[{i}]": c for i, c in enumerate(choices)}})
    return {**rec, "question": q, "choices": choices, "gold": gold}


def _gen_record(rec: dict) -> dict:
    prompt, answer = rec.get("prompt"), rec.get("answer")
    if prompt is None or answer is None:
        raise BadRecord("missing_field", f"field '{'prompt' if prompt is None else 'answer'}' missing")
    if not isinstance(prompt, str) or not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise BadRecord("wrong_type", "'prompt' must be a text and 'answer' a text or number")
    if not prompt.strip():
        raise BadRecord("missing_field", "field 'prompt' is empty")
    _check_text({"prompt": prompt, "answer": str(answer)})
    return {**rec, "answer": str(answer)}


def _toolcall_record(rec: dict) -> dict:
    from minimind_ray.rl.tools import tool_schemas

    prompt, messages, tools = rec.get("prompt"), rec.get("messages"), rec.get("tools")
    if prompt is None and messages is None:
        raise BadRecord("missing_field", "field 'prompt' (or 'messages') missing")
    if messages is None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRecord("wrong_type", "'prompt' must be a non-empty text")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadRecord("wrong_type", "'messages' must be a list of {role, content} texts")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise BadRecord("wrong_type", "'tools' is a string that is not JSON") from None
    if not isinstance(tools, list) or not tools or len(tool_schemas(tools)) != len(tools):
        raise BadRecord("wrong_type" if tools is not None else "missing_field",
                        "'tools' must be a list of function schemas, each with a name")
    tool, args = rec.get("tool"), rec.get("arguments")
    if tool is not None and (not isinstance(tool, str) or tool not in tool_schemas(tools)):
        raise BadRecord("bad_answer", f"field 'tool' is {tool!r}, not one of the tools offered {sorted(tool_schemas(tools))}")
    if args is not None and not isinstance(args, dict):
        raise BadRecord("wrong_type", f"'arguments' is {type(args).__name__}, expected an object")
    _check_text({f"messages[{i}]": m["content"] for i, m in enumerate(messages)})
    return {**rec, "messages": messages, "tools": tools, "tool": tool, "arguments": args}


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


def _subject_names(folder: str) -> Dict[str, str]:
    path = os.path.join(folder, "subject_mapping.json")
    if not os.path.exists(path):
        return {}
    try:
        raw = json.loads(_read_text(path))
    except ValueError as e:
        raise DataError(f"{path}: not JSON ({e})") from None
    names = {}
    for key, value in raw.items():  # C-Eval: [english, chinese, category]; or a plain name
        names[key] = value[1] if isinstance(value, list) and len(value) > 1 else str(value)
    return names


def _letter_subjects(cfg: EvalTaskConfig) -> List[Tuple[str, str, str]]:
    """(subject, scored file, dev file) of a C-Eval or CMMLU folder."""
    folder = cfg.data
    scored, suffix = ("val", "_val.csv") if cfg.task == "ceval" else ("test", ".csv")
    dev_suffix = "_dev.csv" if cfg.task == "ceval" else ".csv"
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


def load_items(cfg: EvalTaskConfig, tokenizer) -> Tuple[list, BadRows]:
    """The task's questions (MCItem) or prompts (GenItem), in file order, and the bad rows met."""
    bad = BadRows(cfg.bad_records)
    build = PromptBuilder(cfg, tokenizer)
    if cfg.task in ("ceval", "cmmlu"):
        return _letter_items(cfg, build, bad), bad
    if not os.path.isfile(cfg.data):
        raise DataError(f"{cfg.data}: no such file (task {cfg.task} reads a jsonl file)")
    records = jsonl_records(cfg.data, bad, cfg.task)
    if cfg.task == "toolcall":  # always the chat template: the tools are rendered into the system turn
        return [ToolCallItem(rec.get("subject", task_name(cfg)), tokenizer.apply_chat_template(
            rec["messages"], add_generation_prompt=True, tools=rec["tools"]), rec["tools"], rec["tool"],
            rec["arguments"], where) for rec, where in (records[:cfg.limit] if cfg.limit else records)], bad
    shot_pool = records if not cfg.fewshot_data else jsonl_records(cfg.fewshot_data, BadRows("skip"), cfg.task)
    if cfg.shots and cfg.shots > len(shot_pool) - (0 if cfg.fewshot_data else 1):
        raise DataError(f"{cfg.fewshot_data or cfg.data}: {cfg.shots} shots asked, {len(shot_pool)} records there")
    template = cfg.doc_to_text or (MC_QUESTION if cfg.task == "mc" else "{prompt}")
    description = cfg.description or ""
    subject = task_name(cfg)
    items = []
    for i, (rec, where) in enumerate(records[:cfg.limit] if cfg.limit else records):
        try:
            text = template.format(**rec)
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(f"{where}: doc_to_text {template!r} cannot be filled from this record ({e!r})") from None
        pool = [r for j, (r, _) in enumerate(shot_pool) if cfg.fewshot_data or j != i][:cfg.shots]
        if cfg.task == "mc":
            shots = [(template.format(**r), r["choices"][r["gold"]]) for r in pool]
            items.append(MCItem(rec.get("subject", subject), build.context(description, shots, text),
                                [build.continuation(c) for c in rec["choices"]], rec["choices"], rec["gold"], where))
        else:
            shots = [(template.format(**r), r["answer"]) for r in pool]
            items.append(GenItem(rec.get("subject", subject), build.context(description, shots, text), rec["answer"],
                                 where))
    return items, bad


def _letter_items(cfg: EvalTaskConfig, build: PromptBuilder, bad: BadRows) -> List[MCItem]:
    ceval = cfg.task == "ceval"
    question_col, answer_col = ("question", "answer") if ceval else ("Question", "Answer")
    names = _subject_names(cfg.data)
    items = []
    for subject, scored, dev in _letter_subjects(cfg):
        if cfg.description is not None:
            description = cfg.description.format(subject=names.get(subject, subject))
        else:
            description = (CEVAL_DESCRIPTION if ceval else CMMLU_DESCRIPTION).format(
                subject=names.get(subject, subject.replace("_", " ")))
        shots = []
        if cfg.shots:
            if not os.path.exists(dev):
                raise DataError(f"{dev}: no such file ({cfg.shots} shots come from the dev split)")
            dev_rows = letter_rows(dev, BadRows("skip"), question_col, answer_col)
            if len(dev_rows) < cfg.shots:
                raise DataError(f"{dev}: {cfg.shots} shots asked, {len(dev_rows)} usable rows there")
            shots = [(_letter_text(r), r["answer"]) for r, _ in dev_rows[:cfg.shots]]
        rows = letter_rows(scored, bad, question_col, answer_col)
        for rec, where in rows[:cfg.limit] if cfg.limit else rows:
            items.append(MCItem(subject, build.context(description, shots, _letter_text(rec)),
                                [build.continuation(x) for x in "ABCD"], list("ABCD"), "ABCD".index(rec["answer"]),
                                where))
    return items


def _letter_text(rec: dict) -> str:
    return LETTER_QUESTION.format(**{**rec, "question": rec["question"].strip()})
