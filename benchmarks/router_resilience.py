"""The router under faults and floods: issue 12's lines that need a live fleet and a clock.

Three replicas of the default model (float32, one torch thread each, KV events with replay) behind
`tokenmill router --policy kv`, then three phases. float32, because the texts are compared: a greedy continuation
in bfloat16 can change with the batch it was computed in (other rows, prefix hits, chunk sizes take other kernel
paths), and a resumed stream is recomputed in another batch on another replica.

1. tenants: a quiet tenant sends one streamed chat request after another (after a warm-up pass, its TTFT p95
   alone first), then the same while a flooding tenant (its own low RPM, one request in flight at most) hammers
   the router from 8 clients (in a process of its own): the
   flood gets 429s, every quiet request succeeds, and the quiet TTFT p95 is compared with its solo figure (the
   line: under 1.5x).
2. faults: 32 greedy streamed chat requests at c=16, once fault-free (the reference texts) and once with
   `kill -9` of one replica (its engine too) while they stream: requests that had not started streaming must all
   succeed (retried), streams cut mid-way resume on another replica, and their texts must equal the reference
   (a stream counts as resumed when its replica, from the x-tokenmill-replica header, was the victim and it ended
   after the kill).
3. stale index: the time from the kill until the router's index of that replica (tokenmill_router:kv_index_blocks)
   is empty; then the replica is restarted on the same ports and killed and restarted again with no traffic at
   all, and the same time is measured (the health check ejects it; an engine that came back before a check is
   recognised by its KV event sequence starting again). The line: within 2 s.

Tenant pools (--isolate-flood): the tenants config gives the flood replica 3 and the quiet tenant replicas 1 and 2
(their `replicas`), as an operator puts batch traffic on a pool of its own; --flood-nice N runs the flood's
replica at a lower CPU weight (its session's autogroup nice level, as a container's CPU weight), since on this one
machine the pools still share 2 cores.

Usage: .venv/bin/python benchmarks/router_resilience.py [OUT_DIR]   (default benchmarks/runs/router-resilience)
Knobs: --quiet-requests N (40), --flood-rpm N (20), --fault-requests N (32), --max-tokens N (64 in phase 2),
--phases tenants,faults, --isolate-flood, --flood-nice N."""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import aiohttp
import httpx

from tokenmill.ports import free_port

MODEL = "SmolLM2-135M-Instruct"
SYSTEMS = ["You are a terse assistant for a shipping company. Answer in one or two sentences. " * 6,
           "You answer questions about astronomy, briefly and with care, as a teacher would. " * 6]
TOPICS = ["the tides", "a lighthouse", "winter storms", "the night sky", "container ships", "the moon", "comets",
          "harbour cranes", "navigation by stars", "sea charts", "the equator", "ocean currents", "Saturn's rings",
          "cargo insurance", "a solar eclipse", "the north star"]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready in {timeout_s} s")


class Replica:
    def __init__(self, out: str, i: int):
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(out, f"replica-{i}.log")
        self.proc: subprocess.Popen | None = None

    def start(self, nice: int = 0) -> None:
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.pub}",
                  "replay_endpoint": f"tcp://*:{self.replay}", "topic": "kv"}
        cmd = [os.path.join(os.path.dirname(sys.executable), "tokenmill"), "serve", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
               "--disable-log-stats", "--kv-events-config", json.dumps(events)]
        log = open(self.log_path, "a")
        # its own process group, so that kill -9 takes the engine process with it, as a crashed node does
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENMILL_NO_PROGRESS": "1"})
        if nice:
            # A session of its own is a scheduling group of its own (Linux autogroups, as a container is a cgroup):
            # the group's nice level sets its CPU share against the others', as a container's CPU weight would
            with open(f"/proc/{self.proc.pid}/autogroup", "w") as f:
                f.write(str(nice))

    def wait_ready(self) -> None:
        wait_http(self.url + "/health/ready", self.proc)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def metric(router_url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(router_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def chat_body(system: str, question: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def streaming_client(connections: int = 100, timeout_s: float = 120) -> aiohttp.ClientSession:
    """The clients' HTTP sessions: aiohttp, not httpx, as the clients share the 2 cores with the replicas and the
    router, and aiohttp spends a fraction of httpx's CPU per request and per event."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def stream_chat(client: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> dict:
    """One streamed request: status, whether any content arrived, TTFT, the text, and an error if one came."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    result = {"status": None, "started": False, "ttft": None, "text": "", "error": None, "replica": None,
              "began": time.monotonic(), "ended": None}
    try:
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            result["status"], result["replica"] = r.status, r.headers.get("x-tokenmill-replica")
            if r.status != 200:
                result["error"] = (await r.read())[:200].decode(errors="replace")
                return result
            async for raw in r.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result["error"] = json.dumps(event["error"])[:200]
                    continue
                for choice in event.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        if not result["started"]:
                            result["started"], result["ttft"] = True, time.perf_counter() - start
                        result["text"] += content
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result["error"] = repr(e)
    result["ended"] = time.monotonic()
    return result


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[18] if len(values) >= 2 else values[0]


async def flood(router: str, clients: int, stop) -> tuple[list[int], list[dict]]:
    """The flooding tenant: `clients` clients that send one request after another, until `stop` is set; their
    statuses, and when and where each admitted one ran (began, ended, replica)."""
    statuses: list[int] = []
    admitted: list[dict] = []
    async with streaming_client() as client:
        async def flooder(j: int) -> None:
            n = 0
            while not stop.is_set():
                body = chat_body(SYSTEMS[j % 2], f"Write about {TOPICS[(j + n) % len(TOPICS)]} at length.", 32)
                result = await stream_chat(client, router, body, "key-flood")
                statuses.append(result["status"])
                n += 1
                if statuses[-1] == 429:
                    await asyncio.sleep(0.05)  # a client that retries at once, as floods do
                else:
                    admitted.append({k: result[k] for k in ("began", "ended", "replica")})

        await asyncio.gather(*(flooder(j) for j in range(clients)))
    return statuses, admitted


def flood_process(router: str, clients: int, started, stop, results) -> None:
    started.set()
    cpu, wall = time.process_time(), time.monotonic()
    statuses, admitted = asyncio.run(flood(router, clients, stop))
    results.put((statuses, admitted, (time.process_time() - cpu) / (time.monotonic() - wall)))


async def tenants_phase(router: str, quiet_requests: int) -> dict:
    """The flood runs in a process of its own, as another tenant's clients would: in the quiet client's event loop,
    reading 160 refusals a second would delay the quiet client's own reads and count as TTFT."""
    async with streaming_client() as client:
        async def quiet_run() -> list[dict]:
            out = []
            for i in range(quiet_requests):
                body = chat_body(SYSTEMS[i % 2], f"Tell me one fact about {TOPICS[i % len(TOPICS)]}.", 16)
                out.append(await stream_chat(client, router, body, "key-quiet"))
            return out

        await quiet_run()  # warm-up: the prompts' prefixes cached, as they are in the two measured passes
        solo = await quiet_run()
        mp = multiprocessing.get_context("spawn")
        started, stop, results = mp.Event(), mp.Event(), mp.Queue()
        flooder = mp.Process(target=flood_process, args=(router, 8, started, stop, results))
        flooder.start()
        await asyncio.to_thread(started.wait, 60)
        await asyncio.sleep(1.0)  # the flood under way
        router_cpu, wall = metric(router, "tokenmill_router:cpu_seconds"), time.monotonic()
        try:
            loaded = await quiet_run()
        finally:
            router_cores = (metric(router, "tokenmill_router:cpu_seconds") - router_cpu) / (time.monotonic() - wall)
            stop.set()
            statuses, admitted, flood_cores = await asyncio.to_thread(results.get, True, 120)
            flooder.join(30)
    solo_ttft = [r["ttft"] for r in solo if r["ttft"] is not None]
    timed = [r for r in loaded if r["ttft"] is not None]
    loaded_ttft = [r["ttft"] for r in timed]
    beside = {"any_replica": [], "same_replica": [], "none": []}
    for r in timed:  # the admitted flood requests that ran while this quiet request waited for its first token
        ran = [f for f in admitted if f["began"] < r["began"] + r["ttft"] and f["ended"] > r["began"]]
        beside["any_replica" if ran else "none"].append(r["ttft"])
        if any(f["replica"] == r["replica"] for f in ran):
            beside["same_replica"].append(r["ttft"])
    return {
        "quiet_requests": quiet_requests,
        "quiet_solo_ok": sum(r["status"] == 200 and r["error"] is None for r in solo),
        "quiet_under_flood_ok": sum(r["status"] == 200 and r["error"] is None for r in loaded),
        "quiet_ttft_p50_solo_ms": round(1000 * statistics.median(solo_ttft), 1),
        "quiet_ttft_p95_solo_ms": round(1000 * p95(solo_ttft), 1),
        "quiet_ttft_p50_under_flood_ms": round(1000 * statistics.median(loaded_ttft), 1),
        "quiet_ttft_p95_under_flood_ms": round(1000 * p95(loaded_ttft), 1),
        "quiet_p95_ratio": round(p95(loaded_ttft) / p95(solo_ttft), 2),
        "flood_requests": len(statuses), "flood_200": statuses.count(200), "flood_429": statuses.count(429),
        "flood_other": len(statuses) - statuses.count(200) - statuses.count(429),
        # CPU (cores) while the quiet tenant ran under the flood: the router's (refusals, the flood's and the quiet
        # tenant's requests) and the flood's own clients' (on the same 2 cores here; elsewhere in a deployment)
        "router_cpu_cores_under_flood": round(router_cores, 3), "flood_clients_cpu_cores": round(flood_cores, 3),
        # the quiet requests under the flood by what ran beside them: count and TTFT p50 (ms)
        "quiet_beside_admitted_flood": {k: {"count": len(v), "ttft_p50_ms": round(1000 * statistics.median(v), 1)
                                            if v else None} for k, v in beside.items()},
        "quiet_ttft_ms_solo": [round(1000 * t, 1) for t in solo_ttft],
        "quiet_ttft_ms_under_flood": [round(1000 * t, 1) for t in loaded_ttft],
    }


def fault_bodies(n: int, max_tokens: int) -> list[dict]:
    return [chat_body(SYSTEMS[i % 2], f"Tell me a long story about {TOPICS[i % len(TOPICS)]} (number {i}).",
                      max_tokens) for i in range(n)]


async def run_at(router: str, bodies: list[dict], concurrency: int, during=None) -> list[dict]:
    """The requests at a fixed concurrency; `during(results_so_far)` runs beside them (the fault injector)."""
    results: list[dict | None] = [None] * len(bodies)
    queue = list(range(len(bodies)))
    async with streaming_client(concurrency + 4, 300) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results[i] = await stream_chat(client, router, bodies[i])

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        if during is not None:
            await during(results)
        await asyncio.gather(*tasks)
    return results


async def wait_index_empty(router: str, replica_url: str, since: float, timeout_s: float = 30) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(router, "tokenmill_router:kv_index_blocks", replica=replica_url) == 0:
            return round(time.monotonic() - since, 3)
        await asyncio.sleep(0.02)
    return None


async def faults_phase(router: str, replicas: list[Replica], n: int, max_tokens: int) -> tuple[dict, Replica]:
    """Returns the figures and the replica that was killed: the one with the most streams under way."""
    bodies = fault_bodies(n, max_tokens)
    reference = await run_at(router, bodies, 16)
    assert all(r["error"] is None and r["status"] == 200 for r in reference), [r for r in reference if r["error"]]
    resumed_before = metric(router, "tokenmill_router:resumed_streams_total")
    retries_before = metric(router, "tokenmill_router:retries_total")
    killed: dict = {}

    async def inject(results: list) -> None:
        # kill once some requests have finished and one replica has at least 3 streams under way
        while True:
            assert not all(r is not None for r in results), "the run ended before a replica held 3 streams"
            load = {r: metric(router, "tokenmill_router:in_flight_requests", replica=r.url) for r in replicas}
            victim = max(load, key=load.get)
            if sum(r is not None for r in results) >= 2 and load[victim] >= 3:
                break
            await asyncio.sleep(0.05)
        killed["victim"] = victim
        killed["in_flight"] = load[victim]
        killed["blocks"] = metric(router, "tokenmill_router:kv_index_blocks", replica=victim.url)
        killed["finished"] = sum(r is not None for r in results)
        killed["at"] = time.monotonic()
        victim.kill9()
        killed["index_dropped_after_s"] = await wait_index_empty(router, victim.url, killed["at"])

    faulted = await run_at(router, bodies, 16, inject)
    failed = [i for i, r in enumerate(faulted) if r["error"] is not None or r["status"] != 200]
    differ = [i for i, (a, b) in enumerate(zip(faulted, reference)) if a["text"] != b["text"]]
    # committed to the victim and still open at the client when it died. Those the victim had not finished
    # generating can only end well if resumed (resumed_streams: the router's own count); the rest were already
    # on their way to the client.
    resumed = [i for i, r in enumerate(faulted) if r["replica"] == killed["victim"].url and r["ended"] > killed["at"]]
    return {
        "requests": n, "concurrency": 16, "max_tokens": max_tokens, "finished_before_kill": killed["finished"],
        "victim_in_flight_at_kill": killed["in_flight"], "victim_index_blocks_at_kill": killed["blocks"],
        "failed": len(failed), "failed_samples": [faulted[i]["error"] for i in failed[:5]],
        "failed_before_first_byte": sum(not faulted[i]["started"] for i in failed),
        "victim_streams_open_at_kill": len(resumed),
        "victim_texts_differing_from_fault_free_run": len([i for i in resumed if i in differ]),
        "all_texts_differing_from_fault_free_run": len(differ),
        "resumed_streams": metric(router, "tokenmill_router:resumed_streams_total") - resumed_before,
        "retried_requests": metric(router, "tokenmill_router:retries_total") - retries_before,
        "stale_index_dropped_after_kill_s": killed["index_dropped_after_s"],
    }, killed["victim"]


async def restart_phase(router: str, victim: Replica) -> dict:
    """Back on the same ports; it fills its cache; then kill -9 and an immediate restart with no traffic."""
    victim.start()
    victim.wait_ready()
    async with streaming_client() as client:
        deadline = time.monotonic() + 30
        while metric(router, "tokenmill_router:replica_healthy", replica=victim.url) != 1:
            assert time.monotonic() < deadline, "the restarted replica was not re-admitted"
            await asyncio.sleep(0.1)
        for i in range(6):  # fill its cache (the router learns of it from the KV events)
            await stream_chat(client, victim.url, chat_body(SYSTEMS[i % 2], f"About {TOPICS[i]}.", 4))
    deadline = time.monotonic() + 10
    while metric(router, "tokenmill_router:kv_index_blocks", replica=victim.url) == 0:
        assert time.monotonic() < deadline, "the router never indexed the restarted replica's blocks"
        await asyncio.sleep(0.05)
    blocks = metric(router, "tokenmill_router:kv_index_blocks", replica=victim.url)
    at = time.monotonic()
    victim.kill9()
    victim.start()
    dropped = await wait_index_empty(router, victim.url, at)
    victim.wait_ready()
    return {"index_blocks_before_kill": blocks, "stale_index_dropped_after_kill_and_restart_s": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="benchmarks/runs/router-resilience")
    parser.add_argument("--quiet-requests", type=int, default=40)
    parser.add_argument("--flood-rpm", type=float, default=20, help="the flooding tenant's RPM limit: what it is "
                        "allowed; each admitted request is 32 tokens, so on a slow machine 20 RPM keeps a replica "
                        "busy all the time")
    parser.add_argument("--isolate-flood", action="store_true", help="the tenants config puts the flooding tenant "
                        "on replica 3 and the quiet one on replicas 1 and 2 (their `replicas`)")
    parser.add_argument("--flood-nice", type=int, default=0, help="with --isolate-flood: the flood's replica "
                        "runs at this nice level (an operator's lower CPU share for a batch pool)")
    parser.add_argument("--fault-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--phases", default="tenants,faults", help="which of tenants, faults (faults includes the "
                        "stale-index phase) to run")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout's SIGTERM still stops the fleet
    replicas = [Replica(args.out, i) for i in range(3)]
    router_proc = None
    try:
        for i, r in enumerate(replicas):
            r.start(args.flood_nice if args.isolate_flood and i == 2 else 0)
        for r in replicas:
            r.wait_ready()
        tenants = os.path.join(args.out, "tenants.json")
        quiet = {"tenant": "quiet", "rpm": 600}
        flood = {"tenant": "flood", "rpm": args.flood_rpm, "max_parallel_requests": 1}
        if args.isolate_flood:
            quiet["replicas"], flood["replicas"] = [r.url for r in replicas[:2]], [replicas[2].url]
        with open(tenants, "w") as f:
            json.dump({"key-quiet": quiet, "key-flood": flood}, f)
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "tokenmill"), "router", "--port", str(port),
               "--policy", "kv", "--backend", *[r.url for r in replicas],
               "--kv-events-endpoint", *[f"tcp://127.0.0.1:{r.pub}" for r in replicas],
               "--kv-events-replay-endpoint", *[f"tcp://127.0.0.1:{r.replay}" for r in replicas],
               "--tenants-config", tenants]
        router_log = open(os.path.join(args.out, "router.log"), "w")
        router_proc = subprocess.Popen(cmd, stdout=router_log, stderr=subprocess.STDOUT)
        wait_http(router + "/health", router_proc)
        result = {}
        if "tenants" in phases:
            result["tenants"] = {"flood_rpm": args.flood_rpm, "isolate_flood": args.isolate_flood,
                                 "flood_nice": args.flood_nice if args.isolate_flood else 0,
                                 **asyncio.run(tenants_phase(router, args.quiet_requests))}
            print(json.dumps(result["tenants"], indent=1), flush=True)
        if "faults" in phases:
            # the faults phase needs no key: a new router without --tenants-config
            router_proc.send_signal(signal.SIGTERM)
            router_proc.wait(30)
            cmd = cmd[:cmd.index("--tenants-config")]
            router_proc = subprocess.Popen(cmd, stdout=router_log, stderr=subprocess.STDOUT)
            wait_http(router + "/health", router_proc)
            result["faults"], victim = asyncio.run(faults_phase(router, replicas, args.fault_requests,
                                                                args.max_tokens))
            print(json.dumps(result["faults"], indent=1), flush=True)
            result["restart"] = asyncio.run(restart_phase(router, victim))
            print(json.dumps(result["restart"], indent=1), flush=True)
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        result["cpu"] = {"cores": os.cpu_count(), "model": platform.processor() or platform.machine(),
                         "flags": " ".join(x for x in flags if x.startswith(("avx", "amx")))}
        with open(os.path.join(args.out, "resilience.json"), "w") as f:
            json.dump(result, f, indent=1)
    finally:
        if router_proc is not None and router_proc.poll() is None:
            router_proc.send_signal(signal.SIGTERM)
            router_proc.wait(30)
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    main()
