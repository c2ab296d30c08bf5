"""Every supported architecture, as a tiny random HF checkpoint: tokenmill's greedy ids equal HF's, on each
attention path: the pure-torch reference, the CPU kernels layer by layer, and the CPU kernels' fused decoder
stack (llama_forward)."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from helpers import build_tiny_model, hf_greedy, tiny_config
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import runnable_isas
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.registry import MODEL_REGISTRY

PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
           "def fibonacci(n):"]
MAX_TOKENS = 12


CASES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm-head-dim": ("qwen3", {"head_dim": 64, "tie_word_embeddings": False}),
    # a window shorter than every prompt, local and global layers with their own RoPE bases, query scaling
    # that is not head_dim ** -0.5, and final logit softcapping
    "gemma3-sliding-window": ("gemma3", {
        "head_dim": 32, "num_hidden_layers": 3, "sliding_window": 5, "query_pre_attn_scalar": 48,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "final_logit_softcapping": 5.0,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
}


# The fast loop (-m "not slow") checks every architecture on the path that serves by default (the fused CPU
# kernels, where they run); the full run checks the other paths too. A case takes ~1-7 s on 2 cores.
DEFAULT_PATH = "cpu-fused" if runnable_isas() else "torch_sdpa"
PATHS = [path if path == DEFAULT_PATH else pytest.param(path, marks=pytest.mark.slow)
         for path in ("torch_sdpa", "cpu-layers", "cpu-fused")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_greedy_matches_hf(case, path, tokenizer_dir, tokenizer, tmp_path, monkeypatch):
    if path != "torch_sdpa" and not runnable_isas():
        pytest.skip("no CPU kernel build runs here")
    arch, kw = CASES[case]
    model = build_tiny_model(arch, str(tmp_path), tokenizer_dir, tokenizer, **kw)
    tok = tokenizer
    if case == "qwen2-qkv-bias":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.model.layers[0].self_attn.o_proj.bias is None
    if case == "qwen3-qk-norm-head-dim":
        assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 64 != model.config.hidden_size
    if "tie_word_embeddings" in kw:
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == kw["tie_word_embeddings"]

    prompts = [tok.encode(p) for p in PROMPTS]
    want = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    # a token budget smaller than the longest prompt: chunked prefill on every architecture
    if path == "cpu-layers":  # the kernels one op at a time, as where the weights are not prepacked
        use = LlamaForCausalLM.use_cpu_kernels
        monkeypatch.setattr(LlamaForCausalLM, "use_cpu_kernels",
                            lambda self, ops: (use(self, ops), setattr(self, "fused_ops", None)))
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=8,
              attention_backend=path.split("-")[0])
    assert llm.engine.model_info.architecture == model.config.architectures[0]
    # Gemma 3's layer shape is not llama_forward's: it runs layer by layer on every CPU path
    assert (llm.engine.runner.model.fused_ops is not None) == (path == "cpu-fused" and arch != "gemma3")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want


def test_every_registered_architecture_is_covered():
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
    encoders = {"BertModel"}  # tested against sentence-transformers with a real model, in tests/test_embeddings.py
    assert {names[arch] for arch, _ in CASES.values()} | encoders == set(MODEL_REGISTRY)


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(ValueError) as e:
        LLM(model=str(tmp_path), dtype="float32", device="cpu")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in MODEL_REGISTRY:
        assert arch in msg


class _Tripwire:
    """Unpickling this creates a directory: proof that a loader called pickle on the file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_pickled_weights_are_refused_and_never_unpickled(tmp_path):
    tiny_config("llama", 100).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    marker = str(tmp_path / "UNPICKLED")
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    with pytest.raises(FileNotFoundError) as e:
        LLM(model=str(tmp_path), dtype="float32", device="cpu")
    assert "safetensors" in str(e.value)
    assert not os.path.exists(marker)


def test_model_eos_token_ids(tmp_path):
    """The ids that end a generation besides the tokenizer's EOS: generation_config.json's eos_token_id (an id or
    a list) for an HF directory, as vLLM reads it; the GGUF EOS (and eot/eom and llama.cpp's end-of-generation
    texts) for a GGUF. SmolLM2's <|endoftext|> is not among them (neither HF nor vLLM stops there)."""
    from tokenmill.models.loader import generation_eos_token_ids, load_model_config
    from tokenmill.models.paths import default_model_path
    assert generation_eos_token_ids(str(tmp_path)) == frozenset()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert generation_eos_token_ids(str(tmp_path)) == {1, 106}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_eos_token_ids(str(tmp_path)) == {7}
    assert load_model_config(default_model_path()).eos_token_ids == {2}
