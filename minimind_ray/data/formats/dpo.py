"""``dpo``: ``{"chosen": [...], "rejected": [...]}`` (MiniMind's dpo.jsonl): both conversations rendered and labelled
like SFT's (data/formats/sft.py), each with its own assistant mask.

Stored columns ``chosen_ids``, ``chosen_mask``, ``rejected_ids``, ``rejected_mask``; batch ``chosen_input_ids``,
``chosen_targets``, ``rejected_input_ids``, ``rejected_targets``, one common length, so that the objective runs
both in one forward (stages dpo, simpo).
"""
from __future__ import annotations

from minimind_ray.data.formats.sft import SFT


class DPO(SFT):
    name = "dpo"
    record = "{chosen, rejected}"
    columns = ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
    byte_columns = ("chosen_mask", "rejected_mask")
    cross_entropy = False
    sides = (("chosen_", "chosen"), ("rejected_", "rejected"))


FORMAT = DPO()
