"""/v1/responses, OpenAI's Responses API: input items → the chat template → the engine → output items (messages,
function calls, reasoning), whole or as a stream of typed events; stored responses for GET and for
previous_response_id.

It is chat underneath: the input becomes chat messages, tools and tool_choice go through chat's tool choice (the
same grammars and parsers), and the model's text through a ChatOutputParser. What differs is the shape of the
output: OutputAssembler turns the parser's deltas into items, and, when streaming, into the events that build
them, so that a streamed response reassembles to exactly the items of a plain one."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response

from tokenmill.api import chat_protocol as chp, protocol as p
from tokenmill.api.errors import stream_error_info
from tokenmill.reasoning import ReasoningSplitter
from tokenmill.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from tokenmill.server import responses_protocol as rp
from tokenmill.server.chat_output import ChatOutputParser, DeltaAssembler
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventLog, EventStreamResponse, json_response, sse_named_event
from tokenmill.server.server_state import ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_engine import OpenAIServing
from tokenmill.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("tokenmill.server")

MAX_STORED_RESPONSES = 1000  # store=true keeps the most recently used ones in memory, for GET and follow-ups
MAX_EVENT_LOGS = 100  # the background responses whose events are kept for GET ...?stream=true
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_frame(event) -> bytes:
    """OpenAI's framing of a Responses stream: the event type (its `type`) in an `event:` line, then its JSON."""
    return sse_named_event(event.type, event)


# ============================== request → chat ==============================

def _text_parts(content: str | list[rp.InputContentPart] | None, where: str) -> str | list[chp.TextContentPart]:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise ParamError(f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PART_TYPES[:2])}) are "
                             f"supported, got {part.type!r}", "input")
        parts.append(chp.TextContentPart(type="text", text=part.text))
    return parts


def to_chat_messages(items: list[rp.InputItem]) -> list[chp.ChatMessage]:
    """Input items → chat messages: a function call joins the assistant message before it (one turn, several
    calls), its output becomes a tool message. Reasoning items are dropped: chat templates drop past reasoning."""
    out: list[chp.ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in MESSAGE_ROLES:
                raise ParamError(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {item.role!r}", "input")
            out.append(chp.ChatMessage(role=item.role, content=_text_parts(item.content, where)))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise ParamError(f"{where}: a function_call needs call_id and name", "input")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1].tool_calls.append(call)
            else:
                out.append(chp.ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise ParamError(f"{where}: a function_call_output needs call_id", "input")
            out.append(chp.ChatMessage(role="tool", tool_call_id=item.call_id, content=_text_parts(item.output, where)))
        elif item.type != "reasoning":
            raise ParamError(f"{where}.type {item.type!r} is not supported; expected message, function_call, "
                             "function_call_output or reasoning", "input")
    return out


def drop_oldest(messages: list[chp.ChatMessage]) -> list[chp.ChatMessage]:
    """truncation "auto": the conversation without its oldest item, and without the tool results that answered a
    call it dropped (a tool message cannot open a conversation)."""
    i = 1
    while i < len(messages) - 1 and messages[i].role == "tool":
        i += 1
    return messages[i:]


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """The Responses API's flat function tools → chat's nested {"type": "function", "function": {...}}."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ParamError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; only function tools "
                             "are", "tools")
        if not isinstance(tool.get("name"), str):
            raise ParamError(f'tools[{i}] must be {{"type": "function", "name": ...}}', "tools")
        fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ParamError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                         "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


# ============================== deltas → items and events ==============================

class OutputAssembler(DeltaAssembler):
    """The ChatOutputParser's deltas → the response's output items (reasoning, message, function call) and, when
    streaming, the SSE events that build them (numbered in order)."""
    REASONING, TEXT = rp.ReasoningItem, rp.OutputMessage

    def __init__(self, streaming: bool):
        super().__init__(streaming)
        self.sequence_number = 0

    def emit(self, event_type: type, name: str, *fields) -> None:
        """Encoded at once: the items in an event are mutated afterwards."""
        if self.streaming:
            self.events.append(sse_frame(event_type(name, self.sequence_number, *fields)))
            self.sequence_number += 1

    def new_reasoning(self) -> rp.ReasoningItem:
        return rp.ReasoningItem(id=new_id("rs"), status="in_progress")

    def new_text(self) -> rp.OutputMessage:
        return rp.OutputMessage(id=new_id("msg"), status="in_progress")

    def new_call(self, name: str) -> rp.FunctionCallItem:
        return rp.FunctionCallItem(id=new_id("fc"), call_id=new_id("call"), name=name, arguments="",
                                   status="in_progress")

    def opened(self, item) -> None:
        index = self.index
        self.emit(rp.OutputItemEvent, "response.output_item.added", index, item)
        if not isinstance(item, rp.FunctionCallItem):
            part = rp.OutputText("") if isinstance(item, rp.OutputMessage) else rp.ReasoningText("")
            item.content.append(part)
            self.emit(rp.ContentPartEvent, "response.content_part.added", item.id, index, 0, part)

    @staticmethod
    def _text_events(item) -> tuple[str, list | None]:
        """The event-name stem of an item's text, and the logprobs its events carry (output text only)."""
        return ("output_text", []) if isinstance(item, rp.OutputMessage) else ("reasoning_text", None)

    def append_text(self, text: str) -> None:
        item = self.open
        item.content[0].text += text
        kind, logprobs = self._text_events(item)
        self.emit(rp.TextDeltaEvent, f"response.{kind}.delta", item.id, self.index, 0, text, logprobs)

    def append_arguments(self, arguments: str) -> None:
        self.open.arguments += arguments
        self.emit(rp.ArgumentsDeltaEvent, "response.function_call_arguments.delta", self.open.id,
                  self.index, arguments)

    def close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status
        index = self.index
        if isinstance(item, rp.FunctionCallItem):
            self.emit(rp.ArgumentsDoneEvent, "response.function_call_arguments.done", item.id, index, item.name,
                      item.arguments)
        else:
            part, (kind, logprobs) = item.content[0], self._text_events(item)
            self.emit(rp.TextDoneEvent, f"response.{kind}.done", item.id, index, 0, part.text, logprobs)
            self.emit(rp.ContentPartEvent, "response.content_part.done", item.id, index, 0, part)
        self.emit(rp.OutputItemEvent, "response.output_item.done", index, item)


# ============================== serving ==============================

class OpenAIServingResponses(OpenAIServing):
    def __init__(self, state: ServerState):
        super().__init__(state)
        self.chat = OpenAIServingChat(state)  # for its tool choice
        # response id → (the response, its conversation without instructions: what previous_response_id continues)
        # (None while a background response runs, and for one cancelled or failed: nothing to continue)
        self.stored: OrderedDict[str, tuple[rp.ResponseObject, list[chp.ChatMessage] | None]] = OrderedDict()
        self.background: dict[str, asyncio.Task] = {}  # the background responses still running, by id
        # the events of the latest background responses, for GET ...?stream=true (and the POST that streams one)
        self.event_logs: OrderedDict[str, EventLog] = OrderedDict()

    async def create_response(self, req: rp.ResponsesRequest, raw: Request):
        state = self.state
        lora = state.check_model(req.model)
        if req.n != 1:
            raise ParamError(f"a response has one output: n must be 1, got {req.n}", "n")
        if req.background and not req.store:
            raise ParamError("a background response is fetched later with GET /v1/responses/{id}: background needs "
                             "store true", "background")
        items = [rp.InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
        conversation = self.previous_conversation(req.previous_response_id) + to_chat_messages(items)
        instructions = [chp.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
        chat_req = chp.ChatCompletionRequest(messages=instructions + conversation, tools=chat_tools(req.tools),
                                             tool_choice=chat_tool_choice(req.tool_choice),
                                             parallel_tool_calls=req.parallel_tool_calls)
        tool_mode, named_tool, tool_constraint = self.chat.tool_choice(chat_req)
        kwargs = chp.template_kwargs(None, req.reasoning.effort if req.reasoning is not None else None)
        context = conversation
        while True:
            try:
                prompt_text, prompt_ids = await state.render_chat(instructions + context, True, False, kwargs,
                                                                  chat_req.tools)
            except ParamError as e:
                if e.param != "messages":
                    raise
                raise ParamError(str(e), "input") from None
            if req.truncation != "auto" or len(context) <= 1 or self.fits(prompt_ids, req.max_output_tokens):
                break
            context = drop_oldest(context)
        params = self.params(req, tool_constraint)
        stream = self.start(new_id("resp"), [prompt_ids], params, req.priority, raw, "responses", lora, req.user,
                            req.stream_interval)
        echo = self.echo(req, stream.request_id, params, state.served_model_name(lora))
        splitter = ReasoningSplitter(state.reasoning, prompt_text) if state.reasoning is not None else None
        tool_parser = TOOL_PARSERS[state.config.auto_tool_call_parser]() if tool_mode == "auto" else None
        parser = ChatOutputParser(splitter, True, tool_mode, tool_parser, named_tool)
        if req.background:
            queued, log = self.run_in_background(stream, echo, prompt_ids, parser, conversation)
            return EventStreamResponse(log.follow(0)) if req.stream else json_response(queued)
        if req.stream:
            return self.streamed_response(stream, echo, prompt_ids, parser, conversation, req.store)
        choices = await self.run_to_completion(raw, stream, 1)
        if isinstance(choices, Response):
            return choices
        return json_response(self.collected(choices[0], echo, prompt_ids, parser, conversation, req.store))

    def collected(self, choice, echo: dict, prompt_ids: list[int], parser: ChatOutputParser,
                  conversation: list[chp.ChatMessage], store: bool) -> rp.ResponseObject:
        """The final response from the whole of the engine's output."""
        assembler = OutputAssembler(streaming=False)
        assembler.add(parser.feed(choice.text))
        assembler.add(parser.finish())
        assembler.finish("incomplete" if choice.finish_reason == "length" else "completed")
        return self.finished(echo, assembler, choice.finish_reason, prompt_ids, choice.num_tokens, conversation,
                             store)

    def run_in_background(self, stream: GenerationStream, echo: dict, prompt_ids: list[int],
                          parser: ChatOutputParser, conversation: list[chp.ChatMessage]
                          ) -> tuple[rp.ResponseObject, EventLog]:
        """background: the response is answered at once, queued, and generated whether or not anyone watches: GET
        sees it in_progress, then completed, incomplete or failed; POST .../cancel aborts it. Its stream's events
        are kept (an EventLog), so that the client that created it with stream true, and any GET ...?stream=true,
        follow it from where they ask, however often they reconnect."""
        response_id = stream.request_id
        queued = rp.ResponseObject(**echo, status="queued", output=[])
        self.store(queued, None)
        body = self.streamed_response(stream, echo, prompt_ids, parser, conversation, True, "queued").events
        log = self.event_logs[response_id] = EventLog()
        while len(self.event_logs) > MAX_EVENT_LOGS:
            self.event_logs.popitem(last=False)

        async def generate() -> None:
            self.store(msgspec.structs.replace(queued, status="in_progress"), None)
            async for chunk in body:  # a cancel ends the body too (its `with stream` aborts the engine request)
                log.extend(chunk)

        def ended(_) -> None:
            """However the task ends, a cancel before it ran included, its engine request is aborted and its
            followers see the log's end."""
            stream.close()
            log.finish()
            self.background.pop(response_id, None)

        task = asyncio.create_task(generate())
        self.background[response_id] = task
        task.add_done_callback(ended)
        return queued, log

    def store(self, response: rp.ResponseObject, conversation: list[chp.ChatMessage] | None) -> None:
        self.stored[response.id] = (response, conversation)
        self.stored.move_to_end(response.id)
        while len(self.stored) > MAX_STORED_RESPONSES:
            evicted, _ = self.stored.popitem(last=False)
            self.event_logs.pop(evicted, None)

    def lookup(self, response_id: str, what: str = "Response") -> tuple[rp.ResponseObject, list | None]:
        stored = self.stored.get(response_id)
        if stored is None:
            raise HTTPException(404, f"{what} with id '{response_id}' not found.")
        self.stored.move_to_end(response_id)
        return stored

    async def cancel(self, response_id: str) -> Response:
        """POST /v1/responses/{id}/cancel: a background response still queued or running stops (its KV is freed)
        and is kept as cancelled; any other is a 400, as OpenAI answers."""
        response, _ = self.lookup(response_id)
        if not await self._stop(response_id):
            why = ("Cannot cancel a synchronous response." if not response.background
                   else f"Cannot cancel a response that is already {response.status}.")
            raise ParamError(why, "response_id")
        cancelled = msgspec.structs.replace(response, status="cancelled")
        self.store(cancelled, None)
        return json_response(cancelled)

    async def delete(self, response_id: str) -> Response:
        """DELETE /v1/responses/{id}: forgotten (a background one still running is cancelled first)."""
        self.lookup(response_id)
        await self._stop(response_id)
        self.stored.pop(response_id, None)
        self.event_logs.pop(response_id, None)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _stop(self, response_id: str) -> bool:
        """Cancels a background response still running, once it has stopped; False when none was."""
        task = self.background.get(response_id)
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True

    def fits(self, prompt_ids: list[int], max_output_tokens: int | None) -> bool:
        """Whether the prompt and the tokens asked for (at least one) fit the context."""
        return len(prompt_ids) + (max_output_tokens or 1) <= self.state.engine.max_model_len

    def retrieve(self, response_id: str, stream: bool, starting_after: int | None) -> Response:
        """GET: the response as it stands; with stream=true, a background response's events from the one after
        sequence number starting_after (from the first without it), then live until it ends."""
        response, _ = self.lookup(response_id)
        if not stream:
            if starting_after is not None:
                raise ParamError("starting_after is for stream=true: the events after that sequence number",
                                 "starting_after")
            return json_response(response)
        log = self.event_logs.get(response_id)
        if log is None:
            raise ParamError(f"response '{response_id}' has no stream to follow: only a background response's "
                             "events are kept (the latest ones)", "stream")
        if starting_after is not None and starting_after < -1:
            raise ParamError(f"starting_after must be at least -1, got {starting_after}", "starting_after")
        return EventStreamResponse(log.follow(0 if starting_after is None else starting_after + 1))

    def previous_conversation(self, response_id: str | None) -> list[chp.ChatMessage]:
        """previous_response_id: the earlier turns (its instructions are not carried over, as OpenAI does)."""
        if response_id is None:
            return []
        response, conversation = self.lookup(response_id, "Previous response")
        if conversation is None:
            raise ParamError(f"response '{response_id}' is {response.status}: only a completed or incomplete "
                             "response can be continued", "previous_response_id")
        return list(conversation)

    def params(self, req: rp.ResponsesRequest, tool_constraint: StructuredOutputsParams | None) -> SamplingParams:
        """text.format is the Responses API's response_format: passed on as one, and its errors name `text`."""
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type != "text":
            if fmt.type not in ("json_schema", "json_object"):
                raise ParamError(f"text.format.type must be text, json_schema or json_object, got {fmt.type!r}", "text")
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise ParamError("text.format of type json_schema needs a schema", "text")
            if req.response_format is not None:
                raise ParamError("give text.format or response_format, not both", "text")
            schema = p.JsonSchemaFormat(name=fmt.name, schema=fmt.schema_) if fmt.type == "json_schema" else None
            req.response_format = p.ResponseFormat(type=fmt.type, json_schema=schema)
        try:
            return self.sampling_params(req, req.max_output_tokens, None, tool_constraint=tool_constraint)
        except ParamError as e:
            if fmt is None or e.param != "response_format":
                raise
            raise ParamError(str(e), "text") from None

    def echo(self, req: rp.ResponsesRequest, response_id: str, params: SamplingParams, model: str) -> dict:
        """The fields every state of the response shares: its id and the request's settings."""
        fmt = req.text.format if req.text is not None and req.text.format is not None else rp.TextFormat()
        return dict(id=response_id, created_at=int(time.time()), model=model,
                    parallel_tool_calls=req.parallel_tool_calls, tool_choice=req.tool_choice or "auto",
                    tools=req.tools or [], text={"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                    temperature=params.temperature, top_p=params.top_p, store=req.store,
                    instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                    previous_response_id=req.previous_response_id,
                    reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
                    truncation=req.truncation or "disabled",
                    metadata=req.metadata or {}, user=req.user, background=req.background)

    def finished(self, echo: dict, assembler: OutputAssembler, finish_reason: str | None, prompt_ids: list[int],
                 num_tokens: int, conversation: list[chp.ChatMessage], store: bool) -> rp.ResponseObject:
        """The final response, stored when asked for. Reasoning tokens are counted by re-encoding the reasoning
        text (the engine does not tell them apart)."""
        incomplete = finish_reason == "length"
        reasoning = "".join(part.text for item in assembler.parts if isinstance(item, rp.ReasoningItem)
                            for part in item.content)
        reasoning_tokens = len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        usage = rp.ResponseUsage(len(prompt_ids), num_tokens, len(prompt_ids) + num_tokens, rp.InputTokensDetails(),
                                 rp.OutputTokensDetails(min(reasoning_tokens, num_tokens)))
        response = rp.ResponseObject(
            **echo, status="incomplete" if incomplete else "completed", output=assembler.parts, usage=usage,
            completed_at=None if incomplete else int(time.time()),
            incomplete_details=rp.IncompleteDetails("max_output_tokens") if incomplete else None)
        if store:
            outputs = [rp.InputItem.model_validate(item) for item in msgspec.to_builtins(assembler.parts)]
            self.store(response, conversation + to_chat_messages(outputs))
        return response

    def streamed_response(self, stream: GenerationStream, echo: dict, prompt_ids: list[int], parser: ChatOutputParser,
                          conversation: list[chp.ChatMessage], store: bool,
                          created: str = "in_progress") -> EventStreamResponse:
        """The response's events as the engine produces them; a failure once they began (the engine died) ends them
        with an error event and response.failed, and stores the response as failed. created: the status that
        response.created reports (a background response's is queued)."""
        assembler = OutputAssembler(streaming=True)
        assembler.emit(rp.LifecycleEvent, "response.created", rp.ResponseObject(**echo, status=created, output=[]))
        assembler.emit(rp.LifecycleEvent, "response.in_progress",
                       rp.ResponseObject(**echo, status="in_progress", output=[]))
        first = b"".join(assembler.take_events())
        finish_reason = None

        def events_for(d: SampleDelta) -> list[bytes]:
            nonlocal finish_reason
            if d.text:
                assembler.add(parser.feed(d.text))
            if d.finish_reason is not None:
                finish_reason = d.finish_reason
                assembler.add(parser.finish())
                assembler.finish("incomplete" if finish_reason == "length" else "completed")
            return assembler.take_events()

        def last_event(num_tokens: int) -> bytes:
            response = self.finished(echo, assembler, finish_reason, prompt_ids, num_tokens, conversation, store)
            assembler.emit(rp.LifecycleEvent, f"response.{response.status}", response)
            return b"".join(assembler.take_events())

        def failure_events(e: BaseException, request_id: str) -> bytes:
            info = stream_error_info(e, request_id)
            assembler.emit(rp.ErrorEvent, "error", info.type, info.message, info.param)
            response = rp.ResponseObject(**echo, status="failed", output=assembler.parts,
                                         error={"code": "server_error", "message": info.message})
            if store:
                self.store(response, None)
            assembler.emit(rp.LifecycleEvent, "response.failed", response)
            return b"".join(assembler.take_events())

        return self.stream_response(stream, first, events_for, last_event, done=b"", error_event=failure_events)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    responses = OpenAIServingResponses(state)

    @app.post("/v1/responses")
    async def create_response(body: rp.ResponsesRequest, raw: Request):
        return await responses.create_response(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        return responses.retrieve(response_id, stream, starting_after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await responses.cancel(response_id)
