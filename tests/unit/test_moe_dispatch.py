"""The MoE dispatch (``MoE.experts_forward``): what it computes, which path runs, and that its bf16 path
reads no tensor value on the host (issue 15: no GPU->CPU sync per MoE layer).

Each token's output is checked against the plainest reference there is: the token alone through each of
its k experts, weighted and summed. fp32 takes the per-expert loop (one host read of the run ends per
layer); bf16 under autocast takes the grouped GEMMs (``F.grouped_mm``), whose run ends stay on the device.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from minimind_ray.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values

torch.set_num_threads(2)

CASES = {  # name: (preset, overrides)
    "minimind2 k=2 +shared": ("tiny-moe", {}),
    "minimind3 k=1": ("tiny3-moe", {}),
    "minimind3 k=3": ("tiny3-moe", {"num_experts_per_tok": 3}),
    "unaligned widths": ("tiny-moe", {"moe_intermediate_size": 36}),  # 36 % 8 != 0: no grouped kernel
}


def moe_layer(preset: str, **overrides):
    model = build_model(ModelConfig(**{**preset_values(preset), **overrides}), seed=0).train()
    return model.model.layers[0].mlp


def per_token_reference(moe, xf, weight, idx):
    """sum_j weight[n, j] * expert_{idx[n, j]}(x_n), one token at a time."""
    rows = []
    for n in range(xf.shape[0]):
        rows.append(sum(weight[n, j] * moe.experts[int(idx[n, j])](xf[n:n + 1])[0] for j in range(idx.shape[1])))
    return torch.stack(rows)


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts F.grouped_mm calls, to tell which path ran."""
    calls = []
    real = F.grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counting)
    return calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dispatch_equals_each_tokens_own_experts(case, precision, grouped_calls):
    preset, overrides = CASES[case]
    moe = moe_layer(preset, **overrides)
    xf = torch.randn(40, moe.gate.in_features, generator=torch.Generator().manual_seed(1))
    bf16 = precision == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, weight, idx = moe.route(xf)
        assert len(idx.unique()) == moe.E  # every expert has tokens here
        got = moe.experts_forward(xf, weight, idx)
        n_calls = len(grouped_calls)
        want = per_token_reference(moe, xf, weight, idx)
    grouped = bf16 and case != "unaligned widths"
    assert n_calls == (3 if grouped else 0) and set(grouped_calls) <= {torch.bfloat16}
    assert got.dtype == torch.float32  # under autocast too: the k slots add up in the residual stream's fp32
    # fp32: the same products, summed in another order; measured up to 1.2e-7 on outputs up to 0.5.
    # bf16: the reference's Linears run in bf16 too (autocast), but it weights and sums the k slots in
    # bf16 where the dispatch does it in fp32; measured up to 2e-3 of the largest output (9.8e-4 on 0.5).
    tol = 1e-2 * float(want.detach().abs().max()) if bf16 else 1e-6
    torch.testing.assert_close(got, want.float(), atol=tol, rtol=0)
    if not bf16:  # gradients reach every expert and the input as the reference's do
        x1, x2 = xf.clone().requires_grad_(), xf.clone().requires_grad_()
        g = torch.randn_like(got)
        (moe.experts_forward(x1, weight.detach(), idx) * g).sum().backward()
        mine = [p.grad.clone() for p in moe.experts.parameters()]
        moe.zero_grad()
        (per_token_reference(moe, x2, weight.detach(), idx) * g).sum().backward()
        for a, b in zip(mine, [p.grad for p in moe.experts.parameters()]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny3-moe"])
def test_bf16_dispatch_reads_no_value_on_the_host(preset):
    """Under FakeTensorMode tensors have shapes but no values, so any host read of a value (``.tolist()``,
    ``.item()``: a GPU->CPU sync on a GPU) raises. The bf16 path runs forward and backward through a whole
    model; the fp32 loop reads the run ends once, and is caught, which shows the check can fail."""
    model = build_model(ModelConfig(**preset_values(preset)), seed=0).train()
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.randint(0, 6400, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids)
            loss = out.logits.float().mean() + out.aux_loss
        loss.backward()
        with pytest.raises(DataDependentOutputException):
            model(ids)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny3-moe"])
def test_bf16_idle_experts_still_get_gradients(preset):
    """One token uses k < E experts; in the grouped path the others run on empty runs and must still get a
    (zero) gradient, or DDP waits for them forever."""
    model = build_model(ModelConfig(**preset_values(preset)), seed=0).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 6400, (1, 1)))
        loss = out.logits.float().mean() + out.aux_loss
    loss.backward()
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert all(p.grad is not None for p in model.parameters())
    assert any(torch.count_nonzero(p.grad) == 0 for p in experts)  # some expert was idle
    assert any(torch.count_nonzero(p.grad) > 0 for p in experts)
