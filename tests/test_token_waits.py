"""Stage 0's token intake where its GPU waits (services/worker/transport/token_waits.py), on CPU: the order
it queues the waits and scatters in, the announcements checked against it and credited, the
deadline of a wait nobody answered, and close() releasing every wait. The stream operations are
recorded instead of queued (tests/gpu/test_recovery_gpu.py and test_pipelined_decode_gpu.py run
them on a GPU)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from strata.services.worker.transport import token_waits
from strata.services.worker.transport.doorbell import Announcement
from strata.services.worker.transport.stage_transport import StepFailed

SLOTS, ROWS = 4, 8


class FakeRing:
    def __init__(self):
        self.slots = SLOTS
        self.buffer = torch.arange(SLOTS * ROWS, dtype=torch.int64) + 1000  # slot s, row r: 1000 + s*ROWS + r
        self.released: list[int] = []

    def ready_word(self, slot: int) -> int:
        return slot

    def consumed_word(self, slot: int) -> int:
        return SLOTS + slot

    def view(self, slot: int, part: int, shape) -> torch.Tensor:
        return self.buffer[slot * ROWS : slot * ROWS + shape[0]]

    def release_words(self, count: int) -> None:
        self.released.append(count)


class FakeReader:
    """The doorbell's side: announcements the test makes arrive, credits counted."""

    def __init__(self):
        self.ring = FakeRing()
        self.arrived: collections.deque[Announcement] = collections.deque()
        self.taken = 0
        self.credited = 0

    def announce(self, step_id: int, rows: int, error: str = "") -> None:
        self.arrived.append(Announcement(step_id, self.taken + len(self.arrived), rows, 0, error))

    def next(self, block: bool):
        assert not block  # the intake never blocks its step thread
        if not self.arrived:
            return None
        self.taken += 1
        return self.arrived.popleft()

    def release(self) -> None:
        self.credited = self.taken


@pytest.fixture
def ops(monkeypatch):
    """The stream operations, in the order they were queued."""
    queued: list[tuple] = []
    monkeypatch.setattr(token_waits, "wait_geq", lambda stream, word, value: queued.append(("wait", word, value)))
    monkeypatch.setattr(token_waits, "write", lambda stream, word, value: queued.append(("write", word, value)))
    monkeypatch.setattr(token_waits.cuda_driver, "current_stream", lambda device: 0)
    return queued


def make(timeout: float = 60.0):
    reader = FakeReader()
    last_sampled = torch.zeros(16, dtype=torch.int64)
    return reader, last_sampled, token_waits.IpcTokenWaits(reader, last_sampled, timeout)


def start(waits, step_id: int, rows: list[int] | None):
    waits.expect(step_id)
    if rows is not None:
        waits.set_rows(step_id, torch.tensor(rows, dtype=torch.int64))


def test_a_step_queues_waits_and_scatters_in_order_up_to_the_step_it_needs(ops):
    reader, last_sampled, waits = make()
    start(waits, 10, [3, 5])  # number 0: slot 0
    start(waits, 11, [7])  # number 1: slot 1
    start(waits, 12, [2])  # number 2: slot 2
    assert waits.queue_through(11) == 2
    assert ops == [("wait", 0, 1), ("write", SLOTS + 0, 1), ("wait", 1, 2), ("write", SLOTS + 1, 2)]
    assert last_sampled[[3, 5, 7]].tolist() == [1000, 1001, 1000 + ROWS]  # slot 0 rows 0-1, slot 1 row 0
    assert waits.queue_through(11) == 0  # queued once
    assert waits.queue_through(12) == 1 and ops[-2] == ("wait", 2, 3)


def test_announcements_are_credited_at_once_and_applied_only_when_needed_or_defer_steps_old(ops):
    """The last stage announces a step as it launches it, before its GPU has drawn the tokens: a
    wait queued then would hold stage 0's next step for tokens it does not need. So an announced
    step is applied when a step needs it, or once `defer` (half the ring's slots) sampling steps
    old, which frees its slot before the ring comes round."""
    reader, last_sampled, waits = make()
    assert waits.defer == SLOTS // 2
    start(waits, 10, [1])
    start(waits, 11, [2])
    waits.queue_through(10)
    reader.announce(10, 1)
    reader.announce(11, 1)
    waits.pump()
    assert reader.credited == 2
    assert [op for op in ops if op[0] == "wait"] == [("wait", 0, 1)]  # step 11's: no step needs it yet
    start(waits, 12, [3])
    waits.pump()
    assert len(ops) == 2  # one sampling step old
    start(waits, 13, [4])
    waits.pump()  # two old: applied
    assert ops[2:] == [("wait", 1, 2), ("write", SLOTS + 1, 2)]
    assert last_sampled[2].item() == 1000 + ROWS
    reader.announce(12, 1)
    waits.pump()  # announced, one step old: deferred
    assert waits.queue_through(12) == 1 and ops[-2] == ("wait", 2, 3)  # a step needs it: queued


def test_a_failed_step_keeps_the_order_and_a_step_that_failed_here_scatters_nothing(ops):
    reader, last_sampled, waits = make()
    start(waits, 10, None)  # failed on stage 0 before its rows
    start(waits, 11, [4])
    reader.announce(10, 0, error="stage 1: boom")
    reader.announce(11, 1)
    waits.pump()
    assert ops == []  # nothing needed them yet
    waits.queue_through(11)
    assert ops == [("wait", 0, 1), ("write", SLOTS, 1), ("wait", 1, 2), ("write", SLOTS + 1, 2)]
    assert last_sampled.tolist().count(0) == 15 and last_sampled[4].item() == 1000 + ROWS


def test_an_announcement_out_of_the_expected_order_fails_and_releases_the_waits(ops):
    reader, _, waits = make()
    start(waits, 10, [1])
    reader.announce(12, 1)
    with pytest.raises(StepFailed, match="out of the expected order"):
        waits.pump()
    assert reader.ring.released == [1]
    with pytest.raises(StepFailed, match="closed"):
        waits.queue_through(10)


def test_a_wait_no_announcement_answered_fails_the_next_step_past_the_deadline(ops):
    reader, _, waits = make(timeout=0.05)
    start(waits, 10, [1])
    waits.queue_through(10)
    waits.pump()  # within the deadline
    waits._pending[0].queued_at -= 1.0
    with pytest.raises(StepFailed, match="did not reach stage 0"):
        waits.pump()


def test_close_releases_every_wait_queued_or_to_come(ops):
    reader, _, waits = make()
    for step in (10, 11, 12):
        start(waits, step, [1])
    waits.queue_through(12)
    waits.close("pipeline re-initialised")
    assert reader.ring.released == [3]  # the next number: every wait is for one at most
    with pytest.raises(StepFailed):
        waits.queue_through(12)


def test_the_intake_queues_what_a_steps_placeholders_need_and_counts_the_gpus_waits(ops):
    """TokenIntake with the GPU's waits (token_handoff.py): a lookahead's placeholders at row 3
    queue the wait for the step that last sampled row 3, not the host's."""
    from types import SimpleNamespace

    from strata.protocol import PLACEHOLDER_TOKEN
    from strata.services.worker.transport.token_handoff import TokenIntake

    reader, last_sampled, waits = make()
    intake = TokenIntake(last_sampled, timeout=60.0)
    intake.device_waits = waits

    def step(step_id, input_ids, rows):
        rows = np.asarray(rows, dtype=np.int64)
        intake.plan_started(SimpleNamespace(step_id=step_id, sample=[True] * len(rows)))
        ids = np.asarray(input_ids, dtype=np.int64)
        h = SimpleNamespace(
            input_ids=ids,
            token_rows=rows,
            has_placeholders=bool((ids < 0).any()),
            sample_seq_ids=list(range(len(rows))),
            sample_rows=rows,
            verify=None,
        )
        intake.before_step(step_id, h)

    step(10, [5, 6], [3, 9])  # samples rows 3 and 9: number 0, slot 0
    step(11, [PLACEHOLDER_TOKEN], [3])  # needs step 10's token for row 3
    assert intake.waits == 1 and intake.wait_seconds == 0.0
    assert ops[:2] == [("wait", 0, 1), ("write", SLOTS, 1)]
    assert last_sampled[[3, 9]].tolist() == [1000, 1001]
    step(12, [7], [4])  # no placeholders: nothing queued, nothing waited
    assert intake.waits == 1 and len(ops) == 2


def test_four_micro_batches_wait_on_the_gpu_only_for_the_tokens_they_need(ops):
    """Two stages, four micro-batches taking turns: step j decodes the rows step j - 4 sampled.
    The last stage announces each step as it launches it, two steps ahead of stage 0's: stage 0
    then queues, before step j, waits for steps up to j - 4 only (or `defer` old), never for the
    steps the last stage's GPU may still be running."""
    from types import SimpleNamespace

    from strata.protocol import PLACEHOLDER_TOKEN
    from strata.services.worker.transport.token_handoff import TokenIntake

    reader, last_sampled, waits = make()
    waits.defer = 16  # a real ring's (32 slots); this fake ring's 4 would recycle at 2 steps old
    intake = TokenIntake(last_sampled, timeout=60.0)
    intake.device_waits = waits
    for j in range(24):
        rows = np.array([j % 4], dtype=np.int64)  # micro-batch j % 4's one sequence
        if j >= 2:  # steps up to j - 2 announced by now (step ids from 100)
            reader.announce(j - 2 + 100, 1)
        intake.plan_started(SimpleNamespace(step_id=j + 100, sample=[True]))
        ids = np.array([PLACEHOLDER_TOKEN if j >= 4 else 5], dtype=np.int64)
        before = len(ops)
        intake.before_step(
            j + 100,
            SimpleNamespace(
                input_ids=ids,
                token_rows=rows,
                has_placeholders=j >= 4,
                sample_seq_ids=[0],
                sample_rows=rows,
                verify=None,
            ),
        )
        waited = [value - 1 for op, _, value in ops[before:] if op == "wait"]  # sampling numbers
        assert all(n <= j - 4 for n in waited), (j, waited)
        if j >= 4:
            assert waits._queued == j - 3  # through step j - 4's: what it needs
    assert reader.credited == reader.taken  # every announcement credited at once


# ------------------------------------------------------------------ a distributed (NCCL) token link


class FakeNcclReceiver:
    """The distributed token receiver's side: receives posted and waited for, in one log (a
    receive's buffer holds what the last stage sent for that step, 100 * step + i, only once
    waited for), and announcements the test makes."""

    max_rows = ROWS

    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.arrived: collections.deque[Announcement] = collections.deque()

    def start_receive(self, step_id: int, buf: torch.Tensor) -> list:
        self.log.append(("post", step_id))
        buf.fill_(-1)  # not yet arrived
        return [(step_id, buf)]

    def finish_receive(self, works: list) -> None:
        for step_id, buf in works:
            self.log.append(("wait", step_id))
            buf.copy_(torch.arange(ROWS) + 100 * step_id)

    def posted(self) -> list[int]:
        return [step for op, step in self.log if op == "post"]

    def waited(self) -> list[int]:
        return [step for op, step in self.log if op == "wait"]

    def next_announcement(self, block: bool):
        assert not block  # the intake never blocks its step thread
        return self.arrived.popleft() if self.arrived else None

    def announce(self, step_id: int, rows: int, error: str = "") -> None:
        self.arrived.append(Announcement(step_id, 0, rows, 0, error))


def make_nccl(timeout: float = 60.0, buffers: int = 2):
    receiver = FakeNcclReceiver()
    last_sampled = torch.zeros(16, dtype=torch.int64)
    return receiver, last_sampled, token_waits.NcclTokenWaits(receiver, last_sampled, timeout, buffers=buffers)


def test_nccl_receives_are_posted_in_order_before_any_announcement_and_scattered(ops):
    receiver, last_sampled, waits = make_nccl()
    start(waits, 10, [3, 5])
    start(waits, 11, [7])
    start(waits, 12, [2])
    assert waits.queue_through(11) == 2  # nothing announced yet: the GPU waits, not the host
    assert receiver.log == [("post", 10), ("wait", 10), ("post", 11), ("wait", 11)]
    assert last_sampled[[3, 5, 7]].tolist() == [1000, 1001, 1100]
    assert waits.queue_through(12) == 1 and receiver.posted() == [10, 11, 12]  # buffer 0 again
    assert last_sampled[2].item() == 1200
    receiver.announce(10, 2)
    receiver.announce(11, 1)
    waits.pump()
    assert receiver.posted() == [10, 11, 12]  # announcements of posted receives post nothing more


def test_an_nccl_receive_is_posted_at_its_announcement_and_waited_for_only_when_a_step_needs_it(ops):
    """Posted at once, the last stage's sends never wait for stage 0's receives; waited for at
    once, stage 0's GPU would wait for tokens its next step does not need (as the ipc ring's)."""
    receiver, last_sampled, waits = make_nccl(buffers=4)
    assert waits.defer == 2
    start(waits, 10, [1])
    start(waits, 11, [2])
    receiver.announce(10, 1)
    waits.pump()
    assert receiver.log == [("post", 10)] and last_sampled[1].item() == 0
    assert waits.queue_through(10) == 1
    assert receiver.log == [("post", 10), ("wait", 10)] and last_sampled[1].item() == 1000
    receiver.announce(11, 1)
    waits.pump()
    assert receiver.waited() == [10]  # step 11's: posted, not waited for
    start(waits, 12, [3])
    start(waits, 13, [4])
    waits.pump()  # step 11 is two sampling steps old: applied
    assert receiver.log == [("post", 10), ("wait", 10), ("post", 11), ("wait", 11)]
    assert last_sampled[2].item() == 1100


def test_an_nccl_buffer_is_received_into_again_only_after_its_scatter(ops):
    receiver, last_sampled, waits = make_nccl(buffers=2)
    for step in (10, 11, 12):
        start(waits, step, [step - 10])
        receiver.announce(step, 1)
    waits.pump()  # step 12's receive goes to step 10's buffer: step 10's scatter is queued first
    assert receiver.log[:4] == [("post", 10), ("post", 11), ("wait", 10), ("post", 12)]
    assert last_sampled[0].item() == 1000


def test_an_nccl_step_known_failed_before_any_need_is_received_but_not_scattered(ops):
    receiver, last_sampled, waits = make_nccl()
    start(waits, 10, [4])
    start(waits, 11, [6])
    receiver.announce(10, 0, error="stage 1: boom")  # its filler still comes: the pairs stay in order
    receiver.announce(11, 1)
    waits.pump()
    assert receiver.posted() == [10, 11]
    assert waits.queue_through(11) == 1  # step 10's: applied (nothing to scatter) at defer
    assert receiver.waited() == [11]
    assert last_sampled[4].item() == 0 and last_sampled[6].item() == 1100


def test_an_nccl_announcement_out_of_order_or_past_the_deadline_fails_the_step(ops):
    receiver, _, waits = make_nccl(timeout=0.05)
    start(waits, 10, [1])
    waits.queue_through(10)
    waits._pending[0].queued_at -= 1.0
    with pytest.raises(StepFailed, match="did not reach stage 0"):
        waits.pump()
    receiver.announce(12, 1)
    with pytest.raises(StepFailed, match="out of the expected order"):
        waits.pump()
    with pytest.raises(StepFailed, match="closed"):
        waits.queue_through(10)
