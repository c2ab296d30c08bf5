"""A PEFT LoRA adapter read from its directory: adapter_config.json and adapter_model.safetensors (never a pickle).

What a linear layer W gains: x @ W^T + scale * (x @ A^T) @ B^T, with A [r, in] and B [out, r], on any of q/k/v/o/
gate/up/down; scale = lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA (`use_rslora`), per module when
`rank_pattern` / `alpha_pattern` say so. The model fuses q/k/v and gate/up into one linear each (models/llama.py),
so an adapter's q_proj is shard 0 of qkv_proj; the scale is folded into B here, once.

Anything an adapter asks for that these deltas would not compute (DoRA, LoRA biases, modules_to_save, embeddings
or lm_head, a rank above --max-lora-rank) is refused with a message that says what, never served wrong."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from tokenmill.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name → (the fused linear that holds it in tokenmill's model, shard)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight")
# adapter_config.json settings whose adapters compute something else than the delta above
_REFUSED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save",
            "fan_in_fan_out": "fan_in_fan_out", "alora_invocation_tokens": "activated LoRA (aLoRA)",
            "layer_replication": "layer_replication", "trainable_token_indices": "trainable_token_indices"}


class LoRAError(ValueError):
    """An adapter that cannot be served; not_found: its path holds no adapter (vLLM answers 404 then, else 400)."""

    def __init__(self, message: str, not_found: bool = False):
        super().__init__(message)
        self.not_found = not_found


@dataclass(frozen=True)
class LinearShape:
    """One fused linear of the model: its input features and each shard's output features."""
    in_features: int
    shard_out: tuple[int, ...]


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of its modules
    # (layer, fused linear) → per shard (A [r, in], scale * B [out, r]) or None where the adapter leaves it alone
    weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for shards in self.weights.values() for pair in shards if pair
                   for t in pair)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name that ends with it (a regex)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?({key})", module):
            return value
    return default


def read_adapter_config(path: str, request: LoRARequest) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        # vLLM's words, which its API maps to 404
        raise LoRAError(f"Loading lora {request.lora_name} failed: No adapter found for {path}", not_found=True)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"Loading lora {request.lora_name} failed: cannot read {CONFIG_FILE}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"Loading lora {request.lora_name} failed: peft_type {config['peft_type']!r} is not LORA")
    for key, what in _REFUSED.items():
        if config.get(key) not in (None, False, [], {}):
            raise LoRAError(f"Loading lora {request.lora_name} failed: {what} adapters are not supported "
                            f"({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"Loading lora {request.lora_name} failed: LoRA biases are not supported "
                        f"(bias={config['bias']!r})")
    return config


def load_adapter(request: LoRARequest, shapes: dict[str, LinearShape], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Reads, checks and scales an adapter for a model whose fused linears have these shapes. Raises LoRAError."""
    path = request.lora_path
    config = read_adapter_config(path, request)
    name = request.lora_name
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(path, f))]
        hint = f" ({pickled[0]} is a pickle, which tokenmill never loads)" if pickled else ""
        raise LoRAError(f"Loading lora {name} failed: no {WEIGHTS_FILE} in {path}{hint}")
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None or m.group(3) not in TARGETS or TARGETS[m.group(3)][0].split(".")[0] != m.group(2):
                    raise LoRAError(f"Loading lora {name} failed: tensor {key!r} is not a LoRA A/B of a q/k/v/o/gate/"
                                    "up/down projection, the modules tokenmill serves adapters on")
                layer, proj = int(m.group(1)), m.group(3)
                pairs.setdefault((layer, f"{m.group(2)}.{proj}", proj), {})[m.group(4)] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file is the adapter's problem, not the engine's
        raise LoRAError(f"Loading lora {name} failed: cannot read {WEIGHTS_FILE}: {e}") from None
    if not pairs:
        raise LoRAError(f"Loading lora {name} failed: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(request, 0)
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))  # PEFT's default alpha
    for (layer, module, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"Loading lora {name} failed: layer {layer} {proj} has lora_{set(ab).pop()} only")
        if layer >= num_layers:
            raise LoRAError(f"Loading lora {name} failed: it has layer {layer}, the model has {num_layers} layers")
        fused, shard = TARGETS[proj]
        shape = shapes[fused]
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if rank > max_rank:  # vLLM's words
            raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape != (shape.shard_out[shard], rank):
            raise LoRAError(f"Loading lora {name} failed: layer {layer} {proj} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; this model needs A [r, {shape.in_features}] and B "
                            f"[{shape.shard_out[shard]}, r]: was it trained on another base model?")
        full_name = f"model.layers.{layer}.{module}"
        module_alpha = _pattern_value(config.get("alpha_pattern"), full_name, alpha)
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        shards = adapter.weights.setdefault((layer, fused), [None] * len(shape.shard_out))
        shards[shard] = (a.to(dtype), (b.float() * scale).to(dtype))
        adapter.rank = max(adapter.rank, rank)
    return adapter
