"""LoRA adapters with MiniMind's key layout (MiniMind ``model/model_lora.py``).

MiniMind hangs a ``lora`` child (``A``: in->r, ``B``: r->out, both bias-free nn.Linear)
on each adapted nn.Linear and rebinds that module's ``forward``. Rebinding makes a
closure that neither pickles nor traces well, so here the adapted layer is swapped
for :class:`LoRALinear`, an ``nn.Linear`` subclass holding the *same* weight Parameter
and the ``lora`` child. The state_dict keys are therefore unchanged:
``<module>.weight`` plus ``<module>.lora.A.weight`` / ``<module>.lora.B.weight``, and
MiniMind's LoRA files load here and ours there.

Scaling: MiniMind adds ``B(A(x))`` unscaled (``LoRAConfig.alpha = None``); with an
``alpha`` the update is scaled by ``alpha / rank`` as in the LoRA paper.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minimind_ray.model.config import LoRAConfig, is_lora_key
from minimind_ray.fsio import torch_save_atomic
from minimind_ray.model.minimind import clean_state_dict, unwrap_model


class LoRA(nn.Module):
    """The low-rank update B(A(x)); A ~ N(0, 0.02), B = 0 so an adapted model starts equal to its base."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        with torch.no_grad():
            self.A.weight.normal_(mean=0.0, std=0.02)
            self.B.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.B(self.A(x))


class LoRALinear(nn.Linear):
    """nn.Linear plus a scaled LoRA branch: y = x W^T (+ b) + scale * B(A(x))."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        nn.Module.__init__(self)  # skip nn.Linear's init: the base's parameters are reused, not re-created
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scale = scale
        self.lora = LoRA(base.in_features, base.out_features, rank).to(base.weight.device, base.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.scale * self.lora(x)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear whose weight has the update folded in (W += scale * B @ A)."""
        with torch.no_grad():
            delta = (self.lora.B.weight.float() @ self.lora.A.weight.float()) * self.scale  # (out, in)
            self.weight += delta.to(self.weight.dtype)
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device="meta")  # meta: no allocation or RNG use for weights we replace at once
        plain.weight, plain.bias = self.weight, self.bias
        return plain


def _is_target(name: str, module: nn.Module, targets: List[str]) -> bool:
    if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear) or is_lora_key(f"{name}."):
        return False  # not a linear layer, or already adapted, or part of an adapter
    if "square" in targets and module.in_features == module.out_features:
        return True
    return any(name == t or name.endswith("." + t) for t in targets if t != "square")


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> List[str]:
    """Wrap every targeted nn.Linear in a LoRALinear; returns the adapted module names.

    Targets: ``"square"`` = every nn.Linear with in == out (MiniMind's rule: q_proj and
    o_proj when nh*hs == h), and/or module-name suffixes such as ``"v_proj"``.
    Adapters are created in ``named_modules`` order, as MiniMind does.
    """
    root = unwrap_model(model)
    scale = 1.0 if cfg.alpha is None else cfg.alpha / cfg.rank
    names = [n for n, m in root.named_modules() if _is_target(n, m, list(cfg.targets))]
    if not names:
        raise ValueError(f"LoRA targets {list(cfg.targets)} match no nn.Linear in the model")
    for name in names:
        _replace(root, name, LoRALinear(root.get_submodule(name), cfg.rank, scale))
    return names


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train: every parameter outside a ``.lora.`` branch stops requiring grad."""
    for name, p in unwrap_model(model).named_parameters():
        p.requires_grad_(is_lora_key(name))


def _adapters(model: nn.Module) -> Dict[str, LoRALinear]:
    return {n: m for n, m in unwrap_model(model).named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """Only the adapter weights, keyed ``<module>.lora.{A,B}.weight`` (MiniMind's layout, no prefixes)."""
    return {f"{name}.lora.{k}": v for name, m in _adapters(model).items() for k, v in m.lora.state_dict().items()}


def save_lora(model: nn.Module, path: str, dtype: Optional[torch.dtype] = torch.float16) -> None:
    """Write the adapters as MiniMind does (fp16 since d65ef2c), atomically via a temp file."""
    sd = {k: (v.to(dtype) if dtype else v).detach().cpu() for k, v in lora_state_dict(model).items()}
    torch_save_atomic(sd, path)


def load_lora(model: nn.Module, path_or_state_dict, strict: bool = True) -> None:
    """Load adapter weights into a model that already has adapters (``apply_lora`` first).

    ``strict``: every adapter must receive its A and B and no key may be left over
    (MiniMind silently ignores extra keys; a typo'd target should fail loudly here).
    """
    sd = path_or_state_dict
    if not isinstance(sd, dict):
        sd = torch.load(sd, map_location="cpu", weights_only=True)
    sd = clean_state_dict(sd)
    adapters = _adapters(model)
    if not adapters:
        raise ValueError("model has no LoRA adapters: call apply_lora(model, cfg) first")
    used = set()
    for name, m in adapters.items():
        prefix = f"{name}.lora."
        part = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        used.update(prefix + k for k in part)
        m.lora.load_state_dict(part, strict=strict)
    extra = sorted(set(sd) - used)
    if strict and extra:
        raise KeyError(f"LoRA keys with no matching adapter: {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it; returns the (same) model,
    now with plain nn.Linear layers and MiniMind's base state_dict keys only."""
    root = unwrap_model(model)
    for name, m in _adapters(root).items():
        _replace(root, name, m.merged())
    return model


# MiniMind's file name for adapters alone, lora_<hidden>.pth (MiniMind's train_lora.py): export writes it beside the weights
ADAPTER_FILE_PREFIX = "lora"


def adapter_rank(sd: Dict[str, Tensor], where: str) -> int:
    """The rank of the adapters in a state dict (their A matrices' rows); ValueError naming ``where`` without any."""
    ranks = [v.shape[0] for k, v in sd.items() if k.endswith("lora.A.weight")]
    if not ranks:
        raise ValueError(f"{where}: no '<module>.lora.A.weight' keys; not a LoRA weights file")
    return ranks[0]


def merge_adapters(model: nn.Module, sd: Dict[str, Tensor], alpha: Optional[float] = None,
                   where: str = "the adapters") -> nn.Module:
    """Attach adapters of ``sd``'s rank to a model without any, load them, fold them in (merge-lora, serve --lora)."""
    apply_lora(model, LoRAConfig(rank=adapter_rank(sd, where), alpha=alpha))
    load_lora(model, sd)
    return merge_lora(model)

