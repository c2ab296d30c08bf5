#!/usr/bin/env bash
# Weight formats and KV-cache dtypes side by side, in one run on this machine (issue 15): for each, the weights'
# bytes and the KV capacity (from the start-up log), the engine's RSS, single-stream ITL (c=1) and throughput at
# c=32; and llama.cpp on the same Q4_1 file at c=1 (it serves one request at a time). Run it on a quiet machine.
#   benchmarks/compare_quantization.sh [OUT_DIR]       (llama.cpp from ../shared/peers; skipped if not set up)
set -euo pipefail
OUT=${1:-benchmarks/runs/quantization}
PEERS=${PEERS:-../shared/peers}
PY=${PY:-.venv/bin}
KV=${KV:-1GiB}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

# name port flags...
SERVERS=(
  "bf16 8000 --dtype bfloat16 --quantization none"
  "q4_1 8001 --dtype bfloat16 --quantization auto"
  "q4_1-fp8kv 8002 --dtype bfloat16 --quantization auto --kv-cache-dtype fp8_e4m3"
  "int8 8003 --dtype bfloat16 --quantization int8"
  "int4 8004 --dtype bfloat16 --quantization int4"
)
for s in "${SERVERS[@]}"; do
  read -r name port flags <<< "$s"
  # one at a time: parallel start-ups on two cores only slow each other down
  $PY/tokenmill serve --port "$port" --max-model-len 2048 --kv-cache-memory "$KV" $flags > "$OUT/$name.log" 2>&1 &
  PIDS+=($!)
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
done
LLAMACPP=""
if [ -x /tmp/tokenmill-peers/llamacpp/bin/python ]; then
  nohup "$PEERS/serve_llamacpp.sh" > "$OUT/llamacpp.log" 2>&1 &
  PIDS+=($!)
  until curl -sf http://127.0.0.1:8101/v1/models > /dev/null; do sleep 1; done
  LLAMACPP=yes
fi

TARGETS=()
for s in "${SERVERS[@]}"; do read -r name port _ <<< "$s"; TARGETS+=("$name=http://127.0.0.1:$port"); done
COMMON=(--dataset random --input-len 256 --output-len 128 --ignore-eos --warmup 2 --seed "${SEED:-1201}"
        --precision bf16 --slo ttft_p99_ms=2000,itl_p50_ms=100)
$PY/tokenmill bench serve --compare "${TARGETS[@]}" "${COMMON[@]}" --concurrency 1 --requests-per-stream 8 \
  --output-dir "$OUT/c1" 2>&1 | tee "$OUT/c1.txt"
$PY/tokenmill bench serve --compare "${TARGETS[@]}" "${COMMON[@]}" --concurrency 32 --requests-per-stream 2 \
  --output-dir "$OUT/c32" 2>&1 | tee "$OUT/c32.txt"
if [ -n "$LLAMACPP" ]; then
  # llama.cpp has no ignore_eos: a bias against the tokens it ends on (0, 2, 4: ../shared/peers/README.md)
  # keeps every answer at full length
  $PY/tokenmill bench serve --compare llama.cpp=http://127.0.0.1:8101 tokenmill-q4_1=http://127.0.0.1:8001 \
    "${COMMON[@]}" --concurrency 1 --requests-per-stream 8 \
    --extra-body '{"logit_bias": {"0": -100, "2": -100, "4": -100}}' \
    --output-dir "$OUT/llamacpp-c1" 2>&1 | tee "$OUT/llamacpp-c1.txt"
fi

# memory: each engine's resident set after the runs, and what its start-up log says about weights and KV
{
  for s in "${SERVERS[@]}"; do
    read -r name port _ <<< "$s"
    echo "== $name"
    grep -E "weights \(--quantization|KV cache: dtype" "$OUT/$name.log" | sed 's/.*INFO[^:]*: //' || true
  done
  $PY/python - "${PIDS[@]}" <<'EOF'
import sys, psutil
for pid in sys.argv[1:]:
    try:
        p = psutil.Process(int(pid))
    except psutil.NoSuchProcess:
        continue
    for proc in [p, *p.children(recursive=True)]:
        print(f"pid {proc.pid} {' '.join(proc.cmdline()[1:4])[:70]}: RSS {proc.memory_info().rss / 2**20:.0f} MiB")
EOF
} | tee "$OUT/memory.txt"
