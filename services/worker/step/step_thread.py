"""The worker's step thread: plans run back to back on it, results leave from the finisher
thread, and the event loop only queues plans and writes results. (Not the scheduler's engine
loop, services/scheduler/engine.py, which builds and sends the plans.)

Each plan used to go event loop -> step thread -> event loop (one run_in_executor per plan), and
each result event loop -> finisher -> event loop. Between two launches the step thread then
waited for two thread wake-ups and a turn of the event loop, a share of the last stage's step
thread that shows where that host bounds a two-stage pipeline (bench/RESULTS.md, "Figures moved
from code comments").

Here the step thread takes the next queued plan itself, and goes back to its pool only when none
is queued (InitCache shares that one thread, between drains). Steps and results stay in step
order: one step thread, one finisher thread, each first in, first out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("strata.worker")


class StepThread:
    """Plans queued from the event loop (put), run by `run_plan` on `executor`'s single thread."""

    def __init__(self, executor: ThreadPoolExecutor, run_plan):
        self.executor, self.run_plan = executor, run_plan
        self._lock = threading.Lock()
        self._plans: collections.deque = collections.deque()
        self._draining = False  # a drain is queued or running: it takes what put adds
        self._last: Future | None = None

    def put(self, plan) -> None:
        """From the event loop."""
        with self._lock:
            self._plans.append(plan)
            if self._draining:
                return
            self._draining = True
        self._last = self.executor.submit(self._drain)

    def drop(self) -> None:
        """Plans not started yet are dropped (their stream is gone)."""
        with self._lock:
            self._plans.clear()

    async def join(self) -> None:
        """Until every plan put so far has run (no put may come meanwhile)."""
        if self._last is not None:
            await asyncio.wrap_future(self._last)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._plans:
                    self._draining = False
                    return
                plan = self._plans.popleft()
            try:
                self.run_plan(plan)
            except Exception:  # run_plan reports a failed step itself; this is a bug, not a step
                log.exception("step %d: the step thread failed", plan.step_id)


class ResultOut:
    """The finisher's end: each launched step's result is fetched (`finish`, waiting for the
    GPU) and handed to the event loop's queue, in the order `put` was called."""

    def __init__(self, finisher: ThreadPoolExecutor, loop: asyncio.AbstractEventLoop, results: asyncio.Queue, finish):
        self.finisher, self.loop, self.results, self.finish = finisher, loop, results, finish

    def put(self, item) -> None:
        """From the step thread: a launched step's pending result, or a finished message."""
        self.finisher.submit(self._hand, item)

    async def close(self) -> None:
        """After the last put: the queue's end marker, behind every result."""
        await asyncio.wrap_future(self.finisher.submit(self._hand, None))

    def _hand(self, item) -> None:
        msg = self.finish(item) if item is not None else None
        self.loop.call_soon_threadsafe(self.results.put_nowait, msg)
