"""A quiet console (issue 38): of the lines Ray's log monitor forwards from the workers, only minimind-ray's reach the
terminal; Ray Data's console says warnings that matter; --verbose or MINIMIND_RAY_VERBOSE=1 changes nothing of Ray's.
No Ray is started: the filter is put in front of a printer registered in Ray's own dispatcher, as Ray registers its
own (the lines below are ones a 2-worker run printed, tests/integration/test_resume.py checks a real run)."""
from __future__ import annotations

import functools
import io
import logging
import sys

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
    from ray._private import worker
    from ray._private.ray_logging import LogDeduplicator

    for name in ("stdout_deduplicator", "stderr_deduplicator"):  # Ray's, fresh: what one test printed is not held
        monkeypatch.setattr(worker, name, LogDeduplicator(5, None, None))
    for var in ("MLFLOW_LOGGING_LEVEL", "RAY_DATA_DISABLE_PROGRESS_BARS", console.VERBOSE_ENV, "RAY_COLOR_PREFIX"):
        monkeypatch.setenv(var, "")  # recorded as it was, so that what the code under test sets is undone
        monkeypatch.delenv(var)
    yield d, printed
    d.handlers = saved


def test_quiet_only_minimind_rays_own_worker_lines_reach_the_terminal(dispatcher, monkeypatch, capsys):
    d, printed = dispatcher
    assert console.ray_init_options() == {"logging_level": logging.WARNING}
    console.after_ray_start()
    capsys.readouterr()
    d.emit({"lines": FORWARDED, "pid": 3290, "is_err": False})
    assert capsys.readouterr().out.splitlines() == OURS and printed == []  # printed here, not by Ray's printer
    assert console.after_ray_start() is None  # once per Ray: not wrapped twice, no second line
    d.emit({"lines": FORWARDED[:1], "pid": 2814, "is_err": True})
    assert capsys.readouterr() == ("", "") and printed == [] and len(d.handlers) == 1
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


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def worker_batch(lines, is_err=False):
    """A batch as Ray's log monitor hands it to the driver's printers: a Ray Train worker's lines."""
    return {"lines": lines, "pid": 3290, "actor_name": "RayTrainWorker", "task_name": None, "ip": "10.0.0.7",
            "localhost": "10.0.0.7", "is_err": is_err}


@pytest.fixture
def rays_printer(dispatcher):
    """Ray's own printer (worker.print_to_stdstream, as ray.init registers it) in the dispatcher."""
    from ray._private.worker import print_to_stdstream

    d, _ = dispatcher
    d.handlers = [("ray_print_logs", functools.partial(print_to_stdstream, ignore_prefix=False))]
    return d


def test_quiet_and_piped_our_worker_lines_are_printed_plainly_to_their_stream(rays_printer, capsys, monkeypatch):
    """Issue 47: no `(RayTrainWorker pid=...)` prefix, no colour codes in piped output; stdout lines to stdout,
    stderr lines to stderr."""
    from ray._private import ray_logging

    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)  # Ray's default (tests/conftest.py turns it off)
    console.after_ray_start()
    capsys.readouterr()
    rays_printer.emit(worker_batch(["[minimind-ray] world 2 on cpu, \x1b[32m1.61M params\x1b[0m", FORWARDED[1]]))
    rays_printer.emit(worker_batch(["[minimind-ray] WARNING: all-reduce took 21% of step time"], is_err=True))
    # Ray's deduplication stays: the same line from another worker is held, to be counted ("[repeated 2x ...]")
    rays_printer.emit(dict(worker_batch(["[minimind-ray] world 2 on cpu, 1.61M params"]), pid=3291))
    out, err = capsys.readouterr()
    assert out == "[minimind-ray] world 2 on cpu, 1.61M params\n"
    assert err == "[minimind-ray] WARNING: all-reduce took 21% of step time\n"


def test_quiet_on_a_terminal_our_lines_keep_their_colours_and_ray_its_own(rays_printer, monkeypatch):
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", Terminal())
    console.after_ray_start()
    rays_printer.emit(worker_batch(["[minimind-ray] step \x1b[32m10\x1b[0m"]))
    assert out.getvalue().splitlines()[-1] == "[minimind-ray] step \x1b[32m10\x1b[0m"
    assert "RAY_COLOR_PREFIX" not in console.os.environ


def test_verbose_and_piped_rays_prefixes_stay_without_colour(rays_printer, monkeypatch, capsys):
    """--verbose: every line of Ray's as it prints them, with Ray's own switch RAY_COLOR_PREFIX=0 when the output is
    not a terminal (no colour codes); a value the user exported wins."""
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert console.after_ray_start() is None
    rays_printer.emit(worker_batch([FORWARDED[1], OURS[0]]))
    assert capsys.readouterr().out.splitlines() == [f"(RayTrainWorker pid=3290) {line}"
                                                    for line in (FORWARDED[1], OURS[0])]
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    console.after_ray_start()
    assert console.os.environ["RAY_COLOR_PREFIX"] == "1"
