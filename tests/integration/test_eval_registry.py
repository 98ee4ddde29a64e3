"""A user's own eval task kind (``package.module:Class``, issue 33 item 5) scored by ``eval --workers 1`` over a Ray
task: its package lies in a temporary folder that only the verb's process has on ``sys.path`` (no PYTHONPATH
entry, not its working directory, which Ray's workers also get), so the Ray task can load it only through what
evals/parallel.py ships (``py_modules``). The verb runs in a process of its own because Ray takes local
``py_modules`` when it starts, and this test process may hold the session's Ray already. Its result is the one of
this process without workers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.run import evaluate_task
from tests.unit.test_eval_registry import user_task  # noqa: F401  (a fixture)
from tests.unit.test_evals import TOKENIZER, model, weights  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
VERB = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from minimind_ray.cli import main; "
        "sys.exit(main(sys.argv[1:]))")


def test_a_user_kind_reaches_the_ray_workers_that_score_it(user_task, weights, tmp_path):
    name, data, package_dir = user_task
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "spread.json"
    verb = subprocess.run([sys.executable, "-c", VERB, str(package_dir.parent), "eval", weights, "--tokenizer",
                           str(TOKENIZER), "--task", name, "--data", data, "--batch-size", "2", "--workers", "1",
                           "--out", str(out), "--log-samples"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert verb.returncode == 0, verb.stderr[-3000:]
    spread = json.loads(out.read_text())
    records = [json.loads(line) for line in Path(spread["samples_file"]).read_text().splitlines()]
    alone = evaluate_task(weights, EvalTaskConfig(task=name, data=data, batch_size=2), tokenizer=str(TOKENIZER))
    assert spread["kind"] == name and spread["n"] == alone["n"] == 6
    assert [r["hit"] for r in records] == [d["hit"] for d in alone["details"]]
    assert [r["logprob"] for r in records] == pytest.approx([d["logprob"] for d in alone["details"]], abs=1e-5)
    assert spread["last_token_logprob"] == pytest.approx(alone["last_token_logprob"], abs=1e-5)
