"""Loads a model's config and weights (the path comes from tokenmill/models/paths.py).

Only safetensors and GGUF are read: nothing is ever unpickled, and nothing is downloaded."""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig

from tokenmill import envs
from tokenmill.models.linear import Linear
from tokenmill.models.llama import RotaryEmbedding
from tokenmill.models.quantization import (
    BLOCK,
    GGUF_KEPT_TYPES,
    LOAD_TIME,
    QuantizedEmbedding,
    QuantizedWeight,
    W8A8Weight,
    attach_kernels,
    describe_weights,
    quantization_kernels,
    quantize,
)
from tokenmill.models.registry import resolve_architecture

logger = logging.getLogger("tokenmill.loader")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "half": torch.float16, "float": torch.float32}  # vLLM's aliases


@dataclass
class ModelInfo:
    path: str
    hf_config: object
    architecture: str
    gguf_arch: str | None  # the GGUF file's architecture; None for an HF directory
    # Every id that ends a generation (unless ignore_eos): the tokenizer's EOS and the model's others, such as
    # Gemma's <end_of_turn>. vLLM reads them from generation_config.json; llama.cpp, for a GGUF, from the
    # eot/eom ids and its end-of-generation token texts.
    eos_token_ids: frozenset[int] = frozenset()


def load_model_config(model_path: str, load_format: str = "auto", trust_remote_code: bool = False,
                      hf_overrides: dict | None = None) -> ModelInfo:
    """load_format, trust_remote_code, hf_overrides: the flags (tokenmill/config.py EngineConfig)."""
    is_gguf = model_path.endswith(".gguf")
    if load_format != "auto" and load_format != ("gguf" if is_gguf else "safetensors"):
        raise ValueError(f"--load-format {load_format} does not match the model {model_path!r}, which is "
                         f"{'a GGUF file' if is_gguf else 'an HF directory (safetensors)'}")
    if is_gguf:
        from tokenmill.gguf_file import gguf_reader
        from tokenmill.models.gguf_loader import gguf_config, gguf_eos_token_ids
        reader = gguf_reader(model_path)
        config, arch = gguf_config(reader)
        apply_hf_overrides(config, hf_overrides)
        return ModelInfo(model_path, config, config.architectures[0], arch, gguf_eos_token_ids(reader))
    config = AutoConfig.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)
    apply_hf_overrides(config, hf_overrides)
    return ModelInfo(model_path, config, resolve_architecture(config)[0], None, generation_eos_token_ids(model_path))


def apply_hf_overrides(config, overrides: dict | None) -> None:
    """--hf-overrides, vLLM's rule: each key replaces the config's attribute, except that an object given for an
    attribute that is itself a dict (or a sub-config) is merged into it key by key."""
    for key, value in (overrides or {}).items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        elif isinstance(value, dict) and hasattr(current, "to_dict"):  # a nested PretrainedConfig
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)


def generation_eos_token_ids(model_dir: str) -> frozenset[int]:
    """generation_config.json's eos_token_id (an id or a list), as vLLM applies it."""
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos or [])


def cpu_has_fast_bf16() -> bool:
    from tokenmill.kernels import cpu_flags
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype the checkpoint's config names (`dtype`, or the older `torch_dtype`), if any."""
    configured = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return DTYPES.get(configured) if isinstance(configured, str) else configured


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        # bf16 matmuls are fast only with AMX or AVX512-BF16; elsewhere oneDNN emulates them and float32 wins
        # (measured on an AVX2-only EPYC: a 2048x576x1728 bf16 linear took 5x as long as float32).
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    # CUDA: bfloat16, whatever the checkpoint says (float32 and float16 checkpoints too, as the README's table
    # says): fp16's range overflows in some models' activations, bf16's does not; --dtype float16 still asks for it
    return torch.bfloat16


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


def quantize_linears(model: nn.Module, kind: str, ops) -> None:
    """`--quantization int8|int4`: every linear weight (and a tied embedding, which is also the lm_head) with K a
    multiple of 32 is quantized at load, replacing the dense weight. `w8a8`: every linear weight of the decoder
    layers, any K; the embedding and the lm_head stay dense (as vLLM's W8A8 checkpoints leave them: the logits
    are the most sensitive product, and a prefill computes them for its last token only)."""
    if kind == "w8a8":
        lm_head = getattr(model, "lm_head", None)
        for module in model.modules():
            if isinstance(module, Linear) and module.weight is not None and module is not lm_head:
                module.set_quantized(W8A8Weight(module.weight), ops)
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None and module.in_features % BLOCK == 0:
            module.set_quantized(QuantizedWeight(quantize(module.weight, kind)), ops)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", True) is None and isinstance(embed, nn.Embedding) and embed.embedding_dim % BLOCK == 0:
        model.embed_tokens = QuantizedEmbedding(QuantizedWeight(quantize(embed.weight, kind)))


# The initializers that torch's layers call from reset_parameters()
_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _no_initial_values():
    """Layers whose values the checkpoint gives skip torch's initializers: time wasted on the CPU, and on meta
    tensors torch's reference implementations, whose first call imports torch._dynamo and with it triton (seconds
    of start-up, and some 150 MB of resident memory that an engine never uses on the CPU, which sleep level 2 could
    not give back)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str = "none"):
    """quantization: --quantization (tokenmill/models/quantization.py); none keeps today's dense weights."""
    _, cls, options = resolve_architecture(info.hf_config)
    # Built without values (the checkpoint gives them): on the CPU in place, its tensors left unwritten until
    # loaded; on an accelerator on the meta device first, then given memory there.
    build_on = device if device.type == "cpu" else torch.device("meta")
    with build_on, _no_initial_values():
        model = cls(info.hf_config, max_positions, **options)
    if build_on != device:
        model = model.to_empty(device=device)
    reader = None
    if info.gguf_arch:
        from tokenmill.gguf_file import gguf_reader
        reader = gguf_reader(info.path)
    has_quantized = reader is not None and any(len(t.shape) == 2 and t.tensor_type.name in GGUF_KEPT_TYPES
                                               for t in reader.tensors)
    quant_ops = quantization_kernels(quantization, info.gguf_arch is not None, dtype, device, has_quantized)
    if reader is not None:
        from tokenmill.models.gguf_loader import gguf_weights
        keep = quant_ops is not None and quantization in ("auto", "gguf")
        weights, total = gguf_weights(reader, info.hf_config, info.gguf_arch, keep), len(reader.tensors)
    else:
        weights, total = _safetensors_weights(info.path), _count_safetensors(info.path)
    progress = tqdm(weights, total=total, desc=f"Loading {os.path.basename(info.path.rstrip('/'))}",
                    unit="tensor", disable=envs.TOKENMILL_NO_PROGRESS)
    loaded = model.load_weights(progress)
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    model = model.to(dtype).eval()
    if quant_ops is not None and quantization in LOAD_TIME:
        quantize_linears(model, quantization, quant_ops)
    attach_kernels(model, quant_ops)
    logger.info("weights (--quantization %s): %s", quantization, describe_weights(model))
    # computed, not loaded, and kept in float32 (the CPU kernels read these tables; torch casts per step)
    if hasattr(model, "build_rotary"):  # models with more than one RoPE table (Gemma 3)
        model.build_rotary(max_positions, device)
    else:
        model.rotary = RotaryEmbedding(info.hf_config, max_positions).to(device)
    model.pack_weights()
    return model
