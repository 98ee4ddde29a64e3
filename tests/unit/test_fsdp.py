"""FSDP2 (``train.parallelism=fsdp``) in the engine, over plain gloo, CPU, fp32: no Ray (the one Ray Train run of
it is tests/integration/test_fsdp_ray.py).

Two processes started by hand (as torchrun would) run every two-rank scenario one after another in one process group,
on the fixture's data and 33k-parameter model (tests/fixtures/checkpoint_v1) with a held-out split of 65 sequences
(shares of 33 and 32: rank 1 runs one micro-batch fewer, which under FSDP it must make up with a forward of its own):
FSDP and DDP straight for 20 steps, each checkpointed at step 8; FSDP with activation checkpointing and without
resharding after forward; FSDP resumed from its own checkpoint, DDP from FSDP's and FSDP from DDP's. This process
runs the one-process scenarios and compares. (The engine's two-rank DDP check lives here too: it needs only
torch.distributed, two processes over plain gloo as torchrun would start them taking the same steps as one.)

Tolerances: between world sizes and wrappers the sums happen in another order (a reduce-scatter per micro-batch, an
all-reduce of the step's sum, one process adding both halves), about 1e-7 relative per step: 1e-5 on the loss. The
same world and wrapper resumed is the same arithmetic: bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.store.checkpoint import CheckpointError, open_checkpoint

from tests.unit.test_engine import FIXTURE, PREPARED, fixture_config

STEPS, SAVE_AT, EVAL_FRACTION = 20, 8, 0.0675  # 65 held-out sequences of the fixture's 982
TOKENIZER = FIXTURE / "tokenizer"


def config(**train):
    cfg = fixture_config(max_steps=STEPS, eval_interval=10, eval_batches=0, **train)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_fraction=EVAL_FRACTION))


def prepared_with_token_bytes(dst: Path) -> str:
    """The fixture's prepared data with the token bytes prepare records today (bits per byte)."""
    from minimind_ray.tokenizer import load_tokenizer

    shutil.copytree(PREPARED, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["token_bytes"] = load_tokenizer(str(TOKENIZER)).token_bytes()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return str(dst)


class Run(Hooks):
    """Records every step's loss and the evaluations; saves the state once at ``save_at`` into ``save_to``."""

    def __init__(self, state, save_at=None, save_to=None, prepared=None):
        self.state, self.save_at, self.save_to, self.prepared = state, save_at, save_to, prepared
        self.losses, self.evals = {}, {}

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.losses.update(per_step_loss)
        if "eval_loss" in metrics:
            self.evals[step] = {k: metrics[k] for k in ("eval_loss", "eval_bpb") if k in metrics}

    def on_checkpoint(self, step, metrics):
        if step == self.save_at:
            self.state.save(self.save_to, mlflow_run_id=None, prepared_dir=self.prepared)


def train(prepared, rank=0, world=1, restore=None, save_at=None, save_to=None, after_restore=None, **train_cfg):
    """One scenario: (per-step losses, evaluations, whole final weights on rank 0, tied?)."""
    from minimind_ray.engine.parallel import whole_model_state

    state = TrainState.build(config(**train_cfg), prepared, rank=rank, world=world)
    if restore:
        state.restore(open_checkpoint(restore))
        if after_restore:
            after_restore(state)
    rec = Run(state, save_at, save_to, prepared)
    run(state, rec)
    raw = state.model
    return {"losses": rec.losses, "evals": rec.evals, "weights": whole_model_state(raw),
            "tied": raw.lm_head.weight is raw.model.embed_tokens.weight, "sharded": state.sharded}


def _ranks(rank: int, world: int, work: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank, world_size=world)
    try:
        prepared, out = f"{work}/prepared", {}
        out["fsdp"] = train(prepared, rank, world, parallelism="fsdp", save_at=SAVE_AT, save_to=f"{work}/ck_fsdp")
        out["ddp"] = train(prepared, rank, world, save_at=SAVE_AT, save_to=f"{work}/ck_ddp")
        out["fsdp_ac_keep"] = train(prepared, rank, world, parallelism="fsdp", activation_checkpointing="blocks",
                                    reshard_after_forward=False)
        out["fsdp_resumed"] = train(prepared, rank, world, parallelism="fsdp", restore=f"{work}/ck_fsdp")
        # the same weights as FSDP's checkpoint, written by DDP at once: the export test compares the two
        out["ddp_from_fsdp"] = train(prepared, rank, world, restore=f"{work}/ck_fsdp", after_restore=lambda s: s.save(
            f"{work}/ck_ddp_same", mlflow_run_id=None, prepared_dir=prepared))
        out["fsdp_from_ddp"] = train(prepared, rank, world, parallelism="fsdp", restore=f"{work}/ck_ddp")
        if rank == 0:
            torch.save(out, f"{work}/results.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The two-rank scenarios, run once: their results and checkpoints."""
    import torch.multiprocessing as mp

    work = tmp_path_factory.mktemp("fsdp")
    prepared_with_token_bytes(work / "prepared")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_ranks, args=(2, str(work)), nprocs=2, start_method="spawn")
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old is None else os.environ.__setitem__("OMP_NUM_THREADS", old)
    return work


@pytest.fixture(scope="module")
def results(work):
    return torch.load(work / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process(work):
    return train(str(work / "prepared"))


def assert_losses_close(got, want, atol, steps=range(1, STEPS + 1)):
    assert [s for s in steps if s in got] == list(steps), sorted(got)
    worst = max(abs(got[s] - want[s]) for s in steps)
    print(f"largest loss difference over steps {steps.start}-{steps.stop - 1}: {worst:.2g}")  # pytest -s shows it
    assert worst <= atol, f"largest difference {worst:.3g} > {atol}: {got} vs {want}"


def test_fsdp_ddp_and_one_process_take_the_same_steps(results, one_process):
    fsdp, ddp = results["fsdp"], results["ddp"]
    assert fsdp["sharded"] and not ddp["sharded"] and fsdp["tied"]  # FSDP2 kept the embedding tied to lm_head
    assert_losses_close(fsdp["losses"], ddp["losses"], 1e-5)
    assert_losses_close(fsdp["losses"], one_process["losses"], 1e-5)
    assert_losses_close(ddp["losses"], one_process["losses"], 1e-5)
    assert one_process["losses"][STEPS] < one_process["losses"][1]
    for k, v in one_process["weights"].items():
        torch.testing.assert_close(fsdp["weights"][k], v, atol=1e-5, rtol=0)
        torch.testing.assert_close(ddp["weights"][k], v, atol=1e-5, rtol=0)
    # the held-out evaluation at steps 10 and 20, each rank its share (one forward made up under FSDP)
    assert sorted(fsdp["evals"]) == sorted(one_process["evals"]) == [10, 20]
    for step, ev in one_process["evals"].items():
        assert set(ev) == {"eval_loss", "eval_bpb"}
        for k in ev:
            assert fsdp["evals"][step][k] == pytest.approx(ev[k], abs=1e-5)
            assert ddp["evals"][step][k] == pytest.approx(ev[k], abs=1e-5)


def test_fsdp_resumes_bit_for_bit_at_the_same_world_size(results):
    straight, resumed = results["fsdp"], results["fsdp_resumed"]
    assert sorted(resumed["losses"]) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(resumed["losses"][s] == straight["losses"][s] for s in resumed["losses"])
    assert all(torch.equal(resumed["weights"][k], v) for k, v in straight["weights"].items())


def test_a_sharded_checkpoint_resumes_on_one_process_and_under_ddp_and_a_ddp_one_under_fsdp(work, results):
    straight = results["fsdp"]["losses"]
    after = range(SAVE_AT + 1, STEPS + 1)
    one = train(str(work / "prepared"), restore=str(work / "ck_fsdp"))  # 2 ranks -> 1, FSDP -> the plain model
    assert_losses_close(one["losses"], straight, 1e-5, after)
    assert_losses_close(results["ddp_from_fsdp"]["losses"], straight, 1e-5, after)  # FSDP -> DDP, 2 ranks
    assert_losses_close(results["fsdp_from_ddp"]["losses"], results["ddp"]["losses"], 1e-5, after)  # DDP -> FSDP


def test_activation_checkpointing_and_keeping_gathered_weights_change_no_loss(work, results, one_process):
    """Checkpointed blocks re-run in backward, and blocks whose gathered weights are kept from forward to backward
    (reshard_after_forward=false), under FSDP; checkpointed blocks in one process (no wrapper)."""
    assert_losses_close(results["fsdp_ac_keep"]["losses"], results["fsdp"]["losses"], 1e-6)
    plain_ac = train(str(work / "prepared"), activation_checkpointing="blocks")  # one process: no wrapper
    assert_losses_close(plain_ac["losses"], one_process["losses"], 1e-6)


def test_a_sharded_checkpoint_lists_every_rank_shard_and_is_refused_with_one_cut_short(work, tmp_path):
    ck = open_checkpoint(work / "ck_fsdp")
    assert ck.sharded and not (work / "ck_fsdp" / "model.pth").exists()
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(ck.record["files"])
    assert "optimizer" not in ck.train_state()  # AdamW's moments are in the shards
    broken = tmp_path / "ck"
    shutil.copytree(work / "ck_fsdp", broken)
    shard = broken / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"sharded/__1_0.distcp missing or of the wrong size; checkpoint refused"):
        open_checkpoint(broken)


def test_export_and_eval_of_a_sharded_checkpoint_equal_those_of_the_same_weights_under_ddp(work, tmp_path):
    from minimind_ray.evals.loss import evaluate_weights
    from minimind_ray.export import export_from_source

    files = {}
    for name in ("ck_fsdp", "ck_ddp_same"):
        paths = export_from_source(str(work / name), tmp_path / name, formats=("minimind", "hf", "gguf"),
                                   tokenizer=str(TOKENIZER))
        files[name] = {k: Path(p) for k, p in paths.items()}
    assert sorted(files["ck_fsdp"]) == sorted(files["ck_ddp_same"]) and len(files["ck_fsdp"]) >= 3
    for kind, path in files["ck_fsdp"].items():
        other = files["ck_ddp_same"][kind]
        if path.is_dir():  # the HF folder: every file the same
            assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in other.iterdir())
            assert all((path / p.name).read_bytes() == (other / p.name).read_bytes() for p in other.iterdir())
        else:
            assert path.read_bytes() == other.read_bytes(), kind
    sharded = evaluate_weights(str(work / "ck_fsdp"), data=str(work / "prepared"), micro_batch_size=8, batches=4)
    assert sharded == evaluate_weights(str(work / "ck_ddp_same"), data=str(work / "prepared"), micro_batch_size=8,
                                       batches=4)
    assert math.isfinite(sharded["eval_bpb"]) and sharded["eval_units"] == 4 * 8 * 32


def test_stages_that_cannot_train_under_fsdp_are_refused_naming_the_field():
    from minimind_ray.config import ConfigError, load_config
    from minimind_ray.stages import STAGES

    recipes = {"lora": "lora_26m", "dpo": "dpo_26m", "distill": "distill_26m", "grpo": "grpo_26m", "ppo": "ppo_26m",
               "agent": "demo_agent", "simpo": "simpo_26m", "kto": "kto_26m", "rloo": "demo_rloo"}
    refused = sorted(n for n, s in STAGES.items() if s.fsdp_refusal)
    assert refused == sorted(recipes)  # pretrain and sft train under FSDP
    for stage, recipe in recipes.items():
        with pytest.raises(ConfigError) as e:
            load_config(f"pipelines/configs/{recipe}.yaml", ["train.parallelism=fsdp", "data.train_path=[demo]"])
        assert str(e.value) == (f"train.parallelism: stage {stage!r} does not train under fsdp: "
                                f"{STAGES[stage].fsdp_refusal}; use train.parallelism=ddp")
        assert "\n" not in str(e.value)
    load_config("pipelines/configs/pretrain_26m.yaml", ["train.parallelism=fsdp", "data.train_path=[demo]"])
    with pytest.raises(ConfigError, match=r"^train.parallelism: must be ddp or fsdp, not 'zero3'$"):
        load_config("pipelines/configs/tiny.yaml", ["train.parallelism=zero3"])
    with pytest.raises(ConfigError, match=r"^train.reshard_after_forward: applies to train.parallelism=fsdp only"):
        load_config("pipelines/configs/tiny.yaml", ["train.reshard_after_forward=false"])
