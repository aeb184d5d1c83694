"""`quillcache sim-engine` / `python -m quillcache_simengine`: a stand-in for vLLM."""

from __future__ import annotations

import asyncio
import sys

from quillcache_core.process.service import configure_logging, serve_until_signalled
from quillcache_core.process.settings import load_settings
from quillcache_simengine.config import SimEngineConfig

DESCRIPTION = (
    "QuillCache sim engine: an OpenAI-compatible stand-in for vLLM with a paged KV cache "
    "(LRU), simulated prefill/decode time, vLLM KV events over ZMQ, offload of evicted "
    "blocks to a store node and FETCH from it. Prints 'READY sim-engine http=URL "
    "kv_events=ENDPOINT replay=ENDPOINT metrics=URL' when serving (tcp://HOST:PORT, or "
    "ipc://DIR/NODE-events and -replay with --kv-events-dir)."
)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(
        SimEngineConfig, argv, prog="quillcache sim-engine", description=DESCRIPTION
    )
    configure_logging(config.log_level)
    from quillcache_simengine.server import SimEngineServer

    return asyncio.run(_run(SimEngineServer, config))


async def _run(server_cls, config: SimEngineConfig) -> int:
    try:
        server = server_cls(config)
    except Exception as exc:  # e.g. a tokenizer file that does not load
        print(f"quillcache sim-engine: {exc}", file=sys.stderr)
        return 2
    return await serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
