"""The kinds of evaluation task, one class each, found by name (docs/evaluation.md, "Task kinds").

As in lm-eval's registry, a name stands for a class that is imported only when it is asked for. The built-in
kinds are the rows of :data:`TASKS` (``kind -> "package.module:Class"``); any other name of the form
``package.module:Class`` is a user's own class, loaded the same way. ``--task``, a task YAML's ``task:``, a
recipe's ``eval.tasks`` and a pipeline's eval stage all name a kind, and everything that runs one goes through
:func:`task_for`: the ``eval`` verb (evals/run.py), ``--workers`` (evals/parallel.py: each Ray task builds the
class again from its name) and the validation during training (raytrain/validation.py).

Adding a kind takes one module with an :class:`EvalTask` subclass, and its row in :data:`TASKS` for a built-in
one. A user's kind is the module alone; :func:`plugin_names` lists such names in a config, so that a run ships
their modules to its Ray workers (plugins.py:module_paths).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

from minimind_ray.config_checks import ConfigError, need
from minimind_ray.plugins import load_object

# kind -> the class implementing it, imported on first use (what the class does: its docstring, `--task list`)
TASKS: Dict[str, str] = {
    "ceval": "minimind_ray.evals.ceval:CEval",
    "cmmlu": "minimind_ray.evals.cmmlu:CMMLU",
    "mc": "minimind_ray.evals.mc:MultipleChoice",
    "gen": "minimind_ray.evals.gen:Generation",
    "toolcall": "minimind_ray.evals.toolcall:ToolCall",
    "loss": "minimind_ray.evals.loss:Loss",
}
NOT_METRICS = ("n", "seconds", "questions_per_s")  # numbers of a summary that are no score


class EvalTask:
    """One kind of evaluation task; an instance is one task, its config in ``self.cfg`` (an EvalTaskConfig).

    A task that scores questions implements the four steps evals/run.py runs, in this process or, batch by batch,
    on ``--workers`` Ray tasks:

    - ``load_items(tokenizer) -> (items, BadRows)``: the questions in file order, each with its prompt (an
      ``items[i].subject`` groups them in reports and batches; ``.where``, its ``file:line``);
    - ``encode(items, tokenizer) -> list``: per item what ``score`` needs, as plain lists (it travels to Ray);
    - ``score(model, batch, batch_index, *, eos_id, pad_id, device, autocast) -> list``: one result per encoded
      item of the batch (anything picklable; a sampling seed derives from ``batch_index`` alone, so the result
      does not depend on how batches are spread over workers);
    - ``summarise(items, results, tokenizer) -> dict``: the totals from the per-item results (in item order):
      the headline scores, ``n``, ``subjects``, and ``details`` (per item what the scores were computed from);

    and ``metrics(summary)``: the headline scores that go to MLflow as ``eval/<name>/<metric>``. A task that
    measures something else than questions overrides :meth:`evaluate` instead (``loss``).
    """

    def __init__(self, cfg):
        self.cfg = cfg

    # ------------------------------------------------------------------ the config

    @classmethod
    def check(cls, cfg, where: str = "") -> None:
        """Refuse, with a ConfigError naming the field, what this kind cannot run (the common fields are checked
        by evals/config.py:validate_task first)."""
        need(bool(cfg.data), f"{where}data", "no data given (a benchmark folder or a jsonl file)")

    @classmethod
    def default_name(cls, cfg) -> str:
        """The name the scores are reported under when the config gives none: the data file's stem
        (``demo:mc_eval`` -> mc_eval, ``dir/arc.jsonl`` -> arc), else the kind (a user class: its own name)."""
        data = cfg.data or ""
        stem = data.split(":", 1)[1] if data.startswith("demo:") else data.rstrip("/").rsplit("/", 1)[-1]
        return stem.split(".", 1)[0] or cfg.task.rpartition(":")[2]

    # ------------------------------------------------------------------ one evaluation

    def evaluate(self, target) -> dict:
        """The summary of this task on ``target`` (evals/run.py:Target: the weights, their tokenizer, the device,
        the workers). By default the questions of :meth:`load_items`, scored in batches (``target.score_items``)."""
        return target.score_items(self)

    def load_items(self, tokenizer) -> Tuple[list, object]:
        raise NotImplementedError(f"{type(self).__name__} scores no questions (it overrides evaluate)")

    def encode(self, items: list, tokenizer) -> list:
        raise NotImplementedError

    def length(self, encoded) -> int:
        """An encoded item's length in tokens: the runner batches the longest together, longest first."""
        return 0

    def score(self, model, batch: list, batch_index: int, *, eos_id: int, pad_id: int, device, autocast=None) -> list:
        raise NotImplementedError

    def summarise(self, items: list, results: list, tokenizer) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ reporting a summary

    def metrics(self, summary: dict) -> Dict[str, float]:
        """The headline scores, ``{metric: value}``; by default every number at the summary's top level but ``n``
        and the runner's own (``seconds``, ``questions_per_s``); MLflow allows no '@' in a name: pass@k is
        ``pass_at_k``."""
        return {k.replace("@", "_at_"): float(v) for k, v in summary.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS}

    def samples(self, items: list, summary: dict) -> List[dict]:
        """``--log-samples``: one record per item, from the ``details`` the summary was computed from."""
        return [{"prompt": it if isinstance(it, str) else getattr(it, "context", None), **d}
                for it, d in zip(items, summary.get("details", []))]

    def table(self, summary: dict) -> str:
        """What the ``eval`` verb prints: by default the metrics, one a line."""
        return "\n".join([f"{summary['task']} (n {summary.get('n', '-')})"] +
                         [f"  {k:<20} {v:.4f}" for k, v in self.metrics(summary).items()])


def task_kinds() -> List[str]:
    """The built-in kinds, in the registry's order."""
    return list(TASKS)


def is_user_task(kind: str) -> bool:
    """A name that is not a built-in kind: a user's ``package.module:Class``."""
    return kind not in TASKS


def task_class(kind: str) -> type:
    """The class of a kind: a built-in name or ``package.module:Class`` (an :class:`EvalTask` subclass); a
    ValueError naming the kinds otherwise."""
    if kind not in TASKS and ":" not in kind:
        raise ValueError(f"unknown task {kind!r}; one of {', '.join(TASKS)}, or your own 'package.module:Class'")
    cls = load_object(TASKS.get(kind, kind), "eval task class")
    if not (isinstance(cls, type) and issubclass(cls, EvalTask)):
        what = f"the class {cls.__qualname__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise ValueError(f"eval task {kind!r} is {what}, not a subclass of minimind_ray.evals.registry.EvalTask")
    return cls


def task_for(cfg) -> EvalTask:
    """The task of an EvalTaskConfig, ready to run."""
    try:
        return task_class(cfg.task)(cfg)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


def plugin_names(eval_cfg) -> List[str]:
    """The ``package.module:Class`` names of the user's own task kinds in ``eval_cfg`` (a recipe's EvalConfig, or
    any iterable of EvalTaskConfig: a pipeline stage's tasks), for the run to ship their modules to its Ray
    workers (raytrain/runtime_env.py: ``user_modules``)."""
    tasks: Iterable = getattr(eval_cfg, "tasks", eval_cfg)
    return list(dict.fromkeys(t.task for t in tasks if is_user_task(t.task) and ":" in t.task))


def summary_line(kind: str) -> Optional[str]:
    """The first line of a kind's docstring (``--task list``)."""
    doc = (task_class(kind).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else None
