#!/usr/bin/env bash
# Speculative decoding (issue 13), side by side: for each mode (off, ngram, suffix, draft_model) one server, then
#   - the copy-heavy dataset (tokenmill/bench/data/copy_edit.json: repeat or lightly edit a text) at c=1: ITL is
#     per streamed chunk (vLLM's definition: a verified run arrives as one chunk), so compare TPOT;
#   - --dataset random (ISL 256 / OSL 128, nothing to copy) at c=1 and c=32: output tok/s, on vs off;
# and the server's vllm:spec_decode_* counters: mean acceptance length = 1 + accepted / drafts (per verification),
# on the copy dataset and on the random one.
# draft_model: the default model with layers dropped (benchmarks/make_draft_model.py, written to $DRAFT once;
# KEEP_EVERY=3 keeps layers 0, 3, ..., 27 and 29), 4 drafts.
# Usage: benchmarks/spec_decode.sh [OUT_DIR]      (MODES="off ngram suffix draft_model" to choose)
set -euo pipefail
OUT=${1:-benchmarks/runs/spec-decode}
PORT=${PORT:-8030}
PY=${PY:-.venv/bin}
MODES=${MODES:-off ngram suffix draft_model}
KEEP_EVERY=${KEEP_EVERY:-3}
DRAFT=${DRAFT:-/tmp/tokenmill-draft-keep-every-$KEEP_EVERY}
declare -A CONFIG=([ngram]='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
                   [suffix]='{"method": "suffix"}'
                   [draft_model]="{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": 4}")
if [[ " $MODES " == *" draft_model "* && ! -e "$DRAFT/config.json" ]]; then
  $PY/python benchmarks/make_draft_model.py "$DRAFT" --keep-every "$KEEP_EVERY"
fi
URL="http://127.0.0.1:$PORT"
for mode in $MODES; do
  args=(--port "$PORT" --max-model-len 2048 --uvicorn-log-level warning)
  [ "$mode" != off ] && args+=(--speculative-config "${CONFIG[$mode]}")
  $PY/tokenmill serve "${args[@]}" > "/tmp/spec-decode-$PORT.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  until curl -sf "$URL/health/ready" > /dev/null; do sleep 1; done
  mkdir -p "$OUT/$mode"
  $PY/tokenmill bench serve --base-url "$URL" --dataset copy --concurrency 1 --num-prompts 10 --warmup 2 \
      --seed 7 --output-dir "$OUT/$mode/copy-c1"
  curl -s "$URL/metrics" | grep '^vllm:spec_decode' > "$OUT/$mode/copy-metrics.txt" || true
  for c in 1 32; do
    n=$(( c == 1 ? 8 : 64 ))
    $PY/tokenmill bench serve --base-url "$URL" --dataset random --input-len 256 --output-len 128 --ignore-eos \
        --concurrency "$c" --num-prompts "$n" --warmup 2 --seed 7 --output-dir "$OUT/$mode/random-c$c"
  done
  curl -s "$URL/metrics" | grep '^vllm:spec_decode' > "$OUT/$mode/all-metrics.txt" || true
  kill $SERVER; wait $SERVER 2>/dev/null || true
done
$PY/python - "$OUT" $MODES <<'PY'
import json, pathlib, re, sys
out, modes = pathlib.Path(sys.argv[1]), sys.argv[2:]

def counters(path):
    values = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = re.match(r'(vllm:spec_decode_\w+?)_total\{[^}]*\} ([0-9.e+]+)', line)
            if m and "per_pos" not in m.group(1):
                values[m.group(1)] = float(m.group(2))
    return values

for mode in modes:
    for run in ("copy-c1", "random-c1", "random-c32"):
        level = json.loads((out / mode / run / "results.json").read_text())["results"][0]
        print(f"{mode:11s} {run:11s} TPOT p50 {level['tpot_ms']['p50']:7.1f} ms  ITL p50 {level['itl_ms']['p50']:7.1f} ms"
              f"  out tok/s {level['output_tok_per_s']:7.1f}")
    copy = counters(out / mode / "copy-metrics.txt")
    total = counters(out / mode / "all-metrics.txt")
    random = {k: v - copy.get(k, 0.0) for k, v in total.items()}  # the random runs: the counters' growth
    for dataset, values in (("copy", copy), ("random", random)):
        if values.get("vllm:spec_decode_num_drafts"):
            acc, drafts = values["vllm:spec_decode_num_accepted_tokens"], values["vllm:spec_decode_num_drafts"]
            tokens = values["vllm:spec_decode_num_draft_tokens"]
            print(f"{mode:11s} {dataset}: mean acceptance length {1 + acc / drafts:.2f}, draft acceptance rate "
                  f"{100 * acc / tokens:.1f}% ({int(drafts)} verifications, {int(tokens)} drafts)")
PY
