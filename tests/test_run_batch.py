"""`tokenmill run-batch` (vLLM's run-batch, OpenAI's Batch file format): the file's checks before the model loads,
the answers' shapes and order through the app on the fake engine, and one real run on the tiny random model whose
answers equal the offline engine's, with the input fetched from and the output PUT to a URL."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_engine import API_KEY, CONTINUATION, MODEL, InProcessServer

from tokenmill import SamplingParams
from tokenmill.server.run_batch import BatchFileError, OrderedWriter, metrics_app, parse_batch, run_batch


def line(custom_id, url="/v1/completions", method="POST", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_good_file_parses_blank_lines_skipped():
    text = "\n".join([line("a", model=MODEL, prompt="x"), "", "  ", line("b", "/v1/embeddings", input="y")])
    assert [(r.custom_id, r.url, r.body) for r in parse_batch(text)] == [
        ("a", "/v1/completions", {"model": MODEL, "prompt": "x"}), ("b", "/v1/embeddings", {"input": "y"})]


@pytest.mark.parametrize("bad,fragment", [
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": ', "line 2: "),
    ('{"method": "POST", "url": "/v1/completions", "body": {}}', "line 2: custom_id: Field required"),
    (line("x") [:-1] + ', "extra": 1}', "line 2: extra: Extra inputs are not permitted"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": [1]}', "line 2: body: "),
    (line("x", method="GET"), "line 2: method 'GET': only POST is supported"),
    (line("x", url="/v1/models"), "line 2: url '/v1/models' is not an endpoint run-batch serves"),
    (line("x", stream=True), "line 2: body.stream: a batch request must not be streamed"),
    (line("a"), "line 2: custom_id 'a' is also line 1's"),
])
def test_a_bad_line_is_named_before_anything_runs(bad, fragment):
    with pytest.raises(BatchFileError) as e:
        parse_batch(line("a") + "\n" + bad)
    assert str(e.value).startswith(fragment), str(e.value)


def test_answers_are_written_in_the_inputs_order():
    out = io.StringIO()
    writer = OrderedWriter(out)
    writer.add(2, {"i": 2})
    writer.add(1, {"i": 1})
    assert out.getvalue() == ""  # both wait for the first
    writer.add(0, {"i": 0})
    writer.add(3, {"i": 3})
    assert [json.loads(x)["i"] for x in out.getvalue().splitlines()] == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_each_line_is_answered_as_the_server_answers_it(tokenizer):
    """Through the app tokenmill serve builds: a success carries the endpoint's body, a refused request the
    server's own error object (and its status), in the input's order, each with its custom_id."""
    server = InProcessServer(tokenizer)
    text = "\n".join([
        line("chat", "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6),
        line("bad", model=MODEL, prompt="x", max_tokens=-1),
        line("completion", model=MODEL, prompt="Colors:", max_tokens=4),
        line("embedding", "/v1/embeddings", model=MODEL, input="Hi"),
        line("responses", "/v1/responses", model=MODEL, input="Hi", max_output_tokens=4),
    ])
    out = io.StringIO()
    progress = await run_batch(server.root.inner, parse_batch(text), out, max_concurrency=2, api_key=API_KEY)
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in rows] == ["chat", "bad", "completion", "embedding", "responses"]
    assert (progress.done, progress.failed) == (5, 2)
    chat, bad, completion, embedding, responses = rows
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["object"] == "chat.completion"
    content = chat["response"]["body"]["choices"][0]["message"]["content"]
    assert len(content) > 10 and CONTINUATION.strip().startswith(content.strip())
    assert completion["response"]["body"]["usage"]["completion_tokens"] == 4
    assert responses["response"]["body"]["object"] == "response"
    assert bad["response"] == {"status_code": 400, "request_id": bad["response"]["request_id"], "body": None}
    assert bad["error"]["error"]["param"] == "max_tokens"
    assert embedding["response"]["status_code"] == 400 and "--runner pooling" in embedding["error"]["error"]["message"]
    assert len({r["id"] for r in rows}) == 5 and all(r["id"].startswith("batch_req_") for r in rows)


@pytest.mark.anyio
async def test_metrics_app_serves_the_engines_metrics(tokenizer):
    import httpx
    server = InProcessServer(tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=metrics_app(server.root.inner)),
                                 base_url="http://m") as client:
        metrics = await client.get("/metrics")
        other = await client.get("/v1/models")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    assert other.status_code == 404  # the metrics port serves nothing else


class FileServer:
    """Serves one file on GET and keeps what is PUT, as the object stores run-batch reads and writes."""

    def __init__(self, content: bytes):
        self.content, self.put = content, None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(owner.content)))
                self.end_headers()
                self.wfile.write(owner.content)

            def do_PUT(self):
                owner.put = self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.slow  # starts an engine process
def test_a_real_batch_equals_the_offline_engine(tmp_path, tiny_llama_dir, shared_tiny_llm):
    """The tiny random model (it loads in seconds), greedy: each answer's text equals LLM.generate's for the same
    prompt; the input comes from a URL and the output is PUT to one."""
    prompts = ["Once upon a time", "The best way to learn", "def fibonacci(n):", "Colors:"]
    text = "\n".join(line(f"req-{i}", model="tiny", prompt=p, max_tokens=12, temperature=0, ignore_eos=True)
                     for i, p in enumerate(prompts))
    files = FileServer(text.encode())
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "run-batch", "-i", files.url + "/in.jsonl", "-o",
             files.url + "/out.jsonl", "--output-tmp-dir", str(tmp_path), tiny_llama_dir, "--served-model-name",
             "tiny", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB"],
            capture_output=True, text=True, timeout=300)
    finally:
        files.server.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(x) for x in files.put.decode().splitlines()]
    expected = shared_tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                        use_tqdm=False)
    assert [r["custom_id"] for r in rows] == [f"req-{i}" for i in range(len(prompts))]
    assert [r["response"]["body"]["choices"][0]["text"] for r in rows] == [e.outputs[0].text for e in expected]
    assert list(tmp_path.iterdir()) == []  # the staged output is removed once PUT


def test_a_bad_file_ends_the_run_before_the_model_loads(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(line("a", method="GET"))
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run-batch", "-i", str(path), "-o",
                             str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "no-such-model")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "line 1: method 'GET': only POST is supported" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
