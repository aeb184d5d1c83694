"""gRPC plumbing every QuillCache service shares.

Domain errors map to status codes here and only here; health and reflection are added
the same way everywhere; the metrics side port is one small aiohttp app.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable

import grpc
from aiohttp import web
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from quillcache_core.errors import (
    CapacityExceeded,
    Corrupt,
    InvalidArgument,
    NodeUnavailable,
    NotFound,
    QuillCacheError,
)
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.security.access import RoleGuard
from quillcache_core.security.tls import Tls, add_port

logger = logging.getLogger(__name__)

STATUS_OF: dict[type[QuillCacheError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NodeUnavailable: grpc.StatusCode.UNAVAILABLE,
    Corrupt: grpc.StatusCode.DATA_LOSS,
}


def status_for(exc: QuillCacheError) -> grpc.StatusCode:
    for kind, code in STATUS_OF.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, message: str) -> QuillCacheError:
    """The domain error a client should raise for a failed call's status."""
    for kind, status in STATUS_OF.items():
        if status == code:
            return kind(message)
    return NodeUnavailable(f"{code.name}: {message}")


def unary_errors(method: Callable):
    """Wrap an async unary servicer method: domain errors become status codes.

    Anything unexpected is logged with its traceback and returned as INTERNAL; the
    server never dies on input.
    """

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except QuillCacheError as exc:
            await context.abort(status_for(exc), str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            logger.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: internal error")

    return wrapper


class _MethodAwarePool:
    """The default descriptor pool, but a method's name finds its service's file.

    protobuf's upb pool resolves services and messages, not `pkg.Service.Method`,
    which `grpcurl describe pkg.Service.Method` asks reflection for.
    """

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str):  # noqa: N802 - protobuf's name
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            parent = symbol.rpartition(".")[0]
            if not parent:
                raise
            return self._pool.FindFileContainingSymbol(parent)


def stream_errors(method: Callable):
    """`unary_errors` for server-streaming handlers (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in method(self, request, context):
                yield item
        except QuillCacheError as exc:
            await context.abort(status_for(exc), str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            logger.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: internal error")

    return wrapper


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> health.aio.HealthServicer:
    """Serve grpc.health.v1 (SERVING for each service and "") and server reflection."""
    names = list(service_names)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
        pool=_MethodAwarePool(descriptor_pool.Default()),
    )
    return servicer


def grpc_server(
    tls: Tls | None, metrics: MetricsRegistry, options: Iterable[tuple[str, object]] = ()
) -> grpc.aio.Server:
    """A gRPC server that, with `tls`, lets each method be called only by its roles
    (`security.access.RULES`), counting every refusal by method and role."""
    if tls is None:
        return grpc.aio.server(options=list(options))
    denied = metrics.counter(
        "rpc_denied_total", "calls refused for the caller's role", ["method", "role"]
    )
    guard = RoleGuard(lambda method, role: denied.inc(method=method, role=role))
    return grpc.aio.server(options=list(options), interceptors=[guard])


async def start_server(
    server: grpc.aio.Server, host: str, port: int, tls: Tls | None = None
) -> int:
    """Bind host:port (port 0 = a free one; mutual TLS with `tls`) and start serving;
    returns the bound port."""
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC port {host}:{port}")
    await server.start()
    return bound


async def set_serving(servicer: health.aio.HealthServicer, service_names: Iterable[str]) -> None:
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def start_metrics_app(
    metrics: MetricsRegistry,
    host: str,
    port: int,
    extra_routes: Iterable[web.RouteDef] = (),
    tls: Tls | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve GET /metrics (Prometheus text) and GET /health on host:port (HTTPS that
    demands a cluster certificate, with `tls`); returns the bound port."""

    async def render(_request: web.Request) -> web.Response:
        return web.Response(text=metrics.render(), content_type="text/plain", charset="utf-8")

    async def healthy(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.get("/metrics", render), web.get("/health", healthy), *extra_routes])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls.server_context() if tls else None)
    await site.start()
    bound = runner.addresses[-1][1]
    return runner, bound
