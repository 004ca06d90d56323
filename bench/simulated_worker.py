"""A worker whose GPU is simulated: the real Worker service and the real per-step host work
(plan deltas, sequence table, input arrays), but each step "runs" on a simulated device that
takes a fixed time per step and executes steps in order, like a CUDA stream.

It isolates the service stack's host overhead from the model: with a simulated step of S ms, a
stack that kept the device busy would run one step every S ms, so the measured step period over
S is the host's share. Used by `python -m strata.bench.host_overhead` (runs on any CPU machine).

    python -m strata.bench.simulated_worker --port 50061 --step-ms 2.8
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import torch

from strata.default_model import ensure_tiny_model
from strata.grpc_util import bind, new_server, set_serving, wait_for_termination_signal
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.runner import ModelRunner
from strata.services.worker.server import WorkerServicer
from strata.services.worker.step.step_results import PendingResult
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2


class SimulatedDevice:
    """Steps queue up and run one after another (a CUDA stream's order), each taking step_s plus
    prefill_token_s for every token past one a sequence (prefill tokens), so that how arrivals fall
    into prefill steps shapes the streams' TPOT as on a GPU."""

    def __init__(self, step_s: float, prefill_token_s: float = 0.0):
        self.step_s, self.prefill_token_s = step_s, prefill_token_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def launch(self, prefill_tokens: int = 0) -> float:
        """Queues a step now; returns when it will have finished."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + self.step_s + prefill_tokens * self.prefill_token_s
            return self._free_at


class SimulatedResult(PendingResult):
    """finish() waits for the simulated step, then reports its tokens."""

    def __init__(self, step_id: int, seq_ids: list[int], tokens: list[int], done_at: float, launch_seconds: float):
        self.step_id, self.seq_ids, self.tokens, self.done_at = step_id, seq_ids, tokens, done_at
        self.launch_seconds = launch_seconds

    def finish(self) -> engine_pb2.StepResult:
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # releases the GIL, as waiting on a CUDA event does
        return engine_pb2.StepResult(
            step_id=self.step_id,
            seq_ids=self.seq_ids,
            num_tokens=[1] * len(self.seq_ids),
            token_ids=self.tokens,
            launch_seconds=self.launch_seconds,
        )


class SimulatedRunner(ModelRunner):
    """The real plan bookkeeping and input preparation; the model and sampler are simulated."""

    def __init__(
        self, config: ModelConfig, device: SimulatedDevice, block_size: int, max_model_len: int, max_num_seqs: int
    ):
        super().__init__(
            shard=None,
            model_config=config,
            stage_index=0,
            num_stages=1,
            block_size=block_size,
            max_model_len=max_model_len,
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_num_seqs=max_num_seqs,
        )
        self.simulated = device
        self.sampler = None

    def init_cache(self, num_blocks: int) -> None:
        self.kv_caches = [None]  # "initialised": the service only checks that it is non-empty
        self.table.reset(num_blocks)

    def execute(self, plan, hidden=None, residual=None):
        start = time.perf_counter()
        rows = self.table.apply(plan)  # no KV cache, so no block copies
        h = self.inputs.build(plan, rows)
        # A token that depends on the sequence and position, within the vocabulary.
        tokens = ((h.sample_rows * 7919 + h.sample_positions) % (self.config.vocab_size - 2) + 2).tolist()
        return SimulatedResult(
            plan.step_id,
            h.sample_seq_ids,
            tokens,
            self.simulated.launch(len(h.positions) - len(h.seq_lens)),
            time.perf_counter() - start,
        )


def build(args) -> tuple[SimulatedRunner, engine_pb2.WorkerDescription]:
    model_dir = ensure_tiny_model()
    config = ModelConfig.from_dir(model_dir)
    runner = SimulatedRunner(
        config,
        SimulatedDevice(args.step_ms / 1e3, args.prefill_us_per_token / 1e6),
        args.block_size,
        args.max_model_len,
        max(4 * args.max_num_seqs, 1024),
    )
    description = engine_pb2.WorkerDescription(
        stage_index=0,
        num_stages=1,
        layer_start=0,
        layer_end=config.num_hidden_layers,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        device="simulated",
        model_fingerprint="simulated",
        model=generate_pb2.ModelInfo(
            model_name="simulated",
            architecture=config.architecture,
            max_model_len=args.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_id,
            dtype="simulated",
        ),
    )
    return runner, description


async def serve(args) -> None:
    runner, description = build(args)
    server, health = new_server()
    engine_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, description), server)
    bind(server, "127.0.0.1", args.port)
    await server.start()
    await set_serving(health, ["strata.v1.Worker"])
    await wait_for_termination_signal()
    await server.stop(grace=1.0)


def main() -> None:
    from strata.launcher import die_with_launcher

    die_with_launcher()  # started by bench.host_overhead's Cluster
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True, help="port to serve the Worker service on (127.0.0.1)")
    p.add_argument("--step-ms", type=float, default=2.8, help="simulated device time of every step")
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="simulated device time per prefill token (tokens past one a sequence), added to --step-ms",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest sequence")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sizes the sequence table")
    p.add_argument("--num-kv-blocks", type=int, default=100_000, help="KV blocks offered to the scheduler")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
