"""docker-compose.yml, for real. First the file alone: valid for Debian's docker-compose, every service
the dev cluster needs, each broker group and the delay-server group a master and a replica on
volumes of their own, healthchecks, named volumes, the ports of DESIGN.md, qmq commands whose flags
exist, the reconciliation exporting one member of each group (scripts/compose-longest-log.py), and
the TLS override (docker-compose.tls.yml, with the certificates scripts/compose-tls-certs.sh makes),
checked as docker-compose resolves it (TLS itself runs live in tests/test_dev.py and
tests/test_demo.py). Then one start of the whole cluster (tests/support/compose.py: images from
Debian's packages through scripts/docker/local.yml, free host ports, its own network) that the rest
drive, in order: the README's quick start from the host, each group's replica in sync, orders
committed on the host and in an app container consumed once with their delayed payment timeouts, a
broker SIGKILLed and restarted on its volume losing nothing, the delay master SIGKILLed with payment
timeouts pending and its replica firing them, and `docker-compose run --rm reconcile` reporting
every order's message delivered (once)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest
import sqlalchemy as sa
import yaml

import qmq
from qmq.cli import main
from qmq.cli.net_options import TLS_SERVER_CERT_ENV, TLS_SERVER_KEY_ENV
from qmq.db.engine import create_engine
from qmq.demo import shop as shop_module
from qmq.demo.run import CRASHING_SHOP
from qmq.demo.shop import emails, invoices, metadata, order_placer, timeouts
from qmq.net.client import BlockingConnection
from qmq.net.tls import TLS_CA_ENV
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT
from tests.support.compose import (
    TEST_TIMEOUT_S,
    Cluster,
    compose_cluster,
    docker_daemon,
    machine_lock,
    run,
    wait_until,
)

COMPOSE = ROOT / "docker-compose.yml"
LOCAL = ROOT / "scripts" / "docker" / "local.yml"

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)
BROKERS = {"broker-a", "broker-a-replica", "broker-b", "broker-b-replica"}
DELAY_SERVERS = {"delay", "delay-replica"}
STORES = BROKERS | DELAY_SERVERS  # one volume each, mounted at /data
SERVICES = {"postgres", "redis", "meta", *STORES, "relay", "worker", "reconcile"}
LONGEST_LOG = ROOT / "scripts" / "compose-longest-log.py"
TLS_OVERRIDE = ROOT / "docker-compose.tls.yml"
TLS_CERTS_SCRIPT = ROOT / "scripts" / "compose-tls-certs.sh"
LONG_RUNNING = SERVICES - {"reconcile"}


def resolved(*files: Path) -> dict:
    """The files as docker-compose resolves them (anchors, merges, defaults)."""
    assert shutil.which("docker-compose"), "docker-compose is missing: scripts/setup.sh installs Debian's package"
    args = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run(["docker-compose", *args, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return resolved(COMPOSE)


PICK = "$$(python /compose/longest-log.py "  # the reconcile service's pick of a group's member


def picked(token: str) -> list[str] | None:
    """The stores of `--data-dir "$$(python /compose/longest-log.py STORE ...)"` (None for a plain path)."""
    return token.removeprefix(PICK).removesuffix(")").split() if token.startswith(PICK) else None


def qmq_args(service: dict) -> list[list[str]]:
    """The qmq command lines a service runs; a member picked by scripts/compose-longest-log.py stands
    as the first store it is given."""
    command = service["command"]
    if service.get("entrypoint") == ["sh", "-c"]:
        lines = [shlex.split(part)[1:] for part in " ".join(command).split("&&")]
        return [[(picked(a) or [a])[0] for a in args] for args in lines]
    return [list(command)]


def test_the_cluster_has_every_service_with_healthchecks_and_volumes(config) -> None:
    services = config["services"]
    assert set(services) >= SERVICES
    for name in LONG_RUNNING:
        assert "healthcheck" in services[name], name
    assert {"pgdata", *STORES} <= set(config["volumes"])
    published = {p["published"] if isinstance(p, dict) else p for s in services.values() for p in s.get("ports", [])}
    for port in (20880, 20881, 20890, 20891):  # DESIGN.md's, and the delay replica's (docs/compose.md)
        assert any(str(port) in str(p) for p in published), port
    qmq_services = [n for n, s in services.items() if s.get("image") == "qmq:dev"]
    assert {"meta", *STORES, "relay", "worker", "reconcile"} <= set(qmq_services)
    assert all(services[n]["build"]["context"] == str(ROOT) for n in qmq_services)  # one Dockerfile


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) of a service's volumes, in either of compose's two forms."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            found[target] = (source, mode == ["ro"])
        else:
            found[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return found


def publishing(service: dict) -> dict[int, str]:
    """container port -> host address:port of a service's published ports, in either of compose's forms."""
    found = {}
    for port in service.get("ports", []):
        if isinstance(port, str):
            *host, published, target = port.removesuffix("/tcp").split(":")
            port = {"host_ip": host[0] if host else "0.0.0.0", "published": published, "target": target}
        found[int(port["target"])] = f"{port.get('host_ip', '0.0.0.0')}:{port['published']}"
    return found


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


GROUPS = {
    "a": ("broker-a", "broker-a-replica"),
    "b": ("broker-b", "broker-b-replica"),
    "d1": ("delay", "delay-replica"),
}
PORT_INSIDE = {"broker": 20881, "delay-server": 20890}


def test_each_group_is_a_master_and_a_replica_on_volumes_of_their_own(config) -> None:
    """Both broker groups and the delay-server group: two members with the same command line but
    their addresses, one volume each, the replica started after its master, each member reachable
    from the host on the port it advertises there."""
    services = config["services"]
    members: dict[str, list[str]] = {}
    for name, service in services.items():
        args = qmq_args(service)[0] if service.get("image") == "qmq:dev" else [""]
        if args[0] in PORT_INSIDE:
            members.setdefault(option(args, "--group"), []).append(name)
            port = PORT_INSIDE[args[0]]
            assert option(args, "--port") == str(port), name
            assert option(args, "--advertise") == f"{name}:{port}", name  # containers dial the service name
            external = option(args, "--advertise-external")
            assert publishing(services[name]) == {port: external}, name
    assert {group: tuple(sorted(names)) for group, names in members.items()} == GROUPS
    data = [mounts(services[n])["/data"][0] for n in STORES]
    assert sorted(data) == sorted(STORES)  # one disk each: a replica is a second copy
    for master, replica in GROUPS.values():
        assert set(services[replica]["depends_on"]) == {master}  # the first of a group to report is master
        assert services[replica]["healthcheck"]["test"] == services[master]["healthcheck"]["test"]

        def flags(name: str) -> list[str]:
            args = qmq_args(services[name])[0]
            for address in ("--advertise", "--advertise-external"):
                args[args.index(address) + 1] = "ADDRESS"
            return args

        assert flags(replica) == flags(master), replica  # the same --group, --ack-replicas, ...
    external = {option(qmq_args(services[n])[0], "--advertise-external") for n in STORES}
    assert len(external) == len(STORES)  # the host reaches whichever is master after a failover


def test_the_reconciliation_exports_one_member_of_each_group(config) -> None:
    """`reconcile` exports every group once (two members would count each message twice), from the
    member scripts/compose-longest-log.py picks among all of the group's stores, mounted read-only."""
    reconcile = config["services"]["reconcile"]
    lines = [shlex.split(part)[1:] for part in " ".join(reconcile["command"]).split("&&")]
    exports = {option(a, "--name"): picked(option(a, "--data-dir")) for a in lines if a[:2] == ["ledger", "export"]}
    stores = {group: [f"/stores/{m}" for m in members] for group, members in GROUPS.items()}
    assert exports == {"a": stores["a"], "b": stores["b"], "delay": stores["d1"]}
    ledgers = {option(a, "--out") for a in lines if a[:2] == ["ledger", "export"]}
    assert lines[-1][0] == "reconcile" and ledgers == {option(lines[-1], "--ledger")}
    found = mounts(reconcile)
    for name in STORES:
        assert found[f"/stores/{name}"] == (name, True), name
    assert found["/compose/longest-log.py"] == (str(LONGEST_LOG), True)


def store(path: Path, epochs: str | None, segments: dict[int, int]) -> str:
    """A store directory as far as the member pick reads it: `epochs`, message-log segments."""
    (path / "messagelog").mkdir(parents=True)
    for base, size in segments.items():
        (path / "messagelog" / f"{base:020d}").write_bytes(b"x" * size)
    if epochs is not None:
        (path / "epochs").write_text(epochs)
    return str(path)


def pick(*stores: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LONGEST_LOG), *stores], capture_output=True, text=True, timeout=60)


def test_the_member_exported_has_the_newest_epoch_and_the_longest_log(tmp_path) -> None:
    old_master = store(tmp_path / "m", "1 0\n", {0: 100, 100: 400})  # log end 500, deposed at epoch 1
    promoted = store(tmp_path / "r", "1 0\n2 300\n", {0: 100, 100: 260})  # 360: shorter, but epoch 2
    behind = store(tmp_path / "b", "1 0\n2 300\n", {0: 100, 100: 250})
    alone = store(tmp_path / "alone", None, {0: 50})  # a server that never joined a group: epoch 0
    empty = tmp_path / "empty"  # a volume no member has used yet
    empty.mkdir()
    assert pick(old_master, promoted).stdout == f"{promoted}\n"
    assert pick(behind, promoted, old_master).stdout == f"{promoted}\n"  # longest among epoch 2
    assert pick(promoted, store(tmp_path / "same", "1 0\n2 300\n", {0: 360})).stdout == f"{promoted}\n"  # tie: first
    assert pick(str(empty), alone).stdout == f"{alone}\n"
    none = pick(str(empty), str(tmp_path / "missing"))
    assert none.returncode == 1 and none.stdout == "" and "no store" in none.stderr


def test_the_tls_override_puts_every_qmq_process_on_tls(tmp_path) -> None:
    """`-f docker-compose.yml -f docker-compose.tls.yml` as docker-compose resolves it, and the
    certificates of scripts/compose-tls-certs.sh: signed by the CA, naming every address a client
    dials (each server's advertised service name, the meta server's, 127.0.0.1 for the host)."""
    services = resolved(COMPOSE, TLS_OVERRIDE)["services"]
    servers = set()
    for name, service in services.items():
        if service.get("image") != "qmq:dev":
            continue
        env = service["environment"]
        assert env[TLS_CA_ENV] == "/tls/ca.pem", name
        assert (env[TLS_SERVER_CERT_ENV], env[TLS_SERVER_KEY_ENV]) == ("/tls/server.pem", "/tls/server.key"), name
        assert mounts(service).get("/tls") == (str(ROOT / "tls"), True), name
        for args in qmq_args(service):
            if args[0] in ("meta", "broker", "delay-server"):
                servers.add(name)
    assert servers == {"meta", *STORES}

    made = subprocess.run(["bash", str(TLS_CERTS_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", "ca.pem", "server.pem"], capture_output=True, text=True, cwd=tmp_path
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    names = subprocess.run(
        ["openssl", "x509", "-in", "server.pem", "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    dialled = {"127.0.0.1", "meta"} | {
        option(args, "--advertise").rsplit(":", 1)[0]
        for name in servers
        for args in qmq_args(services[name])
        if option(args, "--advertise")
    }
    assert services["relay"]["environment"]["QMQ_META"] == "meta:20880"
    for host in dialled:
        assert (f"IP Address:{host}" if host[0].isdigit() else f"DNS:{host}") in names, host
    assert not (tmp_path / "ca.key").exists()  # nothing more can be signed with the CA


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


def test_the_local_override_builds_every_image_from_the_local_base() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "-f", str(LOCAL), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in SERVICES:
        build = services[name]["build"]
        assert build["args"]["BASE_IMAGE"] == "qmq-base:bookworm", name
        assert build["network"] == "host", name
    assert services["postgres"]["image"] != "postgres:15" and services["redis"]["image"] != "redis:7"


# -- the cluster, started once ----------------------------------------------------------------------

README_META = "QMQ_META=127.0.0.1:20880"
SETTLE_DEADLINE_S = 120.0  # orders consumed, payment timeouts fired, after a broker restart too
SKIP_FLAKY_EMAIL = 3  # the demo's e-mail handler fails twice for ids ending in 3 (qmq.demo.consumers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    log_dir = tmp_path_factory.mktemp("compose")
    started = time.monotonic()
    with machine_lock(), docker_daemon(log_dir) as started_daemon, compose_cluster(log_dir) as cluster:
        cluster.timings["daemon started here"] = float(started_daemon)
        yield cluster
        cluster.timings["tests"] = time.monotonic() - started
        print(f"\ncompose timings (s): {json.dumps({k: round(v, 1) for k, v in cluster.timings.items()})}")


@pytest.fixture(scope="module")
def shop(cluster):
    """The shop's database in the cluster's PostgreSQL, from the host, with the demo's tables."""
    engine = create_engine(cluster.shop_url)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def placed() -> dict[str, list]:
    """What the tests committed through the outbox, for the reconciliation at the end."""
    return {"orders": [], "message_ids": []}


def order_ids(start: int, count: int) -> list[int]:
    return [i for i in range(start, start + count * 2) if i % 10 != SKIP_FLAKY_EMAIL][:count]


def place_orders(cluster: Cluster, shop, placed, ids: list[int]) -> None:
    producer = qmq.Producer(meta=cluster.meta, engine=shop)
    try:
        place_order = order_placer(producer)
        for order_id in ids:
            placed["message_ids"] += place_order(order_id=order_id, item="compose", pay=order_id % 2 == 0)
            placed["orders"].append(order_id)
    finally:
        producer.close()


def settled(shop, ids: list[int]) -> bool:
    """Every order billed, e-mailed and its payment timeout handled (the delayed message fired)."""
    with shop.connect() as conn:
        return all(
            set(conn.execute(sa.select(table.c.order_id).where(table.c.order_id.in_(ids))).scalars()) == set(ids)
            for table in (invoices, emails, timeouts)
        )


def wait_settled(cluster: Cluster, shop, ids: list[int]) -> None:
    wait_until(lambda: settled(shop, ids), f"orders {ids} settled", SETTLE_DEADLINE_S, cluster.logs)


def readme_commands() -> list[str]:
    """The README's commands run from the host against the compose cluster."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    return [line for line in lines if line.startswith(f"{README_META} qmq ")]


def test_the_readme_quick_start_works_from_the_host(cluster) -> None:
    """`QMQ_META=127.0.0.1:20880 qmq send ...` and `qmq tail ...` as the README writes them (only the
    port is this run's): the host is handed addresses it can reach, by the meta server's external
    listener; the delayed message comes back through the delay server."""
    commands = readme_commands()
    assert [c.split()[2] for c in commands] == ["send", "send", "tail"], commands
    bin_dir = Path(sys.executable).parent
    env = {**cluster.env, "PATH": f"{bin_dir}:{cluster.env['PATH']}"}
    outputs = []
    for command in commands:
        command = command.replace(README_META, f"QMQ_META={cluster.meta}")
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, f"{command}\n{result.stderr}"
        outputs.append(result.stdout)
    sent = [outputs[0].strip(), outputs[1].strip()]
    tailed = [json.loads(line) for line in outputs[2].splitlines()]
    assert sorted(m["id"] for m in tailed) == sorted(sent)


REPLICA_DEADLINE_S = 30.0  # the replicas started with the cluster: in sync within a fetch or two


def server_stats(port: int, code: RequestCode) -> dict | None:
    """BROKER_STATS or DELAY_STATS of a server, through its published port (None while it cannot
    answer); a member that is not master answers with its "replication" only."""
    try:
        with BlockingConnection.open("127.0.0.1", port, token="", timeout=5) as conn:
            return conn.request(code, {}, timeout=10)
    except OSError:
        return None


def replication(port: int, code: RequestCode) -> dict | None:
    stats = server_stats(port, code)
    return stats and stats.get("replication")


def master_in_sync(cluster: Cluster, members: dict[str, str], code: RequestCode) -> tuple[str, dict] | None:
    """(service, "replication") of the group's master once it names its other member a replica in
    sync (a send is acknowledged on two disks), whichever of the two the meta server made master."""
    stats = {name: replication(cluster.ports[port], code) for name, port in members.items()}
    masters = [(name, s) for name, s in stats.items() if s and s["role"] == "master"]
    if len(masters) != 1 or not all(stats.values()):
        return None
    name, master = masters[0]
    replicas = [r for r in master.get("replicas") or () if r["in_sync"]]
    return (name, master) if len(replicas) == 1 and master["ack_replicas"] == 1 and master["writable"] else None


def wait_master_in_sync(cluster: Cluster, members: dict[str, str], code: RequestCode) -> tuple[str, dict]:
    return wait_until(lambda: master_in_sync(cluster, members, code), f"{' and '.join(members)}: a replica in sync",
                      REPLICA_DEADLINE_S, cluster.logs)  # fmt: skip


def test_each_broker_group_has_a_replica_in_sync(cluster) -> None:
    """BROKER_STATS of each group's master names the other member as a replica in sync."""
    for group in ("a", "b"):
        members = {
            f"broker-{group}": f"BROKER_{group.upper()}",
            f"broker-{group}-replica": f"BROKER_{group.upper()}_REPLICA",
        }
        _, master = wait_master_in_sync(cluster, members, RequestCode.BROKER_STATS)
        assert master["epoch"] >= 1


DELAY_MEMBERS = {"delay": "DELAY", "delay-replica": "DELAY_REPLICA"}


def test_the_delay_group_has_a_replica_in_sync(cluster) -> None:
    """DELAY_STATS of the delay-server group's master names the other member as a replica in sync:
    a delayed message is acknowledged once both disks hold it (docs/replication.md)."""
    name, master = wait_master_in_sync(cluster, DELAY_MEMBERS, RequestCode.DELAY_STATS)
    assert master["epoch"] >= 1
    other = next(n for n in DELAY_MEMBERS if n != name)
    assert replication(cluster.ports[DELAY_MEMBERS[other]], RequestCode.DELAY_STATS)["role"] == "replica"


def test_orders_from_the_host_and_an_app_container_are_consumed_once(cluster, shop, placed) -> None:
    ids = order_ids(1, 6)
    place_orders(cluster, shop, placed, ids)
    # An app container on the cluster's network commits an order and dies (SIGKILL) before sending:
    # the relay ships it.
    crash_id = 1000
    crashed = cluster.compose(
        "run", "--rm", "-T", "--no-deps", "--entrypoint", "python", "worker",
        "-c", CRASHING_SHOP, "postgresql://qmq:qmq@postgres:5432/shop", "meta:20880", str(crash_id),
        check=False,
    )  # fmt: skip
    assert crashed.returncode == 128 + 9, crashed.stderr  # SIGKILLed after its commit, as planned
    placed["orders"].append(crash_id)
    wait_settled(cluster, shop, [*ids, crash_id])
    with shop.connect() as conn:
        attempts = conn.execute(sa.select(emails.c.attempts).where(emails.c.order_id.in_(ids))).scalars().all()
    assert attempts == [1] * len(ids)


def test_a_broker_killed_and_restarted_on_its_volume_loses_nothing(cluster, shop, placed) -> None:
    cluster.compose("stop", "worker")  # messages wait in the brokers' stores
    stored = order_ids(100, 6)
    place_orders(cluster, shop, placed, stored)
    container = cluster.container("broker-a")
    killed = run(["docker", "kill", "--signal", "KILL", container])
    assert killed.returncode == 0, killed.stderr
    state = wait_until(
        lambda: (s := cluster.state("broker-a")) and not s["Running"] and s,
        "broker-a down after SIGKILL",
        30,
    )
    assert state["ExitCode"] == 137
    while_down = order_ids(200, 4)
    place_orders(cluster, shop, placed, while_down)  # broker-b takes them (or the relay, later)
    cluster.compose("start", "broker-a")
    cluster.wait_healthy("broker-a")
    assert cluster.container("broker-a") == container  # the same container: the same volume
    cluster.compose("start", "worker")
    cluster.wait_healthy("worker")
    wait_settled(cluster, shop, [*stored, *while_down])


FAILOVER_DEADLINE_S = 60.0  # the meta server's --failover-after (10 s) and a heartbeat, on a busy machine
# The payment timeouts of the next orders: due after the delay master is killed, so they are pending
# there and only its replica can fire them (about when it takes over, 10 s later).
PENDING_TIMEOUT_S = 12.0


def test_the_delay_master_killed_its_replica_fires_the_pending_timeouts_once(
    cluster, shop, placed, monkeypatch
) -> None:
    """The delay-server group's master SIGKILLed with payment timeouts pending: the meta server
    promotes the replica, which fires them (each once: the reconciliation below classes every one
    `delivered`, acknowledged once by its consumer group)."""
    master, stats = wait_master_in_sync(cluster, DELAY_MEMBERS, RequestCode.DELAY_STATS)
    replica = next(n for n in DELAY_MEMBERS if n != master)
    monkeypatch.setattr(shop_module, "PAYMENT_TIMEOUT_S", PENDING_TIMEOUT_S)
    ids = order_ids(300, 4)
    before = server_stats(cluster.ports[DELAY_MEMBERS[master]], RequestCode.DELAY_STATS)
    sent = time.monotonic()
    place_orders(cluster, shop, placed, ids)  # acknowledged once the replica holds them too
    pending = server_stats(cluster.ports[DELAY_MEMBERS[master]], RequestCode.DELAY_STATS)
    killed = run(["docker", "kill", "--signal", "KILL", cluster.container(master)])
    assert killed.returncode == 0, killed.stderr
    killed_after = time.monotonic() - sent
    assert killed_after < PENDING_TIMEOUT_S, f"placing the orders took {killed_after:.1f} s: timeouts may have fired"
    assert pending["pending"] == before["pending"] + len(ids), (before, pending)  # none fired by the master
    state = wait_until(
        lambda: (s := cluster.state(master)) and not s["Running"] and s, f"{master} down after SIGKILL", 30
    )
    assert state["ExitCode"] == 137
    killed_at = time.monotonic()
    promoted = wait_until(
        lambda: (
            (r := replication(cluster.ports[DELAY_MEMBERS[replica]], RequestCode.DELAY_STATS))
            and r["role"] == "master"
            and r
        ),
        f"{replica} master after {master} was killed",
        FAILOVER_DEADLINE_S,
        cluster.logs,
    )
    cluster.timings["delay failover"] = time.monotonic() - killed_at
    assert promoted["epoch"] > stats["epoch"]
    wait_settled(cluster, shop, ids)
    placed["delay_promoted"] = replica  # the reconciliation exports the delay ledger from its store


RESULTS = textwrap.dedent("""
    import glob, json, pyarrow.parquet as pq
    summary = json.load(open("/ledger/report/summary.json"))
    rows = pq.read_table("/ledger/report/classified", columns=["message_id", "class"]).to_pylist()
    exports = {e["name"]: e["data_dir"] for e in map(json.load, map(open, glob.glob("/ledger/ledger/_exports/*.json")))}
    print(json.dumps({"summary": summary, "classes": {r["message_id"]: r["class"] for r in rows}, "exports": exports}))
""")


def spark_test_jvm() -> tuple[str, ...]:
    """The driver JVM options of tests/spark-conf (a small job, its CPU mostly the JIT's), for the
    job's container, which cannot see that directory: `docker compose run` options."""
    conf = Path(__file__).resolve().parent / "spark-conf" / "spark-defaults.conf"
    for line in conf.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "spark.driver.extraJavaOptions":
            return ("-e", f"JAVA_TOOL_OPTIONS={value.strip()}")
    raise AssertionError(f"{conf} sets no spark.driver.extraJavaOptions")


TEST_JVM = spark_test_jvm()


def test_the_reconciliation_reports_every_message_delivered(cluster, placed) -> None:
    assert placed["orders"], "the tests before this one placed no order"
    window = ["-e", f"QMQ_RECONCILE_SINCE={cluster.started_at.isoformat()}", "-e", "QMQ_RECONCILE_UNTIL=now"]
    result = cluster.compose("run", "--rm", "-T", *window, *TEST_JVM, "reconcile", timeout=600)
    assert result.returncode == 0
    results = ("run", "--rm", "-T", "--no-deps", *TEST_JVM, "--entrypoint", "python", "reconcile", "-c", RESULTS)
    output = cluster.compose(*results)
    found = json.loads(output.stdout.strip().splitlines()[-1])
    summary, classes = found["summary"], found["classes"]
    # One member's store per group; the delay group's from the promoted replica (newer epoch, longer
    # log), not from its killed master's volume.
    assert found["exports"].keys() == {"a", "b", "delay"}
    for name, members in (("a", GROUPS["a"]), ("b", GROUPS["b"]), ("delay", GROUPS["d1"])):
        assert found["exports"][name] in {f"/stores/{m}" for m in members}, found["exports"]
    if "delay_promoted" in placed:
        assert found["exports"]["delay"] == f"/stores/{placed['delay_promoted']}"
    assert {i: classes.get(i) for i in placed["message_ids"]} == {i: "delivered" for i in placed["message_ids"]}
    # The crashed app's two messages, shipped by the relay, are in the outbox too.
    assert summary["delivered"] >= len(placed["message_ids"]) + 2
    assert summary["critical"] == 0
    # Only the README's `qmq send` messages are anomalies: sent outside a transaction (orphaned).
    assert summary["anomalies"] == summary.get("orphaned", 0) == 2, summary
