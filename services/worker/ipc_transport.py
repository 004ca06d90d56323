"""`ipc`: CUDA IPC between two stages on one host (one GPU, or peer GPUs), device to device.

The receiver allocates, once per InitCache, a ring of `slots` slots on its GPU, each a hidden and
a residual buffer of max_rows x hidden_size, and two interprocess events per slot (`ready`,
`consumed`), and exports them in its StageLink; the sender opens them (the GPU found by its UUID).

One step, slot s = the next in turn:
  sender, step thread:      clone hidden/residual on the compute stream, record event E
  sender, transport thread: wait for s's credit (host, with a deadline); on a side stream: wait E,
                            wait consumed[s], copy into the slot, record ready[s]; then send the
                            Forward message (step id, slot, shapes)
  receiver, event loop:     on the compute stream: wait ready[s], copy out of the slot, record
                            consumed[s]; then credit s back on the Forward stream (ForwardAck)
No host thread waits for the GPU. The sender's event wait happens after the receiver's record
(it waits for the credit, sent after the record), and the receiver's after the sender's (it waits
for the message, sent after the record), as interprocess events require. A step larger than a
slot goes inline in the Forward message instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import torch

from strata.services.worker.stage_transport import IPC, Receiver, Sender, TransportError
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")
# int64: the token link's ring (token_handoff.py).
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


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
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        m.handle,
        m.size_bytes,
        m.offset_bytes,
        m.ref_counter_handle,
        m.ref_counter_offset,
        m.event_handle or None,
        m.event_sync_required,
    )
    if storage.nbytes() < numel * dtype.itemsize:
        raise TransportError(f"the ring holds {storage.nbytes()} bytes, {numel * dtype.itemsize} announced")
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))


class IpcReceiver(Receiver):
    kind = IPC

    def __init__(self, session, device, dtype, hidden_size, max_rows, timeout, *, slots: int):
        super().__init__(session, device, dtype, hidden_size, max_rows, timeout)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise TransportError("the ipc stage transport needs a CUDA stage")
        self.slots = slots
        self.slot_elements = max_rows * hidden_size
        with torch.cuda.device(self.device):
            self.ring = torch.empty(slots * 2 * self.slot_elements, dtype=dtype, device=self.device)
            self.ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            stream = torch.cuda.current_stream(self.device)
            for e in self.ready + self.consumed:  # created on this GPU before their handles go out
                e.record(stream)
        log.info(
            "stage transport: ipc ring of %d slots x 2 x %d elements (%.1f MiB) on %s",
            slots,
            self.slot_elements,
            self.ring.numel() * self.ring.element_size() / 2**20,
            self.device,
        )

    def link(self) -> engine_pb2.StageLink:
        return engine_pb2.StageLink(
            transport=IPC,
            session=self.session,
            ring=export_memory(self.ring),
            slots=self.slots,
            slot_elements=self.slot_elements,
            dtype=_NAMES[self.dtype],
            device_uuid=device_uuid(self.device.index),
            ready_events=[e.ipc_handle() for e in self.ready],
            consumed_events=[e.ipc_handle() for e in self.consumed],
        )

    def _check(self, msg: engine_pb2.Activations) -> None:
        super()._check(msg)
        if msg.via_transport:
            if msg.slot >= self.slots:
                raise ValueError(f"ring slot {msg.slot} of {self.slots}")
            if msg.hidden.dtype != _NAMES[self.dtype] or msg.residual.dtype != msg.hidden.dtype:
                raise ValueError(f"activations of dtype {msg.hidden.dtype}, the ring holds {_NAMES[self.dtype]}")

    def _accept(self, msg: engine_pb2.Activations, fut: asyncio.Future) -> None:
        fut.set_result(msg)  # the slot is read when the step runs (receive -> _opened)

    def _opened(self, msg: engine_pb2.Activations):
        s, e = msg.slot, self.slot_elements
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)  # the step thread's stream: the default one
            stream.wait_event(self.ready[s])
            base = 2 * s * e
            out = []
            for i, meta in enumerate((msg.hidden, msg.residual)):
                n = meta.shape[0] * meta.shape[1]
                start = base + i * e
                out.append(self.ring[start : start + n].view(tuple(meta.shape)).clone())
            self.consumed[s].record(stream)
        self.acks.put_nowait(engine_pb2.ForwardAck(step_id=msg.step_id, slot=s))
        return tuple(out)


class IpcSender(Sender):
    kind = IPC

    def __init__(self, session: int, emit, timeout: float, *, link: engine_pb2.StageLink, device):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise TransportError("the ipc stage transport needs a CUDA stage")
        if link.dtype not in _DTYPES or not link.slots or len(link.ready_events) != link.slots:
            raise TransportError("a malformed ipc link")
        self.ring_device = device_of_uuid(link.device_uuid)
        self.dtype = _DTYPES[link.dtype]
        self.slots = link.slots
        self.slot_elements = link.slot_elements
        self.ring = open_memory(link.ring, self.ring_device, self.dtype, link.slots * 2 * link.slot_elements)
        with torch.cuda.device(self.ring_device):
            self.ready = [torch.cuda.Event.from_ipc_handle(self.ring_device, h) for h in link.ready_events]
            self.consumed = [torch.cuda.Event.from_ipc_handle(self.ring_device, h) for h in link.consumed_events]
            self.dst_stream = torch.cuda.Stream(self.ring_device)
        # The copy runs on the source GPU's side stream (torch orders a peer copy against both
        # devices' current streams); on one GPU the two streams are one.
        self.src_stream = torch.cuda.Stream(self.device) if self.ring_device != self.device else self.dst_stream
        self._free = [True] * self.slots
        self._next = 0
        self._credit = threading.Condition()
        self._broken: str | None = None
        super().__init__(session, emit, timeout)
        log.info(
            "stage transport: ipc ring of %d slots opened on %s (this stage on %s)",
            self.slots,
            self.ring_device,
            self.device,
        )

    def _prepare(self, hidden, residual) -> tuple:
        h, r = hidden.clone(), residual.clone()  # the next step may overwrite the originals
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return h, r, done

    def on_ack(self, ack: engine_pb2.ForwardAck) -> None:
        if ack.slot < self.slots:
            with self._credit:
                self._free[ack.slot] = True
                self._credit.notify_all()

    def close(self) -> None:
        super().close()
        with self._credit:
            self._credit.notify_all()

    def _take_slot(self) -> int:
        s = self._next
        with self._credit:
            if self._broken:
                raise TransportError(self._broken)
            if not self._credit.wait_for(lambda: self._free[s] or self.closed, self.timeout):
                self._broken = f"no credit for ring slot {s} in {self.timeout:.0f}s: the next stage stopped reading"
                raise TransportError(self._broken)
            if self.closed:
                raise TransportError("link closed")
            self._free[s] = False
        self._next = (s + 1) % self.slots
        return s

    def _transfer(self, step_id: int, hidden, residual, done=None):
        e = self.slot_elements
        if hidden.numel() > e or residual.numel() > e or hidden.dtype != self.dtype:
            torch.cuda.current_stream(self.device).wait_event(done)
            return super()._transfer(step_id, hidden, residual)  # inline bytes, this step only
        s = self._take_slot()
        src, dst = self.src_stream, self.dst_stream
        src.wait_event(done)
        dst.wait_event(self.consumed[s])  # the receiver has copied the slot's last contents out
        with torch.cuda.stream(src), torch.cuda.stream(dst):
            base = 2 * s * e
            for i, t in enumerate((hidden, residual)):
                start = base + i * e
                self.ring[start : start + t.numel()].view(t.shape).copy_(t, non_blocking=True)
                t.record_stream(src)  # allocated on the compute stream, read on the side stream
            self.ready[s].record(dst)
        return engine_pb2.Activations(
            step_id=step_id,
            session=self.session,
            via_transport=True,
            slot=s,
            hidden=engine_pb2.Tensor(dtype=_NAMES[hidden.dtype], shape=list(hidden.shape)),
            residual=engine_pb2.Tensor(dtype=_NAMES[residual.dtype], shape=list(residual.shape)),
        )
