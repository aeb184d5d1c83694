"""`quillcache register-engine`: put an engine an operator started (vLLM, SGLang) in the fleet.

Writes the engine's record under `/quillcache/v1/nodes/engine/{id}` with a lease and
keeps the lease alive until SIGTERM or SIGINT, when the record is removed; if this
process dies, the lease expires and the engine leaves the fleet. It also watches the
engine's start time (`process_start_time_seconds` on its /metrics, every
--watch-interval-s): when the engine restarts, its cache is gone, and the record is
written again with the new start time, so the conductor drops what the engine held. The conductor then
subscribes to the engine's KV events and the gateway routes its model to it. The same
record can be written with etcdctl instead, as the `engine` role (etcd lets no other
role write engine records; then keep its lease alive yourself):

    etcdctl --endpoints https://10.0.0.2:2379 --cacert certs/ca.pem \
      --cert certs/engine.pem --key certs/engine-key.pem \
      put /quillcache/v1/nodes/engine/vllm-0 '{"base_url": "https://10.0.0.5:8000",
      "model": "tiny", "tokenizer": "/models/tiny", "block_size": 32,
      "kv_events_endpoint": "tcp://10.0.0.5:5557",
      "kv_replay_endpoint": "tcp://10.0.0.5:5558", "locality_domain": "rack-a"}'
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import urllib.request
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.service import configure_logging, serve_until_signalled
from quillcache_core.process.settings import load_settings, opt
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.security.tls import Tls, TlsSettings

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Register an engine started outside QuillCache (vLLM's OpenAI server with KV events) "
    "in the NodeRegistry and keep its lease alive until SIGTERM/SIGINT, which removes it. "
    "Prints 'READY register-engine id=ID'."
)


@dataclass(frozen=True)
class RegisterEngineConfig(TlsSettings):
    id: str = opt("", "the engine's id in the fleet (required)")
    base_url: str = opt(
        "", "the engine's OpenAI server, https://host:port (http:// with --insecure; required)"
    )
    model: str = opt("", "the model name it serves (vLLM's --served-model-name; required)")
    tokenizer: str = opt(
        "",
        "its tokenizer as vLLM names it: the model directory or hub name ('' = the model's "
        "own); a gateway with that directory tokenizes locally, else asks the engine",
    )
    block_size: int = opt(0, "the engine's KV block size in tokens (vLLM's --block-size)")
    capacity_bytes: int = opt(0, "the bytes its KV cache holds (0 = not said)")
    kv_events_endpoint: str = opt("", "its ZMQ KV-event publisher, tcp://host:port")
    kv_replay_endpoint: str = opt("", "its ZMQ replay socket, tcp://host:port")
    locality_domain: str = opt("default", "the rack or zone it runs in")
    store_node: str = opt("", "the store node beside it ('' = none)")
    role: str = opt(
        "both",
        "its part in prefill/decode disaggregation: prefill (computes prompts into the "
        "pool), decode (loads them and generates) or both",
        choices=("prefill", "decode", "both"),
    )
    registry: str = opt("", "the etcd URL, e.g. http://127.0.0.1:2379 (required)")
    lease_ttl_s: float = opt(5.0, "lease TTL of the record")
    watch_interval_s: float = opt(
        2.0, "how often to read the engine's start time from its /metrics (0 = never)"
    )
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, value in (
            ("--id", self.id),
            ("--base-url", self.base_url),
            ("--model", self.model),
            ("--registry", self.registry),
        ):
            if not value:
                raise InvalidArgument(f"{flag} is required")
        scheme = "http://" if self.insecure else "https://"
        if not self.base_url.startswith(scheme):
            raise InvalidArgument(f"--base-url must be {scheme}host:port")
        if self.block_size < 0 or self.capacity_bytes < 0 or self.lease_ttl_s <= 0:
            raise InvalidArgument(
                "--block-size and --capacity-bytes must be >= 0 and --lease-ttl-s positive"
            )

    def record(self, start_time_s: float) -> NodeRecord:
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
            capacity_bytes=self.capacity_bytes,
            start_time_s=start_time_s,
            role=self.role,
            extra={"engine_kind": "external"},
        )


class EngineRegistration:
    """The record's lease, kept alive for as long as this runs."""

    def __init__(self, config: RegisterEngineConfig) -> None:
        self.config = config
        self.tls = config.tls("engine")
        self.registry = open_registry(config.registry, self.tls)
        self.started_at = 0.0
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self.started_at = await engine_start_time(self.config.base_url, self.tls) or time.time()
        await self.registry.register(self.config.record(self.started_at), self.config.lease_ttl_s)
        if self.config.watch_interval_s > 0:
            self._watch = asyncio.get_running_loop().create_task(self._watch_restarts())

    async def _watch_restarts(self) -> None:
        while True:
            await asyncio.sleep(self.config.watch_interval_s)
            now = await engine_start_time(self.config.base_url, self.tls)
            if now is None or now == self.started_at:
                continue
            logger.info("engine %s restarted (start time %.3f)", self.config.id, now)
            self.started_at = now
            try:
                await self.registry.register(self.config.record(now), self.config.lease_ttl_s)
            except Exception:  # noqa: BLE001 - the registry is down: next tick
                logger.exception("re-registering %s failed", self.config.id)
                self.started_at = 0.0

    def ready_line(self) -> str:
        return f"READY register-engine id={self.config.id}"

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.registry.close()


async def engine_start_time(
    base_url: str, tls: Tls | None = None, timeout_s: float = 2.0
) -> float | None:
    """The engine server's process start time from its /metrics, None if unreadable."""
    context = tls.client_context() if tls else None

    def read() -> float | None:
        url = base_url.rstrip("/") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
                for line in r.read().decode("utf-8", "replace").splitlines():
                    if line.startswith("process_start_time_seconds "):
                        return float(line.split()[1])
        except (OSError, ValueError):
            return None
        return None

    return await asyncio.to_thread(read)


def main(argv: list[str] | None = None) -> int:
    config = load_settings(
        RegisterEngineConfig, argv, prog="quillcache register-engine", description=DESCRIPTION
    )
    configure_logging(config.log_level)
    return asyncio.run(serve_until_signalled(EngineRegistration(config)))


if __name__ == "__main__":
    sys.exit(main())
