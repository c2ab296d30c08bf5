#!/usr/bin/env bash
# TPOT with and without a JSON schema at concurrency 8 (issue #6): one server, the same random prompts, two rounds
# alternating free and constrained. The schema's string cannot close within 128 tokens, so every request decodes
# the full OSL under the grammar.  Usage: benchmarks/structured_output_overhead.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-benchmarks/runs/structured-output-overhead}
PORT=${PORT:-8020}
PY=${PY:-.venv/bin}
SCHEMA='{"guided_json": {"type": "object", "properties": {"story": {"type": "string", "minLength": 1000}}, "required": ["story"]}}'
$PY/tokenmill serve --port "$PORT" --max-model-len 2048 --uvicorn-log-level warning > "/tmp/so-overhead-$PORT.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health/ready" > /dev/null; do sleep 1; done
common=(--base-url "http://127.0.0.1:$PORT" --dataset random --input-len 256 --output-len 128 --concurrency 8
        --requests-per-stream 2 --warmup 2 --ignore-eos --seed 7 --precision fp32)
for round in 1 2; do
  $PY/tokenmill bench serve "${common[@]}" --output-dir "$OUT/free-$round"
  $PY/tokenmill bench serve "${common[@]}" --extra-body "$SCHEMA" --output-dir "$OUT/json-$round"
done
$PY/python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {}
for d in sorted(out.iterdir()):
    level = json.loads((d / "results.json").read_text())["results"][0]
    rows[d.name] = level
    print(f"{d.name:8s} TPOT p50 {level['tpot_ms']['p50']:7.1f} ms  ITL p50 {level['itl_ms']['p50']:7.1f} ms  "
          f"out tok/s {level['output_tok_per_s']:6.1f}")
for kind in ("free", "json"):
    vals = [rows[f"{kind}-{r}"]["tpot_ms"]["p50"] for r in (1, 2)]
    rows[kind] = sum(vals) / len(vals)
print(f"TPOT p50 mean: free {rows['free']:.1f} ms, json {rows['json']:.1f} ms, "
      f"overhead {100 * (rows['json'] / rows['free'] - 1):+.1f}%")
PY
echo "engine-side grammar mask time per step (stats lines while constrained requests ran):"
grep -o "Grammar mask time: [0-9.]* ms/step" "/tmp/so-overhead-$PORT.log" | sort | uniq -c
