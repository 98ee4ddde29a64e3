"""Shared fixtures.

One local Ray cluster per test session (every ray.init costs seconds on 2 cores).
Tests that need their own cluster (job submission, node kill) start and stop it
themselves and must not use `ray_session`.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MINIMIND = Path(os.environ.get("MINIMIND_SHARED", REPO.parent / "shared" / "minimind"))

# Must be set before Ray starts: its processes inherit this environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")  # report() is a barrier polled at this interval
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

# Named tokenizers (data.tokenizer=minimind2|minimind3|auto) go through the real fetch code with
# ../shared/minimind as the mirror, into a cache of this session: tests never need the network
# and never write to the user's ~/.cache. Forced, not defaulted, so the run is hermetic.
os.environ["MINIMIND_RAY_TOKENIZER_MIRROR"] = str(SHARED_MINIMIND.resolve())
TEST_CACHE_DIR = tempfile.mkdtemp(prefix="minimind-ray-test-cache-")
os.environ["MINIMIND_RAY_CACHE_DIR"] = TEST_CACHE_DIR
atexit.register(shutil.rmtree, TEST_CACHE_DIR, True)


def minimind_tokenizer_dir(generation: str) -> Path:
    """MiniMind's own tokenizer from ../shared, or skip the test with the reason."""
    d = SHARED_MINIMIND / generation
    if not (d / "tokenizer.json").exists():
        pytest.skip(f"MiniMind's {generation} tokenizer not found at {d} (set MINIMIND_SHARED)")
    return d


# Ray forwards its actors' log lines to the driver's stderr ("(Name pid=N) ..."), in colour or not,
# at any moment: a test that asserts the CLI printed exactly one line must not count them.
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?pid=\d+(, ip=[\d.]+)?\)")


def cli_stderr(capsys) -> str:
    """What the code under test wrote to stderr since the last read, without Ray's forwarded log lines."""
    err = capsys.readouterr().err
    return "\n".join(line for line in err.splitlines() if not _RAY_FORWARDED.match(line)).strip()


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs: 2 training workers at 1 CPU each still leave
    Ray Data its share (Ray Data starves when workers take every CPU)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    ray.shutdown()


@pytest.fixture
def fresh_name():
    """A run name nobody used: a reused Ray Train name resumes that run."""
    return f"t-{uuid.uuid4().hex[:10]}"
