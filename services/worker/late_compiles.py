"""A warning for each Triton kernel variant first needed after the worker's warm-up.

Triton compiles a kernel per specialisation (constexprs, and runtime ints that are 1 or a
multiple of 16 unless told not to specialise on them). One first needed mid-serving costs a
compile of about a second (or a load from the disk cache) on the step thread, stalling every
request; the warm-up at cache init is meant to compile them all, and this says when it did not.
"""
from __future__ import annotations

import logging

log = logging.getLogger("strata.worker")


def warn_on_late_compiles() -> None:
    try:
        from triton import knobs
    except ImportError:  # CPU-only installs
        return

    def warn(*, repr: str, **_) -> None:
        log.warning("Triton kernel variant first needed while serving (stalls the step): %s", repr)

    knobs.runtime.jit_post_compile_hook = warn
