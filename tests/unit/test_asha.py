"""raytrain/asha.py: ASHA's rungs survive a restore of the sweep (Tune's experiment state leaves the scheduler out).
No Ray cluster: the scheduler is driven as Tune's controller drives it (trials added, results reported)."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from minimind_ray.raytrain.asha import ResumableASHA

SETTINGS = dict(time_attr="step", max_t=12, grace_period=4, reduction_factor=2, stop_last_trials=False)


def _trial(i: int):
    return SimpleNamespace(trial_id=f"t_{i:05d}")


def _ready(scheduler):
    scheduler.set_search_properties("eval_loss", "min")
    return scheduler


def test_a_trial_added_after_a_restore_meets_the_scores_recorded_before_it(tmp_path):
    path = str(tmp_path / "tiny-lr.asha_rungs.json")
    pristine = ResumableASHA(path, **SETTINGS)  # what Tuner pickled when the sweep was created
    first = _ready(copy.deepcopy(pristine))
    decisions = []
    for i, loss in enumerate([5.0, 6.0, 7.0]):  # three trials reach step 4, the first driver is then killed
        first.on_trial_add(None, _trial(i))
        decisions.append(first.on_trial_result(None, _trial(i), {"step": 4, "eval_loss": loss}))
    assert decisions == [TrialScheduler.CONTINUE, TrialScheduler.STOP, TrialScheduler.STOP]
    saved = json.loads((tmp_path / "tiny-lr.asha_rungs.json").read_text())
    assert {m: r for m, r in saved["brackets"][0]}[4] == {"t_00000": -5.0, "t_00001": -6.0, "t_00002": -7.0}

    resumed = _ready(copy.deepcopy(pristine))  # Tuner.restore: the pickled scheduler, no results in it
    resumed.on_trial_add(None, _trial(3))
    assert resumed.on_trial_result(None, _trial(3), {"step": 4, "eval_loss": 9.0}) == TrialScheduler.STOP
    # and one better than the recorded median goes on
    resumed.on_trial_add(None, _trial(4))
    assert resumed.on_trial_result(None, _trial(4), {"step": 4, "eval_loss": 4.0}) == TrialScheduler.CONTINUE

    # the control: Tune's own ASHA, restored the same way, has empty rungs and lets the poor trial go on
    plain = _ready(ASHAScheduler(**SETTINGS))
    plain.on_trial_add(None, _trial(3))
    assert plain.on_trial_result(None, _trial(3), {"step": 4, "eval_loss": 9.0}) == TrialScheduler.CONTINUE


def test_rungs_of_another_shape_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "asha_rungs.json"
    path.write_text(json.dumps({"brackets": [[[8, {}], [2, {}]]]}))
    s = _ready(ResumableASHA(str(path), **SETTINGS))
    with pytest.raises(ValueError) as e:
        s.on_trial_add(None, _trial(0))
    assert str(path) in str(e.value) and "[8, 2]" in str(e.value)


def test_a_damaged_rungs_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "asha_rungs.json"
    path.write_text('{"brackets": [[[8, {}')  # cut mid-write by something other than the sweep
    s = _ready(ResumableASHA(str(path), **SETTINGS))
    with pytest.raises(ValueError, match="not ASHA's saved rungs") as e:
        s.on_trial_add(None, _trial(0))
    assert str(path) in str(e.value)
