"""`tokenmill serve` refuses to start, with a clear message and no traceback, when it cannot serve.
Slow: it starts three `tokenmill serve` processes (one loads the engine before it fails)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import MODEL, free_port

pytestmark = pytest.mark.slow


def _serve(*args: str) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tokenmill.cli"]
    return subprocess.Popen([*cmd, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})


def test_startup_failures(tmp_path):
    bad_model = tmp_path / "bad-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        runs = {
            "no such model": _serve("/nonexistent/model.gguf", "--port", str(free_port())),
            "port taken": _serve(MODEL, "--port", str(busy_port)),
            # the engine process fails to load the model
            "engine fails": _serve(str(bad_model), "--port", str(free_port())),
        }
        outputs = {name: proc.communicate(timeout=300)[0] for name, proc in runs.items()}
    for name, proc in runs.items():
        assert proc.returncode != 0, (name, outputs[name][-2000:])
        assert "Traceback" not in outputs[name], (name, outputs[name][-3000:])
    assert "neither a GGUF file nor a directory" in outputs["no such model"]
    assert "in use" in outputs["port taken"] and "Loading" not in outputs["port taken"]
    assert "engine failed to start" in outputs["engine fails"] and "no-such-architecture" in outputs["engine fails"]
