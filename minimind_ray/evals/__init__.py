"""Benchmark evaluation (docs/evaluation.md): multiple-choice tasks scored by log-likelihood as lm-eval scores them
(C-Eval, CMMLU, any jsonl of choices), generative tasks by exact match, in one process or over Ray tasks.

config.py (EvalTaskConfig, a recipe's EvalConfig), tasks.py (files -> prompts), scoring.py (the model's
log-probs and completions), run.py (one task end to end, metrics), parallel.py (--workers), verb.py (the CLI).
"""
