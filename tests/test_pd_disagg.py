"""Disaggregated prefill/decode (--kv-transfer-config TCPConnector, tokenmill/engine/kv_transfer.py) between real
`tokenmill serve` processes on the default model, with vLLM's request shapes (its toy proxy's): the prefill
instance answers a `do_remote_decode` request with kv_transfer_params, the decode instance fetches the blocks it
lacks over TCP and decodes. Greedy outputs equal the single instance's (which tests/test_correctness.py holds
to HF transformers'); a prefix the decode instance caches is not fetched; chunked prefill on the prefill side.
Faults: a decode that never fetches (the prefill instance frees the blocks after its timeout),
malformed params (400 naming the field), stale params and a prefill instance killed before the fetch (the decode
instance recomputes, nothing leaks on either side). fp8 KV on both and a peer of another layout run as two
engines of a tiny random Llama in this process, over the same TCP transport."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import (API_KEY, MODEL, TEXT, RouterProcess, engine_on, free_port, metric_value, save_tiny_llama,
                     scrape_metrics, stop_process, wait_until)
from tokenmill.config import KVTransferConfig
from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.sampling_params import SamplingParams

PIN_TIMEOUT_S = 5  # the prefill instance's abort_request_timeout
FETCH_TIMEOUT_S = 3  # the decode instance's wait for an answer
MAX_TOKENS = 12
# what vLLM's toy proxy sends to the prefill instance
TO_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def tcp(role: str, **extra) -> list[str]:
    config = {"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pd(servers):
    """The single instance (the suite's default server), a prefill instance with 32-token prefill chunks and a
    decode instance."""
    env = {"TOKENMILL_API_KEY": API_KEY}
    specs = {
        "default": [],
        "pd-prefill": [*tcp("kv_producer", abort_request_timeout=PIN_TIMEOUT_S), "--max-num-batched-tokens", "32"],
        "pd-decode": tcp("kv_consumer", fetch_timeout=FETCH_TIMEOUT_S),
    }
    with ThreadPoolExecutor(len(specs)) as pool:  # they load side by side
        futures = {name: pool.submit(servers, name, args, env=env) for name, args in specs.items()}
    return {name: f.result() for name, f in futures.items()}


def complete(server, prompt: list[int], max_tokens: int = MAX_TOKENS, kv=None, path="/v1/completions",
             **fields) -> httpx.Response:
    body = {"prompt": prompt} if path == "/v1/completions" else {"messages": prompt}
    body.update(max_tokens=max_tokens, temperature=0.0, return_token_ids=True, **fields)
    if kv is not None:
        body["kv_transfer_params"] = kv
    return httpx.post(server.url_for(path), json=body, headers=server.headers(), timeout=120)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def through_pd(prefill, decode, prompt, path="/v1/completions") -> tuple[dict, dict]:
    """As vLLM's toy proxy: the prefill instance with max_tokens 1 and TO_PREFILL, then the decode instance with
    the client's request and the prefill instance's kv_transfer_params."""
    first = ok(complete(prefill, prompt, 1, TO_PREFILL, path))
    return first, ok(complete(decode, prompt, kv=first["kv_transfer_params"], path=path))


def tokens(body: dict) -> list[int]:
    choice = body["choices"][0]
    return choice["token_ids"]


def transfer(server) -> dict[str, float]:
    m = scrape_metrics(server)
    fam = "tokenmill:kv_transfer_blocks"
    return {"fetched": metric_value(m, fam, fam + "_total", kind="fetched"),
            "skipped": metric_value(m, fam, fam + "_total", kind="skipped"),
            "sent": metric_value(m, fam, fam + "_total", kind="sent"),
            "external": metric_value(m, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",
                                     source="external_kv_transfer"),
            "pinned": metric_value(m, "tokenmill:kv_transfer_pinned_blocks", "tokenmill:kv_transfer_pinned_blocks"),
            "expired": metric_value(m, "tokenmill:kv_transfer_pins_expired", "tokenmill:kv_transfer_pins_expired_total"),
            "usage": metric_value(m, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
            **{f"failed:{dict(labels)['reason']}": v for (name, labels), v in
               m.get("tokenmill:kv_transfer_fetch_failures", {"samples": {}})["samples"].items()
               if name.endswith("_total")},
            **{f"phase:{dict(labels)['phase']}": v for (name, labels), v in
               m.get("tokenmill:kv_transfer_fetch_phase_seconds", {"samples": {}})["samples"].items()
               if name.endswith("_total")}}


def test_greedy_outputs_through_pd_are_the_single_instances(pd, prompts):
    """Prompts of 97, 150 and 233 tokens (6, 9 and 14 full blocks), prefilled in 32-token chunks: the decode
    instance fetches every full block but the one holding the last prompt token (which it computes, as vLLM's
    decode does), and its tokens are the single instance's."""
    prefill, decode, single = pd["pd-prefill"], pd["pd-decode"], pd["default"]
    before = transfer(decode)
    fetched = 0
    for prompt in prompts[4:7]:
        first, out = through_pd(prefill, decode, prompt)
        kv = first["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False and kv["tp_size"] == 1
        assert len(kv["remote_block_ids"]) == len(prompt) // 16 and kv["remote_port"] > 0
        assert kv["remote_request_id"] and kv["remote_engine_id"] and kv["remote_host"] == "127.0.0.1"
        assert out["kv_transfer_params"] is None
        assert tokens(out) == tokens(ok(complete(single, prompt)))
        fetched += (len(prompt) - 1) // 16
    after = transfer(decode)
    assert after["fetched"] - before["fetched"] == fetched
    assert after["external"] - before["external"] == fetched * 16
    # where the fetches' time went: each phase counted, and every fetch had a network round trip and a write
    assert {"phase:queued", "phase:network", "phase:checks", "phase:write"} <= set(after)
    for phase in ("network", "write"):
        assert after[f"phase:{phase}"] > before.get(f"phase:{phase}", 0), phase
    # the decode instance said it was done: the prefill instance holds nothing
    wait_until(lambda: transfer(prefill)["pinned"] == 0 and transfer(prefill)["usage"] == 0, 10,
               message="the prefill instance to free the fetched blocks")
    assert transfer(prefill)["expired"] == 0


def test_chat_through_pd(pd):
    messages = [{"role": "user", "content": "Write three sentences about the history of the printing press, "
                                            "mentioning Gutenberg, movable type and the spread of books in Europe."}]
    first, out = through_pd(pd["pd-prefill"], pd["pd-decode"], messages, "/v1/chat/completions")
    assert first["kv_transfer_params"]["remote_block_ids"]
    single = ok(complete(pd["default"], messages, path="/v1/chat/completions"))
    assert out["choices"][0]["message"]["content"] == single["choices"][0]["message"]["content"]


def test_a_prefix_the_decode_instance_caches_is_not_fetched(pd, prompts):
    """The decode instance served the first 96 tokens before: of the 12 blocks it needs, 6 are in its prefix
    cache (skipped) and 6 fetched; the output is the single instance's."""
    prefill, decode = pd["pd-prefill"], pd["pd-decode"]
    prompt = prompts[7][:200]  # (no test before this one sent it)
    ok(complete(decode, prompt[:97], max_tokens=1))
    before = transfer(decode)
    _, out = through_pd(prefill, decode, prompt)
    after = transfer(decode)
    assert after["skipped"] - before["skipped"] == 6
    assert after["fetched"] - before["fetched"] == (199 // 16) - 6
    assert tokens(out) == tokens(ok(complete(pd["default"], prompt)))


@pytest.mark.parametrize("kv,fragment", [
    ({"do_remote_prefill": True}, "remote_engine_id"),  # no source
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 0, "remote_request_id": "r"}, "remote_port"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
    ({"do_remote_decode": True}, "prefill instance"),  # the decode instance is no producer
    ({"unknown_key": 1}, "unknown_key"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r", "tp_size": 2}, "tp_size"),
    ("not an object", "kv_transfer_params"),
])
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(pd, kv, fragment):
    r = complete(pd["pd-decode"], [1, 2, 3], kv=kv)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and fragment in err["message"], err


def test_the_single_instance_and_a_streamed_prefill_refuse_kv_transfer_params(pd):
    for server, fields in ((pd["default"], {}), (pd["pd-prefill"], {"stream": True}),
                           (pd["pd-prefill"], {"n": 2})):
        r = complete(server, [1, 2, 3], kv=TO_PREFILL, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text


def test_blocks_no_decode_fetches_are_freed_after_the_timeout_and_stale_params_recompute(pd, prompts):
    """The prefill instance pins the blocks (KV usage above 0) until abort_request_timeout passes, then frees them
    (usage 0, counted). A decode request with those stale params recomputes: the single instance's tokens, a
    failure counted by reason, no block fetched."""
    prefill, decode = pd["pd-prefill"], pd["pd-decode"]
    prompt = prompts[7][2:]  # a chain no instance has seen: the decode instance must fetch all of it
    before = transfer(prefill)
    kv = ok(complete(prefill, prompt, 1, TO_PREFILL))["kv_transfer_params"]
    pinned = transfer(prefill)
    assert pinned["pinned"] == len(prompt) // 16 and pinned["usage"] > 0
    wait_until(lambda: transfer(prefill)["usage"] == 0, PIN_TIMEOUT_S + 10, 0.25,
               message="the pinned blocks to be freed after the timeout")
    after = transfer(prefill)
    assert after["expired"] - before["expired"] == 1 and after["pinned"] == 0
    d0 = transfer(decode)
    out = ok(complete(decode, prompt, kv=kv))
    d1 = transfer(decode)
    assert tokens(out) == tokens(ok(complete(pd["default"], prompt)))
    assert d1.get("failed:unknown", 0) - d0.get("failed:unknown", 0) == 1
    assert d1["fetched"] == d0["fetched"] and d1["external"] == d0["external"] and d1["skipped"] == d0["skipped"]
    wait_until(lambda: transfer(decode)["usage"] == 0, 10, message="the decode instance's KV usage back to 0")


# ---- behind `tokenmill router --prefill ... --decode ...` and vLLM's own proxy ----

class Relay:
    """A TCP relay in front of an instance: the network path to it, so that a test can break the path while the
    instance lives on (the module's instances serve the tests after). `down()` closes its port (a host gone:
    connections refused); `cut_next_post(n)` drops the next POST's connection after n server-sent events of its
    answer (a host gone mid-stream)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut_after: int | None = None
        self.cuts = 0
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def down(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone leaves the port listening)
        self.listener.close()
        for s in list(self.open):  # the connections the router keeps alive go too
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut_next_post(self, n_events: int) -> None:
        self.cut_after = n_events

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        self.open.add(client)
        conn = {"limit": None, "seen": b""}  # this connection's cut, armed by a POST on it (connections are reused)
        threading.Thread(target=self._requests, args=(client, upstream, conn), daemon=True).start()
        try:
            while data := upstream.recv(65536):
                if conn["limit"] is not None:
                    seen = conn["seen"] + data
                    starts = [i for i in range(len(seen)) if seen.startswith(b"data: ", i)]
                    if len(starts) > conn["limit"]:  # send up to the event after the n-th, then drop
                        client.sendall(seen[len(conn["seen"]):starts[conn["limit"]]] if starts[conn["limit"]] >
                                       len(conn["seen"]) else b"")
                        self.cuts += 1
                        break
                    conn["seen"] = seen
                client.sendall(data)
        except OSError:
            pass
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.open.discard(client)

    def _requests(self, client: socket.socket, upstream: socket.socket, conn: dict) -> None:
        try:
            while data := client.recv(65536):
                if data.startswith(b"POST"):
                    with self.lock:
                        if self.cut_after is not None:
                            conn.update(limit=self.cut_after, seen=b"")
                            self.cut_after = None
                upstream.sendall(data)
        except OSError:
            pass


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def pd_router(pd):
    """`tokenmill router --prefill F P --decode G D`, round robin: F and G are relays to the prefill instance P
    and the decode instance D (so every request reaches the one instance of its role, whichever the router picks,
    and a relay can fail while the instance behind it serves on). Health checks 300 s apart: the requests, not a
    check, meet a relay that is down."""
    prefill, decode = pd["pd-prefill"], pd["pd-decode"]
    relays = {"prefill": Relay(_port(prefill)), "decode": Relay(_port(decode))}
    router = RouterProcess(["--prefill", relays["prefill"].url, prefill.url, "--decode", relays["decode"].url,
                            decode.url, "--policy", "round_robin", "--health-check-interval", "300"])
    yield router, relays
    router.stop()
    for relay in relays.values():
        relay.down()


def router_metric(router: RouterProcess, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def post(url: str, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}", **headers}, timeout=120)


def sse(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """A streamed request's text and its events (the last one [DONE], checked)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in e for e in events), events
    text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for e in events
                   for c in e["choices"])
    return text, events


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


REQUESTS = [  # (path, the request less its prompt field)
    ("/v1/completions", {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}),
]


def fresh_text(i: int) -> str:
    """~120 tokens of TEXT from a character offset no other test starts at: a prompt no instance has cached."""
    return TEXT[53 + 233 * i:53 + 233 * i + 500]


def with_prompt(path: str, common: dict, text: str) -> dict:
    if path == "/v1/completions":
        return {**common, "prompt": text}
    return {**common, "messages": [{"role": "user", "content": text}]}


def test_through_the_router_outputs_are_the_single_instances(pd, pd_router):
    """Completions and chat, streamed and not, through `tokenmill router --prefill --decode` in front of real
    instances: the text and usage are the single instance's, the decode instance took its prompt from the prefill
    instance (prompt tokens by source external_kv_transfer), the prefill instance holds nothing after, and the
    router counts each stage on the instance it placed it on."""
    router, relays = pd_router
    single, prefill, decode = pd["default"], pd["pd-prefill"], pd["pd-decode"]
    before = transfer(decode)
    for i, (path, common) in enumerate(REQUESTS * 2):
        body = with_prompt(path, common, fresh_text(i))
        reference = ok(post(single.url, path, body))
        if i < 2:
            r = post(router.url, path, body)
            out = ok(r)
            assert text_of(out) == text_of(reference) and out["usage"] == reference["usage"]
            assert "kv_transfer_params" not in out or out["kv_transfer_params"] is None
        else:
            streamed = {**body, "stream_options": {"include_usage": True}}
            text, events = sse(router.url, path, streamed)
            alone, reference_events = sse(single.url, path, streamed)
            assert text == alone == text_of(reference) and events[-1]["usage"] == reference_events[-1]["usage"]
            assert len({e["id"] for e in events}) == 1
    after = transfer(decode)
    assert after["external"] - before["external"] >= 4 * 16 and after["fetched"] - before["fetched"] >= 4
    wait_until(lambda: transfer(prefill)["pinned"] == 0, 10, message="the prefill instance to free the blocks")
    counted = {(stage, url): router_metric(router, "tokenmill_router:pd_requests_total", stage=stage, replica=url)
               for stage in ("prefill", "decode") for url in (relays[stage].url, pd[f"pd-{stage}"].url)}
    assert counted == {key: 2 for key in counted}, counted  # round robin: two of the four on each


def test_through_the_router_a_decode_cut_mid_stream_is_resumed(pd, pd_router):
    """The path to the decode instance drops after the first events of a stream (the relay G cuts it): the router
    resumes the stream on the other decode URL (the same instance, asked by token ids, recomputing) and the client
    reads the single instance's text under one id, with no error. The instance's request on the cut connection
    is aborted: it holds no block after."""
    router, relays = pd_router
    single, decode = pd["default"], pd["pd-decode"]
    path, common = REQUESTS[1]
    body = {**with_prompt(path, common, fresh_text(5)), "max_tokens": 24, "ignore_eos": True}
    reference = ok(post(single.url, path, body))
    resumed = router_metric(router, "tokenmill_router:resumed_streams_total", replica=decode.url)
    for _ in range(2):  # round robin: one of two decodes goes through the relay
        relays["decode"].cut_next_post(4)
        cuts = relays["decode"].cuts
        text, events = sse(router.url, path, body)
        assert text == text_of(reference) and len({e["id"] for e in events}) == 1
        if relays["decode"].cuts > cuts:
            break
        relays["decode"].cut_after = None
    assert relays["decode"].cuts == cuts + 1
    assert router_metric(router, "tokenmill_router:resumed_streams_total", replica=decode.url) == resumed + 1
    wait_until(lambda: transfer(decode)["usage"] == 0, 10, message="the decode instance's KV usage back to 0")


def test_through_the_router_a_prefill_instance_that_is_down_is_replaced(pd, pd_router):
    """The relay F to the prefill instance goes down (connection refused, as a dead host): the requests round robin
    sends there are prefilled on the other prefill URL and decoded, with the single instance's text; the
    failover is counted and F ejected."""
    router, relays = pd_router
    single = pd["default"]
    relays["prefill"].down()
    for i in range(2):
        path, common = REQUESTS[i]
        body = with_prompt(path, common, fresh_text(6 + i))
        r = post(router.url, path, body)
        assert text_of(ok(r)) == text_of(ok(post(single.url, path, body)))
        assert r.headers["x-tokenmill-prefill-replica"] == pd["pd-prefill"].url
    assert router_metric(router, "tokenmill_router:pd_prefill_failovers_total", replica=relays["prefill"].url) == 1
    assert router_metric(router, "tokenmill_router:replica_healthy", replica=relays["prefill"].url) == 0


# vLLM's own proxy for disaggregated serving, byte for byte: tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py of https://github.com/local-inference-lab/vllm at commit 9aaf83ef502fc37bc647f6e474314d48ba36cd1c
# (Apache-2.0, its SPDX header kept), committed as a test fixture since the tests reach no network. It imports
# only argparse, httpx, fastapi and uvicorn; its git blob id is checked, so that it stays unchanged.
TOY_PROXY = Path(__file__).parent / "data" / "vllm_toy_proxy_server.py"
TOY_PROXY_BLOB = "1a910c8d24dcb2343fa70083874c48445c265fb2"


@pytest.fixture(scope="module")
def toy_proxy(pd):
    """vLLM's toy proxy (unchanged) in front of the prefill and the decode instance, started with its own flags;
    it sends OPENAI_API_KEY as the bearer token."""
    data = TOY_PROXY.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == TOY_PROXY_BLOB, "the proxy was changed"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(TOY_PROXY), "--port", str(port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
         str(_port(pd["pd-prefill"])), "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(_port(pd["pd-decode"]))],
        env={**os.environ, "OPENAI_API_KEY": API_KEY}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/healthcheck", timeout=2).status_code == 200, 30, 0.2,
               message=lambda: f"vLLM's toy proxy to start (exit {proc.poll()})", retry_on=(httpx.HTTPError,))
    yield url
    stop_process(proc, 10)


def test_vllms_own_proxy_in_front_of_the_instances(pd, toy_proxy):
    """A completion (not streamed) and a chat (streamed) through vLLM's toy proxy: the single instance's text and
    usage, the decode instance's prompt taken from the prefill instance, nothing left pinned."""
    single, prefill, decode = pd["default"], pd["pd-prefill"], pd["pd-decode"]
    before = transfer(decode)
    path, common = REQUESTS[0]
    body = with_prompt(path, common, fresh_text(8))
    out, reference = ok(post(toy_proxy, path, body)), ok(post(single.url, path, body))
    assert text_of(out) == text_of(reference) and out["usage"] == reference["usage"]
    path, common = REQUESTS[1]
    body = {**with_prompt(path, common, fresh_text(9)), "stream_options": {"include_usage": True}}
    (text, events), (alone, reference_events) = sse(toy_proxy, path, body), sse(single.url, path, body)
    assert text == alone and events[-1]["usage"] == reference_events[-1]["usage"]
    after = transfer(decode)
    assert after["external"] - before["external"] >= 2 * 16 and after["fetched"] - before["fetched"] >= 2
    wait_until(lambda: transfer(prefill)["pinned"] == 0, 10, message="the prefill instance to free the blocks")


def test_a_prefill_instance_killed_before_the_fetch_costs_a_recomputation(pd, prompts, servers):
    """The prefill instance's processes are killed between its answer and the decode: the decode instance's fetch
    times out (fetch_timeout), it recomputes the prompt (the single instance's tokens), counts the failure, and
    holds no block after (KV usage 0). Last in this module: it ends the prefill instance."""
    prefill, decode = pd["pd-prefill"], pd["pd-decode"]
    prompt = prompts[7][1:]  # a chain no instance has seen: the decode instance must fetch all of it
    kv = ok(complete(prefill, prompt, 1, TO_PREFILL))["kv_transfer_params"]
    prefill.mark_broken()
    prefill.engine_process().kill()
    prefill.proc.kill()
    prefill.proc.wait(30)
    d0 = transfer(decode)
    out = ok(complete(decode, prompt, kv=kv))
    d1 = transfer(decode)
    assert tokens(out) == tokens(ok(complete(pd["default"], prompt)))
    assert d1.get("failed:timeout", 0) - d0.get("failed:timeout", 0) == 1
    assert d1["fetched"] == d0["fetched"] and d1["skipped"] == d0["skipped"]
    wait_until(lambda: transfer(decode)["usage"] == 0, 10, message="the decode instance's KV usage back to 0")


# ---- two engines in this process (a tiny random Llama), over the same TCP transport ----

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-pd")
    save_tiny_llama(path, vocab_size=128, max_position_embeddings=256)
    return str(path)


def tiny_engine(model_dir: str, role: str | None = None, **kw):
    if role is not None:
        kw["kv_transfer_config"] = KVTransferConfig("TCPConnector", role, kv_port=0,
                                                    kv_connector_extra_config={"fetch_timeout": 5})
    return engine_on(model_dir, **{"num_gpu_blocks_override": 64, "block_size": 16, **kw})


def run_engine(engine, request_id: str, prompt: list[int], max_tokens: int, kv: KVTransferParams | None = None):
    request = engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    kv_transfer_params=kv))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return request, outputs[-1]


def tiny_prompt(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_one_byte_kv_on_both_engines(tiny_dir, kv_cache_dtype):
    """fp8 KV (scale 1, no calibration) on both: the decode engine's tokens are a single fp8 engine's, with every
    prompt block but the last fetched (written into its pool as the prefill engine's bytes), and the prefill
    engine's pool empty once the decode engine is done."""
    prompt = tiny_prompt(120, 1)
    alone, _ = run_engine(tiny_engine(tiny_dir, kv_cache_dtype=kv_cache_dtype), "a", prompt, 10)
    prefill = tiny_engine(tiny_dir, "kv_producer", kv_cache_dtype=kv_cache_dtype)
    decode = tiny_engine(tiny_dir, "kv_consumer", kv_cache_dtype=kv_cache_dtype)
    try:
        _, first = run_engine(prefill, "p", prompt, 1, KVTransferParams(do_remote_decode=True))
        assert prefill.kv_cache.usage > 0 and prefill.kv_sender.num_pinned_blocks == 7
        request, out = run_engine(decode, "d", prompt, 10, first.kv_transfer_params)
        assert request.output_token_ids == alone.output_token_ids
        assert request.num_external_tokens == 7 * 16 and decode.transfer_counters.blocks_fetched == 7
        # the decode engine's blocks hold the prefill engine's bytes
        mine = [decode.kv_cache.pool.cached[h].block_id for h in request.block_hashes[:7]]
        theirs = first.kv_transfer_params.remote_block_ids[:7]
        assert [bytes(b) for b in decode.offload.layout.read(mine)] == \
            [bytes(b) for b in prefill.kv_sender.layout.read(theirs)]
        assert decode.kv_cache.block_tables == {}
        wait_until(lambda: prefill.release_kv_pins() or prefill.kv_cache.usage == 0, 5)
        assert prefill.kv_cache.usage == 0 and prefill.transfer_counters.blocks_sent == 7
    finally:
        prefill.kv_sender.close()
        decode.offload.close()


def test_a_peer_of_another_layout_is_refused_and_the_prompt_recomputed(tiny_dir, caplog):
    """A float32 prefill engine and an fp8 decode engine: the handshake is refused with the difference named, the
    decode engine recomputes (its tokens are a lone fp8 engine's) and counts the failure as "layout"."""
    prompt = tiny_prompt(70, 2)
    alone, _ = run_engine(tiny_engine(tiny_dir, kv_cache_dtype="fp8"), "a", prompt, 6)
    prefill = tiny_engine(tiny_dir, "kv_producer")
    decode = tiny_engine(tiny_dir, "kv_consumer", kv_cache_dtype="fp8")
    try:
        _, first = run_engine(prefill, "p", prompt, 1, KVTransferParams(do_remote_decode=True))
        request, _ = run_engine(decode, "d", prompt, 6, first.kv_transfer_params)
        assert request.output_token_ids == alone.output_token_ids
        assert request.num_external_tokens == 0
        assert decode.transfer_counters.fetch_failures == {"layout": 1}
        assert "kv_dtype" in caplog.text and "float8_e4m3fn" in caplog.text
        assert decode.kv_cache.block_tables == {}
    finally:
        prefill.kv_sender.close()
        decode.offload.close()


def test_aborts_leave_no_block_pinned_on_either_side(tiny_dir):
    """A do_remote_decode request aborted mid-prefill pins nothing (vLLM's rule: only one that reached its length
    limit hands its blocks over). A decode request aborted before it was scheduled tells the prefill engine it
    needs none of them: the prefill engine frees them at once, not after the timeout."""
    prompt = tiny_prompt(100, 3)
    prefill = tiny_engine(tiny_dir, "kv_producer", max_num_batched_tokens=32)
    decode = tiny_engine(tiny_dir, "kv_consumer")
    try:
        prefill.add_request("cut", prompt, SamplingParams(max_tokens=1, kv_transfer_params=KVTransferParams(
            do_remote_decode=True)))
        prefill.step()  # the first 32-token chunk
        assert prefill.kv_cache.usage > 0
        prefill.abort_request("cut")
        assert prefill.kv_sender.num_pinned_requests == 0 and prefill.kv_cache.usage == 0
        _, first = run_engine(prefill, "p", prompt, 1, KVTransferParams(do_remote_decode=True))
        assert prefill.kv_sender.num_pinned_blocks == 6
        decode.add_request("d", prompt, SamplingParams(max_tokens=4, kv_transfer_params=first.kv_transfer_params))
        decode.abort_request("d")
        wait_until(lambda: prefill.release_kv_pins() or prefill.kv_cache.usage == 0, 10,
                   message="the prefill engine to free the blocks the aborted decode released")
        assert prefill.kv_sender.num_pinned_requests == 0 and prefill.transfer_counters.pins_expired == 0
        assert prefill.transfer_counters.blocks_sent == 0 and decode.kv_cache.usage == 0
    finally:
        prefill.kv_sender.close()
        decode.offload.close()
