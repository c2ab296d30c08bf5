#!/usr/bin/env bash
# Stall-free steps (--max-step-latency-ms), side by side in one run on this machine: tokenmill with its default
# step bound, tokenmill with the bound off (the fixed 512-token budget), and vLLM-CPU, all up at once, the same
# mixed workload from one client: closed loop at c=8, one request in 8 a long prompt (~1,500 tokens in, 32 out),
# the rest ~240 in / 128 out (issue 41's ITL line: ITL p99 <= 2.5x ITL p50). The machine's flags go into the
# results. Run it on a quiet machine.
#   benchmarks/stall_free.sh [DTYPE] [OUT_DIR]     (vLLM from ../shared/peers; NO_VLLM=1 leaves it out)
set -euo pipefail
NAME=stall-free
source "$(dirname "$0")/side_by_side.sh" "$@"
$PY/tokenmill serve "${COMMON[@]}" --port 8000 > "$OUT/bounded-server.log" 2>&1 & PIDS+=($!)
$PY/tokenmill serve "${COMMON[@]}" --port 8001 --max-step-latency-ms 0 > "$OUT/fixed-server.log" 2>&1 & PIDS+=($!)
TARGETS=(bounded=http://127.0.0.1:8000 fixed-512=http://127.0.0.1:8001)
if [ -z "${NO_VLLM:-}" ]; then
  nohup "$PEERS/serve_vllm.sh" --dtype "$DTYPE" > "$OUT/vllm-server.log" 2>&1 & PIDS+=($!)
  TARGETS+=(vllm-cpu=http://127.0.0.1:8100)
fi
until curl -sf http://127.0.0.1:8000/health > /dev/null && curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 2; done
[ -n "${NO_VLLM:-}" ] || until curl -sf http://127.0.0.1:8100/v1/models > /dev/null; do sleep 2; done
$PY/tokenmill bench serve --compare "${TARGETS[@]}" \
  --dataset random --input-len 240 --output-len 128 --long-prompt-share 0.125 --long-input-len 1500 \
  --long-output-len 32 --concurrency "${CONCURRENCY:-8}" --requests-per-stream "${PER_STREAM:-6}" \
  --warmup 4 --ignore-eos --precision "$PREC" --seed "${SEED:-1205}" \
  --output-dir "$OUT" 2>&1 | tee "$OUT/bench.txt"
