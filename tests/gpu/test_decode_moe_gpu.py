"""The decode chain's layer of experts in one launch (kernels/decode_moe.py) on a real GPU: bf16 at the Qwen3-30B-A3B
and Mixtral shapes (and a tensor-parallel shard of I, an expert-parallel rank), against the batched
layer (RMSNorm, router GEMM, select_experts, fused_moe) on the same inputs, and captured in a CUDA
graph with its dependent launches, replayed with new inputs.

    python -m pytest tests/gpu/test_decode_moe_gpu.py -q

Oracle: kernels/reference.py's float32 math on the same bf16 inputs. Both paths round at the same
points and differ in summation order; the GEMVs must be about as close to it as the batched
layer is. The router's logits come from a GEMV here and from cuBLAS there, so a near tie may
route the other way: layers are compared where both chose the same experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.decode_moe import decode_moe, decode_moe_serves  # noqa: E402
from strata.kernels.fused_moe import expert_map_for_range, fused_moe, select_experts  # noqa: E402
from strata.kernels.reference import fused_moe_reference, rms_norm_reference, select_experts_reference  # noqa: E402

DEVICE = "cuda"
# name -> (hidden, intermediate, experts, top_k, Qwen3-style bf16 weight rounding)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, True),
    "mixtral": (4096, 14336, 8, 2, False),
    "qwen3-30b-a3b-tp2": (2048, 384, 128, 8, True),
}


class Layer:
    def __init__(self, shape: str, seed: int = 0):
        hidden, intermediate, experts, self.top_k, rounds = SHAPES[shape]
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def randn(*size, scale):
            return (torch.randn(*size, device=DEVICE, generator=gen) * scale).to(torch.bfloat16)

        self.weight_dtype = torch.bfloat16 if rounds else None
        self.norm = (torch.rand(hidden, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
        self.router = randn(experts, hidden, scale=hidden**-0.5 * 4)
        self.w13 = randn(experts, 2 * intermediate, hidden, scale=hidden**-0.5)
        self.w2 = randn(experts, hidden, intermediate, scale=intermediate**-0.5)
        self.gen = gen

    def h(self):
        return (torch.randn(1, self.w13.shape[2], device=DEVICE, generator=self.gen) * 3).to(torch.bfloat16)

    def gemvs(self, h, w13=None, w2=None, expert_map=None):
        return decode_moe(
            h,
            self.norm,
            1e-6,
            self.router,
            self.w13 if w13 is None else w13,
            self.w2 if w2 is None else w2,
            top_k=self.top_k,
            renormalize=True,
            weight_dtype=self.weight_dtype,
            expert_map=expert_map,
        )

    def batched(self, h, w13=None, w2=None, expert_map=None):
        """The batched layer's kernels, and the float32 reference on the same bf16 operands."""
        w13 = self.w13 if w13 is None else w13
        w2 = self.w2 if w2 is None else w2
        x = rms_norm_reference(h, self.norm, 1e-6)
        logits = F.linear(x, self.router)
        weights, ids = select_experts(logits, self.top_k, True, weight_dtype=self.weight_dtype)
        got = fused_moe(x, w13, w2, weights, ids, expert_map=expert_map)
        exact = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids, expert_map=expert_map)
        return got, exact, ids

    def routed_ids(self, h):
        """The experts the GEMVs' router picks (its logits from the chain's rounding, in torch)."""
        x = rms_norm_reference(h, self.norm, 1e-6)
        logits = F.linear(x.float(), self.router.float()).to(torch.bfloat16)
        return select_experts_reference(logits, self.top_k, True, weight_dtype=self.weight_dtype)[1]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemvs_as_close_as_the_batched_layer(shape):
    layer = Layer(shape, seed=1)
    compared = 0
    for _ in range(8):
        h = layer.h()
        assert decode_moe_serves(h, layer.w13, layer.w2, layer.top_k, layer.router.shape[0])
        got = layer.gemvs(h)
        batched, exact, ids = layer.batched(h)
        if not torch.equal(ids.sort().values, layer.routed_ids(h).sort().values):
            continue  # a near tie in the router: the paths chose different experts
        compared += 1
        assert got.dtype == torch.bfloat16 and got.shape == h.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), batched.float(), atol=3e-2, rtol=3e-2)
        gemv_error = (got.float() - exact).abs().mean().item()
        batched_error = (batched.float() - exact).abs().mean().item()
        assert gemv_error <= 1.25 * batched_error + 1e-5, (gemv_error, batched_error)
    assert compared >= 6, compared


def test_expert_parallel_rank_adds_only_its_experts():
    layer = Layer("qwen3-30b-a3b", seed=2)
    expert_map = expert_map_for_range(128, 32, 96, device=DEVICE)
    w13, w2 = layer.w13[32:96].contiguous(), layer.w2[32:96].contiguous()
    h = layer.h()
    got = layer.gemvs(h, w13, w2, expert_map)
    batched, exact, _ = layer.batched(h, w13, w2, expert_map)
    torch.testing.assert_close(got.float(), batched.float(), atol=3e-2, rtol=3e-2)


def test_in_a_cuda_graph_equals_eager_with_new_inputs():
    layer = Layer("qwen3-30b-a3b", seed=3)
    h = layer.h()
    graph, captured = capture_graph(lambda: layer.gemvs(h))
    for _ in range(3):
        h.copy_(layer.h())
        eager = layer.gemvs(h)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@pytest.mark.parametrize("programs", [1, 7, 5000])
def test_any_grid_gives_the_same_output(programs, monkeypatch):
    """Items go by ticket, and a down item only waits for items already handed to running
    programs: one program alone finishes (every item in turn), a few finish, and thousands (more
    than the GPU holds at once) find the tickets gone and leave. Same bits every time, and the
    counters are back at zero for the next launch."""
    from strata.kernels import decode_moe as dm
    from strata.kernels.arrival_counters import arrival_counters

    layer = Layer("qwen3-30b-a3b", seed=4)
    hs = [layer.h() for _ in range(2)]
    want = [layer.gemvs(h) for h in hs]
    monkeypatch.setattr(dm, "_programs", lambda *args: programs)
    for h, expected in zip(hs, want):
        assert torch.equal(layer.gemvs(h), expected)
    torch.cuda.synchronize()
    assert not arrival_counters(hs[0].device, 1, "decode_moe").any()
