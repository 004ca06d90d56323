"""Run a kernel test file under Triton's CPU interpreter, in a fresh process.

TRITON_INTERPRET must be set before a kernel is defined (at import), so a test module that
finds it unset re-runs itself in a subprocess with it set, whatever else this session imported.
The kernel files of a session share their interpreted processes: one per core, each running a
share of the files balanced by their launchers' `seconds` (the interpreter runs one core, and
importing torch, Triton and the kernels cost 5-8 s a process on CI's two cores). The first
launcher test to run starts them for every launcher tests/conftest.py found selected; each
launcher then passes or fails on its own file's tests alone. With STRATA_SLOW_TESTS=1 they run
the files' slow cases too (`-m slow` selects no launcher: name the files).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Test files (resolved paths) whose launcher tests this session selected, with the seconds their
# tests take under the interpreter (a hint for sharing them out); filled by tests/conftest.py.
PLANNED: dict[Path, float] = {}
# The interpreted runs' results: file -> its test cases' (name, outcome, details); and output.
_RESULTS: dict[Path, list[tuple[str, str, str, float]]] = {}
_OUTPUT: dict[Path, str] = {}
# The interpreted runs are one test's call: under pytest-timeout's 600 s (pyproject.toml).
MAX_RUN_SECONDS = 570


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


def plan_interpreted_runs(items) -> None:
    """The files of the selected launcher tests: those marked triton_interpreter(seconds=...)."""
    PLANNED.clear()
    for item in items:
        marker = item.get_closest_marker("triton_interpreter")
        if marker is not None:
            PLANNED[Path(str(item.fspath)).resolve()] = marker.kwargs.get("seconds", 10.0)


def rerun_under_interpreter(test_file: str | Path, timeout: float) -> None:
    """test_file's tests under the interpreter, from the session's interpreted runs (started here
    if none ran yet, for every planned file; a file nobody planned runs on its own)."""
    path = Path(test_file).resolve()
    if path not in _RESULTS:
        if path in PLANNED:
            _run_interpreted(list(PLANNED), MAX_RUN_SECONDS)
        else:
            _run_interpreted([path], timeout)
    cases = _RESULTS.get(path, [])
    failed = [(name, outcome, detail) for name, outcome, detail, _ in cases if outcome in ("failed", "error")]
    passed = sum(outcome == "passed" for _, outcome, _, _ in cases)
    seconds = sum(t for *_, t in cases)
    print(
        f"{path.name} under the interpreter: {passed} passed, {len(failed)} failed, {len(cases)} in all, {seconds:.1f} s"
    )
    for name, outcome, detail in failed:
        print(f"--- {outcome}: {name}\n{detail[-6000:]}")
    assert cases, f"no test of {path.name} ran under the interpreter:\n{_OUTPUT.get(path, '')[-20000:]}"
    assert not failed and passed, [name for name, _, _ in failed]


def _shares(files: list[Path], processes: int) -> list[list[Path]]:
    """The files in `processes` groups of about equal planned seconds (longest first)."""
    groups: list[list[Path]] = [[] for _ in range(min(processes, len(files)))]
    load = [0.0] * len(groups)
    for path in sorted(files, key=lambda p: -PLANNED.get(p, 10.0)):
        i = load.index(min(load))
        groups[i].append(path)
        load[i] += PLANNED.get(path, 10.0)
    return groups


def _run_interpreted(files: list[Path], timeout: float) -> None:
    """Every file's tests under the interpreter: a share of the files per core, each share in a
    pytest process of its own, all at once."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, share in enumerate(_shares(files, len(os.sched_getaffinity(0)))):
            report, log = Path(tmp) / f"share{i}.xml", open(Path(tmp) / f"share{i}.log", "w+")
            # A file that fails to collect fails its own launcher only: the others still run.
            argv = [sys.executable, "-m", "pytest", *map(str, share), "-q", "-p", "no:cacheprovider"]
            argv += ["--continue-on-collection-errors", f"--junitxml={report}"]
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            runs.append((share, report, log, proc))
        deadline = time.monotonic() + timeout
        for share, report, log, proc in runs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
                note = ""
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                note = f"timed out after {timeout:.0f} s\n"
            log.seek(0)
            output = note + log.read()
            log.close()
            print(output[-3000:])
            for path in share:
                _OUTPUT[path] = output
                _RESULTS[path] = []
            if report.exists():
                _read_report(report, share)


def _read_report(report: Path, share: list[Path]) -> None:
    by_module = {_module_name(path): path for path in share}
    for case in ElementTree.parse(report).iter("testcase"):
        classname = case.get("classname", "")
        path = by_module.get(classname) or by_module.get(classname.rpartition(".")[0])  # a test class's
        if path is None:
            continue
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = (child.get("message") or "") + "\n" + (child.text or "")
                break
        _RESULTS[path].append((case.get("name", "?"), outcome, detail, float(case.get("time", 0.0))))


def _module_name(path: Path) -> str:
    """junitxml's classname of a module's test functions: the module's dotted path."""
    return ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)


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
