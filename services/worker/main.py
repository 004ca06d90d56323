"""`strata worker`: load this stage's layers, size the KV cache, serve the Worker service."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path

import torch

from strata.grpc_util import add_service, bind, new_server, set_serving, wait_for_termination_signal
from strata.model_source import resolve_model
from strata.quiet_exit import quiet_exit
from strata.services.worker.diagnostics.profiling import StepProfiler
from strata.services.worker.model.attention import kv_cache_bytes_per_block
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.weights import load_shard
from strata.services.worker.runner import ModelRunner, use_device
from strata.services.worker.server import WorkerServicer
from strata.services.worker.tensor_parallel.group import TensorParallelGroup
from strata.services.worker.tensor_parallel.plan_socket import PlanListener
from strata.services.worker.tensor_parallel.ranks import StageRanks
from strata.services.worker.tensor_parallel.rendezvous import split_address
from strata.stage_links import local_location, set_nccl_environment
from strata.v1 import engine_pb2, generate_pb2

log = logging.getLogger("strata.worker")
GiB = 1 << 30
# How long a thread that wants the GIL waits before it asks the holder to drop it (Python's
# default is fifty times this). The step thread gives the GIL up in each system call and torch
# call (the doorbell's send and recv, event waits, copies, graph launches) and wants it back at
# once, while the event loop and the result finisher run Python: a short interval gives it back
# sooner. This one beat a longer and a shorter interval in the A/B runs (bench/RESULTS.md, "The
# GIL switch interval").
GIL_SWITCH_SECONDS = 0.0001


def pick_device(name: str) -> torch.device:
    """--device as a torch device; a GPU always with its index ("cuda" is this process's current
    GPU): the worker binds each of its threads to it (runner.use_device), which takes an index."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda given but no CUDA device is available")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: this host has {torch.cuda.device_count()} GPU(s)")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def attention_backend_for(device: torch.device):
    if device.type == "cuda":
        from strata.services.worker.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from strata.services.worker.model.attention import TorchAttentionBackend

    return TorchAttentionBackend()


def num_kv_blocks_for(
    args, config: ModelConfig, num_layers: int, max_model_len: int, device: torch.device, dtype: torch.dtype
) -> int:
    if args.num_kv_blocks:
        return args.num_kv_blocks
    per_block = kv_cache_bytes_per_block(
        num_layers, args.block_size, config.num_key_value_heads, config.head_dim, dtype
    )
    # More blocks than the sequences that may run at once can use only hold cached prefixes: with
    # P stages, up to P + 1 micro-batches of max_num_seqs each (the scheduler's most by default).
    running = args.max_num_seqs * (args.num_stages + 1 if args.num_stages > 1 else 1)
    useful = running * -(-max_model_len // args.block_size)
    if device.type != "cuda":
        return max(1, min(useful, int(args.kv_cache_memory_gb * GiB) // per_block))
    free, total = torch.cuda.mem_get_info(device)
    # This worker's share of the GPU minus what it holds already (its weights): workers that
    # share a GPU each get a share (see the launcher) and size their caches before either
    # allocates, so the share, not the momentary free memory, decides.
    own = torch.cuda.memory_allocated(device)
    # What the step itself needs besides weights and cache: activations of the largest prefill
    # chunk (MLP intermediates dominate) and the logits of a full decode batch, plus slack.
    itemsize = torch.empty((), dtype=dtype).element_size()
    # The piecewise graphs keep a pool of their own for steps up to their largest size.
    tokens = args.max_num_batched_tokens + piecewise_max_tokens(args)
    mlp = 2 * config.intermediate_size
    if config.num_experts:  # the fused MoE's rows: k (intermediate + weighted output) a token, and the router's
        mlp = max(
            mlp, config.num_experts_per_tok * (config.moe_intermediate_size + config.hidden_size) + config.num_experts
        )
    activations = tokens * (mlp + 8 * config.hidden_size) * itemsize
    logits = args.max_num_seqs * config.vocab_size * 4 * 4
    available = min(args.gpu_memory_utilization * total - own, free)
    budget = available - activations - logits - GiB // 2
    if budget < per_block:
        raise SystemExit(f"no GPU memory left for the KV cache (free {free / GiB:.1f} GiB)")
    return int(budget // per_block)


def piecewise_max_tokens(args) -> int:
    return 0 if args.enforce_eager else max(0, min(args.piecewise_graph_max_tokens, args.max_num_batched_tokens))


def build(args):
    set_nccl_environment()
    device = pick_device(args.device)
    use_device(device)  # (the step threads set it too: server.py)
    dtype = pick_dtype(args.dtype, device)
    model_path, dummy = resolve_model(args.model)
    if not 0 <= args.stage_index < args.num_stages:
        raise SystemExit(f"--stage-index must be in [0, {args.num_stages})")
    draft = args.role == "draft"
    if draft and args.num_stages != 1:
        raise SystemExit("a draft worker holds the whole draft model: --num-stages 1")
    group = tensor_parallel_group(args, device)
    if draft and group.active:
        raise SystemExit("a draft worker is one process: --tensor-parallel-size 1")
    if group.active and group.host_collectives and device.type == "cuda" and not args.enforce_eager:
        # A graph cannot capture gloo's collectives (the host waits on them): every step eager.
        log.warning("--tensor-parallel-all-reduce gloo: CUDA graphs are off (as with --enforce-eager)")
        args.enforce_eager = True
    try:
        shard, config = load_shard(
            "dummy" if dummy else model_path,
            args.stage_index,
            args.num_stages,
            dtype,
            device,
            dummy_config=dummy,
            seed=args.seed,
            attn_backend=attention_backend_for(device),
            first_layers=args.draft_num_layers,
            tp=group,
        )
    except ValueError as e:  # (a model whose heads do not split into the ranks, among others)
        raise SystemExit(str(e)) from None
    max_model_len = args.max_model_len or config.max_position_embeddings
    speculate = bool(args.speculative_method)
    # A draft worker runs batches of speculating sequences only; a target captures verification
    # graphs for them as well as its decode graphs.
    graph_batch = min(args.speculative_max_batch if draft else args.max_num_seqs, 512)
    runner = ModelRunner(
        shard,
        config,
        stage_index=args.stage_index,
        num_stages=args.num_stages,
        block_size=args.block_size,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        # Live sequences: max_num_seqs per micro-batch, stages + 1 micro-batches with pipelined
        # decode (the scheduler's default), and released ones until the next plan says so.
        max_num_seqs=max(args.max_num_seqs * max(4, args.num_stages + 2), 1024),
        cuda_graph_max_batch=0 if args.enforce_eager else graph_batch,
        num_speculative_tokens=args.num_speculative_tokens if speculate and not draft else 0,
        speculative_max_batch=args.speculative_max_batch,
        piecewise_max_tokens=piecewise_max_tokens(args),
        tokenizer_dir=getattr(args, "tokenizer", None) or (None if dummy else model_path),
        # Drafts on this device: prompt lookup (the last stage proposes drafts after each draw),
        # or, on a one-stage target, a draft worker's, handed over the draft link (no lookup is
        # ever asked for then).
        ngram_on_device=(args.ngram_min, args.ngram_max)
        if not draft
        and (
            (args.speculative_method == "ngram" and args.ngram_proposer == "device")
            or (args.speculative_method == "draft" and args.num_stages == 1)
        )
        else None,
        gpu_clock_dir=args.gpu_clock_dir,
        tp=group,
    )
    blocks = num_kv_blocks_for(args, config, shard.num_layers, max_model_len, device, dtype)
    name = Path(model_path).name if model_path else f"dummy:{dummy}"
    description = engine_pb2.WorkerDescription(
        stage_index=args.stage_index,
        num_stages=args.num_stages,
        layer_start=shard.start_layer,
        layer_end=shard.end_layer,
        num_kv_blocks=blocks,
        block_size=args.block_size,
        device=str(device),
        model_fingerprint=shard.fingerprint,
        draft=draft,
        location=local_location(device),
        model=generate_pb2.ModelInfo(
            model_name=name,
            architecture=config.architecture,
            max_model_len=max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_id,
            dtype=str(dtype).removeprefix("torch."),
            tensor_parallel_size=group.size,
        ),
        tensor_parallel_size=group.size,
        tensor_parallel_rank=group.rank,
    )
    return runner, description


def tensor_parallel_group(args, device: torch.device) -> TensorParallelGroup:
    """This worker's rank of its stage (checked against the flags); the group forms at InitCache."""
    size, rank = args.tensor_parallel_size, args.tensor_parallel_rank
    if size < 1 or not 0 <= rank < size:
        raise SystemExit(f"--tensor-parallel-rank {rank} is not in [0, --tensor-parallel-size {size})")
    if size == 1:
        return TensorParallelGroup(0, 1, device)
    if not args.tensor_parallel_master:
        raise SystemExit("--tensor-parallel-size > 1 needs --tensor-parallel-master (rank 0's host:port)")
    try:
        host, _ = split_address(args.tensor_parallel_master)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    group = TensorParallelGroup(
        rank,
        size,
        device,
        args.collective_timeout,
        master_host=host,
        all_reduce=args.tensor_parallel_all_reduce,
        dtype=pick_dtype(args.dtype, device),
    )
    group.skip_collectives = args.tensor_parallel_no_collectives
    group.send_early = not args.tensor_parallel_no_early_send
    if group.skip_collectives:
        log.warning("--tensor-parallel-no-collectives: this stage's tokens are wrong (benchmarks only)")
    return group


def advertised_address(args, port: int) -> str:
    """Where the other ranks of this worker's stage reach it."""
    if args.advertise_address:
        return args.advertise_address
    host = args.host if args.host not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def max_activation_rows(args, runner: ModelRunner) -> int:
    """The most rows of one step's activations between stages (padded graph batches included):
    the stage transport's buffers hold this many (a larger step goes inline over gRPC)."""
    graph_rows = runner.cuda_graph_max_batch * (len(runner.verify_query_lens) + 1)
    return max(args.max_num_batched_tokens, graph_rows, runner.piecewise_max_tokens, 1)


async def serve(args) -> None:
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    runner, description = build(args)
    server, health = new_server()
    profiler = StepProfiler.from_flags(args.profile_output, args.profile_steps)
    port = bind(server, args.host, args.port)
    ranks = StageRanks.join(
        runner.tp, args.tensor_parallel_master, advertised_address(args, port), description, args.cluster_token
    )
    servicer = WorkerServicer(
        runner,
        description,
        profiler,
        token=args.cluster_token,
        max_activation_rows=max_activation_rows(args, runner),
        ranks=ranks,
    )
    worker_service = engine_pb2.DESCRIPTOR.services_by_name["Worker"]
    add_service(server, servicer, worker_service, token=args.cluster_token, raw_too=("Steps",))
    plans = None
    if ranks.size > 1 and ranks.rank > 0:  # a peer rank: its rank 0 writes it every plan here
        plans = PlanListener(args.cluster_token, servicer.serve_relayed_plans)
        description.tensor_parallel_plan_port = await plans.start(args.host)
    await set_serving(health, ["strata.v1.Worker"], serving=False)
    await server.start()
    await set_serving(health, ["strata.v1.Worker"])
    log.info(
        "worker stage %d/%d%s (layers %d-%d, %d KV blocks, %s) listening on %s:%d",
        args.stage_index,
        args.num_stages,
        f", tensor-parallel rank {ranks.rank}/{ranks.size}" if ranks.size > 1 else "",
        description.layer_start,
        description.layer_end,
        description.num_kv_blocks,
        description.device,
        args.host,
        port,
    )
    await wait_for_termination_signal()
    servicer.end_peer_calls()
    await server.stop(grace=1.0)
    # A step still waiting for its activations (or tokens) holds the step thread until the
    # transport's deadline, and the interpreter's exit joins that thread: with the streams ended,
    # nothing it computes can go anywhere, so the links close and it returns at once.
    if plans is not None:
        await plans.close()
    await servicer.close()


def run(args) -> int:
    asyncio.run(serve(args))
    # Stopped cleanly: leave without the interpreter's finalization, where Triton's bindings
    # would report every object the kernel caches still hold (strata/quiet_exit.py).
    quiet_exit(0)
