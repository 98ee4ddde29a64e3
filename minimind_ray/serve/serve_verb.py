"""``minimind-ray serve`` and ``python -m pipelines.serve``: start or join Ray, deploy, wait.

Without ``--address`` or ``RAY_ADDRESS`` a local Ray is started for the service and stopped with
it, on this machine's loopback address only: its node, and so its metrics agent's Prometheus endpoint
(the replicas' metrics, docs/serving.md), answer on 127.0.0.1 alone, whatever ``--host`` the app binds.
On a cluster the app is deployed next to whatever else runs there; the command then waits
(Ctrl-C or ``ray job stop`` deletes the app again) unless ``--detach`` leaves it running.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from minimind_ray.config_checks import ConfigError
from minimind_ray.console import after_ray_start, quiet_handlers, ray_init_options
from minimind_ray.fsio import is_uri
from minimind_ray.generate_verb import add_rope_scaling_arguments, rope_scaling_of
from minimind_ray.serve.options import API_KEY_ENV, ServeOptions, is_mlflow_uri

REPO_ROOT = Path(__file__).resolve().parents[2]
# Ray's own switch: off, a local Ray takes 127.0.0.1 as its node address (what it does on macOS and Windows), and its
# metrics agent binds its Prometheus port to it. Ray reads it when first imported; =1 in the environment keeps the
# node's network address (Ray's default on Linux).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


HELP = "serve WEIGHTS on Ray Serve: an OpenAI-compatible API and a chat page (docs/serving.md)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve command's flags: the CLI verb's (``python -m pipelines.serve`` is that verb), ``python -m
    minimind_ray.serve.serve_verb``'s and the pipeline's serve step's (its ``serve_args``)."""
    d = ServeOptions()
    p.add_argument("weights", help=ServeOptions.__dataclass_fields__["weights"].metadata["help"])
    p.add_argument("--host", default=d.host, help="bind address (default 127.0.0.1: this machine only; "
                                                  "see docs/serving.md before using 0.0.0.0)")
    p.add_argument("--port", type=int, default=d.port)
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=d.replicas, help="fixed replica count")
    scale.add_argument("--autoscale", metavar="MIN..MAX", help="let Serve scale the replicas between MIN and MAX")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="requests decoded together per replica")
    p.add_argument("--max-queued", type=int, default=None,
                   help="requests (rows) one replica lets wait beyond its batch; more get 429 + Retry-After at "
                        "once (default: 2 x --max-batch)")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="abort a request not finished by then and answer 504 (default 300; 0 = never)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (visible in ps: prefer "
                                       f"{API_KEY_ENV} or --api-key-file); /health stays open")
    key.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    p.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help="largest max_tokens accepted")
    p.add_argument("--context", type=int, default=None, help="prompt + reply token limit (default: the model's)")
    p.add_argument("--grammar-timeout-s", type=float, default=d.grammar_timeout_s,
                   help="structured output: refuse (400) a schema or forced tool call whose grammar takes longer to "
                        "compile (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--prefix-cache-mb", type=float, default=d.prefix_cache_mb,
                   help="MiB of prompt keys/values kept per replica for prompts that start alike (LRU; "
                        f"default {d.prefix_cache_mb:g}; 0 = off)")
    p.add_argument("--lora", help="LoRA weights file (MiniMind lora_*.pth) merged into WEIGHTS")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha/rank (default: unscaled)")
    p.add_argument("--tokenizer", help="tokenizer name or directory (default: the one that came with WEIGHTS)")
    p.add_argument("--preset", help="model preset for a bare .pth (default: inferred from shapes)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI for models:/ and runs:/ (default: "
                                          "MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--model-name", help="model id served in /v1/models (default: from WEIGHTS)")
    p.add_argument("--stream-interval-ms", type=float, default=d.stream_interval_ms,
                   help="stream what is new at most this often (default 40; 0 = every token)")
    p.add_argument("--stream-interval-max-ms", type=float, default=d.stream_interval_max_ms,
                   help="a busy replica's interval grows with its streams (x streams/4) up to this (default 160)")
    p.add_argument("--cpus-per-replica", type=float, default=d.cpus_per_replica)
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: its CPUs)")
    p.add_argument("--address", help="Ray address to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--app-name", default=d.app_name, help="Serve application name")
    p.add_argument("--detach", action="store_true",
                   help="on a cluster: deploy and return, leaving the app running (stop: serve shutdown / "
                        "serve.delete(APP_NAME))")
    add_rope_scaling_arguments(p)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    names = {f for f in ServeOptions.__dataclass_fields__}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "request_timeout_s", None) == 0:
        values["request_timeout_s"] = None
    key = api_key_from(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
    if key:
        values["api_key_sha256"] = hashlib.sha256(key.encode()).hexdigest()
    weights = values.get("weights")
    if weights and not is_uri(weights) and not is_mlflow_uri(weights):
        values["weights"] = os.path.abspath(weights)  # replicas do not share our cwd
    return ServeOptions(**values).validate()


def api_key_from(key: Optional[str], key_file: Optional[str]) -> Optional[str]:
    """The API key: --api-key, else the first line of --api-key-file, else MINIMIND_RAY_API_KEY, else None.
    Only its sha256 leaves this process (ServeOptions.api_key_sha256)."""
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: cannot read it ({e.strerror})") from None
        if not key:
            raise ConfigError(f"--api-key-file {key_file}: its first line is empty")
    key = key or os.environ.get(API_KEY_ENV) or None
    if key is not None and len(key) < 16:
        raise ConfigError("the API key is shorter than 16 characters; use a long random one "
                          "(e.g. `openssl rand -hex 32`)")
    return key


def connect(opts: ServeOptions) -> bool:
    """Join ``opts.address`` / RAY_ADDRESS, or start a local Ray bound to the loopback address; True when we
    started it."""
    address = opts.address or os.environ.get("RAY_ADDRESS")
    under_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # under `ray job submit`: the job's runtime env applies
    if not address and not under_job:
        os.environ.setdefault(LOOPBACK_ENV, "0")  # before Ray's first import in this process, which reads it
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}}
    quiet = ray_init_options()  # Ray's and Serve's own lines to Ray's log files, unless --verbose (console.py)
    if under_job:
        after_ray_start(ray.init(**quiet))
        return False
    if address:
        after_ray_start(ray.init(address=address, runtime_env=env, **quiet))
        return False
    after_ray_start(ray.init(num_cpus=max(os.cpu_count() or 1, opts.logical_cpus()), include_dashboard=False,
                             runtime_env=env, **quiet))
    node = ray.nodes()[0]["NodeManagerAddress"]
    if os.environ[LOOPBACK_ENV] == "0" and node != "127.0.0.1":
        print(f"warning: this local Ray took the node address {node}, not 127.0.0.1 (Ray was imported before "
              f"{LOOPBACK_ENV}=0 was set): its metrics port answers on every interface", file=sys.stderr)
    return True


def metrics_url() -> str:
    """The Prometheus endpoint of this node's Ray metrics agent (where the replicas' metrics are)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def deploy(opts: ServeOptions, quiet: bool = False) -> str:
    """Deploy the app on the connected Ray and wait until it is ready; returns its URL.
    ``quiet``: no per-request access log lines (benchmarks)."""
    from ray import serve

    from minimind_ray.serve.app import build_app  # lazy: fastapi, pydantic, ray, tokenizers, torch, only when this runs

    quiet_handlers("ray.serve")  # Serve's own driver lines (started, ready, deleting) to its logs, unless --verbose
    serve.start(http_options={"host": opts.host, "port": opts.port})
    logging_config = {"enable_access_log": False, "log_level": "WARNING"} if quiet else None
    # serve.run starts Serve again, finds the instance serve.start just made and says "Connecting to existing Serve
    # app ... New http_options ... will not be applied": not so, they were; that line is dropped
    own_start = _NotExisting()
    logging.getLogger("ray.serve").addFilter(own_start)
    try:
        serve.run(build_app(_as_args(opts)), name=opts.app_name, route_prefix=opts.route_prefix,
                  logging_config=logging_config)
    finally:
        logging.getLogger("ray.serve").removeFilter(own_start)
    host = "127.0.0.1" if opts.host in ("0.0.0.0", "::") else opts.host
    return f"http://{host}:{opts.port}{opts.route_prefix.rstrip('/')}"


def served_info(app_name: str, timeout_s: float = 60.0) -> Optional[dict]:
    """What the app's replica says it serves (app.py:ChatServer.describe, through Serve's handle): its model id,
    weights, the context it serves and the one its run trained at; None where it cannot say."""
    from ray import serve

    try:
        return serve.get_app_handle(app_name).describe.remote().result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - the startup line is a courtesy: the weights alone then
        return None


def startup_line(info: dict) -> str:
    """``serving sft-20261204-0a1b2c (/runs/sft-latest): context 32768 tokens, trained at 128``: the model id (a
    ``-latest`` link's run), the weights as given, the context served (the RoPE table, or --context) and the one
    the run trained at (data.max_seq_len; past it the model has seen no positions)."""
    trained = info.get("trained_context_length")
    return (f"serving {info['model']} ({info['weights']}): context {info['context_length']} tokens"
            + (f", trained at {trained}" if trained else " (trained context not recorded in these weights)"))


class _NotExisting(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


def _as_args(opts: ServeOptions) -> dict:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(opts).items() if v is not None}


def run(args: argparse.Namespace) -> int:
    from minimind_ray.serve.model_io import check_source, pin_tokenizer  # lazy: tokenizers, torch, only when this runs

    args.rope_scaling = rope_scaling_of(args)  # a dict (ServeOptions.rope_scaling) that travels to the replicas
    opts = options_from_args(args)
    check_source(opts.weights, opts.tracking_uri)  # a one-line error before Ray starts
    opts.tokenizer = pin_tokenizer(opts.weights, opts.tokenizer)
    started_ray = connect(opts)
    stop = threading.Event()
    try:
        url = deploy(opts)
        info = served_info(opts.app_name)
        print("\n" + (startup_line(info) if info else f"serving {opts.weights}"))
        print(f"  chat page:        {url}/")
        print(f"  OpenAI base URL:  {url}/v1   (model id: GET {url}/v1/models)")
        print(f"  health:           {url}/health")
        print(f"  API key:          {'required (Authorization: Bearer <key>)' if opts.api_key_sha256 else 'none'}")
        print(f"  metrics:          {metrics_url()}" if started_ray else
              "  metrics:          Prometheus, on each Ray node's metrics export port (docs/serving.md)")
        if opts.host in ("0.0.0.0", "::"):
            print(f"  bound to {opts.host}: reachable from other machines; see docs/serving.md"
                  + ("" if opts.api_key_sha256 else " (and set an API key)"))
        if args.detach and not started_ray:
            print(f"detached: the app keeps running; stop it with `serve shutdown` or serve.delete('{opts.app_name}')")
            return 0
        if args.detach:
            print("--detach needs a cluster (--address or RAY_ADDRESS): this local Ray lives as long as this command")
        print("Ctrl-C stops it.", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):  # wake up now and then so the signal handlers run promptly
            pass
    finally:
        _teardown(opts, started_ray, stopping=stop.is_set() or not args.detach)
    return 0


def _teardown(opts: ServeOptions, started_ray: bool, stopping: bool) -> None:
    import ray

    if not ray.is_initialized() or not stopping:
        return
    from ray import serve

    try:
        serve.delete(opts.app_name)  # only our app: other apps on a shared cluster stay up
    finally:
        if started_ray:  # Serve ends with the Ray this command started (serve.shutdown's graceful_shutdown task would
            ray.shutdown()  # be cut short by it: "Task ServeController.graceful_shutdown failed ... retries remaining")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
