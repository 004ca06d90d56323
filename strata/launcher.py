"""`strata serve`: scheduler, one worker per stage and the gateway as separate local processes; with
--data-parallel-size D, D such pipelines (a scheduler and its workers each) behind the one gateway."""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from strata.flags import BATCH_FLAGS, ENGINE_FLAGS, GATEWAY_FLAGS, SPECULATIVE_FLAGS, WORKER_FLAGS, argv_for
from strata.grpc_util import check_health
from strata.model_source import resolve_model
from strata.stage_links import NCCL_ENVIRONMENT, gpu_for
from strata.supervision import Supervisor
from strata.v1 import generate_pb2

# Set by the launcher in each service it starts: the launcher's pid.
PARENT_ENV = "STRATA_LAUNCHER_PID"


def die_with_launcher() -> None:
    """In a service the launcher started (`strata.cli` calls it first): the kernel sends it
    SIGTERM when the launcher dies, however it dies (SIGKILL included), so no service outlives
    `strata serve`. Done here, not between fork and exec (preexec_fn): a child forked from a
    process with gRPC threads (a test run, `strata bench`) could abort there."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the launcher died before the line above took effect
        sys.exit(1)


class Stopped(Exception):
    """SIGTERM (or SIGINT) reached `strata serve`."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


GATEWAY_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_HANDED_OUT: set[int] = set()
# Ports handed out start here: above the well-known and the common registered ones.
_LOWEST_PORT = 20000


def free_port() -> int:
    """A port nothing listens on now, never the same one twice in this process. The services
    bind their ports later, and until then the OS may offer a port again: a test cluster's worker
    got the gateway's port, and the gateway's health probe found the worker there (the client then
    got UNIMPLEMENTED). Below the OS's ephemeral range where it has one: a port from that range can
    be taken in the meantime as the source port of any outgoing connection (a TP2 rank's rendezvous
    store on two H200s failed to listen so: EADDRINUSE)."""
    below = _ephemeral_range_start()
    for attempt in itertools.count():
        # (the OS's choice after many misses: a process that has handed out most of the range)
        low = below > _LOWEST_PORT and attempt < 1000
        port = secrets.randbelow(below - _LOWEST_PORT) + _LOWEST_PORT if low else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: another
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@functools.cache
def _ephemeral_range_start() -> int:
    """The first port of the OS's range for outgoing connections' source ports (Linux), or 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class ReplicaAddresses:
    """One data-parallel replica of a local cluster: its scheduler and its workers, in stage order."""

    scheduler: str
    workers: list[str] = field(default_factory=list)  # rank 0 of each stage
    # Every rank of each stage, in rank order (tensor parallelism; one each without it).
    ranks: list[list[str]] = field(default_factory=list)


class Cluster:
    """Child processes of one local cluster; stops them all, in reverse order, on exit."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.gateway_address = ""
        self.http_address = ""  # the OpenAI-compatible HTTP front, when on
        # Every internal RPC carries it: $STRATA_CLUSTER_TOKEN, or a fresh one for this cluster.
        self.cluster_token = os.environ.get("STRATA_CLUSTER_TOKEN") or secrets.token_hex(16)
        self.replicas: list[ReplicaAddresses] = []  # one per data-parallel replica
        self.scheduler_address = ""  # the first replica's (the only one's without data parallelism)
        self.worker_addresses: list[str] = []  # the first replica's (rank 0 of each stage)
        self.rank_addresses: list[list[str]] = []  # the first replica's, every rank of each stage
        self.env: dict[str, str] = {}  # for every service (an MPS daemon's folders)
        self.mps = None  # the cluster's own MpsDaemon (--mps), stopped after the services

    def start(self, name: str, argv: list[str], module: str = "strata.cli") -> None:
        self.procs.append((name, subprocess.Popen([sys.executable, "-m", module, *argv], env=self.service_env())))

    def service_env(self) -> dict[str, str]:
        """The environment of every service of this cluster: its token, this process as the
        launcher it dies with, and NVLink multicast off."""
        return {
            **NCCL_ENVIRONMENT,  # NVLink multicast off in every process (explicit settings win)
            **os.environ,
            **self.env,
            "STRATA_CLUSTER_TOKEN": self.cluster_token,
            PARENT_ENV: str(os.getpid()),
        }

    def wait_healthy(self, address: str, name: str, timeout: float, service: str = "") -> None:
        """service: the gRPC service that must be SERVING there (another server on the port would
        answer the overall health too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pname, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{pname} exited with code {proc.returncode} during start-up")
            if check_health(address, timeout=1.0, service=service):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{name} at {address} not healthy after {timeout:.0f}s")

    def wait_replicas_up(self, api_key: str | None, timeout: float) -> None:
        """The gateway serves once one replica is up: the cluster is ready once it sees them all."""
        import grpc

        from strata.v1 import generate_pb2_grpc

        metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.gateway_address) as channel:
            stub = generate_pb2_grpc.GatewayStub(channel)
            while time.monotonic() < deadline:
                info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10, metadata=metadata)
                if all(r.up for r in info.replicas):
                    return
                for pname, proc in self.procs:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{pname} exited with code {proc.returncode} during start-up")
                time.sleep(0.3)
        raise TimeoutError(f"not every replica up after {timeout:.0f}s")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to each child in reverse start order, each once the one before it has exited:
        a client (the gateway, then the scheduler) ends its streams before the server under it
        stops. Signalled together, a worker could stop first and abort the scheduler's Steps
        stream (grpc logs each abort). Past the deadline, SIGKILL."""
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.mps is not None:
            self.mps.stop()
            self.mps = None


_WORKER_ARGV = (
    "host",
    "port",
    "model",
    "stage_index",
    "num_stages",
    "tensor_parallel_size",
    "tensor_parallel_rank",
    "tensor_parallel_master",
    "tokenizer",
    *WORKER_FLAGS,
)


def worker_argv(
    args, stage: int, port: int, model: str, replica: int = 0, rank: int = 0, master: str | None = None
) -> list[str]:
    """`strata worker` arguments of one stage (of one replica; its rank `rank`, whose stage's rank 0
    hosts the store at `master`) of the cluster `strata serve` args describe."""
    return [
        "worker",
        *argv_for(_worker_settings(args, stage, port, model, replica, rank, master), _WORKER_ARGV),
        *speculation_argv(args, None),
    ]


def _replicas(args) -> int:
    return getattr(args, "data_parallel_size", 1)


def _tensor_parallel_size(args) -> int:
    return getattr(args, "tensor_parallel_size", 1)


def _visible_gpus(args) -> int:
    """GPUs the workers are placed on: those visible, unless --device says CPU or names one."""
    if args.device not in ("cuda", "auto"):
        return 0
    import torch

    return torch.cuda.device_count()


def check_placement(args) -> None:
    """Data-parallel replicas each need GPUs of their own (replicas sharing one would only take
    turns on it), and so does every tensor-parallel rank (NCCL pairs no two ranks on one GPU): a
    GPU per rank of every stage of every replica, or all on CPUs. Ranks whose collectives go
    through gloo may share GPUs (one GPU checks a tensor-parallel stage so)."""
    size = _tensor_parallel_size(args)
    replicas, workers = _replicas(args), _replicas(args) * args.pipeline_stages * size
    if replicas < 1 or args.pipeline_stages < 1 or size < 1:
        raise SystemExit("--pipeline-stages, --tensor-parallel-size and --data-parallel-size must be at least 1")
    if size > 1:
        check_tensor_parallel_placement(args, workers)
    if replicas == 1:
        return
    if args.mps:
        raise SystemExit("--mps is for stages sharing one GPU, not for data-parallel replicas (a GPU each)")
    if args.device.startswith("cuda") and ":" in args.device:
        raise SystemExit(
            f"--device {args.device} names one GPU; --data-parallel-size {replicas} needs {workers}: use --device cuda"
        )
    gpus = _visible_gpus(args)
    if gpus and gpus < workers:
        raise SystemExit(
            f"--data-parallel-size {replicas} x --pipeline-stages {args.pipeline_stages} needs {workers} GPUs; {gpus} visible"
        )


def check_tensor_parallel_placement(args, workers: int) -> None:
    size = _tensor_parallel_size(args)
    if args.mps:
        raise SystemExit("--mps is for stages sharing one GPU; tensor-parallel ranks take a GPU each")
    if args.speculative_method == "draft" or args.draft_model:
        raise SystemExit("a draft model's worker serves a one-rank target: --tensor-parallel-size 1")
    if _ranks_share_gpus(args):
        return
    if args.device.startswith("cuda") and ":" in args.device:
        raise SystemExit(f"--device {args.device} names one GPU; --tensor-parallel-size {size} needs a GPU per rank")
    gpus = _visible_gpus(args)
    if gpus and gpus < workers:
        raise SystemExit(
            f"--tensor-parallel-size {size} x --pipeline-stages {args.pipeline_stages} x --data-parallel-size "
            f"{_replicas(args)} needs {workers} GPUs; {gpus} visible"
        )


def _ranks_share_gpus(args) -> bool:
    return getattr(args, "tensor_parallel_all_reduce", "nccl") == "gloo"


def _worker_settings(
    args, stage: int, port: int, model: str, replica: int = 0, rank: int = 0, master: str | None = None
) -> dict:
    settings = {**vars(args), "host": "127.0.0.1", "port": port, "model": model, "stage_index": stage}
    stages = settings["num_stages"] = args.pipeline_stages
    size = settings["tensor_parallel_size"] = _tensor_parallel_size(args)
    settings.update(tensor_parallel_rank=rank, tensor_parallel_master=master)
    workers = stages * _replicas(args) * size
    if size > 1:
        gpus = _visible_gpus(args)
        if args.device.startswith("cuda") and ":" in args.device:  # (gloo's ranks: all on the GPU named)
            settings["gpu_memory_utilization"] = args.gpu_memory_utilization / workers
        elif gpus:  # rank t of stage i of replica r on a GPU of its own, or round-robin with gloo's
            settings["device"] = f"cuda:{gpu_for(replica, stage, rank, stages, size) % gpus}"
            settings["gpu_memory_utilization"] = args.gpu_memory_utilization / -(-workers // gpus)
    elif stages > 1 and args.device.startswith("cuda") and ":" in args.device:
        # Every stage on the one GPU named: they split its memory share (each sizes its KV cache
        # from the free memory it measures, and the first would take what the others need).
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization / stages
    elif workers > 1 and (gpus := _visible_gpus(args)):
        # Stage i of replica r on GPU r x stages + i; with fewer GPUs than stages (one replica),
        # round-robin, those sharing one splitting its memory share.
        settings["device"] = f"cuda:{gpu_for(replica, stage, num_stages=stages) % gpus}"
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization / -(-workers // gpus)
    if settings.get("profile_output") and workers > 1:  # one file per worker
        replica_part = f".replica{replica}" if _replicas(args) > 1 else ""
        stage_part = f".stage{stage}" if stages > 1 else ""
        rank_part = f".rank{rank}" if size > 1 else ""
        settings["profile_output"] = f"{args.profile_output}{replica_part}{stage_part}{rank_part}"
    return settings


# A draft worker shares stage 0's GPU: it gets this part of the memory share (its KV pool needs
# as many blocks as the target's, at a fraction of the bytes per block).
DRAFT_MEMORY_SHARE = 0.2


def draft_model_of(args, target_model: str) -> str | None:
    """The draft worker's --model, or None when speculation uses no draft model."""
    if args.draft_model:
        return args.draft_model
    if args.speculative_method == "draft":
        if not args.draft_num_layers:
            raise SystemExit("--speculative-method draft needs --draft-model DIR or --draft-num-layers N")
        return target_model
    return None


def draft_worker_argv(args, port: int, model: str, replica: int = 0) -> list[str]:
    """The draft worker's arguments: stage 0's, as the whole (one-stage) draft model."""
    settings = _worker_settings(args, 0, port, model, replica)
    settings.update(num_stages=1, role="draft")
    settings["gpu_memory_utilization"] *= DRAFT_MEMORY_SHARE
    names = (*_WORKER_ARGV, "role")
    if not args.draft_model:  # the target's own first layers
        names += ("draft_num_layers",)
    return ["worker", *argv_for(settings, names), *speculation_argv(args, None)]


def speculation_argv(args, draft_address: str | None) -> list[str]:
    """The scheduler's speculative-decoding flags."""
    method = "draft" if args.draft_model else args.speculative_method
    if not method:
        return []
    settings = {**vars(args), "speculative_method": method, "draft_worker": draft_address}
    return argv_for(settings, (*SPECULATIVE_FLAGS, "draft_worker"))


def start_cluster(args, startup_timeout: float = 600.0) -> Cluster:
    check_placement(args)
    model_path, dummy = resolve_model(args.model)
    model = model_path or f"dummy:{dummy}"
    cluster = Cluster()
    try:
        if args.mps:
            start_mps(cluster, args)
        for replica in range(_replicas(args)):
            cluster.replicas.append(start_replica(cluster, args, model, replica))
        cluster.worker_addresses = cluster.replicas[0].workers
        cluster.rank_addresses = cluster.replicas[0].ranks
        cluster.scheduler_address = cluster.replicas[0].scheduler
        schedulers = ",".join(r.scheduler for r in cluster.replicas)
        gateway = {**vars(args), "scheduler_address": schedulers, "model": model_path or ""}
        names = ("host", "port", "http_port", "scheduler_address", "model", *GATEWAY_FLAGS)
        gateway_argv = ["gateway", *argv_for(gateway, names)]
        cluster.start("gateway", gateway_argv)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        cluster.gateway_address = f"{host}:{args.port}"
        cluster.http_address = f"http://{host}:{args.http_port}" if args.http_port else ""
        if not args.tls_cert:
            cluster.wait_healthy(cluster.gateway_address, "gateway", startup_timeout, service=GATEWAY_SERVICE)
            if len(cluster.replicas) > 1:
                cluster.wait_replicas_up(args.api_key, startup_timeout)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def start_replica(cluster: Cluster, args, model: str, replica: int) -> ReplicaAddresses:
    """Starts one replica's workers (and draft worker) and its scheduler."""
    prefix = f"replica {replica} " if _replicas(args) > 1 else ""  # one replica: "worker 0", "scheduler"
    worker_addresses, rank_addresses = [], []
    draft = draft_model_of(args, model)
    share = args.gpu_memory_utilization
    if draft:  # the target's stages keep the rest of the share
        args.gpu_memory_utilization = share * (1 - DRAFT_MEMORY_SHARE)
    size = _tensor_parallel_size(args)
    try:
        for stage in range(args.pipeline_stages):
            # Tensor parallelism: the stage's ranks find each other at its rank 0's store.
            master = f"127.0.0.1:{free_port()}" if size > 1 else None
            ranks = []
            for rank in range(size):
                port = free_port()
                ranks.append(f"127.0.0.1:{port}")
                name = f"{prefix}worker {stage}" + (f" rank {rank}" if size > 1 else "")
                cluster.start(name, worker_argv(args, stage, port, model, replica, rank, master))
            worker_addresses.append(ranks[0])
            rank_addresses.append(ranks)
    finally:
        args.gpu_memory_utilization = share
    draft_address = None
    if draft:
        port = free_port()
        draft_address = f"127.0.0.1:{port}"
        cluster.start(f"{prefix}draft worker", draft_worker_argv(args, port, draft, replica))
    sched_port = free_port()
    sched = {**vars(args), "host": "127.0.0.1", "port": sched_port, "workers": ",".join(worker_addresses)}
    if args.metrics_port:  # one port each
        sched["metrics_port"] = args.metrics_port + replica
    sched_argv = [
        "scheduler",
        *argv_for(sched, ("host", "port", "workers", *BATCH_FLAGS, *ENGINE_FLAGS)),
        *speculation_argv(args, draft_address),
    ]
    cluster.start(f"{prefix}scheduler", sched_argv)
    return ReplicaAddresses(f"127.0.0.1:{sched_port}", worker_addresses, rank_addresses)


def start_mps(cluster: Cluster, args) -> None:
    """The cluster's own MPS daemon, which its services find through cluster.env (strata/mps.py)."""
    from strata.mps import MpsDaemon

    if args.device.startswith("cpu"):
        raise SystemExit("--mps is for stages sharing an NVIDIA GPU, not --device cpu")
    cluster.mps = MpsDaemon()
    cluster.mps.start()
    cluster.env.update(cluster.mps.env)


def serve(args) -> int:
    """Runs the cluster until SIGTERM or SIGINT, then stops every child. A worker or scheduler that
    exits is started again (strata/supervision.py); the gateway exiting, or a service that keeps
    exiting, stops the cluster."""
    for port in (args.port, args.http_port):
        if port and port_in_use(args.host, port):
            print(f"strata serve: port {port} on {args.host} is in use", file=sys.stderr)
            return 1
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)
    cluster = None
    try:
        cluster = start_cluster(args)
        http = f", OpenAI-compatible HTTP on http://{args.host}:{args.http_port}/v1" if args.http_port else ""
        replicas = f"{_replicas(args)} replicas of " if _replicas(args) > 1 else ""
        ranks = f" of {_tensor_parallel_size(args)} ranks each" if _tensor_parallel_size(args) > 1 else ""
        print(
            f"Strata is serving gRPC on {args.host}:{args.port}{http} ({replicas}{args.pipeline_stages} stage(s){ranks}). "
            "Ctrl-C stops it.",
            flush=True,
        )
        supervisor = Supervisor(cluster, args.restart_limit)
        while (reason := supervisor.check()) is None:
            for line in supervisor.log:
                print(f"strata serve: {line}", file=sys.stderr, flush=True)
            supervisor.log.clear()
            time.sleep(0.5)
        print(f"{reason}; stopping the cluster", file=sys.stderr)
        return 1
    except Stopped:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second signal during the stop kills at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if cluster is not None:
            cluster.stop()
