"""Tool calls in generated text, for `tool_choice="auto"` (`--tool-call-parser hermes|llama3_json`), and the
grammars that enforce `tool_choice="required"` or a named function.

A parser is fed the answer's text (after any reasoning) as it streams, and returns the content to pass on and the
tool calls that completed. A call whose text does not parse is content, never a silent drop."""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.reasoning import held_back
from tokenmill.sampling_params import ParamError


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


def _call_from_json(obj) -> ParsedToolCall:
    """{"name": ..., "arguments" (or Llama's "parameters"): {...}} → a call; KeyError/TypeError if not one."""
    name = obj["name"]
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if not isinstance(name, str):
        raise TypeError("a tool name must be a string")
    return ParsedToolCall(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> list[ParsedToolCall] | None:
    """One or more JSON call objects (or lists of them), separated by whitespace or ';'; None if not that."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    try:
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                break
            obj, i = decoder.raw_decode(text, i)
            calls += [_call_from_json(o) for o in (obj if isinstance(obj, list) else [obj])]
    except (ValueError, KeyError, TypeError):
        return None
    return calls or None


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, between content."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer, self.in_call = "", False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                i = self.buffer.find(self.open_tag)
                if i < 0:
                    keep = held_back(self.buffer, self.open_tag)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.buffer[:i]
                self.buffer, self.in_call = self.buffer[i + len(self.open_tag):], True
            j = self.buffer.find(self.close_tag)
            if j < 0:
                return content, calls
            body, self.buffer, self.in_call = self.buffer[:j], self.buffer[j + len(self.close_tag):], False
            parsed = parse_tool_calls(body)
            if parsed is None:
                content += self.open_tag + body + self.close_tag
            else:
                calls += parsed

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        parsed = parse_tool_calls(rest)  # cut short, e.g. by max_tokens: keep it if it is whole anyway
        return ("", parsed) if parsed is not None else (self.open_tag + rest, [])


class Llama3JsonToolParser:
    """Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (several separated by
    ';'), possibly after `<|python_tag|>`. An answer that starts otherwise is plain content."""
    python_tag = "<|python_tag|>"

    def __init__(self):
        self.buffer, self.mode = "", None  # mode: None (undecided), "content" or "calls"

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self.mode == "content":
            return text, []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or self.python_tag.startswith(head):
                return "", []
            self.mode = "calls" if head.startswith(("{", "[", self.python_tag)) else "content"
            if self.mode == "content":
                text, self.buffer = self.buffer, ""
                return text, []
        return "", []  # calls are parsed once the answer is complete

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return rest, []
        parsed = parse_tool_calls(rest.strip().removeprefix(self.python_tag))
        return ("", parsed) if parsed is not None else (rest, [])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def validate_tools(tools: list[dict]) -> None:
    """A 400 for a tool that is not {"type": "function", "function": {"name": ...}}."""
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise ParamError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_tool_schema(tools: list[dict], name: str) -> dict:
    """tool_choice={"type": "function", "function": {"name": N}}: the output is N's arguments."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool)
    raise ParamError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")


def required_tools_schema(tools: list[dict], parallel: bool = True) -> dict:
    """tool_choice="required": a JSON list of one or more {"name", "parameters"} calls of the given tools.

    Each tool's parameters sit below items.anyOf[i] here, so the `$defs` their `#/$defs/...` references point at are
    hoisted to the root and merged, as vLLM does; where two tools define one name differently, the later one's is
    renamed (vLLM refuses the request there) and its references with it."""
    merged: dict[str, dict] = {}
    calls = []
    for t in tools:
        parameters = _hoist_defs(_parameters(t), merged)
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if merged:
        schema["$defs"] = merged
    return schema


def _hoist_defs(parameters: dict, merged: dict[str, dict]) -> dict:
    """parameters without its $defs, which go into `merged` (a clashing name is renamed, in the references too)."""
    defs = parameters.get("$defs")
    if not isinstance(defs, dict) or not defs:
        return parameters
    renames = {}
    for name, definition in defs.items():
        new_name, i = name, 1
        while new_name in merged and merged[new_name] != _renamed(definition, renames | {name: new_name}):
            new_name, i = f"{name}_{i}", i + 1
        renames[name] = new_name
    for name, definition in defs.items():
        merged[renames[name]] = _renamed(definition, renames)
    return _renamed({k: v for k, v in parameters.items() if k != "$defs"}, renames)


def _renamed(node, renames: dict[str, str]):
    """A copy of a schema with its `#/$defs/NAME` references renamed."""
    if isinstance(node, dict):
        out = {k: _renamed(v, renames) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name, _, rest = ref[len("#/$defs/"):].partition("/")
            if name in renames:
                out["$ref"] = f"#/$defs/{renames[name]}" + (f"/{rest}" if rest else "")
        return out
    if isinstance(node, list):
        return [_renamed(v, renames) for v in node]
    return node
