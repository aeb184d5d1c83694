"""Who may call what: each gRPC method names the roles allowed to call it.

`RoleGuard` is a server interceptor: a call from a role not in its method's set is
refused with PERMISSION_DENIED before the handler runs, and counted by method and
role. A QuillCache method missing from RULES is refused to everyone (fail closed);
other services' methods (health checks, reflection) are open to any client that got
past mutual TLS, that is, any certificate of the cluster's CA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import grpc

from quillcache_core.security.tls import peer_role

logger = logging.getLogger(__name__)

GATEWAY = frozenset({"gateway"})
ANY_COMPONENT = frozenset({"gateway", "conductor", "store", "transfer", "engine", "operator"})

# The allowed callers of every QuillCache method, by full method name.
RULES: dict[str, frozenset[str]] = {
    # The conductor: plans are the gateway's; residency comes from stores and engines.
    "/quillcache.v1.Conductor/Plan": GATEWAY,
    "/quillcache.v1.Conductor/PlanStream": GATEWAY,
    "/quillcache.v1.Conductor/Finish": GATEWAY,
    "/quillcache.v1.Conductor/Observe": frozenset({"gateway", "engine"}),
    "/quillcache.v1.Conductor/IngestKvEvents": frozenset({"engine", "store"}),
    "/quillcache.v1.Conductor/Locate": frozenset(
        {"gateway", "store", "transfer", "engine", "operator"}
    ),
    "/quillcache.v1.Conductor/Stats": ANY_COMPONENT,
    # Scale-in is the operator's.
    "/quillcache.v1.Conductor/Drain": frozenset({"operator"}),
    # Replicas stream each other's reservations.
    "/quillcache.v1.ConductorReplica/Sync": frozenset({"conductor"}),
    # A store: blocks are read and written by engines (their KV connector), by other
    # stores (peer fetch) and by transfer; only transfer asks a node to pull.
    "/quillcache.v1.Store/Put": frozenset({"engine", "store", "transfer"}),
    "/quillcache.v1.Store/Get": frozenset({"engine", "store", "transfer"}),
    "/quillcache.v1.Store/Exists": frozenset({"engine", "store", "transfer", "conductor"}),
    "/quillcache.v1.Store/Delete": frozenset({"engine", "store", "transfer", "operator"}),
    "/quillcache.v1.Store/Pull": frozenset({"transfer"}),
    "/quillcache.v1.Store/Stats": ANY_COMPONENT,
    # Transfer: stores ask it to copy (replication), the operator and conductor too.
    "/quillcache.v1.Transfer/Copy": frozenset({"store", "conductor", "operator"}),
    "/quillcache.v1.Transfer/Move": frozenset({"store", "conductor", "operator"}),
    "/quillcache.v1.Transfer/Prefetch": frozenset({"store", "conductor", "gateway", "operator"}),
}

# Roles that may open a store's block-data port (raw TCP): peers pulling and engines
# putting.
DATA_PORT_ROLES = frozenset({"store", "transfer", "engine"})
# Roles that may open the conductor's plan port.
PLAN_PORT_ROLES = GATEWAY


def _wrap(behavior: Callable, allowed: frozenset[str], method: str, on_denied, streaming_out):
    def denied(context, role):
        on_denied(method, role or "none")
        logger.warning("refused %s to role %s", method, role or "<none>")
        return f"role {role or '<none>'} may not call {method}"

    if streaming_out:

        async def guarded_stream(request_or_iterator, context):
            role = peer_role(context)
            if role not in allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied(context, role))
            async for item in behavior(request_or_iterator, context):
                yield item

        return guarded_stream

    async def guarded(request_or_iterator, context):
        role = peer_role(context)
        if role not in allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied(context, role))
        return await behavior(request_or_iterator, context)

    return guarded


class RoleGuard(grpc.aio.ServerInterceptor):
    """Refuse calls whose client role is not allowed for the method (see RULES)."""

    def __init__(
        self,
        on_denied: Callable[[str, str], None],
        rules: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self.rules = {m: frozenset(r) for m, r in (rules or RULES).items()}
        self.on_denied = on_denied
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        allowed = self.rules.get(method)
        if allowed is None and method.startswith("/quillcache."):
            allowed = frozenset()  # a method of ours nobody listed: closed, not open
        if handler is None or allowed is None:
            return handler
        cached = self._handlers.get(method)
        if cached is not None:
            return cached
        guarded = _guarded_handler(handler, allowed, method, self.on_denied)
        self._handlers[method] = guarded
        return guarded


def _guarded_handler(handler, allowed, method, on_denied) -> grpc.RpcMethodHandler:
    common = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _wrap(handler.unary_unary, allowed, method, on_denied, False), **common
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _wrap(handler.unary_stream, allowed, method, on_denied, True), **common
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap(handler.stream_unary, allowed, method, on_denied, False), **common
        )
    return grpc.stream_stream_rpc_method_handler(
        _wrap(handler.stream_stream, allowed, method, on_denied, True), **common
    )
