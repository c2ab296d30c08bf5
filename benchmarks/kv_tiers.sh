#!/usr/bin/env bash
# KV tiers beyond the pool, under `tokenmill bench serve --dataset multiturn`: conversations arrive at a fixed rate
# and think between turns, so many are open at once and their KV outgrows the pool. Four setups, each from fresh
# replicas and empty tiers, the same sessions (same seed):
#   single-off    one replica, a pool of KV_MEMORY (a fraction of the conversations' working set)
#   single-disk   the same with --kv-offloading-size/--kv-offloading-backend disk (a fresh directory)
#   pair-off      two replicas (THREADS threads each) behind `tokenmill router --policy round_robin`
#   pair-valkey   the same, both replicas sharing one redis-server through --kv-transfer-config (ValkeyConnector)
# Prints and writes (summary.json), per setup: the TTFT p50/p95 of turns >= 2 (those that may find their
# conversation's KV), behind the router split by whether the turn ran where its previous turn ran or on the other
# replica, the prompt tokens by source (vllm:prompt_tokens_by_source over the replicas) and the errors.
#
# Usage: benchmarks/kv_tiers.sh [OUT]   (default benchmarks/runs/kv-tiers)
# Knobs (env): SESSIONS (32), TURNS (6), INPUT_LEN (200), OUTPUT_LEN (40), RATE (sessions/s, 0.5), THINK (8 s),
#   KV_MEMORY (256MiB), OFFLOAD_GIB (4), DTYPE (bfloat16), THREADS (1 per replica in pairs; 2 single), MAX_MODEL_LEN (2048),
#   SETUPS ("single-off single-disk pair-off pair-valkey").
# A tiny check: SESSIONS=2 TURNS=2 INPUT_LEN=16 OUTPUT_LEN=4 RATE=4 THINK=0 DTYPE=float32 KV_MEMORY=128MiB \
#   benchmarks/kv_tiers.sh /tmp/kvt
set -euo pipefail
OUT=${1:-benchmarks/runs/kv-tiers}
PY=${PY:-.venv/bin}
SESSIONS=${SESSIONS:-32}; TURNS=${TURNS:-6}; INPUT_LEN=${INPUT_LEN:-200}; OUTPUT_LEN=${OUTPUT_LEN:-40}
RATE=${RATE:-0.5}; THINK=${THINK:-8}; KV_MEMORY=${KV_MEMORY:-256MiB}; OFFLOAD_GIB=${OFFLOAD_GIB:-4}
DTYPE=${DTYPE:-bfloat16}; THREADS=${THREADS:-1}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
SETUPS=${SETUPS:-single-off single-disk pair-off pair-valkey}
REDIS=$(command -v valkey-server || command -v redis-server)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
git rev-parse HEAD > "$OUT/commit.txt"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap cleanup EXIT

start_replica() {  # $1: index, $2: threads, rest: flags
  local i=$1 threads=$2; shift 2
  OMP_NUM_THREADS=$threads TOKENMILL_NO_PROGRESS=1 $PY/tokenmill serve --port 830$i --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_MEMORY" --disable-log-stats "$@" > "$OUT/$setup-replica-$i.log" 2>&1 &
  PIDS+=($!)
  until curl -sf http://127.0.0.1:830$i/health > /dev/null; do
    kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "replica $i exited:"; tail -5 "$OUT/$setup-replica-$i.log"; exit 1; }
    sleep 1
  done
}

for setup in $SETUPS; do
  run="$OUT/$setup"
  mkdir -p "$run"
  case $setup in
    single-off) start_replica 1 2; URL=http://127.0.0.1:8301; REPLICAS=1 ;;
    single-disk)
      rm -rf "$run/tier"
      start_replica 1 2 --kv-offloading-size "$OFFLOAD_GIB" --kv-offloading-backend disk --kv-offloading-dir "$run/tier"
      URL=http://127.0.0.1:8301; REPLICAS=1 ;;
    pair-off|pair-valkey)
      shared=()
      if [ "$setup" = pair-valkey ]; then
        "$REDIS" --port 8399 --bind 127.0.0.1 --save "" --appendonly no --maxmemory 4gb \
          --maxmemory-policy allkeys-lru > "$run/redis.log" 2>&1 &
        PIDS+=($!)
        shared=(--kv-transfer-config '{"kv_connector": "ValkeyConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"url": "redis://127.0.0.1:8399"}}')
      fi
      start_replica 1 "$THREADS" "${shared[@]}"; start_replica 2 "$THREADS" "${shared[@]}"
      $PY/tokenmill router --port 8300 --policy round_robin \
        --backend http://127.0.0.1:8301 http://127.0.0.1:8302 > "$run/router.log" 2>&1 &
      PIDS+=($!)
      until curl -sf http://127.0.0.1:8300/health > /dev/null; do sleep 0.5; done
      URL=http://127.0.0.1:8300; REPLICAS=2 ;;
  esac
  $PY/tokenmill bench serve --base-url "$URL" --dataset multiturn --num-prompts "$SESSIONS" --turns "$TURNS" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --think-time "$THINK" --request-rate "$RATE" \
    --arrival constant --max-concurrency 256 --warmup 0 --seed 21 --output-dir "$run" > "$run/bench.txt" 2>&1
  for i in $(seq 1 $REPLICAS); do curl -s "http://127.0.0.1:830$i/metrics" > "$run/metrics-$i.txt"; done
  cleanup
done

$PY/python - "$OUT" "$SETUPS" <<'PY'
import json, glob, sys
from prometheus_client.parser import text_string_to_metric_families
out, setups = sys.argv[1], sys.argv[2].split()
summary = {}
for setup in setups:
    run = f"{out}/{setup}"
    sources = {}
    for path in glob.glob(f"{run}/metrics-*.txt"):
        for family in text_string_to_metric_families(open(path).read()):
            for s in family.samples:
                if s.name == "vllm:prompt_tokens_by_source_total":
                    sources[s.labels["source"]] = sources.get(s.labels["source"], 0) + int(s.value)
    level = json.load(open(f"{run}/results.json"))["results"][0]
    row = {"errors": level["errors"], "completed": level["completed"], "prompt_tokens_by_source": sources}
    for key in ("ttft_later_turns_ms", "ttft_same_replica_ms", "ttft_other_replica_ms", "ttft_ms", "itl_ms"):
        if key in level:
            row[key] = {p: round(level[key][p], 1) for p in ("p50", "p95")}
    summary[setup] = row
    print(setup, json.dumps(row))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
