"""A quiet console (issue 38): of the lines Ray's log monitor forwards from the workers, only minimind-ray's reach the
terminal; Ray Data's console says warnings that matter; --verbose or MINIMIND_RAY_VERBOSE=1 changes nothing of Ray's.
No Ray is started: the filter is put in front of a printer registered in Ray's own dispatcher, as Ray registers its
own (the lines below are ones a 2-worker run printed, tests/integration/test_resume.py checks a real run)."""
from __future__ import annotations

import logging

import pytest

from minimind_ray import console

FORWARDED = [
    "[2026-12-03 17:43:11,720 E 2814 3064] core_worker.cc:2330: Actor with class name: 'PreemptionWatcher' and ID: "
    "'3a6e' has constructor arguments in the object store and max_restarts > 0.",
    "Reporting training result 1: TrainingReport(checkpoint=Checkpoint(filesystem=local, path=/tmp/x), metrics={})",
    "2026-12-03 17:41:44,503\tINFO logging_progress.py:225 -- Total Progress: 0/?",
    "[minimind-ray] world 2 on cpu (2 cores), 1.61M params, 239 steps/epoch",
    "[minimind-ray] WARNING: all-reduce took 21% of step time (> 10%) at step 10; see metric comm_fraction",
    "[fault-injection] rank 1: raise at step 6",
    "[sweep-3f2a_00001] step 10/40 ep 0 loss 2.3 tok/s 1,000 ETA 00:00:30",  # a sweep trial's own progress
    "[Errno 2] No such file or directory: 'x'",
    "INFO 2026-12-03 replica.py:1234 -- GET /v1/models 200 1.2ms",  # Serve's access line
]
OURS = FORWARDED[3:7]


@pytest.fixture
def dispatcher(monkeypatch):
    """Ray's dispatcher of the workers' lines with one printer as ray.init registers it, restored afterwards."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as d

    printed = []
    saved = list(d.handlers)
    d.handlers = [("ray_print_logs", lambda data: printed.extend(data["lines"]))]
    for name in ("ray", "ray.serve", "ray.train", "ray.tune"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    for var in ("MLFLOW_LOGGING_LEVEL", "RAY_DATA_DISABLE_PROGRESS_BARS", console.VERBOSE_ENV):
        monkeypatch.setenv(var, "")  # recorded as it was, so that what the code under test sets is undone
        monkeypatch.delenv(var)
    yield d, printed
    d.handlers = saved


def test_quiet_only_minimind_rays_own_worker_lines_reach_the_terminal(dispatcher, monkeypatch):
    d, printed = dispatcher
    assert console.ray_init_options() == {"logging_level": logging.WARNING}
    console.after_ray_start()
    d.emit({"lines": FORWARDED, "pid": 3290, "is_err": False})
    assert printed == OURS
    assert console.after_ray_start() is None  # once per Ray: not wrapped twice, no second line
    d.emit({"lines": FORWARDED[:1], "pid": 2814, "is_err": True})
    assert printed == OURS and len(d.handlers) == 1
    assert logging.getLogger("ray").level == logging.WARNING


@pytest.mark.parametrize("how", ["env", "flag-before", "flag-after"])
def test_verbose_leaves_every_line_of_ray_as_it_prints_them(dispatcher, how, monkeypatch, capsys):
    d, printed = dispatcher
    if how == "env":
        monkeypatch.setenv(console.VERBOSE_ENV, "1")
    else:
        from minimind_ray.cli import main

        argv = ["--verbose", "eval", "--task", "list"] if how == "flag-before" else ["eval", "--task", "list", "--verbose"]
        assert main(argv) == 0 and "mc" in capsys.readouterr().out
        assert console.verbose()  # main set it (the fixture undoes it)
    assert console.verbose() and console.ray_init_options() == {}
    assert console.after_ray_start() is None
    d.emit({"lines": FORWARDED, "pid": 3290, "is_err": False})
    assert printed == FORWARDED


def test_ray_datas_console_keeps_warnings_that_matter_and_drops_its_progress(dispatcher):
    logger = logging.getLogger("minimind-test-ray-data")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        [quieted] = console.quiet_handlers(logger.name)
        keep = [logger.makeRecord(logger.name, lvl, "f.py", 1, msg, (), None) for lvl, msg in (
            (logging.WARNING, "Cluster resources are not enough to run any task; the job may hang forever"),
            (logging.ERROR, "Full stack trace:"))]
        drop = [logger.makeRecord(logger.name, lvl, "f.py", 1, msg, (), None) for lvl, msg in (
            (logging.INFO, "Total Progress: 0/?"),
            (logging.WARNING, "Progress bars disabled. To enable, set `ray.data.DataContext...`"))]
        assert [quieted.filter(r) for r in keep + drop] == [True, True, False, False]
    finally:
        logger.removeHandler(handler)
