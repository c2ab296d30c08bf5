"""`tokenmill router` and the engine's KV events: the wire format in both of vLLM's layouts, the router's block
keys against the engine's (a property test through the real KV cache manager), the policies, gap repair by
replay, token buckets and the admission queue, and, with two real replicas of the default model, cache-aware
routing, round-robin, stream resumption (a cut simulated on real streams, and a replica killed mid-stream),
tenants, the admission queue, draining on SIGTERM, load correction, OTel spans, and ejection."""
from __future__ import annotations

import asyncio
import http.server
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import (MODEL, SERVER_ARGS, SYSTEMS, OtlpReceiver, RemoteServer, RouterProcess, cached_tokens, free_port,
                     make_adapter, prefix_workload_homes, wait_until)

from tokenmill.config import KVEventsConfig
from tokenmill.engine.block_hash import hash_block_tokens
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher
from tokenmill.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tokenmill.engine.request import Request
from tokenmill.router.app import build_state
from tokenmill.router.kv_index import KVEventSubscriber, KVIndex, prompt_block_hashes
from tokenmill.router.policy import KVAware, RoundRobin, RouteRequest, SessionAffinity
from tokenmill.router.replicas import Replica, replica_reported_load
from tokenmill.router.resume import ResumableStream, why_not_resumable
from tokenmill.router.router_config import RouterConfig
from tokenmill.router.tenants import AdmissionQueue, Rejected, Tenant, TenantSpec, TokenBucket, load_tenants
from tokenmill.sampling_params import SamplingParams

H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


def _batch() -> KVEventBatch:
    return KVEventBatch(12.5, [
        BlockStored([H1, H2], None, list(range(8)), 4, None, "GPU", None),
        BlockStored([H3], H2, [8, 9, 10, 11], 4, 7, "GPU", "adapter", [["salt"]]),
        BlockStored([5, 6], 4, list(range(8)), 4, None, None, None),  # vLLM's int hashes decode too
        BlockRemoved([H1], "GPU"),
        AllBlocksCleared(),
    ])


@pytest.mark.parametrize("layout", ["map", "array"])
def test_event_batches_round_trip_in_both_layouts(layout):
    batch = _batch()
    assert decode_batch(encode_batch(batch, layout)) == batch


def test_map_layout_is_vllms_current_wire_shape():
    raw = msgspec.msgpack.decode(encode_batch(_batch(), "map"))
    stored = raw["events"][0]
    assert raw["ts"] == 12.5 and "data_parallel_rank" not in raw  # omit_defaults, as vLLM's EventBatch
    assert stored == {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None,
                      "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                      "lora_name": None}
    assert raw["events"][3] == {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"}
    assert raw["events"][4] == {"type": "AllBlocksCleared"}


def test_decoder_takes_older_and_newer_producers():
    # vLLM before lora_name (7 positions), and a map with a key from a schema newer than ours
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [H1], None, [1, 2, 3, 4], 4, None, "GPU"],
                                        ["BlockRemoved", [H1], "GPU"]]])
    assert decode_batch(old).events == [BlockStored([H1], None, [1, 2, 3, 4], 4, None, "GPU", None),
                                        BlockRemoved([H1], "GPU")]
    new = msgspec.msgpack.encode({"ts": 1.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "cache_salt": "x"}]})
    decoded = decode_batch(new)
    assert decoded.data_parallel_rank == 0 and decoded.events[0].block_hashes == [H1]
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockExploded", [H1]]]]))


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([2, 4, 8]), num_blocks=st.integers(4, 24),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), min_size=1, max_size=30)),
                        min_size=1, max_size=12),
       keep=st.lists(st.booleans(), min_size=12, max_size=12))
def test_router_keys_and_predictions_equal_the_engines(block_size, num_blocks, prompts, keep):
    """Requests sharing prefixes (one of 4 stems + a tail) go through the real KV cache manager with eviction; its
    events cross the wire (both layouts) into a router-side index. Every BlockStored key is the shared function
    of its tokens chained from its parent, and before each request the router's prediction equals the prefix
    hit the engine then finds."""
    kv = KVCacheManager(num_blocks, block_size)
    kv.enable_events()
    index = KVIndex("replica", block_size)
    running = []
    for i, (stem, tail) in enumerate(prompts):
        tokens = [100 + stem] * (3 * block_size) + tail
        request = Request(f"r{i}", tokens, SamplingParams(), None, 4)
        predicted = index.predicted_cached_tokens(prompt_block_hashes(tokens, block_size))
        hits, num_hit = kv.get_computed_blocks(request)
        assert predicted == num_hit
        if kv.allocate_slots(request, len(tokens) - num_hit, hits):
            running.append(request)
        for event in kv.take_events():
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for j, key in enumerate(event.block_hashes):
                    parent = hash_block_tokens(parent, event.token_ids[j * block_size:(j + 1) * block_size])
                    assert key == parent
            index.apply(decode_batch(encode_batch(KVEventBatch(0.0, [event]), "map" if i % 2 else "array")))
        if not keep[i % len(keep)]:
            for r in running:
                kv.free(r)
            running = []
    assert index.blocks == set(kv.pool.cached)


def test_tier_events_do_not_touch_the_pools_blocks():
    """A replica with a KV tier (engine/kv_offload.py) publishes its tier's stores and evictions with their medium:
    the router keeps them apart from the pool's, so a block on disk only is no pool hit, and a disk eviction does
    not hide a block the pool still holds."""
    from tokenmill.engine.kv_events import BlockRemoved
    index = KVIndex("replica", 4)
    a, b = b"a" * 32, b"b" * 32
    index.apply(KVEventBatch(0.0, [BlockStored([a], None, [1, 2, 3, 4], 4, None, "GPU", None),
                                   BlockStored([a, b], None, list(range(8)), 4, None, "DISK", None),
                                   BlockRemoved([a], "DISK")]))
    assert index.blocks == {a} and index.tier_blocks == {"DISK": {b}}


def _replica(name: str, in_flight: int = 0, blocks=()) -> Replica:
    r = Replica(name, KVIndex(name, 4), healthy=True, in_flight=in_flight)
    r.index.blocks.update(blocks)
    return r


def test_kv_policy_prefers_the_cached_replica_until_its_load_outweighs_the_hit():
    tokens = list(range(41))
    hashes = prompt_block_hashes(tokens, 4)
    a, b = _replica("a"), _replica("b", blocks=hashes[:6])
    route = KVAware(load_tokens_per_request=16).rank([a, b], RouteRequest(hashes, len(tokens)))
    assert route.ranked[0] is b and route.reason == "kv_hit" and route.predicted_cached_tokens == {a: 0, b: 24}
    b.in_flight = 2  # 2 x 16 tokens of load > the 24 tokens the hit saves
    route = KVAware(load_tokens_per_request=16).rank([a, b], RouteRequest(hashes, len(tokens)))
    assert route.ranked[0] is a and route.reason == "kv_load"


def test_round_robin_alternates():
    a, b = _replica("a"), _replica("b")
    policy = RoundRobin()
    chosen = [policy.rank([a, b], RouteRequest([], 0)).ranked[0].name for _ in range(4)]
    assert chosen == ["a", "b", "a", "b"]


def test_sessions_stick_rebind_when_their_replica_leaves_and_respect_the_load_bound():
    replicas = [_replica(n) for n in "abc"]
    policy = SessionAffinity(load_factor=1.25)
    homes = {f"s{i}": policy.rank(replicas, RouteRequest([], 0, f"s{i}")).ranked[0] for i in range(30)}
    assert len(set(homes.values())) == 3  # spread over the ring
    assert all(policy.rank(replicas, RouteRequest([], 0, k)).ranked[0] is r for k, r in homes.items())
    gone = replicas[0]
    rest = replicas[1:]
    for key, home in homes.items():
        new_home = policy.rank(rest, RouteRequest([], 0, key)).ranked[0]
        assert new_home is home if home is not gone else new_home in rest  # only the leaver's sessions move
    key = next(k for k, r in homes.items() if r is replicas[1])
    replicas[1].in_flight = 10  # far above 1.25 x the mean: its sessions overflow, the others stay
    route = policy.rank(replicas, RouteRequest([], 0, key))
    assert route.ranked[0] is not replicas[1] and route.reason == "session_overflow"
    assert policy.rank(replicas, RouteRequest([], 0)).reason == "no_session"


def test_a_gap_and_a_late_join_are_filled_by_replay_and_a_restart_drops_the_index():
    """A real publisher on loopback; the subscriber sees only the last batch, and replays the rest."""
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                                                 replay_endpoint=f"tcp://127.0.0.1:{replay_port}"))
    # (connect, not bind: nothing listens on the PUB side, so every batch is "lost" and only replay has it)
    try:
        publisher.publish([BlockStored([H1], None, [1, 2, 3, 4], 4, None, "GPU", None)])  # seq 1
        publisher.publish([BlockStored([H2], H1, [5, 6, 7, 8], 4, None, "GPU", None)])  # seq 2
        publisher.publish([BlockRemoved([H1], "GPU")])  # seq 3

        async def scenario():
            import zmq.asyncio
            ctx = zmq.asyncio.Context()
            index = KVIndex("replica", 4)
            sub = KVEventSubscriber(index, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{replay_port}", ctx)
            try:
                last = encode_batch(KVEventBatch(0.0, [BlockStored([H3], H2, [9] * 4, 4, None, "GPU", None)]))
                publisher.publish(msgspec.msgpack.decode(last, type=KVEventBatch).events)  # seq 4
                time.sleep(0.2)
                await sub.receive(4, last)  # joined late: 0..3 come from the replay socket
                assert index.blocks == {H2, H3} and index.next_seq == 5
                # a router that starts now syncs from the replay buffer, and skips the live copies it then gets
                fresh = KVEventSubscriber(KVIndex("replica", 4), sub.endpoint, sub.replay_endpoint, ctx)
                await fresh.sync()
                assert fresh.index.blocks == {H2, H3} and fresh.index.next_seq == 5
                await fresh.receive(4, fresh._replayed[4])  # the bytes the PUB socket sent for seq 4
                assert fresh.index.num_restarts == 0 and fresh.index.next_seq == 5
                fresh.sub.close(linger=0)
                await sub.receive(0, encode_batch(KVEventBatch(0.0, [AllBlocksCleared()])))  # a new process
                assert index.blocks == set() and index.num_restarts == 1
            finally:
                sub.sub.close(linger=0)
                ctx.destroy(linger=0)

        asyncio.run(scenario())
    finally:
        publisher.shutdown()


def test_token_buckets_refill_and_a_tenant_meets_its_own_limits():
    bucket = TokenBucket(60)  # one a second, at most 60
    now = bucket.updated
    assert bucket.wait_for(60, now) == 0 and bucket.wait_for(61, now) == 0  # more than a minute's: a full bucket
    bucket.take(60, now)
    assert bucket.wait_for(1, now) == pytest.approx(1.0) and bucket.wait_for(1, now + 1) == 0
    bucket.take(30, now + 1)  # a debt (completion tokens counted at the end)
    assert bucket.wait_for(1, now + 1) == pytest.approx(30.0)
    tenant = Tenant(TenantSpec("t", rpm=2, tpm=100))
    assert tenant.admit(40) is None and tenant.admit(40) is None
    limit, wait = tenant.admit(1)
    assert limit == "rpm" and wait > 0
    tenant = Tenant(TenantSpec("t", tpm=100))
    assert tenant.admit(80) is None
    assert tenant.admit(30)[0] == "tpm"
    # max_parallel_requests counts requests in flight: a place comes back when one ends
    tenant = Tenant(TenantSpec("t", rpm=100, max_parallel_requests=2))
    assert tenant.admit(10) is None and tenant.admit(10) is None
    assert tenant.refusal_before_tokenizing()[0] == "max_parallel_requests" and tenant.admit(10)[0] == "max_parallel_requests"
    tenant.release()
    assert tenant.refusal_before_tokenizing() is None and tenant.admit(10) is None
    # a request refused by its RPM is refused before the router tokenizes it
    tenant = Tenant(TenantSpec("t", rpm=1))
    assert tenant.admit(10) is None and tenant.refusal_before_tokenizing()[0] == "rpm"


def test_a_tenant_pool_must_name_the_routers_replicas(tmp_path):
    a, b = (Replica(url, KVIndex(url, 16)) for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"))
    assert Tenant(TenantSpec("t", replicas=["http://127.0.0.1:2/"])).may_use([a, b]) == [b]
    assert Tenant(TenantSpec("t")).may_use([a, b]) == [a, b]
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"k": {"tenant": "t", "replicas": []}}))
    with pytest.raises(ValueError, match="replicas of key ...k is empty"):
        load_tenants(str(path), [a.url, b.url])
    path.write_text(json.dumps({"k": {"tenant": "t", "replicas": ["http://127.0.0.1:3"]}}))
    config = RouterConfig(backend=[a.url, b.url], tenants_config=str(path))
    with pytest.raises(ValueError, match="names http://127.0.0.1:3, not a --backend"):
        build_state(config, tokenizer=None)


def test_admission_queue_bounds_waiters_and_times_them_out():
    async def scenario():
        queue = AdmissionQueue(limit=1, max_queued=1, timeout_s=0.3)
        await queue.acquire()  # the one slot
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0.05)
        assert queue.queued == 1
        with pytest.raises(Rejected) as full:
            await queue.acquire()
        assert full.value.reason == "queue_full"
        queue.release()  # the slot passes to the waiter
        await waiter
        assert queue.in_flight == 1 and queue.queued == 0
        late = asyncio.create_task(queue.acquire())
        with pytest.raises(Rejected) as timed_out:
            await late
        assert timed_out.value.reason == "queue_timeout" and queue.queued == 0
        queue.release()
        assert queue.in_flight == 0
        await queue.acquire()  # free again: admitted at once
        assert queue.in_flight == 1

    asyncio.run(scenario())


def test_replica_load_is_read_from_its_vllm_metrics():
    text = ('# HELP vllm:num_requests_running Number of requests in model execution.\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0\n')
    assert replica_reported_load(text) == 5
    assert replica_reported_load("tokenmill:other 1.0\n") is None


def test_what_can_be_resumed():
    chat = {"messages": [], "stream": True}
    assert why_not_resumable("chat", chat) is None
    assert why_not_resumable("completions", {"prompt": [[1, 2]], "stream": True}) is None
    assert why_not_resumable("chat", {**chat, "stream": False}) is not None
    assert why_not_resumable("chat", {**chat, "n": 2}) is not None
    assert why_not_resumable("chat", {**chat, "logprobs": True}) is not None
    assert why_not_resumable("chat", {**chat, "tools": [{}]}) is not None
    assert why_not_resumable("chat", {**chat, "response_format": {"type": "json_object"}}) is not None
    assert why_not_resumable("chat", {**chat, "frequency_penalty": 0.5}) is not None
    assert why_not_resumable("completions", {"prompt": ["a", "b"], "stream": True}) is not None
    assert why_not_resumable("other", chat) is not None


# ---------------- two real replicas of the default model, and the router in front of them ----------------

@pytest.fixture(scope="module")
def replicas_server():
    """Two replicas, each publishing KV events with a replay socket, with LoRA adapters loadable at run time; one
    torch thread each (2 cores)."""
    def start() -> RemoteServer:
        pub, replay = free_port(), free_port()
        # a wildcard address is bound (vLLM's rule; a concrete one is connected to)
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}
        server = RemoteServer(["--kv-events-config", json.dumps(events), "--enable-lora", "--max-loras", "2",
                               "--max-lora-rank", "4"],
                              env={"OMP_NUM_THREADS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
                              server_args=[*SERVER_ARGS, "--kv-cache-memory", "128MiB", "--disable-log-stats",
                                           "--enable-prompt-tokens-details"])
        server.kv_endpoints = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        return server

    with ThreadPoolExecutor(2) as pool:  # the two load side by side
        futures = [pool.submit(start) for _ in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield started
    finally:
        for server in started:
            server.stop()


def _metric(router: RouterProcess, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError(f"{name}{labels}")


def _router_args(replicas, policy: str) -> list[str]:
    return ["--backend", *[r.url for r in replicas], "--kv-events-endpoint", *[r.kv_endpoints[0] for r in replicas],
            "--kv-events-replay-endpoint", *[r.kv_endpoints[1] for r in replicas], "--policy", policy]


def test_kv_policy_sends_a_prefix_to_the_replica_that_caches_it(replicas_server):
    router = RouterProcess(_router_args(replicas_server, "kv"))
    try:
        homes = prefix_workload_homes(router.url)
        assert _metric(router, "tokenmill_router:requests_total", replica=homes[SYSTEMS[0]], reason="kv_hit") == 2
    finally:
        router.stop()


def test_round_robin_alternates_between_replicas(replicas_server):
    router = RouterProcess(_router_args(replicas_server, "round_robin"))
    try:
        chosen = [router.chat(f"Say {i}.").headers["x-tokenmill-replica"] for i in range(4)]
        assert chosen[0] != chosen[1] and chosen[0::2] == [chosen[0]] * 2 and chosen[1::2] == [chosen[1]] * 2
        models = httpx.get(router.url + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        # completions, streamed and not, pass through whole: the same greedy text either way
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 6,
                "temperature": 0}
        plain = httpx.post(router.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) == plain
    finally:
        router.stop()


class _BodyCutShort(http.server.BaseHTTPRequestHandler):
    """A replica that passes its health checks and answers every POST with 200 and half a body, then hangs up."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"id": "cmpl-cut", "choices": [')
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_a_response_cut_short_before_the_client_saw_it_is_retried_on_another_replica(replicas_server):
    """A response that is not streamed is read whole before it goes out, so a replica that fails half-way through
    its body is like one that failed before answering: ejected, and the request served by the next replica."""
    broken = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BodyCutShort)
    threading.Thread(target=broken.serve_forever, daemon=True).start()
    broken_url = f"http://127.0.0.1:{broken.server_address[1]}"
    router = RouterProcess(["--backend", broken_url, replicas_server[1].url, "--policy", "round_robin",
                            "--health-check-interval", "300"])
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        responses = [httpx.post(router.url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        assert [r.status_code for r in responses] == [200, 200], responses[0].text
        assert {r.headers["x-tokenmill-replica"] for r in responses} == {replicas_server[1].url}
        assert responses[0].headers["x-tokenmill-route-reason"] == "retry"  # round robin tried the broken one
        assert responses[0].json()["choices"][0]["text"] == responses[1].json()["choices"][0]["text"]
        assert _metric(router, "tokenmill_router:replica_healthy", replica=broken_url) == 0
        assert _metric(router, "tokenmill_router:retries_total", replica=broken_url, cause="connection") == 1
        unknown, wrong_method = httpx.get(router.url + "/v1/nope", timeout=10), httpx.get(router.url + "/v1/completions")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"  # the one shape
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    finally:
        router.stop()
        broken.shutdown()


def _long_request(route: str, max_tokens: int, **extra) -> tuple[str, dict]:
    """A streamed greedy generation that runs its full length (ignore_eos), with the usage chunk."""
    common = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}, **extra}
    if route == "chat":
        return "/v1/chat/completions", {**common, "messages": [
            {"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]}
    return "/v1/completions", {**common, "prompt": "Once upon a time, in a lighthouse by the sea,"}


def _events(data: bytes) -> list:
    """The data events of an SSE body: JSON objects, and "[DONE]"."""
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: "):
            out.append("[DONE]" if event[6:] == b"[DONE]" else json.loads(event[6:]))
    return out


def _raw_events(url: str, content: bytes) -> list[bytes]:
    with httpx.stream("POST", url, content=content, headers={"content-type": "application/json"},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = r.read()
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def _text(events: list, route: str) -> str:
    key = (lambda c: c["delta"].get("content") or "") if route == "chat" else (lambda c: c["text"])
    return "".join(key(c) for e in events if e != "[DONE]" for c in e["choices"])


def _normalized(events: list) -> list:
    """Events without what differs between two runs of the same request: id, created, the cache's share."""
    out = []
    for e in events:
        if e != "[DONE]":
            e = {**e, "id": "", "created": 0}
            if e.get("usage"):
                e["usage"] = {k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"}
        out.append(e)
    return out


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_resumed_from_its_token_ids_reads_as_a_fault_free_one(replicas_server, tokenizer, route):
    """Real streams, a simulated cut: the router's view of a stream on one replica stops after 8 events; the
    stream continues on the other replica from its token ids (a /v1/completions request), and what the client
    gets is, event for event, what a fault-free run sends (temperature 0), under one response id."""
    first, second = replicas_server
    path, body = _long_request(route, 24)
    reference = _events(b"".join(_raw_events(second.url + path, json.dumps(body).encode())))
    stream = ResumableStream(route, body, tokenizer)
    client = [stream.feed(e) for e in _raw_events(first.url + path, stream.upstream_body())[:8]]
    assert stream.prompt_ids and 3 <= len(stream.generated) < 24 and not stream.finished
    client.append(stream.begin_resume())
    prompt, content = stream.resume_request()
    assert prompt == stream.prompt_ids + stream.generated
    assert json.loads(content)["max_tokens"] == 24 - len(stream.generated)
    client += [stream.feed(e) for e in _raw_events(second.url + "/v1/completions", content)]
    events = _events(b"".join(client))
    assert _normalized(events) == _normalized(reference)
    assert len({e["id"] for e in events if e != "[DONE]"}) == 1
    assert all(c["token_ids"] is None and c.get("prompt_token_ids") is None for e in events[:-1] for c in e["choices"])
    assert events[-2]["usage"]["completion_tokens"] == 24 and stream.done


def test_tenants_a_flooding_tenant_gets_429s_while_a_quiet_one_is_served(replicas_server, tmp_path):
    keys = {"key-flood": {"tenant": "flood", "rpm": 4}, "key-quiet": {"tenant": "quiet", "rpm": 600},
            "key-tokens": {"tenant": "tokens", "tpm": 60}, "key-one": {"tenant": "one", "max_parallel_requests": 1},
            "key-pinned": {"tenant": "pinned", "replicas": [replicas_server[1].url + "/"]}}
    (tmp_path / "tenants.json").write_text(json.dumps(keys))
    router = RouterProcess([*_router_args(replicas_server, "round_robin"),
                            "--tenants-config", str(tmp_path / "tenants.json")])

    def ask(key: str | None, content: str = "Say hi.", max_tokens: int = 1) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(router.url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0})

    try:
        with ThreadPoolExecutor(2) as pool:
            flood = pool.submit(lambda: [ask("key-flood") for _ in range(12)])
            quiet = pool.submit(lambda: [ask("key-quiet") for _ in range(6)])
            flood, quiet = flood.result(), quiet.result()
        assert [r.status_code for r in quiet] == [200] * 6
        statuses = [r.status_code for r in flood]
        assert statuses[:4] == [200] * 4 and statuses.count(429) >= 7, statuses
        refused = next(r for r in flood if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == 429 and "flood" in error["message"]
        assert ask(None).status_code == 401 and ask("key-unknown").status_code == 401
        # tokens per minute: the prompt's tokens at admission, the completion's at the end
        long = "Tell me about the sea and its many moods. " * 4
        assert ask("key-tokens", long, max_tokens=4).status_code == 200
        assert ask("key-tokens", long).status_code == 429
        # one request in flight at a time: of two sent together, the second is refused while the first streams
        with ThreadPoolExecutor(2) as pool:
            pair = [pool.submit(ask, "key-one", "Count to fifty.", 64) for _ in range(2)]
            codes = sorted(f.result().status_code for f in pair)
        assert codes == [200, 429], codes
        assert ask("key-one").status_code == 200  # its place came back when the first ended
        # a tenant on a pool of its own: round-robin alternates the others, never it
        pinned = [ask("key-pinned") for _ in range(4)]
        assert [r.headers["x-tokenmill-replica"] for r in pinned] == [replicas_server[1].url] * 4
        assert {ask("key-quiet").headers["x-tokenmill-replica"] for _ in range(2)} == {r.url for r in replicas_server}
        assert _metric(router, "tokenmill_router:rejections_total", tenant="flood", reason="rpm") \
            == statuses.count(429)
        assert _metric(router, "tokenmill_router:rejections_total", tenant="tokens", reason="tpm") == 1
        assert _metric(router, "tokenmill_router:rejections_total", tenant="", reason="unauthorized") == 2
    finally:
        router.stop()


def test_a_client_that_leaves_mid_stream_stops_the_replicas_generation(replicas_server):
    """The router closes the replica's connection when its client's goes: the replica aborts the generation
    instead of running it to its 1,800 tokens for nobody."""
    router = RouterProcess(_router_args(replicas_server, "round_robin"))
    path, body = _long_request("completions", 1800)

    def replica_load(url: str) -> int:
        return replica_reported_load(httpx.get(url + "/metrics", timeout=10).text)
    try:
        with httpx.stream("POST", router.url + path, json=body, timeout=120) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_bytes()  # kept: a byte iterator dropped half-read closes its connection
            next(chunks)
            replica = stream.headers["x-tokenmill-replica"]
            # the replica's gauges follow its engine's steps: generating, once they catch up
            wait_until(lambda: replica_load(replica) == 1, timeout_s=10)
        # the client closed its connection after its first chunk
        wait_until(lambda: replica_load(replica) == 0, timeout_s=10, message=lambda: router.log_tail())
        assert _metric(router, "tokenmill_router:in_flight_requests", replica=replica) == 0
        assert router.chat("Still there?").status_code == 200
    finally:
        router.stop()


def test_admission_queue_rejects_when_full_or_too_slow_and_sigterm_drains(replicas_server):
    """One slot, one queue place: a long stream holds the slot; the next request waits and times out, the one
    after it finds the queue full. Then SIGTERM: new requests get 503, the stream still ends whole, and the
    router exits 0."""
    router = RouterProcess([*_router_args(replicas_server, "round_robin"), "--max-concurrent-requests", "1",
                            "--max-queued-requests", "1", "--queue-timeout", "1"])
    # ~3 s of the stream must outlast the queue's one-second timeout and the SIGTERM; it then runs to its end, so
    # its length is the test's cost: ~8 s of this machine's decoding (a fixed 600 tokens took 6 s on the fastest
    # CPUs here and 28 s on two AVX2 cores), timed on a replica first
    path, body = _long_request("completions", 32)
    start = time.monotonic()
    assert httpx.post(replicas_server[0].url + path, json=body, timeout=60).status_code == 200
    tokens = min(600, max(64, int(8 * 32 / (time.monotonic() - start))))
    path, body = _long_request("completions", tokens)
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    try:
        with ThreadPoolExecutor(3) as pool, httpx.stream("POST", router.url + path, json=body, timeout=120) as long:
            assert long.status_code == 200
            chunks = long.iter_bytes()
            received = [next(chunks)]  # admitted and streaming; read on meanwhile
            reading = pool.submit(lambda: received.extend(chunks))
            waiting = pool.submit(httpx.post, router.url + "/v1/chat/completions", json=chat, timeout=30)
            wait_until(lambda: _metric(router, "tokenmill_router:queued_requests") == 1, timeout_s=10)
            full = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30)
            assert full.status_code == 503 and full.json()["error"]["type"] == "queue_full"
            timed_out = waiting.result()
            assert timed_out.status_code == 503 and timed_out.json()["error"]["type"] == "queue_timeout"
            assert not reading.done()  # the stream is still in flight
            router.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 503, timeout_s=10)
            refused = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            reading.result()
        events = _events(b"".join(received))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == tokens
        assert router.proc.wait(30) == 0
    finally:
        router.stop()


def test_load_correction_predictions_metrics_and_a_span_that_continues_traceparent(replicas_server):
    """--policy least_load with a replica kept busy by a client that bypasses the router: the replica's own
    vllm:num_requests_running (read with the health checks) steers requests to the other one. The router's span
    continues the caller's traceparent; predicted and actual cached tokens and CPU per request are exported."""
    receiver = OtlpReceiver()
    busy, idle = replicas_server
    router = RouterProcess([*_router_args(replicas_server, "least_load"), "--otlp-traces-endpoint", receiver.url],
                           env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    path, body = _long_request("completions", 1800)
    try:
        done = threading.Event()
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", busy.url + path, json=body, timeout=120) as direct:
            assert direct.status_code == 200
            chunks = direct.iter_bytes()
            next(chunks)  # generating; read on (a server aborts a stream its client stops reading), then closed
            pool.submit(lambda: next((c for c in chunks if done.is_set()), None))
            try:
                # a health check reads the busy replica's own count
                wait_until(lambda: _metric(router, "tokenmill_router:replica_load", replica=busy.url) >= 1,
                           timeout_s=10, message=lambda: f"the busy replica's load seen:\n{router.log_tail()}")
                chosen = [router.chat(f"Say {i}.").headers["x-tokenmill-replica"] for i in range(3)]
            finally:
                done.set()
        assert chosen == [idle.url] * 3
        trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        response = httpx.post(router.url + "/v1/chat/completions", timeout=60,
                              headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                              json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "Trace me."}]})
        assert response.status_code == 200
        spans = wait_until(lambda: [s for s in receiver.spans if s["trace_id"] == trace_id], timeout_s=20,
                           interval_s=0.2)
        assert len(spans) == 1 and spans[0]["parent_span_id"] == parent_id
        attrs = spans[0]["attributes"]
        assert attrs["tokenmill.router.replica"] == response.headers["x-tokenmill-replica"]
        assert attrs["tokenmill.router.cached_tokens"] == cached_tokens(response.json()["usage"])
        assert _metric(router, "tokenmill_router:cache_predictions_total", outcome="exact") == 4
        assert _metric(router, "tokenmill_router:cpu_seconds_per_request") > 0
    finally:
        router.stop()
        receiver.server.shutdown()


def test_every_endpoint_of_the_replicas_is_served_through_the_router(replicas_server):
    """Each POST and GET a generate replica answers, through the router, answers as the replica does: the Responses
    API (a response continued by previous_response_id, and read back, on whichever replica stores it), /invocations
    in both of its generate shapes, batch chat, Anthropic's Messages API (and its stream), tokenize and detokenize,
    the pooling routes' answers for a generate model, /version and /tokenizer_info."""
    first, second = replicas_server
    router = RouterProcess(_router_args(replicas_server, "round_robin"))

    def both(method: str, path: str, body: dict | None = None) -> tuple[httpx.Response, httpx.Response]:
        via, direct = (httpx.request(method, url + path, json=body, timeout=120) for url in (router.url, first.url))
        return via, direct

    def same(via: httpx.Response, direct: httpx.Response, drop=("id", "created", "created_at", "usage")) -> None:
        assert via.status_code == direct.status_code, (via.text, direct.text)
        strip = (lambda j: {k: v for k, v in j.items() if k not in drop} if isinstance(j, dict) else j)
        assert strip(via.json()) == strip(direct.json())

    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
                "temperature": 0}
        for path, body in [("/tokenize", {"model": MODEL, "prompt": "Hello world"}),
                           ("/tokenize", {"model": MODEL, "messages": chat["messages"]}),
                           ("/detokenize", {"model": MODEL, "tokens": [19556, 905]}),
                           ("/v1/embeddings", {"model": MODEL, "input": "Hi"}),
                           ("/pooling", {"model": MODEL, "input": "Hi"}),
                           ("/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
                           ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
                           ("/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
                           ("/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
                           ("/v2/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
                           ("/invocations", chat),
                           ("/invocations", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3,
                                             "temperature": 0}),
                           ("/v1/chat/completions/batch", {**chat, "messages": [chat["messages"]] * 2}),
                           ("/v1/messages", chat),
                           ("/v1/messages/count_tokens", {"model": MODEL, "messages": chat["messages"]})]:
            via, direct = both("POST", path, body)
            same(via, direct)
            assert via.headers["x-tokenmill-replica"] in (first.url, second.url)
        streamed = httpx.post(router.url + "/v1/messages", json={**chat, "stream": True}, timeout=120)
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')
        for path in ("/version", "/tokenizer_info"):
            same(*both("GET", path))

        created = httpx.post(router.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Name a colour.", "max_output_tokens": 3, "temperature": 0})
        assert created.status_code == 200, created.text
        home, response_id = created.headers["x-tokenmill-replica"], created.json()["id"]
        # round robin asks the other replica first: it answers 404, and the one that stores the response is asked
        follow = httpx.post(router.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Another.", "max_output_tokens": 3, "temperature": 0,
            "previous_response_id": response_id})
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-tokenmill-replica"] == home and follow.headers["x-tokenmill-route-reason"] == "retry"
        stored = httpx.get(f"{router.url}/v1/responses/{response_id}", timeout=30)
        assert stored.status_code == 200 and stored.json()["id"] == response_id
        assert httpx.get(f"{router.url}/v1/responses/resp_unknown", timeout=30).status_code == 404
        # a background response's cancel and delete reach the replica that holds it, whichever is asked first
        background = httpx.post(router.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Write a long story.", "max_output_tokens": 1000, "background": True})
        assert background.status_code == 200 and background.json()["status"] == "queued", background.text
        background_id = background.json()["id"]
        cancelled = httpx.post(f"{router.url}/v1/responses/{background_id}/cancel", timeout=30)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        deleted = httpx.delete(f"{router.url}/v1/responses/{background_id}", timeout=30)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        assert httpx.get(f"{router.url}/v1/responses/{background_id}", timeout=30).status_code == 404
        # a background stream's events, followed again through the router from the replica that keeps them
        streamed = httpx.post(router.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Name a colour.", "max_output_tokens": 3, "background": True, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("}"), streamed.text
        streamed_id = json.loads(streamed.text.split("data: ", 2)[1].split("\n", 1)[0])["response"]["id"]
        replay = httpx.get(f"{router.url}/v1/responses/{streamed_id}", params={"stream": "true", "starting_after": 1},
                           timeout=30)
        assert replay.status_code == 200 and replay.text == streamed.text.split("\n\n", 2)[2], replay.text
        # a live one is relayed as it comes: its first events arrive while it still runs
        live = httpx.post(router.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Write a long story.", "max_output_tokens": 300, "background": True})
        live_id = live.json()["id"]
        with httpx.stream("GET", f"{router.url}/v1/responses/{live_id}", params={"stream": "true"},
                          timeout=120) as events:
            first = next(events.iter_lines())
            assert first == "event: response.created", first
            status = httpx.get(f"{router.url}/v1/responses/{live_id}", timeout=30).json()["status"]
            assert status in ("queued", "in_progress"), status
        assert httpx.post(f"{router.url}/v1/responses/{live_id}/cancel", timeout=30).status_code == 200
    finally:
        router.stop()


@pytest.fixture(scope="module")
def adapter_dir(hf_reference, tmp_path_factory) -> str:
    """A random PEFT adapter on the default model (rank 4, q_proj and v_proj)."""
    path = str(tmp_path_factory.mktemp("router-lora") / "qv-r4")
    make_adapter(hf_reference, path, 0, 0.06, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path


def _adapter(url: str, action: str, key: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{action}_lora_adapter", json=body, headers=headers, timeout=120)


def test_adapter_requests_are_predicted_with_each_replicas_adapter_keys(replicas_server, adapter_dir):
    """An adapter's blocks are keyed with the id each replica gave it (here 2 on one replica, 1 on the other, as one
    had loaded another adapter first): the router's predicted cached tokens are the engine's for adapter requests on
    both replicas, none for the base model's same prompt, and none right after the adapter is loaded anew (a new
    id, so a cold cache), then again the engine's."""
    first, second = replicas_server
    router = RouterProcess(_router_args(replicas_server, "round_robin"))
    prompt = "An adapter keys its own prefix blocks, apart from the base model's. " * 8  # ~130 tokens

    def ask(url: str, model: str, cache_salt: str | None = None) -> tuple[str, int, int]:
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **salt})
        assert r.status_code == 200, r.text
        time.sleep(0.3)  # the step's events reach the router
        return (r.headers.get("x-tokenmill-replica"), int(r.headers.get("x-tokenmill-predicted-cached-tokens", -1)),
                cached_tokens(r.json()["usage"]))

    try:
        assert _adapter(first.url, "load", lora_name="first-only", lora_path=adapter_dir).status_code == 200
        loaded = _adapter(router.url, "load", lora_name="keyed", lora_path=adapter_dir)
        assert loaded.status_code == 200, loaded.text
        assert {(a["replica"], a["status"]) for a in loaded.json()["replicas"]} == {(first.url, 200),
                                                                                    (second.url, 200)}
        for replica in replicas_server:  # each replica caches the prompt under its own id for the adapter
            assert ask(replica.url, "keyed")[2] == 0
        asked = [ask(router.url, "keyed") for _ in range(2)]  # round robin: one on each
        assert {replica for replica, _, _ in asked} == {first.url, second.url}
        assert all(predicted == cached >= 112 for _, predicted, cached in asked), asked
        assert all(predicted == cached == 0 for _, predicted, cached in (ask(router.url, MODEL) for _ in range(2)))

        again = _adapter(router.url, "load", lora_name="keyed", lora_path=adapter_dir, load_inplace=True)
        assert again.status_code == 200, again.text
        cold = [ask(router.url, "keyed") for _ in range(2)]
        assert all(predicted == cached == 0 for _, predicted, cached in cold), cold
        warm = [ask(router.url, "keyed") for _ in range(2)]
        assert all(predicted == cached >= 112 for _, predicted, cached in warm), warm
        assert _metric(router, "tokenmill_router:cache_predictions_total", outcome="exact") == 8
        # vLLM's cache_salt: its blocks are keyed apart (the same prompt unsalted, or with another salt, finds none)
        # and the router predicts them with the salt, for the base model and for an adapter alike
        for model in (MODEL, "keyed"):
            salted = [ask(router.url, model, "tenant-a") for _ in range(3)]  # round robin: cold on each, then warm
            assert [(predicted, cached) for _, predicted, cached in salted[:2]] == [(0, 0), (0, 0)], salted
            assert salted[2][1] == salted[2][2] >= 112, salted
            _, predicted, cached = ask(router.url, model, "tenant-b")  # on the replica that holds tenant-a's
            assert predicted == cached == 0
    finally:
        for replica in replicas_server:
            for name in ("keyed", "first-only"):
                _adapter(replica.url, "unload", lora_name=name)
        router.stop()


def test_adapter_load_and_unload_fan_out_and_adapter_requests_go_where_it_is_loaded(replicas_server, adapter_dir,
                                                                                      tmp_path):
    """vLLM's load/unload through the router reach every replica a tenant may use, and the answer names which took
    it and which failed with what; an adapter's requests then go only to the replicas that hold it."""
    first, second = replicas_server
    keys = {"key-pool": {"tenant": "pool", "replicas": [second.url]}, "key-all": {"tenant": "all"}}
    (tmp_path / "tenants.json").write_text(json.dumps(keys))
    router = RouterProcess([*_router_args(replicas_server, "round_robin"),
                            "--tenants-config", str(tmp_path / "tenants.json")])

    def ask(model: str) -> httpx.Response:
        return httpx.post(router.url + "/v1/completions", headers={"Authorization": "Bearer key-all"}, timeout=120,
                          json={"model": model, "prompt": "Hello", "max_tokens": 1})

    try:
        pooled = _adapter(router.url, "load", "key-pool", lora_name="pooled", lora_path=adapter_dir)
        assert pooled.status_code == 200, pooled.text
        assert [(a["replica"], a["status"]) for a in pooled.json()["replicas"]] == [(second.url, 200)]
        answers = [ask("pooled") for _ in range(4)]  # round robin would alternate; only one replica holds it
        assert [(r.status_code, r.headers["x-tokenmill-replica"]) for r in answers] == [(200, second.url)] * 4
        assert {r.headers["x-tokenmill-replica"] for r in (ask(MODEL) for _ in range(2))} == {first.url, second.url}
        models = httpx.get(router.url + "/v1/models", headers={"Authorization": "Bearer key-all"}, timeout=10)
        assert [m["id"] for m in models.json()["data"]] == [MODEL, "pooled"]

        # taken by one replica, refused by the other: the error names both
        partial = _adapter(router.url, "load", "key-all", lora_name="pooled", lora_path=adapter_dir)
        assert partial.status_code == 502
        error = partial.json()["error"]
        assert f"{second.url} answered 400" in error["message"] and "already been loaded" in error["message"]
        assert f"it succeeded on {first.url}" in error["message"]
        assert {(a["replica"], a["status"]) for a in partial.json()["replicas"]} == {(first.url, 200),
                                                                                     (second.url, 400)}
        missing = _adapter(router.url, "load", "key-all", lora_name="missing", lora_path=str(tmp_path / "none"))
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        by_id = _adapter(router.url, "unload", "key-all", lora_int_id=1)
        assert by_id.status_code == 400 and by_id.json()["error"]["param"] == "lora_int_id"

        gone = _adapter(router.url, "unload", "key-all", lora_name="pooled")
        assert gone.status_code == 200, gone.text
        assert len(gone.json()["replicas"]) == 2
        assert ask("pooled").status_code == 404  # no replica serves it: a replica's own answer
    finally:
        for replica in replicas_server:
            _adapter(replica.url, "unload", lora_name="pooled")
        router.stop()


def test_a_replica_killed_mid_stream_the_stream_resumes_and_later_requests_are_retried(replicas_server):
    """Last in the module: it kills a replica (kill -9, engine included) while it streams a greedy generation
    through the router. The client's stream goes on from the other replica and reads exactly as a fault-free run,
    under one id. A second router, which has not seen the death (health checks 300 s apart), meets it as a
    refused connection: the replica is ejected and the request retried on the other one."""
    victim, survivor = replicas_server
    args = [*_router_args(replicas_server, "round_robin"), "--health-check-interval", "300"]
    router, other_router = RouterProcess(args), RouterProcess(args)
    path, body = _long_request("chat", 160)
    reference = _events(b"".join(_raw_events(survivor.url + path, json.dumps(body).encode())))
    try:
        received = b""
        with httpx.stream("POST", router.url + path, json=body, timeout=120) as r:
            assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == victim.url  # round robin: first
            chunks = r.iter_raw()
            while received.count(b"data: ") < 8:
                received += next(chunks)
            for child in psutil.Process(victim.proc.pid).children(recursive=True):
                child.kill()
            victim.proc.kill()
            victim.proc.wait(10)
            received += b"".join(chunks)
        events = _events(received)
        assert _text(events, "chat") == _text(reference, "chat") and len(_text(reference, "chat")) > 100
        assert _normalized(events) == _normalized(reference)
        assert len({e["id"] for e in events if e != "[DONE]"}) == 1
        assert _metric(router, "tokenmill_router:resumed_streams_total", replica=survivor.url) == 1
        assert _metric(router, "tokenmill_router:replica_healthy", replica=victim.url) == 0

        responses = [other_router.chat(f"Say {i}.") for i in range(4)]
        assert [r.headers["x-tokenmill-replica"] for r in responses] == [survivor.url] * 4
        assert responses[0].headers["x-tokenmill-route-reason"] == "retry"  # round robin tried the victim first
        assert _metric(other_router, "tokenmill_router:replica_healthy", replica=victim.url) == 0
        assert _metric(other_router, "tokenmill_router:retries_total", replica=victim.url, cause="connection") == 1
    finally:
        router.stop()
        other_router.stop()
