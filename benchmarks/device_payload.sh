#!/usr/bin/env bash
# Wheels and the embedded tokenizer for a GPU host that has torch, transformers and Triton but no
# internet and none of the serving packages (Python 3.12, x86-64): the GPU benchmarks and tests run
# there from the checkout with PYTHONPATH=/tmp/site:src after
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#
# Versions are the ones this checkout's .venv runs (make install), so both sides test the same
# code. Writes .whl/ (wheels) and .tok/ (the embedded SmolLM2 tokenizer, the vocabulary the
# dummy-weight configs ending in -smoltok and `--tokenizer .tok` read).
#
#   bash benchmarks/device_payload.sh [--python-version 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=3.12
[ "${1:-}" = "--python-version" ] && PYVER=$2
PACKAGES=(
  fastapi starlette uvicorn h11 anyio sniffio pydantic pydantic-core annotated-types
  typing-inspection msgspec pyzmq prometheus-client gguf xgrammar apache-tvm-ffi
  jsonschema jsonschema-specifications referencing rpds-py
  openai httpx httpx2 httpcore httpcore2 truststore jiter
  pytest-timeout hypothesis sortedcontainers hypothesis-jsonschema peft accelerate
)
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  if [ -z "$version" ]; then
    echo "device_payload: $name is not installed in $PY's environment (run make install)" >&2
    exit 1
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
PYTHONPATH=src "$PY" -c "
from fulcrum.model.loader.default_model import load_default_tokenizer
load_default_tokenizer().save_pretrained('.tok')"
du -sh .whl .tok
echo "device_payload: carry .whl and .tok (one call takes 64 MiB in all)"
