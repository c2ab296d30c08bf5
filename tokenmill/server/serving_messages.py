"""/v1/messages and /v1/messages/count_tokens, Anthropic's Messages API (as vLLM and SGLang serve it, for clients
such as the anthropic SDK and Claude Code): messages → the chat template → the engine → content blocks (text,
thinking, tool_use), whole or as Anthropic's stream of typed events.

It is chat underneath, as the Responses API is: the messages become chat messages (a tool_use block an assistant's
tool call, a tool_result block a tool message), tools and tool_choice go through chat's tool choice (the same
grammars and parsers), and the model's text through a ChatOutputParser. A last message of the assistant's is
continued (Anthropic's prefill: continue_final_message). BlockAssembler turns the parser's deltas into content
blocks and, when streaming, into the events that build them, so that a stream reassembles to exactly the blocks
of a whole message."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.api import chat_protocol as chp
from tokenmill.api.errors import anthropic_error_event
from tokenmill.reasoning import ReasoningSplitter
from tokenmill.sampling_params import ParamError
from tokenmill.server import messages_protocol as mp
from tokenmill.server.chat_output import ChatOutputParser, DeltaAssembler
from tokenmill.server.generation_stream import GenerationStream, SampleDelta
from tokenmill.server.responses import EventStreamResponse, json_response, sse_named_event
from tokenmill.server.server_state import ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_engine import OpenAIServing
from tokenmill.server.serving_responses import new_id
from tokenmill.tool_parsers import TOOL_PARSERS

# the chat choice's finish_reason → Anthropic's stop_reason ("stop" is end_turn, or stop_sequence with the string)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def sse_frame(event) -> bytes:
    """Anthropic's framing: the event's type (its Struct's tag) in an `event:` line, then its JSON."""
    return sse_named_event(type(event).__struct_config__.tag, event)


# ============================== request → chat ==============================

def _text(blocks: str | list[mp.TextBlockParam] | None) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks or [])


def to_chat_messages(req: mp.MessagesInput) -> list[chp.ChatMessage]:
    """The system prompt and the messages as chat messages, in order: a user message's tool_result blocks become
    tool messages (its text blocks user messages, where they stand), an assistant's tool_use blocks its
    tool_calls; thinking blocks are dropped (chat templates drop reasoning_content)."""
    out = [chp.ChatMessage(role="system", content=_text(req.system))] if req.system else []
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append(chp.ChatMessage(role=msg.role, content=msg.content))
            continue
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(msg.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use":
                if msg.role != "assistant" or block.id is None or block.name is None:
                    raise ParamError(f"{where}: a tool_use block (with id and name) belongs to an assistant message",
                                     "messages")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result":
                if msg.role != "user" or block.tool_use_id is None:
                    raise ParamError(f"{where}: a tool_result block (with tool_use_id) belongs to a user message",
                                     "messages")
                if texts:  # text before a result stays before it
                    out.append(chp.ChatMessage(role="user", content="\n".join(texts)))
                    texts = []
                out.append(chp.ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=_text(block.content)))
        if calls:
            out.append(chp.ChatMessage(role="assistant", content="\n".join(texts) if texts else None, tool_calls=calls))
        elif texts or not any(block.type == "tool_result" for block in msg.content):
            out.append(chp.ChatMessage(role=msg.role, content="\n".join(texts)))
    return out


def chat_tools(tools: list[mp.ToolParam] | None) -> list[dict] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                   ("parameters", t.input_schema)) if v is not None}}
            for t in tools]


def chat_tool_choice(choice: mp.ToolChoiceParam | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise ParamError('tool_choice: {"type": "tool"} needs the tool\'s name', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ============================== deltas → blocks and events ==============================

class BlockAssembler(DeltaAssembler):
    """The ChatOutputParser's deltas → the message's content blocks (thinking, text, tool_use) and, when streaming,
    the events that build them."""
    REASONING, TEXT = mp.ThinkingBlock, mp.TextBlock

    def __init__(self, streaming: bool):
        super().__init__(streaming)
        self.arguments = ""  # the open tool_use block's arguments, as JSON text

    def emit(self, event) -> None:
        """Encoded at once: the blocks in an event grow afterwards."""
        if self.streaming:
            self.events.append(sse_frame(event))

    def new_reasoning(self) -> mp.ThinkingBlock:
        return mp.ThinkingBlock("")

    def new_text(self) -> mp.TextBlock:
        return mp.TextBlock("")

    def new_call(self, name: str) -> mp.ToolUseBlock:
        return mp.ToolUseBlock(new_id("toolu"), name, {})

    def opened(self, block) -> None:
        self.arguments = ""
        self.emit(mp.ContentBlockStartEvent(self.index, block))

    def append_text(self, text: str) -> None:
        if isinstance(self.open, mp.ThinkingBlock):
            self.open.thinking += text
            self._delta(mp.ThinkingDelta(text))
        else:
            self.open.text += text
            self._delta(mp.TextDelta(text))

    def append_arguments(self, arguments: str) -> None:
        self.arguments += arguments
        self._delta(mp.InputJsonDelta(arguments))

    def _delta(self, delta) -> None:
        self.emit(mp.ContentBlockDeltaEvent(self.index, delta))

    def close(self, status: str) -> None:
        block, self.open = self.open, None
        if block is None:
            return
        if isinstance(block, mp.ToolUseBlock):
            try:
                block.input = json.loads(self.arguments) if self.arguments else {}
            except ValueError:  # cut by max_tokens: what was streamed is all there is
                block.input = {}
        elif isinstance(block, mp.ThinkingBlock):
            block.signature = new_id("sig")  # Anthropic signs its thinking; here it only marks the block's end
            self._delta(mp.SignatureDelta(block.signature))
        self.emit(mp.ContentBlockStopEvent(self.index))


# ============================== serving ==============================

class AnthropicServingMessages(OpenAIServing):
    def __init__(self, state: ServerState):
        super().__init__(state)
        self.chat = OpenAIServingChat(state)  # for its tool choice

    async def render(self, req: mp.MessagesInput, **sampling) -> tuple[chp.ChatCompletionRequest, str, list[int]]:
        """The chat request this one is (with these sampling fields), and its prompt's text and ids."""
        thinking, reasoning_model = req.thinking, self.state.reasoning is not None
        if thinking is not None and thinking.type == "enabled" and not reasoning_model:
            raise ParamError('thinking: {"type": "enabled"} needs a reasoning model: start with --reasoning-parser',
                             "thinking")
        if thinking is not None and thinking.type != "enabled" and thinking.budget_tokens is not None:
            raise ParamError(f"thinking: budget_tokens goes with type enabled, not {thinking.type}", "thinking")
        thinks = thinking.type == "enabled" or (thinking.type == "adaptive" and reasoning_model) \
            if thinking is not None else None
        choice = req.tool_choice
        chat_req = chp.ChatCompletionRequest(
            messages=to_chat_messages(req), tools=chat_tools(req.tools), tool_choice=chat_tool_choice(choice),
            parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
            include_reasoning=thinks is not False,
            thinking_token_budget=thinking.budget_tokens if thinking is not None else None,
            chat_template_kwargs={"enable_thinking": thinks} if thinks is not None else None,
            **sampling)
        prefill = req.messages[-1].role == "assistant"  # the model continues the assistant's message
        prompt_text, prompt_ids = await self.state.render_chat(chat_req.messages, not prefill, prefill,
                                                               chat_req.chat_template_kwargs, chat_req.tools)
        return chat_req, prompt_text, prompt_ids

    async def count_tokens(self, req: mp.MessagesInput) -> Response:
        self.state.check_model(req.model)
        chat_req, _, prompt_ids = await self.render(req)
        self.chat.tool_choice(chat_req)  # what create_message would refuse, refused here too
        return json_response(mp.TokenCount(len(prompt_ids)))

    async def create_message(self, req: mp.MessagesRequest, raw: Request):
        state = self.state
        lora = state.check_model(req.model)
        user = req.metadata.user_id if req.metadata is not None else None
        chat_req, prompt_text, prompt_ids = await self.render(
            req, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, user=user)
        tool_mode, named_tool, tool_constraint = self.chat.tool_choice(chat_req)
        params = self.sampling_params(chat_req, req.max_tokens, None, tool_constraint=tool_constraint)
        stream = self.start(new_id("msg"), [prompt_ids], params, 0, raw, "messages", lora, user)
        splitter = ReasoningSplitter(state.reasoning, prompt_text) if state.reasoning is not None else None
        tool_parser = TOOL_PARSERS[state.config.auto_tool_call_parser]() if tool_mode == "auto" else None
        parser = ChatOutputParser(splitter, chat_req.include_reasoning, tool_mode, tool_parser, named_tool)
        model = state.served_model_name(lora)
        if req.stream:
            return self.streamed_response(stream, model, prompt_ids, parser)
        choices = await self.run_to_completion(raw, stream, 1)
        if isinstance(choices, Response):
            return choices
        choice, assembler = choices[0], BlockAssembler(streaming=False)
        assembler.add(parser.feed(choice.text))
        assembler.add(parser.finish(cut_short=choice.finish_reason == "length"))
        assembler.finish()
        stop_reason, stop_sequence = self.stop_reason(parser, choice.finish_reason, choice.stop_reason)
        return json_response(mp.Message(id=stream.request_id, content=assembler.parts, model=model,
                                        stop_reason=stop_reason, stop_sequence=stop_sequence,
                                        usage=mp.MessageUsage(len(prompt_ids), choice.num_tokens)))

    @staticmethod
    def stop_reason(parser: ChatOutputParser, finish_reason: str | None,
                    engine_stop: str | int | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a forced tool call (tool_choice any or tool) ends in tool_use too."""
        reason = parser.finish_reason(finish_reason)
        if reason == "stop" and parser.tool_calls:
            return "tool_use", None
        if reason == "stop" and isinstance(engine_stop, str):
            return "stop_sequence", engine_stop
        return STOP_REASONS.get(reason, "end_turn"), None

    def streamed_response(self, stream: GenerationStream, model: str, prompt_ids: list[int],
                          parser: ChatOutputParser) -> EventStreamResponse:
        assembler = BlockAssembler(streaming=True)
        start = mp.Message(id=stream.request_id, content=[], model=model, usage=mp.MessageUsage(len(prompt_ids), 0))
        first = sse_frame(mp.MessageStartEvent(start))
        ending: tuple[str, str | None] = ("end_turn", None)

        def events_for(d: SampleDelta) -> list[bytes]:
            nonlocal ending
            if d.text:
                assembler.add(parser.feed(d.text))
            if d.finish_reason is not None:
                assembler.add(parser.finish(cut_short=d.finish_reason == "length"))
                assembler.finish()
                ending = self.stop_reason(parser, d.finish_reason, d.stop_reason)
            return assembler.take_events()

        def last_events(num_tokens: int) -> bytes:
            return (sse_frame(mp.MessageDeltaEvent(mp.StopDetails(*ending), mp.OutputUsage(num_tokens)))
                    + sse_frame(mp.MessageStopEvent()))

        return self.stream_response(stream, first, events_for, last_events, done=b"",
                                    error_event=anthropic_error_event)


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    messages = AnthropicServingMessages(state)

    @app.post("/v1/messages")
    async def create_message(body: mp.MessagesRequest, raw: Request):
        return await messages.create_message(body, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: mp.MessagesInput):
        return await messages.count_tokens(body)
