"""The ppo stage's configuration (a TrainConfig's ``ppo`` section) and its checks; defaults are MiniMind's
``trainer/train_ppo.py`` (d65ef2c). Kept beside the rl room it configures, as rl/grpo_config.py keeps GRPO's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.rl.rewards import RewardConfig, validate_reward_terms


@dataclass
class PPOConfig:
    """Proximal policy optimisation with a critic (stage 'ppo'); the actor's lr is train.lr (MiniMind: 3e-7)."""

    max_gen_len: int = _f(1024, "most new tokens per completion (one per prompt, as MiniMind samples)", ge=1)
    temperature: float = _f(0.8, "sampling temperature of the rollouts", gt=0)
    top_p: float = _f(1.0, "nucleus sampling mass (1 = off)", gt=0, le=1)
    top_k: int = _f(0, "sample among the k most likely tokens (0 = off)", ge=0)
    critic_lr: float = _f(5e-7, "peak lr of the critic (a value head on a copy of the policy); same schedule as "
                                "train.lr", gt=0)
    clip_epsilon: float = _f(0.2, "clip range of the probability ratio in the policy loss", gt=0, lt=1)
    vf_coef: float = _f(0.5, "weight of the value loss in the combined loss", ge=0)
    cliprange_value: float = _f(0.2, "a new value estimate may move this far from the rollout's before the clipped "
                                     "value loss takes over", gt=0)
    kl_coef: float = _f(0.02, "weight of the KL to the frozen reference (a copy of the initial weights); 0 = none",
                        ge=0)
    kl_penalty: str = _f("loss", "where the KL goes: 'loss' = k3 estimate added to the policy loss (MiniMind); "
                                 "'reward' = -kl_coef * (log p - log ref) on each token's reward before GAE "
                                 "(Ziegler et al., TRL, verl)")
    gamma: float = _f(1.0, "GAE discount", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda", ge=0, le=1)
    whiten_advantages: bool = _f(True, "advantages to mean 0, variance 1 over the global batch's tokens (MiniMind)")
    ppo_update_iters: int = _f(2, "passes over each batch of rollouts", ge=1)
    mini_batches: int = _f(1, "optimizer updates per pass: the rollouts split into this many mini-batches "
                              "(MiniMind: batch_size / mini_batch_size, 2 / 2)", ge=1)
    early_stop_kl: Optional[float] = _f(0.25, "an update whose approximate KL to the rollout policy (mean of "
                                              "(log p - log p_old)^2 / 2 over its tokens) exceeds this is dropped, "
                                              "with every later update of the step; None = never", gt=0)
    rewards: List[RewardConfig] = field(default_factory=lambda: [RewardConfig(n) for n in (
        "length", "think_format", "repetition")], metadata={
        "help": "reward terms (docs/rl.md: a rule's name, 'module:function' or reward_model); the sum is the "
                "reward of a completion's last token. Default: MiniMind's rules; its recipe adds its reward model"})


def validate_ppo(cfg) -> None:
    """The ppo stage's checks (its stage record's validate), naming the field."""
    p, d = cfg.train.ppo, cfg.data
    need(d.max_seq_len + p.max_gen_len <= cfg.model.max_position_embeddings, "train.ppo.max_gen_len",
         f"data.max_seq_len {d.max_seq_len} + max_gen_len {p.max_gen_len} exceed model.max_position_embeddings "
         f"{cfg.model.max_position_embeddings}")
    need(p.kl_penalty in ("loss", "reward"), "train.ppo.kl_penalty", f"{p.kl_penalty!r} is not 'loss' or 'reward'")
    need(d.eval_fraction == 0, "data.eval_fraction", "must be 0 for ppo (there is no held-out loss of sampled "
                                                      "completions; measure rewards or accuracy instead)")
    need(cfg.train.init_from is not None, "train.init_from", "PPO improves a trained policy: give its weights (e.g. "
                                                            "a demo SFT run: train.init_from=runs/<demo-sft-run>)")
    validate_reward_terms(p.rewards, "train.ppo.rewards")
