"""Integration fixtures: a real MLflow tracking server.

Starting one costs about 10 s on 2 cores (``--workers 1`` and no job execution; 20 s with
the defaults), so one server serves a whole test module. A test may leave it stopped: the
next test that asks for it starts it again.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store and proxied artifacts in ``root``.

    ``stop()`` and ``start()`` keep the port and the store, so a test can take the server
    away mid-run and bring the same one back.
    """

    def __init__(self, root: Path, start_timeout_s: float = 90.0, store: str | None = None, artifacts: str = ""):
        """``store``: serve an existing backend store (a tracked run's ``sqlite:///...``) instead of ``root``'s;
        ``artifacts``: a folder, or a bucket (s3://...: issue 49)."""
        self.root = root
        self.store = store or f"sqlite:///{root / 'mlflow.db'}"
        self.artifacts = artifacts or str(root / "artifacts")
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", self.store,
               "--artifacts-destination", self.artifacts]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        log = open(self.root / "server.log", "ab")
        # its own session: the server's workers die with it, never with the test runner's group
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {self.start_timeout_s} s: {self._log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's parent, which stops its workers; SIGKILL its group if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def _log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _mlflow_server_running(request):
    """A test that stopped the module's server (the server going away mid-run) need not start it again (~10 s)
    unless it needs it back itself: the next test of the module that asks for it gets it started here."""
    if "mlflow_server" in request.fixturenames:
        server = request.getfixturevalue("mlflow_server")
        if server.proc is None:
            server.start()


from .local_cluster import cluster_env  # noqa: E402,F401  (a fixture for the tests that start their own cluster)


@pytest.fixture(scope="session")
def tiny_baseline(ray_session, tmp_path_factory):
    """The uninterrupted 2-worker tiny run that recovery tests compare with, trained once per test run:
    (its shared dirs, the result, its final weights, its per-step losses). A run's weights do not depend
    on its name, storage, tracking or fault settings, so any run of helpers.run_tiny's training settings
    must end bit-identical to it.

    Under pytest-xdist the workers share one: the first to ask trains it under a file lock in the run's
    common temp root and leaves its result there; the others wait on the lock and read it (the run's
    files and MLflow store are on disk, read by path)."""
    import fcntl
    import pickle

    from .helpers import final_weights, loss_history, new_shared, run_tiny

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    done = root / "tiny_baseline.pkl"
    with open(root / "tiny_baseline.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            shared, res = pickle.loads(done.read_bytes())
        else:
            shared = new_shared(tmp_path_factory, "baseline")
            # It also evaluates its checkpoints on the side (eval.tasks never change what is trained): the demo's
            # multiple-choice set at every checkpoint, and a task whose file is missing, which must fail alone
            # (tests/integration/test_evals.py reads what they left, and scores each step's checkpoint again: all
            # three are kept).
            res = run_tiny(shared, "baseline-2w", "eval.interval=4", "checkpoint.num_to_keep=3",
                           "eval.tasks=[{task: mc, data: 'demo:mc_eval', limit: 24}, "
                           "{task: gen, data: /nonexistent/prompts.jsonl, name: missing}]")
            done.write_bytes(pickle.dumps((shared, res)))
    return shared, res, final_weights(res), loss_history(shared, res.mlflow_run_id)
