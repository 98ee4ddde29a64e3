"""FSDP2 through Ray Train: ``minimind-ray pretrain ... train.parallelism=fsdp`` on a 2-worker local Ray (gloo, CPU).
The engine's FSDP (equal steps, resharding, activation checkpointing, export) is tests/unit/test_fsdp.py's; this is
the one run that goes through the CLI, the driver, TorchTrainer, Ray Train's checkpoint upload and MLflow."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine import FIXTURE
from tests.unit.test_fsdp import prepared_with_token_bytes

pytestmark = pytest.mark.integration


def test_pretrain_under_fsdp_on_two_ray_workers_checkpoints_sharded_and_logs_bits_per_byte(ray_session, tmp_path,
                                                                                            capsys, fresh_name):
    from mlflow.tracking import MlflowClient

    from minimind_ray.cli import main
    from minimind_ray.store.checkpoint import checkpoints_in, open_checkpoint

    prepared = prepared_with_token_bytes(tmp_path / "prepared")
    mlflow = f"sqlite:///{tmp_path}/mlflow.db"
    over = ["model.preset=tiny", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=64", "model.vocab_size=320",
            f"data.train_path=[{prepared}]", f"data.tokenizer={FIXTURE / 'tokenizer'}", "data.max_seq_len=32",
            "data.block_rows=16", "data.shuffle_window_blocks=2", "data.eval_fraction=0.05",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=6", "train.log_interval=2",
            "train.eval_interval=3", "train.parallelism=fsdp", "train.activation_checkpointing=blocks",
            "checkpoint.interval=3", "cluster.num_workers=2", "cluster.max_failures=0",
            f"checkpoint.storage_path={tmp_path / 'runs'}", f"tracking.uri={mlflow}", f"name={fresh_name}"]
    capsys.readouterr()
    assert main(["pretrain", *over]) == 0
    out = capsys.readouterr().out
    assert "fsdp over 2 workers, activation checkpointing" in out  # the memory estimate's start line
    assert "world 2 on cpu" in out and "fsdp (sharded), activation checkpointing of blocks" in out
    run_dir = tmp_path / "runs" / fresh_name
    steps = [s for s, _ in checkpoints_in(run_dir)]
    assert steps and max(steps) == 6
    final = open_checkpoint(next(p for s, p in checkpoints_in(run_dir) if s == 6))
    # both ranks' shards reached storage through Ray Train's upload, and the checkpoint is complete
    assert final.sharded and {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(final.record["files"])
    # the driver's export read the sharded checkpoint: its .pth holds the same weights
    got, want = torch.load(run_dir / "export" / "pretrain_32.pth", weights_only=True), final.model_state()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    client, run_id = MlflowClient(mlflow), final.meta().mlflow_run_id
    bpb = client.get_metric_history(run_id, "eval/bpb")  # beside eval/loss, at each evaluation
    assert sorted(m.step for m in bpb) == [3, 6] and all(0 < m.value < 20 for m in bpb)
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/loss")) == [3, 6]
