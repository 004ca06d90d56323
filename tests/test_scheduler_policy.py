"""Scheduler policy driven by fake workers that play every pipeline stage.

FakeWorkers keeps what real workers keep (per-seq_id block tables built only from plan deltas)
and a simulated KV cache holding (position, token) in every slot. For every plan it checks that
its tables equal the scheduler's, that input tokens are exactly the right slice of prompt +
output, and that every position a sequence attends to holds the right token; it then samples
a deterministic token from the context it read. Plans execute when built, in step order, as
pipeline stages do; results come back later, with up to P plans in flight.
"""

import random
from collections import deque

import pytest

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler.block_manager import cdiv
from strata.services.scheduler.request import Request as SchedulerRequest
from strata.services.scheduler.request import RequestStatus
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2

STOP, LENGTH = engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH
RUNNING = engine_pb2.FINISH_REASON_UNSPECIFIED
TEST_MAX_TOKENS = 16


def Request(request_id, prompt_token_ids, *, seed=0, max_tokens=TEST_MAX_TOKENS, **stop):
    """A scheduler request as the gateway sends it: the fake workers draw from its seed."""
    sampling = engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=seed, logprobs=-1)
    return SchedulerRequest(request_id, prompt_token_ids, sampling, max_tokens=max_tokens, **stop)


def all_tokens(req) -> list[int]:
    return req.prompt_token_ids + req.output_token_ids


def stats_of(sched) -> engine_pb2.SchedulerStats:
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    return stats


VOCAB = 50


def true_token(seed, context):
    """The token a seeded sampler draws after `context` (any function of both would do)."""
    return hash((seed, *context)) % VOCAB


def reference_output(req, max_model_len, next_token=None):
    """Sequential generation with the documented stop rules: what any schedule must produce."""
    next_token = next_token or (lambda r, ctx: true_token(r.sampling.seed, ctx))
    tokens, out = list(req.prompt_token_ids), []
    while True:
        token = next_token(req, tokens)
        stop_allowed = len(out) >= req.min_tokens
        out.append(token)
        tokens.append(token)
        if stop_allowed and not req.ignore_eos and token in req.eos_token_ids:
            return out, STOP
        if stop_allowed and token in req.stop_token_ids:
            return out, STOP
        if len(out) >= req.max_tokens or len(tokens) >= max_model_len:
            return out, LENGTH


class FakeWorkers:
    def __init__(self, sched, next_token=None):
        self.sched = sched
        self.bs = sched.block_size
        self.kv = [[None] * self.bs for _ in range(sched.block_manager.num_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.seen_seq_ids: set[int] = set()
        self.next_token = next_token or (lambda req, ctx: true_token(req.sampling.seed, ctx))
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        for seq_id in plan.released_seq_ids:
            del self.tables[seq_id]
        for req in plan.new_requests:
            assert req.seq_id not in self.seen_seq_ids, "seq ids are never reused"
            self.seen_seq_ids.add(req.seq_id)
            self.tables[req.seq_id] = []
        new_ids = {r.seq_id for r in plan.new_requests}
        # Copy-on-write before the step, as a vectorised worker does it: gather every source,
        # then scatter. No copy may read a block an earlier copy of the same plan writes.
        for i, (src, _) in enumerate(plan.copies):
            assert src not in {dst for _, dst in plan.copies[:i]}
        gathered = [list(self.kv[src]) for src, _ in plan.copies]
        for (_, dst), contents in zip(plan.copies, gathered):
            self.kv[dst] = contents
        for s in plan.seqs:
            table = self.tables[s.seq_id]
            if s.seq_id in new_ids:
                assert s.table_keep == 0
            else:  # a delta: at most the blocks from the one written first onwards
                first_written = s.num_computed // self.bs
                assert len(s.table_append) <= cdiv(s.num_computed + s.num_scheduled, self.bs) - first_written
            assert s.table_keep <= len(table)
            del table[s.table_keep :]
            table.extend(s.table_append)
            assert table == s.request.block_ids, "worker table diverged from the scheduler's"
            assert len(table) == cdiv(s.num_computed + s.num_scheduled, self.bs)
        # Every layer writes the KV of all its tokens before attention reads.
        for s in plan.seqs:
            req = s.request
            confirmed = s.num_scheduled - s.num_draft
            assert len(s.input_token_ids) == s.num_scheduled
            assert s.input_token_ids[:confirmed] == all_tokens(req)[s.num_computed : s.num_computed + confirmed]
            assert s.num_computed + s.num_scheduled <= self.sched.max_model_len
            assert s.sample == (s.num_computed + confirmed == req.num_tokens)
            table = self.tables[s.seq_id]
            for k, token in enumerate(s.input_token_ids):
                pos = s.num_computed + k
                self.kv[table[pos // self.bs]][pos % self.bs] = (pos, token)
        sampled = {}
        for s in plan.seqs:
            req, table = s.request, self.tables[s.seq_id]
            end = s.num_computed + s.num_scheduled
            context = [self.kv[table[p // self.bs]][p % self.bs] for p in range(end)]
            expected = all_tokens(req)[: end - s.num_draft] + s.input_token_ids[s.num_scheduled - s.num_draft :]
            assert context == list(enumerate(expected)), f"{req.request_id} read wrong KV"
            if s.sample:
                sampled[s.seq_id] = self._verify(req, [t for _, t in context], s.num_draft)
        return sampled

    def _verify(self, req, context, num_draft):
        """Greedy-style verification: drafts are accepted while they equal the true token."""
        base = len(context) - num_draft
        out = []
        for i in range(num_draft + 1):
            token = self.next_token(req, context[: base + i])
            out.append(token)
            if i < num_draft and context[base + i] != token:
                break
        return out


class Driver:
    """The engine loop: up to `pipeline` plans in flight over disjoint requests."""

    def __init__(self, sched, pipeline=1, next_token=None):
        self.sched = sched
        self.workers = FakeWorkers(sched, next_token)
        self.pipeline = pipeline
        self.in_flight = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, int] = {}
        self.max_in_flight = 0
        self.mixed_steps = 0  # steps with both a decode and a prefill chunk

    def step(self, propose=None):
        """Schedules a plan if the pipeline has room, else collects the oldest result.
        Returns the plan built, or None."""
        sched = self.sched
        if len(self.in_flight) < self.pipeline:
            if propose:
                propose(sched)
            plan = sched.schedule()
            if plan is not None:
                self._check_plan(plan)
                self.in_flight.append((plan, self.workers.execute(plan)))
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
                return plan
        assert self.in_flight, "nothing in flight and nothing schedulable: stalled"
        plan, sampled = self.in_flight.popleft()
        for update in sched.update(plan, sampled):
            req = update.request
            self.outputs.setdefault(req.request_id, []).extend(update.new_token_ids)
            assert self.outputs[req.request_id] == req.output_token_ids
            if update.finished:
                self.finish[req.request_id] = update.finish_reason
                assert req.is_finished and req.finish_reason == update.finish_reason
        return None

    def _check_plan(self, plan):
        sched = self.sched
        assert sum(s.num_scheduled for s in plan.seqs) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        ids = [s.request.request_id for s in plan.seqs]
        assert len(ids) == len(set(ids))
        busy = {s.request.request_id for p, _ in self.in_flight for s in p.seqs if not s.request.is_finished}
        assert busy.isdisjoint(ids), "a request is in two plans in flight"
        decodes = [
            s for s in plan.seqs if s.num_scheduled - s.num_draft == 1 and s.num_computed >= s.request.num_prompt_tokens
        ]
        if decodes and len(decodes) < len(plan.seqs):
            self.mixed_steps += 1

    def run(self, max_steps=100_000, propose=None, on_plan=None):
        for _ in range(max_steps):
            if not (bool(self.sched.unfinished_request_ids()) or self.in_flight):
                return
            plan = self.step(propose)
            if plan is not None and on_plan:
                on_plan(plan)
        raise AssertionError("did not finish")


def assert_all_blocks_free(sched, workers=None):
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    stats = stats_of(sched)
    assert stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0
    assert sched.num_in_flight == 0
    if workers is not None:  # every sequence the workers hold is released by the next plan
        assert set(workers.tables) == set(sched.pending_releases)


def make_requests(rng, count, max_prompt, max_tokens, prefix=(), **kw):
    return [
        Request(
            f"r{i}",
            list(prefix) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))],
            seed=1000 + i,
            max_tokens=rng.randint(1, max_tokens),
            **kw,
        )
        for i in range(count)
    ]


def assert_matches_reference(driver, requests, max_model_len, next_token=None):
    for req in requests:
        out, reason = reference_output(req, max_model_len, next_token)
        assert driver.outputs[req.request_id] == out, req.request_id
        assert driver.finish[req.request_id] == reason
        assert req.output_token_ids == out


# ---------------------------------------------------------------------------- batching


def test_continuous_batching_many_requests_mixed_lengths():
    rng = random.Random(0)
    sched = Scheduler(num_blocks=400, block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    requests = make_requests(rng, 24, max_prompt=90, max_tokens=20)
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched)
    running_seen = []
    driver.run(on_plan=lambda plan: running_seen.append(len(sched.running)))
    assert_matches_reference(driver, requests, 128)
    assert max(running_seen) == 8  # the running cap binds, and is respected (checked per plan)
    assert driver.mixed_steps > 0  # decodes and prefill chunks share steps
    stats = stats_of(sched)
    assert stats.preemptions == 0 and stats.finished_requests == 24
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    assert stats.prefill_tokens_computed + stats.prefix_cache_hits == prompt_tokens
    assert stats.decode_tokens_computed == sum(len(r.output_token_ids) - 1 for r in requests)
    # Continuous batching: far fewer steps than tokens.
    assert stats.steps < (prompt_tokens / 64) + sum(r.max_tokens for r in requests) / 4
    assert_all_blocks_free(sched, driver.workers)


def test_chunked_prefill_mixes_with_decodes():
    sched = Scheduler(num_blocks=200, block_size=8, max_model_len=512, max_num_batched_tokens=32)
    short = Request("short", list(range(5)), max_tokens=30, seed=1)
    long = Request("long", [i % VOCAB for i in range(300)], max_tokens=3, seed=2)
    sched.add_request(short)
    sched.add_request(long)
    driver = Driver(sched)
    chunks = []

    def on_plan(plan):
        by_id = {s.request.request_id: s for s in plan.seqs}
        if "long" in by_id and by_id["long"].num_computed < 300:
            chunks.append((by_id["long"].num_scheduled, by_id["long"].sample, "short" in by_id))

    driver.run(on_plan=on_plan)
    # Step 1: short's prompt (5) + 27 of long's; then 1 decode + a 31-token chunk per step.
    assert chunks[0] == (27, False, True)
    assert all(c == (31, False, True) for c in chunks[1:-1])
    assert sum(c[0] for c in chunks) == 300 and chunks[-1][1] is True
    assert len(chunks) == 10
    assert_matches_reference(driver, [short, long], 512)
    assert_all_blocks_free(sched, driver.workers)


@pytest.mark.parametrize("pipeline", [1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_tiny_pool_loses_nothing(pipeline, prefix_caching):
    rng = random.Random(1)
    sched = Scheduler(
        num_blocks=16,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=48,
        enable_prefix_caching=prefix_caching,
    )
    requests = make_requests(rng, 12, max_prompt=30, max_tokens=30)
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, pipeline=pipeline)
    driver.run()
    stats = stats_of(sched)
    assert stats.preemptions > 0
    assert any(r.num_preemptions > 0 and len(r.output_token_ids) > 1 for r in requests)
    assert stats.peak_used_kv_blocks <= 16
    # Identical to an unconstrained run (the reference is sequential, unbatched generation).
    assert_matches_reference(driver, requests, 64)
    assert_all_blocks_free(sched, driver.workers)


def test_preemption_victim_is_latest_arrived_and_it_resumes_first():
    sched = Scheduler(num_blocks=6, block_size=4, max_model_len=24)
    requests = [Request(name, [i] * 7, seed=i, max_tokens=10) for i, name in enumerate("abc")]
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched)
    order = []

    def on_plan(plan):
        for req in requests:
            while order.count(req.request_id) < req.num_preemptions:
                order.append(req.request_id)
        if order and not plan.new_requests:
            assert [r.request_id for r in sched.waiting] == sorted(r.request_id for r in sched.waiting)

    driver.run(on_plan=on_plan)
    assert order[:2] == ["c", "b"]  # c arrived last; then b, the latest left, preempts itself
    assert "a" not in order
    assert_matches_reference(driver, requests, 24)
    assert_all_blocks_free(sched, driver.workers)


def test_plans_in_flight_cover_disjoint_requests():
    rng = random.Random(2)
    sched = Scheduler(num_blocks=300, block_size=4, max_model_len=128, max_num_batched_tokens=40)
    requests = make_requests(rng, 20, max_prompt=60, max_tokens=25)
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, pipeline=3)  # Driver checks disjointness on every plan
    driver.run()
    assert driver.max_in_flight == 3
    assert_matches_reference(driver, requests, 128)
    assert_all_blocks_free(sched, driver.workers)


def test_abort_mid_flight_frees_blocks_at_once():
    rng = random.Random(3)
    sched = Scheduler(num_blocks=100, block_size=4, max_model_len=128, max_num_batched_tokens=256)
    requests = make_requests(rng, 6, max_prompt=20, max_tokens=1)
    for req in requests:
        req.max_tokens = 10
    waiting_victim = Request("waiting", [1, 2, 3], max_tokens=5)
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, pipeline=2)
    driver.step()  # plan 1: every prompt
    driver.step()  # plan 2: nothing schedulable (all in flight) -> collects plan 1
    plan = driver.step()  # plan 2: decodes
    victim = plan.seqs[0].request
    assert victim.in_flight and victim.block_ids
    seq_id, blocks = victim.seq_id, len(victim.block_ids)
    free_before = sched.block_manager.num_free_blocks
    assert sched.abort(victim.request_id)
    assert not sched.abort(victim.request_id) and not sched.abort("nope")
    assert victim.status is RequestStatus.FINISHED_ABORTED and victim.block_ids == []
    assert sched.block_manager.num_free_blocks == free_before + blocks
    assert sched.num_in_flight == len(plan.seqs) - 1
    sched.add_request(waiting_victim)
    assert sched.abort("waiting") and not sched.waiting
    # The in-flight plan's result for the victim is ignored; its seq id is released next.
    outputs_before = list(victim.output_token_ids)
    driver.step()  # collects plan 2 (plan 3 cannot run: the others are all in flight)
    assert victim.output_token_ids == outputs_before
    next_plan = driver.step()
    assert seq_id in next_plan.released_seq_ids
    driver.run()
    assert_matches_reference(driver, [r for r in requests if r is not victim], 128)
    assert_all_blocks_free(sched, driver.workers)


# ---------------------------------------------------------------------------- stop rules


def scripted(script):
    """Sampler emitting script[i] as the i-th output token."""
    return lambda req, ctx: script[len(ctx) - req.num_prompt_tokens]


@pytest.mark.parametrize(
    "kwargs, script, expected, reason, stop_reason",
    [
        (dict(eos_token_ids=[2]), [5, 2, 7, 7], [5, 2], STOP, None),
        (dict(eos_token_ids=[2], min_tokens=2), [5, 2, 2, 7], [5, 2, 2], STOP, None),
        (dict(eos_token_ids=[2], min_tokens=1), [2, 2, 7], [2, 2], STOP, None),
        (dict(eos_token_ids=[2], ignore_eos=True, max_tokens=4), [2, 2, 2, 2, 2], [2, 2, 2, 2], LENGTH, None),
        (dict(stop_token_ids=[9]), [1, 9, 3], [1, 9], STOP, 9),
        (dict(stop_token_ids=[9], ignore_eos=True), [9], [9], STOP, 9),
        (dict(stop_token_ids=[9], min_tokens=3), [9, 9, 9, 9], [9, 9, 9, 9], STOP, 9),
        (dict(max_tokens=3), [1, 2, 3, 4, 5], [1, 2, 3], LENGTH, None),
        (dict(max_tokens=1), [4], [4], LENGTH, None),
        (dict(max_tokens=100), [1] * 10, [1] * 6, LENGTH, None),  # max_model_len = 16
    ],
)
def test_stop_conditions(kwargs, script, expected, reason, stop_reason):
    sched = Scheduler(num_blocks=16, block_size=4, max_model_len=16)
    req = Request("r", list(range(10)), **kwargs)
    sched.add_request(req)
    driver = Driver(sched, next_token=scripted(script))
    driver.run()
    assert req.output_token_ids == expected
    assert driver.finish["r"] == reason and req.finish_reason == reason
    assert req.stop_token_id == stop_reason
    assert_all_blocks_free(sched, driver.workers)


def test_invalid_requests_are_rejected():
    sched = Scheduler(num_blocks=16, block_size=4, max_model_len=16)
    with pytest.raises(ValueError):
        sched.add_request(Request("long", list(range(16))))
    with pytest.raises(ValueError):
        sched.add_request(Request("empty", []))
    with pytest.raises(ValueError):
        sched.add_request(Request("zero", [1], max_tokens=0))
    sched.add_request(Request("ok", [1]))
    with pytest.raises(ValueError):
        sched.add_request(Request("ok", [2]))
    with pytest.raises(ValueError):
        Scheduler(num_blocks=3, block_size=4, max_model_len=16)
    assert sched.schedule() is not None


# ---------------------------------------------------------------------------- sharing


def test_prefix_cache_across_and_within_steps():
    sched = Scheduler(num_blocks=64, block_size=4, max_model_len=64)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    first = [Request(f"a{i}", prompt, seed=i, max_tokens=3) for i in range(3)]
    for req in first:
        sched.add_request(req)
    driver = Driver(sched)
    plan = driver.step()
    assert [s.num_scheduled for s in plan.seqs] == [18, 2, 2]  # repeats in one step share
    driver.run()
    later = Request("later", prompt + [7, 7], seed=9, max_tokens=3)
    sched.add_request(later)
    driver.run()
    assert later.num_cached_prompt_tokens == 16
    assert [r.num_cached_prompt_tokens for r in first] == [0, 16, 16]
    stats = stats_of(sched)
    assert stats.prefix_cache_queries == 3 * 18 + 20 and stats.prefix_cache_hits == 48
    assert stats.prefill_tokens_computed == 18 + 2 + 2 + 4
    assert_matches_reference(driver, first + [later], 64)
    assert_all_blocks_free(sched, driver.workers)


@pytest.mark.parametrize("pipeline", [1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_children_compute_prompt_once_and_share_blocks(pipeline, prefix_caching):
    sched = Scheduler(num_blocks=64, block_size=8, max_model_len=128, enable_prefix_caching=prefix_caching)
    prompt = [(7 * i) % VOCAB for i in range(37)]  # 4 full blocks + 5 tokens
    children = [Request(f"{i}_p", prompt, seed=i, max_tokens=6, parent_id="p") for i in range(4)]
    for child in children:
        sched.add_request(child)
    driver = Driver(sched, pipeline=pipeline)
    shared_tables = []

    def on_plan(plan):
        if all(c.status is RequestStatus.RUNNING for c in children):
            shared_tables.append([c.block_ids[:4] for c in children])

    driver.run(on_plan=on_plan)
    stats = stats_of(sched)
    # The prompt is computed once; each other child computes only its last prompt token.
    assert stats.prefill_tokens_computed == 37 + 3
    assert [c.num_cached_prompt_tokens for c in children] == [0, 36, 36, 36]
    # One copy of the full prompt blocks; a private copy of the partial block each.
    assert shared_tables and all(t.count(t[0]) == 4 for t in shared_tables)
    assert sum(len(p.copies) for p in driver.workers.plans) == 3
    assert stats.peak_used_kv_blocks == 4 + 4 * 2
    assert len({tuple(c.output_token_ids) for c in children}) == 4  # different seeds
    assert_matches_reference(driver, children, 128)
    assert_all_blocks_free(sched, driver.workers)


def test_children_with_block_aligned_prompt_need_no_copy():
    sched = Scheduler(num_blocks=64, block_size=8, max_model_len=128)
    prompt = list(range(33))  # position 32, the last, starts a new block
    children = [Request(f"{i}_q", prompt, seed=i, max_tokens=4, parent_id="q") for i in range(3)]
    for child in children:
        sched.add_request(child)
    driver = Driver(sched)
    driver.run()
    assert stats_of(sched).prefill_tokens_computed == 33 + 2
    assert all(not p.copies for p in driver.workers.plans)
    assert_matches_reference(driver, children, 128)
    assert_all_blocks_free(sched, driver.workers)


def test_children_rewrite_last_prompt_token_in_shared_full_block_without_copy():
    """A prompt filling whole blocks: each child recomputes its last prompt token inside the
    shared last block; the values equal what is there, so no child copies it."""
    sched = Scheduler(num_blocks=64, block_size=8, max_model_len=128)
    prompt = [(5 * i) % VOCAB for i in range(32)]  # exactly 4 full blocks
    children = [Request(f"{i}_r", prompt, seed=i, max_tokens=8, parent_id="r") for i in range(4)]
    for child in children:
        sched.add_request(child)
    driver = Driver(sched, pipeline=2)
    driver.run()
    stats = stats_of(sched)
    assert all(not p.copies for p in driver.workers.plans)
    # One copy of the prompt (4 blocks) plus one block of generated tokens per child.
    assert stats.peak_used_kv_blocks == 4 + 4
    assert_matches_reference(driver, children, 128)
    assert_all_blocks_free(sched, driver.workers)


# ---------------------------------------------------------------------------- speculation


def test_speculative_drafts_roll_back_rejected_slots():
    rng = random.Random(5)
    sched = Scheduler(num_blocks=200, block_size=4, max_model_len=96, max_num_batched_tokens=64)
    requests = make_requests(rng, 8, max_prompt=20, max_tokens=40)
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, pipeline=2)
    rejected_steps = []

    def propose(s):
        for req in s.running:
            if req.in_flight:
                continue
            # Two right guesses then a wrong one, sometimes: exercises accept and rollback.
            ctx = all_tokens(req)
            drafts = []
            for _ in range(rng.randint(1, 4)):
                token = true_token(req.sampling.seed, ctx + drafts)
                drafts.append(token if rng.random() < 0.7 else (token + 1) % VOCAB)
            req.spec.draft_token_ids = drafts

    original_update = sched.update

    def checked_update(plan, sampled):
        updates = original_update(plan, sampled)
        for s in plan.seqs:
            req = s.request
            if s.num_draft and not req.is_finished:
                assert len(req.block_ids) == cdiv(req.num_computed_tokens, 4)
                assert req.num_computed_tokens == req.num_tokens - 1
                if len(sampled[s.seq_id]) < s.num_draft + 1:
                    rejected_steps.append(s.seq_id)
        return updates

    sched.update = checked_update
    driver.run(propose=propose)
    assert rejected_steps
    assert any(s.num_draft for p in driver.workers.plans for s in p.seqs)
    assert_matches_reference(driver, requests, 96)
    assert_all_blocks_free(sched, driver.workers)


# ---------------------------------------------------------------------------- randomized


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_mix_leaves_every_block_free(seed):
    rng = random.Random(seed)
    max_model_len = 48
    sched = Scheduler(
        num_blocks=14,
        block_size=4,
        max_model_len=max_model_len,
        max_num_seqs=rng.choice([4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    pending: list[Request] = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        common = dict(
            max_tokens=rng.randint(1, 25),
            min_tokens=rng.randint(0, 3),
            eos_token_ids=[0],
            stop_token_ids=rng.choice([[], [1]]),
            ignore_eos=rng.random() < 0.2,
        )
        if rng.random() < 0.25:
            pending += [Request(f"{j}_g{i}", prompt, seed=7 * i + j, parent_id=f"g{i}", **common) for j in range(3)]
        else:
            pending.append(Request(f"r{i}", prompt, seed=7 * i, **common))
    everyone = list(pending)
    aborted = set()
    driver = Driver(sched, pipeline=rng.choice([1, 2, 3]))

    def propose(s):
        for req in s.running:
            if not req.in_flight and rng.random() < 0.3:
                req.spec.draft_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]

    for _ in range(20_000):
        while pending and rng.random() < 0.3:  # arrivals over time
            sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and bool(sched.unfinished_request_ids()):  # client cancellations
            req = rng.choice([r for r in everyone if r.arrival >= 0 and not r.is_finished])
            assert sched.abort(req.request_id)
            aborted.add(req.request_id)
        if not (pending or bool(sched.unfinished_request_ids()) or driver.in_flight):
            break
        if bool(sched.unfinished_request_ids()) or driver.in_flight:
            driver.step(propose)
    else:
        raise AssertionError("did not finish")
    assert aborted and stats_of(sched).preemptions > 0
    done = [r for r in everyone if r.request_id not in aborted]
    assert_matches_reference(driver, done, max_model_len)
    assert_all_blocks_free(sched, driver.workers)


# ---------------------------------------------------------------------------- decode lookahead


def test_decode_lookahead_schedules_ahead_of_results_and_drops_steps_after_a_stop():
    from strata.protocol import PLACEHOLDER_TOKEN

    sched = Scheduler(num_blocks=32, block_size=4, max_model_len=64, decode_lookahead=2)
    req = Request("a", [3, 4, 5], max_tokens=10, eos_token_ids=frozenset({9}))
    sched.add_request(req)
    p1 = sched.schedule()  # the prompt, sampling its first token
    p2 = sched.schedule()  # decode of that token, not back yet
    p3 = sched.schedule()  # and of the next one
    assert sched.schedule() is None  # two lookaheads at most
    assert p1.seqs[0].input_token_ids == [3, 4, 5]
    for plan, position in ((p2, 3), (p3, 4)):
        seq = plan.seqs[0]
        assert seq.input_token_ids == [PLACEHOLDER_TOKEN] and seq.sample
        assert (seq.num_computed, seq.num_scheduled) == (position, 1)
    assert stats_of(sched).lookahead_decodes == 2
    assert [u.new_token_ids for u in sched.update(p1, {p1.seqs[0].seq_id: [7]})] == [[7]]
    # The token sampled in p2 (p2's input was p1's token, filled in by the worker) is eos.
    (upd,) = sched.update(p2, {p2.seqs[0].seq_id: [9]})
    assert upd.finished and upd.finish_reason == STOP and req.output_token_ids == [7, 9]
    assert sched.update(p3, {p3.seqs[0].seq_id: [1]}) == []  # computed past the stop: dropped
    stats = stats_of(sched)
    assert stats.used_kv_blocks == 0 and stats.free_kv_blocks == 32


def test_decode_lookahead_stops_short_of_max_tokens():
    sched = Scheduler(num_blocks=32, block_size=4, max_model_len=64, decode_lookahead=2)
    req = Request("b", [3, 4, 5], max_tokens=2)
    sched.add_request(req)
    p1 = sched.schedule()
    p2 = sched.schedule()  # computes the 2nd and last token
    assert sched.schedule() is None  # a 3rd would only be dropped
    sched.update(p1, {p1.seqs[0].seq_id: [7]})
    (upd,) = sched.update(p2, {p2.seqs[0].seq_id: [8]})
    assert upd.finished and upd.finish_reason == LENGTH and req.output_token_ids == [7, 8]
    assert stats_of(sched).used_kv_blocks == 0


# ---------------------------------------------------------------------------- fast paths


def plan_fields(plan):
    """Everything a plan says, field by field (requests by id)."""
    if plan is None:
        return None
    return (
        plan.step_id,
        [r.request_id for r in plan.new_requests],
        list(plan.released_seq_ids),
        [
            (
                s.request.request_id,
                s.seq_id,
                s.num_computed,
                s.num_scheduled,
                list(s.input_token_ids),
                s.table_keep,
                list(s.table_append),
                s.sample,
                s.num_draft,
            )
            for s in plan.seqs
        ],
        list(plan.copies),
    )


def scheduler_state(sched):
    """Every request's fields, the block manager's tables, cache and free queue, and the stats.
    White-box on purpose (the fast paths must leave exactly the state the general path leaves, down
    to the free queue's order): the one place tests read the scheduler's and block manager's private
    tables."""
    bm = sched.block_manager
    clocks = ("arrival_time", "queue_seconds")  # wall-clock readings, not scheduling state
    requests = {
        rid: {
            **{k: v for k, v in vars(req).items() if k not in clocks},
            "blocks": (req.blocks.block_ids, req.blocks.hashes, req.blocks.num_hashed),
        }
        for rid, req in sched._requests.items()
    }
    return (
        requests,
        [r.request_id for r in sched.running],
        [r.request_id for r in sched.waiting],
        sched.pending_releases,
        stats_of(sched),
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        bm._hash,
        list(bm._free),
        bm._cached,
        bm.num_cached_blocks,
        sched.num_in_flight,
    )


def position_token(req, position):
    """The token sampled at `position` of req: depends on nothing the schedule decides."""
    return hash((req.sampling.seed, position)) % VOCAB


def sample_plan(plan):
    """A worker's result for plan (placeholders are never read): drafts are accepted while they
    equal position_token, as a greedy verifier would."""
    sampled = {}
    for s in plan.seqs:
        if not s.sample:
            continue
        base = s.num_computed + s.num_scheduled - s.num_draft  # where the first sampled token goes
        drafts = s.input_token_ids[len(s.input_token_ids) - s.num_draft :]
        tokens = []
        for i in range(s.num_draft + 1):
            tokens.append(position_token(s.request, base + i))
            if i < s.num_draft and drafts[i] != tokens[-1]:
                break
        sampled[s.seq_id] = tokens
    return sampled


@pytest.mark.parametrize("lookahead", [0, 2, "2 stages"])
@pytest.mark.parametrize("num_blocks", [14, 40])
@pytest.mark.parametrize("seed", [21, 22])
def test_fast_paths_build_the_plans_and_state_of_the_general_path(lookahead, num_blocks, seed):
    """Two schedulers, one with fast_paths off, get the same requests, drafts, aborts and
    results in lockstep: every plan, update and piece of state must be identical. The workload
    mixes decode lookaheads crossing block boundaries, prefix-cache hits, preemptions, n > 1
    siblings sharing a prompt, speculative drafts, stop tokens and aborts while in flight; "2
    stages" runs pipelined decode's micro-batches (P + 2 of them, two plans each in flight)."""
    rng = random.Random(seed)
    stages = 2 if lookahead == "2 stages" else 1
    lookahead = 2 if stages > 1 else lookahead
    pipeline = 2 * (stages + 2) if stages > 1 else lookahead + 1 if lookahead else 2
    make = lambda: Scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=48,
        max_num_seqs=6 if stages == 1 else 2,
        max_num_batched_tokens=24,
        decode_lookahead=lookahead,
        num_micro_batches=stages + 2 if stages > 1 else 1,
        pipeline_stages=stages,
        decode_repeats=1,  # (repeated plans reserve blocks earlier: test_micro_batches.py covers them)
    )
    fast, general = make(), make()
    general.fast_paths = False
    fast_decodes = []
    real_fast_path = fast._decode_in_place
    fast._decode_in_place = lambda req, *args: fast_decodes.append(req.request_id) or real_fast_path(req, *args)
    real_run = fast._look_ahead_in_place_run

    def counted_run(running, i, *args):  # the fused lookahead loop: its requests count as fast decodes
        taken = real_run(running, i, *args)
        fast_decodes.extend(r.request_id for r in running[i:taken])
        return taken

    fast._look_ahead_in_place_run = counted_run
    general._decode_in_place = general._look_ahead_in_place_run = None  # the general path must never reach them

    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 13))] for _ in range(3)]
    pending = []  # (request_id, kwargs) in arrival order
    for i in range(30):
        kw = dict(
            prompt_token_ids=rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
            max_tokens=rng.randint(1, 30),
            min_tokens=rng.randint(0, 2),
            eos_token_ids=[0],
            stop_token_ids=rng.choice([[], [1]]),
            ignore_eos=rng.random() < 0.5,
        )
        if rng.random() < 0.25:
            pending += [(f"{j}_g{i}", dict(kw, seed=7 * i + j, parent_id=f"g{i}")) for j in range(3)]
        else:
            pending.append((f"r{i}", dict(kw, seed=7 * i)))

    in_flight = deque()  # (fast plan, general plan, the result for both)
    counts = dict(aborts=0, lookahead_table_growth=0, drafts=0, copies=0, stops=0, decodes=0, fused_results=0)
    for _ in range(20_000):
        while pending and rng.random() < 0.3:  # arrivals over time
            rid, kw = pending.pop(0)
            fast.add_request(Request(rid, **kw))
            general.add_request(Request(rid, **kw))
        if rng.random() < 0.02 and bool(fast._requests):  # cancellations, also while in flight
            rid = rng.choice(sorted(fast._requests))
            assert fast.abort(rid) and general.abort(rid)
            counts["aborts"] += 1
        if not (pending or bool(fast._requests) or in_flight):
            break
        plan = None
        if len(in_flight) < pipeline:
            for req in fast.running:  # drafts (a lookahead drops them: its input is not known)
                if req.output_token_ids and rng.random() < 0.3:
                    drafts = [
                        position_token(req, req.num_tokens + j) if rng.random() < 0.7 else rng.randrange(VOCAB)
                        for j in range(rng.randint(1, 3))
                    ]
                    req.spec.draft_token_ids = drafts
                    general._requests[req.request_id].spec.draft_token_ids = list(drafts)
            plan, general_plan = fast.schedule(), general.schedule()
            assert plan_fields(plan) == plan_fields(general_plan)
            if plan is not None:
                in_flight.append((plan, general_plan, sample_plan(plan)))
                counts["drafts"] += sum(1 for s in plan.seqs if s.num_draft)
                counts["copies"] += len(plan.copies)
                counts["decodes"] += sum(
                    1 for s in plan.seqs if s.num_scheduled == 1 and s.num_computed >= s.request.num_prompt_tokens
                )
                counts["lookahead_table_growth"] += sum(
                    1 for s in plan.seqs if s.input_token_ids == [PLACEHOLDER_TOKEN] and s.table_append
                )
        if plan is None and in_flight:
            plan, general_plan, sampled = in_flight.popleft()
            # The fused result path where the result is one token each, in the plan's order.
            ids = [s.seq_id for s in plan.seqs if s.seq_id in sampled]
            fused = None
            if all(len(sampled[i]) == 1 for i in ids):
                fused = fast.update_one_token_each(plan, ids, [sampled[i][0] for i in ids])
            counts["fused_results"] += fused is not None
            if fused is not None:  # (its running requests as the updates update() gives them)
                running, tokens, others = fused
                got = [(r.request_id, [t], False, RUNNING, None) for r, t in zip(running, tokens)] + [
                    (u.request.request_id, list(u.new_token_ids), u.finished, u.finish_reason, u.stop_token_id)
                    for u in others
                ]
            else:
                got = [
                    (u.request.request_id, list(u.new_token_ids), u.finished, u.finish_reason, u.stop_token_id)
                    for u in fast.update(plan, sampled)
                ]
            expected = [
                (u.request.request_id, u.new_token_ids, u.finished, u.finish_reason, u.stop_token_id)
                for u in general.update(general_plan, sampled)
            ]
            assert sorted(got) == sorted(expected)
            updates = got
            counts["stops"] += sum(1 for u in updates if u[3] == STOP)
        assert scheduler_state(fast) == scheduler_state(general)
    else:
        raise AssertionError("did not finish")
    stats = stats_of(fast)
    assert stats.prefix_cache_hits and counts["copies"] and counts["aborts"] and counts["stops"]
    assert len(fast_decodes) > counts["decodes"] / 2  # the fast path did most decodes
    assert counts["fused_results"]
    if num_blocks == 14:
        assert stats.preemptions
    if lookahead:
        assert stats.lookahead_decodes and counts["lookahead_table_growth"]
    else:
        assert counts["drafts"]
    assert_all_blocks_free(fast)
    assert_all_blocks_free(general)
