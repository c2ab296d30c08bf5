#!/usr/bin/env bash
# tokenmill against vLLM-CPU, side by side in one run on this machine (issue #11's protocol): both servers up,
# the same random prompts, ISL 256 / OSL 128, c=1,8,32,64, 2 requests per stream, SLO TTFT p99 < 2 s and
# ITL p50 < 100 ms. The machine's flags go into the results. Run it on a quiet machine.
#   benchmarks/compare_vllm_cpu.sh [DTYPE] [OUT_DIR]     (DTYPE bfloat16 or float32; vLLM from ../shared/peers;
#                                                        CONCURRENCY: levels, default 1,8,32,64;
#                                                        TOKENMILL_ARGS: more `tokenmill serve` flags, e.g.
#                                                        "--quantization none" for the dense model;
#                                                        VLLM_FIRST=1: vLLM runs each level first, to run the
#                                                        two orders where the host's speed drifts;
#                                                        ALSO="w8a8=--quantization w8a8;dense=--quantization none":
#                                                        more tokenmill servers up beside, one per NAME=FLAGS,
#                                                        compared in the same run)
set -euo pipefail
NAME=compare-vllm-cpu
source "$(dirname "$0")/side_by_side.sh" "$@"
nohup "$PEERS/serve_vllm.sh" --dtype "$DTYPE" > "$OUT/vllm-server.log" 2>&1 & PIDS+=($!)
# tokenmill (TOKENMILL_ARGS) on port 8000, then each of ALSO's NAME=FLAGS as tokenmill-NAME on the next ports
CONFIGS=("tokenmill=${TOKENMILL_ARGS:-}")
IFS=';' read -ra MORE <<< "${ALSO:-}"
for config in "${MORE[@]}"; do CONFIGS+=("tokenmill-$config"); done
TARGETS=()
PORT=8000
for config in "${CONFIGS[@]}"; do
  # shellcheck disable=SC2086 # the flags after NAME= are a list
  $PY/tokenmill serve "${COMMON[@]}" --port $PORT ${config#*=} > "$OUT/${config%%=*}-server.log" 2>&1 & PIDS+=($!)
  TARGETS+=("${config%%=*}=http://127.0.0.1:$PORT")
  PORT=$((PORT + 1))
done
for ((port = 8000; port < PORT; port++)); do
  until curl -sf "http://127.0.0.1:$port/health/ready" > /dev/null; do sleep 2; done
done
until curl -sf http://127.0.0.1:8100/v1/models > /dev/null; do sleep 2; done
if [ "${VLLM_FIRST:-0}" = 1 ]; then TARGETS=(vllm-cpu=http://127.0.0.1:8100 "${TARGETS[@]}")
else TARGETS+=(vllm-cpu=http://127.0.0.1:8100); fi
$PY/tokenmill bench serve --compare "${TARGETS[@]}" \
  --dataset random --input-len 256 --output-len 128 --concurrency "${CONCURRENCY:-1,8,32,64}" --requests-per-stream 2 \
  --warmup 4 --ignore-eos --precision "$PREC" --slo ttft_p99_ms=2000,itl_p50_ms=100 --seed "${SEED:-1130}" \
  --output-dir "$OUT" 2>&1 | tee "$OUT/bench.txt"
