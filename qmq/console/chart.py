"""Charts as inline SVG, drawn on the server: lines over time (a group's backlog, its rates) and bars
(a delay server's pending messages per hour ahead). Nothing is fetched by the browser, no script
runs; what the chart shows is also in the page's tables. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape

from markupsafe import Markup

WIDTH, HEIGHT = 640, 200
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 48, 12, 12, 28
PLOT_WIDTH, PLOT_HEIGHT = WIDTH - MARGIN_LEFT - MARGIN_RIGHT, HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
COLOURS = ("#1f77b4", "#ff7f0e", "#9467bd", "#d62728", "#2ca02c", "#7f7f7f")

Point = tuple[float, float | None]  # (time in seconds since the epoch, value or None for a gap)


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%H:%M:%S")


def _frame(title: str) -> list[str]:
    """The opening of a chart's SVG: its size, title and the plot area."""
    return [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{PLOT_WIDTH}" height="{PLOT_HEIGHT}" class="plot"/>',
    ]


def line_chart(title: str, series: Sequence[tuple[str, Sequence[Point]]], unit: str = "") -> Markup:
    """Lines of `series` ((name, points)) on one time axis, from 0 to the highest value."""
    points = [(t, v) for _name, pts in series for t, v in pts if v is not None]
    plot_w, plot_h = PLOT_WIDTH, PLOT_HEIGHT
    parts = _frame(title)
    if len(points) < 2:
        parts.append(
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">'
            "collecting samples…</text></svg>"
        )
        return Markup("".join(parts))
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    top = max(v for _, v in points) or 1.0
    span = (t1 - t0) or 1.0

    def x(t: float) -> float:
        return MARGIN_LEFT + (t - t0) / span * plot_w

    def y(v: float) -> float:
        return MARGIN_TOP + plot_h - v / top * plot_h

    for fraction in (0.0, 0.5, 1.0):
        value = top * fraction
        parts.append(
            f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            'class="grid"/>'
            f'<text x="{MARGIN_LEFT - 4}" y="{y(value) + 4:.1f}" text-anchor="end">'
            f"{_number(value)}{escape(unit)}</text>"
        )
    parts.append(f'<text x="{MARGIN_LEFT}" y="{HEIGHT - 8}">{_clock(t0)}</text>')
    parts.append(f'<text x="{WIDTH - MARGIN_RIGHT}" y="{HEIGHT - 8}" text-anchor="end">{_clock(t1)} UTC</text>')
    for i, (name, pts) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for t, v in pts:
            if v is None:
                runs.append([])
            else:
                runs[-1].append(f"{x(t):.1f},{y(v):.1f}")
        for run in runs:
            if len(run) > 1:
                parts.append(f'<polyline points="{" ".join(run)}" stroke="{colour}" class="line"/>')
            elif run:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
        legend_x = MARGIN_LEFT + 8 + i * 120
        parts.append(
            f'<rect x="{legend_x}" y="{MARGIN_TOP + 6}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{legend_x + 14}" y="{MARGIN_TOP + 15}" class="legend">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(title: str, bars: Sequence[tuple[str, float]]) -> Markup:
    """One bar per (label, value), labels under them (a delay server's hour buckets)."""
    plot_w, plot_h = PLOT_WIDTH, PLOT_HEIGHT
    parts = _frame(title)
    if not bars:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">nothing pending')
        parts.append("</text>")
    else:
        top = max(v for _, v in bars) or 1.0
        step = plot_w / len(bars)
        for i, (label, value) in enumerate(bars):
            h = value / top * plot_h
            bx = MARGIN_LEFT + i * step + step * 0.1
            parts.append(
                f'<rect x="{bx:.1f}" y="{MARGIN_TOP + plot_h - h:.1f}" width="{step * 0.8:.1f}" height="{h:.1f}" '
                f'fill="{COLOURS[0]}"><title>{escape(label)}: {_number(value)}</title></rect>'
            )
            if len(bars) <= 12 or i % max(1, len(bars) // 12) == 0:
                parts.append(
                    f'<text x="{bx + step * 0.4:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(label[-5:])}</text>'
                )
        parts.append(f'<text x="{MARGIN_LEFT - 4}" y="{MARGIN_TOP + 10}" text-anchor="end">{_number(top)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


SPARK_WIDTH, SPARK_HEIGHT = 120, 24


def sparkline(points: Sequence[Point]) -> Markup:
    """A small line of one series (a group's backlog in the groups table), without axes."""
    values = [(t, v) for t, v in points if v is not None]
    if len(values) < 2:
        return Markup("")
    t0, t1 = values[0][0], values[-1][0]
    top = max(v for _, v in values) or 1.0
    span = (t1 - t0) or 1.0
    line = " ".join(
        f"{(t - t0) / span * (SPARK_WIDTH - 2) + 1:.1f},{SPARK_HEIGHT - 1 - v / top * (SPARK_HEIGHT - 2):.1f}"
        for t, v in values
    )
    return Markup(
        f'<svg class="spark" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}" '
        f'xmlns="http://www.w3.org/2000/svg"><polyline points="{line}" stroke="{COLOURS[0]}" class="line"/></svg>'
    )
