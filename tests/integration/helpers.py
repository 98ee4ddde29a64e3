"""Shared helpers of the integration tests: run the tiny recipe, read back what a run left."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

from minimind_ray.config import load_config, resolve_run
from minimind_ray.store.checkpoint import MODEL

STEPS, CKPT_EVERY, GLOBAL_BATCH = 12, 4, 16
REPO = Path(__file__).resolve().parents[2]


def build_wheel(dest: Path, local_version: str = "") -> Path:
    """The project's wheel, built from a copy of what a wheel holds (the build writes build/ and *.egg-info beside its
    source). ``local_version``: a label added to the version (``0.1.0+label``), so that pip installs the wheel where
    this checkout's editable install of the same version would otherwise count as already there."""
    src = dest / "src"
    src.mkdir(parents=True)
    project = (REPO / "pyproject.toml").read_text()
    if local_version:
        project = re.sub(r'^version = "([^"]+)"', rf'version = "\1+{local_version}"', project, count=1, flags=re.M)
    (src / "pyproject.toml").write_text(project)
    for d in ("minimind_ray", "pipelines"):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(dest / "dist"), str(src)], cwd=dest, text=True, capture_output=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (dest / "dist").glob("minimind_ray-*.whl")
    return wheel


def new_shared(tmp_path_factory, name):
    base = tmp_path_factory.mktemp(name)
    return {"base": base, "cache": base / "data_cache", "mlflow": f"sqlite:///{base}/mlflow.db"}


def new_shared_with_base_weights(tmp_path_factory, name):
    """new_shared plus ``base_pth``: the "earlier weights" a stage starts from, a MiniMind-style .pth of the
    tiny model (fp32, so base weights compare bitwise)."""
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import save_pth

    s = new_shared(tmp_path_factory, name)
    base = build_model(load_config("pipelines/configs/tiny.yaml").model, seed=11)
    s["base_pth"] = s["base"] / "base.pth"
    save_pth(base, str(s["base_pth"]), dtype=torch.float32)
    return s


def run_tiny(shared, name, *overrides, steps=STEPS, ckpt_every=CKPT_EVERY):
    from minimind_ray.raytrain.driver import run

    base = shared["base"]
    return run(resolve_run("pipelines/configs/tiny.yaml", [
        f"name={name}", f"train.max_steps={steps}", f"checkpoint.interval={ckpt_every}", "train.log_interval=2",
        f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=4", f"data.cache_dir={shared['cache']}",
        f"checkpoint.storage_path={base / 'runs'}", f"tracking.uri={shared['mlflow']}",
        f"train.sample_log_dir={base / 'samples' / name}", "train.collective_timeout_s=60", *overrides]))


def final_weights(res):
    return torch.load(Path(res.checkpoint_dir) / MODEL, map_location="cpu", weights_only=True)


def loss_history(shared, run_id, key="train/loss"):
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(shared["mlflow"]).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)


def sample_record(shared, name):
    """step -> set of sample ids trained at that step (union over ranks and replays), and the attempts seen."""
    per_step, attempts = defaultdict(set), set()
    for f in (shared["base"] / "samples" / name).glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            per_step[r["step"]].update(r["ids"])
            attempts.add(r["attempt"])
    return per_step, attempts


def assert_exactly_once(per_step, steps=STEPS, global_batch=GLOBAL_BATCH):
    assert sorted(per_step) == list(range(1, steps + 1))
    seen = set()
    for s in range(1, steps + 1):
        # a replayed step that drew different samples would show more than one global batch here
        assert len(per_step[s]) == global_batch, f"step {s}: {len(per_step[s])} distinct samples"
        assert not (per_step[s] & seen), f"step {s} repeats samples of an earlier step"
        seen |= per_step[s]


