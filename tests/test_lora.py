"""Multi-LoRA serving (tokenmill/lora/): adapters made here with PEFT (random non-zero A and B, different ranks and
target modules) give HF transformers + PEFT's greedy tokens, with base and adapter requests in the same batches;
adapters never share prefix-cache blocks with each other or with the base model; the server lists, loads and
unloads adapters as vLLM does, while serving."""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from helpers import RemoteServer, build_tiny_model, hf_greedy, make_adapter
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.engine.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch
from tokenmill.kernels import load_ops, runnable_isas
from tokenmill.lora.adapter import LinearShape, LoRAError
from tokenmill.lora.layers import LoRABatch, LoRALinear
from tokenmill.lora.manager import LoRAManager
from tokenmill.models.llama import LlamaForCausalLM

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# different ranks, target modules and scalings (rsLoRA, a per-module alpha)
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL),
    "mlp-r2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"],
                   alpha_pattern={"down_proj": 2}),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def hf_outputs(model, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """A tiny random Qwen3 (q/k norms, head_dim * heads != hidden) and three adapters on it, with HF + PEFT's
    greedy tokens for the base model and for each adapter."""
    root = tmp_path_factory.mktemp("lora-tiny")
    tok_dir = str(root / "tokenizer")
    tokenizer.save_pretrained(tok_dir)
    model_dir = str(root / "model")
    base = build_tiny_model("qwen3", model_dir, tok_dir, tokenizer, head_dim=64, tie_word_embeddings=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    want = {None: hf_outputs(base, prompts)}
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        want[name] = hf_outputs(make_adapter(base, paths[name], i, 0.15, **kw), prompts)
        assert want[name] != want[None], f"adapter {name} must change the greedy tokens"
    return model_dir, paths, prompts, want


@pytest.fixture(scope="module")
def smollm2_adapters(hf_reference, tokenizer, tmp_path_factory):
    """Three adapters on the default model (HF's float32 Llama from the GGUF): their paths and HF + PEFT's tokens."""
    root = tmp_path_factory.mktemp("lora-smollm2")
    prompts = [tokenizer.encode(p) for p in PROMPTS[1:]]
    want, paths = {None: hf_outputs(hf_reference, prompts)}, {}
    for i, (name, kw) in enumerate(SMOLLM2_ADAPTERS.items()):
        paths[name] = str(root / name)
        want[name] = hf_outputs(make_adapter(hf_reference, paths[name], 10 + i, 0.06, **kw), prompts)
        assert want[name] != want[None], f"adapter {name} must change the greedy tokens"
    return paths, prompts, want


SMOLLM2_ADAPTERS = {
    "attn-r16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8-rslora": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qv-r4": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}


def test_default_model_adapters_match_peft_in_one_batch(smollm2_adapters, monkeypatch):
    """The default model, dequantized (--quantization none) in float32 against HF's float32 model of the same GGUF:
    each adapter's greedy tokens equal HF + PEFT's, with the base model's requests in the same batch."""
    paths, prompts, want = smollm2_adapters
    llm = LLM(dtype="float32", quantization="none", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_model_len=512)
    spy = StepSpy(llm.engine.runner.lora, monkeypatch)
    requests = [None, *loras(paths).values()]
    batch = [(ids, lora) for lora in requests for ids in prompts]
    outs = llm.generate([ids for ids, _ in batch], GREEDY, use_tqdm=False, lora_request=[lo for _, lo in batch])
    got = [o.outputs[0].token_ids for o in outs]
    for i, lora in enumerate(requests):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == want[lora.lora_name if lora else None]
    assert any(base and len(names) == 3 for names, base in spy.steps)


def loras(paths: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


class StepSpy:
    """Records, for each step with adapter tokens, the adapters in it and whether base tokens were there too."""

    def __init__(self, manager: LoRAManager, monkeypatch):
        self.steps: list[tuple[set[str], bool]] = []
        prepare = manager.prepare

        def spy(requests, query_lens):
            prepare(requests, query_lens)
            names = {r.lora_request.lora_name for r in requests if r.lora_request is not None}
            if names:
                self.steps.append((names, any(r.lora_request is None for r in requests)))
        monkeypatch.setattr(manager, "prepare", spy)


# (path, slots): the fused decoder stack with the deltas in it (the default on the CPU), the torch reference (where
# no kernels run: CUDA), and the CPU kernels layer by layer (Gemma 3, KV-scale calibration)
CASES = [("cpu-fused", 2), ("torch_sdpa", 3), pytest.param("cpu-layers", 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("path,max_loras", CASES)
def test_tiny_qwen3_adapters_match_peft_in_mixed_batches(tiny, path, max_loras, monkeypatch):
    """Every prompt under the base model and under each adapter, all in one generate call: with 3 slots every step
    mixes them; with 2, the third adapter's requests wait for a slot and are swapped in (LRU). The token budget
    chunks the prompts, so prefill chunks and decode rows of different adapters share steps."""
    if path != "torch_sdpa" and not runnable_isas():
        pytest.skip("no CPU kernel build runs here")
    model_dir, paths, prompts, want = tiny
    if path == "cpu-layers":
        use = LlamaForCausalLM.use_cpu_kernels
        monkeypatch.setattr(LlamaForCausalLM, "use_cpu_kernels",
                            lambda self, ops: (use(self, ops), setattr(self, "fused_ops", None)))
    llm = LLM(model=model_dir, dtype="float32", device="cpu", enable_lora=True, max_loras=max_loras,
              max_lora_rank=8, max_num_batched_tokens=24, attention_backend=path.split("-")[0])
    assert (llm.engine.runner.model.fused_ops is not None) == (path == "cpu-fused")
    spy = StepSpy(llm.engine.runner.lora, monkeypatch)
    requests = [None, *loras(paths).values()]
    batch = [(ids, lora) for lora in requests for ids in prompts]
    outs = llm.generate([ids for ids, _ in batch], GREEDY, use_tqdm=False, lora_request=[lo for _, lo in batch])
    got = [o.outputs[0].token_ids for o in outs]
    for i, lora in enumerate(requests):
        name = lora.lora_name if lora else None
        assert got[i * len(prompts):(i + 1) * len(prompts)] == want[name], name
    assert max(len(names) for names, _ in spy.steps) == max_loras  # never more adapters in a step than slots
    assert any(base and len(names) >= 2 for names, base in spy.steps)  # base and adapter rows in one pass
    manager = llm.engine.runner.lora
    assert manager.num_swaps == len(ADAPTERS)  # each adapter copied into a slot once (the third into a freed one)
    assert not manager.refs  # every finished request released its adapter


# ---------------------------------------------------------------- the batched delta, against a per-token loop

DELTA_PATHS = ["torch"] + [f"kernel-{isa}" for isa in runnable_isas()]


@pytest.mark.parametrize("width,slot_ranks", [(16, (16, 8, 5)), (4, (4, 1, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", DELTA_PATHS)
def test_batched_delta_equals_each_tokens_own_adapter(path, dtype, width, slot_ranks):
    """Slots of different ranks (the kernel's vector widths, and a width it has none for) and shards; decode rows of
    three adapters and of the base model interleaved, then prefill chunks (the kernel takes their rows four at a
    time): the one-call delta equals x @ W^T + (x @ A^T) @ B^T computed row by row (float64) with each row's own
    adapter, and base rows keep exactly their base projection."""
    torch.manual_seed(0)
    shape = LinearShape(40, (40, 8, 8))
    slots = 3
    batch = LoRABatch()
    ops = load_ops(path.split("-")[1]) if path != "torch" else None
    linear = LoRALinear("self_attn.qkv_proj", shape, slots, width, dtype, torch.device("cpu"), batch, ops)
    adapters, ranks = [], torch.zeros(slots, 3, dtype=torch.int32)
    for slot, (r, targeted) in enumerate(zip(slot_ranks, [{0, 2}, {1}, {0, 1, 2}])):
        pairs = [(torch.randn(r, 40) / 4, torch.randn(out, r) / 2) if j in targeted else None
                 for j, out in enumerate(shape.shard_out)]
        linear.set_slot(slot, [p and (p[0].to(dtype), p[1].to(dtype)) for p in pairs])
        adapters.append(pairs)
        ranks[slot] = torch.tensor([r if j in targeted else 0 for j in range(3)])
    # (rows, slot): decode rows first, then a base chunk and prefill chunks of 4k, 4k + 1 and 4k + 2 rows
    requests = [(1, 0), (1, -1), (1, 2), (1, 1), (1, 1), (1, -1), (1, 0), (5, -1), (20, 2), (17, 0), (6, 1)]
    tokens = sum(n for n, _ in requests)
    x = torch.randn(tokens, 40).to(dtype)
    base = torch.randn(tokens, 56).to(dtype)
    starts = [sum(n for n, _ in requests[:i]) for i in range(len(requests))]
    batch.segments = torch.tensor([(st, n, slot) for st, (n, slot) in zip(starts, requests) if slot >= 0])
    batch.ranks = {"self_attn.qkv_proj": ranks}
    batch.mask = torch.zeros(tokens, slots, dtype=dtype)
    for st, n, slot in batch.segments.tolist():
        batch.mask[st:st + n, slot] = 1
    got = linear.add_delta(x, base.clone())
    want = base.double()
    row_slot = [slot for n, slot in requests for _ in range(n)]
    for t, slot in enumerate(row_slot):
        if slot < 0:
            continue
        offset = 0
        for pair, out in zip(adapters[slot], shape.shard_out):
            if pair is not None:
                a, b = (w.to(dtype).double() for w in pair)
                want[t, offset:offset + out] += b @ (a @ x[t].double())
            offset += out
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    base_rows = [t for t, slot in enumerate(row_slot) if slot < 0]
    assert torch.equal(got[base_rows], base[base_rows])  # base rows: exactly their base projection
    batch.ranks = {}  # no adapter of the step targets this linear: nothing is computed
    assert torch.equal(linear.add_delta(x, base.clone()), base)


# ---------------------------------------------------------------- prefix isolation and KV events

@pytest.fixture(scope="module")
def tiny_llm(tiny):
    model_dir = tiny[0]
    yield LLM(model=model_dir, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)


def test_prefix_cache_never_shared_across_adapters_or_with_the_base(tiny, tiny_llm):
    """One prompt of four full blocks: under the base model, adapter A and adapter B its KV is computed three
    times (no prefix hit); under A again, A's blocks are hit. BlockStored events carry the adapter's id and name."""
    _, paths, _, _ = tiny
    llm, kv = tiny_llm, tiny_llm.engine.kv_cache
    kv.enable_events()
    a, b = LoRARequest("a", 101, paths["qv-r4"]), LoRARequest("b", 102, paths["mlp-r2"])
    prompt = list(range(1000, 1000 + 4 * kv.block_size + 3))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    hits = []
    for lora in (None, a, b, a, None):
        before = kv.prefix_cache_hits
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        hits.append((kv.prefix_cache_hits - before, out.num_cached_tokens))
    full = 4 * kv.block_size
    assert hits == [(0, 0), (0, 0), (0, 0), (full, full), (full, full)]
    events = decode_batch(encode_batch(KVEventBatch(0.0, kv.take_events()))).events  # as a router reads them
    stored = [e for e in events if isinstance(e, BlockStored)]
    by_lora = {(e.lora_id, e.lora_name): e for e in stored}
    assert set(by_lora) == {(None, None), (101, "a"), (102, "b")}
    assert by_lora[(101, "a")].extra_keys[0] == [["lora", 101, "a"]]
    hashes = [set(e.block_hashes) for e in by_lora.values()]
    assert not (hashes[0] & hashes[1] or hashes[0] & hashes[2] or hashes[1] & hashes[2])


def test_adapter_errors_are_clear(tiny, tiny_llm, tmp_path):
    _, paths, prompts, _ = tiny
    llm = tiny_llm
    with pytest.raises(ValueError, match="No adapter found"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 201, str(tmp_path / "no")))
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads(open(os.path.join(paths["qv-r4"], "adapter_config.json")).read())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        llm.engine.add_lora(LoRARequest("dora", 202, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps(config))
    (bad / "adapter_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(LoRAError, match="pickle"):
        llm.engine.add_lora(LoRARequest("bin", 203, str(bad)))
    with pytest.raises(LoRAError, match="LoRA rank 8 is greater than max_lora_rank 4"):
        LoRAManager.load(_with_max_rank(llm, 4), LoRARequest("r8", 204, paths["all-r8-rslora"]))
    assert not llm.engine.runner.lora.refs  # the failed requests hold no adapter


def _with_max_rank(llm, max_rank: int):
    manager = copy.copy(llm.engine.runner.lora)
    manager.max_rank, manager.cache = max_rank, type(manager.cache)()
    return manager


def test_cpu_cache_keeps_adapters_in_use_and_drops_the_least_recent(tiny, tiny_llm):
    _, paths, prompts, want = tiny
    llm, manager = tiny_llm, tiny_llm.engine.runner.lora
    reqs = {name: LoRARequest(name, 300 + i, path) for i, (name, path) in enumerate(paths.items())}
    for name, lora in reqs.items():  # max_cpu_loras=2: three adapters, one after the other
        out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == want[name][0]
    assert list(manager.cache)[-2:] == [301, 302] and 300 not in manager.cache
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=reqs["qv-r4"])[0]  # read from disk again
    assert out.outputs[0].token_ids == want["qv-r4"][0]
    assert manager.remove(302) and 302 not in manager.cache and 302 not in manager.slots
    assert not manager.remove(999)


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def lora_server(tiny):
    """`tokenmill serve` on the tiny Qwen3 with two adapters from --lora-modules (one in vLLM's JSON form, with a
    parent), two slots, and runtime loading on (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    model_dir, paths, _, _ = tiny
    module = json.dumps({"name": "all-r8-rslora", "path": paths["all-r8-rslora"], "base_model_name": model_dir})
    server = RemoteServer(model=model_dir, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, server_args=[
        "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--uvicorn-log-level",
        "warning", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"qv-r4={paths['qv-r4']}", module])
    yield server
    server.stop()


def _complete(client, url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    return client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})


def test_server_lists_serves_loads_and_unloads_adapters(tiny, lora_server):
    import httpx
    model_dir, paths, prompts, want = tiny
    url = lora_server.url
    with httpx.Client(timeout=60) as client:
        cards = {c["id"]: c for c in client.get(url + "/v1/models").json()["data"]}
        assert set(cards) == {model_dir, "qv-r4", "all-r8-rslora"}
        assert cards["qv-r4"]["parent"] == model_dir and cards["qv-r4"]["root"] == paths["qv-r4"]
        assert cards["all-r8-rslora"]["parent"] == model_dir and cards[model_dir]["parent"] is None
        for model, name in ((model_dir, None), ("qv-r4", "qv-r4"), ("all-r8-rslora", "all-r8-rslora")):
            body = _complete(client, url, model, prompts[0]).json()
            assert body["model"] == model and body["choices"][0]["token_ids"] == want[name][0]

        def error(path: str, payload: dict, status: int, message: str) -> None:
            r = client.post(url + path, json=payload)
            assert r.status_code == status, r.text
            assert message in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")

        load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
        error(load, {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided.")
        error(load, {"lora_name": "x", "lora_path": paths["qv-r4"] + "-missing"}, 404, "No adapter found")
        error(load, {"lora_name": "qv-r4", "lora_path": paths["qv-r4"]}, 400, "has already been loaded")
        error(load, {"lora_name": model_dir, "lora_path": paths["qv-r4"]}, 400, "the base model's name")
        error(unload, {}, 400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        error(unload, {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found.")
        r = _complete(client, url, "nope", prompts[0])
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert client.post(url + load, json={"lora_name": "mlp-r2", "lora_path": paths["mlp-r2"]}).text == (
            "Success: LoRA adapter 'mlp-r2' added successfully.")
        assert _complete(client, url, "mlp-r2", prompts[1]).json()["choices"][0]["token_ids"] == want["mlp-r2"][1]
        assert client.post(url + unload, json={"lora_name": "mlp-r2"}).text == (
            "Success: LoRA adapter 'mlp-r2' removed successfully.")
        assert _complete(client, url, "mlp-r2", prompts[1]).status_code == 404
        metrics = client.get(url + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics
    assert 'tokenmill:lora_requests_total{finished_reason="length",lora_name="qv-r4"' in metrics


async def running_adapters(client) -> list[str]:
    """The running_lora_adapters label of vllm:lora_requests_info."""
    text = (await client.get("/metrics")).text
    m = re.search(r'^vllm:lora_requests_info\{.*running_lora_adapters="([^"]*)"', text, re.M)
    return m.group(1).split(",") if m else []


LONG = 160  # tokens of the requests running while their adapter is unloaded


def test_server_load_and_unload_while_serving_at_c8(tiny, lora_server):
    """Eight streams of base and adapter requests (greedy, checked token by token) while an adapter is loaded and
    another unloaded with its own requests in flight: no request fails, the unloaded ones finish, and the name is
    a 404 afterwards."""
    import asyncio

    import httpx
    model_dir, paths, prompts, want = tiny
    url = lora_server.url

    async def run() -> tuple[list, list]:
        served = [model_dir, "all-r8-rslora"]  # what the workers may ask for: loaded names only
        results, long_runs, stop = [], [], asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def worker(i: int) -> None:
                n = 0
                while not stop.is_set():
                    model, k = served[(i + n) % len(served)], (i + n) % len(prompts)
                    r = await client.post(url + "/v1/completions", json={
                        "model": model, "prompt": prompts[k], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True})
                    results.append((model, k, r.status_code, r.json()))
                    n += 1

            async def long_run() -> None:  # with the adapter that is unloaded while it runs
                r = await _complete(client, url, "qv-r4", prompts[2], max_tokens=LONG)
                long_runs.append((r.status_code, r.json()))

            workers = [asyncio.create_task(worker(i)) for i in range(6)]
            for _ in range(20):  # the long requests may end before a poll sees them: then start them again
                long_runs.clear()
                longs = [asyncio.create_task(long_run()) for _ in range(2)]
                while not all(t.done() for t in longs) and "qv-r4" not in await running_adapters(client):
                    await asyncio.sleep(0.01)
                if not all(t.done() for t in longs):
                    break
                await asyncio.gather(*longs)
            else:
                pytest.fail("the qv-r4 requests were never seen running")
            r = await client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "qv-r4"})
            assert r.status_code == 200, r.text
            assert not all(t.done() for t in longs)  # unloaded with its requests in flight
            gone = await _complete(client, url, "qv-r4", prompts[0])
            assert gone.status_code == 404
            r = await client.post(url + "/v1/load_lora_adapter", json={"lora_name": "mlp-r2",
                                                                      "lora_path": paths["mlp-r2"]})
            assert r.status_code == 200, r.text
            served.append("mlp-r2")
            await asyncio.gather(*longs)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*workers)
        return results, long_runs

    results, long_runs = asyncio.run(run())
    assert [status for status, _ in long_runs] == [200, 200]
    assert all(len(body["choices"][0]["token_ids"]) == LONG for _, body in long_runs)
    assert all(body["choices"][0]["token_ids"][:MAX_TOKENS] == want["qv-r4"][2] for _, body in long_runs)
    assert {model for model, *_ in results} == {model_dir, "all-r8-rslora", "mlp-r2"}
    for model, k, status, body in results:
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want[None if model == model_dir else model][k], (model, k)


# ---------------------------------------------------------------- flags

def test_lora_flags_parse_as_vllm_s():
    import argparse

    from tokenmill.config import EngineConfig
    from tokenmill.lora.request import LoRAModulePath
    from tokenmill.api.server_config import ServerConfig
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    ServerConfig.add_cli_args(parser)
    args = parser.parse_args(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4",
                              "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    engine, server = EngineConfig.from_cli_args(args), ServerConfig.from_cli_args(args)
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 2, 32, 4)
    assert server.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    with pytest.raises(ValueError, match="name=path"):
        LoRAModulePath.parse("no-path")
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/x")


def test_bench_serve_spreads_requests_over_the_adapters():
    """`bench serve --lora-modules`: each request asks for one of the adapters (vLLM's bench option)."""
    import argparse

    from tokenmill.bench.client import Endpoint
    from tokenmill.bench.serve import add_cli_args
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    endpoint = Endpoint("http://x", parser.parse_args(["--lora-modules", "a", "b", "c", "d"]), "base")
    models = [endpoint.body("hi", 4)["model"] for _ in range(200)]
    assert set(models) == {"a", "b", "c", "d"} and max(models.count(m) for m in "abcd") < 80
    assert Endpoint("http://x", parser.parse_args([]), "base").body("hi", 4)["model"] == "base"
