"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), through the anthropic SDK and raw HTTP.

In-process on the fake engine: the prompt each conversation becomes (the same as chat's for the same turns: tool
calls, tool results, a system prompt, an assistant prefill), the message's shape, the stream's events (validated by
the SDK's own types, and reassembled by its stream helper), thinking and tool_use blocks, stop reasons, token
counts, errors in Anthropic's shape, and /ping. On the real engine: a greedy message says what chat says."""
from __future__ import annotations

import copy
import json

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fake_engine import API_KEY, CONTINUATION, MODEL, InProcessServer, post
from pydantic import TypeAdapter

pytestmark = pytest.mark.anyio

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# a template that shows every part of every turn, so that two prompts are equal only if the turns are
TURNS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}]"
                  "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}</{{ m.role }}>"
                  "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def sdk(app: InProcessServer, api_key: str = API_KEY) -> anthropic.AsyncAnthropic:
    """The anthropic SDK on the in-process app: it sends its key as x-api-key (its HTTP client is httpx2's)."""
    return anthropic.AsyncAnthropic(api_key=api_key, base_url="http://tokenmill", max_retries=0, http_client=
                                    httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app.root)))


def last_prompt(app: InProcessServer) -> list[int]:
    return list(app.client.added.values())[-1][0]


async def message(app: InProcessServer, **body) -> dict:
    r = await post(app, "/v1/messages", {"model": MODEL, "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    Message.model_validate(r.json())
    return r.json()


def stream_events(r: httpx.Response) -> list[dict]:
    """Each event is an `event: <type>` line and a `data: <json>` line of that type, as the SDK's types say."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for block in r.text.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}", block
        events.append(event)
    for event in events[:-1] if events[-1]["type"] == "error" else events:
        TypeAdapter(RawMessageStreamEvent).validate_python(event)
    return events


def blocks(msg) -> list[tuple]:
    """What a message's content says, without its random ids."""
    content = msg["content"] if isinstance(msg, dict) else [b.model_dump() for b in msg.content]
    return [(b["type"], b.get("text"), b.get("thinking"), b.get("name"), b.get("input")) for b in content]


@pytest.fixture(scope="module")
def turns_app(tokenizer) -> InProcessServer:
    templated = copy.copy(tokenizer)  # what --chat-template does at start-up (launch.py)
    templated.chat_template = TURNS_TEMPLATE
    return InProcessServer(templated)


async def same_prompt_as_chat(app: InProcessServer, anthropic_body: dict, chat_body: dict) -> list[int]:
    await message(app, **anthropic_body)
    prompt = last_prompt(app)
    r = await post(app, "/v1/chat/completions", {"model": MODEL, "max_tokens": 6, **chat_body})
    assert r.status_code == 200, r.text
    assert prompt == last_prompt(app)
    return prompt


async def test_a_conversation_is_chats_prompt(turns_app):
    """system, text blocks and a plain string; then an assistant's tool_use and the user's tool_result with more
    text: the engine gets the very prompt chat makes of the same turns."""
    prompt = await same_prompt_as_chat(
        turns_app,
        {"system": [{"type": "text", "text": "Be brief."}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "they want weather", "signature": "s"},
                          {"type": "text", "text": "Let me look."},
                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_1",
                           "content": [{"type": "text", "text": "21C"}]},
                          {"type": "text", "text": "And tomorrow?"}]}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "Let me look.", "tool_calls": [
                          {"id": "toolu_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                      {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
                      {"role": "user", "content": "And tomorrow?"}]})
    text = turns_app.state.tokenizer.decode(prompt)
    assert "[call toolu_1 get_weather" in text and "<tool>21C[for toolu_1]</tool>" in text and "they want" not in text


async def test_a_last_assistant_message_is_continued(turns_app):
    prompt = await same_prompt_as_chat(
        turns_app, {"messages": [{"role": "user", "content": "Name a color."},
                                 {"role": "assistant", "content": "The color is"}]},
        {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}],
         "add_generation_prompt": False, "continue_final_message": True})
    assert turns_app.state.tokenizer.decode(prompt).endswith("The color is")


async def test_message_shape_usage_and_count_tokens(app):
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "Name three colors."}]}
    msg = await message(app, **body, max_tokens=5)
    prompt = last_prompt(app)
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == MODEL
    assert msg["id"].startswith("msg_") and msg["stop_reason"] == "max_tokens" and msg["stop_sequence"] is None
    expected = app.state.tokenizer.decode(app.client.tokens[:5])
    assert msg["content"] == [{"type": "text", "text": expected}]
    assert msg["usage"] == {"input_tokens": len(prompt), "output_tokens": 5}
    r = await post(app, "/v1/messages/count_tokens", {"model": MODEL, **body})
    assert r.status_code == 200 and r.json() == {"input_tokens": len(prompt)}


async def test_sampling_fields_reach_the_engine(app):
    await message(app, messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_p=0.9, top_k=7,
                  stop_sequences=["blue"], metadata={"user_id": "u-1"})
    params = list(app.client.added.values())[-1][1]
    assert (params.temperature, params.top_p, params.top_k, params.stop, params.max_tokens) == (0.5, 0.9, 7,
                                                                                              ["blue"], 6)


async def test_a_stop_sequence_is_named(app):
    msg = await message(app, messages=[{"role": "user", "content": "colors?"}], max_tokens=40,
                        stop_sequences=["green"])
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == "green"
    assert msg["content"][0]["text"] == CONTINUATION.split("green")[0]


async def test_the_sdk_and_the_stream(app):
    """The SDK's create and its stream helper (which rebuilds the message from the events) agree with raw HTTP."""
    client = sdk(app)
    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Name three colors."}])
    created = await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as stream:
        final = await stream.get_final_message()
    assert blocks(final) == blocks(created) and final.usage == created.usage
    assert final.stop_reason == created.stop_reason == "max_tokens"
    events = stream_events(await post(app, "/v1/messages", {**kwargs, "stream": True}))
    types = [e["type"] for e in events]
    assert types == ["message_start", "content_block_start", *["content_block_delta"] * (len(types) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": created.usage.input_tokens, "output_tokens": 0}
    assert "".join(e["delta"]["text"] for e in events[2:-3]) == created.content[0].text
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 8}


async def test_thinking_and_tool_use_blocks(tokenizer):
    """A reasoning parser and the hermes tool parser on a scripted output: a thinking block, then a tool_use block
    whose input is the call's arguments; stop_reason tool_use; the stream rebuilds the same blocks."""
    from tokenmill.reasoning import REASONING_PARSERS
    scripted = InProcessServer(tokenizer, enable_auto_tool_choice=True, tool_call_parser="hermes")
    scripted.state.reasoning = REASONING_PARSERS["qwen3"]
    script = ('<think>The user wants the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}</tool_call> <END>')  # the fake engine ends on length, or on a stop string
    scripted.client.tokens = tokenizer.encode(script, add_special_tokens=False)
    kwargs = dict(model=MODEL, max_tokens=len(scripted.client.tokens) + 1, tools=[WEATHER], stop_sequences=["<END>"],
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    client = sdk(scripted)
    created = await client.messages.create(**kwargs)
    assert blocks(created) == [("thinking", None, "The user wants the weather.", None, None),
                               ("tool_use", None, None, "get_weather", {"city": "Paris"})]
    assert created.content[1].id.startswith("toolu_") and created.content[0].signature
    assert created.stop_reason == "tool_use"
    async with client.messages.stream(**kwargs) as stream:
        final = await stream.get_final_message()
    assert blocks(final) == blocks(created) and final.stop_reason == "tool_use"
    events = stream_events(await post(scripted, "/v1/messages", {**kwargs, "stream": True}))
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= set(kinds)
    # thinking disabled: the template's enable_thinking is false and no thinking block comes back; adaptive: this
    # reasoning model thinks; enabled: with its budget
    off = await client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["tool_use"]
    assert list(scripted.client.added.values())[-1][1].thinking_token_budget is None
    adaptive = await client.messages.create(**kwargs, thinking={"type": "adaptive"})
    assert blocks(adaptive) == blocks(created)
    await client.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 1024})
    assert list(scripted.client.added.values())[-1][1].thinking_token_budget == 1024


async def test_adaptive_thinking_on_a_model_that_does_not_think(turns_app):
    """adaptive leaves it to the model: one without a reasoning parser does not think (its template is told so)."""
    templated = turns_app.state.tokenizer
    templated.chat_template = TURNS_TEMPLATE + "{% if enable_thinking is false %}[no thinking]{% endif %}"
    try:
        await message(turns_app, messages=[{"role": "user", "content": "hi"}], thinking={"type": "adaptive"})
        assert templated.decode(last_prompt(turns_app)).endswith("<assistant>[no thinking]")
    finally:
        templated.chat_template = TURNS_TEMPLATE


async def test_tool_choice_any_and_tool_force_a_call(app):
    for choice, name in (({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, "get_weather")):
        await message(app, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice=choice)
        assert list(app.client.added.values())[-1][1].structured_outputs is not None  # the grammar of the call
    await message(app, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                  tool_choice={"type": "none"})
    assert list(app.client.added.values())[-1][1].structured_outputs is None


BAD = [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     400, "invalid_request_error", "messages"),
    ({"tools": [WEATHER]}, 400, "invalid_request_error", "tool_choice"),  # auto needs a tool parser
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice"),
    ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, 400, "invalid_request_error", "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({"temperature": -1}, 400, "invalid_request_error", "temperature"),
    ({"model": "claude-sonnet-4"}, 404, "not_found_error", "model"),
]


@pytest.mark.parametrize("fields,status,kind,param", BAD)
async def test_errors_in_anthropics_shape(app, fields, status, kind, param):
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = await post(app, "/v1/messages", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind and error["error"]["message"].startswith(param), error


async def test_a_failure_mid_stream_is_an_error_event(tokenizer):
    dying = InProcessServer(tokenizer)
    dying.client.die_after_tokens = 2
    events = stream_events(await post(dying, "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True,
                                                              "messages": [{"role": "user", "content": "hi"}]}))
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "overloaded_error" and "message_stop" not in [e["type"] for e in events]


async def test_keys_and_ping(app):
    """x-api-key (the SDK's header) or the bearer token; a wrong key is a 401 in Anthropic's shape. /ping is
    SageMaker's /health, on GET and POST."""
    with pytest.raises(anthropic.AuthenticationError):
        await sdk(app, api_key="wrong").messages.create(model=MODEL, max_tokens=2,
                                                       messages=[{"role": "user", "content": "hi"}])
    async with app.http(api_key=None) as client:
        r = await client.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        for method in ("GET", "POST"):
            assert (await client.request(method, "/ping")).status_code == 200
        app.lifecycle.phase = "loading"
        try:
            assert (await client.get("/ping")).status_code == 503
        finally:
            app.lifecycle.phase = "ready"
        assert (await client.put("/ping")).status_code == 405


def test_greedy_message_says_what_chat_says(server):
    """The real engine: a greedy message, and a streamed one, carry chat's greedy text for the same turns."""
    turns = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Sure:"}]
    client = anthropic.Anthropic(api_key=API_KEY, base_url=server.url_for(""), max_retries=0, timeout=120)
    greedy = {"extra_body": {"temperature": 0}}  # (this SDK has no temperature argument of its own)
    msg = client.messages.create(model=MODEL, max_tokens=24, system="Be brief.", messages=turns, **greedy)
    chat = server.openai().chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[{"role": "system", "content": "Be brief."}, *turns],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert msg.content[0].text == chat.choices[0].message.content and msg.content[0].text
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(model=MODEL, max_tokens=24, system="Be brief.", messages=turns, **greedy) as stream:
        assert stream.get_final_message().content[0].text == msg.content[0].text


def test_the_router_forwards_every_post_the_server_answers(app):
    """tokenmill router relays each of them (/v1/messages with the other routes it routes by load and model)."""
    from tokenmill.router.app import FORWARDED_POSTS, STORED_RESPONSE_ROUTES
    posts = {route.path for route in app.root.inner.routes if "POST" in getattr(route, "methods", ())}
    held = {path for path, methods in STORED_RESPONSE_ROUTES.items() if "POST" in methods}
    assert "/v1/messages" in posts and posts <= set(FORWARDED_POSTS) | held
