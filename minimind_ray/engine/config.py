"""The engine's configuration: the optimisation loop (``train:``), with one section per stage that has settings of
its own (``train.lora``, ``train.dpo``, ...) and those several stages share (``train.rollout``): each stage's record in
minimind_ray/stages/ brings the sections it reads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from minimind_ray.config_checks import config_field as _f, need
from minimind_ray.fault_schedule import validate_faults
from minimind_ray.stages import STAGE_NAMES, STAGES, TRAIN_SECTIONS


@dataclass
class LoopConfig:
    """The optimisation loop (TrainConfig without the stages' sections)."""

    stage: str = _f("pretrain", f"objective plug-in: {' | '.join(STAGE_NAMES)}")
    init_from: Optional[str] = _f(None, "start weights: a MiniMind .pth or a checkpoint directory of an earlier run")
    global_batch_size: int = _f(64, "sequences per optimizer step, whatever the worker count", ge=1)
    micro_batch_size: int = _f(16, "sequences per forward/backward on one worker", ge=1)
    epochs: int = _f(1, "passes over the training split", ge=1)
    max_steps: Optional[int] = _f(None, "stop after this many optimizer steps (None = epochs * steps per epoch)", ge=1)
    lr: float = _f(1e-4, "peak learning rate", gt=0)
    min_lr_ratio: float = _f(0.1, "cosine schedule floor as a fraction of lr", ge=0, le=1)
    warmup_steps: int = _f(1000, "linear warmup steps (capped at 10% of the run if longer)", ge=0)
    lr_schedule: str = _f("cosine", "'cosine' (linear warmup + cosine) or 'minimind' (lr*(0.1+0.45*(1+cos(pi*t/T))))")
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", ge=0)
    seed: int = _f(1337, "seed of weights init, data order and dropout")
    precision: str = _f("auto", "'auto' (bf16 autocast on CUDA, fp32 on CPU), 'bf16' or 'fp32'")
    compile: bool = _f(False, "torch.compile the model")
    parallelism: str = _f("ddp", "how workers share the model: 'ddp' (a whole copy each) or 'fsdp' (FSDP2: weights, "
                                 "gradients and AdamW state sharded over the workers)")
    activation_checkpointing: str = _f("none", "'none' or 'blocks': keep each transformer block's input only and "
                                               "recompute the block in backward (less memory, about 1/3 more compute)")
    reshard_after_forward: bool = _f(True, "fsdp: free a block's gathered weights after its forward, gather them "
                                           "again for backward (False: hold them until then, fewer all-gathers)")
    log_interval: int = _f(10, "optimizer steps between metric reports", ge=1)
    eval_interval: int = _f(0, "optimizer steps between evaluations (0 = only at the end, if there is an eval split)", ge=0)
    eval_batches: int = _f(8, "micro-batches per rank per evaluation (0 = the whole eval split)", ge=0)
    comm_warn_fraction: float = _f(0.10, "warn when all-reduce time exceeds this fraction of step time", ge=0)
    fail_at_step: Optional[int] = _f(None, "fault injection: fail once when this step is reached")
    fail_mode: str = _f("raise", "fault injection: 'raise', 'exit' (os._exit) or 'sigkill'")
    fail_rank: int = _f(0, "fault injection: which rank fails", ge=0)
    hang_at_step: Optional[int] = _f(None, "fault injection: this rank sleeps forever before the all-reduce of this step")
    faults: List[str] = _f([], "fault schedule, each fired once per run: 'step:kind:rank' with kind raise | exit | "
                               "sigkill | hang | oom | lost_report (at a checkpoint step: SIGKILL once the checkpoint is "
                               "in storage, before Ray Train registers it) | bug (raised on every attempt, as a bug "
                               "would: not a fault), 'step:slow:rank:seconds' (a straggler that "
                               "must not fail the run), or 'start:phase:rank': SIGKILL while the worker group starts, "
                               "phase actor | backend | launch")
    collective_timeout_s: float = _f(600.0, "a collective that takes longer fails the worker group (hung-rank detection)", gt=0)
    sample_log_dir: Optional[str] = _f(None, "debug: each rank appends the sample ids of every step here (exactly-once checks)")
    threads_per_worker: int = _f(0, "torch/OMP threads per worker; 0 = CPUs per worker rounded up", ge=0)


# TrainConfig: the loop's fields, then each train.<name> section the stages' records bring (their own, and those
# several share: the RL stages' train.rollout), in the registry's order
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(name, cls, dataclasses.field(default_factory=cls)) for name, (cls, _) in TRAIN_SECTIONS.items()],
    bases=(LoopConfig,), namespace={"__module__": __name__, "__doc__": "The optimisation loop."})


def validate_train(cfg) -> None:
    """The train section's own rules; the stage's are its record's (config.validate calls both)."""
    t = cfg.train
    need(t.stage in STAGES, "train.stage", f"unknown stage {t.stage!r}; one of {STAGE_NAMES}")
    need(t.lr_schedule in ("cosine", "minimind"), "train.lr_schedule", "must be 'cosine' or 'minimind'")
    need(t.precision in ("auto", "bf16", "fp32"), "train.precision", "must be auto, bf16 or fp32")
    need(t.fail_mode in ("raise", "exit", "sigkill"), "train.fail_mode", "must be raise, exit or sigkill")
    need(t.parallelism in ("ddp", "fsdp"), "train.parallelism", f"must be ddp or fsdp, not {t.parallelism!r}")
    need(t.activation_checkpointing in ("none", "blocks"), "train.activation_checkpointing",
         f"must be none or blocks, not {t.activation_checkpointing!r}")
    need(t.reshard_after_forward or t.parallelism == "fsdp", "train.reshard_after_forward",
         "applies to train.parallelism=fsdp only: leave it as it is")
    refusal = STAGES[t.stage].fsdp_refusal
    need(t.parallelism == "ddp" or refusal is None, "train.parallelism",
         f"stage {t.stage!r} does not train under fsdp: {refusal}; use train.parallelism=ddp")
    validate_faults(cfg)
