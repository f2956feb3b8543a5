#!/usr/bin/env bash
# One-shot GPU check of pdserve (docs/gpu.md): versions, the gpu-marked tests, backend agreement on
# the tiny presets, serving tiny GQA and MLA models (colocated and 1P1D on one GPU), decode attention
# bandwidth against the HBM roofline, the engine's decode tokens/s, and the block-scaled FP8 kernels
# (their tests, GEMM and fused-MoE speed against bf16). Sized for one H200 in under five minutes.
# Every server it starts is stopped before it exits (benchmark/servers.py).
#
#   benchmark/gpu_check.sh            run everything (needs a CUDA GPU)
#   benchmark/gpu_check.sh --dry-run  print the steps; run only what works on CPU (versions, the
#                                     bandwidth and FP8 code under the Triton interpreter with tiny shapes)
set -u -o pipefail

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/python:$ROOT/kernels${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
FAILED=()

step() {  # step NAME TIMEOUT_S CMD...: run (or, dry, print) one step; a failure is counted, not fatal
    local name="$1" limit="$2"
    shift 2
    echo "=== $name: $*"
    if (( DRY )); then
        return 0
    fi
    if ! timeout --kill-after=10 "$limit" "$@"; then
        FAILED+=("$name")
    fi
}

install_deps() {
    # Wheels carried in the tree first (offline GPU hosts), then the registries.
    local wheels=()
    shopt -s nullglob
    wheels=("$ROOT"/benchmark/wheels/*.whl)
    shopt -u nullglob
    if (( ${#wheels[@]} )); then
        "$PY" -m pip install -q --no-deps "${wheels[@]}"
    fi
    "$PY" -m pip install -q "triton>=3.2" "flashinfer-python>=0.2.6" "mooncake-transfer-engine>=0.3.13" pytest \
        pytest-timeout
}

echo "pdserve GPU check ($( (( DRY )) && echo dry run || echo live )) in $ROOT"
if (( DRY )); then
    echo "=== install: pip install triton flashinfer-python mooncake-transfer-engine (skipped: dry run)"
    "$PY" benchmark/gpu_bench.py versions || FAILED+=("versions")
    TRITON_INTERPRET=1 timeout 300 "$PY" benchmark/gpu_bench.py bandwidth --smoke || FAILED+=("bandwidth-smoke")
    TRITON_INTERPRET=1 timeout 300 "$PY" benchmark/gpu_bench.py fp8 --smoke || FAILED+=("fp8-smoke")
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "no CUDA device visible to torch: run with --dry-run on CPU hosts"; exit 2; }
    step install 240 install_deps
    step versions 60 "$PY" benchmark/gpu_bench.py versions
fi
step gpu-tests 300 "$PY" -m pytest -q -m gpu test/kernels test/layers test/engine
step agree 300 "$PY" benchmark/gpu_bench.py agree
step serve 300 "$PY" benchmark/gpu_bench.py serve
step bandwidth 120 "$PY" benchmark/gpu_bench.py bandwidth --batch 64 --context 4096
step decode 300 "$PY" benchmark/gpu_bench.py decode --batch 64
# FP8 (docs/gpu.md): the kernels and every installed GEMM backend against their twins, then speed
step fp8-tests 300 "$PY" -m pytest -q -m gpu test/kernels/test_fp8_kernels.py test/layers/test_fp8_dispatch.py
step fp8-models 180 "$PY" -m pytest -q -m gpu test/models/test_fp8_checkpoints.py  # FP8 checkpoints kept FP8
step fp8-bench 300 "$PY" benchmark/gpu_bench.py fp8
# FP8 KV cache (docs/kv-cache.md): drift, agreement and tokens per GiB against bf16 KV, flashinfer reading e4m3 pages
step kv-fp8 240 "$PY" benchmark/bench_kv_fp8.py --presets tiny-llama tiny-deepseek --prompts 4 --output-len 16
step speculative 300 "$PY" benchmark/gpu_bench.py speculative

if (( ${#FAILED[@]} )); then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "all steps passed"
