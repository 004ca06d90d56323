"""The model a stage runs: its layers (`layers.py`: linears, norms, rotary, attention, MLP, the
decoder layer), the stage's shard of them with embeddings and head (`shard.py`), the HF config it
reads (`model_config.py`), its weights from safetensors or a dummy initialiser (`weights.py`),
the attention backends behind one interface (`attention.py`: the torch reference and KV cache
layout; `triton_backend.py`: the Triton kernels) and the batch-1 decode chain of fused GEMVs
(`decode_chain.py`). New architectures and tensor-parallel (sharded) linears land here.
"""
