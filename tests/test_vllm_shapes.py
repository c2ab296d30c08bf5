"""vLLM's response shapes, exactly, where a client written against vLLM reads them (vLLM's tests/entrypoints/openai/
and vllm/entrypoints/openai/*/protocol.py): the fields it always sends, usage's prompt_tokens_details, where a stream
puts finish_reason and usage, the order of completions' top_logprobs, /invocations, and lax request types.

In-process, on the fake engine (tests/fake_engine.py): these are shapes, not model behaviour."""
from __future__ import annotations

import pytest
from fake_engine import MODEL, InProcessServer, post
from openai_shapes import sse_events

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}


# ---- the fields vLLM always sends ----

async def test_whole_responses_carry_every_vllm_field_as_null(app):
    """vLLM's ChatCompletionResponse / CompletionResponse are dumped whole: an extra not asked for is null, never
    absent (a client reads `response.prompt_token_ids`)."""
    chat = (await post(app, "/v1/chat/completions", CHAT)).json()
    for name in ("service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids", "prompt_text",
                 "kv_transfer_params"):
        assert name in chat and chat[name] is None, name
    choice = chat["choices"][0]
    assert choice["token_ids"] is None and choice["stop_reason"] is None and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None, "tool_calls": []}
    completion = (await post(app, "/v1/completions", COMPLETION)).json()
    for name in ("service_tier", "system_fingerprint", "kv_transfer_params"):
        assert name in completion and completion[name] is None, name
    choice = completion["choices"][0]
    for name in ("token_ids", "prompt_logprobs", "prompt_token_ids", "stop_reason", "logprobs"):
        assert name in choice and choice[name] is None, name


async def test_stream_chunks_carry_vllms_fields_as_null(app):
    """vLLM's stream choices carry token_ids (null unless return_token_ids), and completions' prompt_token_ids;
    chat's chunks prompt_token_ids and prompt_text: a client reading them as attributes on any chunk finds them."""
    chat = [e for e in sse_events(await post(app, "/v1/chat/completions", {**CHAT, "stream": True}))
            if isinstance(e, dict)]
    for event in chat:
        assert event["prompt_token_ids"] is None and event["prompt_text"] is None, event
        for choice in event["choices"]:
            for name in ("token_ids", "logprobs", "finish_reason", "stop_reason"):
                assert name in choice and (choice[name] is None or name == "finish_reason"), (name, event)
    completion = [e for e in sse_events(await post(app, "/v1/completions", {**COMPLETION, "stream": True,
                                                                            "echo": True})) if isinstance(e, dict)]
    for event in completion:
        assert "usage" in event, event
        for choice in event["choices"]:
            for name in ("token_ids", "prompt_token_ids", "logprobs", "stop_reason"):
                assert name in choice and choice[name] is None, (name, event)
    # asked for, they are there as before: the prompt's ids in each choice's first chunk only
    asked = [e for e in sse_events(await post(app, "/v1/completions", {**COMPLETION, "stream": True, "n": 2,
                                                                       "return_token_ids": True}))
             if isinstance(e, dict)]
    firsts = [c for e in asked for c in e["choices"] if c["prompt_token_ids"] is not None]
    assert sorted(c["index"] for c in firsts) == [0, 1]
    assert all(isinstance(c["token_ids"], list) for e in asked for c in e["choices"])


# ---- usage.prompt_tokens_details: only with --enable-prompt-tokens-details ----

async def test_prompt_tokens_details_only_with_the_flag(tokenizer):
    """vLLM sends prompt_tokens_details only with --enable-prompt-tokens-details and a prefix-cache hit: null in a
    whole response otherwise, and absent from a stream's usage chunk."""
    plain, flagged = InProcessServer(tokenizer), InProcessServer(tokenizer, enable_prompt_tokens_details=True)
    for app in (plain, flagged):
        app.client.num_cached_tokens = 16
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert (await post(plain, path, body)).json()["usage"]["prompt_tokens_details"] is None
        assert (await post(flagged, path, body)).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert "prompt_tokens_details" not in sse_events(await post(plain, path, streamed))[-1]["usage"]
        assert sse_events(await post(flagged, path, streamed))[-1]["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 16}
    flagged.client.num_cached_tokens = 0  # no hit: nothing to detail, as vLLM
    assert (await post(flagged, "/v1/completions", COMPLETION)).json()["usage"]["prompt_tokens_details"] is None


# ---- /invocations ----

# vllm/entrypoints/openai/chat_completion/protocol.py's ChatCompletionResponse, every field
VLLM_CHAT_RESPONSE_KEYS = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                           "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params"}


async def test_invocations_answers_with_the_keys_of_chat_completions(app):
    """vLLM's test_invocations: the OpenAI SDK's dump of the chat completion and the /invocations JSON for the
    same body have the same keys (those of vLLM's ChatCompletionResponse; this SDK's own additions aside) and the
    same choices."""
    from openai.types.chat import ChatCompletion
    body = {**CHAT, "max_completion_tokens": 5, "temperature": 0.0, "logprobs": False}
    body.pop("max_tokens")
    chat = (await post(app, "/v1/chat/completions", body)).json()
    sdk = ChatCompletion.model_validate(chat).model_dump()
    invocation = (await post(app, "/invocations", body)).json()
    assert chat.keys() == invocation.keys() == VLLM_CHAT_RESPONSE_KEYS
    assert VLLM_CHAT_RESPONSE_KEYS <= sdk.keys()
    assert sdk["choices"] == invocation["choices"]


# ---- streams: finish_reason on the last token's chunk, the usage total on a chunk without choices ----

def _choice_chunks(events: list) -> dict[int, list]:
    """Each choice's chunks (those with choices), in order, as (choice, the chunk's usage)."""
    out: dict[int, list] = {}
    for e in events:
        for c in e["choices"]:
            out.setdefault(c["index"], []).append((c, e.get("usage")))
    return out


@pytest.mark.parametrize("path,body,text", [
    ("/v1/chat/completions", CHAT, lambda c: c["delta"].get("content") or ""),
    ("/v1/completions", COMPLETION, lambda c: c["text"])], ids=["chat", "completions"])
async def test_stream_finish_reason_rides_on_the_last_token(app, path, body, text):
    """As vLLM: one chunk per token (after chat's role chunk), the last one carrying finish_reason, so continuous
    usage reaches max_tokens on a chunk with choices; then the include_usage total with `choices: []`. With n 2,
    each choice's own."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(await post(app, path, {**body, "n": 2, "stream": True, "stream_options": opts}))
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 2 * body["max_tokens"]
    per_choice = _choice_chunks(chunks)
    assert set(per_choice) == {0, 1}
    for index, seen in per_choice.items():
        if "chat" in path:
            assert seen[0][0]["delta"] == {"role": "assistant", "content": ""}
            seen = seen[1:]
        assert len(seen) == body["max_tokens"]  # no chunk of its own for the finish
        assert all(text(c) for c, _ in seen)  # each carries its token's text, the last one too
        assert [c["finish_reason"] for c, _ in seen] == [None] * (body["max_tokens"] - 1) + ["length"]
        assert [u["completion_tokens"] for _, u in seen] == list(range(1, body["max_tokens"] + 1))


@pytest.mark.parametrize("path,body,text", [
    ("/v1/chat/completions", CHAT, lambda c: c["delta"].get("content") or ""),
    ("/v1/completions", COMPLETION, lambda c: c["text"])], ids=["chat", "completions"])
async def test_stream_finish_with_a_stop_string(app, path, body, text):
    """A stop string trims the final text: the finish_reason and stop_reason still come on the last chunk of the
    choice, once, and the text streamed is the trimmed one."""
    events = sse_events(await post(app, path, {**body, "max_tokens": 10, "n": 2, "stream": True,
                                               "stop": [" green"]}))
    for index, seen in _choice_chunks(events).items():
        ends = [(c["finish_reason"], c["stop_reason"]) for c, _ in seen if c["finish_reason"] is not None]
        assert ends == [("stop", " green")] and seen[-1][0]["finish_reason"] == "stop"
        assert "".join(text(c) for c, _ in seen) == " Red,"


# ---- completions logprobs: the chosen token first in top_logprobs ----

async def test_completion_top_logprobs_list_the_chosen_token_first(app, tokenizer):
    """vLLM's top_logprobs[i] starts with tokens[i], then the top alternatives: for an echoed prompt token that
    is not the argmax (the fake engine ranks token + 1 above it), the map has k + 1 entries."""
    body = {**COMPLETION, "echo": True, "logprobs": 1, "max_tokens": 2}
    lp = (await post(app, "/v1/completions", body)).json()["choices"][0]["logprobs"]
    prompt_ids = tokenizer.encode(COMPLETION["prompt"])
    assert lp["top_logprobs"][0] is None
    for i, (token, top) in enumerate(zip(lp["tokens"][1:], lp["top_logprobs"][1:]), 1):
        assert next(iter(top)) == token and top[token] == lp["token_logprobs"][i]
        assert len(top) == (2 if i < len(prompt_ids) else 1)  # prompt: token + the argmax; generated: the argmax
