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
# VIA=lean, VIA=lean-asgi: a second control, benchmarks/lean_proxy.py: the routing work (tokens, block keys, the
# index) and a pooled upstream connection, with none of the router's other work; lean-asgi serves it under
# uvicorn as an ASGI app, as the router is served.
#
# Usage: benchmarks/router_overhead.sh [OUT]   (default benchmarks/results/router/overhead)
# Knobs (env): CONCURRENCY (64), REQUESTS: pairs per client (40), THREADS for the replica (2), POLICY (kv), DTYPE (auto);
# OUTPUT_TOKENS (1, or a range LO-HI), STREAM (0);
# REPLICA_CPUS, ROUTER_CPUS, CLIENT_CPUS: taskset CPU lists (unset: no pinning), e.g. the replica on one core
# (THREADS=1 REPLICA_CPUS=0) and the router and clients on the other, as a router does not share a replica's cores
# in a deployment.
# A tiny check: CONCURRENCY=4 REQUESTS=3 benchmarks/router_overhead.sh /tmp/ro
set -euo pipefail
OUT=${1:-benchmarks/results/router/overhead}
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
trap 'kill $REPLICA ${ROUTER:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8301/health/ready > /dev/null; do sleep 1; done
if [ "${VIA:-router}" = relay ]; then
  $(pin "${ROUTER_CPUS:-}") $PY/python - > "$OUT/relay.log" 2>&1 <<'PY' &
import asyncio, uvloop

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
    server = await asyncio.start_server(relay, "127.0.0.1", 8300)
    await server.serve_forever()

uvloop.run(main())  # the router's event loop too
PY
elif [ "${VIA:-router}" = lean ] || [ "${VIA:-router}" = lean-asgi ]; then
  $(pin "${ROUTER_CPUS:-}") $PY/python benchmarks/lean_proxy.py 8300 8301 $([ "$VIA" = lean-asgi ] && echo --asgi) \
    > "$OUT/lean.log" 2>&1 &
else
$(pin "${ROUTER_CPUS:-}") $PY/tokenmill router --port 8300 --policy "$POLICY" --backend http://127.0.0.1:8301 \
  --kv-events-endpoint tcp://127.0.0.1:5641 --kv-events-replay-endpoint tcp://127.0.0.1:5642 > "$OUT/router.log" 2>&1 &
fi
ROUTER=$!
until curl -sf http://127.0.0.1:8300/health > /dev/null; do sleep 0.5; done

$(pin "${CLIENT_CPUS:-}") $PY/python - "$OUT" "$CONCURRENCY" "$REQUESTS" <<'PY'
import asyncio, json, os, random, sys, time
import aiohttp, httpx
from prometheus_client.parser import text_string_to_metric_families
out, concurrency, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ROUTER, DIRECT = "http://127.0.0.1:8300", "http://127.0.0.1:8301"  # ROUTER: the router, or a control (VIA)
via = os.environ.get("VIA", "router")
lo, _, hi = os.environ.get("OUTPUT_TOKENS", "1").partition("-")
output_tokens, stream = (int(lo), int(hi or lo)), os.environ.get("STREAM", "0") == "1"
rng = random.Random(0)
latency = {ROUTER: [], DIRECT: []}
ttft = {ROUTER: [], DIRECT: []}
pair_difference = []  # via the router minus direct, per pair
ttft_pair_difference = []

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
    # Each of C/2 clients sends a pair at a time: the same request via the router and directly, at the same
    # moment (which goes first alternates), so that both meet the same engine queue and step: the difference is
    # the router's. C requests are in flight.
    for n in range(requests):
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there, how", "temperature": 0,
                "max_tokens": rng.randint(*output_tokens), "ignore_eos": True, "stream": stream}
        order = [ROUTER, DIRECT] if (i + n) % 2 else [DIRECT, ROUTER]
        results = dict(zip(order, await asyncio.gather(*(one(http, base, body) for base in order))))
        for base, (ms, first_ms) in results.items():
            latency[base].append(ms)
            if first_ms is not None:
                ttft[base].append(first_ms)
        pair_difference.append(results[ROUTER][0] - results[DIRECT][0])
        if stream:
            ttft_pair_difference.append(results[ROUTER][1] - results[DIRECT][1])

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
        await asyncio.gather(*(client(http, i) for i in range(concurrency // 2)))  # a warm-up round
        for v in (*latency.values(), *ttft.values(), pair_difference, ttft_pair_difference):
            v.clear()
        before = router_metrics()
        t = time.perf_counter()
        await asyncio.gather(*(client(http, i) for i in range(concurrency // 2)))
        return time.perf_counter() - t, before, router_metrics()

elapsed, before, after = asyncio.run(main())

def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]

def value(metrics, name, **labels):
    return sum(s.value for s in metrics.get(name, []) if all(s.labels.get(k) == x for k, x in labels.items()))

res = {"concurrency": concurrency, "requests_per_path": len(latency[ROUTER]), "duration_s": round(elapsed, 2),
       "output_tokens": output_tokens, "stream": stream, "via": via,
       "pinning": {k: os.environ.get(k) for k in ("THREADS", "REPLICA_CPUS", "ROUTER_CPUS", "CLIENT_CPUS")}}
for name, base in ((f"via_{via}", ROUTER), ("direct", DIRECT)):
    res[name] = {"p50_ms": round(pct(latency[base], 0.5), 2), "p99_ms": round(pct(latency[base], 0.99), 2)}
res[f"{via}_added_ms"] = {q: round(res[f"via_{via}"][q] - res["direct"][q], 2) for q in ("p50_ms", "p99_ms")}
def pair_summary(v):
    return {"p50_ms": round(pct(v, 0.5), 2), "p99_ms": round(pct(v, 0.99), 2), "mean_ms": round(sum(v) / len(v), 2)}
res["pair_difference_ms"] = pair_summary(pair_difference)
if stream:
    res["ttft"] = {name: {"p50_ms": round(pct(ttft[base], 0.5), 2), "p99_ms": round(pct(ttft[base], 0.99), 2)}
                   for name, base in ((f"via_{via}", ROUTER), ("direct", DIRECT))}
    res["ttft"][f"{via}_added_ms"] = {q: round(res["ttft"][f"via_{via}"][q] - res["ttft"]["direct"][q], 2)
                                      for q in ("p50_ms", "p99_ms")}
    res["ttft"]["pair_difference_ms"] = pair_summary(ttft_pair_difference)
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
