"""What a training stage is: one :class:`Stage` record per stage (``stages/<name>.py``) holding everything that
differs between stages, so that the rest of the project asks the record instead of comparing stage names.

The record is light (no torch): the CLI and the config read it. The stage's objective (its loss) is imported only
when a run builds its training state: from ``stages/<name>_objective.py`` (the supervised and preference stages), the
shared cross-entropy of ``stages/objective.py``, or, for an RL stage, its plan in its own module.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class MemoryTerms:
    """What a stage adds to one worker's memory estimate (engine/memory.py) besides one trained policy, in the
    estimate's own units."""

    sequences: int = 1  # sequences per micro-batch row in one forward (DPO, SimPO: the chosen and the rejected)
    extra_tokens: int = 0  # tokens generated after each prompt (RL: max_gen_len; the agent: up to max_total_len)
    frozen_models: float = 0.0  # frozen models held, in policy sizes (a reference; a teacher)
    trained_models: float = 0.0  # models trained beside the policy, in policy sizes, with gradients and AdamW (a critic)
    trained_params: Optional[int] = None  # parameters the policy trains, added to it, if not all of it (LoRA)
    extra_logit_bytes: int = 0  # per logit (distillation: the teacher's logits and the KL's log-softmaxes)
    batch_fields: Tuple[str, ...] = ()  # settings that size a micro-batch besides micro_batch_size and max_seq_len


def no_checks(cfg) -> None:
    return None


def plain_memory(cfg, policy, count) -> MemoryTerms:
    return MemoryTerms()


def no_plugins(cfg) -> List[str]:
    return []


def nothing_beside(cfg) -> Dict[str, float]:
    return {}


def no_old_keys(cfg) -> List[str]:
    return []


def no_adapters(cfg) -> None:
    return None


@dataclass(frozen=True)
class Section:
    """A ``train.<name>`` section that several stages read (the RL stages' ``train.rollout``), as their records name
    it; the engine's config composes it once."""

    name: str
    cls: type  # its config dataclass
    check: Callable[[Any], None]  # its own checks (takes the section), naming the field


def no_shortfall(cfg) -> Tuple[str, str, str]:
    return ("cluster.num_workers", "what the stage places beside them", "Lower cluster.num_workers or add nodes.")


@dataclass(frozen=True)
class Stage:
    """One training stage. Every callable takes the run's config (a RunConfig)."""

    name: str
    help: str
    formats: Tuple[str, ...]  # data formats it trains on (data/formats/__init__.py:FORMATS); the first is its own: the verb
    # implies it when data.format is not given
    objective: Callable[[Any], Any]  # cfg -> its Objective (stages/objective.py); imports torch when called
    export_prefix: str  # MiniMind's file-name prefix for the weights (its trainers' naming)
    parts: Tuple[Tuple[str, str], ...] = ()  # (a model trained beside the policy, MiniMind's file-name prefix for it)
    section: Optional[type] = None  # its config dataclass: train.<name>
    validate: Callable[[Any], None] = no_checks  # its checks, naming the field (config.validate calls them)
    # (cfg, the policy's resolved ModelConfig, count: ModelConfig -> parameters) -> its memory terms
    memory: Callable[[Any, Any, Callable[[Any], int]], MemoryTerms] = plain_memory
    plugins: Callable[[Any], List[str]] = no_plugins  # the user's 'package.module:function' names its config holds
    beside: Callable[[Any], Dict[str, float]] = nothing_beside  # resources it places beside the workers
    # weights it starts from besides init_from: (the parent's name, the field of its own section holding its path);
    # the driver makes each path absolute (the workers run in another directory), lineage and preflight read them
    parent_fields: Tuple[Tuple[str, str], ...] = ()
    # parents whose architecture is their own (a teacher): checked before Ray for completeness only, not against the
    # run's model (preflight.py)
    own_architecture: Tuple[str, ...] = ()
    # keys of its section from before a rename, moved to where they are now (the run's config, before validation):
    # one notice per key moved (GRPO's train.grpo.rollout* -> train.rollout)
    old_keys: Callable[[Any], List[str]] = no_old_keys
    # (a dotted key of a field that moved, the key a run's identity hashes it under): the name it had before the move,
    # so that the same command still finds a run made before (the agent's train.agent.beta: train.grpo.beta)
    identity_renames: Tuple[Tuple[str, str], ...] = ()
    shares: Tuple[Section, ...] = ()  # sections it reads besides its own, shared with other stages (train.rollout)
    reads: Tuple[str, ...] = ()  # other stages' sections it reads (train.<stage>): the agent's GRPO section
    # the cluster holds the workers but not what this stage places beside them (``beside``): (the field to name, what
    # the cluster lacks, the sentence saying what to change), for raytrain/resources.py's refusal
    beside_shortfall: Callable[[Any], Tuple[str, str, str]] = no_shortfall
    # the LoRA adapters it puts on the model (cfg -> a model/config.py LoRAConfig, or None): its checkpoints record
    # them (meta.json's ``adapters``), so whatever loads their weights attaches the same adapters (store/weights.py)
    adapters: Callable[[Any], Any] = no_adapters
    metric_group: str = "train"  # its interval metrics' MLflow group: train/<key>, or rl/<key>
    headline: Tuple[str, ...] = ()  # interval metrics the console shows beside the loss
    rl: bool = False  # samples completions from the policy (train.rollout applies)
    # its loss is the cross-entropy of the data's target tokens, in nats: the held-out evaluation also gives bits per
    # byte (engine/evaluate.py); False for a loss that is something else (preferences, a teacher's KL, RL)
    cross_entropy: bool = False
    # why it cannot train under train.parallelism=fsdp (the refusal names train.parallelism); None: it can. Refused
    # unless its record says otherwise: a model held beside the sharded policy, or a policy sampled one rank at a time,
    # needs more than the engine's wrapper
    fsdp_refusal: Optional[str] = "it is not run under FSDP yet"

    def section_names(self) -> Tuple[str, ...]:
        """The ``train.<name>`` sections a run of this stage reads: its own, other stages' it reads, shared ones."""
        return (((self.name,) if self.section else ()) + self.reads + tuple(s.name for s in self.shares))

    def parents(self, cfg) -> Dict[str, Optional[str]]:
        """{parent: its weights path or None} for each weights it starts from besides init_from."""
        section = getattr(cfg.train, self.name, None)
        return {parent: getattr(section, f) for parent, f in self.parent_fields}

    def with_parents(self, train, change: Callable[[Optional[str]], Optional[str]]):
        """A copy of the TrainConfig ``train`` with ``change`` applied to every parent's path."""
        if not self.parent_fields:
            return train
        section = getattr(train, self.name)
        moved = dataclasses.replace(section, **{f: change(getattr(section, f)) for _, f in self.parent_fields})
        return dataclasses.replace(train, **{self.name: moved})
