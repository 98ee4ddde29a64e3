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

from tests.skip_budget import SkipBudget, missing

REPO = Path(__file__).resolve().parents[1]
SHARED_MINIMIND = Path(os.environ.get("MINIMIND_SHARED", REPO.parent / "shared" / "minimind"))

# Must be set before Ray starts: its processes inherit this environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")  # report() is a barrier polled at this interval
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
# The S3-protocol server's endpoint and credentials (cluster/local/s3_server.py), in the standard AWS variables
# before any Ray starts: every node of the session's Ray has them, as a real cluster's nodes would (never a
# runtime_env's env_vars)
from cluster.local import s3_server  # noqa: E402

S3_STORE = s3_server.reserve()

# Named tokenizers (data.tokenizer=minimind2|minimind3|auto) go through the real fetch code with a mirror, into a cache
# of this session: tests never write to the user's ~/.cache. The mirror is ../shared/minimind (MINIMIND_SHARED); where
# it is missing, MiniMind's tokenizers are fetched once by the project's own code (GitHub at the pinned commit, sha256
# checked) into a directory of this machine's temp dir, which is then the mirror. Where that fails too, the tests that
# need them are skipped with the reason (tests/skip_budget.py:missing; under CI=true they fail with it). The first test
# process decides; the processes it starts (xdist's workers, Ray's) inherit its answer.
_MIRROR_ENV, _MIRROR_MISSING_ENV = "MINIMIND_RAY_TEST_TOKENIZERS", "MINIMIND_RAY_TEST_TOKENIZERS_MISSING"


def _tokenizer_mirror() -> tuple:
    """(a directory laid out as <name>/tokenizer.json holding MiniMind's tokenizers, or None; why not, one line)."""
    from minimind_ray.tokenizer_fetch import PINNED, TokenizerFetchError, fetch_tokenizer

    if all((SHARED_MINIMIND / name / "tokenizer.json").exists() for name in PINNED):
        return SHARED_MINIMIND, ""
    fetched = Path(tempfile.gettempdir()) / f"minimind-ray-test-tokenizers-{os.getuid()}"
    try:
        for name in PINNED:
            fetch_tokenizer(name, cache_dir=str(fetched), mirror="")  # "": GitHub, not this environment's mirror
    except TokenizerFetchError as e:
        return None, f"MiniMind's tokenizers: no mirror at {SHARED_MINIMIND} (set MINIMIND_SHARED), and {e}"
    return fetched / "tokenizers", ""


if _MIRROR_ENV in os.environ:
    TOKENIZER_MIRROR = Path(os.environ[_MIRROR_ENV]) if os.environ[_MIRROR_ENV] else None
    TOKENIZERS_MISSING = os.environ.get(_MIRROR_MISSING_ENV, "")
else:
    TOKENIZER_MIRROR, TOKENIZERS_MISSING = _tokenizer_mirror()
    os.environ[_MIRROR_ENV], os.environ[_MIRROR_MISSING_ENV] = str(TOKENIZER_MIRROR or ""), TOKENIZERS_MISSING
# Forced, not defaulted, so the run is hermetic.
os.environ["MINIMIND_RAY_TOKENIZER_MIRROR"] = str((TOKENIZER_MIRROR or SHARED_MINIMIND).resolve())
# One cache per test process. A process it starts that imports a test module (a Ray worker unpickling a reward term
# of tests/unit) inherits the cache instead of making one it would never remove: Ray kills its workers, atexit never
# runs. (An xdist worker is a test process of its own: PYTEST_XDIST_WORKER tells it from its parent.)
_CACHE_OWNER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_INHERITED_CACHE = os.environ.get("MINIMIND_RAY_CACHE_DIR", "")
_OWNED = os.environ.get("MINIMIND_RAY_TEST_CACHE_OWNER") == _CACHE_OWNER
if _OWNED and _INHERITED_CACHE and Path(_INHERITED_CACHE).is_dir():
    TEST_CACHE_DIR = _INHERITED_CACHE
else:
    TEST_CACHE_DIR = tempfile.mkdtemp(prefix="minimind-ray-test-cache-")
    os.environ["MINIMIND_RAY_CACHE_DIR"] = TEST_CACHE_DIR
    os.environ["MINIMIND_RAY_TEST_CACHE_OWNER"] = _CACHE_OWNER
    atexit.register(shutil.rmtree, TEST_CACHE_DIR, True)


def minimind_tokenizer_dir(generation: str) -> Path:
    """MiniMind's own tokenizer from the mirror, or skip the test with the reason (under CI=true: fail with it)."""
    if TOKENIZER_MIRROR is None:
        missing(TOKENIZERS_MISSING)
    return TOKENIZER_MIRROR / generation


# Ray forwards its actors' log lines to the driver's stderr ("(Name pid=N) ..."), in colour or not,
# at any moment: a test that asserts the CLI printed exactly one line must not count them.
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\((\w+ )?pid=\d+(, ip=[\d.]+)?\)")


def cli_stderr(capsys) -> str:
    """What the code under test wrote to stderr since the last read, without Ray's forwarded log lines."""
    err = capsys.readouterr().err
    return "\n".join(line for line in err.splitlines() if not _RAY_FORWARDED.match(line)).strip()


# Under pytest-xdist (``make test``: ``-n 2 --dist loadfile --no-loadscope-reorder``) each test file is one
# unit of work, except that the files which start a Ray of their own (a 3-node local cluster, a sweep's local Ray, the
# wheel's run in a venv of its own) form one unit: they run one after another in one process, never two cluster starts at once (two 3-node starts side
# by side, at load 28, timed out 3 tries in a row). Units go out heaviest first (seconds measured in a one-process run
# on 2 cores), so that no long file is left to run alone at the end: xdist's own order (most tests first) put the
# single-test heavy files last. (xdist_group marks would say the same, but xdist 3.8 sets ``item._nodeid``, which
# pytest 9 no longer reads: the marks are ignored, hence a scheduler of our own.)
OWN_RAY = ("integration/test_node_faults.py", "integration/test_local_cluster.py",
           "integration/test_sweep.py", "integration/test_wheel.py")
HEAVIEST_FIRST = tuple(f"integration/test_{n}.py" for n in (
    "training", "grpo", "tracking_training", "object_storage", "pipeline", "serve", "recipes", "resume", "evals",
    "stages", "oom")) + (
    "unit/test_precision.py", "integration/test_use_model.py", "integration/test_mlflow_ui.py",
    "integration/test_tracking.py", "integration/test_cli_errors.py",
    "integration/test_data_pipeline.py",
    # issue 36's: 33 s and 28 s at load 5, 100 s and 87 s at load 30; before the many small files
    "integration/test_fsdp_ray.py", "unit/test_fsdp.py")


def _by_file(config) -> bool:
    """``--dist loadfile``, in the controller, or as the controller told a worker (xdist sets a worker's dist to "no")."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput.get("mmr_by_file", False) if workerinput is not None else config.getvalue("dist") == "loadfile"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the process that reports: xdist's controller, or the only one
        config.pluginmanager.register(SkipBudget(), "minimind-ray-skip-budget")


def pytest_configure_node(node):
    """xdist's controller, for each worker it starts."""
    node.workerinput["mmr_by_file"] = _by_file(node.config)


def _in_tests(path) -> str:
    """``integration/test_x.py``: a test file's path under tests/ (unit/ and integration/ share some names)."""
    return Path(path).resolve().relative_to(REPO / "tests").as_posix()


def _heaviest_first(path_in_tests: str) -> tuple:
    if path_in_tests in OWN_RAY:
        return (0, OWN_RAY.index(path_in_tests))
    if path_in_tests in HEAVIEST_FIRST:
        return (1, HEAVIEST_FIRST.index(path_in_tests))
    return (2, 0)


SOAK = REPO / "tests" / "soak"


def _soak_asked(config) -> bool:
    """The checks of tests/soak/ (minutes to hours, a GPU, llama.cpp) run only when asked for: ``-m`` names the
    ``soak`` marker, or the command names a path inside tests/soak/. ``make test`` (``pytest tests``) leaves them out."""
    named = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return "soak" in (config.option.markexpr or "") or any(p == SOAK or SOAK in p.parents for p in named)


def pytest_collection_modifyitems(config, items):
    if not _soak_asked(config):  # deselected, not skipped: tests/skip_budget.py counts skips only
        soak = [i for i in items if SOAK in Path(i.path).parents or i.get_closest_marker("soak")]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [i for i in items if i not in soak]
    if hasattr(config, "workerinput") and _by_file(config):  # each worker collects; its order is the units'
        items.sort(key=lambda item: _heaviest_first(_in_tests(item.path)))  # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    if not _by_file(config):
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByFileOwnRayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]  # relative to the rootdir, the repository
            return "own-ray" if _in_tests(REPO / path) in OWN_RAY else path

    return ByFileOwnRayTogether(config, log)


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


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 with the bucket ``mmr-test``, behind the proxy every client reaches
    (AWS_ENDPOINT_URL): cluster/local/s3_server.py."""
    return s3_server.store()


@pytest.fixture
def fresh_name():
    """A run name nobody used: a reused Ray Train name resumes that run."""
    return f"t-{uuid.uuid4().hex[:10]}"
