"""`quillcache store` / `python -m quillcache_store`: one store node."""

from __future__ import annotations

import asyncio
import sys

from quillcache_core.process.service import configure_logging, serve_until_signalled
from quillcache_core.process.settings import load_settings
from quillcache_store.config import StoreConfig

DESCRIPTION = (
    "QuillCache store node: DRAM and crash-consistent SSD (LMDB) tiers of KV blocks, "
    "gRPC Put/Get/Exists/Delete/Stats/Pull, a raw TCP block-data port peers pull blocks "
    "from, peer fetch, residency events to the conductor, etcd lease. Prints 'READY store "
    "grpc=HOST:PORT metrics=http://HOST:PORT data=HOST:PORT' when serving (no data= with "
    "--data-port -1)."
)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(StoreConfig, argv, prog="quillcache store", description=DESCRIPTION)
    configure_logging(config.log_level)
    from quillcache_store.server import StoreServer

    return asyncio.run(serve_until_signalled(StoreServer(config)))


if __name__ == "__main__":
    sys.exit(main())
