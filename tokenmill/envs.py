"""Every environment variable tokenmill reads, with its default, in one place.

Read them as attributes (`envs.TOKENMILL_CACHE_DIR`): each access reads the environment as it is now, so a test
or a parent process that sets a variable is seen at once. Flags win over these where both exist."""
from __future__ import annotations

import os
from collections.abc import Callable


def _cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true")


ENVIRONMENT_VARIABLES: dict[str, Callable[[], object]] = {
    # `tokenmill serve`: the key /v1/* requires when --api-key is not given
    "TOKENMILL_API_KEY": lambda: os.environ.get("TOKENMILL_API_KEY") or None,
    # where built kernels and converted GGUF tokenizers are kept (default ~/.cache/tokenmill)
    "TOKENMILL_CACHE_DIR": _cache_dir,
    # avx512 | avx2 | none: force one build of the CPU kernels, or none (default: the best this CPU runs)
    "TOKENMILL_CPU_ISA": lambda: os.environ.get("TOKENMILL_CPU_ISA", "").strip().lower(),
    # text | json; `tokenmill serve` sets it from --log-format so that the engine process logs alike
    "TOKENMILL_LOG_FORMAT": lambda: os.environ.get("TOKENMILL_LOG_FORMAT", "text"),
    # "1": no progress bar while weights load
    "TOKENMILL_NO_PROGRESS": lambda: os.environ.get("TOKENMILL_NO_PROGRESS") == "1",
    # seconds between the server's stats log lines (vLLM's 10 s)
    "TOKENMILL_STATS_LOG_INTERVAL_S": lambda: float(os.environ.get("TOKENMILL_STATS_LOG_INTERVAL_S", "10")),
    # vLLM's: "1" or "true" serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters at run time)
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    in ("1", "true"),
    # vLLM's: seconds a prefill instance keeps a finished request's KV blocks for the decode instance that has not
    # fetched them yet (--kv-transfer-config's kv_connector_extra_config.abort_request_timeout wins)
    "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": lambda: float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480")),
    # vLLM's: "1" or "true" serves its development endpoints (POST /reset_prefix_cache, /sleep, /wake_up, GET
    # /is_sleeping)
    "VLLM_SERVER_DEV_MODE": lambda: os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true"),
    # vLLM's: a directory turns on POST /start_profile and /stop_profile (LLM.start_profile, stop_profile): torch's
    # profiler records the engine process in between, and writes a Chrome trace (.pt.trace.json.gz) there
    "VLLM_TORCH_PROFILER_DIR": lambda: os.environ.get("VLLM_TORCH_PROFILER_DIR") or None,
    # vLLM's, for that profiler: record op input shapes, Python stacks (on by default), memory, and FLOPs estimates
    "VLLM_TORCH_PROFILER_RECORD_SHAPES": lambda: _flag("VLLM_TORCH_PROFILER_RECORD_SHAPES", "0"),
    "VLLM_TORCH_PROFILER_WITH_STACK": lambda: _flag("VLLM_TORCH_PROFILER_WITH_STACK", "1"),
    "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": lambda: _flag("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", "0"),
    "VLLM_TORCH_PROFILER_WITH_FLOPS": lambda: _flag("VLLM_TORCH_PROFILER_WITH_FLOPS", "0"),
    # the C++ compiler for the CPU kernels
    "CXX": lambda: os.environ.get("CXX") or "g++",
    # torch's thread count in the engine process; when set, tokenmill does not choose one
    "OMP_NUM_THREADS": lambda: os.environ.get("OMP_NUM_THREADS") or None,
    # `tokenmill bench serve`: the API key sent when --api-key is not given
    "OPENAI_API_KEY": lambda: os.environ.get("OPENAI_API_KEY"),
    # OpenTelemetry's own: where spans go when --otlp-traces-endpoint is not given, and the service name
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
    "OTEL_EXPORTER_OTLP_ENDPOINT": lambda: os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
    "OTEL_SERVICE_NAME": lambda: os.environ.get("OTEL_SERVICE_NAME", "tokenmill"),
    # Triton's own: "1" runs its kernels on the CPU through its interpreter (the tests of kernels/triton/)
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET") == "1",
}


def __getattr__(name: str):
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT_VARIABLES)
