"""The router's flags, as one dataclass: field = flag (tokenmill/config.py's CliConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import DEFAULT_MODEL, CliConfig

POLICIES = ["kv", "session", "round_robin", "least_load"]


@dataclass
class RouterConfig(CliConfig):
    backend: list[str] = field(default_factory=list, metadata={
        "nargs": "+", "help": "the replicas' base URLs, e.g. http://127.0.0.1:8001 http://127.0.0.1:8002"})
    prefill: list[str] = field(default_factory=list, metadata={
        "nargs": "+", "help": "disaggregated serving: the prefill instances' base URLs (started with --kv-transfer-"
                              "config kv_role kv_producer); with --decode, instead of --backend. A chat or "
                              "completion request is prefilled on one (max_tokens 1, kv_transfer_params "
                              "do_remote_decode), then decoded on a --decode instance with the kv_transfer_params "
                              "the prefill returned"})
    decode: list[str] = field(default_factory=list, metadata={
        "nargs": "+", "help": "disaggregated serving: the decode instances' base URLs (kv_role kv_consumer); they "
                              "also serve every other route"})
    kv_events_endpoint: list[str] | None = field(default=None, metadata={
        "nargs": "+", "help": "each replica's KV-event PUB endpoint, in --backend order, or --prefill then --decode "
                              "order (the replica's "
                              "--kv-events-config endpoint with its host, e.g. tcp://127.0.0.1:5557); without it "
                              "--policy kv predicts no cache hits and routes on load"})
    kv_events_replay_endpoint: list[str] | None = field(default=None, metadata={
        "nargs": "+", "help": "each replica's KV-event replay endpoint, in the order of --kv-events-endpoint: a "
                              "gap in the event sequence is filled from it"})
    policy: str = field(default="kv", metadata={
        "choices": POLICIES, "help": "kv: fewest predicted uncached prompt tokens plus load; session: the same "
                                     "replica for the same x-session-id header or `user` field (bounded-load "
                                     "consistent hashing); round_robin; least_load: fewest in-flight requests"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8080, metadata={"help": "port to listen on"})
    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "the served model (HF directory, GGUF file, or SmolLM2-135M-Instruct): its tokenizer and chat "
                "template give the router the replicas' token ids"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: the model's)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "the replicas' --chat-template, if they were given one (a file, a shipped name, or the text)"})
    block_size: int = field(default=16, metadata={"help": "the replicas' --block-size"})
    # 64: on benchmarks/router_cache_aware.sh's multiturn run (3 replicas, c=8, 64-token turns), 256 sent a
    # conversation away from its cached history whenever its replica had one or two more requests in flight (fleet
    # hit rate 0.43 against a single replica's 0.63); 64 gave 0.61 with the requests still spread 34/31/34%, and 0
    # (cache alone) 0.63 with 38/38/25%.
    load_tokens_per_request: int = field(default=64, metadata={
        "help": "--policy kv: each in-flight request on a replica costs as many prompt tokens as this, against "
                "the tokens a cache hit saves (0: route on cache hits alone)"})
    session_load_factor: float = field(default=1.25, metadata={
        "help": "--policy session: a replica takes a session's request only while its in-flight requests are "
                "below this factor times the mean (bounded-load consistent hashing)"})
    health_check_interval: float = field(default=1.0, metadata={
        "help": "seconds between GET /health/ready of each replica; a failed check ejects it, a passing one "
                "re-admits it"})
    max_attempts: int = field(default=3, metadata={
        "help": "replicas tried for one request that fails before its first byte (each at most once)"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds a proxied request may take"})
    max_resumes: int = field(default=2, metadata={
        "help": "times one stream may be resumed on another replica after its replica failed mid-stream (0: end "
                "the stream with an error event instead)"})
    tenants_config: str | None = field(default=None, metadata={
        "help": "JSON file of API keys, each {\"tenant\": name, \"rpm\": N, \"tpm\": N, \"max_parallel_requests\": "
                "N, \"replicas\": [URL, ...]}: every request then needs 'Authorization: Bearer <key>' and meets its "
                "tenant's limits (429 with Retry-After), and goes only to the tenant's replicas if it names any; "
                "the key is not forwarded to the replicas"})
    max_concurrent_requests: int = field(default=0, metadata={
        "help": "requests the router has in flight over all tenants; more wait in the admission queue (0: no "
                "limit, no queue)"})
    max_queued_requests: int = field(default=256, metadata={
        "help": "requests that may wait for --max-concurrent-requests; more are refused with 503 queue_full"})
    queue_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request may wait in the admission queue before a 503 queue_timeout"})
    shutdown_timeout: float = field(default=600.0, metadata={
        "help": "on SIGTERM the router stops admitting (503) and waits this long for in-flight requests"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "OTLP/HTTP endpoint for OpenTelemetry spans (one per request, continuing the caller's "
                "traceparent and passed on to the replica); also OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"})
    sleep_after_idle: float | None = field(default=None, metadata={
        "help": "seconds a replica may serve nothing before the router sends it POST /sleep (vLLM's endpoint: the "
                "replica runs with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1); a request the policy sends to "
                "a sleeping replica waits while the router wakes it (POST /wake_up). Default: never"})
    sleep_level: int = field(default=1, metadata={
        "choices": [1, 2], "help": "--sleep-after-idle: the level of POST /sleep?level= (1: the KV cache is "
                                   "dropped, the weights kept; 2: both dropped)"})
    min_awake: int = field(default=1, metadata={
        "help": "--sleep-after-idle: replicas of each model (and, disaggregated, of each role) kept awake however "
                "idle"})
    uvicorn_log_level: str = field(default="warning", metadata={
        "choices": ["critical", "error", "warning", "info", "debug", "trace"], "help": "uvicorn's log level"})

    def __post_init__(self):
        # no --backend is a CLI error (tokenmill/router/app.py); under Ray Serve the replicas join as they start
        self.backend = [url.rstrip("/") for url in self.backend]
        self.prefill = [url.rstrip("/") for url in self.prefill]
        self.decode = [url.rstrip("/") for url in self.decode]
        if self.prefill or self.decode:
            # A plain replica among P/D instances would need a role the router cannot know (a kv_both instance
            # prefills for others and decodes its own), so the two ways are not mixed.
            if self.backend:
                raise ValueError("give either --backend or --prefill and --decode, not both")
            if not self.prefill or not self.decode:
                raise ValueError("disaggregated serving needs both --prefill and --decode URLs")
            both = set(self.prefill) & set(self.decode)
            if both or len(set(self.replica_urls)) != len(self.replica_urls):
                raise ValueError(f"each instance is named once, in --prefill or --decode: {sorted(both) or 'a repeat'}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.replica_urls):
                order = "--prefill then --decode URL" if self.disaggregated else "--backend"
                raise ValueError(f"--{name.replace('_', '-')} takes one endpoint per {order} "
                                 f"({len(self.replica_urls)}), got {len(values)}")
        if self.sleep_after_idle is not None and self.sleep_after_idle <= 0:
            raise ValueError("--sleep-after-idle must be positive (leave it out to keep every replica awake)")
        if self.min_awake < 0:
            raise ValueError("--min-awake must not be negative")
        if self.sleep_after_idle is None and (self.sleep_level != 1 or self.min_awake != 1):
            raise ValueError("--sleep-level and --min-awake apply to --sleep-after-idle: give it too")
        if self.max_attempts < 1 or self.block_size < 1 or self.health_check_interval <= 0:
            raise ValueError("--max-attempts, --block-size and --health-check-interval must be positive")
        if self.max_resumes < 0 or self.max_concurrent_requests < 0 or self.max_queued_requests < 0 \
                or self.queue_timeout <= 0:
            raise ValueError("--max-resumes, --max-concurrent-requests and --max-queued-requests must not be "
                             "negative, --queue-timeout must be positive")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def replica_urls(self) -> list[str]:
        """Every replica, in the order --kv-events-endpoint follows."""
        return self.backend or [*self.prefill, *self.decode]

    def role_of(self, index: int) -> str | None:
        """The role of replica_urls[index]: prefill, decode, or None (a --backend replica does both)."""
        if not self.disaggregated:
            return None
        return "prefill" if index < len(self.prefill) else "decode"
