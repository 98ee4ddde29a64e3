"""``ceval``: C-Eval's folder (docs/evaluation.md), scored as lm-eval's ``ceval-valid``.

``val/<subject>_val.csv`` is scored and ``dev/<subject>_dev.csv`` gives the shots, columns
``id,question,A,B,C,D,answer`` (the dev split may add ``explanation``). The description
"以下是中国关于<subject>的单项选择题，请选出其中的正确答案。" then each question as
``<question>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\n答案：``, the letters `` A`` .. `` D`` scored as continuations.
"""
from __future__ import annotations

from minimind_ray.evals.kinds import LetterTask


class CEval(LetterTask):
    """C-Eval's layout: val/<subject>_val.csv scored, dev/<subject>_dev.csv shots; lm-eval's ceval-valid prompt."""

    scored_dir, scored_suffix, dev_suffix = "val", "_val.csv", "_dev.csv"
    question_col, answer_col = "question", "answer"
    description = "以下是中国关于{subject}的单项选择题，请选出其中的正确答案。\n\n"
    lm_eval_task = "ceval-valid"
