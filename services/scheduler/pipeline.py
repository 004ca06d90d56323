"""Connection to the pipeline of workers: discovery, cache set-up and the per-stage Steps streams."""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import sys
from dataclasses import dataclass, field

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from strata.grpc_util import aio_channel, bearer
from strata.stage_links import TransportError, choose_transport, gpus_shared_without_mps, host_of, name_of
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.scheduler")


class PipelineError(Exception):
    """A stage is unreachable, misconfigured, or failed mid-stream."""


def _start_eagerly(coro, name: str) -> asyncio.Task:
    """A task that runs up to its first suspension now (a write's submission to grpc), where
    Python allows it (3.12); else at the loop's next turn."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    return loop.create_task(coro, name=name)


@dataclass
class StageHandle:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.WorkerStub
    description: engine_pb2.WorkerDescription
    call: grpc.aio.StreamStreamCall | None = None
    # (step id, plan bytes) not written yet, and the task writing them (None or done: idle).
    outbox: collections.deque = field(default_factory=collections.deque)
    writer: asyncio.Task | None = None


def _raw_steps(channel: grpc.aio.Channel):
    """Worker.Steps taking plans already serialized: the engine serializes each plan once, not
    once per stage."""
    return channel.stream_stream(
        "/strata.v1.Worker/Steps", request_serializer=None, response_deserializer=engine_pb2.StepResult.FromString
    )


class Pipeline:
    """The ordered stages; sends each plan to every stage and reads results from the last one.
    With a draft worker (speculative decoding), also the draft model's proposals."""

    def __init__(
        self,
        addresses: list[str],
        connect_timeout: float = 120.0,
        draft_address: str | None = None,
        draft_link: bool = True,
        token: str | None = None,
        stage_transport: str = "auto",
        transport_timeout: float = 120.0,
    ):
        self.token = token  # the cluster token every call to a worker carries
        # How activations move between stages (auto: per link, from the stages' Describe), and the
        # longest any transport wait may take (longer than a step may: the engine's step deadline
        # notices a hung stage first).
        self.stage_transport = stage_transport
        self.transport_timeout = transport_timeout
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = addresses
        self.draft_address = draft_address
        self.draft_link = draft_link  # with one stage, open the draft link (off: A/B runs, old targets)
        self.connect_timeout = connect_timeout
        self.stages: list[StageHandle] = []
        self.draft: StageHandle | None = None
        self.num_kv_blocks = 0
        # Pipelined decode: the last stage hands its sampled tokens to stage 0 over this link
        # (0: none, one stage), so decode lookaheads work on P stages too.
        self.token_transport = 0
        # One stage with a draft worker: the draft worker hands its proposals straight to the
        # stage over this link (0: none; the engine then fills them into the plans).
        self.draft_transport = 0
        # A stage's plan that could not be written (post() raises it), and who to tell at once.
        self.failed: PipelineError | None = None
        self.on_failure = lambda: None

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    @property
    def stages_share_one_gpu(self) -> bool:
        """Every stage on the same GPU (a small host, a test): their steps take turns on it."""
        uuids = {s.description.location.device_uuid for s in self.stages}
        return len(self.stages) > 1 and len(uuids) == 1 and "" not in uuids

    @property
    def model_info(self) -> engine_pb2.WorkerDescription:
        return self.stages[0].description

    async def connect(self, max_kv_blocks: int | None = None, timeout: float | None = None) -> None:
        """Describes every stage (retrying until it is up), checks they form one pipeline,
        sizes the KV cache to the smallest stage, and opens the Steps streams."""
        await self.close()
        timeout = self.connect_timeout if timeout is None else timeout
        stages = [await self._open(address, timeout) for address in self.addresses]
        self._check_topology(stages)
        self.stages = stages
        every = list(stages)
        if self.draft_address:
            self.draft = await self._open(self.draft_address, timeout)
            self._check_draft(self.draft, stages[0].description)
            every.append(self.draft)
        # One block table per sequence serves the target and the draft: the smallest pool wins.
        blocks = min(s.description.num_kv_blocks for s in every)
        if max_kv_blocks:
            blocks = min(blocks, max_kv_blocks)
        self.num_kv_blocks = blocks
        transports, session = await self._init_caches(stages, blocks)
        self.token_transport = await self._open_token_link(stages[-1], stages[0], session) if len(stages) > 1 else 0
        self.draft_transport = 0
        if self.draft is not None:
            await self._init_cache(self.draft, engine_pb2.InitCacheRequest(num_kv_blocks=blocks, session=session))
            if len(stages) == 1 and self.draft_link:
                try:
                    self.draft_transport = await self._open_token_link(self.draft, stages[0], session, drafts=True)
                except PipelineError as e:  # (an older target, or no transport between the two): as before
                    log.warning("%s; the draft worker's proposals go through the scheduler", e)
        # The token as the calls' own metadata, not through the channel's interceptor: grpc.aio
        # passes an intercepted stream's every write through a queue and two more tasks.
        self.failed = None
        for stage in stages:
            stage.call = _raw_steps(stage.channel)(metadata=bearer(self.token))
        if self.draft is not None:
            self.draft.call = self.draft.stub.Steps(metadata=bearer(self.token))
        for shared in gpus_shared_without_mps([s.description for s in stages]):
            log.warning(
                "stages %s share one GPU without MPS: each hand-off between them leaves the GPU idle while it "
                "switches processes (~150 us; 15%% of a 16-stream step of a 1B model); `strata serve --mps` "
                "runs them side by side",
                ", ".join(map(str, shared)),
            )
        log.info(
            "pipeline of %d stage(s) ready: %d KV blocks of %d tokens; stage transport: %s%s",
            len(stages),
            blocks,
            stages[0].description.block_size,
            ", ".join(f"{i}->{i + 1} {name_of(k)}" for i, k in enumerate(transports)) or "-",
            f"; sampled tokens {len(stages) - 1}->0 {name_of(self.token_transport)}" if self.token_transport else "",
        )
        if self.draft is not None:
            log.info(
                "draft worker %s: proposals %s",
                self.draft.address,
                f"straight to the stage by {name_of(self.draft_transport)}"
                if self.draft_transport
                else "through the scheduler",
            )

    async def _open_token_link(self, last: StageHandle, first: StageHandle, session: int, drafts: bool = False) -> int:
        """The link last stage -> stage 0 for sampled tokens (pipelined decode), or with `drafts`
        draft worker (last) -> the one stage (first) for its proposals, on the transport chosen
        as for any link (--stage-transport; auto: ipc on one host's GPUs, else distributed):
        `first` opens its receiving end, `last` its sending end."""
        name = "draft" if drafts else "token"
        try:
            kind = choose_transport(last.description, first.description, self.stage_transport)
        except TransportError as e:
            raise PipelineError(f"{name} link: {e}") from e
        request = engine_pb2.TokenLinkRequest(
            session=session,
            transport=kind,
            peer_address=last.address,
            transport_timeout_seconds=self.transport_timeout,
            drafts=drafts,
        )
        try:
            reply = await first.stub.OpenTokenLink(request, timeout=120)
            link = reply.link
            if link.rendezvous_address:  # stage 0's store, at its host as this scheduler reaches it
                port = link.rendezvous_address.rsplit(":", 1)[-1]
                host = host_of(first.address)
                link.rendezvous_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            request.send, request.peer_address = True, first.address
            request.link.CopyFrom(link)
            await last.stub.OpenTokenLink(request, timeout=120)
        except grpc.aio.AioRpcError as e:
            raise PipelineError(
                f"opening the {name} link {last.address} -> {first.address} failed: {e.details()}"
            ) from e
        return kind

    async def worker_stats(self) -> list[engine_pb2.WorkerStats]:
        """Each stage's own timeline and transport counters (WorkerStats), in stage order."""
        try:
            return list(
                await asyncio.gather(
                    *(s.stub.GetStats(engine_pb2.WorkerStatsRequest(), timeout=10) for s in self.stages)
                )
            )
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"GetStats failed: {e.details()}") from e

    async def _init_caches(self, stages: list[StageHandle], blocks: int) -> tuple[list[int], int]:
        """InitCache from the last stage to the first: each stage opens the receiving end of the
        link into it and returns it, and the previous stage opens the sending end with it."""
        try:
            transports = [
                choose_transport(a.description, b.description, self.stage_transport) for a, b in zip(stages, stages[1:])
            ]
        except TransportError as e:
            raise PipelineError(str(e)) from e
        session = secrets.randbits(63)  # a new pipeline: its links and stores are new ones
        link = None
        for i in reversed(range(len(stages))):
            request = engine_pb2.InitCacheRequest(
                num_kv_blocks=blocks, session=session, transport_timeout_seconds=self.transport_timeout
            )
            if i + 1 < len(stages):
                request.next_stage_address = stages[i + 1].address
                request.next_stage_link.CopyFrom(link)
            if i > 0:
                request.previous_stage_transport = transports[i - 1]
                request.previous_stage_address = stages[i - 1].address
            reply = await self._init_cache(stages[i], request)
            link = reply.previous_stage_link
            if link.rendezvous_address:  # the receiver's store, at its host as this scheduler reaches it
                port = link.rendezvous_address.rsplit(":", 1)[-1]
                host = host_of(stages[i].address)
                link.rendezvous_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return transports, session

    @staticmethod
    async def _init_cache(stage: StageHandle, request: engine_pb2.InitCacheRequest) -> engine_pb2.InitCacheReply:
        try:
            return await stage.stub.InitCache(request, timeout=300)
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"InitCache on {stage.address} failed: {e.details()}") from e

    async def _open(self, address: str, timeout: float) -> StageHandle:
        channel = aio_channel(address, self.token, intercept_streams=False)
        stub = engine_pb2_grpc.WorkerStub(channel)
        try:
            return StageHandle(address, channel, stub, await self._describe(stub, address, timeout))
        except BaseException:
            await channel.close()
            raise

    async def _describe(self, stub, address: str, timeout: float) -> engine_pb2.WorkerDescription:
        retrying = AsyncRetrying(
            stop=stop_after_delay(timeout),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception_type(grpc.aio.AioRpcError),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await stub.Describe(
                        engine_pb2.DescribeRequest(), timeout=min(5.0, max(timeout, 0.5)), wait_for_ready=True
                    )
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"worker {address} unreachable: {e.details()}") from e

    def _check_topology(self, stages: list[StageHandle]) -> None:
        first = stages[0].description
        for i, s in enumerate(stages):
            d = s.description
            if d.stage_index != i or d.num_stages != len(stages):
                raise PipelineError(
                    f"worker {s.address} is stage {d.stage_index} of {d.num_stages}, expected stage {i} of {len(stages)}"
                )
            if d.model_fingerprint != first.model_fingerprint or d.block_size != first.block_size:
                raise PipelineError(f"worker {s.address} serves a different model or block size")
        for a, b in zip(stages, stages[1:]):
            if a.description.layer_end != b.description.layer_start:
                raise PipelineError(f"layers of {a.address} and {b.address} do not join")
        if any(s.description.draft for s in stages):
            raise PipelineError("a draft worker is not a pipeline stage: pass it as the draft")

    @staticmethod
    def _check_draft(draft: StageHandle, target: engine_pb2.WorkerDescription) -> None:
        d = draft.description
        if not d.draft or d.num_stages != 1:
            raise PipelineError(f"worker {draft.address} is not a draft worker (strata worker --role draft)")
        if d.model.vocab_size != target.model.vocab_size or d.block_size != target.block_size:
            raise PipelineError(f"draft worker {draft.address}: vocabulary or block size differs from the target's")
        if d.model.max_model_len < target.model.max_model_len:
            raise PipelineError(f"draft worker {draft.address}: max_model_len below the target's")

    def post(self, plan: engine_pb2.StepPlan) -> None:
        """Sends the plan, serialized once, on every stage's Steps stream without waiting for the
        writes to complete: an awaited write held the engine loop for a trip through grpc's poller
        every plan. A stage's writer writes its plans in order, the first at once where the task
        can start eagerly (Python 3.12). A write that fails fails the pipeline: post raises it from
        then on, and on_failure wakes the engine."""
        self.raise_if_failed()
        item = (plan.step_id, plan.SerializeToString())
        for stage in self.stages:
            stage.outbox.append(item)
            if stage.writer is None or stage.writer.done():
                stage.writer = _start_eagerly(self._write_plans(stage), f"plans to {stage.address}")

    async def _write_plans(self, stage: StageHandle) -> None:
        """Writes the stage's queued plans in order, then ends (post starts it again)."""
        while stage.outbox:
            step_id, raw = stage.outbox[0]
            try:
                await stage.call.write(raw)
            # A write after the stream ended raises InvalidStateError or UsageError rather than
            # the call's status: either way the stage is gone.
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, AttributeError) as e:
                self.failed = PipelineError(f"sending step {step_id} to {stage.address} failed: {e}")
                self.on_failure()
                return
            stage.outbox.popleft()

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    async def receive(self) -> engine_pb2.StepResult:
        try:
            result = await self.stages[-1].call.read()
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"last stage failed: {e.details()}") from e
        if result is grpc.aio.EOF:
            raise PipelineError("last stage closed its stream")
        return result

    async def send_draft(self, plan: engine_pb2.StepPlan) -> None:
        """Sends a draft plan whose tokens go over the draft link; its result comes later
        (draft_result)."""
        try:
            await self.draft.call.write(plan)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, AttributeError) as e:
            raise PipelineError(f"draft worker failed: {e}") from e

    async def draft_result(self) -> engine_pb2.StepResult:
        try:
            result = await self.draft.call.read()
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"draft worker failed: {e.details()}") from e
        if result is grpc.aio.EOF:
            raise PipelineError("draft worker closed its stream")
        return result

    async def propose(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Runs a draft plan on the draft worker; its result holds propose_tokens tokens per sequence."""
        try:
            await self.draft.call.write(plan)
            result = await self.draft.call.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            raise PipelineError(f"draft worker failed: {e}") from e
        if result is grpc.aio.EOF:
            raise PipelineError("draft worker closed its stream")
        return result

    async def close(self) -> None:
        for s in self.stages + ([self.draft] if self.draft else []):
            if s.writer is not None:
                s.writer.cancel()
            if s.call is not None:
                s.call.cancel()
            await s.channel.close()
        self.stages = []
        self.draft = None
