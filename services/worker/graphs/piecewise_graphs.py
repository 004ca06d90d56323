"""Piecewise CUDA graphs for mixed steps: everything but attention captured once per padded token
count, attention launched eagerly between the pieces (as vLLM V1 does).

A mixed step (prefill chunks beside decodes) has a shape the decode graphs cannot capture: its
query and context lengths change every step, and with them the attention kernels' grids. The
rest of a layer (norms, projections, rotary and the KV write, the MLP) depends only on the
number of tokens. So the shard's forward is cut at attention:
- piece 0: the embedding (or the previous stage's activations) and layer 0 up to its rotated
  queries;
- piece l: the end of layer l-1 (o_proj, norm, MLP) and layer l up to its queries;
- the last piece: the end of the last layer.
A step of T tokens replays the pieces of the smallest captured size Tp >= T and launches its
attention in between: L + 1 graph launches and L attention launches, where the eager forward
makes about ten launches a layer from Python, which at small steps takes longer on the host than
the kernels take on the GPU.

The pieces hand over through buffers at fixed addresses: the qkv projection of every layer goes
into one buffer (rotary and the KV write work in place there, attention reads its queries), the
attention output into another, and the residual stream is added into a third in place. So the
memory a piece allocates is freed when it ends, and the pieces of every size share one pool.

Padding tokens (T..Tp) get slot -1, so the KV write skips them; their ids and positions are
whatever an earlier step left (valid indices either way), the projections compute rows nobody
reads, and attention never sees them (its metadata covers the T real tokens). The logits and the
draw stay eager: they need only the sample rows.
"""

from __future__ import annotations

import bisect

import torch

from strata.services.worker.graphs.cuda_graphs import capturing
from strata.services.worker.model.attention import AttentionMetadata


def piece_token_counts(max_tokens: int) -> list[int]:
    """Captured step sizes up to max_tokens: doubling from 64, with a size 1.5x between from 512
    on, so padding wastes at most half a small step and a third of a large one."""
    sizes, size = [], 64
    while size < max_tokens:
        sizes += [size, size * 3 // 2] if size >= 512 else [size]
        size *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    """The pieces of one stage's forward, per padded token count up to max_tokens.

    last_sampled, scratch_row: as the decode graphs' (the placeholder ids of a decode lookahead
    read last_sampled at their token's state row; the scratch row is a valid row for padding)."""

    def __init__(
        self,
        shard,
        kv_caches: list[torch.Tensor],
        *,
        max_tokens: int,
        last_sampled: torch.Tensor,
        scratch_row: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.shard, self.kv_caches, self.last_sampled = shard, kv_caches, last_sampled
        self.device = device
        self.sizes = piece_token_counts(max_tokens)
        n = self.sizes[-1]
        attn = shard.layers[0].self_attn
        hidden_size = shard.config.hidden_size
        # Step inputs; slot -1 (skip the KV write) wherever a step leaves a row as padding.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.token_rows = torch.full((n,), scratch_row, dtype=torch.long, device=device)
        self.hidden_in = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        # The hand-over buffers (see the module docstring).
        self.residual = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(n, attn.q_size + 2 * attn.kv_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden_out: dict[int, torch.Tensor] = {}  # the last piece's output, per size
        self.pool = None

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds num_tokens; None when none does."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) and num_tokens > 0 else None

    def _queries(self, index: int, tp: int) -> torch.Tensor:
        """Layer index's rotated queries [tp, Hq, D]: a view of the qkv buffer."""
        attn = self.shard.layers[index].self_attn
        return self.qkv[:tp, : attn.q_size].view(tp, attn.num_heads, attn.head_dim)

    def _piece(self, index: int, tp: int) -> torch.Tensor | None:
        """Piece `index` over tp tokens. The last piece returns the stage's hidden output."""
        shard, layers, residual = self.shard, self.shard.layers, self.residual[:tp]
        if index > 0:
            before, defer = layers[index - 1], index < len(layers)  # (the stage's output is summed)
            hidden, _ = before.after_attention(
                self.attn_out[:tp].view(tp, -1), residual, in_place=True, defer_output=defer
            )
            if index == len(layers):
                return hidden
            qkv, _ = layers[index].before_attention(
                hidden, residual, in_place=True, qkv_out=self.qkv[:tp], input_reduce=before.output_reduce(defer)
            )
        elif shard.is_first:
            residual.copy_(shard.embed_tokens(self.input_ids[:tp], (self.token_rows[:tp], self.last_sampled)))
            qkv, _ = layers[0].before_attention(residual, None, qkv_out=self.qkv[:tp])
        else:
            qkv, _ = layers[0].before_attention(self.hidden_in[:tp], residual, in_place=True, qkv_out=self.qkv[:tp])
        layer = layers[index]
        layer.self_attn.rotate_and_cache(
            qkv,
            self.positions[:tp],
            shard.rotary_for(layer),
            self.kv_caches[index],
            self.slot_mapping[:tp],
            shard.attn_backend,
        )
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        num_pieces = len(self.shard.layers) + 1
        for tp in reversed(self.sizes):  # largest first: the smaller sizes fit in its memory
            for index in range(num_pieces):  # compiles the Triton kernels outside the capture
                self._piece(index, tp)
            torch.cuda.synchronize(self.device)
            graphs = []
            for index in range(num_pieces):
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, self.pool):
                    out = self._piece(index, tp)
                self.pool = self.pool or graph.pool()
                graphs.append(graph)
            self.graphs[tp], self.hidden_out[tp] = graphs, out
        torch.cuda.synchronize(self.device)

    def run(
        self,
        tp: int,
        d: dict[str, torch.Tensor],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's forward on the pieces of size tp. d: its uploaded inputs (input_ids,
        positions, slot_mapping, and token_rows where it has placeholders); meta: its attention
        metadata; hidden/residual: the previous stage's. Returns (hidden, residual) of its
        tokens: views of the pieces' buffers, valid until the next step is launched."""
        t = d["positions"].shape[0]
        self.positions[:t].copy_(d["positions"])
        self.slot_mapping[:t].copy_(d["slot_mapping"])
        self.slot_mapping[t:tp].fill_(-1)
        if self.shard.is_first:
            self.input_ids[:t].copy_(d["input_ids"])
            if "token_rows" in d:  # without placeholders every id is >= 0 and no row is read
                self.token_rows[:t].copy_(d["token_rows"])
        else:
            self.hidden_in[:t].copy_(hidden)
            self.residual[:t].copy_(residual)
            self.residual[t:tp].zero_()  # padding rows are added into in place: keep them finite
        backend, layers = self.shard.attn_backend, self.shard.layers
        for index, layer in enumerate(layers):
            self._launch(index, tp)
            layer.self_attn.attend_cached(
                self._queries(index, t), self.kv_caches[index], meta, backend, out=self.attn_out[:t]
            )
        return self._launch(len(layers), tp)[:t], self.residual[:t]

    def _launch(self, index: int, tp: int) -> torch.Tensor:
        """Replays piece `index` of size tp; before capture (the CPU tests) runs it eagerly on the
        same buffers. Returns the last piece's hidden output."""
        graphs = self.graphs.get(tp)
        if graphs is None:
            return self._piece(index, tp)
        graphs[index].replay()
        return self.hidden_out[tp]
