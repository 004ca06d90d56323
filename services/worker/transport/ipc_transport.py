"""`ipc`: two stages on one host, device to device (one GPU or peer GPUs, by CUDA IPC) or through
host shared memory (CPU stages), with each step announced on a doorbell (doorbell.py) from one
step thread straight to the other.

The receiving stage allocates a ring of slots (ring.py, which also says how each slot's uses are
ordered between the two processes) and exports it in its StageLink with its doorbell's path; the
sender opens both. RingReader and RingWriter are the two ends' order, shared with the token link
(token_handoff.py); IpcReceiver and IpcSender are the activations' link on them, run from the two
step threads (the Forward stream carries nothing).
"""

from __future__ import annotations

import logging
import time

import torch

from strata.services.worker.device import cuda_driver
from strata.services.worker.transport import stream_memops
from strata.services.worker.transport.doorbell import Announcement, DoorbellClosed, DoorbellReceiver, DoorbellSender
from strata.services.worker.transport.ring import DTYPE_NAMES, Ring, device_of_uuid
from strata.services.worker.transport.stage_transport import PeerLost, Receiver, StepFailed, StepThreadSender
from strata.stage_links import IPC, TransportError
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")


def check_ipc_device(device) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise TransportError(f"the ipc stage transport runs between CUDA or CPU stages, not {device}")
    return device


# ------------------------------------------------------------------ the two ends


class RingReader:
    """The receiving end's order (shared with the token link): announcement i in slot i % slots,
    taken in the sender's order on the step thread."""

    def __init__(self, ring: Ring, timeout: float):
        self.ring = ring
        self.doorbell = DoorbellReceiver(timeout)
        self.taken = 0  # announcements taken so far
        self.wait_seconds = 0.0

    def link(self, session: int) -> engine_pb2.StageLink:
        link = engine_pb2.StageLink(transport=IPC, session=session, doorbell_path=self.doorbell.path)
        self.ring.export(link)
        return link

    def next(self, block: bool) -> Announcement | None:
        started = time.perf_counter()
        try:
            a = self.doorbell.next(block)
        except DoorbellClosed as e:
            raise PeerLost(f"stage transport (ipc): {e}") from None
        finally:
            self.wait_seconds += time.perf_counter() - started
        if a is None:
            return None
        if not a.error and a.slot != self.taken % self.ring.slots:
            raise StepFailed(
                f"stage transport (ipc): step {a.step_id} announced in slot {a.slot}, expected {self.taken % self.ring.slots}"
            )
        self.taken += 1
        return a

    def release(self) -> None:
        """Every announcement taken so far is read (its reads queued): credit them back."""
        try:
            self.doorbell.release(self.taken)
        except DoorbellClosed as e:
            log.warning("stage transport (ipc): credit not sent: %s", e)

    def close(self) -> None:
        self.doorbell.close()
        self.ring.unlink()


class RingWriter:
    """The sending end (shared with the token link), on the step thread: launches and a message."""

    def __init__(self, link: engine_pb2.StageLink, device, timeout: float):
        self.device = check_ipc_device(device)
        self.ring = Ring.open(link, self.device)
        try:
            self.doorbell = DoorbellSender(link.doorbell_path, timeout)
        except DoorbellClosed as e:
            raise TransportError(str(e)) from None
        self.announced = 0

    def put(self, step_id: int, tensors) -> None:
        ring = self.ring
        for t in tensors:
            if t.numel() > ring.slot_elements or DTYPE_NAMES.get(t.dtype) != DTYPE_NAMES[ring.buffer.dtype]:
                raise TransportError(
                    f"{t.dtype} {list(t.shape)} does not fit the ring's slots of {ring.slot_elements} {ring.buffer.dtype}"
                )
        slot = self.announced % ring.slots
        self.doorbell.wait_released(self.announced - ring.slots + 1)
        ring.write(slot, tensors, self.announced + 1)
        t = tensors[0]
        self.doorbell.announce(step_id, slot, t.shape[0], t.shape[1] if t.dim() > 1 else 0)
        self.announced += 1

    def put_error(self, step_id: int, error: str) -> None:
        self.doorbell.wait_released(self.announced - self.ring.slots + 1)
        self.ring.mark(self.announced % self.ring.slots, self.announced + 1)  # a receiver's GPU may wait on it
        self.doorbell.announce(step_id, 0, 0, 0, error or "failed upstream")
        self.announced += 1

    def close(self) -> None:
        self.doorbell.close()
        self.ring.release_words(self.announced)  # a stream waiting for a dead receiver's reads
        self.ring.close_words()


class IpcReceiver(Receiver):
    """Activations in: the step thread takes each step's announcement itself (take), not the
    Forward stream (which carries nothing on this link)."""

    kind = IPC
    on_step_thread = True

    def __init__(self, session, device, dtype, hidden_size, max_rows, timeout, *, slots: int):
        super().__init__(session, device, dtype, hidden_size, max_rows, timeout)
        self.device = check_ipc_device(device)
        # Slot words: the GPU waits for the sender's copy on a word in host memory, as the token
        # link does (interprocess events where this GPU cannot wait on a word).
        ring = Ring.create(self.device, dtype, slots, 2, max_rows * hidden_size, words=True)
        self.reader = RingReader(ring, timeout)
        self._held: tuple[Announcement, int] | None = None  # a later step's announcement, taken early (take)
        log.info(
            "stage transport: ipc ring of %d slots x 2 x %d elements (%.1f MiB) on %s, ordered by %s",
            slots,
            ring.slot_elements,
            ring.buffer.numel() * ring.buffer.element_size() / 2**20,
            self.device,
            "slot words" if ring.words is not None else "interprocess events",
        )

    @property
    def wait_seconds(self) -> float:
        return self.reader.wait_seconds

    def link(self) -> engine_pb2.StageLink:
        return self.reader.link(self.session)

    def take(self, step_id: int, into: tuple[torch.Tensor, torch.Tensor] | None = None):
        """On the step thread: this step's (hidden, residual), queued on the compute stream behind
        the sender's copy, read into `into`'s first rows (a graph's inputs) or into new tensors;
        raises StepFailed. Announcements come in step order: an earlier step's that no plan here
        asked for is dropped, a later one's is kept for its own step."""
        reader = self.reader
        while True:
            if self._held is not None:
                (a, count), self._held = self._held, None
            else:
                a = reader.next(block=True)
                count = reader.taken  # the announcement's number + 1: its slot words' value
            if a.step_id >= step_id:
                break
            self._skip(a, count)
        if a.step_id > step_id:
            self._held = (a, count)
            raise StepFailed(f"step {step_id}'s activations never came (step {a.step_id}'s did)")
        if a.error:
            self._skip(a, count)
            raise StepFailed.upstream(a.error)
        if a.cols != self.hidden_size or not 0 < a.rows <= self.max_rows:
            self._skip(a, count)
            raise StepFailed(f"stage transport (ipc): activations of shape [{a.rows}, {a.cols}]")
        ring = reader.ring
        ring.ready_wait(a.slot, count)
        views = (ring.view(a.slot, part, (a.rows, a.cols)) for part in range(2))
        if into is None:
            out = tuple(v.clone() for v in views)
        elif self.device.type == "cuda":  # driver copies, which keep the GIL (cuda_driver.py); all contiguous
            stream = cuda_driver.current_stream(self.device)
            out = tuple(dst[: a.rows] for dst in into)
            for dst, v in zip(out, views):
                stream_memops.copy(stream, dst, v)
        else:  # a ring in /dev/shm
            out = tuple(dst[: a.rows].copy_(v) for dst, v in zip(into, views))
        ring.consumed_record(a.slot, count)
        reader.release()
        return out

    def _skip(self, a: Announcement, count: int) -> None:
        """An announcement no step reads: its slot goes back to the sender (GPU word, credit)."""
        self.reader.ring.consumed_record(a.slot, count)
        self.reader.release()

    def close(self) -> None:
        ring = self.reader.ring
        ring.release_words(self.reader.taken)  # a stream waiting for a dead sender's copy
        self.reader.close()
        ring.close_words()
        super().close()


class IpcSender(StepThreadSender):
    """Activations out, from the step thread itself: no transport thread, no Forward message."""

    kind = IPC

    def __init__(self, session: int, emit, timeout: float, *, link: engine_pb2.StageLink, device):
        self.writer = RingWriter(link, device, timeout)
        super().__init__(session, emit, timeout)
        log.info(
            "stage transport: ipc ring of %d slots on %s opened (mapped into %s; this stage on %s)",
            link.slots,
            device_of_uuid(link.device_uuid) if link.device_uuid else "host memory",
            self.writer.ring.device,
            self.writer.device,
        )

    def put(self, step_id: int, tensors) -> None:
        self.writer.put(step_id, tensors)

    def send_error(self, step_id: int, error: str) -> None:
        try:
            self.writer.put_error(step_id, error)
        except DoorbellClosed as e:
            log.warning("stage transport (ipc): step %d's error not sent: %s", step_id, e)

    def close(self) -> None:
        super().close()
        self.writer.close()
