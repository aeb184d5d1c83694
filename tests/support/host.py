"""What another user of the host sees of a running cluster: its processes in /proc.

A process of `quillcache up` (or of a bench's cluster) names its data directory on its
command line (a data dir, a log, a credential dir), so that name finds them all, the
ones started since and the ones left behind.
"""

from __future__ import annotations

from pathlib import Path


def processes_naming(marker: str | Path) -> dict[int, str]:
    """pid -> command line (arguments joined by spaces) of every live process whose
    command line contains `marker`; zombies (exited, not yet reaped) are not live."""
    needle = str(marker).encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if needle in cmdline and state != "Z":
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found
