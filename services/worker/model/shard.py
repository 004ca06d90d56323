"""One pipeline stage of a decoder (any architecture of model_config.py) over a paged KV cache:
layers [start, end) of the model (decoder_layer.py), plus the embeddings on the first stage and
the final norm and lm_head on the last, and the checkpoint's tensors loaded into them
(weight_names.py says where each goes).

Batch-1 decode steps on the GPU take the decode chain of fused GEMVs (decode_chain.py) instead of
the layers' own forward; both return the same (hidden, residual) pair at the stage's boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from strata.services.worker.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from strata.services.worker.model.decode_chain import (
    chain_serves,
    decode_chain_forward,
    decode_chain_logits,
)
from strata.services.worker.model.decoder_layer import DecoderLayer
from strata.services.worker.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, rms_norm_for
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.weight_names import Destination, checkpoint_names
from strata.services.worker.tensor_parallel.vocab import VocabShard


class CausalLMShard(torch.nn.Module):
    """Layers [start, end) of the model, plus embeddings (first stage) and head (last stage)."""

    def __init__(
        self,
        config: ModelConfig,
        start_layer: int,
        end_layer: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_backend: AttentionBackend | None = None,
        tp=None,
    ) -> None:
        """tp: this rank's tensor-parallel group (model/sharding.py): config is then the rank's
        (local_config), the vocabulary its slice."""
        super().__init__()
        if not 0 <= start_layer < end_layer <= config.num_hidden_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) for {config.num_hidden_layers} layers")
        self.config = config
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == config.num_hidden_layers
        self.attn_backend: AttentionBackend = attn_backend or TorchAttentionBackend()
        self.tp = tp if tp is not None and tp.size > 1 else None
        rank, size = (tp.rank, tp.size) if self.tp is not None else (0, 1)
        self.vocab = VocabShard(config.vocab_size, rank, size)  # the embedding's and lm_head's rows

        self.embed_tokens: Embedding | None = None
        if self.is_first:
            self.embed_tokens = Embedding(
                self.vocab.local,
                config.hidden_size,
                device,
                dtype,
                scale=config.embedding_scale,
                vocab=self.vocab,
                reduce=self.tp,
            )
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, device, dtype, reduce=self.tp) for i in range(start_layer, end_layer)
        )
        self.rotary = RotaryEmbedding(config, device, dtype)
        # Gemma 3's sliding layers rotate with a table of their own.
        self.local_rotary: RotaryEmbedding | None = None
        if any(layer.self_attn.local_rotary for layer in self.layers):
            self.local_rotary = RotaryEmbedding(config, device, dtype, local=True)
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if self.is_last:
            self.norm = rms_norm_for(config, config.hidden_size, device, dtype)
            self.lm_head = Linear(config.hidden_size, self.vocab.local, False, device, dtype)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self._destinations, self._alternatives = checkpoint_names(config, start_layer, end_layer)
        self.decode_chain: bool | None = None

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def rotary_for(self, layer: DecoderLayer) -> RotaryEmbedding:
        """The rotary table a layer of this shard rotates with."""
        return self.local_rotary if layer.self_attn.local_rotary else self.rotary

    # ---- compute -----------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        placeholders: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this shard's layers over a flat batch of T tokens.

        First stage: input_ids [T] given, hidden/residual None; placeholders (token_rows,
        last_sampled) resolve a decode lookahead's ids < 0 (Embedding.forward). Later stages: the
        (hidden, residual) pair [T, hidden_size] returned by the previous stage.
        kv_caches[i] is the cache of local layer i (global layer start_layer + i).
        """
        if self.is_first:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            hidden, residual = self.embed_tokens(input_ids, placeholders), None
        elif hidden is None or residual is None:
            raise ValueError("a later stage needs the previous stage's hidden and residual")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        positions = positions.long()
        if self._runs_decode_chain(hidden):
            return decode_chain_forward(self, hidden, residual, positions, kv_caches, meta)
        pending = None  # the group over which hidden is still to be summed (a deferred MLP output)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            defer = i < last  # the stage's output is summed: the next stage or the final norm takes it
            hidden, residual = layer(
                hidden, residual, positions, self.rotary_for(layer), kv_cache, meta, self.attn_backend, pending, defer
            )
            pending = layer.output_reduce(defer)
        return hidden, residual

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm of (hidden + residual), lm_head; [N, vocab] in the model's dtype
        ([N, vocab.local], the rank's slice, with tensor parallelism).

        Not upcast here: the fused sampling kernel reads bf16 logits directly (an fp32 copy of a
        full batch's logits over a large vocabulary is a sizeable part of a small model's decode
        step); the sampler upcasts only for the torch ops that need it."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        if self._runs_decode_chain(hidden):
            return decode_chain_logits(self, hidden, residual)
        normed, _ = self.norm.add_and_norm(hidden, residual)
        logits = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap:  # as HF's Gemma: in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _runs_decode_chain(self, hidden: torch.Tensor) -> bool:
        """Batch-1 steps on the GPU take the fused GEMV chain (decode_chain.py) where it serves the
        architecture; decode_chain None decides by device and kernel switch (the fused kernels
        on), tests and benchmarks force it."""
        enabled = self.decode_chain
        if enabled is None:
            enabled = hidden.is_cuda and self.layers[0].mlp._use_fused(hidden)
        return enabled and chain_serves(hidden, self)

    # ---- weights -----------------------------------------------------------------------

    def wants_weight(self, name: str) -> bool:
        """Whether an HF checkpoint tensor name is needed by this shard."""
        return name in self._destinations or name in self._alternatives

    def weight_shape(self, name: str) -> torch.Size:
        """Shape of HF tensor `name` as this shard stores it."""
        return self._target(self._destination(name)).shape

    def expected_weight_names(self) -> set[str]:
        """HF tensor names this shard needs, all of which must be loaded (an alternative form
        counts for the names it covers: weight_names.py)."""
        return set(self._destinations)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this shard, skipping names it does not own.

        Returns the names that were loaded (with those an alternative form covered).
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            if not self.wants_weight(name):
                continue
            dest = self._target(self._destination(name))
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            alternative = self._alternatives.get(name)
            loaded.update(alternative.covers if alternative else (name,))
        return loaded

    def _destination(self, name: str) -> Destination:
        alternative = self._alternatives.get(name)
        return alternative.destination if alternative else self._destinations[name]

    def _target(self, dest: Destination) -> torch.Tensor:
        """The parameter, or the part of a fused parameter, that a Destination names."""
        tensor = self.get_parameter(dest.param)
        if dest.expert is not None:
            tensor = tensor[dest.expert]
        if dest.rows is not None:
            tensor = tensor[dest.rows[0] : dest.rows[1]]
        return tensor
