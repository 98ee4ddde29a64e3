"""The serve package's one door into the rest of the project: model, weights, tokenizer, generation
helpers and MLflow. When those modules move, only the imports at the top of this file change.

:func:`load_served_model` turns whatever a user points ``minimind-ray serve`` at into a model in
eval mode plus its tokenizer:

* anything ``minimind_ray.store.weights`` loads: a run directory, a checkpoint, a MiniMind ``.pth``,
  the project's ``.safetensors``, an HF export folder, or a storage URI of one; the tokenizer is the
  run's own, the HF folder's, or ``--tokenizer``;
* an MLflow model URI, ``models:/<name>/<version|alias>`` (also ``models:/<name>@<alias>``) or
  ``runs:/<run_id>/<path>``: the model files of the run's logged model (or, for a run logged before
  logged models, its ``model/`` artifacts: the ``.safetensors``, which records its architecture, else
  the ``.pth`` with the run's ``config/config.yaml``) and the run's ``tokenizer/`` are downloaded from
  the tracking server.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from minimind_ray.config import from_dict, run_config_of
from minimind_ray.tracking.config import TrackingConfig
from minimind_ray.tracking.models import MODEL_NAME, run_model
from minimind_ray.fsio import is_uri
from minimind_ray.generate import StreamDecoder, generate_tokens, render_prompt  # noqa: F401
from minimind_ray.model.kv_cache import KVCache  # noqa: F401
from minimind_ray.model.lora import ADAPTER_FILE_PREFIX, merge_adapters
from minimind_ray.model.minimind import build_model
from minimind_ray.model.grammar import (GrammarCompiler, RowConstraint, SchemaError, new_bitmask,  # noqa: F401
                                       schema_grammar, tool_call_grammar)
from minimind_ray.model.prefix_cache import PrefixCache  # noqa: F401
from minimind_ray.model.sampling import apply_token_bitmask, sample_tokens  # noqa: F401
from minimind_ray.serve.options import is_mlflow_uri
from minimind_ray.store.pth import read_pth
from minimind_ray.store.weights import (LoadedWeights, apply_weights, build_inference_model, load_weights,
                                        resolve_checkpoint, set_rope_scaling)
from minimind_ray.tokenizer import Tokenizer, load_tokenizer, resolve_tokenizer
from minimind_ray.tracking.runs import resolve_tracking_uri

# Re-exported for the rest of the package: StreamDecoder (app), KVCache, PrefixCache, sample_tokens, apply_token_bitmask
# and new_bitmask (engine), the grammar's names (app: structured output), generate_tokens and render_prompt (bench).


def render_chat(tokenizer: Tokenizer, messages: list, think: Optional[bool] = None,
                tools: Optional[list] = None) -> str:
    """The chat template with the generation prompt, ``tools`` (OpenAI function schemas) in the system turn
    and the thinking switch (MiniMind2's template reads ``enable_thinking``, minimind-3's ``open_thinking``):
    ``render_prompt`` of ``minimind-ray generate``, plus tools."""
    kw = {} if think is None else {"enable_thinking": think, "open_thinking": think}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None, **kw)


class TokenPieces:
    """A token id -> (its text, its bytes), as OpenAI's log-probs show tokens; cached per id.

    MiniMind's tokenizers are byte-level BPE: a token's vocabulary string maps back to bytes through
    GPT-2's byte-to-character table, so a token that holds half of a Chinese character still has its
    exact bytes (its text then shows the missing part as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.cache = tokenizer, {}
        self.byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token_id: int) -> Tuple[str, list]:
        hit = self.cache.get(token_id)
        if hit is None:
            # the vocabulary's spelling of the id (byte-level: one character per byte), mapped back to its bytes
            raw = self.tok.id_to_token(token_id) or ""
            data = bytes(self.byte_of[c] for c in raw) if all(c in self.byte_of for c in raw) else raw.encode()
            hit = self.cache[token_id] = (data.decode("utf-8", errors="replace"), list(data))
        return hit


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenizers use)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table



@dataclass
class ServedModel:
    model: torch.nn.Module  # eval mode, on its device
    tokenizer: Tokenizer
    name: str  # the id /v1/models lists
    context: int  # the model's position limit (max_position_embeddings: the RoPE table)
    trained_context: Optional[int] = None  # the run's data.max_seq_len, where the weights record their run


def default_name(source: str) -> str:
    """A readable model id: the registered name and version, the run id, or the file/dir name; a link (a run's
    ``<stage>-latest``) is followed, so that the id names the run it points to, not the link."""
    if source.startswith("models:/"):
        return source[len("models:/"):].strip("/")
    if source.startswith("runs:/"):
        return source[len("runs:/"):].split("/")[0][:12]
    path = source.rstrip("/")
    if not is_uri(path) and path:
        path = os.path.realpath(path)
    stem = Path(path).name
    return stem[:-4] if stem.endswith(".pth") else stem or "minimind"


def trained_context(run_config: Optional[dict]) -> Optional[int]:
    """The context a run trained at (its recorded ``data.max_seq_len``), None where no run is recorded."""
    value = ((run_config or {}).get("data") or {}).get("max_seq_len")
    return int(value) if isinstance(value, int) and value > 0 else None


def check_source(source: str, tracking_uri: Optional[str] = None) -> None:
    """Fail fast in the driver, with one line, before replicas try to load: a missing path or an
    MLflow model/run that does not exist."""
    if is_mlflow_uri(source):
        uri = resolve_tracking_uri(TrackingConfig(uri=tracking_uri))
        _mlflow_run_id(source, uri)
        return
    if not is_uri(source) and not Path(source).exists():
        raise FileNotFoundError(f"{source}: no such file or directory (a run dir, checkpoint, .pth, HF export "
                                f"folder, storage URI, models:/NAME/VERSION or runs:/RUN_ID/model)")


def pin_tokenizer(source: str, tokenizer: Optional[str]) -> Optional[str]:
    """In the driver: the tokenizer replicas should load, as something that means the same on every
    process. A run records ``data.tokenizer`` and ``data.cache_dir`` as given, often relative to where it
    was trained (``builtin`` lives in ``data_cache/``); replicas run in another directory, so the driver
    resolves it here, in the user's directory as ``chat`` would, and passes the absolute folder on.
    Weights that bring no tokenizer of their own (a .pth, an HF folder, MLflow URIs) are left as they are."""
    if tokenizer:
        return os.path.abspath(tokenizer) if os.path.exists(tokenizer) else tokenizer  # a dir, or a name
    if is_mlflow_uri(source) or is_uri(source) or not Path(source).is_dir() or (Path(source) / "config.json").exists():
        return None
    ck = resolve_checkpoint(source)
    run_cfg = from_dict(ck.meta().config)
    return resolve_tokenizer(run_cfg.data.tokenizer, run_cfg.data.cache_dir, run_cfg.model.generation).path


def load_served_model(source: str, tokenizer: Optional[str] = None, preset: Optional[str] = None,
                      lora: Optional[str] = None, lora_alpha: Optional[float] = None, device: str = "cpu",
                      tracking_uri: Optional[str] = None, name: Optional[str] = None,
                      rope_scaling: Optional[dict] = None) -> ServedModel:
    """Model (eval mode, LoRA merged) and tokenizer for ``source``; ``lora`` adds a separate adapter
    file (MiniMind's ``lora_*.pth``) on top of the weights and merges it; ``rope_scaling`` turns YaRN on
    or off (store.weights.set_rope_scaling; None = as the weights record)."""
    if is_mlflow_uri(source):
        model, tok, trained = _from_mlflow(source, resolve_tracking_uri(TrackingConfig(uri=tracking_uri)), preset)
    else:
        model, lw = build_inference_model(source, preset, merge_lora=True, device="cpu")
        tok, trained = _tokenizer_of(lw), trained_context(lw.run_config)
    if tokenizer:  # an explicit tokenizer wins over the one that came with the weights
        tok = resolve_tokenizer(tokenizer, "data_cache", model.cfg.generation)
    if tok is None:
        raise ValueError(f"{source}: these weights carry no tokenizer; pass --tokenizer "
                         f"(minimind2, minimind3, auto or a tokenizer directory)")
    if lora:
        model = _add_lora(model, lora, lora_alpha)
    if rope_scaling is not None:
        set_rope_scaling(model, rope_scaling)
    model = model.to(device).eval()
    return ServedModel(model, tok, name or default_name(source), model.cfg.max_position_embeddings, trained)


def _tokenizer_of(lw: LoadedWeights) -> Optional[Tokenizer]:
    """The run's tokenizer, or an HF export folder's own; None for bare weight files."""
    run_cfg = run_config_of(lw.run_config)
    if run_cfg is not None:
        return resolve_tokenizer(run_cfg.data.tokenizer, run_cfg.data.cache_dir, run_cfg.model.generation)
    if lw.tokenizer_dir:
        return load_tokenizer(lw.tokenizer_dir)
    return None


def _add_lora(model, path: str, alpha: Optional[float]):
    return merge_adapters(model, read_pth(path), alpha, f"--lora {path}")


# --------------------------------------------------------------------------- MLflow


_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<ref>[^/]+)|@(?P<alias>[^/]+))/?$")


def _mlflow_run_id(source: str, uri: str) -> Tuple[str, str]:
    """(run id, where the model files are) of a models:/ or runs:/ URI: the artifact location of the run's logged
    model (tracking/models.py; a version's source), or, for a run whose weights are its own ``model/`` artifacts,
    that path in the run. The location is read here, with ``uri``: MLflow 3.17 resolves a ``models:/`` URI (and a
    run's logged model behind ``runs:/<run>/model``) through the process's default tracking URI whatever
    ``tracking_uri`` it is given."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        if source.startswith("runs:/"):
            run_id, _, path = source[len("runs:/"):].partition("/")
            client.get_run(run_id)
            path = path.strip("/") or MODEL_NAME
            model = run_model(client, run_id) if path == MODEL_NAME else None
            return run_id, (model.artifact_location if model is not None and str(model.status) == "READY" else path)
        m = _MODELS_URI.match(source)
        if not m:
            raise ValueError(f"{source}: expected models:/<name>/<version|alias> or models:/<name>@<alias>")
        ref = m["ref"] or m["alias"]
        if m["ref"] and ref.isdigit():
            mv = client.get_model_version(m["name"], ref)
        else:
            mv = client.get_model_version_by_alias(m["name"], ref)
    except MlflowException as e:
        raise ValueError(f"{source}: not found in the MLflow registry at {uri} ({str(e).splitlines()[0]})") from None
    run_base = client.get_run(mv.run_id).info.artifact_uri.rstrip("/")
    if mv.source.startswith(run_base + "/"):  # a version of a run's own model/ directory (before logged models)
        return mv.run_id, mv.source[len(run_base) + 1:]
    return mv.run_id, mv.source  # a logged model's artifact location (tracking/artifacts.py:register_version)


def _from_mlflow(source: str, uri: str, preset: Optional[str]):
    """Download model files, config and tokenizer of the run behind ``source`` and build the model; (model,
    tokenizer or None, the context the run trained at or None)."""
    run_id, model_path = _mlflow_run_id(source, uri)
    dst = Path(tempfile.mkdtemp(prefix="mmr-serve-"))
    try:
        return _build_from_download(source, uri, run_id, model_path, dst, preset)
    finally:
        shutil.rmtree(dst, ignore_errors=True)  # everything is in memory by now


def _build_from_download(source: str, uri: str, run_id: str, model_path: str, dst: Path, preset: Optional[str]):
    from mlflow.artifacts import download_artifacts

    def fetch(path: str) -> Optional[Path]:
        try:
            if ":" in path:  # a logged model's artifact location
                return Path(download_artifacts(artifact_uri=path, tracking_uri=uri, dst_path=str(dst / MODEL_NAME)))
            return Path(download_artifacts(run_id=run_id, artifact_path=path, tracking_uri=uri,
                                           dst_path=str(dst)))
        except Exception:  # noqa: BLE001 - an optional artifact that is absent
            return None

    model_dir = fetch(model_path)
    files = sorted(model_dir.rglob("*")) if model_dir else []
    tensors = [p for p in files if p.suffix == ".safetensors"]
    pths = [p for p in files if p.suffix == ".pth" and not p.name.startswith(ADAPTER_FILE_PREFIX)]
    config_file = fetch("config/config.yaml")
    run_config = None
    if config_file is not None:
        from omegaconf import OmegaConf

        run_config = OmegaConf.to_container(OmegaConf.load(config_file))
    if tensors:  # the project's safetensors record the exact architecture (and keep fp32)
        model, _ = build_inference_model(str(tensors[0]), preset)
    elif pths and config_file is not None and not preset:  # MiniMind's fp16 .pth + the run's config
        run_cfg = from_dict(run_config)
        lw = LoadedWeights(load_weights(str(pths[0]), run_cfg.model.preset).state_dict, run_cfg.model, None, None)
        model = apply_weights(build_model(run_cfg.model), lw)
    elif pths:
        model, _ = build_inference_model(str(pths[0]), preset)
    else:
        raise FileNotFoundError(f"{source}: run {run_id} has no model weights (.safetensors or .pth) under its "
                                f"'{model_path}' artifacts")
    tok_dir = fetch("tokenizer")
    tok = load_tokenizer(str(tok_dir)) if tok_dir is not None and (tok_dir / "tokenizer.json").exists() else None
    return model.eval(), tok, trained_context(run_config)
