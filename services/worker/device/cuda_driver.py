"""libcuda's queueing calls, bound so that they keep the GIL: the step thread's copies, event
records and graph launches.

Every torch call that reaches CUDA (copy_, Event.record, CUDAGraph.replay) lets go of the GIL
around it, and the step thread must then take it back from whichever thread grabbed it: the
worker's event loop or its finisher, which keep it for their whole burst of Python or up to the
interpreter's switch interval. py-spy of the step thread (bench/RESULTS.md, issue 29 session 10)
put a large share of it on the two staging copies of a graph step, a few microseconds of driver
work each. The calls here only queue work on a stream or ask whether an event is done, and never
wait for the GPU, so they run with the GIL held (ctypes.PyDLL), as a Python call would.

Runtime and driver handles are the same objects (cudaStream_t is CUstream, cudaEvent_t is CUevent,
cudaGraphExec_t is CUgraphExec), so torch's streams, events and graphs are used as they are.
"""

from __future__ import annotations

import ctypes

import torch

_NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery's "still pending"
_MEMORY_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class _Copy2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class Driver:
    def __init__(self):
        lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL stays held through each call

        def fn(name, *argtypes):
            f = getattr(lib, name + "_v2", None) or getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        u64, u32, ptr, size = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t
        self.memcpy = fn("cuMemcpyAsync", u64, u64, size, ptr)
        self.memcpy_2d = fn("cuMemcpy2DAsync", ctypes.POINTER(_Copy2D), ptr)
        self.event_create = fn("cuEventCreate", ctypes.POINTER(ptr), ctypes.c_uint)
        self.event_destroy = fn("cuEventDestroy", ptr)
        self.event_record = fn("cuEventRecord", ptr, ptr)
        self.event_query = fn("cuEventQuery", ptr)
        self.event_elapsed = fn("cuEventElapsedTime", ctypes.POINTER(ctypes.c_float), ptr, ptr)
        # The one call here that waits for the GPU: through ctypes.CDLL, which lets go of the GIL.
        self.event_synchronize = ctypes.CDLL("libcuda.so.1").cuEventSynchronize
        self.event_synchronize.argtypes, self.event_synchronize.restype = [ptr], ctypes.c_int
        self.graph_launch = fn("cuGraphLaunch", ptr, ptr)
        # Stream memory operations (stream_memops.py).
        self.wait_value = fn("cuStreamWaitValue32", ptr, u64, u32, ctypes.c_uint)
        self.write_value = fn("cuStreamWriteValue32", ptr, u64, u32, ctypes.c_uint)
        self.register = fn("cuMemHostRegister", ptr, size, ctypes.c_uint)
        self.unregister = fn("cuMemHostUnregister", ptr)
        self.device_pointer = fn("cuMemHostGetDevicePointer", ctypes.POINTER(u64), ptr, ctypes.c_uint)


_driver: Driver | None = None
_missing = ""


def lib() -> Driver:
    global _driver, _missing
    if _driver is None and not _missing:
        try:
            _driver = Driver()
        except (OSError, AttributeError) as e:
            _missing = str(e)
    if _driver is None:
        raise RuntimeError(f"the CUDA driver library is unavailable: {_missing}")
    return _driver


def available() -> bool:
    try:
        lib()
        return True
    except RuntimeError:
        return False


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


def call(what: str, fn, *args) -> None:
    """fn(*args), again after a runtime call if it failed: a thread that has made no CUDA runtime
    call yet has no current context, where the runtime would have set one (an executor thread's
    first step)."""
    rc = fn(*args)
    if rc != 0:
        torch.cuda.current_stream().query()
        rc = fn(*args)
    check(rc, what)


def current_stream(device: torch.device) -> int:
    """The calling thread's current stream on `device`, as torch queues on it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (no Python layers; CUDA builds)
    if raw is not None:
        return raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queues a copy of nbytes between two addresses of this process (device or page-locked host
    memory: a pageable source would make the call wait) on `stream`."""
    call("cuMemcpyAsync", lib().memcpy, dst, src, nbytes, stream)


class RowCopy:
    """Queues copies of `rows` rows of `row_bytes` bytes from one device address to another,
    each side with its own pitch (cuMemcpy2DAsync), reusing one descriptor."""

    def __init__(self):
        self._desc = _Copy2D(srcMemoryType=_MEMORY_DEVICE, dstMemoryType=_MEMORY_DEVICE)
        self._ref = ctypes.byref(self._desc)

    def __call__(self, dst: int, dst_pitch: int, src: int, src_pitch: int, row_bytes: int, rows: int, stream: int):
        d = self._desc
        d.srcDevice, d.srcPitch, d.dstDevice, d.dstPitch = src, src_pitch, dst, dst_pitch
        d.WidthInBytes, d.Height = row_bytes, rows
        call("cuMemcpy2DAsync", lib().memcpy_2d, self._ref, stream)


def record(event: torch.cuda.Event, stream: int) -> None:
    """event.record() on `stream`, for an event torch has recorded once: torch makes an event's
    CUDA object at its first record."""
    if not event.cuda_event:
        raise RuntimeError("record the event through torch once first")
    call("cuEventRecord", lib().event_record, event.cuda_event, stream)


class TimingEvent:
    """A CUDA event with timing, made and recorded through the driver: the steps' start and end
    marks (a torch.cuda.Event's first record went through torch, and gave the GIL away).

    A freed event's handle goes back to its pool, not to cuEventDestroy: a step made three of them
    and the finisher destroyed three, with the GIL held (PyDLL), and py-spy put the destroys at
    6.8% of the last stage's finisher (bench/RESULTS.md, "Where the 1B pipeline's time goes").
    Re-recording a handle whose last record is still pending is allowed: nothing waits on it once
    its TimingEvent is gone."""

    __slots__ = ("handle", "pool")

    def __init__(self, pool: list[int] | None = None):
        self.handle, self.pool = None, pool
        if pool:
            try:
                self.handle = pool.pop()
                return
            except IndexError:  # (another thread took the last one)
                pass
        handle = ctypes.c_void_p()
        call("cuEventCreate", lib().event_create, ctypes.byref(handle), 0)  # CU_EVENT_DEFAULT: timed
        self.handle = handle.value

    def record(self, stream: int) -> None:
        call("cuEventRecord", lib().event_record, self.handle, stream)

    def query(self) -> bool:
        """Whether the work queued before the last record has completed."""
        rc = lib().event_query(self.handle)
        if rc == _NOT_READY:
            return False
        check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Waits for the last record (the GIL is let go meanwhile)."""
        check(lib().event_synchronize(self.handle), "cuEventSynchronize")

    def elapsed_time(self, end: TimingEvent) -> float:
        """Milliseconds from this event to `end`, both completed (torch.cuda.Event's unit)."""
        ms = ctypes.c_float()
        check(lib().event_elapsed(ctypes.byref(ms), self.handle, end.handle), "cuEventElapsedTime")
        return ms.value

    def __del__(self):
        if self.handle and _driver is not None:
            if self.pool is not None:
                self.pool.append(self.handle)  # (list.append is atomic: the finisher frees, the step thread takes)
            else:
                _driver.event_destroy(self.handle)  # (a pending event is released once it completes)


# Each device's freed timing events (a handle belongs to the context it was made in).
_EVENT_POOLS: dict[int, list[int]] = {}


def timing_event(device: torch.device) -> TimingEvent:
    """A TimingEvent recorded now on the calling thread's current stream of `device`, from the
    device's pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    event = TimingEvent(_EVENT_POOLS.setdefault(index, []))
    event.record(current_stream(device))
    return event


def graph_exec(graph: torch.cuda.CUDAGraph) -> int | None:
    """A captured graph's executable, for launch(); None where this torch does not expose it
    (replay() then)."""
    if not hasattr(graph, "raw_cuda_graph_exec") or not available():
        return None
    handle = graph.raw_cuda_graph_exec()
    return handle if isinstance(handle, int) else ctypes.cast(handle, ctypes.c_void_p).value


def launch(executable: int, stream: int) -> None:
    """Replays a captured graph (graph_exec's handle) on `stream`. torch's replay also refreshes
    its RNG generators' seeds first (two small kernels); these graphs draw from their own
    seeds, never from torch's RNG."""
    call("cuGraphLaunch", lib().graph_launch, executable, stream)
