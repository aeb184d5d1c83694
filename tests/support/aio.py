"""Running a test's coroutine: a fresh event loop with a deadline."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
    """asyncio.run with a deadline. Each test gets a fresh loop; collecting garbage
    while the loop still runs lets grpc.aio release everything bound to it (else its
    poller may later poke the closed loop: "Event loop is closed" noise)."""

    async def bounded() -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await coro
        finally:
            gc.collect()
            await asyncio.sleep(0)

    asyncio.run(bounded())
