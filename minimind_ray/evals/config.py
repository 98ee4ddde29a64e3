"""What a benchmark evaluation runs: one task (:class:`EvalTaskConfig`, a task YAML or the ``eval`` verb's flags)
and a recipe's evaluation during training (:class:`EvalConfig`, its ``eval:`` section)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from minimind_ray.config_checks import ConfigError, check_bounds, config_field as _f, need
from minimind_ray.evals.registry import task_class


@dataclass
class EvalTaskConfig:
    """One benchmark task over local files (docs/evaluation.md)."""

    task: str = _f("mc", "a kind of evals/registry.py: ceval | cmmlu (a benchmark folder in its own layout, letters "
                         "scored as lm-eval does) | mc (jsonl {question, choices, answer}: the choice texts scored) | "
                         "gen (jsonl {prompt, answer}: greedy and sampled exact match) | toolcall (jsonl {prompt, "
                         "tools, tool, arguments}: the tool called and its arguments' validity) | loss (the training "
                         "objective's loss and perplexity on a prepared split); or your own 'package.module:Class'")
    data: str = _f("", "ceval: a folder with val/<subject>_val.csv and dev/<subject>_dev.csv; cmmlu: test/<subject>.csv "
                       "and dev/<subject>.csv; mc/gen: a jsonl file; 'demo:<name>' = a file of the built-in corpus; "
                       "loss: a prepared dir ('' = the eval split of the run the weights come from)")
    name: Optional[str] = _f(None, "the task's name in reports and MLflow (eval/<name>/acc); None = the kind's "
                                   "default: the data file's stem (mc, gen, toolcall, a user kind), else the kind")
    shots: int = _f(0, "k-shot: the first k examples of the dev split (ceval/cmmlu) or of fewshot_data (mc/gen; "
                       "default: the same file, without the question itself)", ge=0)
    fewshot_data: Optional[str] = _f(None, "mc/gen: the jsonl the shots come from (None = data)")
    chat_template: bool = _f(False, "render the prompt with the tokenizer's chat template (lm-eval's "
                                    "--apply_chat_template: description as the system turn, shots and question as one "
                                    "user turn, the answer as the assistant's reply); False = raw text")
    limit: Optional[int] = _f(None, "at most this many questions per subject (ceval/cmmlu) or per file (mc/gen), the "
                                    "first ones (lm-eval's --limit); loss: this many micro-batches", ge=1)
    subjects: List[str] = _f([], "ceval/cmmlu: only these subjects (default: every file in the folder)")
    description: Optional[str] = _f(None, "text before the shots, '{subject}' standing for the subject's name; None = "
                                          "the task's own (lm-eval's for ceval/cmmlu; none for mc/gen). ceval/cmmlu "
                                          "name a subject from subject_mapping.json when the folder has one, else "
                                          "from the file name with '_' as a space (poem_author: 'poem author')")
    doc_to_text: Optional[str] = _f(None, "mc/gen: the question as a Python format string over the record's fields; "
                                          "None = 'Question: {question}\\nAnswer:' (mc, lm-eval's ARC layout) or "
                                          "'{prompt}' (gen)")
    target_delimiter: str = _f(" ", "raw prompts: between a question and its answer (lm-eval's target_delimiter)")
    fewshot_delimiter: str = _f("\n\n", "raw prompts: after each shot's answer")
    batch_size: int = _f(16, "questions (mc) or prompts (gen) per forward pass; loss: sequences per micro-batch",
                         ge=1)
    bad_records: str = _f("skip", "a malformed row: 'skip' (counted per reason with file:line) or 'strict' (stop at "
                                  "the first, naming file, line and field)")
    max_new_tokens: int = _f(32, "gen: the most new tokens of a completion", ge=1)
    samples: int = _f(0, "gen: sampled completions per prompt for pass@1/pass@k (0 = greedy only)", ge=0)
    k: Optional[int] = _f(None, "gen: the k of pass@k (None = samples)", ge=1)
    temperature: float = _f(0.8, "gen: sampling temperature", gt=0)
    top_p: float = _f(1.0, "gen: nucleus sampling mass (1 = off)", gt=0, le=1)
    top_k: int = _f(0, "gen: sample among the k most likely tokens (0 = off)", ge=0)
    prefix_cache_mb: float = _f(0.0, "gen: MiB of prompt keys/values kept within a batch (model/prefix_cache.py): "
                                     "the sampled pass copies the greedy pass's prompts, and prompts that start "
                                     "alike (few-shot examples) compute their shared blocks once; 0 = off", ge=0)
    seed: int = _f(0, "gen: seed of the sampled completions (each batch draws from its own generator, so the result "
                      "does not depend on --workers)")


@dataclass
class EvalConfig:
    """Benchmark tasks run on checkpoints while training goes on, outside the training workers (a recipe's
    ``eval:`` section; docs/evaluation.md). Each score is logged to the run at the checkpoint's step as
    ``eval/<name>/<metric>``."""

    tasks: List[EvalTaskConfig] = _f([], "tasks to run, e.g. [{task: mc, data: 'demo:mc_eval', chat_template: true}]")
    interval: int = _f(0, "optimizer steps between evaluations, each on a checkpoint saved at that step (0 = only at "
                          "the end); the last step is always evaluated", ge=0)
    num_cpus: float = _f(1.0, "CPUs reserved for the evaluation task (a Ray task beside the workers)", gt=0)
    num_gpus: float = _f(0.0, "GPUs reserved for the evaluation task", ge=0)
    timeout_s: float = _f(1800.0, "an evaluation that takes longer is cancelled (logged, training goes on)", gt=0)


def validate_task(t: EvalTaskConfig, where: str = "") -> None:
    """Refuse, naming the field, a task that cannot run: the common fields here, then its kind's own checks
    (evals/registry.py: ``check`` of the kind's class, which a user's ``package.module:Class`` is loaded for)."""
    check_bounds(t, where)
    try:
        kind = task_class(t.task)
    except ValueError as e:
        raise ConfigError(f"{where}task: {e}") from None
    need(t.bad_records in ("skip", "strict"), f"{where}bad_records", "must be 'skip' or 'strict'")
    if t.k is not None:
        need(t.samples >= t.k, f"{where}k", f"pass@{t.k} needs samples >= {t.k}, got samples={t.samples}")
    kind.check(t, where)


def task_name(t: EvalTaskConfig) -> str:
    """The name a task's scores are reported under: its ``name``, else its kind's default (the data file's stem
    for mc/gen/toolcall, the kind for ceval/cmmlu/loss)."""
    return t.name or task_class(t.task).default_name(t)


def validate_eval(e: EvalConfig) -> None:
    check_bounds(e, "eval.")
    names = []
    for i, t in enumerate(e.tasks):
        validate_task(t, f"eval.tasks[{i}].")
        names.append(task_name(t))
    dup = sorted({n for n in names if names.count(n) > 1})
    need(not dup, "eval.tasks", f"two tasks report under the same name {dup}: give them distinct 'name's")
