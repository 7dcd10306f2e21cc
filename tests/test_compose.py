"""docker-compose.yml: valid for Debian's docker-compose, with every service the dev cluster needs,
healthchecks, named volumes, the ports of DESIGN.md, and qmq commands whose flags really exist."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import click
import pytest
import yaml

from qmq.cli import main
from tests.support.broker import ROOT

COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"postgres", "redis", "meta", "broker-a", "broker-b", "delay", "relay", "worker", "reconcile"}
LONG_RUNNING = SERVICES - {"reconcile"}


@pytest.fixture(scope="module")
def config() -> dict:
    """The file as docker-compose resolves it (anchors, merges, defaults)."""
    assert shutil.which("docker-compose"), "docker-compose is missing: scripts/setup.sh installs Debian's package"
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def qmq_args(service: dict) -> list[list[str]]:
    """The qmq command lines a service runs."""
    command = service["command"]
    if service.get("entrypoint") == ["sh", "-c"]:
        return [shlex.split(part)[1:] for part in " ".join(command).split("&&")]
    return [list(command)]


def test_the_cluster_has_every_service_with_healthchecks_and_volumes(config) -> None:
    services = config["services"]
    assert set(services) >= SERVICES
    for name in LONG_RUNNING:
        assert "healthcheck" in services[name], name
    assert {"pgdata", "broker-a", "broker-b", "delay"} <= set(config["volumes"])
    published = {p["published"] if isinstance(p, dict) else p for s in services.values() for p in s.get("ports", [])}
    for port in (20880, 20881, 20890):
        assert any(str(port) in str(p) for p in published), port
    qmq_services = [n for n, s in services.items() if s.get("image") == "qmq:dev"]
    assert {"meta", "broker-a", "broker-b", "delay", "relay", "worker", "reconcile"} <= set(qmq_services)
    assert all(services[n]["build"]["context"] == str(ROOT) for n in qmq_services)  # one Dockerfile


def test_every_qmq_command_line_parses(config) -> None:
    for name, service in config["services"].items():
        if service.get("image") != "qmq:dev":
            continue
        for args in qmq_args(service):
            command = main.get_command(click.Context(main), args[0])
            assert command is not None, f"{name}: no command {args[0]!r}"
            try:
                command.make_context(args[0], args[1:])
            except click.BadParameter as exc:
                # A path that exists only in the container must lie on one of the service's volumes.
                mounts = [str(v).split(":")[1] if ":" in str(v) else v["target"] for v in service.get("volumes", [])]
                missing = str(exc).split("'")[1] if "does not exist" in str(exc) else None
                if missing is None or not any(missing.startswith(m) for m in mounts):
                    pytest.fail(f"{name}: qmq {' '.join(args)}: {exc}")
            except click.UsageError as exc:
                pytest.fail(f"{name}: qmq {' '.join(args)}: {exc}")
