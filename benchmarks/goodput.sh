#!/usr/bin/env bash
# Goodput under Poisson arrivals (issue 41's first line), side by side in one run on this machine: tokenmill dense
# (--quantization none: the same weights vLLM serves), the same with the step bound off (--max-step-latency-ms 0:
# a fixed token budget per step, as vLLM schedules), tokenmill with its defaults (the GGUF's quantized weights
# kept), tokenmill --quantization w8a8, and vLLM-CPU, all up at once, the same requests from one client. Rates in
# steps of 0.5 req/s up to 6, then 7 and 8, each level stopping past the knee; one request in 8 a long prompt
# (~1,500 tokens in, 32 out), the rest ~240 in / 128 out; a request is good within TTFT 2 s and TPOT 60 ms, and
# the goodput is the highest rate where >= 90% are. The machine's flags go into the results. Run it on a quiet
# machine.
#   benchmarks/goodput.sh [DTYPE] [OUT_DIR]     (vLLM from ../shared/peers; NO_VLLM=1 leaves it out;
#                                                 PROMPTS: requests per level, default 64; RATES)
set -euo pipefail
NAME=goodput
source "$(dirname "$0")/side_by_side.sh" "$@"
$PY/tokenmill serve "${COMMON[@]}" --port 8000 --quantization none > "$OUT/dense-server.log" 2>&1 & PIDS+=($!)
$PY/tokenmill serve "${COMMON[@]}" --port 8003 --quantization none --max-step-latency-ms 0 \
  > "$OUT/dense-fixed-server.log" 2>&1 & PIDS+=($!)
$PY/tokenmill serve "${COMMON[@]}" --port 8001 > "$OUT/default-server.log" 2>&1 & PIDS+=($!)
$PY/tokenmill serve "${COMMON[@]}" --port 8002 --quantization w8a8 > "$OUT/w8a8-server.log" 2>&1 & PIDS+=($!)
TARGETS=(tokenmill-dense=http://127.0.0.1:8000 tokenmill-dense-fixed=http://127.0.0.1:8003
         tokenmill-default=http://127.0.0.1:8001
         tokenmill-w8a8=http://127.0.0.1:8002)
if [ -z "${NO_VLLM:-}" ]; then
  nohup "$PEERS/serve_vllm.sh" --dtype "$DTYPE" > "$OUT/vllm-server.log" 2>&1 & PIDS+=($!)
  TARGETS+=(vllm-cpu=http://127.0.0.1:8100)
fi
for port in 8000 8001 8002 8003; do until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 2; done; done
[ -n "${NO_VLLM:-}" ] || until curl -sf http://127.0.0.1:8100/v1/models > /dev/null; do sleep 2; done
$PY/tokenmill bench serve --compare "${TARGETS[@]}" \
  --dataset random --input-len 240 --output-len 128 --long-prompt-share 0.125 --long-input-len 1500 \
  --long-output-len 32 --request-rate "${RATES:-0.5:6:0.5,7,8}" --arrival poisson --num-prompts "${PROMPTS:-64}" \
  --goodput ttft:2000 tpot:60 --warmup 4 --ignore-eos --precision "$PREC" --seed "${SEED:-1206}" \
  --output-dir "$OUT" 2>&1 | tee "$OUT/bench.txt"
