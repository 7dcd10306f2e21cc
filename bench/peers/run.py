"""qmq against its peers, the same workload on each, on this machine, one system after the other.

    .venv/bin/python -m bench.peers.run                        # every system, 100,000 messages of 1 KiB
    .venv/bin/python -m bench.peers.run --repeat 2             # two runs, both reported and charted
    .venv/bin/python -m bench.peers.run --systems qmq redis --messages 10000

Systems: qmq (a `qmq broker --flush sync` process of its own), RabbitMQ at 127.0.0.1:5672 (guest/guest),
NATS JetStream at 127.0.0.1:4222, Redis Streams at 127.0.0.1:6379, and for task throughput Celery on
that Redis against the qmq worker. A peer that cannot be reached is named with the command that
starts it (or started with it, given --start-stopped) and the rest are still measured. Needs the
`bench` extra (`pip install -e '.[bench]'`). Prints a table with ratios to qmq per run, the durability
of each system, Markdown with --markdown; writes the chart (docs/peers.png) and, with --json, the
figures. Not run in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.peers import priority, report
from bench.peers.workload import HOST, Measurement, Options, fsync_probe, reachable

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class System:
    label: str
    module: str  # under bench.peers, imported only when the system is measured
    port: int | None  # None: started by the benchmark itself
    start: str = ""  # the command that starts it on this machine
    also_ports: tuple[int, ...] = ()  # other servers it uses, given the benchmark's priority too


SYSTEMS = {
    "qmq": System("qmq", "qmq_broker", None),
    "rabbitmq": System("RabbitMQ", "rabbitmq", 5672, "rabbitmq-server -detached"),
    "nats": System(
        "NATS JetStream",
        "nats_jetstream",
        4222,
        "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 "
        "-p 4222 -js -sd /var/lib/nats-server",
    ),
    "redis": System("Redis Streams", "redis_streams", 6379, 'redis-server --daemonize yes --port 6379 --save ""'),
    "celery": System(
        "Celery on Redis (and the qmq worker)",
        "celery_redis",
        6379,
        'redis-server --daemonize yes --port 6379 --save ""',
    ),
    "outbox": System(  # commit to handler: the qmq outbox against Celery's on_commit(delay); PostgreSQL too
        "qmq outbox and Celery on_commit",
        "outbox_path",
        6379,
        'redis-server --daemonize yes --port 6379 --save ""',
        also_ports=(5432,),
    ),
}


def start(system: System) -> bool:
    """Run the system's start command and wait for its port; whether it is reachable now."""
    print(f"# starting {system.label}: {system.start}", flush=True)
    subprocess.run(system.start, shell=True, check=False)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if system.port is not None and reachable(HOST, system.port):
            return True
        time.sleep(0.5)
    return False


def measure(system: System, options: Options, start_stopped: bool, match_priority: bool = True) -> list[Measurement]:
    if system.port is not None and not reachable(HOST, system.port) and not (start_stopped and start(system)):
        error = f"not reachable at {HOST}:{system.port}; start it with: {system.start}"
        print(f"# {system.label}: {error}", file=sys.stderr, flush=True)
        return [Measurement(system.label, "", "", "", error=error)]
    if match_priority:
        for port in (system.port, *system.also_ports) if system.port is not None else ():
            print(priority.match(port, system.label), flush=True)
    try:
        module = importlib.import_module(f"bench.peers.{system.module}")
        return module.measure(options)
    except Exception as exc:  # one system failing must not stop the others
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        print(f"# {system.label}: {error}", file=sys.stderr, flush=True)
        return [Measurement(system.label, "", "", "", error=error)]
    finally:
        priority.restore()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def disk() -> str:
    p50, p99 = fsync_probe()
    return f"1 KiB write + fdatasync in /tmp: p50 {p50:.2f} ms, p99 {p99:.2f} ms"


def conditions(options: Options) -> str:
    size = "1 KiB" if options.size == 1024 else f"{options.size} B"
    return (
        f"{options.messages:,} messages of {size}; latency at {options.latency_rate:,}/s for "
        f"{options.latency_seconds:g} s; {platform.node()}, {os.cpu_count()} cores"
    )


CHART_NOTE = (
    "Tasks: a no-op task with a ~100-byte argument, both workers -P threads -c 8, latency at 200/s. "
    "Ratios and durability: see docs/benchmarks.md. Other developers' work ran on the same 2 cores and disk."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--messages", type=int, default=Options.messages)
    parser.add_argument("--size", type=int, default=Options.size)
    parser.add_argument("--rate", type=int, default=Options.latency_rate, help="latency case, msg/s")
    parser.add_argument("--seconds", type=float, default=Options.latency_seconds, help="latency case, seconds")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--start-stopped", action="store_true", help="run the start command of an unreachable peer")
    parser.add_argument(
        "--keep-priority",
        action="store_true",
        help="leave the peers' servers at their own niceness (default: this process's; bench/peers/priority.py)",
    )
    parser.add_argument("--chart", default=str(ROOT / "docs" / "peers.png"), help="PNG to write; '' for none")
    parser.add_argument("--json", help="write the figures of every run to this file")
    parser.add_argument("--from-json", help="report and chart the runs in this file instead of measuring")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown too")
    args = parser.parse_args()
    options = Options(args.messages, args.size, args.rate, args.seconds)
    try:
        import uvloop  # every system runs on the same event loop

        uvloop.install()
    except ImportError:
        pass

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        title = saved["conditions"]
        runs = [[Measurement(**{**m, "load": tuple(m["load"])}) for m in run] for run in saved["runs"]]
    else:
        title = conditions(options)
        runs = []
        for n in range(args.repeat):
            print(f"# run {n + 1}: {title}; {uptime()}; {disk()}", flush=True)
            run: list[Measurement] = []
            for name in args.systems:
                print(f"# {SYSTEMS[name].label} ({uptime()})", flush=True)
                run.extend(measure(SYSTEMS[name], options, args.start_stopped, not args.keep_priority))
            runs.append(run)
            print(f"\n# run {n + 1} done ({uptime()}; {disk()})\n{report.text_table(run)}\n", flush=True)
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"conditions": title, "runs": [[dataclasses.asdict(m) for m in run] for run in runs]}, indent=1
                )
            )
    if args.from_json or len(runs) > 1:
        for n, run in enumerate(runs, 1):
            print(f"Run {n}:\n{report.text_table(run)}\n")
    print(
        "Ratios (÷qmq) are the system's figure over qmq's in the same run: above 1 is faster for throughput, "
        "slower for latency. Durability and setup:"
    )
    print(report.durability([m for m in runs[-1] if m.error is None]))
    if args.markdown:
        print("\n" + report.markdown(runs))
    if args.chart:
        report.chart(runs, Path(args.chart), title, CHART_NOTE)
        print(f"\nchart: {args.chart}")


if __name__ == "__main__":
    main()
