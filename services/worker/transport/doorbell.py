"""The doorbell of a link: each step's announcement, and (ipc) the ring slots' credits, sent
straight from one stage's step thread to the other's: a Unix SEQPACKET socket on an `ipc` link,
a TCP connection on a `distributed` one (its stages may be on two hosts).

Why not the Forward stream: there, each announcement took a transport thread's wake-up, a gRPC
message and an event-loop hop on both sides, hundreds of microseconds per step (bench/RESULTS.md,
"Figures moved from code comments"). A SEQPACKET message from one step thread to the other, blocked in recv,
takes microseconds; it keeps message boundaries; the system call orders the ring's writes before
the announcement on every CPU; and its end of file says at once that the peer is gone (kill -9),
where a gRPC stream waits for its keepalive.

The receiving stage listens on a path in /dev/shm (an ipc link's two processes share it, as they
share torch's CUDA IPC reference counters there) and names it in its StageLink; the sender
connects. Each end is used by one thread, its stage's step thread; close() from any other thread
wakes a blocked recv. Every wait has a deadline.

Over TCP (a byte stream) every message is framed by its length, and the receiver listens on
every interface, as torch's TCPStore does: the sender first presents the link's secret, which
only the StageLink carries (through the scheduler's authenticated gRPC), and any other
connection is dropped.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
import tempfile
import time
from typing import NamedTuple

_ANNOUNCE = struct.Struct("<QIII")  # step id, ring slot, rows, columns; an error's text follows
_CREDIT = struct.Struct("<Q")  # the receiver has released every announcement before this count
_FRAME = struct.Struct("<I")  # TCP: each message's length, before it
# The socket's send buffer (net.core.wmem_default, about 200 KB) holds about 77 announcements;
# credits keep at most a ring's slots unread, so rings stay below 64 slots (errors are short).
MAX_ERROR_BYTES = 1024


class DoorbellClosed(Exception):
    """The link is closed, its peer is gone, or a wait passed its deadline."""


class Announcement(NamedTuple):
    step_id: int
    slot: int
    rows: int
    cols: int
    error: str  # the step failed upstream: nothing in the slot


def _socket_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _End:
    """A connected socket kept in blocking mode, so that each call on the step thread is one
    system call: a probe is recv(MSG_DONTWAIT), a wait polls the socket with its deadline, and a
    send is one send(), bounded by the kernel's send timeout. (Python's settimeout() around each
    call cost two fcntl calls more per call, and a timed send a poll() first, each dropping and
    taking back the GIL, which the worker's other threads hold often: it showed in the token
    hop's host time.)"""

    def __init__(self, timeout: float, stream: bool = False):
        self.timeout = timeout
        self.stream = stream  # TCP: messages framed by their length
        self.sock: socket.socket | None = None
        self._poll: select.poll | None = None
        self._bytes = bytearray()  # TCP: what arrived of the next messages
        self.closed = False

    def _use(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        if self.stream:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each announcement at once
        seconds = max(self.timeout, 1e-3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self.sock = sock

    def _recv(self, size: int, block: bool, deadline: float) -> bytes | None:
        """One message; None when none is waiting and block is False."""
        if self.stream:
            return self._recv_framed(size, block, deadline)
        return self._recv_some(size, block, deadline)

    def _recv_some(self, size: int, block: bool, deadline: float) -> bytes | None:
        """One recv() of up to `size` bytes (a SEQPACKET socket: one message)."""
        while True:
            if self.closed or self.sock is None:
                raise DoorbellClosed("link closed")
            if block:
                left = deadline - time.monotonic()
                if left <= 0 or not self._poll.poll(max(1, int(left * 1000))):
                    raise DoorbellClosed(f"no message from the peer stage in {self.timeout:.0f} s")
            try:
                data = self.sock.recv(size, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if block:
                    continue  # (woken without a message)
                return None
            except OSError as e:
                raise DoorbellClosed(f"link closed ({e})") from None
            if not data:
                raise DoorbellClosed("link closed" if self.closed else "the peer stage is gone")
            return data

    def _recv_framed(self, size: int, block: bool, deadline: float) -> bytes | None:
        """TCP: the next whole message (of at most `size` bytes) from the stream."""
        buf = self._bytes
        while True:
            if len(buf) >= _FRAME.size:
                (n,) = _FRAME.unpack_from(buf)
                if n > size:
                    raise DoorbellClosed(f"a message of {n} bytes from the peer stage (at most {size})")
                if len(buf) >= _FRAME.size + n:
                    data = bytes(buf[_FRAME.size : _FRAME.size + n])
                    del buf[: _FRAME.size + n]
                    return data
                block = True  # a message partly here: the rest follows
            chunk = self._recv_some(1 << 16, block, deadline)
            if chunk is None:
                return None
            buf += chunk

    def _send(self, data: bytes) -> None:
        if self.closed or self.sock is None:
            raise DoorbellClosed("link closed")
        try:
            if self.stream:
                self.sock.sendall(_FRAME.pack(len(data)) + data)
                return
            self.sock.send(data)
        except OSError as e:
            raise DoorbellClosed(f"the peer stage is gone ({e})") from None

    def close(self) -> None:
        """From any thread: a recv blocked on the step thread returns at once."""
        self.closed = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class DoorbellReceiver(_End):
    """The receiving stage's end: listens at `path` until the sender connects."""

    def __init__(self, timeout: float, tcp: bool = False):
        """tcp: listen on a TCP port of every interface (`port`; the sender presents `secret`),
        else at a Unix socket `path`."""
        super().__init__(timeout, stream=tcp)
        self.path, self.port, self.secret = "", 0, b""
        if tcp:
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4)
            else:
                self._listener = socket.create_server(("", 0), backlog=4)
            self.port = self._listener.getsockname()[1]
            self.secret = secrets.token_bytes(16)
        else:
            self.path = os.path.join(_socket_directory(), f"strata-link-{os.getpid()}-{secrets.token_hex(8)}.sock")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._listener.bind(self.path)
            self._listener.listen(1)
        self.released = 0

    def _connect(self, block: bool, deadline: float) -> bool:
        if self.sock is not None:
            return True
        if self.closed or self._listener is None:
            raise DoorbellClosed("link closed")
        while True:
            self._listener.settimeout(max(deadline - time.monotonic(), 1e-3) if block else 0.0)
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except TimeoutError:
                raise DoorbellClosed(f"the sending stage did not connect in {self.timeout:.0f} s") from None
            except OSError as e:
                raise DoorbellClosed(f"link closed ({e})") from None
            self._use(sock)
            if not self.secret or self._presented_secret(deadline):
                break
            block = True  # a stranger's connection: dropped, the sender's is still to come
        self._stop_listening()
        return True

    def _presented_secret(self, deadline: float) -> bool:
        """TCP: whether the new connection's first message is the link's secret (else it is closed)."""
        try:
            ok = hmac.compare_digest(self._recv(64, True, min(deadline, time.monotonic() + 5.0)) or b"", self.secret)
        except DoorbellClosed:
            ok = False
        if not ok:
            self.sock.close()
            self.sock, self._bytes = None, bytearray()
        return ok

    def next(self, block: bool = True) -> Announcement | None:
        """The next announcement, in the sender's order; None if none waits and block is False."""
        deadline = time.monotonic() + self.timeout
        if not self._connect(block, deadline):
            return None
        data = self._recv(_ANNOUNCE.size + MAX_ERROR_BYTES, block, deadline)
        if data is None:
            return None
        if len(data) < _ANNOUNCE.size:
            raise DoorbellClosed(f"a malformed announcement of {len(data)} bytes")
        step_id, slot, rows, cols = _ANNOUNCE.unpack_from(data)
        return Announcement(step_id, slot, rows, cols, data[_ANNOUNCE.size :].decode(errors="replace"))

    def release(self, count: int) -> None:
        """Every announcement before `count` is read: their slots may be written again."""
        self.released = count
        self._send(_CREDIT.pack(count))

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self.path:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass

    def close(self) -> None:
        super().close()
        self._stop_listening()


class DoorbellSender(_End):
    """The sending stage's end, connected to the receiver's path."""

    def __init__(self, path: str, timeout: float, *, port: int = 0, secret: bytes = b""):
        """port: the receiver's TCP doorbell at host `path`, where `secret` opens it."""
        super().__init__(timeout, stream=bool(port))
        where = f"{path}:{port}" if port else path
        try:
            if port:
                sock = socket.create_connection((path, port), timeout=timeout)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.settimeout(timeout)
                sock.connect(path)
        except OSError as e:
            if not port:
                sock.close()
            raise DoorbellClosed(f"cannot reach the next stage's doorbell at {where}: {e}") from None
        self._use(sock)
        if port:
            self._send(secret)
        self.released = 0

    def announce(self, step_id: int, slot: int, rows: int, cols: int, error: str = "") -> None:
        self._send(_ANNOUNCE.pack(step_id, slot, rows, cols) + error.encode()[:MAX_ERROR_BYTES])

    def wait_released(self, count: int) -> None:
        """Until the receiver has released every announcement before `count` (its credits)."""
        deadline = time.monotonic() + self.timeout
        while True:
            block = self.released < count
            data = self._recv(_CREDIT.size, block, deadline)
            if data is not None:
                (released,) = _CREDIT.unpack_from(data)
                self.released = max(self.released, released)  # (credits are counts: one read may lag)
            if not block:
                return  # one probe a step: the receiver sends one credit a step
