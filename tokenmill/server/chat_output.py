"""One chat choice's generated text → the assistant message: reasoning, content and tool calls.

The same parser serves both response shapes: streaming sends the deltas feed() returns, a plain response reads
message() at the end, so the two always agree."""
from __future__ import annotations

import json
import uuid

from tokenmill.api import chat_protocol as chp
from tokenmill.reasoning import ReasoningSplitter
from tokenmill.tool_parsers import ParsedToolCall, parse_tool_calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ChatOutputParser:
    """tool_mode: "none" (text only), "auto" (tool_parser finds calls), "required" (the output is a JSON list of
    {"name", "parameters"}, enforced by a grammar) or "named" (the output is the arguments of `named_tool`)."""

    def __init__(self, splitter: ReasoningSplitter | None = None, include_reasoning: bool = True,
                 tool_mode: str = "none", tool_parser=None, named_tool: str | None = None, role: str = "assistant"):
        self.role = role  # the message's role (--response-role; vLLM's rule in serving_chat.response_role)
        self.splitter, self.include_reasoning = splitter, include_reasoning
        self.tool_mode, self.tool_parser, self.named_tool = tool_mode, tool_parser, named_tool
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[chp.ToolCall] = []
        self._required_text = ""

    def feed(self, text: str) -> list[chp.DeltaMessage]:
        if self.splitter is None:
            return self._answer(text)
        reasoning, content = self.splitter.feed(text)
        return self._reasoning(reasoning) + self._answer(content)

    def finish(self, cut_short: bool = False) -> list[chp.DeltaMessage]:
        """cut_short: the output ended at max_tokens. A forced call (required, named) that it cut off is dropped,
        calls and partial JSON alike (finish_reason "length" tells why); a streamed named call's argument deltas
        have gone out already."""
        deltas = []
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            deltas = self._reasoning(reasoning) + self._answer(content)
        if self.tool_mode == "auto":
            content, calls = self.tool_parser.finish()
            deltas += self._content(content) + self._calls(calls)
        elif self.tool_mode == "required":
            calls = parse_tool_calls(self._required_text)
            if calls is not None:
                deltas += self._calls(calls)
            elif not cut_short:  # the grammar makes it whole otherwise; never dropped without a reason
                deltas += self._content(self._required_text)
        elif self.tool_mode == "named":
            if not self.tool_calls and not cut_short:
                deltas += self._named("")
            elif cut_short and self.tool_calls and not _is_json(self.tool_calls[0].function.arguments):
                self.tool_calls.clear()
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI: "tool_calls" when the model chose to call (auto, required); a named choice stays "stop"."""
        if engine_reason == "stop" and self.tool_calls and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    def message(self) -> chp.ChatResponseMessage:
        content = "".join(self.content)
        if (self.tool_calls and not content.strip()) or (self.reasoning and not content):
            content = None
        message = chp.ChatResponseMessage(role=self.role, content=content, tool_calls=self.tool_calls)
        if self.reasoning:
            message.reasoning_content = "".join(self.reasoning)
        return message

    # ---- routing ----

    def _reasoning(self, text: str) -> list[chp.DeltaMessage]:
        if not text or not self.include_reasoning:
            return []
        self.reasoning.append(text)
        return [chp.DeltaMessage(reasoning_content=text)]

    def _answer(self, text: str) -> list[chp.DeltaMessage]:
        if not text:
            return []
        if self.tool_mode == "auto":
            content, calls = self.tool_parser.feed(text)
            return self._content(content) + self._calls(calls)
        if self.tool_mode == "required":
            self._required_text += text  # a JSON list: its calls are known once it is complete
            return []
        if self.tool_mode == "named":
            return self._named(text)
        return self._content(text)

    def _content(self, text: str) -> list[chp.DeltaMessage]:
        if not text:
            return []
        self.content.append(text)
        return [chp.DeltaMessage(content=text)]

    def _calls(self, calls: list[ParsedToolCall]) -> list[chp.DeltaMessage]:
        deltas = []
        for call in calls:
            tc = chp.ToolCall(new_tool_call_id(), chp.FunctionCall(call.name, call.arguments))
            deltas.append(chp.DeltaMessage(tool_calls=[chp.DeltaToolCall(
                len(self.tool_calls), chp.DeltaFunctionCall(call.name, call.arguments), tc.id, "function")]))
            self.tool_calls.append(tc)
        return deltas

    def _named(self, arguments: str) -> list[chp.DeltaMessage]:
        """The grammar makes the whole answer the arguments: stream them as they come, after a header."""
        deltas = []
        if not self.tool_calls:
            tc = chp.ToolCall(new_tool_call_id(), chp.FunctionCall(self.named_tool, ""))
            self.tool_calls.append(tc)
            deltas.append(chp.DeltaMessage(tool_calls=[chp.DeltaToolCall(
                0, chp.DeltaFunctionCall(self.named_tool, ""), tc.id, "function")]))
        if arguments:
            self.tool_calls[0].function.arguments += arguments
            call = chp.DeltaToolCall(0, chp.DeltaFunctionCall(arguments=arguments))
            deltas.append(chp.DeltaMessage(tool_calls=[call]))
        return deltas



class DeltaAssembler:
    """A ChatOutputParser's deltas → the parts of an output that another API shapes them into (the Responses API's
    items, the Messages API's content blocks) and, when streaming, the events that build them. A part stays open
    until another kind starts or the output ends. Whitespace before any visible text waits: a text part opens
    with its first visible text, so that the blank line a model writes before a tool call is no part of its own.

    A subclass says what the parts are (new_reasoning, new_text, new_call; REASONING and TEXT, their types) and
    what growing one sends (opened, append_text: reasoning or visible text, append_arguments, close)."""
    REASONING: type
    TEXT: type

    def __init__(self, streaming: bool):
        self.streaming = streaming
        self.parts: list = []
        self.open = None
        self.pending = ""
        self.events: list[bytes] = []

    @property
    def index(self) -> int:
        """The last part's position: the open one's, while one is open."""
        return len(self.parts) - 1

    def take_events(self) -> list[bytes]:
        events, self.events = self.events, []
        return events

    def add(self, deltas: list[chp.DeltaMessage]) -> None:
        for d in deltas:
            if d.reasoning_content:
                if not isinstance(self.open, self.REASONING):
                    self._open(self.new_reasoning())
                self.append_text(d.reasoning_content)
            if d.content:
                self._content(d.content)
            for call in d.tool_calls or []:
                if call.id is not None:  # a call's first delta; a named function's arguments then stream on
                    self._open(self.new_call(call.function.name))
                if call.function.arguments:
                    self.append_arguments(call.function.arguments)

    def finish(self, status: str = "completed") -> None:
        """Closes the last part. An output with nothing visible is still one text part."""
        if not self.parts:
            text, self.pending = self.pending, ""
            self._open(self.new_text())
            if text:
                self.append_text(text)
        self.close(status)

    def _content(self, text: str) -> None:
        if not isinstance(self.open, self.TEXT):
            self.pending += text
            if not self.pending.strip():
                return
            text, self.pending = self.pending, ""
            self._open(self.new_text())
        self.append_text(text)

    def _open(self, part) -> None:
        self.close("completed")
        self.parts.append(part)
        self.open = part
        self.opened(part)

    # ---- what a subclass defines ----

    def new_reasoning(self):
        raise NotImplementedError

    def new_text(self):
        raise NotImplementedError

    def new_call(self, name: str):
        raise NotImplementedError

    def opened(self, part) -> None:
        """The events of a part that has just opened (it is self.open, last of self.parts)."""

    def append_text(self, text: str) -> None:
        raise NotImplementedError

    def append_arguments(self, arguments: str) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        """Ends self.open, if any (status: "completed", or "incomplete" when the output was cut short)."""
        raise NotImplementedError
