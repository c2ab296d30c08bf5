"""Issue 35: every accepted input is honoured or refused, never silently served as something else.

- Architecture fields that change the math (Mistral's sliding_window, Qwen2's use_sliding_window and
  max_window_layers, head_dim overrides, rope scaling types, MLP activations and biases): a tiny random
  checkpoint gives HF transformers' greedy ids on both attention backends, under chunked prefill and prefix
  hits, or the load fails naming the field.
- prompt_logprobs of a request preempted in the middle of its chunked prefill come back whole.
- /v1/completions with echo and max_tokens 0 scores the prompt (vLLM's behaviour), checked against HF's
  logprobs; max_tokens 0 without echo stays a 400."""
from __future__ import annotations

import httpx
import pytest
import torch

from helpers import MODEL, build_tiny_model, hf_greedy
from openai_shapes import sse_events
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import runnable_isas

WINDOW = 5
MAX_TOKENS = 10
TEXTS = ["The capital of France is Paris, and the capital of Italy is",
         "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
SHARED = ("A long shared preamble that every prompt of the prefix-cache test starts with, so that the second "
          "round finds whole cached blocks longer than the window: ")
BACKENDS = ["torch_sdpa", "cpu"]


def _backend(name: str) -> str:
    if name == "cpu" and not runnable_isas():
        pytest.skip("no CPU kernel build runs here")
    return name


def _check_windowed(arch: str, kw: dict, backend: str, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """tokenmill's greedy ids equal HF's for prompts longer than the window, in chunks of 8 tokens, then again
    with a shared prefix whose blocks are cached by the first round."""
    model = build_tiny_model(arch, str(tmp_path), tokenizer_dir, tokenizer, **kw)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    prefixed = [tokenizer.encode(SHARED + t) for t in TEXTS]
    assert all(len(p) > 2 * WINDOW for p in prompts)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=8,
              attention_backend=backend, enable_prefix_caching=True)
    assert llm.engine.runner.model.fused_ops is None  # llama_forward has no window: layer by layer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for batch in (prompts, prefixed, prefixed):
        outs = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS) for p in batch]
    assert all(o.num_cached_tokens >= 16 for o in outs)  # the last round read its prefix from cached blocks
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_matches_hf(backend, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """A window of 5 tokens and a head_dim (64) that is not hidden_size / heads (32)."""
    model = _check_windowed("mistral", {"sliding_window": WINDOW, "head_dim": 64}, _backend(backend), tmp_path,
                            tokenizer_dir, tokenizer)
    assert model.config.sliding_window == WINDOW
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen2_sliding_window_layers_match_hf(backend, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """use_sliding_window with max_window_layers 1: layer 0 attends over everything, layer 1 through the window."""
    model = _check_windowed("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
                            _backend(backend), tmp_path, tokenizer_dir, tokenizer)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]


REFUSED = {  # (architecture, config fields, the field the error names)
    "activation": ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    "mlp-bias": ("llama", {"mlp_bias": True}, "mlp_bias"),
    "dynamic-rope-beyond-its-length": (
        "llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                  "max_position_embeddings": 64}, "rope_type"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unimplemented_architecture_fields_are_refused_at_load(case, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    arch, kw, field = REFUSED[case]
    build_tiny_model(arch, str(tmp_path), tokenizer_dir, tokenizer, **kw)
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=128)


ROPE_TYPES = {  # honoured: static tables (dynamic: up to max_position_embeddings, where HF's are static too)
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("rope", list(ROPE_TYPES))
def test_rope_scaling_types_match_hf(rope, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    model = build_tiny_model("llama", str(tmp_path), tokenizer_dir, tokenizer, max_position_embeddings=64,
                   rope_parameters={**ROPE_TYPES[rope], "rope_theta": 10000.0})
    assert model.config.rope_parameters["rope_type"] == rope
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    prompt = tokenizer.encode(TEXTS[1])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS)


def test_prompt_logprobs_whole_after_a_preemption_mid_prefill(tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """A pool of 6 blocks of 16 tokens and chunks of 16: a 40-token generation holds 2-3 blocks while a 75-token
    prompt with prompt_logprobs needs 5, so the prompt is preempted in the middle of its chunked prefill (its
    first chunks' logprobs already returned) and recomputed once the generation ends. Its list comes back whole:
    one entry per prompt token, equal to the unpreempted run's."""
    build_tiny_model("llama", str(tmp_path), tokenizer_dir, tokenizer)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=6,
              max_num_batched_tokens=16, max_model_len=96)
    engine = llm.engine
    long_prompt = tokenizer.encode(" ".join(TEXTS) * 2)[:75]
    assert len(long_prompt) == 75
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    engine.add_request("generation", tokenizer.encode(TEXTS[0])[:20],
                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.add_request("scored", long_prompt, scored)
    got, returned_before_preemption = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "scored":
                got += o.prompt_logprobs or []
        request = engine.scheduler.requests.get("scored")
        if returned_before_preemption is None and request is not None and request.num_preemptions:
            returned_before_preemption = len(got)
    assert returned_before_preemption is not None and 0 < returned_before_preemption < len(long_prompt)
    assert engine.stats()["num_preemptions"] > 0

    want = llm.generate([long_prompt], scored, use_tqdm=False)[0].prompt_logprobs  # alone: no preemption
    assert len(want) == len(got) == len(long_prompt)
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert (g.token_id, g.rank, g.top_token_ids) == (w.token_id, w.rank, w.top_token_ids)
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


SCORED = "The capital of France is Paris, and the capital of Italy is Rome."


def test_completions_echo_with_max_tokens_0_scores_the_prompt(server, tokenizer, hf_reference):  # noqa: F811
    """vLLM's prompt scoring (evaluation harnesses send it): the prompt comes back as the text, with HF's logprob
    of each of its tokens (the first has none), and nothing is generated: no text, ids or usage beyond it."""
    ids = tokenizer.encode(SCORED)
    body = {"model": MODEL, "prompt": SCORED, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    r = httpx.post(server.url_for("/v1/completions"), json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == SCORED and choice["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
    assert "".join(lp["tokens"]) == SCORED and lp["token_logprobs"][0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [ref[pos - 1, ids[pos]].item() for pos in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-2)  # fp32 kernels against HF's fp32

    events = sse_events(httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=120,
                                   json={**body, "logprobs": None, "stream": True,
                                         "stream_options": {"include_usage": True}}))
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == SCORED
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 0


def test_completions_max_tokens_0_without_echo_is_refused(server):  # noqa: F811
    """As vLLM: max_tokens 0 means prompt scoring only with echo; alone it is a 400 naming max_tokens."""
    r = httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=60,
                   json={"model": MODEL, "prompt": SCORED, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.text


@pytest.mark.anyio
async def test_prompt_scoring_shapes_in_process(app, tokenizer):
    """The same request on the in-process app (fake engine, milliseconds): two prompts, n 2, token ids asked for.
    Each choice is its prompt, with one logprob entry per prompt token; no generated text, ids or usage; streamed,
    the echo and then only the finish_reason."""
    prompts = ["One", "Two three"]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1, "n": 2,
            "return_token_ids": True}
    async with app.http() as client:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        for i, c in enumerate(out["choices"]):
            ids = tokenizer.encode(prompts[i // 2])
            assert c["text"] == prompts[i // 2] and c["token_ids"] == [] and c["prompt_token_ids"] == ids
            assert len(c["logprobs"]["tokens"]) == len(ids) and c["logprobs"]["token_logprobs"][0] is None
            assert c["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 0
        assert out["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
        r = await client.post("/v1/completions", json={**body, "logprobs": None, "return_token_ids": False,
                                                       "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r)
    by_choice: dict[int, list] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            by_choice.setdefault(c["index"], []).append((c["text"], c["finish_reason"]))
    assert by_choice == {i: [(prompts[i // 2], None), ("", "length")] for i in range(4)}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_user_is_on_the_log_line_and_the_span(path, tokenizer, caplog):
    """OpenAI's `user` (the client's id for its end user, for abuse monitoring) is honoured: with
    --enable-log-requests it is on the request's log line, and it is the span's `user.id`, so that an operator can
    find that user's requests."""
    import logging

    from fake_engine import InProcessServer
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tokenmill.api.tracing import RequestTracer

    app = InProcessServer(tokenizer, enable_log_requests=True)
    tracer = RequestTracer("http://127.0.0.1:9/v1/traces", include_text=False)
    tracer.provider.shutdown()  # its OTLP exporter: the spans go to memory instead
    tracer.provider, spans = TracerProvider(), InMemorySpanExporter()
    tracer.provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer.tracer = tracer.provider.get_tracer("tokenmill")
    app.state.tracer = tracer
    prompt = {"/v1/completions": {"prompt": "Hi"}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                         "content": "Hi"}]},
              "/v1/responses": {"input": "Hi"}}[path]
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    try:
        with caplog.at_level(logging.INFO, logger="tokenmill.server"):
            async with app.http() as client:
                r = await client.post(path, json={"model": MODEL, **prompt, limit: 2, "user": "user-7f3a"})
        assert r.status_code == 200, r.text
        logged = [rec.getMessage() for rec in caplog.records if "Received request" in rec.getMessage()]
        assert len(logged) == 1 and "user: user-7f3a" in logged[0], logged
        assert [s.attributes.get("user.id") for s in spans.get_finished_spans()] == ["user-7f3a"]
    finally:
        tracer.shutdown()
