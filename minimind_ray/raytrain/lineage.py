"""What a run came from, as MLflow tags on its run: the prepared data (its manifest's sha256) and the run whose
weights it starts from (``train.init_from``'s checkpoint records its MLflow run id). With them the path from the
data to a registered model can be followed in the MLflow UI, one run to the next (docs/pipeline.md)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional

from minimind_ray.data.manifest import DataError, skipped_records
from minimind_ray.fsio import filesystem, is_uri, join, redact
from minimind_ray.stages import Stage

TAG_MANIFEST = "minimind.data.manifest_sha256"
TAG_DATA = "minimind.data.prepared_dir"
TAG_INIT_FROM = "minimind.init_from"
TAG_INIT_FROM_RUN = "minimind.init_from.run_id"
TAG_SKIPPED = "data/skipped"  # the records the prepare left out: '1 of 12,345 records (bad_json: 1; first at f:6)'


def manifest_sha256(prepared_dir: str) -> Optional[str]:
    """sha256 of the prepared directory's manifest.json: the data's identity (it lists every shard, its size and
    row count, the tokenizer's hash and the settings that shaped the rows)."""
    try:
        fs, path = filesystem(join(prepared_dir, "manifest.json"))
        with fs.open_input_stream(path) as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, ValueError):
        return None


def source_run_id(weights: Optional[str]) -> Optional[str]:
    """The MLflow run id recorded in the checkpoint a weights path names (a checkpoint, a run directory, or a file
    of a run's ``export/`` directory), or None (a MiniMind .pth from elsewhere, an untracked run)."""
    if not weights:
        return None
    from minimind_ray.store.checkpoint import CheckpointError  # lazy: torch, only when this runs
    from minimind_ray.store.weights import resolve_checkpoint  # lazy: pyarrow, torch, only when this runs

    candidates = [weights]
    if not is_uri(weights) and Path(weights).parent.name == "export":  # runs/<name>/export/<file>
        candidates.append(str(Path(weights).parent.parent))
    for c in candidates:
        try:
            ck = resolve_checkpoint(c)
        except (OSError, CheckpointError, ValueError):
            continue
        if ck is not None:
            return ck.meta().mlflow_run_id
    return None


def skipped(prepared_dir: str) -> Optional[str]:
    """The prepared data's skipped records (data/manifest.py:skipped_records), redacted; None if unreadable."""
    try:
        return redact(skipped_records(prepared_dir))
    except (OSError, ValueError, DataError):
        return None


def lineage_tags(cfg, stage: Stage, prepared_dir: str) -> Dict[str, str]:
    """The tags of one training run (``stage``: its record): its data and what its weights came from (only what is
    known)."""
    t = cfg.train
    tags = {TAG_DATA: redact(prepared_dir), TAG_MANIFEST: manifest_sha256(prepared_dir), TAG_SKIPPED: skipped(prepared_dir),
            TAG_INIT_FROM: redact(t.init_from) if t.init_from else None, TAG_INIT_FROM_RUN: source_run_id(t.init_from)}
    for parent, weights in stage.parents(cfg).items():  # the teacher, a reference given by path
        tags[f"minimind.{t.stage}.{parent}.run_id"] = source_run_id(weights)
    return {k: v for k, v in tags.items() if v}
