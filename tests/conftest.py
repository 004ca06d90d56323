"""Markers CI skips by design: `slow` runs only with STRATA_SLOW_TESTS=1 (gpu and docker tests
skip themselves when there is no GPU or no Docker engine). After collection, the selected
Triton-interpreter launchers are planned into one interpreted run (tests/triton_interpreter.py)."""

from __future__ import annotations

import os
import sys

import pytest


def pytest_configure(config):
    # Registered here rather than in pyproject.toml, whose edits rebuild the container tests' image.
    config.addinivalue_line(
        "markers",
        "triton_interpreter(seconds): re-runs its file's kernel tests under TRITON_INTERPRET=1, which take about"
        " `seconds` (the files share a process per core, tests/triton_interpreter.py)",
    )


def pytest_collection_modifyitems(config, items):
    # STRATA_SLOW_TESTS is the test suite's own variable, not a service switch (strata/flags.py).
    if os.environ.get("STRATA_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set STRATA_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    from tests.triton_interpreter import plan_interpreted_runs

    plan_interpreted_runs(session.items)


def pytest_sessionfinish(session):
    if "tests.cluster" in sys.modules:  # the clusters tests shared (tests/cluster.py)
        sys.modules["tests.cluster"].stop_shared_clusters()
