"""`tokenmill bench serve --launch`: start `tokenmill serve` in its own process group, wait until it answers, stop
it (and everything it started) afterwards."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx


def launch_server(base_url: str, serve_args: list[str], timeout: float = 900.0) -> subprocess.Popen:
    parsed = urlparse(base_url)
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", parsed.hostname or "127.0.0.1",
           "--port", str(parsed.port or 8000), *serve_args]
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url.rstrip("/") + "/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"tokenmill serve was not ready within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
