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
