"""Typed configuration for every part of a run.

Each section is a small dataclass; every field carries a one-line ``help`` in its
metadata, which the CLI prints (``minimind-ray pretrain --help``) and which doubles
as the field's documentation. Configs are loaded from YAML and dotted overrides with
OmegaConf (``train.lr=3e-4 cluster.num_workers=2``), then checked by
:func:`validate` before any Ray work starts.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from minimind_ray.config_checks import ConfigError, check_bounds, config_field, need, read_yaml
from minimind_ray.evals.config import EvalConfig, validate_eval
from minimind_ray.rl.config import GRPOConfig, RewardConfig, validate_grpo  # noqa: F401 (RewardConfig: re-exported)
from minimind_ray.rl.ppo_config import PPOConfig, validate_ppo
from minimind_ray.rl.agent_config import AgentConfig, validate_agent
from minimind_ray.fault_schedule import validate_faults
from minimind_ray.fsio import is_uri
from minimind_ray.stages import FORMATS, STAGE_NAMES, STAGES


_f = config_field  # a field with its help line and bounds: every section below uses it


@dataclass
class ModelConfig:
    """Architecture of a MiniMind-family causal LM. Names follow MiniMind's own config."""

    preset: str = _f("minimind2-small", "named preset whose values fill the fields left unset (see minimind_ray/model/presets.py)")
    generation: str = _f("minimind2", "MiniMind generation: 'minimind2' (83e52f6 layout) or 'minimind3' (d65ef2c layout: QK-norm, MoE router as nn.Linear)")
    hidden_size: int = _f(512, "model width", ge=1)
    num_hidden_layers: int = _f(8, "number of transformer blocks", ge=1)
    num_attention_heads: int = _f(8, "query heads", ge=1)
    num_key_value_heads: int = _f(2, "key/value heads (GQA); must divide num_attention_heads", ge=1)
    head_dim: Optional[int] = _f(None, "per-head width; None = hidden_size // num_attention_heads", ge=1)
    vocab_size: int = _f(6400, "tokenizer vocabulary size", ge=1)
    intermediate_size: Optional[int] = _f(None, "SwiGLU width; None = the generation's rule (64*ceil(int(8h/3)/64) or 64*ceil(pi*h/64))", ge=1)
    rms_norm_eps: float = _f(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = _f(1e6, "RoPE base", gt=0)
    max_position_embeddings: int = _f(32768, "length of the precomputed RoPE table", ge=1)
    inference_rope_scaling: bool = _f(False, "apply YaRN scaling (factor 16 over 2048) to the RoPE table")
    qk_norm: bool = _f(False, "per-head RMSNorm on q and k (minimind-3)")
    dropout: float = _f(0.0, "dropout on embeddings, attention and residuals", ge=0, lt=1)
    tie_word_embeddings: bool = _f(True, "lm_head shares the embedding matrix")
    use_moe: bool = _f(False, "replace the FFN by a mixture of experts")
    num_experts: int = _f(4, "routed experts per MoE layer", ge=1)
    num_experts_per_tok: int = _f(2, "experts each token is routed to (top-k)", ge=1)
    n_shared_experts: int = _f(1, "always-on shared experts (minimind2 layout only)", ge=0)
    moe_intermediate_size: Optional[int] = _f(None, "expert FFN width; None = intermediate_size", ge=1)
    norm_topk_prob: bool = _f(True, "renormalise the top-k routing weights to sum to 1")
    aux_loss_alpha: float = _f(0.01, "weight of the load-balancing loss", ge=0)
    seq_aux: bool = _f(True, "sequence-level balancing loss (minimind2); minimind3 uses the batch-level one")


@dataclass
class DataConfig:
    """Where the data is and how records become token sequences."""

    format: str = _f("pretrain", "record format: pretrain {text} | sft {conversations} | dpo {chosen, rejected} | rlaif {conversations ending with the assistant turn to generate} | prompt {prompt, answer} | agent_rl {conversations with tools, gt} (MiniMind's agent_rl.jsonl)")
    train_path: List[str] = _f([], "jsonl(.gz)/parquet files, directories, globs or URIs; or a prepared directory with manifest.json; 'demo' = the built-in corpus (its file of data.format), 'demo:<name>' = one of its files (tool_sft, mc_eval, ...)")
    tokenizer: str = _f("auto", "'auto' = MiniMind's tokenizer of model.generation; 'minimind2' | 'minimind3' (fetched by name, sha256-checked; offline: MINIMIND_RAY_TOKENIZER_MIRROR); 'builtin' = trained on the demo corpus; or a directory with tokenizer.json")
    max_seq_len: int = _f(512, "tokens per training sequence", ge=8)
    pack: bool = _f(True, "pretrain: pack documents into full windows (False = MiniMind pad mode)")
    bad_records: str = _f("skip", "bad input policy: 'skip' (count per reason) or 'strict' (fail at the first, naming file:line)")
    cache_dir: str = _f("data_cache", "where raw jsonl is prepared (tokenized once) before training")
    eval_fraction: float = _f(0.0, "fraction of sequences held out for evaluation (chosen by sample id hash)", ge=0, lt=1)
    block_rows: int = _f(1024, "rows per Parquet row group in prepared data (the unit of reading)", ge=1)
    shuffle: bool = _f(True, "reshuffle every epoch with a seed derived from (seed, epoch)")
    shuffle_window_blocks: int = _f(16, "row groups mixed together by the within-window shuffle", ge=1)
    prefetch_steps: int = _f(2, "optimizer steps of batches a worker reads ahead in a background thread", ge=0)
    chunk_bytes: int = _f(32 << 20, "prepare: jsonl byte-range per Ray task", ge=1)
    max_record_chars: int = _f(1_000_000, "prepare: a longer record (its jsonl line; a Parquet row's text fields) is skipped, counted as too_long", ge=1)


@dataclass
class LoRAConfig:
    """Low-rank adapters (stage 'lora')."""

    rank: int = _f(16, "adapter rank", ge=1)
    alpha: Optional[float] = _f(None, "scale = alpha/rank; None = no scaling (MiniMind's behaviour)", gt=0)
    targets: List[str] = _f(["square"], "module name suffixes to adapt, or 'square' for every square nn.Linear (MiniMind)")


@dataclass
class DPOConfig:
    """Direct preference optimisation (stage 'dpo')."""

    beta: float = _f(0.1, "DPO temperature", gt=0)
    reference: Optional[str] = _f(None, "reference weights (.pth/checkpoint); None = a frozen copy of the initial weights")


@dataclass
class DistillConfig:
    """Knowledge distillation (stage 'distill')."""

    teacher_preset: Optional[str] = _f(None, "teacher architecture preset; None = same as the student")
    teacher_weights: Optional[str] = _f(None, "teacher weights (.pth or checkpoint directory)")
    alpha: float = _f(0.5, "weight of the hard-label CE; (1-alpha) goes to the KL term", ge=0, le=1)
    temperature: float = _f(1.5, "softmax temperature of the KL term", gt=0)


@dataclass
class TrainConfig:
    """The optimisation loop."""

    stage: str = _f("pretrain", "objective plug-in: pretrain | sft | lora | dpo | distill | grpo | ppo | agent")
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
                               "in storage, before Ray Train registers it), 'step:slow:rank:seconds' (a straggler that "
                               "must not fail the run), or 'start:phase:rank': SIGKILL while the worker group starts, "
                               "phase actor | backend | launch")
    collective_timeout_s: float = _f(600.0, "a collective that takes longer fails the worker group (hung-rank detection)", gt=0)
    sample_log_dir: Optional[str] = _f(None, "debug: each rank appends the sample ids of every step here (exactly-once checks)")
    threads_per_worker: int = _f(0, "torch/OMP threads per worker; 0 = CPUs per worker rounded up", ge=0)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class CheckpointConfig:
    """Ray Train checkpoints."""

    interval: int = _f(100, "optimizer steps between checkpoints (and one at the end)", ge=1)
    num_to_keep: int = _f(3, "checkpoints kept by Ray Train (the newest always; the rest by score_metric when set)", ge=1)
    score_metric: Optional[str] = _f(None, "keep the num_to_keep best checkpoints by this metric, e.g. "
                                           "eval/<task>/acc (eval.tasks) or loss; None = the newest")
    score_order: str = _f("max", "max | min: which end of score_metric is best")
    storage_path: str = _f("runs", "local directory or URI (s3://, gs://) of run storage; shared by all nodes on a cluster")
    preemption_check_interval: Optional[int] = _f(None, "optimizer steps between asks for a drain notice (ray.train.get_preemption_info, a barrier of the ranks); on one, every rank checkpoints that step and waits for Ray Train's restart, so no step is lost (docs/reliability.md). None = every train.log_interval, 0 = never", ge=0)


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = _f(True, "log to MLflow")
    uri: Optional[str] = _f(None, "tracking URI; None = MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db")
    experiment: Optional[str] = _f(None, "experiment name; None = 'minimind-<stage>'")
    registered_model: Optional[str] = _f(None, "register the final model under this name; None = 'minimind-<stage>'")
    system_metrics: bool = _f(False, "MLflow system metrics (CPU/GPU/memory) sampling on rank 0")
    timeout_s: float = _f(10.0, "per-request timeout; a slow or down server never stalls training", gt=0)


@dataclass
class ClusterConfig:
    """Ray cluster and worker group."""

    address: Optional[str] = _f(None, "Ray address; None = RAY_ADDRESS or a local Ray started for this run")
    num_workers: int = _f(2, "training workers (DDP ranks)", ge=1)
    min_workers: Optional[int] = _f(None, "elastic: smallest worker group to continue with (None = fixed size)", ge=1)
    use_gpu: Optional[bool] = _f(None, "one GPU per worker; None = when the cluster has GPUs")
    cpus_per_worker: float = _f(1.0, "logical CPUs reserved per worker", gt=0)
    backend: str = _f("auto", "torch.distributed backend: auto (nccl with GPUs, else gloo) | nccl | gloo")
    max_failures: int = _f(3, "worker-group restarts before the run fails")
    resource_timeout_s: float = _f(60.0, "fail if the cluster cannot place the worker group within this time; a "
                                         "restart waits this long for its full group before an elastic run goes on "
                                         "smaller (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, unless exported)", gt=0)
    worker_resource: Optional[str] = _f(None, "custom resource each worker takes one unit of (one slot per node makes elastic work)")


@dataclass
class RunConfig:
    """Everything one run needs."""

    name: Optional[str] = _f(None, "run name (Ray Train + MLflow); None = <stage>-<hash of the settings that define the "
                                   "training> (see run_identity), so running the same command again finds the same run")
    resume: str = _f("auto", "auto: continue an unfinished run of this name, train a finished one further only when "
                             "max_steps/epochs grew | never: always a new run (a fresh name when none is given) | "
                             "must: fail unless there is an unfinished run to continue")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None, check: bool = True) -> RunConfig:
    """YAML file + dotted overrides -> validated RunConfig (``check=False``: resolved, not validated).

    The model preset is applied first; fields named explicitly in the YAML or the
    overrides win over it.
    """
    from minimind_ray.model.presets import preset_values

    schema = OmegaConf.structured(RunConfig)
    layers = []
    if path:  # the file's own errors name the file (and line)
        layers.append(read_yaml(path, schema))
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        user = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
        preset = OmegaConf.select(user, "model.preset", default=schema.model.preset)
        try:
            base = preset_values(preset)
        except KeyError as e:
            raise ConfigError(f"model.preset: {e.args[0]}") from None
        merged = OmegaConf.merge(schema, {"model": base}, user)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's errors: re-raise as ours, naming the key
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {msg}" if key and key not in msg else msg) from None
    cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if check:
        validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), d)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: the form MLflow params take."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Settings that do not change what is trained, only where, how fast, or how it is watched: left out of a
# run's identity, so a run can be resumed on another cluster, with other logging, or trained further.
RUNTIME_FIELDS = (
    "name", "resume", "cluster", "tracking", "checkpoint", "eval",
    "data.cache_dir", "data.prefetch_steps",
    "train.max_steps", "train.epochs", "train.micro_batch_size", "train.precision", "train.compile",
    "train.threads_per_worker", "train.log_interval", "train.eval_interval", "train.eval_batches",
    "train.comm_warn_fraction", "train.collective_timeout_s", "train.sample_log_dir",
    "train.fail_at_step", "train.fail_mode", "train.fail_rank", "train.hang_at_step", "train.faults",
)


def run_identity(cfg: "RunConfig") -> str:
    """``<stage>-<10 hex>``: a hash of the settings that define the training (model, data, stage,
    optimisation, seed), without the runtime-only ones in :data:`RUNTIME_FIELDS`. The default run name:
    the same command finds the same run again, whatever the cluster size or tracking server."""
    import hashlib
    import json

    flat = flatten(to_dict(cfg))
    kept = {k: v for k, v in flat.items()
            if not any(k == f or k.startswith(f + ".") for f in RUNTIME_FIELDS)}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()
    return f"{cfg.train.stage}-{digest[:10]}"


def field_help(cls=RunConfig, prefix: str = "") -> List[tuple]:
    """[(dotted name, default, help)] for every leaf field: what --help prints."""
    rows = []
    inst = cls()
    for f in dataclasses.fields(cls):
        val = getattr(inst, f.name)
        if dataclasses.is_dataclass(val):
            rows += field_help(type(val), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", val, f.metadata.get("help", "")))
    return rows


# --------------------------------------------------------------------------- validation

def worker_threads(cfg: RunConfig) -> int:
    """torch/OMP threads of one training worker."""
    return cfg.train.threads_per_worker or max(1, math.ceil(cfg.cluster.cpus_per_worker))


def validation_due(cfg: RunConfig, step: int, total_steps: int) -> bool:
    """Whether the benchmark tasks of ``eval.tasks`` run on this step's checkpoint (every ``eval.interval``
    steps and at the last); they run outside the loop, on the checkpoint (raytrain/validation.py)."""
    e = cfg.eval
    return bool(e.tasks) and ((e.interval > 0 and step % e.interval == 0) or step == total_steps)


def checkpoint_due(cfg: RunConfig, step: int, total_steps: int) -> bool:
    """Whether a checkpoint is saved after this step: every checkpoint.interval, the last, and each validated one."""
    return step % cfg.checkpoint.interval == 0 or step == total_steps or validation_due(cfg, step, total_steps)


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that the global batch is the same at every world size;
    ConfigError when it does not split evenly (the one place this rule is written)."""
    per_step = world_size * micro_batch_size
    if micro_batch_size < 1 or global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size: {global_batch_size} is not divisible by "
            f"world size {world_size} x train.micro_batch_size {micro_batch_size}")
    return global_batch_size // per_step


def validate(cfg: RunConfig) -> None:
    """Fail fast, naming the field, before any Ray work starts."""
    m, d, t, cl = cfg.model, cfg.data, cfg.train, cfg.cluster
    check_bounds(cfg)  # first: the checks below divide by head counts
    need(m.generation in ("minimind2", "minimind3"), "model.generation", f"unknown generation {m.generation!r}")
    need(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
          f"{m.num_key_value_heads} does not divide num_attention_heads {m.num_attention_heads}")
    need(m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0, "model.num_attention_heads",
          f"does not divide hidden_size {m.hidden_size}")
    if m.use_moe:
        need(1 <= m.num_experts_per_tok <= m.num_experts, "model.num_experts_per_tok", "must be in [1, num_experts]")
    need(d.format in FORMATS, "data.format", f"unknown format {d.format!r}; one of {FORMATS}")
    need(d.bad_records in ("skip", "strict"), "data.bad_records", "must be 'skip' or 'strict'")
    need(d.max_seq_len <= m.max_position_embeddings, "data.max_seq_len",
          f"{d.max_seq_len} exceeds model.max_position_embeddings {m.max_position_embeddings} (the RoPE table)")
    need(bool(d.train_path), "data.train_path", "no training data given (use 'demo' for the built-in corpus)")
    from minimind_ray.tokenizer_fetch import PINNED

    need(d.tokenizer in ("auto", "builtin", *PINNED) or os.path.exists(d.tokenizer), "data.tokenizer",
          f"{d.tokenizer!r} is neither a tokenizer name (auto, builtin, {', '.join(PINNED)}) nor an existing directory")
    for p in d.train_path:
        if p == "demo" or is_uri(p) or any(ch in p for ch in "*?["):
            continue
        if p.startswith("demo:"):
            from minimind_ray.data.demo import DEMO_FILES

            need(p[len("demo:"):] in DEMO_FILES, "data.train_path",
                 f"{p}: no such demo file; one of {', '.join('demo:' + n for n in DEMO_FILES)}")
            continue
        need(os.path.exists(p), "data.train_path", f"path does not exist: {p}")
    need(t.stage in STAGES, "train.stage", f"unknown stage {t.stage!r}; one of {STAGE_NAMES}")
    want_fmt = STAGES[t.stage].formats
    need(d.format in want_fmt, "data.format", f"stage {t.stage!r} needs data.format in {want_fmt}, got {d.format!r}")
    need(t.lr_schedule in ("cosine", "minimind"), "train.lr_schedule", "must be 'cosine' or 'minimind'")
    need(t.precision in ("auto", "bf16", "fp32"), "train.precision", "must be auto, bf16 or fp32")
    need(t.fail_mode in ("raise", "exit", "sigkill"), "train.fail_mode", "must be raise, exit or sigkill")
    validate_faults(cfg)
    need(cfg.resume in ("auto", "never", "must"), "resume", "must be auto, never or must")
    need(cl.backend in ("auto", "nccl", "gloo"), "cluster.backend", "must be auto, nccl or gloo")
    validate_eval(cfg.eval)
    need(cfg.checkpoint.score_order in ("max", "min"), "checkpoint.score_order", "must be max or min")
    if cl.min_workers is not None:
        need(cl.min_workers <= cl.num_workers, "cluster.min_workers", "must be in [1, num_workers]")
    # the global batch must split evenly at every worker count the run may use
    lo = cl.min_workers or cl.num_workers
    for w in range(lo, cl.num_workers + 1):
        accumulation_steps(t.global_batch_size, t.micro_batch_size, w)
    if t.init_from:
        need(is_uri(t.init_from) or os.path.exists(t.init_from), "train.init_from", f"not found: {t.init_from}")
    if t.stage == "distill":
        need(t.distill.teacher_weights is not None, "train.distill.teacher_weights", "distillation needs teacher weights")
    if t.stage == "grpo":
        validate_grpo(cfg)
    if t.stage == "ppo":
        validate_ppo(cfg)
    if t.stage == "agent":
        validate_agent(cfg)
