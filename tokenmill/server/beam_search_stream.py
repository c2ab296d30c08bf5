"""`use_beam_search` in the API server: beam searches (tokenmill/beam_search.py, one per prompt) behind a
GenerationStream's interface, so that the endpoints collect and stream them with their usual code.

Each step is a GenerationStream of one-token requests, one per live beam of every prompt, submitted in one message
(so the engine runs them as one batch) and sharing their prefixes' KV blocks through the prefix cache. The stream
yields once, when every search is done: one SampleDelta per returned beam, best first (choice index = prompt index
* n + rank), carrying the whole text. That is what vLLM does too: its beam search yields only the final output, so
a streaming chat gets each beam in one chunk."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.beam_search import BeamSearch, BeamSearchParams, advance_all, live_beams
from tokenmill.logprobs import TokenLogprobs
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.generation_stream import GenerationStream, SampleDelta

if TYPE_CHECKING:
    from tokenmill.server.engine_client import EngineClient


class BeamSearchStream:
    def __init__(self, client: EngineClient, request_id: str, prompts: list[list[int]],
                 params: list[BeamSearchParams], tokenizer, priority: int = 0, num_logprobs: int | None = None,
                 skip_special_tokens: bool = True, lora_request: LoRARequest | None = None):
        """params: each prompt's (their max_tokens may differ); num_logprobs: the top logprobs the client asked for
        per token (None: no logprobs)."""
        self.client = client
        self.request_id = request_id
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.priority = priority
        self.skip_special_tokens = skip_special_tokens
        self.lora_request = lora_request  # every step's requests run with this adapter
        self.searches = [BeamSearch(ids, bp, tokenizer.eos_token_id) for ids, bp in zip(prompts, params)]
        width = params[0].beam_width
        # What the endpoints read of a stream's params: n (choices per prompt) and whether logprobs are rendered.
        self.params = SamplingParams(n=width, max_tokens=max(bp.max_tokens for bp in params), logprobs=num_logprobs)
        self.step_params = params[0].step_params(num_logprobs or 0)
        self.trace = None  # no tracing of beam searches
        self.on_close: Callable[[BeamSearchStream], None] | None = None
        self.num_cached_tokens = 0  # the prompts' prefix-cache hits, as the first step found them
        self._step: GenerationStream | None = None
        self._finished = False

    def __enter__(self) -> BeamSearchStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Aborts the step in flight (a client that went away frees its KV blocks at once)."""
        step, self._step = self._step, None
        if step is not None:
            step.close()

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> list[SampleDelta]:
        if self._finished:
            raise StopAsyncIteration
        num_steps = 0
        while not all(s.done for s in self.searches):
            prompts = live_beams(self.searches)
            results: list[TokenLogprobs | None] = [None] * len(prompts)
            step = self._step = self.client.generate(f"{self.request_id}-step{num_steps}", prompts, self.step_params,
                                                     self.tokenizer, self.priority, self.lora_request)
            with step:
                async for deltas in step:
                    for d in deltas:
                        if d.logprobs:
                            results[d.index] = d.logprobs[0]
            self._step = None
            if num_steps == 0:
                self.num_cached_tokens = getattr(step, "num_cached_tokens", 0)
            advance_all(self.searches, results)
            num_steps += 1
        self._finished = True
        return [delta for p, search in enumerate(self.searches) for delta in self._deltas(p, search)]

    def _deltas(self, prompt_index: int, search: BeamSearch) -> list[SampleDelta]:
        """Each returned beam as vLLM's online beam search gives it: the EOS is not in the text, and in token_ids
        only with include_stop_str_in_output; stop_reason is the EOS id."""
        deltas = []
        for rank, beam in enumerate(search.best()):
            generated = beam.tokens[search.prompt_len:]
            eos = beam.finish_reason == "stop"
            token_ids = generated[:-1] if eos and not search.params.include_stop_str_in_output else generated
            text = self.tokenizer.decode(generated[:-1] if eos else generated,
                                         skip_special_tokens=self.skip_special_tokens)
            logprobs = None
            if self.params.logprobs is not None:
                k = self.params.logprobs
                logprobs = [TokenLogprobs(e.token_id, e.logprob, e.rank, e.top_token_ids[:k], e.top_logprobs[:k])
                            for e in beam.logprobs[:len(token_ids)]]
            deltas.append(SampleDelta(prompt_index * self.params.n + rank, text, token_ids, logprobs, None,
                                      beam.finish_reason, beam.stop_reason))
        return deltas
