"""ASHA whose rungs outlive the sweep's driver.

Tune's experiment state leaves the scheduler out (``TuneController.__getstate__`` drops ``_scheduler_alg``), and
``Tuner.restore`` hands the restored run the scheduler pickled when the sweep was created, before any result. A
resumed sweep therefore met empty rungs: a trial that resumed, or started, after the driver was killed was compared
with nobody and never stopped early, however poor. This scheduler writes its rungs (each rung's milestone and the
score every trial had there) to one JSON file beside the sweep's directory after every result it records, and reads them
back the first time it is used after a restore. Only ASHA's decisions depend on them; which bracket a trial is in is
given again as Tune re-adds the restored trials (one bracket, the default, so always the same).

The file lives beside the sweep's directory, not in it: Tune restores the experiment directory into a local staging
copy and uploads that copy over the directory at every experiment checkpoint, which put back the rungs as they were
at the restore (seen: a trial stopped after the restore was missing from the file).
"""
from __future__ import annotations

import json
from typing import Dict

from ray.tune.schedulers import ASHAScheduler

from minimind_ray.fsio import filesystem, write_bytes_atomic


class ResumableASHA(ASHAScheduler):
    def __init__(self, state_path: str, **kwargs):
        super().__init__(**kwargs)
        self.state_path = state_path  # <storage>/<sweep>.asha_rungs.json
        self._loaded = False

    def _rungs_state(self) -> Dict:
        return {"brackets": [[[milestone, dict(recorded)] for milestone, recorded in b._rungs] for b in self._brackets]}

    def _load_once(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            fs, p = filesystem(self.state_path)
            with fs.open_input_stream(p) as f:
                text = f.read()
        except FileNotFoundError:
            return  # a new sweep
        try:
            brackets = json.loads(text)["brackets"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.state_path}: not ASHA's saved rungs ({type(e).__name__}: {e}); it is written "
                             f"by the sweep itself: move it away to resume with empty rungs") from None
        if len(brackets) != len(self._brackets):
            raise ValueError(f"{self.state_path}: {len(brackets)} ASHA brackets saved, the sweep has {len(self._brackets)}")
        for bracket, rungs in zip(self._brackets, brackets):
            if [m for m, _ in rungs] != [m for m, _ in bracket._rungs]:
                raise ValueError(f"{self.state_path}: rungs at {[m for m, _ in rungs]}, the sweep's are at "
                                 f"{[m for m, _ in bracket._rungs]}")
            for (_, recorded), (_, saved_recorded) in zip(bracket._rungs, rungs):
                recorded.update(saved_recorded)

    def _save(self) -> None:
        write_bytes_atomic(self.state_path, json.dumps(self._rungs_state(), indent=1).encode())

    def on_trial_add(self, tune_controller, trial) -> None:
        self._load_once()
        super().on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: Dict) -> str:
        self._load_once()
        decision = super().on_trial_result(tune_controller, trial, result)
        self._save()
        return decision

    def on_trial_complete(self, tune_controller, trial, result: Dict) -> None:
        self._load_once()
        super().on_trial_complete(tune_controller, trial, result)
        self._save()
