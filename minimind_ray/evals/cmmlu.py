"""``cmmlu``: CMMLU's folder (docs/evaluation.md), scored as lm-eval's ``cmmlu``.

``test/<subject>.csv`` is scored and ``dev/<subject>.csv`` gives the shots, columns ``,Question,A,B,C,D,Answer``.
The description "以下是关于<subject>的单项选择题，请直接给出正确答案的选项。" then each question as C-Eval's,
the letters `` A`` .. `` D`` scored as continuations.
"""
from __future__ import annotations

from minimind_ray.evals.kinds import LetterTask


class CMMLU(LetterTask):
    """CMMLU's layout: test/<subject>.csv scored, dev/<subject>.csv shots; lm-eval's cmmlu prompt."""

    scored_dir, scored_suffix, dev_suffix = "test", ".csv", ".csv"
    question_col, answer_col = "Question", "Answer"
    description = "以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n"
    lm_eval_task = "cmmlu"
