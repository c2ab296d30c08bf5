"""The samples of one API request, as the server reads them: a GenerationStream.

A passive collector (as vLLM's RequestOutputCollector): EngineClient.generate registers and submits the request's
engine requests (n samples per prompt) and puts their outputs on the stream's queue; the stream detokenizes
them, applies stop strings and yields per-sample deltas. The one thing it does to the engine is through the
`abort` callable it is handed: a stop string that matched ends its sample, and leaving its `with` block (or
close(), for a response that never started reading it) aborts whatever still runs, so a client that goes away
frees its KV blocks at once; fail() does the same for a stream the server gives up on (its engine died, or its
client stopped reading)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.api.errors import EngineDeadError, RequestAborted, StreamStalled
from tokenmill.api.tracing import RequestTrace
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreOutput, RequestError
from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.logprobs import TokenLogprobs
from tokenmill.sampling_params import ParamError, SamplingParams, child_params


@dataclass
class SampleDelta:
    """What one sample (one choice) gained since the last delta."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class _Sample:
    index: int
    engine_request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # its prompt's prefix-cache hit, known once the engine scheduled it


@dataclass
class GenerationStream:
    """The samples of one API request; choice index = prompt index * n + sample index. `abort(engine request ids,
    finished reason)` stops samples in the engine (EngineClient.abort)."""
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    tokenizer: object
    abort: Callable[[list[str], str], None]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    samples: dict[str, _Sample] = field(default_factory=dict)
    unfinished: set[str] = field(default_factory=set)
    trace: RequestTrace | None = None  # filled in as outputs arrive; handed to on_close
    on_close: Callable[[GenerationStream], None] | None = None
    last_read: float = field(default_factory=time.monotonic)  # when the reader last asked for output
    error: Exception | None = None  # set by fail(): raised to the reader
    closed: bool = False
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's answer (engine/kv_transfer.py)
    # --stream-interval / stream_interval (SGLang's and vLLM's): after the first, a delta waits until some sample has
    # this many new tokens (or one finished), so a stream sends fewer, larger chunks
    stream_interval: int = 1
    _sent: bool = False  # a delta went out: the first one waits for nothing

    def __post_init__(self):
        n = self.params.n
        for p, prompt in enumerate(self.prompts):
            for i in range(n):
                params = child_params(self.params, i)
                engine_id = f"{self.request_id}-{p}-{i}"
                detokenizer = IncrementalDetokenizer(self.tokenizer, params, prompt)
                self.samples[engine_id] = _Sample(p * n + i, engine_id, params, detokenizer)
        self.unfinished.update(self.samples)

    def engine_requests(self) -> list[tuple[str, list[int], SamplingParams]]:
        """(engine request id, prompt, params) of each sample, for EngineClient to submit."""
        return [(engine_id, self.prompts[sample.index // self.params.n], sample.params)
                for engine_id, sample in self.samples.items()]

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Aborts the samples still running in the engine; the client stops watching a closed stream."""
        self.closed = True
        if self.unfinished:
            self.abort(sorted(self.unfinished), "abort")
            self.unfinished.clear()
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self)

    def __aiter__(self) -> GenerationStream:
        return self

    @property
    def num_cached_tokens(self) -> int:
        """usage.prompt_tokens_details.cached_tokens: each prompt's hit, as its first sample found it."""
        return sum(s.num_cached_tokens for s in self.samples.values() if s.index % self.params.n == 0)

    def fail(self, error: Exception) -> None:
        """Ends the stream: aborts its engine requests now, and its reader gets `error`."""
        self.error = error
        self.close()
        self.queue.put_nowait(error)  # wakes a reader waiting for output

    async def __anext__(self) -> list[SampleDelta]:
        """The deltas of all samples that moved since the last call (several engine steps if we fell behind)."""
        self.last_read = time.monotonic()
        if self.error is not None:
            raise self.error
        if not self.unfinished:
            raise StopAsyncIteration
        deltas: dict[str, SampleDelta] = {}
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in items:
                if isinstance(item, (EngineDeadError, StreamStalled, RequestAborted)):
                    self.unfinished.clear()
                    raise item
                if isinstance(item, RequestError):
                    self.close()
                    raise ParamError(item.message, item.param)
                if item.request_id in self.unfinished:
                    self._apply(item, deltas)
            if self._due(deltas):
                break
        self._sent = True
        for engine_id, delta in deltas.items():
            sample = self.samples[engine_id]
            delta.text = sample.detokenizer.delta(delta.finish_reason is not None)
        return sorted(deltas.values(), key=lambda d: d.index)

    def _due(self, deltas: dict[str, SampleDelta]) -> bool:
        if self.stream_interval <= 1 or not self._sent or not self.unfinished:
            return True
        return any(d.finish_reason is not None or len(d.token_ids) >= self.stream_interval for d in deltas.values())

    def _apply(self, out: EngineCoreOutput, deltas: dict[str, SampleDelta]) -> None:
        sample = self.samples[out.request_id]
        if self.trace is not None:
            self._time(out)
        delta = deltas.get(out.request_id)
        if delta is None:
            delta = deltas[out.request_id] = SampleDelta(sample.index, "", [], None, None, None)
        delta.token_ids.extend(out.new_token_ids)
        sample.num_tokens += len(out.new_token_ids)
        sample.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.logprobs:
            delta.logprobs = (delta.logprobs or []) + list(out.logprobs)
        if out.prompt_logprobs:
            delta.prompt_logprobs = (delta.prompt_logprobs or []) + list(out.prompt_logprobs)
        finish, stop_reason = sample.detokenizer.finish(out.new_token_ids, out.finish_reason,
                                                         sample.params.stop_token_ids)
        if finish is None:
            return
        if out.finish_reason is None:
            self.abort([out.request_id], finish)
        self.unfinished.discard(out.request_id)
        sample.finish_reason = delta.finish_reason = finish
        sample.stop_reason = stop_reason
        delta.stop_reason = sample.stop_reason

    def _time(self, out: EngineCoreOutput) -> None:
        """The request's span covers all its samples: earliest arrival, scheduling and first token, last finish."""
        t = self.trace
        for name, value in (("arrival", out.arrival_time), ("first_scheduled", out.first_scheduled_time),
                            ("first_token", out.first_token_time)):
            if value and (not getattr(t, name) or value < getattr(t, name)):
                setattr(t, name, value)
        t.finished = max(t.finished, out.finished_time or time.monotonic())
