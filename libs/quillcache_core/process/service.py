"""Run a service object until SIGTERM/SIGINT: start, print READY, stop cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Protocol


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
