"""What a reconciliation leaves for people and programs, from figures already collected on the
driver: `summary.json` (a count per class, `total`, the verdict), `report.md` (per subject and
group, examples of each anomaly with its reason, the repairs made) and `anomalies.png` (anomalies
per subject, by class). Nothing here touches Spark.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spark_etl.classify import ANOMALIES, CLASSES, CRITICAL, NOT_SHIPPED
from spark_etl.redrive import RedriveReport

SUMMARY_FILE, REPORT_FILE, CHART_FILE = "summary.json", "report.md", "anomalies.png"
CLASSIFIED_DIR, ANOMALIES_DIR, PAIRS_DIR = "classified", "anomalies", "pairs"
EXAMPLES_PER_CLASS = 20
OK, THRESHOLD_EXCEEDED, CRITICAL_FOUND = 0, 3, 4  # exit codes
CLASS_COLOURS = {
    "rolled_back": "#7f0000",
    "not_shipped": "#d62728",
    "dead_lettered": "#9467bd",
    "not_acked": "#ff7f0e",
    "redelivered": "#1f77b4",
    "orphaned": "#7f7f7f",
}


@dataclass
class Findings:
    window: dict[str, Any]  # since, until, as_of, grace_s, cutoff
    sources: dict[str, Any]  # outbox databases, consumed databases, ledger stores
    counts: dict[str, int]  # class -> messages
    per_subject: dict[str, dict[str, int]]  # subject -> class -> messages
    per_group: list[dict[str, Any]]  # subject, group, messages, acked, not_acked, dead, redelivered
    examples: dict[str, list[dict[str, Any]]]  # class -> [{message_id, subject, groups, reason}]
    thresholds: dict[str, str]  # class -> threshold as given
    exceeded: list[str] = field(default_factory=list)
    redrive: RedriveReport | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def exit_code(self) -> int:
        if any(self.counts.get(c, 0) for c in CRITICAL):
            return CRITICAL_FOUND
        return THRESHOLD_EXCEEDED if self.exceeded else OK


def summary(findings: Findings) -> dict[str, Any]:
    counts = {"total": findings.total, **{c: findings.counts.get(c, 0) for c in CLASSES}}
    out: dict[str, Any] = {
        **counts,
        "anomalies": sum(findings.counts.get(c, 0) for c in ANOMALIES),
        "critical": sum(findings.counts.get(c, 0) for c in CRITICAL),
        "window": findings.window,
        "thresholds": findings.thresholds,
        "exceeded": findings.exceeded,
        "exit_code": findings.exit_code,
        "subjects": findings.per_subject,
        "groups": findings.per_group,
        "sources": findings.sources,
    }
    if findings.redrive is not None:
        out["redrive"] = asdict(findings.redrive)
    return out


def write_all(out: Path, findings: Findings) -> None:
    """The chart, the report, and last the summary (its presence says the run finished)."""
    out.mkdir(parents=True, exist_ok=True)
    write_chart(out / CHART_FILE, findings)
    _replace(out / REPORT_FILE, render_report(findings))
    _replace(out / SUMMARY_FILE, json.dumps(summary(findings), indent=2, default=str) + "\n")


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_chart(path: Path, findings: Findings) -> None:
    """A horizontal bar per subject, stacked by anomaly class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    subjects = sorted(
        (s for s, c in findings.per_subject.items() if any(c.get(a) for a in ANOMALIES)),
        key=lambda s: -sum(findings.per_subject[s].get(a, 0) for a in ANOMALIES),
    )
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.45 * max(1, len(subjects))), dpi=100)
    if not subjects:
        ax.text(0.5, 0.5, f"no anomalies among {findings.total:,} messages", ha="center", va="center", fontsize=13)
        ax.set_axis_off()
    else:
        left = [0] * len(subjects)
        for cls in ANOMALIES:
            values = [findings.per_subject[s].get(cls, 0) for s in subjects]
            if any(values):
                ax.barh(subjects, values, left=left, label=cls, color=CLASS_COLOURS[cls])
                left = [a + b for a, b in zip(left, values, strict=True)]
        ax.invert_yaxis()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("messages")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"qmq reconciliation {findings.window['since']} .. {findings.window['until']}: anomalies")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def render_report(f: Findings) -> str:
    w = f.window
    verdict = {
        OK: "**OK**: within the thresholds.",
        THRESHOLD_EXCEEDED: f"**FAILED**: {', '.join(f.exceeded)} over the threshold.",
        CRITICAL_FOUND: "**CRITICAL**: messages of rolled-back transactions were found on brokers.",
    }
    lines = [
        f"# qmq reconciliation: {w['since']} .. {w['until']}",
        "",
        f"{verdict[f.exit_code]} {f.total:,} messages; the ledger is complete up to {w['as_of']}; messages made "
        f"after {w['cutoff']} (grace {w['grace_s']:g} s) are counted in flight, not reported.",
        "",
        "| class | messages | threshold |",
        "|---|---:|---|",
        *[f"| {c} | {f.counts.get(c, 0):,} | {f.thresholds.get(c, '')} |" for c in CLASSES],
        f"| **total** | {f.total:,} | |",
        "",
        f"![anomalies per subject]({CHART_FILE})",
        "",
        "## Per subject",
        "",
        "| subject | " + " | ".join(CLASSES) + " |",
        "|---|" + "---:|" * len(CLASSES),
        *[
            f"| {s} | " + " | ".join(f"{c.get(k, 0):,}" for k in CLASSES) + " |"
            for s, c in sorted(f.per_subject.items())
        ],
        "",
        "## Per consumer group",
        "",
        "Messages of the window each group consumes (or received), and what became of them there.",
        "",
        "| subject | group | messages | acked | not acked | dead-lettered | received twice or more |",
        "|---|---|---:|---:|---:|---:|---:|",
        *[
            f"| {g['subject']} | {g['group']} | {g['messages']:,} | {g['acked']:,} | {g['not_acked']:,} | "
            f"{g['dead']:,} | {g['redelivered']:,} |"
            for g in f.per_group
        ],
        "",
        "## Anomalies",
        "",
        f"Every one is in `{ANOMALIES_DIR}/` (Parquet: message id, class, subject, database, groups, reason); "
        f"every message of the window with its class is in `{CLASSIFIED_DIR}/`, and every (message, group) in "
        f"`{PAIRS_DIR}/`.",
        "",
    ]
    for cls in ANOMALIES:
        examples = f.examples.get(cls, [])
        if not examples:
            continue
        count = f.counts.get(cls, 0)
        lines += [f"### {cls} ({count:,})", "", "| message id | subject | reason |", "|---|---|---|"]
        lines += [f"| `{e['message_id']}` | {e['subject']} | {_cell(e['reason'])} |" for e in examples]
        if count > len(examples):
            lines.append(f"| ... {count - len(examples):,} more | | |")
        lines.append("")
    lines += _redrive_section(f.redrive)
    lines += ["## Sources", "", "```", json.dumps(f.sources, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _redrive_section(redrive: RedriveReport | None) -> list[str]:
    if redrive is None:
        return []
    lines = ["## Repairs", ""]
    for database, rows in redrive.outbox.items():
        lines.append(
            f"- {NOT_SHIPPED}: {rows:,} outbox rows of `{database}` put back to pending "
            f"({redrive.outbox_skipped.get(database, 0):,} left alone: leased at that moment, or gone)."
        )
    for item in redrive.dead:
        outcome = f"{item['redriven']:,} dead letters re-driven" if "redriven" in item else f"failed: {item['error']}"
        lines.append(f"- dead letters of {item['subject']} / {item['group']} on {item['broker']}: {outcome}.")
    if not redrive.outbox and not redrive.dead:
        lines.append("- nothing to repair.")
    return [*lines, ""]


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")
