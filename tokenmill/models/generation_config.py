"""--generation-config: the default sampling parameters a model's creator recommends in its generation_config.json,
applied (as vLLM does) to the requests that do not set them. Torch-free: the API server reads them."""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("tokenmill.generation_config")

# generation_config.json's keys that vLLM takes as defaults, and the request field each one sets
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str, flag: str = "auto", override: dict | None = None) -> dict:
    """flag: auto (the model directory's file; a GGUF file has none), vllm (no defaults), or a directory whose
    generation_config.json is read, which must be there. override (--override-generation-config): generation
    config keys set over those (alone with vllm), as vLLM merges them; another key is a ValueError naming it."""
    unknown = sorted(set(override or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} not among the keys it sets "
                         f"({', '.join(SAMPLING_KEYS)})")
    defaults = _file_defaults(model_path, flag)
    defaults.update({SAMPLING_KEYS[key]: value for key, value in (override or {}).items()})
    if override:
        logger.info("default sampling parameters with --override-generation-config: %s", defaults)
    return defaults


def _file_defaults(model_path: str, flag: str) -> dict:
    if flag == "vllm":
        return {}
    folder = model_path if flag == "auto" else flag
    path = os.path.join(folder, "generation_config.json")
    if flag != "auto" and not os.path.isfile(path):
        raise FileNotFoundError(f"--generation-config {flag!r}: no generation_config.json there (use auto, vllm, or "
                                "a directory holding one)")
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError):
        return {}
    defaults = {field: values[key] for key, field in SAMPLING_KEYS.items() if values.get(key) is not None}
    if defaults:
        logger.info("default sampling parameters from %s (--generation-config vllm ignores them): %s", path, defaults)
    return defaults
