"""GGUF files: config from the metadata, HF tensor names, weights dequantized with the gguf package or kept
quantized (Q4_0, Q4_1, Q8_0: tokenmill/models/quantization.py)."""
from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig

from tokenmill.models.quantization import GGUF_KEPT_TYPES, from_gguf

# GGUF architecture → HF architecture and model_type
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
          "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
          "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms both sides of attention and of the MLP; llama.cpp's ffn_norm is the one before the MLP.
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: GGUFReader):
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tokenmill supports: {', '.join(_ARCHS)}")
    hf_arch, model_type = _ARCHS[arch]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs = dict(
        architectures=[hf_arch], vocab_size=vocab, hidden_size=g("embedding_length"),
        intermediate_size=g("feed_forward_length"), num_hidden_layers=g("block_count"),
        num_attention_heads=heads, num_key_value_heads=g("attention.head_count_kv", heads),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-6), max_position_embeddings=g("context_length"),
        rope_theta=g("rope.freq_base", 10000.0), tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    if g("attention.key_length"):
        kwargs["head_dim"] = g("attention.key_length")
    if arch == "gemma3":  # what the file leaves out takes HF's Gemma3TextConfig defaults, as HF's own loader
        rope = {"full_attention": kwargs.pop("rope_theta"), "sliding_attention": 10000.0}
        kwargs.update(sliding_window=g("attention.sliding_window"), query_pre_attn_scalar=kwargs.get("head_dim", 256),
                      rope_parameters={t: {"rope_type": "default", "rope_theta": b} for t, b in rope.items()})
    return AutoConfig.for_model(model_type, **kwargs), arch


# Token texts llama.cpp treats as end of generation besides the declared EOS (its EOG set). <|endoftext|> is left
# out: models that use it as their EOS declare it, and where they do not (SmolLM2) neither HF nor vLLM stop there.
EOG_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<EOT>", "<end_of_utterance>")


def gguf_eos_token_ids(reader: GGUFReader) -> frozenset[int]:
    ids = {_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return frozenset(ids | {i for i, text in enumerate(tokens) if text in EOG_TEXTS})


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores Llama q/k rows interleaved per rotary pair; HF's rotate_half wants the halves split.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(reader: GGUFReader, config, arch: str, keep_quantized: bool = False):
    """Yields (HF name, float32 tensor) for every tensor in the file; with keep_quantized, a 2-D tensor of a type
    the quantized kernels serve (Q4_0, Q4_1, Q8_0) comes as a QuantizedTensor with the same values instead."""
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m:
            names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
            name = f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        else:
            base, _, leaf = t.name.rpartition(".")
            name = f"{_GLOBAL_NAMES[base]}.{leaf}"
        shape = tuple(reversed([int(d) for d in t.shape]))
        permuted_heads = None
        if arch in ("llama", "mistral") and m and m.group(2) in ("attn_q", "attn_k"):
            permuted_heads = config.num_attention_heads if m.group(2) == "attn_q" else config.num_key_value_heads
        if keep_quantized and len(shape) == 2 and t.tensor_type.name in GGUF_KEPT_TYPES:
            q = from_gguf(t.data, t.tensor_type.name, shape)
            if permuted_heads:  # a row reorder: the same on quantized rows
                q = q.rows(torch.from_numpy(_unpermute(np.arange(shape[0]), permuted_heads)))
            yield name, q
            continue
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if permuted_heads:
            w = _unpermute(w, permuted_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1  # llama.cpp stores Gemma's 1 + w; HF's checkpoint names hold w
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the file is mapped read-only
