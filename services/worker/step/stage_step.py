"""One plan's step on this stage's step thread, around the runner's launch: the activations taken
from the link (or awaited from the event loop, with the transport's deadline), the launch inside
the profile window, the stage's timeline and GPU clock stamps, and the outputs handed on (to the
next stage's link, or the last stage's sampled tokens to stage 0). The server's _run_one calls
these; a failed step's error goes on in step order from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from strata.services.worker.diagnostics.profiling import StepProfiler
from strata.services.worker.diagnostics.stage_stats import StageStats
from strata.services.worker.speculation.draft_steps import DraftProposal
from strata.services.worker.step.step_results import PendingResult
from strata.services.worker.transport.stage_transport import Receiver, Sender, StepFailed
from strata.services.worker.transport.token_handoff import TokenIntake, TokenOutlet
from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.worker.runner import ModelRunner

log = logging.getLogger("strata.worker")


def on_loop(loop, coro, timeout: float):
    """From the step thread: `coro`'s result, run on the event loop; a wait past `timeout` (the
    transport's deadline) fails the step, so a lost peer never holds the step thread."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise StepFailed(f"stage transport: no activations within {timeout:g} s") from None


def fetch_result(item):
    """On the finisher thread: a launched step's StepResult, once its GPU work is done."""
    if isinstance(item, (PendingResult, DraftProposal)):
        try:
            return item.finish()
        except Exception as e:
            log.exception("step %d failed while fetching its result", item.step_id)
            return engine_pb2.StepResult(step_id=item.step_id, error=f"{type(e).__name__}: {e}")
    return item


def on_step_thread(profiler: StepProfiler, launch):
    """A step's launch on the step thread, where a profile window starts and ends (a trace then
    holds the step thread's Python and CPU ops)."""
    profiler.step_launched()
    return launch()


def _token_wait_seconds(runner: ModelRunner) -> float:
    handoff = runner.handoff
    return handoff.wait_seconds if isinstance(handoff, TokenIntake) else 0.0


def _launch(runner: ModelRunner, plan, inputs):
    """inputs: (hidden, residual), None on stage 0, or an ipc link's take, which the runner calls
    once the step's host inputs are built (raises StepFailed)."""
    if callable(inputs):
        return runner.execute(plan, take_inputs=inputs)
    return runner.execute(plan, *(inputs or ()))


def _step_thread_waits(runner: ModelRunner, receiver: Receiver | None) -> float:
    """The step thread's waits inside a launch so far: tokens (stage 0), activations (ipc)."""
    return _token_wait_seconds(runner) + (receiver.wait_seconds if receiver is not None else 0.0)


def execute_and_send(
    runner: ModelRunner, stats: StageStats, receiver: Receiver | None, sender: Sender | None, plan, inputs
) -> None:
    """On the step thread: launch the step, hand its activations to the transport (no wait)."""
    start, waited = time.perf_counter(), _step_thread_waits(runner, receiver)
    out = _launch(runner, plan, inputs)
    stats.step(runner.gpu_start, start, _step_thread_waits(runner, receiver) - waited, plan.after_idle)
    if runner.clock:
        runner.clock.stamp(plan.step_id, "body")
    if sender is not None:
        sender.send(plan.step_id, *out)
    if runner.clock:
        runner.clock.stamp(plan.step_id, "handed")


def execute_last(runner: ModelRunner, stats: StageStats, receiver: Receiver | None, token_sender, plan, inputs):
    """On the last stage's step thread: launch the step, then hand its sampled tokens to stage 0
    (pipelined decode) on the device, behind the draw."""
    start, waited = time.perf_counter(), _step_thread_waits(runner, receiver)
    out = _launch(runner, plan, inputs)
    if runner.clock:
        runner.clock.stamp(plan.step_id, "body")
    if token_sender is not None and isinstance(runner.handoff, TokenOutlet):
        runner.handoff.hand(plan.step_id, token_sender)
    if runner.clock:
        runner.clock.stamp(plan.step_id, "handed")
    stats.step(runner.gpu_start, start, _step_thread_waits(runner, receiver) - waited, plan.after_idle)
    return out
