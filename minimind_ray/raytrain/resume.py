"""What happens to a run of this name: started, resumed from its newest complete checkpoint, trained further, or
already finished (:class:`RunFinished`: the same command run again is a no-op that says where its results are).
Decided on the driver before Ray starts, from the run's storage alone."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Tuple

from minimind_ray.config import ConfigError, RunConfig, from_dict, run_identity
from minimind_ray.fsio import filesystem, is_uri, redact


class RunFinished(Exception):
    """``resume=auto`` found this run finished, with no more steps asked for: the same command run again. Not an error
    but an outcome: the CLI says where its results are and exits 0 (:meth:`line`); a pipeline or sweep uses the run
    as it is."""

    def __init__(self, msg: str, name: str = "", step: int = 0, run_dir: str = "", checkpoint: str = "",
                 mlflow_run_id: Optional[str] = None):
        super().__init__(msg)
        self.name, self.step, self.run_dir, self.checkpoint, self.mlflow_run_id = (name, step, run_dir, checkpoint,
                                                                                   mlflow_run_id)

    def line(self) -> str:
        """``already finished at step N: <run dir>, <export>, MLflow <id>``, and how to train on."""
        export = f"{self.run_dir.rstrip('/')}/export"
        export = export if has_run_state(export) else "no export (the driver stopped before writing it)"
        return redact(f"[minimind-ray] {self.name} already finished at step {self.step}: {self.run_dir}, {export}, "
                      f"MLflow {self.mlflow_run_id or '(untracked)'}; raise train.max_steps above {self.step} to "
                      f"train it further, or pass --fresh to start anew")


def storage_root(cfg: RunConfig) -> str:
    """checkpoint.storage_path as the run sees it: a URI as given, a local path made absolute."""
    sp = cfg.checkpoint.storage_path
    return sp if is_uri(sp) else str(Path(sp).expanduser().resolve())


def has_run_state(run_dir: str) -> bool:
    """Has Ray Train left anything of this run in storage (so that starting it again resumes it)?"""
    import pyarrow.fs as pafs

    fs, root = filesystem(run_dir)
    return fs.get_file_info(root).type == pafs.FileType.Directory


def decide_run(cfg: RunConfig, storage: str) -> Tuple[str, str]:
    """(run name, what happens to it), by ``cfg.resume``; raises ConfigError when the choice is the user's.

    The name is ``cfg.name``, or the run's identity (:func:`minimind_ray.config.run_identity`), so the
    same command finds the same run. Ray Train resumes a run whose name it finds in storage; this decides
    beforehand whether that is what the user asked for, and says so."""
    from minimind_ray.store.checkpoint import newest_complete  # lazy: torch, only when this runs

    name = cfg.name or run_identity(cfg)
    run_dir = f"{storage.rstrip('/')}/{name}"
    latest = newest_complete(run_dir)
    if cfg.resume == "never":
        if latest is None and not has_run_state(run_dir):
            return name, f"starting run {name}"
        if cfg.name:
            raise ConfigError(f"resume: run {name!r} already exists in {storage} and resume=never starts a new run; "
                              f"choose another name= (nothing is deleted)")
        name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return name, f"starting run {name} (resume=never; {run_dir} is left as it is)"
    if latest is None:
        if cfg.resume == "must":
            raise ConfigError(f"resume: must, but run {name!r} has no complete checkpoint in {storage}")
        return name, f"starting run {name}" + (" (its earlier attempt left no checkpoint)" if has_run_state(run_dir)
                                                else "")
    meta = latest.meta()
    if meta.step < meta.total_steps:
        return name, f"resuming run {name} from step {meta.step} of {meta.total_steps} ({latest.location})"
    old = from_dict(meta.config).train
    t = cfg.train
    more = t.max_steps > meta.step if t.max_steps else (old.max_steps is None and t.epochs > old.epochs)
    if more:
        return name, f"training run {name} further from its last checkpoint (step {meta.step}, {latest.location})"
    msg = (f"resume: run {name!r} finished at step {meta.step} ({latest.location}). To train it further, raise "
           f"train.max_steps above {meta.step} (or train.epochs); to start anew, pass --fresh or resume=never (a new "
           f"run name) or another name=")
    if cfg.resume == "must":
        raise ConfigError(msg.replace("resume: run", "resume: must, but run", 1))
    raise RunFinished(msg, name, meta.step, run_dir, latest.location, meta.mlflow_run_id)
