"""KVBlockManager: allocation, reference counts, prefix cache (hits, LRU eviction, chained
hashes), copy-on-write, and the all-blocks-free invariant."""

import random
from collections import Counter

import pytest

from strata.services.scheduler.block_manager import KVBlockManager, hash_block, root_hash
from strata.services.scheduler.request import Request
from strata.v1 import engine_pb2


def make_req(tokens, rid="r"):
    return Request(rid, list(tokens), engine_pb2.SamplingOptions(top_p=1.0), max_tokens=1)


def schedule_tokens(bm, req, end):
    """What the scheduler does for one step: reserve blocks, cache the full ones, advance."""
    copy = bm.reserve(req, end)
    bm.register_full_blocks(req, end)
    req.num_computed_tokens = end
    return copy


def admit(bm, req):
    """Admission through the prefix cache; returns the number of cached tokens."""
    hits = bm.lookup(req)
    bm.acquire(req, hits, cached=True)
    req.num_computed_tokens = len(hits) * bm.block_size
    return req.num_computed_tokens


def check_consistent(bm, live):
    """Reference counts equal table memberships; the free queue is exactly the unreferenced
    blocks; the cached count is the free blocks that still hold a hash."""
    counts = Counter(b for req in live for b in req.block_ids)
    for block in range(bm.num_blocks):
        assert bm.ref_count(block) == counts.get(block, 0), block
    free = [b for b in range(bm.num_blocks) if counts.get(b, 0) == 0]
    assert bm.num_free_blocks == len(free)
    assert bm.num_cached_blocks == sum(1 for b in free if bm.is_cached(b))


def test_allocate_free_and_refcounts():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    req = make_req(range(10))
    assert bm.blocks_needed(req, 10) == 3
    assert schedule_tokens(bm, req, 10) is None
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert all(bm.ref_count(b) == 1 for b in req.block_ids)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 3)
    # Growing within the last partial block needs nothing; crossing into a new one needs one.
    assert bm.blocks_needed(req, 12) == 0
    assert bm.blocks_needed(req, 13) == 1
    with pytest.raises(RuntimeError):
        bm.reserve(req, 10 + 4 * 6)
    bm.free(req)
    assert req.block_ids == []
    assert bm.num_free_blocks == 8 and bm.peak_used_blocks == 3
    check_consistent(bm, [])


def test_prefix_hit_across_requests_after_free():
    bm = KVBlockManager(num_blocks=16, block_size=4)
    a = make_req(range(10), "a")
    assert admit(bm, a) == 0
    schedule_tokens(bm, a, 10)
    full_blocks = a.block_ids[:2]
    bm.free(a)
    assert bm.num_cached_blocks == 2  # the partial third block is not cached

    b = make_req(list(range(8)) + [99, 98, 97], "b")
    free_before = bm.num_free_blocks
    assert admit(bm, b) == 8
    assert b.block_ids == full_blocks
    # A hit on a cached free block takes it out of the free queue.
    assert bm.num_free_blocks == free_before - 2 and bm.num_cached_blocks == 0
    bm.record_prefix_query(b.num_prompt_tokens, 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (11, 8)
    schedule_tokens(bm, b, 11)
    check_consistent(bm, [b])
    bm.free(b)
    check_consistent(bm, [])


def test_prefix_hit_within_same_step_before_any_result():
    """Blocks are cached when scheduled, so a repeat in the same step shares them."""
    bm = KVBlockManager(num_blocks=16, block_size=4)
    a, b = make_req(range(13), "a"), make_req(range(13), "b")
    admit(bm, a)
    schedule_tokens(bm, a, 13)  # nothing computed yet: the step has not run
    assert admit(bm, b) == 12
    assert b.block_ids == a.block_ids[:3]
    assert [bm.ref_count(x) for x in a.block_ids] == [2, 2, 2, 1]
    schedule_tokens(bm, b, 13)
    assert b.block_ids[3] != a.block_ids[3]
    check_consistent(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    check_consistent(bm, [])


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    a = make_req(range(8), "a")
    schedule_tokens(bm, a, 8)
    bm.free(a)
    b = make_req(range(8), "b")
    assert admit(bm, b) == 4  # the second block holds the last token: it is recomputed
    assert bm.blocks_needed(b, 8) == 1


def test_lru_eviction_of_cached_blocks():
    bm = KVBlockManager(num_blocks=4, block_size=2)
    reqs = [make_req([10 * i, 10 * i + 1, 7], f"p{i}") for i in range(3)]
    for req in reqs:  # each caches one full block (and holds one partial block)
        schedule_tokens(bm, req, 3)
        bm.free(req)
    assert bm.num_cached_blocks == 3
    # The oldest cached block (p0's) goes first; uncached free blocks go before any cached one.
    hog = make_req(range(100, 106), "hog")
    schedule_tokens(bm, hog, 2)  # takes the one free uncached block
    assert bm.num_cached_blocks == 3
    bm.reserve(hog, 4)
    assert bm.num_cached_blocks == 2
    assert bm.lookup(make_req(reqs[0].prompt_token_ids)) == []
    assert len(bm.lookup(make_req(reqs[1].prompt_token_ids))) == 1
    # A hit protects a block from eviction: p1's block is taken, so p2's is evicted next.
    p1 = make_req(reqs[1].prompt_token_ids, "p1 again")
    admit(bm, p1)
    hog.num_computed_tokens = 4
    bm.reserve(hog, 6)
    assert bm.lookup(make_req(reqs[2].prompt_token_ids)) == []
    assert len(bm.lookup(make_req(reqs[1].prompt_token_ids))) == 1
    check_consistent(bm, [hog, p1])


def test_copy_on_write_of_shared_partial_block():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    leader = make_req(range(6), "leader")
    schedule_tokens(bm, leader, 6)  # blocks [x, y]; y holds positions 4..5
    x, y = leader.block_ids
    children = [make_req(range(6), f"c{i}") for i in range(2)]
    for child in children:  # share the prompt but for its last token
        bm.acquire(child, leader.block_ids, cached=False)
        child.num_computed_tokens = 5
    assert bm.ref_count(y) == 3
    # A child writing position 5 into the shared block copies it first.
    assert bm.blocks_needed(children[0], 6) == 1
    src, dst = bm.reserve(children[0], 6)
    assert (src, children[0].block_ids) == (y, [x, dst])
    assert bm.ref_count(y) == 2 and bm.ref_count(dst) == 1
    src, dst2 = bm.reserve(children[1], 6)
    assert src == y and dst2 not in (dst, y)
    # The last holder writes in place.
    assert bm.ref_count(y) == 1
    assert bm.blocks_needed(leader, 7) == 0
    assert bm.reserve(leader, 7) is None and leader.block_ids == [x, y]
    assert bm.ref_count(x) == 3
    check_consistent(bm, [leader, *children])
    for req in (leader, *children):
        bm.free(req)
    assert bm.num_free_blocks == 8
    check_consistent(bm, [])


def test_cached_block_is_immutable_even_for_its_only_holder():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    a = make_req(range(4), "a")
    schedule_tokens(bm, a, 4)
    b = make_req(range(4), "b")
    bm.acquire(b, a.block_ids, cached=False)
    b.num_computed_tokens = 3
    bm.free(a)
    (block,) = b.block_ids
    assert bm.ref_count(block) == 1 and bm.is_cached(block)
    assert bm.blocks_needed(b, 4) == 1
    src, dst = bm.reserve(b, 4)
    assert src == block and b.block_ids == [dst]
    # The original stays in the cache, free.
    assert bm.num_cached_blocks == 1 and bm.lookup(make_req(range(5))) == [block]


def test_truncate_frees_surplus_blocks():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    req = make_req(range(3))
    schedule_tokens(bm, req, 14)  # e.g. a step with draft tokens
    bm.truncate(req, 2)
    assert len(req.block_ids) == 2
    assert bm.num_free_blocks == 6
    check_consistent(bm, [req])


def test_chained_hash_depends_on_prefix_and_salt():
    block = [5, 6, 7, 8]
    root = root_hash("")
    assert hash_block(root, block) == hash_block(root_hash(""), list(block))
    assert hash_block(root, block) != hash_block(root_hash("tenant-b"), block)
    assert hash_block(root, block) != hash_block(hash_block(root, [1, 2, 3, 4]), block)
    assert hash_block(root, block) != hash_block(root, [5, 6, 7, 9])

    def hashes(tokens, salt=""):
        bm = KVBlockManager(num_blocks=4, block_size=4, cache_salt=salt)
        return bm.compute_block_hashes(make_req(tokens), len(tokens) // 4)

    same_second_block = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([1, 2, 3, 0, 5, 6, 7, 8])
    assert same_second_block[0][1] != same_second_block[1][1]
    assert hashes([1, 2, 3, 4]) == hashes([1, 2, 3, 4])
    assert hashes([1, 2, 3, 4]) != hashes([1, 2, 3, 4], salt="model-v2")


def test_prefix_caching_disabled():
    bm = KVBlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_req(range(9), "a")
    schedule_tokens(bm, a, 9)
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.lookup(make_req(range(9))) == []


def test_reset_prefix_cache_forgets_every_block():
    bm = KVBlockManager(num_blocks=8, block_size=4)
    a, b = make_req(range(9), "a"), make_req(range(100, 109), "b")
    schedule_tokens(bm, a, 9)
    schedule_tokens(bm, b, 9)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.lookup(make_req(range(100, 109))) != []
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.lookup(make_req(range(9))) == [] and bm.lookup(make_req(range(100, 109))) == []
    bm.free(b)
    check_consistent(bm, [])


def test_random_mix_leaves_every_block_free():
    rng = random.Random(7)
    bm = KVBlockManager(num_blocks=40, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: list[Request] = []
    hits = copies = 0
    for step in range(600):
        op = rng.random()
        if op < 0.35:  # a new request, often repeating a prefix
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            req = make_req(tokens, f"r{step}")
            hits += admit(bm, req) > 0
            end = req.num_tokens
            if bm.blocks_needed(req, end) <= bm.num_free_blocks:
                schedule_tokens(bm, req, end)
                live.append(req)
            else:
                bm.free(req)
        elif op < 0.55 and live:  # a sibling sharing a live request's prompt, then writing
            src = rng.choice(live)
            child = make_req(src.prompt_token_ids + src.output_token_ids, f"c{step}")
            need = child.num_tokens - 1
            bm.acquire(child, src.block_ids[: -(-need // 4)], cached=False)
            child.num_computed_tokens = need
            if bm.blocks_needed(child, need + 1) <= bm.num_free_blocks:
                copies += schedule_tokens(bm, child, need + 1) is not None
                live.append(child)
            else:
                bm.free(child)
        elif op < 0.8 and live:  # decode a token
            req = rng.choice(live)
            req.output_token_ids.append(rng.randrange(50))
            if bm.blocks_needed(req, req.num_tokens) <= bm.num_free_blocks:
                schedule_tokens(bm, req, req.num_tokens)
            else:
                req.output_token_ids.pop()
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        check_consistent(bm, live)
    assert hits > 20 and copies > 20  # the mix exercised the cache and copy-on-write
    for req in live:
        bm.free(req)
    assert bm.num_cached_blocks > 0
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    check_consistent(bm, [])


def test_writes_in_place_exactly_when_reserve_would_change_nothing():
    bm = KVBlockManager(num_blocks=16, block_size=4)
    req = make_req(range(6))
    schedule_tokens(bm, req, 6)
    assert bm.writes_in_place(req)  # slot 6 lies in its own partial block
    schedule_tokens(bm, req, 8)
    assert not bm.writes_in_place(req)  # slot 8 starts a new block
    schedule_tokens(bm, req, 9)
    # A sibling sharing the partial block: the write must copy it first.
    other = make_req(range(9), "other")
    bm.acquire(other, req.block_ids, cached=False)
    other.num_computed_tokens = 9
    assert not bm.writes_in_place(req) and bm.blocks_needed(req, 10) == 1
    bm.free(other)
    assert bm.writes_in_place(req) and bm.blocks_needed(req, 10) == 0
    # A cached (hashed) block is immutable: writing into it copies too.
    req.num_computed_tokens = 4
    assert not bm.writes_in_place(req) and bm.blocks_needed(req, 5) == 1
    for end in range(5, 13):
        req.num_computed_tokens = end - 1
        table, refs = list(req.block_ids), [bm.ref_count(b) for b in range(16)]
        in_place = bm.writes_in_place(req)
        copy = bm.reserve(req, end)
        assert in_place == (copy is None and req.block_ids == table and [bm.ref_count(b) for b in range(16)] == refs)
