"""vLLM's `serve` command line starts tokenmill, or says why not: each flag vLLM users pass is honoured with vLLM's
meaning, accepted where it means nothing here (documented), or refused naming it. Most are checked through the
command line's parse (tokenmill.cli.main with the serve entry point stubbed) and the function that reads them;
one real `tokenmill serve` on a tiny model (module-scoped) carries the HTTP ones: --config, --ssl-*, --root-path,
--enable-log-requests and --generation-config."""
from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from tokenmill import cli
from tokenmill.api.server_config import ServerConfig
from tokenmill.config import EngineConfig


def parse(*argv: str, monkeypatch) -> tuple[EngineConfig, ServerConfig]:
    """`tokenmill serve ARGV` as far as its configs: the CLI's whole parse (dotted flags, --config), no server."""
    import tokenmill.server.launch as launch
    seen = {}

    def fake_run(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(launch, "run_from_cli", fake_run)
    assert cli.main(["serve", *argv]) == 0
    args = seen["args"]
    if args.model_tag is not None:
        args.model = args.model_tag
    return EngineConfig.from_cli_args(args), ServerConfig.from_cli_args(args)


@pytest.mark.parametrize("argv, config, field, value", [
    (["--enforce-eager"], "engine", "enforce_eager", True),
    (["--enable-chunked-prefill"], "engine", "enable_chunked_prefill", True),
    (["--gpu-memory-utilization", "0.9"], "engine", "gpu_memory_utilization", 0.9),
    (["--tensor-parallel-size", "1"], "engine", "tensor_parallel_size", 1),
    (["--trust-remote-code"], "engine", "trust_remote_code", True),
    (["--load-format", "safetensors"], "engine", "load_format", "safetensors"),
    (["--download-dir", "/models"], "engine", "download_dir", "/models"),
    (["--generation-config", "vllm"], "engine", "generation_config", "vllm"),
    (["--hf-overrides", '{"rope_theta": 1000.0}'], "engine", "hf_overrides", {"rope_theta": 1000.0}),
    (["--dtype", "half"], "engine", "dtype", "half"),
    (["--dtype", "float"], "engine", "dtype", "float"),
    (["--enable-log-requests"], "server", "enable_log_requests", True),
    (["--enable-log-requests", "--disable-log-requests"], "server", "enable_log_requests", False),
    (["--response-role", "model"], "server", "response_role", "model"),
    (["--chat-template-content-format", "openai"], "server", "chat_template_content_format", "openai"),
    (["--root-path", "/api"], "server", "root_path", "/api"),
    (["--disable-fastapi-docs"], "server", "disable_fastapi_docs", True),
    (["--disable-uvicorn-access-log"], "server", "disable_uvicorn_access_log", True),
    (["--trust-request-chat-template"], "server", "trust_request_chat_template", True),
    (["--max-log-len", "100"], "server", "max_log_len", 100),
    (["--override-generation-config", '{"temperature": 0.5}'], "engine", "override_generation_config",
     {"temperature": 0.5}),
])
def test_vllm_flag_parses(argv, config, field, value, monkeypatch):
    engine, server = parse(*argv, monkeypatch=monkeypatch)
    assert getattr(engine if config == "engine" else server, field) == value


def test_structured_outputs_backend_dotted_and_json(monkeypatch):
    engine, _ = parse("--structured-outputs-config.backend", "xgrammar", monkeypatch=monkeypatch)
    assert engine.structured_outputs_config.backend == "xgrammar"
    engine, _ = parse("--structured-outputs-config", '{"backend": "auto"}', monkeypatch=monkeypatch)
    assert engine.structured_outputs_config.backend == "auto"
    for name in ("guidance", "outlines", "lm-format-enforcer"):
        with pytest.raises(ValueError, match=f"backend '{name}' is not available.*xgrammar"):
            parse(f"--structured-outputs-config.backend={name}", monkeypatch=monkeypatch)


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: tokenmill runs a model on one device"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: tokenmill always chunks"),
    (["--load-format", "pt"], "--load-format 'pt' is not supported.*never unpickles"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"], "not both"),
    (["--ssl-keyfile", "key.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
    (["--override-generation-config", "[1]"], "--override-generation-config takes a JSON object"),
])
def test_vllm_flag_refused_with_its_name(argv, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        parse(*argv, monkeypatch=monkeypatch)


def test_config_file_and_command_line_precedence(tmp_path, monkeypatch):
    """vLLM's --config: the file's flags, the command line's winning where both give one."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /from/file\nport: 1234\nenforce_eager: true\nenable-prefix-caching: false\n"
                   "served-model-name: [a, b]\ndtype: float\nhf-overrides: {rope_theta: 10.0}\n"
                   "disable-log-requests: true\n")
    engine, server = parse("--config", str(cfg), "--port", "5678", monkeypatch=monkeypatch)
    assert (engine.model, server.port, engine.enforce_eager, engine.enable_prefix_caching) == \
           ("/from/file", 5678, True, False)
    assert server.served_model_name == ["a", "b"] and engine.dtype == "float"
    assert engine.hf_overrides == {"rope_theta": 10.0} and server.enable_log_requests is False
    # a positional model on the command line wins over the file's, even after the file's list flag
    engine, server = parse("/from/cli", "--config", str(cfg), monkeypatch=monkeypatch)
    assert engine.model == "/from/cli" and server.served_model_name == ["a", "b"]
    (tmp_path / "bad.yaml").write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse("--config", str(tmp_path / "bad.yaml"), monkeypatch=monkeypatch)


# ---- where each flag is read ----

def test_dtype_aliases():
    import torch
    from transformers import LlamaConfig

    from tokenmill.models.loader import resolve_dtype
    assert resolve_dtype("half", LlamaConfig(), torch.device("cpu")) == torch.float16
    assert resolve_dtype("float", LlamaConfig(), torch.device("cpu")) == torch.float32


def test_gpu_memory_utilization_sizes_the_cuda_pool_and_is_refused_on_cpu():
    from tokenmill.engine.runner import kv_budget, runner_device
    gib = 2**30
    config = EngineConfig(gpu_memory_utilization=0.9)
    # 100 GiB device, 10 GiB already in use (weights, torch's context): the pool fills up to 90 GiB
    assert kv_budget(config, "cuda", free=90 * gib, total=100 * gib) == 80 * gib
    assert kv_budget(EngineConfig(), "cuda", free=90 * gib, total=100 * gib) == int(0.8 * 90 * gib)  # unchanged
    with pytest.raises(ValueError, match="already in use"):
        kv_budget(EngineConfig(gpu_memory_utilization=0.05), "cuda", free=90 * gib, total=100 * gib)
    with pytest.raises(ValueError, match="--gpu-memory-utilization sizes the KV cache on CUDA"):
        runner_device(EngineConfig(device="cpu", gpu_memory_utilization=0.9))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    """A tiny random Llama with the default model's tokenizer and a generation_config.json of sampling defaults."""
    from helpers import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny-flags")
    save_tiny_llama(path, vocab_size=len(tokenizer), max_position_embeddings=512)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7, "max_new_tokens": 3,
                                                             "do_sample": True}))
    return str(path)


def test_load_format_and_hf_overrides(tiny_model, tmp_path):
    from tokenmill.models.loader import load_model_config
    assert load_model_config(tiny_model, "safetensors").hf_config.max_position_embeddings == 512
    with pytest.raises(ValueError, match="--load-format gguf does not match"):
        load_model_config(tiny_model, "gguf")
    info = load_model_config(tiny_model, hf_overrides={"max_position_embeddings": 64,
                                                       "rope_parameters": {"rope_theta": 500.0}})
    # a value replaces the attribute; an object is merged into a dict attribute, its other keys kept
    assert info.hf_config.max_position_embeddings == 64
    assert info.hf_config.rope_parameters == {"rope_theta": 500.0, "rope_type": "default"}


def test_download_dir_finds_a_repo_in_a_local_hf_cache(tiny_model, tmp_path):
    from tokenmill.models.paths import resolve_model_path
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    os.symlink(tiny_model, snapshot)
    assert resolve_model_path("org/tiny", str(tmp_path)) == str(snapshot)
    with pytest.raises(FileNotFoundError, match="'org/other' is not in --download-dir"):
        resolve_model_path("org/other", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model_path("org/tiny")


def test_generation_config_defaults(tiny_model, tmp_path):
    from tokenmill.models.generation_config import generation_defaults
    assert generation_defaults(tiny_model) == {"temperature": 0.25, "top_k": 7, "max_tokens": 3}
    assert generation_defaults(tiny_model, "vllm") == {}
    # --override-generation-config: merged over the file's (vLLM's rule), alone with vllm; other keys refused
    override = {"top_k": 5, "max_new_tokens": 9}
    assert generation_defaults(tiny_model, "auto", override) == {"temperature": 0.25, "top_k": 5, "max_tokens": 9}
    assert generation_defaults(tiny_model, "vllm", override) == {"top_k": 5, "max_tokens": 9}
    with pytest.raises(ValueError, match="--override-generation-config: do_sample not among"):
        generation_defaults(tiny_model, "auto", {"do_sample": True})
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert generation_defaults(tiny_model, str(tmp_path)) == {"top_p": 0.5}
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        generation_defaults(tiny_model, str(tmp_path / "missing"))




def test_offline_llm_applies_generation_config_defaults(tiny_model, tmp_path):
    """vLLM's LLM.get_default_sampling_params: with no SamplingParams, generate() and chat() use the model's
    generation_config.json defaults (max_new_tokens 3 here, so 3 tokens, not SamplingParams' 16); given
    SamplingParams are the caller's; generation_config="vllm" leaves SamplingParams' own."""
    from helpers import llm_sharing_weights

    from tokenmill import SamplingParams
    llm = llm_sharing_weights(model=tiny_model)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.25, 7, 3)
    prompt = [1, 2, 3, 4]
    assert len(llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids) <= 3
    assert len(llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 5
    assert len(llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)[0].outputs[0].token_ids) <= 3
    plain = llm_sharing_weights(model=tiny_model, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)
def test_trust_remote_code_reaches_the_tokenizer(tiny_model, tmp_path):
    """A tokenizer shipped as code beside the checkpoint (auto_map) loads only with --trust-remote-code."""
    import shutil

    from tokenmill.tokenizer import load_tokenizer
    model = tmp_path / "remote"
    shutil.copytree(tiny_model, model)
    (model / "my_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n"
        "class MyTokenizer(PreTrainedTokenizerFast):\n    shipped_as_code = True\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(str(model))
    assert load_tokenizer(str(model), trust_remote_code=True).shipped_as_code


def test_chat_template_content_format():
    from tokenmill.api.chat_protocol import ChatMessage
    from tokenmill.api.chat_utils import content_format, render_chat

    class Tok:
        # prints what the template is given: a string, or the parts' types and texts
        chat_template = ("{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
                         "{% else %}{% for p in m['content'] %}{{ p['type'] }}={{ p['text'] }};{% endfor %}"
                         "{% endif %}{% endfor %}")

        def apply_chat_template(self, conversation, **kw):
            import jinja2
            return jinja2.Template(self.chat_template).render(messages=conversation)

        def encode(self, text, add_special_tokens=False):
            return [1]

    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
    assert render_chat(Tok(), messages, False, content_format_flag="string")[0] == "S:a\nb"
    assert render_chat(Tok(), messages, False, content_format_flag="openai")[0] == "text=a;text=b;"
    assert render_chat(Tok(), messages, False)[0] == "text=a;text=b;"  # auto: the template loops over content
    assert content_format("{{ messages[0]['content'] }}") == "string"
    assert render_chat(Tok(), [ChatMessage(role="user", content="x")], False, content_format_flag="openai")[0] \
        == "text=x;"


@pytest.mark.anyio
async def test_response_role(tokenizer):
    """vLLM's rule: --response-role names the answer's role when the prompt ends with the generation prompt; with
    add_generation_prompt false the model continues the last message, whose role it keeps."""
    from fake_engine import InProcessServer, post
    app = InProcessServer(tokenizer, response_role="model")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    assert (await post(app, "/v1/chat/completions", body)).json()["choices"][0]["message"]["role"] == "model"
    continued = {**body, "add_generation_prompt": False,
                 "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]}
    assert (await post(app, "/v1/chat/completions", continued)).json()["choices"][0]["message"]["role"] == \
        "assistant"
    async with app.http() as client:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            first = json.loads([line async for line in r.aiter_lines() if line.startswith("data: {")][0][6:])
    assert first["choices"][0]["delta"]["role"] == "model"


@pytest.mark.anyio
async def test_disable_fastapi_docs(tokenizer):
    from fake_engine import InProcessServer
    for disabled, status in ((False, 200), (True, 404)):
        async with InProcessServer(tokenizer, disable_fastapi_docs=disabled).http() as client:
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert (await client.get(path)).status_code == status, (path, disabled)


# ---- one real server: --config, HTTPS, root path, no docs, request logging, generation_config.json ----

@pytest.fixture(scope="module")
def flags_server(tiny_model, tmp_path_factory):
    from helpers import RemoteServer
    certs = tmp_path_factory.mktemp("certs")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(certs / "key.pem"), "-out", str(certs / "cert.pem")], check=True,
                   capture_output=True)
    cfg = certs / "serve.yaml"
    cfg.write_text(f"ssl-keyfile: {certs / 'key.pem'}\nssl-certfile: {certs / 'cert.pem'}\nroot-path: /api\n"
                   "max-model-len: 256\nenable-chunked-prefill: true\nport: 1\n")  # the command line's port wins

    class HttpsServer(RemoteServer):
        def _wait_ready(self):
            self.url = self.url.replace("http://", "https://")
            real_get = httpx.get
            httpx.get = lambda url, **kw: real_get(url, verify=False, **kw)
            try:
                super()._wait_ready()
            finally:
                httpx.get = real_get

    server = HttpsServer(["--config", str(cfg), "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "4",
                          "--override-generation-config", '{"top_k": 5}', "--disable-uvicorn-access-log",
                          "--uvicorn-log-level", "info"], model=tiny_model,
                         server_args=["--dtype", "float32", "--kv-cache-memory", "16MiB", "--uvicorn-log-level",
                                      "warning", "--api-key", "k"])
    yield server
    server.stop()


def test_real_server_with_vllm_flags(flags_server):
    with httpx.Client(base_url=flags_server.url, verify=False, headers={"Authorization": "Bearer k"},
                      timeout=60) as client:
        assert client.get("/health").status_code == 200  # HTTPS, from the config file's key and certificate
        # --root-path /api: a proxy strips the prefix; the app's links (OpenAPI's servers, /docs) carry it
        assert client.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
        assert "/api/openapi.json" in client.get("/docs").text
        # generation_config.json's max_new_tokens bounds a request that sets no max_tokens
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    log = flags_server.log_tail(20000)
    # generation_config.json's temperature, and --override-generation-config's top_k over its 7
    assert "Received request chatcmpl-" in log and "temperature=0.25" in log and "top_k=5" in log, log[-3000:]
    # --enable-log-outputs, cut to --max-log-len; no access log lines (--disable-uvicorn-access-log)
    [generated] = [line for line in log.splitlines() if "Generated response chatcmpl-" in line]
    assert "3 tokens, finish_reason: length, output: '" in generated and generated.endswith("'...")
    assert len(generated.split("output: ")[1]) == len("''...") + 4
    assert 'HTTP/1.1" 200' not in log
    assert "https://127.0.0.1" in log and f":{flags_server.port}/api" in log
