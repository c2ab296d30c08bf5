"""/metrics for the KV tiers beyond the pool (tokenmill/engine/kv_offload.py): vLLM's external prefix cache
counters and tokenmill's own (bytes, blocks, rejections, store errors, occupancy, load latency), fed from the
engine's cumulative OffloadStats as deltas, as the other engine counters are."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.messages import SchedulerStats

LOAD_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class KVOffloadMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        r, labels = registry, ["model_name"]
        self.external_queries = Counter("vllm:external_prefix_cache_queries",
                                        "External prefix cache queries from KV connector cross-instance cache "
                                        "sharing, in terms of number of queried tokens.", labels, registry=r)
        self.external_hits = Counter("vllm:external_prefix_cache_hits",
                                     "External prefix cache hits from KV connector cross-instance cache sharing, "
                                     "in terms of number of cached tokens.", labels, registry=r)
        self.bytes_written = Counter("tokenmill:kv_offload_bytes_written", "Bytes of KV blocks written to the tiers.",
                                     labels, registry=r)
        self.bytes_read = Counter("tokenmill:kv_offload_bytes_read", "Bytes of KV blocks loaded from the tiers.",
                                  labels, registry=r)
        self.blocks_written = Counter("tokenmill:kv_offload_blocks_written", "KV blocks written to the tiers.",
                                      labels, registry=r)
        self.blocks_read = Counter("tokenmill:kv_offload_blocks_read", "KV blocks loaded from the tiers.",
                                   labels, registry=r)
        self.saves_skipped = Counter("tokenmill:kv_offload_saves_skipped",
                                     "Computed KV blocks not saved: the pool reused them before a save had room.",
                                     labels, registry=r)
        self.blocks_rejected = Counter("tokenmill:kv_offload_blocks_rejected",
                                       "Stored KV blocks refused on load (checksum, length, layout...) and recomputed.",
                                       labels + ["reason"], registry=r)
        self.store_errors = Counter("tokenmill:kv_offload_store_errors",
                                    "Failed calls to a KV tier (disk full, store unreachable...); requests recompute.",
                                    labels + ["medium"], registry=r)
        self.occupancy = Gauge("tokenmill:kv_offload_occupancy_bytes", "Bytes held by each KV tier (a shared "
                               "store: the bytes this instance wrote).", labels + ["medium"], registry=r)
        self.capacity = Gauge("tokenmill:kv_offload_capacity_bytes", "Each KV tier's size cap (0: the store's own).",
                              labels + ["medium"], registry=r)
        self.healthy = Gauge("tokenmill:kv_offload_healthy", "1 while a KV tier's last call succeeded.",
                             labels + ["medium"], registry=r)
        self.loading = Gauge("tokenmill:kv_offload_requests_loading", "Requests waiting for their KV blocks to load.",
                             labels, registry=r)
        self.load_seconds = Histogram("tokenmill:kv_offload_load_seconds", "Time to load one request's blocks.",
                                      labels, buckets=LOAD_SECONDS_BUCKETS, registry=r)
        self._last: dict[str, object] = {}

    def record(self, stats: SchedulerStats) -> None:
        o, m = stats.kv_offload, self.model_name
        if o is None:
            return
        for name, metric, value in (("queries", self.external_queries, stats.external_prefix_cache_queries),
                                    ("hits", self.external_hits, stats.external_prefix_cache_hits),
                                    ("bw", self.bytes_written, o.bytes_written), ("br", self.bytes_read, o.bytes_read),
                                    ("nw", self.blocks_written, o.blocks_written),
                                    ("nr", self.blocks_read, o.blocks_read),
                                    ("skipped", self.saves_skipped, o.saves_skipped)):
            self._inc(name, metric.labels(m), value)
        for reason, value in o.blocks_rejected.items():
            self._inc(f"rejected:{reason}", self.blocks_rejected.labels(m, reason), value)
        for medium, value in o.occupancy_bytes.items():
            self.occupancy.labels(m, medium).set(value)
            self.capacity.labels(m, medium).set(o.capacity_bytes.get(medium, 0))
            self.healthy.labels(m, medium).set(1 if o.healthy.get(medium, True) else 0)
            self._inc(f"errors:{medium}", self.store_errors.labels(m, medium), o.store_errors.get(medium, 0))
        self.loading.labels(m).set(o.num_loading)
        for seconds in o.load_seconds:
            self.load_seconds.labels(m).observe(seconds)

    def _inc(self, name: str, child, value: int) -> None:
        old = self._last.get(name, 0)
        if value > old:
            child.inc(value - old)
        self._last[name] = value
