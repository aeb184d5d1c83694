"""`quillcache transfer` / `python -m quillcache_transfer`: moves blocks between stores."""

from __future__ import annotations

import asyncio
import sys

from quillcache_core.process.service import configure_logging, serve_until_signalled
from quillcache_core.process.settings import load_settings
from quillcache_transfer.config import TransferConfig

DESCRIPTION = (
    "QuillCache transfer service: Copy, Move and Prefetch of blocks between store nodes "
    "resolved through the registry. The destination pulls the blocks from the source's "
    "raw TCP block-data port (the bytes go store to store); without one, they stream "
    "through this service in chunks with a bounded window. Checksums verified end to "
    "end, retries with backoff, per-block results. Prints 'READY transfer "
    "grpc=HOST:PORT metrics=http://HOST:PORT'."
)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(
        TransferConfig, argv, prog="quillcache transfer", description=DESCRIPTION
    )
    configure_logging(config.log_level)
    from quillcache_transfer.server import TransferServer

    return asyncio.run(serve_until_signalled(TransferServer(config)))


if __name__ == "__main__":
    sys.exit(main())
