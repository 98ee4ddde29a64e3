"""Stage plug-ins without Ray: what each loss sees and what it may touch."""
import copy

import pytest
import torch

from minimind_ray.config import load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.store.pth import save_pth
from minimind_ray.engine.objectives import build_objective


def cfg_for(stage, fmt, *extra):
    return load_config(None, ["data.train_path=[demo]", "model.preset=tiny", f"train.stage={stage}",
                              f"data.format={fmt}", *extra])


def sft_batch(T=16, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 6400, (B, T), generator=g)
    targets = torch.full((B, T), -100)
    targets[:, 8:14] = ids[:, 9:15]  # an "assistant span"
    return {"input_ids": ids, "targets": targets, "sample_ids": torch.arange(B)}


def test_sft_tokens_outside_assistant_spans_carry_no_gradient():
    cfg = cfg_for("sft", "sft")
    model = build_model(cfg.model, seed=0)
    obj = build_objective(cfg)
    batch = sft_batch()
    captured = {}
    orig_forward = model.forward

    def forward(ids):
        out = orig_forward(ids)
        out.logits.retain_grad()
        captured["logits"] = out.logits
        return out

    model.forward = forward
    loss, aux, _ = obj.loss_sum(model, batch)
    loss.backward()
    g = captured["logits"].grad  # (B, T, V)
    masked = batch["targets"].eq(-100)
    assert torch.count_nonzero(g[masked]) == 0
    assert torch.count_nonzero(g[~masked]) > 0
    assert obj.weight(batch) == int((~masked).sum())


def test_dpo_reference_is_frozen_and_margin_grows():
    cfg = cfg_for("dpo", "dpo", "train.dpo.beta=0.5")
    model = build_model(cfg.model, seed=0)
    obj = build_objective(cfg)
    obj.setup(model, torch.device("cpu"))
    ref0 = copy.deepcopy(obj.reference.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 6400, (4, 12), generator=g)
    rej = torch.randint(3, 6400, (4, 12), generator=g)
    tgt = torch.full((4, 12), -100)
    tgt[:, 4:11] = ids[:, 5:12]
    rtgt = torch.full((4, 12), -100)
    rtgt[:, 4:11] = rej[:, 5:12]
    batch = {"chosen_input_ids": ids, "chosen_targets": tgt, "rejected_input_ids": rej, "rejected_targets": rtgt}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    margins = []
    for _ in range(5):
        loss, aux, extra = obj.loss_sum(model, batch)
        margins.append(float(extra["reward_margin"]) / 4)
        opt.zero_grad()
        (loss / 4).backward()
        opt.step()
    assert margins[0] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    assert margins[-1] > margins[0] + 0.1
    assert all(torch.equal(v, obj.reference.state_dict()[k]) for k, v in ref0.items())
    assert not any(p.requires_grad for p in obj.reference.parameters())


def test_distillation_of_a_copy_of_the_teacher_costs_nothing_at_step_0(tmp_path):
    teacher_path = tmp_path / "teacher.pth"
    cfg0 = cfg_for("sft", "sft")
    student = build_model(cfg0.model, seed=3)
    save_pth(student, str(teacher_path), dtype=torch.float32)
    cfg = cfg_for("distill", "sft", f"train.distill.teacher_weights={teacher_path}", "train.distill.alpha=0")
    obj = build_objective(cfg)
    obj.setup(student, torch.device("cpu"))
    loss, _, extra = obj.loss_sum(student, sft_batch())
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-4)
    # with alpha = 1 it is plain cross-entropy
    cfg1 = cfg_for("distill", "sft", f"train.distill.teacher_weights={teacher_path}", "train.distill.alpha=1")
    obj1 = build_objective(cfg1)
    obj1.setup(student, torch.device("cpu"))
    loss1, _, extra1 = obj1.loss_sum(student, sft_batch())
    assert float(loss1.detach()) == pytest.approx(float(extra1["ce"]), rel=1e-6)


def test_lora_objective_trains_adapters_only():
    cfg = cfg_for("lora", "sft")
    model = build_model(cfg.model, seed=0)
    obj = build_objective(cfg)
    obj.setup(model, torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
