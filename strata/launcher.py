"""`strata serve`: scheduler, one worker per stage and the gateway as separate local processes."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from strata.flags import BATCH_FLAGS, ENGINE_FLAGS, GATEWAY_FLAGS, SPECULATIVE_FLAGS, WORKER_FLAGS, argv_for
from strata.grpc_util import check_health
from strata.model_source import resolve_model
from strata.stage_links import NCCL_ENVIRONMENT, gpu_for
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


def free_port() -> int:
    """A port nothing listens on now, never the same one twice in this process. The services
    bind their ports later, and until then the OS may offer a port again: a test cluster's worker
    got the gateway's port, and the gateway's health probe found the worker there (the client then
    got UNIMPLEMENTED)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class Cluster:
    """Child processes of one local cluster; stops them all, in reverse order, on exit."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.gateway_address = ""
        self.http_address = ""  # the OpenAI-compatible HTTP front, when on
        # Every internal RPC carries it: $STRATA_CLUSTER_TOKEN, or a fresh one for this cluster.
        self.cluster_token = os.environ.get("STRATA_CLUSTER_TOKEN") or secrets.token_hex(16)
        self.scheduler_address = ""
        self.worker_addresses: list[str] = []  # rank 0 of each stage, in stage order
        # Every rank of each stage (tensor parallelism; one each without it), in rank order.
        self.rank_addresses: list[list[str]] = []
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

    def stop(self, timeout: float = 10.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
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


def worker_argv(args, stage: int, port: int, model: str, rank: int = 0, master: str | None = None) -> list[str]:
    """`strata worker` arguments of one stage (of its rank `rank`, whose stage's rank 0 hosts the
    store at `master`) of the cluster `strata serve` args describe."""
    return [
        "worker",
        *argv_for(_worker_settings(args, stage, port, model, rank, master), _WORKER_ARGV),
        *speculation_argv(args, None),
    ]


def _tensor_parallel_size(args) -> int:
    return getattr(args, "tensor_parallel_size", 1)


def check_tensor_parallel_placement(args) -> None:
    """Tensor-parallel ranks each need a GPU of their own (NCCL pairs no two ranks on one GPU):
    a GPU per rank of every stage, or all on CPUs."""
    size, stages = _tensor_parallel_size(args), args.pipeline_stages
    if size < 1:
        raise SystemExit("--tensor-parallel-size must be at least 1")
    if size == 1:
        return
    if args.mps:
        raise SystemExit("--mps is for stages sharing one GPU; tensor-parallel ranks take a GPU each")
    if args.speculative_method == "draft" or args.draft_model:
        raise SystemExit("a draft model's worker serves a one-rank target: --tensor-parallel-size 1")
    if args.device.startswith("cuda") and ":" in args.device:
        raise SystemExit(f"--device {args.device} names one GPU; --tensor-parallel-size {size} needs a GPU per rank")
    if args.device in ("cuda", "auto"):
        import torch

        gpus = torch.cuda.device_count()
        if gpus and gpus < size * stages:
            raise SystemExit(
                f"--tensor-parallel-size {size} x --pipeline-stages {stages} needs {size * stages} GPUs; {gpus} visible"
            )


def _worker_settings(args, stage: int, port: int, model: str, rank: int = 0, master: str | None = None) -> dict:
    settings = {**vars(args), "host": "127.0.0.1", "port": port, "model": model, "stage_index": stage}
    settings["num_stages"] = args.pipeline_stages
    size = settings["tensor_parallel_size"] = _tensor_parallel_size(args)
    settings.update(tensor_parallel_rank=rank, tensor_parallel_master=master)
    if size > 1 and args.device in ("cuda", "auto"):
        import torch

        if torch.cuda.device_count():  # a GPU per rank (check_tensor_parallel_placement)
            settings["device"] = f"cuda:{gpu_for(0, stage, rank, args.pipeline_stages, size)}"
    elif args.pipeline_stages > 1 and args.device.startswith("cuda") and ":" in args.device:
        # Every stage on the one GPU named: they split its memory share (each sizes its KV cache
        # from the free memory it measures, and the first would take what the others need).
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization / args.pipeline_stages
    elif args.device in ("cuda", "auto") and args.pipeline_stages > 1:
        import torch

        gpus = torch.cuda.device_count()
        if gpus:
            # Stages round-robin over the GPUs; those sharing one split its memory share.
            settings["device"] = f"cuda:{stage % gpus}"
            per_gpu = -(-args.pipeline_stages // gpus)
            settings["gpu_memory_utilization"] = args.gpu_memory_utilization / per_gpu
    if settings.get("profile_output") and args.pipeline_stages > 1:  # one file per stage
        settings["profile_output"] = f"{args.profile_output}.stage{stage}"
    if settings.get("profile_output") and size > 1:  # and rank
        settings["profile_output"] = f"{settings['profile_output']}.rank{rank}"
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


def draft_worker_argv(args, port: int, model: str) -> list[str]:
    """The draft worker's arguments: stage 0's, as the whole (one-stage) draft model."""
    settings = _worker_settings(args, 0, port, model)
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
    if args.pipeline_stages < 1:
        raise SystemExit("--pipeline-stages must be at least 1")
    check_tensor_parallel_placement(args)
    model_path, dummy = resolve_model(args.model)
    model = model_path or f"dummy:{dummy}"
    cluster = Cluster()
    try:
        if args.mps:
            start_mps(cluster, args)
        worker_addresses = []
        draft = draft_model_of(args, model)
        share = args.gpu_memory_utilization
        if draft:  # the target's stages keep the rest of the share
            args.gpu_memory_utilization = share * (1 - DRAFT_MEMORY_SHARE)
        size = _tensor_parallel_size(args)
        for stage in range(args.pipeline_stages):
            # Tensor parallelism: the stage's ranks find each other at its rank 0's store.
            master = f"127.0.0.1:{free_port()}" if size > 1 else None
            ranks = []
            for rank in range(size):
                port = free_port()
                ranks.append(f"127.0.0.1:{port}")
                name = f"worker {stage}" + (f" rank {rank}" if size > 1 else "")
                cluster.start(name, worker_argv(args, stage, port, model, rank, master))
            worker_addresses.append(ranks[0])
            cluster.rank_addresses.append(ranks)
        args.gpu_memory_utilization = share
        draft_address = None
        if draft:
            port = free_port()
            draft_address = f"127.0.0.1:{port}"
            cluster.start("draft worker", draft_worker_argv(args, port, draft))
        sched_port = free_port()
        sched = {**vars(args), "host": "127.0.0.1", "port": sched_port, "workers": ",".join(worker_addresses)}
        sched_argv = [
            "scheduler",
            *argv_for(sched, ("host", "port", "workers", *BATCH_FLAGS, *ENGINE_FLAGS)),
            *speculation_argv(args, draft_address),
        ]
        cluster.start("scheduler", sched_argv)
        cluster.worker_addresses = worker_addresses
        cluster.scheduler_address = f"127.0.0.1:{sched_port}"
        gateway = {**vars(args), "scheduler_address": f"127.0.0.1:{sched_port}", "model": model_path or ""}
        names = ("host", "port", "http_port", "scheduler_address", "model", *GATEWAY_FLAGS)
        gateway_argv = ["gateway", *argv_for(gateway, names)]
        cluster.start("gateway", gateway_argv)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        cluster.gateway_address = f"{host}:{args.port}"
        cluster.http_address = f"http://{host}:{args.http_port}" if args.http_port else ""
        if not args.tls_cert:
            cluster.wait_healthy(cluster.gateway_address, "gateway", startup_timeout, service=GATEWAY_SERVICE)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def start_mps(cluster: Cluster, args) -> None:
    """The cluster's own MPS daemon, which its services find through cluster.env (strata/mps.py)."""
    from strata.mps import MpsDaemon

    if args.device.startswith("cpu"):
        raise SystemExit("--mps is for stages sharing an NVIDIA GPU, not --device cpu")
    cluster.mps = MpsDaemon()
    cluster.mps.start()
    cluster.env.update(cluster.mps.env)


def serve(args) -> int:
    """Runs the cluster until SIGTERM or SIGINT (or a service exits), then stops every child."""
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
        ranks = f" of {_tensor_parallel_size(args)} ranks each" if _tensor_parallel_size(args) > 1 else ""
        print(
            f"Strata is serving gRPC on {args.host}:{args.port}{http} ({args.pipeline_stages} stage(s){ranks}). "
            "Ctrl-C stops it.",
            flush=True,
        )
        while all(proc.poll() is None for _, proc in cluster.procs):
            time.sleep(0.5)
        failed = [name for name, proc in cluster.procs if proc.poll() is not None]
        print(f"{', '.join(failed)} exited; stopping the cluster", file=sys.stderr)
        return 1
    except Stopped:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second signal during the stop kills at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if cluster is not None:
            cluster.stop()
