"""The copy-engine all-reduce of two ranks (tensor_parallel/copy_all_reduce.py,
kernels/copy_all_reduce.py) between two processes, on one GPU (CUDA IPC, its copies and the stream
memory operations work within a device) or on a GPU each when there are two: exact sums over
messages of both parities, in pieces and past its buffer, the fused add and norm giving the
one-shot-then-norm bits, declining a graph capture, and the host's release of a rank whose peer
never comes.

    python -m pytest tests/gpu/test_copy_all_reduce_gpu.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.gpu.test_one_shot_all_reduce_gpu import PLACEMENTS, _on_ranks
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()


def _copy_engine(rank, one_shot, max_bytes: int = 4 << 20):
    from strata.services.worker.tensor_parallel.copy_all_reduce import CopyEngineAllReduce

    return CopyEngineAllReduce(one_shot.store, rank, 9, one_shot.buffer.device, torch.bfloat16, max_bytes=max_bytes)


def _sums(rank, one_shot):
    """Integer-valued inputs (exact in bf16) of 0.5 to 20 MiB through a 16 MiB buffer: one piece,
    several (4 MiB each at least), or messages of the buffer's size; repeated, so both parities
    serve; then a graph capture, which it declines."""
    engine = _copy_engine(rank, one_shot, max_bytes=16 << 20)
    device = engine.recv.device
    got = []
    for n in (1 << 18, 3 << 20, 10 << 20 | 77, 1 << 18, 4 << 20):
        x = (torch.arange(n, device=device) % 7 + rank * 10).to(torch.bfloat16)
        assert engine(x)
        want = (torch.arange(n, device=device) % 7) * 2 + 10
        got.append(bool(torch.equal(x.float(), want.float())))
    graph = torch.cuda.CUDAGraph()
    static = torch.zeros(1 << 18, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        declined = not engine(static)
    return got, declined, engine.calls


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_sums_are_exact_over_both_parities_and_in_parts(spread):
    for got, declined, calls in _on_ranks(_sums, spread):
        assert all(got), got
        assert declined
        assert calls == 1 + 1 + 2 + 1 + 1  # 20 MiB in two messages


def _normed(rank, one_shot):
    """The copy engine's add and norm against the one-shot's sum followed by rmsnorm.py's
    fused_add_rms_norm: the same bits, for rows in one piece, in pieces and in messages, without a
    residual and in place."""
    from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    engine = _copy_engine(rank, one_shot, max_bytes=16 << 20)
    device, hidden, eps = engine.recv.device, 4096, 1e-5
    common = torch.Generator(device="cpu").manual_seed(5)  # the same residual and weight on every rank
    weight = torch.randn(hidden, generator=common).to(device=device, dtype=torch.bfloat16)
    own = torch.Generator(device="cpu").manual_seed(rank)
    same = []
    for rows in (300, 1100, 2500):  # one piece; two; a message of four pieces (2,048 rows), then one
        x = torch.randn(rows, hidden, generator=own).to(device=device, dtype=torch.bfloat16)
        residual = torch.randn(rows, hidden, generator=common).to(device=device, dtype=torch.bfloat16)
        summed = x.clone()
        for part in summed.split(256):  # (the one-shot's buffer holds 4 MiB)
            assert one_shot(part)
        want_out, want_res = fused_add_rms_norm(summed, residual, weight, eps)
        out, res = engine.add_rms_norm(x.clone(), residual.clone(), weight, eps)
        same.append(torch.equal(out, want_out) and torch.equal(res, want_res))
        in_place = residual.clone()
        out, res = engine.add_rms_norm(x.clone(), in_place, weight, eps, residual_out=in_place)
        same.append(res is in_place and torch.equal(out, want_out) and torch.equal(in_place, want_res))
        out, res = engine.add_rms_norm(x.clone(), None, weight, eps)
        same.append(torch.equal(out, rms_norm(summed, weight, eps)) and torch.equal(res, summed))
    return same, want_out.float().sum().item()


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_the_add_and_norm_give_the_one_shot_then_norm_bits(spread):
    (same0, total0), (same1, total1) = _on_ranks(_normed, spread)
    assert all(same0) and all(same1), (same0, same1)
    assert total0 == total1


def _abandoned(rank, one_shot):
    """Rank 1 never calls (but stays up): rank 0's stream waits until abort() stores the released
    value into its words from another thread, as TensorParallelGroup.abort calls it."""
    engine = _copy_engine(rank, one_shot)
    if rank == 1:
        time.sleep(5.0)
        return None
    x = torch.ones(1 << 20, device=engine.recv.device, dtype=torch.bfloat16)
    started = time.monotonic()
    threading.Timer(1.0, engine.abort).start()
    assert engine(x)
    torch.cuda.synchronize()
    return time.monotonic() - started, engine(x)


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_the_host_releases_a_rank_whose_peer_never_comes(spread):
    (waited, called_after), _ = _on_ranks(_abandoned, spread)
    assert 0.9 < waited < 30  # released by the abort, not before it
    assert called_after is False  # an aborted all-reduce takes no more messages
