"""/v1/responses on the real default model, through the openai SDK (`responses.create`, `responses.stream`,
`responses.retrieve`): text, structured output (text.format json_schema), function calls (tool_choice required
and named), a greedy stream that reassembles to the plain response, storing, max_output_tokens, and 400s.

The shared server runs SmolLM2's own chat template, which ignores tools: the tool-choice grammar alone makes the
calls valid. Validation in depth, reasoning items and auto tool calls are in test_responses_in_process.py."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from helpers import MODEL

CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": CITY}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_WEATHER = "What is the weather like in Paris right now?"
GREETING = "Say hello in three words."


def summary(response) -> list[tuple]:
    """What a response says, without its random ids."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.status, item.name, item.arguments))
        else:
            out.append((item.type, item.status, [part.text for part in item.content]))
    return out


def test_text(server):
    r = server.openai().responses.create(model=MODEL, input=GREETING, instructions="Be friendly.",
                                         max_output_tokens=32, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.completed_at >= r.created_at
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.output_text.strip() and r.output_text == message.content[0].text
    u = r.usage
    assert 0 < u.output_tokens <= 32 and u.total_tokens == u.input_tokens + u.output_tokens
    assert r.instructions == "Be friendly." and r.temperature == 0 and r.max_output_tokens == 32


def test_json_schema(server):
    r = server.openai().responses.create(
        model=MODEL, input="Describe a person as JSON.", max_output_tokens=32, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_call(server, tool_choice):
    r = server.openai().responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], tool_choice=tool_choice,
                                         max_output_tokens=32, temperature=0)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert r.tools[0].name == "get_weather"

    # the call's result goes back as input, and the model answers in text
    follow_up = server.openai().responses.create(
        model=MODEL, max_output_tokens=16, temperature=0, tools=[WEATHER], tool_choice="none",
        input=[{"role": "user", "content": ASK_WEATHER},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow_up.output[0].type == "message" and follow_up.output_text


@pytest.mark.parametrize("kwargs", [dict(input=GREETING), dict(input=ASK_WEATHER, tools=[WEATHER],
                                                               tool_choice="required")], ids=["text", "tool"])
def test_stream_reassembles_to_the_plain_response(server, kwargs):
    client = server.openai()
    kwargs = dict(model=MODEL, max_output_tokens=32, temperature=0, **kwargs)
    plain = client.responses.create(**kwargs)
    assert plain.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert summary(final) == summary(plain) and final.output_text == plain.output_text
    assert final.usage == plain.usage
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "".join(part.text for item in final.output if item.type == "message" for part in item.content)
    assert arguments == "".join(item.arguments for item in final.output if item.type == "function_call")


def test_retrieve_and_previous_response_id(server):
    client = server.openai()
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.", max_output_tokens=12,
                                    temperature=0)
    assert client.responses.retrieve(first.id).to_dict() == first.to_dict()
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_through_the_sdk(server):
    """background=True on the real engine: queued at once; retrieve() then gives what the same request gives
    served in the foreground (greedy); cancel() stops a long one; delete() forgets a response."""
    client = server.openai()
    kwargs = dict(model=MODEL, input="Name three colours.", max_output_tokens=16, temperature=0)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True
    for _ in range(600):
        done = client.responses.retrieve(queued.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert done.output_text == client.responses.create(**kwargs).output_text
    long = client.responses.create(background=True, **{**kwargs, "max_output_tokens": 1500})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def test_a_background_stream_outlives_its_client_and_resumes(server):
    """background with stream on the real engine: the client reads two events and leaves; generation goes on (the
    response completes), and GET ...?stream=true&starting_after=1 gives the events the client missed, the final
    text the same as the stored response's."""
    client = server.openai()
    with client.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=24,
                                 temperature=0, stream=True, background=True) as events:
        seen = [next(events), next(events)]
    assert [e.type for e in seen] == ["response.created", "response.in_progress"]
    response_id = seen[0].response.id
    for _ in range(600):
        done = client.responses.retrieve(response_id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.output_text
    with client.responses.retrieve(response_id, stream=True, starting_after=1) as rest:
        rest = list(rest)
    assert rest[0].sequence_number == 2 and rest[-1].type == "response.incomplete"
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == done.output_text


def test_max_output_tokens_makes_it_incomplete(server):
    client = server.openai()
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=4,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete" and r.completed_at is None
    with client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=4,
                                 temperature=0, stream=True) as raw:
        last = list(raw)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text  # as OpenAI ends it


@pytest.mark.parametrize("kwargs,param", [
    (dict(), "input"),
    (dict(input="Hi", tools=[{"type": "web_search"}]), "tools"),
    (dict(input="Hi", text={"format": {"type": "xml"}}), "text"),
    (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}), "text"),
    (dict(input="Hi", background=True, store=False), "background"),
], ids=["no-input", "built-in-tool", "format-type", "format-schema", "background"])
def test_bad_requests(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().responses.create(model=MODEL, max_output_tokens=4, **kwargs)
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
