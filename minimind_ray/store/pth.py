"""MiniMind ``.pth`` files: a plain ``state_dict`` with MiniMind's keys (both tied keys kept)."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from minimind_ray.fsio import torch_save_atomic
from minimind_ray.model.minimind import clean_state_dict


def save_pth(model: nn.Module, path: str, dtype: torch.dtype = torch.float16) -> None:
    """MiniMind's .pth: the model's clean state dict in ``dtype`` (fp16 as MiniMind's trainers
    write it), written atomically (a reader never sees a half-written file)."""
    sd = {k: v.detach().to(dtype).cpu() for k, v in clean_state_dict(model.state_dict()).items()}
    torch_save_atomic(sd, path)


def read_pth(path: str) -> Dict[str, torch.Tensor]:
    """A .pth as a clean state dict; ``weights_only``: a file holding pickled code is refused."""
    return clean_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def load_pth(model: nn.Module, path_or_state_dict, strict: bool = True):
    """Load a MiniMind .pth (fp16 or fp32, with or without wrapper prefixes) into ``model``;
    values are cast to the model's dtype. Returns load_state_dict's (missing, unexpected)."""
    sd = path_or_state_dict
    if not isinstance(sd, dict):
        sd = read_pth(sd)
    return model.load_state_dict(clean_state_dict(sd), strict=strict)
