"""The IPC one-shot's launchers (kernels/one_shot_all_reduce.py) without a GPU: what each kernel is
given. The kernels themselves need two processes on GPUs: tests/gpu/test_one_shot_all_reduce_gpu.py."""

from __future__ import annotations

import torch

import strata.kernels.one_shot_all_reduce as one_shot


class _Recorded:
    """Stands in for a Triton kernel: kernel[grid](*args, **kwargs) is recorded."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _exchange(world: int, rank: int, capacity: int) -> one_shot.Exchange:
    buffers = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    sequences, abort = torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return one_shot.Exchange(buffers, flags, sequences, abort, capacity, rank)


def test_every_ranks_buffers_in_rank_order_the_rest_this_ranks(monkeypatch):
    kernel = _Recorded()
    monkeypatch.setattr(one_shot, "_one_shot_all_reduce_kernel", kernel)
    exchange = _exchange(3, rank=1, capacity=4096)
    buffers, flags = exchange.buffers, exchange.flags
    x = torch.zeros(3000, dtype=torch.bfloat16)
    one_shot.one_shot_all_reduce(x, exchange)
    ((grid, args, kwargs),) = kernel.calls
    assert grid == (3,)  # 1,024 bf16 a program
    pointers = args[1:17]
    assert pointers[:3] == tuple(buffers) and all(p is buffers[1] for p in pointers[3:8])
    assert pointers[8:11] == tuple(flags) and all(p is flags[1] for p in pointers[11:16])
    assert args[17] is exchange.sequences and args[18] == exchange.abort_word.data_ptr() and args[19] == 3000
    assert kwargs["RANK"] == 1 and kwargs["WORLD"] == 3 and kwargs["BLOCK"] == 1024 and not kwargs["MAX"]


def test_the_norm_variant_runs_a_program_a_row(monkeypatch):
    kernel = _Recorded()
    monkeypatch.setattr(one_shot, "_one_shot_all_reduce_norm_kernel", kernel)
    exchange = _exchange(2, rank=0, capacity=8192)
    buffers, flags = exchange.buffers, exchange.flags
    x, residual = torch.zeros(5, 1000, dtype=torch.bfloat16), torch.zeros(5, 1000, dtype=torch.bfloat16)
    weight, out = torch.ones(1000, dtype=torch.bfloat16), torch.empty(5, 1000, dtype=torch.bfloat16)
    one_shot.one_shot_all_reduce_add_rms_norm(x, residual, weight, 1e-6, False, out, residual, exchange)
    ((grid, args, kwargs),) = kernel.calls
    assert grid == (5,)
    assert args[:5] == (x, residual, weight, out, residual)  # residual_out may be residual: in place
    assert args[5:7] == tuple(buffers) and args[13:15] == tuple(flags)
    assert kwargs["HIDDEN"] == 1000 and kwargs["BLOCK"] == 1024 and kwargs["ADD_RESIDUAL"]
    assert kwargs["num_warps"] == 2  # rmsnorm.py's, for the same order of the sum of squares
