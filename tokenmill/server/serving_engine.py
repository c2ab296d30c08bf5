"""What completions and chat share: request fields → SamplingParams, validation, starting the engine requests,
collecting a non-streaming response, usage, and the request's trace. One subclass per endpoint family."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api import protocol as p
from tokenmill.api.errors import sse_error_event
from tokenmill.api.tracing import RequestTrace
from tokenmill.beam_search import BeamSearchParams, check_beam_width
from tokenmill.config import kv_transfer_refusal
from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.logprobs import TokenLogprobs
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import ParamError, SamplingParams, StructuredOutputsParams, bad_words_token_ids
from tokenmill.server.beam_search_stream import BeamSearchStream
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import DONE, ClientDisconnected, EventStreamResponse, until_disconnected
from tokenmill.server.server_state import ServerState

logger = logging.getLogger("tokenmill.server")


@dataclass
class CollectedChoice:
    """A choice being accumulated for a non-streaming response."""
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


# vLLM's stand-in for -inf in logprobs (JSON has no infinity)
MIN_LOGPROB = -9999.0


# response_format's fields by type; any other given is a 400 (never ignored)
FORMAT_FIELDS = {"json_schema": ("json_schema",), "structural_tag": ("format", "structures", "triggers")}


def structural_tag_text(fmt: p.ResponseFormat) -> str:
    """response_format's structural_tag as the JSON text the compiler takes: `format` (xgrammar's form) or
    `structures` with `triggers` (vLLM's legacy form), exactly one of them."""
    legacy = fmt.structures is not None or fmt.triggers is not None
    if (fmt.format is not None) == legacy:
        raise ParamError("response_format structural_tag takes either format, or structures with triggers",
                         "response_format")
    if fmt.format is not None:
        return json.dumps({"type": "structural_tag", "format": fmt.format})
    if not fmt.structures or not fmt.triggers:
        raise ParamError("response_format structural_tag needs non-empty structures and triggers", "response_format")
    return json.dumps({"structures": [s.model_dump(by_alias=True) for s in fmt.structures],
                       "triggers": fmt.triggers})


class OpenAIServing:
    """The base of the per-endpoint serving classes."""

    def __init__(self, state: ServerState):
        self.state = state

    def sampling_params(self, req: p.SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        max_n = self.state.config.max_n
        if req.n > max_n:
            raise ParamError(f"n must be at most {max_n}, got {req.n}", "n")
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError as e:
                raise ParamError("logit_bias keys must be token ids", "logit_bias") from e
            bad = [t for t in logit_bias if not 0 <= t < self.state.engine.vocab_size]
            if bad:
                raise ParamError(f"logit_bias token id {bad[0]} is out of vocabulary", "logit_bias")
            if any(not -100 <= v <= 100 for v in logit_bias.values()):
                raise ParamError("logit_bias values must be in [-100, 100]", "logit_bias")
        vocab = self.state.engine.vocab_size
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"stop_token_ids: token id {bad[0]} is out of vocabulary (size {vocab})",
                             "stop_token_ids")
        defaults = self.state.generation_defaults  # --generation-config: the model's, for fields left unset

        def given(name: str, vllm_default):
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, vllm_default)

        if "max_tokens" in defaults:  # vLLM's rule: the model's max_new_tokens bounds every request
            max_tokens = min(max_tokens or defaults["max_tokens"], defaults["max_tokens"])
        top_k = given("top_k", 0)
        if top_k >= vocab:  # keeps every token, as no top-k at all does
            top_k = 0
        structured = self.structured_outputs(req)
        if tool_constraint is not None:
            if structured is not None:
                raise ParamError("tool_choice required or a named function cannot be combined with another "
                                 "structured-output constraint", "tool_choice")
            try:
                self.state.grammar_compiler.compile(tool_constraint)
            except ParamError as e:  # the schema came from a tool's parameters
                raise ParamError(f"{e} (in the tools' parameters)", "tools") from None
            structured = tool_constraint
        return SamplingParams(
            kv_transfer_params=self.kv_transfer_params(req),
            structured_outputs=structured, thinking_token_budget=req.thinking_token_budget,
            n=req.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=top_k,
            min_p=given("min_p", 0.0), presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias=logit_bias, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None, cache_salt=req.cache_salt,
            bad_words_token_ids=bad_words_token_ids(self.state.tokenizer, req.bad_words) if req.bad_words else None)

    def kv_transfer_params(self, req: p.SamplingFields) -> KVTransferParams | None:
        """The request's kv_transfer_params (disaggregated prefill/decode), if this instance can serve them: its
        --kv-transfer-config role, one sample, and for a prefill a whole response (the params are in its body)."""
        field_ = req.kv_transfer_params
        if field_ is None:
            return None
        kv = KVTransferParams(**field_.model_dump())
        if not kv.active:
            return None
        engine_config = getattr(self.state.client, "config", None)
        problem = kv.problem() or kv_transfer_refusal(getattr(engine_config, "kv_transfer_config", None), kv)
        if problem is None and kv.do_remote_decode and req.stream:
            problem = "do_remote_decode answers with the decode instance's params in a whole response: stream false"
        if problem is not None:
            raise ParamError(f"kv_transfer_params: {problem}", "kv_transfer_params")
        return kv

    def num_logprobs(self, value: int | None, param: str) -> int | None:
        """vLLM's rule for logprobs, top_logprobs and prompt_logprobs: -1 is the whole vocabulary, and no more than
        --max-logprobs may be asked for (-1 there too: the vocabulary)."""
        if value is None:
            return None
        vocab, limit = self.state.engine.vocab_size, self.state.engine.max_logprobs
        limit = vocab if limit == -1 else limit
        num = vocab if value == -1 else value
        if num > limit:
            kind = "prompt" if param == "prompt_logprobs" else "sample"
            raise ParamError(f"Requested {kind} logprobs of {num}, which is greater than max allowed: {limit}", param)
        return num

    def truncate(self, prompts: list[list[int]], req: p.SamplingFields) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens: keep the last k tokens of each prompt (-1: the context's length), or the
        first k with truncation_side "right"."""
        k = req.truncate_prompt_tokens
        if k is None:
            return prompts
        k = self.state.engine.max_model_len if k == -1 else k
        if req.truncation_side == "right":
            return [ids[:k] for ids in prompts]
        return [ids[len(ids) - min(k, len(ids)):] for ids in prompts]

    def tokens_as_ids(self, req: p.SamplingFields) -> bool:
        """Whether logprob tokens read "token_id:N": the request's return_tokens_as_token_ids, else the flag."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.state.config.return_tokens_as_token_ids

    def logprob_token(self, token_id: int, as_ids: bool, context: Sequence[int] = ()) -> str:
        """context: the tokens before this position (ServerState.token_str)."""
        return f"token_id:{token_id}" if as_ids else self.state.token_str(token_id, context)

    def stream_usage(self, req: p.SamplingFields) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk), as vLLM decides them: --enable-force-include-usage gives
        both; otherwise stream_options.include_usage, and continuous_usage_stats only along with it."""
        if self.state.config.enable_force_include_usage:
            return True, True
        so = req.stream_options
        include = bool(so and so.include_usage)
        return include, include and bool(so.continuous_usage_stats)

    def prompt_logprobs(self, prompt_ids: list[int], entries: list[TokenLogprobs | None]) -> p.PromptLogprobs:
        """vLLM's prompt_logprobs: per prompt token (null for the first) a map from token id to its logprob, rank
        and text, holding the prompt's token and then the top alternatives."""
        entries = entries[-len(prompt_ids):]
        entries = [None] * (len(prompt_ids) - len(entries)) + entries
        out: p.PromptLogprobs = []
        for i, e in enumerate(entries):
            if e is None:
                out.append(None)
                continue
            before = prompt_ids[max(0, i - 4):i]
            lps = {e.token_id: p.PromptLogprob(max(e.logprob, MIN_LOGPROB), e.rank,
                                               self.state.token_str(e.token_id, before))}
            for rank, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), 1):
                lps[t] = p.PromptLogprob(max(lp, MIN_LOGPROB), rank, self.state.token_str(t, before))
            out.append(lps)
        return out

    def structured_outputs(self, req: p.SamplingFields) -> StructuredOutputsParams | None:
        """The request's constraint, from whichever field carries it; compiled here first, so that an invalid
        schema, regex or grammar is a 400 quoting the compiler (and the engine finds it in the cache)."""
        specs = []
        fmt = req.response_format
        if fmt is not None:
            stray = [name for name in ("json_schema", "format", "structures", "triggers")
                     if getattr(fmt, name) is not None and name not in FORMAT_FIELDS.get(fmt.type, ())]
            if stray:
                raise ParamError(f"response_format of type {fmt.type} does not take {', '.join(stray)}",
                                 "response_format")
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                specs.append(StructuredOutputsParams(json_object=True))
            elif fmt.type == "structural_tag":
                specs.append(StructuredOutputsParams(structural_tag=structural_tag_text(fmt)))
            else:  # json_schema: the only other type the request model admits
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise ParamError("response_format json_schema needs json_schema.schema", "response_format")
                specs.append(StructuredOutputsParams(json=fmt.json_schema.schema_))
        for name, field_name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                                 ("grammar", "guided_grammar")):
            if getattr(req, field_name) is not None:
                specs.append(StructuredOutputsParams(**{name: getattr(req, field_name)}))
        so = req.structured_outputs
        if so is not None:
            specs.append(StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                                 choice=so.choice, grammar=so.grammar,
                                                 structural_tag=so.structural_tag))
        if not specs:
            return None
        if len(specs) > 1:
            raise ParamError("give one structured-output constraint: response_format, guided_json, guided_regex, "
                             "guided_choice, guided_grammar or structured_outputs", "response_format")
        self.state.grammar_compiler.compile(specs[0])
        return specs[0]

    def start(self, request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int,
              raw: Request, operation: str, lora_request: LoRARequest | None = None,
              user: str | None = None, stream_interval: int | None = None) -> GenerationStream:
        """Validates every prompt first, so that a bad one fails the request before anything reaches the engine.
        lora_request: the adapter the request's model names (ServerState.check_model). user: OpenAI's end-user id,
        on the log line and the trace span, so that an operator can find one user's requests (abuse monitoring)."""
        state = self.state
        state.client.check_alive()
        if params.kv_transfer_params is not None and len(prompts) > 1:
            raise ParamError("kv_transfer_params: one prompt per request (the blocks of one prompt go to one decode)",
                             "kv_transfer_params")
        for ids in prompts:
            state.validate(ids, params, priority)
        state.check_queue([ids for ids in prompts for _ in range(params.n)])
        if state.config.enable_log_requests:
            logger.info("Received request %s: %d prompt(s) of %s tokens, params: %s, lora: %s, user: %s", request_id,
                        len(prompts), [len(ids) for ids in prompts], params,
                        lora_request.lora_name if lora_request else None, user)
        # submitted in the same event-loop turn as the check (EngineClient.generate)
        stream = state.client.generate(request_id, prompts, params, state.tokenizer, priority, lora_request)
        stream.stream_interval = stream_interval or state.config.stream_interval
        if state.tracer is not None:
            stream.trace = RequestTrace(
                request_id, operation, state.served_model_name(lora_request), dict(raw.headers), params.max_tokens,
                params.temperature, params.top_p, params.n, input_tokens=sum(len(ids) for ids in prompts), user=user)
            if state.tracer.include_text:
                stream.trace.prompt_text = "".join(state.tokenizer.decode(ids) for ids in prompts)
        if state.tracer is not None or state.config.enable_log_outputs:
            stream.on_close = self._ended
        return stream

    def _ended(self, stream: GenerationStream) -> None:
        """A stream's end: its output logged (--enable-log-outputs) and its trace recorded (tracing on)."""
        if self.state.config.enable_log_outputs:
            self._log_outputs(stream)
        if stream.trace is not None:
            self._record_trace(stream)

    def _log_outputs(self, stream: GenerationStream) -> None:
        """--enable-log-outputs: each sample's text (cut to --max-log-len), its token count and finish reason."""
        limit = self.state.config.max_log_len
        for sample in sorted(stream.samples.values(), key=lambda s: s.index):
            text = sample.detokenizer.text
            logger.info("Generated response %s (sample %d): %d tokens, finish_reason: %s, output: %r%s",
                        stream.request_id, sample.index, sample.num_tokens, sample.finish_reason or "abort",
                        text[:limit] if limit is not None else text,
                        "..." if limit is not None and len(text) > limit else "")

    def start_beam_search(self, request_id: str, prompts: list[list[int]], req: p.SamplingFields,
                          max_tokens: int | None, num_logprobs: int | None,
                          tool_constraint: StructuredOutputsParams | None = None,
                          lora_request: LoRARequest | None = None) -> BeamSearchStream:
        """use_beam_search, n being the beam width. Beam search ranks by the model's logprobs alone, so a sampling
        field it would not honour is a 400 naming it (vLLM ignores them), as is a width whose 2n candidates per
        step exceed --max-logprobs."""
        state = self.state
        refused = {
            "top_p": req.top_p not in (None, 1.0), "top_k": req.top_k not in (None, 0, -1), "min_p": bool(req.min_p),
            "presence_penalty": bool(req.presence_penalty), "frequency_penalty": bool(req.frequency_penalty),
            "repetition_penalty": req.repetition_penalty not in (None, 1.0), "logit_bias": bool(req.logit_bias),
            "allowed_token_ids": req.allowed_token_ids is not None, "bad_words": bool(req.bad_words),
            "cache_salt": req.cache_salt is not None,
            "stop": bool(req.stop), "stop_token_ids": bool(req.stop_token_ids), "min_tokens": req.min_tokens > 0,
            "thinking_token_budget": req.thinking_token_budget is not None,
            "kv_transfer_params": req.kv_transfer_params is not None and (
                req.kv_transfer_params.do_remote_decode or req.kv_transfer_params.do_remote_prefill),
            "prompt_logprobs": req.prompt_logprobs is not None, "tool_choice": tool_constraint is not None,
            "response_format": req.response_format is not None and req.response_format.type != "text",
            **{name: getattr(req, name) is not None
               for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")}}
        for name, is_set in refused.items():
            if is_set:
                raise ParamError(f"{name} cannot be combined with use_beam_search: beam search ranks continuations by "
                                 "the model's logprobs alone", name)
        if req.n > state.config.max_n:
            raise ParamError(f"n must be at most {state.config.max_n}, got {req.n}", "n")
        check_beam_width(req.n, state.engine.max_logprobs, "n")
        state.client.check_alive()
        temperature = 1.0 if req.temperature is None else req.temperature  # vLLM's default; it changes nothing
        params = []
        for ids in prompts:
            state.validate(ids, SamplingParams(n=req.n, max_tokens=max_tokens, logprobs=num_logprobs), req.priority)
            limit = max_tokens if max_tokens is not None else state.engine.max_model_len - len(ids)
            params.append(BeamSearchParams(req.n, limit, req.ignore_eos, temperature, req.length_penalty,
                                           req.include_stop_str_in_output, req.early_stopping))
        # the first step: one request per prompt. Its requests go out when the reader starts, not here as in
        # start(), so a burst of beam searches can pass this check together
        state.check_queue(prompts)
        return BeamSearchStream(state.client, request_id, prompts, params, state.tokenizer, req.priority,
                                num_logprobs, req.skip_special_tokens, lora_request)

    def _record_trace(self, stream: GenerationStream) -> None:
        t = stream.trace
        samples = sorted(stream.samples.values(), key=lambda s: s.index)
        t.output_tokens = sum(s.num_tokens for s in samples)
        t.finish_reasons = [s.finish_reason or "abort" for s in samples]
        if self.state.tracer.include_text:
            t.completion_text = "".join(s.detokenizer.text for s in samples)
        try:
            self.state.tracer.record(t)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            logger.exception("could not record the trace of %s", stream.request_id)

    def usage(self, prompts: list[list[int]], num_completion_tokens: int, num_cached_tokens: int = 0,
              streamed: bool = False) -> p.Usage:
        """prompt_tokens_details as vLLM sends it: only with --enable-prompt-tokens-details, and only when some of
        the prompt was found in the prefix cache; otherwise null in a whole response, absent from a stream."""
        num_prompt = sum(len(ids) for ids in prompts)
        details = p.UNSET if streamed else None
        if self.state.config.enable_prompt_tokens_details and num_cached_tokens:
            details = p.PromptTokensDetails(num_cached_tokens)
        return p.Usage(num_prompt, num_completion_tokens, num_prompt + num_completion_tokens, details)

    @staticmethod
    async def collect(stream: GenerationStream, num_choices: int) -> list[CollectedChoice]:
        """Every delta of `stream`, gathered per choice (run_to_completion closes the stream)."""
        choices = [CollectedChoice() for _ in range(num_choices)]
        async for deltas in stream:
            for d in deltas:
                c = choices[d.index]
                c.text += d.text
                c.num_tokens += len(d.token_ids)
                c.token_ids += d.token_ids
                if d.logprobs:
                    c.logprobs.extend(d.logprobs)
                if d.prompt_logprobs:
                    c.prompt_logprobs.extend(d.prompt_logprobs)
                if d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return choices

    @staticmethod
    def stream_response(stream: GenerationStream, first: bytes, events_for: Callable[[SampleDelta], list[bytes]],
                        usage_event: Callable[[int], bytes] | None, done: bytes = DONE,
                        error_event: Callable[[BaseException, str], bytes] = sse_error_event) -> EventStreamResponse:
        """A streamed response. Its SSE body: `first`, then the events of each delta as the engine produces them
        (one write per batch), then the usage chunk (given the number of generated tokens) when asked for, then
        `done` ([DONE]; the Responses and Messages APIs send nothing). A failure after the status line went out ends
        the stream with an error event (error_event's). The stream is closed when its output ends, or when the
        response does if the client left before the body began."""
        async def body() -> AsyncIterator[bytes]:
            num_tokens = 0
            with stream:
                try:
                    if first:
                        yield first
                    async for deltas in stream:
                        events = []
                        for d in deltas:
                            num_tokens += len(d.token_ids)
                            events += events_for(d)
                        if events:
                            yield b"".join(events)
                except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream, then end it
                    yield error_event(e, stream.request_id) + done
                    return
            if usage_event is not None:
                yield usage_event(num_tokens)
            if done:
                yield done

        return EventStreamResponse(body(), on_close=stream.close)

    async def run_to_completion(self, raw: Request, stream: GenerationStream, num_choices: int):
        try:
            return await until_disconnected(raw.receive, self.collect(stream, num_choices))
        except ClientDisconnected:
            logger.info("client went away; aborted %s", stream.request_id)
            return Response(status_code=499)
        finally:
            stream.close()  # however it ended, the client's leaving included
