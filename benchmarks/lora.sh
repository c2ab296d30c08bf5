#!/usr/bin/env bash
# Multi-LoRA throughput (issue 14), in one run on one server: the default model with 4 adapters (random, made with
# peft, ranks 8-16 over different modules: benchmarks/make_lora_adapters.py) in 4 slots, then at c=8 (random
# prompts, ISL 256 / OSL 128):
#   - base: every request asks for the base model (its steps take the fused CPU kernels, as without --enable-lora)
#   - lora: every request asks for one of the 4 adapters, drawn at random (bench serve --lora-modules)
# and prints the output tok/s of both and their ratio.
# Usage: benchmarks/lora.sh [OUT_DIR]       (NUM_PROMPTS=32 CONCURRENCY=8 PORT=8040 to change)
set -euo pipefail
OUT=${1:-benchmarks/runs/lora}
PORT=${PORT:-8040}
PY=${PY:-.venv/bin}
NUM_PROMPTS=${NUM_PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-8}
URL="http://127.0.0.1:$PORT"
ADAPTERS=$(mktemp -d /tmp/tokenmill-lora-XXXXXX)
mkdir -p "$OUT"
mapfile -t MODULES < <($PY/python benchmarks/make_lora_adapters.py "$ADAPTERS")
NAMES=("${MODULES[@]%%=*}")
$PY/tokenmill serve --port "$PORT" --max-model-len 2048 --uvicorn-log-level warning \
    --enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules "${MODULES[@]}" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$ADAPTERS"' EXIT
until curl -sf "$URL/health/ready" > /dev/null; do
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
common=(--base-url "$URL" --dataset random --input-len 256 --output-len 128 --ignore-eos
        --concurrency "$CONCURRENCY" --num-prompts "$NUM_PROMPTS" --warmup 4 --seed 7)
$PY/tokenmill bench serve "${common[@]}" --output-dir "$OUT/base"
$PY/tokenmill bench serve "${common[@]}" --lora-modules "${NAMES[@]}" --output-dir "$OUT/lora"
curl -s "$URL/metrics" | grep -E '^(vllm:lora_requests_info|tokenmill:lora_requests_total)' > "$OUT/lora-metrics.txt" || true
kill $SERVER; wait $SERVER 2>/dev/null || true
$PY/python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
level = {run: json.loads((out / run / "results.json").read_text())["results"][0] for run in ("base", "lora")}
for run, lv in level.items():
    print(f"{run:5s} c={lv['concurrency']}: {lv['output_tok_per_s']:7.1f} out tok/s, {lv['completed']}/"
          f"{lv['num_requests']} ok, TTFT p50 {lv['ttft_ms']['p50']:.0f} ms, ITL p50 {lv['itl_ms']['p50']:.0f} ms")
ratio = level["lora"]["output_tok_per_s"] / level["base"]["output_tok_per_s"]
print(f"4 adapters mixed / base model: {ratio:.2f}x output tok/s")
PY
