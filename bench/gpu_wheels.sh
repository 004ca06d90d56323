#!/usr/bin/env bash
# Run here (not on the GPU machine): downloads into bench/build/whl (ignored) the pure-Python
# wheels that the GPU machine's image lacks, for bench/gpu_env.sh to install there. That image
# has torch, triton, transformers, tokenizers, safetensors, accelerate, numpy, grpcio 1.84.0 and
# protobuf; the rest of Strata's dependencies (xgrammar, with pydantic and tvm-ffi, for constrained
# decoding among them), the test runner and py-spy travel as these wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d bench/build/whl \
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 tenacity prometheus-client starlette uvicorn \
  h11 click anyio typing_extensions gguf tqdm pytest pytest-timeout pluggy iniconfig pygments \
  xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
  py-spy  # --spy-dir of the benches
