"""Compile the Triton kernels for an H100 (sm_90) on a machine without a GPU.

The interpreter checks what the kernels compute, not that they compile: type errors in the
GPU front end, register spills, or a loop the compiler fails to software-pipeline only show up
when compiling. Triton ships ptxas, so the whole pipeline runs on CPU. Pointer and stride
arguments are declared 16-divisible, as Triton specialises them at run time for contiguous
tensors.

    python -m strata.kernels.compile_check            # table for Llama-like shapes
    python -m strata.kernels.compile_check --strict   # exit 1 on a spill or an unpipelined loop

Must run without TRITON_INTERPRET (the kernels must be real JITFunctions).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import strata.kernels.attention_launch as attention_launch
import strata.kernels.cascade_attention as cascade_attention
import strata.kernels.fused_moe as fused_moe
import strata.kernels.kv_cache_write as kv_cache_write
import strata.kernels.paged_attention as paged_attention

_TRITON_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_INT_POINTERS = {
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "seq_prefix_lens_ptr": "*i32",
    "token_start_ptr": "*i32",
    "prefix_lens_ptr": "*i32",
    "table_rows_ptr": "*i32",
    # fused_moe: routing ids, the expert-grouped layout, expert-parallel maps
    "ids_ptr": "*i32",
    "topk_ids_ptr": "*i32",
    "expert_map_ptr": "*i32",
    "sorted_pairs_ptr": "*i32",
    "block_experts_ptr": "*i32",
    "padded_total_ptr": "*i32",
    "chunk_counts_ptr": "*i32",
    "counters_ptr": "*i32",  # decode_moe's ticket and arrival counters
    "seq_ptr": "*i32",  # the one-shot all-reduce's sequence numbers (decode_linear's early sends)
}
# decode_linear's early sends: every rank's one-shot buffer, of the data's dtype.
_DATA_POINTERS = {f"buf{i}" for i in range(8)}
_FP32_POINTERS = {"partial_acc_ptr", "partial_max_ptr", "partial_sum_ptr", "stats_ptr", "stats_out_ptr"}
_FP32_POINTERS |= {"weights_ptr", "topk_weights_ptr"}
_FLOAT_ARGS = {"qk_scale_log2", "eps", "norm_eps"}


@dataclass
class CompileReport:
    name: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    async_copies: int  # cp.async ops in the final TTGIR: > 0 means the loop was pipelined

    def line(self) -> str:
        return (
            f"{self.name:<58} regs={self.registers:<4} spills={self.spill_bytes:<5} "
            f"smem={self.shared_bytes:<7} async_copies={self.async_copies}"
        )


def _signature(kernel, data_dtype: str, constexprs: dict) -> ASTSource:
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INT_POINTERS:
            signature[name] = _INT_POINTERS[name]
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr") or name in _DATA_POINTERS:
            signature[name] = "*" + data_dtype
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if name.endswith("_ptr") or name.startswith("stride") or name in _DATA_POINTERS:
            attrs[(index,)] = [["tt.divisibility", 16]]
    unknown = set(constexprs) - set(kernel.arg_names)
    assert not unknown, f"not arguments of {kernel.fn.__name__}: {unknown}"
    return ASTSource(
        kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )


def _ptxas_stats(ptx: str) -> tuple[int, int]:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    try:
        result = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", handle.name, "-o", os.devnull], capture_output=True, text=True, check=True
        )
    finally:
        os.unlink(handle.name)
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", result.stderr).group(1))
    return registers, spills


def compile_for_sm90(source: ASTSource, num_warps: int, num_stages: int = 1):
    """Compile for an H100 without a GPU -> (the compiled kernel, registers, spilled bytes)."""
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    registers, spills = _ptxas_stats(compiled.asm["ptx"])
    return compiled, registers, spills


def _compile(name: str, kernel, data_dtype: str, constexprs: dict, num_warps: int, num_stages: int) -> CompileReport:
    compiled, registers, spills = compile_for_sm90(_signature(kernel, data_dtype, constexprs), num_warps, num_stages)
    return CompileReport(
        name, registers, spills, compiled.metadata.shared, compiled.asm["ttgir"].count("async_copy_global_to_local")
    )


def compile_attention(
    *,
    dtype: str,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    num_kv_splits: int = 1,
    sliding_window: bool = False,
    block_size: int = 16,
    min_query_len: int = 1,
) -> list[CompileReport]:
    """Compile the attention kernel (and the merge kernel when split) as paged_attention would launch it."""
    group = num_q_heads // num_kv_heads
    config = attention_launch.choose_launch_config(
        num_seqs=256,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=max_query_len,
        max_seq_len=4096,
        sm_count=132,
        num_kv_splits=num_kv_splits,
        min_query_len=min_query_len,
    )
    constexprs = dict(
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=config.block_q,
        BLOCK_M=max(16, triton.next_power_of_2(config.block_q * group)),
        TILE_N=config.tile_n,
        NUM_SPLITS=config.num_kv_splits,
        USE_WINDOW=sliding_window,
        IEEE_DOT=dtype == "fp32",
        INTERPRETED=False,
        PREFIX_PARTS=0,
    )
    name = (
        f"attention {dtype} D={head_dim} G={group} q<={max_query_len} splits={num_kv_splits}"
        f"{' window' if sliding_window else ''}{f' q>={min_query_len}' if min_query_len > 1 else ''}"
    )
    reports = [
        _compile(name, paged_attention._paged_attention_kernel, dtype, constexprs, config.num_warps, config.num_stages)
    ]
    if config.num_kv_splits > 1:
        merge = dict(
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=config.num_kv_splits,
            SPLITS_PADDED=triton.next_power_of_2(config.num_kv_splits),
        )
        reports.append(
            _compile(
                f"merge splits {dtype} D={head_dim} splits={config.num_kv_splits}",
                paged_attention._merge_kv_splits_kernel,
                dtype,
                merge,
                4,
                1,
            )
        )
    return reports


def compile_cascade(
    *,
    dtype: str,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    prefix_splits: int = 2,
    block_size: int = 16,
) -> list[CompileReport]:
    """The cascade's two kernels: the paged kernel with prefix parts, and the shared-prefix kernel."""
    group = num_q_heads // num_kv_heads
    config = cascade_attention.choose_own_keys_config(
        num_seqs=256,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=max_query_len,
        max_seq_len=4096,
        sm_count=132,
    )
    own = dict(
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=config.block_q,
        BLOCK_M=max(16, triton.next_power_of_2(config.block_q * group)),
        TILE_N=config.tile_n,
        NUM_SPLITS=1,
        USE_WINDOW=False,
        IEEE_DOT=dtype == "fp32",
        INTERPRETED=False,
        PREFIX_PARTS=prefix_splits,
    )
    prefix_config = cascade_attention.choose_prefix_config(
        num_runs=16,
        max_run_tokens=256,
        max_prefix_len=2048,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sm_count=132,
        prefix_splits=prefix_splits,
    )
    shared = dict(
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=prefix_config.block_t,
        BLOCK_M=max(16, triton.next_power_of_2(prefix_config.block_t * group)),
        TILE_N=prefix_config.tile_n,
        NUM_PARTS=prefix_splits,
        IEEE_DOT=dtype == "fp32",
        INTERPRETED=False,
    )
    shape = f"{dtype} D={head_dim} G={group} q<={max_query_len} prefix splits={prefix_splits}"
    return [
        _compile(
            f"attention (cascade own keys) {shape}",
            paged_attention._paged_attention_kernel,
            dtype,
            own,
            config.num_warps,
            config.num_stages,
        ),
        _compile(
            f"attention (cascade shared prefix) {shape}",
            cascade_attention._shared_prefix_kernel,
            dtype,
            shared,
            prefix_config.num_warps,
            prefix_config.num_stages,
        ),
    ]


def compile_kv_write(*, dtype: str, head_dim: int, num_kv_heads: int, block_size: int = 16) -> CompileReport:
    constexprs = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )
    return _compile(
        f"write_kv_cache {dtype} D={head_dim} Hkv={num_kv_heads}",
        kv_cache_write._write_kv_cache_kernel,
        dtype,
        constexprs,
        num_warps=4,
        num_stages=1,
    )


def compile_fused_moe(*, dtype: str, **shape) -> list[CompileReport]:
    """Every variant fused_moe launches for a model shape (fused_moe.launch_variants)."""
    return [
        _compile(f"{launch.name} {dtype}", launch.kernel, dtype, launch.constexprs, launch.num_warps, launch.num_stages)
        for launch in fused_moe.launch_variants(**shape)
    ]


def default_reports() -> list[CompileReport]:
    """Llama-3.2-1B (32/8 heads, D=64), Llama-3-8B-like (32/8, D=128), MHA D=128, GQA 8, Qwen2 GQA 7,
    Gemma 3 12B (16/8, D=256) and 1B (4/1, D=256)."""
    reports = []
    for dtype, head_dim, heads, kv_heads in [
        ("bf16", 64, 32, 8),
        ("bf16", 128, 32, 8),
        ("bf16", 128, 16, 16),
        ("bf16", 128, 64, 8),
        ("bf16", 64, 14, 2),
        ("bf16", 256, 16, 8),
        ("bf16", 256, 4, 1),
    ]:
        reports += compile_attention(
            dtype=dtype, head_dim=head_dim, num_q_heads=heads, num_kv_heads=kv_heads, max_query_len=1
        )
        reports += compile_attention(
            dtype=dtype,
            head_dim=head_dim,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            max_query_len=512,
            sliding_window=head_dim >= 128,
        )
        reports += compile_attention(
            dtype=dtype,
            head_dim=head_dim,
            num_q_heads=heads,
            num_kv_heads=kv_heads,
            max_query_len=512,
            min_query_len=512,
        )  # the 128-row prefill launch
    for head_dim, heads, kv_heads in [(128, 32, 8), (256, 16, 8)]:
        reports += compile_attention(
            dtype="bf16", head_dim=head_dim, num_q_heads=heads, num_kv_heads=kv_heads, max_query_len=1, num_kv_splits=16
        )
    for dtype, head_dim, heads, kv_heads in [
        ("bf16", 64, 32, 8),
        ("bf16", 128, 32, 8),
        ("bf16", 64, 9, 3),
        ("bf16", 256, 16, 8),
    ]:
        for max_query_len in (1, 512):
            reports += compile_cascade(
                dtype=dtype, head_dim=head_dim, num_q_heads=heads, num_kv_heads=kv_heads, max_query_len=max_query_len
            )
    reports.append(compile_kv_write(dtype="bf16", head_dim=64, num_kv_heads=8))
    reports.append(compile_kv_write(dtype="fp16", head_dim=128, num_kv_heads=2))
    reports.append(compile_kv_write(dtype="bf16", head_dim=256, num_kv_heads=8))
    # Qwen3-30B-A3B (its router rounds the weights to bf16), then Mixtral (keeps them float32).
    reports += compile_fused_moe(
        dtype="bf16", hidden_size=2048, intermediate=768, num_experts=128, top_k=8, weight_dtype=torch.bfloat16
    )
    reports += compile_fused_moe(dtype="bf16", hidden_size=4096, intermediate=14336, num_experts=8, top_k=2)  # Mixtral
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--strict", action="store_true", help="fail on register spills or an attention loop without cp.async pipelining"
    )
    args = parser.parse_args(argv)
    assert not os.environ.get("TRITON_INTERPRET"), "unset TRITON_INTERPRET: this compiles the real kernels"
    failures = []
    for report in default_reports():
        print(report.line(), flush=True)
        if report.spill_bytes:
            failures.append(f"{report.name}: {report.spill_bytes} bytes spilled")
        if report.name.startswith("attention") and report.async_copies == 0:
            failures.append(f"{report.name}: K/V loads not pipelined")
        if report.name.startswith("fused_moe gemm") and report.async_copies == 0:
            failures.append(f"{report.name}: weight loads not pipelined")
    for failure in failures:
        print("FAIL", failure)
    return 1 if (args.strict and failures) else 0


if __name__ == "__main__":
    sys.exit(main())
