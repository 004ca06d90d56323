"""Random bf16 model shards with Llama-3.2-1B's layer shapes, for the GPU tests."""

from __future__ import annotations

import torch

from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.shard import CausalLMShard
from strata.services.worker.model.triton_backend import TritonAttentionBackend


def llama_1b_like(num_layers: int = 3) -> ModelConfig:
    """Llama-3.2-1B's layer shapes and llama3 RoPE, fewer layers and a smaller vocabulary."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=2048,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=16384,
        tie_word_embeddings=True,
    )


def small_llama() -> ModelConfig:
    """Four layers of 1,024 with 16/4 heads of 64 and a 5,000-token vocabulary: the chain's shard tests."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2816,
        vocab_size=5000,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
    )


def random_bf16_shard(config: ModelConfig, device: str = "cuda") -> CausalLMShard:
    shard = CausalLMShard(
        config, 0, config.num_hidden_layers, device=device, dtype=torch.bfloat16, attn_backend=TritonAttentionBackend()
    )
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in shard.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, device=device, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, device=device, generator=gen) * 0.02)
    return shard.eval()
