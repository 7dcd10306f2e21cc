"""The figures of one or more runs as a text table with ratios to qmq, as Markdown, and as a PNG chart.

Ratios are the peer's figure divided by qmq's of the same run and kind: for throughput above 1 means
the peer is faster, for latency above 1 means the peer is slower. Message systems are compared with
the "qmq broker" row (the client library), task systems with the "qmq worker" row.
"""

from __future__ import annotations

from pathlib import Path

from bench.peers.workload import Measurement

REFERENCE = {"messages": "qmq broker", "tasks": "qmq worker", "outbox": "qmq outbox -> qmq worker"}
COLUMNS = (
    "system",
    "produce/s",
    "÷qmq",
    "consume/s",
    "÷qmq",
    "p50 ms",
    "÷qmq",
    "p99 ms",
    "÷qmq",
    "on disk at ack",
    "load 1m",
)
CHART_SIZE_IN = (15, 7)
LATENCY_AXIS_FROM_MS = 0.1


def reference(run: list[Measurement], kind: str) -> Measurement | None:
    return next((m for m in run if m.system == REFERENCE[kind] and m.error is None), None)


def ratio(value: float | None, ref: float | None) -> str:
    return f"{value / ref:.2f}" if value and ref else "—"


def number(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def rows(run: list[Measurement]) -> list[tuple[str, ...]]:
    out = []
    for m in run:
        ref = reference(run, m.kind)
        if m.error is not None:
            out.append((m.system, "not measured: " + m.error, *[""] * (len(COLUMNS) - 2)))
            continue
        out.append(
            (
                m.system,
                number(m.produce),
                ratio(m.produce, ref and ref.produce),
                number(m.consume),
                ratio(m.consume, ref and ref.consume),
                number(m.p50_ms, 2),
                ratio(m.p50_ms, ref and ref.p50_ms),
                number(m.p99_ms, 2),
                ratio(m.p99_ms, ref and ref.p99_ms),
                m.synced,
                f"{m.load[0]:.1f}",
            )
        )
    return out


def text_table(run: list[Measurement]) -> str:
    body = rows(run)
    widths = [
        max(len(r[i]) for r in [COLUMNS, *body] if not r[i].startswith("not measured")) for i in range(len(COLUMNS))
    ]
    lines = [
        "  ".join(
            c.ljust(w) if i in (0, 9) else c.rjust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths, strict=True))
        )
    ]
    for r in body:
        if r[1].startswith("not measured"):
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
        else:
            lines.append(
                "  ".join(
                    c.ljust(w) if i in (0, 9) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
                )
            )
    return "\n".join(lines)


def durability(run: list[Measurement]) -> str:
    return "\n".join(f"- {m.system}: {m.durability}. Setup: {m.setup}." for m in run)


def markdown(runs: list[list[Measurement]]) -> str:
    out = []
    for n, run in enumerate(runs, 1):
        out.append(f"Run {n}:\n")
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|---|" + "---:|" * (len(COLUMNS) - 3) + "---|---:|")
        out.extend("| " + " | ".join(r) + " |" for r in rows(run))
        out.append("")
    return "\n".join(out)


def label(m: Measurement) -> str:
    return f"{m.system}{' (tasks)' if m.kind == 'tasks' else ''}\non disk at ack: {m.synced}"


def chart(runs: list[list[Measurement]], path: Path, conditions: str, note: str = "") -> None:
    """Three panels (produce, consume, latency p50 and p99), one bar per system and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [[m for m in run if m.error is None] for run in runs]
    systems = list(dict.fromkeys(label(m) for run in measured for m in run))
    figure, axes = plt.subplots(1, 3, figsize=CHART_SIZE_IN, sharey=True)
    height = 0.8 / max(1, len(runs))
    panels = [
        ("produce: msg/s (tasks published/s)", "produce"),
        ("consume: msg/s (tasks executed/s)", "consume"),
        ("end-to-end latency, ms (log): p50 dark, p99 light", "p50_ms"),
    ]
    for ax, (title, field) in zip(axes, panels, strict=True):
        for n, run in enumerate(measured):
            by_label = {label(m): m for m in run}
            ys = [i + n * height for i in range(len(systems))]
            values = [getattr(by_label[s], field) or 0 if s in by_label else 0 for s in systems]
            ax.barh(ys, values, height, color=f"C{n}", label=f"run {n + 1}")
            if field == "p50_ms":
                p99 = [by_label[s].p99_ms or 0 if s in by_label else 0 for s in systems]
                ax.barh(
                    ys,
                    [b - a for a, b in zip(values, p99, strict=True)],
                    height,
                    left=values,
                    color=f"C{n}",
                    alpha=0.35,
                )
                for y, low, high in zip(ys, values, p99, strict=True):
                    if high:
                        ax.text(high, y, f" {low:.2f} / {high:.1f}", va="center", fontsize=7)
            else:
                for y, v in zip(ys, values, strict=True):
                    if v:
                        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)
        if field == "p50_ms":
            ax.set_xscale("log")
            ax.set_xlim(LATENCY_AXIS_FROM_MS, ax.get_xlim()[1] * 3)
        else:
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:,.0f}k"))
            ax.margins(x=0.15)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="major", alpha=0.3)
    axes[0].set_yticks([i + height * (len(runs) - 1) / 2 for i in range(len(systems))], systems, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(f"qmq against its peers: {conditions}", fontsize=11)
    if note:
        figure.text(0.01, 0.01, note, fontsize=8, color="0.3")
    figure.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
