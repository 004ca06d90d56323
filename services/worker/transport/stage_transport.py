"""Stage transports: how a step's activations (hidden state and residual) reach the next stage.

Each step's id, its tensors' shape, or its error when a stage failed it, are announced on the
Forward stream (gRPC) or on the link's own doorbell; a transport moves the bytes:

- `grpc`: inline in the Forward message, through both hosts (A/B runs and the last fallback):
  the Sender and Receiver here;
- `ipc`: one host (one GPU or peer GPUs by CUDA IPC, or CPU stages through /dev/shm): a ring of
  buffers the receiver allocates once (ring.py), each step announced and each slot credited back
  on a doorbell socket between the two step threads (the Forward stream carries nothing), in
  ipc_transport.py and doorbell.py;
- `distributed`: torch.distributed send/recv in a process group of two per link (NCCL between
  GPUs, gloo between CPUs), each step announced on a TCP doorbell between the two step threads
  (the Forward stream carries nothing), in distributed_transport.py.

The scheduler picks one per link at InitCache (strata/stage_links.py's `choose_transport`, from
each stage's Describe); the receiving stage opens its end first (open_receiver) and returns a
StageLink, which the scheduler passes to the sending stage (open_sender). Every wait has a
deadline, and a new InitCache closes both ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from strata.services.worker.transport.doorbell import DoorbellClosed
from strata.stage_links import DISTRIBUTED, GRPC, IPC, TransportError, host_of, name_of
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")

# Steps whose activations may wait for their plan: far more than the plans in flight (one per stage).
MAX_PENDING_ACTIVATIONS = 64


class StepFailed(Exception):
    """This step's activations never come: an upstream stage failed it, or the transport did."""

    @staticmethod
    def upstream(error: str) -> StepFailed:
        """An upstream stage's error, as its link carried it (PeerLost keeps its kind)."""
        if error.startswith(PeerLost.PREFIX):
            return PeerLost(error[len(PeerLost.PREFIX) :])
        return StepFailed(error)


class PeerLost(StepFailed):
    """The step failed because a peer stage is gone (its link closed under it): the pipeline
    must be rebuilt, and the step's requests resume (StepResult.peer_lost), not fail. Errors
    cross the links as strings; this prefix keeps the kind across a middle stage."""

    PREFIX = "peer stage lost: "

    def __str__(self) -> str:
        return self.PREFIX + super().__str__()


# ------------------------------------------------------------------ the two ends


class Sender:
    """The sending end of a link. send() runs on the step thread and returns at once: the
    transport's own thread moves the bytes and emits the Forward message (emit is thread-safe),
    except where the transport needs no thread (uses_thread False: ipc, distributed)."""

    kind = GRPC
    uses_thread = True

    def __init__(self, session: int, emit: Callable[[engine_pb2.Activations], None], timeout: float):
        self.session = session
        self.emit = emit
        self.timeout = timeout
        self.closed = False
        # What the link moved (WorkerStats): steps, their bytes, the transport thread's time on them.
        self.steps_sent = 0
        self.bytes_sent = 0
        self.send_seconds = 0.0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"transport-send-{session}", daemon=True)
        if self.uses_thread:
            self._thread.start()

    def send(self, step_id: int, hidden, residual) -> None:
        """Queues one step's activations. On a GPU the tensors may be buffers the next step
        overwrites: a transport copies them (on the device, queued on the current stream) first."""
        self._jobs.put((step_id, *self._prepare(hidden, residual)))

    def send_error(self, step_id: int, error: str) -> None:
        self.emit(engine_pb2.Activations(step_id=step_id, error=error, session=self.session))

    def on_ack(self, ack: engine_pb2.ForwardAck) -> None:
        """A credit back from the receiver (event loop thread)."""

    def close(self) -> None:
        """Never blocks: the thread ends after its current job (bounded by the deadline)."""
        self.closed = True
        self._jobs.put(None)

    # ---- the transport thread

    def _prepare(self, hidden, residual) -> tuple:
        """On the step thread: what _transfer gets (launches only, no host synchronisation)."""
        return tuple(t.clone() if t.device.type == "cuda" else t for t in (hidden, residual))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            step_id, *payload = job
            if self.closed:
                break
            try:
                started = time.perf_counter()
                msg = self._transfer(step_id, *payload)
                if msg is not None:
                    self.emit(msg)
                self.send_seconds += time.perf_counter() - started
                self.steps_sent += 1
                self.bytes_sent += sum(t.numel() * t.element_size() for t in payload if hasattr(t, "numel"))
            except Exception as e:  # this step fails downstream; the next ones try again
                log.warning("stage transport (%s): step %d not sent: %s", name_of(self.kind), step_id, e)
                self.send_error(step_id, f"stage transport ({name_of(self.kind)}): {type(e).__name__}: {e}")
        self._finish()

    def _transfer(self, step_id: int, hidden, residual, *_) -> engine_pb2.Activations | None:
        """Moves the bytes (or puts them inline); returns the Forward message (None: emitted)."""
        from strata.codec import tensor_to_proto

        return engine_pb2.Activations(
            step_id=step_id, session=self.session, hidden=tensor_to_proto(hidden), residual=tensor_to_proto(residual)
        )

    def _finish(self) -> None:
        """On the transport thread, once closed: release what the link holds."""


class StepThreadSender(Sender):
    """A Sender whose steps go out from the step thread itself (ipc, distributed): launches and
    one announcement on the link's doorbell (put), no transport thread, no Forward message."""

    uses_thread = False

    def send(self, step_id: int, *tensors) -> None:
        """On the step thread, right after the step's launch."""
        started = time.perf_counter()
        try:
            self.put(step_id, tensors)
        except TransportError as e:  # this step fails downstream (in order); the next ones try again
            self.send_error(step_id, f"stage transport ({name_of(self.kind)}): {e}")
            return
        except DoorbellClosed as e:  # the peer is gone: the scheduler rebuilds the pipeline
            log.warning("stage transport (%s): step %d not sent: %s", name_of(self.kind), step_id, e)
            return
        self.send_seconds += time.perf_counter() - started
        self.steps_sent += 1
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def put(self, step_id: int, tensors) -> None:
        raise NotImplementedError


class Receiver:
    """The receiving end of a link: Forward delivers each step's message with its bytes (event
    loop thread), the step awaits receive(step_id): the grpc transport. A receiver with
    on_step_thread (ipc, distributed) instead has the step thread take each step's activations
    from its own doorbell: take(step_id)."""

    kind = GRPC
    on_step_thread = False
    wait_seconds = 0.0  # on_step_thread: the step thread's time waiting for announcements

    def __init__(self, session: int, device, dtype, hidden_size: int, max_rows: int, timeout: float):
        self.session = session
        self.device = device
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.max_rows = max_rows
        self.timeout = timeout
        self.acks: asyncio.Queue = asyncio.Queue()  # ForwardAck messages for the sender
        self._futures: dict[int, asyncio.Future] = {}

    def link(self) -> engine_pb2.StageLink:
        return engine_pb2.StageLink(transport=self.kind, session=self.session)

    def _future(self, step_id: int) -> asyncio.Future:
        fut = self._futures.get(step_id)
        if fut is None:
            fut = self._futures[step_id] = asyncio.get_running_loop().create_future()
        return fut

    def deliver(self, msg: engine_pb2.Activations) -> bool:
        """Takes one Forward message; False when too many steps wait for their plans already
        (a sender running far ahead, or step ids that never come)."""
        if msg.step_id not in self._futures and len(self._futures) >= MAX_PENDING_ACTIVATIONS:
            return False
        fut = self._future(msg.step_id)
        if fut.done():
            return True
        if msg.error:
            fut.set_exception(StepFailed.upstream(msg.error))
            return True
        try:
            self._check(msg)
        except Exception as e:  # a malformed message fails its step, not the worker
            fut.set_exception(StepFailed(f"stage transport: {e}"))
            return True
        fut.set_result(msg)
        return True

    def _check(self, msg: engine_pb2.Activations) -> None:
        # Inline tensors, bounded by the gRPC message size (ipc and distributed links announce
        # their steps on their own doorbells: the Forward stream carries nothing there).
        if msg.via_transport:
            raise ValueError("bytes announced on a transport this link does not have")
        for t in (msg.hidden, msg.residual):
            if len(t.shape) != 2 or t.shape[1] != self.hidden_size or t.shape[0] <= 0:
                raise ValueError(f"activations of shape {list(t.shape)}, expected [rows, {self.hidden_size}]")

    async def receive(self, step_id: int):
        """(hidden, residual) of this step on this stage's device and dtype; raises StepFailed."""
        fut = self._future(step_id)
        try:
            got = await fut
        finally:
            self._futures.pop(step_id, None)
        from strata.codec import tensor_from_proto

        try:
            return (
                tensor_from_proto(got.hidden, self.device).to(self.dtype),
                tensor_from_proto(got.residual, self.device).to(self.dtype),
            )
        except Exception as e:
            raise StepFailed(f"stage transport: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(StepFailed("pipeline re-initialised"))
        self._futures.clear()
        self.acks.put_nowait(None)  # ends the Forward call serving this link


# ------------------------------------------------------------------ opening a link


def open_receiver(request: engine_pb2.InitCacheRequest, *, device, dtype, hidden_size: int, max_rows: int, slots: int):
    kind = request.previous_stage_transport
    args = (request.session, device, dtype, hidden_size, max_rows, request.transport_timeout_seconds or 120.0)
    if kind == IPC:
        from strata.services.worker.transport.ipc_transport import IpcReceiver

        return IpcReceiver(*args, slots=slots)
    if kind == DISTRIBUTED:
        from strata.services.worker.transport.distributed_transport import DistributedReceiver

        return DistributedReceiver(*args, peer_host=host_of(request.previous_stage_address))
    return Receiver(*args)


def open_sender(request: engine_pb2.InitCacheRequest, emit, *, device):
    link = request.next_stage_link
    timeout = request.transport_timeout_seconds or 120.0
    if link.session != request.session:
        raise TransportError(f"the next stage's link belongs to session {link.session}, not {request.session}")
    if link.transport == IPC:
        from strata.services.worker.transport.ipc_transport import IpcSender

        return IpcSender(request.session, emit, timeout, link=link, device=device)
    if link.transport == DISTRIBUTED:
        from strata.services.worker.transport.distributed_transport import DistributedSender

        return DistributedSender(request.session, emit, timeout, link=link, device=device)
    return Sender(request.session, emit, timeout)
