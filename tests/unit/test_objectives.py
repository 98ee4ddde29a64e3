"""Stage plug-ins without Ray: what each loss sees and what it may touch."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from minimind_ray.config import load_config
from minimind_ray.model.minimind import build_model
from minimind_ray.store.pth import save_pth
from minimind_ray.stages import build_objective


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
    # with alpha = 1 it is plain cross-entropy over the target tokens, as F.cross_entropy computes it
    cfg1 = cfg_for("distill", "sft", f"train.distill.teacher_weights={teacher_path}", "train.distill.alpha=1")
    obj1 = build_objective(cfg1)
    obj1.setup(student, torch.device("cpu"))
    batch = sft_batch()
    loss1, _, _ = obj1.loss_sum(student, batch)
    with torch.no_grad():
        ce = F.cross_entropy(student(batch["input_ids"]).logits.flatten(0, 1), batch["targets"].flatten())
    assert float(loss1.detach()) / obj1.weight(batch) == pytest.approx(float(ce), rel=1e-5)


def minimind_distill_loss(student_logits, teacher_logits, targets, alpha, T):
    """MiniMind's train_distillation.py, per target token: alpha * CE + (1 - alpha) * T^2 * KL(teacher || student),
    the KL with F.kl_div(reduction='batchmean') over the target positions."""
    mask = targets.ne(-100)
    s, t = student_logits[mask], teacher_logits[mask]
    ce = F.cross_entropy(s, targets[mask])
    kl = F.kl_div(F.log_softmax(s / T, -1), F.softmax(t / T, -1), reduction="batchmean") * T * T
    return alpha * ce + (1 - alpha) * kl, kl


@pytest.mark.parametrize("student_preset,teacher_preset", [
    ("tiny", None),        # a teacher of the student's architecture, other weights
    ("tiny3", "tiny3-moe"),  # MiniMind's d65ef2c default: the MoE minimind-3 teaches the dense one
])
def test_distillation_from_a_different_teacher_is_minimind_loss_and_the_teacher_stays_frozen(
        tmp_path, student_preset, teacher_preset):
    teacher_cfg = cfg_for("sft", "sft", f"model.preset={teacher_preset or student_preset}").model
    teacher = build_model(teacher_cfg, seed=7).eval()
    with torch.no_grad():  # sharper than a fresh init (minimind-3's N(0, 0.02) gives near-uniform logits)
        teacher.model.embed_tokens.weight.mul_(10)
    save_pth(teacher, str(tmp_path / "teacher.pth"), dtype=torch.float32)
    extra = [f"model.preset={student_preset}", f"train.distill.teacher_weights={tmp_path / 'teacher.pth'}",
             "train.distill.alpha=0.5", "train.distill.temperature=1.5"]
    if teacher_preset:
        extra.append(f"train.distill.teacher_preset={teacher_preset}")
    obj = build_objective(cfg_for("distill", "sft", *extra))
    student = build_model(cfg_for("sft", "sft", f"model.preset={student_preset}").model, seed=3)
    obj.setup(student, torch.device("cpu"))
    assert obj.teacher.cfg.use_moe == bool(teacher_preset) and not any(p.requires_grad for p in obj.teacher.parameters())
    frozen = copy.deepcopy(obj.teacher.state_dict())
    batch = sft_batch(T=24)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    kls = []
    for _ in range(6):
        loss, _, extra_out = obj.loss_sum(student, batch)
        with torch.no_grad():  # the same loss, written as MiniMind writes it, with the teacher as saved
            want, kl = minimind_distill_loss(student(batch["input_ids"]).logits, teacher(batch["input_ids"]).logits,
                                             batch["targets"], 0.5, 1.5)
        assert float(loss.detach()) / obj.weight(batch) == pytest.approx(float(want), rel=1e-4)
        kls.append(float(kl))
        opt.zero_grad()
        (loss / obj.weight(batch)).backward()
        opt.step()
    print(f"\nKL(teacher || student) over 6 steps: {[round(k, 3) for k in kls]}")
    assert kls[0] > 0.05, kls  # the teacher differs: distillation has something to learn
    assert kls[-1] < 0.9 * kls[0], kls  # and the student moves towards it
    assert all(torch.equal(v, obj.teacher.state_dict()[k]) for k, v in frozen.items())  # the teacher did not


def test_lora_objective_trains_adapters_only():
    cfg = cfg_for("lora", "sft")
    model = build_model(cfg.model, seed=0)
    obj = build_objective(cfg)
    obj.setup(model, torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)


def test_simpo_loss_is_the_papers_formula_computed_by_hand():
    """SimPO (stages/simpo.py): -log sigmoid(beta * (mean log p(chosen) - mean log p(rejected)) - gamma), summed over
    the pairs; the means are over each response's target tokens (here of unequal lengths), computed token by token
    from the model's logits; the margin metric is beta times the difference of the means, and there is no reference."""
    cfg = cfg_for("simpo", "dpo", "train.simpo.beta=2.5", "train.simpo.gamma=0.75")
    model = build_model(cfg.model, seed=0)
    obj = build_objective(cfg)
    obj.setup(model, torch.device("cpu"))
    assert not hasattr(obj, "reference")
    g = torch.Generator().manual_seed(3)
    ids, rej = torch.randint(3, 6400, (3, 10), generator=g), torch.randint(3, 6400, (3, 10), generator=g)
    tgt, rtgt = torch.full((3, 10), -100), torch.full((3, 10), -100)
    for row, (a, b) in enumerate(((2, 9), (4, 9), (1, 6))):  # responses of 7, 5 and 5 tokens
        tgt[row, a:b] = ids[row, a + 1:b + 1]
        rtgt[row, a + 1:b] = rej[row, a + 2:b + 1]  # rejected: one token shorter
    batch = {"chosen_input_ids": ids, "chosen_targets": tgt, "rejected_input_ids": rej, "rejected_targets": rtgt}
    loss, aux, extra = obj.loss_sum(model, batch)

    def mean_logp(input_ids, targets, row):
        logits = model(input_ids[row:row + 1]).logits[0].double()  # (T, V)
        picked = [torch.log_softmax(logits[t], -1)[targets[row, t]] for t in range(targets.shape[1])
                  if targets[row, t] != -100]
        return sum(picked) / len(picked)

    with torch.no_grad():
        expected, margin = 0.0, 0.0
        for row in range(3):
            diff = 2.5 * (mean_logp(ids, tgt, row) - mean_logp(rej, rtgt, row))
            expected += -math.log(1 / (1 + math.exp(-(float(diff) - 0.75))))
            margin += float(diff)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(extra["reward_margin"]) == pytest.approx(margin, rel=1e-5)
    assert obj.weight(batch) == 3 and obj.tokens(batch) == 60
