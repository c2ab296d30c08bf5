"""Issue 35: every accepted input is honoured or refused, never silently served as something else.

- Architecture fields that change the math (Mistral's sliding_window, Qwen2's use_sliding_window and
  max_window_layers, head_dim overrides, rope scaling types, MLP activations and biases): a tiny random
  checkpoint gives HF transformers' greedy ids on both attention backends, under chunked prefill and prefix
  hits, or the load fails naming the field.
- prompt_logprobs of a request preempted in the middle of its chunked prefill come back whole.
- /v1/completions with echo and max_tokens 0 scores the prompt (vLLM's behaviour), checked against HF's
  logprobs; max_tokens 0 without echo stays a 400."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from test_models import _build, tokenizer_dir  # noqa: F401  (tokenizer_dir: a fixture used below)
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import runnable_isas

WINDOW = 5
MAX_TOKENS = 10
TEXTS = ["The capital of France is Paris, and the capital of Italy is",
         "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
SHARED = ("A long shared preamble that every prompt of the prefix-cache test starts with, so that the second "
          "round finds whole cached blocks longer than the window: ")
BACKENDS = ["torch_sdpa", "cpu"]


def _backend(name: str) -> str:
    if name == "cpu" and not runnable_isas():
        pytest.skip("no CPU kernel build runs here")
    return name


def _check_windowed(arch: str, kw: dict, backend: str, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """tokenmill's greedy ids equal HF's for prompts longer than the window, in chunks of 8 tokens, then again
    with a shared prefix whose blocks are cached by the first round."""
    model = _build(arch, str(tmp_path), tokenizer_dir, tokenizer, **kw)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    prefixed = [tokenizer.encode(SHARED + t) for t in TEXTS]
    assert all(len(p) > 2 * WINDOW for p in prompts)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=8,
              attention_backend=backend, enable_prefix_caching=True)
    assert llm.engine.runner.model.fused_ops is None  # llama_forward has no window: layer by layer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for batch in (prompts, prefixed, prefixed):
        outs = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS) for p in batch]
    assert all(o.num_cached_tokens >= 16 for o in outs)  # the last round read its prefix from cached blocks
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_matches_hf(backend, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """A window of 5 tokens and a head_dim (64) that is not hidden_size / heads (32)."""
    model = _check_windowed("mistral", {"sliding_window": WINDOW, "head_dim": 64}, _backend(backend), tmp_path,
                            tokenizer_dir, tokenizer)
    assert model.config.sliding_window == WINDOW
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen2_sliding_window_layers_match_hf(backend, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """use_sliding_window with max_window_layers 1: layer 0 attends over everything, layer 1 through the window."""
    model = _check_windowed("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
                            _backend(backend), tmp_path, tokenizer_dir, tokenizer)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]


REFUSED = {  # (architecture, config fields, the field the error names)
    "activation": ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    "mlp-bias": ("llama", {"mlp_bias": True}, "mlp_bias"),
    "dynamic-rope-beyond-its-length": (
        "llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                  "max_position_embeddings": 64}, "rope_type"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unimplemented_architecture_fields_are_refused_at_load(case, tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    arch, kw, field = REFUSED[case]
    _build(arch, str(tmp_path), tokenizer_dir, tokenizer, **kw)
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=128)


def test_dynamic_rope_within_its_length_matches_hf(tmp_path, tokenizer_dir, tokenizer):  # noqa: F811
    """Up to max_position_embeddings HF's dynamic NTK tables are the static ones: served, and equal to HF."""
    model = _build("llama", str(tmp_path), tokenizer_dir, tokenizer, max_position_embeddings=64,
                   rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    prompt = tokenizer.encode(TEXTS[1])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, MAX_TOKENS)
