#!/usr/bin/env bash
# GuideLLM vs tokenmill bench serve on the same tokenmill server, same ISL/OSL, concurrency 4 and 16.
set -u
cd /work/main
OUT=/tmp/tm_s2/xcheck
PORT=8011
TOKENMILL_NO_PROGRESS=1 .venv/bin/tokenmill serve --port $PORT --max-model-len 2048 --kv-cache-memory 2GiB \
   --uvicorn-log-level warning --disable-log-stats > $OUT/server.log 2>&1 &
SERVER=$!
until curl -sf localhost:$PORT/health/ready >/dev/null; do sleep 1; done
echo "server ready"
for C in 4 16; do
  N=$((C==4 ? 16 : 48))
  GUIDELLM__MAX_WORKER_PROCESSES=1 HF_HUB_OFFLINE=1 /tmp/guidellm-venv/bin/guidellm run \
    --backend kind=openai_http,target=http://127.0.0.1:$PORT,model=SmolLM2-135M-Instruct,request_format=/v1/completions \
    --profile kind=concurrent,streams=$C --constraint kind=max_requests,count=$N \
    --tokenizer kind=huggingface_auto,model=/tmp/smollm2-tokenizer \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 --data-loader kind=pytorch,samples=$N \
    --output kind=json,path=$OUT/guidellm-c$C.json > $OUT/guidellm-c$C.log 2>&1
  echo "guidellm c=$C rc=$?"
  .venv/bin/tokenmill bench serve --base-url http://127.0.0.1:$PORT --dataset random --input-len 256 \
    --output-len 128 --num-prompts $N --concurrency $C --warmup 0 --ignore-eos --seed $((500+C)) \
    --slo ttft_p99_ms=2000,itl_p50_ms=100 --output-dir $OUT/tokenmill-c$C > $OUT/tokenmill-c$C.log 2>&1
  echo "tokenmill bench c=$C rc=$?"
done
kill $SERVER; wait $SERVER
