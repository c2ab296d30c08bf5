"""Prometheus /metrics, with vLLM's metric names. Gauges are read from the engine process at each scrape."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.num_requests_running = Gauge("vllm:num_requests_running", "Number of requests in model execution.",
                                          labels, registry=self.registry).labels(model_name)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                          labels, registry=self.registry).labels(model_name)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    labels, registry=self.registry).labels(model_name)

    def update_from_engine(self, stats: dict[str, float]) -> None:
        """stats: EngineCore.stats(), fetched over ZMQ."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage.set(stats["kv_cache_usage"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
