"""vLLM parity (issue 19): the request fields, response fields, endpoints and metrics that code written against
vLLM's OpenAI server relies on, through the `openai` SDK (httpx where the SDK has no field) against the real
server. Shapes and values are vLLM's (vllm/entrypoints/openai, vllm/v1/metrics/loggers.py).

Most tests share the session's server (helpers.SERVER_ARGS, which enables /tokenizer_info and /load); the
server flags that change every answer (--return-tokens-as-token-ids, --enable-force-include-usage, --max-logprobs
-1) get one module server."""
from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import MODEL, RemoteServer

GREEDY = {"temperature": 0.0}
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def flags_server():
    s = RemoteServer(["--return-tokens-as-token-ids", "--enable-force-include-usage", "--max-logprobs", "-1"])
    yield s
    s.stop()


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url_for(path), json={"model": MODEL, **body}, headers=server.headers(), timeout=120, **kw)


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# ---- 1, 2: forced tool calls ----

UNIT = {"type": "object", "properties": {"unit": {"enum": ["cm", "in"]}}, "required": ["unit"],
        "additionalProperties": False}
COLOR = {"type": "object", "properties": {"rgb": {"enum": ["red", "green"]}}, "required": ["rgb"],
         "additionalProperties": False}


def _tool(name: str, prop: str, defs: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {prop: {"$ref": "#/$defs/Thing"}}, "required": [prop],
        "additionalProperties": False, "$defs": {"Thing": defs}}}}


def test_required_tool_choice_with_defs(server):
    """Both tools define `$defs/Thing`, differently: the grammar hoists them (renaming the second), so each call's
    arguments follow its own tool's definition."""
    client = server.openai()
    tools = [_tool("measure", "length", UNIT), _tool("paint", "color", COLOR)]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required",
                                       max_tokens=60, **GREEDY)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "measure":
            assert set(args) == {"length"} and args["length"]["unit"] in ("cm", "in")
        else:
            assert set(args) == {"color"} and args["color"]["rgb"] in ("red", "green")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "measure"}}])
def test_forced_tool_call_cut_by_max_tokens(server, tool_choice):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[_tool("measure", "length", UNIT)],
                                       tool_choice=tool_choice, max_tokens=2, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert not re.search(r"[\[{]", choice.message.content or ""), choice.message.content


# ---- 3: stream_options without stream ----

def test_stream_options_need_stream(server):
    client = server.openai()
    for create, body in ((client.completions.create, {"prompt": "Hi"}),
                         (client.chat.completions.create, {"messages": USER})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, stream_options={"include_usage": True}, **body)
        assert e.value.body["param"] == "stream_options" and "stream=True" in e.value.body["message"]


# ---- 4: metrics ----

def _scrape(server) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(server.url_for("/metrics"), timeout=30).text.splitlines():
        if line.startswith("vllm:"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            out[name, labels.rstrip("}")] = float(value)
    return out


def _value(m: dict, name: str, **labels) -> float:
    want = {f'{k}="{v}"' for k, v in labels.items()}
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab.split(",")))


def test_metrics_as_vllm_counts_them(server):
    prompt = list(range(1000, 1009))  # 9 prompt tokens
    before = _scrape(server)
    for _ in range(10):
        _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, **GREEDY})
    _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "n": 2, "ignore_eos": True})
    after = _scrape(server)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)
    # vLLM: per step with outputs, new tokens + the whole prompt of each request's first output: 10 * (9 + 10)
    # and then 2 * (9 + 3)
    assert delta("vllm:iteration_tokens_total_sum") == 10 * 19 + 2 * 12
    assert delta("vllm:request_params_n_count") == 11 and delta("vllm:request_params_n_sum") == 12
    assert delta("vllm:request_params_n_bucket", le="1.0") == 10 and delta("vllm:request_params_n_bucket",
                                                                            le="2.0") == 11
    assert delta("vllm:request_params_max_tokens_count") == 12
    assert delta("vllm:request_params_max_tokens_sum") == 10 * 10 + 2 * 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == 10 * 10 + 3
    buckets = [lab for (n, lab) in after if n == "vllm:request_params_n_bucket"]
    assert {re.search(r'le="([^"]+)"', b).group(1) for b in buckets} == {"1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"}
    waiting = _value(after, "vllm:num_requests_waiting")
    by_reason = {r: _value(after, "vllm:num_requests_waiting_by_reason", reason=r) for r in ("capacity", "deferred")}
    assert ("vllm:num_requests_waiting_by_reason", f'model_name="{MODEL}",reason="deferred"') in after
    assert sum(by_reason.values()) == waiting


# ---- 5: /tokenize return_token_strs ----

def test_tokenize_token_strs_are_vocabulary_pieces(server, tokenizer):
    r = _post(server, "/tokenize", {"prompt": "The capital is", "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"]) and "Ġcapital" in r["token_strs"]


# ---- 6: prompt_logprobs ----

def test_prompt_logprobs_match_hf(server, tokenizer, hf_reference):
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = tokenizer.encode(prompt)
    r = server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                           extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry and 2 <= len(entry) <= 3  # the prompt's token and the top 2
        for token, lp in entry.items():
            assert lp["logprob"] == pytest.approx(ref[pos - 1, int(token)].item(), abs=1e-2)  # fp32 kernels
            assert lp["decoded_token"] == tokenizer.decode([int(token)])
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in top][:2] == [1, 2] and top[0]["logprob"] == max(e["logprob"] for e in top)
    # chat: top level, one entry per prompt token
    chat = server.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                                   extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])


@pytest.mark.parametrize("body,fragment", [
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "Requested prompt logprobs of 49152, which is greater than max allowed: 20"),
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
])
def test_prompt_logprobs_refused(server, body, fragment):
    for path, payload in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = _post(server, path, {**payload, "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert fragment in r.json()["error"]["message"]


# ---- 7, 8: return_token_ids, return_tokens_as_token_ids ----

def test_return_token_ids_and_tokens_as_ids(server, tokenizer):
    client = server.openai()
    prompt = "The capital of France is"
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, extra_body=extra, **GREEDY)
    c = r.choices[0]
    assert c.model_extra["prompt_token_ids"] == tokenizer.encode(prompt)
    token_ids = c.model_extra["token_ids"]
    assert len(token_ids) == r.usage.completion_tokens and tokenizer.decode(token_ids) == c.text
    assert c.logprobs.tokens == [f"token_id:{t}" for t in token_ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in c.logprobs.top_logprobs)
    stream = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True, extra_body=extra,
                                            **GREEDY))
    assert stream[0].choices[0].model_extra["prompt_token_ids"] == tokenizer.encode(prompt)
    assert [t for ch in stream for t in ch.choices[0].model_extra["token_ids"]] == token_ids
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, logprobs=True, top_logprobs=1,
                                          extra_body=extra, **GREEDY)
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, stream=True,
                                                 extra_body=extra, **GREEDY))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for ch in chunks for c in ch.choices for t in c.model_extra["token_ids"]] == ids


def test_tokens_as_ids_flag_and_force_usage(flags_server):
    client = flags_server.openai()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0, **GREEDY)
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": False}, **GREEDY)
    assert not any(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    # --enable-force-include-usage: usage in every chunk and a final usage chunk, unasked
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, stream=True, **GREEDY))
    assert all(ch.usage is not None for ch in chunks) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4


# ---- 9: continuous usage ----

def test_continuous_usage_stats(server):
    client = server.openai()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, body in ((client.completions.create, {"prompt": "Hello"}),
                         (client.chat.completions.create, {"messages": USER})):
        chunks = list(create(model=MODEL, max_tokens=5, stream=True, stream_options=opts,
                             extra_body={"ignore_eos": True}, **GREEDY, **body))
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == 5
        counts = [ch.usage.completion_tokens for ch in chunks[:-1]]
        assert all(ch.usage is not None and ch.usage.prompt_tokens == final.usage.prompt_tokens for ch in chunks)
        assert counts == sorted(counts) and counts[-1] == 5
        plain = list(create(model=MODEL, max_tokens=2, stream=True, stream_options={"include_usage": True}, **body))
        assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage is not None


# ---- 11: chat echo ----

def test_chat_echo_with_continue_final_message(server):
    client = server.openai()
    prefix = "The capital of France is"
    messages = [*USER, {"role": "assistant", "content": prefix}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=body, **GREEDY)
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            extra_body={**body, "echo": True}, **GREEDY)
    assert echoed.choices[0].message.content == prefix + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                 extra_body={**body, "echo": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content


# ---- 12: logprobs values vLLM accepts ----

def test_logprobs_minus_one_bounded_by_max_logprobs(server, flags_server, tokenizer):
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "logprobs": True,
                                                "top_logprobs": -1})
    assert r.status_code == 400 and "greater than max allowed: 20" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    ok = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "top_logprobs": 0})
    assert ok.status_code == 200  # 0 is the default: allowed without logprobs
    vocab = len(tokenizer)
    chat = flags_server.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=1, logprobs=True,
                                                         top_logprobs=-1)
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == vocab and math.isclose(sum(math.exp(t.logprob) for t in top), 1.0, abs_tol=1e-3)
    comp = flags_server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=-1)
    assert len(comp.choices[0].logprobs.top_logprobs[0]) == vocab  # keys "token_id:N" (the flag): all distinct


# ---- 13: endpoints and headers ----

def test_tokenizer_info(server, tokenizer):
    info = httpx.get(server.url_for("/tokenizer_info")).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and "vocab_file" not in info


def test_invocations_dispatch_on_the_body(server):
    chat = _post(server, "/invocations", {"messages": USER, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"
    comp = _post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2}).json()
    assert comp["object"] == "text_completion"
    bad = _post(server, "/invocations", {"input": "Hi"})
    assert bad.status_code == 400 and "Cannot find suitable handler" in bad.json()["error"]["message"]


def test_server_load(server):
    assert httpx.get(server.url_for("/load")).json() == {"server_load": 0}
    seen = []

    def poll():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not seen:
            load = httpx.get(server.url_for("/load")).json()["server_load"]
            if load:
                seen.append(load)
            time.sleep(0.02)
    thread = threading.Thread(target=poll)
    thread.start()
    _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 60, "ignore_eos": True})
    thread.join()
    assert seen == [1]
    assert httpx.get(server.url_for("/load")).json() == {"server_load": 0}


def test_orca_load_report_header(server):
    body = {"messages": USER, "max_tokens": 1}
    assert "endpoint-load-metrics" not in _post(server, "/v1/chat/completions", body).headers
    r = httpx.post(server.url_for("/v1/completions"), json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                   headers={**server.headers(), "endpoint-load-metrics-format": "TEXT"})
    assert re.fullmatch(r"TEXT named_metrics\.kv_cache_usage_perc=[0-9.e-]+, named_metrics\.num_requests_waiting="
                        r"[0-9.]+", r.headers["endpoint-load-metrics"])
    r = httpx.post(server.url_for("/v1/chat/completions"), json={"model": MODEL, **body},
                   headers={**server.headers(), "endpoint-load-metrics-format": "JSON"})
    kind, report = r.headers["endpoint-load-metrics"].split(" ", 1)
    assert kind == "JSON" and set(json.loads(report)["named_metrics"]) == {"kv_cache_usage_perc",
                                                                          "num_requests_waiting"}


def test_batch_chat_completions(server):
    convs = [USER, [{"role": "user", "content": "Name a color."}]]
    r = _post(server, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 5, **GREEDY}).json()
    assert r["object"] == "chat.completion" and [c["index"] for c in r["choices"]] == [0, 1]
    prompt_tokens = 0
    for conv, choice in zip(convs, r["choices"]):
        single = server.openai().chat.completions.create(model=MODEL, messages=conv, max_tokens=5, **GREEDY)
        assert choice["message"]["content"] == single.choices[0].message.content
        prompt_tokens += single.usage.prompt_tokens
    assert r["usage"]["prompt_tokens"] == prompt_tokens
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n")):
        bad = _post(server, "/v1/chat/completions/batch", {"messages": convs, "max_tokens": 2, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


# ---- every vLLM request field: honoured, or a 400 that names it ----

# vLLM's CompletionRequest / ChatCompletionRequest sampling and extra fields (vllm/entrypoints/openai/
# completion/protocol.py, chat_completion/protocol.py), each with a value that is not its default, sent alone (so
# length_penalty and early_stopping, which only beam search reads, are refused without use_beam_search).
COMMON_FIELDS = {
    "use_beam_search": True, "length_penalty": 1.5, "early_stopping": True,
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "watermarking": True, "stop_token_ids": [5],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4, "truncation_side": "right",
    "prompt_logprobs": 1, "logprob_token_ids": [5], "allowed_token_ids": [5, 6], "bad_words": ["Paris"],
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[a-z]+"}, "priority": 1,
    "request_id": "my-id", "session_id": "s1", "return_tokens_as_token_ids": True, "return_token_ids": True,
    "return_token_offsets": True, "return_mm_kwargs": False, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"max_pattern_size": 2},
    "thinking_token_budget": 4, "stream_interval": 2, "routed_experts_prompt_start": 1, "seed": 3, "n": 2,
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "echo": True, "logprobs": 2, "add_special_tokens": False,
                     "prompt_embeds": "AAAA", "suffix": "x"}
CHAT_FIELDS = {**COMMON_FIELDS, "echo": True, "logprobs": True, "top_logprobs": 2, "add_special_tokens": True,
               "add_generation_prompt": False, "continue_final_message": True, "documents": [{"text": "x"}],
               "chat_template": "{{ messages }}", "chat_template_kwargs": {"a": 1}, "media_io_kwargs": {"a": {}},
               "mm_processor_kwargs": {"a": 1}, "reasoning_effort": "low", "include_reasoning": False,
               "return_prompt_text": True, "parallel_tool_calls": False}
# What the honoured fields must show in the answer
SHOWN = {"prompt_logprobs": "prompt_logprobs", "return_token_ids": "token_ids"}


@pytest.mark.parametrize("path,fields", [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)])
def test_every_vllm_field_is_honoured_or_refused(server, path, fields):
    base = {"prompt": "The capital of France is"} if "chat" not in path else {
        "messages": [*USER, {"role": "assistant", "content": "It is"}]}
    honoured = []
    for name, value in fields.items():
        r = _post(server, path, {**base, "max_tokens": 1, name: value})
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] == name or name in err["message"], (name, err)
            continue
        assert r.status_code == 200, (name, r.text)
        honoured.append(name)
        if name in SHOWN:
            assert SHOWN[name] in r.text, name
    # the refusals are the fields tokenmill does not implement, and only those
    assert {"top_k", "min_p", "prompt_logprobs", "return_token_ids", "truncate_prompt_tokens", "echo",
            "return_tokens_as_token_ids", "add_special_tokens", "use_beam_search", "allowed_token_ids", "bad_words",
            "cache_salt", "stream_interval"} <= set(honoured)
    assert not {"length_penalty", "early_stopping", "watermarking", "logprob_token_ids", "kv_transfer_params",
                "vllm_xargs"} & set(honoured)


def test_allowed_token_ids_and_bad_words(server, tokenizer):
    """vLLM's allowed_token_ids (every generated token among them) and bad_words (the greedy answer's own word
    never appears once banned, and the answer is the same up to where it came)."""
    client = server.openai()
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert "Paris" in plain.choices[0].text
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    text, head = banned.choices[0].text, plain.choices[0].text.split("Paris")[0]
    assert "Paris" not in text and text.startswith(head), (plain.choices[0].text, text)  # the same up to the word
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    r = httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "return_token_ids": True,
        "allowed_token_ids": allowed})
    assert r.status_code == 200 and set(r.json()["choices"][0]["token_ids"]) <= set(allowed), r.text
    bad = httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=60, json={
        "model": MODEL, "prompt": prompt, "allowed_token_ids": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"
