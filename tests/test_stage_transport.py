"""The stage transport: auto's choice from the stages' Describe, a gloo link and an ipc link (host
shared memory and its doorbell) between two ends (bytes, order, errors, deadlines, a lost peer, a
rebuilt link), and greedy, seeded and n > 1 outputs through 2 and 3 real stages on every transport
a CPU runs (grpc, distributed over gloo, ipc) equal to HF and one stage."""

from __future__ import annotations

import time

import pytest
import torch

from strata.services.worker.transport.distributed_transport import _join_closing_links
from strata.services.worker.transport.stage_transport import PeerLost, StepFailed, open_receiver, open_sender
from strata.stage_links import DISTRIBUTED, GRPC, IPC, TransportError, choose_transport, local_location, same_ipc_domain
from strata.v1 import engine_pb2, generate_pb2
from tests.cluster import collect, hf_greedy, running_cluster, tiny_llama_dir, worker_calls

GPU0, GPU1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


def _stage(device="cuda:0", host="h1", boot="b1", ns="ipc:[4026531839]", uuid=GPU0, visible=(GPU0, GPU1)):
    loc = engine_pb2.WorkerLocation(hostname=host, boot_id=boot, ipc_namespace=ns)
    if device.startswith("cuda"):
        loc.device_uuid = uuid
        loc.visible_device_uuids.extend(visible)
    return engine_pb2.WorkerDescription(device=device, location=loc)


# ------------------------------------------------------------------ auto's choice


def test_auto_picks_ipc_for_gpus_of_one_host_and_ipc_namespace():
    assert choose_transport(_stage(), _stage(uuid=GPU0)) == IPC  # both stages on one GPU
    assert choose_transport(_stage(), _stage(device="cuda:1", uuid=GPU1)) == IPC  # peer GPUs


@pytest.mark.parametrize(
    "receiver",
    [
        _stage(host="h2"),  # another host
        _stage(boot="b2"),  # the same name after a reboot, or another machine that shares it
        _stage(ns="ipc:[4026532000]"),  # containers that do not share an IPC namespace
        _stage(device="cuda:0", uuid="GPU-not-visible-to-the-sender"),
        _stage(device="cpu"),
    ],
    ids=["other-host", "other-boot", "other-ipc-namespace", "gpu-not-visible", "cpu-receiver"],
)
def test_auto_picks_distributed_where_the_handles_cannot_open(receiver):
    assert choose_transport(_stage(), receiver) == DISTRIBUTED


def test_auto_on_cpu_stages_is_ipc_on_one_host_else_gloo_and_overrides_are_honoured():
    cpu = _stage(device="cpu")
    assert choose_transport(cpu, cpu) == IPC  # a ring in /dev/shm
    assert choose_transport(cpu, _stage(device="cpu", host="h2")) == DISTRIBUTED
    assert choose_transport(cpu, cpu, "grpc") == GRPC
    assert choose_transport(cpu, cpu, "distributed") == DISTRIBUTED
    assert choose_transport(_stage(), _stage(host="h2"), "distributed") == DISTRIBUTED
    assert choose_transport(_stage(), _stage(), "ipc") == IPC
    with pytest.raises(TransportError, match="ipc needs both stages in one host"):
        choose_transport(cpu, _stage(), "ipc")  # a CPU stage cannot write a GPU's ring
    with pytest.raises(TransportError, match="ipc needs"):
        choose_transport(_stage(), _stage(host="h2"), "ipc")
    with pytest.raises(TransportError, match="NCCL cannot pair two stages on one GPU"):
        choose_transport(_stage(), _stage(), "distributed")
    assert choose_transport(_stage(), _stage(device="cuda:1", uuid=GPU1), "distributed") == DISTRIBUTED
    with pytest.raises(TransportError, match="unknown stage transport"):
        choose_transport(cpu, cpu, "carrier-pigeon")


def test_this_process_reports_where_it_runs():
    loc = local_location(torch.device("cpu"))
    assert loc.hostname and loc.ipc_namespace.startswith("ipc:[") and not loc.device_uuid
    assert same_ipc_domain(loc, local_location(torch.device("cpu")))
    assert not same_ipc_domain(loc, engine_pb2.WorkerLocation())


def test_a_stage_on_its_own_gpu_launches_from_threads_bound_to_it(monkeypatch):
    """A stage on cuda:1 (a GPU per stage): Triton launches and graph capture use the calling
    thread's current device, so the worker's step and finisher threads must be bound to the
    stage's GPU (on two GPUs, stage 1's InitCache failed in Triton while they were not)."""
    import threading
    from types import SimpleNamespace

    from strata.services.worker import runner as runner_module
    from strata.services.worker.server import WorkerServicer

    bound = {}
    monkeypatch.setattr(
        runner_module.torch.cuda, "set_device", lambda device: bound.setdefault(threading.current_thread().name, device)
    )
    servicer = WorkerServicer(SimpleNamespace(device=torch.device("cuda", 1)), engine_pb2.WorkerDescription())
    pools = (servicer.executor, servicer.finisher)
    names = [pool.submit(lambda: threading.current_thread().name).result() for pool in pools]
    assert all(bound[name] == torch.device("cuda", 1) for name in names)
    runner_module.use_device(torch.device("cpu"))  # a CPU stage binds nothing
    assert len(bound) == 2
    for pool in pools:
        pool.shutdown()


def test_a_gpu_stage_named_without_an_index_gets_one(monkeypatch):
    """`--device cuda` (and auto) is the current GPU with its index: binding a thread takes one,
    and an index-less device made every GPU worker fail at start-up (the two-GPU fix's regression)."""
    from strata.services.worker.main import pick_device

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    assert pick_device("cuda") == pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="2 GPU"):
        pick_device("cuda:2")


# ------------------------------------------------------------------ a gloo link, both ends in one process

HIDDEN = 8


def _open_link(timeout=20.0, session=7, before_sender=None):
    """The scheduler's order: the receiver opens its end, its link goes to the sender."""
    request = engine_pb2.InitCacheRequest(
        session=session,
        previous_stage_transport=DISTRIBUTED,
        previous_stage_address="127.0.0.1:1",
        transport_timeout_seconds=timeout,
    )
    receiver = open_receiver(request, device="cpu", dtype=torch.float32, hidden_size=HIDDEN, max_rows=16, slots=3)
    link = receiver.link()
    assert link.transport == DISTRIBUTED and link.backend == "gloo" and link.rendezvous_address.startswith("127.0.0.1:")
    assert link.doorbell_port and len(link.doorbell_secret) == 16
    if before_sender is not None:
        before_sender(link)
    emitted = []  # the Forward stream: nothing goes there on a distributed link
    sender = open_sender(
        engine_pb2.InitCacheRequest(session=session, next_stage_link=link, transport_timeout_seconds=timeout),
        emitted.append,
        device="cpu",
    )
    return receiver, sender, emitted


def _in_thread(fn, *args):
    """fn(*args) on a thread of its own (the other stage's step thread); its result or error."""
    import concurrent.futures

    return concurrent.futures.ThreadPoolExecutor(1).submit(fn, *args)


def test_a_gloo_link_moves_the_bytes_in_order_and_forwards_errors():
    receiver, sender, emitted = _open_link()
    sent, got, failed = {}, {}, {}

    def take_all():  # the receiving step thread
        for step in range(1, 8):
            try:
                got[step] = receiver.take(step)
            except StepFailed as e:
                failed[step] = str(e)

    reader = _in_thread(take_all)
    try:
        for step, rows in ((1, 3), (2, 16), (3, 1), (5, 40), (6, 2), (7, 1)):  # 40 rows: more than the link takes
            h, r = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)
            sent[step] = (h, r)
            sender.send(step, h, r)
            if step == 3:
                sender.send_error(4, "stage 0: RuntimeError: boom")
        reader.result(60)
    finally:
        sender.close()
        receiver.close()
    assert emitted == []
    assert sorted(failed) == [4, 5] and "boom" in failed[4] and "more than the link takes" in failed[5]
    for step in (1, 2, 3, 6, 7):
        assert torch.equal(got[step][0], sent[step][0]) and torch.equal(got[step][1], sent[step][1]), step
    assert sender.steps_sent == 5
    # close() never blocks; at exit the links' threads are joined (an NCCL group torn down
    # during CUDA's shutdown would end the process with SIGABRT)
    _join_closing_links()
    assert not sender.group.thread.is_alive() and not receiver.group.thread.is_alive()


def test_a_gloo_receiver_receives_and_drops_steps_no_plan_asked_for_and_keeps_a_later_one():
    receiver, sender, _ = _open_link()
    try:
        for step in (3, 4, 6):
            sender.send(step, *_step_tensors(step, 2))
        assert torch.equal(receiver.take(4)[0], _step_tensors(4, 2)[0])  # 3's is received and dropped
        with pytest.raises(StepFailed, match="step 5's activations never came"):
            receiver.take(5)
        into = (torch.zeros(16, HIDDEN), torch.zeros(16, HIDDEN))  # a graph's inputs
        h, r = receiver.take(6, into)
        assert h.data_ptr() == into[0].data_ptr() and torch.equal(h, _step_tensors(6, 2)[0])
        assert torch.equal(into[1][:2], _step_tensors(6, 2)[1]) and not into[1][2:].any()
    finally:
        sender.close()
        receiver.close()


def test_a_lost_peer_fails_the_step_at_once_and_a_new_link_works():
    receiver, sender, _ = _open_link(timeout=30.0, session=1)
    h = torch.ones(2, HIDDEN)
    sender.send(1, h, h)
    receiver.take(1)
    # The sender goes away (its stage was lost): the receiver's next step fails at once, not
    # at the deadline, and the stage itself lives on.
    sender.close()
    start = time.monotonic()
    with pytest.raises(PeerLost, match="gone|closed"):
        receiver.take(2)
    assert time.monotonic() - start < 5
    receiver.close()
    # The receiver goes away: the sender's next steps are not sent, and the sender lives on.
    receiver, sender, _ = _open_link(timeout=30.0, session=2)
    sender.send(1, h, h)
    receiver.take(1)
    receiver.close()
    start = time.monotonic()
    for step in (2, 3, 4):
        sender.send(step, h, h)
    assert time.monotonic() - start < 10 and sender.steps_sent < 4
    sender.close()
    # A rebuilt pipeline: a new session, a new store, a new group.
    receiver, sender, _ = _open_link(session=3)
    try:
        sender.send(1, h * 2, h)
        got_h, _ = receiver.take(1)
        assert torch.equal(got_h, h * 2)
    finally:
        sender.close()
        receiver.close()


def test_a_gloo_receiver_waiting_for_a_step_fails_it_when_the_pipeline_is_rebuilt():
    receiver, sender, _ = _open_link()
    waiting = _in_thread(receiver.take, 5)
    time.sleep(0.2)
    receiver.close()
    sender.close()
    with pytest.raises(StepFailed, match="closed"):
        waiting.result(10)


def test_a_stranger_cannot_announce_steps_on_a_distributed_link():
    import socket
    import struct

    strangers = []

    def intrude(link):  # connects first, with a wrong secret and a step of its own
        stranger = socket.create_connection(("127.0.0.1", link.doorbell_port))
        fake = struct.pack("<QIII", 1, 0, 16, HIDDEN)
        stranger.sendall(struct.pack("<I", 16) + b"x" * 16 + struct.pack("<I", len(fake)) + fake)
        strangers.append(stranger)

    receiver, sender, _ = _open_link(before_sender=intrude)
    try:
        sender.send(1, *_step_tensors(1, 3))
        h, _ = receiver.take(1)
        assert torch.equal(h, _step_tensors(1, 3)[0])  # the stranger's connection was dropped
        try:
            assert strangers[0].recv(16) == b""  # closed (reset, where bytes were left unread)
        except ConnectionResetError:
            pass
    finally:
        strangers[0].close()
        sender.close()
        receiver.close()


def _open_ipc_link(timeout=20.0, session=7, slots=3):
    request = engine_pb2.InitCacheRequest(
        session=session,
        previous_stage_transport=IPC,
        previous_stage_address="127.0.0.1:1",
        transport_timeout_seconds=timeout,
    )
    receiver = open_receiver(request, device="cpu", dtype=torch.float32, hidden_size=HIDDEN, max_rows=16, slots=slots)
    link = receiver.link()
    assert link.transport == IPC and link.doorbell_path and link.host_ring_path and link.slots == slots
    emitted = []  # the Forward stream: nothing goes there on an ipc link
    sender = open_sender(
        engine_pb2.InitCacheRequest(session=session, next_stage_link=link, transport_timeout_seconds=timeout),
        emitted.append,
        device="cpu",
    )
    return receiver, sender, emitted


def _step_tensors(step, rows):
    h = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN) + 1000 * step
    return h, -h


def test_an_ipc_link_moves_every_step_in_order_reuses_slots_only_after_they_are_read_and_forwards_errors():
    import threading

    receiver, sender, emitted = _open_ipc_link(slots=2)
    got, failed = {}, {}

    def take_all():  # the receiving step thread, slower than the sender
        for step in range(1, 31):
            try:
                got[step] = receiver.take(step)
            except StepFailed as e:
                failed[step] = str(e)
            time.sleep(0.002)

    reader = threading.Thread(target=take_all)
    reader.start()
    try:
        for step in range(1, 31):  # 2 slots for 30 steps: the sender waits for each credit
            if step % 7 == 0:
                sender.send_error(step, f"stage 0: RuntimeError: step {step} broke")
            else:
                sender.send(step, *_step_tensors(step, 1 + step % 16))
        reader.join(30)
        assert not reader.is_alive()
    finally:
        sender.close()
        receiver.close()
    assert emitted == []
    assert sorted(failed) == [7, 14, 21, 28] and "step 14 broke" in failed[14]
    for step, (h, r) in got.items():
        want_h, want_r = _step_tensors(step, 1 + step % 16)
        assert torch.equal(h, want_h) and torch.equal(r, want_r), step
    assert len(got) == 26 and sender.steps_sent == 26


def test_an_ipc_receiver_drops_steps_no_plan_asked_for_and_keeps_a_later_one():
    receiver, sender, _ = _open_ipc_link()
    try:
        for step in (3, 4, 6):
            sender.send(step, *_step_tensors(step, 2))
        assert torch.equal(receiver.take(4)[0], _step_tensors(4, 2)[0])  # 3's is dropped
        with pytest.raises(StepFailed, match="step 5's activations never came"):
            receiver.take(5)
        assert torch.equal(receiver.take(6)[0], _step_tensors(6, 2)[0])  # kept for its step
        h = torch.ones(17, HIDDEN)  # more rows than the ring's slots: this step fails, in order
        sender.send(7, h, h)
        with pytest.raises(StepFailed, match="does not fit"):
            receiver.take(7)
    finally:
        sender.close()
        receiver.close()


def test_an_ipc_take_fails_at_once_when_the_sender_is_gone_or_the_link_closes():
    import threading

    receiver, sender, _ = _open_ipc_link(timeout=30.0)
    sender.close()  # its process died: end of file on the doorbell
    start = time.monotonic()
    with pytest.raises(StepFailed, match="gone|closed"):
        receiver.take(1)
    assert time.monotonic() - start < 5
    receiver.close()

    receiver, sender, _ = _open_ipc_link(timeout=30.0)
    errors = []

    def wait():
        try:
            receiver.take(1)
        except StepFailed as e:
            errors.append(str(e))

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)
    receiver.close()  # a new InitCache closes the link under the waiting step thread
    waiting.join(5)
    sender.close()
    assert not waiting.is_alive() and errors and "closed" in errors[0]


def test_an_ipc_link_leaves_nothing_in_dev_shm_and_a_dead_owners_files_are_swept():
    import os
    import subprocess

    def ours():
        return {n for n in os.listdir("/dev/shm") if n.startswith(("strata-ring-", "strata-link-"))}

    before = ours()
    receiver, sender, _ = _open_ipc_link()
    sender.send(1, *_step_tensors(1, 2))
    receiver.take(1)
    assert ours() == before  # the sender unlinked the ring once mapped, the receiver its socket once accepted
    sender.close()
    receiver.close()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/strata-ring-{dead.pid}-0123456789abcdef"
    open(stale, "wb").close()
    receiver, sender, _ = _open_ipc_link()  # a new ring sweeps what dead processes left
    sender.close()
    receiver.close()
    assert not os.path.exists(stale)


def test_an_ipc_take_has_a_deadline():
    receiver, sender, _ = _open_ipc_link(timeout=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(StepFailed, match="in 0 s|in 1 s"):
            receiver.take(1)
        assert time.monotonic() - start < 5
    finally:
        sender.close()
        receiver.close()


# ------------------------------------------------------------------ through the real services


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=5, layers=3)


def _describe(cluster):
    return worker_calls(cluster, "Describe", engine_pb2.DescribeRequest())


PROMPTS = [[5, 17, 42, 99, 3], [7] * 12, list(range(20, 61)), [300, 2, 250]]
LENGTHS = [12, 6, 20, 9]


def _greedy(client):
    return [
        collect(
            client.generate(
                p, max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=300
            )
        )[0]
        for p, n in zip(PROMPTS, LENGTHS)
    ]


def _sampled(client):
    """Seeded, filtered and n > 1 requests, run concurrently (their batches mix)."""
    from concurrent.futures import ThreadPoolExecutor

    kws = [
        dict(temperature=0.9, top_p=0.9, seed=11),
        dict(temperature=0.7, top_k=20, seed=12, n=3),
        dict(temperature=1.2, min_p=0.05, seed=13, n=2),
    ]

    def one(i):
        return collect(
            client.generate(
                PROMPTS[i],
                max_tokens=16,
                ignore_eos=True,
                output_kind=generate_pb2.DELTA,
                timeout=300,
                **kws[i],
            )
        )

    with ThreadPoolExecutor(len(kws)) as pool:
        return list(pool.map(one, range(len(kws))))


@pytest.mark.parametrize(
    "transport",
    [
        "grpc",
        "distributed",
        # ipc is auto's choice on CPUs of one host: 3 stages of it are tests/test_e2e_greedy.py's
        # qwen2-3 (greedy equal to HF), and the auto test below reads ipc in Describe.
        pytest.param("ipc", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "stages",
    [
        # Behind the slow marker (STRATA_SLOW_TESTS=1): with 3 stages each transport carries the
        # first stage's sends and the last stage's receives as with 2, and a middle stage's both.
        pytest.param(2, marks=pytest.mark.slow),
        3,
    ],
)
def test_greedy_through_stages_equals_hf_on_every_cpu_transport(model_dir, transport, stages):
    expected = hf_greedy(model_dir, PROMPTS, LENGTHS)
    with running_cluster(model_dir, stages, "--stage-transport", transport, "--max-num-batched-tokens", "32") as (
        cluster,
        client,
    ):
        got = _greedy(client)
        descriptions = _describe(cluster)
    assert got == expected
    want = {"grpc": GRPC, "distributed": DISTRIBUTED, "ipc": IPC}[transport]
    assert [d.next_stage_transport for d in descriptions] == [want] * (stages - 1) + [0]
    assert [d.previous_stage_transport for d in descriptions] == [0] + [want] * (stages - 1)


def test_auto_on_cpus_of_one_host_is_ipc_and_seeded_sampling_and_n_match_one_stage(model_dir):
    with running_cluster(model_dir, 1) as (_, client):
        alone = _sampled(client)
    with running_cluster(model_dir, 2) as (cluster, client):  # --stage-transport auto
        piped = _sampled(client)
        descriptions = _describe(cluster)
    assert piped == alone
    assert [len(out) for out in piped] == [1, 3, 2]
    assert descriptions[0].next_stage_transport == IPC
    assert descriptions[1].previous_stage_transport == IPC
    assert descriptions[0].location.hostname == descriptions[1].location.hostname


def test_a_lost_peer_keeps_its_kind_across_a_middle_stage():
    """Errors cross the links as strings: a step failed by a lost peer stays PeerLost downstream
    (the last stage reports StepResult.peer_lost, and the scheduler rebuilds instead of failing)."""
    from strata.services.worker.transport.stage_transport import PeerLost, StepFailed

    lost = StepFailed.upstream(str(PeerLost("stage transport (ipc): link closed")))
    assert isinstance(lost, PeerLost) and str(lost) == "peer stage lost: stage transport (ipc): link closed"
    assert type(StepFailed.upstream("stage 0: ValueError: bad plan")) is StepFailed
