"""KTO (Ethayarajh, Xu, Muennighoff, Jurafsky and Kiela, 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization"): preference optimisation on unpaired replies, each judged desirable or undesirable (data format
``kto``), against a frozen reference like DPO's (``train.kto``). As TRL's KTOTrainer computes it, with r the
implied reward log pi(y|x) - log ref(y|x) (summed over the reply's tokens) and z the reference point:

    desirable:   desirable_weight   * (1 - sigmoid(beta * (r - z)))
    undesirable: undesirable_weight * (1 - sigmoid(beta * (z - r)))

averaged over the global batch's replies. z estimates KL(pi || ref) from mismatched prompt/reply pairs (the format
pairs each prompt with another row's reply), detached and clamped at 0. It is the mean over the whole optimizer
step's batch, all its micro-batches on all workers (TRL gathers it across processes), so it is known before any of
the step's losses and is the same at every worker count. KTO's worked example of docs/architecture.md: this module,
stages/kto_objective.py, data/formats/kto.py and one line in each registry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.stages.stage import MemoryTerms, Stage


@dataclass
class KTOConfig:
    """Kahneman-Tversky optimisation (stage 'kto'); defaults are TRL's."""

    beta: float = _f(0.1, "scale of the implied reward: beta x (log pi - log ref) of a reply, against the KL point",
                     gt=0)
    desirable_weight: float = _f(1.0, "weight of a desirable reply's loss (label true); with unequal counts the paper "
                                      "keeps (desirable_weight x desirable replies) / (undesirable_weight x "
                                      "undesirable replies) within [1, 4/3]", ge=0)
    undesirable_weight: float = _f(1.0, "weight of an undesirable reply's loss (label false)", ge=0)
    reference: Optional[str] = _f(None, "reference weights (.pth/checkpoint); None = a frozen copy of the initial "
                                        "weights")


def objective(cfg):
    from minimind_ray.stages.kto_objective import KTOObjective  # lazy: torch, when a run builds its state

    return KTOObjective(cfg)


def validate(cfg) -> None:
    need(cfg.train.micro_batch_size >= 2, "train.micro_batch_size",
         "kto estimates its KL reference point from each prompt paired with another row's reply of its micro-batch: "
         "a micro-batch of 1 row has no other reply (TRL refuses it too); use 2 or more")


def memory(cfg, policy, count) -> MemoryTerms:
    return MemoryTerms(frozen_models=1.0)  # one sequence per row with gradients; the reference


STAGE = Stage("kto", "KTO: preference optimisation on unpaired replies judged desirable or not", formats=("kto",),
              objective=objective, export_prefix="kto", section=KTOConfig, validate=validate, memory=memory,
              parent_fields=(("reference", "reference"),),
              headline=("kl", "reward_accuracy"),
              fsdp_refusal="its frozen reference would stay a whole copy on every worker, unsharded")
