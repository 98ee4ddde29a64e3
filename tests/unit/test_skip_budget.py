"""No silent skips in CI (issue 34; tests/skip_budget.py): under CI=true a test that lacks what it needs fails with one
line, and a session whose skips go over the allowed list fails, naming each; outside CI both are skips. Checked on a
small suite of its own in a subprocess pytest, in one process and on two xdist workers (how `make test` runs)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.skip_budget import ALLOWED, Allowance, in_ci, over_budget

REPO = Path(__file__).resolve().parents[2]

ALLOW = (Allowance("test_small.py::test_allowed*", r"the kernel says no", 1, "because"),)
SMALL = '''
import pytest
from tests.skip_budget import missing

def test_runs():
    pass

def test_allowed_once():
    pytest.skip("the kernel says no")

def test_lacks_a_browser():
    missing("no chromium here")
'''


def test_over_budget_names_each_skip_outside_the_allowances():
    skips = [("tests/integration/test_oom.py::test_a", "vm.overcommit_memory=1 would grant the allocation"),
             ("tests/integration/test_oom.py::test_b", "vm.overcommit_memory=1 would grant the allocation"),
             ("tests/unit/test_x.py::test_y", "no chromium here"),
             ("tests/integration/test_local_cluster.py::test_z[a]", "making a directory another user's needs root")]
    assert over_budget(skips) == [
        "tests/integration/test_oom.py::test_b: skipped (vm.overcommit_memory=1 would grant the allocation): more than "
        "the 1 allowed for 'vm\\\\.overcommit_memory=1'",
        "tests/unit/test_x.py::test_y: skipped (no chromium here): not an allowed skip"]
    assert over_budget(skips[:1] + skips[3:]) == []
    assert all(a.why and a.at_most >= 1 for a in ALLOWED)  # each allowance says why
    assert in_ci({"CI": "true"}) and in_ci({"CI": "1"}) and not in_ci({}) and not in_ci({"CI": "false"})


def _run_small(tmp_path, ci: bool, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                                                             "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(REPO)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def _write(tmp_path, quiet_skip: bool, small: bool = True):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f'''
        from tests.skip_budget import Allowance, SkipBudget

        def pytest_configure(config):
            if not hasattr(config, "workerinput"):
                config.pluginmanager.register(SkipBudget({ALLOW!r}), "budget")
        '''))
    if small:
        (tmp_path / "test_small.py").write_text(SMALL)
    if quiet_skip:
        (tmp_path / "test_more.py").write_text("import pytest\n\ndef test_quietly():\n    pytest.skip('no reason given')\n")


def _budget_lines(stdout: str):
    return stdout[stdout.index("skip budget (CI=true)"):].splitlines()[1:3]


QUIET = "test_more.py::test_quietly: skipped (no reason given): not an allowed skip"


def test_under_ci_a_missing_part_fails_in_one_line_and_the_skip_budget_holds(tmp_path):
    _write(tmp_path, quiet_skip=False)
    outside = _run_small(tmp_path, False)
    assert outside.returncode == 0 and "1 passed, 2 skipped" in outside.stdout, outside.stdout[-2000:]
    assert "no chromium here" in outside.stdout and "skip budget" not in outside.stdout
    ci = _run_small(tmp_path, True)
    assert ci.returncode == 1 and "1 failed, 1 passed, 1 skipped" in ci.stdout, ci.stdout[-2000:]
    assert [ln for ln in ci.stdout.splitlines() if ln.startswith("CI=true: no chromium here")] == \
        ["CI=true: no chromium here"] and "Traceback" not in ci.stdout, ci.stdout[-2000:]
    assert "skip budget" not in ci.stdout  # the one allowed skip is within the budget
    os.remove(tmp_path / "test_small.py")
    _write(tmp_path, quiet_skip=True, small=False)
    over = _run_small(tmp_path, True)  # every test passed or skipped, but one skip is outside the budget
    assert over.returncode == 1 and "1 skipped" in over.stdout and "failed" not in over.stdout, over.stdout[-2000:]
    lines = _budget_lines(over.stdout)
    assert lines[0] == "1 skip(s) over the budget of tests/skip_budget.py:ALLOWED:" and lines[1].endswith(QUIET)
    assert _run_small(tmp_path, False).returncode == 0  # outside CI a skip is a skip


def test_the_skip_budget_counts_the_skips_of_xdist_workers(tmp_path):
    _write(tmp_path, quiet_skip=True)
    run = _run_small(tmp_path, True, "-n", "2")
    assert run.returncode == 1 and "1 failed, 1 passed, 2 skipped" in run.stdout, run.stdout[-2000:]
    assert _budget_lines(run.stdout)[1].endswith(QUIET) and "CI=true: no chromium here" in run.stdout
