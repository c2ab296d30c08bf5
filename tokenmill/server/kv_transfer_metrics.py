"""/metrics for disaggregated prefill/decode (tokenmill/engine/kv_transfer.py), fed from the engine's cumulative
KVTransferStats as deltas. The decode side's transferred prompt tokens are counted by vLLM's
`vllm:prompt_tokens_by_source{source="external_kv_transfer"}` (metrics.py), as a KV tier's are; these are
tokenmill's own (vLLM has no connector-neutral names for them)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.messages import SchedulerStats

FETCH_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        r, labels = registry, ["model_name"]
        self.pinned_blocks = Gauge("tokenmill:kv_transfer_pinned_blocks", "KV blocks a prefill instance holds for "
                                   "decode instances that have not fetched them yet.", labels, registry=r)
        self.pinned_requests = Gauge("tokenmill:kv_transfer_pinned_requests", "Finished prefill requests whose KV "
                                     "blocks wait for their decode instance.", labels, registry=r)
        self.pins_expired = Counter("tokenmill:kv_transfer_pins_expired", "Prefill requests whose blocks no decode "
                                    "instance fetched within abort_request_timeout (freed then).", labels, registry=r)
        self.blocks = Counter("tokenmill:kv_transfer_blocks", "KV blocks sent (prefill side), fetched, and skipped "
                              "because the decode instance's prefix cache held them.", labels + ["kind"], registry=r)
        self.bytes = Counter("tokenmill:kv_transfer_bytes", "Bytes of KV blocks sent and received.",
                             labels + ["direction"], registry=r)
        self.tokens = Counter("tokenmill:kv_transfer_tokens_fetched", "Prompt tokens whose KV a decode instance "
                              "fetched (with kv_transfer_fetch_seconds_sum: the cost per token).", labels, registry=r)
        self.failures = Counter("tokenmill:kv_transfer_fetch_failures", "Fetches that failed, by reason (timeout, "
                                "connection, unknown: the prefill instance no longer holds them, layout...); their "
                                "blocks are recomputed.", labels + ["reason"], registry=r)
        self.fetch_seconds = Histogram("tokenmill:kv_transfer_fetch_seconds", "Time to fetch one request's KV blocks "
                                       "from its prefill instance and write them into the pool.", labels,
                                       buckets=FETCH_SECONDS_BUCKETS, registry=r)
        self.phase_seconds = Counter("tokenmill:kv_transfer_fetch_phase_seconds", "The decode side's fetch time by "
                                     "phase: queued (waiting for the transfer worker), network (the request, the "
                                     "prefill instance's read and the reply), checks (headers and CRC-32s), write "
                                     "(into the pool).", labels + ["phase"], registry=r)
        self._last: dict[str, float] = {}

    def record(self, stats: SchedulerStats) -> None:
        t, m = stats.kv_transfer, self.model_name
        if t is None:
            return
        self.pinned_blocks.labels(m).set(t.pinned_blocks)
        self.pinned_requests.labels(m).set(t.pinned_requests)
        for name, child, value in (("expired", self.pins_expired.labels(m), t.pins_expired),
                                   ("sent", self.blocks.labels(m, "sent"), t.blocks_sent),
                                   ("fetched", self.blocks.labels(m, "fetched"), t.blocks_fetched),
                                   ("skipped", self.blocks.labels(m, "skipped"), t.blocks_skipped),
                                   ("bytes_sent", self.bytes.labels(m, "sent"), t.bytes_sent),
                                   ("bytes_received", self.bytes.labels(m, "received"), t.bytes_received)):
            self._inc(name, child, value)
        for reason, value in t.fetch_failures.items():
            self._inc(f"failed:{reason}", self.failures.labels(m, reason), value)
        for phase, value in t.fetch_phase_seconds.items():
            self._inc(f"phase:{phase}", self.phase_seconds.labels(m, phase), value)
        for seconds in t.fetch_seconds:
            self.fetch_seconds.labels(m).observe(seconds)
        if t.tokens_fetched:
            self.tokens.labels(m).inc(sum(t.tokens_fetched))

    def _inc(self, name: str, child, value: float) -> None:
        old = self._last.get(name, 0)
        if value > old:
            child.inc(value - old)
        self._last[name] = value
