"""Worker service: one process per pipeline stage.

Plans arrive from the scheduler on the Steps stream; each step's activations come from the
previous stage through the stage transport (stage_transport.py), announced on the Forward
stream. A single executor thread runs steps strictly in step order, so the event loop keeps
receiving plans and activations while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from strata.gc_tuning import thaw, tune_for_serving
from strata.grpc_util import aio_channel
from strata.services.worker.draft_steps import DraftProposal, propose
from strata.services.worker.profiling import StepProfiler
from strata.services.worker.runner import ModelRunner
from strata.services.worker.stage_transport import (
    MAX_PENDING_ACTIVATIONS,
    Receiver,
    Sender,
    StepFailed,
    TransportError,
    name_of,
    open_receiver,
    open_sender,
)
from strata.services.worker.step_results import PendingResult
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.worker")


class WorkerServicer(engine_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        runner: ModelRunner,
        description: engine_pb2.WorkerDescription,
        profiler: StepProfiler | None = None,
        token: str | None = None,
        max_activation_rows: int = 4096,
        ring_slots: int = 0,
    ):
        self.token = token  # the cluster token, for the stream to the next stage
        # The most rows (tokens, padding included) of one step's activations, which sizes the
        # transport's buffers, and the IPC ring's slots (0: one more than the stages).
        self.max_activation_rows = max_activation_rows
        self.ring_slots = ring_slots or description.num_stages + 1
        self.runner = runner
        self.profiler = profiler or StepProfiler(None)
        self.description = description
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # Waits for sampled tokens to reach the host while the step thread launches the next plan.
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finish")
        self._receiver: Receiver | None = None  # the link from the previous stage
        self._sender: Sender | None = None  # the link to the next stage
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
        if not 0 <= request.transport_timeout_seconds <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transport_timeout_seconds must be in [0, 3600]")
        if request.next_stage_address and not request.next_stage_link.transport:  # an older scheduler: gRPC
            request.next_stage_link.transport = engine_pb2.STAGE_TRANSPORT_GRPC
            request.next_stage_link.session = request.session
        if not self.runner.is_first and not request.previous_stage_transport:
            request.previous_stage_transport = engine_pb2.STAGE_TRANSPORT_GRPC
        self._session += 1
        await self._close_links()
        loop = asyncio.get_running_loop()
        thaw()  # a second InitCache (the scheduler came back) replaces the frozen cache and graphs
        await loop.run_in_executor(self.executor, self.runner.init_cache, request.num_kv_blocks)
        # The model, its graphs and torch's own objects are start-up state: frozen, the collector
        # no longer walks them (a full collection of an idle worker took 70 ms on CPU), and the
        # steps' short-lived objects trigger it far less often, as in the scheduler and gateway.
        tune_for_serving()
        reply = engine_pb2.InitCacheReply()
        try:
            if not self.runner.is_first:
                self._receiver = open_receiver(
                    request,
                    device=self.runner.device,
                    dtype=self.runner.dtype,
                    hidden_size=self.runner.config.hidden_size,
                    max_rows=self.max_activation_rows,
                    slots=self.ring_slots,
                )
                reply.previous_stage_link.CopyFrom(self._receiver.link())
            if request.next_stage_address:
                queue: asyncio.Queue = asyncio.Queue()

                def emit(msg, queue=queue):  # from any thread
                    loop.call_soon_threadsafe(queue.put_nowait, msg)

                self._sender = open_sender(request, emit, device=self.runner.device)
                self._forward_queue = queue
                self._forward_task = asyncio.create_task(
                    self._forward_to(request.next_stage_address, queue, self._sender)
                )
        except (TransportError, RuntimeError, ValueError) as e:
            await self._close_links()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage transport: {e}")
        self.description.previous_stage_transport = self._receiver.kind if self._receiver else 0
        self.description.next_stage_transport = self._sender.kind if self._sender else 0
        log.info(
            "stage %d: KV cache of %d blocks; activations in by %s, out by %s to %s (session %d)",
            self.runner.stage_index,
            request.num_kv_blocks,
            name_of(self.description.previous_stage_transport),
            name_of(self.description.next_stage_transport),
            request.next_stage_address or "-",
            request.session,
        )
        return reply

    async def _forward_to(self, address: str, queue: asyncio.Queue, sender: Sender) -> None:
        async def messages():
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                yield msg

        async with aio_channel(address, self.token) as channel:
            stub = engine_pb2_grpc.WorkerStub(channel)
            try:
                async for ack in stub.Forward(messages()):  # credits for the transport's buffers
                    sender.on_ack(ack)
            except grpc.aio.AioRpcError as e:
                # The scheduler sees the downstream stage fail and re-initialises the pipeline.
                log.warning("forward stream to %s ended: %s", address, e.details())

    async def _close_links(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._forward_queue is not None:
            self._forward_queue.put_nowait(None)
        if self._forward_task is not None:
            self._forward_task.cancel()
            try:
                await self._forward_task
            except (asyncio.CancelledError, Exception):
                pass
        self._forward_queue = self._forward_task = None
        if self._receiver is not None:
            self._receiver.close()  # steps waiting for activations fail
            self._receiver = None

    # ------------------------------------------------------------ data path

    async def Forward(self, request_iterator, context):
        receiver = self._receiver
        if receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no link from a previous stage: InitCache first")
        overflow = False

        async def read():
            nonlocal overflow
            try:
                async for msg in request_iterator:
                    if msg.session != receiver.session:
                        continue  # a stream of an older pipeline
                    if not receiver.deliver(msg):
                        # Activations of steps no plan has asked for yet: a sender running far ahead
                        # of the plans (or sending step ids that never come) must not grow this.
                        overflow = True
                        break
            finally:
                receiver.acks.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (ack := await receiver.acks.get()) is not None:
                yield ack
            if overflow:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"more than {MAX_PENDING_ACTIVATIONS} steps' activations waiting for their plans",
                )
            await reader  # a malformed message ends the call with its status
        finally:
            reader.cancel()

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
        error = ""
        hidden = residual = None
        if not runner.is_first:
            receiver = self._receiver
            try:  # a failed upstream step, or a transport that failed it, fails this step only
                if receiver is None:
                    raise StepFailed("no link from the previous stage")
                hidden, residual = await receiver.receive(plan.step_id)
            except StepFailed as e:
                error = str(e)
        out = None
        if not error:
            self.profiler.step_launched()
            try:
                if plan.propose_tokens:  # a draft worker's proposal: k steps
                    out = await loop.run_in_executor(self.executor, propose, runner, plan)
                elif runner.is_last:
                    out = await loop.run_in_executor(self.executor, runner.execute, plan, hidden, residual)
                else:
                    sender = self._sender
                    await loop.run_in_executor(self.executor, _execute_and_send, runner, sender, plan, hidden, residual)
                    return
            except Exception as e:  # a failed step must not take the worker down
                log.exception("step %d failed on stage %d", plan.step_id, runner.stage_index)
                error = f"stage {runner.stage_index}: {type(e).__name__}: {e}"
        if runner.is_last:
            await pending.put(out if not error else engine_pb2.StepResult(step_id=plan.step_id, error=error))
        elif self._sender is not None:
            self._sender.send_error(plan.step_id, error)


def _execute_and_send(runner: ModelRunner, sender: Sender | None, plan, hidden, residual) -> None:
    """On the step thread: launch the step, hand its activations to the transport (no wait)."""
    out = runner.execute(plan, hidden, residual)
    if sender is not None:
        sender.send(plan.step_id, *out)
