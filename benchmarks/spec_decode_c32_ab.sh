#!/usr/bin/env bash
# Speculation on vs off at c=32 on --dataset random (issue 13's >= 0.97x line), alternating one server per mode for
# ROUNDS rounds, so that each round's ratios are taken under the same conditions (this machine varies by several
# percent from run to run; one run per mode cannot decide a 3% line). Prints each round's output tok/s and ratio.
# Usage: benchmarks/spec_decode_c32_ab.sh [OUT_DIR]     (MODES="off ngram suffix" ROUNDS=3 to change)
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/spec-decode/c32-alternating}
MODES=${MODES:-off ngram suffix}; ROUNDS=${ROUNDS:-3}
PORT=8032; URL="http://127.0.0.1:$PORT"
declare -A CONFIG=([ngram]='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
                   [suffix]='{"method": "suffix"}')
mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    args=(--port "$PORT" --max-model-len 2048 --uvicorn-log-level warning)
    [ "$mode" != off ] && args+=(--speculative-config "${CONFIG[$mode]}")
    .venv/bin/tokenmill serve "${args[@]}" > "$OUT/$mode.log" 2>&1 &
    SERVER=$!
    until curl -sf "$URL/health" > /dev/null; do sleep 1; done
    .venv/bin/tokenmill bench serve --base-url "$URL" --dataset random --input-len 256 --output-len 128 --ignore-eos \
        --concurrency 32 --num-prompts 128 --warmup 4 --seed 7 --output-dir "$OUT/$mode-$round" > /dev/null 2>&1
    curl -s "$URL/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' \
        > "$OUT/$mode-$round/spec-metrics.txt" || true
    kill $SERVER; wait $SERVER 2>/dev/null
  done
done
find "$OUT" -name "*.png" -delete
.venv/bin/python - "$OUT" "$ROUNDS" $MODES <<'PY'
import json, pathlib, statistics, sys
out, rounds, modes = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
tput = {m: [json.loads((out / f"{m}-{r}" / "results.json").read_text())["results"][0]["output_tok_per_s"]
            for r in range(1, rounds + 1)] for m in modes}
for m in modes:
    ratios = [t / o for t, o in zip(tput[m], tput["off"])]
    print(f"{m:7s} out tok/s {', '.join(f'{t:.1f}' for t in tput[m])}   / off: {', '.join(f'{x:.3f}' for x in ratios)}"
          f"   median {statistics.median(ratios):.3f}")
PY
