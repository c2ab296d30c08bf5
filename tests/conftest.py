"""Shared fixtures: the default model, its tokenizer and HF transformers reference, the real server, the offline
LLM the engine-API tests share, and prompts cut from one text. Helpers (plain functions) are in helpers.py."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENMILL_NO_PROGRESS", "1")
# Torch computes on every core: the offline engines, HF's reference and the servers alike. The tests used to pin
# the in-process engines and HF to one thread, for fear of the threads' spinning where another process computes
# at the same time; no test does both at once, and on an idle 2-core AVX2 EPYC the 60 JSON-schema generations
# of test_structured_output took 18 s on two threads against 33 s on one. (OMP_WAIT_POLICY=PASSIVE would make
# the overlap harmless, but it cost 25-40% of every in-process engine's steps.)
torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from tokenmill.models.paths import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """HF transformers' own GGUF loader and Llama implementation, in float32: the correctness reference."""
    from helpers import hf_from_gguf
    return hf_from_gguf(default_gguf)


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
def servers():
    """Real `tokenmill serve` processes by configuration, started on first use and stopped when the test run
    ends: every module that asks for a configuration gets the same process (its model loads once)."""
    from helpers import RemoteServer
    running: dict[str, RemoteServer] = {}

    def get(name: str, *args, **kwargs) -> RemoteServer:
        s = running.get(name)
        if s is None or not s.alive:  # a test that killed the engine marked it broken: start a fresh one
            if s is not None:
                s.stop()
            s = running[name] = RemoteServer(*args, **kwargs)
        return s

    yield get
    for s in running.values():
        s.stop()


@pytest.fixture
def server(servers):
    """The default configuration (helpers.SERVER_ARGS). Function-scoped over the session's process, so that a
    test after one that broke the server gets a fresh one. The key comes from the environment, which exercises
    TOKENMILL_API_KEY."""
    from helpers import API_KEY
    return servers("default", env={"TOKENMILL_API_KEY": API_KEY})


@pytest.fixture(scope="session")
def llm():
    """The offline LLM on the default model that the engine-API tests share (LLM.generate, beam search,
    structured output, bench step): the model loads once. quantization none: logprobs and beams are compared with
    HF's float32 model on the dequantized GGUF weights; 512 MiB of KV cache cannot hold one sequence of the
    model's 8192 positions, so the length is capped."""
    from tokenmill import LLM
    return LLM(dtype="float32", kv_cache_memory="512MiB", max_model_len=2048, quantization="none")


@pytest.fixture(scope="module")
def tiny_llm(shared_tiny_llm):
    """shared_tiny_llm, run on one torch thread while the module's tests use it: its ops take microseconds, less
    than waking a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield shared_tiny_llm
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_dir(tokenizer, tmp_path_factory) -> str:
    """A tiny random Llama (the scheduler tests' shape) with the default model's tokenizer, as an HF directory, for
    the engine mechanics that need no real weights: a step takes milliseconds, a server on it starts in seconds.
    Its weights are wide enough (initializer range 0.5) that its greedy text is varied gibberish, not one token
    repeated, which is what the stop-string tests need."""
    from helpers import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama-default-tokenizer")
    save_tiny_llama(path, vocab_size=len(tokenizer), max_position_embeddings=8192, initializer_range=0.5,
                    tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def shared_tiny_llm(tiny_llama_dir):
    """An offline LLM on tiny_llama_dir (seeds, n, max_tokens, stop strings and ids, EOS, metrics, prompt forms)."""
    from tokenmill import LLM
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=512, kv_cache_memory="64MiB")


@pytest.fixture(scope="session")
def tokenizer_dir(tokenizer, tmp_path_factory) -> str:
    """The default model's tokenizer saved as an HF directory, for the tiny random checkpoints built beside it."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def stream(tokenizer) -> list[int]:
    """helpers.TEXT as token ids."""
    from helpers import TEXT
    return tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="session")
def prompts(stream) -> list[list[int]]:
    """Mixed lengths (helpers.PROMPT_LENGTHS), each a different window of the text."""
    from helpers import PROMPT_LENGTHS
    assert len(stream) >= max(PROMPT_LENGTHS) + 7 * 40
    return [stream[i * 40:i * 40 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def hf_continuations(hf_reference, prompts) -> list[list[int]]:
    """HF float32's greedy 64-token continuation of each of `prompts`, in one batch (helpers.hf_greedy_batch):
    test_correctness compares with their first tokens, test_kv_cache_dtype scores all 64."""
    from helpers import hf_greedy_batch
    return hf_greedy_batch(hf_reference, prompts, 64)


@pytest.fixture(scope="session")
def prefix_prompts(stream) -> list[list[int]]:
    """A 200-token shared prefix with different suffixes, exact duplicates, and the first 12 blocks alone."""
    prefix = stream[-200:]
    suffixes = [stream[s:s + n] for s, n in ((0, 3), (20, 9), (60, 17), (100, 30), (150, 45))]
    unique = [prefix + s for s in suffixes]
    return unique + [unique[0], unique[2], prefix[:192]]


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    from tokenmill.tokenizer import load_tokenizer
    return load_tokenizer(default_gguf)


# A test that takes one of these fixtures, directly or through another fixture, is marked slow below: those that
# start a real `tokenmill serve` process (by convention any fixture named `*_server` does too), HF's reference
# model (~13 s to load on 2 cores) and the default model's offline LLM (~9 s; tiny_llm is for the fast loop). A
# test that starts a server itself (RemoteServer, `tokenmill serve`, `bench serve --launch`) or runs long for
# another reason carries @pytest.mark.slow, or its module a pytestmark.
SERVER_FIXTURES = {"servers", "server", "lone_server", "obs_server", "tool_server"}
SLOW_FIXTURES = SERVER_FIXTURES | {"hf_reference", "llm"}


def pytest_collection_modifyitems(config, items):
    """`pytest -m "not slow"` is the fast inner loop; `make test` (no -m) still runs everything."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())  # the whole closure: fixtures of fixtures too
        if any(name in SLOW_FIXTURES or name.endswith("_server") for name in fixtures):
            item.add_marker(pytest.mark.slow)
