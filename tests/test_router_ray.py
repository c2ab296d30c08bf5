"""`tokenmill serve-ray` (tokenmill/router/ray_serve.py). Without Ray: replicas joining and leaving a running
router, and the replicas' flags. With Ray (the `ray` extra), on a local cluster of 2 CPUs: the application starts
with one replica of the default model, a burst of requests fills its engine's queue and Serve scales the
replicas to two on that queue, the new replica joins the router, and a prefix workload is routed by the router's
KV-event index over both: each system prompt's repeats go to the replica that caches it, with the cached-token
count predicted exactly."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import pytest
from helpers import SERVER_ARGS, free_port, prefix_workload_homes, wait_until, wait_until_async

from tokenmill.config import KVEventsConfig
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher
from tokenmill.engine.kv_events import BlockStored
from tokenmill.router import app as router_app
from tokenmill.router.app import build_state, join, leave
from tokenmill.router.kv_index import KVEventFeeds
from tokenmill.router.ray_serve import (
    APP_NAME,
    REPLICA_DEPLOYMENT,
    RayServeConfig,
    deploy,
    replica_serve_args,
    serve_autoscaling_config,
)
from tokenmill.router.router_config import RouterConfig

H1 = bytes([1]) * 32


def test_a_replica_that_joins_a_running_router_is_indexed_and_one_that_leaves_is_forgotten():
    """As Serve's replicas come and go: join subscribes to the replica's KV events (a real publisher; what it
    cached before comes from its replay buffer), leave stops routing to it, ends the subscription and drops its
    gauges. `tokenmill router` itself still needs a --backend."""
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{pub_port}",
                                                 replay_endpoint=f"tcp://127.0.0.1:{replay_port}"))
    url = "http://127.0.0.1:1"
    try:
        publisher.publish([BlockStored([H1], None, [1, 2, 3, 4], 4, None, "GPU", None)])

        async def scenario():
            state = build_state(RouterConfig(block_size=4), tokenizer=None)
            state.feeds = KVEventFeeds()
            try:
                replica = join(state, url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
                assert state.replicas.replicas == [replica] and not state.replicas.routable()  # until checked
                await wait_until_async(lambda: H1 in replica.index.blocks, 10, message="the replayed block")
                gauges = state.metrics.render(state.replicas.replicas).decode()
                assert f'kv_index_blocks{{replica="{url}"}} 1.0' in gauges
                leave(state, replica)
                assert state.replicas.replicas == [] and url not in state.metrics.render([]).decode()
                await asyncio.sleep(0.05)
                assert all(t.done() for t in asyncio.all_tasks() if t is not asyncio.current_task())
            finally:
                await state.feeds.close()
                await state.client.aclose()

        asyncio.run(scenario())
    finally:
        publisher.shutdown()
    parser = argparse.ArgumentParser()
    router_app.add_cli_args(parser)
    with pytest.raises(SystemExit, match="--backend"):
        router_app.run_from_cli(parser.parse_args([]))


def test_the_replicas_flags_are_checked_before_anything_starts():
    config = RayServeConfig(model="SmolLM2-135M-Instruct", block_size=32)
    assert replica_serve_args(config, ["--kv-cache-memory", "1GiB"]) == [
        "--model", "SmolLM2-135M-Instruct", "--block-size", "32", "--kv-cache-memory", "1GiB"]
    with pytest.raises(ValueError, match="--kv-events-config"):
        replica_serve_args(config, ["--kv-events-config", "{}"])
    with pytest.raises(ValueError, match="--model"):
        replica_serve_args(config, ["other-model"])
    with pytest.raises(SystemExit):  # tokenmill serve's parser: an unknown flag
        replica_serve_args(config, ["--no-such-flag"])
    with pytest.raises(ValueError, match="--num-cpus"):
        RayServeConfig(ray_address="auto", num_cpus=2)


def test_the_autoscaling_config_is_serves_with_tokenmills_defaults_and_policy():
    pytest.importorskip("ray.serve")
    merged = serve_autoscaling_config('{"max_replicas": 3, "upscale_delay_s": 5}')
    assert merged["min_replicas"] == 1 and merged["max_replicas"] == 3 and merged["target_ongoing_requests"] == 16
    assert merged["policy"] == {"policy_function": "tokenmill.router.ray_serve:engine_queue_autoscaling_policy"}
    with pytest.raises(ValueError, match="max_replica"):  # Serve ignores keys it does not know; tokenmill refuses
        serve_autoscaling_config('{"max_replica": 3}')
    with pytest.raises(ValueError):  # Serve's own check
        serve_autoscaling_config('{"min_replicas": 3, "max_replicas": 2}')


@pytest.fixture
def ray_cluster():
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_states() -> dict[str, int]:
    from ray import serve
    status = serve.status().applications[APP_NAME].deployments[REPLICA_DEPLOYMENT]
    return {str(state): n for state, n in status.replica_states.items()}


def _metrics(url: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _requests_by_replica(url: str, reason: str | None = None) -> dict[str, float]:
    counts: dict[str, float] = {}
    for s in _metrics(url):
        if s.name == "tokenmill_router:requests_total" and reason in (None, s.labels["reason"]):
            counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return counts


def _healthy_replicas(url: str) -> list[str]:
    return [s.labels["replica"] for s in _metrics(url) if s.name == "tokenmill_router:replica_healthy" and s.value]


# metrics_interval_s: the replicas push their autoscaling metric every 0.5 s instead of Serve's 10 s, so that the
# test scales soon (Serve deprecates the field for an environment variable that it does not read yet)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_serve_ray_scales_on_the_engine_queue_and_routes_prefixes_to_their_cache(ray_cluster):
    config = RayServeConfig(port=free_port(), health_check_interval=0.5, replica_num_cpus=1,
                            autoscaling_config=json.dumps({"min_replicas": 1, "max_replicas": 2,
                                                           "target_ongoing_requests": 2, "metrics_interval_s": 0.5,
                                                           "look_back_period_s": 2,
                                                           "upscale_delay_s": 0, "downscale_delay_s": 600}))
    deploy(config, replica_serve_args(config, [*SERVER_ARGS, "--kv-cache-memory", "128MiB", "--disable-log-stats",
                                                 "--enable-prompt-tokens-details"]))
    url = f"http://127.0.0.1:{config.port}"
    assert _replica_states() == {"RUNNING": 1}  # min_replicas, and nothing queued yet
    first = wait_until(lambda: _healthy_replicas(url), 30, 0.2, "the first replica to join the router")

    # A burst of 6 concurrent requests, three times target_ongoing_requests, until Serve scales up.
    scaled, statuses = threading.Event(), []

    def burst(worker: int) -> None:
        n = 0
        while not scaled.is_set():
            n += 1
            response = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": f"{worker * 1000 + n} reasons to tell a long story:",
                "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            statuses.append(response.status_code)

    workers = [threading.Thread(target=burst, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: sum(_replica_states().values()) == 2, 60, 0.2,
                   lambda: f"Serve to add a replica (replicas: {_replica_states()})")
    finally:
        scaled.set()
        for w in workers:
            w.join()
    assert statuses and set(statuses) == {200}
    replicas = wait_until(lambda: len(h := _healthy_replicas(url)) == 2 and h, 120, 0.5,
                          lambda: f"the second replica to join the router ({_replica_states()})")
    (joined,) = set(replicas) - set(first)

    # The prefix workload: the repeats of each system prompt go to the replica that caches it.
    homes = prefix_workload_homes(url)
    kv_hits = _requests_by_replica(url, "kv_hit")
    for home in set(homes.values()):
        assert kv_hits[home] >= 2
    # both replicas served: the first the burst, the one that joined the burst's end or the prefix workload
    served = _requests_by_replica(url)
    assert served.get(first[0], 0) > 0 and served.get(joined, 0) > 0, served
    # a stream through Serve's proxy and the router's relay arrives whole, to its [DONE]: its text is the
    # unstreamed completion's, and its usage counts every token (a lagging reader gets tokens merged into fewer
    # chunks, as vLLM's output collector merges them, so the chunks are not counted)
    request = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}
    whole = httpx.post(url + "/v1/completions", timeout=120, json=request).json()["choices"][0]["text"]
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            **request, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        body = b"".join(stream.iter_bytes())
    assert stream.status_code == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole
    assert events[-1]["usage"]["completion_tokens"] == 8
