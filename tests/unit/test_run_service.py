"""`run_service`: a service runs on the event loop its `event_loop` setting names, and
stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import uvloop

from quillcache_core.process.service import run_service

pytestmark = pytest.mark.unit


class _Probe:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped = False

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        self.stopped = True

    def ready_line(self) -> str:
        return "READY probe"


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_the_service_runs_on_the_named_loop_and_stops_on_sigterm(name, capsys):
    probe = _Probe()
    assert run_service(lambda: probe, name) == 0
    assert isinstance(probe.loop, uvloop.Loop) == (name == "uvloop")
    assert probe.stopped
    assert capsys.readouterr().out.strip() == "READY probe"
