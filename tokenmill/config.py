"""Configuration as dataclasses whose fields are the CLI flags (vLLM's names): EngineConfig here with the configs
of its JSON flags (--kv-events-config, --speculative-config), and the API server's ServerConfig in
tokenmill/api/server_config.py. CliConfig turns the fields into argparse flags. Torch-free: the API server and the
router parse these flags too."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field

from tokenmill import envs
from tokenmill.json_flag import parse_json_flag
from tokenmill.reasoning import ReasoningSpec, reasoning_spec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class CliConfig:
    """Generates a dataclass's flags: --field-name per field, its help, choices, type and nargs from the field's
    metadata, bools as --flag/--no-flag. One source of truth: the flag, its default and its doc are the field."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction, help=help_)
                for alias in f.metadata.get("negative_aliases", ()):  # vLLM's older --disable-X spellings
                    parser.add_argument(alias, dest=f.name, action="store_false", help=f"same as --no-{flag[2:]}")
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            kind = f.metadata.get("type") or {"int": int, "int | None": int, "float": float,
                                              "float | None": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"),
                                nargs=f.metadata.get("nargs"), help=help_)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})


@dataclass
class KVEventsConfig:
    """--kv-events-config: vLLM's KVEventsConfig fields, as JSON."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; default: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        return parse_json_flag(cls, "--kv-events-config", text)


# The connectors --kv-transfer-config may name: a store shared by replicas (engine/kv_store.py), and blocks handed
# from a prefill instance to a decode instance over TCP (engine/kv_transfer.py).
KV_CONNECTORS = ("ValkeyConnector", "TCPConnector")
# TCPConnector's kv_connector_extra_config: seconds a prefill instance keeps a finished request's blocks for the
# decode instance (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, whose value is the default), and seconds a decode
# instance waits for the prefill instance's answer before it recomputes
TCP_CONNECTOR_EXTRA = {"abort_request_timeout": None, "fetch_timeout": 10.0}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """--kv-transfer-config: vLLM's KVTransferConfig, as JSON. Its fields that mean nothing to a connector here
    (ranks, buffer sizes, module paths) are refused when set, not ignored: see __post_init__."""
    kv_connector: str | None = None
    kv_role: str | None = None
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self):
        flag = "--kv-transfer-config"
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"{flag}: kv_connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"{flag}: kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        for name in ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_connector_module_path"):
            if getattr(self, name) is not None:
                raise ValueError(f"{flag}: {name} is not supported by {self.kv_connector}")
        if self.kv_parallel_size != 1:
            raise ValueError(f"{flag}: kv_parallel_size must be 1 (one engine per instance)")
        if self.kv_load_failure_policy != "recompute":
            raise ValueError(f"{flag}: kv_load_failure_policy must be 'recompute': a block that fails to load is "
                             "computed, never a failed request")
        if self.kv_connector == "TCPConnector":
            extra = self.kv_connector_extra_config
            unknown = set(extra) - set(TCP_CONNECTOR_EXTRA)
            if unknown:
                raise ValueError(f"{flag}: TCPConnector's kv_connector_extra_config takes {list(TCP_CONNECTOR_EXTRA)}, "
                                 f"got {sorted(unknown)}")
            for name in TCP_CONNECTOR_EXTRA:
                value = extra.get(name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or not value > 0):
                    raise ValueError(f"{flag}: kv_connector_extra_config.{name} must be a positive number of "
                                     f"seconds, got {value!r}")
            if not 0 <= self.kv_port < 65536:
                raise ValueError(f"{flag}: kv_port must be in [0, 65535] (0: any free port), got {self.kv_port}")
        if self.kv_connector == "ValkeyConnector":
            extra = self.kv_connector_extra_config
            if set(extra) - {"url"} or not str(extra.get("url", "")).startswith(("redis://", "valkey://",
                                                                                    "rediss://", "valkeys://")):
                raise ValueError(f"{flag}: ValkeyConnector takes kv_connector_extra_config "
                                 '{"url": "redis://HOST:PORT"}' f", got {extra!r}")

    @property
    def url(self) -> str:
        return self.kv_connector_extra_config["url"]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, name: str) -> float:
        """A TCPConnector setting: kv_connector_extra_config's, else its default (abort_request_timeout: vLLM's
        VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s unset)."""
        value = self.kv_connector_extra_config.get(name)
        if value is None and name == "abort_request_timeout":
            return envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT
        return float(value if value is not None else TCP_CONNECTOR_EXTRA[name])

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        return parse_json_flag(cls, "--kv-transfer-config", text)


def kv_transfer_refusal(config: KVTransferConfig | None, kv) -> str | None:
    """Why this instance cannot serve a request's kv_transfer_params (tokenmill/kv_transfer_params.py), or None."""
    tcp = config is not None and config.kv_connector == "TCPConnector"
    if kv.do_remote_decode and not (tcp and config.is_producer):
        return ("do_remote_decode needs a prefill instance (--kv-transfer-config with TCPConnector, kv_role "
                "kv_producer or kv_both)")
    if kv.do_remote_prefill and not (tcp and config.is_consumer):
        return ("do_remote_prefill needs a decode instance (--kv-transfer-config with TCPConnector, kv_role "
                "kv_consumer or kv_both)")
    return None


# --speculative-config: vLLM's JSON shape, e.g. '{"method": "ngram", "num_speculative_tokens": 4,
# "prompt_lookup_min": 2, "prompt_lookup_max": 5}', '{"method": "suffix"}' or '{"method": "draft_model", "model":
# PATH, "num_speculative_tokens": 4}' (as in vLLM, a "model" without a "method" means draft_model).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    # None: draft_model when a model is given (vLLM's inference), else ngram
    method: str | None = None
    # Most drafts per request and step. ngram: required in vLLM, 4 here by default; suffix: the tree depth
    # bounds it (vLLM's default there is suffix_decoding_max_tree_depth); draft_model: required, as in vLLM.
    num_speculative_tokens: int | None = None
    # draft_model: the draft (an HF directory or a GGUF file) sharing the target's tokenizer, and its
    # --quantization (None: auto, its weights as they are, as vLLM infers it from the draft).
    model: str | None = None
    quantization: str | None = None
    # ngram (prompt lookup): the longest n-gram of the context's tail, min..max tokens long, found earlier in
    # the prompt or output, proposes the tokens that followed it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix (vLLM's / Arctic Inference's names): a match is at most max_tree_depth tokens long; a draft is at
    # most max_spec_factor x the match length; a path is followed while its estimated probability (the product
    # of the continuation frequencies along it) stays >= min_token_prob; finished requests' outputs are kept
    # for cross-request matches, the newest max_cached_requests of them.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # tokenmill's own: choose the draft length per request and step from its measured acceptance and the
    # batch size (tokenmill/engine/spec_decode/adaptive.py); false: always propose up to num_speculative_tokens.
    adaptive: bool = True
    # The most tokens (decode rows plus drafts) a step may verify before drafts are cut; None: the measured
    # default (adaptive.DEFAULT_MAX_VERIFY_TOKENS).
    max_verify_tokens: int | None = None

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.method == "ngram":
            # vLLM's rule: one bound given, the other defaults to it; neither: 5 and 5 in vLLM, 2..5 here (a
            # 135M model's copies are found sooner with shorter keys, and a longer match is preferred anyway).
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min, self.prompt_lookup_max = 2, 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = 4
        elif self.method == "draft_model":
            if self.model is None or self.num_speculative_tokens is None:
                raise ValueError('--speculative-config: method draft_model needs "model" (the draft\'s path) and '
                                 '"num_speculative_tokens"')
        elif self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ValueError(f'--speculative-config: "model" and "quantization" are for method draft_model, not '
                             f"{self.method}")
        if self.num_speculative_tokens < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be at least 1")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("--speculative-config: suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if self.max_verify_tokens is not None and self.max_verify_tokens < 2:
            raise ValueError("--speculative-config: max_verify_tokens must be at least 2")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The flag's JSON text, or (offline LLM) a dict or a SpeculativeConfig."""
        return parse_json_flag(cls, "--speculative-config", value)


# --structured-outputs-config (or vLLM's dotted --structured-outputs-config.backend NAME): the grammar backend.
# tokenmill has xgrammar; vLLM's auto picks it first too.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")
UNAVAILABLE_STRUCTURED_OUTPUT_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"

    def __post_init__(self):
        if self.backend in UNAVAILABLE_STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend {self.backend!r} is not available; tokenmill "
                             "constrains decoding with xgrammar (backend xgrammar or auto)")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend must be one of "
                             f"{list(STRUCTURED_OUTPUT_BACKENDS + UNAVAILABLE_STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {self.backend!r}")

    @classmethod
    def parse(cls, value) -> StructuredOutputsConfig | None:
        return parse_json_flag(cls, "--structured-outputs-config", value)


# --load-format: vLLM's values. tokenmill reads safetensors and GGUF only and never unpickles (pt, npcache).
LOAD_FORMATS = ("auto", "safetensors", "gguf")

# --dtype: vLLM's names, half and float being its aliases of float16 and float32.
DTYPE_NAMES = ("auto", "bfloat16", "float16", "half", "float32", "float")


@dataclass
class EngineConfig(CliConfig):
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "HF directory, GGUF file, or SmolLM2-135M-Instruct"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: the model's)"})
    runner: str = field(default="auto", metadata={
        "help": "generate (text) | pooling (embeddings, score, rerank) | auto (pooling for encoders such as "
                "BertModel, else generate)", "choices": ["auto", "generate", "pooling"]})
    dtype: str = field(default="auto", metadata={
        "help": "auto|bfloat16|float16 (= half)|float32 (= float); auto: bfloat16 on CUDA and on CPUs with fast bf16, "
                "else float32 (tokenmill/models/loader.py resolve_dtype)", "choices": list(DTYPE_NAMES)})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    quantization: str = field(default="auto", metadata={
        "help": "weights: auto (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized, other types are dequantized; an HF "
                "model stays as it is) | none (dequantize everything to --dtype) | gguf (auto, but only for a GGUF) | "
                "int8 (per block of 32, with a min) | int4 (group-wise, group 32, with a min): weight-only, "
                "quantized at load | w8a8 (int8 weights per output channel and int8 activations per token at run "
                "time, int32 dot products: faster prefill; quantized at load from a dense or GGUF checkpoint, "
                "CPU only; the embedding and lm_head stay dense)",
        "choices": ["auto", "none", "gguf", "int8", "int4", "w8a8"]})
    load_format: str = field(default="auto", metadata={
        "help": "auto | safetensors (an HF directory) | gguf (a GGUF file); vLLM's other formats are refused: "
                "tokenmill never unpickles weights"})
    download_dir: str | None = field(default=None, metadata={
        "help": "a Hugging Face cache directory to find --model in, when --model is a repo id (org/name): its "
                "models--org--name/snapshots/ revision; nothing is ever downloaded"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "let transformers run code shipped with the checkpoint for its config and tokenizer (the model's "
                "forward pass is always tokenmill's own)"})
    hf_overrides: dict | None = field(default=None, metadata={
        "type": json.loads, "help": "a JSON object merged into the model's HF config (nested objects merged key by "
                                    "key), e.g. '{\"max_position_embeddings\": 4096}'"})
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters of requests that do not set them: auto (the model directory's "
                "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as "
                "max_tokens), vllm (none: vLLM's own defaults), or a directory holding a generation_config.json"})
    override_generation_config: dict | None = field(default=None, metadata={
        "type": json.loads, "help": "generation config keys set over --generation-config's defaults (alone with "
                                    "vllm), e.g. '{\"temperature\": 0.5}': temperature, top_p, top_k, min_p, "
                                    "repetition_penalty, max_new_tokens"})
    seed: int = field(default=0, metadata={"help": "seed for unseeded sampling"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the model's)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory: str = field(default="auto", metadata={
        "help": "KV pool size: bytes ('4GiB', '512MiB'), a fraction of free memory ('0.3'), or auto"})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "CUDA: the fraction of the GPU's total memory this server may fill (weights, activations and the KV "
                "pool, which gets what is left up to it); instead of --kv-cache-memory. Refused on the CPU"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache element: auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e5m2 | int8: one byte, so "
                "twice the tokens of bf16 in the same memory (scales: tokenmill/models/kv_quant.py)",
        "choices": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]})
    calculate_kv_scales: bool = field(default=False, metadata={
        "help": "fp8 KV cache: scales from the first forward pass's K/V amax (vLLM's rule) instead of 1.0; int8 "
                "always calculates them"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={"help": "force the number of KV blocks"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    enable_sleep_mode: bool = field(default=False, metadata={
        "help": "let POST /sleep free memory and POST /wake_up restore it (vLLM's development endpoints, served "
                "with VLLM_SERVER_DEV_MODE=1): level 1 frees the KV pool and the caches built from the weights, "
                "level 2 the weights too, loaded again from the checkpoint on wake_up"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests in one batch"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget of one step (default: 512 on CPU, so a prefill chunk stalls running decodes for "
                "~0.3 s rather than over a second; 2048 on CUDA)"})
    max_step_latency_ms: float | None = field(default=None, metadata={
        "help": "while decodes run, prefill chunks get only the tokens that keep a step within this many ms, as "
                "predicted by a step-cost model fitted from the engine's own steps (Sarathi-Serve's stall-free "
                "batching). Default: twice what the step's decodes alone cost, at least 30 ms (until the model has "
                "fitted, at most 64 prefill tokens beside decodes, fewer where the latest steps say 64 would pass "
                "the target); with --max-num-batched-tokens set and this "
                "not, the token budget alone decides (vLLM's rule); 0: off"})
    enable_chunked_prefill: bool | None = field(default=None, metadata={
        "help": "always on (a prompt longer than the step's token budget is prefilled in chunks); "
                "--no-enable-chunked-prefill is refused"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "tokenmill runs a model on one device: only 1 is accepted"})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs|priority", "choices": ["fcfs", "priority"]})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto (tokenmill's CPU kernels where they serve, the Triton kernels on CUDA, else torch_sdpa) | cpu | "
                "triton | torch_sdpa (the pure-torch reference)", "choices": ["auto", "cpu", "triton", "torch_sdpa"]})
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [512], metadata={
        "type": int, "nargs": "+",
        "help": "CUDA: decode batch sizes captured as CUDA graphs, vLLM's rule: one value N captures 1, 2, 4 and every "
                "multiple of 8 up to N; several values capture those; none above --max-num-seqs "
                "(tokenmill/engine/cuda_graph.py)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly, capturing no CUDA graphs"})
    max_logprobs: int = field(default=20, metadata={
        "help": "most logprobs (or prompt logprobs) a request may ask for; -1: the whole vocabulary"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "split <think> reasoning into reasoning_content: deepseek_r1|qwen3", "choices": ["deepseek_r1", "qwen3"]})
    think_start_str: str | None = field(default=None, metadata={
        "help": "the string that opens reasoning (default <think>; alone, it turns reasoning on)"})
    think_end_str: str | None = field(default=None, metadata={
        "help": "the string that closes reasoning (default </think>)"})
    kv_events_config: KVEventsConfig | None = field(default=None, metadata={
        "type": KVEventsConfig.from_json,
        "help": "publish KV cache events in vLLM's format, as vLLM's JSON: "
                '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                '"topic": "kv@replica-1@SmolLM2"}\' (the ZMQ PUB endpoint, a ROUTER endpoint that replays missed '
                "batches, buffer_steps, hwm, max_queue_size, publisher zmq|null)"})

    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "type": SpeculativeConfig.parse,
        "help": "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or '{\"method\": \"suffix\"}' "
                "(suffix_decoding_max_tree_depth, _max_cached_requests, _max_spec_factor, _min_token_prob) or "
                "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' (a smaller model "
                "with the target's tokenizer; optional \"quantization\"); draft lengths adapt to each request's acceptance and the batch size unless \"adaptive\": false "
                "(tokenmill/engine/spec_decode/)"})
    # parsed in __post_init__, not by argparse, so that a refused backend's message reaches the user as it is
    structured_outputs_config: StructuredOutputsConfig | None = field(default=None, metadata={
        "help": "vLLM's JSON, '{\"backend\": \"xgrammar\"}', or --structured-outputs-config.backend xgrammar: "
                "auto and xgrammar are served (xgrammar); guidance, outlines and lm-format-enforcer are refused"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT directories) beside the base model, in the same batches (tokenmill/lora/)"})
    max_loras: int = field(default=1, metadata={"help": "LoRA adapters one step can compute with (slots)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank served (slots are this wide)"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "LoRA adapters kept loaded on the CPU, least recently used dropped first (default: --max-loras)"})
    kv_offloading_size: float | None = field(default=None, metadata={
        "help": "GiB of KV blocks kept beyond the pool (vLLM's flag): every computed prefix block is also saved "
                "there, and a request whose prefix left the pool loads it back instead of computing it "
                "(tokenmill/engine/kv_offload.py)"})
    kv_offloading_backend: str = field(default="native", metadata={
        "help": "where --kv-offloading-size keeps blocks: native (host memory, vLLM's default) | disk (files "
                "under --kv-offloading-dir, found again after a restart)", "choices": ["native", "disk", "lmcache"]})
    kv_offloading_dir: str | None = field(default=None, metadata={
        "help": "the disk tier's directory (default: kv-blocks under TOKENMILL_CACHE_DIR)"})
    kv_transfer_config: KVTransferConfig | None = field(default=None, metadata={
        "type": KVTransferConfig.from_json,
        "help": "share KV blocks with other instances, as vLLM's JSON: '{\"kv_connector\": \"ValkeyConnector\", "
                "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"url\": \"redis://HOST:6379\"}}' "
                "(a Valkey or Redis server that every replica writes its computed blocks to and loads prefixes from; "
                "kv_producer only writes, kv_consumer only reads; tokenmill/engine/kv_offload.py), or "
                "disaggregated prefill/decode: '{\"kv_connector\": \"TCPConnector\", \"kv_role\": \"kv_producer\", "
                "\"kv_ip\": \"HOST\", \"kv_port\": PORT}' on the prefill instance (it serves its requests' blocks "
                "there), kv_consumer on the decode instance (tokenmill/engine/kv_transfer.py)"})

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # LLM(...) may pass a dict
        self.structured_outputs_config = StructuredOutputsConfig.parse(self.structured_outputs_config)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format!r} is not supported: tokenmill loads "
                             f"{', '.join(LOAD_FORMATS)} (safetensors from an HF directory, or a GGUF file) and never "
                             "unpickles weights")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: tokenmill runs a model on one "
                             "device and has no tensor parallelism; run several replicas behind `tokenmill router` "
                             "instead")
        if self.enable_chunked_prefill is False:
            raise ValueError("--no-enable-chunked-prefill: tokenmill always chunks a prefill longer than "
                             "--max-num-batched-tokens; raise that flag to prefill longer prompts in one step")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.kv_cache_memory != "auto":
                raise ValueError("give --gpu-memory-utilization or --kv-cache-memory, not both")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"--hf-overrides takes a JSON object, got {self.hf_overrides!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"--override-generation-config takes a JSON object, got "
                             f"{self.override_generation_config!r}")
        self.kv_transfer_config = KVTransferConfig.from_json(self.kv_transfer_config)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.max_step_latency_ms is not None and self.max_step_latency_ms < 0:
            raise ValueError(f"--max-step-latency-ms must be >= 0 (0: off), got {self.max_step_latency_ms}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1) or self.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be positive")
        reasoning_spec(self.reasoning_parser, self.think_start_str, self.think_end_str)  # raises if invalid
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        if self.kv_offloading_backend == "lmcache":
            raise ValueError("--kv-offloading-backend lmcache: LMCache is not supported; use native (host memory) "
                             "or disk")
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"--kv-offloading-size must be positive (GiB), got {self.kv_offloading_size}")
        if self.kv_offloading_size is None and (self.kv_offloading_backend != "native" or self.kv_offloading_dir):
            raise ValueError("--kv-offloading-backend and --kv-offloading-dir take effect with --kv-offloading-size")

    @property
    def reasoning(self) -> ReasoningSpec | None:
        return reasoning_spec(self.reasoning_parser, self.think_start_str, self.think_end_str)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024**2,
          "g": 1e9, "gb": 1e9, "gib": 1024**3}


def parse_memory(text: str, free_bytes: int) -> int:
    """'4GiB' → bytes; '0.3' → that fraction of free memory."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse --kv-cache-memory {text!r}; use e.g. 4GiB, 512MiB or 0.3")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and value <= 1.0:
        return int(value * free_bytes)
    return int(value * _UNITS[unit])

