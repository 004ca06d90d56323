"""Words in shared host memory that a CUDA stream waits on and another process's stream writes
(the driver's stream memory operations, cuStreamWaitValue32 / cuStreamWriteValue32): how a
stage's GPU waits for a peer's copy with no host in between.

Why: an interprocess CUDA event can be waited on only after the peer has recorded it, so the
waiting stage's host first had to hear from the peer's host (the doorbell) before it could queue
its next step. A wait on a word needs no such order: the waiting stream stalls in the GPU's front
end (no SM is held) until the peer's stream writes a value at least as large.

The words live in a file in /dev/shm that both processes map and register with CUDA, not in
device memory: the waiting side's host can then release its own GPU with a plain store (a peer
that died never writes; a stream of the same process writing a word its other stream waits on
did not return on the GPU it was tried on), and can read how far the peer got without touching the GPU.

torch has no binding for these calls; they are functions of libcuda (cuda_driver.py: they keep
the GIL, as they only queue work).
`usable(device)` probes once per device; without them a link keeps its events and doorbell.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets

import numpy as np
import torch

from strata.services.worker.device import cuda_driver

log = logging.getLogger("strata.worker")

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, so counters may wrap
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: the write follows a memory barrier
_REGISTER_FLAGS = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
WORD_BYTES = 4


_probed: dict[int, bool] = {}


def _lib() -> cuda_driver.Driver:
    try:
        return cuda_driver.lib()
    except RuntimeError as e:
        raise RuntimeError(f"stream memory operations unavailable: {e}") from None


# A stream: torch's, or its raw handle (cuda_driver.current_stream: no Stream object to build on
# the step thread, where py-spy put torch.cuda.current_stream at 5% of the 1B's last stage).
StreamLike = torch.cuda.Stream | int


def wait_geq(stream: StreamLike, address: int, value: int) -> None:
    """Work queued on `stream` after this runs once the word at device `address` holds at least
    `value`."""
    _on_stream(_lib().wait_value, stream, address, value, _WAIT_GEQ, "cuStreamWaitValue32")


def write(stream: StreamLike, address: int, value: int) -> None:
    """Writes `value` into the word at device `address` once the work queued on `stream` before
    it is done (and visible: the write follows a memory barrier)."""
    _on_stream(_lib().write_value, stream, address, value, _WRITE_DEFAULT, "cuStreamWriteValue32")


def copy(stream: StreamLike, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copies contiguous `src` into `dst` (same bytes, any devices of this process) on `stream`
    alone. torch's copy_ between two GPUs also orders it with the destination GPU's current
    stream in this process: work in a context of this process on the peer's GPU, which the GPU
    time-slices with the peer's own context (ipc_transport.Ring.write)."""
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"copy of {list(src.shape)} {src.dtype} into {list(dst.shape)} {dst.dtype}")
    handle = _handle(stream)
    lib = _lib()
    rc = _retry_without_context(stream, lambda: lib.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, handle))
    cuda_driver.check(rc, "cuMemcpyAsync")


def _handle(stream: StreamLike) -> int:
    return stream if isinstance(stream, int) else stream.cuda_stream


def _on_stream(call, stream: StreamLike, address: int, value: int, flags: int, what: str) -> None:
    handle = _handle(stream)
    rc = _retry_without_context(stream, lambda: call(handle, address, value & 0xFFFFFFFF, flags))
    cuda_driver.check(rc, what)


def _retry_without_context(stream: StreamLike, call) -> int:
    rc = call()
    if rc != 0:
        # A thread that has made no CUDA runtime call yet has no current context, and the driver
        # call fails where the runtime's would have set it (an executor thread taking a step's
        # activations): one runtime call makes it current, then the call again. (A raw handle is
        # the current device's: cuda_driver.current_stream.)
        (torch.cuda.current_stream() if isinstance(stream, int) else stream).query()
        rc = call()
    return rc


class SharedWords:
    """`count` int32 words in a /dev/shm file, mapped and registered with CUDA in this process:
    `host` is their numpy view, address(i) the device address of word i. The creator names the
    file in its link; the peer opens it (and unlinks the name: both have it mapped)."""

    def __init__(self, path: str, count: int, create: bool, device: torch.device):
        self.path, self.count = path, count
        lib = _lib()  # (before the file: without the driver there is nothing to clean up)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, count * WORD_BYTES)
            self._map = mmap.mmap(fd, count * WORD_BYTES)
        finally:
            os.close(fd)
        self.host = np.frombuffer(self._map, dtype=np.int32, count=count)
        self._base = self.host.ctypes.data
        try:
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).query()  # a runtime call: the device's context is current
                cuda_driver.check(lib.register(self._base, count * WORD_BYTES, _REGISTER_FLAGS), "cuMemHostRegister")
        except RuntimeError:
            self._base, self.host = 0, None
            self._map.close()
            if create:
                self.unlink()
            raise
        device = ctypes.c_uint64()
        cuda_driver.check(lib.device_pointer(ctypes.byref(device), self._base, 0), "cuMemHostGetDevicePointer")
        self._device_base = device.value

    @classmethod
    def create(cls, count: int, device: torch.device) -> SharedWords:
        # The name carries the pid: ipc_transport.sweep_stale_files removes a dead process's.
        name = f"strata-words-{os.getpid()}-{secrets.token_hex(8)}"
        return cls(os.path.join(words_directory(), name), count, True, device)

    def address(self, i: int) -> int:
        return self._device_base + i * WORD_BYTES

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """Unregisters and unmaps (the caller makes sure no queued operation still uses them)."""
        if self._base:
            _lib().unregister(self._base)
            self._base = 0
            self.host = None
            self._map.close()
            self.unlink()


def words_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def usable(device: torch.device) -> bool:
    """Whether this process can wait on and write a shared word on `device` (probed once: a write
    and a wait that it satisfies, on a side stream)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _probed:
        words = None
        try:
            with torch.cuda.device(index):
                side = torch.cuda.Stream()
                words = SharedWords.create(1, torch.device("cuda", index))
                words.unlink()
                write(side, words.address(0), 7)
                wait_geq(side, words.address(0), 7)
                side.synchronize()
                _probed[index] = int(words.host[0]) == 7
        except (RuntimeError, OSError) as e:
            log.info("stream memory operations unusable on %s: %s", device, e)
            _probed[index] = False
        finally:
            if words is not None:
                words.close()
    return _probed[index]
