"""Bytes the gateway writes beside an engine's own: the client's body as an engine gets
it (the tenant's salt and the plan spliced in), and the SSE error event that ends a
stream the engine broke off."""

from __future__ import annotations

import json

from quillcache_core.wire.engine_plan import FIELD as PLAN_FIELD
from quillcache_core.wire.engine_plan import attach


def upstream_body(
    raw: bytes, payload: dict, ident, plan: dict, stream_options: dict | None = None
) -> bytes:
    """The client's JSON body with `cache_salt` and `kv_transfer_params.quillcache` set,
    and `stream_options` instead of the client's when given.

    The usual body has none of these fields: they are spliced in before the closing
    brace, so the client's bytes are forwarded without re-encoding. A body that has
    either of the first two (the salt is always the tenant's, never the client's), or
    stream options to replace, is re-encoded.
    """
    replaces_options = stream_options is not None and "stream_options" in payload
    if "cache_salt" not in payload and "kv_transfer_params" not in payload and not replaces_options:
        plan_json = json.dumps(plan, separators=(",", ":")).encode()
        head = raw[: raw.rindex(b"}")].rstrip()
        sep = b"" if head.endswith(b"{") else b","
        if stream_options is not None:
            options = json.dumps(stream_options, separators=(",", ":")).encode()
            head += sep + b'"stream_options":' + options
            sep = b","
        return b"".join(
            (
                head,
                sep,
                b'"cache_salt":',
                ident.salt_json,
                b',"kv_transfer_params":{"' + PLAN_FIELD.encode() + b'":',
                plan_json,
                b"}}",
            )
        )
    body = dict(payload)
    body["cache_salt"] = ident.identity.cache_salt
    if stream_options is not None:
        body["stream_options"] = stream_options
    return json.dumps(attach(body, plan), separators=(",", ":")).encode()


def error_event(tail: bytes, engine_id: str) -> bytes:
    """An SSE error event, after closing any event the engine left half-written."""
    event = {
        "error": {
            "message": f"engine {engine_id} failed before the stream completed",
            "type": "upstream_error",
            "param": None,
            "code": "engine_failed",
        }
    }
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    return sep + b"data: " + json.dumps(event).encode() + b"\n\n"
