"""`tokenmill router --prefill ... --decode ...`: disaggregated serving orchestrated by the router, against fake
instances (tests/fake_replica.py) that record what they receive: the prefill request's and the decode request's
shapes (vLLM's: its disaggregated proxy's), placement by each pool's KV index, a prefill instance that is down or
answers 500 (the next one prefills), and a decode instance that dies mid-stream (the stream resumes on another
decode instance, recomputing). The engine side (an instance that hands its KV over) is tested with the engine."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, running_router
from helpers import free_port, wait_until_async
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import KVEventsConfig
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher
from tokenmill.engine.kv_events import BlockStored
from tokenmill.router.kv_index import prompt_block_hashes
from tokenmill.router.router_config import RouterConfig

# what a prefill instance answers with: vLLM's keys, and one the router must pass on without knowing it
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
          "remote_block_ids": [4, 5, 6], "remote_host": "10.0.0.7", "remote_port": 14579,
          "remote_request_id": "req-1", "tp_size": 1, "opaque_extra": {"k": [1, 2]}}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about lighthouses."}], "max_tokens": 10,
        "min_tokens": 2, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _content(events: str) -> tuple[str, set]:
    """The streamed chat's text and its chunk ids."""
    text, ids = "", set()
    for line in events.split("\n\n"):
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text, ids


def _run(tokenizer, scenario, prefill: int = 2, decode: int = 2, policy: str = "round_robin",
         kv_events: bool = False, **config):
    """`scenario(client, state, prefills, decodes)` with the router in front of fake instances; with `kv_events`,
    each fake has a real KV-event publisher (fake.publisher) whose endpoints the router is given."""
    async def main():
        prefills = [await FakeReplica(tokenizer, {**PARAMS, "remote_engine_id": f"engine-p{i}"}).start()
                    for i in range(prefill)]
        decodes = [await FakeReplica(tokenizer).start() for _ in range(decode)]
        if kv_events:
            endpoints = []
            for fake in prefills + decodes:
                pub, replay = free_port(), free_port()
                fake.publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{pub}",
                                                                  replay_endpoint=f"tcp://127.0.0.1:{replay}"))
                endpoints.append((f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"))
            config.update(kv_events_endpoint=[e[0] for e in endpoints],
                          kv_events_replay_endpoint=[e[1] for e in endpoints])
        try:
            cfg = RouterConfig(prefill=[p.url for p in prefills], decode=[d.url for d in decodes], policy=policy,
                               **{"health_check_interval": 0.2, **config})
            async with running_router(cfg, tokenizer) as (url, state), httpx.AsyncClient(base_url=url,
                                                                                       timeout=30) as client:
                await wait_until_async(lambda: all(r.healthy for r in state.replicas.replicas), timeout_s=10)
                await scenario(client, state, prefills, decodes)
        finally:
            for replica in prefills + decodes:
                await replica.stop()
                if kv_events:
                    replica.publisher.shutdown()
    asyncio.run(main())


def test_a_request_is_prefilled_then_decoded_in_vllms_shapes(tokenizer):
    """The prefill instance gets the client's request with do_remote_decode, max_tokens 1, not streamed, without
    stream_options or min_tokens; the decode instance gets the client's own request with exactly the prefill's
    kv_transfer_params, under the same X-Request-Id; the client gets the decode's stream, and a non-streamed
    completion likewise; the stages are counted per instance."""
    async def scenario(client, state, prefills, decodes):
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200
            assert r.headers["x-tokenmill-prefill-replica"] == prefills[0].url
            assert r.headers["x-tokenmill-replica"] == decodes[0].url
            events = (await r.aread()).decode()
        text, ids = _content(events)
        assert text == tokenizer.decode(prefills[0].answer_ids[:10]) and len(ids) == 1
        assert '"usage"' in events and events.endswith("data: [DONE]\n\n")

        [prefill] = prefills[0].posts("/v1/chat/completions")
        sent = {k: v for k, v in CHAT.items() if k not in ("stream_options", "min_tokens")}
        assert prefill.body == {**sent, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        [decode] = decodes[0].posts("/v1/chat/completions")
        assert decode.body["kv_transfer_params"] == {**PARAMS, "remote_engine_id": "engine-p0"}
        assert {k: decode.body[k] for k in CHAT} == CHAT  # the client's request, min_tokens and all
        assert decode.headers["x-request-id"] == prefill.headers["x-request-id"]
        assert not prefills[1].calls and not decodes[1].calls

        body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 5, "max_completion_tokens": 5}
        r = await client.post("/v1/completions", json=body, headers={"x-request-id": "mine"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tokenizer.decode(
            decodes[1].answer_ids[:5])
        [prefill] = prefills[1].posts("/v1/completions")
        assert prefill.body["max_tokens"] == prefill.body["max_completion_tokens"] == 1
        assert prefill.body["stream"] is False and prefill.headers["x-request-id"] == "mine"
        [decode] = decodes[1].posts("/v1/completions")
        assert decode.body == {**body, "kv_transfer_params": {**PARAMS, "remote_engine_id": "engine-p1"}}

        refused = await client.post("/v1/completions", json={**body, "kv_transfer_params": PREFILL_PARAMS})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
        tokenized = await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        assert tokenized.status_code == 404 and tokenized.headers["x-tokenmill-replica"] in {d.url for d in decodes}

        metrics = (await client.get("/metrics")).text
        for stage, fakes in (("prefill", prefills), ("decode", decodes)):
            for fake in fakes:
                assert _metric(metrics, "tokenmill_router:pd_requests_total", stage=stage, replica=fake.url) == 1
    _run(tokenizer, scenario)


def test_each_stage_goes_where_its_pool_caches_the_prompt(tokenizer):
    """--policy kv on each pool's own index, fed by each instance's KV events (--kv-events-endpoint in --prefill
    then --decode order): the second prefill instance and the first decode instance publish the prompt's blocks,
    and the prefill and the decode go there."""
    async def scenario(client, state, prefills, decodes):
        request = {**CHAT, "stream": False}
        request.pop("stream_options")
        ids = state.tokenizer.token_ids("chat", request)
        size = state.config.block_size
        hashes = prompt_block_hashes(ids, size)
        assert len(hashes) >= 2
        for fake in (prefills[1], decodes[0]):
            fake.publisher.publish([BlockStored(hashes, None, ids[:len(hashes) * size], size, None, "GPU", None)])
        by_url = {r.url: r for r in state.replicas.replicas}
        await wait_until_async(lambda: all(by_url[f.url].index.blocks == set(hashes)
                                           for f in (prefills[1], decodes[0])), timeout_s=10)
        assert not by_url[prefills[0].url].index.blocks and not by_url[decodes[1].url].index.blocks
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=request)
            assert r.status_code == 200
            assert r.headers["x-tokenmill-prefill-replica"] == prefills[1].url
            assert r.headers["x-tokenmill-replica"] == decodes[0].url
            assert r.headers["x-tokenmill-route-reason"] == "kv_hit"
            assert int(r.headers["x-tokenmill-predicted-cached-tokens"]) == len(hashes) * state.config.block_size
        assert not prefills[0].calls and not decodes[1].calls
    _run(tokenizer, scenario, policy="kv", kv_events=True)


def test_a_prefill_instance_down_or_failing_is_replaced_by_the_next(tokenizer):
    """Round robin sends the first prefill to an instance that is down (connection refused) and the next to one
    that answers 500: both requests are prefilled by the third instance and decoded; the failures are counted,
    the dead one ejected. (Health checks 300 s apart: the requests, not a check, meet the dead instance.)"""
    async def scenario(client, state, prefills, decodes):
        dead, broken, good = prefills
        await dead.stop()
        broken.status = 500
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
            assert r.status_code == 200, r.text
            assert r.headers["x-tokenmill-prefill-replica"] == good.url
            assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(good.answer_ids[:10])
        assert len(broken.posts("/v1/chat/completions")) >= 1 and len(good.posts("/v1/chat/completions")) == 2
        for decode in decodes:
            for call in decode.posts("/v1/chat/completions"):
                assert call.body["kv_transfer_params"]["remote_engine_id"] == "engine-p2"
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "tokenmill_router:pd_prefill_failovers_total", replica=dead.url) == 1
        assert _metric(metrics, "tokenmill_router:pd_prefill_failovers_total", replica=broken.url) >= 1
        assert _metric(metrics, "tokenmill_router:replica_healthy", replica=dead.url) == 0
        broken.status = 200
        await good.stop()  # the mended one is the only prefill instance that answers now
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
        assert r.status_code == 200 and r.headers["x-tokenmill-prefill-replica"] == broken.url
    _run(tokenizer, scenario, prefill=3, health_check_interval=300)


def test_a_decode_instance_that_dies_mid_stream_is_resumed_on_another(tokenizer):
    """The first decode instance drops its connection after 4 tokens: the stream goes on from the other decode
    instance, asked by token ids and without kv_transfer_params (it recomputes), and the client reads the whole
    answer under one id."""
    async def scenario(client, state, prefills, decodes):
        victim, survivor = decodes
        victim.die_after = 4
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == victim.url
            events = (await r.aread()).decode()
        text, ids = _content(events)
        assert text == tokenizer.decode(victim.answer_ids[:10]) and len(ids) == 1
        assert events.endswith("data: [DONE]\n\n") and '"error"' not in events
        [first] = victim.posts("/v1/chat/completions")
        assert first.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
        [resumed] = survivor.posts("/v1/completions")
        assert "kv_transfer_params" not in resumed.body
        assert resumed.body["prompt"] == [1, 2, 3] + victim.answer_ids[:4] and resumed.body["max_tokens"] == 6
        assert len(prefills[0].calls) + len(prefills[1].calls) == 1  # prefilled once
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "tokenmill_router:resumed_streams_total", replica=survivor.url) == 1
    _run(tokenizer, scenario)


def test_a_decode_retried_before_its_first_byte_recomputes_on_the_next_instance(tokenizer):
    """The decode instance chosen answers 503 (overloaded): the decode goes to the next decode instance without
    kv_transfer_params (the KV handed over was for the first), which computes the prompt itself."""
    async def scenario(client, state, prefills, decodes):
        decodes[0].status = 503
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
        assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == decodes[1].url
        assert r.headers["x-tokenmill-route-reason"] == "retry"
        [refused] = decodes[0].posts("/v1/chat/completions")
        assert refused.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
        [retried] = decodes[1].posts("/v1/chat/completions")
        assert "kv_transfer_params" not in retried.body and retried.body["max_tokens"] == 10
    _run(tokenizer, scenario)


def test_flags_refuse_a_mix_and_a_half_setup():
    with pytest.raises(ValueError, match="either --backend or --prefill"):
        RouterConfig(backend=["http://a"], prefill=["http://b"], decode=["http://c"])
    with pytest.raises(ValueError, match="both --prefill and --decode"):
        RouterConfig(prefill=["http://b"])
    with pytest.raises(ValueError, match="named once"):
        RouterConfig(prefill=["http://b"], decode=["http://b/"])
    with pytest.raises(ValueError, match="--prefill then --decode"):
        RouterConfig(prefill=["http://b"], decode=["http://c"], kv_events_endpoint=["tcp://127.0.0.1:1"])
