"""The symmetric-memory one-shot's group registration (services/worker/tensor_parallel/symm_mem.py)
on this torch, with gloo thread ranks: symmetric memory's registry takes a ProcessGroup, not the
bare backend a TensorParallelGroup forms (torch 2.11 refused that, so the one-shot never formed on
GPUs), and keeps only a weak reference to it. The one-shot itself needs CUDA:
tests/gpu/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

from strata.services.worker.tensor_parallel.symm_mem import _as_process_group
from tests.tp_threads import form_groups, run_ranks


@pytest.fixture(scope="module")
def groups():
    made = form_groups(2)
    yield made
    made.clear()
    gc.collect()  # gloo's groups go before the interpreter's exit, which they would abort


def test_a_ranks_backend_wrapped_registers_and_reduces_through_the_registry(groups):
    store = dist.HashStore()

    def wrap_and_reduce(rank, group):
        wrapped = _as_process_group(group.pg, dist.PrefixStore("wrap/", store), rank, group.size, group.device)
        name = f"test-wrap-{rank}"  # (threads of one process share the registry)
        _register_process_group(name, wrapped)
        resolved = _resolve_process_group(name)
        assert (resolved.rank(), resolved.size()) == (rank, 2)
        x = torch.full((4,), float(rank + 1))
        resolved.allreduce([x]).wait()
        return x.tolist(), wrapped

    (a, keep_a), (b, keep_b) = run_ranks(groups, wrap_and_reduce)
    assert a == b == [3.0] * 4
    del keep_a, keep_b
    gc.collect()
    with pytest.raises(RuntimeError, match="destroyed"):  # why SymmetricMemoryAllReduce holds it
        _resolve_process_group("test-wrap-0")


def test_tearing_the_group_down_releases_the_one_shots_waits():
    """abort() sets the one-shot's abort word (a kernel spinning on a lost peer ends) and drops it:
    every later all-reduce of the session raises PeerLost instead of launching."""
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from strata.services.worker.transport.stage_transport import PeerLost

    class OneShot:
        aborted = False

        def abort(self):
            self.aborted = True

    group = TensorParallelGroup(0, 2, torch.device("cpu"))
    group.broken, group.one_shot = None, OneShot()
    shot = group.one_shot
    group.abort("a peer is gone")
    assert shot.aborted and group.one_shot is None
    with pytest.raises(PeerLost, match="a peer is gone"):
        group.all_reduce_(torch.ones(3))


def test_an_abort_that_blocks_never_holds_the_caller_and_its_steps_return_no_tokens():
    """NCCL's abort takes seconds, and on the event loop it once never returned: the worker stopped
    answering the scheduler's InitCache (two H200s). So it runs on its own thread, and a step that
    ends after the break (its kernels released with partial sums) reaches the scheduler as a lost
    peer's failure, not as tokens."""
    import threading

    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from strata.services.worker.tensor_parallel.ranks import StageRanks
    from strata.services.worker.transport.stage_transport import PeerLost
    from strata.v1 import engine_pb2

    released = threading.Event()

    class StuckNcclGroup:
        aborted = False

        def abort(self):
            released.wait(30)
            self.aborted = True

    group = TensorParallelGroup(0, 2, torch.device("cpu"))
    ranks = StageRanks(group)
    pg = group.pg = StuckNcclGroup()
    group.broken = None
    tokens = engine_pb2.StepResult(step_id=7, token_ids=[5])
    assert ranks.vouch(tokens) is tokens  # a formed group vouches for its steps
    began = time.monotonic()
    ranks.fail("tensor-parallel rank 1 closed its plan connection")
    assert time.monotonic() - began < 1.0 and group.aborting.is_alive() and not pg.aborted
    with pytest.raises(PeerLost, match="closed its plan connection"):
        group.all_reduce_(torch.ones(3))
    failed = ranks.vouch(tokens)
    assert failed.step_id == 7 and failed.peer_lost and not failed.token_ids and "plan connection" in failed.error
    own = engine_pb2.StepResult(step_id=8, error="stage 0: ValueError: x")
    assert ranks.vouch(own) is own  # a step's own error stays its own
    released.set()
    group.aborting.join(5)
    assert pg.aborted and group.pg is None


def test_a_group_forms_after_its_predecessors_abort_or_its_grace(caplog):
    """A rebuilt stage's group waits for the old group's abort (most end in seconds), but not for
    one that never ends (NCCL's, after kill -9 of a peer on two H200s): past the grace it forms
    without it, and the warning shows where the abort thread is stuck."""
    import threading

    from strata.services.worker.tensor_parallel.group import TensorParallelGroup

    released = threading.Event()

    def stuck_in_the_abort():
        released.wait(30)

    group = TensorParallelGroup(0, 2, torch.device("cpu"), timeout=0.2)
    group.aborting = threading.Thread(target=stuck_in_the_abort, daemon=True)
    group.aborting.start()
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="strata.worker"):
        group._await_abort()
    assert 0.2 <= time.monotonic() - began < 2.0 and group.aborting is None
    assert "left behind" in caplog.text
    assert "stuck_in_the_abort" in caplog.text  # the thread's stack
    released.set()

    caplog.clear()
    ended = threading.Thread(target=time.sleep, args=(0.05,), daemon=True)
    group.aborting = ended
    ended.start()
    with caplog.at_level("WARNING", logger="strata.worker"):
        group._await_abort()
    assert not ended.is_alive() and not caplog.text


def test_an_nccl_group_whose_abort_failed_is_never_shut_down(monkeypatch):
    """shutdown() first waits for the group's work, and NCCL work waiting for a lost peer never
    ends: after a failed abort an NCCL group is left alone; another backend is shut down."""
    import torch.distributed as dist

    from strata.services.worker.transport.distributed_transport import abort_group

    class Group:
        def __init__(self):
            self.calls = []

        def abort(self):
            self.calls.append("abort")
            raise RuntimeError("the group is broken")

        def shutdown(self):
            self.calls.append("shutdown")

    class Nccl(Group):
        pass

    monkeypatch.setattr(dist, "ProcessGroupNCCL", Nccl, raising=False)
    nccl, other = Nccl(), Group()
    abort_group(nccl)
    abort_group(other)
    assert nccl.calls == ["abort"] and other.calls == ["abort", "shutdown"]


def test_a_one_shot_that_did_not_form_on_every_rank_is_dropped_on_all():
    """A rank that could not map a peer's buffers sends that message to NCCL: its peers must too,
    or they would wait in the one-shot for a rank that never comes."""
    from strata.services.worker.tensor_parallel.group import _formed_on_every_rank

    class Shot:
        def __init__(self, name):
            self.name, self.aborted = name, False

        def abort(self):
            self.aborted = True

    made = [[Shot("sum"), None, Shot("norm")], [Shot("sum"), Shot("max"), None]]
    kept = run_ranks(form_groups(2), lambda rank, g: _formed_on_every_rank(g.pg, made[rank], g.device))
    for rank in range(2):
        assert [s and s.name for s in kept[rank]] == ["sum", None, None]
    assert made[0][2].aborted and made[1][1].aborted and not made[0][0].aborted
