"""The decode chain's MoE GEMVs (kernels/decode_moe.py) against the batched layer's torch references
(RMSNorm, router, select_experts_reference, fused_moe_reference), on CPU under Triton's interpreter,
and their sm_90 compile without a GPU: no spills, and down's weight loads issued before its wait.

This process holds launcher tests only unless it was started with TRITON_INTERPRET=1 (triton.jit
reads it when a kernel is defined; tests/triton_interpreter.py). float32 and float16 here; bf16 at
the model shapes in tests/gpu/test_decode_moe_gpu.py.
    TRITON_INTERPRET=1 python -m pytest tests/test_decode_moe.py -k map
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

# (hidden, intermediate, experts, k): the shapes the chain launches for.
MODEL_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


def sm90_launch(name: str):
    """(registers, spilled bytes, ptx) of the one launch for a model shape on an H100."""
    from strata.kernels import compile_check
    from strata.kernels import decode_moe as dm

    hidden, intermediate, experts, top_k = MODEL_SHAPES[name]
    constexprs = dm.layer_plan(
        hidden=hidden,
        intermediate=intermediate,
        num_experts=experts,
        top_k=top_k,
        renormalize=True,
        weight_dtype=torch.bfloat16,
        element_size=2,
        has_map=False,
        pdl=True,
    )
    source = compile_check._signature(dm._expert_layer_kernel, "bf16", constexprs)
    compiled, registers, spills = compile_check.compile_for_sm90(source, dm.WARPS)
    return registers, spills, compiled.asm["ptx"]


if not can_run_interpreted_here("strata.kernels.decode_moe", "strata.kernels.decode_linear"):

    @pytest.mark.triton_interpreter(seconds=4)  # its tests' time under the interpreter
    def test_decode_moe_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
    def test_one_launch_compiles_for_sm90(name):
        registers, spills, ptx = sm90_launch(name)
        # 4 programs an SM at 4 warps. Mixtral's one-column down tile needs an inter row as large
        # as itself: ptxas spills a word there.
        assert registers <= 128 and spills <= (8 if name.startswith("mixtral") else 0), (name, registers, spills)
        lines = ptx.splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert not any(re.search(r"\bld\.global", line) for line in lines[:wait]), "a load before the routing"
        # A down item's weights are in flight before it spins on its slot's gate/up items, and so
        # is the next ticket's atomic.
        spin = next(i for i, line in enumerate(lines) if "ld.acquire.gpu" in line)
        released = max(i for i, line in enumerate(lines[:spin]) if "atom.global.gpu.release" in line)
        between = lines[released:spin]
        assert sum(1 for line in between if re.search(r"\bld\.global\.v4", line)) >= 8, name
        assert any("atom.global.gpu.relaxed.add" in line for line in between), name

    def test_tile_rows():
        from strata.kernels.decode_moe import tile_rows

        assert tile_rows(2048, 2, 2) == 8  # 8 gate + 8 up rows of K = 2048: 64 KB
        assert tile_rows(2048, 4, 2) == 4  # the one launch's half tile: 4 gate + 4 up rows
        assert tile_rows(768, 2, 2) == 16  # its down: 16 rows of I = 768 (padded to 1024)
        assert tile_rows(14336, 2, 2) == 1  # Mixtral's down: 1 row of 16384
        assert tile_rows(32768, 2, 2) == 0  # would not fit: the batched layer serves

else:
    import torch.nn.functional as F

    from strata.kernels import decode_moe as dm
    from strata.kernels.reference import fused_moe_reference, rms_norm_reference, select_experts_reference

    def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def layer(hidden, intermediate, experts, dtype, seed=0):
        return dict(
            norm_weight=(rand(hidden, seed=seed + 1).abs() + 0.5).to(dtype),
            gate_weight=rand(experts, hidden, dtype=dtype, seed=seed + 2, scale=hidden**-0.5 * 3),
            w13=rand(experts, 2 * intermediate, hidden, dtype=dtype, seed=seed + 3, scale=hidden**-0.5),
            w2=rand(experts, hidden, intermediate, dtype=dtype, seed=seed + 4, scale=intermediate**-0.5),
        )

    def gemvs(h, w, eps, top_k, renormalize, weight_dtype=None, expert_map=None):
        """The kernels on layer w (the same arguments as reference)."""
        return dm.decode_moe(
            h,
            w["norm_weight"],
            eps,
            w["gate_weight"],
            w["w13"],
            w["w2"],
            top_k=top_k,
            renormalize=renormalize,
            weight_dtype=weight_dtype,
            expert_map=expert_map,
        )

    def reference(h, w, eps, top_k, renormalize, weight_dtype=None, expert_map=None):
        """The batched path's layer: norm, router, top-k, the experts (HF's loop), in torch."""
        x = rms_norm_reference(h, w["norm_weight"], eps)
        logits = F.linear(x, w["gate_weight"])
        weights, ids = select_experts_reference(logits, top_k, renormalize, weight_dtype=weight_dtype)
        return fused_moe_reference(x, w["w13"], w["w2"], weights, ids, expert_map=expert_map)

    # Ragged on purpose: H = 200 and I = 40 pad, k = 3 pads to 4, E = 6 pads to 8.
    @pytest.mark.parametrize(
        "hidden,intermediate,experts,top_k",
        [(64, 32, 8, 2), (200, 40, 6, 3), (128, 48, 16, 8)],
    )
    @pytest.mark.parametrize("renormalize,round_weights", [(True, True), (False, False)])
    def test_float32_equals_the_batched_layer(hidden, intermediate, experts, top_k, renormalize, round_weights):
        w = layer(hidden, intermediate, experts, torch.float32, seed=hidden)
        h = rand(1, hidden, seed=7, scale=3.0)
        weight_dtype = torch.float32 if round_weights else None
        got = gemvs(h, w, 1e-6, top_k, renormalize, weight_dtype)
        want = reference(h, w, 1e-6, top_k, renormalize, weight_dtype)
        assert got.shape == want.shape == (1, hidden) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

    def test_float16_rounds_as_the_batched_layer():
        hidden, intermediate, experts, top_k = 96, 48, 8, 2
        w = layer(hidden, intermediate, experts, torch.float16, seed=3)
        h = rand(1, hidden, dtype=torch.float16, seed=9, scale=2.0)
        got = gemvs(h, w, 1e-5, top_k, True, torch.float16)
        want = reference(h, w, 1e-5, top_k, True, torch.float16)
        assert got.dtype == torch.float16
        # Same roundings, other summation orders: a float16 ulp or two.
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)

    def test_experts_held_elsewhere_add_nothing():
        """Expert parallelism: this rank holds global experts 2..5 as its 0..3."""
        from strata.kernels.moe_routing import expert_map_for_range

        hidden, intermediate, experts, top_k = 64, 32, 8, 4
        w = layer(hidden, intermediate, experts, torch.float32, seed=5)
        expert_map = expert_map_for_range(experts, 2, 6)
        local = dict(w, w13=w["w13"][2:6].contiguous(), w2=w["w2"][2:6].contiguous())
        h = rand(1, hidden, seed=11, scale=3.0)
        got = gemvs(h, local, 1e-6, top_k, True, expert_map=expert_map)
        want = reference(h, local, 1e-6, top_k, True, None, expert_map=expert_map)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        everything = reference(h, w, 1e-6, top_k, True, None)
        assert not torch.allclose(got, everything)  # some of the token's experts are elsewhere

    import triton
    import triton.language as tl

    from strata.kernels.moe_routing import round_code, route_one_token, select_experts

    @triton.jit
    def _route_kernel(
        logits_ptr,
        ids_ptr,
        weights_ptr,
        NUM_EXPERTS: tl.constexpr,
        EXPERTS_PAD: tl.constexpr,
        TOP_K: tl.constexpr,
        TOP_K_PAD: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        ROUND_WEIGHTS: tl.constexpr,
    ):
        ids, weights = route_one_token(
            logits_ptr, NUM_EXPERTS, EXPERTS_PAD, TOP_K, TOP_K_PAD, RENORMALIZE, ROUND_WEIGHTS
        )
        slots = tl.arange(0, TOP_K_PAD)
        tl.store(ids_ptr + slots, ids, mask=slots < TOP_K)
        tl.store(weights_ptr + slots, weights, mask=slots < TOP_K)

    @pytest.mark.parametrize("top_k,renormalize,weight_dtype", [(3, True, torch.bfloat16), (8, False, None)])
    def test_routing_by_ranks_chooses_as_select_experts(top_k, renormalize, weight_dtype):
        """The one launch's routing against select_experts' k argmax rounds: the same experts in the
        same slots (ties to the lower id), the same weights, on random and on tied logits."""
        random = rand(1, 12, seed=4, scale=2.0)
        tied = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 0.5, 0.5, 3.0, 2.0, 1.0, -4.0]])
        for logits in (random, tied, random.to(torch.bfloat16)):
            ids = torch.empty(top_k, dtype=torch.int32)
            weights = torch.empty(top_k, dtype=torch.float32)
            _route_kernel[(1,)](
                logits,
                ids,
                weights,
                12,
                16,
                top_k,
                triton.next_power_of_2(top_k),
                renormalize,
                round_code(weight_dtype),
            )
            want_weights, want_ids = select_experts(logits, top_k, renormalize, weight_dtype=weight_dtype)
            assert ids.tolist() == want_ids[0].tolist(), (logits, ids)
            torch.testing.assert_close(weights, want_weights[0], atol=1e-7, rtol=1e-6)

    def test_serves_one_token_only():
        w = layer(64, 32, 8, torch.float32)
        assert dm.decode_moe_serves(rand(1, 64), w["w13"], w["w2"], 2, 8)
        assert not dm.decode_moe_serves(rand(2, 64), w["w13"], w["w2"], 2, 8)  # fused_moe takes batches
        assert not dm.decode_moe_serves(rand(1, 64, dtype=torch.float16), w["w13"], w["w2"], 2, 8)
        assert not dm.decode_moe_serves(rand(1, 64), w["w13"], w["w2"], 2, 256)  # routing's pairs: at most 128
