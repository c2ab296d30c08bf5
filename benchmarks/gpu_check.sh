#!/usr/bin/env bash
# The CUDA path's proof on one GPU (issue 42), in one run of under 8 minutes on a fresh machine without network:
#   1. the wheels of `make gpu-wheels` (.whl/, carried with the tree) installed with --no-index, before anything;
#   2. the CUDA tests (pytest -m cuda): the Triton kernels at real shapes, CUDA graph capture, the one transfer;
#   3. a checkpoint of SmolLM2-135M's shape (benchmarks/gpu_check.py says why random weights), unless MODEL is set;
#   4. greedy equality with HF transformers on the same GPU, bf16, tie-aware, on the test suite's prompts;
#   5. `tokenmill bench throughput --hf-baseline` at batch 1, 64 and 256 (HF generate in static batches of the same
#      size, same GPU, same dtype);
#   6. decode step time against its memory bound at batch 1, 64, 256, and CUDA graphs on vs off at batch 1 (ITL);
#   7. a closed-loop `tokenmill bench serve` sweep (concurrency 1 and 64) against a launched server.
# Every figure goes to one JSON ($OUT/gpu_check.json when OUT is set, as the device tool returns $OUT; else the
# path given, or benchmarks/results/gpu_check/<date>/gpu_check.json), with a short table beside it (.txt).
#
# Usage: benchmarks/gpu_check.sh [--dry-run] [OUT_JSON]
#   --dry-run (or DRY_RUN=1): every step on this CPU at toy sizes (the wheels listed, not installed), so the GPU
#   run meets no error of ours before its first CUDA call. PYTHON=... picks the interpreter (default python3).
# On a lent GPU machine: `make gpu-wheels` here first, then run `benchmarks/gpu_check.sh` there with `.whl` carried
# (the device tool's carry), timeout ~560 s; the JSON, the table and the log come back under $OUT.
set -u -o pipefail

DRY_RUN=${DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%d-%H%M)
if [ -n "${OUT:-}" ]; then JSON=$OUT/gpu_check.json; else JSON=${1:-benchmarks/results/gpu_check/$STAMP/gpu_check.json}; fi
mkdir -p "$(dirname "$JSON")"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$(dirname "$JSON")/gpu_check.log
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
FAILED=()
step() { echo; echo "=== [$(( $(date +%s) - START )) s] $*"; }
run() {  # run NAME CMD...: a failing step is recorded and the run goes on, so one failure costs no other figure
    local name=$1; shift
    "$@" || { echo "!!! $name failed ($?)"; FAILED+=("$name"); }
}

if [ "$DRY_RUN" = 1 ]; then
    DEVICE=cpu; BATCHES="1 4"; IN=16; OUT_LEN=8; DECODE="--batches 1,4 --prompt-len 32 --steps 3"
    EQ="--num-prompts 2 --max-tokens 4"; LAYERS="--num-layers 2"; PER_STREAM=2; CONC=1,4; KV=256MiB
else
    DEVICE=cuda; BATCHES="1 64 256"; IN=128; OUT_LEN=256; DECODE="--batches 1,64,256 --prompt-len 512 --steps 50"
    EQ="--num-prompts 8 --max-tokens 24"; LAYERS=""; PER_STREAM=4; CONC=1,64; KV=16GiB
fi

step "1. wheels"
ls .whl/*.whl .whl/smollm2-135m/config.json || { echo "no .whl/: run make gpu-wheels first"; exit 2; }
if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: not installed (this venv has the packages)"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$ROOT
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
export TOKENMILL_NO_PROGRESS=1 PYTHONUNBUFFERED=1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

step "2. CUDA tests (pytest -m cuda)"
run cuda_tests $PY -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_triton_attention.py tests/test_cuda_graph.py \
    tests/test_gpu_ready.py

step "3. model"
if [ -n "${MODEL:-}" ]; then
    echo "MODEL=$MODEL"
else
    MODEL=$WORK/smollm2-135m-random
    $PY benchmarks/gpu_check.py make-weights .whl/smollm2-135m "$MODEL" $LAYERS || exit 3
fi

step "4. greedy equality with HF transformers (bfloat16, tie-aware)"
if [ "$DRY_RUN" = 1 ]; then  # the triton backend in the real model, its kernels under Triton's interpreter
    run hf_equality env TRITON_INTERPRET=1 $PY benchmarks/gpu_check.py hf-equality --model "$MODEL" --device cpu \
        --dtype bfloat16 --attention-backend triton $EQ --out "$WORK/hf_equality.json"
else
    run hf_equality $PY benchmarks/gpu_check.py hf-equality --model "$MODEL" --device cuda --dtype bfloat16 $EQ \
        --out "$WORK/hf_equality.json"
fi

step "5. bench throughput vs HF generate"
PARTS=("$WORK/hf_equality.json")
for B in $BATCHES; do
    run "throughput_b$B" $PY -m tokenmill.cli bench throughput --model "$MODEL" --device $DEVICE --dtype bfloat16 \
        --num-prompts "$B" --max-num-seqs "$B" --input-len $IN --output-len $OUT_LEN --temperature 0 \
        --max-model-len 2048 --kv-cache-memory $KV --hf-baseline --hf-batch-size "$B" \
        --output-json "$WORK/throughput_b$(printf %03d "$B").json"
    PARTS+=("$WORK/throughput_b$(printf %03d "$B").json")
done

step "6. decode step time vs memory bound; CUDA graphs on vs off at batch 1"
run decode $PY benchmarks/gpu_check.py decode --model "$MODEL" --device $DEVICE --dtype bfloat16 $DECODE \
    --out "$WORK/decode.json"
PARTS+=("$WORK/decode.json")

step "7. closed-loop serve sweep"
run serve $PY -m tokenmill.cli bench serve --launch --base-url http://127.0.0.1:8123 --tokenizer "$MODEL" \
    --concurrency $CONC --requests-per-stream $PER_STREAM --input-len $IN --output-len $OUT_LEN --ignore-eos --warmup 4 \
    --precision bf16 --output-dir "$WORK/serve_report" \
    "$MODEL" --device $DEVICE --dtype bfloat16 --max-model-len 2048 --kv-cache-memory $KV --max-num-seqs 256
cp "$WORK/serve_report/results.json" "$WORK/serve.json" 2>/dev/null
PARTS+=("$WORK/serve.json")

step "report"
$PY benchmarks/gpu_check.py report --out "$JSON" $([ "$DRY_RUN" = 1 ] && echo --dry-run) "${PARTS[@]}"
echo "failed steps: ${FAILED[*]:-none}; $(( $(date +%s) - START )) s; wrote $JSON"
[ ${#FAILED[@]} -eq 0 ]
