"""A Docker engine for the container tests: the one already running, or one started here.

Nothing is pre-installed on CI: missing tools come from Debian (docker.io, docker-compose,
debootstrap), and when no daemon answers, a private dockerd is started with its own socket,
pidfile, exec-root and data-root, and stopped again by `stop()`. A daemon found running is
used as is and never stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

# Tool -> Debian package that provides it.
DEBIAN_PACKAGES = {
    "dockerd": "docker.io",
    "docker-compose": "docker-compose",
    "debootstrap": "debootstrap",
    "node": "nodejs",
    "npm": "npm",
}

# Where a daemon started here keeps its state. Images survive between runs on one machine
# (the base image and build cache make a rerun fast); everything else is torn down.
# (STRATA_IT_* variables configure these container tests only; they are not service switches.)
PRIVATE_ROOT = Path(os.environ.get("STRATA_IT_DOCKER_ROOT", "/var/lib/strata-it"))
PRIVATE_EXEC_ROOT = Path("/run/strata-it")  # sockets live here: keep the path short
PRIVATE_SOCKET = f"unix://{PRIVATE_EXEC_ROOT}/docker.sock"


def run(
    cmd: list[str], timeout: float, env: dict | None = None, check: bool = True, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """Runs a command with a deadline, output captured; a failure message carries its output."""
    try:
        proc = subprocess.run(
            cmd,
            env=env,
            cwd=cwd,
            timeout=timeout,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise RuntimeError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{out[-4000:]}") from None
    if check and proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-4000:]}")
    return proc


def why_docker_cannot_run() -> str | None:
    """The reason no Docker engine can run on this machine at all, or None when one can."""
    if not Path("/proc/self/cgroup").exists():
        return "Docker needs Linux (no /proc/self/cgroup here)"
    if _daemon_answers(os.environ.get("DOCKER_HOST")) or _daemon_answers("unix:///var/run/docker.sock"):
        return None
    if os.geteuid() != 0:
        return "no Docker daemon is running and starting one needs root"
    cgroup_root = Path("/sys/fs/cgroup")
    if not cgroup_root.is_dir() or not any(cgroup_root.iterdir()):
        return "no cgroup filesystem is mounted at /sys/fs/cgroup: containers cannot run"
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        return "no dockerd and no apt-get to install Debian's docker.io"
    return None


def install_debian_packages(tools: list[str], timeout: float = 900) -> None:
    """apt-get installs the Debian packages providing the tools that are missing."""
    missing = sorted({DEBIAN_PACKAGES[t] for t in tools if shutil.which(t) is None})
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update"], timeout=timeout / 3, env=env)
    run(["apt-get", "install", "-y", "--no-install-recommends", *missing], timeout=timeout, env=env)


def _client_for(dockerd: str | None) -> str:
    """The docker client from dockerd's own package (matching versions), else the one on PATH."""
    if dockerd:
        sibling = Path(dockerd).resolve().parent.parent / "bin" / "docker"
        if sibling.exists():
            return str(sibling)
    client = shutil.which("docker")
    if client is None:
        raise RuntimeError("no docker client found")
    return client


def _daemon_answers(host: str | None, client: str | None = None) -> bool:
    if not host:
        return False
    if host.startswith("unix://") and not Path(host[len("unix://") :]).exists():
        return False
    client = client or shutil.which("docker")
    if client is None:
        return False
    try:
        proc = subprocess.run(
            [client, "version", "--format", "{{.Server.Version}}"],
            timeout=20,
            env={**os.environ, "DOCKER_HOST": host},
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and proc.stdout.strip() != ""


class DockerEngine:
    """A reachable Docker daemon; `owned` when this process started it (and must stop it)."""

    def __init__(self) -> None:
        self.host: str | None = None
        self.client: str = ""
        self.owned = False
        self.pid: int | None = None
        self.log_path = PRIVATE_ROOT / "dockerd.log"
        self.compose: list[str] = []
        self.buildkit = False
        self._proc: subprocess.Popen | None = None  # set when this process is dockerd's parent

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120) -> DockerEngine:
        for host in (os.environ.get("DOCKER_HOST"), "unix:///var/run/docker.sock"):
            if _daemon_answers(host):
                self.host, self.client = host, _client_for(shutil.which("dockerd"))
                break
        else:
            if _daemon_answers(PRIVATE_SOCKET):
                self._adopt_private_daemon()  # left running by an interrupted run
            else:
                install_debian_packages(["dockerd"])
                self._start_private_daemon(timeout)
        self.compose = self._compose_command()
        self.buildkit = self._supports_buildkit()
        return self

    def _start_private_daemon(self, timeout: float) -> None:
        dockerd = shutil.which("dockerd")
        self.client = _client_for(dockerd)
        PRIVATE_ROOT.mkdir(parents=True, exist_ok=True)
        PRIVATE_EXEC_ROOT.mkdir(parents=True, exist_ok=True)
        cmd = [
            dockerd,
            "--data-root",
            str(PRIVATE_ROOT / "data"),
            "--exec-root",
            str(PRIVATE_EXEC_ROOT / "exec"),
            "--pidfile",
            str(PRIVATE_EXEC_ROOT / "dockerd.pid"),
            "--host",
            PRIVATE_SOCKET,
        ]
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._proc, self.pid, self.owned, self.host = proc, proc.pid, True, PRIVATE_SOCKET
        deadline = time.monotonic() + timeout
        while not _daemon_answers(self.host, self.client):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dockerd did not come up (exit {proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.5)

    def _adopt_private_daemon(self) -> None:
        self.client = _client_for(shutil.which("dockerd"))
        self.host, self.owned = PRIVATE_SOCKET, True
        self.pid = int((PRIVATE_EXEC_ROOT / "dockerd.pid").read_text().strip())

    def stop(self, timeout: float = 60) -> None:
        """Stops the daemon this process started (SIGTERM, then SIGKILL to its process group)."""
        if not self.owned or self.pid is None:
            return
        proc = self._proc
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            if proc is None and not Path(f"/proc/{self.pid}").exists():
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # dockerd leads its own session and group
            except ProcessLookupError:
                pass
            if proc is not None:
                proc.wait(timeout=10)
        self.owned, self.pid = False, None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------ commands
    @property
    def env(self) -> dict[str, str]:
        env = {**os.environ, "DOCKER_HOST": self.host or ""}
        env["DOCKER_BUILDKIT"] = "1" if self.buildkit else "0"
        return env

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run([self.client, *args], timeout=timeout, env=self.env, check=check)

    def image_exists(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False, timeout=30).returncode == 0

    def server_version(self) -> str:
        return self.docker("version", "--format", "{{json .Server.Version}}").stdout.strip().strip('"')

    def _compose_command(self) -> list[str]:
        """$STRATA_IT_COMPOSE if set, `docker compose` (v2) when the client has it, else
        docker-compose (v1, from Debian)."""
        if os.environ.get("STRATA_IT_COMPOSE"):
            return os.environ["STRATA_IT_COMPOSE"].split()
        if run([self.client, "compose", "version"], timeout=30, env=self.env, check=False).returncode == 0:
            return [self.client, "compose"]
        install_debian_packages(["docker-compose"])
        return [shutil.which("docker-compose")]

    def _supports_buildkit(self) -> bool:
        """BuildKit is built into clients before 23.0; later ones need the buildx plugin."""
        version = run(
            [self.client, "version", "--format", "{{json .Client.Version}}"],
            timeout=30,
            env={**os.environ, "DOCKER_HOST": self.host or ""},
            check=False,
        ).stdout.strip()
        try:
            major = int(json.loads(version).split(".")[0])
        except (ValueError, json.JSONDecodeError):
            major = 0
        if 0 < major < 23:
            return True
        return run([self.client, "buildx", "version"], timeout=30, env=os.environ, check=False).returncode == 0
