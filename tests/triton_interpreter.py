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


def can_run_interpreted_here(*module_names: str) -> bool:
    """TRITON_INTERPRET is set and none of these kernel modules was imported (by an earlier test
    of this session) with compiled kernels: then the kernels run interpreted in this process."""
    if not interpreter_active():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    def interpreted(module) -> bool:
        return all(
            isinstance(value, InterpretedFunction)
            for name, value in vars(module).items()
            if name.startswith("_") and name.endswith("_kernel")
        )

    return all(name not in sys.modules or interpreted(sys.modules[name]) for name in module_names)


def rerun_under_interpreter(test_file: str | Path, timeout: float) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-q", "-x", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    print(output[-3000:])
    assert proc.returncode == 0, output[-20000:]
    assert " passed" in output and " failed" not in output


def compiled_gpu_kernels_only() -> list:
    """pytestmark of the GPU kernel tests: a CUDA GPU, and kernels compiled for it."""
    import pytest
    import torch

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        pytest.mark.skipif(
            interpreter_active(), reason="TRITON_INTERPRET=1 would run the kernels in the CPU interpreter"
        ),
    ]
