#!/usr/bin/env bash
# The first checks of a session lent a GPU, as one prepared script: `pytest -m gpu`, then the CUDA memory bench.
#
#   bash bench/gpu_kit.sh prepare      # here, with the registries: the wheels the device image lacks -> .whl/
#   device `run`: command "bash bench/gpu_kit.sh run", carry [".whl"], timeout_s 560
#
# The device image (see the device tool's KINDS.md) has Python 3.12 with torch, peft, accelerate, safetensors,
# onnx/onnxruntime, psutil, typer, rich, matplotlib and pytest, but not pydantic, datasets, torchao or boto3, and
# an older transformers/tokenizers; memfit imports prefect, mlflow and bitsandbytes only where they are used, and
# no gpu-marked test needs them (bitsandbytes, 43 MB, would not fit the 64 MiB the working tree may carry).
# Everything the run writes goes under $OUT (at most 8 files, two folders down).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic pydantic-core annotated-types typing-inspection transformers==5.24.0 tokenizers==0.23.3
        datasets==5.2.0 dill multiprocess torchao==0.18.0 boto3 botocore s3transfer jmespath)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]/#/--platform=}" -d .whl "${WHEELS[@]}"
    size=$(du -sm .whl | cut -f1)
    echo "wheels in .whl: ${size} MiB (the carry limit is 64 MiB with the working tree)"
    [ "$size" -lt 56 ] || { echo "too large to carry: drop the boto3 stack (botocore is 17 MB)"; exit 1; }
    ;;
run)
    out=${OUT:-/tmp/memfit-gpu-out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false \
        MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1
    { nvidia-smi || true; python3 -c "import torch, transformers, pydantic; print('torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"; } \
        > "$out/versions.txt" 2>&1
    cat "$out/versions.txt"
    # -o addopts= drops nothing but pyproject's own options, given again here (strict markers, a short summary).
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --strict-markers -ra \
        --durations=15 2>&1 | tee "$out/pytest-gpu.log" || true
    timeout 220 python3 bench/memory_bench.py --device cuda --shape llama-3.2-1b --out "$out/bench" 2>&1 \
        | tee "$out/memory-bench.log" || true
    ;;
*)
    echo "usage: bash bench/gpu_kit.sh prepare|run" >&2
    exit 2
    ;;
esac
