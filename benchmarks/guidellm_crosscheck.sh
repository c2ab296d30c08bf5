#!/usr/bin/env bash
# GuideLLM vs tokenmill bench serve on the same tokenmill server, same ISL/OSL, concurrency 4 and 16
# (benchmarks/results/guidellm-crosscheck.md). GuideLLM lives in a side venv and reads a saved tokenizer: see the
# README's "Benchmarking with GuideLLM" for both (GUIDELLM and TOKENIZER below point at them).
# Usage: benchmarks/guidellm_crosscheck.sh [OUT_DIR]   (default benchmarks/runs/guidellm-crosscheck)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/runs/guidellm-crosscheck}
PORT=${PORT:-8011}
PY=${PY:-.venv/bin}
GUIDELLM=${GUIDELLM:-/tmp/guidellm-venv/bin/guidellm}
TOKENIZER=${TOKENIZER:-/tmp/smollm2-tokenizer}
mkdir -p "$OUT"
TOKENMILL_NO_PROGRESS=1 $PY/tokenmill serve --port $PORT --max-model-len 2048 --kv-cache-memory 2GiB \
   --uvicorn-log-level warning --disable-log-stats > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until curl -sf localhost:$PORT/health/ready >/dev/null; do sleep 1; done
echo "server ready"
for C in 4 16; do
  N=$((C==4 ? 16 : 48))
  GUIDELLM__MAX_WORKER_PROCESSES=1 HF_HUB_OFFLINE=1 "$GUIDELLM" run \
    --backend kind=openai_http,target=http://127.0.0.1:$PORT,model=SmolLM2-135M-Instruct,request_format=/v1/completions \
    --profile kind=concurrent,streams=$C --constraint kind=max_requests,count=$N \
    --tokenizer kind=huggingface_auto,model="$TOKENIZER" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 --data-loader kind=pytorch,samples=$N \
    --output kind=json,path="$OUT/guidellm-c$C.json" > "$OUT/guidellm-c$C.log" 2>&1
  echo "guidellm c=$C rc=$?"
  $PY/tokenmill bench serve --base-url http://127.0.0.1:$PORT --dataset random --input-len 256 \
    --output-len 128 --num-prompts $N --concurrency $C --warmup 0 --ignore-eos --seed $((500+C)) \
    --slo ttft_p99_ms=2000,itl_p50_ms=100 --output-dir "$OUT/tokenmill-c$C" > "$OUT/tokenmill-c$C.log" 2>&1
  echo "tokenmill bench c=$C rc=$?"
done
