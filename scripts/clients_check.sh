#!/usr/bin/env bash
# guidellm (the vLLM project's load tester) against a live `tandem serve` of the default model:
# /v1/completions streamed at concurrency 1, 16 and 64, then chat, each with 0 errors. guidellm
# lives in a virtualenv of its own (.venv-clients; its pins are not the project's).
#
#   scripts/clients_check.sh          (make clients)      about 4 minutes on two cores
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-clients
PORT=${CLIENTS_PORT:-8765}
OUT=$(mktemp -d)
MODEL_DIR=$(.venv/bin/python -c \
    'from tandem.models.loader.model_files import resolve_model; print(resolve_model("smollm2-135m"))')

test -x $VENV/bin/guidellm || { .venv/bin/uv venv -q -p 3.11 $VENV && \
    .venv/bin/uv pip install -q --python $VENV/bin/python guidellm==0.8.1; }

.venv/bin/tandem serve --model smollm2-135m --port "$PORT" --log-level warning \
    > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true; rm -rf "$OUT"' EXIT
healthy() { curl -sf "localhost:$PORT/health" > /dev/null; }
for _ in $(seq 120); do  # until it is healthy or has died
    healthy || ! kill -0 $SERVER 2>/dev/null && break
    sleep 1
done
healthy || { echo "tandem serve is dead or not healthy after 120 s; its log ends:" >&2
    tail -30 "$OUT/serve.log" >&2; exit 1; }

BACKEND="kind=openai_http,target=http://127.0.0.1:$PORT,model=smollm2-135m"
run() {  # FORMAT STREAMS REQUESTS
    HF_HUB_OFFLINE=1 $VENV/bin/guidellm run --disable-console-interactive \
        --backend "$BACKEND,request_format=$1" \
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=16 \
        --tokenizer "kind=hf_auto,model=$MODEL_DIR" --profile "kind=concurrent,streams=$2" \
        --constraint "kind=max_requests,count=$3" --output "kind=json,path=$OUT/run.json" \
        > "$OUT/run.log" 2>&1 || { tail -20 "$OUT/run.log"; exit 1; }
    .venv/bin/python - "$OUT/run.json" "$1 at $2" <<'EOF'
import json, sys
totals = json.load(open(sys.argv[1]))["benchmarks"][0]["metrics"]["request_totals"]
print(f"guidellm {sys.argv[2]}: {totals}")
sys.exit(totals["errored"] or totals["incomplete"] or not totals["successful"])
EOF
}
run /v1/completions 1 2
run /v1/completions 16 16
run /v1/completions 64 64
run /v1/chat/completions 4 4
