"""Tensor parallelism on two GPUs (skipped with fewer; the tests marked one-gpu-gloo put both ranks
on one GPU with gloo's collectives, eagerly): the rank group's NCCL collectives eager
and captured in a CUDA graph, the symmetric-memory one-shot against NCCL (the same bits), the
sampler's draw over vocabulary slices in a graph against the whole rows' kernel, and through real
clusters: greedy tokens equal HF's at T = 2 (float32), every mode's tokens equal T = 1's, and a
rank killed (NCCL's abort path) or hung mid-stream leaves no GPU waiting: the stage is rebuilt and
every request resumes with the tokens of an uninterrupted run.

    python -m pytest tests/gpu/test_tensor_parallel_gpu.py -q
"""

from __future__ import annotations

import datetime
import multiprocessing
import pickle
import signal
import threading
import time
import traceback

import pytest
import torch

from strata.launcher import free_port
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# Where the two ranks run: a GPU each with NCCL (and CUDA graphs), or both on one GPU with gloo's
# collectives, eagerly (NCCL refuses two ranks on one GPU): one GPU checks the sharded model, the
# sampler's slices and a stage's faults on its kernels, the graphs and NCCL need two.
PLACEMENTS = [
    pytest.param("nccl", marks=two_gpus, id="two-gpus"),
    pytest.param("ipc", marks=two_gpus, id="two-gpus-ipc"),  # Strata's one-shot: no NCCL in a batch-1 step
    pytest.param("gloo", id="one-gpu-gloo"),
]


def test_one_shot_forms_and_sums_in_place_on_one_rank():
    """The symmetric-memory one-shot on one GPU (a group of one): it forms with this torch, and sums
    in place eagerly and in a graph. Its two-rank sums are test_collectives_eager_and_in_a_graph's."""
    from strata.services.worker.tensor_parallel.symm_mem import SymmetricMemoryAllReduce
    from strata.services.worker.transport.distributed_transport import abort_group

    device = torch.device("cuda", torch.cuda.current_device())
    store = torch.distributed.TCPStore(
        "127.0.0.1", free_port(), world_size=1, is_master=True, timeout=datetime.timedelta(seconds=60)
    )
    backend = torch.distributed.ProcessGroupNCCL(torch.distributed.PrefixStore("tp/", store), 0, 1)
    shot = SymmetricMemoryAllReduce(backend, store, 0, 1, 7, device, torch.bfloat16)
    x = torch.randn(3000, device=device, dtype=torch.bfloat16)
    want = x.clone()
    assert shot(x) and torch.equal(x, want)
    assert not shot(x.float()) and not shot(torch.zeros(10**6, device=device, dtype=torch.bfloat16))
    assert not shot(x[1:])  # misaligned for torch's kernel: NCCL's
    static = torch.zeros(4096, device=device, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        shot(static)
    for value in (1.0, 2.5):
        static.fill_(value)
        graph.replay()
        assert static.eq(value).all()
    abort_group(backend, "test")


def test_slice_draws_combine_to_the_whole_rows_draw_on_one_gpu():
    """The compiled kernel on each slice (vocab_offset, packed keys) and their max against the
    whole rows' draw, bf16 logits of a Llama-3 vocabulary, both launch shapes: no second GPU."""
    from strata.kernels.gumbel_sampling import gumbel_argmax, unpack_draw_tokens
    from strata.services.worker.sampling.sampler import SamplingTensors
    from strata.services.worker.tensor_parallel.vocab import VocabShard

    vocab_size = 128_256
    for n in (3, 200):
        gen = torch.Generator(device="cpu").manual_seed(n)
        logits = (torch.randn(n, vocab_size, generator=gen) * 2).to(device="cuda", dtype=torch.bfloat16)
        logits[0, [7, 100_000]] = 30.0
        st = SamplingTensors.build(
            temperature=[0.0] + [0.8] * (n - 1),
            top_k=[0] * n,
            top_p=[1.0] * n,
            min_p=[0.0] * n,
            seeds=list(range(n)),
            positions=[3] * n,
            num_logprobs=-1,
            device="cuda",
        )
        args = (st.seeds, st.positions, st.inv_temperature, st.greedy, None, False)
        whole = gumbel_argmax(logits, *args)[0]
        assert whole[0].item() == 7
        for size in (2, 4):
            keys = []
            for rank in range(size):
                v = VocabShard(vocab_size, rank, size)
                k = torch.empty(n, dtype=torch.int64, device="cuda")
                gumbel_argmax(logits[:, v.offset : v.offset + v.valid], *args, vocab_offset=v.offset, keys=k)
                keys.append(k)
            assert torch.equal(unpack_draw_tokens(torch.stack(keys).amax(dim=0)), whole), (n, size)


def _on_ranks(fn, size: int = 2, timeout: float = 300.0, all_reduce: str = "symm-mem") -> list:
    """fn(rank, group) in a process per rank (cuda:rank; every rank on cuda:0 with gloo's
    collectives), their results in rank order."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, size, port, results, all_reduce)) for rank in range(size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout)
            assert ok, f"rank {rank} failed:\n{value}"
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(size)]


def _rank_main(fn, rank: int, size: int, port: int, results, all_reduce: str) -> None:
    try:
        from strata.services.worker.tensor_parallel.group import TensorParallelGroup
        from strata.stage_links import set_nccl_environment

        set_nccl_environment()
        device = torch.device("cuda", 0 if all_reduce == "gloo" else rank)
        torch.cuda.set_device(device)
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
        )
        group = TensorParallelGroup(rank, size, device, timeout=60.0, all_reduce=all_reduce, dtype=torch.bfloat16)
        group.form(store, 1)
        value = fn(rank, group)
        torch.cuda.synchronize()
        # By value: a tensor put as it is travels as a file descriptor that the main process can
        # no longer fetch once this process has exited.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _captured_all_reduce_replays(rank, group, dtype) -> list:
    """A graph of one all-reduce of 4,096 `dtype` values, replayed three times over new inputs:
    the first and last sums of each replay."""
    static = torch.zeros(4096, device=group.device, dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        group.all_reduce_(static)
    replays = []
    for step in range(3):
        static.fill_(float(rank + step))
        graph.replay()
        replays.append(static[[0, -1]].tolist())
    return replays


def _collectives(rank, group):
    device = group.device
    x = torch.full((5, 7), float(rank + 1), device=device)
    group.all_reduce_(x)
    keys = torch.tensor([rank, -rank, 10 * rank], dtype=torch.int64, device=device)
    group.all_reduce_max_(keys)
    gathered = group.all_gather(torch.arange(3, device=device) + 100 * rank)
    # Captured: the graph's all-reduce (NCCL's: float32) sums what its input holds at each replay.
    replays = _captured_all_reduce_replays(rank, group, torch.float32)
    # The one-shot (bf16, small) and NCCL give the same bits.
    rng = torch.Generator(device="cpu").manual_seed(rank)
    data = torch.randn(3000, generator=rng).to(device=device, dtype=torch.bfloat16)
    one = data.clone()
    assert group.one_shot is not None and group.one_shot(one)
    nccl = data.clone()
    group._run("all-reduce", lambda pg: pg.allreduce([nccl]))
    # The one-shot (bf16) in place inside a graph, as a decode step replays it.
    shot_replays = _captured_all_reduce_replays(rank, group, torch.bfloat16)
    return (
        x.sum().item(),
        keys.tolist(),
        gathered.tolist(),
        replays,
        torch.equal(one, nccl),
        one.float().sum().item(),
        shot_replays,
    )


@two_gpus
def test_collectives_eager_and_in_a_graph():
    a, b = _on_ranks(_collectives)
    assert a[0] == b[0] == 3.0 * 35
    assert a[1] == b[1] == [1, 0, 10]
    assert a[2] == b[2] == [[0, 1, 2], [100, 101, 102]]
    assert a[3] == b[3] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]
    assert a[4] and b[4] and a[5] == b[5]  # the one-shot equals NCCL, and every rank holds the same
    assert a[6] == b[6] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0]]  # the one-shot replayed in a graph


def _draws(rank, group):
    from strata.kernels.gumbel_sampling import gumbel_argmax
    from strata.services.worker.sampling.sampler import Sampler, SamplingTensors
    from strata.services.worker.sampling.sharded import ShardedSampler
    from strata.services.worker.tensor_parallel.vocab import VocabShard

    device, n, vocab_size = group.device, 24, 50_000
    gen = torch.Generator(device="cpu").manual_seed(0)  # the same logits on both ranks
    logits = (torch.randn(n, vocab_size, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
    logits[0, [5, 30_000]] = 20.0  # a greedy tie across the slices
    v = VocabShard(vocab_size, rank, 2)
    part = torch.full((n, v.local), 1e4, dtype=logits.dtype, device=device)  # padding would win if read
    part[:, : v.valid] = logits[:, v.offset : v.offset + v.valid]
    st = SamplingTensors.build(
        temperature=[0.0, 0.0] + [0.9] * (n - 2),
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        seeds=list(range(n)),
        positions=list(range(100, 100 + n)),
        num_logprobs=-1,
        device=device,
    )
    sharded = ShardedSampler(group, v)
    whole = gumbel_argmax(logits, st.seeds, st.positions, st.inv_temperature, st.greedy, None, False)[0]
    # In a graph, as the decode graphs draw, with the lookahead's store.
    kept = torch.zeros(n + 1, dtype=torch.int64, device=device)
    rows = torch.arange(n, device=device)
    static = part.clone()
    torch.cuda.synchronize()
    sharded.draw_unfiltered(static, st.seeds, st.positions, st.inv_temperature, st.greedy, store=(kept, rows))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = sharded.draw_unfiltered(
            static, st.seeds, st.positions, st.inv_temperature, st.greedy, store=(kept, rows)
        )
    kept.zero_()
    graph.replay()
    in_graph = torch.equal(tokens, whole) and torch.equal(kept[:n], whole)
    # Eager, with filters and logprobs, against the Sampler on the whole rows.
    filtered = SamplingTensors.build(
        temperature=[0.0] + [1.0] * (n - 1),
        top_k=[0, 40, 5] * (n // 3),
        top_p=[1.0, 0.9, 1.0] * (n // 3),
        min_p=[0.0, 0.0, 0.05] * (n // 3),
        seeds=list(range(n)),
        positions=[7] * n,
        num_logprobs=3,
        device=device,
    )
    got, want = sharded(part, filtered), Sampler()(logits, filtered)
    eager = torch.equal(got.token_ids, want.token_ids) and torch.equal(got.top_ids, want.top_ids)
    close = (got.logprobs - want.logprobs).abs().max().item()
    return whole[0].item(), in_graph, eager, close


@two_gpus
def test_the_draw_over_slices_is_the_whole_rows_draw_in_a_graph_and_eagerly():
    for first, in_graph, eager, close in _on_ranks(_draws):
        assert first == 5 and in_graph and eager and close < 1e-3


# ------------------------------------------------------------------ through real clusters


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.cluster import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory, seed=23, arch="qwen2")


# A fixed KV cache: sized from an H200's memory, the tiny model's 131M blocks of 4 tokens took the
# scheduler 25 s to list at every cluster's start.
FLAGS = (
    *("--device", "cuda", "--dtype", "float32", "--num-kv-blocks", "8192"),
    *("--stage-recovery-timeout", "90", "--step-timeout", "30"),
)


@pytest.mark.parametrize("all_reduce", PLACEMENTS)
def test_greedy_equals_hf_and_every_mode_equals_one_rank(model_dir, all_reduce):
    from strata.v1 import generate_pb2
    from tests.cluster import collect, hf_greedy, mixed_requests, run_all, running_cluster

    prompts = [[5, 17, 42, 99, 100, 7], list(range(30, 90))]
    outs = {}
    for size in ("1", "2"):
        flags = (*FLAGS, "--tensor-parallel-size", size, "--tensor-parallel-all-reduce", all_reduce)
        if all_reduce == "gloo":  # T = 1 eager too: the same kernels as the ranks run
            flags += ("--enforce-eager",)
        with running_cluster(model_dir, 1, *flags) as (cluster, client):
            greedy = [
                collect(
                    client.generate(
                        p, max_tokens=24, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=120
                    )
                )[0]
                for p in prompts
            ]
            threads, sampled, errors = run_all(client, mixed_requests(40)[:12])
            for t in threads:
                t.join()
            assert not errors
            outs[size] = (greedy, sampled)
    assert outs["2"][0] == hf_greedy(model_dir, prompts, [24, 24])
    assert outs["2"] == outs["1"]


@pytest.mark.parametrize("all_reduce", PLACEMENTS)
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rank_leaves_no_gpu_waiting_and_requests_resume_identically(model_dir, stop, all_reduce):
    from tests.cluster import mixed_requests, run_all, running_cluster, scheduler_stats
    from tests.test_recovery import hang_until_noticed, restart, worker

    work = mixed_requests(40)[:8]
    flags = (
        *FLAGS,
        "--tensor-parallel-size",
        "2",
        "--collective-timeout",
        "30",
        "--tensor-parallel-all-reduce",
        all_reduce,
    )
    with running_cluster(model_dir, 1, *flags) as (cluster, client):
        threads, plain, errors = run_all(client, work)
        for t in threads:
            t.join()
        assert not errors
        started = threading.Barrier(len(work) + 1)
        threads, resumed, errors = run_all(client, work, started)
        started.wait(timeout=60)
        victim = worker(cluster, "worker 0 rank 1")
        if stop == signal.SIGKILL:
            argv = victim.args
            victim.kill()
            victim.wait()
            time.sleep(1.0)
            restart(cluster, "worker 0 rank 1", argv)
        else:
            hang_until_noticed(cluster, victim, within=40)
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        assert resumed == plain
        assert scheduler_stats(cluster).used_kv_blocks == 0


def _chain_and_layers(rank, group):
    """A batch-1 decode through the decode chain and through the layers, at two ranks (bf16)."""
    from strata.services.worker.model.attention import allocate_kv_cache
    from strata.services.worker.model.triton_backend import TritonAttentionBackend
    from strata.services.worker.model.weights import load_shard
    from strata.services.worker.sampling.sharded import ShardedSampler
    from tests.gpu_shards import small_llama
    from tests.paged_inputs import SequenceChunk, build_step_inputs

    config = small_llama()
    shard, local = load_shard(
        "dummy",
        0,
        1,
        torch.bfloat16,
        group.device,
        dummy_config=config,
        attn_backend=TritonAttentionBackend(),
        tp=group,
    )
    assert shard._runs_decode_chain(torch.zeros(1, 1024, device=group.device, dtype=torch.bfloat16))
    prompt = [SequenceChunk(list(range(3, 40)), 0, [0, 1, 2])]
    decode = [SequenceChunk([7], 37, [0, 1, 2])]
    gather = ShardedSampler(group, shard.vocab).all_gather_rows
    senders = []  # what the chain's row-parallel GEMVs were given to send their rows into
    early_sender = group.early_sender
    group.early_sender = lambda *a: senders.append(early_sender(*a)) or senders[-1]
    logits = {}
    for chain in (False, True):
        shard.decode_chain = chain
        caches = allocate_kv_cache(4, 3, 16, local.num_key_value_heads, 64, torch.bfloat16, group.device)
        for chunks in (prompt, decode):
            inputs = build_step_inputs(chunks, block_size=16, device=group.device)
            hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
        logits[chain] = gather(shard.compute_logits(hidden, residual)).float().cpu()
    return logits[False], logits[True], any(s is not None for s in senders)


@pytest.mark.parametrize("all_reduce", PLACEMENTS)
def test_the_decode_chain_at_two_ranks_adds_the_residual_once(all_reduce):
    (plain, chain, sent), (plain1, chain1, sent1) = _on_ranks(_chain_and_layers, all_reduce=all_reduce)
    assert sent == sent1 == (all_reduce == "ipc")  # the GEMVs sent their rows early (ipc only)
    assert torch.equal(plain, plain1) and torch.equal(chain, chain1)  # every rank the same logits
    scale = plain.abs().max().item()
    torch.testing.assert_close(chain, plain, atol=0.03 * scale, rtol=0.0)
    assert torch.equal(chain.argmax(-1), plain.argmax(-1))
