"""The messages that cross the engine process boundary, and the request checks both sides apply.

Two ZMQ PUSH/PULL sockets over ipc:// carry msgpack (msgspec, the typed Structs below):
  API server → engine: AddRequest | AddRequests | AbortRequests | StatsQuery | AddLoRA | RemoveLoRA |
  ResetPrefixCache | Sleep | WakeUp | Profile | Shutdown
  engine → API server: EngineReady | EngineStartupFailed (once), then EngineCoreOutputs (one per step)

This module imports no torch (nor anything that does): the API server process, the router and the benchmarks
import it to speak to an engine without loading a deep-learning framework."""
from __future__ import annotations

import msgspec

from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.logprobs import TokenLogprobs
from tokenmill.lora.request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import ParamError, SamplingParams


# ---- API server → engine ----

class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    priority: int
    arrival_time: float  # time.monotonic(): one clock for all processes of a machine
    pooling: PoolingParams | None = None  # set: embed the prompt (params is then unused), no generation
    lora_request: LoRARequest | None = None  # the adapter it runs with (tokenmill/lora/); None: the base model


class AddRequests(msgspec.Struct, tag="add_many", array_like=True):
    """Requests that must start in the same step (the n samples of a request, one beam-search step's beams): one
    message, so the engine's non-blocking drain sees all of them or none."""
    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class StatsQuery(msgspec.Struct, tag="stats", array_like=True):
    query_id: int


class AddLoRA(msgspec.Struct, tag="add_lora", array_like=True):
    """Load an adapter into the engine's CPU cache now (the API's load_lora_adapter); answered by a ControlReply."""
    query_id: int
    lora_request: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora", array_like=True):
    """Unload an adapter once its requests have finished (unload_lora_adapter); answered by a ControlReply."""
    query_id: int
    lora_int_id: int


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached prefix block (vLLM's POST /reset_prefix_cache); answered by a StatsReply."""
    query_id: int


class Sleep(msgspec.Struct, tag="sleep", array_like=True):
    """Free memory (vLLM's POST /sleep, --enable-sleep-mode): level 1 the KV pool and the caches built from the
    weights, level 2 the weights too. mode "wait": the engine first finishes the requests it has (admitting no
    others meanwhile is the API server's part); "abort": it aborts them (the API server has failed their streams
    already). Answered by a SleepReply once asleep."""
    query_id: int
    level: int = 1
    mode: str = "abort"


class WakeUp(msgspec.Struct, tag="wake_up", array_like=True):
    """Restore what Sleep freed (vLLM's POST /wake_up): the parts named in tags ("weights", "kv_cache"), or both
    when None. Answered by a SleepReply."""
    query_id: int
    tags: list[str] | None = None


class Profile(msgspec.Struct, tag="profile", array_like=True):
    """Start (or stop) torch's profiler in the engine process (vLLM's POST /start_profile, /stop_profile, with
    VLLM_TORCH_PROFILER_DIR); answered by a ControlReply."""
    query_id: int
    start: bool


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """End the engine process now (the API server stops): it ignores SIGTERM, which a process group gets all at
    once, so that only the API server, once it has drained its requests, decides when the engine ends."""


EngineInput = (AddRequest | AddRequests | AbortRequests | StatsQuery | AddLoRA | RemoveLoRA | ResetPrefixCache | Sleep
               | WakeUp | Profile | Shutdown)


# ---- engine → API server ----

class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)
    num_cached_tokens: int = 0
    # monotonic timestamps, for the front end's timings and metrics
    arrival_time: float = 0.0
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    pooled: list[float] | None = None  # a pooling request's vector, in its one (finishing) output
    num_external_tokens: int = 0  # of num_cached_tokens, those loaded from the tier beyond the pool
    # a prefill instance's finished do_remote_decode request: where a decode instance fetches its blocks
    kv_transfer_params: KVTransferParams | None = None


class OffloadStats(msgspec.Struct, array_like=True):
    """The tiers beyond the pool (engine/kv_offload.py): cumulative counters, per-medium state, and the loads'
    latencies since the last report."""
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    saves_skipped: int = 0
    blocks_rejected: dict[str, int] = msgspec.field(default_factory=dict)  # reason → blocks
    store_errors: dict[str, int] = msgspec.field(default_factory=dict)  # medium → failed calls
    occupancy_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # medium → bytes held
    capacity_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # medium → cap (0: the store's own)
    healthy: dict[str, bool] = msgspec.field(default_factory=dict)
    load_seconds: list[float] = msgspec.field(default_factory=list)
    num_loading: int = 0  # requests waiting for their blocks


class KVTransferStats(msgspec.Struct, array_like=True):
    """Disaggregated prefill/decode (engine/kv_transfer.py), cumulative: the prefill side's pinned blocks and what
    it sent, the decode side's fetches (blocks fetched, blocks its prefix cache already held, failures by reason)
    and the fetches' latencies since the last report."""
    pinned_blocks: int = 0
    pinned_requests: int = 0
    pins_expired: int = 0  # requests whose blocks no decode instance fetched within abort_request_timeout
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_fetched: int = 0
    blocks_skipped: int = 0
    bytes_received: int = 0
    fetch_failures: dict[str, int] = msgspec.field(default_factory=dict)  # reason → fetches
    fetch_seconds: list[float] = msgspec.field(default_factory=list)
    tokens_fetched: list[int] = msgspec.field(default_factory=list)  # per fetch, with fetch_seconds
    fetch_phase_seconds: dict[str, float] = msgspec.field(default_factory=dict)  # TransferCounters.phase_seconds


class SchedulerStats(msgspec.Struct, array_like=True):
    """The engine's state after a step; counters are cumulative since start, so a lost message loses nothing."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    step_tokens: int = 0  # tokens this step computed (prompt and generated), for the step profile
    num_steps: int = 0
    grammar_mask_time_s: float = 0.0  # spent filling structured-output bitmasks
    num_waiting_deferred: int = 0  # of num_waiting: held back while their grammar compiles (vLLM's "deferred")
    # speculative decoding (vLLM's spec_decode counters): verification steps with drafts, drafts, accepted
    # drafts, and accepted drafts by position (index 0: the first draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # LoRA (vLLM's names): adapter name → its requests running / waiting
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    # the tiers beyond the pool: vLLM's external prefix cache counters (tokens), and tokenmill's own
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload: OffloadStats | None = None
    kv_transfer: KVTransferStats | None = None


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    scheduling_policy: str
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    runner: str = "generate"  # or "pooling": which endpoints the server may take (the other kind is a 400)
    matryoshka: bool = False  # whether a pooling request may ask for fewer `dimensions`
    cache_dtype: str = "auto"  # --kv-cache-dtype, for vllm:cache_config_info
    max_loras: int = 0  # --max-loras with --enable-lora; 0: the engine serves no adapters


class EngineStartupFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class RequestError(msgspec.Struct, array_like=True):
    """add_request refused a request (normally the API server has validated it already)."""
    request_id: str
    message: str
    param: str | None = None


class StatsReply(msgspec.Struct, array_like=True):
    query_id: int
    stats: SchedulerStats


class ControlReply(msgspec.Struct, array_like=True):
    """AddLoRA, RemoveLoRA or Profile done (error None), or why not; not_found: no adapter at the path (vLLM's
    404)."""
    query_id: int
    error: str | None = None
    not_found: bool = False


class SleepReply(msgspec.Struct, array_like=True):
    """A Sleep or WakeUp done (error None), or why not; the engine's sleep state after it: level 0 when awake,
    else the level it slept at, and the parts still asleep ("weights", "kv_cache")."""
    query_id: int
    level: int
    asleep: list[str]
    stats: SchedulerStats
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    errors: list[RequestError] = []
    stats: list[StatsReply] = []
    timestamp: float = 0.0  # time.monotonic() when the step ended: the time of every token in `outputs`
    scheduler_stats: SchedulerStats | None = None  # after a step; None when no step ran
    control_replies: list[ControlReply] = []
    sleep_replies: list[SleepReply] = []


EngineMessage = EngineReady | EngineStartupFailed | EngineCoreOutputs


def validate_request(prompt_token_ids: list[int], params: SamplingParams, priority: int, max_model_len: int,
                     max_logprobs: int, vocab_size: int, scheduling_policy: str,
                     kv_capacity_tokens: int | None = None, reasoning: bool = False) -> int:
    """Raises ParamError if the engine cannot take the request; returns its max_tokens. The API server calls
    it too, so that it can answer 400 before streaming starts."""
    if not prompt_token_ids:
        raise ParamError("the prompt is empty", "prompt")
    n_prompt = len(prompt_token_ids)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n_prompt
    if n_prompt + max_tokens > max_model_len:
        raise ParamError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} "
                         "in the completion). Please reduce the length of the messages or completion.",
                         "max_tokens" if params.max_tokens is not None else "messages")
    if kv_capacity_tokens is not None and n_prompt + max_tokens > kv_capacity_tokens:
        # Admitting it would stall the queue forever: the pool could never hold it, even empty.
        raise ParamError(f"The request needs {n_prompt + max_tokens} tokens of KV cache ({n_prompt} in the prompt, "
                         f"{max_tokens} to generate), more than the whole KV cache holds ({kv_capacity_tokens} "
                         "tokens). Lower max_tokens or shorten the prompt.",
                         "max_tokens" if params.max_tokens is not None else "prompt")
    if max_tokens < 1:
        raise ParamError(f"the prompt ({n_prompt} tokens) leaves no room to generate within "
                         f"max_model_len={max_model_len}", "prompt")
    limit = vocab_size if max_logprobs == -1 else max_logprobs  # --max-logprobs -1: the whole vocabulary (vLLM)
    for kind, param, num in (("sample", "logprobs", params.logprobs), ("prompt", "prompt_logprobs",
                                                                      params.prompt_logprobs)):
        if (num or 0) > limit:
            raise ParamError(f"Requested {kind} logprobs of {num}, which is greater than max allowed: {limit}", param)
    for param, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", list(params.logit_bias or ())),
                       ("allowed_token_ids", params.allowed_token_ids or ()),
                       ("bad_words", [t for w in params.bad_words_token_ids or () for t in w])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ParamError(f"token id {bad[0]} is out of vocabulary (size {vocab_size})", param)
    if params.bad_words and params.bad_words_token_ids is None:  # the front end's part (sampling_params.py)
        raise ParamError("bad_words reached the engine untokenized: fill bad_words_token_ids", "bad_words")
    if params.thinking_token_budget is not None and not reasoning:
        raise ParamError("thinking_token_budget needs a reasoning model: start with --reasoning-parser (or "
                         "--think-start-str/--think-end-str)", "thinking_token_budget")
    kv = params.kv_transfer_params
    if kv is not None:
        problem = kv.problem()
        if problem is None and kv.active and params.n != 1:
            problem = "one sample per request (n=1): the blocks of one prompt go to one decode"
        if problem is not None:
            raise ParamError(f"kv_transfer_params: {problem}", "kv_transfer_params")
    if scheduling_policy == "fcfs" and priority != 0:
        raise ParamError("priority is only allowed with --scheduling-policy priority", "priority")
    return max_tokens
