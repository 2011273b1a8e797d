#!/usr/bin/env bash
# The first checks of a session lent a GPU, as one prepared script: `pytest -m gpu`, then the GPU table.
#
#   bash bench/gpu_kit.sh prepare      # here, with the registries: the wheels the device image lacks -> .whl/
#   device `run`: command "bash bench/gpu_kit.sh run", carry [".whl"], timeout_s 560   (<= 8 minutes)
#   PYTHON=.venv/bin/python bash bench/gpu_kit.sh dry   # here: the table on tiny shapes on the CPU (~8 min on 2 cores)
#
# The device image (/work/.library/device/KINDS.md) has Python 3.12 with torch 2.11, triton, peft, accelerate,
# safetensors, pyarrow, xxhash, onnx/onnxruntime, psutil, typer, rich, matplotlib and pytest, an older
# transformers/tokenizers, and no pydantic, datasets, trl, torchao, liger-kernel, mlflow, prefect, boto3 or
# bitsandbytes. memfit imports prefect, mlflow, boto3 and bitsandbytes only where they are used; a gpu-marked test
# that needs one of them skips (tests/unit/test_gpu_collection.py holds `pytest -m gpu` collecting without them).
# bitsandbytes (43 MB) and botocore (17 MB) would not fit the 64 MiB the working tree may carry: no QLoRA row.
# What the run writes goes under $OUT: versions, pytest's log, the table (gpu.md, also docs/gpu.md there), rows.log.
set -euo pipefail
cd "$(dirname "$0")/.."

# Versions as constraints.txt pins them where it does (pydantic and pydantic-core must agree); the rest pinned here.
WHEELS=(pydantic pydantic-core annotated-types typing-inspection transformers tokenizers datasets dill multiprocess
        torchao==0.18.0 liger-kernel==0.8.5 trl==1.16.0)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

case "${1:-}" in
prepare)
    # .whl/ travels only as carried (ignored) files; a linked worktree shares its checkout's exclude: left alone.
    exclude=$(git rev-parse --git-path info/exclude)
    if [ "$(git rev-parse --git-dir)" = "$(git rev-parse --git-common-dir)" ]; then
        grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    fi
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]/#/--platform=}" -c constraints.txt -d .whl "${WHEELS[@]}"
    size=$(du -sm .whl | cut -f1)
    ls .whl
    echo "wheels in .whl: ${size} MiB (the carry limit is 64 MiB with the working tree)"
    [ "$size" -lt 40 ] || { echo "too large to carry beside the working tree"; exit 1; }
    ;;
run)
    out=${OUT:-/tmp/memfit-gpu-out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DO_NOT_TRACK=true HF_HUB_OFFLINE=1 \
        TOKENIZERS_PARALLELISM=false
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
      python3 -c "import torch, transformers, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"; } > "$out/versions.txt" 2>&1
    cat "$out/versions.txt"
    # -o addopts= drops nothing but pyproject's own options, given again here (strict markers, a short summary).
    timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --strict-markers -ra \
        --durations=10 > "$out/pytest-gpu.log" 2>&1 || true
    tail -15 "$out/pytest-gpu.log"
    # The table gets what pytest left of 8 minutes (470 s from the start; 25 s kept for its last writes).
    left=$(( 470 - SECONDS ))
    timeout "$left" python3 bench/gpu_table.py run --out /tmp/gpu-table --doc docs/gpu.md \
        --deadline-s "$(( left - 25 ))" || true
    cp docs/gpu.md "$out/gpu.md" 2>/dev/null || true
    cp /tmp/gpu-table/rows.log /tmp/gpu-table/table.json "$out/" 2>/dev/null || true
    ;;
dry)
    out=${OUT:-/tmp/memfit-gpu-dry}   # PYTHON: the project's interpreter (e.g. .venv/bin/python), trl importable
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python3}" bench/gpu_table.py run --out "$out" --dry-run \
        --deadline-s 560
    ;;
*)
    echo "usage: bash bench/gpu_kit.sh prepare|run|dry" >&2
    exit 2
    ;;
esac
