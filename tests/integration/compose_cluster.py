"""Drives one docker-compose project (the repo's docker-compose.yml) for the container tests."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from docker_engine import DockerEngine, run

SERVICES = ("worker0", "worker1", "scheduler", "gateway")


class ComposeCluster:
    """`docker-compose -p PROJECT` over the repo's compose file, with bounded waits."""

    def __init__(
        self,
        engine: DockerEngine,
        repo_root: Path,
        project: str,
        env: dict[str, str],
        files: tuple[str, ...] = ("docker-compose.yml",),
    ) -> None:
        self.engine, self.repo_root, self.project = engine, repo_root, project
        self.env = {**engine.env, **env}
        self.files = files

    def _command(self, *args: str) -> list[str]:
        file_args = [a for f in self.files for a in ("-f", str(self.repo_root / f))]
        return [*self.engine.compose, *file_args, "-p", self.project, *args]

    def compose(self, *args: str, timeout: float = 120, check: bool = True):
        return run(self._command(*args), timeout=timeout, env=self.env, check=check, cwd=self.repo_root)

    # ------------------------------------------------------------ state
    def container_id(self, service: str) -> str:
        # By label, not `compose ps`: v1 and v2 list stopped containers differently.
        out = self.engine.docker(
            "ps",
            "-a",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            timeout=60,
        )
        ids = out.stdout.split()
        if not ids:
            raise RuntimeError(f"no container for service {service} in project {self.project}")
        return ids[0]

    def state(self, service: str) -> dict:
        out = self.engine.docker("inspect", "--format", "{{json .State}}", self.container_id(service), timeout=60)
        return json.loads(out.stdout)

    def health(self, service: str) -> str:
        state = self.state(service)
        if state.get("Status") != "running":
            return state.get("Status", "missing")
        return state.get("Health", {}).get("Status", "none")

    def wait_healthy(self, services=SERVICES, timeout: float = 300) -> None:
        """Waits until every service's health check passes; fails fast when one dies."""
        deadline = time.monotonic() + timeout
        while True:
            status = {s: self.health(s) for s in services}
            if all(v == "healthy" for v in status.values()):
                return
            dead = {s: v for s, v in status.items() if v in ("exited", "dead", "unhealthy")}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"cluster not healthy ({status}) after "
                    f"{timeout - max(0.0, deadline - time.monotonic()):.0f}s\n{self.logs(80)}"
                )
            time.sleep(1)

    def logs(self, tail: int = 200) -> str:
        try:
            return self.compose("logs", "--no-color", f"--tail={tail}", timeout=60, check=False).stdout
        except RuntimeError as e:
            return f"(no logs: {e})"

    # ------------------------------------------------------------ lifecycle
    def up(self, timeout: float = 900) -> None:
        """`up -d`; fails fast, with logs, when a container exits or restarts meanwhile
        (`up` itself waits for each depends_on health condition, for up to start_period)."""
        with tempfile.TemporaryFile("w+") as output:
            proc = subprocess.Popen(
                self._command("up", "-d", "--no-build"),
                env=self.env,
                cwd=self.repo_root,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            deadline = time.monotonic() + timeout
            try:
                while proc.poll() is None:
                    broken = self._broken_containers()
                    if broken or time.monotonic() > deadline:
                        raise RuntimeError(f"compose up: {broken or 'timed out'}\n{self.logs(80)}")
                    time.sleep(1)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
            if proc.returncode != 0:
                output.seek(0)
                raise RuntimeError(f"compose up exited {proc.returncode}:\n{output.read()[-4000:]}\n{self.logs(80)}")

    def _broken_containers(self) -> dict[str, str]:
        out = self.engine.docker(
            "ps",
            "-a",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--format",
            '{{.Label "com.docker.compose.service"}} {{.State}}',
            timeout=60,
        ).stdout
        states = dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())
        return {s: v for s, v in states.items() if v in ("exited", "dead", "restarting")}

    def stop_service(self, service: str, grace: int = 10, timeout: float = 120) -> float:
        """Stops one service; returns the seconds it took."""
        start = time.monotonic()
        self.compose("stop", "-t", str(grace), service, timeout=timeout)
        return time.monotonic() - start

    def start_service(self, service: str, timeout: float = 120) -> None:
        self.compose("start", service, timeout=timeout)

    def down(self, timeout: float = 300) -> None:
        """Removes the project's containers, networks and volumes (its images stay)."""
        self.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=timeout)
