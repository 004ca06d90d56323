"""Speculative decoding in the scheduler: prompt-lookup proposals, k-or-nothing draft-model slots,
rollback, metrics, and outputs equal to plain decoding (fake workers verify the drafts)."""

import random

import numpy as np
import pytest

from strata.protocol import DRAFT_PLACEHOLDER
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.services.scheduler.speculation.ngram_proposer import propose_from
from tests.test_scheduler_policy import (
    VOCAB,
    Driver,
    Request,
    assert_all_blocks_free,
    assert_matches_reference,
    stats_of,
)


def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int32)
    # Suffix [2, 3] occurs at 1 and 5 (the suffix itself excluded): the latest is followed by 7, 8.
    assert propose_from(tokens, 3, 1, 2) == [7, 8, 5]
    # A 3-gram [5, 2, 3] occurs nowhere else; the 2-gram decides.
    assert propose_from(tokens, 2, 1, 3) == [7, 8]
    # Near the end the proposal is shorter; with nothing matching, there is none.
    assert propose_from(np.array([4, 5, 6, 4, 5], dtype=np.int32), 4, 1, 2) == [6, 4, 5]
    assert propose_from(np.array([1, 2, 3, 4], dtype=np.int32), 4, 1, 3) == []
    assert propose_from(tokens, 0, 1, 2) == []


def test_lookup_equals_a_plain_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        n_min, n_max = sorted(rng.sample(range(1, 5), 2))
        k = rng.randint(1, 5)
        expected = []
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]]
            if starts:
                expected = tokens[starts[-1] + n : starts[-1] + n + k]
                break
        assert propose_from(np.array(tokens, dtype=np.int32), k, n_min, n_max) == expected


def periodic_token(req, context):
    """Output that repeats with a period, so prompt lookup pays (and sometimes misses)."""
    period = 3 + req.sampling.seed % 5
    position = len(context)
    return (position % period + req.sampling.seed) % VOCAB if position % 11 else (position * 7) % VOCAB


@pytest.mark.parametrize("pipeline", [1, 2])
def test_ngram_speculation_gives_the_plain_outputs(pipeline):
    rng = random.Random(pipeline)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
    sched = Scheduler(num_blocks=120, block_size=4, max_model_len=96, max_num_batched_tokens=64, speculation=spec)
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))],
            seed=i,
            max_tokens=rng.randint(5, 60),
            stop_token_ids=[VOCAB - 1],
        )
        for i in range(10)
    ]
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, pipeline=pipeline, next_token=periodic_token)
    driver.run()
    assert_matches_reference(driver, requests, 96, next_token=periodic_token)
    stats = stats_of(sched)
    assert stats.spec_decode_drafts > 0 and stats.spec_decode_draft_tokens >= stats.spec_decode_drafts
    assert 0 < stats.spec_decode_accepted_tokens < stats.spec_decode_draft_tokens
    assert stats.spec_decode_accepted_tokens == sum(stats.spec_decode_accepted_per_position)
    per_position = list(stats.spec_decode_accepted_per_position)
    assert per_position == sorted(per_position, reverse=True)  # a later draft needs the earlier ones
    assert stats.spec_decode_acceptance_rate == pytest.approx(
        stats.spec_decode_accepted_tokens / stats.spec_decode_draft_tokens
    )
    assert_all_blocks_free(sched, driver.workers)


def test_no_speculation_above_the_batch_limit():
    spec = SpeculativeConfig("ngram", num_speculative_tokens=2, max_batch=2)
    sched = Scheduler(num_blocks=200, block_size=4, max_model_len=64, speculation=spec)
    requests = [Request(f"r{i}", [1, 2, 1, 2, 1], seed=i, max_tokens=m) for i, m in enumerate((6, 9, 30, 40))]
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, next_token=periodic_token)
    while len(sched.running) < 4:
        driver.step()
    drafted = []
    driver.run(on_plan=lambda plan: drafted.append((len(sched.running), any(s.num_draft for s in plan.seqs))))
    assert all(running <= 2 for running, with_drafts in drafted if with_drafts)
    assert any(with_drafts for _, with_drafts in drafted)  # once requests finish, it speculates
    assert_matches_reference(driver, requests, 64, next_token=periodic_token)


def test_draft_model_slots_are_k_or_nothing_and_leave_no_blocks():
    """The draft method schedules k placeholder slots (the engine fills them from the draft
    worker), or none when max_tokens leaves less room; rollback frees the unaccepted slots."""
    spec = SpeculativeConfig("draft", num_speculative_tokens=3)
    sched = Scheduler(num_blocks=60, block_size=4, max_model_len=64, speculation=spec)
    requests = [Request(f"r{i}", list(range(1, 6 + i)), seed=i, max_tokens=9) for i in range(3)]
    for req in requests:
        sched.add_request(req)
    driver = Driver(sched, next_token=periodic_token)
    counts = []

    def fill_drafts(plan):  # what the engine does with the draft worker's tokens
        for s in plan.seqs:
            if s.num_draft:
                assert s.input_token_ids[-s.num_draft :] == [DRAFT_PLACEHOLDER] * 3
                context = s.request.prompt_token_ids + s.request.output_token_ids
                for j in range(s.num_draft):  # right twice, then wrong
                    token = periodic_token(s.request, context)
                    token = token if j < 2 else (token + 1) % VOCAB
                    s.input_token_ids[len(s.input_token_ids) - s.num_draft + j] = token
                    context = context + [token]
            counts.append(s.num_draft)

    original = driver.workers.execute
    driver.workers.execute = lambda plan: (fill_drafts(plan), original(plan))[1]
    driver.run()
    assert set(counts) == {0, 3} and 3 in counts
    assert_matches_reference(driver, requests, 64, next_token=periodic_token)
    stats = stats_of(sched)
    assert list(stats.spec_decode_accepted_per_position)[:2] == [stats.spec_decode_drafts] * 2
    assert_all_blocks_free(sched, driver.workers)
    assert sorted(sched.spec.draft_releases) == []  # nothing reached a draft worker in this test


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    """Drafts that are right and hold the stop token before their end: the request stops at it
    (once min_tokens allow), and what followed it in the step is dropped."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    sched = Scheduler(num_blocks=40, block_size=4, max_model_len=64, speculation=spec)
    script = [4, 5, 6, 3] * 4  # the output repeats 4 5 6 3; 6 is a stop token from output 4 on

    def next_token(req, context):
        return script[len(context) - req.num_prompt_tokens]

    req = Request("r", [1, 3, 4, 5, 6, 3, 4, 5, 6, 2, 3], max_tokens=14, stop_token_ids=[6], min_tokens=3)
    sched.add_request(req)
    driver = Driver(sched, next_token=next_token)
    driver.run()
    assert req.output_token_ids == [4, 5, 6, 3, 4, 5, 6] and req.stop_token_id == 6
    last = [s for p in driver.workers.plans for s in p.seqs if s.num_draft][-1]
    drafts = last.input_token_ids[-last.num_draft :]
    assert drafts[:3] == [4, 5, 6] and len(drafts) == 4  # the stop token came as an accepted draft
    assert_all_blocks_free(sched, driver.workers)
