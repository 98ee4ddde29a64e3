"""Retention never counts a refused checkpoint (issue 54, item 3; store/retention.py). A checkpoint Ray Train registered
that no longer verifies (a file truncated by hand; a rank's file missing in a bucket) is moved aside to
``refused-<name>`` before Ray starts, and taken out of Ray's snapshot: Ray's own checkpoint manager (the real one,
loaded from that snapshot as a rerun's controller loads it) restores the one before, and counts only checkpoints that
verify among ``checkpoint.num_to_keep``, so the good one before the refused one is not deleted in its place. No Ray
cluster: Ray Train's CheckpointManager runs on its own, on an event loop of the test's."""
from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pyarrow.fs as pafs
from ray.train import Checkpoint, CheckpointConfig
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.storage import StorageContext
from ray.train.v2._internal.execution.training_report import _TrainingReport

from minimind_ray.fsio import filesystem, upload_dir
from minimind_ray.store import checkpoint as ck
from minimind_ray.store.retention import REFUSED, REFUSED_KEPT, set_aside_refused
from tests.unit.test_object_storage import _local_checkpoint


def _ray_keeps(storage: str, name: str, steps_and_dirs, num_to_keep: int = 2):
    """Ray Train's checkpoint manager of run ``name`` (its snapshot loaded, as a controller does), after registering
    ``steps_and_dirs`` in order: (the checkpoint it would restore, the names it keeps)."""
    async def go():
        fs, root = filesystem(storage)
        manager = CheckpointManager(CheckpointConfig(num_to_keep=num_to_keep),
                                    StorageContext(root, name, storage_filesystem=fs))
        restore = manager.latest_checkpoint_result
        for step, path in steps_and_dirs:
            manager.register_checkpoint(_TrainingReport(Checkpoint(path, filesystem=fs), {"step": step}, False))
        return (None if restore is None else Path(restore.checkpoint.path).name,
                [Path(r.checkpoint.path).name for r in manager.best_checkpoint_results])
    return asyncio.run(go())


def _names(run_dir: str) -> set:
    fs, root = filesystem(run_dir)
    return {e.base_name for e in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
            if e.type == pafs.FileType.Directory}


def _run_with_two_checkpoints(tmp_path: Path, storage: str, run_dir: str):
    """Steps 2 and 4 written (each a 2-rank checkpoint) and registered by Ray Train, num_to_keep=2."""
    dirs = {}
    for step in (2, 4):
        d = _local_checkpoint(tmp_path / "staging", step)
        dirs[step] = f"{run_dir}/{d.name}"
        if run_dir.startswith("s3://"):
            upload_dir(d, dirs[step])
        else:
            Path(dirs[step]).parent.mkdir(parents=True, exist_ok=True)
            d.rename(dirs[step])
    _ray_keeps(storage, Path(run_dir).name, [(s, filesystem(dirs[s])[1]) for s in (2, 4)])
    return dirs


def _check_retention(tmp_path, storage, run_dir, dirs, why):
    step2, step4 = Path(dirs[2]).name, Path(dirs[4]).name
    lines = set_aside_refused(run_dir)
    assert len(lines) == 1 and lines[0].startswith(f"{dirs[4]}: {why}") and f"{REFUSED}{step4}" in lines[0], lines
    assert _names(run_dir) == {step2, f"{REFUSED}{step4}"}
    assert ck.newest_complete(run_dir).step == 2
    # the rerun: Ray restores step 2, then registers the rerun's steps 4 and 6; the good step 2 goes only when two
    # newer checkpoints that verify are kept, never for the refused one
    new4, new6 = (_local_checkpoint(tmp_path / "rerun", s) for s in (4, 6))
    _, root = filesystem(run_dir)
    targets = []
    for d in (new4, new6):
        name = d.name.replace("2026-12-06", "2026-12-07")  # a later attempt's names
        upload_dir(d, f"{run_dir}/{name}") if run_dir.startswith("s3://") else d.rename(Path(run_dir) / name)
        targets.append(f"{root}/{name}")
    restored, kept_after_4 = _ray_keeps(storage, Path(run_dir).name, [(4, targets[0])])
    assert restored == step2 and kept_after_4 == [step2, Path(targets[0]).name]
    assert step2 in _names(run_dir)  # not deleted in place of the refused one
    _, kept = _ray_keeps(storage, Path(run_dir).name, [(6, targets[1])])
    assert kept == [Path(t).name for t in targets] and step2 not in _names(run_dir)
    assert f"{REFUSED}{step4}" in _names(run_dir)  # kept for inspection


def test_a_truncated_file_is_set_aside_and_never_counted(tmp_path):
    storage = str(tmp_path / "runs")
    run_dir = f"{storage}/run"
    dirs = _run_with_two_checkpoints(tmp_path, storage, run_dir)
    model = Path(dirs[4]) / "model.pth"
    model.write_bytes(model.read_bytes()[:100])  # truncated by hand
    _check_retention(tmp_path, storage, run_dir, dirs, "model.pth missing or of the wrong size")


def test_a_rank_file_missing_in_a_bucket_is_set_aside_and_never_counted(s3, tmp_path):
    storage = s3.uri("unit", uuid.uuid4().hex[:8])
    run_dir = f"{storage}/run"
    dirs = _run_with_two_checkpoints(tmp_path, storage, run_dir)
    key = dirs[4].split(f"{s3.uri()}/", 1)[1]
    s3.client().delete_object(Bucket="mmr-test", Key=f"{key}/rng/rank_1.pt")  # a rank's file never arrived
    _check_retention(tmp_path, storage, run_dir, dirs, "rng/rank_1.pt missing")


def test_refused_checkpoints_are_kept_up_to_a_bound_and_unfinished_ones_left_to_the_run(tmp_path):
    run = tmp_path / "run"
    for step in range(1, REFUSED_KEPT + 3):
        d = _local_checkpoint(run, step)
        (d / "train_state.pt").write_bytes(b"cut")
    unfinished = _local_checkpoint(run, 40)
    (unfinished / ck.COMPLETE).unlink()  # an upload cut before its marker: never registered, pruned at the run's end
    lines = set_aside_refused(str(run))
    assert len(lines) == REFUSED_KEPT + 2
    refused = sorted(n for n in _names(str(run)) if n.startswith(REFUSED))
    assert len(refused) == REFUSED_KEPT and refused[-1].endswith(f"-{REFUSED_KEPT + 2:02d}.000000")
    assert unfinished.name in _names(str(run))
    assert set_aside_refused(str(run)) == []  # nothing left to refuse


def test_a_snapshot_naming_a_deleted_checkpoint_no_longer_stops_ray(tmp_path):
    """Issue 54, item 1's aftermath: two writers left Ray's snapshot naming a checkpoint one of them deleted, and
    raising train.max_steps then failed in Ray's CheckpointManagerInitializationError. The snapshot loses what is
    gone, so Ray's manager loads it and restores the newest that is there."""
    storage = str(tmp_path / "runs")
    run_dir = f"{storage}/run"
    dirs = _run_with_two_checkpoints(tmp_path, storage, run_dir)
    shutil.rmtree(dirs[4])  # deleted by the other writer
    assert set_aside_refused(run_dir) == []
    restored, kept = _ray_keeps(storage, "run", [])
    assert restored == Path(dirs[2]).name and kept == [Path(dirs[2]).name]
