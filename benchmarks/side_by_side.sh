# Sourced by the scripts that run tokenmill servers beside vLLM-CPU in one run (stall_free.sh, goodput.sh,
# compare_vllm_cpu.sh), after they set NAME: the arguments [DTYPE] [OUT_DIR], the output directory with the
# machine's lscpu and the commit, and the servers' PIDs, killed on exit. Sets DTYPE, PREC, OUT, PEERS, PY, PIDS
# and COMMON (the tokenmill serve flags every server shares).
DTYPE=${1:-bfloat16}
PREC=$([ "$DTYPE" = float32 ] && echo fp32 || echo bf16)
OUT=${2:-benchmarks/runs/$NAME-$PREC}
PEERS=${PEERS:-../shared/peers}
PY=${PY:-.venv/bin}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
git rev-parse HEAD > "$OUT/commit.txt"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
COMMON=(--dtype "$DTYPE" --max-model-len 2048 --disable-log-stats)
