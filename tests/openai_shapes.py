"""Checks of the OpenAI wire shapes shared by the live-server and the in-process API tests."""
from __future__ import annotations

import json

import httpx


def error_object(r: httpx.Response, status: int) -> dict:
    """The response is `status` with OpenAI's error object (message, type, param, code) and no traceback."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]
    assert "Traceback" not in r.text
    return body["error"]


def json_error(r: httpx.Response, status: int) -> dict:
    """error_object, sent as JSON."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    return error_object(r, status)


def sse_events(response: httpx.Response) -> list:
    """Parses an SSE body, checking the framing: every event is one 'data: ...' line followed by a blank line, and
    the stream ends with [DONE], once."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]
