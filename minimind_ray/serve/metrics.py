"""Prometheus metrics of a replica, through Ray's metrics export.

``ray.serve.metrics`` Counter/Gauge/Histogram are Ray metrics with the Serve tags (``application``,
``deployment``, ``replica``) added; every node's metrics agent serves them, next to Serve's own
(``ray_serve_*``), on the node's metrics export port (``ray start --metrics-export-port``, or
``ray.nodes()[i]["MetricsExportPort"]``) at ``/metrics``, named with a ``ray_`` prefix (and
``_total`` on counters): ``ray_minimind_serve_requests_total{endpoint, status}``, ... The agent
reads them from the replica every few seconds (Ray's ``metrics_report_interval_ms``, 10 s).
docs/serving.md lists them and says how to scrape them.
"""
from __future__ import annotations

import threading
from typing import Callable

# seconds; first tokens wait for a prefill (and a queue), later ones for one decode step of the batch
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]
LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]
PREFIX = "minimind_serve_"


class ServeMetrics:
    """The replica's metrics; ``load()`` (the engine's) is sampled for the gauges once a second."""

    def __init__(self, model: str, load: Callable[[], dict], period_s: float = 1.0):
        from ray.serve.metrics import Counter, Gauge, Histogram

        def made(cls, name, description, **kw):
            metric = cls(PREFIX + name, description=description, tag_keys=("model",) + kw.pop("keys", ()), **kw)
            metric.set_default_tags({"model": model})  # a new dict each time: Serve adds its tags to it in place
            return metric

        self.requests = made(Counter, "requests", "HTTP requests answered, by endpoint and status code",
                             keys=("endpoint", "status"))
        self.aborted = made(Counter, "aborted_requests", "requests whose generation was stopped early: "
                            "client disconnected, timeout", keys=("reason",))
        self.prompt_tokens = made(Counter, "prompt_tokens", "prompt tokens of requests that started generating")
        self.cached_tokens = made(Counter, "prompt_cached_tokens", "of the prompt tokens, those the prefix cache "
                                  "held (not computed again); / prompt_tokens = the hit rate over any window")
        self.generated_tokens = made(Counter, "generated_tokens", "tokens generated (every choice, end-of-turn "
                                     "included)")
        self.tool_parse_failures = made(Counter, "tool_call_parse_failures", "<tool_call> blocks returned as text "
                                        "(not JSON, no name, unknown function, unterminated)")
        self.ttft = made(Histogram, "time_to_first_token_seconds", "request arrival to its first generated token",
                         boundaries=TTFT_BUCKETS)
        self.itl = made(Histogram, "inter_token_latency_seconds", "time between two tokens of one choice, as the "
                        "replica's handler receives them", boundaries=ITL_BUCKETS)
        self.latency = made(Histogram, "request_latency_seconds", "request arrival to its last token",
                            boundaries=LATENCY_BUCKETS)
        self.queue_depth = made(Gauge, "queue_depth", "rows waiting to join the running batch")
        self.running = made(Gauge, "running_batch", "rows in the running batch")
        self.cache_hit_rate = made(Gauge, "prefix_cache_hit_rate", "prompt tokens served from the prefix cache / "
                                   "prompt tokens looked up, since the replica started (0 without a cache)")
        self.cache_bytes = made(Gauge, "prefix_cache_bytes", "bytes of keys/values the prefix cache holds "
                                "(never above --prefix-cache-mb)")
        self._load, self._period_s = load, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="minimind-serve-metrics", daemon=True)
        self._thread.start()

    def request(self, endpoint: str, status: int) -> None:
        self.requests.inc(1, tags={"endpoint": endpoint, "status": str(status)})

    def close(self) -> None:
        self._stop.set()

    def _sample(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                load = self._load()
                self.queue_depth.set(load["waiting"])
                self.running.set(load["running"])
                self.cache_hit_rate.set(load.get("prefix_cache_hit_rate", 0.0))
                self.cache_bytes.set(load.get("prefix_cache_bytes", 0))
            except Exception:  # noqa: BLE001 - a metric must never take the replica down
                pass
