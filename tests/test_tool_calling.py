"""Tool calling and reasoning over HTTP, through the openai SDK, on the real default model; the tool-call parsers
and the chat output parser on scripted text streams.

The HTTP server runs the shipped `chatml_tools` template (SmolLM2's own ignores tools), the hermes parser for
tool_choice auto, and the qwen3 reasoning parser; `enable_thinking` in chat_template_kwargs opens a think block."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from helpers import API_KEY, RemoteServer
from tokenmill.reasoning import REASONING_PARSERS, ReasoningSplitter
from tokenmill.server.chat_output import ChatOutputParser
from tokenmill.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedToolCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


# ---- parsers on scripted text ----

def chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text), 3):
        yield [text[:i], text[i:]]


def run_parser(parser, pieces: list[str]) -> tuple[str, list[ParsedToolCall]]:
    content, calls = "", []
    for piece in pieces:
        c, found = parser.feed(piece)
        content, calls = content + c, calls + found
    c, found = parser.finish()
    return content + c, calls + found


@pytest.mark.parametrize("text, content, calls", [
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>', "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    # two calls; SmolLM2's own training format puts a list inside the tags
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>[{"name": "b", "arguments": {"x": 1}}]'
     '</tool_call>', "\n", [("a", "{}"), ("b", '{"x": 1}')]),
    # not JSON inside the tags: kept as content, never dropped
    ("<tool_call>{oops}</tool_call> done", "<tool_call>{oops}</tool_call> done", []),
    # cut off after a complete call (max_tokens before the closing tag)
    ('<tool_call>{"name": "a", "arguments": {"k": "v"}}', "", [("a", '{"k": "v"}')]),
    # no calls: a '<' that is not the tag passes through
    ("1 < 2 and <tool", "1 < 2 and <tool", []),
])
def test_hermes_parser(text, content, calls):
    for pieces in chunkings(text):
        got_content, got_calls = run_parser(HermesToolParser(), pieces)
        assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls), pieces


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "", [("f", '{"x": 1}'), ("g", "{}")]),
    ('<|python_tag|>{"name": "f", "arguments": {"q": "a b"}}', "", [("f", '{"q": "a b"}')]),
    ("Hello {there}", "Hello {there}", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_llama3_json_parser(text, content, calls):
    for pieces in chunkings(text):
        got_content, got_calls = run_parser(Llama3JsonToolParser(), pieces)
        assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls), pieces


def reassemble(deltas) -> dict:
    """What an OpenAI client builds from streamed deltas."""
    reasoning, content, calls = "", "", {}
    for d in deltas:
        reasoning += getattr(d, "reasoning_content", None) or ""  # an SDK delta has it only when sent
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    return {"reasoning": reasoning, "content": content, "calls": [calls[i] for i in sorted(calls)]}


def test_streamed_deltas_rebuild_the_message():
    text = ('I should look.</think>Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    for pieces in chunkings(text):
        parser = ChatOutputParser(ReasoningSplitter(REASONING_PARSERS["qwen3"], "assistant\n<think>\n"), True,
                                  "auto", HermesToolParser())
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
        got, message = reassemble(deltas), parser.message()
        assert got["reasoning"] == message.reasoning_content == "I should look."
        assert got["content"] == message.content == "Sure."
        assert [(c["id"], c["name"], c["arguments"]) for c in got["calls"]] == [
            (tc.id, tc.function.name, tc.function.arguments) for tc in message.tool_calls]
        assert parser.finish_reason("stop") == "tool_calls"


# ---- over HTTP, on the real model ----

@pytest.fixture(scope="module")
def tool_server():
    s = RemoteServer(["--api-key", API_KEY, "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    yield s
    s.stop()


def assert_valid_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_a_valid_call(tool_server):
    client = tool_server.openai()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice="required", n=8, temperature=0.8, seed=1, max_tokens=120)
    assert len(r.choices) == 8
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_named_function_is_always_called(tool_server):
    client = tool_server.openai()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       n=6, temperature=0.8, seed=2, max_tokens=80)
    for choice in r.choices:
        assert choice.finish_reason == "stop"  # as OpenAI: a forced function is not the model's choice
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, names=["get_time"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_same_call(tool_server, tool_choice):
    client = tool_server.openai()
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    got = reassemble([c.choices[0].delta for c in chunks if c.choices])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]
    assert all(c["id"] and c["id"].startswith("chatcmpl-tool-") for c in got["calls"])
    assert finish == [whole.finish_reason]
    assert_valid_calls(whole.message.tool_calls)


# SmolLM2-135M does not decide to call tools by itself; this regex makes it write a hermes call, so that the
# auto path (generated text → parser → tool_calls) runs on a real generation.
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


def test_auto_turns_generated_tool_call_text_into_calls(tool_server):
    client = tool_server.openai()
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, names=["get_weather"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    got = reassemble([c.choices[0].delta for c in chunks if c.choices])
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls]
    assert "<tool_call>" not in got["content"]


def test_auto_without_a_call_is_plain_content(tool_server):
    client = tool_server.openai()
    choice = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                            temperature=0, max_tokens=30).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls == []
    assert "Paris" in choice.message.content


def test_tool_results_go_back_through_the_template(tool_server):
    client = tool_server.openai()
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=80).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    rendered = httpx.post(tool_server.url + "/tokenize", headers=tool_server.headers(), timeout=30,
                          json={"messages": history, "tools": TOOLS, "return_token_strs": False}).json()
    text = httpx.post(tool_server.url + "/detokenize", headers=tool_server.headers(), timeout=30,
                      json={"tokens": rendered["tokens"]}).json()["prompt"]
    args = json.loads(call.function.arguments)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 18, "sky": "sunny"}\n</tool_response>' in text
    assert '"name": "get_time"' in text  # the tools' signatures are in the system prompt
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=30).choices[0]
    assert answer.message.content and not answer.message.tool_calls


def think_request(client, **kwargs):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is 17 times 23? Think step by step."}],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, **kwargs.pop("extra_body", {})},
        temperature=0, **kwargs)


def test_reasoning_content_is_split_from_content(tool_server):
    client = tool_server.openai()
    r = think_request(client, max_tokens=60, extra_body={"thinking_token_budget": 12})
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.content
    assert len(tool_server_tokens(tool_server, reasoning)) in range(11, 14)  # the budget, give or take a merge
    for marker in ("<think>", "</think>"):
        assert marker not in msg.content and marker not in reasoning
    assert reasoning.strip() not in msg.content
    chunks = list(think_request(client, max_tokens=60, stream=True, extra_body={"thinking_token_budget": 12}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == msg.content
    hidden = think_request(client, max_tokens=60, extra_body={"thinking_token_budget": 12,
                                                               "include_reasoning": False}).choices[0].message
    assert hidden.model_extra.get("reasoning_content") is None and hidden.content == msg.content


def tool_server_tokens(s, text: str) -> list[int]:
    return httpx.post(s.url + "/tokenize", headers=s.headers(), timeout=30,
                      json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_tool_grammar_starts_after_thinking(tool_server):
    client = tool_server.openai()
    r = think_request(client, max_tokens=100, tools=TOOLS, extra_body={"thinking_token_budget": 8},
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"]
    assert_valid_calls(msg.tool_calls, names=["get_weather"])


def test_tool_choice_errors(tool_server, server):
    client = tool_server.openai()
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="get_date"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_date"}})
    bad_schema = {"type": "function", "function": {"name": "x", "parameters": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="nonsense") as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=[bad_schema],
                                       tool_choice="required")
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="64 bits"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                       extra_body={"thinking_token_budget": 10**30})
    plain = server.openai()  # the shared server: no --enable-auto-tool-choice, no reasoning parser
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        plain.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="reasoning-parser"):
        plain.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                      extra_body={"thinking_token_budget": 4})
    ok = plain.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice="none", max_tokens=5)
    assert ok.choices[0].message.tool_calls == []
