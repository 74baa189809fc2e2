#!/usr/bin/env bash
# The lanes issue's GPU check, in one call on one H200 (under 8 minutes):
#   splits -> green-context GEMM scaling and disjointness; steps -> dummy Llama-3.1-8B bf16
#   prefill/decode latency at three splits, alone and co-running; bench -> bullet vs chunked-1024
#   at two rates through the real server. Prints one table; logs and JSON go to $OUT.
# The device has torch, CUDA and cuda-bindings but not the server's packages: carry them as
# wheels in .whl/ (see /work/.library/device/README.md) and name .whl in the run's carry.
set -uo pipefail
OUT=${OUT:-device-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout 150 python3 scripts/device_check.py splits steps --out "$OUT" 2>&1 | tee "$OUT/check.log"
timeout 300 python3 scripts/device_check.py bench --out "$OUT" --num-prompts 150 --rates 8,16 2>&1 | tee -a "$OUT/check.log"
