"""The ipc link's ring: `slots` x `parts` buffers the receiving stage allocates once per
InitCache, and the order of each slot's uses between the two processes.

The receiver allocates the ring (hidden and residual per slot; or one buffer for the token link)
and exports it in its StageLink; the sender opens it. On CUDA the ring is one device allocation
with two interprocess events per slot (`ready`, `consumed`), the GPU found by its UUID; on CPUs it
is a file in /dev/shm that both map. A sender on a peer GPU maps the ring into its own GPU's
context (Ring.open): a context of its process on the ring's GPU would cost each hand-off a context
switch there.

Announcement i uses slot i % slots. One step:
  sender, step thread:   wait for the credit of announcement i - slots (host, with a deadline);
                         on the compute stream: wait consumed[s], copy into the slot, record
                         ready[s]; announce (step id, slot, shape) on the doorbell
  receiver, step thread: take the announcement; on the compute stream: wait ready[s], copy out
                         of the slot, record consumed[s]; credit i + 1 on the doorbell
No host thread waits for the GPU, and no thread other than the two step threads is involved. Each
event wait is issued after the peer's record (the credit and the announcement are sent after
their records), as interprocess events require. A failed step is announced with its error, in
order, and uses no slot.

A ring may instead order its slots with two words per slot in shared host memory (`words`,
stream_memops.py; the token link's, on GPUs), so that the receiver's stream can wait for slot i
before its announcement has arrived (token_waits.py):
  sender's stream:   wait until consumed word[s] >= i + 1 - slots; copy; ready word[s] = i + 1
                     (a failed step: the ready word only)
  receiver's stream: wait until ready word[s] >= i + 1; copy out; consumed word[s] = i + 1
Events cannot do this: a receiver that queues its reads early would record `consumed` for use i
before the sender waited for use i - slots's, and the sender would wait on the later record.
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import numpy as np
import torch

from strata.services.worker.device import cuda_driver
from strata.services.worker.transport import stream_memops
from strata.stage_links import TransportError
from strata.v1 import engine_pb2

_CURRENT_DEVICE = torch.device("cuda")  # (cuda_driver.current_stream: the thread's current device)

log = logging.getLogger("strata.worker")
# int64: the token link's ring (token_handoff.py).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_WORDS_KEPT: list = []  # slot words a busy stream may still use (Ring.close_words)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_of_uuid(uuid: str) -> torch.device:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return torch.device("cuda", i)
    raise TransportError(f"the next stage's GPU {uuid} is not visible to this process")


def export_memory(t: torch.Tensor) -> engine_pb2.CudaIpcMemory:
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, sync) = t.untyped_storage()._share_cuda_()
    return engine_pb2.CudaIpcMemory(
        device=device,
        handle=handle,
        size_bytes=size,
        offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=sync,
    )


def open_memory(m: engine_pb2.CudaIpcMemory, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    torch.cuda._lazy_init()
    if m.event_sync_required and not m.event_handle:
        raise TransportError("the shared memory asks for an event to wait on and names none")
    # torch takes the event's handle as bytes even where it will not wait on it (empty then).
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        m.handle,
        m.size_bytes,
        m.offset_bytes,
        m.ref_counter_handle,
        m.ref_counter_offset,
        m.event_handle,
        m.event_sync_required,
    )
    if storage.nbytes() < numel * dtype.itemsize:
        raise TransportError(f"the ring holds {storage.nbytes()} bytes, {numel * dtype.itemsize} announced")
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))


# ------------------------------------------------------------------ the ring


class Ring:
    """`slots` x `parts` buffers of slot_elements, in one allocation the receiver owns, and the
    per-slot ordering between the two processes (interprocess events on CUDA; on CPUs the copies
    are done when they return, and the doorbell's system calls order them)."""

    def __init__(
        self, buffer: torch.Tensor, slots: int, parts: int, slot_elements: int, ready=None, consumed=None, words=None
    ):
        self.buffer, self.slots, self.parts, self.slot_elements = buffer, slots, parts, slot_elements
        self.device = buffer.device
        self.ready, self.consumed = ready, consumed  # CUDA only
        self.words: stream_memops.SharedWords | None = words  # CUDA only, where asked for and usable
        self.path = ""  # CPU: the shared file (the sender unlinks it once mapped; close() too)
        # Views by (slot, part, shape): a slice and a view cost the step thread measurable time,
        # four a step at each end, and a decode's shape repeats. Bounded: offline shapes vary.
        self._views: dict[tuple, torch.Tensor] = {}

    @classmethod
    def create(
        cls, device: torch.device, dtype: torch.dtype, slots: int, parts: int, slot_elements: int, words: bool = False
    ) -> Ring:
        """words: two words per slot (ready, consumed) that order the slots on the GPUs, where this
        GPU allows it (stream_memops.usable); else the events do."""
        numel = slots * parts * slot_elements
        if device.type == "cuda":
            with torch.cuda.device(device):
                words = words and stream_memops.usable(device)
                # With words, a failed step's slot is read as it is: zeros, or an earlier step's data.
                buffer = (torch.zeros if words else torch.empty)(numel, dtype=dtype, device=device)
                # (the events stay for the link's format; with words nothing waits on them)
                ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                consumed = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                stream = torch.cuda.current_stream(device)
                for e in ready + consumed:  # created on this GPU before their handles go out
                    e.record(stream)
            shared = None
            if words:
                sweep_stale_files(stream_memops.words_directory())
                shared = stream_memops.SharedWords.create(2 * slots, device)
            return cls(buffer, slots, parts, slot_elements, ready, consumed, shared)
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        if directory is None:
            raise TransportError("the ipc stage transport between CPU stages needs /dev/shm")
        need, free = numel * dtype.itemsize, _free_bytes(directory)
        if need > free:  # a mapping past tmpfs's space would fault (SIGBUS) on first touch
            raise TransportError(
                f"the ipc ring needs {need / 2**20:.0f} MiB of /dev/shm and {free / 2**20:.0f} MiB are free: "
                "give the container more (docker --shm-size) or use --stage-transport distributed"
            )
        sweep_stale_files(directory)
        path = os.path.join(directory, f"strata-ring-{os.getpid()}-{secrets.token_hex(8)}")
        ring = cls(torch.from_file(path, shared=True, size=numel, dtype=dtype), slots, parts, slot_elements)
        ring.path = path
        return ring

    def export(self, link: engine_pb2.StageLink) -> None:
        link.slots, link.parts, link.slot_elements = self.slots, self.parts, self.slot_elements
        link.dtype = DTYPE_NAMES[self.buffer.dtype]
        if self.path:
            link.host_ring_path = self.path
            return
        link.ring.CopyFrom(export_memory(self.buffer))
        link.device_uuid = device_uuid(self.device.index)
        link.ready_events.extend(e.ipc_handle() for e in self.ready)
        link.consumed_events.extend(e.ipc_handle() for e in self.consumed)
        if self.words is not None:
            link.slot_words_path = self.words.path

    @classmethod
    def open(cls, link: engine_pb2.StageLink, device: torch.device) -> Ring:
        if link.dtype not in DTYPES or not link.slots or not link.parts or not link.doorbell_path:
            raise TransportError("a malformed ipc link")
        dtype, numel = DTYPES[link.dtype], link.slots * link.parts * link.slot_elements
        if link.host_ring_path:
            if device.type != "cpu":
                raise TransportError("the previous stage's ring is in host memory, this stage is on " + str(device))
            try:
                buffer = torch.from_file(link.host_ring_path, shared=True, size=numel, dtype=dtype)
            except RuntimeError as e:
                raise TransportError(f"cannot map the next stage's ring {link.host_ring_path}: {e}") from None
            try:  # both ends have it mapped now: the name in /dev/shm is no longer needed
                os.unlink(link.host_ring_path)
            except OSError:
                pass
            return cls(buffer, link.slots, link.parts, link.slot_elements)
        if device.type != "cuda" or len(link.ready_events) != link.slots or len(link.consumed_events) != link.slots:
            raise TransportError("a CUDA ipc ring needs a CUDA stage and an event pair per slot")
        ring_device = device_of_uuid(link.device_uuid)
        buffer = None
        if link.slot_words_path and ring_device != device:
            # On slot words every launch of this end goes on its own stream (write), so the ring
            # is mapped into this GPU's context (CUDA IPC enables the peer access): this process
            # then keeps no work on the ring's GPU, whose context there the GPU would time-slice
            # with the receiver's.
            try:
                buffer = open_memory(link.ring, device, dtype, numel)
            except RuntimeError as e:  # no peer access between the two: map it where it lives
                log.info("ipc ring: cannot map %s's memory into %s (%s); mapping it there", ring_device, device, e)
        if buffer is None:
            buffer = open_memory(link.ring, ring_device, dtype, numel)
        with torch.cuda.device(ring_device):
            ready = [torch.cuda.Event.from_ipc_handle(ring_device, h) for h in link.ready_events]
            consumed = [torch.cuda.Event.from_ipc_handle(ring_device, h) for h in link.consumed_events]
            words = None
            if link.slot_words_path:  # the receiver's GPU waits on them: this end must write them
                try:
                    words = stream_memops.SharedWords(link.slot_words_path, 2 * link.slots, False, ring_device)
                except (RuntimeError, OSError) as e:
                    raise TransportError(f"cannot open the next stage's slot words: {e}") from None
                words.unlink()  # both ends have them mapped
        if words is not None and buffer.device != device:
            # torch enables this GPU's access to the ring's GPU at its first copy between them;
            # the steps' copies (stream_memops.copy, write) then go straight over the link.
            buffer[:1].copy_(torch.zeros(1, dtype=dtype, device=device))
            torch.cuda.synchronize(device)
        return cls(buffer, link.slots, link.parts, link.slot_elements, ready, consumed, words)

    def view(self, slot: int, part: int, shape) -> torch.Tensor:
        key = (slot, part, *shape)
        v = self._views.get(key)
        if v is None:
            start = (slot * self.parts + part) * self.slot_elements
            n = 1
            for d in shape:
                n *= d
            if len(self._views) >= 4096:
                self._views.clear()
            v = self._views[key] = self.buffer[start : start + n].view(tuple(shape))
        return v

    def write(self, slot: int, tensors, count: int) -> None:
        """Sender, on its step thread: queued behind the work that produced the tensors. On slot
        words, all of it goes on the sender's own stream (the wait until the receiver has read
        the slot, the copy, the ready word), also when the ring is on a peer GPU: a stream of
        this process on the peer's GPU is a context of its own there, which that GPU time-slices
        with the receiver's: a hand-off between two GPUs then cost the GPU several times one on a
        single GPU (bench/RESULTS.md, stage_hop). Events order the copy on the ring GPU's current stream
        (torch syncs a peer copy with both devices' current streams).
        count: the announcement's number + 1, for the slot's word."""
        if self.words is not None:
            stream = cuda_driver.current_stream(_CURRENT_DEVICE)  # the sender's own
            stream_memops.wait_geq(stream, self.consumed_word(slot), count - self.slots)
            for part, t in enumerate(tensors):  # (a driver call: it keeps the GIL, cuda_driver.py)
                stream_memops.copy(stream, self.view(slot, part, t.shape), t.contiguous())
            stream_memops.write(stream, self.ready_word(slot), count)
        elif self.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.consumed[slot])
            for part, t in enumerate(tensors):
                self.view(slot, part, t.shape).copy_(t, non_blocking=True)
            self.ready[slot].record(stream)
        else:
            for part, t in enumerate(tensors):
                self.view(slot, part, t.shape).copy_(t)

    def ready_word(self, slot: int) -> int:
        return self.words.address(slot)

    def consumed_word(self, slot: int) -> int:
        return self.words.address(self.slots + slot)

    def mark(self, slot: int, count: int) -> None:
        """Sender: the slot's ready word says announcement count - 1 is in (or failed), once the
        work queued before it is done."""
        if self.words is not None:  # on the sender's own stream (write)
            stream_memops.write(torch.cuda.current_stream(), self.ready_word(slot), count)

    def release_words(self, count: int) -> None:
        """Either end, tearing the link down: every wait on the words, queued or to come, passes
        (count: this end's announcements so far; waits are for values near it)."""
        if self.words is not None:
            self.words.host.view(np.uint32)[:] = (count + (1 << 30)) & 0xFFFFFFFF

    def ready_wait(self, slot: int, count: int) -> None:
        """Receiver: the compute stream waits for the sender's copy into the slot (count: the
        announcement's number + 1)."""
        if self.words is not None:
            stream_memops.wait_geq(cuda_driver.current_stream(self.device), self.ready_word(slot), count)
        elif self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def consumed_record(self, slot: int, count: int) -> None:
        """Receiver: after its reads of the slot are queued (or for a slot it skips)."""
        if self.words is not None:
            stream_memops.write(cuda_driver.current_stream(self.device), self.consumed_word(slot), count)
        elif self.consumed is not None:
            self.consumed[slot].record(torch.cuda.current_stream(self.device))

    def close_words(self, wait_seconds: float = 5.0) -> None:
        """Unmaps the words once the work queued on the stream so far is done (the caller released
        any wait on them first). A stream still busy past wait_seconds (a wait on a dead peer's
        event) leaves them mapped for the process's life: unmapped, the GPU would fault."""
        words, self.words = self.words, None
        if words is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + wait_seconds
        while not done.query():
            if time.monotonic() > deadline:
                log.warning("ipc ring: the stream is still busy after %.0f s: its slot words stay mapped", wait_seconds)
                _WORDS_KEPT.append(words)
                return
            time.sleep(0.001)
        words.close()

    def unlink(self) -> None:
        if self.words is not None:
            self.words.unlink()
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = ""


def sweep_stale_files(directory: str) -> None:
    """Rings and doorbells of processes that died before they unlinked them (kill -9 while a
    link was being set up): their names carry the owner's pid."""
    for name in os.listdir(directory):
        if not name.startswith(("strata-ring-", "strata-link-", "strata-words-")):
            continue
        try:
            pid = int(name.split("-")[2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except PermissionError:
            continue  # another user's live process


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
