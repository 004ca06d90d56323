"""Run a kernel test file under Triton's CPU interpreter, in a fresh process.

TRITON_INTERPRET must be set before a kernel is defined (at import), so a test module that
finds it unset re-runs itself in a subprocess with it set, whatever else this session imported.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def rerun_under_interpreter(test_file: str | Path, timeout: float) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-x", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    print(output[-3000:])
    assert proc.returncode == 0, output[-20000:]
    assert " passed" in output and " failed" not in output
