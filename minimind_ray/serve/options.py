"""What one ``minimind-ray serve`` deployment is: the weights, the limits, the replicas, the address.

The same dataclass comes from the command line (``minimind-ray serve``, ``python -m pipelines.serve``)
and from a Serve config file's ``args`` (``import_path: minimind_ray.serve.app:build_app``, as the
KubeRay RayService uses it), and travels to every replica as a plain dict.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from minimind_ray.config_checks import ConfigError


def is_mlflow_uri(source: str) -> bool:
    """``models:/...`` or ``runs:/...``: weights that come from an MLflow tracking server."""
    return source.startswith(("models:/", "runs:/"))


API_KEY_ENV = "MINIMIND_RAY_API_KEY"
RETRY_AFTER_S = 1  # what a refused request is told to wait before it tries again


def _f(default: Any, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ServeOptions:
    """One served model on Ray Serve."""

    weights: str = _f("", "run dir, checkpoint, MiniMind .pth, HF export folder, storage URI, "
                          "models:/NAME/VERSION|ALIAS or runs:/RUN_ID/model")
    tokenizer: Optional[str] = _f(None, "tokenizer name or directory; None = the one that came with the weights")
    preset: Optional[str] = _f(None, "model preset for a bare .pth; None = inferred from the tensor shapes")
    lora: Optional[str] = _f(None, "a LoRA weights file (MiniMind lora_*.pth) merged into the weights")
    lora_alpha: Optional[float] = _f(None, "LoRA scale alpha/rank; None = unscaled (MiniMind's behaviour)")
    tracking_uri: Optional[str] = _f(None, "MLflow tracking URI for models:/ and runs:/; None = MLFLOW_TRACKING_URI "
                                           "or sqlite:///<cwd>/mlflow.db")
    model_name: Optional[str] = _f(None, "the model id /v1/models lists; None = derived from the weights")
    device: Optional[str] = _f(None, "cpu | cuda; None = cuda when the machine has a GPU (one GPU per replica)")
    rope_scaling: Optional[Dict[str, Any]] = _f(None, "{type: yarn, factor: 16, original_max_position_embeddings: "
                                                      "2048} (MiniMind's YaRN) or {type: none}; None = as the weights "
                                                      "record (minimind-ray serve --rope-scaling)")
    max_batch: int = _f(16, "most requests one replica decodes together (continuous batching)")
    max_queued: Optional[int] = _f(None, "rows one replica lets wait beyond its running batch; a request past "
                                         "them gets 429 + Retry-After at once; None = 2 x max_batch")
    request_timeout_s: Optional[float] = _f(300.0, "a request not finished by then is aborted (its rows freed) "
                                                   "and answered 504 (mid-stream: an error event); None = never")
    api_key_sha256: Optional[str] = _f(None, "hex sha256 of the API key requests must send as 'Authorization: "
                                             "Bearer KEY' (the key itself never travels); None = the replica's "
                                             "MINIMIND_RAY_API_KEY if set, else no key")
    grammar_timeout_s: float = _f(5.0, "structured output: a response_format schema or forced tool call whose "
                                  "grammar takes longer to compile is refused with a 400")
    max_tokens_cap: int = _f(1024, "requests asking for more max_tokens get a 400")
    context: Optional[int] = _f(None, "most prompt + reply tokens per request; None = the model's "
                                      "max_position_embeddings")
    prefix_cache_mb: float = _f(256.0, "MiB of prompt keys/values a replica keeps to reuse for prompts that start "
                                       "alike (a system prompt, earlier turns; LRU); 0 = no prefix cache")
    stream_interval_ms: float = _f(40.0, "a stream sends what is new at most this often (the first token at "
                                         "once): fewer, fuller chunks when decoding is fast; 0 = every token")
    stream_interval_max_ms: float = _f(160.0, "a busy replica coalesces more: the interval grows with the streams it "
                                              "serves (x streams/4) up to this; every chunk costs CPU in the replica "
                                              "and Serve's proxy (docs/serving.md's benchmark)")
    temperature: float = _f(0.85, "temperature when a request gives none (0 = greedy)")
    top_p: float = _f(0.85, "top_p when a request gives none")
    top_k: int = _f(50, "top_k when a request gives none (0 = off)")
    replicas: int = _f(1, "fixed number of replicas (each holds the model and its own batch)")
    autoscale: Optional[str] = _f(None, "MIN..MAX: let Serve scale replicas on load instead of --replicas")
    cpus_per_replica: float = _f(1.0, "logical CPUs Ray reserves per replica")
    threads: Optional[int] = _f(None, "torch threads per replica; None = cpus_per_replica (at least 1)")
    host: str = _f("127.0.0.1", "HTTP bind address of Serve's proxies; 0.0.0.0 exposes it (see docs/serving.md)")
    port: int = _f(8000, "HTTP port of Serve's proxies")
    app_name: str = _f("minimind", "Serve application name (serve status, serve.delete)")
    route_prefix: str = _f("/", "URL prefix of the app")
    address: Optional[str] = _f(None, "Ray address to join; None = RAY_ADDRESS or a local Ray")

    def autoscale_range(self) -> Optional[Tuple[int, int]]:
        if not self.autoscale:
            return None
        lo, sep, hi = self.autoscale.partition("..")
        try:
            low, high = int(lo), int(hi)
        except ValueError:
            low = high = -1
        if not sep or low < 0 or high < max(low, 1):
            raise ConfigError(f"autoscale: {self.autoscale!r} is not MIN..MAX with 0 <= MIN <= MAX and MAX >= 1")
        return low, high

    def validate(self) -> "ServeOptions":
        if not self.weights:
            raise ConfigError("weights: nothing to serve (a run dir, checkpoint, .pth, HF export or models:/ URI)")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device: {self.device!r} is not cpu or cuda")
        for name, low in (("max_batch", 1), ("max_tokens_cap", 1), ("replicas", 1), ("port", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name}: must be >= {low} (got {getattr(self, name)})")
        if self.context is not None and self.context < 2:
            raise ConfigError(f"context: must be >= 2 (got {self.context})")
        if self.max_queued is not None and self.max_queued < 0:
            raise ConfigError(f"max_queued: must be >= 0 (got {self.max_queued})")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s: must be > 0 (got {self.request_timeout_s})")
        if not self.grammar_timeout_s > 0:
            raise ConfigError(f"grammar_timeout_s: must be > 0 (got {self.grammar_timeout_s})")
        if self.api_key_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.api_key_sha256):
            raise ConfigError("api_key_sha256: must be 64 lowercase hex digits (sha256 of the key)")
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb: must be >= 0 (got {self.prefix_cache_mb})")
        if self.stream_interval_ms < 0:
            raise ConfigError(f"stream_interval_ms: must be >= 0 (got {self.stream_interval_ms})")
        if self.stream_interval_max_ms < self.stream_interval_ms:
            raise ConfigError(f"stream_interval_max_ms: must be >= stream_interval_ms "
                              f"(got {self.stream_interval_max_ms})")
        if self.cpus_per_replica < 0:
            raise ConfigError(f"cpus_per_replica: must be >= 0 (got {self.cpus_per_replica})")
        if not 0 <= self.temperature <= 2 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("temperature/top_p/top_k: need 0 <= temperature <= 2, 0 < top_p <= 1, top_k >= 0")
        self.autoscale_range()
        return self

    def queued(self) -> int:
        return 2 * self.max_batch if self.max_queued is None else self.max_queued

    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_replica))

    def max_replicas(self) -> int:
        rng = self.autoscale_range()
        return rng[1] if rng else self.replicas

    def deployment_options(self) -> Dict[str, Any]:
        """Ray Serve deployment options: replicas or autoscaling, resources, how many requests may wait."""
        # Serve runs a replica's request handlers on its own event loop, in the replica's main thread, instead
        # of a second loop thread: every SSE chunk then skips a hop between threads. Safe here because no
        # handler blocks its loop (the model runs in the engine thread). bench_serve.py at 16 streaming
        # clients: 1.23 instead of 1.82 CPU s per 1000 tokens (replica 0.77 / 1.09, proxy 0.30 / 0.51).
        actor = {"num_cpus": self.cpus_per_replica,
                 "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}}
        if self.device and self.device.startswith("cuda"):
            actor["num_gpus"] = 1
        held = self.max_batch + self.queued()
        headroom = max(32, held)
        opts: Dict[str, Any] = {
            "ray_actor_options": actor,
            # every running stream is one ongoing request. The replica itself holds max_batch running and
            # max_queued waiting rows and refuses more at once with OpenAI's 429 body; Serve lets `headroom`
            # more reach it, so that a burst is refused by the replica (JSON) rather than by Serve's router
            "max_ongoing_requests": held + headroom,
            # Serve's own bound: requests its router holds when every replica is at max_ongoing_requests
            # (its 429 has a plain-text body); keeps the proxy's memory bounded
            "max_queued_requests": headroom,
            "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
            "health_check_period_s": 10,
        }
        rng = self.autoscale_range()
        if rng:
            opts["autoscaling_config"] = {"min_replicas": rng[0], "initial_replicas": max(rng[0], 1),
                                          "max_replicas": rng[1], "target_ongoing_requests": self.max_batch}
        else:
            opts["num_replicas"] = self.replicas
        return opts

    def logical_cpus(self) -> int:
        """Logical CPUs a local Ray needs for every replica."""
        return math.ceil(self.max_replicas() * self.cpus_per_replica)


def options_from_dict(d: Dict[str, Any]) -> ServeOptions:
    """A Serve config's ``args`` (or a replica's copy) -> ServeOptions; unknown keys are an error."""
    known = {f.name for f in dataclasses.fields(ServeOptions)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown serve option(s) {unknown}; known: {', '.join(sorted(known))}")
    return ServeOptions(**d).validate()
