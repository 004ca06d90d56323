"""One pipeline stage of a Llama / Mistral / Qwen2 decoder over a paged KV cache: layers
[start, end) of the model (layers.py), plus the embeddings on the first stage and the final norm
and lm_head on the last, and where each tensor of an HF checkpoint goes in it.

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
from strata.services.worker.model.layers import DecoderLayer, Embedding, Linear, RMSNorm, RotaryEmbedding
from strata.services.worker.model.model_config import ModelConfig


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
    ) -> None:
        super().__init__()
        if not 0 <= start_layer < end_layer <= config.num_hidden_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) for {config.num_hidden_layers} layers")
        self.config = config
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == config.num_hidden_layers
        self.attn_backend: AttentionBackend = attn_backend or TorchAttentionBackend()

        self.embed_tokens: Embedding | None = None
        if self.is_first:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device, dtype)
        self.rotary = RotaryEmbedding(config, device, dtype)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i, device, dtype) for i in range(start_layer, end_layer))
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, device, dtype)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self._expected_names = self._weight_names()
        self.decode_chain: bool | None = None

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

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
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.rotary, kv_cache, meta, self.attn_backend)
        return hidden, residual

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm of (hidden + residual), lm_head; [N, vocab] in the model's dtype.

        Not upcast here: the fused sampling kernel reads bf16 logits directly (an fp32 copy of a
        full batch's logits over a large vocabulary is a sizeable part of a small model's decode
        step); the sampler upcasts only for the torch ops that need it."""
        if not self.is_last:
            raise RuntimeError("compute_logits runs on the last stage only")
        if self._runs_decode_chain(hidden):
            return decode_chain_logits(self, hidden, residual)
        normed, _ = self.norm.add_and_norm(hidden, residual)
        return self.lm_head(normed)

    def _runs_decode_chain(self, hidden: torch.Tensor) -> bool:
        """Batch-1 steps on the GPU take the fused GEMV chain (decode_chain.py); decode_chain
        None decides by device and kernel switch (the fused kernels on), tests and
        benchmarks force it."""
        enabled = self.decode_chain
        if enabled is None:
            enabled = hidden.is_cuda and self.layers[0].mlp._use_fused(hidden)
        return enabled and chain_serves(hidden, self)

    # ---- weights -----------------------------------------------------------------------

    def wants_weight(self, name: str) -> bool:
        """Whether an HF checkpoint tensor name is needed by this shard."""
        return name in self._expected_names

    def weight_shape(self, name: str) -> torch.Size:
        """Shape of HF tensor `name` as this shard stores it."""
        return self._destination_of(name).shape

    def expected_weight_names(self) -> set[str]:
        """HF tensor names this shard needs, all of which must be loaded."""
        return set(self._expected_names)

    def _weight_names(self) -> set[str]:
        cfg = self.config
        names: set[str] = set()
        if self.is_first or (self.is_last and cfg.tie_word_embeddings):
            names.add("model.embed_tokens.weight")
        if self.is_last:
            names.add("model.norm.weight")
            # A tied checkpoint may still hold lm_head.weight (a copy of the embedding): unused.
            if not cfg.tie_word_embeddings:
                names.add("lm_head.weight")
        projections = (
            [("self_attn", p, cfg.attention_bias) for p in ("q_proj", "k_proj", "v_proj")]
            + [("self_attn", "o_proj", cfg.o_proj_bias)]
            + [("mlp", p, cfg.mlp_bias) for p in ("gate_proj", "up_proj", "down_proj")]
        )
        for i in range(self.start_layer, self.end_layer):
            prefix = f"model.layers.{i}."
            names.add(prefix + "input_layernorm.weight")
            names.add(prefix + "post_attention_layernorm.weight")
            for module, proj, has_bias in projections:
                names.add(f"{prefix}{module}.{proj}.weight")
                if has_bias:
                    names.add(f"{prefix}{module}.{proj}.bias")
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this shard, skipping names it does not own.

        Returns the names that were loaded.
        """
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in self._expected_names:
                continue
            dest = self._destination_of(name)
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name)
        return loaded

    def _destination_of(self, name: str) -> torch.Tensor:
        """The parameter, or rows of a fused parameter, that receive HF tensor `name`."""
        if name == "model.embed_tokens.weight":
            # A tied head on a last stage without embeddings takes the embedding matrix.
            owner = self.embed_tokens if self.embed_tokens is not None else self.lm_head
            return owner.weight
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self.lm_head.weight
        # model.layers.{i}.{norm}.weight or model.layers.{i}.{self_attn|mlp}.{proj}.{weight|bias}
        parts = name.split(".")
        layer = self.layers[int(parts[2]) - self.start_layer]
        if len(parts) == 5:
            return getattr(layer, parts[3]).weight
        module, proj, kind = parts[3:]
        cfg = self.config
        if proj in ("q_proj", "k_proj", "v_proj"):
            q_size = cfg.num_attention_heads * cfg.head_dim
            kv_size = cfg.num_key_value_heads * cfg.head_dim
            start, size = {"q_proj": (0, q_size), "k_proj": (q_size, kv_size), "v_proj": (q_size + kv_size, kv_size)}[
                proj
            ]
            return getattr(layer.self_attn.qkv_proj, kind)[start : start + size]
        if proj in ("gate_proj", "up_proj"):
            size = cfg.intermediate_size
            start = 0 if proj == "gate_proj" else size
            return getattr(layer.mlp.gate_up_proj, kind)[start : start + size]
        owner = layer.self_attn if module == "self_attn" else layer.mlp
        return getattr(getattr(owner, proj), kind)
