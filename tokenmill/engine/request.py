"""The engine's view of one request: its tokens, progress, KV blocks and timings."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: int | None, max_tokens: int, priority: int = 0,
                 extra_keys: tuple = (), arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # all_token_ids is what the KV cache holds: prompt + output, recomputed as one prompt after preemption.
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        # the ids that end this generation unless ignore_eos: the EOS and the model's others (ModelInfo)
        self.eos_token_ids = frozenset() if eos_token_id is None else frozenset([eos_token_id])
        self.max_tokens = max_tokens
        self.priority = priority
        self.extra_keys = extra_keys  # e.g. LoRA id or cache_salt: enters every block hash
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling (the tier's blocks included)
        self.num_external_tokens = 0  # of those, tokens loaded from the tier beyond the pool (kv_offload.py)
        self.kv_loaded = False  # the tier was asked for its prefix since its last (re)admission
        # disaggregated prefill/decode (engine/kv_transfer.py): on a decode instance, the prefill instance's blocks
        # still to fetch; on a prefill instance, where its pinned blocks are, for its last output
        kv = params.kv_transfer_params
        self.kv_remote = kv if kv is not None and kv.do_remote_prefill else None
        self.kv_transfer_out = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.times = RequestTimes()
        if arrival_time is not None:
            self.times.arrival = arrival_time
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.logprobs: list[dict] = []  # per output token, when params.logprobs is set
        self.prompt_logprobs: list[dict | None] = []
        self.num_prompt_logprobs = 0  # prompt logprob entries returned so far (kept across preemptions)
        self.thinking = None  # a ThinkingTracker, for reasoning requests with a thinking budget or a grammar
        self.pooling = None  # PoolingParams: embedded in one step, never decoded
        self.lora_request = None  # a LoRARequest: the adapter it runs with (tokenmill/lora/); None: the base model
        # Speculative decoding: the drafts scheduled after the last token this step (spec_decode/), the
        # distributions they were drawn from when a draft model sampled them ([k, V]; None: deterministic
        # drafts), and a seeded request's generator state before verification drew its uniforms.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs = None
        self.spec_generator_state = None

    @property
    def is_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.thinking

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.times.arrival)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
