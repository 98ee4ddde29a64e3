"""Benchmark evaluation (docs/evaluation.md): multiple-choice tasks scored by log-likelihood as lm-eval scores them
(C-Eval, CMMLU, any jsonl of choices), generative tasks by exact match, tool calls, the training objective's loss,
in one process or over Ray tasks.

registry.py (the task kinds: one EvalTask class each, named by kind or 'package.module:Class'), one module per
built-in kind (ceval.py, cmmlu.py, mc.py, gen.py, toolcall.py, loss.py) over what they share (kinds.py: choices
and generations; tasks.py: files -> prompts; scoring.py: the model's log-probs and completions), config.py
(EvalTaskConfig, a recipe's EvalConfig), run.py (one task end to end, metrics), parallel.py (--workers), eval_verb.py
(the CLI).
"""
