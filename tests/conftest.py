"""Markers CI skips by design: `slow` runs only with STRATA_SLOW_TESTS=1 (gpu and docker tests
skip themselves when there is no GPU or no Docker engine)."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("STRATA_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set STRATA_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
