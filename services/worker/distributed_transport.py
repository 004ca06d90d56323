"""`distributed`: torch.distributed point-to-point between two stages, NCCL on GPUs, gloo on CPUs.

Each link is a process group of its own, of two ranks (0 sends, 1 receives), built directly on a
PrefixStore of the TCPStore the receiver hosts (port chosen by the OS, one store per InitCache, so
a rebuilt pipeline never meets an older one's keys) - not the process-wide default group: a
middle stage holds two links, and a rebuilt pipeline drops one link without touching the other.

Order: the sender posts its sends in step order on its transport thread and only then emits the
Forward message; the receiver posts its receives in the order the messages arrive (one gRPC
stream: the same order), on its own thread. NCCL pairs point-to-point calls in that order; gloo
by tag (the step id). Deadlines: the rendezvous and every gloo wait take at most the link's
timeout; NCCL work is bounded by the group's timeout (its watchdog aborts the communicator, see
NCCL_ENVIRONMENT), and close() aborts the group so a lost peer never leaves a kernel waiting.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import datetime
import logging
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from strata.services.worker.stage_transport import (
    DISTRIBUTED,
    Receiver,
    Sender,
    StepFailed,
    TransportError,
    host_of,
    local_address_towards,
    resolve_threadsafe,
)
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


# Threads of closed links, which may still be aborting their NCCL groups (close() never blocks).
_CLOSING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _join_closing_links() -> None:
    """At exit, closed links finish tearing their groups down before CUDA shuts down: a group
    aborted during the driver's shutdown ends the process with SIGABRT (seen on two H200s, after
    every step had arrived intact)."""
    for thread in list(_CLOSING):
        thread.join(timeout=10)


def _tag(step_id: int) -> int:
    return step_id % (1 << 31)


def _form_group(store, rank: int, backend: str, peer_host: str, timeout: float, session: int):
    """The link's process group of two, through `store` (the receiver's TCPStore)."""
    prefixed = dist.PrefixStore(f"strata/link/{session}/", store)
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = delta
        pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        # NCCL builds a pair's communicator at its first point-to-point call and blocks there
        # until both ranks join. The sender's first step would block in it before emitting the
        # message the receiver waits for before posting its first receive: a deadlock (seen on
        # two H200s). One handshake here, where both sides arrive on their own, joins them.
        handshake = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        (pg.send if rank == 0 else pg.recv)([handshake], 1 - rank, 0).wait()
        return pg
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = delta
    # Gloo listens on the interface that routes to the peer (the hostname may resolve elsewhere).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(peer_host))]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def _abort(pg) -> None:
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception as e:  # a group already broken
                log.debug("stage transport: %s of the old group: %s", name, e)


def _meta(t: torch.Tensor) -> engine_pb2.Tensor:
    return engine_pb2.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape))


class DistributedSender(Sender):
    kind = DISTRIBUTED

    def __init__(self, session: int, emit, timeout: float, *, link: engine_pb2.StageLink, device):
        self.device = torch.device(device)
        self.backend = link.backend
        if (self.backend == "nccl") != (self.device.type == "cuda"):
            raise TransportError(f"a {link.backend} link from a stage on {self.device}")
        self.rendezvous = link.rendezvous_address
        self.max_elements = link.slot_elements
        self.pg = None
        self._error: Exception | None = None
        self._inflight: collections.deque = collections.deque(maxlen=64)  # NCCL work: keeps its tensors alive
        super().__init__(session, emit, timeout)

    def _loop(self) -> None:
        try:
            host, port = self.rendezvous.rsplit(":", 1)
            host = host_of(self.rendezvous)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            store = dist.TCPStore(
                host, int(port), world_size=2, is_master=False, timeout=datetime.timedelta(seconds=self.timeout)
            )
            self.pg = _form_group(store, 0, self.backend, host, self.timeout, self.session)
            log.info("stage transport: %s link to %s formed (session %d)", self.backend, self.rendezvous, self.session)
        except Exception as e:
            log.warning("stage transport: no %s link to %s: %s", self.backend, self.rendezvous, e)
            self._error = e
        super()._loop()

    def _transfer(self, step_id: int, hidden, residual):
        if self._error is not None:
            raise TransportError(f"link to the next stage is down: {self._error}")
        if max(hidden.numel(), residual.numel()) > self.max_elements:
            return super()._transfer(step_id, hidden, residual)  # inline bytes, this step only
        hidden, residual = hidden.contiguous(), residual.contiguous()
        works = [self.pg.send([t], 1, _tag(step_id)) for t in (hidden, residual)]
        # Announced before waiting: the receiver posts its receives when the message arrives.
        self.emit(
            engine_pb2.Activations(
                step_id=step_id,
                session=self.session,
                via_transport=True,
                hidden=_meta(hidden),
                residual=_meta(residual),
            )
        )
        if self.backend == "nccl":
            self._inflight.append((works, hidden, residual))  # queued on NCCL's stream: no host wait
            return None
        try:
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            self._error = e  # the peer is gone: later steps fail at once until the pipeline is rebuilt
            raise
        return None

    def _finish(self) -> None:
        if self.pg is not None and self.backend == "nccl":
            _abort(self.pg)
        self.pg = None

    def close(self) -> None:
        super().close()
        _CLOSING.add(self._thread)


class DistributedReceiver(Receiver):
    kind = DISTRIBUTED

    def __init__(self, session, device, dtype, hidden_size, max_rows, timeout, *, peer_host: str):
        super().__init__(session, device, dtype, hidden_size, max_rows, timeout)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.peer_host = peer_host
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size=2,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        self.pg = None
        self._error: Exception | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"transport-recv-{session}", daemon=True)
        self._thread.start()

    def link(self) -> engine_pb2.StageLink:
        # The scheduler replaces the host with this worker's host as it reaches it.
        return engine_pb2.StageLink(
            transport=self.kind,
            session=self.session,
            rendezvous_address=f"127.0.0.1:{self.store.port}",
            backend=self.backend,
            slot_elements=self.max_rows * self.hidden_size,  # larger steps go inline
        )

    def _check(self, msg: engine_pb2.Activations) -> None:
        super()._check(msg)
        if msg.via_transport and (msg.hidden.dtype != _NAMES[self.dtype] or msg.residual.dtype != msg.hidden.dtype):
            raise ValueError(f"activations of dtype {msg.hidden.dtype}, this stage runs {_NAMES[self.dtype]}")

    def _accept(self, msg: engine_pb2.Activations, fut: asyncio.Future) -> None:
        self._jobs.put((msg, fut, asyncio.get_running_loop()))

    def _loop(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.pg = _form_group(self.store, 1, self.backend, self.peer_host, self.timeout, self.session)
            log.info("stage transport: %s link from %s formed (session %d)", self.backend, self.peer_host, self.session)
        except Exception as e:
            log.warning("stage transport: no %s link from %s: %s", self.backend, self.peer_host, e)
            self._error = e
        while (job := self._jobs.get()) is not None:
            msg, fut, loop = job
            if self._closed:
                break
            try:
                if self._error is not None:
                    raise TransportError(f"link from the previous stage is down: {self._error}")
                tensors = [
                    torch.empty(tuple(m.shape), dtype=self.dtype, device=self.device) for m in self._announced(msg)
                ]
                works = [self.pg.recv([t], 0, _tag(msg.step_id)) for t in tensors]
                for w in works:
                    if self.backend == "nccl":
                        w.wait()  # the current (default) stream waits for NCCL's: no host wait
                    else:
                        w.wait(datetime.timedelta(seconds=self.timeout))
                self._received(msg, fut, loop, tensors)
            except Exception as e:
                if not isinstance(e, TransportError):
                    self._error = e
                self._failed(msg, fut, loop, StepFailed(f"stage transport (distributed): {e}"))
        if self.pg is not None and self.backend == "nccl":
            _abort(self.pg)
        self.pg = None

    # ---- what one message announces and what becomes of it (the token link overrides these)

    @staticmethod
    def _announced(msg) -> tuple:
        return (msg.hidden, msg.residual)

    def _received(self, msg, fut, loop, tensors) -> None:
        resolve_threadsafe(loop, fut, tuple(tensors))

    def _failed(self, msg, fut, loop, error: Exception) -> None:
        resolve_threadsafe(loop, fut, error=error)

    def close(self) -> None:
        super().close()
        self._closed = True
        self._jobs.put(None)
        _CLOSING.add(self._thread)
