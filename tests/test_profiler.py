"""vLLM's torch profiler (VLLM_TORCH_PROFILER_DIR): LLM.start_profile / stop_profile on the tiny model, and POST
/start_profile, /stop_profile on a real server (the engine process records, the trace lands in the directory);
without the variable the routes are not served, as in vLLM."""
from __future__ import annotations

import gzip
import json

import httpx
import pytest
from helpers import RemoteServer

from tokenmill import SamplingParams


def trace_events(directory) -> list[dict]:
    [trace] = list(directory.glob("*.pt.trace.json.gz"))
    with gzip.open(trace) as f:
        return json.load(f)["traceEvents"]


def test_offline_profile_records_the_steps(tiny_llm, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    with pytest.raises(ValueError, match="not running"):
        tiny_llm.stop_profile()
    tiny_llm.start_profile()
    try:
        with pytest.raises(ValueError, match="already running"):
            tiny_llm.start_profile()
        tiny_llm.generate(["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        tiny_llm.stop_profile()
    names = {e.get("name", "") for e in trace_events(tmp_path / "traces")}
    assert any(name.startswith("aten::") for name in names)  # the model's ops, as torch ran them


def test_profiling_is_off_without_a_directory(tiny_llm, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        tiny_llm.start_profile()


@pytest.mark.slow  # starts a server
def test_server_profile_endpoints(tiny_llama_dir, tmp_path):
    directory = tmp_path / "traces"
    server = RemoteServer(model=tiny_llama_dir, server_args=["--max-model-len", "512", "--dtype", "float32",
                                                             "--kv-cache-memory", "64MiB"],
                          env={"VLLM_TORCH_PROFILER_DIR": str(directory)})
    try:
        url, headers = server.url_for, server.headers()
        assert httpx.post(url("/start_profile"), headers=headers, timeout=60).status_code == 200
        again = httpx.post(url("/start_profile"), headers=headers, timeout=60)
        assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
        r = httpx.post(url("/v1/completions"), headers=headers, timeout=60,
                       json={"model": tiny_llama_dir, "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200
        assert httpx.post(url("/stop_profile"), headers=headers, timeout=600).status_code == 200
        assert any(e.get("name", "").startswith("aten::") for e in trace_events(directory))
    finally:
        server.stop()


@pytest.mark.anyio
async def test_routes_are_served_only_with_a_directory(app):
    from fake_engine import post
    assert (await post(app, "/start_profile", {})).status_code == 404
