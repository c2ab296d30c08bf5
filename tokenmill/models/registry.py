"""Maps config.json's `architectures` to our model classes."""
from __future__ import annotations

from tokenmill.models.bert import BertModel
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM, layer_windows


def _llama_options(config) -> dict:
    bias = bool(getattr(config, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


# architecture → (class, options derived from the HF config), each as HF's implementation reads the config:
# Llama has no window and biases per attention_bias; Mistral has no biases and its window on every layer;
# Qwen2 has q/k/v biases and no o bias; Qwen2 and Qwen3 window the layers layer_types marks sliding.
MODEL_REGISTRY = {
    "LlamaForCausalLM": (LlamaForCausalLM, _llama_options),
    "MistralForCausalLM": (LlamaForCausalLM, lambda c: {"qkv_bias": False, "o_bias": False, "qk_norm": False,
                                                        "sliding_windows": layer_windows(c, every_layer=True)}),
    "Qwen2ForCausalLM": (LlamaForCausalLM, lambda c: {"qkv_bias": True, "o_bias": False, "qk_norm": False,
                                                      "sliding_windows": layer_windows(c, every_layer=False)}),
    "Qwen3ForCausalLM": (LlamaForCausalLM, lambda c: {**_llama_options(c), "qk_norm": True,
                                                      "sliding_windows": layer_windows(c, every_layer=False)}),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, lambda c: {}),
    "BertModel": (BertModel, lambda c: {}),  # an encoder: pooling only (RoBERTa's family waits for a test model)
}


def resolve_architecture(config):
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            cls, options = MODEL_REGISTRY[arch]
            return arch, cls, options(config)
    raise ValueError(f"unsupported model architecture {archs or '(none given)'}; "
                     f"tokenmill supports: {', '.join(sorted(MODEL_REGISTRY))}")
