"""Stage 0's token intake where its GPU waits for the tokens (an ipc token link whose ring has
slot words, ring.py and stream_memops.py; or NCCL, at the end): no host on the token path.

With the doorbell alone, stage 0's step thread could queue a step whose placeholders need step
s's tokens only after the last stage's announcement of s had arrived (an interprocess event can
be waited on only after its record): every micro-batch's step waited for the other host's launch
and a socket hop (bench/RESULTS.md, "Figures moved from code comments").
Here stage 0 queues it at once, behind a wait of its stream on the slot's word.

The order: the last stage announces one thing per step that samples, its tokens or its error,
in step order, in slots 0, 1, 2, ... (announcement i in slot i % slots, its ready word set to i + 1
after the copy). Both stages see every plan, so stage 0 gives each sampling plan its number as the plan
starts (expect), before anything that can fail, and knows step s's slot without hearing from the
last stage. Before a step with placeholders it queues, in order, for every sampling step up to
the one they need: a wait for the ready word, the scatter of the slot into last_sampled, and
i + 1 into the slot's consumed word (the last stage's stream waits on it before it reuses the
slot). Announcements are still taken (pump, non-blocking, before every step): each is checked
against the expected order and credited; the application of one that no step has needed yet is
queued only once it is `defer` sampling steps old, so that its slot is read before the ring comes
round. Queued at once, it held stage 0's GPU for tokens its step did not need: the last
stage announces a step as it launches it, up to two steps before its GPU has drawn them, and the
two GPUs then took turns (bench/RESULTS.md, "Stage 0 waited for tokens it did not need").

Deadlines: a wait no announcement has answered within the link's timeout fails the next step
(StepFailed). The GPU itself waits until close(), which releases every wait with a store to the
words (the scheduler rebuilds the pipeline around a lost stage; the steps behind the wait then
run on stale tokens, and their results are never delivered).

A distributed link on GPUs (NCCL) does the same with receives (NcclTokenWaits): the last stage
sends one message of max_tokens per sampling step, in step order, its tokens padded or, for a
failed step, zeros (distributed_transport.py, fixed_elements), so stage 0 knows every receive's
size and order before the announcement. Each is posted into one of a ring of buffers at its
announcement (or earlier, when a step needs it first); the compute stream waits for it and the
scatter follows when a step needs it, as above. Close aborts the link's group, which ends any
receive still waiting (before this, stage 0's host waited for each announcement, longer the more
stages: bench/RESULTS.md, issue 29 session 12).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import torch

from strata.services.worker.device import cuda_driver
from strata.services.worker.transport.ipc_transport import RingReader
from strata.services.worker.transport.stage_transport import PeerLost, StepFailed
from strata.services.worker.transport.stream_memops import wait_geq, write

log = logging.getLogger("strata.worker")


class _Sampling:
    __slots__ = ("number", "step_id", "rows", "queued_at")

    def __init__(self, number: int, step_id: int):
        self.number, self.step_id = number, step_id
        self.rows: torch.Tensor | None = None  # None: the step failed on stage 0 before its rows
        self.queued_at: float | None = None


class DeviceTokenWaits:
    """The order and the deadlines; subclasses queue one sampling step's tokens on the stream
    (_queue), take the next announcement (_announcement) and credit it (_credit)."""

    def __init__(self, last_sampled: torch.Tensor, timeout: float):
        self.last_sampled = last_sampled
        self.timeout = timeout
        self._pending: collections.deque[_Sampling] = collections.deque()  # not yet announced, in order
        self._deferred: collections.deque[_Sampling] = collections.deque()  # announced, not yet queued
        self._numbered = 0  # sampling plans numbered so far
        self._queued = 0  # sampling plans whose application is queued on the GPU
        self._announced_count = 0  # announcements taken
        self._lock = threading.Lock()  # close() (event loop) against queueing (step thread)
        self._closed: str | None = None

    def expect(self, step_id: int) -> None:
        """Step thread: a plan that samples has started (every one, in order)."""
        self._pending.append(_Sampling(self._numbered, step_id))
        self._numbered += 1

    def set_rows(self, step_id: int, rows: torch.Tensor) -> None:
        """The rows the step's tokens go to, once its inputs are built."""
        s = self._pending[-1] if self._pending else None
        if s is not None and s.step_id == step_id:
            s.rows = rows

    # Sampling steps an announced step's application waits for a step to need it before pump
    # queues it anyway (0: at once).
    defer = 0

    def queue_through(self, step_id: int) -> int:
        """The GPU applies every sampling step's tokens up to step_id's before what is queued
        after this. Returns how many it queued now."""
        return self._queue_while(lambda s: s.step_id <= step_id)

    def _queue_while(self, due) -> int:
        """Queues, in order, every sampling step not yet queued while due(step) holds."""
        queued = self._queued
        with self._lock:
            if self._closed:
                raise PeerLost(f"token link closed: {self._closed}")
            stream = cuda_driver.current_stream(self.last_sampled.device)
            for s in itertools.chain(self._deferred, self._pending):
                if not due(s):
                    break
                if s.number < self._queued:
                    continue
                self._queue(s, stream)
                s.queued_at = time.monotonic()
                self._queued = s.number + 1
            while self._deferred and self._deferred[0].number < self._queued:
                self._deferred.popleft()
        return self._queued - queued

    def pump(self) -> None:
        """Step thread, before each step: the announcements that have arrived, checked and
        credited, and those `defer` sampling steps old applied; raises StepFailed if a queued
        wait is past the deadline."""
        # Only announcements of plans that started: a draft worker may announce a step's drafts
        # before this stage's step thread reaches its plan (token_handoff.DraftIntake).
        while self._announced_count < self._numbered and (got := self._announcement()) is not None:
            a, number = got
            self._announced_count += 1
            s = self._pending[0] if self._pending else None
            if s is None or s.step_id != a.step_id or s.number != number:
                self.close(f"step {a.step_id}'s tokens announced out of the expected order")
                raise StepFailed(f"token link: {self._closed}")
            if a.error and s.number >= self._queued:
                s.rows = None  # known failed before anything needed it: nothing to scatter
            if not a.error and s.rows is not None and a.rows != s.rows.shape[0]:
                log.error("token link: step %d handed %d tokens for %d rows", a.step_id, a.rows, s.rows.shape[0])
            if s.number >= self._queued:
                self._deferred.append(s)
            self._pending.popleft()
            self._credit()
            self._on_announced(s)
        newest = self._numbered - 1 - self.defer  # (announced ones only: they precede _pending)
        self._queue_while(lambda s: s.number <= newest and s.number < self._announced_count)
        s = self._pending[0] if self._pending else None
        if s is not None and s.queued_at is not None and time.monotonic() - s.queued_at > self.timeout:
            raise StepFailed(f"step {s.step_id}'s sampled tokens did not reach stage 0 in {self.timeout:.0f} s")

    def close(self, reason: str) -> None:
        """Any thread: every wait queued or to come passes (the link is being torn down)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            self._release()

    def _queue(self, s: _Sampling, stream) -> None:
        raise NotImplementedError

    def _announcement(self):
        """(the next announcement, its number), or None: nothing has arrived."""
        raise NotImplementedError

    def _credit(self) -> None:
        pass

    def _on_announced(self, s: _Sampling) -> None:
        pass

    def _release(self) -> None:
        pass


class IpcTokenWaits(DeviceTokenWaits):
    """An ipc token link whose ring has slot words."""

    def __init__(self, reader: RingReader, last_sampled: torch.Tensor, timeout: float):
        super().__init__(last_sampled, timeout)
        self.reader, self.ring = reader, reader.ring
        # Half the ring: the last stage refills step i's slot with step i + slots, which starts
        # here (pump) before the last stage can send it; i is queued by then (defer < slots).
        self.defer = self.ring.slots // 2

    def _queue(self, s: _Sampling, stream) -> None:
        ring = self.ring
        slot = s.number % ring.slots
        wait_geq(stream, ring.ready_word(slot), s.number + 1)
        if s.rows is not None:
            self.last_sampled.index_copy_(0, s.rows, ring.view(slot, 0, (s.rows.shape[0],)))
        write(stream, ring.consumed_word(slot), s.number + 1)

    def _announcement(self):
        a = self.reader.next(block=False)
        return None if a is None else (a, self.reader.taken - 1)

    def _credit(self) -> None:
        self.reader.release()

    def _release(self) -> None:
        self.ring.release_words(self._numbered)


class NcclTokenWaits(DeviceTokenWaits):
    """A distributed token link on GPUs: each sampling step's receive (max_tokens, in step order)
    posted into one of `buffers` buffers as soon as it is announced or a step needs it, whichever
    comes first; the compute stream waits for it only when a step needs its tokens (or it is
    `defer` steps old), as the ipc ring's waits. A receive posted late would hold the last
    stage's sends behind it (NCCL pairs them in order), and a compute-stream wait at once held
    stage 0's GPU for tokens it did not need (the 1B's two stages at 1.37x one GPU over NCCL
    against 1.85x over ipc: bench/RESULTS.md, "The NCCL token link had the same eager waits")."""

    def __init__(self, receiver, last_sampled: torch.Tensor, timeout: float, buffers: int = 32):
        super().__init__(last_sampled, timeout)
        self.receiver = receiver
        self.buffers = torch.zeros(buffers, receiver.max_rows, dtype=torch.int64, device=last_sampled.device)
        self.defer = buffers // 2  # a buffer's scatter is queued before its next receive is due
        self._posted = 0  # sampling steps whose receive is posted
        self._receives: dict[int, list] = {}  # number -> its posted, unwaited receives
        on_gpu = last_sampled.device.type == "cuda"
        # Receives are posted from a stream of their own: from the compute stream, NCCL's would
        # first wait for every step already queued there, and the tokens would reach stage 0
        # only after its GPU had drained. A buffer is received into again only after the event
        # recorded behind the scatter from it.
        self._stream = torch.cuda.Stream(last_sampled.device) if on_gpu else None
        self._scattered = [torch.cuda.Event() if on_gpu else None for _ in range(buffers)]

    def _on_announced(self, s: _Sampling) -> None:
        self._queue_while(lambda x: x.number <= s.number - self.buffers.shape[0])  # (its buffer's last use)
        with self._lock:
            if self._closed:
                raise PeerLost(f"token link closed: {self._closed}")
            self._post(s)

    def _post(self, s: _Sampling) -> None:
        """s's receive, once, in step order (both callers go in order, and whichever comes first
        for a step has come for every step before it)."""
        if s.number < self._posted:
            return
        b = s.number % self.buffers.shape[0]
        if self._stream is None:
            self._receives[s.number] = self.receiver.start_receive(s.step_id, self.buffers[b])
        else:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._scattered[b])
                self._receives[s.number] = self.receiver.start_receive(s.step_id, self.buffers[b])
        self._posted = s.number + 1

    def _queue(self, s: _Sampling, stream) -> None:
        self._post(s)
        receives = self._receives.pop(s.number)
        if s.rows is not None:
            b = s.number % self.buffers.shape[0]
            self.receiver.finish_receive(receives)  # the compute stream waits for it
            self.last_sampled.index_copy_(0, s.rows, self.buffers[b][: s.rows.shape[0]])
            if self._scattered[b] is not None:
                self._scattered[b].record()

    def _announcement(self):
        a = self.receiver.next_announcement(block=False)
        return None if a is None else (a, self._announced_count)  # (pump counts each one taken)
