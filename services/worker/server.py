"""Worker service: one process per pipeline stage.

Plans arrive from the scheduler on the Steps stream; each step's activations come from the
previous stage through the stage transport (transport/), announced on the Forward stream or on
the link's own doorbell. A single step thread runs the queued plans back to back, strictly in
step order (step/step_thread.py; what one plan's step does there: step/stage_step.py), and a
finisher thread hands their results back, so the event loop keeps receiving plans and
activations while the model computes. (The scheduler's engine loop, which sends the plans, is a
loop of its own: services/scheduler/engine.py.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from strata.gc_tuning import thaw, tune_for_serving
from strata.grpc_util import aio_channel
from strata.services.worker.device import host_to_device
from strata.services.worker.diagnostics.profiling import StepProfiler
from strata.services.worker.diagnostics.stage_stats import StageStats
from strata.services.worker.runner import ModelRunner, use_device
from strata.services.worker.speculation.draft_steps import propose
from strata.services.worker.step.sequence_table import PlanError
from strata.services.worker.step.stage_step import execute_and_send, execute_last, fetch_result, on_loop, on_step_thread
from strata.services.worker.step.step_thread import ResultOut, StepThread
from strata.services.worker.tensor_parallel.plan_socket import frame, read_frame
from strata.services.worker.tensor_parallel.ranks import PeersUnavailable, StageRanks
from strata.services.worker.transport.stage_transport import (
    MAX_PENDING_ACTIVATIONS,
    PeerLost,
    Receiver,
    Sender,
    StepFailed,
    open_receiver,
    open_sender,
)
from strata.services.worker.transport.token_handoff import TokenIntake
from strata.services.worker.transport.token_link_service import TokenLinkService
from strata.stage_links import TransportError, name_of
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.worker")


class WorkerServicer(TokenLinkService, engine_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        runner: ModelRunner,
        description: engine_pb2.WorkerDescription,
        profiler: StepProfiler | None = None,
        token: str | None = None,
        max_activation_rows: int = 4096,
        ring_slots: int = 0,
        ranks: StageRanks | None = None,
    ):
        self.token = token  # the cluster token, for the stream to the next stage
        # Tensor parallelism: this worker's rank of its stage (rank 0 relays to the others).
        self.ranks = ranks or StageRanks.single(runner.device)
        # The most rows (tokens, padding included) of one step's activations, which sizes the
        # transport's buffers, and the IPC ring's slots (0: one more than the stages).
        self.max_activation_rows = max_activation_rows
        self.ring_slots = ring_slots or description.num_stages + 1
        self.runner = runner
        self.profiler = profiler or StepProfiler(None)
        self.description = description
        bind = {"initializer": use_device, "initargs": (runner.device,)}
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step", **bind)
        # Waits for sampled tokens to reach the host while the step thread launches the next plan.
        self.finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="finish", **bind)
        self._receiver: Receiver | None = None  # the link from the previous stage
        self._sender: Sender | None = None  # the link to the next stage
        self._forward_queue: asyncio.Queue | None = None
        self._forward_task: asyncio.Task | None = None
        self._session = 0  # bumped by InitCache: stale streams stop touching state
        self._link_session = 0  # the scheduler's session of the last InitCache (the token link's)
        # Pipelined decode's token link (token_handoff.py): stage 0 receives, the last stage sends.
        self._token_receiver = None
        self._token_sender: Sender | None = None
        self._token_queue: asyncio.Queue | None = None
        self._token_task: asyncio.Task | None = None
        self.stats = StageStats(runner.device)

    # ------------------------------------------------------------ setup

    async def Describe(self, request, context):
        try:
            return await self.ranks.describe(self.description)
        except PeersUnavailable as e:  # the scheduler retries until the whole stage is up
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

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
        self._link_session = request.session
        # A step thread held by a collective with a lost rank is released before the new group.
        self.ranks.abort("the stage is being rebuilt (InitCache)")
        await self._close_links()
        loop = asyncio.get_running_loop()
        thaw()  # a second InitCache (the scheduler came back) replaces the frozen cache and graphs

        def init_on_step_thread():  # every rank at once: the group forms, then warm-up in lockstep
            self.ranks.form(request.session)
            self.runner.init_cache(request.num_kv_blocks)

        try:
            _, peer_replies = await asyncio.gather(
                loop.run_in_executor(self.executor, init_on_step_thread), self.ranks.init_peers(request)
            )
        except PeersUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        # The model, its graphs and torch's own objects are start-up state: frozen, the collector
        # no longer walks them (a full collection of an idle worker took tens of ms), and the
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
                self.ranks.nest(reply.previous_stage_link, [r.previous_stage_link for r in peer_replies])
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

    async def GetStats(self, request, context):
        s = self.stats
        s.poll()
        if self.runner.clock:
            self.runner.clock.dump()
        out = engine_pb2.WorkerStats(
            stage_index=self.runner.stage_index,
            steps=s.steps,
            busy_seconds=s.busy_seconds,
            idle_seconds=s.idle_seconds,
            timed_steps=s.timed_steps,
            launch_seconds=s.launch_seconds,
            # Awaited on the event loop (Forward), or taken on the step thread (ipc).
            input_wait_seconds=s.input_wait_seconds + (self._receiver.wait_seconds if self._receiver else 0.0),
            step_thread_cpu_seconds=s.step_thread_cpu_seconds,
            process_cpu_seconds=time.process_time(),
            gpu_wait_seconds=host_to_device.gpu_waits.seconds,
            gpu_waits=host_to_device.gpu_waits.count,
        )
        if isinstance(self.runner.handoff, TokenIntake):
            out.token_wait_seconds = self.runner.handoff.wait_seconds
            out.token_waits = self.runner.handoff.waits
        for sender, prefix in ((self._sender, "activation"), (self._token_sender, "token")):
            if sender is not None:
                setattr(out, f"{prefix}_steps_sent", sender.steps_sent)
                setattr(out, f"{prefix}_bytes_sent", sender.bytes_sent)
                setattr(out, f"{prefix}_send_seconds", sender.send_seconds)
        return out

    def end_peer_calls(self) -> None:
        """At shutdown, before the server stops: the calls a peer keeps open here (the previous
        stage's Forward, stage 0's HandTokens) end. Left open, grpc cancels them once its grace
        is over and logs each as an exception their handler did not handle."""
        if self._receiver is not None:
            self._receiver.acks.put_nowait(None)
        if self._token_queue is not None:
            self._token_queue.put_nowait(None)

    async def close(self) -> None:
        """At shutdown, after the server stopped: the links close, and steps waiting on them fail."""
        self._session += 1  # plans still queued run nothing
        await self.ranks.close()
        await self._close_links()

    async def _close_links(self) -> None:
        await self._close_token_link()
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
            if reader.done():  # the sender's stream ended; a malformed message ends the call with its status
                await reader
            # else this end closed (a new pipeline, or shutdown: end_peer_calls): the call ends now
        finally:
            reader.cancel()

    async def Steps(self, request_iterator, context):
        if not self.runner.kv_caches:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InitCache first")

        async def plans():
            async for item in request_iterator:
                # (raw bytes, plan) as main.py registers the service (add_service's raw_too)
                yield item if isinstance(item, tuple) else (None, item)

        async for result in self._run_plans(plans()):
            yield result

    async def serve_relayed_plans(self, session: int, reader, writer) -> None:
        """A peer rank (tensor parallelism): the plans its rank 0 relays on its plan socket
        (tensor_parallel/plan_socket.py) run as a Steps stream's would; a failed step's result
        goes back on it."""
        if session != self._link_session or not self.runner.kv_caches:
            log.warning("tensor parallel: plans of session %d refused (InitCache of it first)", session)
            return

        async def plans():
            while (raw := await read_frame(reader)) is not None:
                yield raw, engine_pb2.StepPlan.FromString(raw)

        async for result in self._run_plans(plans()):
            try:
                writer.write(frame(result.SerializeToString()))
                await writer.drain()
            except ConnectionError:  # rank 0 is gone or closed the relay: it knows already
                pass

    async def _run_plans(self, plans):
        """Runs plans (an async iterator of (raw bytes or None, StepPlan)) on the step thread, in
        order; yields the results (the last stage's; a peer rank's failures)."""
        session = self._session
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        out = ResultOut(self.finisher, loop, results, lambda item: self.ranks.vouch(fetch_result(item)))
        steps = StepThread(self.executor, functools.partial(self._run_one, loop, session, out))

        def lost(reason: str) -> None:  # (a relay of an older session has no say in a new group)
            if session == self._session:
                self.ranks.fail(reason)

        # Rank 0 of several: every plan to the other ranks too.
        peers = await self.ranks.open_plans(self._link_session, lost)

        async def read_plans():
            try:
                async for raw, plan in plans:
                    if session != self._session:
                        break  # InitCache rebuilt the state these plans refer to
                    if peers is not None:  # before this rank's own step: a peer's plan is never late
                        await peers.write(raw if raw is not None else plan.SerializeToString())
                    steps.put(plan)
            except asyncio.CancelledError:
                steps.drop()  # the scheduler (or rank 0) went away: launch nothing more of these
                raise
            except DecodeError as e:  # a relayed plan that does not parse: this rank is lost
                self.ranks.fail(f"an undecodable relayed plan: {e}")
            finally:
                # Ranks that ran these plans together are apart now: until a new InitCache
                # re-forms the group, no rank waits in a collective for another.
                if session == self._session:
                    self.ranks.abort("the stage's stream of plans ended")
                if peers is not None:
                    await peers.close()
                await steps.join()
                await out.close()

        reader = asyncio.create_task(read_plans())
        try:
            while (item := await results.get()) is not None:
                yield item
        finally:
            reader.cancel()

    def _run_one(self, loop, session: int, out: ResultOut, plan) -> None:
        """On the step thread (step/step_thread.py): one plan's step; the last stage's result, or a
        failed step's error, goes on in step order."""
        if session != self._session:
            return  # a plan of an older pipeline, queued before InitCache
        runner = self.runner
        error, peer_lost, refused = "", False, False
        inputs = None  # the activations, or how the step thread takes them (an ipc link)
        receiver = self._receiver
        if not runner.is_first:
            waited = time.perf_counter()
            try:  # a failed upstream step, or a transport that failed it, fails this step only
                if receiver is None:
                    raise StepFailed("no link from the previous stage")
                if receiver.on_step_thread:
                    inputs = functools.partial(receiver.take, plan.step_id)
                else:  # delivered on the event loop (Forward)
                    inputs = on_loop(loop, receiver.receive(plan.step_id), receiver.timeout)
            except StepFailed as e:
                error, peer_lost = str(e), isinstance(e, PeerLost)
            self.stats.input_wait_seconds += time.perf_counter() - waited
        result = None
        if not error:
            if plan.propose_tokens:  # a draft worker's proposal: k steps (to the target too, with a link)
                launch = functools.partial(propose, runner, plan, self._token_sender)
            elif runner.is_last:
                launch = functools.partial(execute_last, runner, self.stats, receiver, self._token_sender, plan, inputs)
            else:
                launch = functools.partial(execute_and_send, runner, self.stats, receiver, self._sender, plan, inputs)
            try:
                result = on_step_thread(self.profiler, launch)
                if not (plan.propose_tokens or runner.is_last):
                    return  # a middle stage: its activations went to the next stage
            except StepFailed as e:  # its activations never came
                error, peer_lost = str(e), isinstance(e, PeerLost)
            except PlanError as e:  # every rank refuses the same plan, before any collective
                log.warning("step %d refused on stage %d: %s", plan.step_id, runner.stage_index, e)
                error, refused = f"stage {runner.stage_index}: PlanError: {e}", True
            except Exception as e:  # a failed step must not take the worker down
                log.exception("step %d failed on stage %d", plan.step_id, runner.stage_index)
                error = f"stage {runner.stage_index}: {type(e).__name__}: {e}"
        failed = engine_pb2.StepResult(step_id=plan.step_id, error=error, peer_lost=peer_lost) if error else None
        if error and not refused:  # this rank left its collectives: the others must not wait on it
            self.ranks.fail(f"step {plan.step_id} failed on rank {self.ranks.rank}: {error}")
            if not self.ranks.answers:  # a peer's stream carries only this: rank 0 rebuilds the stage
                out.put(failed)
        # A failed step's error goes on in step order, from the step thread as its data would.
        if runner.is_last:
            if error and self._token_sender is not None and any(plan.sample):
                self._token_sender.send_error(plan.step_id, error)  # stage 0 must not wait for its tokens
            if self.ranks.answers:
                out.put(failed or result)
        elif self._sender is not None:
            self._sender.send_error(plan.step_id, error)
