"""The OpenAI-compatible server, through the official openai SDK and raw HTTP, against a real `tokenmill serve`."""
from __future__ import annotations


import httpx
import pytest
from openai_shapes import sse_events
from helpers import MODEL

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


def test_health_version_models(server):
    assert httpx.get(server.url_for("/health")).status_code == 200
    assert httpx.get(server.url_for("/version")).json()["version"]
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_request_id_header(server):
    r = httpx.get(server.url_for("/v1/models"), headers={**server.headers(), "X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.url_for("/v1/models"), headers=server.headers())
    assert len(r.headers["x-request-id"]) >= 16


def test_chat_completion(server, tokenizer):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt_ids, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 12


def test_usage_matches_tokenizer(server, tokenizer):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=7, logprobs=True,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 == len(r.choices[0].logprobs.content)
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 5


def test_completion_prompt_forms(server, tokenizer):
    client = server.openai()
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion" and by_text.choices[0].text == by_ids.choices[0].text
    several = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two, three,"], max_tokens=6, temperature=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == by_text.choices[0].text
    assert several.usage.prompt_tokens == len(ids) + len(tokenizer.encode("One, two, three,"))
    id_lists = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in id_lists.choices] == [by_text.choices[0].text] * 2
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_completion_default_max_tokens_is_16(server):
    r = server.openai().completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_streaming_matches_non_streaming(server):
    client = server.openai()
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_sse_framing(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    r = httpx.post(server.url_for("/v1/chat/completions"), json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    first, *content, usage = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    assert content and all(set(e["choices"][0]["delta"]) == {"content"} for e in content)
    # as vLLM: the last token's chunk carries finish_reason
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert len({e["id"] for e in events}) == 1

    body["stream_options"] = None
    events = sse_events(httpx.post(server.url_for("/v1/chat/completions"), json=body, headers=server.headers(),
                                    timeout=120))
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-1]


def test_completion_sse_framing(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(httpx.post(server.url_for("/v1/completions"), json=body, headers=server.headers(),
                                    timeout=120))
    *content, finish, usage = events
    assert all(e["object"] == "text_completion" and e["choices"][0]["finish_reason"] is None for e in content)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["text"]  # the last token's
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_n_choices(server):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=1,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, seed=1, stream=True,
                                                 extra_body={"ignore_eos": True}))
    texts = ["", ""]
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert texts == [c.message.content for c in r.choices] and finished == {0, 1}
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon"], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]


def test_seed_reproducibility(server):
    client = server.openai()

    def sample(seed):
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b and a != c


def test_stop_strings(server):
    client = server.openai()
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    cut = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    raw = httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": stop,
        "include_stop_str_in_output": True}).json()
    assert raw["choices"][0]["text"] == cut + stop and raw["choices"][0]["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(server):
    r = server.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the most likely
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert bytes(t.bytes).decode(errors="replace") == t.token
    chunks = list(server.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                          logprobs=True, top_logprobs=3, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_completion_logprobs(server):
    r = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(logprob) and top[tok] == pytest.approx(logprob)
    echoed = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                                echo=True)
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None and "".join(lp.tokens) == echoed.choices[0].text


def test_vllm_sampling_extras(server):
    r = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 8, "skip_special_tokens": True},
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"11": -100}, top_p=0.9, temperature=0.7, user="u1")
    assert r.usage.completion_tokens == 8


def test_chat_roles_and_content_parts(server, tokenizer):
    client = server.openai()
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hi!"},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                {"role": "user", "content": "And?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello\nthere"},
         {"role": "assistant", "content": "Hi!"}, {"role": "tool", "content": "42"},
         {"role": "user", "content": "And?"}], add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    # continue_final_message: the prompt ends inside the assistant message
    tok = httpx.post(server.url_for("/tokenize"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert httpx.post(server.url_for("/detokenize"), json={"tokens": tok["tokens"]}).json()["prompt"].endswith("Well,")


def test_tokenize_detokenize(server, tokenizer):
    r = httpx.post(server.url_for("/tokenize"), json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    # vLLM's token_strs are vocabulary pieces (byte-level BPE: "Ġcapital"), not decoded text
    assert body["max_model_len"] == 2048 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    r = httpx.post(server.url_for("/detokenize"), json={"model": MODEL, "tokens": body["tokens"]})
    assert r.json() == {"prompt": PROMPT}
    chat = httpx.post(server.url_for("/tokenize"), json={"model": MODEL, "messages": CHAT}).json()
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_metrics_endpoint(server):
    r = httpx.get(server.url_for("/metrics"))
    assert r.status_code == 200
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in r.text
    values = server.metrics()
    assert set(values) >= {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0


def test_cors_preflight(server):
    r = httpx.options(server.url_for("/v1/chat/completions"), headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")
