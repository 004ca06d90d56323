"""`distributed`: torch.distributed send/recv between two stages, NCCL on GPUs, gloo on CPUs.

Each link is a process group of its own, of two ranks (0 sends, 1 receives), built directly on a
PrefixStore of the TCPStore the receiver hosts (port chosen by the OS, one store per InitCache, so
a rebuilt pipeline never meets an older one's keys) - not the process-wide default group: a
middle stage holds two links, and a rebuilt pipeline drops one link without touching the other.
The group is formed on a thread of the link's own (the rendezvous, and NCCL's first call, block
until both ends join); the steps use it once it is there.

Both ends run on their stages' step threads, as an ipc link's do: the sender posts its sends and
then announces the step (id and shape, or its error) on the link's TCP doorbell (doorbell.py);
the receiver takes the announcements in order and posts its receives, into the step's graph
inputs where it has them. NCCL pairs point-to-point calls in posting order, and both sides post
in step order; an announced step no plan here reads is received anyway and dropped. On GPUs
nothing waits on a host: the sender's sends wait for its step on the device, and the receiver's
compute stream waits for its receives. (Through the Forward stream, each announcement took a
transport thread's wake-up, a gRPC message and an event-loop hop on both sides, and the stages
waited on them: bench/RESULTS.md, "Figures moved from code comments".)

Deadlines: the rendezvous, every doorbell wait and every gloo wait take at most the link's
timeout; NCCL work is bounded by the group's timeout (its watchdog aborts the communicator, see
strata/stage_links.py's NCCL_ENVIRONMENT), and close() aborts the group so a lost peer never leaves a kernel waiting. A
peer that dies closes the doorbell: the next wait fails at once (PeerLost).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import logging
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

from strata.services.worker.transport.doorbell import Announcement, DoorbellClosed, DoorbellReceiver, DoorbellSender
from strata.services.worker.transport.stage_transport import PeerLost, Receiver, StepFailed, StepThreadSender
from strata.stage_links import DISTRIBUTED, TransportError, host_of
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Sends whose tensors the sender keeps until they complete: gloo's beyond this are waited for;
# NCCL's are dropped past the larger bound (its work keeps their tensors until they complete).
_MAX_PENDING_SENDS = 16
_MAX_PENDING_NCCL_SENDS = 64


# Threads of closed links, which may still be aborting their NCCL groups (close() never blocks).
_CLOSING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _join_closing_links() -> None:
    """At exit, closed links finish tearing their groups down before CUDA shuts down: a group
    aborted during the driver's shutdown ends the process with SIGABRT (seen on two GPUs, after
    every step had arrived intact)."""
    for thread in list(_CLOSING):
        thread.join(timeout=10)


def local_address_towards(host: str) -> str:
    """The address of this host's interface on the route to `host` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


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
        # until both ranks join: one handshake here, on the link's thread, where both sides
        # arrive on their own, keeps that wait off the step threads.
        handshake = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        (pg.send if rank == 0 else pg.recv)([handshake], 1 - rank, 0).wait()
        torch.cuda.current_stream().synchronize()
        return pg
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = delta
    # Gloo listens on the interface that routes to the peer (the hostname may resolve elsewhere).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(peer_host))]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def abort_group(pg, owner: str = "stage transport") -> None:
    """Tear a process group down without waiting on its peers: abort where the backend has it
    (NCCL), else shut down. A group already broken may refuse either (logged, not raised). An NCCL
    group whose abort failed is left as it is: its shutdown() first waits for the group's work to
    finish, and work waiting for a lost peer never does (a thread stuck there forever)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as e:  # a group already broken
            log.warning("%s: %s of the old group failed: %s", owner, name, e)
        if nccl is not None and isinstance(pg, nccl):
            return


class _Group:
    """A link end's process group, formed on a thread of its own, which also tears it down after
    close() (an NCCL abort may take a while; close() never blocks)."""

    def __init__(self, form, device: torch.device, timeout: float, what: str):
        self.pg = None
        self.error: Exception | None = None
        self.timeout = timeout
        self._form, self._device, self._what = form, device, what
        self._formed = threading.Event()
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"transport-{what}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            self.pg = self._form()
            log.info("stage transport: %s formed", self._what)
        except Exception as e:
            log.warning("stage transport: no %s: %s", self._what, e)
            self.error = e
        self._formed.set()
        self._closed.wait()
        if self.pg is not None and self._device.type == "cuda":  # (gloo's ends with its sockets)
            abort_group(self.pg)
        self.pg = None

    def get(self):
        """The formed group (on the step thread: waits for the rendezvous, with the deadline)."""
        if not self._formed.wait(self.timeout):
            self.error = TimeoutError(f"the peer stage did not join in {self.timeout:.0f} s")
        if self.error is not None:
            raise TransportError(f"{self._what} is down: {self.error}")
        if self._closed.is_set():
            raise TransportError(f"{self._what} is closed")
        return self.pg

    def fail(self, error: Exception) -> None:
        """A wait on the group failed: the peer is gone, later steps fail at once until the
        pipeline is rebuilt."""
        self.error = error

    def close(self) -> None:
        self._closed.set()
        self._formed.set()
        _CLOSING.add(self.thread)


class DistributedSender(StepThreadSender):
    """The sending end, on the step thread: each step's sends posted, then its announcement (no
    transport thread, no Forward message). Tokens (the token link) are one 1-D tensor a step."""

    kind = DISTRIBUTED

    def __init__(self, session: int, emit, timeout: float, *, link: engine_pb2.StageLink, device):
        self.device = torch.device(device)
        if (link.backend == "nccl") != (self.device.type == "cuda"):
            raise TransportError(f"a {link.backend} link from a stage on {self.device}")
        if not link.doorbell_port:
            raise TransportError("the distributed link names no doorbell")
        self.max_elements = link.slot_elements
        host, port = host_of(link.rendezvous_address), int(link.rendezvous_address.rsplit(":", 1)[1])
        try:
            self.doorbell = DoorbellSender(host, timeout, port=link.doorbell_port, secret=link.doorbell_secret)
        except DoorbellClosed as e:
            raise TransportError(str(e)) from None

        def form():
            store = dist.TCPStore(
                host, port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
            return _form_group(store, 0, link.backend, host, timeout, session)

        self.group = _Group(form, self.device, timeout, f"{link.backend} link to {link.rendezvous_address}")
        self._pending: collections.deque = collections.deque()  # (works, tensors) not known complete
        # The token link: every step's one tensor goes out padded to this many elements, and a
        # failed step's as zeros, so the receiver can post each receive before its announcement
        # (token_waits.NcclTokenWaits). 0: the tensors' own sizes, errors on the doorbell only.
        self.fixed_elements = 0
        self._filler: torch.Tensor | None = None
        super().__init__(session, emit, timeout)

    def put(self, step_id: int, tensors) -> None:
        """On the step thread: the step's sends posted behind it, then its announcement."""
        t = tensors[0]
        if max(x.numel() for x in tensors) > self.max_elements or t.dim() > 2:
            raise TransportError(
                f"{t.dtype} {list(t.shape)} is more than the link takes ({self.max_elements} elements)"
            )
        pg = self.group.get()
        if self.fixed_elements:  # (one 1-D tensor: the token link)
            tensors = [torch.nn.functional.pad(t, (0, self.fixed_elements - t.shape[0]))]
        else:
            # A graph's outputs are overwritten by its next replay, which nothing orders after the
            # sends: they go out of copies (queued on the compute stream, as the step was).
            copy = tensors[0].device.type == "cuda"
            tensors = [x.clone() if copy else x.contiguous() for x in tensors]
        self._post(pg, step_id, tensors)
        self.doorbell.announce(step_id, 0, t.shape[0], t.shape[1] if t.dim() > 1 else 0)

    def _post(self, pg, step_id: int, tensors) -> None:
        self._reap()
        try:
            works = [pg.send([x], 1, _tag(step_id)) for x in tensors]
        except Exception as e:  # a send half posted leaves the pairs unknown: the link is down
            self.group.fail(e)
            raise TransportError(f"send failed: {e}") from None
        self._pending.append((works, tensors))

    def _reap(self) -> None:
        """Drops the sends that have completed; waits (with the deadline) for gloo's oldest past
        _MAX_PENDING_SENDS (NCCL's work keeps its tensors alive on its own)."""
        pending = self._pending
        while pending and all(w.is_completed() for w in pending[0][0]):
            pending.popleft()
        if self.device.type == "cuda":
            while len(pending) > _MAX_PENDING_NCCL_SENDS:
                pending.popleft()
            return
        while len(pending) > _MAX_PENDING_SENDS:
            works, _ = pending.popleft()
            try:
                for w in works:
                    w.wait(datetime.timedelta(seconds=self.timeout))
            except Exception as e:
                self.group.fail(e)
                raise TransportError(f"a send did not complete: {e}") from None

    def send_error(self, step_id: int, error: str) -> None:
        if self.fixed_elements:  # the receiver may have posted this step's receive already
            try:
                if self._filler is None:
                    self._filler = torch.zeros(self.fixed_elements, dtype=torch.int64, device=self.device)
                self._post(self.group.get(), step_id, [self._filler])
            except TransportError as e:  # the link is down: the receiver hears of it on its own
                log.warning("stage transport (distributed): step %d's filler not sent: %s", step_id, e)
        try:
            self.doorbell.announce(step_id, 0, 0, 0, error or "failed upstream")
        except DoorbellClosed as e:
            log.warning("stage transport (distributed): step %d's error not sent: %s", step_id, e)

    def close(self) -> None:
        super().close()
        self.doorbell.close()
        self.group.close()


class DistributedReceiver(Receiver):
    """The receiving end: the step thread takes each step's announcement from the doorbell and
    posts its receives (take), as an ipc link's does; the Forward stream carries nothing."""

    kind = DISTRIBUTED
    on_step_thread = True

    def __init__(self, session, device, dtype, hidden_size, max_rows, timeout, *, peer_host: str):
        super().__init__(session, device, dtype, hidden_size, max_rows, timeout)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size=2,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        self.doorbell = DoorbellReceiver(timeout, tcp=True)
        store = self.store
        self.group = _Group(
            lambda: _form_group(store, 1, self.backend, peer_host, timeout, session),
            self.device,
            timeout,
            f"{self.backend} link from {peer_host}",
        )
        self.columns = hidden_size  # of each announced tensor (0: one dimension, the token link's)
        self._held: Announcement | None = None  # a later step's announcement, taken early (take)
        self.wait_seconds = 0.0

    def link(self) -> engine_pb2.StageLink:
        # The scheduler replaces the host with this worker's host as it reaches it.
        return engine_pb2.StageLink(
            transport=self.kind,
            session=self.session,
            rendezvous_address=f"127.0.0.1:{self.store.port}",
            backend=self.backend,
            slot_elements=self.max_rows * self.hidden_size,
            doorbell_port=self.doorbell.port,
            doorbell_secret=self.doorbell.secret,
        )

    def _next(self, block: bool = True) -> Announcement | None:
        started = time.perf_counter()
        try:
            return self.doorbell.next(block)
        except DoorbellClosed as e:
            raise PeerLost(f"stage transport (distributed): {e}") from None
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _shape(self, a: Announcement) -> tuple:
        """The announced step's tensor shape. A shape this end cannot take breaks the link: the
        sender posted its sends, and skipping them would pair every later step wrongly."""
        shape = (a.rows, a.cols) if a.cols else (a.rows,)
        if a.cols != self.columns or not 0 < a.rows <= self.max_rows:
            self.group.fail(ValueError(f"step {a.step_id} announced as {list(shape)}"))
            raise PeerLost(f"stage transport (distributed): step {a.step_id}'s tensors of shape {list(shape)}")
        return shape

    def _receive(self, a: Announcement, into=None, parts: int = 2) -> tuple:
        """Posts the announced step's receives (into `into`'s first rows where given)."""
        shape = self._shape(a)
        if into is None:
            out = tuple(torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(parts))
        else:
            out = tuple(dst[: a.rows] for dst in into)
        self.post_receive(a.step_id, *out)
        return out

    def post_receive(self, step_id: int, *tensors) -> None:
        """Step `step_id`'s receives into `tensors` (each the size of its send); on GPUs the
        current stream waits for them, on CPUs this thread does (with the deadline)."""
        self.finish_receive(self.start_receive(step_id, *tensors))

    def start_receive(self, step_id: int, *tensors) -> list:
        """Posts step `step_id`'s receives and returns them unwaited (finish_receive waits). On
        GPUs NCCL's stream first waits for the current stream's work, as for any of its ops."""
        try:
            pg = self.group.get()
        except TransportError as e:
            raise PeerLost(f"stage transport (distributed): {e}") from None
        try:
            return [pg.recv([t], 0, _tag(step_id)) for t in tensors]
        except Exception as e:
            self.group.fail(e)
            raise PeerLost(f"stage transport (distributed): {e}") from None

    def finish_receive(self, works: list) -> None:
        """On GPUs the current stream waits for the receives (no host wait); on CPUs this thread
        does, with the deadline."""
        try:
            for w in works:
                if self.backend == "nccl":
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            self.group.fail(e)
            raise PeerLost(f"stage transport (distributed): {e}") from None

    def next_announcement(self, block: bool = True) -> Announcement | None:
        return self._next(block)

    def take(self, step_id: int, into: tuple[torch.Tensor, torch.Tensor] | None = None):
        """On the step thread: this step's (hidden, residual) on this stage's device, read into
        `into`'s first rows (a graph's inputs) or into new tensors; raises StepFailed.
        Announcements come in step order: an earlier step's that no plan here asked for is
        received and dropped, a later one's is kept for its own step."""
        while True:
            a = self._held or self._next()
            self._held = None
            if a.step_id >= step_id:
                break
            if not a.error:
                self._receive(a)
        if a.step_id > step_id:
            self._held = a
            raise StepFailed(f"step {step_id}'s activations never came (step {a.step_id}'s did)")
        if a.error:
            raise StepFailed.upstream(a.error)
        if into is not None and (into[0].dtype != self.dtype or into[0].shape[0] < a.rows):
            into = None  # (a receive must match the send's size exactly)
        return self._receive(a, into)

    def close(self) -> None:
        self.doorbell.close()
        self.group.close()
        super().close()
