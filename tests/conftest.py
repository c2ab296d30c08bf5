"""Shared fixtures: the embedded default model and its HF transformers reference."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENMILL_NO_PROGRESS", "1")
torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from tokenmill.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """HF transformers' own GGUF loader and Llama implementation, in float32: the correctness reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf),
                                                 gguf_file=os.path.basename(default_gguf), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    from tokenmill.models.loader import load_tokenizer
    return load_tokenizer(default_gguf)


def single_threaded_llm(**engine_args):
    """An offline LLM for a test module, run on one torch thread (yield from it in a module-scoped fixture).

    Decoding a few sequences gains little from a second thread, and where other processes share the cores,
    torch's thread pool then makes each step several times slower."""
    from tokenmill import LLM
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(dtype="float32", **engine_args)
    finally:
        torch.set_num_threads(threads)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation, forced to max_new_tokens (ignore EOS), one prompt at a time (no padding)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
