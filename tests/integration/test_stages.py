"""SFT, LoRA, DPO, distillation, SimPO and KTO on the same loop, tiny preset.

LoRA runs on real Ray (2 gloo workers: DDP over a model whose base is frozen), then exported and merged. Every
stage, LoRA included, also runs on one in-process engine, the code each Ray Train worker runs, stopped after step 4
and restored from that checkpoint, which must end exactly where a straight run ends: SFT, DPO and distillation add
nothing to the Ray layer (SFT's loss mask lives in the batch; DPO's frozen reference and the teacher are built by the
objective, in every worker, from files), and a worker group's restart from a checkpoint is the shared machinery that
test_training.py breaks in every way (and test_grpo.py for GRPO). SFT through Ray Train is trained by test_serve.py
and killed and resumed by test_pipeline.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minimind_ray.config import load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.store.checkpoint import open_checkpoint

from .helpers import final_weights, loss_history, new_shared_with_base_weights, run_tiny, sample_record
from .test_training import LOSS_ATOL_ACROSS_WORLD_SIZES, WEIGHT_ATOL_ACROSS_WORLD_SIZES

pytestmark = pytest.mark.integration

STEPS = 8


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return new_shared_with_base_weights(tmp_path_factory, "stages")


LORA = ("train.stage=lora", "data.format=sft", "train.lr=1e-2", "train.lora.rank=4")


def run_stage(shared, name, *overrides):
    return run_tiny(shared, name, f"train.init_from={shared['base_pth']}", "train.warmup_steps=1", *overrides,
                    steps=STEPS, ckpt_every=2)


def test_sft_lowers_assistant_loss_and_resumes(shared, tmp_path):
    """SFT on the in-process engine, straight and stopped at step 4 then restored: the same end, bit for bit.
    (SFT through Ray Train, and its resume after a killed driver, run in test_pipeline.py and test_serve.py.)"""
    straight, seen, resumed, halves = run_in_process(shared, tmp_path, "train.stage=sft", "data.format=sft",
                                                     "train.lr=3e-3")
    assert _same_weights(straight, resumed) and halves.series("loss") == seen.series("loss")
    losses = seen.series("loss")
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert losses[-1][1] < losses[0][1] - 0.5, losses


def test_lora_changes_only_adapters_on_two_workers(ray_session, shared):
    res = run_stage(shared, "lora", *LORA)
    _, attempts = sample_record(shared, "lora")
    assert attempts == {0}
    w = final_weights(res)
    base = torch.load(shared["base_pth"], weights_only=True)
    assert all(torch.equal(w[k], base[k]) for k in base), "a frozen base weight changed"
    lora_keys = [k for k in w if ".lora." in k]
    assert lora_keys and all(k.endswith(("lora.A.weight", "lora.B.weight")) for k in lora_keys)
    assert any(w[k].abs().sum() > 0 for k in lora_keys if k.endswith("lora.B.weight")), "adapters did not train"
    # its checkpoints record the adapters the stage's record says it put on the model (store/weights.py reads them)
    assert open_checkpoint(res.checkpoint_dir).meta().adapters == {"rank": 4, "alpha": None, "targets": ["square"]}
    # the exported artifact is the LoRA weights alone, in MiniMind's layout
    lora_file = Path(res.exports["lora"])
    exported = torch.load(lora_file, weights_only=True)
    assert set(exported) == set(lora_keys)
    # `minimind-ray merge-lora` folds them into the base: same logits as base + adapters
    import subprocess
    import sys

    from minimind_ray.model.config import LoRAConfig
    from minimind_ray.model.lora import apply_lora, load_lora

    merged = shared["base"] / "merged.pth"
    p = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "merge-lora", "--base", str(shared["base_pth"]),
                        "--lora", str(lora_file), "--out", str(merged)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    cfg = load_config("pipelines/configs/tiny.yaml").model
    with_adapters = build_model(cfg)
    with_adapters.load_state_dict(base)
    apply_lora(with_adapters, LoRAConfig(rank=4))
    load_lora(with_adapters, {k: v.float() for k, v in exported.items()})
    plain = build_model(cfg)
    plain.load_state_dict({k: v.float() for k, v in torch.load(merged, weights_only=True).items()}, strict=True)
    ids = torch.randint(3, 6400, (2, 16), generator=torch.Generator().manual_seed(0))
    base_model = build_model(cfg)
    base_model.load_state_dict(base)
    with torch.no_grad():  # merged.pth is fp16 on disk, like MiniMind's: compare to fp16 rounding
        adapted = with_adapters(ids).logits
        torch.testing.assert_close(plain(ids).logits, adapted, atol=2e-2, rtol=1e-2)
        # the control: the trained adapters move the logits far more than that tolerance, so a merge that
        # dropped them (or a merge-lora that wrote the base back) would fail the comparison above
        moved = (adapted - base_model(ids).logits).abs().max().item()
    assert moved > 10 * 2e-2, moved


def test_lora_resumes_bit_for_bit_and_trains_only_its_adapters(shared, tmp_path):
    """LoRA on the in-process engine, straight and stopped at step 4 then restored: the same adapters and losses,
    bit for bit; the base (init_from) untouched in both."""
    straight, seen, resumed, halves = run_in_process(shared, tmp_path, *LORA)
    assert _same_weights(straight, resumed) and halves.series("loss") == seen.series("loss")
    base = torch.load(shared["base_pth"], weights_only=True)
    w = resumed.model.state_dict()
    assert all(torch.equal(w[k], base[k]) for k in base), "a frozen base weight changed"
    assert any(w[k].abs().sum() > 0 for k in w if k.endswith("lora.B.weight")), "adapters did not train"


class _Metrics:
    """Each step's metrics (log_interval 1) from the engine's hooks; saves and stops after ``stop_at``."""

    def __init__(self, state=None, stop_at=None, ckpt=None, prepared=None):
        from minimind_ray.engine.loop import Hooks

        outer = self

        class H(Hooks):
            def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
                outer.by_step[step] = dict(metrics)

            def on_checkpoint(self, step, metrics):
                if step == stop_at:
                    state.save(ckpt, mlflow_run_id=None, prepared_dir=prepared)
                    raise KeyboardInterrupt  # stop here, as a crash would

        self.by_step, self.hooks = {}, H()

    def series(self, key):
        return [(s, m[key]) for s, m in sorted(self.by_step.items())]


def run_in_process(shared, tmp_path, *overrides):
    """The stage on one in-process engine, straight and stopped at step 4 then restored: (straight state, its
    per-step metrics, the restored state, the metrics of both halves)."""
    import random

    from minimind_ray.data.prepare import ensure_prepared
    from minimind_ray.engine.loop import run
    from minimind_ray.engine.state import TrainState
    from minimind_ray.store.checkpoint import open_checkpoint
    from minimind_ray.tokenizer import resolve_tokenizer

    cfg = load_config("pipelines/configs/tiny.yaml", [
        f"train.max_steps={STEPS}", "checkpoint.interval=2", "train.log_interval=1", "train.global_batch_size=8",
        "train.micro_batch_size=4", f"data.cache_dir={shared['cache']}", "tracking.enabled=false",
        f"train.init_from={shared['base_pth']}", "train.warmup_steps=1", *overrides])
    prepared = ensure_prepared(cfg.data, resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir))
    threads, py_rng = torch.get_num_threads(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):  # the engine seeds and sizes this process as its own
            straight = TrainState.build(cfg, prepared)
            seen = _Metrics()
            run(straight, seen.hooks)
            first = TrainState.build(cfg, prepared)
            halves = _Metrics(first, stop_at=4, ckpt=tmp_path / "ck", prepared=prepared)
            with pytest.raises(KeyboardInterrupt):
                run(first, halves.hooks)
            first.stream.close()
            resumed = TrainState.build(cfg, prepared)
            assert resumed.restore(open_checkpoint(tmp_path / "ck")).step == 4
            run(resumed, halves.hooks)
    finally:
        torch.set_num_threads(threads)
        random.setstate(py_rng)
    return straight, seen, resumed, halves


def _same_weights(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _preference_pairs(d: Path) -> Path:
    """64 hand-made pairs in DPO's format: a right sum chosen, a refusal rejected."""
    d.mkdir(exist_ok=True)
    pairs = []
    for i in range(64):
        q = f"What is {i} plus {i}?"
        pairs.append({"chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": f"{2 * i}."}],
                      "rejected": [{"role": "user", "content": q},
                                   {"role": "assistant", "content": "I refuse to count, sorry, bananas."}]})
    f = d / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in pairs) + "\n")
    return f


def test_dpo_margin_grows_on_hand_made_pairs(ray_session, shared, tmp_path):
    f = _preference_pairs(tmp_path / "dpo_data")
    straight, seen, resumed, halves = run_in_process(
        shared, tmp_path, "train.stage=dpo", "data.format=dpo", f"data.train_path=[{f}]", "train.lr=3e-3",
        "train.dpo.beta=0.5")
    # the restored engine rebuilt the same frozen reference (a copy of init_from, not of the checkpoint): the
    # run ends exactly where the straight one does
    assert _same_weights(straight, resumed)
    assert halves.series("loss") == seen.series("loss")
    margins, acc = seen.series("reward_margin"), seen.series("reward_accuracy")
    assert [s for s, _ in margins] == list(range(1, STEPS + 1))
    assert margins[-1][1] > margins[0][1] + 0.1, margins
    assert acc[-1][1] >= 0.9
    # the reference never enters the checkpoint: model.pth holds the policy's keys only
    from minimind_ray.store.checkpoint import open_checkpoint

    w = open_checkpoint(tmp_path / "ck").model_state()
    assert set(w) == set(build_model(load_config("pipelines/configs/tiny.yaml").model).state_dict())


def test_distillation_from_a_frozen_teacher(ray_session, shared, tmp_path):
    from minimind_ray.store.checkpoint import open_checkpoint
    from minimind_ray.store.pth import save_pth

    # a teacher that is not the student's starting point: the KL starts well above 0 and has work to do
    teacher = tmp_path / "teacher.pth"
    save_pth(build_model(load_config("pipelines/configs/tiny.yaml").model, seed=12), str(teacher), dtype=torch.float32)
    before = torch.load(teacher, weights_only=True)
    straight, seen, resumed, halves = run_in_process(
        shared, tmp_path, "train.stage=distill", "data.format=sft", f"train.distill.teacher_weights={teacher}",
        "train.lr=3e-3")
    assert _same_weights(straight, resumed) and halves.series("loss") == seen.series("loss")
    losses, kl, ce = seen.series("loss"), seen.series("kl"), seen.series("ce")
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert kl and ce and all(v >= 0 for _, v in kl)
    assert kl[0][1] > 0.1 and kl[-1][1] < kl[0][1], kl  # the student moves towards the teacher
    after = torch.load(teacher, weights_only=True)
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # the teacher's weights are read, never written
    teacher_model = straight.objective.teacher
    assert not any(p.requires_grad for p in teacher_model.parameters())
    w = open_checkpoint(tmp_path / "ck").model_state()
    assert set(w) == set(before), "the teacher must not enter the student's checkpoint"
    # loss = alpha * CE + (1 - alpha) * T^2 * KL with MiniMind's alpha 0.5 (per-token means)
    assert losses[-1][1] == pytest.approx(0.5 * ce[-1][1] + 0.5 * kl[-1][1], rel=1e-4)


def test_simpo_learns_the_preference_and_resumes_bit_for_bit(shared, tmp_path):
    """SimPO (stages/simpo.py, added by its own modules and one registry name) on the in-process engine, straight
    and stopped at step 4 then restored: the same weights and losses, bit for bit; the implicit-reward margin grows
    and the chosen answers win; no reference model is built, and the checkpoint holds the policy only."""
    from minimind_ray.store.checkpoint import open_checkpoint

    f = _preference_pairs(tmp_path / "pairs")
    straight, seen, resumed, halves = run_in_process(
        shared, tmp_path, "train.stage=simpo", "data.format=dpo", f"data.train_path=[{f}]", "train.lr=3e-3")
    assert _same_weights(straight, resumed) and halves.series("loss") == seen.series("loss")
    margins, acc = seen.series("reward_margin"), seen.series("reward_accuracy")
    assert [s for s, _ in margins] == list(range(1, STEPS + 1))
    assert margins[-1][1] > margins[0][1] + 0.5 and acc[-1][1] >= 0.9, (margins, acc)
    assert not hasattr(straight.objective, "reference")
    w = open_checkpoint(tmp_path / "ck").model_state()
    assert set(w) == set(build_model(load_config("pipelines/configs/tiny.yaml").model).state_dict())


def test_simpo_trains_on_two_workers_and_exports_as_its_own_stage(ray_session, shared, tmp_path):
    """The `simpo` verb's run on Ray Train (2 gloo workers, DDP over the chosen+rejected forward): every step trains
    the same 8 pairs' global batch, and the final model is exported as simpo_<hidden>.pth beside the HF folder."""
    f = _preference_pairs(tmp_path / "pairs")
    res = run_stage(shared, "simpo", "train.stage=simpo", "data.format=dpo", f"data.train_path=[{f}]",
                    "train.lr=3e-3", "train.global_batch_size=8", "train.micro_batch_size=2")
    per_step, attempts = sample_record(shared, "simpo")
    assert attempts == {0} and sorted(per_step) == list(range(1, STEPS + 1))
    assert all(len(ids) == 8 for ids in per_step.values())
    exported = Path(res.exports["pth"])
    assert exported.name == "simpo_64.pth", res.exports
    w = torch.load(exported, weights_only=True)
    base = torch.load(shared["base_pth"], weights_only=True)
    assert set(w) == set(base) and any(not torch.equal(w[k].float(), base[k]) for k in base)



def _judged_replies(d: Path) -> Path:
    """The 64 hand-made pairs unpaired into KTO's format, as TRL unpairs them: each right sum a desirable reply,
    each refusal an undesirable one."""
    d.mkdir(exist_ok=True)
    records = [{"conversations": p[side], "label": side == "chosen"}
               for p in map(json.loads, _preference_pairs(d).read_text().splitlines()) for side in ("chosen", "rejected")]
    f = d / "judged.jsonl"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    return f


KTO = ("train.stage=kto", "data.format=kto", "train.lr=3e-3", "train.kto.beta=0.5")


@pytest.fixture(scope="module")
def kto_in_process(ray_session, shared, tmp_path_factory):
    """KTO on one in-process engine (global batch 8 = 2 micro-batches of 4), straight and stopped at step 4 then
    restored: (the data file, the checkpoint of step 4, what run_in_process returns)."""
    d = tmp_path_factory.mktemp("kto")
    f = _judged_replies(d)
    return f, d / "ck", run_in_process(shared, d, *KTO, f"data.train_path=[{f}]")


def test_kto_learns_the_labels_and_resumes_bit_for_bit(kto_in_process):
    """KTO (stages/kto.py, data/formats/kto.py: added by their modules and one line in each registry) on the
    in-process engine, straight and stopped at step 4 then restored: the same weights, losses and KL points, bit for
    bit (the restored engine rebuilt the same frozen reference). The judged replies move to their label's side of
    the KL point, which leaves 0 once the policy leaves the reference; the checkpoint holds the policy only."""
    from minimind_ray.store.checkpoint import open_checkpoint

    _, ck, (straight, seen, resumed, halves) = kto_in_process
    assert _same_weights(straight, resumed) and halves.series("loss") == seen.series("loss")
    assert halves.series("kl") == seen.series("kl")
    kl, acc, signed = seen.series("kl"), seen.series("reward_accuracy"), seen.series("signed_reward")
    assert [s for s, _ in kl] == list(range(1, STEPS + 1))
    assert kl[0][1] == 0.0 and any(v > 0 for _, v in kl), kl  # policy == reference at step 1
    assert signed[-1][1] > signed[0][1] + 0.5 and acc[-1][1] >= 0.9, (signed, acc)
    w = open_checkpoint(ck).model_state()
    assert set(w) == set(build_model(load_config("pipelines/configs/tiny.yaml").model).state_dict())


def test_kto_on_two_workers_takes_the_steps_of_one_and_exports_as_its_own_stage(ray_session, shared, kto_in_process):
    """The `kto` verb's run on Ray Train, 2 gloo workers of one micro-batch each, against the in-process engine's 1
    worker of two: the KL point of each step is the global batch's (all-reduced before any loss), so every step's loss
    and KL point and the final weights match to the cross-world-size tolerances (test_training.py); each step trains
    the same 8 replies, and the model is exported as kto_<hidden>.pth."""
    f, _, (straight, seen, _, _) = kto_in_process
    res = run_stage(shared, "kto", *KTO, f"data.train_path=[{f}]", "train.global_batch_size=8",
                    "train.micro_batch_size=4", "train.log_interval=1")
    per_step, attempts = sample_record(shared, "kto")
    assert attempts == {0} and sorted(per_step) == list(range(1, STEPS + 1))
    assert all(len(ids) == 8 for ids in per_step.values())
    for key in ("loss", "kl"):
        two = loss_history(shared, res.mlflow_run_id, f"train/{key}")
        assert [s for s, _ in two] == [s for s, _ in seen.series(key)], key
        for (s, a), (_, b) in zip(two, seen.series(key)):
            assert abs(a - b) <= LOSS_ATOL_ACROSS_WORLD_SIZES, f"{key} at step {s}: {a} on 2 workers, {b} on 1"
    assert any(v > 0 for _, v in seen.series("kl"))  # so the comparison above covers the all-reduced point
    w, one = final_weights(res), straight.model.state_dict()
    for k in one:
        torch.testing.assert_close(w[k], one[k], atol=WEIGHT_ATOL_ACROSS_WORLD_SIZES, rtol=0)
    exported = Path(res.exports["pth"])
    assert exported.name == "kto_64.pth", res.exports
    base = torch.load(shared["base_pth"], weights_only=True)
    e = torch.load(exported, weights_only=True)
    assert set(e) == set(base) and any(not torch.equal(e[k].float(), base[k]) for k in base)
