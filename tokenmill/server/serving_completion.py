"""/v1/completions: prompts as text, token ids or lists of either; echo, logprobs, n, streaming."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.messages import TokenLogprobs
from tokenmill.sampling_params import ParamError
from tokenmill.server import protocol as p
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventStreamResponse, json_response, sse_event
from tokenmill.server.serving_engine import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    async def prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return await self.state.encode([prompt])
        if not prompt:
            raise ParamError("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return await self.state.encode(prompt)
        return [list(ids) for ids in prompt]

    async def create_completion(self, req: p.CompletionRequest, raw: Request):
        state = self.state
        state.check_model(req.model)
        prompts = await self.prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self.start(request_id, prompts, params, req.priority, raw, "text_completion")
        echo_texts = [state.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        model, created, n = state.model_names[0], int(time.time()), params.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self.events(stream, prompts, echo_texts, model, created,
                                                               include_usage))
        choices = await self.run_to_completion(raw, stream, len(prompts) * n)
        if isinstance(choices, Response):
            return choices
        out = []
        for i, c in enumerate(choices):
            prompt_ids = prompts[i // n]
            prefix = echo_texts[i // n] if echo_texts else ""
            logprobs = None
            if req.logprobs is not None:
                entries = []
                if req.echo:
                    lp = c.prompt_logprobs[-len(prompt_ids):]
                    lp = [None] * (len(prompt_ids) - len(lp)) + lp
                    entries = list(zip(prompt_ids, lp))
                entries += [(e.token_id, e) for e in c.logprobs]
                logprobs = self.logprobs(entries, 0)
            out.append(p.CompletionChoice(i, prefix + c.text, logprobs, c.finish_reason, c.stop_reason))
        usage = self.usage(prompts, sum(c.num_tokens for c in choices))
        return json_response(p.CompletionResponse(request_id, created, model, out, usage))

    def logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offset: int) -> p.CompletionLogprobs:
        """entries: (token id, its logprobs or None, as for the first prompt token); offset: the text offset of the
        first token."""
        out = p.CompletionLogprobs()
        for token_id, e in entries:
            s = self.state.token_str(token_id)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {self.state.token_str(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
            top.setdefault(s, e.logprob)
            out.top_logprobs.append(top)
        return out

    def events(self, stream: GenerationStream, prompts: list[list[int]], echo_texts: list[str] | None, model: str,
               created: int, include_usage: bool) -> AsyncIterator[bytes]:
        n, rid = stream.params.n, stream.request_id
        num_choices = len(prompts) * n
        offsets = [len(echo_texts[i // n]) if echo_texts else 0 for i in range(num_choices)]  # of the next token
        first = b"".join(sse_event(p.CompletionResponse(rid, created, model, [
            p.CompletionChoice(i, echo_texts[i // n], None, None)])) for i in range(num_choices)) if echo_texts else b""

        def events_for(d: SampleDelta) -> list[bytes]:
            events = []
            logprobs = None
            if d.logprobs:
                logprobs = self.logprobs([(e.token_id, e) for e in d.logprobs], offsets[d.index])
                offsets[d.index] += sum(len(t) for t in logprobs.tokens)
            if d.text or logprobs is not None:
                events.append(sse_event(p.CompletionResponse(rid, created, model, [
                    p.CompletionChoice(d.index, d.text, logprobs, None)])))
            if d.finish_reason is not None:
                events.append(sse_event(p.CompletionResponse(rid, created, model, [
                    p.CompletionChoice(d.index, "", None, d.finish_reason, d.stop_reason)])))
            return events

        def usage_event(num_tokens: int) -> bytes:
            return sse_event(p.CompletionResponse(rid, created, model, [], self.usage(prompts, num_tokens)))

        return self.stream_events(stream, first, events_for, usage_event if include_usage else None)
