"""Configuration as dataclasses whose fields are the CLI flags (vLLM's names): EngineConfig here, and the API
server's ServerConfig in tokenmill/server/server_config.py. CliConfig turns the fields into argparse flags."""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field

from tokenmill.engine.kv_events import KVEventsConfig
from tokenmill.engine.spec_decode.config import SpeculativeConfig
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
            if f.type in ("bool", bool):
                parser.add_argument(flag, default=f.default, action=argparse.BooleanOptionalAction, help=help_)
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
class EngineConfig(CliConfig):
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "HF directory, GGUF file, or SmolLM2-135M-Instruct"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: the model's)"})
    runner: str = field(default="auto", metadata={
        "help": "generate (text) | pooling (embeddings, score, rerank) | auto (pooling for encoders such as "
                "BertModel, else generate)", "choices": ["auto", "generate", "pooling"]})
    dtype: str = field(default="auto", metadata={"help": "auto|bfloat16|float16|float32",
                                                  "choices": ["auto", "bfloat16", "float16", "float32"]})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    quantization: str = field(default="auto", metadata={
        "help": "weights: auto (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized, other types are dequantized; an HF "
                "model stays as it is) | none (dequantize everything to --dtype) | gguf (auto, but only for a GGUF) | "
                "int8 (symmetric, per block of 32) | int4 (group-wise, group 32, with a min): quantized at load",
        "choices": ["auto", "none", "gguf", "int8", "int4"]})
    seed: int = field(default=0, metadata={"help": "seed for unseeded sampling"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the model's)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory: str = field(default="auto", metadata={
        "help": "KV pool size: bytes ('4GiB', '512MiB'), a fraction of free memory ('0.3'), or auto"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache element: auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e5m2 | int8: one byte, so "
                "twice the tokens of bf16 in the same memory (scales: tokenmill/models/kv_quant.py)",
        "choices": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]})
    calculate_kv_scales: bool = field(default=False, metadata={
        "help": "fp8 KV cache: scales from the first forward pass's K/V amax (vLLM's rule) instead of 1.0; int8 "
                "always calculates them"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={"help": "force the number of KV blocks"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests in one batch"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "token budget of one step (default: 512 on CPU, so a prefill chunk stalls running decodes for "
                "~0.3 s rather than over a second; 2048 on CUDA)"})
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
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT directories) beside the base model, in the same batches (tokenmill/lora/)"})
    max_loras: int = field(default=1, metadata={"help": "LoRA adapters one step can compute with (slots)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank served (slots are this wide)"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "LoRA adapters kept loaded on the CPU, least recently used dropped first (default: --max-loras)"})

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # LLM(...) may pass a dict
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1) or self.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be positive")
        reasoning_spec(self.reasoning_parser, self.think_start_str, self.think_end_str)  # raises if invalid
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")

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

