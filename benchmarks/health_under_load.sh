#!/usr/bin/env bash
# /health and /metrics latency while the server runs c=64 streams (ISL 256 / OSL 128): the engine computes on
# every core, and the API server must still answer probes quickly.  Usage: benchmarks/health_under_load.sh [OUT]
set -euo pipefail
OUT=${1:-benchmarks/runs/health-under-load}
PY=${PY:-.venv/bin}
mkdir -p "$OUT"
$PY/tokenmill serve --dtype bfloat16 --max-model-len 2048 --port 8030 --disable-log-stats > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:8030/health/ready > /dev/null; do sleep 1; done
$PY/tokenmill bench serve --base-url http://127.0.0.1:8030 --dataset random --input-len 256 --output-len 128 \
  --concurrency 64 --requests-per-stream 1 --warmup 0 --ignore-eos --seed 64 --output-dir "$OUT/load" > "$OUT/load.txt" 2>&1 &
LOAD=$!
$PY/python - "$OUT" "$LOAD" <<'PY'
import json, os, sys, time, httpx
out, load = sys.argv[1], int(sys.argv[2])
lat = {"/health": [], "/metrics": []}
time.sleep(3)  # let the 64 streams start
with httpx.Client(base_url="http://127.0.0.1:8030", timeout=10) as c:
    while os.path.exists(f"/proc/{load}"):
        for path in lat:
            t = time.perf_counter(); r = c.get(path); lat[path].append((time.perf_counter() - t) * 1e3)
            assert r.status_code == 200, (path, r.status_code)
        time.sleep(0.25)
res = {}
for path, v in lat.items():
    v.sort()
    res[path] = {"n": len(v), "p50_ms": round(v[len(v) // 2], 1), "p99_ms": round(v[int(len(v) * 0.99)], 1),
                 "max_ms": round(v[-1], 1)}
    print(f"{path}: {res[path]}")
json.dump(res, open(f"{out}/probes.json", "w"), indent=2)
PY
wait $LOAD
grep -o "\[.*c=64\] [0-9].*" "$OUT/load.txt" || true
