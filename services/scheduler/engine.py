"""The engine loop (Engine._engine_loop): submit plans, collect results, keep up to P plans in flight,
the two-stage loop of the seeds' pipeline RFC. (Not the workers' step thread, which runs the plans:
services/worker/step/step_thread.py.)

All scheduler state is touched from this one asyncio loop and scheduling itself never awaits,
so there are no locks. Plans in flight cover disjoint requests (the scheduler guarantees it);
every stage executes plans in step order.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from strata.services.scheduler import prompt_logprobs
from strata.services.scheduler.engine_config import SchedulerConfig, default_micro_batches, plans_in_flight
from strata.services.scheduler.output_stream import OutputStream, RequestFailed, deliver, deliver_running
from strata.services.scheduler.pipeline import Pipeline, PipelineError
from strata.services.scheduler.plan_codec import plan_to_proto, split_proposals, split_result, split_rounds
from strata.services.scheduler.plan_pacing import PlanHold
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.draft_proposer import draft_plan, fill_drafts, link_drafts
from strata.v1 import engine_pb2

log = logging.getLogger("strata.scheduler")


# A step may take this many times the slowest of the last 64 before its stage counts as hung.
SLOW_STEP_MARGIN = 4.0


class Engine:
    def __init__(self, pipeline: Pipeline, config: SchedulerConfig, on_serving=None):
        self.pipeline = pipeline
        self.config = config
        self._on_serving = on_serving  # async (bool) -> None: health follows the pipeline
        self.scheduler: Scheduler | None = None
        self.streams: dict[str, OutputStream] = {}
        self.in_flight: collections.deque = collections.deque()
        self._results: collections.deque[engine_pb2.StepResult] = collections.deque()  # received, not applied
        self._wake = asyncio.Event()
        # A draft model's proposals sent over the draft link, and those the draft worker failed.
        self.linked_proposals = self.failed_proposals = 0
        self._deadlines: collections.deque[float] = collections.deque()  # seconds each plan in flight may take
        self._last_result = 0.0
        self._recent_step_seconds: collections.deque[float] = collections.deque(maxlen=64)
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._busy_since: float | None = None
        self._busy_seconds = 0.0
        self._started = time.monotonic()
        # The last stage's CUDA-event view: [busy seconds, idle seconds, timed steps].
        self._worker_gpu = [0.0, 0.0, 0]
        self._worker_launch_seconds = 0.0
        self._host_seconds = 0.0  # this loop's own work on results and plans (SchedulerStats.host_seconds)
        # Where plans wait (SchedulerStats): their round trips, and this loop's waits for a result
        # [at the limit of plans in flight, below it].
        self._round_trip_seconds = 0.0
        self._result_waits = [0.0, 0.0]
        # One stage: the next plan waits while those in flight keep the GPU busy (plan_pacing.py).
        self._pacing = PlanHold(self._wake.set)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.pipeline.on_failure = self._wake.set  # a plan that could not be written
        await self._connect()
        self._task = asyncio.create_task(self._engine_loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.pipeline.close()

    async def _connect(self, timeout: float | None = None) -> None:
        self._ready.clear()
        await self.pipeline.connect(self.config.max_kv_blocks or None, timeout)
        desc = self.pipeline.model_info
        old = self.scheduler
        if old is not None and (desc.block_size, desc.model.max_model_len, desc.model_fingerprint) == (
            old.block_size,
            old.max_model_len,
            old.block_manager.cache_salt,
        ):
            # The pipeline is back (the same workers, or replacements of the same model): the
            # requests resume by recompute on the fresh caches.
            old.reset_kv(self.pipeline.num_kv_blocks)
            self._ready.set()
            return
        self.scheduler = Scheduler(
            num_blocks=self.pipeline.num_kv_blocks,
            block_size=desc.block_size,
            max_model_len=desc.model.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
            cascade_attention=self.config.cascade_attention,
            cache_salt=desc.model_fingerprint,
            # With one stage the worker that samples also embeds: it can fill in the token itself,
            # so every plan in flight but the first can be a lookahead of the same requests. With P
            # stages the last stage hands its tokens to stage 0 (pipelined decode), and a request
            # may be in P + 1 plans: its micro-batch's next plans go out before results come back.
            decode_lookahead=self.max_in_flight - 1 if self.pipeline.num_stages == 1 else self.lookahead_stages,
            speculation=self.config.speculation,
            num_micro_batches=self.num_micro_batches,
            micro_batch_min_seqs=self.config.micro_batch_min_seqs,
            decode_repeats=self.config.decode_repeats,
            pipeline_stages=self.pipeline.num_stages,
        )
        self._ready.set()

    @property
    def pipelined(self) -> bool:
        """P > 1 stages whose last hands its sampled tokens to stage 0 (decode lookahead on P stages)."""
        return self.pipeline.num_stages > 1 and bool(self.pipeline.token_transport) and self.config.pipelined_decode

    @property
    def lookahead_stages(self) -> int:
        return self.pipeline.num_stages if self.pipelined else 0

    @property
    def num_micro_batches(self) -> int:
        if not self.pipelined:
            return 1
        if self.config.pipeline_micro_batches:
            return self.config.pipeline_micro_batches
        return default_micro_batches(self.pipeline.num_stages, self.pipeline.stages_share_one_gpu)

    @property
    def paces_plans(self) -> bool:
        """One stage: the next plan waits while those in flight keep the GPU busy (plan_pacing.py)."""
        return self.pipeline.num_stages == 1 and self.config.plan_pacing

    @property
    def max_in_flight(self) -> int:
        if self.config.max_plans_in_flight:
            return self.config.max_plans_in_flight
        if self.pipelined or self.pipeline.num_stages == 1:
            return plans_in_flight(self.pipeline.num_stages, self.num_micro_batches)
        return self.pipeline.num_stages  # P stages without pipelined decode: one plan per stage

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # ------------------------------------------------------------ requests

    async def wait_ready(self) -> None:
        """Waits while the pipeline (re)connects; RequestFailed(UNAVAILABLE) after reconnect_timeout."""
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self.config.reconnect_timeout)
            except asyncio.TimeoutError:
                raise RequestFailed("UNAVAILABLE", "the worker pipeline is not available") from None

    async def submit(self, request: Request, final_only: bool = False) -> OutputStream:
        await self.wait_ready()
        return self.add(request, final_only)

    def add(self, request: Request, final_only: bool = False, on_ready=None) -> OutputStream:
        """Admits a request to the queue (the pipeline ready) and returns its output stream;
        raises RequestFailed. on_ready: OutputStream's."""
        if request.request_id in self.streams:
            raise RequestFailed("ALREADY_EXISTS", f"request_id {request.request_id!r} is already running")
        try:
            self.scheduler.add_request(request)
        except ValueError as e:
            raise RequestFailed("INVALID_ARGUMENT", str(e)) from None
        stream = OutputStream(
            request.request_id, len(request.prompt_token_ids), final_only, request.output_token_ids, on_ready
        )
        self.streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Frees the request's blocks at once (also when it is in a plan in flight)."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        if self.scheduler is not None:
            self.scheduler.abort(request_id)
        stream.push((), (), finish_reason=engine_pb2.FINISH_REASON_ABORT)
        self._wake.set()
        return True

    # ------------------------------------------------------------ loop

    async def _engine_loop(self) -> None:
        readers: list[asyncio.Task] = []  # the last stage's results (and the draft worker's, with the draft link)
        try:
            while True:
                try:
                    if not readers:
                        readers.append(asyncio.create_task(self._read_results()))
                        if self.pipeline.draft_transport:
                            readers.append(asyncio.create_task(self._read_draft_results()))
                    started = time.perf_counter()
                    await self._fill_pipeline()
                    if self._results:
                        # One result, then straight back to scheduling: the next plan goes out first.
                        self._finish_step(self._results.popleft())
                        self._host_seconds += time.perf_counter() - started
                        continue
                    self._host_seconds += time.perf_counter() - started
                    for reader in readers:
                        if reader.done():
                            reader.result()  # re-raises the stage's failure
                    self.pipeline.raise_if_failed()
                    if not self.in_flight:
                        self._mark_idle()
                    self._wake.clear()
                    await self._wait_for_results()
                except Exception as e:  # a lost stage, or a bug: never leave requests hanging
                    if not isinstance(e, PipelineError):
                        log.exception("engine loop failed")
                    for reader in readers:
                        reader.cancel()
                    readers = []
                    self._results.clear()
                    await self._recover(e)
        finally:  # stop() cancels the loop: the readers go with it
            for reader in readers:
                reader.cancel()

    async def _wait_for_results(self) -> None:
        """Waits for a result (or a request) until the oldest plan in flight is overdue: a stage
        that misses a step's deadline is treated as lost."""
        if not self.in_flight:
            await self._wake.wait()
            return
        # Plans run one after another: the oldest started when the previous result came back.
        now = time.monotonic()
        started = max(self.in_flight[0].sent_at, self._last_result)
        timeout = started + self._deadlines[0] - now
        at_limit = len(self.in_flight) >= self.max_in_flight
        try:
            await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise PipelineError(
                f"step {self.in_flight[0].step_id} missed its {self._deadlines[0]:.1f} s deadline (a hung stage)"
            ) from None
        finally:
            self._result_waits[0 if at_limit else 1] += time.monotonic() - now

    async def _read_draft_results(self) -> None:
        """With the draft link: the draft worker's results (each proposal also went to the stage).
        A failed proposal costs only acceptance (the stage verifies whatever drafts it holds, and
        its tokens stay exact); a lost draft worker ends this reader, and the loop rebuilds."""
        try:
            while True:
                result = await self.pipeline.draft_result()
                if result.error:
                    self.failed_proposals += 1
                    log.warning(
                        "draft worker: step %d: %s (verified against older drafts)", result.step_id, result.error
                    )
        finally:
            self._wake.set()

    async def _read_results(self) -> None:
        """Moves the last stage's results into self._results as they arrive and wakes the loop
        (one long-lived reader: no task per step)."""
        try:
            while True:
                self._results.append(await self.pipeline.receive())
                self._wake.set()
        finally:
            self._wake.set()  # a failed stream wakes the loop too, which re-raises the error

    async def _fill_pipeline(self) -> None:
        while len(self.in_flight) < self.max_in_flight:
            if self.in_flight and self._hold_next_plan():
                return
            plan = self.scheduler.schedule()
            if plan is None:
                return
            if self.pipeline.draft is not None:
                await self._propose_drafts(plan)
            msg = plan_to_proto(plan)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "step %d: %d sequences, %d verifying %d drafts, %d tokens, %d in flight, %d waiting",
                    plan.step_id,
                    len(plan.seqs),
                    sum(1 for s in plan.seqs if s.num_draft),
                    sum(s.num_draft for s in plan.seqs),
                    sum(s.num_scheduled for s in plan.seqs),
                    len(self.in_flight),
                    len(self.scheduler.waiting),
                )
            if self.paces_plans:
                self._pacing.sent(plan)
            plan.sent_at = time.monotonic()
            plan.after_idle = msg.after_idle = self._busy_since is None  # (the engine had nothing to run)
            self.in_flight.append(plan)
            self._deadlines.append(self._step_deadline(plan.num_tokens))
            self._mark_busy()
            self.pipeline.post(msg)
            # One turn of the loop a plan: the tokens just delivered go out to their streams (a
            # client's next token waits on that, not on this loop's next plan).
            await asyncio.sleep(0)

    def _hold_next_plan(self) -> bool:
        """One stage: whether the next plan waits for the plans in flight (plan_pacing.py); never
        for a backlog that fills it already."""
        if not self.paces_plans or self.scheduler.waiting_fill_a_plan():
            return False
        return self._pacing.hold(self.in_flight, max(self.in_flight[0].sent_at, self._last_result))

    def _step_deadline(self, tokens: int) -> float:
        """Seconds a step of `tokens` tokens may take before its stage counts as hung."""
        scaled = self.config.step_timeout * max(0.1, tokens / self.config.max_num_batched_tokens)
        return max(scaled, SLOW_STEP_MARGIN * max(self._recent_step_seconds, default=0.0))

    async def _propose_drafts(self, plan) -> None:
        """The draft model's tokens for the plan's speculating sequences: with the draft link,
        the draft plan goes out first and the proposal straight to the stage (its result comes
        back to _read_draft_results); else the engine waits for it and fills the plan."""
        k = self.config.speculation.num_speculative_tokens
        msg = draft_plan(plan, k, self.scheduler.spec.draft_releases)
        if msg is not None and self.pipeline.draft_transport:  # the tokens go straight to the stage
            link_drafts(plan)
            await self.pipeline.send_draft(msg)
            self.linked_proposals += 1
        elif msg is not None:
            try:
                result = await asyncio.wait_for(self.pipeline.propose(msg), self.config.step_timeout)
            except asyncio.TimeoutError:
                raise PipelineError(f"the draft worker missed its {self.config.step_timeout:.0f} s deadline") from None
            fill_drafts(plan, result, k)

    def _finish_step(self, result: engine_pb2.StepResult) -> None:
        plan = self.in_flight.popleft()
        self._deadlines.popleft()
        now = time.monotonic()
        step_seconds = now - max(plan.sent_at, self._last_result)
        self._round_trip_seconds += now - plan.sent_at
        pipelined = plan.sent_at < self._last_result  # sent before the previous result came back
        self._recent_step_seconds.append(step_seconds)
        if self.paces_plans:
            timed = result.gpu_seconds > 0 and not plan.after_idle  # (the GPU waiting for clients is no bubble)
            self._pacing.done(plan, step_seconds, result.gpu_idle_seconds if timed else None)
        self._last_result = now
        if result.step_id != plan.step_id:
            raise PipelineError(f"result for step {result.step_id} while expecting {plan.step_id}")
        if log.isEnabledFor(logging.DEBUG):  # per-step timeline, beside the plan's line in _fill_pipeline
            log.debug(
                "step %d done: GPU %.3f ms in the step, %.3f ms idle before it, %.3f ms launching",
                result.step_id,
                result.gpu_seconds * 1e3,
                result.gpu_idle_seconds * 1e3,
                result.launch_seconds * 1e3,
            )
        if result.gpu_seconds > 0:
            self._worker_gpu[0] += result.gpu_seconds
            if not plan.after_idle:  # the GPU waiting for clients is no bubble
                self._worker_gpu[1] += result.gpu_idle_seconds
            self._worker_gpu[2] += 1
        self._worker_launch_seconds += result.launch_seconds
        if result.error and result.peer_lost:  # a stage is gone: rebuild, the requests resume
            raise PipelineError(f"step {plan.step_id}: {result.error}")
        try:
            if result.error:
                self.scheduler.retire(plan)
                raise RuntimeError(result.error)
            if not result.logprobs and not plan.asks_prompt_logprobs:  # most steps: one token each, fused
                fused = self.scheduler.update_one_token_each(plan, list(result.seq_ids), list(result.token_ids))
                if fused is not None:
                    running, tokens, others = fused
                    deliver_running(self.streams, running, tokens)
                    for upd in others:
                        deliver(self.streams, upd)
                    return
            sampled, logprobs = split_result(result)
            if plan.asks_prompt_logprobs:  # before update() ends a request
                self.scheduler.counters.prompt_logprob_positions += prompt_logprobs.receive(plan, result)
            spec = self.scheduler.spec
            if spec is not None and result.gpu_seconds > 0:
                # The cost model: what a step costs the pipeline (result to result, the host's
                # part included: a host-bound batch gains from fewer steps), on GPU workers, and
                # the tokens it emitted.
                spec.observe(plan, max(step_seconds, result.gpu_seconds), now, len(result.token_ids), pipelined)
            updates = self.scheduler.update(
                plan,
                sampled,
                split_proposals(result) if spec is not None else None,
                split_rounds(result) if plan.verify_rounds > 1 else None,
            )
        except Exception as e:
            # A failed step poisons only its own requests; the workers keep serving.
            log.error("step %d failed: %s", plan.step_id, e)
            for seq in plan.seqs:
                self._fail(seq.request.request_id, "INTERNAL", f"step failed: {e}")
            # Blocks are cached when scheduled: this step's may never have been written.
            self.scheduler.reset_prefix_cache()
            return
        # Mapping requests to seq ids only when some request asked for logprobs (rarely).
        seq_of = {seq.request.request_id: seq.seq_id for seq in plan.seqs} if logprobs else {}
        for upd in updates:
            deliver(self.streams, upd, logprobs.get(seq_of.get(upd.request.request_id)) if logprobs else None)

    def _fail(self, request_id: str, code: str, message: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(RequestFailed(code, message))
        if self.scheduler is not None:
            self.scheduler.abort(request_id)

    async def _recover(self, error: Exception) -> None:
        """A stage went away (or the loop hit a bug). A lost or hung stage: the requests pause
        while the pipeline reconnects (the same workers back, or replacements) and then resume by
        recompute, drawing the tokens they would have drawn; only past stage_recovery_timeout do
        they fail with UNAVAILABLE. A bug: the running requests fail, so it cannot repeat."""
        lost_stage = isinstance(error, PipelineError)
        log.error(
            "%s: %s; %s %d request(s)",
            "pipeline failure" if lost_stage else "engine failure",
            error,
            "pausing" if lost_stage else "failing",
            len(self.streams),
        )
        self.in_flight.clear()
        self._deadlines.clear()
        self._mark_idle()
        if not lost_stage:
            for request_id in list(self.streams):
                self._fail(request_id, "INTERNAL", f"the engine failed: {error}")
        self._ready.clear()
        await self._set_serving(False)
        give_up = time.monotonic() + self.config.stage_recovery_timeout
        while True:
            try:
                await self._connect(timeout=5.0)  # short tries: the give-up time is checked between them
                break
            except PipelineError as e:
                if self.streams and time.monotonic() > give_up:
                    log.error(
                        "the pipeline is still down after %.0f s: failing %d request(s)",
                        self.config.stage_recovery_timeout,
                        len(self.streams),
                    )
                    for request_id in list(self.streams):
                        self._fail(request_id, "UNAVAILABLE", f"a pipeline stage is lost: {error}")
                log.warning("reconnect failed: %s; retrying", e)
                await asyncio.sleep(0.5)
        log.info("pipeline back: %d request(s) resume", len(self.streams))
        await self._set_serving(True)

    async def _set_serving(self, serving: bool) -> None:
        if self._on_serving is not None:
            await self._on_serving(serving)

    # ------------------------------------------------------------ stats

    def _mark_busy(self) -> None:
        if self._busy_since is None:
            self._busy_since = time.monotonic()

    def _mark_idle(self) -> None:
        if self._busy_since is not None:
            self._busy_seconds += time.monotonic() - self._busy_since
            self._busy_since = None

    def stats(self) -> engine_pb2.SchedulerStats:
        stats = engine_pb2.SchedulerStats()
        if self.scheduler is not None:
            self.scheduler.fill_stats(stats)
        busy = self._busy_seconds + (time.monotonic() - self._busy_since if self._busy_since else 0.0)
        wall = max(time.monotonic() - self._started, 1e-9)
        stats.gpu_idle_fraction = 1.0 - min(busy / wall, 1.0)
        stats.pipeline_stages = self.pipeline.num_stages
        stats.busy_seconds = busy
        stats.worker_gpu_busy_seconds, stats.worker_gpu_idle_seconds, stats.worker_timed_steps = self._worker_gpu
        stats.worker_launch_seconds = self._worker_launch_seconds
        stats.host_seconds = self._host_seconds
        stats.plan_round_trip_seconds = self._round_trip_seconds
        stats.wait_at_limit_seconds, stats.wait_below_limit_seconds = self._result_waits
        stats.spec_decode_linked_proposals = self.linked_proposals
        stats.spec_decode_failed_proposals = self.failed_proposals
        return stats
