"""`strata serve` keeps its cluster up: a worker or scheduler that exits is started again with its
own command line, so that the recovery paths can run (a restarted stage rejoins its pipeline and
the paused requests resume by recompute; a restarted scheduler brings its replica back, while the
gateway has resumed its requests on the other replicas). At most `limit` restarts of one service
in a minute: past that it keeps failing for a reason a restart will not fix, and the cluster
stops, as it does when the gateway exits.
"""

from __future__ import annotations

import subprocess
import time
from collections import deque

WINDOW_SECONDS = 60.0
# A service that just exited is started again after this pause (a port still held by the dying
# process, a device still being released).
BACKOFF_SECONDS = 1.0


class Supervisor:
    def __init__(self, cluster, limit: int, window: float = WINDOW_SECONDS, backoff: float = BACKOFF_SECONDS):
        self.cluster = cluster  # launcher.Cluster: its procs are (name, Popen), started with its environment
        self.limit = limit
        self.window = window
        self.backoff = backoff
        self._restarts: dict[str, deque[float]] = {}
        self._exited_at: dict[str, float] = {}
        self.log: list[str] = []  # what it did, for serve's stderr

    def check(self, now: float | None = None) -> str | None:
        """Restarts the services that exited (after the backoff); returns why the cluster must
        stop instead, or None."""
        now = time.monotonic() if now is None else now
        procs = self.cluster.procs
        for i, (name, proc) in enumerate(procs):
            code = proc.poll()
            if code is None:
                continue
            if name == "gateway" or self.limit <= 0:
                return f"{name} exited with code {code}"
            exited = self._exited_at.setdefault(name, now)
            if now - exited < self.backoff:
                continue
            recent = self._restarts.setdefault(name, deque())
            while recent and now - recent[0] > self.window:
                recent.popleft()
            if len(recent) >= self.limit:
                return f"{name} exited {len(recent) + 1} times within {self.window:.0f} s (code {code})"
            recent.append(now)
            del self._exited_at[name]
            procs[i] = (name, subprocess.Popen(proc.args, env=self.cluster.service_env()))
            self.log.append(f"{name} exited with code {code}; started again")
        return None
