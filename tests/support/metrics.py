"""Reading a process's /metrics in tests: the text, and the sum of a metric's samples."""

from __future__ import annotations

import re
import urllib.request

from tests.support.cluster import https


def scrape(endpoints, url: str) -> str:
    """The /metrics text at `url`, read with the endpoints file's operator certificate."""
    with urllib.request.urlopen(url, timeout=10, context=https(endpoints)) as reply:
        return reply.read().decode()


def series(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total
