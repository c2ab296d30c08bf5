"""/v1/chat/completions: the chat template, tool choice (auto, required, named), reasoning, logprobs, streaming.

The model's text goes through a ChatOutputParser per choice, which splits reasoning from content and turns tool
calls into tool_calls, holding back text until it knows which it is."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from tokenmill.engine.messages import TokenLogprobs
from tokenmill.reasoning import ReasoningSplitter
from tokenmill.sampling_params import ParamError, StructuredOutputsParams
from tokenmill.server import protocol as p
from tokenmill.server.chat_output import ChatOutputParser
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventStreamResponse, json_response, sse_event
from tokenmill.server.serving_engine import OpenAIServing
from tokenmill.server.tool_parsers import TOOL_PARSERS, named_tool_schema, required_tools_schema, validate_tools


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: p.ChatCompletionRequest, raw: Request):
        state = self.state
        state.check_model(req.model)
        tool_mode, named_tool, tool_constraint = self.tool_choice(req)
        prompt_text, prompt_ids = await state.render_chat(req.messages, req.add_generation_prompt,
                                                          req.continue_final_message, req.chat_template_kwargs,
                                                          req.tools)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise ParamError("top_logprobs needs logprobs set to true", "top_logprobs")
            if not 0 <= req.top_logprobs <= state.engine.max_logprobs:
                raise ParamError(f"top_logprobs must be in [0, {state.engine.max_logprobs}], got {req.top_logprobs}",
                                 "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise ParamError(f"{param} must be at least 1, got {max_tokens}", param)
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      tool_constraint=tool_constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def output_parser() -> ChatOutputParser:
            splitter = ReasoningSplitter(state.reasoning, prompt_text) if state.reasoning is not None else None
            tool_parser = TOOL_PARSERS[state.config.auto_tool_call_parser]() if tool_mode == "auto" else None
            return ChatOutputParser(splitter, req.include_reasoning, tool_mode, tool_parser, named_tool)

        stream = self.start(request_id, [prompt_ids], params, req.priority, raw, "chat")
        model, created = state.model_names[0], int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self.events(stream, prompt_ids, model, created, include_usage, output_parser))
        choices = await self.run_to_completion(raw, stream, params.n)
        if isinstance(choices, Response):
            return choices
        out = []
        for i, c in enumerate(choices):
            parser = output_parser()
            parser.feed(c.text)
            parser.finish()
            out.append(p.ChatChoice(i, parser.message(), logprobs=self.logprobs(c.logprobs) if req.logprobs else None,
                                    finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        usage = self.usage([prompt_ids], sum(c.num_tokens for c in choices))
        return json_response(p.ChatCompletionResponse(request_id, created, model, out, usage))

    def tool_choice(self, req: p.ChatCompletionRequest) -> tuple[str, str | None, StructuredOutputsParams | None]:
        """(tool mode, named function, the grammar that enforces it), with vLLM's defaults and errors."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        if not req.tools:
            if choice != "none":
                raise ParamError("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return "none", None, None
        validate_tools(req.tools)
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ParamError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}', "tool_choice")
            schema = named_tool_schema(req.tools, fn["name"])
            return "named", fn["name"], StructuredOutputsParams(json=schema)
        if choice == "required":
            return "required", None, StructuredOutputsParams(json=required_tools_schema(req.tools,
                                                                                        req.parallel_tool_calls))
        if choice == "auto":
            if self.state.config.auto_tool_call_parser is None:
                raise ParamError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                 "to be set", "tool_choice")
            return "auto", None, None
        if choice == "none":
            return "none", None, None
        raise ParamError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                         "tool_choice")

    def logprobs(self, entries: list[TokenLogprobs]) -> p.ChatLogprobs:
        content = []
        for e in entries:
            s = self.state.token_str(e.token_id)
            top = [p.TopLogprob(self.state.token_str(t), lp, list(self.state.token_str(t).encode()))
                   for t, lp in zip(e.top_token_ids, e.top_logprobs)]
            content.append(p.ChatLogprobToken(s, e.logprob, list(s.encode()), top))
        return p.ChatLogprobs(content)

    def events(self, stream: GenerationStream, prompt_ids: list[int], model: str, created: int,
               include_usage: bool, output_parser: Callable[[], ChatOutputParser]) -> AsyncIterator[bytes]:
        rid, n = stream.request_id, stream.params.n
        want_logprobs = stream.params.logprobs is not None
        parsers = [output_parser() for _ in range(n)]

        def chunk(index: int, delta: p.DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
            return sse_event(p.ChatCompletionChunk(rid, created, model, [
                p.ChatChunkChoice(index, delta, logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=stop_reason)]))

        def events_for(d: SampleDelta) -> list[bytes]:
            logprobs = self.logprobs(d.logprobs) if want_logprobs and d.logprobs else None
            parser = parsers[d.index]
            parts = parser.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                parts += parser.finish()
            if logprobs is not None and not parts:
                parts = [p.DeltaMessage()]  # the text is held back for now; its logprobs are not
            events = [chunk(d.index, part, logprobs if j == 0 else None) for j, part in enumerate(parts)]
            if d.finish_reason is not None:
                events.append(chunk(d.index, p.DeltaMessage(), None, parser.finish_reason(d.finish_reason),
                                    d.stop_reason))
            return events

        def usage_event(num_tokens: int) -> bytes:
            return sse_event(p.ChatCompletionUsageChunk(rid, created, model, self.usage([prompt_ids], num_tokens)))

        first = b"".join(chunk(i, p.DeltaMessage(role="assistant", content="")) for i in range(n))
        return self.stream_events(stream, first, events_for, usage_event if include_usage else None)
