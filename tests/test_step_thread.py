"""The worker's step thread (services/worker/step/step_thread.py): plans queued from the event loop run in
order on the one step thread, back to back, and that thread is free between drains (InitCache
runs there); results reach the event loop in the order they were put."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from strata.services.worker.step.step_thread import ResultOut, StepThread


def test_plans_run_in_order_on_one_thread_and_the_thread_is_free_between_drains():
    async def main():
        executor = ThreadPoolExecutor(max_workers=1)
        ran, threads, gate = [], set(), threading.Event()

        def run_plan(plan):
            gate.wait(5)  # the first plan holds the thread while the rest queue up
            ran.append(plan.step_id)
            threads.add(threading.get_ident())

        steps = StepThread(executor, run_plan)
        for i in range(5):
            steps.put(SimpleNamespace(step_id=i))
        other = asyncio.get_running_loop().run_in_executor(executor, lambda: list(ran))  # as InitCache
        gate.set()
        await steps.join()
        assert ran == [0, 1, 2, 3, 4] and len(threads) == 1
        assert await other == [0, 1, 2, 3, 4]  # one drain took all five; InitCache came after it
        steps.put(SimpleNamespace(step_id=5))  # a new drain once the last one ended
        await steps.join()
        assert ran[-1] == 5
        executor.shutdown()

    asyncio.run(main())


def test_dropped_plans_never_run_and_a_failing_plan_does_not_stop_the_loop():
    async def main():
        executor = ThreadPoolExecutor(max_workers=1)
        ran, gate, started = [], threading.Event(), threading.Event()

        def run_plan(plan):
            started.set()
            gate.wait(5)
            if plan.step_id == 1:
                raise RuntimeError("a bug")
            ran.append(plan.step_id)

        steps = StepThread(executor, run_plan)
        for i in range(3):
            steps.put(SimpleNamespace(step_id=i))
        await asyncio.to_thread(started.wait, 5)  # step 0 is running: 1 and 2 wait in the queue
        gate.set()
        await steps.join()
        assert ran == [0, 2]

        gate.clear()
        started.clear()
        for i in range(3, 6):
            steps.put(SimpleNamespace(step_id=i))
        await asyncio.to_thread(started.wait, 5)
        steps.drop()  # 3 is running; 4 and 5 have not started
        gate.set()
        await steps.join()
        assert ran == [0, 2, 3]
        executor.shutdown()

    asyncio.run(main())


def test_results_reach_the_event_loop_in_order_with_the_end_marker_last():
    async def main():
        finisher = ThreadPoolExecutor(max_workers=1)
        results: asyncio.Queue = asyncio.Queue()

        def finish(item):
            time.sleep(0.01 if item % 2 else 0)  # uneven waits for the GPU
            return item * 10

        out = ResultOut(finisher, asyncio.get_running_loop(), results, finish)
        for item in range(6):
            out.put(item)
        await out.close()
        got = []
        while (msg := await results.get()) is not None:
            got.append(msg)
        assert got == [0, 10, 20, 30, 40, 50]
        finisher.shutdown()

    asyncio.run(main())
