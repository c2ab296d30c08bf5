"""Observability with real tools: OTLP spans caught by a receiver in the test, a real Prometheus server scraping
under load, and the dashboard rendered by headless Chromium (which saves a screenshot).

Slow: every test starts a real server, and two install Debian packages (Prometheus, Chromium)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading

import httpx
import pytest

from helpers import MODEL, OtlpReceiver, RemoteServer, ensure_debian_package, free_port, wait_until

pytestmark = pytest.mark.slow

ARTIFACTS = os.environ.get("TOKENMILL_TEST_ARTIFACTS", os.path.join(os.path.dirname(__file__), "artifacts"))


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def obs_server(receiver, tiny_llama_dir):
    """Traces, metrics and the dashboard are the server's: the tiny random model, served under the default
    model's name, starts in seconds."""
    s = RemoteServer(["--otlp-traces-endpoint", receiver.url, "--served-model-name", MODEL],
                     env={"OTEL_BSP_SCHEDULE_DELAY": "100"}, model=tiny_llama_dir)
    yield s
    s.stop()


class Load:
    """Requests in a loop from a few threads, until stopped: traffic for the scrapers to see."""

    def __init__(self, server, threads: int = 3):
        self.server, self.stop_event, self.done = server, threading.Event(), 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            r = httpx.post(self.server.url_for("/v1/completions"), timeout=120, json={
                "model": MODEL, "prompt": f"Thread {i} request {n}: tell me about rivers", "max_tokens": 16,
                "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
            self.done += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        for t in self.threads:
            t.join(180)


def test_trace_continues_the_callers_traceparent(obs_server, receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    secret = "a prompt that must not be exported"
    r = httpx.post(obs_server.url_for("/v1/completions"), timeout=120,
                   headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                   json={"model": MODEL, "prompt": secret, "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                         "ignore_eos": True})
    assert r.status_code == 200
    spans = wait_until(lambda: [s for s in receiver.spans if s["trace_id"] == trace_id], timeout_s=20,
                       interval_s=0.2, message=lambda: f"a span of trace {trace_id}; spans so far: {receiver.spans}")
    assert len(spans) == 1, receiver.spans
    span = spans[0]
    assert span["parent_span_id"] == parent_id
    a = span["attributes"]
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    for key in ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{key}"] >= 0, key
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"] > 0
    assert span["end"] > span["start"]
    assert not any(secret in str(v) for v in a.values())  # no text unless --otlp-traces-include-text


def test_real_prometheus_scrapes_under_load(obs_server):
    prometheus = ensure_debian_package("prometheus", "prometheus")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tokenmill-prom-") as tmp:
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tokenmill\n"
                    f"    static_configs:\n      - targets: ['127.0.0.1:{obs_server.port}']\n")
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            answers: dict[str, str] = {}

            def query(q: str) -> list | None:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": q}, timeout=10)
                answers[q] = r.text
                if r.status_code != 200 or r.json()["status"] != "success":
                    return None  # Prometheus still starting up (a bad query: the timeout message shows the answer)
                return r.json()["data"]["result"]

            def positive(result: list | None) -> bool:
                return bool(result) and float(result[0]["value"][1]) > 0

            queries = {"rate": "rate(vllm:generation_tokens_total[30s])",
                       "p99": "histogram_quantile(0.99, rate(vllm:time_to_first_token_seconds_bucket[1m]))"}
            seen: dict[str, list | None] = {}

            def scraped_the_load() -> bool:
                # scraped every second: rate() needs two samples of the growing counter, the quantile first tokens
                # inside its window
                for key, q in queries.items():
                    seen[key] = query(q)
                return all(positive(result) for result in seen.values())

            with Load(obs_server):
                wait_until(scraped_the_load, timeout_s=120, interval_s=1, retry_on=(httpx.TransportError,),
                           message=lambda: f"Prometheus to see the load; last answers: {answers}")
            rate, p99 = seen["rate"], seen["p99"]
        finally:
            proc.terminate()
            proc.wait(30)
    assert rate and float(rate[0]["value"][1]) > 0, rate
    assert p99 and float(p99[0]["value"][1]) > 0, p99
    print(f"\nPrometheus: rate(generation_tokens_total[30s]) = {float(rate[0]['value'][1]):.2f}, "
          f"TTFT p99 = {float(p99[0]['value'][1]):.3f} s")


def test_dashboard_renders_live_charts_in_chromium(obs_server):
    chromium = ensure_debian_package("chromium", "chromium")
    page = httpx.get(obs_server.url_for("/dashboard"))
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "http://" not in page.text and "https://" not in page.text  # self-contained: no CDN
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "dashboard.png")
    if os.path.exists(shot):
        os.remove(shot)
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1400,800", "--virtual-time-budget=12000"]
    with Load(obs_server) as load:
        # the page charts what the server has served: wait until every load thread has had a request completed, so
        # that there are first-token latencies and token counts to show
        wait_until(lambda: load.done >= len(load.threads), timeout_s=120, interval_s=0.2,
                   message=lambda: f"the load to complete a request per thread ({load.done} done)")
        dom = subprocess.run([*base, "--dump-dom", obs_server.url_for("/dashboard")], capture_output=True,
                             text=True, timeout=120).stdout
        subprocess.run([*base, f"--screenshot={shot}", obs_server.url_for("/dashboard")], capture_output=True,
                       timeout=120)
    # the page's script read /metrics and filled the cards in
    def text_of(element_id: str) -> str:
        match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
        assert match, f"#{element_id} not in the rendered page"
        return match.group(1)

    assert text_of("status").startswith(f"model {MODEL} · updated"), text_of("status")
    assert re.fullmatch(r"\d+ running, \d+ waiting", text_of("reqs-value"))
    assert re.fullmatch(r"[\d.]+ gen, [\d.]+ prompt", text_of("toks-value"))
    assert text_of("kv-value").endswith(" %")
    assert re.fullmatch(r"p50 [\d.]+ / p99 [\d.]+ ms", text_of("ttft-value")), text_of("ttft-value")
    assert re.fullmatch(r"[\d.]+ computed, [\d.]+ pool, [\d.]+ tier", text_of("src-value")), text_of("src-value")
    assert text_of("tier-value") == "no tier"  # this server keeps no KV beyond its pool
    assert text_of("pd-value") == "no TCPConnector"  # nor hands KV to other instances
    with open(shot, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    print(f"\ndashboard screenshot: {shot} ({len(png)} bytes)")


def is_stats_line(record: dict) -> bool:
    message = str(record.get("message", ""))
    return "Avg prompt throughput" in message and "Prefix cache hit rate" in message


def test_stats_log_line_and_json_logs(tiny_llama_dir):
    """--log-format json: every line is JSON, request lines carry the request id, and the periodic stats line
    appears (its interval shortened for the test). On the tiny random model, as obs_server."""
    server = RemoteServer(["--log-format", "json", "--uvicorn-log-level", "info", "--served-model-name", MODEL],
                          env={"TOKENMILL_STATS_LOG_INTERVAL_S": "1"}, model=tiny_llama_dir)
    try:
        r = httpx.post(server.url_for("/v1/completions"), headers={"X-Request-Id": "req-abc-123"}, timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200

        def json_records() -> list[dict]:
            records = []
            for line in server.log_tail(1_000_000).splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # not JSON (asserted on below), or a line still being written
                if isinstance(record, dict):
                    records.append(record)
            return records

        def logged_both() -> bool:
            records = json_records()
            return (any(is_stats_line(r) for r in records)
                    and any(r.get("request_id") == "req-abc-123" for r in records))

        # the stats line comes every second here
        wait_until(logged_both, timeout_s=30, interval_s=0.1,
                   message=lambda: f"the stats line and the request's line in the log:\n{server.log_tail()}")
        lines = [line for line in server.log_tail(1_000_000).splitlines() if line.strip()]
    finally:
        server.stop()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) >= 0.9 * len(lines), lines[:5]  # a stray non-JSON line or two (warnings) at most
    assert any(is_stats_line(r) for r in records)
    assert any(r.get("request_id") == "req-abc-123" for r in records)
