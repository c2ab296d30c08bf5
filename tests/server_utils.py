"""A real `tokenmill serve` subprocess for the server tests, shared by all of them (the model loads once).

Test modules take the `server` fixture (`from server_utils import server`); every test gets the same process,
which is stopped when the test session ends. A test that breaks the server (kills its engine) calls
`server.mark_broken()`, and the next user gets a fresh one."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
# float32: CPUs without AMX/AVX512-BF16 emulate bf16 matmuls very slowly. Quantization none: some tests compare
# logprobs with HF's float32 model on the dequantized GGUF weights.
SERVER_ARGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--dtype", "float32", "--max-n", "8",
               "--quantization", "none",
               "--uvicorn-log-level", "warning",
               # endpoints that vLLM serves only when asked (tests/test_vllm_parity.py); the same in fake_engine.py
               "--enable-tokenizer-info-endpoint", "--enable-server-load-tracking"]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, extra_args: list[str] = (), env: dict[str, str] | None = None, model: str = MODEL,
                 server_args: list[str] = SERVER_ARGS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.broken = False
        self.seen_loading = False
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-serve-", suffix=".log", delete=False)
        exe = os.path.join(os.path.dirname(sys.executable), "tokenmill")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tokenmill.cli"]
        cmd += ["serve", model, "--host", "127.0.0.1", "--port", str(self.port), *server_args, *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENMILL_NO_PROGRESS": "1", **(env or {})})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # as a vLLM user's script would: wait for /health, then send traffic
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
                # alive (/health/live 200) but not ready (/health 503): the model is loading
                live = httpx.get(self.url + "/health/live", timeout=2).status_code == 200
                self.seen_loading = self.seen_loading or live
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"tokenmill serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{tail}")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def url_for(self, path: str) -> str:
        return self.url + path

    def openai(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def engine_process(self) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "spawn_main" in " ".join(child.cmdline()):
                return child
        raise RuntimeError("no engine process found")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if line.startswith(("vllm:", "tokenmill:")):
                name_labels, value = line.rsplit(" ", 1)
                values[name_labels.split("{")[0]] = float(value)
        return values

    def mark_broken(self) -> None:
        self.broken = True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def scrape_metrics(server) -> dict[str, dict]:
    """/metrics parsed: family name → {'type': ..., 'samples': {(sample name, sorted label items): value}}"""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(server.url_for("/metrics"), timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        out[family.name] = {"type": family.type, "samples": samples}
    return out


def metric_value(m: dict, family: str, sample: str, **labels) -> float:
    """One sample of scrape_metrics' result (0 if absent); model_name defaults to the served model."""
    labels.setdefault("model_name", MODEL)
    return m[family]["samples"].get((sample, tuple(sorted(labels.items()))), 0.0)


_shared: RemoteServer | None = None


def shared_server() -> RemoteServer:
    global _shared
    if _shared is None or _shared.broken or _shared.proc.poll() is not None:
        if _shared is not None:
            _shared.stop()
        # The key comes from the environment, which exercises TOKENMILL_API_KEY.
        _shared = RemoteServer(env={"TOKENMILL_API_KEY": API_KEY})
    return _shared


@atexit.register
def _stop_shared() -> None:
    if _shared is not None:
        _shared.stop()


@pytest.fixture
def server() -> RemoteServer:
    """Function-scoped, so that a test after one that broke the server gets a fresh one."""
    return shared_server()
