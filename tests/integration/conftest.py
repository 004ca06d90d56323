"""Fixtures for the container tests: engine, base image, project image, compose cluster.

Each is set up once and torn down in a finalizer, even when a test or a later setup step
fails: the compose project goes down (containers, networks, volumes) and a dockerd started
here is stopped. Module scope, not session: the rest of the test run then does not share
two cores with an idle cluster. Images stay in the daemon's data-root, so a rerun on the
same machine reuses the base image and the build cache.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from compose_cluster import ComposeCluster
from docker_engine import DockerEngine, install_debian_packages, run, why_docker_cannot_run

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
# STRATA_IT_* variables configure these container tests only; they are not service switches.
BASE_IMAGE = os.environ.get("STRATA_IT_BASE_IMAGE", "strata-base:bookworm")
IMAGE = "strata:it"
PROJECT_PREFIX = "strata-it-"
BASE_PYTHON_TAG = "cp311"  # Debian bookworm's python3 is 3.11
WHEEL_DIR = REPO_ROOT / ".docker-wheels"

# Seconds per setup phase, printed at the end of the session.
TIMINGS: dict[str, float] = {}


@contextlib.contextmanager
def _timed(phase: str):
    start = time.monotonic()
    try:
        yield
    finally:
        TIMINGS[phase] = time.monotonic() - start


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("container test timings")
        for phase, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{phase:<40} {seconds:7.1f} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed container test shows the services' logs beside its traceback."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("compose_cluster")
    if report.failed and cluster is not None:
        report.sections.append(("docker-compose logs (tail)", cluster.logs(150)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_serving(address: str, timeout: float = 3.0) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# ---------------------------------------------------------------- engine and images
@pytest.fixture(scope="module")
def docker_engine():
    reason = why_docker_cannot_run()
    if reason:
        pytest.skip(f"Docker cannot run here: {reason}")
    engine = DockerEngine()
    try:
        with _timed("engine: install + start dockerd"):
            engine.start()
        _remove_stale_projects(engine)
        yield engine
    finally:
        with _timed("engine: stop dockerd"):
            try:
                if engine.owned:  # superseded layers of rebuilt images
                    engine.docker("image", "prune", "-f", timeout=120, check=False)
            finally:
                engine.stop()


def _remove_stale_projects(engine: DockerEngine) -> None:
    """Clusters an interrupted run left in a daemon this test owns would eat the CPU."""
    if not engine.owned:
        return
    out = engine.docker(
        "ps",
        "-a",
        "--filter",
        "label=com.docker.compose.project",
        "--format",
        '{{.Label "com.docker.compose.project"}}',
        timeout=60,
    ).stdout
    for project in sorted({p for p in out.split() if p.startswith(PROJECT_PREFIX)}):
        # compose interpolates the whole file even to take a project down, and the file
        # requires a cluster token: any value serves for removing containers.
        env = {"STRATA_IMAGE": IMAGE, "STRATA_CLUSTER_TOKEN": "stale"}
        ComposeCluster(engine, REPO_ROOT, project, env).down()


def _host_torch_wheel() -> Path | None:
    """This machine's torch wheel, if pip's find-links hold it: the image then gets the same torch."""
    version = importlib.metadata.version("torch")
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip().strip("'\"").split()
    for d in dirs:
        path = Path(d.removeprefix("file://"))
        if path.is_dir():
            for wheel in sorted(path.glob(f"torch-{version}-{BASE_PYTHON_TAG}-{BASE_PYTHON_TAG}-*x86_64.whl")):
                return wheel
    return None


@contextlib.contextmanager
def _torch_build_args():
    """Build args choosing torch: the host's wheel via .docker-wheels/ if there is one, else the CPU index."""
    version = importlib.metadata.version("torch")
    wheel = _host_torch_wheel()
    if wheel is None:
        yield ["--build-arg", "TORCH_SOURCE=index", "--build-arg", f"TORCH_VERSION={version.split('+')[0]}"]
        return
    made_dir = not WHEEL_DIR.exists()
    staged = WHEEL_DIR / wheel.name
    made_file = not staged.exists()
    WHEEL_DIR.mkdir(exist_ok=True)
    if made_file:
        try:
            os.link(wheel, staged)
        except OSError:
            shutil.copy2(wheel, staged)
    try:
        yield ["--build-arg", "TORCH_SOURCE=wheels", "--build-arg", f"TORCH_VERSION={version}"]
    finally:
        if made_file:
            staged.unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(WHEEL_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def strata_image(docker_engine):
    if not docker_engine.image_exists(BASE_IMAGE):
        with _timed("base image: debootstrap + import"):
            install_debian_packages(["debootstrap"])
            run(
                ["bash", str(HERE / "build_base_image.sh"), BASE_IMAGE],
                timeout=1200,
                env={**docker_engine.env, "DOCKER": docker_engine.client},
            )
    with _timed("project image: docker build"), _torch_build_args() as torch_args:
        # The tiny model in the image (no download): the cluster mounts the host-built one anyway.
        docker_engine.docker(
            "build",
            "-t",
            IMAGE,
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "--build-arg",
            "DEFAULT_MODEL=tiny-random",
            *torch_args,
            str(REPO_ROOT),
            timeout=1800,
        )
    return IMAGE


# ---------------------------------------------------------------- model and cluster
@pytest.fixture(scope="module")
def host_model_dir(tmp_path_factory) -> Path:
    """The default model built on the host; mounted into the containers, so both sides share weights."""
    out = tmp_path_factory.mktemp("strata-model") / "model"
    run(
        [sys.executable, "-m", "strata.cli", "build-model", "tiny-random", "--output", str(out)],
        timeout=300,
        cwd=REPO_ROOT,
    )
    # The services run as an unprivileged user in the containers.
    for root, dirs, files in os.walk(out):
        for name in dirs + files + [""]:
            path = os.path.join(root, name)
            mode = os.stat(path).st_mode
            os.chmod(
                path,
                mode
                | stat.S_IRUSR
                | stat.S_IRGRP
                | stat.S_IROTH
                | (stat.S_IXGRP | stat.S_IXOTH if stat.S_ISDIR(mode) else 0),
            )
    return out


@pytest.fixture(scope="module")
def compose_cluster(docker_engine, strata_image, host_model_dir, tmp_path_factory):
    port = free_port()
    project = f"{PROJECT_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    cluster = ComposeCluster(
        docker_engine,
        REPO_ROOT,
        project,
        {
            "STRATA_IMAGE": strata_image,
            "STRATA_MODEL_DIR": str(host_model_dir),
            "STRATA_GATEWAY_BIND": "127.0.0.1",
            "STRATA_GATEWAY_PORT": str(port),
            "STRATA_HTTP_PORT": str(free_port()),
            "STRATA_CLUSTER_TOKEN": secrets.token_hex(16),
        },
    )
    cluster.gateway_address = f"127.0.0.1:{port}"
    try:
        with _timed("cluster: up until healthy"):
            cluster.up(timeout=900)
            cluster.wait_healthy(timeout=300)
            deadline = time.monotonic() + 60
            while not gateway_serving(cluster.gateway_address):
                assert time.monotonic() < deadline, f"gateway not reachable at {cluster.gateway_address} from the host"
                time.sleep(0.5)
        yield cluster
    finally:
        log_file = tmp_path_factory.mktemp("compose-logs") / f"{project}.log"
        log_file.write_text(cluster.logs(tail=2000))
        print(f"\ncompose logs of {project}: {log_file}")
        with _timed("cluster: down"):
            cluster.down()


@pytest.fixture(scope="module")
def node_client(tmp_path_factory) -> Path:
    """generate_client.js beside its npm dependencies (@grpc/grpc-js, @grpc/proto-loader)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        install_debian_packages(["node", "npm"])
    folder = tmp_path_factory.mktemp("node-client")
    with _timed("node client: npm install"):
        run(
            [
                "npm",
                "install",
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                "@grpc/grpc-js@^1.14",
                "@grpc/proto-loader@^0.8",
            ],
            cwd=folder,
            timeout=300,
        )
    shutil.copy(HERE / "generate_client.js", folder / "generate_client.js")
    return folder / "generate_client.js"
