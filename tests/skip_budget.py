"""No silent skips in CI (issue 34).

A test that cannot run here calls :func:`missing` with one line saying what is missing: outside CI it is skipped
with that reason; under CI (``CI=true``, what .ci/run and CI services set) it fails with that line, so that a
machine without MiniMind's tokenizers, chromium or a free port block cannot give a green run with those features
untested.

The skips that remain are counted: under CI, :class:`SkipBudget` (a plugin tests/conftest.py registers in the
process that reports, xdist's controller or the only process) fails the session when a test skipped for a reason
:data:`ALLOWED` does not list, or more tests skipped for a reason than it allows; it names each one in one line.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Iterable, List, Mapping, NoReturn, Sequence, Tuple

import pytest


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str) -> NoReturn:
    """This test cannot run here because of ``what`` (one line): a skip, or under CI a failure."""
    if in_ci():
        pytest.fail(f"CI=true: {what}", pytrace=False)
    pytest.skip(what)


@dataclass(frozen=True)
class Allowance:
    """Up to ``at_most`` tests matching ``tests`` (an fnmatch pattern of node ids) may skip with a reason that
    ``reason`` (a regular expression) finds, because ``why``."""

    tests: str
    reason: str
    at_most: int
    why: str


ALLOWED: Tuple[Allowance, ...] = (
    Allowance("tests/integration/test_oom.py::*", r"vm\.overcommit_memory=1", 1,
              "a kernel that grants every allocation would let the test touch twice the machine's memory"),
    Allowance("tests/unit/test_memory_estimate.py::*", r"vm\.overcommit_memory=1", 1,
              "a kernel that grants every allocation refuses nothing: there is no refusal to read"),
    Allowance("tests/integration/test_local_cluster.py::*", r"needs root", 4,
              "giving a directory to another user needs root; CI runs as root, a container may not"),
)


def over_budget(skips: Iterable[Tuple[str, str]], allowed: Sequence[Allowance] = ALLOWED) -> List[str]:
    """One line per skip (node id, reason) that the allowances do not cover, in the order seen."""
    used = [0] * len(allowed)
    lines = []
    for nodeid, reason in skips:
        for i, a in enumerate(allowed):
            if fnmatch.fnmatchcase(nodeid, a.tests) and re.search(a.reason, reason):
                used[i] += 1
                if used[i] > a.at_most:
                    lines.append(f"{nodeid}: skipped ({reason}): more than the {a.at_most} allowed for "
                                 f"{a.reason!r}")
                break
        else:
            lines.append(f"{nodeid}: skipped ({reason}): not an allowed skip")
    return lines


def skip_reason(report) -> str:
    """The reason a skipped report gives (pytest's longrepr is (path, line, 'Skipped: reason'))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


class SkipBudget:
    """Counts the session's skips; under CI fails the session (exit 1) when they go over :data:`ALLOWED`."""

    def __init__(self, allowed: Sequence[Allowance] = ALLOWED, environ: Mapping[str, str] = os.environ):
        self.allowed, self.environ = allowed, environ
        self.skips: List[Tuple[str, str]] = []
        self.lines: List[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_collectreport(self, report) -> None:  # a whole module skipped (importorskip at its top)
        if report.skipped:
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_sessionfinish(self, session) -> None:
        if not in_ci(self.environ):
            return
        self.lines = over_budget(self.skips, self.allowed)
        if self.lines and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section("skip budget (CI=true)", sep="=", red=True)
            terminalreporter.write_line(f"{len(self.lines)} skip(s) over the budget of tests/skip_budget.py:ALLOWED:")
            for line in self.lines:
                terminalreporter.write_line(line)
