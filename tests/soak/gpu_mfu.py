"""The MFU candidates that tests/soak/gpu_ray_check.py measures (part ``mfu``), and its reading of a profile (part
``profile``).

Each candidate changes one thing of one bare-engine run in the check's process and undoes it after; the product code
is untouched, so CPU results and bit-exactness stay as they are. A candidate that wins on the GPU, with its loss
within bf16 noise of the baseline's, becomes a product change with its own CPU test in a later commit (issue 51).
What each one switches, against minimind_ray/model/minimind.py, engine/state.py and stages/objective.py as they are:

  baseline     bf16 autocast + torch.compile (default mode), micro-batch 64 x 512: what the recipes run
  fused_adamw  ``torch.optim.AdamW(fused=True)`` in place of the default (foreach) AdamW that ``TrainState.build``
               makes: one kernel for the whole update (CUDA; torch has a fused CPU AdamW too, so it runs there)
  micro_x4     4x the sequences per micro-batch (and per step): 256 x 512 on the GPU, by engine/memory.py's estimate
               44.6 GiB with compile, which an 80 GiB H100 holds
  sdpa_gqa     the training path's attention (``Attention.forward`` without a KV cache) still copies each kv head
               out to its query heads (``repeat_kv``) before ``scaled_dot_product_attention``: here ``repeat_kv`` is
               the identity and that one call passes ``enable_gqa=True`` with the nkv heads as they are (torch >= 2.5,
               ``SDPA_GQA``). Only minimind.py's ``F`` is swapped (a copy of torch.nn.functional whose SDPA adds
               the flag when the key heads are fewer than the query heads), not torch's. The decode paths are not
               touched and not measured: a cached prefill already passes ``enable_gqa``, and a decode step's
               ``_grouped_attention`` (with its keys-first CPU product) reads the cached heads with no copy
  all          micro_x4 + fused_adamw + sdpa_gqa together
  micro_x2     2x the sequences per micro-batch
  cuda_graphs  ``torch.compile(mode="reduce-overhead")`` in place of the default mode: CUDA graphs replay each step's
               launches (CUDA only); the row says how many graphs inductor skipped (``cudagraph_skips``)
  bf16_loss    ``stages/objective.py``'s cross-entropy (``Objective.loss_sum``: pretrain and SFT) on the logits as
               autocast leaves them, without its explicit ``.float()`` copy (B x T x 6400 fp32, outside the compiled
               model); autocast still runs log_softmax in fp32. In fp32 (the CPU rehearsal) it changes nothing

None was dropped: each still changes what it names in today's code. A switch that did not take effect in its run
(no attention call saw uncopied kv heads, the loss never ran) raises, and its row says the candidate failed.
"""
from __future__ import annotations

import gzip
import re
import shutil
import time
import types
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from minimind_ray.engine.step import lr_lambda, train_step
from minimind_ray.model import minimind
from minimind_ray.stages.objective import Objective

VARIANTS: Dict[str, dict] = {  # in the order they are measured (the budget may cut the last ones)
    "baseline": {"what": "the check's settings (on the GPU bf16 autocast + torch.compile)"},
    "fused_adamw": {"what": "AdamW(fused=True)"},
    "micro_x4": {"micro_x": 4, "what": "4x the sequences per micro-batch"},
    "sdpa_gqa": {"what": "SDPA enable_gqa on the kv heads, no repeat_kv copies"},
    "all": {"micro_x": 4, "what": "micro_x4 + fused_adamw + sdpa_gqa"},
    "micro_x2": {"micro_x": 2, "what": "2x the sequences per micro-batch"},
    "cuda_graphs": {"cuda_only": True, "what": "torch.compile(mode='reduce-overhead'): CUDA graphs"},
    "bf16_loss": {"what": "cross-entropy on the bf16 logits, no .float() copy"},
}


def _functional_with_gqa(seen: List[int]) -> types.ModuleType:
    """A copy of torch.nn.functional whose SDPA attends fewer key/value heads than query heads with ``enable_gqa``
    (what minimind.py's attention calls once ``repeat_kv`` copies nothing); ``seen`` gets one entry per such call."""
    functional = types.ModuleType(F.__name__)
    functional.__dict__.update(F.__dict__)

    def scaled_dot_product_attention(q, k, v, *args, **kwargs):  # q (B, nh, T, hs), k and v (B, nkv, S, hs)
        if k.shape[-3] != q.shape[-3]:
            kwargs.setdefault("enable_gqa", True)
            seen.append(k.shape[-3])
        return F.scaled_dot_product_attention(q, k, v, *args, **kwargs)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    return functional


def _loss_on_bf16_logits(calls: List[torch.dtype]) -> Callable:
    """``Objective.loss_sum`` without the ``.float()`` copy of the logits; ``calls`` gets each call's logits dtype."""

    def loss_sum(self, model, batch):
        out = model(batch["input_ids"])
        calls.append(out.logits.dtype)
        ce = F.cross_entropy(out.logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum")
        return ce, out.aux_loss, {}

    return loss_sum


class Candidate:
    """One candidate's switches for one run: ``with Candidate(name) as c:`` build the state, ``c.on_state(state)``,
    train, ``c.verify()`` (raises when a switch never took effect; else a note for the row). Module-level switches
    (the attention) are on inside the ``with`` only: they must be there when the model is built and compiled."""

    def __init__(self, name: str):
        if name not in VARIANTS:
            raise ValueError(f"no MFU candidate {name!r}: one of {', '.join(VARIANTS)}")
        self.name, self.undo, self.gqa_calls, self.loss_calls, self.skips = name, [], [], [], None

    def has(self, switch: str) -> bool:
        return self.name == switch or (self.name == "all" and switch in ("fused_adamw", "sdpa_gqa"))

    def __enter__(self) -> "Candidate":
        if self.has("sdpa_gqa"):
            if not minimind.SDPA_GQA:
                raise RuntimeError(f"torch {torch.__version__} has no enable_gqa in scaled_dot_product_attention")
            old_repeat, old_f = minimind.repeat_kv, minimind.F
            minimind.repeat_kv = lambda x, n_rep: x  # (B, S, nkv, hs) as it is
            minimind.F = _functional_with_gqa(self.gqa_calls)
            self.undo.append(lambda: (setattr(minimind, "repeat_kv", old_repeat), setattr(minimind, "F", old_f)))
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self.undo):
            undo()

    def on_state(self, state) -> None:
        """The switches of a built ``TrainState`` (engine/state.py): its optimizer, compiled model, objective."""
        t = state.cfg.train
        if self.has("fused_adamw"):
            state.optimizer = torch.optim.AdamW(state.params, lr=t.lr, betas=(t.beta1, t.beta2),
                                                weight_decay=t.weight_decay, fused=True)
            state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(t, state.total_steps))
        if self.has("cuda_graphs"):
            from torch._dynamo.utils import counters

            self.skips = (counters, counters["inductor"]["cudagraph_skips"])
            state.forward_model = torch.compile(state.ddp_model, mode="reduce-overhead")
        if self.has("bf16_loss"):
            if type(state.objective).loss_sum is not Objective.loss_sum:
                raise RuntimeError(f"{type(state.objective).__name__} is not stages/objective.py's cross-entropy")
            state.objective.loss_sum = types.MethodType(_loss_on_bf16_logits(self.loss_calls), state.objective)

    def verify(self) -> str:
        notes = []
        if self.has("sdpa_gqa"):
            if not self.gqa_calls:
                raise RuntimeError("sdpa_gqa: no attention call got the kv heads uncopied; the switch changed nothing")
        if self.has("bf16_loss"):
            if not self.loss_calls:
                raise RuntimeError("bf16_loss: the switched loss never ran")
            if torch.float32 in self.loss_calls:
                notes.append("logits fp32 here: the same loss as the baseline's")
        if self.skips:
            counters, before = self.skips
            notes.append(f"cudagraph skips {counters['inductor']['cudagraph_skips'] - before}")
        return "; ".join(notes)


# --------------------------------------------------------------------------- the profile part

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
    """Over the profiled steps: the share of device time by kind of kernel, the device time a step, the top 10
    kernels (us a step). The profiler's own ``ProfilerStep`` ranges are not kernels."""
    attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    rows = [(e.key, float(getattr(e, attr, 0) or 0)) for e in events if not e.key.startswith("ProfilerStep") and
            (device_type != "cuda" or "CUDA" in str(getattr(e, "device_type", "")))]
    rows = sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])
    total = sum(us for _, us in rows) or 1.0
    shares: Dict[str, float] = {}
    for key, us in rows:
        cat = next((c for c, pat in CATEGORIES if re.search(pat, key, re.I)), "other")
        shares[cat] = shares.get(cat, 0.0) + us / total
    return {"shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])), "device_us_per_step": total / steps,
            "top": [(k[:120], round(us / steps, 1)) for k, us in rows[:10]]}


def profile_run(s, state, n: int) -> dict:
    """torch.profiler over ``n`` steps of ``state`` after a warm-up (``s``: the check's Setup): a kernel table and a
    gzip'd trace under its --out; the kernel summary, how busy the device was and the wall time of a step."""
    from torch.profiler import ProfilerActivity, profile, schedule

    def sync():
        if s.device.type == "cuda":
            torch.cuda.synchronize()

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    warm = 12  # compiled and warm before the profiler starts
    for step in range(1, warm + 1):
        train_step(state, state.stream.next_step(), step)
    sync()
    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=n, repeat=1)) as prof:
        for step in range(warm + 1, warm + n + 2):
            if step == warm + 2:
                sync()
                t_active = time.perf_counter()
            train_step(state, state.stream.next_step(), step)
            prof.step()
        sync()
        wall_us = (time.perf_counter() - t_active) * 1e6
    state.stream.close()
    key = "self_cuda_time_total" if s.device.type == "cuda" else "self_cpu_time_total"
    (s.out / "profile_kernels.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    trace = s.work / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(s.out / "profile_trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    if (s.out / "profile_trace.json.gz").stat().st_size > 15 << 20:
        (s.out / "profile_trace.json.gz").unlink()  # over what a device call brings back
    summary = kernel_summary(prof.key_averages(), s.device.type, n)
    summary["busy"] = summary["device_us_per_step"] * n / wall_us  # 1 - this: the device idles, launch-bound
    summary["step_ms"] = wall_us / n / 1000
    return summary
