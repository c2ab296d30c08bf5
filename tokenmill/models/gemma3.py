"""Gemma 3 (text): the Llama decoder with local and global layers, over the same flat batch and paged KV cache.

What differs from Llama, and how it is met here without new kernels:
- Sliding-window layers interleaved with global ones (`layer_types`): a local layer passes its window to the
  attention backend, which reads only keys inside it; each kind of layer has its own RoPE base
  (`rope_parameters[layer_type]`: 1e6 global, 1e4 local), so each passes its own RotaryEmbedding.
- RMSNorm scales by (1 + w). We store 1 + w in the weight at load time, so Llama's RMSNorm and the CPU
  kernels' fused add + norm (and the q/k norms inside rope_and_cache) serve unchanged. In float32 the product
  is the same as HF's `x * (1 + w)`.
- Norms before and after both attention and the MLP; the residual stream is still carried beside the hidden
  state, so `pre_feedforward_layernorm` is the fused residual add + norm and the two post norms are plain.
- GeGLU (tanh-approximated GELU), embeddings scaled by sqrt(hidden_size) in the model dtype (as HF), queries
  scaled by query_pre_attn_scalar ** -0.5, tied lm_head, optional final logit softcapping.

The fused decoder-stack kernel (llama_forward) is Llama-shaped, so Gemma 3 runs layer by layer on the CPU
kernels (attention, norms, linears)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.attention import AttentionMetadata
from tokenmill.models.linear import Linear
from tokenmill.models.llama import FULL, MLP, SLIDING, Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding

def layer_types(config) -> list[str]:
    """HF's layer_types, or the older sliding_window_pattern (every n-th layer global)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


def rope_config(config, layer_type: str):
    """A config that llama.rope_inv_freq reads for one kind of layer."""
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(layer_type) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_local_base_freq", 10000.0) if layer_type == SLIDING
        else getattr(config, "rope_theta", 1e6)}
    return SimpleNamespace(rope_parameters=params, head_dim=config.head_dim, hidden_size=config.hidden_size,
                           num_attention_heads=config.num_attention_heads)


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    def __init__(self, config, sliding_window: int | None):
        super().__init__(config, qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
                         qk_norm=True, sliding_window=sliding_window)
        self.scale = config.query_pre_attn_scalar ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, config.sliding_window if layer_type == SLIDING else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GeGLU(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x, residual, kv_cache, meta, backend, rope):
        """Returns (this layer's normed MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, kv_cache, meta, backend, rope))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Reuses LlamaForCausalLM's weight fusing, packing, tied lm_head and CPU-kernel wiring."""

    def __init__(self, config, max_positions: int):
        nn.Module.__init__(self)
        if getattr(config, "attn_logit_softcapping", None):  # Gemma 2's; Gemma 3 checkpoints leave it unset
            raise ValueError("Gemma3ForCausalLM: attn_logit_softcapping is not supported")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t) for t in layer_types(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                    bias=False)
        self.tied_lm_head_packed = None
        self.kernel_ops, self.tied_lm_head_small_m = None, None
        self.fused_ops, self.fused_weights = None, None
        self.softcap = getattr(config, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.build_rotary(max_positions, None)

    def build_rotary(self, max_positions: int, device) -> None:
        """The RoPE tables of global layers (self.rotary) and of local ones; computed, never loaded, float32."""
        self.rotary = RotaryEmbedding(rope_config(self.config, FULL), max_positions)
        self.rotary_local = RotaryEmbedding(rope_config(self.config, SLIDING), max_positions)
        if device is not None:
            self.rotary, self.rotary_local = self.rotary.to(device), self.rotary_local.to(device)

    def use_cpu_kernels(self, ops) -> None:
        super().use_cpu_kernels(ops)
        self.fused_ops, self.fused_weights = None, None  # llama_forward has Llama's layer shape, not Gemma's

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        meta.rope = self.rotary
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)  # rounded to the dtype, as HF
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            rope = self.rotary_local if layer.layer_type == SLIDING else self.rotary
            x, residual = layer(x, residual, kv_cache, meta, backend, rope)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights) -> set[str]:
        """HF's Gemma 3 names; norms are stored as 1 + w (see the module docstring)."""
        def shifted():
            for name, tensor in weights:
                yield name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
        return super().load_weights(shifted())
