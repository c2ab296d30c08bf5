"""The API server's own flags (the engine's are EngineConfig's), as one dataclass: field = flag, vLLM's names; and
`tokenmill serve`'s whole command line, which serve-ray (tokenmill/router/ray_serve.py) checks its replicas'
flags with."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from tokenmill.chat_templates import SHIPPED_TEMPLATES
from tokenmill.config import CliConfig, EngineConfig
from tokenmill.lora.request import LoRAModulePath
from tokenmill.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_N = 128  # OpenAI's own limit for n


@dataclass
class ServerConfig(CliConfig):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: list[str] | None = field(default=None, metadata={
        "nargs": "+", "help": "the model name(s) the API accepts; the first is reported (default: the model)"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENMILL_API_KEY)"})
    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata={
        "type": json.loads, "help": "CORS origins, a JSON list"})
    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata={
        "type": json.loads, "help": "CORS methods, a JSON list"})
    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata={
        "type": json.loads, "help": "CORS headers, a JSON list"})
    allow_credentials: bool = field(default=False, metadata={"help": "CORS: allow credentials"})
    config: str | None = field(default=None, metadata={
        "help": "a YAML file of flags, vLLM's --config: each key a flag's name (port: 8000, enforce-eager: true), "
                "and flags given on the command line override the file's"})
    ssl_keyfile: str | None = field(default=None, metadata={"help": "serve HTTPS: the private key file"})
    ssl_certfile: str | None = field(default=None, metadata={"help": "serve HTTPS: the certificate file"})
    root_path: str | None = field(default=None, metadata={
        "help": "the path prefix a proxy serves this app under (ASGI root_path: OpenAPI's servers and /docs use it)"})
    disable_fastapi_docs: bool = field(default=False, metadata={"help": "no /docs, /redoc or /openapi.json"})
    enable_log_requests: bool = field(default=False, metadata={
        "negative_aliases": ("--disable-log-requests",),
        "help": "log each generation request as it arrives: its id, sampling parameters and prompt length"})
    response_role: str = field(default="assistant", metadata={
        "help": "the role of chat responses to requests with add_generation_prompt (otherwise the last message's)"})
    chat_template_content_format: str = field(default="auto", metadata={
        "choices": ["auto", "string", "openai"],
        "help": "how a message's content reaches the chat template: string (text parts joined by newlines), openai "
                "(the list of {type: text, text} parts), auto (openai when the template loops over content parts, "
                "else string)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template to use instead of the model's: a file, a shipped name "
                f"({', '.join(sorted(SHIPPED_TEMPLATES))}), or the template text itself"})
    trust_request_chat_template: bool = field(default=False, metadata={
        "help": "let a request bring its own chat template (chat_template, or chat_template_kwargs' chat_template); "
                "otherwise such a request is refused (vLLM's)"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "let the model decide to call tools (tool_choice auto); needs --tool-call-parser"})
    tool_call_parser: str | None = field(default=None, metadata={
        "choices": sorted(TOOL_PARSERS), "help": "how the model writes tool calls, for tool_choice auto"})
    max_request_body_bytes: int = field(default=16 * 2**20, metadata={
        "help": "refuse a request body larger than this (413), before reading it in full"})
    stream_stall_timeout: float = field(default=30.0, metadata={
        "help": "abort a streaming request whose client has not taken its pending output for this many seconds "
                "(it stopped reading): its KV cache is freed"})
    max_n: int = field(default=DEFAULT_MAX_N, metadata={"help": "largest n a request may ask for"})
    stream_interval: int = field(default=1, metadata={
        "help": "a stream's chunks carry at least this many new tokens (the first and the last excepted): fewer, "
                "larger chunks for less overhead; a request's stream_interval wins"})
    lora_modules: list[LoRAModulePath] | None = field(default=None, metadata={
        "nargs": "+", "type": LoRAModulePath.parse,
        "help": "LoRA adapters to serve (needs --enable-lora): name=path or JSON {\"name\", \"path\", "
                "\"base_model_name\"}; a request picks one by its model name"})
    return_tokens_as_token_ids: bool = field(default=False, metadata={
        "help": "render logprob tokens as 'token_id:N' (so that bytes that are not UTF-8 survive) unless a request's "
                "return_tokens_as_token_ids says otherwise"})
    enable_force_include_usage: bool = field(default=False, metadata={
        "help": "every stream carries usage: in each chunk and in a final usage chunk, whatever stream_options says"})
    enable_prompt_tokens_details: bool = field(default=False, metadata={
        "help": "usage carries prompt_tokens_details.cached_tokens (the prompt tokens found in the prefix cache) "
                "when some were; a router that compares its predictions needs it"})
    enable_server_load_tracking: bool = field(default=False, metadata={
        "help": "count the generation and pooling requests in flight, for GET /load"})
    enable_tokenizer_info_endpoint: bool = field(default=False, metadata={
        "help": "serve GET /tokenizer_info (the tokenizer's configuration and chat template)"})
    max_num_queued_reqs: int | None = field(default=None, metadata={
        "help": "answer 503 (overloaded_error, Retry-After) past this many requests waiting for their first token "
                "(default: no limit)"})
    max_num_queued_tokens: int | None = field(default=None, metadata={
        "help": "the same, counting the prompt tokens of those requests"})
    wake_on_demand: bool = field(default=False, metadata={
        "help": "with --enable-sleep-mode: a request that arrives while the engine sleeps (POST /sleep) wakes it "
                "and runs, instead of getting 503 with Retry-After"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM, seconds to let in-flight requests finish before failing them"})
    disable_log_stats: bool = field(default=False, metadata={"help": "no stats line every 10 s"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "export a span per request over OTLP/HTTP to this URL (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
                "or OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing)"})
    otlp_traces_include_text: bool = field(default=False, metadata={
        "help": "also record prompt and completion text in spans (never done otherwise)"})
    log_format: str = field(default="text", metadata={"choices": ["text", "json"], "help": "text or JSON log lines"})
    uvicorn_log_level: str = field(default="info", metadata={
        "choices": ["critical", "error", "warning", "info", "debug", "trace"], "help": "uvicorn's log level"})
    disable_uvicorn_access_log: bool = field(default=False, metadata={
        "help": "no access log line per HTTP request (uvicorn's)"})
    enable_log_outputs: bool = field(default=False, metadata={
        "help": "with --enable-log-requests, log each generation request's output when it ends: every sample's "
                "text, token count and finish reason"})
    max_log_len: int | None = field(default=None, metadata={
        "help": "the most characters of an output's text a log line carries (default: all)"})

    def __post_init__(self):
        if self.max_n < 1:
            raise ValueError("--max-n must be at least 1")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests (as in vLLM)")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be at least 0, got {self.max_log_len}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The parser for tool_choice "auto": set only with --enable-auto-tool-choice."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def add_serve_cli_args(parser: argparse.ArgumentParser) -> None:
    """`tokenmill serve`'s flags: the model, then the engine's and the API server's."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    EngineConfig.add_cli_args(parser)
    ServerConfig.add_cli_args(parser)


def config_file_args(path: str, known_flags: set[str], cli_gives_model: bool) -> list[str]:
    """--config FILE.yaml as flags to put before the command line's (vLLM's rule: where both give a flag, the
    command line's wins, argparse keeping the last value). Keys are flag names, dashes or underscores; true gives
    `--flag`, false `--no-flag` (or nothing for a flag without that form, such as --disable-log-requests), a list
    its items, an object its JSON. `model` is the model unless the command line names one."""
    import yaml
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: the file must be a mapping of flag names to values")
    args: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another one")
        if flag not in known_flags:
            raise ValueError(f"--config {path}: unknown flag {key!r}")
        if value is None or (flag == "--model" and cli_gives_model):
            continue
        if isinstance(value, bool):
            negative = "--no-" + flag[2:]
            args += [flag] if value else [negative] if negative in known_flags else []
        elif isinstance(value, list):
            args += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
