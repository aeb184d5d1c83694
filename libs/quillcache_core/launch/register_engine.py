"""`quillcache register-engine`: put an engine an operator started (vLLM, SGLang) in the fleet.

Writes the engine's record under `/quillcache/v1/nodes/engine/{id}` with a lease and
keeps the lease alive until SIGTERM or SIGINT, when the record is removed; if this
process dies, the lease expires and the engine leaves the fleet. The conductor then
subscribes to the engine's KV events and the gateway routes its model to it. The same
record can be written with etcdctl instead (then keep its lease alive yourself):

    etcdctl put /quillcache/v1/nodes/engine/vllm-0 '{"base_url": "http://10.0.0.5:8000",
      "model": "tiny", "tokenizer": "/models/tiny", "block_size": 32,
      "kv_events_endpoint": "tcp://10.0.0.5:5557",
      "kv_replay_endpoint": "tcp://10.0.0.5:5558", "locality_domain": "rack-a"}'
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.service import configure_logging, serve_until_signalled
from quillcache_core.process.settings import load_settings, opt
from quillcache_core.registry import NodeRecord, open_registry

DESCRIPTION = (
    "Register an engine started outside QuillCache (vLLM's OpenAI server with KV events) "
    "in the NodeRegistry and keep its lease alive until SIGTERM/SIGINT, which removes it. "
    "Prints 'READY register-engine id=ID'."
)


@dataclass(frozen=True)
class RegisterEngineConfig:
    id: str = opt("", "the engine's id in the fleet (required)")
    base_url: str = opt("", "the engine's OpenAI server, http://host:port (required)")
    model: str = opt("", "the model name it serves (vLLM's --served-model-name; required)")
    tokenizer: str = opt(
        "",
        "its tokenizer as vLLM names it: the model directory or hub name ('' = the model's "
        "own); a gateway with that directory tokenizes locally, else asks the engine",
    )
    block_size: int = opt(0, "the engine's KV block size in tokens (vLLM's --block-size)")
    kv_events_endpoint: str = opt("", "its ZMQ KV-event publisher, tcp://host:port")
    kv_replay_endpoint: str = opt("", "its ZMQ replay socket, tcp://host:port")
    locality_domain: str = opt("default", "the rack or zone it runs in")
    store_node: str = opt("", "the store node beside it ('' = none)")
    registry: str = opt("", "the etcd URL, e.g. http://127.0.0.1:2379 (required)")
    lease_ttl_s: float = opt(5.0, "lease TTL of the record")
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        for flag, value in (
            ("--id", self.id),
            ("--base-url", self.base_url),
            ("--model", self.model),
            ("--registry", self.registry),
        ):
            if not value:
                raise InvalidArgument(f"{flag} is required")
        if not self.base_url.startswith("http://"):
            raise InvalidArgument("--base-url must be http://host:port")
        if self.block_size < 0 or self.lease_ttl_s <= 0:
            raise InvalidArgument("--block-size must be >= 0 and --lease-ttl-s positive")

    def record(self) -> NodeRecord:
        return NodeRecord(
            kind="engine",
            id=self.id,
            address="",
            locality_domain=self.locality_domain,
            base_url=self.base_url.rstrip("/"),
            kv_events_endpoint=self.kv_events_endpoint,
            kv_replay_endpoint=self.kv_replay_endpoint,
            model=self.model,
            tokenizer=self.tokenizer,
            store_node=self.store_node,
            block_size=self.block_size,
            start_time_s=time.time(),
            extra={"engine_kind": "external"},
        )


class EngineRegistration:
    """The record's lease, kept alive for as long as this runs."""

    def __init__(self, config: RegisterEngineConfig) -> None:
        self.config = config
        self.registry = open_registry(config.registry)

    async def start(self) -> None:
        await self.registry.register(self.config.record(), self.config.lease_ttl_s)

    def ready_line(self) -> str:
        return f"READY register-engine id={self.config.id}"

    async def stop(self) -> None:
        await self.registry.close()


def main(argv: list[str] | None = None) -> int:
    config = load_settings(
        RegisterEngineConfig, argv, prog="quillcache register-engine", description=DESCRIPTION
    )
    configure_logging(config.log_level)
    return asyncio.run(serve_until_signalled(EngineRegistration(config)))


if __name__ == "__main__":
    sys.exit(main())
