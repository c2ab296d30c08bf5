"""/v1/completions: prompts as text, token ids or lists of either; echo, logprobs, n, streaming."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api import completion_protocol as cp, protocol as p
from tokenmill.logprobs import TokenLogprobs
from tokenmill.sampling_params import ParamError
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventStreamResponse, json_response, sse_event
from tokenmill.server.serving_engine import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    async def prompts(self, prompt, add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(prompt, str):
            return await self.state.encode([prompt], add_special_tokens)
        if not prompt:
            raise ParamError("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return await self.state.encode(prompt, add_special_tokens)
        return [list(ids) for ids in prompt]

    async def create_completion(self, req: cp.CompletionRequest, raw: Request):
        state = self.state
        lora = state.check_model(req.model)
        prompts = self.truncate(await self.prompts(req.prompt, req.add_special_tokens), req)
        num_logprobs = self.num_logprobs(req.logprobs, "logprobs")
        prompt_logprobs = self.num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if prompt_logprobs is None and req.echo:  # as vLLM: the echoed tokens' logprobs are the prompt's
            prompt_logprobs = num_logprobs
        # Prompt scoring, as vLLM does it: echo with max_tokens 0 returns the prompt and its logprobs. The engine
        # computes one token (vLLM's way: every request samples one), which is dropped: no text, ids, logprobs
        # or usage of it reach the client.
        echo_only = bool(req.echo) and req.max_tokens == 0
        max_tokens = 1 if echo_only else req.max_tokens
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            if req.stream:  # vLLM's answer: its beam search yields only the final output
                raise ParamError("Streaming is not currently supported with beam search", "stream")
            stream = self.start_beam_search(request_id, prompts, req, max_tokens, num_logprobs, lora_request=lora)
        else:
            params = self.sampling_params(req, max_tokens, num_logprobs, prompt_logprobs)
            stream = self.start(request_id, prompts, params, req.priority, raw, "text_completion", lora, req.user,
                                req.stream_interval)
        echo_texts = [state.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        model, created, n = state.served_model_name(lora), int(time.time()), stream.params.n
        as_ids = self.tokens_as_ids(req)
        if req.stream:
            return self.streamed_response(stream, prompts, echo_texts, model, created, *self.stream_usage(req),
                                          bool(req.return_token_ids), as_ids, echo_only)
        choices = await self.run_to_completion(raw, stream, len(prompts) * n)
        if isinstance(choices, Response):
            return choices
        if echo_only:
            for c in choices:
                c.text, c.token_ids, c.logprobs, c.num_tokens = "", [], [], 0
        out = []
        for i, c in enumerate(choices):
            prompt_ids = prompts[i // n]
            prefix = echo_texts[i // n] if echo_texts else ""
            logprobs = None
            if num_logprobs is not None:
                entries = []
                if req.echo:
                    lp = c.prompt_logprobs[-len(prompt_ids):]
                    lp = [None] * (len(prompt_ids) - len(lp)) + lp
                    entries = list(zip(prompt_ids, lp))
                entries += [(e.token_id, e) for e in c.logprobs]
                logprobs = self.logprobs(entries, 0, num_logprobs, as_ids)
            choice = cp.CompletionChoice(i, prefix + c.text, logprobs, c.finish_reason, c.stop_reason)
            if req.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = prompt_ids, c.token_ids
            if prompt_logprobs is not None:
                choice.prompt_logprobs = self.prompt_logprobs(prompt_ids, c.prompt_logprobs)
            out.append(choice)
        usage = self.usage(prompts, sum(c.num_tokens for c in choices), stream.num_cached_tokens)
        return json_response(cp.CompletionResponse(request_id, created, model, out, usage,
                                                   kv_transfer_params=getattr(stream, "kv_transfer_params", None)))

    def logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offset: int, k: int,
                 as_ids: bool, context: list[int] | None = None) -> cp.CompletionLogprobs:
        """entries: (token id, its logprobs or None, as for the first prompt token); offset: the text offset of the
        first token; k: the alternatives to give; as_ids: "token_id:N"; context: the tokens before the first entry
        (a stream's earlier chunks), extended with the entries' tokens. As vLLM, each top_logprobs map holds the
        token itself first, then the k alternatives (k + 1 entries when the token is not among them)."""
        out = cp.CompletionLogprobs()
        context = [] if context is None else context
        for token_id, e in entries:
            before = context[-4:]
            context.append(token_id)
            s = self.logprob_token(token_id, as_ids, before)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {s: e.logprob}
            for t, lp in zip(e.top_token_ids[:k], e.top_logprobs[:k]):
                top[self.logprob_token(t, as_ids, before)] = lp
            out.top_logprobs.append(top)
        return out

    def streamed_response(self, stream: GenerationStream, prompts: list[list[int]], echo_texts: list[str] | None,
                          model: str, created: int, include_usage: bool, continuous_usage: bool,
                          return_token_ids: bool, as_ids: bool, echo_only: bool = False) -> EventStreamResponse:
        """echo_only: prompt scoring (echo, max_tokens 0): the echo, then only each choice's finish_reason."""
        n, rid, k = stream.params.n, stream.request_id, stream.params.logprobs
        num_choices = len(prompts) * n
        offsets = [len(echo_texts[i // n]) if echo_texts else 0 for i in range(num_choices)]  # of the next token
        num_tokens = [0] * num_choices  # per choice: continuous usage counts each choice's own tokens, as vLLM
        prompt_ids_due = [return_token_ids] * num_choices  # vLLM sends them in each choice's first chunk

        def chunk(i: int, text: str, logprobs=None, finish_reason=None, stop_reason=None, token_ids=()) -> bytes:
            choice = cp.CompletionStreamChoice(i, text, logprobs, finish_reason, stop_reason)
            if return_token_ids:
                choice.token_ids = list(token_ids)
                if prompt_ids_due[i]:
                    choice.prompt_token_ids, prompt_ids_due[i] = prompts[i // n], False
            usage = None
            if continuous_usage:
                num_prompt = len(prompts[i // n])
                usage = p.Usage(num_prompt, num_tokens[i], num_prompt + num_tokens[i])
            return sse_event(cp.CompletionStreamResponse(rid, created, model, [choice], usage))

        first = b"".join(chunk(i, echo_texts[i // n]) for i in range(num_choices)) if echo_texts else b""

        contexts: dict[int, list[int]] = {}  # per choice: its tokens so far, for their logprob texts

        def events_for(d: SampleDelta) -> list[bytes]:
            events = []
            if echo_only:  # the one token the engine computed is not the client's
                return [chunk(d.index, "", None, d.finish_reason, d.stop_reason)] if d.finish_reason else []
            num_tokens[d.index] += len(d.token_ids)
            logprobs = None
            if d.logprobs:
                logprobs = self.logprobs([(e.token_id, e) for e in d.logprobs], offsets[d.index], k, as_ids,
                                         contexts.setdefault(d.index, []))
                offsets[d.index] += sum(len(t) for t in logprobs.tokens)
            # as vLLM: the last token's chunk carries finish_reason (no chunk of its own)
            if d.text or logprobs is not None or (return_token_ids and d.token_ids) or d.finish_reason is not None:
                events.append(chunk(d.index, d.text, logprobs, d.finish_reason, d.stop_reason, d.token_ids))
            return events

        def usage_event(num_tokens: int) -> bytes:
            usage = self.usage(prompts, 0 if echo_only else num_tokens, stream.num_cached_tokens, streamed=True)
            return sse_event(cp.CompletionStreamResponse(rid, created, model, [], usage))

        return self.stream_response(stream, first, events_for, usage_event if include_usage else None)
