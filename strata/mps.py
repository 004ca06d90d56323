"""NVIDIA MPS for a cluster whose pipeline stages share a GPU (`strata serve --mps`).

Without MPS a GPU runs one process's context at a time and switches between them. Two stages on
one GPU hand each step to each other twice (activations, then sampled tokens), and each hand-off
left the GPU idle while it switched contexts, a large share of a small decode step. Under an MPS
server the stages' work shares one context and runs without the switch (bench/RESULTS.md, issue
29, and "Figures moved from code comments").

The daemon started here is the cluster's own: a private pipe and log folder (processes find an
MPS server through $CUDA_MPS_PIPE_DIRECTORY), started before the workers and told to quit after
they stop. It changes no GPU setting (compute mode stays as it is).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the daemon's own default


def mps_serves_this_process() -> bool:
    """Whether an MPS control daemon listens where this process's CUDA would look for one."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    return (Path(pipe) / "control").exists()


class MpsDaemon:
    """An MPS control daemon in a private folder; `env` points a child process at it."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="strata-mps-"))
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log"),
        }
        self.running = False

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CONTROL, *args],
            input=stdin,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
        )

    def start(self) -> None:
        if shutil.which(CONTROL) is None:
            self.cleanup()
            raise SystemExit(f"--mps: {CONTROL} is not on PATH (it ships with the NVIDIA driver)")
        for folder in self.env.values():
            Path(folder).mkdir(parents=True)
        done = self._run(["-d"])
        if done.returncode != 0:
            log = self.folder / "log" / "control.log"
            detail = (done.stderr or "").strip() or (log.read_text()[-500:] if log.exists() else "")
            self.cleanup()
            raise SystemExit(f"--mps: {CONTROL} -d failed (exit {done.returncode}): {detail}")
        self.running = True

    def stop(self) -> None:
        """Asks the daemon to quit (its server exits once the workers are gone) and removes the folder."""
        if self.running:
            self.running = False
            try:
                self._run([], stdin="quit\n")
            except (OSError, subprocess.TimeoutExpired):
                pass  # the folder goes anyway; a daemon left behind serves nobody else
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
