"""Strata's one-shot all-reduce over CUDA IPC (kernels/one_shot_all_reduce.py,
tensor_parallel/ipc_all_reduce.py) between two processes, on one GPU (CUDA IPC works within a
device, so this needs no second GPU) or on a GPU each when there are two: exact sums eagerly and in
CUDA graphs, calls of changing sizes, a chain of dependent launches around it, and the abort word
releasing a rank whose peer never comes.

    python -m pytest tests/gpu/test_one_shot_all_reduce_gpu.py -q
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
import time
import traceback

import pytest
import torch

from strata.launcher import free_port
from strata.mps import MpsDaemon
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()
PLACEMENTS = [
    pytest.param(False, id="one-gpu"),
    pytest.param(True, id="two-gpus", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
]


def _on_ranks(fn, spread: bool, size: int = 2, timeout: float = 90.0) -> list:
    """fn(rank, one_shot) in a process per rank: cuda:rank if spread, else all on cuda:0 under an
    MPS server of their own. Without MPS one GPU time-slices the two processes, and a graph's
    spinning kernel was never switched out for its peer's (it hung; eager launches were)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    mps = None if spread else MpsDaemon()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, size, port, spread, results)) for rank in range(size)]
    saved = dict(os.environ)
    try:
        if mps is not None:
            mps.start()
            os.environ.update(mps.env)  # what the children start with
        for p in procs:
            p.start()
        os.environ.clear()
        os.environ.update(saved)
        out = {}
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout)
            assert ok, f"rank {rank} failed:\n{value}"
            out[rank] = value
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for p in procs:
            if p.pid is not None:
                p.join(30)
            if p.is_alive():
                p.kill()
        if mps is not None:
            mps.stop()
    return [out[r] for r in range(size)]


def _rank_main(fn, rank: int, size: int, port: int, spread: bool, results) -> None:
    try:
        import faulthandler

        faulthandler.dump_traceback_later(60, exit=True)  # a hung rank says where
        from strata.services.worker.tensor_parallel.ipc_all_reduce import IpcAllReduce

        device = torch.device("cuda", rank if spread else 0)
        torch.cuda.set_device(device)
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
        )
        # 4 MiB of bf16: past MAX_PROGRAMS blocks (and rows of 4,096), so the looping launches run too.
        one_shot = IpcAllReduce(store, rank, size, 1, device, torch.bfloat16, max_bytes=4 << 20)
        one_shot.keys = IpcAllReduce(store, rank, size, 1, device, torch.int64, max_bytes=16 * 1024, kind="max")
        one_shot.norm = IpcAllReduce(store, rank, size, 1, device, torch.bfloat16, max_bytes=4 << 20, kind="norm")
        one_shot.store = store
        value = fn(rank, one_shot)
        torch.cuda.synchronize()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _sums(rank, one_shot):
    """Integer-valued inputs (exact in bf16): sizes that miss programs, then repeat them, so each
    program's sequence numbers and both buffer parities are exercised, with messages past
    MAX_PROGRAMS blocks (a launch that loops) between them; then a graph."""
    device = one_shot.buffer.device
    got = []
    for n in (1, 1000, 4096, 65536, 4096, 3, 1 << 20, 4096, 300 * 1024 + 5, 300 * 1024 + 5, 4096, 4096):
        x = (torch.arange(n, device=device) % 7 + rank * 10).to(torch.bfloat16)
        assert one_shot(x)
        want = (torch.arange(n, device=device) % 7) * 2 + 10
        got.append(bool(torch.equal(x.float(), want.float())))
    assert not one_shot(torch.zeros((2 << 20) + 1, device=device, dtype=torch.bfloat16))  # past its buffer
    assert not one_shot(torch.zeros(8, device=device))  # float32: NCCL's
    static = torch.zeros(4096, device=device, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(3):  # three in a row: 1 + 2 ranks' inputs, doubled twice
            one_shot(static)
    replays = []
    for step in range(4):
        static.fill_(float(rank + step))
        graph.replay()
        replays.append(static[[0, -1]].tolist())
    return got, replays


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_sums_are_exact_eagerly_and_in_a_graph(spread):
    for got, replays in _on_ranks(_sums, spread):
        assert all(got), got
        assert replays == [[v * 4.0, v * 4.0] for v in (1, 3, 5, 7)]


def _chained(rank, one_shot):
    """GEMV, all-reduce, GEMV as the decode chain runs them (dependent launches), in a graph."""
    from strata.kernels.decode_linear import plain_linear

    device = one_shot.buffer.device
    gen = torch.Generator(device="cpu").manual_seed(rank)
    w1 = (torch.randn(4096, 2048, generator=gen) / 64).to(device=device, dtype=torch.bfloat16)
    w2 = (torch.randn(1024, 4096, generator=torch.Generator(device="cpu").manual_seed(9)) / 64).to(
        device=device, dtype=torch.bfloat16
    )
    x = torch.randn(1, 2048, generator=gen).to(device=device, dtype=torch.bfloat16)
    partial = plain_linear(x, w1, None)
    reference = partial.clone()
    one_shot(reference)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = plain_linear(x, w1, None)
        one_shot(y)
        z = plain_linear(y, w2, None)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    want = plain_linear(reference, w2, None)
    # (Lists: a tensor would travel as a handle to this process's memory, gone once it exits.)
    return y.float().tolist(), z.float().tolist(), torch.equal(y, reference), torch.equal(z, want)


def _maxima(rank, one_shot):
    """The draw's maximum over packed int64 keys (negative ones and ones past 2^53 included), eagerly
    for 1 and 2,048 rows and in a graph for 16."""
    device, maxima = one_shot.buffer.device, one_shot.keys
    got = []
    for n in (1, 2048, 16):
        keys = torch.arange(n, dtype=torch.int64, device=device) * (1 << 40) * (1 if rank else -1) + rank
        want = torch.arange(n, dtype=torch.int64, device=device) * (1 << 40) + 1  # rank 1's, always larger
        want[0] = 1
        assert maxima(keys)
        got.append(bool(torch.equal(keys, want)))
    static = torch.zeros(16, dtype=torch.int64, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        maxima(static)
    for step in range(3):
        static.fill_(-(1 << 60) + 7 * step + rank)
        graph.replay()
        got.append(bool(static.eq(-(1 << 60) + 7 * step + 1).all()))
    return got


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_the_draws_maximum_over_int64_keys(spread):
    for got in _on_ranks(_maxima, spread):
        assert all(got), got


def _normed(rank, one_shot):
    """The all-reduce fused with the residual add and RMSNorm against the one-shot followed by
    rmsnorm.py's fused_add_rms_norm: the same bits, for several batches, without a residual, in
    place, and in a graph."""
    from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    device, hidden, eps = one_shot.buffer.device, 4096, 1e-5
    common = torch.Generator(device="cpu").manual_seed(5)  # the same residual and weight on every rank
    weight = torch.randn(hidden, generator=common).to(device=device, dtype=torch.bfloat16)
    own = torch.Generator(device="cpu").manual_seed(rank)
    same = []
    for rows in (1, 16, 30, 256 + 7, 16):  # 263 rows: a launch that loops
        x = torch.randn(rows, hidden, generator=own).to(device=device, dtype=torch.bfloat16)
        residual = torch.randn(rows, hidden, generator=common).to(device=device, dtype=torch.bfloat16)
        summed = x.clone()
        assert one_shot(summed)
        want_out, want_res = fused_add_rms_norm(summed, residual, weight, eps)
        out, res = one_shot.norm.add_rms_norm(x.clone(), residual.clone(), weight, eps)
        same.append(torch.equal(out, want_out) and torch.equal(res, want_res))
        in_place = residual.clone()
        out, res = one_shot.norm.add_rms_norm(x.clone(), in_place, weight, eps, residual_out=in_place)
        same.append(res is in_place and torch.equal(out, want_out) and torch.equal(in_place, want_res))
        out, res = one_shot.norm.add_rms_norm(x.clone(), None, weight, eps)
        same.append(torch.equal(out, rms_norm(summed, weight, eps)) and torch.equal(res, summed))
    assert (
        one_shot.norm.add_rms_norm(torch.zeros(4, 2048, device=device, dtype=torch.bfloat16), None, weight, eps) is None
    )
    x = torch.randn(16, hidden, generator=own).to(device=device, dtype=torch.bfloat16)
    residual = torch.randn(16, hidden, generator=common).to(device=device, dtype=torch.bfloat16)
    static_x, static_res = x.clone(), residual.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out, _ = one_shot.norm.add_rms_norm(static_x, static_res, weight, eps, residual_out=static_res)
    for _ in range(2):
        static_x.copy_(x)
        static_res.copy_(residual)
        graph.replay()
    summed = x.clone()
    one_shot(summed)
    want_out, want_res = fused_add_rms_norm(summed, residual, weight, eps)
    same.append(torch.equal(out, want_out) and torch.equal(static_res, want_res))
    return same, want_out.float().sum().item()


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_the_all_reduce_fused_with_the_add_and_norm_gives_the_unfused_bits(spread):
    (same0, total0), (same1, total1) = _on_ranks(_normed, spread)
    assert all(same0) and all(same1), (same0, same1)
    assert total0 == total1  # every rank the same normalised rows


def _layers(rank, one_shot):
    """A rank of a two-way small Llama (bf16) through its unfused layers, a prefill and a decode
    batch of three, with gloo's all-reduces and then with the one-shots (o_proj's and down's sums
    fused into the norms after them): the same logits."""
    from strata.services.worker.model.attention import allocate_kv_cache
    from strata.services.worker.model.triton_backend import TritonAttentionBackend
    from strata.services.worker.model.weights import load_shard
    from strata.services.worker.sampling.sharded import ShardedSampler
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from tests.gpu_shards import small_llama
    from tests.paged_inputs import SequenceChunk, build_step_inputs

    device = one_shot.buffer.device
    group = TensorParallelGroup(rank, 2, device, timeout=60.0, all_reduce="gloo")
    group.form(one_shot.store, 3)
    shard, local = load_shard(
        "dummy",
        0,
        1,
        torch.bfloat16,
        device,
        dummy_config=small_llama(),
        attn_backend=TritonAttentionBackend(),
        tp=group,
    )
    shard.decode_chain = False
    steps = [
        [SequenceChunk(list(range(3, 40)), 0, [0, 1, 2]), SequenceChunk(list(range(50, 70)), 0, [3, 4])],
        [SequenceChunk([7], 37, [0, 1, 2]), SequenceChunk([9], 20, [3, 4])],
    ]
    gather = ShardedSampler(group, shard.vocab).all_gather_rows
    logits = []
    for fused in (False, True):
        group.one_shot, group.one_shot_norm = (one_shot, one_shot.norm) if fused else (None, None)
        caches = allocate_kv_cache(len(shard.layers), 8, 16, local.num_key_value_heads, 64, torch.bfloat16, device)
        for chunks in steps:
            inputs = build_step_inputs(chunks, block_size=16, device=device)
            hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
            logits.append(gather(shard.compute_logits(hidden, residual)).float().cpu().tolist())
    sequences = one_shot.norm.sequences[:4].tolist()  # the fused launches ran
    group.abort("done")
    return logits, sequences


def test_the_layers_with_fused_all_reduces_give_gloos_logits():
    for logits, sequences in _on_ranks(_layers, spread=False):  # (gloo's ranks share a GPU)
        prefill, decode, fused_prefill, fused_decode = logits
        assert sequences[0] > 0
        assert fused_prefill == prefill and fused_decode == decode


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_a_chain_of_dependent_launches_around_it(spread):
    (y0, z0, same0, after0), (y1, z1, same1, after1) = _on_ranks(_chained, spread)
    assert same0 and same1 and y0 == y1  # every rank the same sum, the eager one's
    assert after0 and after1 and z0 == z1  # the GEMV after it read the finished sum


def _abandoned(rank, one_shot):
    """Rank 1 never calls (but stays up: rank 0 writes into its buffer): rank 0's kernel waits
    until its abort word is set, from another thread as TensorParallelGroup.abort sets it."""
    if rank == 1:
        time.sleep(5.0)
        return None
    from strata.kernels.one_shot_all_reduce import one_shot_all_reduce

    x = torch.ones(4096, device=one_shot.buffer.device, dtype=torch.bfloat16)
    started = time.monotonic()
    threading.Timer(1.0, one_shot.abort).start()
    one_shot_all_reduce(x, one_shot.exchange)  # (the launcher itself: one_shot(x) declines once aborted)
    torch.cuda.synchronize()
    return time.monotonic() - started, one_shot(x)


@pytest.mark.parametrize("spread", PLACEMENTS)
def test_the_abort_word_releases_a_rank_whose_peer_never_comes(spread):
    (waited, called_after), _ = _on_ranks(_abandoned, spread)
    assert 0.9 < waited < 30  # released by the abort, not before it
    assert called_after is False  # an aborted one-shot takes no more messages
