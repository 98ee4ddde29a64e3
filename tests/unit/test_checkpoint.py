"""Checkpoint files: atomic writes, verification, and which checkpoint a restart resumes from."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ray.train import Checkpoint

from minimind_ray.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.train import checkpoint as ck


def _write_checkpoint(run_dir: Path, step: int, world: int = 2) -> Path:
    """What every rank of a ``world``-worker group leaves in storage for one report."""
    d = run_dir / f"checkpoint_2026-11-29_00-00-{step:02d}.000000"
    model = build_model(ModelConfig(**preset_values("tiny")), seed=step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for r in range(world):
        ck.write_rank_files(d, r)
    ck.write_rank0_files(d, model_state=model.state_dict(), optimizer=opt, scheduler=sched,
                         meta={"step": step, "world_size": world}, world_size=world)
    return d


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    for step in (4, 8):
        _write_checkpoint(run, step)
    return run


def test_atomic_write_leaves_nothing_when_the_write_fails(tmp_path):
    target = tmp_path / "x.pt"

    def half_then_fail(tmp):
        Path(tmp).write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ck._atomic_write_bytes(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_verify_refuses_incomplete_checkpoints(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    assert ck.verify(newest)["step"] == 8
    (newest / ck.MODEL).write_bytes((newest / ck.MODEL).read_bytes()[:100])  # cut short
    with pytest.raises(ck.CheckpointError, match="model.pth missing or of the wrong size"):
        ck.verify(newest)
    assert ck.verify(ck.latest_checkpoint(run_dir))["step"] == 4  # the newest *complete* one

    older = ck.latest_checkpoint(run_dir)
    (older / "rng" / "rank_1.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="rng/rank_1.pt missing"):
        ck.verify(older)
    (older / ck.COMPLETE).unlink()
    with pytest.raises(ck.CheckpointError, match="not finished"):
        ck.verify(older)
    assert ck.latest_checkpoint(run_dir) is None


def test_deep_verify_reads_every_rank_file(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    rng1 = newest / "rng" / "rank_1.pt"
    rng1.write_bytes(rng1.read_bytes()[:50])  # a rank killed while uploading: size unknown to rank 0
    assert ck.verify(newest)["step"] == 8
    with pytest.raises(ck.CheckpointError, match="rank_1.pt unreadable"):
        ck.verify(newest, deep=True)
    assert ck.verify(ck.latest_checkpoint(run_dir, deep=True))["step"] == 4


def test_restart_resumes_from_a_newer_checkpoint_ray_did_not_register(run_dir):
    ckpts = {ck.verify(p)["step"]: Path(p) for _, p in ck.checkpoints_in(run_dir)}
    assert sorted(ckpts) == [4, 8]
    # a hard kill after step 8's upload: Ray's controller only registered step 4
    chosen = ck.restore_point(Checkpoint.from_directory(str(ckpts[4])), str(run_dir), rank=0, world=1)
    assert ck.verify(chosen.path, filesystem=chosen.filesystem)["step"] == 8
    with chosen.as_directory() as d:
        assert ck.read_meta(Path(d))["step"] == 8
    # nothing registered yet (the crash came before Ray collected the first report)
    chosen = ck.restore_point(None, str(run_dir), rank=0, world=1)
    assert ck.verify(chosen.path, filesystem=chosen.filesystem)["step"] == 8
    # Ray's registered checkpoint is the newest: it is the one used
    registered = Checkpoint.from_directory(str(ckpts[8]))
    assert ck.restore_point(registered, str(run_dir), rank=0, world=1) is registered
    # the newer one is unusable: Ray's stands
    (ckpts[8] / "rng" / "rank_0.pt").write_bytes(b"PK")
    registered = Checkpoint.from_directory(str(ckpts[4]))
    assert ck.restore_point(registered, str(run_dir), rank=0, world=1) is registered
    # a fresh run: nothing anywhere
    assert ck.restore_point(None, str(run_dir.parent / "fresh"), rank=0, world=1) is None


def test_checkpoints_on_a_uri_filesystem(run_dir, tmp_path):
    uri = f"file://{run_dir}"
    assert ck.latest_checkpoint(uri) == str(ck.latest_checkpoint(run_dir))
    chosen = ck.restore_point(None, uri, rank=0, world=1)
    assert ck.verify(chosen.path, filesystem=chosen.filesystem)["step"] == 8
    shutil.rmtree(run_dir)
    assert ck.latest_checkpoint(uri) is None


def test_prune_untracked_removes_only_what_ray_does_not_keep(run_dir):
    (run_dir / "checkpoint_2026-11-29_00-00-09.000000").mkdir()  # an upload a crash cut short
    names = sorted(p.name for p in run_dir.iterdir())
    kept = {names[1]}  # Ray kept step 8 only; step 4 was never registered
    assert ck.prune_untracked(run_dir, kept) == [names[0], names[2]]
    assert sorted(p.name for p in run_dir.iterdir()) == [names[1]]
    assert ck.prune_untracked(run_dir.parent / "absent", kept) == []
