"""/v1/responses in-process, on the fake engine: request validation (400s naming the field), 404s, the response
object's shape, storing, previous_response_id, and the stream's framing, in milliseconds and without a model.

What depends on the model (structured output, tool calls, greedy stream = plain response) runs against the real
engine in test_responses_api.py. The fake engine always stops on length, so its responses are incomplete."""
from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest
from fake_engine import CONTINUATION, MODEL, InProcessServer, post
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from openai_shapes import json_error

pytestmark = pytest.mark.anyio

FUNCTION_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def _create(app: InProcessServer, **body) -> dict:
    r = await post(app, "/v1/responses", {"model": MODEL, "max_output_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_text(app: InProcessServer, response_id: str) -> str:
    prompt_ids, _, _ = app.client.added[f"{response_id}-0-0"]
    return app.state.tokenizer.decode(prompt_ids)


def _stream_events(r: httpx.Response, first: int = 0) -> list[dict]:
    """Each event is an `event: <type>` line and a `data: <json>` line whose type matches; no [DONE]. first: the
    first event's sequence number (a resumed stream's)."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for block in r.text.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        event = json.loads(data_line[len("data: "):])
        assert event["type"] == event_line[len("event: "):]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(first, first + len(events)))
    for event in events:  # strictly, as the SDK's own types say (the SDK itself does not validate)
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    return events


async def _stream(app: InProcessServer, **body) -> list[dict]:
    return _stream_events(await post(app, "/v1/responses", {"model": MODEL, "stream": True, **body}))


def _items(response: dict) -> list[tuple]:
    """What a response says, without its random ids."""
    return [(item["type"], item["status"], item.get("name"), item.get("arguments"),
             [part["text"] for part in item.get("content", [])]) for item in response["output"]]


BAD_REQUESTS = [
    ({"input": None}, "input", "input"),
    ({"input": 42}, "input", "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input", "wizard"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input", "file_search_call"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
    ({"input": []}, "input", "at least one"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "file_search"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "name": "f", "function": {"name": "f"}}], "tool_choice": {"type": "web_search"}},
     "tool_choice", "tool_choice"),
    ({"tools": [FUNCTION_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tools": [FUNCTION_TOOL]}, "tool_choice", "auto"),  # tool_choice defaults to auto: needs a tool parser
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"text": {"format": {"type": "xml"}}}, "text", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wibble"}}}}, "text", "json"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [FUNCTION_TOOL], "tool_choice": "required"},
     "tool_choice", "structured-output"),
    ({"text": "plain"}, "text", "text"),
    ({"background": True, "store": False}, "background", "store true"),
    ({"conversation": "conv_123"}, "conversation", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"n": 2}, "n", "n must be 1"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"model": "gpt-5"}, "model", "gpt-5"),
]


@pytest.mark.parametrize("override,param,fragment", BAD_REQUESTS,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(BAD_REQUESTS)])
async def test_bad_request(app, override, param, fragment):
    status = 404 if param == "model" else 400
    err = json_error(await post(app, "/v1/responses", {"model": MODEL, "input": "Hi", **override}), status)
    assert err["param"] == param, err
    assert fragment in err["message"], err


async def test_missing_input(app):
    err = json_error(await post(app, "/v1/responses", {"model": MODEL}), 400)
    assert err["param"] == "input" and "required" in err["message"]


async def test_errors_come_before_the_stream(app):
    r = await post(app, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True, "background": True,
                                          "store": False})
    assert json_error(r, 400)["param"] == "background"


async def test_unknown_ids_are_404(app):
    async with app.http() as client:
        err = json_error(await client.get("/v1/responses/resp_nope"), 404)
    assert err["type"] == "not_found_error" and "resp_nope" in err["message"]
    err = json_error(await post(app, "/v1/responses", {"model": MODEL, "input": "Hi", "previous_response_id": "resp_x"}),
                 404)
    assert err["type"] == "not_found_error" and "resp_x" in err["message"]


async def test_response_shape(app):
    body = await _create(app, input="Hi", instructions="Answer in French.", metadata={"k": "v"}, temperature=0)
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == MODEL
    # the fake engine stops on length: incomplete, and the open message with it
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = body["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_") and message["role"] == "assistant"
    assert message["status"] == "incomplete"
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    assert CONTINUATION.startswith(part["text"]) and part["text"]
    usage = body["usage"]
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert body["instructions"] == "Answer in French." and body["metadata"] == {"k": "v"}
    assert body["temperature"] == 0 and body["top_p"] == 1 and body["max_output_tokens"] == 6
    assert body["text"] == {"format": {"type": "text"}} and body["tools"] == [] and body["tool_choice"] == "auto"
    assert body["store"] is True and body["parallel_tool_calls"] is True
    Response.model_validate(body)
    prompt = _prompt_text(app, body["id"])
    assert prompt.index("Answer in French.") < prompt.index("Hi")  # instructions: a system message first


async def test_input_items(app):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    body = await _create(app, input=items)
    prompt = _prompt_text(app, body["id"])
    for text in ("Be brief.", "Weather in Paris?", "sunny, 21 C"):
        assert text in prompt


async def test_store_and_previous_response_id(app):
    first = await _create(app, input="My name is Ada.", instructions="Only for the first turn.")
    async with app.http() as client:
        r = await client.get(f"/v1/responses/{first['id']}")
    assert r.status_code == 200 and r.json() == first
    second = await _create(app, input="What is my name?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    prompt = _prompt_text(app, second["id"])
    first_answer = first["output"][0]["content"][0]["text"]
    assert prompt.index("My name is Ada.") < prompt.index(first_answer.strip()) < prompt.index("What is my name?")
    assert "Only for the first turn." not in prompt  # instructions are not carried over


async def test_store_false(app):
    body = await _create(app, input="Hi", store=False)
    assert body["store"] is False
    async with app.http() as client:
        json_error(await client.get(f"/v1/responses/{body['id']}"), 404)


async def test_stored_responses_are_bounded(tokenizer, monkeypatch):
    from tokenmill.server import serving_responses
    monkeypatch.setattr(serving_responses, "MAX_STORED_RESPONSES", 2)
    small = InProcessServer(tokenizer)
    ids = [(await _create(small, input="Hi", max_output_tokens=1))["id"] for _ in range(3)]
    async with small.http() as client:
        assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 404
        for kept in ids[1:]:
            assert (await client.get(f"/v1/responses/{kept}")).status_code == 200


async def _poll(app: InProcessServer, response_id: str, until: tuple[str, ...]) -> dict:
    async with app.http() as client:
        for _ in range(2000):
            body = (await client.get(f"/v1/responses/{response_id}")).json()
            if body["status"] in until:
                return body
            await asyncio.sleep(0)  # an in-process GET never waits on I/O: let the background task run
    raise AssertionError(f"{response_id} stayed {body['status']}")


async def test_background_response_is_answered_at_once_then_polled(tokenizer):
    """background: queued at once; GET sees it run, then its output, the same as a plain request's; it can then
    be continued, and cancelling it is a 400 (it has finished)."""
    app = InProcessServer(tokenizer)
    queued = await _create(app, input="Hi", background=True)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    Response.model_validate(queued)
    final = await _poll(app, queued["id"], ("completed", "incomplete"))
    plain = await _create(app, input="Hi")
    assert final["status"] == "incomplete" and final["background"] is True and final["usage"]["output_tokens"] == 6
    assert final["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    second = await _create(app, input="And then?", previous_response_id=queued["id"])
    assert plain["output"][0]["content"][0]["text"].strip() in _prompt_text(app, second["id"])
    async with app.http() as client:
        err = json_error(await client.post(f"/v1/responses/{queued['id']}/cancel"), 400)
        assert err["message"] == "Cannot cancel a response that is already incomplete."
        err = json_error(await client.post(f"/v1/responses/{plain['id']}/cancel"), 400)
        assert err["message"] == "Cannot cancel a synchronous response." and err["param"] == "response_id"
        json_error(await client.post("/v1/responses/resp_nope/cancel"), 404)


async def test_cancel_stops_a_running_background_response(tokenizer):
    app = InProcessServer(tokenizer)
    queued = await _create(app, input="Hi", background=True, max_output_tokens=1900)
    await _poll(app, queued["id"], ("in_progress",))
    async with app.http() as client:
        r = await client.post(f"/v1/responses/{queued['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert f"{queued['id']}-0-0" in app.client.aborted  # the engine request is aborted: its KV is freed
        assert (await client.get(f"/v1/responses/{queued['id']}")).json()["status"] == "cancelled"
        err = json_error(await client.post(f"/v1/responses/{queued['id']}/cancel"), 400)
        assert err["message"] == "Cannot cancel a response that is already cancelled."
    err = json_error(await post(app, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                       "previous_response_id": queued["id"]}), 400)
    assert err["param"] == "previous_response_id" and "cancelled" in err["message"]


async def test_delete_forgets_a_response_and_stops_a_running_one(tokenizer):
    app = InProcessServer(tokenizer)
    done = await _create(app, input="Hi")
    running = await _create(app, input="Hi", background=True, max_output_tokens=1900)
    async with app.http() as client:
        for body in (done, running):
            r = await client.delete(f"/v1/responses/{body['id']}")
            assert r.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
            json_error(await client.get(f"/v1/responses/{body['id']}"), 404)
        assert f"{running['id']}-0-0" in app.client.aborted
        json_error(await client.delete(f"/v1/responses/{done['id']}"), 404)


async def test_a_background_response_whose_engine_dies_is_failed(tokenizer):
    app = InProcessServer(tokenizer)
    app.client.die_after_tokens = 3
    queued = await _create(app, input="Hi", background=True)
    failed = await _poll(app, queued["id"], ("failed",))
    assert failed["error"]["code"] == "server_error" and "died" in failed["error"]["message"]
    async with app.http() as client:  # its stream ends as OpenAI's does: an error event, then response.failed
        events = _stream_events(await client.get(f"/v1/responses/{queued['id']}", params={"stream": "true"}))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "died" in events[-2]["message"] and events[-1]["response"] == failed


async def test_a_background_stream_can_be_followed_again_from_any_event(tokenizer):
    """background with stream: the POST streams the events while they are also kept; GET ...?stream=true replays
    them from the one after starting_after, and the replay equals the original (OpenAI's and vLLM's resume)."""
    app = InProcessServer(tokenizer)
    r = await post(app, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "stream": True,
                                          "background": True})
    events = _stream_events(r)
    assert events[0]["type"] == "response.created" and events[0]["response"]["status"] == "queued"
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["background"] is True
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response_id = events[0]["response"]["id"]
    async with app.http() as client:
        url = f"/v1/responses/{response_id}"
        assert _stream_events(await client.get(url, params={"stream": "true"})) == events
        tail = _stream_events(await client.get(url, params={"stream": "true", "starting_after": 4}), first=5)
        assert tail == events[5:]
        assert (await client.get(url)).json() == events[-1]["response"]
        err = json_error(await client.get(url, params={"starting_after": 4}), 400)
        assert err["param"] == "starting_after"
        plain = await _create(app, input="Hi")
        err = json_error(await client.get(f"/v1/responses/{plain['id']}", params={"stream": "true"}), 400)
        assert err["param"] == "stream"


async def test_stream_events(app):
    r = await post(app, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "stream": True})
    events = _stream_events(r)
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 6
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == events[-4]["text"] and text
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]}
    async with app.http() as client:  # a streamed response is stored too
        assert (await client.get(f"/v1/responses/{final['id']}")).json() == final


async def test_reasoning_and_auto_tool_calls(tokenizer):
    """A reasoning parser and the hermes tool parser, on a scripted output: a reasoning item, then a function call;
    streamed, the events build the same items."""
    from tokenmill.reasoning import REASONING_PARSERS
    scripted = InProcessServer(tokenizer, enable_auto_tool_choice=True, tool_call_parser="hermes")
    scripted.state.reasoning = REASONING_PARSERS["qwen3"]
    script = ('<think>The user wants the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}</tool_call>')
    scripted.client.tokens = tokenizer.encode(script, add_special_tokens=False)
    body = dict(input="Weather in Paris?", tools=[FUNCTION_TOOL], max_output_tokens=len(scripted.client.tokens))
    plain = await _create(scripted, **body)
    Response.model_validate(plain)
    reasoning, call = plain["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    events = await _stream(scripted, **body)
    streamed = events[-1]["response"]
    assert _items(streamed) == _items(plain) and streamed["usage"] == plain["usage"]
    types = [e["type"] for e in events]
    for expected in ("response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert expected in types
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == call["arguments"]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]  # no message for the blank line before the call


# ---- reasoning effort, truncation, and the fields this endpoint does not read ----

EFFORT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}effort={{ reasoning_effort }}"


async def test_reasoning_effort_reaches_the_chat_template_on_both_endpoints(tokenizer):
    """vLLM's treatment of chat's reasoning_effort and the Responses API's reasoning.effort: the chat template's
    `reasoning_effort` variable (over chat_template_kwargs' own); an unknown effort is a 400 naming the field."""
    templated = copy.copy(tokenizer)  # what --chat-template does at start-up (launch.py)
    templated.chat_template = EFFORT_TEMPLATE
    app = InProcessServer(templated)
    r = await _create(app, input="Hi", reasoning={"effort": "low"})
    assert _prompt_text(app, r["id"]).endswith("effort=low") and r["reasoning"] == {"effort": "low"}
    r = await _create(app, input="Hi")
    assert _prompt_text(app, r["id"]).endswith("effort=") and r["reasoning"] is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra, effort in (({"reasoning_effort": "high"}, "high"),
                          ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "low")):
        r = (await post(app, "/v1/chat/completions", {**chat, **extra})).json()
        assert _prompt_text(app, r["id"]).endswith(f"effort={effort}")
    assert json_error(await post(app, "/v1/chat/completions", {**chat, "reasoning_effort": "extreme"}),
                      400)["param"] == "reasoning_effort"
    err = json_error(await post(app, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                       "reasoning": {"effort": "extreme"}}), 400)
    assert err["param"] == "reasoning"
    err = json_error(await post(app, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                       "reasoning": {"summary": "auto"}}), 400)
    assert err["param"] == "reasoning"


async def test_truncation_auto_drops_the_oldest_input_items(tokenizer):
    """OpenAI's truncation: "disabled" (the default) is a 400 when the input does not fit the context; "auto"
    drops the oldest items (never the instructions) until it does."""
    app = InProcessServer(tokenizer, max_model_len=96)
    turns = [{"role": "user", "content": f"Turn {i}: " + "words to fill the context " * 6} for i in range(4)]
    body = {"model": MODEL, "input": turns, "instructions": "Be brief.", "max_output_tokens": 4}
    err = json_error(await post(app, "/v1/responses", body), 400)
    assert "context length" in err["message"]
    assert json_error(await post(app, "/v1/responses", {**body, "truncation": "disabled"}), 400)
    r = await _create(app, **{**body, "truncation": "auto"})
    prompt = _prompt_text(app, r["id"])
    assert "Be brief." in prompt and "Turn 3:" in prompt and "Turn 0:" not in prompt
    assert len(app.state.tokenizer.encode(prompt)) + 4 <= 96 and r["truncation"] == "auto"
    # what cannot fit even alone stays a 400
    huge = {**body, "truncation": "auto", "input": [{"role": "user", "content": "word " * 200}]}
    assert "context length" in json_error(await post(app, "/v1/responses", huge), 400)["message"]


@pytest.mark.parametrize("field,value", [
    ("prompt_logprobs", 1), ("return_token_ids", True), ("return_tokens_as_token_ids", True),
    ("truncate_prompt_tokens", 4), ("truncation_side", "right"), ("use_beam_search", True),
    ("stream_options", {"include_usage": True}), ("include", ["message.output_text.logprobs"]),
    ("max_tool_calls", 2), ("top_logprobs", 2)])
async def test_fields_this_endpoint_does_not_read_are_refused(app, field, value):
    body = {"model": MODEL, "input": "Hi", "stream": field == "stream_options", field: value}
    err = json_error(await post(app, "/v1/responses", body), 400)
    assert err["param"] == field or field in err["message"], err
