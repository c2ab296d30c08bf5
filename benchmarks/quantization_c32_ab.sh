#!/usr/bin/env bash
# c=32 throughput, bf16 dense (--quantization none) against the Q4_1 GGUF kept quantized (--quantization auto), one
# server at a time, alternating for three rounds so that the ratio of each round is taken under the same conditions
# (this machine varies by several percent from run to run). Usage: benchmarks/quantization_c32_ab.sh [OUT_DIR]
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/quantization/c32-tiled}
mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
PORT=8051; URL="http://127.0.0.1:$PORT"
for round in 1 2 3; do
for name in bf16 q4_1; do
  flags="--dtype bfloat16 --quantization none"; [ $name = q4_1 ] && flags="--dtype bfloat16 --quantization auto"
  .venv/bin/tokenmill serve --port $PORT --max-model-len 2048 --kv-cache-memory 1GiB --uvicorn-log-level warning $flags > "$OUT/$name.log" 2>&1 &
  SERVER=$!
  until curl -sf "$URL/health" > /dev/null; do sleep 1; done
  .venv/bin/tokenmill bench serve --base-url "$URL" --dataset random --input-len 256 --output-len 128 --ignore-eos \
      --concurrency 32 --num-prompts 128 --warmup 4 --seed 7 --output-dir "$OUT/$name-$round" 2>&1 | grep -E "ok," | sed "s/.*\[tokenmill/$name round $round [tokenmill/"
  kill $SERVER; wait $SERVER 2>/dev/null
done
done
find "$OUT" -name "*.png" -delete
