#!/usr/bin/env bash
# Cache-aware routing: 3 replicas behind `tokenmill router --policy kv`, the same behind --policy round_robin, and
# one replica alone, each under `tokenmill bench serve --dataset prefix` and `--dataset multiturn`. Every setup
# starts from fresh replicas (cold caches, same seed). Prints and writes, per dataset and setup: the fleet's
# prefix-cache hit rate (from the replicas' vllm:prefix_cache_hits/queries), TTFT p50/p95, requests/s, and the
# share of requests each replica took (from the router's tokenmill_router:requests_total), and the share of
# requests whose predicted cached tokens equal the usage's cached_tokens (tokenmill_router:cache_predictions_total).
#
# Usage: benchmarks/router_cache_aware.sh [OUT]   (default benchmarks/runs/router-cache-aware)
# Knobs (env): THREADS per replica (1), NUM_PROMPTS (96), CONCURRENCY (8), PREFIX_GROUPS (32), PREFIX_LEN (512),
#   INPUT_LEN (64), OUTPUT_LEN (32), SESSIONS (24), TURNS (4), KV_MEMORY (1GiB), DTYPE (auto), MAX_MODEL_LEN (4096),
#   DATASETS ("prefix multiturn"), SETUPS ("kv round_robin single"), ROUTER_ARGS (more `tokenmill router` flags).
# The prefix dataset interleaves its groups (request i is of group i mod G): with G a multiple of the 3 replicas,
# round-robin sends every request of a group to the same replica, by arithmetic; 32 groups of 3 requests do not.
# A tiny check: NUM_PROMPTS=6 SESSIONS=2 TURNS=2 PREFIX_GROUPS=2 PREFIX_LEN=64 INPUT_LEN=16 OUTPUT_LEN=4 CONCURRENCY=2 \
#   DTYPE=float32 KV_MEMORY=128MiB MAX_MODEL_LEN=1024 SETUPS="kv single" benchmarks/router_cache_aware.sh /tmp/rca
set -euo pipefail
OUT=${1:-benchmarks/runs/router-cache-aware}
PY=${PY:-.venv/bin}
THREADS=${THREADS:-1}; NUM_PROMPTS=${NUM_PROMPTS:-96}; CONCURRENCY=${CONCURRENCY:-8}
PREFIX_GROUPS=${PREFIX_GROUPS:-32}; PREFIX_LEN=${PREFIX_LEN:-512}; INPUT_LEN=${INPUT_LEN:-64}; OUTPUT_LEN=${OUTPUT_LEN:-32}
SESSIONS=${SESSIONS:-24}; TURNS=${TURNS:-4}; KV_MEMORY=${KV_MEMORY:-1GiB}; DTYPE=${DTYPE:-auto}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; ROUTER_ARGS=${ROUTER_ARGS:-}
DATASETS=${DATASETS:-prefix multiturn}; SETUPS=${SETUPS:-kv round_robin single}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start_replicas() {  # $1: how many
  PIDS=()
  for i in $(seq 1 "$1"); do
    OMP_NUM_THREADS=$THREADS TOKENMILL_NO_PROGRESS=1 $PY/tokenmill serve --port 820$i --dtype "$DTYPE" \
      --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory "$KV_MEMORY" --disable-log-stats \
      --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:562'$i'", "replay_endpoint": "tcp://*:563'$i'", "topic": "kv@replica-'$i'"}' \
      > "$OUT/replica-$i.log" 2>&1 &
    PIDS+=($!)
  done
  for i in $(seq 1 "$1"); do
    until curl -sf http://127.0.0.1:820$i/health/ready > /dev/null; do
      kill -0 "${PIDS[$((i - 1))]}" 2>/dev/null || { echo "replica $i exited:"; tail -5 "$OUT/replica-$i.log"; exit 1; }
      sleep 1
    done
  done
}

start_router() {  # $1: policy
  $PY/tokenmill router --port 8200 --policy "$1" $ROUTER_ARGS \
    --backend http://127.0.0.1:8201 http://127.0.0.1:8202 http://127.0.0.1:8203 \
    --kv-events-endpoint tcp://127.0.0.1:5621 tcp://127.0.0.1:5622 tcp://127.0.0.1:5623 \
    --kv-events-replay-endpoint tcp://127.0.0.1:5631 tcp://127.0.0.1:5632 tcp://127.0.0.1:5633 \
    > "$OUT/router-$1.log" 2>&1 &
  PIDS+=($!)
  until curl -sf http://127.0.0.1:8200/health > /dev/null; do sleep 0.5; done
}

for dataset in $DATASETS; do
  if [ "$dataset" = prefix ]; then
    DATA_ARGS=(--dataset prefix --prefix-groups "$PREFIX_GROUPS" --prefix-len "$PREFIX_LEN" --input-len "$INPUT_LEN"
               --num-prompts "$NUM_PROMPTS")
  else
    DATA_ARGS=(--dataset multiturn --turns "$TURNS" --input-len "$INPUT_LEN" --num-prompts "$SESSIONS")
  fi
  for setup in $SETUPS; do
    run="$OUT/$dataset-$setup"
    mkdir -p "$run"
    if [ "$setup" = single ]; then
      start_replicas 1; URL=http://127.0.0.1:8201; REPLICAS="http://127.0.0.1:8201"
    else
      start_replicas 3; start_router "$setup"; URL=http://127.0.0.1:8200
      REPLICAS="http://127.0.0.1:8201 http://127.0.0.1:8202 http://127.0.0.1:8203"
    fi
    $PY/tokenmill bench serve --base-url "$URL" "${DATA_ARGS[@]}" --output-len "$OUTPUT_LEN" --ignore-eos \
      --concurrency "$CONCURRENCY" --warmup 0 --seed 12 --output-dir "$run" > "$run/bench.txt" 2>&1
    for r in $REPLICAS; do curl -s "$r/metrics" > "$run/metrics-${r##*:}.txt"; done
    [ "$setup" != single ] && curl -s http://127.0.0.1:8200/metrics > "$run/router-metrics.txt"
    cleanup
  done
done

$PY/python - "$OUT" "$DATASETS" "$SETUPS" <<'PY'
import glob, json, os, sys
from prometheus_client.parser import text_string_to_metric_families
out, datasets, setups = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()

def samples(path):
    with open(path) as f:
        for family in text_string_to_metric_families(f.read()):
            yield from family.samples

summary = {}
for dataset in datasets:
    for setup in setups:
        run = f"{out}/{dataset}-{setup}"
        hits = queries = 0.0
        for path in glob.glob(f"{run}/metrics-*.txt"):
            for s in samples(path):
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
        share, predictions = {}, {}
        if os.path.exists(f"{run}/router-metrics.txt"):
            for s in samples(f"{run}/router-metrics.txt"):
                if s.name == "tokenmill_router:requests_total":
                    share[s.labels["replica"]] = share.get(s.labels["replica"], 0) + s.value
                elif s.name == "tokenmill_router:cache_predictions_total":
                    predictions[s.labels["outcome"]] = s.value
        total = sum(share.values()) or 1
        result = json.load(open(f"{run}/results.json"))["results"][0]
        summary[f"{dataset}/{setup}"] = row = {
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "ttft_p50_ms": round(result["ttft_ms"]["p50"], 1), "ttft_p95_ms": round(result["ttft_ms"]["p95"], 1),
            "requests_per_s": round(result["requests_per_s"], 3), "errors": result["errors"],
            "request_share": {k: round(v / total, 3) for k, v in sorted(share.items())},
            "cache_predictions": predictions,
            "exact_prediction_share": round(predictions.get("exact", 0) / sum(predictions.values()), 4)
            if predictions else None}
        print(f"{dataset:9s} {setup:11s} hit rate {row['prefix_cache_hit_rate']}  TTFT p50 {row['ttft_p50_ms']} ms "
              f"p95 {row['ttft_p95_ms']} ms  {row['requests_per_s']} req/s  errors {row['errors']}  "
              f"share {row['request_share']}  exact predictions {row['exact_prediction_share']}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
PY
