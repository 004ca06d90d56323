"""A model's pipeline shards chained in one process, against Hugging Face transformers: the step
loop of tests/test_model_shard.py (CPU, torch attention) and tests/gpu/test_greedy_hf_gpu.py
(the Triton kernels), with chunked prefill and greedy decoding as the engine schedules them.
With tensor parallelism (tp > 1) each stage is that many rank shards, each on a thread of its own
over gloo (tests/tp_threads.py), and the logits are the ranks' vocabulary slices put together."""

from __future__ import annotations

import gc
import random

import torch

from strata.services.worker.model.attention import allocate_kv_cache
from strata.services.worker.model.weights import load_shard
from tests.paged_inputs import SequenceChunk, build_step_inputs
from tests.tp_threads import form_groups, run_on_threads

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
        tp: int = 1,
        **load_kwargs,
    ):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.tp = tp
        # Per stage, a shard and its KV caches per rank (one rank without tensor parallelism).
        self.ranks: list[list[tuple]] = []
        self.groups = [form_groups(tp) for _ in range(num_stages)] if tp > 1 else [[None]] * num_stages
        for stage in range(num_stages):

            def load(group, stage=stage):
                shard, config = load_shard(model_dir, stage, num_stages, dtype, device, tp=group, **load_kwargs)
                caches = allocate_kv_cache(
                    shard.num_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype, device
                )
                return shard, caches, config

            self.ranks.append(run_on_threads([lambda g=g: load(g) for g in self.groups[stage]]))
        self.config = self.ranks[-1][0][2]
        self.shards = [ranks[0][0] for ranks in self.ranks]  # rank 0's
        self.kv_caches = [ranks[0][1] for ranks in self.ranks]

    def close(self) -> None:
        """Drops the ranks' gloo groups before the interpreter's exit (which they would abort)."""
        self.ranks, self.groups, self.shards = [], [], []
        gc.collect()

    def step(self, chunks: list[SequenceChunk], all_logits: bool = False) -> torch.Tensor:
        inputs = build_step_inputs(chunks, self.block_size, self.device)
        hidden = residual = None
        for ranks in self.ranks:

            def rank_step(shard, caches, hidden=hidden, residual=residual):
                input_ids = inputs.input_ids if shard.is_first else None
                return shard(input_ids, inputs.positions, hidden, residual, caches, inputs.meta)

            # Every rank ends the stage with the same (hidden, residual): rank 0's goes on.
            hidden, residual = run_on_threads([lambda s=s, c=c: rank_step(s, c) for s, c, _ in ranks])[0]
        if not all_logits:
            hidden, residual = hidden[inputs.logits_indices], residual[inputs.logits_indices]
        slices = run_on_threads([lambda s=s: s.compute_logits(hidden, residual) for s, _, _ in self.ranks[-1]])
        vocab = self.config.vocab_size
        return torch.cat(slices, dim=-1)[:, :vocab] if len(slices) > 1 else slices[0]


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
