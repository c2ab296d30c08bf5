"""Prometheus metrics with vLLM's names, types and bucket edges, so vLLM dashboards and autoscalers work as-is.

Every time comes from the engine process: requests carry their arrival, scheduling, first-token and finish times
(time.monotonic(), one clock for the machine), and each step's outputs carry the step's end time, which is when its
tokens were made. How fast HTTP delivers them does not change any figure here. Counters that the engine keeps
(prefix cache, preemptions) arrive as running totals with each step and are added as deltas."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from tokenmill.engine.messages import EngineCoreOutput, SchedulerStats
from tokenmill.server.kv_offload_metrics import KVOffloadMetrics
from tokenmill.server.kv_transfer_metrics import KVTransferMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's default bucket edges (vllm/v1/metrics: request latency, TTFT, inter-token latency, iteration tokens)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vllm:num_requests_waiting_by_reason: "capacity" (waiting for room in the batch or the KV cache) and "deferred"
# (held back by a transient constraint: in tokenmill, a structured-output grammar still compiling)
WAITING_REASONS = ("capacity", "deferred")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass
class _Tracked:
    num_prompt_tokens: int
    arrival: float
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    num_generated: int = 0
    max_tokens: int | None = None  # the request's max_tokens parameter (None: a pooling request has none)
    parent: str | None = None  # the API request's prompt that this is one of n samples of
    has_output: bool = False  # vLLM's "is_prefilling" is over: its first output has arrived
    lora_name: str | None = None  # the LoRA adapter it ran with


@dataclass
class _Parent:
    """The n samples of one prompt: vLLM observes n and their longest generation once all have finished."""
    n: int
    unfinished: int
    max_generated: int = 0


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vllm:engine_sleep_state's labels, by sleep level


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool, cache_dtype: str = "auto", max_loras: int = 0):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                                  "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                                  "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
                                  "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                                  ["model_name", "reason"], registry=r)
        self.num_requests_waiting_by_reason = {reason: waiting_by_reason.labels(model_name, reason)
                                               for reason in WAITING_REASONS}
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.stalled_streams = counter("tokenmill:stalled_streams_aborted",
                                       "Streaming requests aborted because their client stopped reading.")
        # speculative decoding, as vLLM's SpecDecodingProm (running totals from SchedulerStats, added as deltas)
        self.spec_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["model_name", "position"], registry=r)
        self._spec_totals = (0, 0, 0)
        self._spec_per_pos_totals: list[int] = []
        self._spec_logged = (0, 0, 0)  # drafts, draft tokens, accepted, at the last stats line
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = request_tokens_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                          REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self._parents: dict[str, _Parent] = {}
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        Info("vllm:cache_config", "Information of the LLMEngine CacheConfig", registry=r).info({
            "block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(enable_prefix_caching), "cache_dtype": cache_dtype})
        # LoRA (with --enable-lora): vLLM's info gauge, whose labels name the adapters of the running and waiting
        # requests (its value: when that was last so), and the finished requests of each adapter
        self.max_loras = max_loras
        self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                registry=r) if max_loras else None
        self._lora_info_labels: tuple[str, str, str] | None = None
        self._lora_requests = None
        if max_loras:
            self._lora_requests = Counter("tokenmill:lora_requests", "Finished requests per LoRA adapter.",
                                          ["model_name", "lora_name", "finished_reason"], registry=r)
        self.kv_offload = KVOffloadMetrics(r, model_name)
        self.kv_transfer = KVTransferMetrics(r, model_name)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            ["model_name", "source"], registry=r)
        self.prompt_tokens_by_source = {source: by_source.labels(model_name, source)
                                        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        # vLLM's sleep state (POST /sleep, /wake_up): 1 on the series of the current state, 0 on the others
        sleep_state = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; "
                            "awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; "
                            "discard_all = 1 means sleep level 2.", ["model_name", "sleep_state"], registry=r)
        self._sleep_state = {state: sleep_state.labels(model_name, state) for state in SLEEP_STATES}
        self.record_sleep_state(0)
        self._engine_totals = (0, 0, 0)  # prefix queries, prefix hits, preemptions, as last reported
        self._tracked: dict[str, _Tracked] = {}
        # plain copies for the periodic stats line (prometheus_client has no public read of a counter)
        self.last_stats: SchedulerStats | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._logged = (0.0, 0, 0, 0, 0, 0, 0.0)  # time, prompt, generation, prefix queries, hits, steps, mask s

    def record_sleep_state(self, level: int) -> None:
        """0: awake; 1 or 2: asleep at that level (vLLM's weights_offloaded, discard_all)."""
        for i, state in enumerate(SLEEP_STATES):
            self._sleep_state[state].set(int(i == level))

    # ---- engine state, once per step ----

    def record_step(self, stats: SchedulerStats) -> None:
        self.last_stats = stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_waiting_by_reason["capacity"].set(stats.num_waiting - stats.num_waiting_deferred)
        self.num_requests_waiting_by_reason["deferred"].set(stats.num_waiting_deferred)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        for metric, new, old in zip((self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions),
                                    totals, self._engine_totals):
            if new > old:
                metric.inc(new - old)
        self._engine_totals = totals
        self.kv_offload.record(stats)
        self.kv_transfer.record(stats)
        spec = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        for metric, new, old in zip((self.spec_num_drafts, self.spec_num_draft_tokens,
                                     self.spec_num_accepted_tokens), spec, self._spec_totals):
            if new > old:
                metric.inc(new - old)
        self._spec_totals = spec
        for pos, new in enumerate(stats.spec_accepted_per_pos):
            old = self._spec_per_pos_totals[pos] if pos < len(self._spec_per_pos_totals) else 0
            if new > old:
                self._spec_per_pos.labels(self._model_name, str(pos)).inc(new - old)
        if stats.spec_accepted_per_pos:
            self._spec_per_pos_totals = list(stats.spec_accepted_per_pos)
        if self._lora_info is not None:
            labels = (str(self.max_loras), ",".join(sorted(stats.waiting_lora_adapters)),
                      ",".join(sorted(stats.running_lora_adapters)))
            if labels != self._lora_info_labels:  # one series, the current one (vLLM keeps every past one too)
                if self._lora_info_labels is not None:
                    self._lora_info.remove(*self._lora_info_labels)
                self._lora_info_labels = labels
            self._lora_info.labels(*labels).set_to_current_time()

    def record_iteration(self, outputs: list[EngineCoreOutput]) -> None:
        """vllm:iteration_tokens_total as vLLM counts it, per step that produced outputs: the new tokens, plus the
        whole prompt (cached part included) of each request whose first output this is. (Not the tokens the step
        computed: a 9-token prompt's prefill and 10 outputs count 19, not 18.)"""
        if not outputs:
            return
        tokens = 0
        for out in outputs:
            tokens += len(out.new_token_ids)
            t = self._tracked.get(out.request_id)
            if t is not None and not t.has_output:
                t.has_output = True
                tokens += t.num_prompt_tokens
        self.iteration_tokens.observe(tokens)

    # ---- per request ----

    def request_added(self, request_id: str, num_prompt_tokens: int, arrival: float,
                      max_tokens: int | None = None, lora_name: str | None = None) -> None:
        """max_tokens: the max_tokens parameter as the engine applies it; None for a pooling request, which has
        none. A sampling request's id is GenerationStream's `{request}-{prompt}-{sample}`: the samples of one prompt
        (all added at once, before any can finish) make its n."""
        parent = request_id.rsplit("-", 1)[0] if max_tokens is not None else None
        self._tracked[request_id] = _Tracked(num_prompt_tokens, arrival, max_tokens=max_tokens, parent=parent,
                                             lora_name=lora_name)
        if parent is not None:
            group = self._parents.setdefault(parent, _Parent(0, 0))
            group.n += 1
            group.unfinished += 1

    def record_output(self, out: EngineCoreOutput, timestamp: float) -> None:
        """One engine output: its new tokens were made at `timestamp` (the end of the step)."""
        t = self._tracked.get(out.request_id)
        if t is None or not out.new_token_ids:
            return
        if not t.num_generated:
            t.first_scheduled = out.first_scheduled_time or t.arrival
            t.first_token = out.first_token_time or timestamp
            self.ttft.observe(max(0.0, t.first_token - t.arrival))
            self.prompt_tokens.inc(t.num_prompt_tokens)
            cached, external = min(out.num_cached_tokens, t.num_prompt_tokens), out.num_external_tokens
            self.prompt_tokens_by_source["local_compute"].inc(t.num_prompt_tokens - cached)
            self.prompt_tokens_by_source["local_cache_hit"].inc(cached - external)
            self.prompt_tokens_by_source["external_kv_transfer"].inc(external)
            self.prompt_tokens_cached.inc(cached)
            self.num_prompt_tokens += t.num_prompt_tokens
        else:
            self.itl.observe(max(0.0, timestamp - t.last_token))
        t.last_token = timestamp
        t.num_generated += len(out.new_token_ids)
        self.generation_tokens.inc(len(out.new_token_ids))
        self.num_generation_tokens += len(out.new_token_ids)

    def request_finished(self, request_id: str, finished_reason: str, finished_time: float) -> None:
        """Called once per request, whoever ended it: the engine (stop token, length), the front end (stop
        string) or the client (abort). Requests that never produced a token count only as finished."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        self._success.labels(self._model_name, finished_reason).inc()
        if t.lora_name is not None and self._lora_requests is not None:
            self._lora_requests.labels(self._model_name, t.lora_name, finished_reason).inc()
        if t.max_tokens:
            self.request_params_max_tokens.observe(t.max_tokens)
        group = self._parents.get(t.parent) if t.parent is not None else _Parent(1, 1)
        if group is not None:
            group.unfinished -= 1
            group.max_generated = max(group.max_generated, t.num_generated)
            if not group.unfinished:
                self._parents.pop(t.parent, None)
                self.request_params_n.observe(group.n)
                self.request_max_num_generation_tokens.observe(group.max_generated)
        if not t.num_generated:
            return
        end = max(finished_time, t.last_token)
        self.e2e.observe(end - t.arrival)
        self.queue_time.observe(max(0.0, t.first_scheduled - t.arrival))
        self.inference_time.observe(max(0.0, end - t.first_scheduled))
        self.prefill_time.observe(max(0.0, t.first_token - t.first_scheduled))
        self.decode_time.observe(max(0.0, t.last_token - t.first_token))
        self.request_prompt_tokens.observe(t.num_prompt_tokens)
        self.request_generation_tokens.observe(t.num_generated)
        if t.num_generated > 1:
            per_token = (t.last_token - t.first_token) / (t.num_generated - 1)
            self.tpot.observe(per_token)
            self.request_tpot.observe(per_token)

    def stats_line(self, now: float) -> str | None:
        """vLLM's periodic log line: throughput since the last line, queue, KV usage, prefix-cache hit rate.
        None when nothing happened since the last line (an idle server stays quiet)."""
        last_time, last_prompt, last_gen, last_queries, last_hits, last_steps, last_mask = self._logged
        s = self.last_stats
        queries, hits = (s.prefix_cache_queries, s.prefix_cache_hits) if s else (0, 0)
        steps, mask = (s.num_steps, s.grammar_mask_time_s) if s else (0, 0.0)
        self._logged = (now, self.num_prompt_tokens, self.num_generation_tokens, queries, hits, steps, mask)
        if not last_time:
            return None
        prompt, gen = self.num_prompt_tokens - last_prompt, self.num_generation_tokens - last_gen
        if not (prompt or gen or (s and (s.num_running or s.num_waiting))):
            return None
        elapsed = max(now - last_time, 1e-9)
        hit_rate = (hits - last_hits) / (queries - last_queries) if queries > last_queries else 0.0
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{gen / elapsed:.1f} tokens/s, Running: {s.num_running if s else 0} reqs, Waiting: "
                f"{s.num_waiting if s else 0} reqs, KV cache usage: {100 * (s.kv_cache_usage if s else 0):.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
        if mask > last_mask and steps > last_steps:
            line += f", Grammar mask time: {1000 * (mask - last_mask) / (steps - last_steps):.2f} ms/step"
        drafts, draft_tokens, accepted = (d - last for d, last in zip(self._spec_totals, self._spec_logged))
        self._spec_logged = self._spec_totals
        if drafts > 0:  # vLLM's SpecDecoding figures: accepted drafts + the bonus token per verification
            line += (f", Spec decode: mean acceptance length {1 + accepted / drafts:.2f}, draft acceptance rate "
                     f"{100 * accepted / max(draft_tokens, 1):.1f}%")
        return line

    def render(self) -> bytes:
        return generate_latest(self.registry)
