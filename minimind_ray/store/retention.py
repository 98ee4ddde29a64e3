"""Retention never counts a refused checkpoint (issue 54, item 3).

Ray Train keeps ``checkpoint.num_to_keep`` of the checkpoints it registered, listed in its snapshot
(``<run_dir>/checkpoint_manager_snapshot.json``), and deletes the oldest when a new one registers. A registered
checkpoint that no longer verifies (a file truncated by hand, a rank's file lost in a bucket) is refused at restore,
and the run resumes from the one before; but Ray went on counting the refused one, and deleted the good one before it
in its place at the next registration. So before Ray starts on a run that resumes, :func:`set_aside_refused` moves
each checkpoint that does not verify aside, to ``refused-<name>`` beside it (kept for inspection; the newest
:data:`REFUSED_KEPT` of them), and takes it out of Ray's snapshot: Ray counts, keeps and restores only checkpoints
that verify, and the newest complete one is never the one it deletes. A checkpoint directory without a
``COMPLETE.json`` at all is not refused here: an upload cut short that Ray never registered, which the end of the run
removes as before (``prune_untracked``).
"""
from __future__ import annotations

import json
from typing import List, Optional

import pyarrow.fs as pafs

from minimind_ray.fsio import filesystem, join, redact, write_bytes_atomic
from minimind_ray.store.checkpoint import COMPLETE, PREFIX, CheckpointError, open_checkpoint

RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of a run's checkpoints (CHECKPOINT_MANAGER_SNAPSHOT_FILENAME)
REFUSED = "refused-"  # a refused checkpoint's directory, moved aside: refused-checkpoint_<date>
REFUSED_KEPT = 3  # refused checkpoints kept for inspection per run; older ones are removed


def set_aside_refused(run_dir: str) -> List[str]:
    """Move every checkpoint of ``run_dir`` that has a COMPLETE.json but does not verify to ``refused-<name>``, drop
    it (and any checkpoint no longer there) from Ray's snapshot, keep the newest :data:`REFUSED_KEPT` refused ones.
    Returns one line per checkpoint set aside, saying why."""
    fs, root = filesystem(run_dir)
    root = root.rstrip("/")
    try:
        entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return []
    lines, dropped = [], set()
    for e in sorted(entries, key=lambda e: e.base_name):
        if e.type != pafs.FileType.Directory or not e.base_name.startswith(PREFIX):
            continue
        if fs.get_file_info(f"{e.path}/{COMPLETE}").type != pafs.FileType.File:
            continue  # never finished: not Ray's to count unless it registered it (then dropped below, if gone)
        where = join(run_dir, e.base_name)
        try:
            open_checkpoint(e.path, fs, where=where)  # every listed file there at its size (no reads: cheap)
            continue
        except CheckpointError as refusal:
            why = " ".join(str(refusal).split())
        aside = f"{root}/{REFUSED}{e.base_name}"
        _move_dir(fs, e.path, aside)
        dropped.add(e.base_name)
        lines.append(redact(f"{why}: moved aside to {join(run_dir, REFUSED + e.base_name)}, never counted among "
                            f"checkpoint.num_to_keep"))
    _drop_from_snapshot(fs, root, run_dir, dropped)
    _keep_newest_refused(fs, root)
    return lines


def _move_dir(fs, src: str, dst: str) -> None:
    """A directory moved on any filesystem: a rename locally; a copy then a delete on object storage (no renames)."""
    if fs.get_file_info(dst).type != pafs.FileType.NotFound:
        fs.delete_dir(dst)  # an older refusal of the same name: this one is newer
    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(src, dst)
        return
    fs.create_dir(dst, recursive=True)
    pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)
    fs.delete_dir(src)


def _drop_from_snapshot(fs, root: str, run_dir: str, dropped: set) -> None:
    """Ray's snapshot without the checkpoints set aside, nor any it names that is no longer there (a snapshot naming a
    missing checkpoint fails Ray's start: CheckpointManagerInitializationError)."""
    path = f"{root}/{RAY_SNAPSHOT}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return
    with fs.open_input_stream(path) as f:
        snap = json.loads(f.read())
    names = [r["checkpoint_dir_name"] for r in snap.get("checkpoint_results", [])]
    infos = fs.get_file_info([f"{root}/{n}" for n in names])
    gone = dropped | {n for n, i in zip(names, infos) if i.type == pafs.FileType.NotFound}
    if not gone:
        return
    keep = [i for i, n in enumerate(names) if n not in gone]
    indices = snap.get("checkpoint_report_indices", [])
    snap["checkpoint_results"] = [snap["checkpoint_results"][i] for i in keep]
    snap["checkpoint_report_indices"] = [indices[i] for i in keep]
    latest: Optional[dict] = snap.get("latest_checkpoint_result")
    if latest is not None and latest.get("checkpoint_dir_name") in gone:
        newest = max(range(len(keep)), key=lambda k: snap["checkpoint_report_indices"][k], default=None)
        snap["latest_checkpoint_result"] = None if newest is None else snap["checkpoint_results"][newest]
    pending = list(zip(snap.get("pending_training_results", []), snap.get("pending_validation_specs", [])))
    pending = [(r, v) for r, v in pending if r.get("checkpoint_dir_name") not in gone]
    snap["pending_training_results"] = [r for r, _ in pending]
    snap["pending_validation_specs"] = [v for _, v in pending]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        if key in snap:
            snap[key] = [n for n in snap[key] if n not in gone]
    write_bytes_atomic(join(run_dir, RAY_SNAPSHOT), json.dumps(snap).encode())


def _keep_newest_refused(fs, root: str) -> None:
    """The newest :data:`REFUSED_KEPT` refused checkpoints stay (by name: Ray's names sort by their time)."""
    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    refused = sorted(e.path for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith(REFUSED))
    for path in refused[:-REFUSED_KEPT]:
        fs.delete_dir(path)
