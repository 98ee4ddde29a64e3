"""The prepared data as the run's MLflow dataset input: what the run page's "Datasets" shows.

MLflow 3 records what a run read as dataset inputs (name, digest, source, a profile) beside its params. The
prepared directory's ``manifest.json`` (data/prepare.py writes it last) says everything the input needs, so
only that one file is read, wherever the directory is (a local path or an ``s3://`` cache_dir):

- name: the directory's own name (``pretrain-<key>``: its format and the hash of its sources and settings);
- source: the directory, redacted (fsio.redact: a URI's credentials never reach MLflow); MLflow's source type is
  ``local`` for a path and the URI's scheme (``s3``) otherwise;
- digest: the first 12 hex digits of the manifest's sha256, which is the run's ``minimind.data.manifest_sha256``;
- profile: the manifest's counts (records, tokens, sequences, records skipped, shards) and the settings that shaped
  the rows; the same counts are the input's tags, which the run page's dataset list shows beside its name.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

from minimind_ray.fsio import filesystem, is_uri, join, redact

log = logging.getLogger(__name__)

CONTEXT_TAG = "mlflow.data.context"  # MLflow's own input tag: the UI shows it as the dataset's role ("Train")


def prepared_data_input(prepared_dir: str):
    """An ``mlflow.entities.DatasetInput`` for the prepared directory, from its manifest (one read)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    fs, path = filesystem(join(prepared_dir, "manifest.json"))
    with fs.open_input_stream(path) as f:
        raw = f.read()
    manifest = json.loads(raw)
    counts = manifest.get("counts") or {}
    skipped = sum(int(e.get("count", 0)) for e in (manifest.get("skipped") or {}).values())
    profile = {"records": counts.get("records"), "tokens": counts.get("tokens"), "sequences": counts.get("sequences"),
               "skipped_records": skipped, "shards": len(manifest.get("shards") or []),
               **{k: manifest.get(k) for k in ("format", "max_seq_len", "pack", "tokenizer_hash", "vocab_size")}}
    source = redact(prepared_dir.rstrip("/"))
    source_type = source.split("://", 1)[0] if is_uri(source) else "local"
    name = source.rsplit("/", 1)[-1] or source
    dataset = Dataset(name=name, digest=hashlib.sha256(raw).hexdigest()[:12], source_type=source_type,
                      source=json.dumps({"uri": source}), profile=json.dumps(profile))
    tags = [InputTag(CONTEXT_TAG, "train")] + [InputTag(k, f"{int(profile[k]):,}") for k in ("records", "tokens")
                                                if profile.get(k) is not None]
    return DatasetInput(dataset, tags=tags)


def log_prepared_data(client, run, prepared_dir: Optional[str]) -> Optional[str]:
    """Log the prepared data as ``run``'s dataset input unless the run has it already (a resumed run reads the
    same data: same name and digest). Never raises: returns what failed, one line, or None."""
    if not prepared_dir:
        return None
    try:
        item = prepared_data_input(prepared_dir)
        have = {(d.dataset.name, d.dataset.digest) for d in (run.inputs.dataset_inputs if run.inputs else [])}
        if (item.dataset.name, item.dataset.digest) not in have:
            client.log_inputs(run.info.run_id, datasets=[item])
        return None
    except Exception as e:  # noqa: BLE001 - a dataset record must never cost the run
        first = str(e).splitlines()[0] if str(e) else ""
        msg = redact(f"dataset input {prepared_dir}: {type(e).__name__}: {first}")[:500]
        log.warning("MLflow run %s: %s (not logged)", run.info.run_id, msg)
        return msg
