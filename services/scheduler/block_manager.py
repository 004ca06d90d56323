"""Paged KV block manager: free queue, reference counts, block tables, prefix cache, copy-on-write.

The block manager owns every request's block table (BlockTable: block ids in position order and
the chained hashes of its full blocks); the scheduler reads it and never writes it. What the
workers already hold of a table is the scheduler's bookkeeping, not this module's.

A block is free when nobody references it. Free blocks that hold a full, hashed block of
tokens stay findable in the prefix cache; they sit in an LRU free queue and lose their
contents only when a fresh block is needed and they reach its front.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(cache_salt: str) -> bytes:
    """Parent hash of every request's first block: different salts never share a block."""
    return hashlib.sha256(b"strata-kv-prefix\0" + cache_salt.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block. A cryptographic hash, so that no client can craft a
    prompt whose block collides with another client's block and read its cached KV."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockTable:
    """One request's KV blocks, written only by KVBlockManager."""

    __slots__ = ("block_ids", "hashes", "num_hashed")

    def __init__(self) -> None:
        self.block_ids: list[int] = []  # the block of positions [i * block_size, (i + 1) * block_size)
        # Chained hashes of the request's full blocks of tokens. Tokens are only ever appended, so
        # they stay valid for the request's life (after a preemption too).
        self.hashes: list[bytes] = []
        self.num_hashed = 0  # leading entries of block_ids already offered to the prefix cache


class KVBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_salt: str = "",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self._root = root_hash(cache_salt)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding it
        # Free blocks in eviction order (front first). Insertion-ordered dict: O(1) removal of
        # a cache hit from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_cached_free = 0
        self.peak_used_blocks = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ------------------------------------------------------------------ counters

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached ones included: what an allocation may take."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        """How many holders reference the block (tables and pins); 0 when it is free."""
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether the block holds a full block of tokens the prefix cache can find."""
        return self._hash[block] is not None

    def carry_counters(self, old: KVBlockManager) -> None:
        """Running totals survive a pool rebuilt after a lost stage."""
        self.prefix_cache_queries, self.prefix_cache_hits = old.prefix_cache_queries, old.prefix_cache_hits
        self.peak_used_blocks = old.peak_used_blocks

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------------ prefix cache

    def compute_block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        """Extends (and returns) req's block hashes to its first num_full_blocks blocks."""
        hashes = req.blocks.hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else self._root
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, req.token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)
        return hashes

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks holding the request's leading full blocks (no references taken).
        The last token is never looked up: it must be computed to get logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self.compute_block_hashes(req, max_blocks)
        hits = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Offers to the cache every block of req filled by its first num_tokens tokens.
        Called when those tokens are scheduled, not when computed: a later sequence in the same
        step or in a later plan can then share them (plans execute in order, and a layer writes
        its KV before its attention reads)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        blocks = req.blocks
        if num_full <= blocks.num_hashed:
            return
        hashes = self.compute_block_hashes(req, num_full)
        table = blocks.block_ids
        for i in range(blocks.num_hashed, num_full):
            block, h = table[i], hashes[i]
            # A block already hashed (shared from a hit or a sibling) holds these same tokens;
            # a duplicate of a block already in the cache stays unregistered.
            if self._hash[block] is None and h not in self._cached:
                self._hash[block] = h
                self._cached[h] = block
        blocks.num_hashed = num_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (e.g. after a failed step whose KV writes never landed).
        Blocks in use stay with their holders; they just stop being findable."""
        for block in self._cached.values():
            self._hash[block] = None
        self._cached.clear()
        self._num_cached_free = 0

    # ------------------------------------------------------------------ allocation

    def _needed(self, table: Sequence[int], num_computed: int, end: int, holding: bool) -> int:
        need = max(0, cdiv(end, self.block_size) - len(table))
        first = num_computed // self.block_size
        if num_computed < end and first < len(table):
            block = table[first]
            refs = self._ref[block] + (0 if holding else 1)
            if refs > 1 or self._hash[block] is not None:
                need += 1  # copy-on-write of a shared (or cached, hence immutable) block
        return need

    def blocks_needed(self, req: Request, end: int) -> int:
        """Free blocks that computing req's tokens [num_computed, end) would take."""
        return self._needed(req.blocks.block_ids, req.num_computed_tokens, end, holding=True)

    def admission_cost(self, shared: Sequence[int], num_computed: int, end: int) -> int:
        """Free blocks that admitting a request on top of `shared` (cache hits or a sibling's
        blocks) and computing [num_computed, end) would take: shared blocks that are free now
        leave the free queue too."""
        taken = sum(1 for b in shared if self._ref[b] == 0)
        return taken + self._needed(shared, num_computed, end, holding=False)

    def acquire(self, req: Request, blocks: Sequence[int], cached: bool) -> None:
        """Appends existing blocks to req's table: its prefix-cache hits (cached: already in the
        cache) or a sibling's prompt blocks (offered to the cache again as req fills them)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
                if self._hash[block] is not None:
                    self._num_cached_free -= 1
            self._ref[block] += 1
        req.blocks.block_ids.extend(blocks)
        if cached:
            req.blocks.num_hashed = len(req.blocks.block_ids)
        self._note_usage()

    def reserve(self, req: Request, end: int, rewrites_prompt: bool = False) -> tuple[int, int] | None:
        """Makes req's table hold tokens [0, end) with the block of its next write private.
        Returns the (src, dst) copy when that block had to be copied on write.

        rewrites_prompt: the write only recomputes prompt tokens that a shared or cached block
        already holds (a child's last prompt token, a fully cached prompt's last token): the
        values written equal those there, so the block stays shared and nothing is copied."""
        need = self.blocks_needed(req, end)
        if need > len(self._free):
            raise RuntimeError(f"need {need} free blocks, have {len(self._free)}")
        blocks = req.blocks
        table = blocks.block_ids
        copy = None
        first = req.num_computed_tokens // self.block_size
        if req.num_computed_tokens < end and first < len(table) and not rewrites_prompt:
            src = table[first]
            if self._ref[src] > 1 or self._hash[src] is not None:
                dst = self._allocate()
                table[first] = dst
                self._release(src)
                blocks.num_hashed = min(blocks.num_hashed, first)
                copy = (src, dst)
        for _ in range(cdiv(end, self.block_size) - len(table)):
            table.append(self._allocate())
        self._note_usage()
        return copy

    def slot_owners(self) -> tuple[list[int], list[bytes | None]]:
        """Every block's reference count and cache hash, read only: what writes_in_place reads,
        for a loop that checks a whole micro-batch's slots without a call a sequence."""
        return self._ref, self._hash

    def writes_in_place(self, req: Request) -> bool:
        """True when computing req's next token (at num_computed_tokens) takes no allocation:
        its slot lies in a table block that req alone holds and nobody caches, so that
        reserve(req, num_computed_tokens + 1) would change nothing (no new block, no copy on
        write). The scheduler's decode fast path then skips reserve()."""
        table = req.blocks.block_ids
        index = req.num_computed_tokens // self.block_size
        if index >= len(table):
            return False  # the slot starts a new block
        block = table[index]
        return self._ref[block] == 1 and self._hash[block] is None

    def pin(self, blocks: Sequence[int]) -> None:
        """Holds a reference to blocks someone holds already (a prefix group's prefix)."""
        for block in blocks:
            assert self._ref[block] > 0, "only blocks in use can be pinned"
            self._ref[block] += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._release(block)

    def truncate(self, req: Request, num_blocks: int) -> None:
        """Frees the table entries past the first num_blocks (speculative rollback)."""
        blocks = req.blocks
        table = blocks.block_ids
        for block in reversed(table[num_blocks:]):
            self._release(block)
        del table[num_blocks:]
        blocks.num_hashed = min(blocks.num_hashed, num_blocks)

    def free(self, req: Request) -> None:
        """Drops all of req's references. Tail blocks go first so that, among cached blocks,
        a prompt's later blocks are evicted before the earlier ones others may share."""
        self.truncate(req, 0)

    # ------------------------------------------------------------------ internals

    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:  # evict its cached contents
            self._num_cached_free -= 1
            self._hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        self._free[block] = None
        if self._hash[block] is not None:
            self._num_cached_free += 1  # most recently used: evicted last
        else:
            self._free.move_to_end(block, last=False)  # holds nothing reusable: reuse first

    def _note_usage(self) -> None:
        used = self.num_blocks - len(self._free)
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
