#!/usr/bin/env bash
# Disaggregated prefill/decode against colocated replicas on the same two cores (issue 37's speed line):
#   colocated   two replicas, one core each (taskset -c 0 / -c 1, OMP_NUM_THREADS=1), behind
#               `tokenmill router --policy round_robin`
#   pd          a prefill instance on core 0 (TCPConnector, kv_producer) and a decode instance on core 1
#               (kv_consumer), behind `tokenmill router --prefill URL --decode URL`
# The same workload, side by side in one run, from fresh processes: chat requests (ISL CHAT_ISL, OSL CHAT_OSL) at a
# steady CHAT_RATE, and at the same time long-prompt requests (ISL LONG_ISL, OSL LONG_OSL) arriving as a Poisson
# process at LONG_RATE: two `tokenmill bench serve` runs against the router at once. Prints and writes
# (summary.json), per setup: the chat requests' ITL p50/p99 and TTFT p50/p99, the long requests' ITL and TTFT
# p50/p99, and for pd the transfer cost (ms per 1,000 transferred tokens, from the decode instance's
# tokenmill:kv_transfer_fetch_seconds_sum and tokenmill:kv_transfer_tokens_fetched), the blocks fetched and the
# router's requests per stage.
# Issue 37 asks for pd's chat ITL p99 <= 0.5x colocated's at the same rates.
#
# Usage: benchmarks/pd_disagg.sh [OUT]   (default benchmarks/runs/pd-disagg)
# Knobs (env): CHAT_N (64), CHAT_ISL (200), CHAT_OSL (256), CHAT_RATE (req/s, 0.5), LONG_N (8), LONG_ISL (2000),
#   LONG_OSL (64), LONG_RATE (req/s, 0.0625), DTYPE (bfloat16), KV_MEMORY (1GiB), MAX_MODEL_LEN (4096),
#   SETUPS ("colocated pd"; also colocated-fixed: colocated with --max-step-latency-ms 0), BASE_PORT (8400: the router; the instances BASE_PORT+1, +2; the KV port +91),
#   PY (the directory of the python and tokenmill to run, .venv/bin).
# A tiny check: CHAT_N=2 CHAT_ISL=32 CHAT_OSL=4 CHAT_RATE=4 LONG_N=1 LONG_ISL=64 LONG_OSL=4 LONG_RATE=4 \
#   DTYPE=float32 KV_MEMORY=128MiB MAX_MODEL_LEN=512 benchmarks/pd_disagg.sh /tmp/pd
set -euo pipefail
OUT=${1:-benchmarks/runs/pd-disagg}
PY=${PY:-.venv/bin}
CHAT_N=${CHAT_N:-64}; CHAT_ISL=${CHAT_ISL:-200}; CHAT_OSL=${CHAT_OSL:-256}; CHAT_RATE=${CHAT_RATE:-0.5}
LONG_N=${LONG_N:-8}; LONG_ISL=${LONG_ISL:-2000}; LONG_OSL=${LONG_OSL:-64}; LONG_RATE=${LONG_RATE:-0.0625}
DTYPE=${DTYPE:-bfloat16}; KV_MEMORY=${KV_MEMORY:-1GiB}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
SETUPS=${SETUPS:-colocated pd}; BASE_PORT=${BASE_PORT:-8400}
ROUTER=http://127.0.0.1:$BASE_PORT
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
grep -m1 flags /proc/cpuinfo > "$OUT/cpu-flags.txt" || true
git rev-parse HEAD > "$OUT/commit.txt"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap cleanup EXIT

wait_health() {  # $1: url, $2: pid, $3: log
  until curl -sf "$1/health" > /dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "$3 exited:"; tail -5 "$3"; exit 1; }
    sleep 1
  done
}

instance() { echo "http://127.0.0.1:$((BASE_PORT + $1))"; }

start_instance() {  # $1: index (port BASE_PORT + $1), $2: core, rest: flags
  local i=$1 core=$2; shift 2
  OMP_NUM_THREADS=1 TOKENMILL_NO_PROGRESS=1 taskset -c "$core" $PY/tokenmill serve --port $((BASE_PORT + i)) \
    --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_MEMORY" --disable-log-stats "$@" \
    > "$run/instance-$i.log" 2>&1 &
  PIDS+=($!)
  wait_health "$(instance "$i")" "${PIDS[-1]}" "$run/instance-$i.log"
}

for setup in $SETUPS; do
  run="$OUT/$setup"
  mkdir -p "$run"
  case $setup in
    colocated)
      start_instance 1 0; start_instance 2 1
      router=(--policy round_robin --backend "$(instance 1)" "$(instance 2)") ;;
    colocated-fixed)  # the same with the step bound off: a fixed token budget per step, as vLLM schedules
      start_instance 1 0 --max-step-latency-ms 0; start_instance 2 1 --max-step-latency-ms 0
      router=(--policy round_robin --backend "$(instance 1)" "$(instance 2)") ;;
    pd)
      start_instance 1 0 --kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_producer", "kv_port": '"$((BASE_PORT + 91))"'}'
      start_instance 2 1 --kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}'
      router=(--prefill "$(instance 1)" --decode "$(instance 2)") ;;
  esac
  # the router shares the cores, as an API server does
  $PY/tokenmill router --port "$BASE_PORT" "${router[@]}" > "$run/router.log" 2>&1 &
  PIDS+=($!)
  wait_health "$ROUTER" "${PIDS[-1]}" "$run/router.log"
  mkdir -p "$run/chat" "$run/long"
  $PY/tokenmill bench serve --base-url "$ROUTER" --dataset random --num-prompts "$CHAT_N" \
    --input-len "$CHAT_ISL" --output-len "$CHAT_OSL" --ignore-eos --request-rate "$CHAT_RATE" --arrival constant \
    --max-concurrency 256 --warmup 0 --seed 37 --output-dir "$run/chat" > "$run/chat/bench.txt" 2>&1 &
  chat=$!
  $PY/tokenmill bench serve --base-url "$ROUTER" --dataset random --num-prompts "$LONG_N" \
    --input-len "$LONG_ISL" --output-len "$LONG_OSL" --ignore-eos --request-rate "$LONG_RATE" --arrival poisson \
    --max-concurrency 256 --warmup 0 --seed 38 --output-dir "$run/long" > "$run/long/bench.txt" 2>&1 &
  long=$!
  wait "$chat" "$long"
  for i in 1 2; do curl -s "$(instance "$i")/metrics" > "$run/metrics-$i.txt"; done
  curl -s "$ROUTER/metrics" > "$run/metrics-router.txt" || true
  cleanup
done

$PY/python - "$OUT" "$SETUPS" <<'PY'
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out, setups = sys.argv[1], sys.argv[2].split()


def samples(path):
    values = {}
    for family in text_string_to_metric_families(open(path).read()):
        for s in family.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            values[key] = values.get(key, 0) + s.value
    return values


def pct(level, key):
    return {p: round(level[key][p], 1) for p in ("p50", "p99") if p in level.get(key, {})}


summary = {}
for setup in setups:
    run = f"{out}/{setup}"
    chat = json.load(open(f"{run}/chat/results.json"))["results"][0]
    long = json.load(open(f"{run}/long/results.json"))["results"][0]
    row = {"chat_itl_ms": pct(chat, "itl_ms"), "chat_ttft_ms": pct(chat, "ttft_ms"),
           "long_itl_ms": pct(long, "itl_ms"), "long_ttft_ms": pct(long, "ttft_ms"),
           "errors": chat["errors"] + long["errors"], "completed": chat["completed"] + long["completed"]}
    if setup == "pd":
        decode = samples(f"{run}/metrics-2.txt")
        seconds = decode.get(("tokenmill:kv_transfer_fetch_seconds_sum", ()), 0.0)
        tokens = decode.get(("tokenmill:kv_transfer_tokens_fetched_total", ()), 0.0)
        row["transfer_ms_per_1k_tokens"] = round(1e6 * seconds / tokens, 2) if tokens else None
        row["transfer_phase_ms_per_1k_tokens"] = {  # where it goes: queued, network, checks, write
            dict(k[1])["phase"]: round(1e6 * v / tokens, 2) for k, v in decode.items()
            if k[0] == "tokenmill:kv_transfer_fetch_phase_seconds_total" and tokens}
        row["blocks_fetched"] = decode.get(("tokenmill:kv_transfer_blocks_total", (("kind", "fetched"),)), 0)
        row["blocks_skipped"] = decode.get(("tokenmill:kv_transfer_blocks_total", (("kind", "skipped"),)), 0)
        row["fetch_failures"] = {dict(k[1])["reason"]: v for k, v in decode.items()
                                 if k[0] == "tokenmill:kv_transfer_fetch_failures_total"}
        router = samples(f"{run}/metrics-router.txt")  # the router's placement: requests per stage
        row["router_pd_requests"] = {dict(k[1])["stage"]: v for k, v in router.items()
                                     if k[0] == "tokenmill_router:pd_requests_total"}
    summary[setup] = row
    print(setup, json.dumps(row))
for base in ("colocated", "colocated-fixed"):
    if {"pd", base} <= set(summary):
        pd, co = summary["pd"]["chat_itl_ms"].get("p99"), summary[base]["chat_itl_ms"].get("p99")
        if pd and co:
            key = "itl_p99_ratio" if base == "colocated" else "itl_p99_ratio_fixed"
            summary[key] = round(pd / co, 3)
            print(f"chat ITL p99, pd / {base}:", summary[key], "(issue 37 asks <= 0.5)")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
