"""Helpers every benchmark command shares: progress, percentiles, result files, plots."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = max(1, total)
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.done < self.total and now - self._last < (0.1 if self._tty else 2.0):
            return
        self._last = now
        pct = 100.0 * self.done / self.total
        if self._tty:
            filled = int(pct / 5)
            bar = "#" * filled + "." * (20 - filled)
            end = "\n" if self.done >= self.total else ""
            print(f"\r{self.label:<28} [{bar}] {pct:5.1f}%", end=end, file=sys.stderr, flush=True)
        else:
            print(f"{self.label}: {pct:.0f}%", file=sys.stderr, flush=True)


# Words for the benchmarks' synthetic prompts (the sim engines' built-in tokenizer makes
# about two tokens of a word).
WORDS = (
    "the cache block token prefix engine request reply model tenant store node route plan "
    "fetch hit miss evict offload memory disk page queue batch stream first last next"
).split()


def percentiles_us(samples_s: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(samples_s, dtype=np.float64) * 1e6
    return {
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "mean_us": float(arr.mean()),
    }


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if n == 0 or i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine_info() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def write_results(name: str, payload: dict, out_dir: str | os.PathLike = "bench/results") -> Path:
    """Write `payload` as bench/results/<name>-<UTC timestamp>.json and <name>-latest.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    payload = {"name": name, "utc": stamp, "machine": machine_info(), **payload}
    path = out / f"{name}-{stamp}.json"
    text = json.dumps(payload, indent=2, sort_keys=True)
    path.write_text(text)
    (out / f"{name}-latest.json").write_text(text)
    return path


async def read_chat_stream(content, sent_s: float, sample) -> tuple[str, dict | None]:
    """Read an OpenAI chat-completion stream (server-sent events) to its end (the whole
    body, as the openai SDK does: a body left unread closes a keep-alive connection).

    `sample.ttft_s` is set at the first chunk with content (seconds after `sent_s`),
    `sample.error` at an error chunk, `sample.ok` at `[DONE]` unless an error came.
    Returns the answer's text and the last `usage` seen (None without one). An
    unparsable chunk raises ValueError."""
    parts: list[str] = []
    usage = None
    done = False
    async for raw in content:  # to the body's end, past [DONE], so the connection is reused
        line = raw.decode("utf-8", "replace").strip()
        if done or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            sample.ok = not sample.error
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            sample.error = str(chunk["error"])[:200]
            continue
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                if sample.ttft_s is None:
                    sample.ttft_s = time.perf_counter() - sent_s
                parts.append(text)
        usage = chunk.get("usage") or usage
    return "".join(parts), usage
