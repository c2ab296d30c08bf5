#!/usr/bin/env bash
# Throughput of server configurations side by side: one `tokenmill serve` at a time, each configuration in turn,
# for ROUNDS rounds, so that every round's ratios are taken under the same conditions (this machine varies by
# several percent from run to run: one run per configuration cannot decide a 3% line). The order rotates by one
# each round (round 2 starts with the second configuration, ...): this machine also drifts within a round, which
# a fixed order would charge to whichever configuration always runs last. Random prompts, ISL 256 / OSL 128,
# --ignore-eos, NUM_PROMPTS (128) prompts at c=CONCURRENCY (32). The first configuration is the reference: prints
# each one's output tok/s per round, its ratio to the reference and the median ratio. The vllm:spec_decode
# counters are kept too.
# Usage: benchmarks/alternating.sh OUT_DIR NAME='serve flags' [NAME='serve flags' ...]    (ROUNDS=3, CONCURRENCY=32, NUM_PROMPTS=128)
#   issue 15: benchmarks/alternating.sh benchmarks/runs/quantization-c32 \
#     bf16='--dtype bfloat16 --quantization none --kv-cache-memory 1GiB' \
#     q4_1='--dtype bfloat16 --quantization auto --kv-cache-memory 1GiB'
#   issue 13: benchmarks/alternating.sh benchmarks/runs/spec-decode-c32 off='' \
#     ngram='--speculative-config {"method":"ngram","num_speculative_tokens":5,"prompt_lookup_min":2,"prompt_lookup_max":5}' \
#     suffix='--speculative-config {"method":"suffix"}'
cd "$(dirname "$0")/.."
OUT=$1; shift
ROUNDS=${ROUNDS:-3}; CONCURRENCY=${CONCURRENCY:-32}; NUM_PROMPTS=${NUM_PROMPTS:-128}; PORT=${PORT:-8051}; URL="http://127.0.0.1:$PORT"
NAMES=("${@%%=*}"); FLAGS=("${@#*=}")
mkdir -p "$OUT"; lscpu > "$OUT/lscpu.txt"
for round in $(seq 1 "$ROUNDS"); do
  for j in "${!NAMES[@]}"; do
    i=$(( (j + round - 1) % ${#NAMES[@]} ))
    name=${NAMES[$i]}
    read -r -a flags <<< "${FLAGS[$i]}"
    .venv/bin/tokenmill serve --port "$PORT" --max-model-len 2048 --uvicorn-log-level warning "${flags[@]}" > "$OUT/$name.log" 2>&1 &
    SERVER=$!
    until curl -sf "$URL/health" > /dev/null; do sleep 1; done
    .venv/bin/tokenmill bench serve --base-url "$URL" --dataset random --input-len 256 --output-len 128 --ignore-eos \
        --concurrency "$CONCURRENCY" --num-prompts "$NUM_PROMPTS" --warmup 4 --seed 7 --output-dir "$OUT/$name-$round" > /dev/null 2>&1
    curl -s "$URL/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' \
        > "$OUT/$name-$round/spec-metrics.txt" || true
    kill $SERVER; wait $SERVER 2>/dev/null
  done
done
find "$OUT" -name "*.png" -delete
.venv/bin/python - "$OUT" "$ROUNDS" "${NAMES[@]}" <<'PY'
import json, pathlib, statistics, sys
out, rounds, names = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
tput = {n: [json.loads((out / f"{n}-{r}" / "results.json").read_text())["results"][0]["output_tok_per_s"]
            for r in range(1, rounds + 1)] for n in names}
for n in names:
    ratios = [t / ref for t, ref in zip(tput[n], tput[names[0]])]
    print(f"{n:8s} out tok/s {', '.join(f'{t:.1f}' for t in tput[n])}   / {names[0]}: "
          f"{', '.join(f'{x:.3f}' for x in ratios)}   median {statistics.median(ratios):.3f}")
PY
