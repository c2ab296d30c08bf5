"""/v1/chat/completions: the chat template, tool choice (auto, required, named), reasoning, logprobs, streaming.

The model's text goes through a ChatOutputParser per choice, which splits reasoning from content and turns tool
calls into tool_calls, holding back text until it knows which it is."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from tokenmill.api import chat_protocol as chp, protocol as p
from tokenmill.logprobs import TokenLogprobs
from tokenmill.reasoning import ReasoningSplitter
from tokenmill.sampling_params import ParamError, StructuredOutputsParams
from tokenmill.server.chat_output import ChatOutputParser
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventStreamResponse, json_response, sse_event
from tokenmill.server.serving_engine import MIN_LOGPROB, OpenAIServing
from tokenmill.tool_parsers import TOOL_PARSERS, named_tool_schema, required_tools_schema, validate_tools


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: chp.ChatCompletionRequest, raw: Request):
        return await self.chat(req, [req.messages], raw)

    async def create_batch_chat_completion(self, req: chp.BatchChatCompletionRequest, raw: Request):
        """vLLM's /v1/chat/completions/batch: one choice per conversation (index i for conversation i)."""
        if req.prompt_logprobs is not None:  # vLLM computes and drops them: refused rather than ignored
            raise ParamError("Batch chat completions do not support `prompt_logprobs`.", "prompt_logprobs")
        return await self.chat(req, req.messages, raw, batch=True)

    async def chat(self, req: chp.ChatCompletionRequest, conversations: list[list[chp.ChatMessage]], raw: Request,
                   batch: bool = False):
        """The conversations' prompts go to the engine as one request (n samples of each), as a completion's list
        of prompts does: choice i is sample i % n of conversation i // n."""
        state = self.state
        lora = state.check_model(req.model)
        tool_mode, named_tool, tool_constraint = self.tool_choice(req)
        kwargs = chp.template_kwargs(req.chat_template_kwargs, req.reasoning_effort)
        if req.chat_template is not None:  # the request's own (ServerState.render_chat checks it is trusted)
            kwargs = {**(kwargs or {}), "chat_template": req.chat_template}
        rendered = [await state.render_chat(messages, req.add_generation_prompt, req.continue_final_message, kwargs,
                                            req.tools) for messages in conversations]
        prompt_texts, prompts = [text for text, _ in rendered], [ids for _, ids in rendered]
        if req.add_special_tokens:  # vLLM: the rendered text tokenized with special tokens (a BOS) added
            prompts = await state.encode(prompt_texts)
        prompts = self.truncate(prompts, req)
        if req.top_logprobs and not req.logprobs:  # 0 is the default, so it is allowed alone (vLLM)
            raise ParamError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        num_logprobs = self.num_logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
        prompt_logprobs = self.num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if prompt_logprobs is None and req.echo and not batch:  # as vLLM: echo brings the prompt's logprobs
            prompt_logprobs = self.num_logprobs(req.top_logprobs or 0, "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise ParamError(f"{param} must be at least 1, got {max_tokens}", param)
        if not req.use_beam_search:
            params = self.sampling_params(req, max_tokens, num_logprobs, prompt_logprobs,
                                          tool_constraint=tool_constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        as_ids = self.tokens_as_ids(req)
        echo_texts = [self.echo_text(messages, batch) if req.echo else "" for messages in conversations]

        def output_parser(conversation: int = 0) -> ChatOutputParser:
            splitter = None
            if state.reasoning is not None:
                splitter = ReasoningSplitter(state.reasoning, prompt_texts[conversation])
            tool_parser = TOOL_PARSERS[state.config.auto_tool_call_parser]() if tool_mode == "auto" else None
            return ChatOutputParser(splitter, req.include_reasoning, tool_mode, tool_parser, named_tool,
                                    self.response_role(req, conversations[conversation]))

        if req.use_beam_search:  # streamed too, as vLLM does: each beam in one chunk, at the end
            stream = self.start_beam_search(request_id, prompts, req, max_tokens, num_logprobs, tool_constraint, lora)
        else:
            stream = self.start(request_id, prompts, params, req.priority, raw, "chat", lora, req.user,
                                req.stream_interval)
        model, created, n = state.served_model_name(lora), int(time.time()), stream.params.n
        if req.stream:  # one conversation: a batch cannot stream (protocol.BatchChatCompletionRequest)
            return self.streamed_response(stream, prompts[0], model, created, *self.stream_usage(req),
                                          output_parser, echo_texts[0], bool(req.return_token_ids), as_ids)
        choices = await self.run_to_completion(raw, stream, len(prompts) * n)
        if isinstance(choices, Response):
            return choices
        out = []
        for i, c in enumerate(choices):
            parser = output_parser(i // n)
            parser.feed(c.text)
            parser.finish(cut_short=c.finish_reason == "length")
            message = parser.message()
            if echo_texts[i // n]:
                message.content = echo_texts[i // n] + (message.content or "")
            choice = chp.ChatChoice(i, message, logprobs=self.logprobs(c.logprobs, as_ids) if req.logprobs else None,
                                    finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason)
            if req.return_token_ids:
                choice.token_ids = c.token_ids
            out.append(choice)
        usage = self.usage(prompts, sum(c.num_tokens for c in choices), stream.num_cached_tokens)
        response = chp.ChatCompletionResponse(request_id, created, model, out, usage,
                                              kv_transfer_params=getattr(stream, "kv_transfer_params", None))
        if not batch:  # vLLM's batch response has neither: there is no one prompt
            if req.return_token_ids:
                response.prompt_token_ids = prompts[0]
            if prompt_logprobs is not None:
                response.prompt_logprobs = self.prompt_logprobs(prompts[0], choices[0].prompt_logprobs)
        return json_response(response)

    def response_role(self, req: chp.ChatCompletionRequest, messages: list[chp.ChatMessage]) -> str:
        """vLLM's: --response-role when the prompt ends with the generation prompt, else the last message's role
        (the model continues that message)."""
        return self.state.config.response_role if req.add_generation_prompt else messages[-1].role

    @staticmethod
    def echo_text(messages: list[chp.ChatMessage], any_role: bool) -> str:
        """What `echo` puts in front of the answer: the last message's content, when it is the assistant's (vLLM's
        batch endpoint echoes it whatever its role). Text parts are joined by newlines, as vLLM does."""
        last = messages[-1]
        if not any_role and last.role != "assistant":
            return ""
        if isinstance(last.content, list):
            return "\n".join(part.text or "" for part in last.content if part.type == "text")
        return last.content or ""

    def tool_choice(self, req: chp.ChatCompletionRequest) -> tuple[str, str | None, StructuredOutputsParams | None]:
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

    def logprobs(self, entries: list[TokenLogprobs], as_ids: bool,
                 context: list[int] | None = None) -> chp.ChatLogprobs:
        """As vLLM: a token's `bytes` are its text's; with as_ids its `token` (and each alternative's token and
        bytes) read "token_id:N". context: the tokens sampled before the first entry (a stream's earlier chunks),
        extended with the entries' tokens (ServerState.token_str)."""
        content = []
        context = [] if context is None else context
        for e in entries:
            before = context[-4:]
            context.append(e.token_id)
            text = self.state.token_str(e.token_id, before)
            top = []
            for t, lp in zip(e.top_token_ids, e.top_logprobs):
                token = self.logprob_token(t, as_ids, before)
                top.append(chp.TopLogprob(token, max(lp, MIN_LOGPROB), list(token.encode())))
            content.append(chp.ChatLogprobToken(self.logprob_token(e.token_id, as_ids, before),
                                                max(e.logprob, MIN_LOGPROB), list(text.encode()), top))
        return chp.ChatLogprobs(content)

    def streamed_response(self, stream: GenerationStream, prompt_ids: list[int], model: str, created: int,
                          include_usage: bool, continuous_usage: bool, output_parser: Callable[[], ChatOutputParser],
                          echo_text: str, return_token_ids: bool, as_ids: bool) -> EventStreamResponse:
        rid, n = stream.request_id, stream.params.n
        want_logprobs = stream.params.logprobs is not None
        parsers = [output_parser() for _ in range(n)]
        num_tokens = [0] * n  # per choice: continuous usage counts each choice's own tokens, as vLLM

        def chunk(index: int, delta: chp.DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None,
                  token_ids=None, first: bool = False) -> bytes:
            choice = chp.ChatChunkChoice(index, delta, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)
            out = chp.ChatCompletionChunk(rid, created, model, [choice])
            if return_token_ids:
                choice.token_ids = token_ids or []
                if first:
                    out.prompt_token_ids = prompt_ids
            if continuous_usage:
                out.usage = p.Usage(len(prompt_ids), num_tokens[index], len(prompt_ids) + num_tokens[index])
            return sse_event(out)

        contexts: dict[int, list[int]] = {}  # per choice: its tokens so far, for their logprob texts

        def events_for(d: SampleDelta) -> list[bytes]:
            num_tokens[d.index] += len(d.token_ids)
            logprobs = (self.logprobs(d.logprobs, as_ids, contexts.setdefault(d.index, []))
                        if want_logprobs and d.logprobs else None)
            parser = parsers[d.index]
            parts = parser.feed(d.text) if d.text else []
            if d.finish_reason is not None:
                parts += parser.finish(cut_short=d.finish_reason == "length")
            finishing = d.finish_reason is not None
            if (logprobs is not None or (return_token_ids and d.token_ids) or finishing) and not parts:
                parts = [chp.DeltaMessage()]  # the text is held back for now; its logprobs, ids and end are not
            # as vLLM: the last token's chunk carries finish_reason (no chunk of its own: a client counting chunks
            # sees one per token, and continuous usage stops growing on a chunk with choices)
            events = []
            for j, part in enumerate(parts):
                end = finishing and j == len(parts) - 1
                events.append(chunk(d.index, part, logprobs if j == 0 else None,
                                    parser.finish_reason(d.finish_reason) if end else None,
                                    d.stop_reason if end else None, d.token_ids if j == 0 else None))
            return events

        def usage_event(num_tokens: int) -> bytes:
            usage = self.usage([prompt_ids], num_tokens, stream.num_cached_tokens, streamed=True)
            return sse_event(chp.ChatCompletionUsageChunk(rid, created, model, usage))

        first = b"".join(chunk(i, chp.DeltaMessage(role=parsers[i].role, content=""), first=True) for i in range(n))
        if echo_text:  # vLLM: a chunk per choice with the echoed content, after the role
            first += b"".join(chunk(i, chp.DeltaMessage(content=echo_text)) for i in range(n))
        return self.stream_response(stream, first, events_for, usage_event if include_usage else None)
