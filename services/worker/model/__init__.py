"""The model a stage runs: the HF config it reads and every architecture's options
(`model_config.py`), the layers' blocks (`layers.py`: linears, norms, rotary with q/k norms,
attention, the gated MLP), the mixture of experts (`moe.py`), the decoder layer that chains them
(`decoder_layer.py`), the stage's shard of them with embeddings and head (`shard.py`), where each
checkpoint tensor goes (`weight_names.py`), its weights from safetensors or a dummy preset
(`weights.py`), the attention backends behind one interface (`attention.py`: the torch reference
and KV cache layout; `triton_backend.py`: the Triton kernels) and the batch-1 decode chain of fused
GEMVs (`decode_chain.py`). With tensor parallelism a rank's slice of it (`sharding.py`: its
heads, intermediate sizes and vocabulary, and its part of each checkpoint tensor), whose
row-parallel linears and embedding sum over the ranks. Expert parallelism lands here.
"""
