#!/usr/bin/env bash
# Issue 53's GPU checks in one call on one H200, dummy weights, printing every number:
#   1. tests/gpu: the new layers in bf16 against the torch path, greedy through the kernels
#      against HF (Gemma at head_dim 256), decode and piecewise graphs with experts, the fused MoE;
#   2. qwen3-30b-a3b's decode step at batch 1 and 256 against its floor (the experts a step
#      touches, attention weights, KV): target <= 1.5x;
#   3. qwen3-30b-a3b on the mixed shape (1,024 requests, prompts and outputs uniform in
#      100-1,024 tokens, ignore_eos): output tok/s;
#   4. qwen3-8b and gemma-3-12b offline (512 x 512/128, as llama-3-8b's row): the share of the
#      workload floor the run prints (target >= 75%).
#
#   bench/models_gpu.sh TOKENIZER_DIR [OUT_DIR]
#
# TOKENIZER_DIR: any HF tokenizer directory (the GPU machine has no hub; SmolLM2's, built by
# `strata build-model smollm2-135m`, will do: dummy weights take any ids). Each step's JSON and
# log go to OUT_DIR (default /tmp/strata-models-gpu). A failing step is reported and the next
# one runs; the exit status is 1 if any failed. The steps' deadlines add up to 9.5 minutes.
set -uo pipefail
TOKENIZER=${1:?usage: bench/models_gpu.sh TOKENIZER_DIR [OUT_DIR]}
OUT=${2:-/tmp/strata-models-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
failed=()

step() {  # step NAME SECONDS COMMAND...: run it under a deadline, log it, remember a failure
    local name=$1 seconds=$2
    shift 2
    echo
    echo "=== $name ($(date +%T), at most ${seconds} s)"
    local start=$SECONDS
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "=== $name: exit $status after $((SECONDS - start)) s"
    [ "$status" -eq 0 ] || failed+=("$name")
}

bench() {  # bench NAME SECONDS BENCHMARK ARGS...
    local name=$1 seconds=$2
    shift 2
    step "$name" "$seconds" python -m strata.cli bench "$@" --tokenizer "$TOKENIZER" --no-progress \
        --output "$OUT/$name.json"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

step gpu-tests 200 python -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_model_families_gpu.py tests/gpu/test_fused_moe_gpu.py

# The floor at batch 1 is the 8 experts a layer its token picks; at 256, all 128 of them.
bench roofline-qwen3-30b-a3b-b1 60 roofline --model dummy:qwen3-30b-a3b --batch 1 --no-through-stack
bench roofline-qwen3-30b-a3b-b256 70 roofline --model dummy:qwen3-30b-a3b --batch 256 --no-through-stack

bench mixed-qwen3-30b-a3b 110 throughput --model dummy:qwen3-30b-a3b --num-prompts 1024 \
    --input-len 1024 --min-input-len 100 --output-len 1024 --min-output-len 100 --no-hf-baseline --no-roofline

bench offline-qwen3-8b 60 throughput --model dummy:qwen3-8b --num-prompts 512 --input-len 512 --output-len 128 \
    --no-hf-baseline
bench offline-gemma-3-12b 70 throughput --model dummy:gemma-3-12b --num-prompts 512 --input-len 512 \
    --output-len 128 --no-hf-baseline

echo
echo "=== summary"
for name in roofline-qwen3-30b-a3b-b1 roofline-qwen3-30b-a3b-b256; do
    grep -h "measured / floor\|^  floor\|measured step" "$OUT/$name.log" | sed "s/^/$name: /"
done
grep -h "output tokens/s" "$OUT/mixed-qwen3-30b-a3b.log" | head -1 | sed "s/^/mixed-qwen3-30b-a3b: /"
for name in offline-qwen3-8b offline-gemma-3-12b; do
    grep -h "output tokens/s\|^  floor\|^  strata" "$OUT/$name.log" | sed "s/^/$name: /"
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "every step ran"
