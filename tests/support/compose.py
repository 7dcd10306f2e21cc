"""The docker-compose cluster of tests/test_compose.py, for real: a Docker daemon (the one running, or
one started here and stopped again), the local base image from Debian's packages, the images of
scripts/docker/local.yml, and one compose project per test run on free host ports.

The daemon started here uses Docker's default data root, /var/lib/docker, on purpose: CI runs on the
same machine in a fresh clone, and a data root inside the checkout would throw away the image cache
(about 10 minutes of building) at every run. It runs without iptables rules and without the default
bridge: published ports go through docker-proxy on 127.0.0.1, and containers have no route out of
this machine (builds use the host's network). One compose test runs at a time per machine (a lock),
since the daemon it may start is shared.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support import waiting
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "scripts" / "docker" / "local.yml")
BASE_SCRIPT = ROOT / "scripts" / "docker-base.sh"
LOCK_PATH = Path(tempfile.gettempdir()) / "qmq-compose-test.lock"

LOCK_TIMEOUT_S = 900  # another compose test on this machine may hold the daemon this long
DAEMON_START_TIMEOUT_S = 60
DAEMON_STOP_TIMEOUT_S = 60
BASE_TIMEOUT_S = 600  # debootstrap: 1-2 minutes here
BUILD_TIMEOUT_S = 1200  # a cold build of the images: Java, PySpark from PyPI; 2-3 minutes here
UP_TIMEOUT_S = 300  # `up -d` waits for the healthchecks its depends_on name
HEALTHY_DEADLINE_S = 180
COMMAND_TIMEOUT_S = 300
# pytest-timeout's limit for the compose tests: the first one to use the cluster pays for the start.
TEST_TIMEOUT_S = LOCK_TIMEOUT_S + BASE_TIMEOUT_S + BUILD_TIMEOUT_S + UP_TIMEOUT_S + HEALTHY_DEADLINE_S
POLL_S = 0.5  # polling another process's state (a container's health): no event to await from here

# Host ports the cluster publishes, as docker-compose.yml reads them.
HOST_PORT_VARIABLES = (
    "META",
    "BROKER_A",
    "BROKER_A_REPLICA",
    "BROKER_B",
    "BROKER_B_REPLICA",
    "DELAY",
    "DELAY_REPLICA",
    "POSTGRES",
    "REDIS",
)
BROKERS = ("broker-a", "broker-a-replica", "broker-b", "broker-b-replica")
DELAY_SERVERS = ("delay", "delay-replica")
LONG_RUNNING = ("postgres", "redis", "meta", *BROKERS, *DELAY_SERVERS, "relay", "worker")


def fail(reason: str) -> None:
    """The compose test cannot run here: say why and fail (never skip: CI here can run it)."""
    pytest.fail(f"the docker-compose cluster cannot run: {reason}", pytrace=False)


def run(args: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)


def wait_until(condition: Callable[[], Any], what: str, deadline_s: float, explain: Callable[[], str] = str) -> Any:
    """Poll `condition` until it returns something truthy; fail with `explain()` after the deadline."""
    return waiting.wait_until(condition, what, deadline_s, explain=explain, poll_s=POLL_S)


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """One compose test at a time on this machine (they may share, start and stop the daemon)."""
    with open(LOCK_PATH, "w") as lock:
        wait_until(
            lambda: _try_lock(lock),
            f"another compose test holds {LOCK_PATH}",
            LOCK_TIMEOUT_S,
        )
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def daemon_answers() -> bool:
    return run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30).returncode == 0


@contextlib.contextmanager
def docker_daemon(log_dir: Path) -> Iterator[bool]:
    """A Docker daemon for the test; yields whether it was started here (then it is stopped after)."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            fail(f"the {tool} command is missing: scripts/setup.sh installs Debian's docker.io and docker-compose")
    if daemon_answers():
        yield False
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        fail("no Docker daemon answers and dockerd is missing: install Debian's docker.io")
    if os.geteuid() != 0:
        fail("no Docker daemon answers, and only root can start dockerd here")
    log_path = log_dir / "dockerd.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [dockerd, "--iptables=false", "--ip-masq=false", "--bridge=none"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: proc.poll() is not None or daemon_answers(),
            "dockerd answers",
            DAEMON_START_TIMEOUT_S,
        )
        if proc.poll() is not None:
            fail(f"dockerd exited with {proc.returncode}:\n{_tail(log_path)}")
        yield True
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # dockerd stops its containers and its containerd
            try:
                proc.wait(DAEMON_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    """One compose project: `compose(...)` runs docker-compose on it with the test's ports."""

    project: str
    ports: dict[str, int]
    log_dir: Path
    timings: dict[str, float] = field(default_factory=dict)
    # The reconciliation's window starts here: a minute of slack for clocks.
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC) - timedelta(minutes=1))

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QMQ_")}
        env.update({f"QMQ_HOST_PORT_{name}": str(port) for name, port in self.ports.items()})
        env["QMQ_COMPOSE_NETWORK"] = f"{self.project}-net"
        return env

    @property
    def meta(self) -> str:
        return f"127.0.0.1:{self.ports['META']}"

    @property
    def shop_url(self) -> str:
        return f"postgresql+psycopg://qmq:qmq@127.0.0.1:{self.ports['POSTGRES']}/shop"

    def compose(
        self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess:
        files = [a for f in COMPOSE_FILES for a in ("-f", str(f))]
        result = run(["docker-compose", "-p", self.project, *files, *args], timeout=timeout, cwd=ROOT, env=self.env)
        if check and result.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{self.logs()}"
            )
        return result

    def containers(self) -> dict[str, dict[str, Any]]:
        """`docker inspect` of the project's service containers (not one-off runs), by service: two
        docker calls, where `docker-compose ps` per service would take a second each."""
        listed = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"])
        ids = listed.stdout.split()
        if not ids:
            return {}
        inspected = run(["docker", "inspect", *ids], timeout=30)
        if inspected.returncode != 0:  # a container went away between the two calls: ask again
            return {}
        found = {}
        for item in json.loads(inspected.stdout):
            labels = item["Config"]["Labels"]
            if labels.get("com.docker.compose.oneoff") != "True":
                found[labels["com.docker.compose.service"]] = item
        return found

    def container(self, service: str) -> str:
        return self.containers()[service]["Id"]

    def state(self, service: str) -> dict[str, Any]:
        """`docker inspect`'s State of the service's container ({} when it has none)."""
        return self.containers().get(service, {}).get("State", {})

    def healthy(self, *services: str) -> bool:
        containers = self.containers()
        return all(
            (containers.get(s, {}).get("State", {}).get("Health") or {}).get("Status") == "healthy" for s in services
        )

    def wait_healthy(self, *services: str, deadline_s: float = HEALTHY_DEADLINE_S) -> None:
        services = services or LONG_RUNNING
        wait_until(lambda: self.healthy(*services), f"{', '.join(services)} healthy", deadline_s, self.logs)

    def logs(self, lines: int = 40) -> str:
        result = self.compose("logs", "--no-color", "--tail", str(lines), check=False, timeout=60)
        return f"--- docker-compose logs (last {lines} lines per service) ---\n{result.stdout[-12000:]}"


def build_images(cluster: Cluster) -> None:
    """The local base image (debootstrap, once per machine), then PostgreSQL's, Redis's and qmq's."""
    started = time.monotonic()
    base = run(["bash", str(BASE_SCRIPT)], timeout=BASE_TIMEOUT_S, cwd=ROOT)
    cluster.timings["base image"] = time.monotonic() - started
    if base.returncode != 0:
        fail(f"scripts/docker-base.sh failed:\n{base.stdout[-2000:]}\n{base.stderr[-3000:]}")
    # One qmq service is enough: every qmq service shares the image qmq:dev.
    started = time.monotonic()
    cluster.compose("build", "postgres", "redis", "meta", timeout=BUILD_TIMEOUT_S)
    cluster.timings["build"] = time.monotonic() - started
    # Earlier builds of these images, untagged now: every image made from the local base carries its
    # label, so nothing else is touched (and nothing in use: only dangling images are removed).
    run(["docker", "image", "prune", "-f", "--filter", "label=qmq.recipe"])


@contextlib.contextmanager
def compose_cluster(log_dir: Path) -> Iterator[Cluster]:
    """The whole cluster up and healthy; `down -v` (volumes, network) at the end, pass or fail."""
    ports = {name: free_port() for name in HOST_PORT_VARIABLES}
    cluster = Cluster(project=f"qmqtest{os.getpid()}", ports=ports, log_dir=log_dir)
    build_images(cluster)
    try:
        started = time.monotonic()
        cluster.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
        cluster.wait_healthy()
        cluster.timings["up until healthy"] = time.monotonic() - started
        yield cluster
    finally:
        (log_dir / "compose.log").write_text(cluster.logs(lines=400))
        cluster.compose("--profile", "jobs", "down", "-v", "--remove-orphans", check=False, timeout=UP_TIMEOUT_S)
