"""The one registry of record formats (docs/data.md, "Formats"; docs/architecture.md, "Where to add things").

Each format is one module, ``data/formats/<name>.py``, whose ``FORMAT`` (a :class:`~.base.Format`) holds all that
differs between formats: its record check, its encoding into stored rows, its columns and its collation into a
micro-batch. Nothing outside this package compares format names: it asks the record (``get_format(name)``).
Adding a format is its module and one name in ``FORMAT_MODULES``.

The functions below are the data pipeline's doors, each by format name: :func:`check_record` (the prepare job's
check of a parsed record), :func:`Encoder` (its rows), :func:`collate` (a worker's micro-batch); and ``COLUMNS``,
what a prepared directory of each format stores.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

import numpy as np

from minimind_ray.data.formats.base import REASONS, BadRecord, Format, RowEncoder, id_dtype, parse_line, \
    to_arrow, too_long

FORMAT_MODULES = ("pretrain", "sft", "dpo", "rlaif", "prompt", "agent_rl", "kto")

REGISTRY: Dict[str, Format] = {}
for _module in FORMAT_MODULES:
    _format = importlib.import_module(f"{__name__}.{_module}").FORMAT
    REGISTRY[_format.name] = _format
FORMATS: Tuple[str, ...] = tuple(REGISTRY)
COLUMNS: Dict[str, List[str]] = {name: list(f.columns) for name, f in REGISTRY.items()}  # stored list columns

__all__ = ["COLUMNS", "FORMATS", "FORMAT_MODULES", "REASONS", "REGISTRY", "BadRecord", "Encoder", "Format",
           "RowEncoder", "check_record", "collate", "describe", "get_format", "id_dtype", "parse_line", "to_arrow"]


def get_format(name: str) -> Format:
    if name not in REGISTRY:
        raise ValueError(f"unknown format {name!r}; one of {FORMATS}")
    return REGISTRY[name]


def describe() -> str:
    """Every format with what its record holds: ``pretrain {text} | sft {conversations} | ...`` (--help)."""
    return " | ".join(f"{name} {f.record}" for name, f in REGISTRY.items())


def check_record(fmt: str, rec: dict, max_chars: Optional[int] = None) -> None:
    """Raise BadRecord(missing_field | wrong_type | no_prompt) unless ``rec`` has what ``fmt`` needs, or
    BadRecord(too_long) if its text fields hold more than ``max_chars`` characters (used for
    Parquet rows; a jsonl line was measured whole by :func:`parse_line`)."""
    chars = get_format(fmt).check(rec)
    if max_chars is not None and chars > max_chars:
        raise too_long(chars, max_chars)


def Encoder(fmt: str, tokenizer, max_seq_len: int, pack: bool = True) -> RowEncoder:  # noqa: N802 (a class's name)
    """The encoder of ``fmt``'s records into stored rows (a :class:`RowEncoder`); ``pack`` applies to the formats
    that pack (pretrain)."""
    return get_format(fmt).encoder(tokenizer, max_seq_len, pack)


def collate(fmt: str, rows: Dict[str, List[np.ndarray]], sample_ids: np.ndarray, pad_id: int,
            max_seq_len: int) -> dict:
    """Stored rows of ``fmt`` -> one micro-batch of tensors (pre-shifted targets, -100 = no loss); see each
    format's ``collate``."""
    return get_format(fmt).collate(rows, sample_ids, pad_id, max_seq_len)
