"""The package as a user installs it: the wheel, in an empty venv, with what pyproject.toml declares and nothing else.

`make` installs the lock and then the project with --no-deps, so the suite alone would never notice a dependency the
code imports but pyproject.toml forgets. Here the wheel goes into a venv of its own with pip resolving its declared
dependencies (the lock's pins, requirements.txt, only as constraints, so the versions are the tested ones), without the
test extras; then `minimind-ray pretrain` runs the tiny recipe to its end on a Ray of its own, and a run that needs
an extra the venv lacks (a reward model needs transformers, the hf extra) is refused in one line naming the extra.
uv (or pip) reuses its cache, so the install costs copying and byte-compiling, not downloading.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .helpers import REPO, build_wheel

pytestmark = pytest.mark.integration


def run(args, cwd, env=None, timeout=900):
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    with zipfile.ZipFile(wheel) as z:  # what a non-editable install needs besides the code
        names = set(z.namelist())
    assert {"pipelines/configs/tiny.yaml", "minimind_ray/serve/static/index.html"} <= names, sorted(names)[:20]

    venv = base / "venv"
    made = run([sys.executable, "-m", "venv", venv], cwd=base)
    assert made.returncode == 0, made.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # the lock's pins without its hashes: with hashes pip's hash-checking mode refuses the wheel's own torch range
    # against the lock's torch==2.13.0 when the file it finds is 2.13.0+cpu (what make installs checks the hashes)
    pins = base / "pins.txt"
    pins.write_text("".join(f"{m.group(0)}\n" for m in re.finditer(r"^[A-Za-z0-9_.-]+==\S+",
                                                                  (REPO / "requirements.txt").read_text(), re.M)))
    uv = Path(sys.executable).parent / "uv"  # make installs it (the Makefile); it resolves as pip does, faster
    if uv.exists():  # the find-links pip is configured with (this machine's CPU torch), which uv does not read
        links = run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], cwd=base).stdout.split()
        install = [uv, "pip", "install", "-q", "--compile-bytecode", "--python", venv / "bin/python",
                   *[a for d in links for a in ("--find-links", d)]]
    else:
        install = [venv / "bin/python", "-m", "pip", "install", "-q"]
    # byte-compiled as make does: every Ray process would otherwise compile Ray from source (PYTHONDONTWRITEBYTECODE)
    installed = run([*install, "-c", pins, wheel], cwd=base, env=env)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, env


def test_the_wheel_alone_runs_the_tiny_recipe_and_names_a_missing_extra(wheel_venv, tmp_path):
    venv, env = wheel_venv
    py = venv / "bin/python"
    # the run's set only: no test extra, no hf or s3 extra, and the project from the wheel, not this checkout
    where = run([py, "-c", "import importlib.util as u, minimind_ray; print(minimind_ray.__file__); "
                 "print([m for m in ('transformers', 'boto3', 'pytest', 'moto', 'lm_eval') if u.find_spec(m)])"],
                cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr[-2000:]
    path, extras = where.stdout.split("\n")[:2]
    assert path.startswith(str(venv)) and extras == "[]", where.stdout

    common = ["--config", REPO / "pipelines/configs/tiny.yaml", "train.max_steps=4", "checkpoint.interval=4",
              "train.log_interval=2", f"data.cache_dir={tmp_path / 'cache'}",
              f"checkpoint.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    pretrain = run([venv / "bin/minimind-ray", "pretrain", *common], cwd=tmp_path, env=env)
    assert pretrain.returncode == 0, pretrain.stdout[-3000:] + pretrain.stderr[-3000:]
    assert (tmp_path / "runs" / "pretrain-latest").exists(), sorted(p.name for p in (tmp_path / "runs").iterdir())

    reward_dir = tmp_path / "reward_model"
    reward_dir.mkdir()
    grpo = run([venv / "bin/minimind-ray", "grpo", *common, f"train.init_from={tmp_path / 'runs' / 'pretrain-latest'}",
                "data.format=prompt", f"train.grpo.rewards=[{{name: reward_model, path: {reward_dir}}}]"],
               cwd=tmp_path, env=env)
    lines = grpo.stderr.strip().splitlines()
    assert grpo.returncode == 2 and lines == [
        "config error: train.grpo.rewards[0]: a reward model needs transformers, which is not installed here: "
        "pip install 'minimind-ray[hf]'"], (grpo.returncode, grpo.stdout[-2000:], grpo.stderr[-3000:])
