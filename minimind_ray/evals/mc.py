"""``mc``: any multiple-choice jsonl (docs/evaluation.md): ``{"question", "choices": [...], "answer": index
(0-based) or letter}``, any number of choices, an optional ``subject``. The choice texts are scored after
``Question: <question>\\nAnswer:`` (lm-eval's ARC layout; ``doc_to_text`` changes it), the shots the first k
records of ``fewshot_data`` or of the same file without the question itself.
"""
from __future__ import annotations

from minimind_ray.data.formats import BadRecord
from minimind_ray.evals.kinds import ChoiceTask
from minimind_ray.evals.tasks import LETTERS, MCItem, PromptBuilder, check_text, jsonl_contexts

QUESTION = "Question: {question}\nAnswer:"


def mc_record(rec: dict) -> dict:
    """{question, choices: [>= 2 strings], answer: 0-based index or a letter} -> the record with its ``gold``."""
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
    check_text({"question": q, **{f"choices[{i}]": c for i, c in enumerate(choices)}})
    return {**rec, "question": q, "choices": choices, "gold": gold}


class MultipleChoice(ChoiceTask):
    """A jsonl of {question, choices, answer}: the choice texts scored after lm-eval's ARC prompt."""

    def load_items(self, tokenizer):
        cfg = self.cfg
        rows, bad = jsonl_contexts(cfg, tokenizer, mc_record, cfg.doc_to_text or QUESTION,
                                   lambda r: r["choices"][r["gold"]])
        build = PromptBuilder(cfg, tokenizer)
        return [MCItem(subject, context, [build.continuation(c) for c in rec["choices"]], rec["choices"], rec["gold"],
                       where) for rec, subject, context, where in rows], bad
