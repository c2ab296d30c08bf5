"""The router's Prometheus metrics (`tokenmill_router:*`), on its own registry, served at the router's /metrics."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST

# the time the router adds before a request leaves for its replica: reading, tokenizing, hashing, choosing
OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
# a replica's /wake_up: under a second from level 1, seconds from level 2 (the weights mapped again)
WAKE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("tokenmill_router:requests", "requests sent to a replica (retries included), by "
                                "the policy's reason", ["replica", "reason"], registry=registry)
        self.retries = Counter("tokenmill_router:retries", "requests retried on another replica, by the failure "
                               "on this one", ["replica", "cause"], registry=registry)
        self.failures = Counter("tokenmill_router:failures", "requests the router answered with an error itself",
                                ["cause"], registry=registry)
        self.prompt_tokens = Counter("tokenmill_router:prompt_tokens", "prompt tokens routed", ["replica"],
                                     registry=registry)
        self.predicted_cached_tokens = Counter(
            "tokenmill_router:predicted_cached_tokens", "prompt tokens predicted to be in the chosen replica's "
            "prefix cache", ["replica"], registry=registry)
        self.overhead = Histogram("tokenmill_router:overhead_seconds", "time from a request's arrival to its "
                                  "forwarding to a replica", buckets=OVERHEAD_BUCKETS, registry=registry)
        self.in_flight = Gauge("tokenmill_router:in_flight_requests", "requests sent and not yet finished",
                               ["replica"], registry=registry)
        self.load = Gauge("tokenmill_router:replica_load", "the load the policies see: in-flight requests plus "
                          "those the replica reported running or waiting beyond them", ["replica"], registry=registry)
        self.healthy = Gauge("tokenmill_router:replica_healthy", "1 while the replica is admitted", ["replica"],
                             registry=registry)
        self.index_blocks = Gauge("tokenmill_router:kv_index_blocks", "cached blocks the router knows of",
                                  ["replica"], registry=registry)
        self.event_gaps = Gauge("tokenmill_router:kv_event_gaps", "gaps seen in the replica's KV event sequence "
                                "(each repaired by replay when it has a replay endpoint)", ["replica"],
                                registry=registry)

        self.actual_cached_tokens = Counter(
            "tokenmill_router:actual_cached_tokens", "prompt tokens the replica found in its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens), for the requests whose usage the router saw",
            ["replica"], registry=registry)
        self.cache_predictions = Counter(
            "tokenmill_router:cache_predictions", "requests whose usage the router saw, by how the predicted "
            "cached tokens compare with the replica's count: exact, over, under", ["outcome"], registry=registry)
        self.resumed_streams = Counter("tokenmill_router:resumed_streams", "streams continued on this replica "
                                       "after another failed mid-stream", ["replica"], registry=registry)
        self.rejections = Counter("tokenmill_router:rejections", "requests refused by admission: unauthorized, "
                                  "rpm, tpm, queue_full, queue_timeout, draining", ["tenant", "reason"],
                                  registry=registry)
        self.queued = Gauge("tokenmill_router:queued_requests", "requests waiting in the admission queue",
                            registry=registry)
        self.admitted = Gauge("tokenmill_router:admitted_requests", "requests past admission and not yet finished",
                              registry=registry)
        self.finished = Counter("tokenmill_router:finished_requests", "requests the router has finished, failed "
                                "and rejected ones included", registry=registry)
        self.cpu = Gauge("tokenmill_router:cpu_seconds", "CPU time of the router process since it started",
                         registry=registry)
        self.cpu_per_request = Gauge("tokenmill_router:cpu_seconds_per_request", "the router process's CPU time "
                                     "(tokenizing, hashing, relaying, health checks, KV events) per finished "
                                     "request", registry=registry)
        # disaggregated serving (--prefill, --decode)
        self.pd_requests = Counter("tokenmill_router:pd_requests", "disaggregated requests placed, by stage "
                                   "(prefill, decode) and the instance that served the stage", ["stage", "replica"],
                                   registry=registry)
        self.pd_prefill_failovers = Counter("tokenmill_router:pd_prefill_failovers", "prefills that failed on this "
                                            "prefill instance (connection, 5xx): the next prefill instance in the "
                                            "policy's ranking is tried (up to --max-attempts)",
                                            ["replica"], registry=registry)
        # idle replicas sleep (--sleep-after-idle)
        self.sleeping = Gauge("tokenmill_router:sleeping_replicas", "replicas the router has put to sleep (or found "
                              "asleep) and not woken since", registry=registry)
        self.sleeps = Counter("tokenmill_router:replica_sleeps", "POST /sleep the replica accepted", ["replica"],
                              registry=registry)
        self.wakes = Counter("tokenmill_router:replica_wakes", "POST /wake_up the replica answered, for requests "
                             "routed to it", ["replica"], registry=registry)
        self.wake_seconds = Histogram("tokenmill_router:wake_seconds", "time a replica's POST /wake_up took (what "
                                      "the requests that waited for it waited)", buckets=WAKE_BUCKETS,
                                      registry=registry)
        self._cpu_start = time.process_time()
        self._num_finished = 0

    def request_finished(self) -> None:
        self._num_finished += 1
        self.finished.inc()

    def forget(self, replica_name: str) -> None:
        """A replica that left: its gauges go (its counters stay, they are history)."""
        for gauge in (self.in_flight, self.load, self.healthy, self.index_blocks, self.event_gaps):
            try:
                gauge.remove(replica_name)
            except KeyError:
                pass

    def render(self, replicas, admission=None) -> bytes:
        cpu = time.process_time() - self._cpu_start
        self.cpu.set(cpu)
        self.cpu_per_request.set(cpu / self._num_finished if self._num_finished else 0.0)
        if admission is not None:
            self.queued.set(admission.queued)
            self.admitted.set(admission.in_flight)
        self.sleeping.set(sum(r.asleep for r in replicas))
        for r in replicas:
            self.in_flight.labels(r.name).set(r.in_flight)
            self.load.labels(r.name).set(r.load)
            self.healthy.labels(r.name).set(1 if r.healthy else 0)
            self.index_blocks.labels(r.name).set(len(r.index.blocks))
            self.event_gaps.labels(r.name).set(r.index.num_gaps)
        return generate_latest(self.registry)
