"""ORCA load reports (Open Request Cost Aggregation), as vLLM sends them: a request that carries the header
`endpoint-load-metrics-format: TEXT` (or `JSON`) gets the server's load in an `endpoint-load-metrics` response
header, so that a load balancer such as Envoy routes by it without scraping /metrics. vLLM reports two of its
gauges, KV-cache usage and the requests waiting; so does tokenmill, with the same names and formats."""
from __future__ import annotations

import json

REQUEST_HEADER = "endpoint-load-metrics-format"
RESPONSE_HEADER = "endpoint-load-metrics"


def load_report(metrics_format: str, kv_cache_usage: float, num_waiting: float) -> dict[str, str]:
    """The response header for a request's format ("" or an unknown format: none, as vLLM)."""
    named = {"kv_cache_usage_perc": float(kv_cache_usage), "num_requests_waiting": float(num_waiting)}
    fmt = metrics_format.lower()
    if fmt == "text":
        return {RESPONSE_HEADER: "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())}
    if fmt == "json":
        return {RESPONSE_HEADER: "JSON " + json.dumps({"named_metrics": named})}
    return {}
