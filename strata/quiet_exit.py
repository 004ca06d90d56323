"""A service's last step after its clean shutdown: end the process without the interpreter's
finalization.

Extension modules report, at finalization, the objects of theirs that are still alive: a GPU
worker's Triton bindings printed a `nanobind: leaked ...` line for each of their objects still
held by torch's and Triton's caches, after a clean shutdown, burying the service's own last lines
under Ctrl-C of `strata serve`. Nothing is left to release once the service has stopped (its
server, links and threads are done; the OS frees the rest), so after the shutdown the process
runs its atexit handlers (a closed NCCL link's teardown waits in one), flushes its logs and
streams, and leaves with os._exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn


def quiet_exit(code: int = 0) -> NoReturn:
    """Ends the process with `code` after its atexit handlers and a flush of logs and streams;
    call it only once the service's own shutdown is complete."""
    try:
        atexit._run_exitfuncs()  # what a normal exit runs first (then clears them)
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed or replaced streams
                pass
        os._exit(code)
