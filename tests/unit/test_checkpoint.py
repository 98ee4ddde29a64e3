"""Checkpoint files: atomic writes, verification, and which checkpoint a restart resumes from. No Ray."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.engine.state import RNGState
from minimind_ray.fsio import atomic_write
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store import checkpoint as ck

LOCAL = pafs.LocalFileSystem()


def _write_checkpoint(run_dir: Path, step: int, world: int = 2) -> Path:
    """What every rank of a ``world``-worker group leaves in storage for one report."""
    d = run_dir / f"checkpoint_2026-11-29_00-00-{step:02d}.000000"
    model = build_model(ModelConfig(**preset_values("tiny")), seed=step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for r in range(world):
        ck.write_rank_files(d, r, RNGState().state_dict())
    meta = ck.CheckpointMeta(step=step, epoch=0, data_state={}, world_size=world, stage="pretrain", total_steps=8,
                             config={}, prepared_dir="/nowhere")
    ck.write_shared_files(d, model_state=model.state_dict(),
                          train_state={"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, meta=meta)
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
        atomic_write(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_writes_get_the_mode_of_any_new_file_not_mkstemps_0600(tmp_path):
    import os
    import stat

    from minimind_ray.fsio import write_text_atomic

    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
        (tmp_path / "plain").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) \
        == 0o640


def test_verify_refuses_incomplete_checkpoints(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    assert ck.open_checkpoint(newest).step == 8
    (newest / ck.MODEL).write_bytes((newest / ck.MODEL).read_bytes()[:100])  # cut short
    with pytest.raises(ck.CheckpointError, match="model.pth missing or of the wrong size"):
        ck.open_checkpoint(newest)
    assert ck.open_checkpoint(ck.latest_checkpoint(run_dir)).step == 4  # the newest *complete* one

    older = ck.latest_checkpoint(run_dir)
    (older / "rng" / "rank_1.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="rng/rank_1.pt missing"):
        ck.open_checkpoint(older)
    (older / ck.COMPLETE).unlink()
    with pytest.raises(ck.CheckpointError, match="not finished"):
        ck.open_checkpoint(older)
    assert ck.latest_checkpoint(run_dir) is None


def test_deep_verify_reads_every_rank_file(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    rng1 = newest / "rng" / "rank_1.pt"
    rng1.write_bytes(rng1.read_bytes()[:50])  # a rank killed while uploading: size unknown to rank 0
    assert ck.open_checkpoint(newest).step == 8
    with pytest.raises(ck.CheckpointError, match="rank_1.pt: unreadable"):
        ck.open_checkpoint(newest, deep=True)
    assert ck.open_checkpoint(ck.latest_checkpoint(run_dir, deep=True)).step == 4


def test_restart_resumes_from_a_newer_checkpoint_ray_did_not_register(run_dir):
    ckpts = {ck.open_checkpoint(p).step: Path(p) for _, p in ck.checkpoints_in(run_dir)}
    assert sorted(ckpts) == [4, 8]
    # a hard kill after step 8's upload: Ray's controller only registered step 4
    chosen = ck.choose_restore((str(ckpts[4]), LOCAL), str(run_dir))
    assert chosen.step == 8 and chosen.meta().step == 8
    # nothing registered yet (the crash came before Ray collected the first report)
    assert ck.choose_restore(None, str(run_dir)).step == 8
    # Ray's registered checkpoint is the newest: it is the one used
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).path == str(ckpts[8])
    # the newer one is unusable: Ray's stands
    (ckpts[8] / "rng" / "rank_0.pt").write_bytes(b"PK")
    assert ck.choose_restore((str(ckpts[4]), LOCAL), str(run_dir)).path == str(ckpts[4])
    # a fresh run: nothing anywhere
    assert ck.choose_restore(None, str(run_dir.parent / "fresh")) is None


def test_checkpoints_on_a_uri_filesystem(run_dir, tmp_path):
    uri = f"file://{run_dir}"
    assert ck.latest_checkpoint(uri) == f"{uri}/{ck.latest_checkpoint(run_dir).name}"
    assert ck.choose_restore(None, uri).step == 8
    shutil.rmtree(run_dir)
    assert ck.latest_checkpoint(uri) is None


def test_prune_untracked_removes_only_what_ray_does_not_keep(run_dir):
    (run_dir / "checkpoint_2026-11-29_00-00-09.000000").mkdir()  # an upload a crash cut short
    names = sorted(p.name for p in run_dir.iterdir())
    kept = {names[1]}  # Ray kept step 8 only; step 4 was never registered
    assert ck.prune_untracked(run_dir, kept) == [names[0], names[2]]
    assert sorted(p.name for p in run_dir.iterdir()) == [names[1]]
    assert ck.prune_untracked(run_dir.parent / "absent", kept) == []


@pytest.mark.parametrize("record", ['{"step": 2}', "[]", '{"files": [], "rng_ranks": [0], "step": 8}', "not json"])
def test_a_malformed_complete_marker_is_refused_and_the_older_checkpoint_used(run_dir, record):
    """Issue 11, item 10: a malformed COMPLETE.json is a refusal naming the checkpoint, not a crash of
    the search, and the restart falls back to the newest good checkpoint."""
    ckpts = {ck.open_checkpoint(p).step: Path(p) for _, p in ck.checkpoints_in(run_dir)}
    (ckpts[8] / ck.COMPLETE).write_text(record)
    with pytest.raises(ck.CheckpointError, match=str(ckpts[8].name)):
        ck.open_checkpoint(ckpts[8])
    assert [s for s, _ in ck.checkpoints_in(run_dir)] == [4]
    assert ck.latest_checkpoint(run_dir) == ckpts[4]
    # Ray registered the malformed one: the restart says why it is unusable and takes the older good one
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).step == 4


def test_meta_round_trips_and_names_the_file_when_malformed(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    meta = ck.open_checkpoint(newest).meta()
    assert meta.step == 8 and meta.world_size == 2 and meta.extra == {}
    d = json.loads((newest / ck.META).read_text())
    assert ck.CheckpointMeta.from_json({**d, "added_later": 1}).to_json() == {**d, "added_later": 1}
    with pytest.raises(ck.CheckpointError, match="meta.json: missing"):
        ck.CheckpointMeta.from_json({"step": 1}, "x/meta.json")
