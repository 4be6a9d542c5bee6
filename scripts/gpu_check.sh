#!/usr/bin/env bash
# The prepared GPU check of issue 14, in two halves.
#
#   scripts/gpu_check.sh prepare      here, with the project's venv: fills gpu_payload/ (git-ignored;
#                                     the device tool carries it with carry: ["gpu_payload"]) with the
#                                     gguf wheel (the GPU image lacks it) and SmolLM2-135M re-quantised
#                                     to fit the 64 MiB the tree may take (scripts/pack_model.py).
#   scripts/gpu_check.sh run [OUT]    on the GPU machine (Python 3.12, torch 2.11, transformers 5,
#                                     triton 3.6, no index): the CUDA test subset, then
#                                     `tandem bench gpu`. Writes OUT/gpu_check.json and OUT/gpu_check.log
#                                     (OUT: the argument, else $GPU_CHECK_OUT, else $OUT, else ./gpu_check_out).
#                                     About 6 minutes; each half has a time limit, 8 minutes in all.
set -uo pipefail
cd "$(dirname "$0")/.."
PAYLOAD=gpu_payload
PY=${PYTHON:-python3}

prepare() {
    local venv=.venv/bin
    rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
    "$venv/pip" download -q --no-deps -d "$PAYLOAD" "gguf>=0.10" || exit 1
    local src
    src=$(PYTHONPATH=$PWD "$venv/tandem" prepare --model smollm2-135m) || exit 1
    PYTHONPATH=$PWD "$venv/python" scripts/pack_model.py pack "$src" "$PAYLOAD/smollm2-135m-3bit" || exit 1
    local tree payload
    tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    payload=$(du -sb "$PAYLOAD" | cut -f1)
    echo "tree $((tree >> 20)) MiB + payload $((payload >> 20)) MiB (limit 64 MiB)"
    [ $((tree + payload)) -lt $((63 << 20)) ] || { echo "too big to travel"; exit 1; }
}

run() {
    local out=$1 wheel
    wheel=$(ls "$PAYLOAD"/gguf-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no $PAYLOAD/gguf-*.whl: run 'scripts/gpu_check.sh prepare' first and carry $PAYLOAD"; exit 1; }
    # gguf is pure Python: importable from its wheel (a zip) on the path, no install.
    export PYTHONPATH=$PWD:$PWD/$wheel TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
    date -u; command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
    local model=/tmp/smollm2-135m-3bit
    $PY scripts/pack_model.py unpack "$PAYLOAD/smollm2-135m-3bit" "$model" || exit 1

    echo "== CUDA test subset"
    SECONDS=0
    timeout 200 $PY -m pytest -q --tb=short -p no:cacheprovider tests/test_triton_attention.py tests/test_engine_tiny.py \
        tests/test_sampler.py tests/test_bad_input.py tests/test_attention.py | tee "$out/.pytest.txt"
    local pytest_rc=${PIPESTATUS[0]} pytest_s=$SECONDS

    echo "== tandem bench gpu"
    # GPU_CHECK_ARGS: extra flags, e.g. "--device cpu --tiny" for a dry run of this script on CPU.
    timeout 330 $PY -m tandem.bench.gpu --out "$out" --model "$model" ${GPU_CHECK_ARGS:-}
    local bench_rc=$?
    # One JSON: the test subset's outcome joins the bench's report.
    $PY - "$out" "$pytest_rc" "$pytest_s" "$bench_rc" <<'EOF'
import json, sys
from pathlib import Path
out, pytest_rc, pytest_s, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
path = out / "gpu_check.json"
report = json.loads(path.read_text()) if path.exists() else {}
lines = (out / ".pytest.txt").read_text().strip().splitlines()
report["cuda_tests"] = {"rc": pytest_rc, "seconds": pytest_s, "summary": lines[-1] if lines else "",
                        "failures": [l for l in lines if l.startswith(("FAILED", "ERROR"))]}
report["bench_rc"] = bench_rc  # 124: it ran out of time (the parts done are in the report)
path.write_text(json.dumps(report, indent=2))
(out / ".pytest.txt").unlink()
print(f"wrote {path}")
EOF
}

case "${1:-}" in
    prepare) prepare ;;
    run)
        out=${2:-${GPU_CHECK_OUT:-${OUT:-gpu_check_out}}}
        mkdir -p "$out"
        run "$out" 2>&1 | tee "$out/gpu_check.log"  # the pipeline waits for tee: the log is whole
        exit "${PIPESTATUS[0]}" ;;
    *) echo "usage: scripts/gpu_check.sh prepare | run [OUT]"; exit 2 ;;
esac
