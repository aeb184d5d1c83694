"""Run a service object until SIGTERM/SIGINT: start, print READY, stop cleanly.

With `QUILLCACHE_PROFILE_DIR` set, the event loop's thread runs under cProfile timed
by its own CPU clock (`time.thread_time`: what it costs, not what it waits), and
`<dir>/<service>-<pid>.pstats` is written as it stops (`python -m pstats` reads it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Protocol

from quillcache_core.process.settings import opt

EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop_opt():
    """The `event_loop` setting of a service that runs on `run_service`."""
    return opt("uvloop", "asyncio event loop: uvloop (faster) or Python's own", EVENT_LOOPS)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready_line(self) -> str: ...


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def serve_until_signalled(service: Service) -> int:
    """Start `service`, print its READY line on stdout, run until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except Exception:
        logging.getLogger(__name__).exception("start failed")
        await service.stop()
        return 1
    print(service.ready_line(), flush=True)
    await stop.wait()
    logging.getLogger(__name__).info("signal received, stopping")
    await service.stop()
    return 0


def run_service(make: Callable[[], Service], event_loop: str) -> int:
    """Build the service inside the loop and serve it until signalled, on uvloop or on
    Python's own asyncio loop."""

    async def main() -> int:
        return await serve_until_signalled(make())

    profile_dir = os.environ.get("QUILLCACHE_PROFILE_DIR")
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        try:
            return _run(main, event_loop)
        finally:
            profiler.disable()
            name = os.path.basename(sys.argv[1] if len(sys.argv) > 1 else "service")
            os.makedirs(profile_dir, exist_ok=True)
            profiler.dump_stats(os.path.join(profile_dir, f"{name}-{os.getpid()}.pstats"))
    return _run(main, event_loop)


def _run(main: Callable, event_loop: str) -> int:
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())
