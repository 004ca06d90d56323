"""The token link's two ends (token_handoff.py says what the link is for and in which order its
tokens land): stage 0's receivers, which hand each step's tokens to its TokenIntake, and the last
stage's senders, which its TokenOutlet hands them to. Per transport:

- `grpc`: the tokens' bytes ride the SampledTokens message (the last stage's transport thread
  copies them to the host, off the step thread);
- `distributed`: a torch.distributed send/recv in a group of two (the receiver hosts the store),
  each step announced on the link's TCP doorbell from the last stage's step thread to stage 0's.
  Every sampling step sends the same size (padded), so on GPUs stage 0 posts a step's receive as
  soon as a step needs its tokens and its GPU waits for it (token_waits.NcclTokenWaits); on CPUs
  stage 0's step thread takes the announcements and receives before each of its steps
  (TokenIntake.pump);
- `ipc`: a ring of int64 token buffers on stage 0's device (ring.py, ipc_transport.py), each step
  announced on a doorbell from the last stage's step thread straight to stage 0's, which takes
  what has arrived before each of its steps (TokenIntake.pump): no thread, no gRPC message.
  On GPUs that allow it, stage 0's GPU waits for the tokens instead of its host
  (token_waits.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import torch

from strata.services.worker.device.host_to_device import upload
from strata.services.worker.transport.distributed_transport import DistributedReceiver, DistributedSender
from strata.services.worker.transport.ipc_transport import RingReader
from strata.services.worker.transport.ring import Ring
from strata.services.worker.transport.stage_transport import PeerLost, Sender
from strata.services.worker.transport.token_handoff import TokenIntake
from strata.services.worker.transport.token_waits import IpcTokenWaits, NcclTokenWaits
from strata.stage_links import DISTRIBUTED, GRPC, IPC, TransportError, host_of, name_of
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")
# The token ring's slots. Tokens not yet taken by stage 0 are at most the plans in flight plus one
# (stage 0 takes all that arrived before each step); a slot is max_num_seqs int64s. Below the
# doorbell socket's buffer (doorbell.py).
TOKEN_RING_SLOTS = 32


# ------------------------------------------------------------------ stage 0: receivers


class _TokenReceiving:
    """The receiving end's common part: HandTokens delivers each message (event loop thread)."""

    intake: TokenIntake
    max_tokens: int
    vocab_size: int

    def deliver_tokens(self, msg: engine_pb2.SampledTokens) -> None:
        if msg.error:
            self.intake.apply(msg.step_id, None)
            return
        t = msg.tokens
        if t.dtype != "int64" or len(t.shape) != 1 or not 0 < t.shape[0] <= self.max_tokens:
            log.error("token link: step %d: tokens of %s %s", msg.step_id, t.dtype, list(t.shape))
            self.intake.apply(msg.step_id, None)
            return
        if msg.via_transport:  # (ipc and distributed links announce on their doorbells)
            log.error("token link: step %d announced on a transport this link does not have", msg.step_id)
            self.intake.apply(msg.step_id, None)
            return
        host = np.frombuffer(t.data, dtype=np.int64).copy()
        if host.shape[0] != t.shape[0] or (host < 0).any() or (host >= self.vocab_size).any():
            log.error("token link: step %d: malformed token bytes", msg.step_id)
            self.intake.apply(msg.step_id, None)
            return
        self.intake.apply(msg.step_id, upload({"t": host}, self.intake.device)["t"])

    def close_tokens(self) -> None:
        self.intake.close()

    def pump(self, need: int) -> None:
        """ipc and distributed links, on stage 0's step thread: apply every step's tokens that has
        arrived, and wait (with the link's deadline) until step `need`'s are applied."""
        intake = self.intake
        while True:
            if intake._closed:
                raise PeerLost(f"token link closed: {intake._closed}")
            a = self._next_announcement(block=intake.applied < need)
            if a is None:
                return
            self._apply_announced(a)


class GrpcTokenReceiver(_TokenReceiving):
    kind = GRPC

    def __init__(self, session: int, intake: TokenIntake, max_tokens: int, vocab_size: int):
        self.session, self.intake, self.max_tokens, self.vocab_size = session, intake, max_tokens, vocab_size
        self.acks: asyncio.Queue = asyncio.Queue()

    def link(self) -> engine_pb2.StageLink:
        return engine_pb2.StageLink(transport=GRPC, session=self.session)

    def close(self) -> None:
        self.close_tokens()
        self.acks.put_nowait(None)


class IpcTokenReceiver(_TokenReceiving):
    """A ring of `slots` int64 buffers of max_tokens on stage 0's device; stage 0's step thread
    takes each step's announcement from the doorbell (pump) and scatters the tokens from the
    slot. The HandTokens stream carries nothing but its end (the last stage is gone)."""

    kind = IPC

    def __init__(self, session: int, device, max_tokens: int, timeout: float, slots: int):
        self.session = session
        ring = Ring.create(torch.device(device), torch.int64, slots, 1, max_tokens, words=True)
        self.reader = RingReader(ring, timeout)
        self.acks: asyncio.Queue = asyncio.Queue()  # no credits on the stream: they go on the doorbell

    def link(self) -> engine_pb2.StageLink:
        return self.reader.link(self.session)

    def _next_announcement(self, block: bool):
        return self.reader.next(block)

    def _apply_announced(self, a) -> None:
        intake, reader = self.intake, self.reader
        if a.error:
            intake.apply(a.step_id, None)
        elif a.cols or not 0 < a.rows <= self.max_tokens:
            log.error("token link: step %d: %d x %d tokens", a.step_id, a.rows, a.cols)
            intake.apply(a.step_id, None)
        else:
            ring = reader.ring
            ring.ready_wait(a.slot, reader.taken)
            intake.apply(a.step_id, ring.view(a.slot, 0, (a.rows,)))
            ring.consumed_record(a.slot, reader.taken)
        reader.release()

    def deliver_tokens(self, msg: engine_pb2.SampledTokens) -> None:
        log.error("token link: step %d sent on the stream of an ipc link", msg.step_id)

    def close(self) -> None:
        self.close_tokens()  # releases the GPU's waits, if any
        self.reader.close()
        self.reader.ring.close_words()
        self.acks.put_nowait(None)


class DistributedTokenReceiver(_TokenReceiving, DistributedReceiver):
    """Every sampling step sends max_tokens int64s, padded (zeros for a failed step: the sender's
    fixed_elements). On GPUs stage 0 posts each receive at its announcement or when a step needs
    it, whichever comes first, and its stream waits only when a step needs the tokens
    (token_waits.NcclTokenWaits); on CPUs (gloo) its step thread takes the announcements and
    receives in their order (pump), as an ipc link without slot words. The HandTokens stream
    carries nothing but its end (the last stage is gone)."""

    def __init__(self, session: int, device, max_tokens: int, timeout: float, *, peer_host: str):
        super().__init__(session, device, torch.int64, 1, max_tokens, timeout, peer_host=peer_host)
        self.columns = 0

    def _next_announcement(self, block: bool):
        return self._next(block)

    def _apply_announced(self, a) -> None:
        tokens = torch.empty(self.max_rows, dtype=torch.int64, device=self.device)
        self.post_receive(a.step_id, tokens)  # a failed step's zeros too: the pairs stay in order
        if not a.error and (a.cols or not 0 < a.rows <= self.max_rows):
            log.error("token link: step %d: %d x %d tokens", a.step_id, a.rows, a.cols)
            a = a._replace(error="malformed")
        self.intake.apply(a.step_id, None if a.error else tokens[: a.rows])

    def deliver_tokens(self, msg: engine_pb2.SampledTokens) -> None:
        log.error("token link: step %d sent on the stream of a distributed link", msg.step_id)

    def close(self) -> None:
        self.close_tokens()
        super().close()


def open_token_receiver(
    request: engine_pb2.TokenLinkRequest, intake: TokenIntake, *, max_tokens: int, vocab_size: int, slots: int
):
    kind, session = request.transport, request.session
    timeout = request.transport_timeout_seconds or 120.0
    device = intake.device
    if kind == IPC:
        receiver = IpcTokenReceiver(session, device, max_tokens, timeout, slots)
        if receiver.reader.ring.words is not None:
            intake.device_waits = IpcTokenWaits(receiver.reader, intake.last_sampled, timeout)
        else:
            intake.pump = receiver.pump
    elif kind == DISTRIBUTED:
        receiver = DistributedTokenReceiver(
            session, device, max_tokens, timeout, peer_host=host_of(request.peer_address)
        )
        if receiver.backend == "nccl":
            intake.device_waits = NcclTokenWaits(receiver, intake.last_sampled, timeout)
        else:
            intake.pump = receiver.pump
    else:
        return GrpcTokenReceiver(session, intake, max_tokens, vocab_size)
    receiver.intake, receiver.max_tokens, receiver.vocab_size = intake, max_tokens, vocab_size
    return receiver


# ------------------------------------------------------------------ the last stage: senders


class _Failed:
    def __init__(self, error: str):
        self.error = error


class _TokenSending:
    """A Sender for the token link on gRPC: one int64 tensor per step, SampledTokens messages,
    in step order (a step's error goes through the transport thread's queue behind earlier
    steps). ipc and distributed links send from the step thread, tokens as one more tensor."""

    def send(self, step_id: int, tokens: torch.Tensor) -> None:
        # A copy on the step's stream: tokens may be a graph's outputs, which its next replay
        # overwrites before the transport thread reads them.
        self._jobs.put((step_id, tokens.clone()))

    def send_error(self, step_id: int, error: str) -> None:
        if threading.current_thread() is self._thread:  # this step's transfer failed: in order
            self.emit(engine_pb2.SampledTokens(step_id=step_id, error=error, session=self.session))
        else:
            self._jobs.put((step_id, _Failed(error)))

    def _transfer(self, step_id: int, tokens, *rest):
        if isinstance(tokens, _Failed):
            return engine_pb2.SampledTokens(step_id=step_id, error=tokens.error, session=self.session)
        return self._transfer_tokens(step_id, tokens, *rest)


class GrpcTokenSender(_TokenSending, Sender):
    def _transfer_tokens(self, step_id: int, tokens):
        t = tokens.cpu()  # on the transport thread: waits for the step's draw, not the step thread
        msg = engine_pb2.SampledTokens(
            step_id=step_id, session=self.session, tokens=engine_pb2.Tensor(dtype="int64", shape=list(t.shape))
        )
        msg.tokens.data = t.numpy().tobytes()
        return msg


def open_token_sender(request: engine_pb2.TokenLinkRequest, emit, *, device):
    link = request.link
    timeout = request.transport_timeout_seconds or 120.0
    if link.session != request.session or link.transport != request.transport:
        raise TransportError(f"stage 0's token link ({name_of(link.transport)}, session {link.session}) does not match")
    if link.transport == IPC:  # the activations' sender: tokens are one more tensor in a slot
        from strata.services.worker.transport.ipc_transport import IpcSender

        return IpcSender(request.session, emit, timeout, link=link, device=device)
    if link.transport == DISTRIBUTED:
        sender = DistributedSender(request.session, emit, timeout, link=link, device=device)
        # stage 0 may post a step's receive before its announcement; the padding copies the tokens
        # (a graph's outputs, which its next replay overwrites)
        sender.fixed_elements = link.slot_elements
        return sender
    return GrpcTokenSender(request.session, emit, timeout)
