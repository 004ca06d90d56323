"""Worker service: one process per pipeline stage.

Plans arrive from the scheduler on the Steps stream, activations from the previous stage on the
Forward stream. A single executor thread runs steps strictly in step order, so the event loop
keeps receiving plans and activations while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from strata.codec import tensor_from_proto, tensor_to_proto
from strata.gc_tuning import thaw, tune_for_serving
from strata.grpc_util import aio_channel
from strata.services.worker.draft_steps import DraftProposal, propose
from strata.services.worker.profiling import StepProfiler
from strata.services.worker.runner import ModelRunner
from strata.services.worker.step_results import PendingResult
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.worker")
# Steps whose activations may wait for their plan: far more than the plans in flight (one per stage).
MAX_PENDING_ACTIVATIONS = 64


class StepFailed(Exception):
    pass


class WorkerServicer(engine_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        runner: ModelRunner,
        description: engine_pb2.WorkerDescription,
        profiler: StepProfiler | None = None,
        token: str | None = None,
    ):
        self.token = token  # the cluster token, for the stream to the next stage
        self.runner = runner
        self.profiler = profiler or StepProfiler(None)
        self.description = description
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # Waits for sampled tokens to reach the host while the step thread launches the next plan.
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finish")
        self._activations: dict[int, asyncio.Future] = {}
        self._forward_queue: asyncio.Queue | None = None
        self._forward_task: asyncio.Task | None = None
        self._session = 0  # bumped by InitCache: stale streams stop touching state

    # ------------------------------------------------------------ setup

    async def Describe(self, request, context):
        return self.description

    async def InitCache(self, request, context):
        if request.num_kv_blocks <= 0 or request.num_kv_blocks > self.description.num_kv_blocks:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"num_kv_blocks must be in [1, {self.description.num_kv_blocks}]"
            )
        if self.runner.is_last == bool(request.next_stage_address):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "next_stage_address must be set on every stage but the last"
            )
        self._session += 1
        await self._close_forward()
        self._fail_pending_activations()
        loop = asyncio.get_running_loop()
        thaw()  # a second InitCache (the scheduler came back) replaces the frozen cache and graphs
        await loop.run_in_executor(self.executor, self.runner.init_cache, request.num_kv_blocks)
        # The model, its graphs and torch's own objects are start-up state: frozen, the collector
        # no longer walks them (a full collection of an idle worker took 70 ms on CPU), and the
        # steps' short-lived objects trigger it far less often, as in the scheduler and gateway.
        tune_for_serving()
        if request.next_stage_address:
            self._forward_queue = asyncio.Queue()
            self._forward_task = asyncio.create_task(self._forward_to(request.next_stage_address, self._forward_queue))
        log.info(
            "stage %d: KV cache of %d blocks; next stage %s",
            self.runner.stage_index,
            request.num_kv_blocks,
            request.next_stage_address or "-",
        )
        return engine_pb2.InitCacheReply()

    async def _forward_to(self, address: str, queue: asyncio.Queue) -> None:
        async def messages():
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                yield msg

        async with aio_channel(address, self.token) as channel:
            stub = engine_pb2_grpc.WorkerStub(channel)
            try:
                await stub.Forward(messages())
            except grpc.aio.AioRpcError as e:
                # The scheduler sees the downstream stage fail and re-initialises the pipeline.
                log.warning("forward stream to %s ended: %s", address, e.details())

    async def _close_forward(self) -> None:
        if self._forward_queue is not None:
            self._forward_queue.put_nowait(None)
        if self._forward_task is not None:
            self._forward_task.cancel()
            try:
                await self._forward_task
            except (asyncio.CancelledError, Exception):
                pass
        self._forward_queue = self._forward_task = None

    def _fail_pending_activations(self) -> None:
        for fut in self._activations.values():
            if not fut.done():
                fut.set_exception(StepFailed("pipeline re-initialised"))
        self._activations.clear()

    def _activation_future(self, step_id: int) -> asyncio.Future:
        fut = self._activations.get(step_id)
        if fut is None:
            fut = self._activations[step_id] = asyncio.get_running_loop().create_future()
        return fut

    # ------------------------------------------------------------ data path

    async def Forward(self, request_iterator, context):
        async for msg in request_iterator:
            if msg.step_id not in self._activations and len(self._activations) >= MAX_PENDING_ACTIVATIONS:
                # Activations of steps no plan has asked for yet: a sender running far ahead of the
                # plans (or sending step ids that never come) must not grow this without bound.
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"more than {MAX_PENDING_ACTIVATIONS} steps' activations waiting for their plans",
                )
            fut = self._activation_future(msg.step_id)
            if not fut.done():
                fut.set_result(msg)
        return engine_pb2.ForwardReply()

    async def Steps(self, request_iterator, context):
        if not self.runner.kv_caches:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InitCache first")
        session = self._session
        results: asyncio.Queue = asyncio.Queue()
        plans: asyncio.Queue = asyncio.Queue()

        async def read_plans():
            try:
                async for plan in request_iterator:
                    await plans.put(plan)
            finally:
                await plans.put(None)

        reader = asyncio.create_task(read_plans())
        runner_task = asyncio.create_task(self._run_plans(plans, results, session))
        try:
            while True:
                item = await results.get()
                if item is None:
                    break
                yield item
        finally:
            reader.cancel()
            runner_task.cancel()

    async def _run_plans(self, plans: asyncio.Queue, results: asyncio.Queue, session: int) -> None:
        loop = asyncio.get_running_loop()
        pending: asyncio.Queue = asyncio.Queue()
        finisher = asyncio.create_task(self._finish_results(pending, results))
        try:
            while (plan := await plans.get()) is not None:
                if session != self._session:
                    break
                await self._run_one(loop, plan, pending)
        finally:
            await pending.put(None)
            await finisher

    async def _finish_results(self, pending: asyncio.Queue, results: asyncio.Queue) -> None:
        """Turns launched steps into StepResults, in step order."""
        loop = asyncio.get_running_loop()
        try:
            while (item := await pending.get()) is not None:
                if isinstance(item, (PendingResult, DraftProposal)):
                    try:
                        item = await loop.run_in_executor(self.finisher, item.finish)
                    except Exception as e:
                        log.exception("step %d failed while fetching its result", item.step_id)
                        item = engine_pb2.StepResult(step_id=item.step_id, error=f"{type(e).__name__}: {e}")
                await results.put(item)
        finally:
            await results.put(None)

    async def _run_one(self, loop, plan, pending: asyncio.Queue) -> None:
        runner = self.runner
        act = None
        if not runner.is_first:
            act = await self._activation_future(plan.step_id)
            self._activations.pop(plan.step_id, None)
        error = act.error if act is not None else ""
        out = None
        if not error:
            self.profiler.step_launched()
            try:
                hidden = residual = None
                if act is not None:  # a malformed tensor fails this step, not the worker
                    hidden = tensor_from_proto(act.hidden, runner.device).to(runner.dtype)
                    residual = tensor_from_proto(act.residual, runner.device).to(runner.dtype)
                if plan.propose_tokens:  # a draft worker's proposal: k steps
                    out = await loop.run_in_executor(self.executor, propose, runner, plan)
                else:
                    out = await loop.run_in_executor(self.executor, runner.execute, plan, hidden, residual)
            except Exception as e:  # a failed step must not take the worker down
                log.exception("step %d failed on stage %d", plan.step_id, runner.stage_index)
                error = f"stage {runner.stage_index}: {type(e).__name__}: {e}"
        if runner.is_last:
            await pending.put(out if not error else engine_pb2.StepResult(step_id=plan.step_id, error=error))
            return
        if error:
            msg = engine_pb2.Activations(step_id=plan.step_id, error=error)
        else:
            msg = await loop.run_in_executor(self.executor, _encode_activations, plan.step_id, *out)
        if self._forward_queue is not None:
            self._forward_queue.put_nowait(msg)


def _encode_activations(step_id: int, hidden: torch.Tensor, residual: torch.Tensor) -> engine_pb2.Activations:
    return engine_pb2.Activations(step_id=step_id, hidden=tensor_to_proto(hidden), residual=tensor_to_proto(residual))
