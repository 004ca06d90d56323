"""Random paged-attention batches for the kernel tests and benchmarks (not used by the server).

A batch mixes sequences that each have `context` cached tokens and `query` new tokens. Their KV
blocks are scattered over the cache in random order, block-table padding is 0 (as the worker
fills it), and every cache slot that no sequence owns can be filled with NaN: a kernel that reads
outside a sequence's keys then produces NaN instead of a plausible wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [2, num_blocks, Hkv, block_size, D]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T], slots of the new tokens
    max_query_len: int
    max_seq_len: int

    def attention_args(self) -> tuple:
        """Positional arguments of paged_attention / paged_attention_reference, up to max_seq_len."""
        return (
            self.query,
            self.kv_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.max_query_len,
            self.max_seq_len,
        )


def kv_by_slot(kv_cache: torch.Tensor) -> torch.Tensor:
    """kv_cache [2, NB, Hkv, BS, D] as [2, NB * BS, Hkv, D], row s = slot s; a copy, for reading."""
    return kv_cache.transpose(2, 3).reshape(2, -1, kv_cache.shape[2], kv_cache.shape[4])


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    poison_unowned: bool = True,
) -> PagedBatch:
    """Build a batch; sequence b has context_lens[b] cached and query_lens[b] new tokens.

    Random data is generated on `device` (large benchmark caches stay off the CPU).
    """
    assert len(query_lens) == len(context_lens)
    cpu_gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = torch.tensor(context_lens, dtype=torch.int64) + torch.tensor(query_lens, dtype=torch.int64)
    blocks_per_seq = (seq_lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + spare_blocks
    order = torch.randperm(num_blocks, generator=cpu_gen).to(torch.int32)
    max_blocks = max(1, int(blocks_per_seq.max())) if len(seq_lens) else 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    # Row b takes the next blocks_per_seq[b] entries of the shuffled block order.
    columns = torch.arange(max_blocks)
    used = columns[None, :] < blocks_per_seq[:, None]
    block_tables[used] = order[: int(blocks_per_seq.sum())]

    def slots_of(seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_tables[seq_ids, positions // block_size].long() * block_size + positions % block_size

    def ranges(begins: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence id, position) of every position in [begins[b], ends[b]) for all b, flattened."""
        lengths = ends - begins
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        return seq_ids, begins[seq_ids] + offsets

    context = torch.tensor(context_lens, dtype=torch.int64)
    slot_mapping = slots_of(*ranges(context, seq_lens))

    shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
    kv_cache = torch.randn(shape, generator=device_gen, device=device).to(dtype)
    if poison_unowned:
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        owned[slots_of(*ranges(torch.zeros_like(seq_lens), seq_lens))] = True
        # Slot s is (block s // block_size, offset s % block_size), in every KV head.
        unowned = ~owned.view(1, num_blocks, 1, block_size, 1).to(device)
        kv_cache.masked_fill_(unowned, float("nan"))

    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=device_gen, device=device).to(dtype)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        query=query,
        kv_cache=kv_cache,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
    )


def share_prefixes(batch: PagedBatch, run_sizes: list[int], prefix_lens: list[int], first_seq: int = 0):
    """Makes the batch's sequences from first_seq on, in consecutive shared-KV runs of run_sizes[r],
    share their first prefix_lens[r] keys as the server does: whole blocks through the block table, and
    the block the prefix ends in (if it ends mid-block) as a copy of the first member's, so only
    the keys before prefix_len are alike. Every member must have at least prefix_lens[r] cached
    keys. Returns the cascade's SharedKVRuns for the batch."""
    from strata.kernels.shared_kv_runs import SharedKVRuns

    block_size = batch.kv_cache.shape[3]
    qsl = batch.query_start_loc.tolist()
    seq_lens, q_lens = batch.seq_lens.tolist(), (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    tables = batch.block_tables.cpu()
    seq_prefix = [0] * len(seq_lens)
    token_start, table_rows = [qsl[first_seq]], []
    seq = first_seq
    for size, prefix in zip(run_sizes, prefix_lens):
        leader, full = seq, prefix // block_size
        for member in range(seq, seq + size):
            assert seq_lens[member] - q_lens[member] >= prefix, "a member's queries must lie past its prefix"
            tables[member, :full] = tables[leader, :full]
            if prefix % block_size and member != leader:
                src, dst = int(tables[leader, full]), int(tables[member, full])
                batch.kv_cache[:, dst, :, : prefix % block_size] = batch.kv_cache[:, src, :, : prefix % block_size]
            seq_prefix[member] = prefix
        seq += size
        token_start.append(qsl[seq])
        table_rows.append(leader)
    batch.block_tables.copy_(tables)
    device = batch.query.device

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return SharedKVRuns(
        token_start=ints(token_start),
        prefix_lens=ints(list(prefix_lens)),
        table_rows=ints(table_rows),
        seq_prefix_lens=ints(seq_prefix),
        max_run_tokens=token_start[-1] - token_start[0],
        max_prefix_len=max(prefix_lens, default=0),
    )
