"""What a run's Ray processes need besides the project: the user's own plug-in modules, and CPUs beside the workers.

A run may name code of the user's as ``package.module:function``: a reward term (``train.grpo.rewards``,
``train.ppo.rewards``, ``train.agent.rewards``), an agent's tool (``train.agent.tools``); each stage's record says
which names its config holds (stages/stage.py: ``plugins``). The driver can import it (its
``PYTHONPATH``, its working directory), but the workers run elsewhere: in Ray's session directory, on other
nodes. :func:`user_modules` finds each named module that is neither part of this project nor an installed
package, and the driver ships it to every training worker (and the validation task) the way Ray does it, as a
``py_modules`` entry of their runtime env (a package's directory, or a single module's ``.py`` file, uploaded:
:func:`shipped_modules`), in every mode, a submitted job included (its ``working_dir`` holds only what was in it). What a worker starts inherits it (rollout actors; the
tool worker process gets the worker's ``sys.path``). The driver's own ``PYTHONPATH`` entries are kept for the
workers of a local Ray or ``cluster.address`` as well (:func:`worker_pythonpath`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from minimind_ray.evals.registry import plugin_names as eval_plugin_names
from minimind_ray.plugins import module_paths
from minimind_ray.stages import Stage

REPO_ROOT = Path(__file__).resolve().parents[2]


def plugin_names(cfg, stage: Stage) -> List[str]:
    """The ``module:function`` / ``module:Class`` names a run's config holds: its stage's (``stage``: its record;
    reward terms, tools) and its evaluation tasks' own kinds (evals/registry.py)."""
    return stage.plugins(cfg) + eval_plugin_names(cfg.eval)


def user_modules(cfg, stage: Stage) -> List[str]:
    """Local paths to ship as ``py_modules``: each plug-in's top-level package directory or module file that lies
    outside this project and outside the interpreter's installed packages (plugins.py:module_paths)."""
    return module_paths(plugin_names(cfg, stage))


def shipped_modules(cfg, stage: Stage) -> List[str]:
    """:func:`user_modules` uploaded to the cluster: the ``gcs://`` URIs of their packages, for the runtime envs of the
    workers and of the validation task. Ray turns local paths into such URIs only for a job's own runtime env (what
    ``ray.init`` is given), not for a task's or an actor's, and a submitted job's driver cannot extend its job's: so
    the driver uploads them the way ``ray.init`` does (Ray's own ``upload_py_modules_if_needed``). Call it connected."""
    import tempfile

    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    paths = user_modules(cfg, stage)
    if not paths:
        return []
    with tempfile.TemporaryDirectory(prefix="mmr-plugins-") as scratch:  # where Ray zips them before the upload
        return list(upload_py_modules_if_needed({"py_modules": paths}, include_gitignore=False,
                                                scratch_dir=scratch)["py_modules"])


def worker_pythonpath() -> str:
    """The project's root, then the driver's own PYTHONPATH entries (a user's plug-ins may be found there)."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([str(REPO_ROOT)] + [str(Path(p).resolve()) for p in extra]))


def beside_workers(cfg, stage: Stage) -> Dict[str, float]:
    """What a run places beside its workers: the evaluation task of eval.tasks, and its stage's (``stage``: its record;
    rollout actors)."""
    out = {k: v for k, v in stage.beside(cfg).items() if v}
    if cfg.eval.tasks:
        for k, v in (("CPU", cfg.eval.num_cpus), ("GPU", cfg.eval.num_gpus)):
            out[k] = out.get(k, 0.0) + v
    return {k: v for k, v in out.items() if v}


def side_cpus(cfg, stage: Stage) -> float:
    """CPUs a run reserves beside its workers (beside_workers)."""
    return beside_workers(cfg, stage).get("CPU", 0.0)
