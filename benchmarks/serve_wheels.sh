#!/usr/bin/env bash
# Wheels of what `kestrel serve` imports and the GPU machine's image lacks (KINDS.md's package list has httpx,
# anyio, h11, click, pyyaml, annotated-doc, but no fastapi, starlette, pydantic, uvicorn or pyzmq; xxhash, the
# hand-off's checksum, rides along in case the image's is missing), for Python 3.12
# on x86-64, into .whl (git-ignored) next to the fast-path session's fla-core and einops wheels. Run here, where
# pip reaches PyPI; carry `.whl` in the device call (benchmarks/gpu_run.sh installs it into /tmp/site).
# The versions are the ones the CPU tests run with.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 pyzmq==27.3.0 \
  xxhash==4.1.0
ls -la .whl
