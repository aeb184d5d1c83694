"""`quillcache gateway` / `python -m quillcache_gateway`: the OpenAI-compatible proxy."""

from __future__ import annotations

import sys

from quillcache_core.process.service import configure_logging, run_service
from quillcache_core.process.settings import load_settings
from quillcache_gateway.config import GatewayConfig

DESCRIPTION = (
    "QuillCache gateway: OpenAI-compatible HTTP proxy (/v1/chat/completions, /v1/completions, "
    "/v1/models, /health, /metrics). Hashes each prompt into KV blocks, asks the conductor "
    "for a plan, streams the chosen engine's answer with x-quillcache-* headers. Prints "
    "'READY gateway http=http://HOST:PORT' when serving."
)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(GatewayConfig, argv, prog="quillcache gateway", description=DESCRIPTION)
    configure_logging(config.log_level)
    from quillcache_gateway.server import Gateway

    return run_service(lambda: Gateway(config), config.event_loop)


if __name__ == "__main__":
    sys.exit(main())
