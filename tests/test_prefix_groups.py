"""Prefix groups in the scheduler: admitted together once every member arrived and fits, the
prefix computed once and pinned until the last member ends, nothing leaked on cancellation or
preemption; and the plans' shared-prefix groups that cascade attention reads."""

import collections
import random

from strata.services.scheduler.scheduler import Scheduler
from tests.test_scheduler_policy import (
    VOCAB,
    Driver,
    Request,
    assert_all_blocks_free,
    assert_matches_reference,
    stats_of,
)

BS = 4


def group(name, prefix, suffixes, max_tokens=6, seed=0):
    return [
        Request(
            f"{name}/{i}",
            prefix + suffix,
            seed=seed + i,
            max_tokens=max_tokens,
            parent_id=name,
            shared_prefix_len=len(prefix),
            group_size=len(suffixes),
        )
        for i, suffix in enumerate(suffixes)
    ]


def suffixes(rng, count, low=1, high=9):
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_the_prefix_is_computed_once_and_every_member_gets_its_own_output():
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(10)]  # ends mid-block
    members = group("g", prefix, suffixes(rng, 5))
    sched = Scheduler(num_blocks=64, block_size=BS, max_model_len=64, enable_prefix_caching=False)
    for req in members:
        sched.add_request(req)
    driver = Driver(sched)
    driver.run()
    assert_matches_reference(driver, members, 64)
    own = sum(r.num_prompt_tokens - len(prefix) for r in members)
    assert stats_of(sched).prefill_tokens_computed == len(prefix) + own
    assert_all_blocks_free(sched, driver.workers)


def test_members_wait_for_each_other():
    rng = random.Random(1)
    members = group("g", [1, 2, 3, 4, 5, 6], suffixes(rng, 3))
    sched = Scheduler(num_blocks=64, block_size=BS, max_model_len=64)
    for req in members[:2]:
        sched.add_request(req)
    assert sched.schedule() is None  # the third member has not arrived
    sched.add_request(members[2])
    driver = Driver(sched)
    driver.run()
    assert_matches_reference(driver, members, 64)
    assert_all_blocks_free(sched, driver.workers)


def test_a_group_starts_only_when_its_prefix_and_members_fit_and_kv_stays_bounded():
    rng = random.Random(2)
    prefix_a, prefix_b = [rng.randrange(VOCAB) for _ in range(16)], [rng.randrange(VOCAB) for _ in range(16)]
    a = group("a", prefix_a, suffixes(rng, 4, 4, 4), max_tokens=4, seed=10)
    b = group("b", prefix_b, suffixes(rng, 4, 4, 4), max_tokens=4, seed=20)
    # A group starts at 4 prefix blocks + 4 members x 1 own block = 8 of the 12 blocks, and grows
    # to 12 with its outputs: the second group must wait for the first, and nobody is preempted.
    sched = Scheduler(num_blocks=12, block_size=BS, max_model_len=32)
    for req in a + b:
        sched.add_request(req)
    driver = Driver(sched)
    running_groups = []
    driver.run(on_plan=lambda plan: running_groups.append({r.parent_id for r in sched.running}))
    assert all(len(g) <= 1 for g in running_groups) and {"b"} in running_groups  # b started after a
    assert stats_of(sched).preemptions == 0
    assert_matches_reference(driver, a + b, 32)
    assert_all_blocks_free(sched, driver.workers)


def test_the_prefix_stays_pinned_while_later_members_wait():
    """Two members at a time: the first two finish before the last are admitted, and the prefix
    they computed is still there for them (no prefix cache to fall back on)."""
    rng = random.Random(3)
    prefix = [rng.randrange(VOCAB) for _ in range(12)]
    members = group("g", prefix, suffixes(rng, 6))
    sched = Scheduler(num_blocks=64, block_size=BS, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
    for req in members:
        sched.add_request(req)
    driver = Driver(sched)
    driver.run()
    assert_matches_reference(driver, members, 64)
    own = sum(r.num_prompt_tokens - len(prefix) for r in members)
    assert stats_of(sched).prefill_tokens_computed == len(prefix) + own
    assert_all_blocks_free(sched, driver.workers)  # unpinned with the last member


def test_a_group_larger_than_the_whole_cache_still_runs_with_its_prefix_computed_once():
    """20 members x 2 own blocks + 2 prefix blocks = 42 blocks of a 16-block cache: it could never
    start with every member's blocks reserved, so it starts holding only its prefix."""
    rng = random.Random(4)
    prefix = [rng.randrange(VOCAB) for _ in range(8)]
    members = group("g", prefix, suffixes(rng, 20, 5, 8), max_tokens=1)  # no growth: no preemption
    sched = Scheduler(num_blocks=16, block_size=BS, max_model_len=32, enable_prefix_caching=False)
    for req in members:
        sched.add_request(req)
    driver = Driver(sched)
    driver.run()
    assert_matches_reference(driver, members, 32)
    own = sum(r.num_prompt_tokens - len(prefix) for r in members)
    stats = stats_of(sched)
    assert stats.preemptions == 0 and stats.prefill_tokens_computed == len(prefix) + own
    assert_all_blocks_free(sched, driver.workers)


def test_cancelled_and_preempted_members_leak_nothing():
    rng = random.Random(4)
    everyone = []
    sched = Scheduler(num_blocks=40, block_size=BS, max_model_len=40)
    driver = Driver(sched, pipeline=2)
    for g in range(6):
        prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 14))]
        members = group(f"g{g}", prefix, suffixes(rng, rng.randint(1, 5)), max_tokens=rng.randint(3, 12), seed=g * 10)
        everyone += members
        for req in members:
            sched.add_request(req)
    aborted = set()
    for _ in range(100_000):
        if not (sched.unfinished_request_ids() or driver.in_flight):
            break
        if rng.random() < 0.05 and sched.unfinished_request_ids():
            rid = rng.choice(sorted(sched.unfinished_request_ids()))
            sched.abort(rid)
            aborted.add(rid)
        driver.step()
    assert aborted and not sched.sharing.prefix_groups and sched.sharing.reserved_blocks == 0
    done = [r for r in everyone if r.request_id not in aborted]
    assert_matches_reference(driver, done, 40)
    assert_all_blocks_free(sched, driver.workers)


def check_plan_groups(plan, seen: list) -> None:
    """A plan's groups are consecutive runs numbered in order, each of >= 2 members that hold the
    same physical blocks for the whole prefix and compute only past it."""
    if not plan.shared_kv_run_lens:
        return
    groups = {}
    for s, g in zip(plan.seqs, plan.shared_kv_run):
        if g:
            groups.setdefault(g, []).append(s)
    assert sorted(groups) == list(range(1, len(plan.shared_kv_run_lens) + 1))
    order = [g for g in plan.shared_kv_run if g]
    assert order == sorted(order)  # members are consecutive
    assert plan.shared_kv_run[-len(order) :] == order  # after every sequence outside a group
    for g, seqs in groups.items():
        prefix_len = plan.shared_kv_run_lens[g - 1]
        blocks = prefix_len // BS
        assert len(seqs) >= 2 and prefix_len % BS == 0 and blocks > 0
        assert len({tuple(s.request.block_ids[:blocks]) for s in seqs}) == 1  # the same physical blocks
        assert all(s.num_computed >= prefix_len for s in seqs)
        seen.append(({s.request.parent_id for s in seqs}, prefix_len))


def test_plans_name_the_groups_that_share_a_prefix():
    """An explicit group, n > 1 siblings and a lone request, all in flight together: the group's
    members and the siblings are named as groups with their shared blocks, the lone one is not;
    children and requests hitting the same cached blocks are grouped the same way."""
    rng = random.Random(5)
    prefix = [rng.randrange(VOCAB) for _ in range(10)]
    members = group("g", prefix, suffixes(rng, 3), max_tokens=8)
    children = [Request(f"{i}_p", [7, 8, 9, 1, 2, 3, 4, 5, 6], seed=i, max_tokens=8, parent_id="p") for i in range(3)]
    alone = Request("alone", [5, 5, 5, 5, 5], max_tokens=8)
    sched = Scheduler(num_blocks=80, block_size=BS, max_model_len=64)
    for req in members + children + [alone]:
        sched.add_request(req)
    driver = Driver(sched)
    seen = []

    def check(plan):
        check_plan_groups(plan, seen)
        assert all(s.request is not alone for s, g in zip(plan.seqs, plan.shared_kv_run) if g)

    driver.run(on_plan=check)
    assert {"g"} in [parents for parents, _ in seen] and {"p"} in [parents for parents, _ in seen]
    assert_matches_reference(driver, members + children + [alone], 64)


def test_families_that_share_only_a_template_header_are_not_merged():
    """Two groups and a lone request whose prompts all start with the same 8-token header (two
    cached blocks), then differ: each group keeps its own long prefix, and the header alone is
    not passed off as the prefix of everyone (the plan once claimed the longest family's prefix
    for all of them, which a cascade would have read through the wrong blocks)."""
    rng = random.Random(7)
    header = [rng.randrange(VOCAB) for _ in range(8)]
    first = group("a", header + [rng.randrange(VOCAB) for _ in range(12)], suffixes(rng, 3), max_tokens=8)
    second = group("b", header + [rng.randrange(VOCAB) for _ in range(16)], suffixes(rng, 4), max_tokens=8)
    alone = Request("alone", header + [1, 2, 3, 4, 5], max_tokens=8)
    sched = Scheduler(num_blocks=120, block_size=BS, max_model_len=64)
    for req in first + [alone] + second:
        sched.add_request(req)
    driver = Driver(sched)
    seen = []
    driver.run(on_plan=lambda plan: check_plan_groups(plan, seen))
    prefixes = {frozenset(parents): prefix for parents, prefix in seen}
    assert prefixes.get(frozenset({"a"})) == 20 and prefixes.get(frozenset({"b"})) == 24, seen
    assert_matches_reference(driver, first + second + [alone], 64)


def test_disable_cascade_attn_sends_no_groups_and_changes_no_output():
    """--disable-cascade-attn (vLLM's flag): plans carry no shared-prefix groups, the prefix is
    still computed once, and every member's output is the same."""
    rng = random.Random(7)
    members = group("g", [rng.randrange(VOCAB) for _ in range(10)], suffixes(rng, 4))
    sched = Scheduler(num_blocks=64, block_size=BS, max_model_len=64, cascade_attention=False)
    for req in members:
        sched.add_request(req)
    driver = Driver(sched)
    plans = []
    driver.run(on_plan=plans.append)
    assert plans and not any(p.shared_kv_run or p.shared_kv_run_lens for p in plans)
    assert_matches_reference(driver, members, 64)
    assert stats_of(sched).prefill_tokens_computed == 10 + sum(r.num_prompt_tokens - 10 for r in members)
    assert_all_blocks_free(sched, driver.workers)


def test_common_prefix_len_agrees_with_a_plain_walk_whatever_the_guess():
    """The grouping's fast common-run length (slice compares from a guess) against the obvious
    element-by-element walk, over random tables that share some leading run."""
    import os

    from strata.common_prefix import common_prefix_len as _common_prefix_len

    rng = random.Random(11)
    for _ in range(5000):
        a = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        assert _common_prefix_len(a, b, rng.randint(0, 40)) == len(os.path.commonprefix([a, b])), (a, b)


def test_a_started_groups_members_keep_their_seats():
    # Ten groups of 4 members, 32 seats. While a group's first member computes the prefix, the
    # others wait for it; the next groups' first members must not take their seats. Without held
    # seats the first step admitted ten first members, the batch then filled with parts of ten
    # groups, and first members decoded alone while their siblings waited a wave.
    rng = random.Random(7)
    groups = [
        group(f"g{g}", [rng.randrange(VOCAB) for _ in range(12)], suffixes(rng, 4, 2, 2), max_tokens=5, seed=10 * g)
        for g in range(10)
    ]
    sched = Scheduler(num_blocks=512, block_size=BS, max_model_len=64, max_num_seqs=32, max_num_batched_tokens=256)
    for req in [r for members in groups for r in members]:
        sched.add_request(req)
    driver = Driver(sched, pipeline=2)
    admitted_at: dict[str, list[int]] = collections.defaultdict(list)  # group -> its members' admission steps
    full_batches = []

    def on_plan(plan):
        for req in plan.new_requests:
            admitted_at[req.parent_id].append(plan.step_id)
        assert len(sched.running) + sched.sharing.reserved_seats <= sched.max_num_seqs
        if len(sched.running) == sched.max_num_seqs:
            full_batches.append(collections.Counter(r.parent_id for r in sched.running))

    driver.run(on_plan=on_plan)
    # A group's members join within two steps of its first (the prefix's step, then one in flight).
    assert all(max(steps) - min(steps) <= 2 for steps in admitted_at.values()), dict(admitted_at)
    assert full_batches and all(sorted(c.values()) == [4] * 8 for c in full_batches[:1]), full_batches
    assert_matches_reference(driver, [r for members in groups for r in members], 64)
    assert_all_blocks_free(sched, driver.workers)


def test_a_group_larger_than_the_seats_left_starts_with_what_is_free():
    # 6 seats: a group of 5 runs, and a group of 10 (more than the seats) starts beside it once an
    # eighth of the seats (at least one) are free, its other members taking seats as they free up.
    rng = random.Random(8)
    small = group("small", [rng.randrange(VOCAB) for _ in range(8)], suffixes(rng, 5, 2, 2), max_tokens=8, seed=1)
    large = group("large", [rng.randrange(VOCAB) for _ in range(8)], suffixes(rng, 10, 2, 2), max_tokens=3, seed=2)
    sched = Scheduler(num_blocks=128, block_size=BS, max_model_len=64, max_num_seqs=6, max_num_batched_tokens=64)
    for req in small + large:
        sched.add_request(req)
    driver = Driver(sched)
    running = []
    driver.run(on_plan=lambda plan: running.append(collections.Counter(r.parent_id for r in sched.running)))
    assert any(counts["small"] and counts["large"] for counts in running), running
    assert_matches_reference(driver, small + large, 64)
    assert_all_blocks_free(sched, driver.workers)
