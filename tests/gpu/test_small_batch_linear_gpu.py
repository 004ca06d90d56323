"""The small-batch GEMM (kernels/small_batch_linear.py) on a GPU: bf16 at every tuned shape (split-K,
bias, SiLU in the epilogue) against F.linear; in a CUDA graph as a programmatic dependent of the
RMSNorm before it, whose output it must read only after its wait (its weights before); and an 8B
decoder layer's linears in a graph against the same layer's cuBLAS step.

    python -m pytest tests/gpu/test_small_batch_linear_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Both sum in float32 over K, in different orders, then round to bf16: a bf16 ulp or two apart.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


def _tuned():
    from strata.kernels.small_batch_linear import TUNED

    return sorted(TUNED)


@pytest.mark.parametrize("rows", [2, 7, 16])
@pytest.mark.parametrize("shape", _tuned())
@pytest.mark.parametrize("split_k", [None, 1, 4])
def test_it_equals_f_linear_at_the_tuned_shapes(rows, shape, split_k):
    from strata.kernels.small_batch_linear import SmallBatchConfig, small_batch_linear

    n, k, silu_mul = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * k**-0.5
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    config = None if split_k is None else SmallBatchConfig(block_n=64, block_k=256, split_k=split_k)
    want = F.linear(x, w, bias)
    if silu_mul:  # [gate | up]: silu(gate) * up in the epilogue
        want = F.silu(want[:, : n // 2]) * want[:, n // 2 :]
    else:
        _close(small_batch_linear(x, w, config=config), F.linear(x, w))
    _close(small_batch_linear(x, w, bias, silu_mul=silu_mul, config=config), want)


def test_in_a_graph_after_a_norm_it_reads_the_norms_output():
    from strata.kernels.rmsnorm import rms_norm
    from strata.kernels.small_batch_linear import small_batch_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 2048, device="cuda", generator=gen).to(torch.bfloat16) * 2048**-0.5
    norm_weight = torch.rand(2048, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    x = torch.zeros(16, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    rms_norm(x, norm_weight, 1e-5)  # (compiled outside the capture)
    small_batch_linear(x, w)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = small_batch_linear(rms_norm(x, norm_weight, 1e-5), w)
    for step in range(3):  # new inputs each replay: a read before the norm ended would see the old ones
        x.copy_(torch.randn(16, 2048, device="cuda", generator=gen).to(torch.bfloat16) * (step + 1))
        graph.replay()
        _close(y, F.linear(rms_norm(x, norm_weight, 1e-5), w))


@pytest.mark.parametrize("rows", [3, 16])
def test_an_8b_layer_in_a_graph_equals_its_cublas_step(rows, monkeypatch):
    """A decoder layer of the 8B's shapes at a decode batch, its linears around attention (qkv;
    o_proj, the norm, gate_up with SiLU in its epilogue, down) captured in a CUDA graph as a decode
    step is: the small-batch GEMMs as programmatic dependents of the norms and of each other give
    the cuBLAS step's result within bf16 rounding."""
    from strata.kernels import small_batch_linear
    from strata.services.worker.model.decoder_layer import DecoderLayer
    from strata.services.worker.model.weights import dummy_config

    config = dummy_config("llama-3-8b")
    layer = DecoderLayer(config, 0, "cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    hidden = torch.randn(rows, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    attn = torch.randn(rows, config.num_attention_heads * config.head_dim, device="cuda", generator=gen)
    attn = attn.to(torch.bfloat16)

    def step():
        qkv, res = layer.before_attention(hidden, residual)
        out, res = layer.after_attention(attn, res)
        return qkv, out, res

    results = {}
    for on in (False, True):
        monkeypatch.setattr(small_batch_linear, "enabled", on)
        step()  # (compiled outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        graph.replay()
        torch.cuda.synchronize()
        results[on] = [t.clone() for t in outputs]
    for cublas, small in zip(results[False], results[True]):
        _close(small, cublas)
