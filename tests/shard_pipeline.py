"""A model's pipeline shards chained in one process, against Hugging Face transformers: the step
loop of tests/test_model_shard.py (CPU, torch attention) and tests/gpu/test_greedy_hf_gpu.py
(the Triton kernels), with chunked prefill and greedy decoding as the engine schedules them."""

from __future__ import annotations

import random

import torch

from strata.services.worker.model.attention import allocate_kv_cache
from strata.services.worker.model.weights import load_shard
from tests.paged_inputs import SequenceChunk, build_step_inputs

BLOCK_SIZE = 4
NUM_BLOCKS = 48


class Pipeline:
    """Shards of one model chained in-process, each with its own paged KV cache."""

    def __init__(
        self,
        model_dir,
        num_stages: int,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = BLOCK_SIZE,
        num_blocks: int = NUM_BLOCKS,
        **load_kwargs,
    ):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.shards = []
        self.kv_caches = []
        for stage in range(num_stages):
            shard, config = load_shard(model_dir, stage, num_stages, dtype, device, **load_kwargs)
            self.shards.append(shard)
            self.kv_caches.append(
                allocate_kv_cache(
                    shard.num_layers,
                    num_blocks,
                    block_size,
                    config.num_key_value_heads,
                    config.head_dim,
                    dtype,
                    device,
                )
            )
        self.config = config

    def step(self, chunks: list[SequenceChunk], all_logits: bool = False) -> torch.Tensor:
        inputs = build_step_inputs(chunks, self.block_size, self.device)
        hidden = residual = None
        for shard, caches in zip(self.shards, self.kv_caches):
            input_ids = inputs.input_ids if shard.is_first else None
            hidden, residual = shard(input_ids, inputs.positions, hidden, residual, caches, inputs.meta)
        if not all_logits:
            hidden, residual = hidden[inputs.logits_indices], residual[inputs.logits_indices]
        return self.shards[-1].compute_logits(hidden, residual)


def shuffled_block_tables(
    lengths: list[int], seed: int, block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS
) -> list[list[int]]:
    """Disjoint, non-contiguous block ids covering each length."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for length in lengths:
        count = -(-length // block_size)
        assert count <= len(ids), "the pipeline's cache is too small for these sequences"
        tables.append(ids[:count])
        ids = ids[count:]
    return tables


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt], device=hf.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=hf.config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


def greedy_decode(pipeline: Pipeline, prompts, chunk_plans, max_new_tokens: int, eos_ids) -> list[list[int]]:
    """Chunked prefill then decode, all sequences in one flat batch per step.

    chunk_plans[i] lists the prefill chunk sizes of prompt i; a sequence decodes as soon as
    its prefill is done, while others are still prefilling.
    """
    lengths = [len(p) + max_new_tokens for p in prompts]
    tables = shuffled_block_tables(lengths, seed=11, block_size=pipeline.block_size, num_blocks=pipeline.num_blocks)
    computed = [0] * len(prompts)
    plans = [list(plan) for plan in chunk_plans]
    generated: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    while not all(finished):
        chunks, owners = [], []
        for i, prompt in enumerate(prompts):
            if finished[i]:
                continue
            if plans[i]:
                size = plans[i].pop(0)
                tokens = prompt[computed[i] : computed[i] + size]
            else:
                tokens = generated[i][-1:]
            chunks.append(SequenceChunk(tokens, computed[i], tables[i]))
            owners.append(i)
        logits = pipeline.step(chunks)
        next_tokens = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(owners):
            computed[i] += len(chunks[row].token_ids)
            if plans[i]:
                continue  # mid-prefill: this chunk's logits are not sampled
            generated[i].append(next_tokens[row])
            if len(generated[i]) == max_new_tokens or next_tokens[row] in eos_ids:
                finished[i] = True
    return generated
