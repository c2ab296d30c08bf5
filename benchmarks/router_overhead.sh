#!/usr/bin/env bash
# The latency `tokenmill router` adds: one replica, the router in front of it, and C requests in flight (64):
# C/2 clients, each sending the same request via the router and to the replica directly at the same moment, pair
# after pair, so that both of a pair meet the same engine queue and step (clients that alternated request by
# request met a queue of ~1 s at c=64 that changed between a request and the next, and the difference drowned in
# it). Requests are tiny (a short prompt, max_tokens 1). Prints the latency p50/p99 of each path and their
# difference, the p50/p99 of the per-pair difference, the router's own histogram
# (tokenmill_router:overhead_seconds: arrival to forwarding) and its CPU time per request.
# OUTPUT_TOKENS=16-64 STREAM=1: streamed requests whose length is drawn per pair (both of a pair alike,
# ignore_eos), so that responses do not all end in the same engine step as tiny ones do; TTFT is then
# compared too.
# VIA=relay: a control. A bare TCP relay (bytes copied both ways, nothing parsed) stands where the router stood,
# pinned the same way, so that what any extra hop in front of the replica costs (a copy reaching the engine a
# fraction of a millisecond after its twin, and missing the step its twin started) shows apart from what the
# router's own work costs.
# CONTROL=relay: the bare relay as a third path in the same run (on the router's core): each request is sent
# three ways at once (C/3 clients), so that the relay's figures, the floor any hop meets, come from the same engine
# steps as the router's. Also reported: the share of copies answered more than 5 ms after (or before) their direct
# twin.
# VIA=lean, VIA=lean-asgi: a second control, benchmarks/lean_proxy.py: the routing work (tokens, block keys, the
# index) and a pooled upstream connection, with none of the router's other work; lean-asgi serves it under
# uvicorn as an ASGI app, as the router is served.
#
# Usage: benchmarks/router_overhead.sh [OUT]   (default benchmarks/runs/router-overhead)
# Knobs (env): CONCURRENCY (64), REQUESTS: pairs (or triples) per client (40), THREADS for the replica (2), POLICY (kv), DTYPE (auto);
# OUTPUT_TOKENS (1, or a range LO-HI), STREAM (0);
# REPLICA_CPUS, ROUTER_CPUS, CLIENT_CPUS: taskset CPU lists (unset: no pinning); CLIENT_NICE: the clients' nice
# level (0).
# The placement that stands for a deployment on 2 cores, where neither the replica nor the router shares a core
# with its clients: THREADS=1 REPLICA_CPUS=0 ROUTER_CPUS=1 CLIENT_CPUS=1 CLIENT_NICE=10. The clients use a few
# percent of a core and yield theirs to the router (nice 10), which then runs as soon as a request reaches it.
# Clients on the replica's core (CLIENT_CPUS=0) hand their direct copies to the replica on its own core, ahead of
# any copy through a hop: a quarter of a bare relay's copies are then answered >5 ms after their twins (Zen 4,
# 2026-12-03, benchmarks/results/router.md). Clients sharing the router's core at the same priority make
# the router wait behind their bursts.
# A tiny check: CONCURRENCY=4 REQUESTS=3 benchmarks/router_overhead.sh /tmp/ro
set -euo pipefail
OUT=${1:-benchmarks/runs/router-overhead}
PY=${PY:-.venv/bin}
CONCURRENCY=${CONCURRENCY:-64}; REQUESTS=${REQUESTS:-40}; THREADS=${THREADS:-2}; POLICY=${POLICY:-kv}
export THREADS
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
pin() { if [ -n "$1" ]; then echo taskset -c "$1"; fi; }
OMP_NUM_THREADS=$THREADS TOKENMILL_NO_PROGRESS=1 $(pin "${REPLICA_CPUS:-}") $PY/tokenmill serve --port 8301 --dtype "${DTYPE:-auto}" \
  --max-model-len 2048 --disable-log-stats \
  --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5641", "replay_endpoint": "tcp://*:5642"}' \
  > "$OUT/replica.log" 2>&1 &
REPLICA=$!
trap 'kill $REPLICA ${ROUTER:-} ${CONTROL_PID:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8301/health/ready > /dev/null; do sleep 1; done
start_relay() {  # a bare TCP relay on port $1 in front of the replica, pinned as the router is
  $(pin "${ROUTER_CPUS:-}") $PY/python - "$1" > "$OUT/relay-$1.log" 2>&1 <<'PY' &
import asyncio, sys, uvloop

async def pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def relay(client_reader, client_writer):
    replica_reader, replica_writer = await asyncio.open_connection("127.0.0.1", 8301)
    await asyncio.gather(pipe(client_reader, replica_writer), pipe(replica_reader, client_writer))

async def main():
    server = await asyncio.start_server(relay, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()

uvloop.run(main())  # the router's event loop too
PY
}
if [ "${CONTROL:-}" = relay ]; then
  start_relay 8302
  CONTROL_PID=$!
fi
if [ "${VIA:-router}" = relay ]; then
  start_relay 8300
elif [ "${VIA:-router}" = lean ] || [ "${VIA:-router}" = lean-asgi ]; then
  $(pin "${ROUTER_CPUS:-}") $PY/python benchmarks/lean_proxy.py 8300 8301 $([ "$VIA" = lean-asgi ] && echo --asgi) \
    > "$OUT/lean.log" 2>&1 &
else
$(pin "${ROUTER_CPUS:-}") $PY/tokenmill router --port 8300 --policy "$POLICY" --backend http://127.0.0.1:8301 \
  --kv-events-endpoint tcp://127.0.0.1:5641 --kv-events-replay-endpoint tcp://127.0.0.1:5642 > "$OUT/router.log" 2>&1 &
fi
ROUTER=$!
until curl -sf http://127.0.0.1:8300/health > /dev/null; do sleep 0.5; done
if [ -n "${CONTROL_PID:-}" ]; then until curl -sf http://127.0.0.1:8302/health > /dev/null; do sleep 0.5; done; fi

$(pin "${CLIENT_CPUS:-}") nice -n "${CLIENT_NICE:-0}" $PY/python - "$OUT" "$CONCURRENCY" "$REQUESTS" <<'PY'
import asyncio, json, os, random, sys, time
import aiohttp, httpx
from prometheus_client.parser import text_string_to_metric_families
out, concurrency, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ROUTER, DIRECT = "http://127.0.0.1:8300", "http://127.0.0.1:8301"  # ROUTER: the router, or a control (VIA)
via = os.environ.get("VIA", "router")
# every path a request is sent on at once: the one measured (VIA), direct, and with CONTROL=relay a bare relay too
paths = {f"via_{via}": ROUTER, "direct": DIRECT}
if os.environ.get("CONTROL") == "relay":
    paths["via_control_relay"] = "http://127.0.0.1:8302"
compared = [name for name in paths if name != "direct"]
lo, _, hi = os.environ.get("OUTPUT_TOKENS", "1").partition("-")
output_tokens, stream = (int(lo), int(hi or lo)), os.environ.get("STREAM", "0") == "1"
rng = random.Random(0)
latency = {name: [] for name in paths}
ttft = {name: [] for name in paths}
pair_difference = {name: [] for name in compared}  # that path minus direct, per request sent both ways
ttft_pair_difference = {name: [] for name in compared}

async def one(http, base, body):
    """(latency, TTFT) in ms; TTFT only when streamed."""
    t = time.perf_counter()
    async with http.post(base + "/v1/completions", json=body) as r:
        if not stream:
            text = await r.read()
            assert r.status == 200, text
            return (time.perf_counter() - t) * 1e3, None
        assert r.status == 200, await r.read()
        first = None
        async for chunk in r.content.iter_any():
            if first is None and b'"text"' in chunk:
                first = time.perf_counter()
    return (time.perf_counter() - t) * 1e3, (first - t) * 1e3

async def client(http, i):
    # Each of C/k clients (k paths) sends the same request on every path at the same moment (which goes first
    # rotates), so that all copies meet the same engine queue and step: the differences are the hops'. C
    # requests are in flight (with CONTROL=relay, k = 3: the nearest multiple of 3 below C).
    names = list(paths)
    for n in range(requests):
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there, how", "temperature": 0,
                "max_tokens": rng.randint(*output_tokens), "ignore_eos": True, "stream": stream}
        k = (i + n) % len(names)
        order = names[k:] + names[:k]
        results = dict(zip(order, await asyncio.gather(*(one(http, paths[name], body) for name in order))))
        for name, (ms, first_ms) in results.items():
            latency[name].append(ms)
            if first_ms is not None:
                ttft[name].append(first_ms)
        for name in compared:
            pair_difference[name].append(results[name][0] - results["direct"][0])
            if stream:
                ttft_pair_difference[name].append(results[name][1] - results["direct"][1])

def router_metrics():
    if via != "router":  # the relay and the lean proxy have no metrics of their own
        return {}
    values = {}
    for family in text_string_to_metric_families(httpx.get(ROUTER + "/metrics").text):
        for s in family.samples:
            values.setdefault(s.name, []).append(s)
    return values

async def main():
    # aiohttp, not httpx: the clients share the 2 cores with the replica, and aiohttp spends a fraction of httpx's
    # CPU per request (less of the replica's queue is the load generator's)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(client(http, i) for i in range(concurrency // len(paths))))  # a warm-up round
        for v in (*latency.values(), *ttft.values(), *pair_difference.values(), *ttft_pair_difference.values()):
            v.clear()
        before = router_metrics()
        t = time.perf_counter()
        await asyncio.gather(*(client(http, i) for i in range(concurrency // len(paths))))
        return time.perf_counter() - t, before, router_metrics()

elapsed, before, after = asyncio.run(main())

def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]

def value(metrics, name, **labels):
    return sum(s.value for s in metrics.get(name, []) if all(s.labels.get(k) == x for k, x in labels.items()))

res = {"concurrency": concurrency // len(paths) * len(paths), "requests_per_path": len(latency["direct"]),
       "duration_s": round(elapsed, 2), "output_tokens": output_tokens, "stream": stream, "via": via,
       "pinning": {k: os.environ.get(k) for k in ("THREADS", "REPLICA_CPUS", "ROUTER_CPUS", "CLIENT_CPUS", "CLIENT_NICE")},
       "control": os.environ.get("CONTROL")}
def quantiles(v):
    return {"p50_ms": round(pct(v, 0.5), 2), "p99_ms": round(pct(v, 0.99), 2)}
def pair_summary(v):
    # the share of copies more than 5 ms later or earlier than their direct twin: a copy answered in another engine
    # step than its twin, or later in its step's serial answers
    return {**quantiles(v), "mean_ms": round(sum(v) / len(v), 2),
            "share_later_by_5ms": round(sum(x > 5 for x in v) / len(v), 3),
            "share_earlier_by_5ms": round(sum(x < -5 for x in v) / len(v), 3)}
def summary(by_path, differences):
    """Each path's p50/p99 and, for each hop, its added p50/p99 against direct and its per-pair differences."""
    out = {name: quantiles(v) for name, v in by_path.items()}
    for name in compared:
        hop = name.removeprefix("via_")
        out[f"{hop}_added_ms"] = {q: round(out[name][q] - out["direct"][q], 2) for q in ("p50_ms", "p99_ms")}
        out["pair_difference_ms" if hop == via else f"{hop}_pair_difference_ms"] = pair_summary(differences[name])
    return out
res.update(summary(latency, pair_difference))
if stream:
    res["ttft"] = summary(ttft, ttft_pair_difference)
def router_view(before, after):
    """The router's own view: arrival to forwarding, from its histogram (bucket bounds), and its CPU per request."""
    count = value(after, "tokenmill_router:overhead_seconds_count") - value(before, "tokenmill_router:overhead_seconds_count")
    buckets = sorted({float(s.labels["le"]) for s in after["tokenmill_router:overhead_seconds_bucket"]})
    def bound(q):
        for le in buckets:
            n = value(after, "tokenmill_router:overhead_seconds_bucket", le=str(le)) - \
                value(before, "tokenmill_router:overhead_seconds_bucket", le=str(le))
            if count and n >= q * count:
                return le * 1e3
    overhead_sum = value(after, "tokenmill_router:overhead_seconds_sum") - value(before, "tokenmill_router:overhead_seconds_sum")
    finished = value(after, "tokenmill_router:finished_requests_total") - value(before, "tokenmill_router:finished_requests_total")
    cpu = value(after, "tokenmill_router:cpu_seconds") - value(before, "tokenmill_router:cpu_seconds")
    return {"router_overhead_histogram": {"p50_ms_at_most": bound(0.5), "p99_ms_at_most": bound(0.99),
                                          "mean_ms": round(1e3 * overhead_sum / max(count, 1), 3)},
            "router_cpu_ms_per_request": round(1e3 * cpu / max(finished, 1), 3)}

if via == "router":
    res.update(router_view(before, after))
print(json.dumps(res, indent=2))
json.dump(res, open(f"{out}/overhead.json", "w"), indent=2)
PY
