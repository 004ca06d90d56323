"""y = x @ W.T (+ bias) for decode batches of 64..512 rows: a tensor-core Triton GEMM cut to fill the GPU.

At M = 256 a Llama-3.2-1B linear is a small GEMM: qkv (N 3072, K 2048) is 3.2 GFLOP, ~4.7 us at
the ~690 TFLOP/s an H200 sustains on a big bf16 matmul, and its 12.6 MB of weight take ~3 us to
stream at 4.3 TB/s, so compute and weight traffic are about even. What keeps such shapes far
below the matmul rate is tile quantisation: 128 x 128 output tiles make 48 (qkv) or 32 (o_proj,
down) tiles for 132 SMs, so most SMs idle while a few walk the whole K. The launch is shaped to
give every SM a comparable share of the multiply-adds instead.

Against cuBLAS (H200, bench/bench_gemm.py: CUDA-graph replays, weights streamed from HBM) this is
a per-shape tool, not a replacement: faster on the down projections (1B at M = 64..256: 0.82-0.95x
cuBLAS's time, level at 512; 8B at M = 64: 0.88x), the 8B o_proj at M = 256 (0.86-0.95x) and
lm_head at M = 64 (0.91x); level on gate_up at M <= 128; slower on qkv at every M (1.1-1.4x), on
the 1B o_proj below M = 512 and wherever the tiles fill several waves (M >= 256 gate_up, lm_head,
8B at M = 512), where cuBLAS's kernels run at 600-720 TFLOP/s and these at 440-600.

How the work is cut:
- Output tiles of BLOCK_M x BLOCK_N, walked along K in BLOCK_K steps by tl.dot (bf16/fp16 with
  4 or 8 warps and BLOCK_M >= 64 lowers to Hopper's wgmma, which reads both operands from shared
  memory; num_stages - 1 steps of x and W are in flight, through TMA or cp.async). W is [N, K]
  row-major, so its [BLOCK_N, BLOCK_K] tile is loaded K-innermost and fed transposed as the B
  operand; x's rows are the A operand. Float32 accumulators, one rounding to x's dtype.
- Tile order: tiles are numbered M-fastest within groups of GROUP_M row blocks, so the
  programs that share a slice of W (M / BLOCK_M of them) run side by side and all but the first
  can find it in L2, so W crosses HBM about once per call. x (at most a few MB) stays in L2.
- Three schedules, one per config (all from python ints):
  * data parallel (split_k = 1, stream_k = 0): one program per tile; the epilogue adds the bias
    and stores. Used once the tiles fill the SMs (gate_up, lm_head, most shapes at M >= 256).
  * split-K (split_k = S > 1): each tile's K steps are cut into S contiguous ranges, one
    program each (grid tiles x S), writing float32 partials [S, M, N]; a second kernel sums them
    in split order (bit-identical run to run: no atomics), adds the bias and rounds once. The
    1B down at M = 256 (64 tiles of 64 x 128) runs as 2 x 64 programs of 4096 K each.
  * stream-K (stream_k = P programs, persistent): the tiles x K-steps units are numbered
    tile-major and program p takes units [p U / P, (p+1) U / P): every program does the same
    number of steps (to one), whatever the tile count. A program's run covers the tail of one
    tile, whole tiles, and the head of another; a whole tile is stored directly, a piece goes to
    float32 scratch slot 2p (the piece that starts inside a tile, i.e. the program's first) or
    2p + 1 (the one that starts at a tile's first step and ends inside it, i.e. its last). A
    fixup kernel then sums each shared tile in program order: the first contributor's slot 1,
    then slot 0 of each following one, so the result is fixed by (M, N, K, P) alone. P is
    capped at U so that every program owns at least one step. Kept for the sweep, not picked:
    on the H200 its best config was 11-66% slower than the best split-K / data-parallel one at
    every shape swept (1B and 8B linears, M = 64..512).
  Split-K and stream-K trade a float32 round trip through L2 (M x N x 4 bytes per extra part)
  and a second, small launch for the SMs they fill. The second kernel is a programmatic
  dependent launch on sm_90 (the GEMM lets it be scheduled early; it waits for the GEMM's
  memory before reading): 0.4-0.8 us less per call in a CUDA graph than a plain launch (12 of
  13 swept cases; the 13th lost 0.2 us).
- Loads: the TMA path (sm_90, use_tma) reads both operands through host-made tensor
  descriptors, whose bounds handling zero-fills the edges (ragged M, N, K need no masks); it
  needs 16-byte aligned bases and row strides and falls back to the pointer path otherwise. The
  pointer path (any GPU, and TRITON_INTERPRET=1) clamps rows past M and N to the last valid one
  (re-read, never stored), so its loads need no mask unless K is ragged (EVEN_K). On the H200
  TMA was as fast or faster than the pointer path on the same tiles, warps and stages in all but
  a few swept cases: typically by 0-15%, up to 2x for 64-row split-K tiles at M = 64.
- M, N, K and the strides are run-time arguments (M is not even specialised): a config is one
  compiled variant serving every shape and batch size, so a model compiles a handful.

Launches depend only on python ints (M, N, K, SM count): no autotuning, capturable in a CUDA
graph; the scratch buffers come from torch's allocator (the graph's pool when captured).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.paged_attention import _device_sm_count

__all__ = [
    "GemmLaunchConfig",
    "batched_linear",
    "choose_batched_linear_config",
    "compile_batched_linear",
    "use_batched_linear",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SHARED = 200 * 1024  # operand buffers per program, of the 227 KB an sm_90 block may use
FIXUP_ROWS = 32  # rows of a tile per fixup program
REDUCE_BLOCK = 1024  # float32 outputs per split-K reduce program


@dataclass(frozen=True)
class GemmLaunchConfig:
    """Tile shapes and schedule; choose_batched_linear_config picks them from python ints only."""

    block_m: int = 128  # rows of x per tile (>= 64 for wgmma)
    block_n: int = 128  # rows of W (output columns) per tile
    block_k: int = 64  # K per loop step
    split_k: int = 1  # > 1: K ranges per tile, float32 partials + an ordered reduce kernel
    stream_k: int = 0  # > 0: persistent stream-K over this many programs (split_k must be 1)
    group_m: int = 8  # row blocks per tile group (W-sharing programs run side by side)
    num_warps: int = 8
    num_stages: int = 4
    use_tma: bool = False  # TMA descriptors for x and W (sm_90; pointer path otherwise)
    pdl: bool = True  # launch the reduce/fixup kernel as a programmatic dependent (sm_90)

    def __post_init__(self):
        assert self.split_k >= 1 and self.stream_k >= 0 and not (self.split_k > 1 and self.stream_k), self
        for block in (self.block_m, self.block_n, self.block_k):
            assert block >= 16 and block & (block - 1) == 0, self

    def shared_bytes(self, element_size: int = 2) -> int:
        """Operand buffers: num_stages steps of an x tile and a W tile (wgmma keeps all of them)."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size

    def describe(self) -> str:
        schedule = f"streamk{self.stream_k}" if self.stream_k else f"split{self.split_k}" if self.split_k > 1 else "dp"
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} {schedule} w{self.num_warps} s{self.num_stages}"
            f"{' tma' if self.use_tma else ''}{'' if self.pdl else ' nopdl'}"
        )


def choose_batched_linear_config(m: int, n: int, k: int, sm_count: int, element_size: int = 2) -> GemmLaunchConfig:
    """Shape heuristic (no autotune: launches must stay capturable and deterministic), from an
    H200 sweep (bench_gemm.py --sweep) over the Llama-3.2-1B / 3.1-8B linears at M = 64..512.

    - 16-bit: 64 x 128 tiles, one warpgroup (4 warps), TMA operands. Where these tiles fit in
      one wave this came within 5% of the sweep's best config at every shape and M; past a wave
      (gate_up at M >= 256, 8B down at M = 512) 128 x 128, 256 x 128 or 128 x 256 tiles were up to 19%
      faster, but cuBLAS beat every swept config there, so the rule stays simple.
    - At most one wave of 64 x 128 tiles: BLOCK_K = 128 (4 stages, 192 KB of operand buffers),
      and split-K into S = min(SMs // tiles, K steps // 4) parts (so S x tiles <= SMs and each
      part keeps >= 4 steps of 128): 1B down at M = 256 (64 tiles) runs as 2 x 64 programs,
      at M = 64 (16 tiles) as 8 x 16; tiles past half the SMs run data parallel (S = 1).
    - More than a wave (gate_up, lm_head, 8B qkv from M = 256, everything at M = 512): data
      parallel with BLOCK_K = 64 (4 stages, 96 KB, two programs per SM).
    - Stream-K is never picked: its best config was 11-66% behind the best split-K or data-parallel
      one at every swept shape.
    - Float32 (ieee dots, no tensor-core fast path): 64 x 64 x 32 tiles, data parallel, pointers.
    """
    if element_size >= 4:
        return GemmLaunchConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
    if tiles > sm_count:
        return GemmLaunchConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, use_tma=True)
    split = max(1, min(sm_count // tiles, triton.cdiv(k, 128) // 4))
    return GemmLaunchConfig(
        block_m=64, block_n=128, block_k=128, split_k=split, num_warps=4, num_stages=4, use_tma=True
    )


# --- kernels ----------------------------------------------------------------------------------


@triton.jit
def _tile_position(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a tile number: M-fastest within groups of GROUP_M row blocks."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile % tiles_per_group
    return first_m + in_group % rows, in_group // rows


@triton.jit
def _dot_step(
    acc,
    x_in,
    w_in,
    a_ptrs,
    b_ptrs,
    off_m,
    off_n,
    step,
    K,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """acc += one BLOCK_K step of the tile's x rows times its W rows, transposed."""
    if USE_TMA:
        k0 = (step * BLOCK_K).to(tl.int32)
        a = x_in.load([off_m, k0])
        b = w_in.load([off_n, k0])
    else:
        k0 = step * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
        else:
            k_valid = (k0 + tl.arange(0, BLOCK_K) < K)[None, :]
            a = tl.load(a_ptrs + k0, mask=k_valid, other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_valid, other=0.0)
    if INTERPRETED:
        # The interpreter's dot gets bfloat16 wrong (numpy has none); float32 products of 16-bit
        # values are exact, so this is the tensor cores' arithmetic up to summation order.
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    elif IEEE_DOT:
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _accumulate(
    acc,
    x_in,
    w_in,
    pid_m,
    pid_n,
    step_begin,
    step_end,
    M,
    N,
    K,
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """acc += x[tile rows, steps] @ W[tile columns, steps].T over K steps [step_begin, step_end)."""
    off_m = (pid_m * BLOCK_M).to(tl.int32)
    off_n = (pid_n * BLOCK_N).to(tl.int32)
    a_ptrs = x_in
    b_ptrs = w_in
    if not USE_TMA:
        offs_k = tl.arange(0, BLOCK_K)
        rows_m = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1).to(tl.int64)
        rows_n = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        a_ptrs = x_in + rows_m[:, None] * stride_xm + offs_k[None, :]
        b_ptrs = w_in + rows_n[:, None] * K + offs_k[None, :]
    if INTERPRETED:
        # The interpreter (triton 3.6 + numpy 2.x) cannot take tensor bounds in range().
        step = step_begin
        while step < step_end:
            acc = _dot_step(
                acc, x_in, w_in, a_ptrs, b_ptrs, off_m, off_n, step, K, BLOCK_K, EVEN_K, USE_TMA, IEEE_DOT, INTERPRETED
            )
            step += 1
    else:
        for step in range(step_begin, step_end):
            acc = _dot_step(
                acc, x_in, w_in, a_ptrs, b_ptrs, off_m, off_n, step, K, BLOCK_K, EVEN_K, USE_TMA, IEEE_DOT, INTERPRETED
            )
    return acc


@triton.jit
def _store_tile(
    acc,
    out_ptr,
    bias_ptr,
    pid_m,
    pid_n,
    M,
    N,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[tile] = acc (+ bias), rounded once to out's dtype; rows past M, columns past N dropped."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit(do_not_specialize=["M", "split_k", "programs"])
def _batched_linear_kernel(
    x_in,
    w_in,
    bias_ptr,
    out_ptr,
    scratch_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    split_k,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCHEDULE: tl.constexpr,  # 0 data parallel, 1 split-K, 2 stream-K
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        # The reduce/fixup kernel may be scheduled now; it waits for this grid's memory.
        gdc_launch_dependents()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    if SCHEDULE == 2:
        # Stream-K: program p owns units [p U / P, (p+1) U / P) of the tile-major (tile, step) space.
        pid = tl.program_id(0).to(tl.int64)
        units = (num_pid_m * num_pid_n).to(tl.int64) * steps
        unit = pid * units // programs
        unit_end = (pid + 1) * units // programs
        while unit < unit_end:
            tile = unit // steps
            step_begin = unit - tile * steps
            step_end = tl.minimum(unit_end - tile * steps, steps)
            pid_m, pid_n = _tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc = _accumulate(
                acc,
                x_in,
                w_in,
                pid_m,
                pid_n,
                step_begin,
                step_end,
                M,
                N,
                K,
                stride_xm,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
                USE_TMA,
                IEEE_DOT,
                INTERPRETED,
            )
            if step_begin == 0 and step_end == steps:
                _store_tile(acc, out_ptr, bias_ptr, pid_m, pid_n, M, N, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)
            else:
                # Slot 2p: the piece starting inside a tile; 2p + 1: the one starting at its first step.
                slot = pid * 2 + (step_begin == 0).to(tl.int64)
                local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                tl.store(scratch_ptr + slot * (BLOCK_M * BLOCK_N) + local, acc)
            unit = tile * steps + step_end
    else:
        tile = tl.program_id(0)
        pid_m, pid_n = _tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SCHEDULE == 1:
            split = tl.program_id(1)
            per_split = tl.cdiv(steps, split_k)
            step_begin = split * per_split
            step_end = tl.minimum(step_begin + per_split, steps)
            acc = _accumulate(
                acc,
                x_in,
                w_in,
                pid_m,
                pid_n,
                step_begin,
                step_end,
                M,
                N,
                K,
                stride_xm,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
                USE_TMA,
                IEEE_DOT,
                INTERPRETED,
            )
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            rows = (split * M + offs_m).to(tl.int64)
            tl.store(scratch_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
        else:
            acc = _accumulate(
                acc,
                x_in,
                w_in,
                pid_m,
                pid_n,
                0,
                steps,
                M,
                N,
                K,
                stride_xm,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
                USE_TMA,
                IEEE_DOT,
                INTERPRETED,
            )
            _store_tile(acc, out_ptr, bias_ptr, pid_m, pid_n, M, N, stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _reduce_splits_kernel(
    scratch_ptr, bias_ptr, out_ptr, M, N, split_k, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, WAIT: tl.constexpr
):
    """out = sum over splits of the float32 partials [split_k, M, N], in split order (+ bias)."""
    if WAIT:
        gdc_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N
    valid = offs < size
    y = tl.load(scratch_ptr + offs, mask=valid, other=0.0)
    split = 1
    while split < split_k:  # fixed order: bit-identical run to run (while: the interpreter's range()
        y += tl.load(scratch_ptr + split * size + offs, mask=valid, other=0.0)  # takes no tensor bounds)
        split += 1
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs % N, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["M", "programs"])
def _stream_k_fixup_kernel(
    scratch_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Each tile that several stream-K programs shared: their pieces summed in program order."""
    if WAIT:
        gdc_wait()
    tile = tl.program_id(0)
    part = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    units = (num_pid_m * num_pid_n).to(tl.int64) * steps
    first_unit = tile.to(tl.int64) * steps
    # The programs holding the tile's first and last step (start(p) = p U // P, U >= P).
    p_first = ((first_unit + 1) * programs - 1) // units
    p_last = ((first_unit + steps) * programs - 1) // units
    if p_first != p_last:  # else one program owned the whole tile and stored it
        local = (part * ROWS + tl.arange(0, ROWS))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc = tl.load(scratch_ptr + (p_first * 2 + 1) * (BLOCK_M * BLOCK_N) + local)
        p = p_first + 1
        while p <= p_last:  # program order: bit-identical run to run
            acc += tl.load(scratch_ptr + (p * 2) * (BLOCK_M * BLOCK_N) + local)
            p += 1
        pid_m, pid_n = _tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + part * ROWS + tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(
            out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


_INTERPRETED = isinstance(_batched_linear_kernel, InterpretedFunction)


@functools.cache
def _is_sm90_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _hopper(device: torch.device) -> bool:
    if device.type != "cuda" or _INTERPRETED:
        return False
    return _is_sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())


def _tma_available(device: torch.device) -> bool:
    """TMA descriptors for the operands: sm_90 and later (tests force it under the interpreter)."""
    return _hopper(device)


def _tma_ready(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1


# --- python entry points ----------------------------------------------------------------------


def use_batched_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether batched_linear can serve F.linear(x, weight): CUDA tensors on sm_90 or later (what
    the heuristic is tuned for: its 192 KB of operand buffers exceed an A100's shared memory), at
    least one row of x, a supported dtype shared by both, a contiguous 2-D weight and unit-stride
    rows of x. Whether it is faster than cuBLAS for a shape is the caller's call (bench_gemm)."""
    if not (x.is_cuda and weight.is_cuda and x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype):
        return False
    if not _hopper(x.device):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    return x.stride(-1) == 1 and weight.shape[1] > 0 and x.numel() // weight.shape[1] >= 1


def launch_grid(config: GemmLaunchConfig, m: int, n: int, k: int) -> tuple[tuple[int, ...], int]:
    """(grid of the GEMM kernel, stream-K programs actually used: the config's, capped at the units)."""
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if config.stream_k:
        programs = min(config.stream_k, tiles * triton.cdiv(k, config.block_k))
        return (programs,), programs
    if config.split_k > 1:
        return (tiles, config.split_k), 0
    return (tiles,), 0


def batched_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: GemmLaunchConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] (any number of rows), weight [N, K] contiguous.

    Float32 accumulation, one rounding to x's dtype; deterministic. config overrides the
    heuristic (benchmarks, tests).
    """
    return _batched_linear(x, weight, bias, out, config, warmup=False)


def compile_batched_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: GemmLaunchConfig | None = None,
) -> None:
    """Compile what batched_linear(x, weight, bias, out, config=config) would launch, launching
    nothing (Triton's warmup; inside triton's AsyncCompileMode the compiles run in its executor)."""
    _batched_linear(x, weight, bias, out, config, warmup=True)


def _launch(kernel, grid, warmup: bool, *args, **kwargs) -> None:
    if warmup:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def _batched_linear(x, weight, bias, out, config, *, warmup: bool) -> torch.Tensor:
    n, k = weight.shape
    assert x.shape[-1] == k and weight.is_contiguous() and weight.dtype == x.dtype, (x.shape, weight.shape)
    assert x.dtype in SUPPORTED_DTYPES and k > 0, (x.dtype, k)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    assert x2.stride(-1) == 1, "rows of x must be unit-stride"
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1), bias.shape
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype and out.is_contiguous(), (out.shape, out.dtype)
    if m == 0 or n == 0:
        return out
    if config is None:
        config = choose_batched_linear_config(m, n, k, _device_sm_count(x.device), x.element_size())
    out2 = out.view(m, n)
    hopper = _hopper(x.device)
    use_tma = config.use_tma and _tma_available(x.device) and _tma_ready(x2) and _tma_ready(weight)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_in = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [config.block_m, config.block_k])
        w_in = TensorDescriptor(weight, [n, k], [k, 1], [config.block_n, config.block_k])
    else:
        x_in, w_in = x2, weight
    grid, programs = launch_grid(config, m, n, k)
    schedule = 2 if programs else 1 if config.split_k > 1 else 0
    scratch = None
    if schedule == 1:
        scratch = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    elif schedule == 2:
        scratch = torch.empty((2 * programs, config.block_m, config.block_n), dtype=torch.float32, device=x.device)
    pdl = config.pdl and hopper and schedule != 0
    _launch(
        _batched_linear_kernel,
        grid,
        warmup,
        x_in,
        w_in,
        weight if bias is None else bias,
        out2,
        out2 if scratch is None else scratch,
        m,
        n,
        k,
        x2.stride(0),
        out2.stride(0),
        config.split_k,
        max(programs, 1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        SCHEDULE=schedule,
        EVEN_K=k % config.block_k == 0,
        HAS_BIAS=bias is not None,
        USE_TMA=use_tma,
        IEEE_DOT=x.dtype == torch.float32,
        LAUNCH_DEPENDENTS=pdl,
        INTERPRETED=_INTERPRETED,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    bias_arg = scratch if bias is None else bias
    pdl_kwargs = {"launch_pdl": True} if pdl else {}
    if schedule == 1:
        _launch(
            _reduce_splits_kernel,
            (triton.cdiv(m * n, REDUCE_BLOCK),),
            warmup,
            scratch,
            bias_arg,
            out2,
            m,
            n,
            config.split_k,
            BLOCK=REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
            WAIT=pdl,
            num_warps=4,
            **pdl_kwargs,
        )
    elif schedule == 2:
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        rows = min(FIXUP_ROWS, config.block_m)
        _launch(
            _stream_k_fixup_kernel,
            (tiles, config.block_m // rows),
            warmup,
            scratch,
            bias_arg,
            out2,
            m,
            n,
            k,
            out2.stride(0),
            programs,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            ROWS=rows,
            HAS_BIAS=bias is not None,
            WAIT=pdl,
            num_warps=4,
            **pdl_kwargs,
        )
    return out
