"""Which replica a request goes to (data parallelism): by load, with prefix affinity. Pure: the
replica set (replicas.py) gives it each replica's load and whether it is up.

Load is in tokens, the issue's "queued and running tokens": prompt plus output so far of every
request a replica holds (its KV footprint and decode cost). Affinity: a request whose prompt
starts with blocks that an earlier request routed somewhere also started with goes there, so its
scheduler finds them in its prefix cache, unless that replica's load is past a bound
(consistent hashing with bounded loads): a burst sharing one system prompt then spreads, each
replica computing the prompt once. The n > 1 siblings of a request and the members of a prefix
group share one route (replicas.Route), so they always land together.

PrefixIndex is a flat, hash-keyed version of SGLang's approximate radix tree per worker
(sgl-router's cache_aware policy): chained hashes of a prompt's leading full blocks, the
boundaries the scheduler's prefix cache keys on, each naming the replica a prompt starting with
those blocks was last routed to, bounded by LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Blocks of a prompt the index keys (deeper matches are rarer and cost more to hash).
MAX_INDEXED_BLOCKS = 64
# Entries the index keeps (a few tens of MB at most); the least recently used go first.
MAX_INDEX_ENTRIES = 1 << 18
# A shared prefix shorter than this is not worth sending a request to a busier replica for.
MIN_AFFINITY_TOKENS = 32
# Affinity holds while the replica's load is at most this many times the mean of the other
# replicas' (up ones), plus the request's.
LOAD_BOUND = 1.25

LOAD, AFFINITY, GROUP, RESUME = "load", "affinity", "group", "resume"
REASONS = (LOAD, AFFINITY, GROUP, RESUME)


def block_hashes(prompt: Sequence[int], block_size: int, max_blocks: int = MAX_INDEXED_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's leading full blocks: the j-th names blocks 0..j together."""
    hashes, h = [], 0
    for j in range(min(len(prompt) // block_size, max_blocks)):
        h = hash((h, *prompt[j * block_size : (j + 1) * block_size]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """Chained block hash -> the replica the latest prompt with those leading blocks went to."""

    def __init__(self, max_entries: int = MAX_INDEX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, hashes: Sequence[int]) -> tuple[int | None, int]:
        """(replica, matched blocks) of the deepest of `hashes` present; (None, 0) if none is."""
        replica, depth = None, 0
        for j, h in enumerate(hashes):
            found = self._entries.get(h)
            if found is None:
                break
            replica, depth = found, j + 1
        return replica, depth

    def insert(self, hashes: Sequence[int], replica: int) -> None:
        entries = self._entries
        for h in hashes:
            entries[h] = replica
            entries.move_to_end(h)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica lost its cache (it went down): nothing routes there for affinity any more."""
        for h in [h for h, r in self._entries.items() if r == replica]:
            del self._entries[h]


class Router:
    """Picks a replica for a request, given each replica's load (None: down)."""

    def __init__(self, block_size: int, index: PrefixIndex | None = None):
        self.block_size = block_size
        self.index = index if index is not None else PrefixIndex()

    def choose(
        self,
        prompt: Sequence[int],
        cost: int,
        loads: Sequence[float | None],
        affinity: bool = True,
        exclude: int | None = None,
    ) -> tuple[int | None, str]:
        """(replica index, reason) for a request of `cost` tokens starting with `prompt`:
        the replica its prefix went to when it matches at least MIN_AFFINITY_TOKENS and that
        replica's load is within the bound (LOAD_BOUND), else the least-loaded replica that is up (the
        lowest index on ties). (None, LOAD) when none is up but `exclude`. The prompt's blocks
        are recorded for the replica chosen."""
        up = [i for i, load in enumerate(loads) if load is not None and i != exclude]
        if not up:
            return None, LOAD
        if len(loads) == 1:
            return up[0], LOAD
        hashes = block_hashes(prompt, self.block_size) if affinity else []
        choice, reason = None, LOAD
        if hashes:
            replica, depth = self.index.match(hashes)
            if replica in up and depth * self.block_size >= MIN_AFFINITY_TOKENS:
                others = [loads[i] for i in up if i != replica]
                mean = sum(others) / len(others) if others else 0.0
                if loads[replica] <= LOAD_BOUND * mean + cost:
                    choice, reason = replica, AFFINITY
        if choice is None:
            choice = min(up, key=lambda i: (loads[i], i))
        if hashes:
            self.index.insert(hashes, choice)
        return choice, reason


def effective_load(local_tokens: float, others_tokens: float | None, kv_used_fraction: float | None) -> float:
    """The load a replica is routed by: what this gateway has running there now, plus what its
    scheduler last held beyond what this gateway had there then (other gateways' requests);
    raised as its KV cache fills (from half used, +100% at 95% used), where admissions start to
    wait for blocks. (Not the polled figure itself: half a second old, it sent a whole burst past
    a replica that had just finished its requests.)"""
    load = local_tokens + (others_tokens or 0.0)
    if kv_used_fraction is not None and kv_used_fraction > 0.5:
        load *= 1.0 + min(1.0, (kv_used_fraction - 0.5) / 0.45)
    return load
