#!/usr/bin/env bash
# The same guidellm command against `tandem serve` and llama.cpp's `llama-server` on the same
# GGUF file (the default model's), 2 threads each: /v1/completions streamed, synthetic prompts of
# 256 tokens and 128 output tokens, at concurrency 1, 16 and 64, the two servers alternating at
# each level. llama-server gets 64 slots (-np 64, 512 tokens each in one unified KV pool), so
# that it batches every stream, as Tandem's scheduler does. Prints a Markdown table
# (docs/benchmarks.md). Needs .venv-clients (make clients) and llama-server. LEVELS holds
# concurrency:requests pairs.
#
#   LLAMA_SERVER=~/.cache/peers/llama.cpp/bin/llama-server scripts/guidellm_vs_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/serve_lib.sh
LLAMA_SERVER=${LLAMA_SERVER:-llama-server}
test -x .venv-clients/bin/guidellm || { echo "no .venv-clients: run make clients" >&2; exit 1; }
OUT=${OUT:-$(mktemp -d)}  # the reports and logs stay there
MODEL_DIR=$(.venv/bin/python -c \
    'from tandem.models.loader.model_files import resolve_model; print(resolve_model("smollm2-135m"))')
GGUF=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"])' \
    "$MODEL_DIR/gguf.json")

start_server 8771 "$OUT/tandem.log" .venv/bin/tandem serve --model smollm2-135m --port 8771 \
    --log-level warning
TANDEM=$SERVER_PID
trap 'stop_server $TANDEM' EXIT
start_server 8772 "$OUT/llama.log" "$LLAMA_SERVER" -m "$GGUF" --port 8772 --host 127.0.0.1 \
    -t 2 -tb 2 -np 64 -c 32768 --kv-unified --alias smollm2-135m
LLAMA=$SERVER_PID
trap 'stop_server $TANDEM; stop_server $LLAMA' EXIT

run() {  # NAME PORT STREAMS REQUESTS
    HF_HUB_OFFLINE=1 .venv-clients/bin/guidellm run --disable-console-interactive \
        --backend "kind=openai_http,target=http://127.0.0.1:$2,model=smollm2-135m,$(
        )request_format=/v1/completions" \
        --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 \
        --tokenizer "kind=hf_auto,model=$MODEL_DIR" --profile "kind=concurrent,streams=$3" \
        --constraint "kind=max_requests,count=$4" --output "kind=json,path=$OUT/$1-$3.json" \
        > "$OUT/run.log" 2>&1 || { tail -20 "$OUT/run.log"; exit 1; }
}
for level in ${LEVELS:-1:4 16:32 64:64}; do
    run tandem 8771 "${level%:*}" "${level#*:}"
    run llama-server 8772 "${level%:*}" "${level#*:}"
done
.venv/bin/python scripts/guidellm_table.py "$OUT"/*.json
echo "guidellm reports and server logs: $OUT"
