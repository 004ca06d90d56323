"""Stage links: what the scheduler and the workers both need to know about the links between
pipeline stages, with no torch at import time.

A link carries one direction between two stages: activations from stage i to stage i + 1, the
last stage's sampled tokens back to stage 0 (pipelined decode), or a draft worker's proposals to
the one target stage. Each worker describes where it runs (`local_location`, in its Describe);
the scheduler picks each link's transport from the two ends' locations (`choose_transport`) when
it builds the pipeline, and the workers open their ends of it (services/worker/transport/).

- `grpc`: the bytes ride the gRPC messages, through both hosts (A/B runs, the last fallback);
- `ipc`: one host and IPC namespace (one GPU or peer GPUs by CUDA IPC, or CPU stages through
  /dev/shm);
- `distributed`: torch.distributed send/recv (NCCL between GPUs, gloo between CPUs), any hosts.
"""

from __future__ import annotations

import os
import socket

from strata.mps import mps_serves_this_process
from strata.v1 import engine_pb2

GRPC = engine_pb2.STAGE_TRANSPORT_GRPC
IPC = engine_pb2.STAGE_TRANSPORT_IPC
DISTRIBUTED = engine_pb2.STAGE_TRANSPORT_DISTRIBUTED
NAMES = {"grpc": GRPC, "ipc": IPC, "distributed": DISTRIBUTED}
CHOICES = ("auto", *NAMES)


# Set in every process Strata starts (strata/launcher.py) and in every worker before
# torch.distributed or NCCL start: NVLink multicast (NVLS) stays off.
NCCL_ENVIRONMENT = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # A collective past its timeout aborts its communicator and fails its work, not the process:
    # the scheduler rebuilds the pipeline (a new InitCache) around a lost peer.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def set_nccl_environment() -> None:
    """At worker start, before torch.distributed or NCCL read them (explicit settings win)."""
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def name_of(kind: int) -> str:
    return {v: k for k, v in NAMES.items()}.get(kind, "none")


class TransportError(Exception):
    """A link cannot be opened as asked."""


# ------------------------------------------------------------------ where a worker runs


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def local_location(device) -> engine_pb2.WorkerLocation:
    """This process's host, boot, IPC namespace and CUDA devices, for the scheduler's choice."""
    try:
        ipc_namespace = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc_namespace = ""
    loc = engine_pb2.WorkerLocation(
        hostname=socket.gethostname(), boot_id=_read("/proc/sys/kernel/random/boot_id"), ipc_namespace=ipc_namespace
    )
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        loc.visible_device_uuids.extend(
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        )
        loc.device_uuid = str(torch.cuda.get_device_properties(device).uuid)
        loc.mps = mps_serves_this_process()
    return loc


def same_ipc_domain(a: engine_pb2.WorkerLocation, b: engine_pb2.WorkerLocation) -> bool:
    """One host, one boot and one IPC namespace: CUDA IPC handles of one open in the other."""
    return bool(a.hostname and a.boot_id and a.ipc_namespace) and (
        (a.hostname, a.boot_id, a.ipc_namespace) == (b.hostname, b.boot_id, b.ipc_namespace)
    )


def host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


# ------------------------------------------------------------------ the scheduler's choice


def choose_transport(
    sender: engine_pb2.WorkerDescription, receiver: engine_pb2.WorkerDescription, requested: str = "auto"
) -> int:
    """The transport of the link sender -> receiver. `auto`: ipc where the sender can open the
    receiver's ring (one host and IPC namespace; on CUDA, the receiver's GPU visible to the
    sender; or both on CPUs, through /dev/shm), else torch.distributed (NCCL between GPUs, gloo
    between CPUs)."""
    both_cuda = sender.device.startswith("cuda") and receiver.device.startswith("cuda")
    both_cpu = sender.device.startswith("cpu") and receiver.device.startswith("cpu")
    same_domain = same_ipc_domain(sender.location, receiver.location)
    ipc_ok = same_domain and (
        both_cpu or (both_cuda and receiver.location.device_uuid in sender.location.visible_device_uuids)
    )
    if requested == "auto":
        return IPC if ipc_ok else DISTRIBUTED
    if requested not in NAMES:
        raise TransportError(f"unknown stage transport {requested!r}: one of {', '.join(CHOICES)}")
    if requested == "ipc" and not ipc_ok:
        raise TransportError(
            "--stage-transport ipc needs both stages in one host and IPC namespace, both on CPUs or both on CUDA "
            f"with the receiver's GPU visible to the sender ({sender.device} on {sender.location.hostname}, {receiver.device} on "
            f"{receiver.location.hostname})"
        )
    if requested == "distributed" and both_cuda and same_ipc_domain(sender.location, receiver.location):
        if sender.location.device_uuid == receiver.location.device_uuid:
            raise TransportError("--stage-transport distributed: NCCL cannot pair two stages on one GPU (use ipc)")
    return NAMES[requested]


def gpus_shared_without_mps(stages: list[engine_pb2.WorkerDescription]) -> list[list[int]]:
    """The stages that share one GPU (one host, one device) while some of them run without an
    MPS server, as lists of stage indices: each hand-off between them then waits for the GPU
    to switch processes (strata/mps.py)."""
    by_gpu: dict[tuple, list[int]] = {}
    for i, d in enumerate(stages):
        loc = d.location
        if d.device.startswith("cuda") and loc.device_uuid:
            by_gpu.setdefault((loc.hostname, loc.boot_id, loc.device_uuid), []).append(i)
    return [idx for idx in by_gpu.values() if len(idx) > 1 and not all(stages[i].location.mps for i in idx)]


# ------------------------------------------------------------------ placement


def gpu_for(replica: int, stage: int, rank: int = 0, num_stages: int = 1, tensor_parallel_size: int = 1) -> int:
    """The GPU (index among the visible ones) of rank `rank` of stage `stage` of data-parallel
    replica `replica`: replicas one after another, each its stages in order, each stage's ranks
    side by side (NVLink neighbours where not every pair of GPUs is linked)."""
    return (replica * num_stages + stage) * tensor_parallel_size + rank
