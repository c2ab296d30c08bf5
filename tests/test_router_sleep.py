"""`tokenmill router --sleep-after-idle`: idle replicas sent to sleep (vLLM's POST /sleep?level=N), --min-awake
kept awake, and a request routed to a sleeping replica waits while the router wakes it (one POST /wake_up for all
the requests that arrive meanwhile), against fake replicas (tests/fake_replica.py) that answer a generation with
503 while asleep, so that a request that succeeds proves the wake came first."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_replica import MODEL, FakeReplica, running_router
from helpers import wait_until_async
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.router.router_config import RouterConfig

IDLE_S = 0.5
REQUEST = {"model": MODEL, "prompt": "The sea is", "max_tokens": 4}


def _metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _run(tokenizer, scenario, replicas: int, wake_s: float = 0.0, asleep: bool = False, **config):
    async def main():
        fakes = [await FakeReplica(tokenizer, wake_s=wake_s).start() for _ in range(replicas)]
        for fake in fakes:
            fake.asleep = asleep
        try:
            cfg = RouterConfig(backend=[f.url for f in fakes], policy="least_load",
                               **{"health_check_interval": 0.2, "sleep_after_idle": IDLE_S, **config})
            async with running_router(cfg, tokenizer) as (url, state), httpx.AsyncClient(base_url=url,
                                                                                       timeout=30) as client:
                await scenario(client, state, fakes)
        finally:
            for fake in fakes:
                await fake.stop()
    asyncio.run(main())


def test_idle_replicas_sleep_and_min_awake_stay_awake(tokenizer):
    """Three idle replicas, --min-awake 1, --sleep-level 2: two are sent POST /sleep?level=2, the third never is;
    the sleeping ones stay admitted though their /health/ready answers 503; a busy replica is not put to sleep."""
    async def scenario(client, state, fakes):
        await wait_until_async(lambda: sum(f.asleep for f in fakes) == 2, timeout_s=10)
        awake = next(f for f in fakes if not f.asleep)
        # a few more idle periods: the last awake replica stays so
        await asyncio.sleep(3 * IDLE_S)
        assert not awake.asleep and not awake.posts("/sleep")
        for fake in fakes:
            assert [c.path for c in fake.calls] == ([] if fake is awake else ["/sleep?level=2"])
        assert all(r.healthy for r in state.replicas.replicas)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "tokenmill_router:sleeping_replicas") == 2
        assert sum(_metric(metrics, "tokenmill_router:replica_sleeps_total", replica=f.url) for f in fakes) == 2
        # the policy prefers the awake replica to a sleeping one of the same load: nothing is woken
        r = await client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 200 and r.headers["x-tokenmill-replica"] == awake.url
        assert not any(f.posts("/wake_up") for f in fakes)
    _run(tokenizer, scenario, replicas=3, min_awake=1, sleep_level=2)


def test_a_request_to_a_sleeping_replica_waits_for_one_shared_wake(tokenizer):
    """--min-awake 0: the only replica falls asleep; four requests sent together all succeed after one
    POST /wake_up (which takes 0.3 s), sent before any of them reached the replica; idle again, it sleeps again."""
    async def scenario(client, state, fakes):
        [fake] = fakes
        await wait_until_async(lambda: fake.asleep, timeout_s=10)
        answers = await asyncio.gather(*(client.post("/v1/completions", json=REQUEST) for _ in range(4)))
        assert [r.status_code for r in answers] == [200] * 4, answers[0].text
        calls = [c.path for c in fake.calls]
        assert calls == ["/sleep?level=1", "/wake_up"] + ["/v1/completions"] * 4
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "tokenmill_router:replica_wakes_total", replica=fake.url) == 1
        assert _metric(metrics, "tokenmill_router:wake_seconds_count") == 1
        assert _metric(metrics, "tokenmill_router:wake_seconds_sum") >= 0.3
        await wait_until_async(lambda: len(fake.posts("/sleep")) == 2, timeout_s=10)
        r = await client.post("/v1/completions", json={**REQUEST, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert len(fake.posts("/wake_up")) == 2
    _run(tokenizer, scenario, replicas=1, wake_s=0.3, min_awake=0)


def test_a_replica_that_refuses_sleep_stays_awake_and_serves(tokenizer):
    """A replica without sleep mode answers /sleep with 404: it stays awake and routable."""
    async def scenario(client, state, fakes):
        [fake] = fakes
        fake.sleep_mode = False
        await wait_until_async(lambda: fake.posts("/sleep"), timeout_s=10)
        assert not fake.asleep and not state.replicas.replicas[0].asleep
        r = await client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 200 and not fake.posts("/wake_up")
    _run(tokenizer, scenario, replicas=1, min_awake=0)


def test_a_replica_asleep_before_the_router_started_is_admitted_and_woken(tokenizer):
    """A replica left asleep (its /health/ready answers 503): the router asks /is_sleeping at start-up, admits it,
    and wakes it for the first request."""
    async def scenario(client, state, fakes):
        [fake] = fakes
        assert state.replicas.replicas[0].healthy and state.replicas.replicas[0].asleep
        r = await client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 200, r.text
        assert [c.path for c in fake.calls] == ["/wake_up", "/v1/completions"]
    _run(tokenizer, scenario, replicas=1, asleep=True, sleep_after_idle=60, min_awake=0)


def test_a_replica_put_to_sleep_behind_the_routers_back_is_woken_for_a_request(tokenizer):
    """Someone else sends the only replica to sleep: the request meets a 503, the router finds it asleep
    (/is_sleeping), wakes it, and the request succeeds there."""
    async def scenario(client, state, fakes):
        [fake] = fakes
        fake.asleep = True
        r = await client.post("/v1/completions", json=REQUEST)
        assert r.status_code == 200, r.text
        assert [c.path for c in fake.calls] == ["/v1/completions", "/wake_up", "/v1/completions"]
    _run(tokenizer, scenario, replicas=1, sleep_after_idle=60, min_awake=0, health_check_interval=300)


def test_sleep_flags_without_sleep_after_idle_are_refused():
    with pytest.raises(ValueError, match="give it too"):
        RouterConfig(backend=["http://a"], sleep_level=2)
    with pytest.raises(ValueError, match="must be positive"):
        RouterConfig(backend=["http://a"], sleep_after_idle=0)
