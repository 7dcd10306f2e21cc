"""The last reconciliation's report, as `qmq reconcile --out DIR` left it (spark_etl/report.py):
`summary.json` (counts per class, the window, the verdict), `report.md` and `anomalies.png`. The
console is given DIR, or a folder of such folders (one per night): the newest with a summary wins,
a summary being written last (its presence says the run finished). Read-only; no Spark.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY_FILE, REPORT_FILE, CHART_FILE = "summary.json", "report.md", "anomalies.png"  # spark_etl/report.py
CLASSES = ("delivered", "not_shipped", "not_acked", "dead_lettered", "redelivered", "orphaned", "rolled_back")


def latest_run(root: Path) -> Path | None:
    """The folder of the newest finished run under `root` (or `root` itself)."""
    if (root / SUMMARY_FILE).is_file():
        return root
    runs = [p.parent for p in root.glob(f"*/{SUMMARY_FILE}")]
    return max(runs, key=lambda p: (p / SUMMARY_FILE).stat().st_mtime, default=None)


def read_report(root: Path) -> dict[str, Any] | None:
    """{"dir", "summary", "counts": [(class, n)], "report" (markdown text), "chart" (a path or
    None), "finished_at"}; None when no run finished under `root`."""
    run = latest_run(root)
    if run is None:
        return None
    summary = json.loads((run / SUMMARY_FILE).read_text())
    report = run / REPORT_FILE
    chart = run / CHART_FILE
    return {
        "dir": str(run),
        "summary": summary,
        "counts": [(c, summary.get(c, 0)) for c in ("total", *CLASSES) if c in summary],
        "report": report.read_text() if report.is_file() else "",
        "chart": chart if chart.is_file() else None,
        "finished_at": (run / SUMMARY_FILE).stat().st_mtime,
    }
