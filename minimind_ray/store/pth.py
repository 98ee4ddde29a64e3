"""MiniMind ``.pth`` files: a plain ``state_dict`` with MiniMind's keys (both tied keys kept)."""
from __future__ import annotations

import io
from typing import Dict, Mapping, Optional

import torch
from torch import nn

from minimind_ray.fsio import torch_save_atomic
from minimind_ray.model.minimind import clean_state_dict


def save_pth(model: nn.Module, path: str, dtype: torch.dtype = torch.float16) -> None:
    """MiniMind's .pth: the model's clean state dict in ``dtype`` (fp16 as MiniMind's trainers
    write it), written atomically (a reader never sees a half-written file)."""
    sd = {k: v.detach().to(dtype).cpu() for k, v in clean_state_dict(model.state_dict()).items()}
    torch_save_atomic(sd, path)


class WeightsError(ValueError):
    """Weights that cannot be used as they are; the message names the file (and tensor) and why."""


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first sentence of its message."""
    text = str(e).strip()
    text = text.splitlines()[0] if text else ""
    if len(text) > 120 and ". " in text:  # torch's zip errors go on with advice for several sentences
        text = text.split(". ")[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def check_float_tensors(sd: Mapping[str, object], where: str) -> None:
    """Refuse a state dict with anything but floating-point tensors. int8 or other quantized weights
    would otherwise be cast to float as if they were the values, and the model would be garbage."""
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor):
            raise WeightsError(f"{where}: {key!r} holds a value of type {type(value).__name__}, not a tensor: "
                               f"not a model state dict")
        if not value.is_floating_point():
            raise WeightsError(f"{where}: tensor {key!r} has dtype {str(value.dtype).removeprefix('torch.')}; only "
                               f"floating-point weights load (fp32, fp16, bf16): dequantize them first")


def read_pth(path: str, data: Optional[bytes] = None) -> Dict[str, torch.Tensor]:
    """A .pth as a clean state dict of float tensors (``data``: its bytes, already read). ``weights_only``:
    a file holding pickled code is refused. A truncated or foreign file is a WeightsError naming it."""
    try:
        sd = torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:  # a truncated zip, a half-copied pickle, pickled code, not a .pth at all
        raise WeightsError(f"{path}: not a readable PyTorch .pth ({one_line(e)})") from e
    if not isinstance(sd, dict):
        raise WeightsError(f"{path}: holds a {type(sd).__name__}, not a state dict")
    sd = clean_state_dict(sd)
    check_float_tensors(sd, path)
    return sd


def load_pth(model: nn.Module, path_or_state_dict, strict: bool = True):
    """Load a MiniMind .pth (fp16 or fp32, with or without wrapper prefixes) into ``model``;
    values are cast to the model's dtype. Returns load_state_dict's (missing, unexpected)."""
    sd = path_or_state_dict
    if not isinstance(sd, dict):
        sd = read_pth(sd)
    return model.load_state_dict(clean_state_dict(sd), strict=strict)
