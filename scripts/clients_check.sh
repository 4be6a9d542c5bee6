#!/usr/bin/env bash
# Real clients against a live `tandem serve` of the default model in fp32, each with 0 errors:
# guidellm (the vLLM project's load tester) streaming /v1/completions at concurrency 1, 16 and
# 64, then chat; lm-eval-harness's local-completions on a loglikelihood and a generate task
# (scripts/lm_eval_tasks, local jsonl, no hub), its loglikelihoods equal to Tandem's own
# teacher-forced ones within 1e-4 (scripts/lm_eval_compare.py). The clients live in a
# virtualenv of their own (.venv-clients; their pins are not the project's), on the project's
# CPU torch wheel rather than a CUDA one from the index.
#
#   TORCH=torch==X FIND_LINKS=DIRS scripts/clients_check.sh   (make clients)
# About 6 CPU-minutes, and a minute to build .venv-clients (1.5 GB) the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/serve_lib.sh
VENV=.venv-clients
PORT=${CLIENTS_PORT:-8765}
PINS="guidellm==0.8.1 lm-eval[api]==0.4.13 ${TORCH:?TORCH=torch==VERSION, as the Makefile pins}"
OUT=$(mktemp -d)
MODEL_DIR=$(.venv/bin/python -c \
    'from tandem.models.loader.model_files import resolve_model; print(resolve_model("smollm2-135m"))')
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "$(cat $VENV/.pins 2>/dev/null)" != "$PINS" ]; then
    rm -rf $VENV
    UV=(.venv/bin/uv pip install -q --python $VENV/bin/python)
    .venv/bin/uv venv -q -p 3.11 $VENV
    # torch first, from the wheel folder; the clients then find it satisfied
    LINKS=()
    for f in ${FIND_LINKS:-}; do LINKS+=(--find-links "$f"); done
    "${UV[@]}" "${LINKS[@]}" "$TORCH"
    "${UV[@]}" $PINS
    echo "$PINS" > $VENV/.pins
fi

start_server "$PORT" "$OUT/serve.log" .venv/bin/tandem serve --model smollm2-135m \
    --port "$PORT" --dtype float32 --log-level warning
trap 'stop_server $SERVER_PID; rm -rf "$OUT"' EXIT

BACKEND="kind=openai_http,target=http://127.0.0.1:$PORT,model=smollm2-135m"
guidellm() {  # FORMAT STREAMS REQUESTS
    $VENV/bin/guidellm run --disable-console-interactive \
        --backend "$BACKEND,request_format=$1" \
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=16 \
        --tokenizer "kind=hf_auto,model=$MODEL_DIR" --profile "kind=concurrent,streams=$2" \
        --constraint "kind=max_requests,count=$3" --output "kind=json,path=$OUT/run.json" \
        > "$OUT/run.log" 2>&1 || { tail -20 "$OUT/run.log"; exit 1; }
    .venv/bin/python - "$OUT/run.json" "$1 at $2" <<'PY'
import json, sys
totals = json.load(open(sys.argv[1]))["benchmarks"][0]["metrics"]["request_totals"]
print(f"guidellm {sys.argv[2]}: {totals}")
sys.exit(totals["errored"] or totals["incomplete"] or not totals["successful"])
PY
}
guidellm /v1/completions 1 2
guidellm /v1/completions 16 16
guidellm /v1/completions 64 64
guidellm /v1/chat/completions 4 4

# lm-eval's tokenizer is the model's own files, as the server's (no hub); a request that errs
# past its retries fails the run, and one retried at all is an error here too
ARGS="model=smollm2-135m,base_url=http://127.0.0.1:$PORT/v1/completions,num_concurrent=2"
ARGS+=",max_retries=1,tokenizer_backend=huggingface,tokenizer=$MODEL_DIR"
$VENV/bin/lm_eval --model local-completions --model_args "$ARGS" \
    --include_path scripts/lm_eval_tasks --tasks tandem_choice,tandem_generate \
    --log_samples --output_path "$OUT/lm_eval" > "$OUT/lm_eval.log" 2>&1 ||
    { tail -30 "$OUT/lm_eval.log"; exit 1; }
grep -A4 '^|  *Tasks' "$OUT/lm_eval.log"
if grep -E 'API request failed|null content' "$OUT/lm_eval.log"; then exit 1; fi
.venv/bin/python scripts/lm_eval_compare.py "$OUT"/lm_eval/*/samples_tandem_choice_*.jsonl \
    smollm2-135m
