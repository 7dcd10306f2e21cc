"""Replicated broker groups against a single broker, in one run on this machine (docs/replication.md):

    .venv/bin/python bench/replication.py                  # every case
    .venv/bin/python bench/replication.py produce          # 1 KiB, batches of 64: single vs --ack-replicas 1
    .venv/bin/python bench/replication.py latency          # send-to-ack p50/p99 at 1,000 msg/s, both ways
    .venv/bin/python bench/replication.py failover         # SIGKILL of the master -> first acked send
    .venv/bin/python bench/replication.py failover --failover-after 2

Every broker is a real `qmq broker` process with sync flush; the replicated group has a meta server
(SQLite) and two brokers (master and replica, `--ack-replicas 1`); the failover case has three (so
the new master still has a replica to acknowledge with). All share this machine's cores and disk,
so the replica's fsync competes with the master's. Record the figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker import cpu_split, free_port, install_uvloop, produce, wait_port  # bench/broker.py

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteError

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class Cluster:
    """Brokers (and a meta server when `replicated`) in a temporary directory."""

    def __init__(self, replicated: bool, members: int = 2, failover_after: float = 10.0, tree: Path = ROOT) -> None:
        self.tree = tree
        self.dir = Path(tempfile.mkdtemp(prefix="qmq-bench-repl-"))
        self.procs: dict[int, subprocess.Popen] = {}
        self.meta: str | None = None
        self.failover_after = failover_after
        if replicated:
            port = free_port()
            proc = self._start(
                "meta",
                [
                    *("meta", "--port", str(port), "--db", f"sqlite:///{self.dir / 'meta.sqlite3'}"),
                    *("--failover-after", str(failover_after), "-l", "WARNING"),
                ],
            )
            self.procs[port] = proc  # stopped with the brokers
            wait_port(port, proc)
            self.meta = f"{HOST}:{port}"
        self.ports: list[int] = []
        try:
            for i in range(members if replicated else 1):
                self.add_broker(i)
                if replicated:
                    asyncio.run(self.wait_role(self.ports[-1], "master" if i == 0 else "replica"))
            if replicated:
                asyncio.run(self.wait_writable(self.ports[0]))
        except BaseException:
            self.stop(keep=True)
            raise

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - the child's
        proc = subprocess.Popen([sys.executable, "-m", "qmq", *args], cwd=self.tree, stdout=log, stderr=log)
        log.close()
        return proc

    def add_broker(self, i: int, port: int | None = None) -> int:
        port = port or free_port()
        args = ["broker", "--data-dir", str(self.dir / f"b{i}"), "--port", str(port), "-l", "WARNING"]
        if self.meta:
            args += ["--meta", self.meta, "--group", "g1", "--ack-replicas", "1"]
        self.procs[port] = self._start(f"b{i}", args)
        wait_port(port, self.procs[port])
        self.ports.append(port)
        return port

    async def stats(self, port: int) -> dict | None:
        try:
            conn = await AsyncConnection.open(HOST, port, client_id="bench")
        except OSError:
            return None
        try:
            return (await conn.request(RequestCode.BROKER_STATS, {}, timeout=5)).get("replication")
        except (OSError, RemoteError, TimeoutError):
            return None
        finally:
            await conn.close()

    async def wait_role(self, port: int, role: str) -> None:
        await self._wait(port, lambda stats: stats.get("role") == role, f"role {role}")

    async def wait_writable(self, port: int) -> None:
        """Until sends are taken and, in a group, acknowledged (the meta server holds a replica as in
        sync; brokers from before that rule say nothing of it)."""

        def ready(stats: dict) -> bool:
            replicas = stats.get("replicas") or []
            return bool(stats.get("writable")) and (not replicas or any(r.get("acknowledges", True) for r in replicas))

        await self._wait(port, ready, "writable")

    async def _wait(self, port: int, ready, what: str, timeout_s: float = 60.0) -> None:
        """Until the broker on `port` reports `ready`; RuntimeError when it exited (another process
        took its port between free_port and its bind) or took over `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not ready((await self.stats(port)) or {}):
            proc = self.procs.get(port)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the broker on port {port} exited with {proc.returncode} (see {self.dir})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker on port {port} was not {what} within {timeout_s:g} s")
            await asyncio.sleep(0.05)

    def stop(self, keep: bool = False) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if keep:
            print(f"# kept {self.dir} (logs of every process)", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


async def send_latency(port: int, rate: int, seconds: float, size: int) -> dict:
    """One message every 1/rate s, each its own BROKER_SEND: the time to its acknowledgement."""
    conn = await AsyncConnection.open(HOST, port, client_id="bench-latency")
    payload = os.urandom(size)
    delays: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        await conn.request(
            RequestCode.BROKER_SEND, {"messages": [{"id": f"l{i}", "subject": "lat", "payload": payload}]}
        )
        delays.append(time.perf_counter() - t0)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    await conn.close()
    delays.sort()
    return {"p50_ms": delays[len(delays) // 2] * 1000, "p99_ms": delays[int(len(delays) * 0.99)] * 1000}


async def failover_time(cluster: Cluster) -> dict:
    """Send one message every 10 ms to whoever is master; SIGKILL the master; the time until a send
    is acknowledged by another broker."""
    master = cluster.ports[0]
    kill_at: float | None = None
    i = 0
    while True:
        for port in [master] + [p for p in cluster.ports if p != master]:
            if kill_at is not None and port == master:
                continue
            try:
                conn = await AsyncConnection.open(HOST, port, client_id="bench-failover", timeout=1)
            except OSError:
                continue
            try:
                i += 1
                await conn.request(
                    RequestCode.BROKER_SEND,
                    {"messages": [{"id": f"f{i}", "subject": "fo", "payload": b"x"}]},
                    timeout=2,
                )
            except (OSError, RemoteError, TimeoutError):
                continue
            finally:
                await conn.close()
            if kill_at is None:
                if i >= 100:
                    cluster.procs[master].send_signal(signal.SIGKILL)
                    kill_at = time.perf_counter()
                break
            return {"seconds": time.perf_counter() - kill_at, "new_master": port}
        await asyncio.sleep(0.01)


def cpu_of(cluster: Cluster) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds so far of each broker of `cluster` (the meta server left out)."""
    return {port: cpu_split(cluster.procs[port].pid) for port in cluster.ports}


def py_spy(cluster: Cluster, port: int, name: str, seconds: float) -> subprocess.Popen | None:
    """`py-spy record` of the broker on `port` for `seconds` into <name>.svg beside this run's
    logs (py-spy from the venv, when installed)."""
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        print("# py-spy is not installed: pip install py-spy", file=sys.stderr)
        return None
    out = Path(os.environ.get("QMQ_BENCH_PROFILE_DIR", tempfile.gettempdir())) / f"{name}.txt"
    args = [exe, "record", "-p", str(cluster.procs[port].pid), "-d", str(int(seconds)), "-r", "200"]
    args += ["--format", "raw", "-o", str(out), "--nonblocking"]
    print(f"# profiling {name} into {out}", file=sys.stderr)
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def produce_round(replicated: bool, args: argparse.Namespace, profile: bool) -> dict:
    """One produce run on a new cluster: rate, batch latency, CPU per 1,000 messages of each broker."""
    cluster = Cluster(replicated, tree=args.tree)
    try:
        port = cluster.ports[0]
        before = cpu_of(cluster)
        load = os.getloadavg()[0]
        spies = []
        if profile:
            for i, p in enumerate(cluster.ports):
                kind = ("master" if i == 0 else "replica") if replicated else "single"
                spy = py_spy(cluster, p, f"qmq-{kind}", args.messages / 8000 + 5)
                if spy is not None:
                    spies.append(spy)
            time.sleep(0.5)
        client = time.process_time()
        r = asyncio.run(produce(port, args.messages, args.batch, args.size, connections=2, inflight=args.inflight))
        after = cpu_of(cluster)
        r["client_cpu_ms"] = (time.process_time() - client) * 1e6 / r["messages"]
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on ^C
            spy.wait(30)
        r["load"] = load
        r["cpu_ms"] = [(sum(after[p]) - sum(before[p])) * 1e6 / r["messages"] for p in cluster.ports]
        r["sys_ms"] = [(after[p][1] - before[p][1]) * 1e6 / r["messages"] for p in cluster.ports]
    except BaseException:
        cluster.stop(keep=True)
        raise
    cluster.stop()
    return r


def report_produce(args: argparse.Namespace) -> None:
    """Single and replicated interleaved, `args.rounds` times; each round's ratio, then the medians."""
    rates: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    for n in range(args.rounds):
        for replicated in (False, True):
            r = produce_round(replicated, args, profile=args.profile and n == 0)
            rates[replicated].append(r["rate"])
            name = "replicated (--ack-replicas 1)" if replicated else "single broker"
            cpu = f"master {r['cpu_ms'][0]:.1f} (system {r['sys_ms'][0]:.1f})"
            cpu += f", replica {r['cpu_ms'][1]:.1f} (system {r['sys_ms'][1]:.1f})" if replicated else ""
            cpu += f", load generator {r['client_cpu_ms']:.1f}"
            print(
                f"produce  round {n + 1} {name:<30} {r['rate']:>8,.0f} msg/s "
                f"(batch p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; CPU ms per 1,000: {cpu}; "
                f"load {r['load']:.2f})",
                flush=True,
            )
        ratios.append(rates[True][-1] / rates[False][-1])
        print(f"produce  round {n + 1} replicated / single: {ratios[-1]:.0%}", flush=True)
    print(
        f"produce  {args.rounds} rounds, batch {args.batch}, 2 conns x {args.inflight} in flight, "
        f"{args.messages:,} messages each: single median {statistics.median(rates[False]):,.0f} msg/s, "
        f"replicated median {statistics.median(rates[True]):,.0f} msg/s; ratio per round "
        f"{', '.join(f'{x:.0%}' for x in ratios)} (median {statistics.median(ratios):.0%})"
    )


def report_latency(args: argparse.Namespace) -> None:
    for n in range(args.rounds):
        for replicated in (False, True):
            cluster = Cluster(replicated, tree=args.tree)
            name = "replicated (--ack-replicas 1)" if replicated else "single broker"
            try:
                load = os.getloadavg()[0]
                r = asyncio.run(send_latency(cluster.ports[0], 1000, 10, args.size))
                print(
                    f"latency  round {n + 1} {name:<30} 1,000 msg/s for 10 s, send to ack: "
                    f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms (load {load:.2f})",
                    flush=True,
                )
            except BaseException:
                cluster.stop(keep=True)
                raise
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", default="all", choices=["all", "produce", "latency", "failover"])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight per connection (2 connections)")
    parser.add_argument("--rounds", type=int, default=3, help="single and replicated, interleaved, this many times")
    parser.add_argument("--failover-after", type=float, default=10.0)
    parser.add_argument("--tree", type=Path, default=ROOT, help="run the brokers of another checkout")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the brokers in the first round (raw stacks, $TMPDIR)"
    )
    args = parser.parse_args()
    install_uvloop()
    print(
        f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, sync flush, "
        f"{args.size} B messages, brokers of {args.tree}, load average {os.getloadavg()[0]:.2f}"
    )
    cases = ["produce", "latency", "failover"] if args.case == "all" else [args.case]
    for case in cases:
        if case == "produce":
            report_produce(args)
        elif case == "latency":
            report_latency(args)
        else:
            cluster = Cluster(True, members=3, failover_after=args.failover_after, tree=args.tree)
            try:
                asyncio.run(cluster.wait_role(cluster.ports[2], "replica"))
                r = asyncio.run(failover_time(cluster))
                print(
                    f"failover --failover-after {args.failover_after:g}s, 3 brokers: SIGKILL of the master to the "
                    f"first acknowledged send on the new master: {r['seconds']:.2f} s"
                )
            finally:
                cluster.stop()


if __name__ == "__main__":
    main()
