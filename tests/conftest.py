"""Shared fixtures: the embedded default model and its HF transformers reference."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENMILL_NO_PROGRESS", "1")
torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from tokenmill.models.paths import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """HF transformers' own GGUF loader and Llama implementation, in float32: the correctness reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf),
                                                 gguf_file=os.path.basename(default_gguf), dtype=torch.float32)
    return model.eval()


@pytest.fixture
def anyio_backend():
    """The async in-process API tests (pytest.mark.anyio) run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture(scope="module")
def app(tokenizer):
    """The OpenAI app as `tokenmill serve` builds it, on a fake engine client (tests/fake_engine.py)."""
    from fake_engine import InProcessServer
    return InProcessServer(tokenizer)


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    from tokenmill.tokenizer import load_tokenizer
    return load_tokenizer(default_gguf)


# A test that takes one of these fixtures, directly or through another fixture, is marked slow below: those that
# start a real `tokenmill serve` process (by convention any fixture named `*_server` does too), and HF's reference
# model (~13 s to load on 2 cores). A test that starts a server itself (RemoteServer, `tokenmill serve`,
# `bench serve --launch`) or runs long for another reason carries @pytest.mark.slow, or its module a pytestmark.
SERVER_FIXTURES = {"server", "lone_server", "obs_server", "tool_server"}
SLOW_FIXTURES = SERVER_FIXTURES | {"hf_reference"}


def pytest_collection_modifyitems(config, items):
    """`pytest -m "not slow"` is the fast inner loop; `make test` (no -m) still runs everything."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())  # the whole closure: fixtures of fixtures too
        if any(name in SLOW_FIXTURES or name.endswith("_server") for name in fixtures):
            item.add_marker(pytest.mark.slow)


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


def teacher_forced_agreement(llm, prompts: list[list[int]], refs: list[list[int]],
                             decode_steps: bool = False) -> tuple[float, float]:
    """The quality measure of the README and issue 15: the reference's greedy continuation fed as prompt; the
    share of positions where the reference's token is also llm's top-1, and where it is llm's unique maximum
    (strict: a tie counts as disagreement).

    decode_steps: each prompt is prefilled in one step, then its continuation fed one token per step, so that
    every scored position is computed as decoding computes it: the tokens before it read from the KV cache as
    stored, only its own K/V as just computed. In one prefill, a chunk's positions read each other's K/V as
    computed (a one-byte KV cache is only written), so that measure barely sees a quantized cache."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    if decode_steps:
        logprobs = [_prompt_logprobs_by_decode_steps(llm, f"decode-steps-{i}", p, r, params)
                    for i, (p, r) in enumerate(zip(prompts, refs))]
    else:
        logprobs = [o.prompt_logprobs for o in llm.generate([p + r for p, r in zip(prompts, refs)], params,
                                                            use_tqdm=False)]
    top1, strict = [], []
    for p, r, lps in zip(prompts, refs, logprobs):
        entries = lps[len(p):]
        assert [e.token_id for e in entries] == r
        for e in entries:
            top1.append(e.rank == 1)
            strict.append(e.rank == 1 and e.top_logprobs[1] < e.logprob)
    return sum(top1) / len(top1), sum(strict) / len(strict)


def _prompt_logprobs_by_decode_steps(llm, request_id: str, prompt: list[int], ref: list[int], params):
    """The prompt logprobs of prompt + ref with the prompt in one step and ref one token per step (the engine
    runs nothing else meanwhile): the scheduler's token budget set to the prompt, then to 1. On one torch thread,
    as single_threaded_llm explains: one-token steps gain little from a second."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    budget, threads = scheduler.max_num_batched_tokens, torch.get_num_threads()
    engine.add_request(request_id, prompt + ref, params)
    scheduler.max_num_batched_tokens = len(prompt)
    torch.set_num_threads(1)
    logprobs = []
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                logprobs += o.prompt_logprobs or []
            scheduler.max_num_batched_tokens = 1
    finally:
        scheduler.max_num_batched_tokens = budget
        torch.set_num_threads(threads)
    return logprobs
