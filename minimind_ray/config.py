"""The run's configuration, composed of the sections each room owns.

Each section is a small dataclass beside the code it configures (``model:`` in model/config.py, ``data:`` in
data/config.py, ``train:`` in engine/config.py with one section per stage from stages/, ``checkpoint:`` in
store/config.py, ``tracking:`` in tracking/config.py, ``cluster:`` in cluster_config.py, ``eval:`` in
evals/config.py); every field carries a one-line ``help`` in its metadata, which the CLI prints (``minimind-ray
pretrain --help``) and which doubles as the field's documentation. This module composes them into
:class:`RunConfig`, loads YAML and dotted overrides with OmegaConf (``train.lr=3e-4 cluster.num_workers=2``), and
checks the rules that span rooms in :func:`validate`, before any Ray work starts. Nothing it composes imports it.

A training run is resolved once, by :func:`resolve_run` (a recipe and overrides) or :func:`resolve` (a composed
RunConfig): ``train.init_from``'s architecture adopted when the user wrote no ``model.*`` field that shapes it, then
:func:`validate`, once, and the stage's record looked up, once, into one frozen :class:`RunSpec` that the checks before
Ray (preflight.py), the driver and the workers read and never rebuild.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, FrozenSet, List, Optional, Tuple

from omegaconf import OmegaConf

from minimind_ray.cluster_config import ClusterConfig, validate_cluster
from minimind_ray.config_checks import (ConfigError, check_bounds, config_field as _f, conform, flatten, need,
                                        omegaconf_message, read_yaml)
from minimind_ray.data.config import DataConfig, accumulation_steps, validate_data
from minimind_ray.engine.config import TrainConfig, validate_train
from minimind_ray.evals.config import EvalConfig, validate_eval
from minimind_ray.fsio import is_uri, redact
from minimind_ray.model.config import ModelConfig, validate_model
from minimind_ray.model.presets import preset_values
from minimind_ray.stages import STAGES, Stage, get_stage, other_stages_field
from minimind_ray.store.config import CheckpointConfig, validate_checkpoint
from minimind_ray.tokenizer_fetch import PINNED
from minimind_ray.tracking.config import TrackingConfig

__all__ = ["ConfigError", "RunConfig", "RunSpec", "load_config", "resolve_run", "resolve", "validate", "to_dict",
           "from_dict", "to_yaml", "flatten",
           "run_identity", "field_help", "run_config_of", "refuse_other_stages_field", "RUNTIME_FIELDS"]


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
    # The dotted fields the user wrote (the YAML recipe, the overrides), set by load_config; not a config field.
    # resolve() reads it: with no model.* written, the architecture comes from train.init_from.
    written: ClassVar[FrozenSet[str]] = frozenset()


# --------------------------------------------------------------------------- loading


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None, check: bool = True,
                stage: Optional[str] = None) -> RunConfig:
    """YAML file + dotted overrides -> validated RunConfig (``check=False``: resolved, not validated). ``stage``: the
    verb's (a training verb, a pipeline's step), over the YAML's train.stage and under the overrides.

    The model preset is applied first; fields named explicitly in the YAML or the
    overrides win over it.
    """
    schema = OmegaConf.structured(RunConfig)
    layers = []
    if path:  # the file's own errors name the file (and line)
        layers.append(read_yaml(path, schema))
    if stage is not None:  # the verb's stage, as a value: never a train.stage=... string parsed back
        layers.append(OmegaConf.create({"train": {"stage": stage}}))
    try:
        layers.append(conform(schema, OmegaConf.from_dotlist(list(overrides or []))))
        user = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
        preset = OmegaConf.select(user, "model.preset", default=schema.model.preset)
        try:
            base = preset_values(preset)
        except KeyError as e:
            raise ConfigError(f"model.preset: {e.args[0]}") from None
        # the stage's record, looked up once here (an unknown name is validate()'s to refuse): the verb's stage implies
        # its own data format when data.format is not given
        record = STAGES.get(OmegaConf.select(user, "train.stage", default=schema.train.stage))
        implied = {}
        if OmegaConf.select(user, "data.format") is None and record is not None:
            implied = {"data": {"format": record.formats[0]}}
        merged = OmegaConf.merge(schema, {"model": base}, implied, user)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's errors: re-raise as ours, naming the key
        raise ConfigError(omegaconf_message(e)) from None
    cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    cfg.written = frozenset(flatten(OmegaConf.to_container(user)))  # type: ignore[misc]
    for notice in record.old_keys(cfg) if record else []:  # its section's renamed keys (train.grpo.rollout*)
        print(f"[minimind-ray] notice: {notice}", file=sys.stderr)
    if check:
        validate(cfg)
    return cfg


# --------------------------------------------------------------------------- one run, resolved once


@dataclass(frozen=True)
class RunSpec:
    """One training run, resolved once (:func:`resolve`): what the checks before Ray (preflight.py), the driver and
    the workers read, and never rebuild or validate again. Frozen: assigning a field raises; what the driver decides
    goes into its own copy (raytrain/spec.py:WorkerSpec)."""

    cfg: RunConfig  # validated, with train.init_from's architecture when the user wrote no model.* field shaping it
    stage: Stage  # the run's stage record (stages/), looked up once
    written: FrozenSet[str] = frozenset()  # the dotted fields the user wrote (recipe, overrides); the rest: defaults
    lines: Tuple[str, ...] = ()  # what resolving decided, said as the run starts (the architecture it took)


def resolve_run(path: Optional[str] = None, overrides: Optional[List[str]] = None,
                stage: Optional[str] = None) -> RunSpec:
    """A recipe and its dotted overrides (``stage``: the verb's, as :func:`load_config` takes it) -> the run,
    composed and then resolved once (:func:`resolve`)."""
    return resolve(load_config(path, overrides, check=False, stage=stage))


def resolve(cfg: RunConfig) -> RunSpec:
    """A composed RunConfig (``cfg.written``: the fields the user wrote) -> its :class:`RunSpec`: ``train.init_from``'s
    architecture taken when the user wrote no ``model.*`` field that shapes it (LitGPT reads a checkpoint's own config
    the same way), then :func:`validate`, once, on the config the run uses; one written that differs from the weights'
    is refused naming both. ``cfg`` is not modified."""
    written = frozenset(cfg.written)
    info = init_from_weights(cfg)
    given = {k[len("model."):] for k in written if k.startswith("model.")}
    shaping = given - set(NOT_SHAPING)
    adopted, lines = cfg, ()
    if info is not None and not shaping:  # the architecture is the weights', the user's other model.* fields stay
        adopted, lines = adopt_architecture(cfg, info, given)
    validate(adopted)  # once: its checks divide by head counts, so a written architecture is compared after them
    if info is not None and shaping:
        refuse_other_architecture(cfg, info, written)
    return RunSpec(adopted, get_stage(adopted.train.stage), written, lines)


# model.* fields that shape nothing in the weights: written by the user, they leave init_from's architecture adopted
NOT_SHAPING = ("dropout", "max_position_embeddings", "inference_rope_scaling", "aux_loss_alpha", "seq_aux")


def weights_info(source: str, field_name: str):
    """store/inspect.py's :func:`inspect_weights` (a WeightsInfo), its refusal one line naming the config field."""
    from minimind_ray.store.checkpoint import CheckpointError  # lazy: torch, only when a run is resolved
    from minimind_ray.store.inspect import inspect_weights  # lazy: torch, only when a run is resolved
    from minimind_ray.store.pth import WeightsError  # lazy: torch, only when a run is resolved

    try:
        return inspect_weights(source)
    except (OSError, CheckpointError, WeightsError) as e:
        raise ConfigError(f"{field_name}: {' '.join(str(e).split())}") from None


def init_from_weights(cfg: RunConfig):
    """What ``train.init_from`` is (a WeightsInfo), read cheaply; None without one. A config mistake is said before
    the weights' (a path that does not exist: ``not found``, as the user wrote it)."""
    if not cfg.train.init_from:
        return None
    try:
        return weights_info(cfg.train.init_from, "train.init_from")
    except ConfigError:
        validate(cfg)  # raises the config's own mistake, if it has one; the weights' otherwise
        raise


def adopt_architecture(cfg: RunConfig, info, given) -> Tuple[RunConfig, Tuple[str, ...]]:
    """(a copy of ``cfg`` with the architecture of the weights ``info``, keeping the ``model.*`` fields ``given``;
    the line that says so)."""
    from minimind_ray.store.inspect import architecture, differences  # lazy: torch, only when a run is resolved

    theirs = {f.name: getattr(info.model, f.name) for f in dataclasses.fields(ModelConfig) if f.name not in given}
    adopted = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **theirs))
    adopted.written = cfg.written  # type: ignore[misc]
    same = not differences(cfg.model, info.model, info.recorded)
    line = (f"model: {architecture(adopted.model)}, from train.init_from={cfg.train.init_from} ({info.what()})"
            + ("" if same else f"; no model.* was given, so not the default {cfg.model.preset}"))
    return adopted, (redact(line),)


def refuse_other_architecture(cfg: RunConfig, info, written: FrozenSet[str]) -> None:
    """A ``model.*`` architecture the user wrote that differs from ``train.init_from``'s: refused, naming both."""
    from minimind_ray.store.inspect import architecture, differences  # lazy: torch, only when a run is resolved

    diff = differences(cfg.model, info.model, info.recorded)
    if diff:
        fields = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in list(diff.items())[:4])
        model_fields = ", ".join(sorted(k for k in written if k.startswith("model.")))
        raise ConfigError(
            f"train.init_from: {redact(cfg.train.init_from)} is {info.describe()}; this run asks "
            f"{architecture(cfg.model)} ({fields}): drop {model_fields} to train the weights' own architecture, or "
            f"make them equal")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), d)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def run_config_of(recorded: Optional[dict]) -> Optional[RunConfig]:
    """The RunConfig a checkpoint recorded (its meta.json's ``config``; a loaded checkpoint's ``run_config``), or None."""
    return from_dict(recorded) if recorded else None


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


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
    """``<stage>-<10 hex>``: a hash of the settings that define the training (model, data, stage, optimisation,
    seed), without the runtime-only ones in :data:`RUNTIME_FIELDS`, and of those only the ones that differ from the
    config's defaults (the stage always counts), each under the name its stage's record says it had when it moved
    (``identity_renames``). The default run name: the same command finds the same run again,
    whatever the cluster size or tracking server, and a later version that adds a field (a new stage's section, a new
    option at its default) still finds it."""
    import hashlib
    import json

    def defining(d: dict) -> dict:
        return {k: v for k, v in flatten(d).items() if not any(k == f or k.startswith(f + ".") for f in RUNTIME_FIELDS)}

    defaults = defining(to_dict(RunConfig()))
    renamed = dict(STAGES[cfg.train.stage].identity_renames) if cfg.train.stage in STAGES else {}
    kept = {renamed.get(k, k): v for k, v in defining(to_dict(cfg)).items()
            if k == "train.stage" or k not in defaults or defaults[k] != v}
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


def refuse_other_stages_field(cfg: RunConfig, where: str = "") -> None:
    """A field of a section the run's stage does not read, set (``train.grpo.rewards`` on an rloo run), is refused:
    it would be ignored without a word. ``where``: what the config is, before the field (a pipeline's step)."""
    foreign = other_stages_field(cfg.train)
    if foreign:
        raise ConfigError(f"{where}{foreign[0]}: {foreign[1]}")


def validate(cfg: RunConfig) -> None:
    """Fail fast, naming the field, before any Ray work starts: each section's own rules (its room's), the stage's
    (its record's), then the rules that span rooms."""
    m, d, t, cl = cfg.model, cfg.data, cfg.train, cfg.cluster
    check_bounds(cfg)  # first: the checks below divide by head counts
    validate_model(m)
    validate_data(d)
    need(d.max_seq_len <= m.max_position_embeddings, "data.max_seq_len",
         f"{d.max_seq_len} exceeds model.max_position_embeddings {m.max_position_embeddings} (the RoPE table)")
    need(d.tokenizer in ("auto", "builtin", *PINNED) or os.path.exists(d.tokenizer), "data.tokenizer",
         f"{d.tokenizer!r} is neither a tokenizer name (auto, builtin, {', '.join(PINNED)}) nor an existing directory")
    validate_train(cfg)
    refuse_other_stages_field(cfg)
    stage = get_stage(t.stage)  # known: validate_train refused another name
    for section in stage.shares:  # the sections it shares with other stages (train.rollout)
        section.check(getattr(t, section.name))
    want_fmt = stage.formats
    need(d.format in want_fmt, "data.format", f"{t.stage} trains on {' or '.join(want_fmt)} records, not {d.format!r}; "
                                              f"leave data.format out and the {t.stage} verb reads {want_fmt[0]}")
    need(cfg.resume in ("auto", "never", "must"), "resume", "must be auto, never or must")
    validate_cluster(cl)
    validate_eval(cfg.eval)
    validate_checkpoint(cfg.checkpoint)
    # the global batch must split evenly at every worker count the run may use
    for w in range((cl.min_workers or cl.num_workers), cl.num_workers + 1):
        accumulation_steps(t.global_batch_size, t.micro_batch_size, w)
    if t.init_from:
        need(is_uri(t.init_from) or os.path.exists(t.init_from), "train.init_from", f"not found: {t.init_from}")
    stage.validate(cfg)
