"""The tensor-parallel group of one stage: its T ranks joined by torch.distributed (NCCL on GPUs,
gloo on CPUs, or on GPUs that ranks share: NCCL refuses two ranks on one GPU), and the collectives
the model and the sampler call on it.

The group is formed again at every InitCache (the session names its keys in the rank-0 store,
so a rebuilt group never meets an older one's), on the step thread, where the rendezvous blocks
until every rank joins (at most the collective deadline). Every collective has that deadline:
gloo's waits are bounded by the group's timeout; NCCL's host never waits (the stream does), its
work is bounded by the communicator's timeout and by the engine's step deadline, after which the
next InitCache aborts the group (NCCL's abort makes enqueued and graph-replayed kernels exit).

NCCL's abort takes seconds after a lost rank (on two H200s: 0.1-0.5 s with the ipc one-shot,
10.5-16.5 s with NCCL alone), and on the event loop (a peer's plan socket closing) it once did not
return in 90 s: the worker stopped answering the scheduler, so the stage was never rebuilt. It
runs on a thread of its own. A new group that waited for it waited for ever (NCCL's aborts did
not end in 90 s while form() waited, eb73a89; they ended once it went on, 0a78cb4), so form()
gives it ABORT_GRACE_SECONDS, then goes on: the old communicator is left behind meanwhile (a
warning with the thread's stack says so), and graph capture runs in thread-local mode
(graphs/cuda_graphs.py `capturing`), so the abort's CUDA calls cannot fail it. The kernels
that waited for the lost rank exit with partial sums: a step that ends while the group is broken
returns no tokens (`broken` is set before the abort; server.py's result fetch checks it).

A failed collective means a rank is gone or the ranks diverged: it raises PeerLost, so the step
fails as a lost stage's does (the scheduler rebuilds the pipeline and the requests resume), and
the group stays broken until then: a rank that skipped a collective would pair every later one
wrongly.

With one rank every collective is a no-op, so the model and the sampler call them
unconditionally.
"""

from __future__ import annotations

import datetime
import logging
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from strata.flags import DEFAULTS
from strata.services.worker.transport.distributed_transport import abort_group, local_address_towards
from strata.services.worker.transport.stage_transport import PeerLost

log = logging.getLogger("strata.worker")
# How long a forming group waits for its predecessor's abort: the quick ones end within it; a
# slower one may need the new group to go on (module docstring).
ABORT_GRACE_SECONDS = 10.0


class TensorParallelGroup:
    """Rank `rank` of `size` of one stage. Collectives run on the step thread; abort() may come
    from any thread."""

    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        timeout: float = 60.0,
        master_host: str = "",
        all_reduce: str = DEFAULTS["tensor_parallel_all_reduce"],
        dtype: torch.dtype = torch.bfloat16,
    ):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
        self.rank, self.size, self.device, self.timeout = rank, size, torch.device(device), timeout
        self.master_host = master_host or "127.0.0.1"  # gloo listens on the interface towards it
        # "symm-mem" and "ipc": small all-reduces of `dtype` take a one-shot through symmetric
        # memory (symm_mem.py) or Strata's own over CUDA IPC (ipc_all_reduce.py), the rest NCCL's.
        self.all_reduce_kind, self.dtype = all_reduce, dtype
        # gloo's collectives (CPU tensors, or CUDA tensors staged through the host) wait on this
        # thread and cannot be captured; NCCL's wait on the stream.
        self.host_collectives = self.device.type != "cuda" or all_reduce == "gloo"
        self.one_shot = None
        self.one_shot_max = None  # "ipc": the draw's maximum over int64 keys too
        self.one_shot_norm = None  # "ipc": the all-reduce fused with the add and norm after it
        self.pg = None
        self.session = 0
        self.aborting: threading.Thread | None = None  # the last NCCL abort, on its own thread
        # Why the group cannot run collectives (None: it can, once formed).
        self.broken: str | None = None if size == 1 else "the tensor-parallel group is not formed yet (InitCache)"
        # Bench only: collectives return at once, leaving each rank's partial values (wrong
        # tokens, the step's time without its communication).
        self.skip_collectives = False
        self.send_early = True  # (--tensor-parallel-no-early-send: the bench's A/B)

    @property
    def active(self) -> bool:
        return self.size > 1

    def form(self, store, session: int) -> None:
        """Joins the group of `session` through `store` (the rank-0 TCPStore); blocks until every
        rank joined, at most the deadline. On the step thread, before the KV cache's warm-up and
        graph capture, which run collectives in lockstep."""
        if self.size == 1:
            return
        self._await_abort()
        prefixed = dist.PrefixStore(f"strata/tp/{session}/", store)
        delta = datetime.timedelta(seconds=self.timeout)
        if not self.host_collectives:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = delta
            pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, opts)
            # NCCL builds its communicator at the first collective and blocks there until every
            # rank arrives: once here, not inside a graph capture or a step.
            warm = torch.ones(1, device=self.device)
            pg.allreduce([warm]).wait()
            torch.cuda.current_stream(self.device).synchronize()
            # Agreed in two rounds: a rank whose sum did not form builds no more, and its peers
            # must know that before they wait for its buffers.
            (self.one_shot,) = _formed_on_every_rank(pg, [self._one_shot(pg, store, session)], self.device)
            more = self._more_ipc_one_shots(store, session, self.one_shot is not None)
            self.one_shot_max, self.one_shot_norm = _formed_on_every_rank(pg, list(more), self.device)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = delta
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(self.master_host))]
            pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, opts)
        self.pg, self.session, self.broken = pg, session, None
        log.info("tensor parallel: rank %d of %d joined the group of session %d", self.rank, self.size, session)

    def _one_shot(self, pg, store, session: int):
        """The one-shot all-reduce for small messages, if one was asked for and forms."""
        if self.all_reduce_kind not in ("symm-mem", "ipc"):
            return None
        try:
            if self.all_reduce_kind == "ipc":
                from strata.services.worker.tensor_parallel.ipc_all_reduce import IpcAllReduce

                return IpcAllReduce(store, self.rank, self.size, session, self.device, self.dtype, timeout=self.timeout)
            from strata.services.worker.tensor_parallel.symm_mem import SymmetricMemoryAllReduce

            return SymmetricMemoryAllReduce(pg, store, self.rank, self.size, session, self.device, self.dtype)
        except Exception as e:  # (a torch without it, or no peer access): NCCL takes every message
            log.warning("tensor parallel: no %s all-reduce (%s); NCCL takes every one", self.all_reduce_kind, e)
            return None

    def _more_ipc_one_shots(self, store, session: int, sum_formed: bool):
        """With "ipc" (and its sum formed): the sampler's maximum over the slices' keys (a batch-1
        decode step then runs no NCCL kernel at all), and the all-reduce fused with the residual
        add and RMSNorm after it (a launch less after each row-parallel linear of the unfused
        layers)."""
        if not sum_formed or self.all_reduce_kind != "ipc":
            return None, None
        from strata.services.worker.tensor_parallel.ipc_all_reduce import MAX_KEY_BYTES, IpcAllReduce

        try:
            args = (store, self.rank, self.size, session, self.device)
            maximum = IpcAllReduce(*args, torch.int64, MAX_KEY_BYTES, self.timeout, kind="max")
            return maximum, IpcAllReduce(*args, self.dtype, timeout=self.timeout, kind="norm")
        except Exception as e:
            log.warning("tensor parallel: no more ipc one-shots (%s); NCCL takes their messages", e)
            return None, None

    def abort(self, reason: str = "the tensor-parallel group was rebuilt") -> None:
        """Breaks the group (any thread, never blocking it): NCCL kernels waiting for a lost rank
        exit, and every later collective raises PeerLost until the next form()."""
        if self.size == 1:
            return
        self.broken = reason
        for one_shot in (self.one_shot, self.one_shot_max, self.one_shot_norm):
            if hasattr(one_shot, "abort"):  # its kernels' waits on a lost peer end now
                one_shot.abort()
        self.one_shot = self.one_shot_max = self.one_shot_norm = None
        pg, self.pg = self.pg, None
        if pg is not None:
            args = (pg, reason, self.device)
            self.aborting = threading.Thread(target=_abort, args=args, name="tp-abort", daemon=True)
            self.aborting.start()

    def _await_abort(self) -> None:
        """The last abort's end, at most ABORT_GRACE_SECONDS (or the deadline, if shorter); past
        it the group forms without it (module docstring)."""
        aborting, self.aborting = self.aborting, None
        if aborting is None:
            return
        aborting.join(min(ABORT_GRACE_SECONDS, self.timeout))
        if aborting.is_alive():
            frame = sys._current_frames().get(aborting.ident)
            where = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "(no frame)"
            log.warning(
                "tensor parallel: the old group's abort has not ended in %.0f s; forming the new group "
                "without it (its communicator is left behind). The abort thread is at:\n%s",
                min(ABORT_GRACE_SECONDS, self.timeout),
                where,
            )

    def fail(self, reason: str) -> None:
        """A step failed between collectives on this rank: the ranks no longer pair theirs."""
        if self.size > 1 and self.broken is None:
            log.warning("tensor parallel: group broken: %s", reason)
            self.abort(reason)

    # ------------------------------------------------------------ collectives

    def _group(self):
        pg = self.pg
        if self.broken is not None or pg is None:
            raise PeerLost(f"tensor parallel: {self.broken or 'no group'}")
        return pg

    def _run(self, what: str, post):
        """Posts a collective and waits for it: on GPUs the stream waits, on CPUs this thread,
        at most the deadline. A failure breaks the group and fails the step as a lost peer's."""
        pg = self._group()
        try:
            work = post(pg)
            if self.host_collectives:
                self._wait_on_host(work, what)
            else:
                work.wait()
        except PeerLost:
            raise
        except Exception as e:
            self.abort(f"{what} failed: {e}")
            raise PeerLost(f"tensor parallel: {what} failed: {e}") from None

    def _wait_on_host(self, work, what: str) -> None:
        """gloo's wait, in short turns that see the group broken from another thread (gloo's
        abort does not release a wait): a rank whose peer is lost is free at once, not after
        the deadline."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not work.is_completed():
            if self.broken is not None:
                raise PeerLost(f"tensor parallel: {what}: {self.broken}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no peer answered in {self.timeout:g} s")
            spins += 1
            time.sleep(0 if spins < 100 else 0.0002)
        work.wait()  # (its error, if it failed)

    def early_sender(self, numel: int, dtype: torch.dtype):
        """The ipc one-shot that a kernel computing a sum's numel elements may send its part into as
        it ends (kernels/one_shot_all_reduce.py, "Sent early"), or None. Pass it to the all_reduce_
        of that sum, which then only waits and adds. Every rank decides alike."""
        shot = self.one_shot
        if shot is None or not self.send_early or self.size == 1 or self.skip_collectives or self.broken is not None:
            return None
        return shot if shot.takes_early_sends(numel, dtype) else None

    def all_reduce_(self, x: torch.Tensor, sent=None) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits). sent: the
        early_sender whose buffers x's kernel sent it into; only that one-shot can finish the sum
        (if the group broke since, its abort word releases the wait and the step fails)."""
        if sent is not None:
            sent.receive(x)
            return x
        if self.size == 1 or self.skip_collectives:
            return x
        if self.one_shot is not None and self.broken is None and self.one_shot(x):
            return x
        self._run("all-reduce", lambda pg: pg.allreduce([x]))
        return x

    def all_reduce_add_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(x summed over the ranks + residual), that sum + residual) in one launch;
        None when no fused one-shot takes x (the caller all-reduces, then adds and norms)."""
        shot = self.one_shot_norm
        if shot is None or self.size == 1 or self.skip_collectives or self.broken is not None:
            return None
        return shot.add_rms_norm(x, residual, weight, eps, unit_offset, residual_out)

    def all_reduce_max_(self, x: torch.Tensor) -> torch.Tensor:
        """x's elementwise maximum over the ranks, in place."""
        if self.size == 1 or self.skip_collectives:
            return x
        if self.one_shot_max is not None and self.broken is None and self.one_shot_max(x):
            return x
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._run("all-reduce (max)", lambda pg: pg.allreduce([x], opts))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        if self.skip_collectives:
            out.copy_(x.unsqueeze(0).expand_as(out))
            return out
        self._run("all-gather", lambda pg: pg._allgather_base(out.view(-1), x.view(-1)))
        return out


def _abort(pg, reason: str, device: torch.device) -> None:
    started = time.monotonic()
    log.info("tensor parallel: aborting the group (%s)", reason)
    if device.type == "cuda":  # (a thread starts on GPU 0: a context there would cost another rank's GPU memory)
        torch.cuda.set_device(device)
    abort_group(pg, "tensor parallel")
    log.info("tensor parallel: the old group's abort took %.1f s (%s)", time.monotonic() - started, reason)


def _formed_on_every_rank(pg, shots: list, device: torch.device) -> list:
    """The one-shots that formed on every rank; the others dropped everywhere (a rank that failed
    to map a peer's buffer would send that message to NCCL while its peers wait in the one-shot)."""
    formed = torch.tensor([shot is not None for shot in shots], dtype=torch.int32, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([formed], opts).wait()
    everywhere = formed.tolist()
    for shot, ok in zip(shots, everywhere):
        if shot is not None and not ok:
            log.warning("tensor parallel: a peer could not form %s; NCCL takes its messages", type(shot).__name__)
            if hasattr(shot, "abort"):
                shot.abort()
    return [shot if ok else None for shot, ok in zip(shots, everywhere)]


def single_rank(device: torch.device) -> TensorParallelGroup:
    """The group of a stage without tensor parallelism: every collective a no-op."""
    return TensorParallelGroup(0, 1, device)
