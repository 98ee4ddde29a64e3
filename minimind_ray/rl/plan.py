"""The plan base of every RL algorithm: what one step of GRPO, PPO, the agent, RLOO (each one module of stages/:
stages/grpo.py, ppo.py, agent.py, rloo.py) or a new algorithm does, written once. An algorithm subclasses
:class:`RolloutPlan` (or :class:`GroupPlan`, for one that samples a group of completions per prompt) and supplies only
what differs. The plan is the stage's objective: it answers what the engine asks of one (stages/objective.py's
hooks), so a stage record's ``objective`` returns the algorithm's plan.

    setup(model)    the frozen reference (a copy of the initial policy, when the algorithm weighs a KL to it) and the
                    reward terms, loaded without moving the sampling RNG
    prepare(step)   the rollouts sent ahead for this step are collected (train.rollout.overlap), the policy's weights
                    go to the rollout engine of train.rollout, the step's requests are generated (all micro-batches as
                    one batch, unless they were sent ahead) and scored, step + 1's requests are sent to run during this
                    step's update (where overlapping keeps a restored run exact), the advantages are computed, and the
                    rollout's seconds are a metric
    update_plan()   passes over the rollouts, each of mini-batches optimizer updates over row slices of them

What an algorithm supplies (the rest has defaults):

    section             its config section (train.<name>): max_gen_len, temperature, top_p, top_k, rewards, mini_batches
    kl_field            its section's KL weight: > 0, a frozen reference is kept (its log-probs as ``ref_logp``)
    grammar()           what every completion follows (default: the section's ``json_schema`` file; None = free)
    requests()          each micro-batch's first rollout request (prompt rows, their mask, sampling params, row seeds)
    score()             one micro-batch's rollout -> what the loss trains on: rewards, log-probs, ``metric_<name>`` sums
    advantages()        the step's rolled-out micro-batches get their ``advantages`` (a global batch's all-reduce here)
    passes_field, weight(), loss_sum()   passes per step, a micro-batch's loss units, its loss summed over them
    keep_update(), end_step(), state_dict(), trained_parts()    when it has an early stop, state or a second model

Light: torch is imported where a run uses it, so that a stage record (stages/<name>.py, imported by the CLI) can
subclass a plan: one module then holds an algorithm's section, record, advantages and loss.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Dict, List

Batch = Dict[str, Any]  # name -> torch.Tensor


def rows(batch: Batch, lo: int, hi: int, keep_metrics: bool) -> Batch:
    """Rows lo:hi of a rolled-out micro-batch; its metric sums and metric_rows stay with one slice only."""
    import torch  # lazy: torch, when a run trains

    out = {k: v[lo:hi] for k, v in batch.items() if not k.startswith("metric_") and v.dim() > 0}
    if keep_metrics:
        out.update({k: v for k, v in batch.items() if k.startswith("metric_")})
    out["metric_rows"] = torch.tensor(batch["completion_mask"].shape[0] if keep_metrics else 0)
    return out


def build_rollout(cfg, state, constrained_by=None):
    """The engine ``train.rollout.engine`` names: this worker's sampler, or a pool of Ray actors (rl/actors.py).
    ``constrained_by``: the run's tokenizer when the stage constrains its rollouts (rl/constraints.py): the engine
    compiles the grammars for it."""
    engine = cfg.train.rollout.engine
    if engine == "worker":
        from minimind_ray.model.prefix_cache import PrefixCache  # lazy: torch, when a run trains
        from minimind_ray.rl.constraints import grammar_compiler  # lazy: torch, when a run trains
        from minimind_ray.rl.rollout import TorchRollout  # lazy: torch, when a run trains

        return TorchRollout(state.autocast, PrefixCache.of_mib(cfg.train.rollout.prefix_cache_mb),
                            grammar_compiler(constrained_by, cfg.model.vocab_size) if constrained_by else None)
    if engine == "actors":
        from minimind_ray.rl.actors import ActorRollout  # lazy: torch and Ray, when a run trains

        return ActorRollout(cfg, state.rank, state.world, constrained_by)
    raise ValueError(f"train.rollout.engine: unknown rollout engine {engine!r}; one of ('worker', 'actors')")


def all_reduced(state, t):
    """``t`` summed over the ranks (in place), as every rank's copy of it."""
    if state.world > 1:
        import torch.distributed as dist  # lazy: torch, when a run trains

        dist.all_reduce(t)
    return t


class RolloutPlan:
    """The skeleton of an RL step (module docstring). ``section``: the algorithm's config section."""

    group_size = 1  # completions sampled per prompt
    generate_together = True  # a step's requests are generated as one batch when none was sent ahead (the agent: no,
    # its turns are generated one after another)

    def __init__(self, cfg, section):
        self.cfg, self.section = cfg, section
        self.engine = self.tokenizer = self.reference = None
        self.grammar_text = None  # what every completion follows (the section's constraint, rl/constraints.py)
        self.rewards: list = []
        self.pending: Dict[int, list] = {}  # step -> this rank's requests sent ahead, one per micro-batch

    # ------------------------------------------------------------------ what an algorithm supplies

    kl_field = None  # its section's field weighing a KL to the frozen reference (> 0: one is kept); None: no reference
    passes_field = None  # its section's field counting the optimizer passes over each batch of rollouts; None: one

    @property
    def kl_weight(self) -> float:
        return getattr(self.section, self.kl_field) if self.kl_field else 0.0

    @property
    def passes(self) -> int:
        return getattr(self.section, self.passes_field) if self.passes_field else 1

    def grammar(self):
        """The llguidance grammar text every completion follows, or None (free sampling, the default): the
        section's ``json_schema`` file (rl/constraints.py), for every algorithm whose section has the field."""
        from minimind_ray.rl.constraints import json_schema_grammar  # lazy: llguidance, when a run trains

        path = getattr(self.section, "json_schema", None)
        return json_schema_grammar(path, f"train.{self.cfg.train.stage}.json_schema")

    def build_rewards(self, device) -> list:
        from minimind_ray.rl.rewards import build_rewards  # lazy: a reward model's torch, when a run builds its state

        return build_rewards(self.section.rewards, device, run_name=self.cfg.name)

    def requests(self, state, batches: List[Batch], step: int) -> list:
        raise NotImplementedError

    def score(self, state, mb: Batch, step: int, roll) -> Batch:
        """``roll``: the micro-batch's first request's rollout (generated together or ahead), or None (the agent's,
        when not sent ahead: it generates its turns itself)."""
        raise NotImplementedError

    def advantages(self, state, out: List[Batch]) -> None:
        raise NotImplementedError

    def step_metrics(self, first: Batch, scale: float, state) -> None:
        """Metric sums of the whole step beside ``rollout_s``, on the first micro-batch (GRPO's beta)."""

    def weight(self, batch: Batch) -> int:
        raise NotImplementedError

    def loss_sum(self, model, batch: Batch):
        raise NotImplementedError

    def metric_weight(self, batch: Batch) -> int:
        """The rolled-out completions: the interval meter's means are over completions."""
        return int(batch.get("metric_rows", batch["completion_mask"].new_zeros(())).item())

    def tokens(self, batch: Batch) -> int:
        """Tokens of the update's forward pass (for tokens/s and MFU)."""
        return int(sum(v.numel() for k, v in batch.items() if k.endswith("input_ids")))

    def keep_update(self, state) -> bool:
        return True

    def end_step(self, state, out) -> None:
        pass

    def trained_parts(self) -> dict:
        return {}

    def bind_parts(self, forward_modules: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    # ------------------------------------------------------------------ what every algorithm does

    def setup(self, model, device) -> None:
        """The reference and the reward terms, once, before the policy is wrapped for training."""
        import torch  # lazy: torch, when a run builds its state

        self.reference = frozen_copy(model).to(device) if self.kl_weight > 0 else None
        with torch.random.fork_rng(devices=[]):  # loading a reward model must not move the sampling RNG
            self.rewards = self.build_rewards(device)

    def start(self, state) -> None:
        """The engine and the tokenizer, once, on the first step (the engine needs the worker's state)."""
        from minimind_ray.rl.completions import run_tokenizer  # lazy: torch, when a run trains

        if self.engine is None:
            self.tokenizer = run_tokenizer(self.cfg, state.dataset.manifest)
            self.grammar_text = self.grammar()
            self.engine = build_rollout(self.cfg, state, self.tokenizer if self.grammar_text else None)

    def params(self):
        """The sampling parameters of the algorithm's section."""
        from minimind_ray.model.sampling import SamplingParams  # lazy: torch, when a run trains

        s = self.section
        return SamplingParams(s.max_gen_len, s.temperature, s.top_p, s.top_k, self.tokenizer.eos_id,
                              self.tokenizer.pad_id, grammar=self.grammar_text)

    def overlaps(self, state, step: int) -> bool:
        """Whether step ``step + 1``'s rollouts are sent now, from the weights before this step's update: with
        ``train.rollout.overlap``, except before the last step and at a checkpoint step (a run restored there must
        generate what an uninterrupted one did, so nothing of step + 1 may come from before the checkpoint)."""
        from minimind_ray.store.config import checkpoint_due  # lazy: omegaconf, yaml, only when this runs

        return (self.cfg.train.rollout.overlap and step < state.total_steps
                and not checkpoint_due(self.cfg, step, state.total_steps))

    def prepare(self, state, batches: List[Batch], step: int) -> List[Batch]:
        import torch  # lazy: torch, when a run trains

        self.start(state)
        t0 = time.perf_counter()
        ahead = [self.engine.collect(h) for h in self.pending.pop(step, [])]  # generated from the older weights
        self.engine.update_policy(state.model, step)
        if not ahead and self.generate_together:  # the step's micro-batches as one batch of rows
            ahead = self.engine.generate_many(self.requests(state, batches, step))
        out = [self.score(state, mb, step, ahead[i] if ahead else None) for i, mb in enumerate(batches)]
        if self.overlaps(state, step):  # step + 1's rollouts, generated while this step's updates run
            self.pending[step + 1] = [self.engine.submit(*request)
                                      for request in self.requests(state, state.stream.peek(), step + 1)]
        self.advantages(state, out)
        # the interval meter divides metric sums by the completions of the interval (global batch * group per step):
        # weighted so, this rank's seconds come out as the step's rollout time averaged over ranks
        scale = self.cfg.train.global_batch_size * self.group_size / state.world
        out[0]["metric_rollout_s"] = torch.tensor((time.perf_counter() - t0) * scale, dtype=torch.float64,
                                                  device=state.device)
        self.step_metrics(out[0], scale, state)
        return out

    def update_plan(self, batches: List[Batch]) -> List[List[List[Batch]]]:
        """``passes`` passes over the rollouts, each ``section.mini_batches`` updates: update j of a pass trains on the
        j-th row slice of every micro-batch (the same slices on every rank and pass); the metrics ride with the
        first."""
        out = []
        for p in range(self.passes):
            updates = []
            for j in range(self.section.mini_batches):
                update = []
                for b in batches:
                    n = b["completion_mask"].shape[0]
                    update.append(rows(b, n * j // self.section.mini_batches, n * (j + 1) // self.section.mini_batches,
                                       keep_metrics=(p == 0 and j == 0)))
                updates.append(update)
            out.append(updates)
        return out


class GroupPlan(RolloutPlan):
    """An algorithm that samples ``section.num_generations`` completions of each prompt, each from its own seed
    (rollout.row_seeds), and scores them with rl/completions.py:rollout_micro_batch: the group's rewards and each term's,
    the behaviour and reference log-probs, ``section.mask_truncated`` (GRPO, RLOO)."""

    dynamic_rounds = 0  # DAPO's resampling of groups whose rewards are all equal (GRPO's dynamic_sampling)
    kl_field, passes_field = "beta", "num_iterations"  # a group algorithm's section names them so (GRPO, RLOO)

    @property
    def group_size(self) -> int:
        return self.section.num_generations

    def requests(self, state, batches: List[Batch], step: int) -> list:
        from minimind_ray.rl.rollout import row_seeds  # lazy: torch, when a run trains

        G, dev = self.group_size, state.device
        return [(mb["prompt_ids"].to(dev).repeat_interleave(G, 0), mb["prompt_mask"].to(dev).repeat_interleave(G, 0),
                 self.params(), row_seeds(self.cfg.train.seed, step, mb["sample_ids"], G).to(dev)) for mb in batches]

    def score(self, state, mb: Batch, step: int, roll) -> Batch:
        from minimind_ray.rl.completions import rollout_micro_batch  # lazy: torch, when a run trains

        return rollout_micro_batch(mb, engine=self.engine, params=self.params(), group_size=self.group_size,
                                   rewards=self.rewards, tokenizer=self.tokenizer, reference=self.reference,
                                   autocast=state.autocast, device=state.device, seed=self.cfg.train.seed, step=step,
                                   dynamic_rounds=self.dynamic_rounds, mask_truncated=self.section.mask_truncated,
                                   pending=roll)


def frozen_copy(model):
    """A copy of ``model`` that never trains (the reference policy), in eval mode."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
