"""What an objective is, the cross-entropy of pretraining and SFT, and helpers the other objectives share.

The training step (engine/step.py) is the same for every stage; each stage's record (stages/<name>.py) builds its
objective: this module's cross-entropy, or a subclass in stages/<name>_objective.py. An objective supplies:

* ``setup(model, device)``: freeze what must not train, build frozen extra
  models (DPO reference, distillation teacher);
* ``prepare(state, batches, step)``: what the step trains on (RL rollouts; the identity otherwise);
* ``weight(batch)``: how many loss units a micro-batch holds (target tokens, or
  preference pairs), computable before the forward pass;
* ``loss_sum(model, batch)``: the loss *summed* over those units, plus metrics.

The step all-reduces its total weight over ranks and divides by it, so an
optimizer step's gradient is the gradient of the mean over the *global* batch,
whatever the worker count and accumulation split. That is what makes a 1-worker
and a 2-worker run at the same global batch take the same steps.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minimind_ray.failures import reading
from minimind_ray.rl.plan import frozen_copy  # the reference policy's copy, as RL's plan base makes it

Batch = Dict[str, torch.Tensor]


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-position log p(target) and the mask of positions that carry a target.

    logits (B, T, V), targets (B, T) with -100 where there is no target.
    Returns logp (B, T) (0 where masked) and mask (B, T) float.
    """
    mask = targets.ne(-100)
    safe = targets.clamp_min(0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return logp * mask, mask.float()


class Objective:
    """Base: causal-LM cross-entropy on every target token (the pretrain and sft stages' objective; what the others
    share). A stage's record names its objective (stages/stage.py); the objective needs no name of its own."""

    def __init__(self, cfg):  # the run's RunConfig
        self.cfg = cfg

    def setup(self, model: nn.Module, device: torch.device) -> None:
        """Called once before DDP wrapping; the default trains every parameter."""

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        """Turn this rank's micro-batches of the step into what ``loss_sum`` trains on, before their
        weight is counted. The identity here; an RL objective generates and scores its rollouts
        with ``state.model`` (the plain module: generation needs no collectives)."""
        return batches

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        """The step's optimizer updates: passes, each a list of updates, each a list of micro-batches. One
        update of every micro-batch here; GRPO makes ``num_iterations`` passes of ``mini_batches`` updates."""
        return [[batches]]

    def weight(self, batch: Batch) -> int:
        return int(batch["targets"].ne(-100).sum())

    def metric_weight(self, batch: Batch) -> int:
        """What the extra metrics of ``loss_sum`` are means over (the loss units, unless said otherwise)."""
        return self.weight(batch)

    def tokens(self, batch: Batch) -> int:
        """Tokens processed by the forward pass (for tokens/s and MFU)."""
        return int(sum(v.numel() for k, v in batch.items() if k.endswith("input_ids")))

    def end_step(self, state, out) -> None:
        """After the step's updates (every rank): an objective with state of its own updates it here."""

    def trained_parts(self) -> Dict[str, Tuple[nn.Module, float]]:
        """Models besides the policy that this objective trains (PPO's critic), by name: (module, peak lr). The
        state gives each its own DDP wrapper, AdamW, lr schedule and checkpoint file (engine/state.py:TrainedPart)
        and hands the wrapped modules back through ``bind_parts``, for ``loss_sum`` to run forward through."""
        return {}

    def bind_parts(self, forward_modules: Dict[str, nn.Module]) -> None:
        pass

    def keep_update(self, state) -> bool:
        """After an update's backward, before its optimizer steps (every rank, the same answer on each): False drops
        this update's gradients and every later update of the step (PPO's early stop on KL)."""
        return True

    def state_dict(self) -> Dict:
        """The objective's own state for checkpoints (Stateful; empty for the stateless ones)."""
        return {}

    def load_state_dict(self, sd: Dict) -> None:
        pass

    def loss_sum(self, model: nn.Module, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
        """-> (loss summed over target tokens, aux loss of this micro-batch, extra metric sums)."""
        out = model(batch["input_ids"])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=-100,
                             reduction="sum")
        return ce, out.aux_loss, {}


def load_frozen(cfg_model, weights: str, device: torch.device, field: str) -> nn.Module:
    """A frozen model of ``cfg_model`` with ``weights`` (a teacher, a reference given by path: the config ``field``
    that names it), on ``device``. Weights that cannot be loaded are the user's mistake (failures.py)."""
    from minimind_ray.model.minimind import build_model  # lazy: only the stages with a frozen model load one
    from minimind_ray.store.weights import load_model_weights  # lazy: pyarrow, torch, as build_model above

    m = build_model(cfg_model)
    with reading(f"{field}={weights}"):
        load_model_weights(m, weights)
    m.to(device)
    return frozen_copy(m)
