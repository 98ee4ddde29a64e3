"""The ``eval`` verb's checks of ``--data`` (issue 11, item 19): the tokenizer-hash check training applies,
and a split smaller than one micro-batch evaluated as it is. The small model, tokenizer and prepared data
of tests/fixtures/checkpoint_v1; no Ray."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from minimind_ray.config import from_dict
from minimind_ray.config import to_dict
from minimind_ray.data.manifest import DataError
from minimind_ray.engine.state import RNGState
from minimind_ray.evals.loss import evaluate_weights
from minimind_ray.store import checkpoint as ckpt_io

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"
PREPARED = FIXTURE / "prepared"


@pytest.fixture(scope="module")
def run_checkpoint(tmp_path_factory) -> Path:
    """The fixture's step-4 checkpoint, rewritten to name this machine's tokenizer and prepared data."""
    old = ckpt_io.open_checkpoint(FIXTURE / "checkpoint_step4")
    cfg = from_dict(old.meta().config)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(FIXTURE / "tokenizer")))
    ck = tmp_path_factory.mktemp("eval") / "run" / "checkpoint_000004"
    ckpt_io.write_rank_files(ck, 0, RNGState().state_dict())
    ckpt_io.write_shared_files(ck, model_state=old.model_state(), train_state={}, meta=ckpt_io.CheckpointMeta(
        step=4, epoch=0, data_state={}, world_size=1, stage="pretrain", total_steps=8, config=to_dict(cfg),
        prepared_dir=str(PREPARED)))
    return ck


def prepared_copy(dst: Path, rows: int = None, **manifest_changes) -> str:
    """The fixture's prepared data, cut to its first ``rows`` sequences and/or with manifest fields changed."""
    shutil.copytree(PREPARED, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    if rows is not None:
        table = pq.read_table(PREPARED / "part-00000.parquet").slice(0, rows)
        pq.write_table(table, dst / "part-00000.parquet", row_group_size=manifest["block_rows"])
        manifest["shards"] = [{"file": "part-00000.parquet", "index": 0, "rows": rows}] if rows else []
    manifest.update(manifest_changes)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return str(dst)


def test_item19_eval_data_tokenized_with_another_tokenizer_is_refused(run_checkpoint, tmp_path):
    other = prepared_copy(tmp_path / "other", tokenizer_hash="0" * 64, tokenizer_path="/elsewhere/tokenizer")
    with pytest.raises(DataError, match=rf"^prepared data {other} was tokenized with tokenizer hash 0{{64}} "
                                        rf"\(/elsewhere/tokenizer\), but the tokenizer {run_checkpoint} was "
                                        rf"trained with has hash 258bbd64"):
        evaluate_weights(str(run_checkpoint), data=other, micro_batch_size=8, batches=1)
    # the same check with the tokenizer named explicitly (what a bare .pth needs)
    with pytest.raises(DataError, match=r"but --tokenizer '.*tokenizer' has hash 258bbd64"):
        evaluate_weights(str(run_checkpoint), data=other, batches=1, tokenizer=str(FIXTURE / "tokenizer"))


def test_item19_eval_data_of_the_same_tokenizer_is_evaluated(run_checkpoint):
    res = evaluate_weights(str(run_checkpoint), data=str(PREPARED), micro_batch_size=8, batches=2)
    # packed windows of max_seq_len 32 with every position a target: 2 micro-batches of 8 x 32
    assert math.isfinite(res["eval_loss"]) and res["eval_units"] == 2 * 8 * 32


def test_item19_eval_on_fewer_sequences_than_a_micro_batch_evaluates_them(run_checkpoint, tmp_path):
    small = prepared_copy(tmp_path / "small", rows=3)
    one_batch = evaluate_weights(str(run_checkpoint), data=small, micro_batch_size=8)  # was a global_batch_size error
    exact = evaluate_weights(str(run_checkpoint), data=small, micro_batch_size=3)
    assert one_batch == exact and one_batch["eval_units"] == 3 * 32


def test_item19_eval_on_an_empty_split_says_so(run_checkpoint, tmp_path):
    empty = prepared_copy(tmp_path / "empty", rows=0)
    with pytest.raises(DataError, match=rf"^{empty}: the data holds no sequences: nothing to evaluate"):
        evaluate_weights(str(run_checkpoint), data=empty)
