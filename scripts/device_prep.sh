#!/usr/bin/env bash
# Prepare what scripts/device_check.sh needs on the GPU machine, which has torch, CUDA and
# cuda-bindings but neither the server's packages nor the embedded model (its 94 MB wheel is over
# the device tool's 64 MiB limit):
#   .whl/              wheels of the server's packages for that machine's Python 3.12, at the
#                      versions installed in this checkout's .venv
#   .device/tokenizer  the embedded model's tokenizer, saved as a folder (serve/bench --tokenizer)
# Both paths are ignored by git; name them in the device run's carry:
#   run(command="bash scripts/device_check.sh", carry=[".whl", ".device"])
set -euo pipefail
PY=${PY:-.venv/bin/python}
# fastapi >= 0.16x imports opentelemetry-api; the others are the server's and loader's needs
# that the GPU image lacks (checked against /work/.library/device/KINDS.md's package list).
PACKAGES="fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc
typing-inspection typing_extensions httptools gguf platformdirs opentelemetry-api"
pins=()
for name in $PACKAGES; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
rm -rf .device/tokenizer && mkdir -p .device
"$PY" -c "from bulletserve.model.tokenizer import load_tokenizer; \
load_tokenizer(None).save_pretrained('.device/tokenizer')"
du -sh .whl .device
