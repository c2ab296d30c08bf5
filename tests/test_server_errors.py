"""Error responses: OpenAI's JSON shape, the right status, and `param` naming the offending field."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai_shapes import error_object
from helpers import MODEL

CHAT = [{"role": "user", "content": "Hi"}]


def _post(server, path: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    headers = {**server.headers(), "Content-Type": "application/json", **(headers or {})}
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(server.url_for(path), headers=headers, timeout=120, **kwargs)


# The exhaustive tables run in-process (test_api_in_process.py); here a few of each kind go through the real
# engine: pydantic's checks, the serving layer's and the engine's own validation.
CHAT_CASES = [
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"n": 9}, "n", "at most 8"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "wizard"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "greater than max allowed: 20"),  # vLLM's words
    ({"priority": 3}, "priority", "priority"),
]


@pytest.mark.parametrize("override,param,fragment", CHAT_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CHAT_CASES)])
def test_chat_bad_request(server, override, param, fragment):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **override}
    err = error_object(_post(server, "/v1/chat/completions", body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err


COMPLETION_CASES = [
    ({"top_p": 2}, "top_p", "(0, 1]"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [999999]}, "prompt", "vocabulary"),
    ({"logprobs": 99}, "logprobs", "logprobs"),
]


@pytest.mark.parametrize("override,param,fragment", COMPLETION_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(COMPLETION_CASES)])
def test_completion_bad_request(server, override, param, fragment):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **override}
    err = error_object(_post(server, "/v1/completions", body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err


def test_missing_required_field(server):
    err = error_object(_post(server, "/v1/completions", {"model": MODEL}), 400)
    assert err["param"] == "prompt" and "required" in err["message"]
    err = error_object(_post(server, "/v1/chat/completions", {"model": MODEL}), 400)
    assert err["param"] == "messages"


def test_malformed_json(server):
    err = error_object(_post(server, "/v1/completions", '{"model": "x", "prompt": '), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


def test_context_length_exceeded(server):
    long_prompt = "hello " * 1500  # ~1500 tokens; max_model_len is 2048
    err = error_object(_post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 1000}), 400)
    assert err["param"] == "max_tokens" and "2048" in err["message"]
    n_prompt = httpx.post(server.url_for("/tokenize"), json={"prompt": long_prompt}).json()["count"]
    assert f"{n_prompt + 1000} tokens" in err["message"] and f"{n_prompt} in the messages" in err["message"]
    # chat without max_tokens: the prompt alone is too long
    err = error_object(_post(server, "/v1/chat/completions",
                       {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2100}]}), 400)
    assert "2048" in err["message"]
    # the same through the SDK
    with pytest.raises(openai.BadRequestError) as exc:
        server.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5000)
    assert exc.value.status_code == 400 and exc.value.param == "max_tokens"
    assert "maximum context length is 2048" in exc.value.message


def test_streaming_errors_come_before_the_stream(server):
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0, "stream": True})
    assert error_object(r, 400)["param"] == "max_tokens"
    assert r.headers["content-type"].startswith("application/json")


def test_unknown_model(server):
    err = error_object(_post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}), 404)
    assert err["type"] == "not_found_error" and "gpt-9" in err["message"]
    with pytest.raises(openai.NotFoundError):
        server.openai().completions.create(model="nope", prompt="x", max_tokens=1)


def test_api_key(server):
    url = server.url_for("/v1/models")
    err = error_object(httpx.get(url), 401)
    assert err["type"] == "authentication_error"
    error_object(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    error_object(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT},
                 headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url, headers=server.headers()).status_code == 200
    assert httpx.get(server.url_for("/health")).status_code == 200  # not behind the key
    assert httpx.post(server.url_for("/tokenize"), json={"prompt": "x"}).status_code == 200


def test_unknown_route(server):
    err = error_object(httpx.get(server.url_for("/v1/nothing-here"), headers=server.headers()), 404)
    assert err["type"] == "not_found_error"


# Values at the edges: refused with 400 (the full table is in-process), or served; either way the engine lives.
HOSTILE = [
    ('{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}' % MODEL, 400, "temperature"),
    ({"seed": 2**70}, 400, "seed"),
    ({"min_tokens": 2, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ({"top_k": 10**12}, 200, None),
    ({"seed": -5}, 200, None),
    ({"temperature": 1e300}, 200, None),
    ({"repetition_penalty": 1e-300}, 200, None),
    ({"stop": [""] * 3 + ["x" * 500]}, 200, None),
]


@pytest.mark.parametrize("body,status,param", HOSTILE, ids=[f"{c[2] or 'ok'}-{i}" for i, c in enumerate(HOSTILE)])
def test_hostile_values_do_not_hurt_the_engine(server, body, status, param):
    engine_pid = server.engine_process().pid
    if isinstance(body, dict):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}
    r = _post(server, "/v1/completions", body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert error_object(r, status)["param"] == param
    assert server.engine_process().pid == engine_pid
    assert httpx.get(server.url_for("/health")).status_code == 200
