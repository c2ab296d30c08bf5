"""The HTTP layer in-process (httpx's ASGI transport) on a fake engine client: request validation, error shapes
and statuses (400/401/404/503), and SSE framing, in milliseconds and without a model.

The same paths run against the real engine in test_server.py, test_server_errors.py, test_lifecycle.py and
test_server_stress.py; this file holds the exhaustive tables."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from fake_engine import CONTINUATION, MODEL, InProcessServer, post
from openai_shapes import json_error, sse_events

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _sse_events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return sse_events(r)


# ---- 400: validation ----

CHAT_CASES = [
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": -5}, "max_tokens", "at least 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"temperature": -0.5}, "temperature", "non-negative"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"n": 9}, "n", "at most 8"),
    ({"n": 0}, "n", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "wizard"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": "hello"}, "messages", "messages"),
    ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"n": 1.5}, "n", "n"),
    ({"stream": "maybe"}, "stream", "stream"),
    ({"messages": [{"content": "no role"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "text"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "greater than max allowed: 20"),  # vLLM's words
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"presence_penalty": 5}, "presence_penalty", "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ({"priority": 3}, "priority", "priority"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    # tools and reasoning (the live versions are in test_tool_calling.py)
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice",
     "get_date"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "nonsense"),
    ({"tools": [TOOL]}, "tool_choice", "enable-auto-tool-choice"),
    ({"thinking_token_budget": 10**30}, "thinking_token_budget", "64 bits"),
    ({"thinking_token_budget": 4}, "thinking_token_budget", "reasoning-parser"),
    # structured output (the live versions are in test_structured_output.py)
    ({"guided_regex": "a("}, "guided_regex", "regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "response_format", "one structured-output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
]


@pytest.mark.parametrize("override,param,fragment", CHAT_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CHAT_CASES)])
async def test_chat_bad_request(app, override, param, fragment):
    err = json_error(await post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                           **override}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err


COMPLETION_CASES = [
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"temperature": -1}, "temperature", "non-negative"),
    ({"top_p": 2}, "top_p", "(0, 1]"),
    ({"n": 100}, "n", "at most 8"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [999999]}, "prompt", "vocabulary"),
    ({"prompt": {"text": "x"}}, "prompt", "prompt"),
    ({"logprobs": 99}, "logprobs", "logprobs"),
    ({"echo": "yes please"}, "echo", "echo"),
]


@pytest.mark.parametrize("override,param,fragment", COMPLETION_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(COMPLETION_CASES)])
async def test_completion_bad_request(app, override, param, fragment):
    err = json_error(await post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                      **override}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err


HOSTILE = [
    ('{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}' % MODEL, "temperature"),
    ('{"model": "%s", "prompt": "Hi", "max_tokens": 2, "top_p": Infinity}' % MODEL, "top_p"),
    ({"top_k": 2**70}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"priority": -2**70}, "priority"),
    ({"min_tokens": 2, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {"5": 1e9}}, "logit_bias"),
]


@pytest.mark.parametrize("body,param", HOSTILE, ids=[f"{c[1]}-{i}" for i, c in enumerate(HOSTILE)])
async def test_hostile_values_are_400(app, body, param):
    if isinstance(body, dict):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}
    assert json_error(await post(app, "/v1/completions", body), 400)["param"] == param


async def test_missing_required_field(app):
    err = json_error(await post(app, "/v1/completions", {"model": MODEL}), 400)
    assert err["param"] == "prompt" and "required" in err["message"]
    err = json_error(await post(app, "/v1/chat/completions", {"model": MODEL}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize("body", ['{"model": "x", "prompt": ', "not json at all", "[1, 2"])
async def test_malformed_json(app, body):
    err = json_error(await post(app, "/v1/completions", body), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


async def test_body_not_an_object(app):
    assert json_error(await post(app, "/v1/chat/completions", "[1, 2]"), 400)["type"] == "invalid_request_error"


async def test_context_length_exceeded(app):
    long_prompt = "hello " * 1500  # ~1500 tokens; max_model_len is 2048
    err = json_error(await post(app, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 1000}),
                 400)
    assert err["param"] == "max_tokens" and "maximum context length is 2048" in err["message"]
    n_prompt = (await post(app, "/tokenize", {"prompt": long_prompt})).json()["count"]
    assert f"{n_prompt + 1000} tokens" in err["message"] and f"{n_prompt} in the messages" in err["message"]
    # chat without max_tokens: the prompt alone is too long
    err = json_error(await post(app, "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2100}]}), 400)
    assert "2048" in err["message"]


async def test_request_larger_than_the_kv_pool(tokenizer):
    small = InProcessServer(tokenizer, max_model_len=4096, num_blocks=200)  # 3,200 tokens of KV cache
    err = json_error(await post(small, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3500}), 400)
    assert "KV cache" in err["message"] and "3200" in err["message"] and err["param"] == "max_tokens"
    assert not small.client.added  # refused before anything reached the engine


async def test_errors_come_before_the_stream(app):
    r = await post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0, "stream": True})
    assert json_error(r, 400)["param"] == "max_tokens"


async def test_detokenize_out_of_vocabulary(app):
    err = json_error(await post(app, "/detokenize", {"tokens": [1, 10**7]}), 400)
    assert err["param"] == "tokens" and "vocabulary" in err["message"]
    assert json_error(await post(app, "/tokenize", {}), 400)["param"] == "prompt"


# ---- 401 and 404 ----

async def test_api_key(app):
    for key in (None, "wrong"):
        async with app.http(key) as client:
            assert json_error(await client.get("/v1/models"), 401)["type"] == "authentication_error"
            json_error(await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT}), 401)
            # only /v1/* is behind the key
            assert (await client.get("/health")).status_code == 200
            assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 200
            assert (await client.get("/version")).status_code == 200
            # CORS preflight never needs it
            preflight = await client.options("/v1/models", headers={"Origin": "http://example.com",
                                                                    "Access-Control-Request-Method": "GET"})
            assert preflight.status_code == 200
    async with app.http() as client:
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL


async def test_unknown_model_and_route(app):
    err = json_error(await post(app, "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}), 404)
    assert err["type"] == "not_found_error" and err["param"] == "model" and "gpt-9" in err["message"]
    assert json_error(await post(app, "/v1/completions", {"model": "nope", "prompt": "x"}), 404)["param"] == "model"
    assert json_error(await post(app, "/tokenize", {"model": "nope", "prompt": "x"}), 404)["param"] == "model"
    async with app.http() as client:
        assert json_error(await client.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
        assert json_error(await client.get("/v1/completions"), 405)["type"] == "invalid_request_error"


# ---- 503 ----

async def test_queue_limits_answer_503_with_retry_after(tokenizer):
    app = InProcessServer(tokenizer, max_num_queued_reqs=8, max_num_queued_tokens=10_000)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    app.client.num_queued_requests = 7
    assert (await post(app, "/v1/completions", body)).status_code == 200
    r = await post(app, "/v1/completions", {**body, "n": 2})  # 7 + 2 > 8
    err = json_error(r, 503)
    assert err["type"] == "overloaded_error" and "--max-num-queued-reqs 8" in err["message"]
    assert int(r.headers["retry-after"]) > 0
    app.client.num_queued_requests, app.client.num_queued_tokens = 0, 10_000
    r = await post(app, "/v1/completions", body)
    assert json_error(r, 503)["type"] == "overloaded_error" and "--max-num-queued-tokens" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) > 0


@pytest.mark.parametrize("phase,why", [("loading", "still loading"), ("draining", "shutting down")])
async def test_loading_and_draining_answer_503(tokenizer, phase, why):
    app = InProcessServer(tokenizer)
    app.lifecycle.phase = phase
    async with app.http() as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        err = json_error(r, 503)
        assert err["type"] == "service_unavailable_error" and why in err["message"]
        assert int(r.headers["retry-after"]) > 0
        assert (await client.get("/health/live")).status_code == 200  # alive
        for path in ("/health", "/health/ready"):  # but not serving, as in vLLM
            ready = await client.get(path)
            assert ready.status_code == 503 and ready.text == phase
        assert (await client.get("/metrics")).status_code == 200  # control paths still answer


async def test_dead_engine_fails_the_stream_in_flight_and_later_requests_with_503(tokenizer):
    app = InProcessServer(tokenizer)
    app.client.die_after_tokens = 5
    async with app.http() as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 1000,
                                                       "stream": True})
        assert r.status_code == 200
        events = [line for line in r.text.split("\n\n") if line]
        assert json.loads(events[0][len("data: "):])["choices"][0]["text"]  # it was streaming
        error = json.loads(events[-2][len("data: "):])["error"]
        assert events[-1] == "data: [DONE]"
        assert error["code"] == 503 and error["type"] == "service_unavailable_error" and "engine" in error["message"]
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Twice", "max_tokens": 2})
        err = json_error(r, 503)
        assert err == error  # one table: the same error object in a stream and in a response
        assert (await client.get("/health")).status_code == 503
        assert (await client.get("/health/live")).status_code == 200  # the process still answers (it exits soon)


# ---- 200: SSE framing and the shape of responses ----

async def test_chat_sse_framing(app):
    r = await post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True,
                                                  "n": 2, "stream_options": {"include_usage": True}})
    events = _sse_events(r)
    assert len({e["id"] for e in events}) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        assert CONTINUATION.startswith(text) and len(text) > 6


async def test_completion_sse_framing_with_echo_and_logprobs(app):
    r = await post(app, "/v1/completions", {"model": MODEL, "prompt": "Say", "max_tokens": 5, "stream": True,
                                             "echo": True, "logprobs": 1})
    events = _sse_events(r)
    choices = [e["choices"][0] for e in events]
    assert choices[0]["text"] == "Say" and choices[-1]["finish_reason"] == "length"
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    texts = [c["text"] for c in choices[1:-1]]
    assert offsets[0] == len("Say") and len(offsets) == 5
    assert offsets == [len("Say") + sum(len(t) for t in texts[:i]) for i in range(5)]


async def test_non_streaming_shapes_and_usage(app, tokenizer):
    r = await post(app, "/v1/completions", {"model": MODEL, "prompt": ["One", "Two three"], "max_tokens": 4,
                                             "n": 2, "logprobs": 2, "echo": True})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and len(body["choices"]) == 4
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["text"].startswith("Two three")
    n_prompt = len(tokenizer.encode("One")) + len(tokenizer.encode("Two three"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 16, "total_tokens": n_prompt + 16,
                             "prompt_tokens_details": None}
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and "".join(lp["tokens"]) == body["choices"][0]["text"]
    r = await post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5,
                                                  "logprobs": True, "top_logprobs": 2, "stop": [" green"]})
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == " Red,"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " green"
    assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])


async def test_request_id_header(app):
    async with app.http() as client:
        assert (await client.get("/v1/models", headers={"X-Request-Id": "abc-123"})).headers["x-request-id"] \
            == "abc-123"
        assert len((await client.get("/v1/models")).headers["x-request-id"]) >= 16


# ---- the API server process imports no torch ----

SERVE_WITHOUT_TORCH = """
import asyncio, sys
from tokenmill.server import launch  # noqa: F401 - the server's start-up, its app, routes and serving modules
assert "torch" not in sys.modules, "importing the API server imported torch"
from tokenmill.tokenizer import load_tokenizer
from fake_engine import InProcessServer

async def main():
    app = InProcessServer(load_tokenizer(sys.argv[1]))
    async with app.http() as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\\n\\n"), r.text
asyncio.run(main())
assert "torch" not in sys.modules, "serving a request imported torch"
print("no torch")
"""


def test_api_server_process_imports_no_torch(default_gguf, tokenizer):
    # `tokenizer` first: it converts and caches the GGUF's tokenizer, the one step that needs torch, once per file
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_TORCH, default_gguf], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "no torch" in out.stdout, out.stderr[-3000:]


TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


async def test_a_requests_own_chat_template_needs_trust(tokenizer):
    """vLLM's rule: a request's chat_template (or one in chat_template_kwargs, which the template engine would
    take as well) is refused unless the server runs with --trust-request-chat-template; trusted, it renders the
    prompt."""
    untrusted = InProcessServer(tokenizer)
    for body in ({"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}):
        err = json_error(await post(untrusted, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **body}),
                         400)
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    r = await post(untrusted, "/tokenize", {"model": MODEL, "messages": CHAT,
                                            "chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert json_error(r, 400)["param"] == "chat_template"
    trusted = InProcessServer(tokenizer, trust_request_chat_template=True)
    r = await post(trusted, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                     "chat_template": TEMPLATE})
    assert r.status_code == 200, r.text
    [(prompt_ids, _, _)] = trusted.client.added.values()
    assert tokenizer.decode(prompt_ids) == "<<Hi>>"


async def test_stream_interval_sends_fewer_larger_chunks(tokenizer):
    """SGLang's and vLLM's stream_interval (and --stream-interval): after the first chunk, each carries at least that
    many tokens, the last excepted; the text is the same."""
    server = InProcessServer(tokenizer, stream_interval=1)
    body = {"model": MODEL, "prompt": "Colors:", "max_tokens": 14, "stream": True, "return_token_ids": True}

    async def chunk_tokens(app, **extra) -> tuple[list[int], str]:
        events = [e for e in sse_events(await post(app, "/v1/completions", {**body, **extra})) if e["choices"]]
        return [len(e["choices"][0]["token_ids"]) for e in events], "".join(e["choices"][0]["text"] for e in events)
    every, text = await chunk_tokens(server)
    four, text_four = await chunk_tokens(server, stream_interval=4)
    assert sum(every) == sum(four) == 14 and text_four == text
    assert four[0] >= 1 and all(n >= 4 for n in four[1:-1]) and len(four) <= 5 < len(every), (four, every)
    by_flag, _ = await chunk_tokens(InProcessServer(tokenizer, stream_interval=4))
    assert all(n >= 4 for n in by_flag[1:-1]) and len(by_flag) <= 5, by_flag
