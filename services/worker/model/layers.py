"""The decoder's building blocks: linears, RMSNorm, rotary embeddings, attention and the gated MLP
(the mixture of experts that replaces the MLP is in moe.py, the decoder layer that chains them in
decoder_layer.py).

One layer layout serves every architecture of model_config.py; what differs between them is an
option of these layers, read from the config: q/k norms before rotary (Qwen3, Gemma 3), norms
scaling by 1 + weight (Gemma), the norms around the attention and the MLP (Gemma's four), the
embedding scale, the activation (SiLU or GELU-tanh), the attention scale, a second rotary table
for sliding layers (Gemma 3), experts in place of the MLP (Qwen3-MoE, Mixtral).

The math follows Hugging Face transformers step for step (RMSNorm in float32, rotate-half
RoPE, gated MLP) so that float32 greedy decoding matches `generate()` token for token. On
CUDA tensors the fused Triton kernels run; elsewhere the torch references in
kernels/reference.py, which are those kernels' oracle.
The residual stream is carried vLLM style: each layer receives (hidden, residual), adds them
and normalises in one step, so a stage boundary only has to pass that pair along.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.reference import (
    embed_tokens_reference,
    fused_add_rms_norm_reference,
    gelu_tanh_and_mul_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    silu_and_mul_reference,
)
from strata.services.worker.model.attention import AttentionBackend, AttentionMetadata
from strata.services.worker.model.model_config import ModelConfig


def empty_param(*shape: int, device, dtype) -> nn.Parameter:
    # Weights always come from a checkpoint or the dummy initialiser: skip nn.Linear's init,
    # which would cost seconds per layer on large models.
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), with uninitialised parameters. reduce: a row-parallel linear's
    tensor-parallel group (model/sharding.py), over whose ranks y is summed in place: each holds
    a slice of the input features, and so a partial y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype, reduce=None) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, device=device, dtype=dtype)
        self.bias = empty_param(out_features, device=device, dtype=dtype) if bias else None
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
        """out: a buffer of [T, out_features] to write y into (the same cuBLAS GEMM as F.linear).
        reduce False: this rank's partial y, which the caller sums (RMSNorm.add_and_norm's reduce)."""
        if out is None:
            small = _fused_kernels().small_batch_linear if x.is_cuda else None
            if small is not None and small.serves(x, self.weight):  # 2-16 rows of a tuned shape
                y = small.small_batch_linear(x, self.weight, self.bias)
            else:
                y = F.linear(x, self.weight, self.bias)
        elif self.bias is None:
            y = torch.matmul(x, self.weight.t(), out=out)
        else:
            y = torch.addmm(self.bias, x, self.weight.t(), out=out)
        return y if self.reduce is None or not reduce else self.reduce.all_reduce_(y)


@functools.cache
def _fused_kernels() -> SimpleNamespace:
    # Imported on first use, not with this module: CPU-only installs may lack triton, and
    # triton.jit reads TRITON_INTERPRET when a kernel is defined (the interpreter tests set it).
    from strata.kernels import small_batch_linear
    from strata.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from strata.kernels.embedding import embed_tokens
    from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from strata.kernels.rotary import rotary_embedding_

    return SimpleNamespace(
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        rotary_embedding_=rotary_embedding_,
        silu_and_mul=silu_and_mul,
        gelu_tanh_and_mul=gelu_tanh_and_mul,
        embed_tokens=embed_tokens,
        small_batch_linear=small_batch_linear,
    )


class FusedKernelSwitch:
    """Mixin: run the fused Triton kernels on CUDA tensors, the HF-exact torch code otherwise.

    `fused_kernels` None (default) decides by device; tests force the kernels with True (on CPU
    too, under TRITON_INTERPRET=1) or the torch path with False.
    """

    fused_kernels: bool | None = None

    def _use_fused(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.fused_kernels is None else self.fused_kernels


class Embedding(FusedKernelSwitch, nn.Module):
    """vocab (tensor parallelism): the rows are the rank's vocabulary slice (VocabShard), ids
    outside it give zeros, and `reduce` sums the ranks' rows (each id's comes from one rank)."""

    def __init__(
        self, num_embeddings: int, dim: int, device, dtype, scale: float | None = None, vocab=None, reduce=None
    ) -> None:
        super().__init__()
        self.weight = empty_param(num_embeddings, dim, device=device, dtype=dtype)
        # Gemma multiplies by sqrt(hidden) rounded to the weights' dtype first (HF's
        # Gemma3TextScaledWordEmbedding); the product, in that dtype, rounds as HF's.
        self.scale = None if scale is None else torch.tensor(scale).to(dtype).item()
        self.vocab, self.reduce = (vocab, reduce) if vocab is not None and vocab.sharded else (None, None)

    def forward(self, ids: torch.Tensor, placeholders: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The rows of `ids`; placeholders (token_rows, last_sampled): a decode lookahead's ids < 0
        stand for last_sampled[token_rows] (kernels/embedding.py)."""
        if self.vocab is not None:
            rows = self._slice_rows(ids, placeholders)
        elif self._use_fused(ids):
            rows = _fused_kernels().embed_tokens(ids, self.weight, *(placeholders or ()))
        else:
            rows = embed_tokens_reference(ids, self.weight, *(placeholders or ()))
        return rows if self.scale is None else rows.mul_(self.scale)

    def _slice_rows(self, ids: torch.Tensor, placeholders) -> torch.Tensor:
        """The rank's rows of the ids in its slice, zeros elsewhere, summed over the ranks (the
        sum adds zeros to one rank's row: exact). Placeholders resolve first, on the device."""
        if self._use_fused(ids):  # one launch (kernels/embedding.py)
            rows = _fused_kernels().embed_tokens(
                ids, self.weight, *(placeholders or ()), vocab_offset=self.vocab.offset, vocab_valid=self.vocab.valid
            )
            return self.reduce.all_reduce_(rows)
        if placeholders is not None:
            token_rows, last_sampled = placeholders
            ids = torch.where(ids < 0, last_sampled[token_rows], ids)
        local = ids - self.vocab.offset
        inside = (local >= 0) & (local < self.vocab.valid)
        rows = F.embedding(local.clamp(0, max(self.vocab.valid - 1, 0)), self.weight)
        rows = rows * inside.unsqueeze(1).to(rows.dtype)
        return self.reduce.all_reduce_(rows)


class RMSNorm(FusedKernelSwitch, nn.Module):
    """unit_offset: scale by (1 + weight), in float32 (Gemma's norm); else by weight (Llama's)."""

    def __init__(self, hidden_size: int, eps: float, device, dtype, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, device=device, dtype=dtype)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_fused(x):
            return _fused_kernels().rms_norm(x, self.weight, self.eps, self.unit_offset)
        return rms_norm_reference(x, self.weight, self.eps, self.unit_offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, in_place: bool = False, reduce=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- x + residual; return (norm(residual), residual). in_place: the sum goes
        into `residual` itself (the piecewise graphs keep the residual stream in one buffer).
        reduce: the tensor-parallel group over which x, a row-parallel linear's partial output, is
        summed first: in the same launch as the add and norm where its one-shot takes x."""
        if reduce is not None:
            if self._use_fused(x):
                fused = reduce.all_reduce_add_norm(
                    x, residual, self.weight, self.eps, self.unit_offset, residual if in_place else None
                )
                if fused is not None:
                    return fused
            x = reduce.all_reduce_(x)
        if residual is None:  # the first layer of the first stage
            return self(x), x
        if self._use_fused(x):
            return _fused_kernels().fused_add_rms_norm(
                x,
                residual,
                self.weight,
                self.eps,
                residual_out=residual if in_place else None,
                unit_offset=self.unit_offset,
            )
        normed, summed = fused_add_rms_norm_reference(x, residual, self.weight, self.eps, self.unit_offset)
        return normed, residual.copy_(summed) if in_place else summed


def rms_norm_for(config: ModelConfig, size: int, device, dtype) -> RMSNorm:
    """An RMSNorm of the model's kind over `size` values."""
    return RMSNorm(size, config.rms_norm_eps, device, dtype, unit_offset=config.norm_unit_offset)


def qk_norm_weights(qk_norm: tuple[RMSNorm, RMSNorm] | None) -> tuple[torch.Tensor, torch.Tensor, float, bool] | None:
    """(q_norm, k_norm) as the kernels' qk_norm argument: (q weight, k weight, eps, unit_offset)."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    return q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], float32, with llama3 or linear scaling when
    configured. local: the sliding layers' table (Gemma 3: its own base, never scaled)."""
    dim = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = None if local else config.rope_scaling
    if scaling is None or scaling["rope_type"] == "default":
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions divided by factor (Gemma 3's global layers)
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(FusedKernelSwitch, nn.Module):
    """Rotate-half (GPT-NeoX) RoPE with cos/sin tables precomputed for every position. local: the
    table of the sliding layers (rope_inv_freq)."""

    def __init__(self, config: ModelConfig, device, dtype, local: bool = False) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config, local).to(device)
        positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2], as HF computes it
        # HF casts cos/sin to the activation dtype before rotating; do the same.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by their token positions [T].

        The fused kernel rotates q and k in place (they are views of the fresh qkv projection)
        and returns them; the torch path returns new tensors.
        """
        if self._use_fused(q):
            _fused_kernels().rotary_embedding_(positions, q, k, self.cos, self.sin)
            return q, k
        return rotary_embedding_reference(positions, q, k, self.cos, self.sin)

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        """Rotate q in place and store the rotated k and v in kv_cache at slot_mapping; returns q.
        qk_norm: the (q_norm, k_norm) each head of q and k goes through first.

        The fused kernel does all of it in one launch (as SGLang fuses its KV store into RoPE):
        the keys go rotated to the cache, never back into the projection. The torch path rotates
        q in place too, so that q stays where the piecewise graphs' attention reads it."""
        if self._use_fused(q):
            _fused_kernels().rotary_embedding_(
                positions,
                q,
                k,
                self.cos,
                self.sin,
                value=v,
                kv_cache=kv_cache,
                slot_mapping=slot_mapping,
                qk_norm=qk_norm_weights(qk_norm),
            )
            return q
        normed_q, normed_k = (qk_norm[0](q), qk_norm[1](k)) if qk_norm is not None else (q, k)
        rotated_q, rotated_k = self(positions, normed_q, normed_k)
        backend.write_kv(rotated_k, v, kv_cache, slot_mapping)
        return q.copy_(rotated_q)


class Attention(nn.Module):
    # The one-launch decode attention where it serves (kernels/decode_attention.py); False keeps
    # rotary, attention and the merge as three kernels. Only bench/decode_chain.py turns it off,
    # to time what the one launch is worth; a server always takes it.
    one_launch_decode = True

    def __init__(self, config: ModelConfig, layer_index: int, device, dtype, reduce=None) -> None:
        """config: the rank's (model/sharding.py's local_config) with tensor parallelism, whose
        outputs o_proj sums over the ranks (reduce)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_window_for_layer(layer_index)
        # Whether the layer rotates with the shard's local table (CausalLMShard.rotary_for).
        self.local_rotary = config.local_rotary_for_layer(layer_index)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, device, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, device, dtype, reduce=reduce)
        # Qwen3, Gemma 3: each head of q and k RMS-normalised over head_dim before rotary.
        self.q_norm = rms_norm_for(config, self.head_dim, device, dtype) if config.qk_norm else None
        self.k_norm = rms_norm_for(config, self.head_dim, device, dtype) if config.qk_norm else None

    @property
    def qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """(q_norm, k_norm), or None for a layer without them."""
        return (self.q_norm, self.k_norm) if self.q_norm is not None else None

    def attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """From the qkv projection [T, q + 2 kv] to the attention output [T, q] (o_proj's input):
        rotary, the KV cache write, attention. A small decode-only step does all three in one
        launch (kernels/decode_attention.py, q/k norms included) where that kernel serves the layer."""
        if self._one_launch_decode(qkv, rotary, meta):
            from strata.kernels.decode_attention import decode_attention

            return decode_attention(
                qkv,
                positions,
                rotary.cos,
                rotary.sin,
                kv_cache,
                meta.seq_lens,
                meta.block_tables,
                meta.slot_mapping,
                num_q_heads=self.num_heads,
                scale=self.scale,
                max_seq_len=meta.max_seq_len,
                qk_norm=qk_norm_weights(self.qk_norms),
            )
        q = self.rotate_and_cache(qkv, positions, rotary, kv_cache, meta.slot_mapping, backend)
        return self.attend_cached(q, kv_cache, meta, backend)

    def rotate_and_cache(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Rotary and the KV cache write: the part of attention whose launch depends only on the
        token count. Returns the rotated queries [T, Hq, D] (a view of qkv)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return rotary.rotate_and_cache(positions, q, k, v, kv_cache, slot_mapping, backend, self.qk_norms)

    def attend_cached(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of rotated queries [T, Hq, D] over the cache (their own keys written):
        [T, q_size], into out [T, Hq, D] when given."""
        out = backend.forward(q, kv_cache, meta, self.scale, self.sliding_window, out=out)
        return out.reshape(q.shape[0], self.q_size)

    def _one_launch_decode(self, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> bool:
        """Whether kernels/decode_attention.py serves this step: one new token per sequence, with
        the fused kernels on, no sliding window or shared-prefix cascade (q/k norms it takes), and a
        batch small enough that one launch is faster (decode_attention_serves: the latency-bound
        batches), unless a benchmark turned one_launch_decode off to time the three kernels (read
        when a step is built or captured)."""
        num_seqs = meta.seq_lens.shape[0]
        if meta.max_query_len != 1 or qkv.shape[0] != num_seqs or not rotary._use_fused(qkv):
            return False
        if self.sliding_window is not None or meta.shared_kv_runs is not None:
            return False
        from strata.kernels.attention_launch import decode_attention_serves

        return self.one_launch_decode and decode_attention_serves(
            num_seqs, self.num_kv_heads, self.head_dim, qkv.dtype, qkv.device
        )


class MLP(FusedKernelSwitch, nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one [gate | up] projection; act SiLU or GELU-tanh."""

    def __init__(self, config: ModelConfig, device, dtype, reduce=None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, device, dtype)
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, config.mlp_bias, device, dtype, reduce=reduce
        )
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce False: this rank's partial output (tensor parallelism), summed by the caller."""
        if self._use_fused(x):
            kernels = _fused_kernels()
            small, gate_up = kernels.small_batch_linear, self.gate_up_proj
            if not self.gelu_tanh and small.serves(x, gate_up.weight, silu_mul=True):
                # SiLU in gate_up's epilogue: no activation launch, and down reads [T, I].
                act = small.small_batch_linear(x, gate_up.weight, gate_up.bias, silu_mul=True)
                return self.down_proj(act, reduce=reduce)
            act = kernels.gelu_tanh_and_mul if self.gelu_tanh else kernels.silu_and_mul
        else:
            act = gelu_tanh_and_mul_reference if self.gelu_tanh else silu_and_mul_reference
        return self.down_proj(act(self.gate_up_proj(x)), reduce=reduce)
