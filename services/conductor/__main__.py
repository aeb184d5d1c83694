"""`quillcache conductor` / `python -m quillcache_conductor`: the control plane."""

from __future__ import annotations

import sys

from quillcache_conductor.config import ConductorConfig
from quillcache_core.process.service import configure_logging, run_service
from quillcache_core.process.settings import load_settings

DESCRIPTION = (
    "QuillCache conductor: routing plans with live load, residency index, reuse guard, "
    "KV events (gRPC and engines' ZMQ publishers), registry watch. Prints "
    "'READY conductor grpc=HOST:PORT metrics=http://HOST:PORT' when serving."
)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(
        ConductorConfig, argv, prog="quillcache conductor", description=DESCRIPTION
    )
    configure_logging(config.log_level)
    from quillcache_conductor.server import ConductorServer

    return run_service(lambda: ConductorServer(config), config.event_loop)


if __name__ == "__main__":
    sys.exit(main())
