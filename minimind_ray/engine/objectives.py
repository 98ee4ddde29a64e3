"""Stage plug-ins: what differs between pretrain, SFT, LoRA, DPO, distillation and GRPO.

The training step (step.py) is the same for every stage; minimind_ray/stages.py names each
stage's objective class here. An objective supplies:

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

import copy
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minimind_ray.config import RunConfig

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
    """Base: causal-LM cross-entropy on every target token (pretrain, SFT)."""

    name = "pretrain"

    def __init__(self, cfg: RunConfig):
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


class SFTObjective(Objective):
    """Same loss; the data format puts targets on assistant spans only."""

    name = "sft"


class LoRAObjective(SFTObjective):
    """Adapters on the configured projections; base weights frozen.

    Frozen parameters have requires_grad=False before DDP wraps the model, so DDP
    never waits for their gradients (no unused-parameter hang)."""

    name = "lora"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        from minimind_ray.model.lora import apply_lora, freeze_base

        if not any(".lora." in k for k in model.state_dict()):
            apply_lora(model, self.cfg.train.lora)
        freeze_base(model)


def _frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _load_frozen(cfg_model, weights: str, device: torch.device) -> nn.Module:
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.weights import load_model_weights

    m = build_model(cfg_model)
    load_model_weights(m, weights)
    m.to(device)
    return _frozen_copy(m)


class DPOObjective(Objective):
    """-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r))), log-probs summed over assistant tokens.

    The reference model is a frozen copy held outside the trained module: it is
    never handed to the optimizer, DDP or the checkpoint."""

    name = "dpo"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        ref = self.cfg.train.dpo.reference
        self.reference = _load_frozen(self.cfg.model, ref, device) if ref else _frozen_copy(model).to(device)

    def weight(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].shape[0])

    def tokens(self, batch: Batch) -> int:
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())

    @staticmethod
    def _seq_logp(model, ids, targets):
        out = model(ids)
        logp, _ = token_log_probs(out.logits, targets)
        return logp.sum(-1), out.aux_loss  # (B,)

    def loss_sum(self, model, batch):
        # one forward over chosen+rejected keeps DDP to a single backward graph
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        tgt = torch.cat([batch["chosen_targets"], batch["rejected_targets"]])
        b = batch["chosen_input_ids"].shape[0]
        pol, aux = self._seq_logp(model, ids, tgt)
        with torch.no_grad():
            ref, _ = self._seq_logp(self.reference, ids, tgt)
        pi_logratio = pol[:b] - pol[b:]
        ref_logratio = ref[:b] - ref[b:]
        beta = self.cfg.train.dpo.beta
        margin = beta * (pi_logratio - ref_logratio)  # implicit reward margin (B,)
        loss = -F.logsigmoid(margin).sum()
        chosen_reward = beta * (pol[:b] - ref[:b]).detach()
        rejected_reward = beta * (pol[b:] - ref[b:]).detach()
        extra = {
            "reward_margin": (chosen_reward - rejected_reward).sum(),
            "reward_accuracy": (chosen_reward > rejected_reward).float().sum(),
            "chosen_reward": chosen_reward.sum(),
            "rejected_reward": rejected_reward.sum(),
        }
        return loss, aux, extra


class DistillObjective(Objective):
    """alpha * CE + (1 - alpha) * T^2 * KL(teacher || student) on target tokens (MiniMind's defaults 0.5, 1.5)."""

    name = "distill"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        from minimind_ray.config import ModelConfig
        from minimind_ray.model.presets import preset_values

        d = self.cfg.train.distill
        tcfg = ModelConfig(**preset_values(d.teacher_preset)) if d.teacher_preset else self.cfg.model
        self.teacher = _load_frozen(tcfg, d.teacher_weights, device)

    def loss_sum(self, model, batch):
        d = self.cfg.train.distill
        out = model(batch["input_ids"])
        with torch.no_grad():
            t_logits = self.teacher(batch["input_ids"]).logits
        targets = batch["targets"]
        s, t = out.logits.float(), t_logits.float()  # (B, T, V)
        ce = F.cross_entropy(s.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        T = d.temperature
        kl_tok = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                          reduction="none").sum(-1)  # (B, T); masked by multiplication: no host sync
        kl = (kl_tok * targets.ne(-100)).sum() * (T * T)
        loss = d.alpha * ce + (1.0 - d.alpha) * kl
        return loss, out.aux_loss, {"ce": ce.detach(), "kl": kl.detach()}


class GRPOObjective(Objective):
    """GRPO / CISPO (MiniMind's train_grpo.py, with verl's, TRL's and DAPO's options; the pieces are in
    minimind_ray/rl/, docs/rl.md). ``prepare`` samples ``num_generations`` completions of each prompt from the
    current policy (in this worker or on a pool of rollout actors), scores them with the reward terms and turns
    the rewards into advantages; ``update_plan`` makes ``num_iterations`` passes of ``mini_batches`` optimizer
    updates over them; ``loss_sum`` is the clipped (grpo) or clamped (cispo) policy-gradient loss plus beta * KL to
    a frozen copy of the initial weights, aggregated as ``loss_agg`` says. Every completion samples from a seed of
    its own (rl/rollout.py:row_seeds), so a restarted run samples what an uninterrupted one did; the adaptive KL
    controller's beta is the objective's checkpointed state."""

    name = "grpo"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        from minimind_ray.rl.policy_step import GRPOPlan
        from minimind_ray.rl.rewards import build_rewards

        g = self.cfg.train.grpo
        self.reference = _frozen_copy(model).to(device) if g.beta > 0 else None
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_rewards(g.rewards, device, run_name=self.cfg.name)
        self.plan = GRPOPlan(self.cfg)

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        return self.plan.prepare(state, batches, step, rewards=self.rewards, reference=self.reference)

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        return self.plan.updates(batches)

    def weight(self, batch: Batch) -> int:
        from minimind_ray.rl.grpo import loss_units

        return loss_units(batch["completion_mask"], self.cfg.train.grpo.loss_agg)

    def metric_weight(self, batch: Batch) -> int:
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def loss_sum(self, model, batch):
        from minimind_ray.rl.grpo import grpo_loss_sum

        return grpo_loss_sum(model, batch, self.cfg.train.grpo, beta=self.plan.kl.beta)

    def end_step(self, state, out) -> None:
        self.plan.end_step(state, out)

    def state_dict(self) -> Dict:
        return self.plan.state_dict()

    def load_state_dict(self, sd: Dict) -> None:
        self.plan.load_state_dict(sd)


# --------------------------------------------------------------------------- PPO (issue 24): the rl/ppo*.py pieces


class PPOObjective(Objective):
    """PPO with a critic (MiniMind's train_ppo.py; rl/ppo.py, rl/ppo_step.py, docs/rl.md). ``prepare`` samples one
    completion per prompt, scores it with the reward terms, and turns the score on its last token (and, with
    ``kl_penalty: reward``, the per-token KL) into GAE advantages over the critic's values; ``update_plan`` makes
    ``ppo_update_iters`` passes of ``mini_batches`` updates; ``loss_sum`` is the clipped policy loss, kl_coef x
    the k3 KL to a frozen copy of the initial weights and vf_coef x the clipped value loss, per completion token;
    ``keep_update`` stops the step's updates when their approximate KL exceeds early_stop_kl. The critic (a value
    head on a copy of the initial policy) is a trained part: its own DDP wrapper, AdamW at critic_lr, and
    ``critic.pth`` in every checkpoint."""

    name = "ppo"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        from minimind_ray.rl.ppo import CriticModel
        from minimind_ray.rl.ppo_step import PPOPlan
        from minimind_ray.rl.rewards import build_rewards

        p = self.cfg.train.ppo
        self.reference = _frozen_copy(model).to(device) if p.kl_coef > 0 else None
        self.critic = self.critic_forward = CriticModel(model, seed=self.cfg.train.seed)
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_rewards(p.rewards, device, run_name=self.cfg.name)
        self.plan = PPOPlan(self.cfg)

    def trained_parts(self) -> Dict[str, Tuple[nn.Module, float]]:
        return {"critic": (self.critic, self.cfg.train.ppo.critic_lr)}

    def bind_parts(self, forward_modules: Dict[str, nn.Module]) -> None:
        self.critic_forward = forward_modules["critic"]

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        return self.plan.prepare(state, batches, step, rewards=self.rewards, reference=self.reference,
                                 critic=self.critic)

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        return self.plan.updates(batches)

    def weight(self, batch: Batch) -> int:
        return int(batch["completion_mask"].sum())  # MiniMind's losses are means over the completion tokens

    def metric_weight(self, batch: Batch) -> int:
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def loss_sum(self, model, batch):
        return self.plan.loss_sum(model, self.critic_forward, batch)

    def keep_update(self, state) -> bool:
        return self.plan.keep_update(state)

    def end_step(self, state, out) -> None:
        self.plan.end_step(state, out)


class AgentObjective(GRPOObjective):
    """Agentic tool-use RL (MiniMind's train_agent.py; rl/agent*.py, rl/tools.py, docs/rl.md): GRPO/CISPO as the grpo
    objective computes it (train.grpo), on multi-turn trajectories in which the policy calls tools (train.agent.tools,
    run in a worker process with a time limit) and reads their results; only the policy's own tokens carry loss, and
    a trajectory's reward is the sum of train.agent.rewards (MiniMind's answer, format and repetition terms)."""

    name = "agent"

    def setup(self, model: nn.Module, device: torch.device) -> None:
        from minimind_ray.rl.agent_rewards import build_agent_rewards
        from minimind_ray.rl.agent_step import AgentPlan
        from minimind_ray.rl.tools import ToolBox

        a, g = self.cfg.train.agent, self.cfg.train.grpo
        self.reference = _frozen_copy(model).to(device) if g.beta > 0 else None
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = build_agent_rewards(a.rewards, device, run_name=self.cfg.name)
        self.plan = AgentPlan(self.cfg, ToolBox(a.tools, a.max_tool_response_chars))


OBJECTIVE_CLASSES = {c.__name__: c for c in (Objective, SFTObjective, LoRAObjective, DPOObjective, DistillObjective,
                                             GRPOObjective, PPOObjective, AgentObjective)}


def build_objective(cfg: RunConfig) -> Objective:
    """The objective of ``cfg.train.stage``, by the class name the stage registry gives."""
    from minimind_ray.stages import get_stage

    return OBJECTIVE_CLASSES[get_stage(cfg.train.stage).objective](cfg)
