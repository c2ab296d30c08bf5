"""/metrics against a real server: vLLM's names, types, labels and bucket edges, and counts that add up."""
from __future__ import annotations

import httpx

from helpers import MODEL, metric_value, scrape_metrics, wait_until
from tokenmill.server.metrics import ITL_BUCKETS, TTFT_BUCKETS


def complete(server, prompt: str, max_tokens: int, **extra) -> dict:
    r = httpx.post(server.url_for("/v1/completions"), headers=server.headers(), timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_names_types_and_buckets(server):
    m = scrape_metrics(server)
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:iteration_tokens_total": "histogram", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:cache_config_info": "gauge",  # an info metric, exposed as vLLM does: a gauge of 1 with labels
    }
    for name, kind in expected.items():
        assert name in m, name
        assert m[name]["type"] == kind, (name, m[name]["type"])
    ttft_edges = sorted(float(dict(labels)["le"]) for (s, labels) in m["vllm:time_to_first_token_seconds"]["samples"]
                        if s.endswith("_bucket"))
    assert ttft_edges == sorted([*TTFT_BUCKETS, float("inf")])
    itl_edges = sorted(float(dict(labels)["le"]) for (s, labels) in m["vllm:inter_token_latency_seconds"]["samples"]
                       if s.endswith("_bucket"))
    assert itl_edges == sorted([*ITL_BUCKETS, float("inf")])
    info = next(dict(labels) for (s, labels) in m["vllm:cache_config_info"]["samples"])
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0 and info["enable_prefix_caching"] == "True"


def test_counts_add_up(server):
    before = scrape_metrics(server)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    a = complete(server, prompt, 6, ignore_eos=True)
    b = complete(server, prompt, 5, ignore_eos=True)  # the same prompt again: a prefix-cache hit
    # A stop string that greedy decoding will meet: a piece of the text it produced unconstrained.
    free = complete(server, "Once upon a time", 12, ignore_eos=True)
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    c = complete(server, "Once upon a time", 12, stop=[stop], ignore_eos=True)
    assert c["choices"][0]["finish_reason"] == "stop"
    after = scrape_metrics(server)

    def delta(family, sample, **labels):
        return metric_value(after, family, sample, **labels) - metric_value(before, family, sample, **labels)

    prompt_tokens = sum(x["usage"]["prompt_tokens"] for x in (a, b, free, c))
    # c stopped on a string: the engine made at least the tokens it returned before the front end aborted it
    gen_tokens = 6 + 5 + 12 + c["usage"]["completion_tokens"]
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") >= gen_tokens
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 4
    # one inter-token gap per token after the first: 5 + 4 + 11 for a, b and free, and more for c
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") >= 21
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") >= gen_tokens
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") >= prompt_tokens
    assert delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") >= 16  # b reused a's full blocks
    # every token computed went through some step; cache hits are not computed again
    iteration = delta("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum")
    assert prompt_tokens - delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") <= iteration
    assert delta("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum") > 0
    # c's abort reaches the engine after its response reached us; the engine reports the state it leaves (no step
    # follows an abort), so the gauge falls to 0 within a moment of the response, not necessarily before it.
    wait_until(lambda: metric_value(scrape_metrics(server), "vllm:num_requests_running",
                                    "vllm:num_requests_running") == 0, timeout_s=10, interval_s=0.05,
               message="vllm:num_requests_running to fall to 0")
