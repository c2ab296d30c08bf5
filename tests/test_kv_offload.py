"""The tier beyond the pool (--kv-offloading-size, tokenmill/engine/kv_offload.py), on the real engine with a tiny
random Llama: blocks a request computed come back, from a fresh engine's disk tier or from host memory once the pool
evicted them, and the outputs are the ones computed without the tier; an entry that is corrupted, short, or from
another layout is recomputed, never read."""
from __future__ import annotations

import os

import pytest

from tokenmill.engine.kv_blocks import HEADER_SIZE, unpack
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama-offload")
    save_tiny_llama(path, vocab_size=128, max_position_embeddings=256)
    return str(path)


def make_engine(model_dir: str, **kw):
    from helpers import engine_on
    return engine_on(model_dir, **{"num_gpu_blocks_override": 64, "block_size": 16, **kw})


def run(engine, prompts: list[list[int]], params: SamplingParams = GREEDY, lora=None) -> dict[str, list[int]]:
    """Each prompt to the end, one after the other (so each finds what the ones before it left)."""
    out = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{len(engine.scheduler.requests)}-{i}-{id(prompt)}"
        request = engine.add_request(rid, prompt, params, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        out[rid.split("-")[1]] = list(request.output_token_ids)
        out.setdefault("cached", []).append(request.num_cached_tokens)
        out.setdefault("external", []).append(request.num_external_tokens)
    return out


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(length)] for _ in range(n)]


def test_a_fresh_engine_reads_the_blocks_another_wrote_to_disk(model_dir, tmp_path):
    ps = prompts(3, 100)
    reference = run(make_engine(model_dir), ps)
    writer = make_engine(model_dir, kv_offloading_size=0.01, kv_offloading_backend="disk",
                         kv_offloading_dir=str(tmp_path))
    first = run(writer, ps)
    writer.offload.close()
    assert first["external"] == [0, 0, 0]
    assert writer.offload.counters.blocks_written == 3 * (106 // 16)  # every full block, generated ones too
    reader = make_engine(model_dir, kv_offloading_size=0.01, kv_offloading_backend="disk",
                         kv_offloading_dir=str(tmp_path))
    second = run(reader, ps)
    for i in range(3):
        assert second[str(i)] == reference[str(i)] == first[str(i)]
    assert second["external"] == [96, 96, 96]  # 6 of the prompt's blocks; the last token is computed
    assert second["cached"] == [96, 96, 96]
    assert reader.kv_cache.external_hits == 3 * 96
    assert reader.offload.counters.blocks_read == 18


def test_host_memory_tier_brings_back_what_the_pool_evicted(model_dir):
    ps = prompts(6, 150, seed=1)
    reference = run(make_engine(model_dir, num_gpu_blocks_override=16), ps)
    engine = make_engine(model_dir, num_gpu_blocks_override=16, kv_offloading_size=0.01)
    run(engine, ps)  # 6 × 10 blocks through a 16-block pool: each evicts the one before
    again = run(engine, ps)
    for i in range(6):
        assert again[str(i)] == reference[str(i)]
    assert again["external"] == [144] * 6


@pytest.mark.parametrize("case", ["bfloat16", "fp8", "chunked", "lora"])
def test_every_prefix_block_from_disk_gives_the_same_tokens(model_dir, tmp_path, case):
    """bf16 and a one-byte (fp8) cache, prompts prefilled in chunks of 32 tokens, and a LoRA adapter (whose
    requests' blocks are keyed by it: the base model's blocks of the same tokens are never loaded for them)."""
    from helpers import make_adapter
    from transformers import AutoModelForCausalLM

    from tokenmill.lora.request import LoRARequest
    kw = {"bfloat16": dict(dtype="bfloat16"), "fp8": dict(kv_cache_dtype="fp8"),
          "chunked": dict(max_num_batched_tokens=32), "lora": dict(enable_lora=True, max_lora_rank=8)}[case]
    lora = None
    if case == "lora":
        make_adapter(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "adapter"), 0, 0.3, r=8,
                     target_modules=["q_proj", "v_proj", "down_proj"])
        lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    ps = prompts(3, 100, seed=6)
    reference = run(make_engine(model_dir, **kw), ps, lora=lora)
    tier = dict(kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path / "tier"))
    engine_kw = {**kw, **tier}
    if case == "lora":  # the base model's blocks of these prompts are there too: they must not be used
        run(make_engine(model_dir, **engine_kw), ps)
    writer = make_engine(model_dir, **engine_kw)
    run(writer, ps, lora=lora)
    writer.offload.close()
    reader = make_engine(model_dir, **engine_kw)
    out = run(reader, ps, lora=lora)
    for i in range(3):
        assert out[str(i)] == reference[str(i)]
    assert out["external"] == [96, 96, 96]
    if case == "lora":
        assert reference["0"] != run(make_engine(model_dir), ps[:1])["0"]  # the adapter changes the tokens


@pytest.mark.parametrize("damage", ["flip", "truncate", "layout"])
def test_a_damaged_entry_is_recomputed_and_counted(model_dir, tmp_path, damage):
    """A flipped byte, a cut file, an entry of another layout: the tokens are HF transformers' greedy ones."""
    from helpers import hf_greedy
    from transformers import AutoModelForCausalLM
    ps = prompts(1, 100, seed=2)
    reference = run(make_engine(model_dir), ps)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    assert reference["0"] == hf_greedy(hf, ps[0], GREEDY.max_tokens)
    writer = make_engine(model_dir, kv_offloading_size=0.01, kv_offloading_backend="disk",
                         kv_offloading_dir=str(tmp_path))
    run(writer, ps)
    writer.offload.close()
    key = writer.offload.key(_third_block_hash(writer, ps[0]))
    path = os.path.join(tmp_path, key.hex()[:2], key.hex()[2:])
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[HEADER_SIZE + 100] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[8] ^= 1  # the layout key: as if another model (or dtype, or backend) had written it
    open(path, "wb").write(bytes(data))
    reader = make_engine(model_dir, kv_offloading_size=0.01, kv_offloading_backend="disk",
                         kv_offloading_dir=str(tmp_path))
    out = run(reader, ps)
    assert out["0"] == reference["0"]
    assert out["external"] == [32]  # the two blocks before the damaged one
    why = {"flip": "checksum", "truncate": "length", "layout": "layout"}[damage]
    assert reader.offload.counters.blocks_rejected == {why: 1}
    # dropped, then written again from the recomputed block: the next reader loads all of it
    block_hash = _third_block_hash(reader, ps[0])
    assert unpack(open(path, "rb").read(), reader.offload.layout.key(), block_hash)[1] == ""


def _third_block_hash(engine, prompt: list[int]) -> bytes:
    from tokenmill.engine.block_hash import hash_request_blocks
    return hash_request_blocks(prompt, 16)[2]


def test_an_unusable_directory_is_a_warning_not_a_failure(model_dir, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    engine = make_engine(model_dir, kv_offloading_size=0.01, kv_offloading_backend="disk",
                         kv_offloading_dir=str(blocker / "tier"))
    assert engine.offload is None
    assert "KV disk tier off" in caplog.text
    assert run(engine, prompts(1, 40))["0"]


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 KiB tmpfs (room for a few of the tiny model's blocks), mounted for the test: a real full disk, and, remounted
    read-only, a real read-only one. Needs the right to mount (root in the test container)."""
    import subprocess
    path = tmp_path / "fs"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_tier_filesystem_costs_recomputation_only(model_dir, small_filesystem, fault, caplog):
    import subprocess
    ps = prompts(3, 100, seed=8)
    reference = run(make_engine(model_dir), ps)
    if fault == "read-only":
        (small_filesystem / "tier").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)
    engine = make_engine(model_dir, kv_offloading_size=1.0, kv_offloading_backend="disk",
                         kv_offloading_dir=str(small_filesystem / "tier"))
    out = run(engine, ps)
    for i in range(3):
        assert out[str(i)] == reference[str(i)]
    written = engine.offload.counters.blocks_written
    assert (0 < written < 6) if fault == "full" else written == 0  # the first request's first blocks fit
    assert engine.offload.counters.store_errors["DISK"] == 18 - written
    assert caplog.text.count("KV DISK tier: writing failed") == 1
    engine.offload.close()
    engine = make_engine(model_dir, kv_offloading_size=1.0, kv_offloading_backend="disk",
                         kv_offloading_dir=str(small_filesystem / "tier"))
    again = run(engine, ps)  # a fresh pool: what was written comes back, the rest is computed
    for i in range(3):
        assert again[str(i)] == reference[str(i)]
    assert again["external"] == [16 * written, 0, 0]


# ---------------------------------------------------------------- a Valkey server shared by engines

@pytest.fixture
def valkey():
    from helpers import ValkeyServer
    server = ValkeyServer()
    yield server
    server.stop()


def shared(url: str, role: str = "kv_both") -> dict:
    return {"kv_connector": "ValkeyConnector", "kv_role": role, "kv_connector_extra_config": {"url": url}}


WRITER = """
import sys
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import EngineCore
from tokenmill.sampling_params import SamplingParams
model, url, prompts, dtype = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4]
engine = EngineCore(EngineConfig(model=model, dtype=dtype, device="cpu", num_gpu_blocks_override=64,
                                 kv_transfer_config={"kv_connector": "ValkeyConnector", "kv_role": "kv_producer",
                                                     "kv_connector_extra_config": {"url": url}}))
for i, p in enumerate(prompts):
    engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6))
while engine.has_unfinished_requests():
    engine.step()
print(engine.offload.counters.blocks_written)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_loads_the_blocks_another_process_wrote_to_valkey(model_dir, valkey, dtype):
    import subprocess
    import sys
    ps = prompts(3, 100, seed=3)
    reference = run(make_engine(model_dir, dtype=dtype), ps)
    written = subprocess.run([sys.executable, "-c", WRITER, model_dir, valkey.url, repr(ps), dtype],
                             capture_output=True, text=True, timeout=300, check=True).stdout.split()[-1]
    assert int(written) == 3 * 6  # kv_producer: writes, never reads
    reader = make_engine(model_dir, dtype=dtype, kv_transfer_config=shared(valkey.url, "kv_consumer"))
    out = run(reader, ps)
    for i in range(3):
        assert out[str(i)] == reference[str(i)]
    assert out["external"] == [96, 96, 96]
    assert reader.offload.counters.blocks_written == 0  # kv_consumer: reads, never writes


def test_valkey_killed_mid_run_costs_recomputation_only(model_dir, valkey, caplog):
    ps = prompts(4, 100, seed=4)
    reference = run(make_engine(model_dir), ps)
    engine = make_engine(model_dir, kv_transfer_config=shared(valkey.url))
    assert run(engine, ps[:2])["external"] == [0, 0]
    valkey.kill()
    fresh = make_engine(model_dir, kv_transfer_config=shared(valkey.url))
    out = run(fresh, ps)  # the first two are in the dead store: looked up, not found, recomputed
    for i in range(4):
        assert out[str(i)] == reference[str(i)]
    assert out["external"] == [0, 0, 0, 0]
    assert fresh.offload.counters.store_errors["VALKEY"] >= 1
    assert caplog.text.count("KV VALKEY tier:") == 1  # one line for the state change, not one per call
    valkey.start()  # back: after the circuit's backoff, the store is used again
    fresh.offload.tiers[0].store._open_until = 0.0
    again = run(fresh, ps[:1])
    assert again["0"] == reference["0"]
    assert "works again" in caplog.text


def test_valkey_down_at_start_serves_without_it(model_dir, valkey):
    valkey.kill()
    engine = make_engine(model_dir, kv_transfer_config=shared(valkey.url))
    ps = prompts(2, 60, seed=5)
    assert run(engine, ps)["external"] == [0, 0]


def test_tier_writes_are_kv_events_with_their_medium(model_dir, tmp_path):
    """A router tells a replica that holds a prefix in its pool (medium GPU) from one that can load it (DISK)."""
    from tokenmill.engine.kv_events import BlockRemoved, BlockStored
    entry = HEADER_SIZE + 2 * 2 * 16 * 2 * 16 * 4  # 2 layers × K, V × 16 tokens × 2 heads × 16 dims × fp32
    engine = make_engine(model_dir, kv_offloading_size=8 * entry / 1024**3, kv_offloading_backend="disk",
                         kv_offloading_dir=str(tmp_path))  # room for 8 of the 12 blocks
    engine.kv_cache.enable_events()
    run(engine, prompts(2, 100, seed=7))
    events = engine.kv_cache.take_events()
    stored = {}
    for e in events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                stored.setdefault(h, set()).add(e.medium)
    assert len(stored) == 12 and all(media == {"GPU", "DISK"} for media in stored.values())
    disk_event = next(e for e in events if isinstance(e, BlockStored) and e.medium == "DISK")
    assert len(disk_event.token_ids) == 16 and disk_event.block_size == 16
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
    assert len(removed) == 4 and engine.offload.tiers[0].store.occupancy == 8 * entry


# ---------------------------------------------------------------- through `tokenmill serve`

def test_two_servers_share_blocks_through_valkey_and_survive_its_death(tiny_llama_dir, valkey):
    import json

    import httpx
    from helpers import TEXT, RemoteServer, metric_value, scrape_metrics, wait_until
    args = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--uvicorn-log-level",
            "warning", "--kv-transfer-config", json.dumps(shared(valkey.url))]
    a = RemoteServer(model=tiny_llama_dir, server_args=args)
    b = RemoteServer(model=tiny_llama_dir, server_args=args)
    try:
        def complete(server, prompt: str) -> dict:
            r = httpx.post(server.url_for("/v1/completions"), timeout=60,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        def metric(server, family, sample, **labels):
            return metric_value(scrape_metrics(server), family, sample, model_name=tiny_llama_dir, **labels)

        prompt = TEXT[:1200]
        first = complete(a, prompt)
        full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16  # the last prompt token is always computed
        wait_until(lambda: metric(a, "tokenmill:kv_offload_blocks_written", "tokenmill:kv_offload_blocks_written_total")
                   >= full_blocks, 30)
        assert complete(b, prompt)["choices"] == first["choices"]
        hits = metric(b, "vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total")
        assert hits == full_blocks * 16
        assert metric(b, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer") == hits
        valkey.kill()
        for i in range(3):  # new prompts and the shared one, on both: every request succeeds, recomputing
            for server in (a, b):
                complete(server, TEXT[100 * (i + 1):100 * (i + 1) + 1200])
        assert complete(b, prompt)["choices"] == first["choices"]
        assert metric(b, "tokenmill:kv_offload_store_errors", "tokenmill:kv_offload_store_errors_total",
                      medium="VALKEY") >= 1
        assert metric(b, "tokenmill:kv_offload_healthy", "tokenmill:kv_offload_healthy", medium="VALKEY") == 0
    finally:
        a.stop()
        b.stop()


def test_a_failing_load_costs_recomputation_not_a_hung_request(model_dir, tmp_path, monkeypatch, caplog):
    """Whatever goes wrong in the tier's worker (here the copy into the pool raises), the request is computed."""
    ps = prompts(1, 100, seed=9)
    tier = dict(kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path))
    writer = make_engine(model_dir, **tier)
    first = run(writer, ps)
    reader = make_engine(model_dir, **tier)

    def broken(*args):
        raise RuntimeError("a bug in the copy")
    monkeypatch.setattr(reader.offload.layout, "write", broken)
    out = run(reader, ps)
    assert out["0"] == first["0"] and out["external"] == [0]
    assert "KV tier worker: LoadJob failed" in caplog.text


def test_a_store_that_never_answers_costs_a_timeout_then_nothing(model_dir):
    """A Valkey address that accepts connections and never answers (a hung server): the first calls wait for the
    0.5 s timeout, then the circuit opens for 5 s and requests recompute without waiting (the test would outrun
    pytest's timeout if every block's write waited); the store is counted as failing."""
    import socket
    import threading
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(100)], daemon=True).start()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}"
    ps = prompts(4, 100, seed=10)
    reference = run(make_engine(model_dir), ps)
    engine = make_engine(model_dir, kv_transfer_config=shared(url))
    out = run(engine, ps)
    assert [out[str(i)] for i in range(4)] == [reference[str(i)] for i in range(4)]
    assert out["external"] == [0, 0, 0, 0]
    assert engine.offload.counters.store_errors["VALKEY"] >= 2
    listener.close()
