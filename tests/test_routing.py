"""The gateway's router (services/gateway/routing.py), pure: load, prefix affinity and its bound,
replicas that are down, the index's LRU."""

from __future__ import annotations

import random

from strata.services.gateway.routing import (
    AFFINITY,
    LOAD,
    LOAD_BOUND,
    MIN_AFFINITY_TOKENS,
    PrefixIndex,
    Router,
    block_hashes,
    effective_load,
)

BS = 4


def prompt(shared: list[int], own: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return shared + [rng.randrange(1000, 2000) for _ in range(own)]


def test_block_hashes_chain_the_leading_full_blocks():
    a = list(range(10))
    b = list(range(8)) + [99, 98]
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert len(ha) == 2 == len(hb)  # 10 tokens: two full blocks of 4
    assert ha == hb  # the same first 8 tokens
    c = [0, 1, 2, 3, 4, 5, 6, 9]
    assert block_hashes(c, BS)[0] == ha[0] and block_hashes(c, BS)[1] != ha[1]
    # chained: the second block's hash depends on the first block too
    assert block_hashes([7, 7, 7, 7, 4, 5, 6, 7], BS)[1] != ha[1]
    assert len(block_hashes(list(range(1000)), BS, max_blocks=64)) == 64


def test_least_loaded_replica_that_is_up_wins_lowest_index_on_ties():
    router = Router(BS)
    assert router.choose([1, 2, 3], 3, [5.0, 2.0, 2.0]) == (1, LOAD)
    assert router.choose([1, 2, 3], 3, [5.0, None, 2.0]) == (2, LOAD)  # replica 1 is down
    assert router.choose([1, 2, 3], 3, [0.0, 0.0, 0.0], exclude=0) == (1, LOAD)
    assert router.choose([1, 2, 3], 3, [None, None]) == (None, LOAD)
    assert router.choose([1, 2, 3], 3, [None, 7.0], exclude=1) == (None, LOAD)
    assert router.choose([1, 2, 3], 3, [9.0]) == (0, LOAD)  # one replica: no hashing at all
    assert len(router.index) == 0


def test_a_shared_prefix_sticks_to_its_replica_until_the_load_bound_then_spills():
    router = Router(BS)
    system = list(range(48))  # 12 full blocks: past MIN_AFFINITY_TOKENS
    loads = [0.0, 0.0]
    placed = []
    for i in range(40):
        p = prompt(system, 20, seed=i)
        cost = len(p)
        replica, reason = router.choose(p, cost, loads)
        if i:
            # Affinity (to where the latest went) while that replica's load is within the bound of
            # the other's, else the least loaded, which the prefix then follows.
            last = placed[-1][0]
            expect_affinity = loads[last] <= LOAD_BOUND * loads[1 - last] + cost
            assert (reason == AFFINITY) == expect_affinity, (i, loads, placed[-1])
            assert replica == (last if expect_affinity else loads.index(min(loads)))
        loads[replica] += cost
        placed.append((replica, reason))
    reasons = [r for _, r in placed]
    assert reasons[:2] == [LOAD, AFFINITY]  # the first follower sticks at once
    assert reasons.count(AFFINITY) > 30 and LOAD in reasons[2:]  # mostly sticks, spilling past the bound
    assert abs(loads[0] - loads[1]) <= (LOAD_BOUND - 1) * min(loads) + 2 * len(prompt(system, 20, 0))


def test_affinity_needs_a_long_enough_shared_prefix_and_an_up_replica():
    router = Router(BS)
    short = list(range(MIN_AFFINITY_TOKENS - BS))
    first, _ = router.choose(short + [500, 501, 502, 503], 8, [0.0, 0.0])
    assert router.choose(short + [600, 601, 602, 603], 8, [0.0 if first else 1.0, 1.0 if first else 0.0])[1] == LOAD
    long = list(range(MIN_AFFINITY_TOKENS + BS))
    replica, _ = router.choose(long + [1], 10, [0.0, 0.0])
    assert router.choose(long + [2], 10, [3.0, 3.0]) == (replica, AFFINITY)
    down = [None, None]
    down[1 - replica] = 3.0
    assert router.choose(long + [3], 10, down) == (1 - replica, LOAD)  # its replica went down
    assert router.choose(long + [4], 10, [3.0, 3.0], affinity=False)[1] == LOAD


def test_the_prefix_index_forgets_least_recently_used_and_lost_replicas():
    index = PrefixIndex(max_entries=4)
    a, b = block_hashes(list(range(8)), BS), block_hashes(list(range(100, 108)), BS)
    index.insert(a, 0)
    assert index.match(a) == (0, 2)
    index.insert(b, 1)  # 4 entries: full
    index.insert(a, 0)  # a used again: b is now the oldest
    c = block_hashes(list(range(200, 208)), BS)
    index.insert(c, 1)
    assert len(index) == 4
    assert index.match(b) == (None, 0) and index.match(a) == (0, 2) and index.match(c) == (1, 2)
    assert index.match(a[:1] + [12345]) == (0, 1)  # the deepest match counts
    index.forget(1)
    assert index.match(c) == (None, 0) and index.match(a) == (0, 2)


def test_effective_load_adds_other_gateways_and_rises_with_kv_pressure():
    assert effective_load(100, None, None) == 100
    assert effective_load(100, 50, None) == 150
    assert effective_load(100, 0, 0.5) == 100
    assert effective_load(100, 0, 0.95) == 200
    assert 100 < effective_load(100, 0, 0.7) < 200
    assert effective_load(100, 0, 1.0) == 200
