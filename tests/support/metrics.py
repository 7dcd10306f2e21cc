"""Reading a server's Prometheus metrics over HTTP, as a scraper does."""

from __future__ import annotations

import re
import urllib.request

HOST = "127.0.0.1"


def scrape(port: int, host: str = HOST) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` with exactly `labels` (in any order), or None."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match and match.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")) == labels:
            return float(match.group(3))
    return None
