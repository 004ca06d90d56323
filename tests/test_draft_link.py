"""The draft link (one target stage, a draft model): the draft worker's proposals go straight to
the target's stage (token_handoff.DraftIntake), not through the scheduler.

On CPU: the intake puts each step's drafts at its DEVICE_DRAFT inputs' slots whether they come
before or after the step (host paths) or the GPU waits for them (token_waits, recorded), and a
failed proposal leaves older drafts (the tokens stay exact: verification draws its own). Through
a real cluster, a draft model equal to the target has every draft accepted: the drafts reach
the right sequences and positions."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.protocol import DEVICE_DRAFT, PLACEHOLDER_TOKEN
from strata.services.worker.graphs.cuda_graphs import DecodeGraphs
from strata.services.worker.transport import token_waits
from strata.services.worker.transport.token_handoff import DraftIntake
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir
from tests.test_token_waits import FakeReader

K = 2


def _plan(step_id: int, linked: bool = True):
    return SimpleNamespace(step_id=step_id, linked_drafts=linked)


def _inputs(tokens: list[int], rows: list[int]):
    """A verify step's inputs: each sequence's last token then K DEVICE_DRAFTs, its drafts at the
    draft area's slots 100 + row * K + j (device_speculation.source_row)."""
    input_ids, source_rows = [], []
    for token, row in zip(tokens, rows):
        input_ids += [token] + [DEVICE_DRAFT] * K
        source_rows += [row] + [100 + row * K + j for j in range(K)]
    return SimpleNamespace(input_ids=np.asarray(input_ids), source_rows=np.asarray(source_rows))


def test_drafts_before_or_after_their_step_land_at_its_draft_inputs_slots():
    last = torch.zeros(120, dtype=torch.long)
    intake = DraftIntake(last, timeout=5.0)
    # Step 1's proposal came before its plan started here (the draft worker was quicker).
    intake.apply(1, torch.tensor([11, 12, 21, 22]))
    intake.plan_started(_plan(1))
    intake.before_step(1, _inputs([5, 6], [0, 3]))
    assert last[[100, 101, 106, 107]].tolist() == [11, 12, 21, 22]
    # Step 2's comes after: the step waits for it.
    intake.plan_started(_plan(2))
    done = threading.Event()
    t = threading.Thread(target=lambda: (intake.before_step(2, _inputs([7], [3])), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set()
    intake.apply(2, torch.tensor([31, 32]))
    t.join(5)
    assert done.is_set() and last[[106, 107]].tolist() == [31, 32] and intake.waits == 1
    # A step without linked drafts waits for nothing; a failed proposal (None) and one of the wrong
    # size leave the older drafts (the step verifies them: its tokens stay exact).
    intake.plan_started(_plan(3, linked=False))
    intake.before_step(3, _inputs([8], [0]))
    for step, tokens in ((4, None), (5, torch.tensor([1, 2, 3]))):
        intake.apply(step, tokens)
        intake.plan_started(_plan(step))
        intake.before_step(step, _inputs([9], [0]))
    assert last[[100, 101]].tolist() == [11, 12]
    # Tokens of a step that never reached before_step (it failed earlier here) are dropped.
    intake.apply(6, torch.tensor([1, 2]))
    intake.apply(7, torch.tensor([71, 72]))
    intake.plan_started(_plan(7))
    intake.before_step(7, _inputs([9], [0]))
    assert last[[100, 101]].tolist() == [71, 72] and not intake._early


def test_a_missing_proposal_fails_its_step_at_the_deadline():
    intake = DraftIntake(torch.zeros(120, dtype=torch.long), timeout=0.2)
    intake.plan_started(_plan(1))
    with pytest.raises(Exception, match="did not reach"):
        intake.before_step(1, _inputs([5], [0]))


def test_on_the_gpu_path_a_proposal_announced_before_its_plan_started_waits_for_it(monkeypatch):
    """token_waits takes only announcements of plans that started: the draft worker may announce
    step 2's drafts while this stage still runs step 1."""
    queued: list[tuple] = []
    monkeypatch.setattr(token_waits, "wait_geq", lambda stream, word, value: queued.append(("wait", word, value)))
    monkeypatch.setattr(token_waits, "write", lambda stream, word, value: queued.append(("write", word, value)))
    monkeypatch.setattr(token_waits.cuda_driver, "current_stream", lambda device: 0)
    reader = FakeReader()
    last = torch.zeros(120, dtype=torch.long)
    intake = DraftIntake(last, timeout=60.0)
    intake.device_waits = token_waits.IpcTokenWaits(reader, last, 60.0)
    intake.plan_started(_plan(1))
    reader.announce(1, 2)
    reader.announce(2, 2)  # before plan 2 started here
    intake.before_step(1, _inputs([5], [0]))
    assert reader.taken == 1 and reader.credited == 1  # step 1's only
    assert last[[100, 101]].tolist() == [1000, 1001]  # the fake ring's slot 0
    intake.plan_started(_plan(2))
    intake.before_step(2, _inputs([6], [1]))
    assert reader.taken == 2 and last[[102, 103]].tolist() == [1008, 1009]  # slot 1
    assert [op for op in queued if op[0] == "wait"] == [("wait", 0, 1), ("wait", 1, 2)]


def test_a_decode_graphs_inputs_move_on_one_token_into_the_next_positions_slot():
    """ModelRunner.decode_again's move (the draft worker's proposal steps after the first): each
    sequence reads its last draw (a placeholder) at the next position, in the slot its block
    table gives, its draw's noise at the next position; padding rows stay as they were."""
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.rows = {
        "positions": torch.tensor([3, 7, 0]),
        "sample_positions": torch.tensor([4, 8, 0]),
        "seq_lens": torch.tensor([4, 8, 0], dtype=torch.int32),
        "input_ids": torch.tensor([11, 12, 0]),
        "slot_mapping": torch.tensor([23, 47, -1]),
    }
    graphs.block_tables = torch.tensor([[5, 9, 0], [2, 6, 3], [0, 0, 0]], dtype=torch.int32)
    graphs.move_on_one_token(2, block_size=4)  # positions 4 and 8: block 9 and block 3, offset 0
    rows = graphs.rows
    assert rows["positions"].tolist() == [4, 8, 0] and rows["sample_positions"].tolist() == [5, 9, 0]
    assert rows["seq_lens"].tolist() == [5, 9, 0]
    assert rows["input_ids"].tolist() == [PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN, 0]
    assert rows["slot_mapping"].tolist() == [9 * 4, 3 * 4, -1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=7, layers=2)


def test_a_draft_equal_to_the_target_has_every_linked_draft_accepted(model_dir):
    """The draft worker runs all of the target's layers: each of its greedy proposals is the
    target's own greedy continuation, so every draft is accepted only if each reached its own
    sequence and position over the link, several sequences per step."""
    flags = ("--speculative-method", "draft", "--draft-num-layers", "2", "--num-speculative-tokens", "3")
    with running_cluster(model_dir, 1, *flags) as (cluster, client):
        outputs = []

        def one(i):
            outputs.append(
                collect(client.generate(f"prompt {i} " * (1 + i), max_tokens=24, ignore_eos=True, temperature=0.0))
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = scheduler_stats(cluster)
    assert len(outputs) == 6
    assert stats.spec_decode_linked_proposals > 0 and stats.spec_decode_failed_proposals == 0
    assert stats.spec_decode_draft_tokens > 0
    assert stats.spec_decode_accepted_tokens == stats.spec_decode_draft_tokens
