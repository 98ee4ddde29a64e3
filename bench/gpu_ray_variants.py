"""The MFU candidates bench/gpu_ray_check.py measures, as bench-only switches on the bare engine.

Each variant changes one thing for one run in this process and undoes it after; the product code is
untouched, so CPU behaviour and bit-exactness stay as they are. A candidate that wins on the GPU becomes
a product change (with its own test) in a later commit, measured here first.

  baseline     bf16 autocast + torch.compile, micro-batch 64 x 512 (what the recipes run)
  fused_adamw  torch.optim.AdamW(fused=True): one kernel per step for the whole update (CUDA only)
  micro_128    128 sequences per micro-batch (the H200 holds far more than 64 x 512 needs)
  micro_256    256 sequences per micro-batch
  sdpa_gqa     scaled_dot_product_attention(..., enable_gqa=True) on the kv heads, no repeat_kv copies
  bf16_loss    cross-entropy on the logits as autocast leaves them (no explicit .float() copy first)
  cuda_graphs  torch.compile(mode="reduce-overhead"): CUDA graphs replay each step's launches (CUDA only)
  all          micro_256 + fused_adamw + sdpa_gqa together
"""
from __future__ import annotations

import re
from typing import Callable, Dict

import torch
import torch.nn.functional as F

VARIANTS: Dict[str, dict] = {  # in the order they are measured (the budget may cut the last ones)
    "baseline": {},
    "fused_adamw": {"cuda_only": True},
    "micro_256": {"micro": 256},
    "sdpa_gqa": {},
    "all": {"micro": 256, "cuda_only": True},
    "micro_128": {"micro": 128},
    "cuda_graphs": {"cuda_only": True},
    "bf16_loss": {},
}


def _gqa_sdpa(original):
    def sdpa(q, k, v, *args, **kwargs):  # q (B, nh, T, hs), k and v (B, nkv, S, hs) once repeat_kv is off
        kwargs.setdefault("enable_gqa", k.shape[-3] != q.shape[-3])  # decoding passes it itself
        return original(q, k, v, *args, **kwargs)
    return sdpa


def _module_switches(name: str) -> Callable[[], None]:
    """Module-level switches (before the model is built); returns what undoes them."""

    from minimind_ray.model import minimind as mm

    undo = []
    if name in ("sdpa_gqa", "all"):
        old_repeat, old_sdpa = mm.repeat_kv, F.scaled_dot_product_attention
        mm.repeat_kv = lambda x, n_rep: x
        F.scaled_dot_product_attention = _gqa_sdpa(old_sdpa)
        undo.append(lambda: (setattr(mm, "repeat_kv", old_repeat), setattr(F, "scaled_dot_product_attention", old_sdpa)))
    if name == "bf16_loss":
        old_loss = objectives.Objective.loss_sum

        def loss_sum(self, model, batch):
            out = model(batch["input_ids"])
            ce = F.cross_entropy(out.logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100,
                                 reduction="sum")
            return ce, out.aux_loss, {}

        objectives.Objective.loss_sum = loss_sum
        undo.append(lambda: setattr(objectives.Objective, "loss_sum", old_loss))
    return lambda: [u() for u in reversed(undo)]


def apply_variant(name: str, state) -> Callable[[], None]:
    """``state`` None: the module-level switches (returns their undo); else the state-level ones."""
    if state is None:
        return _module_switches(name)
    t = state.cfg.train
    if name in ("fused_adamw", "all"):
        from minimind_ray.engine.step import lr_lambda

        state.optimizer = torch.optim.AdamW(state.params, lr=t.lr, betas=(t.beta1, t.beta2),
                                            weight_decay=t.weight_decay, fused=True)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(t, state.total_steps))
    if name == "cuda_graphs":
        state.forward_model = torch.compile(state.ddp_model, mode="reduce-overhead")
    return lambda: None


CATEGORIES = [  # by kernel (CUDA) or op (CPU) name, first match wins
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|aten::(mm|bmm|addmm|linear|matmul)"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("fused elementwise (triton)", r"^triton_"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copies and casts", r"copy|cast|memcpy|memset|to_copy|cat\b"),
    ("loss (softmax, nll)", r"softmax|nll|cross_entropy"),
    ("communication", r"nccl|all_reduce|gloo"),
]


def kernel_summary(events, device_type: str, steps: int) -> dict:
    """Share of device time by kind of kernel over the profiled steps, and the top 10 kernels."""
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    rows = []
    for e in events:
        if device_type == "cuda" and getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        us = float(getattr(e, attr, 0) or (getattr(e, "self_cuda_time_total", 0) if device_type == "cuda" else 0))
        if us > 0:
            rows.append((e.key, us))
    total = sum(us for _, us in rows) or 1.0
    shares: Dict[str, float] = {}
    for key, us in rows:
        cat = next((c for c, pat in CATEGORIES if re.search(pat, key, re.I)), "other")
        shares[cat] = shares.get(cat, 0.0) + us / total
    top = sorted(rows, key=lambda r: -r[1])[:10]
    return {"shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])), "device_us_per_step": total / steps,
            "top": [(k[:120], round(us / steps, 1)) for k, us in top]}
