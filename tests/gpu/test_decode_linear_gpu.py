"""The decode chain on a real GPU: its GEMVs in bf16 on the Llama-3.2-1B and 3.1-8B shapes
against float32 math on the same inputs (and no worse than cuBLAS's bf16 path), a chain captured
in a CUDA graph with programmatic dependent launches equal to its eager run, and a shard's
logits through the chain against the unfused kernels.

    python -m pytest tests/gpu/test_decode_linear_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels import decode_linear as dl  # noqa: E402
from strata.kernels.reference import rms_norm_reference, silu_and_mul_reference  # noqa: E402

SHAPES = [
    ("1b.qkv", 3072, 2048),
    ("1b.o_proj", 2048, 2048),
    ("1b.gate_up", 16384, 2048),
    ("1b.down", 2048, 8192),
    ("1b.lm_head", 128256, 2048),
    ("8b.qkv", 6144, 4096),
    ("8b.down", 4096, 14336),
    ("smol.down", 576, 1536),
]


def rand(*shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


def assert_like_cublas(got, want32, cublas):
    """bf16 output within the rounding of float32 math, and on average no further from it than cuBLAS."""
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want32, atol=3e-2, rtol=2e-2)
    error = (got.float() - want32).abs().mean().item()
    assert error <= 1.5 * (cublas.float() - want32).abs().mean().item() + 1e-4, error


@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
def test_fused_linears_bf16_model_shapes(name, n, k):
    m = 1
    w = rand(n, k, seed=n, scale=k**-0.5)
    x, residual, gate_up = rand(m, k, seed=1, scale=3.0), rand(m, k, seed=2), rand(m, 2 * k, seed=3, scale=2.0)
    norm_w = rand(k, seed=4).abs() + 0.5
    # x + residual then norm, fused, against the unfused bf16 path (rounded at the same points).
    got, summed = dl.norm_linear(x, w, None, norm_w, 1e-5, residual=residual)
    assert torch.equal(summed, x + residual)
    normed = rms_norm_reference(x + residual, norm_w, 1e-5)
    assert_like_cublas(got, F.linear(normed.float(), w.float()), F.linear(normed, w))
    act = silu_and_mul_reference(gate_up)
    assert_like_cublas(dl.silu_mul_linear(gate_up, w), F.linear(act.float(), w.float()), F.linear(act, w))
    out_residual = rand(m, n, seed=5)
    h = dl.linear_add_residual(gate_up, w, None, out_residual, silu_mul=True)
    assert_like_cublas(h, F.linear(act.float(), w.float()) + out_residual.float(), F.linear(act, w) + out_residual)


def test_chain_in_a_cuda_graph_equals_eager():
    """o_proj + residual -> gate_up with its norm -> down (SiLU) + residual -> qkv with its
    norm: dependent launches in a graph give the eager result bit for bit."""
    m, hidden, inter = 1, 2048, 8192
    o_w, gu_w = rand(hidden, hidden, seed=1, scale=hidden**-0.5), rand(2 * inter, hidden, seed=2, scale=hidden**-0.5)
    down_w, qkv_w = rand(hidden, inter, seed=3, scale=inter**-0.5), rand(3072, hidden, seed=4, scale=hidden**-0.5)
    n1, n2 = rand(hidden, seed=5).abs() + 0.5, rand(hidden, seed=6).abs() + 0.5
    attn, residual = rand(m, hidden, seed=7), rand(m, hidden, seed=8)

    def chain():
        h = dl.linear_add_residual(attn, o_w, None, residual)
        gate_up, _ = dl.norm_linear(h, gu_w, None, n1, 1e-5)
        h = dl.linear_add_residual(gate_up, down_w, None, h, silu_mul=True)
        return dl.norm_linear(h, qkv_w, None, n2, 1e-5)[0], h

    eager = chain()
    graph, captured = capture_graph(chain)
    for out in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


def test_shard_logits_through_the_chain():
    """A 4-layer bf16 Llama shard, a decode step of one token: the chain's logits against
    the unfused kernels' (both bf16: roundings differ only in summation order)."""
    from strata.services.worker.model.attention import allocate_kv_cache
    from strata.services.worker.model.shard import CausalLMShard
    from strata.services.worker.model.triton_backend import TritonAttentionBackend
    from tests.gpu_shards import small_llama
    from tests.paged_inputs import SequenceChunk, build_step_inputs

    config = small_llama()
    shard = CausalLMShard(config, 0, 4, device="cuda", dtype=torch.bfloat16, attn_backend=TritonAttentionBackend())
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in shard.named_parameters():
            scale = 0.02 if not name.endswith("norm.weight") else 0.0
            param.copy_(torch.randn(param.shape, device="cuda", generator=gen) * scale + (1.0 if scale == 0 else 0))
    assert shard._runs_decode_chain(torch.zeros(1, 1024, device="cuda", dtype=torch.bfloat16))
    assert not shard._runs_decode_chain(torch.zeros(3, 1024, device="cuda", dtype=torch.bfloat16))
    prompt = [SequenceChunk(list(range(3, 40)), 0, [0, 1, 2])]
    decode = [SequenceChunk([7], 37, [0, 1, 2])]
    logits = {}
    for chain in (False, True):
        shard.decode_chain = chain
        caches = allocate_kv_cache(4, 3, 16, 4, 64, torch.bfloat16, "cuda")
        for chunks in (prompt, decode):
            inputs = build_step_inputs(chunks, block_size=16, device="cuda")
            hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
        logits[chain] = shard.compute_logits(hidden, residual).float()
    assert torch.isfinite(logits[True]).all()
    scale = logits[False].abs().max().item()
    torch.testing.assert_close(logits[True], logits[False], atol=0.03 * scale, rtol=0.0)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
