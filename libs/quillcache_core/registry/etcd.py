"""`EtcdRegistry`: the registry on etcd v3, through `etcd3aio` (async gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
from etcd3aio._protobuf import (
    LeaseKeepAliveRequest,
    LeaseStub,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
)
from etcd3aio.errors import EtcdPermissionDeniedError, EtcdUnauthenticatedError

from quillcache_core.errors import InvalidArgument, NodeUnavailable, QuillCacheError
from quillcache_core.registry.base import WATCH_END, NodeRegistry, WatchFailure
from quillcache_core.registry.records import (
    JOIN,
    LEAVE,
    UPDATE,
    NodeEvent,
    NodeKey,
    NodeRecord,
    _check_part,
    check_ttl,
    diff_records,
    kind_prefix,
    node_key,
    parse_node_key,
)
from quillcache_core.registry.renewals import REWRITE_EVERY_ROUNDS, RenewalTracker

if TYPE_CHECKING:
    from quillcache_core.security.tls import Tls

log = logging.getLogger(__name__)


class RegistryAccessDenied(QuillCacheError):
    """etcd refused the call: this client's role (its certificate's name) may not
    read or write that key. Not transient: retrying does not help until the
    certificate or etcd's roles change."""


# --------------------------------------------------------------------------- etcd

# mvccpb.Event.EventType
_EV_PUT = 0
_EV_DELETE = 1

_DENIED_CODES = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)

# Why `_follow` returned when a followed record's owner stopped rewriting it.
_RENEWAL_DUE = "a record is due for its owner's renewal"


def _is_denial(exc: BaseException) -> bool:
    """Whether etcd refused the call for who we are (RBAC), not for being down."""
    if isinstance(exc, EtcdPermissionDeniedError | EtcdUnauthenticatedError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _DENIED_CODES


# Everything an etcd call can fail with when etcd is down, slow or restarting (and,
# sorted out by `_is_denial`, when it refuses us).
_ETCD_ERRORS: tuple[type[BaseException], ...] = (
    EtcdError,
    grpc.aio.AioRpcError,
    TimeoutError,
    NodeUnavailable,
)


def normalize_endpoint(item: str) -> str:
    ep = item.strip()
    for scheme in ("etcd://", "http://", "https://"):
        if ep.startswith(scheme):
            ep = ep[len(scheme) :]
            break
    ep = ep.rstrip("/")
    host, sep, port = ep.rpartition(":")
    if not sep or not host or "/" in ep or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"etcd endpoint must be host:port, got {item!r}")
    return ep


async def _resolve_ipv4(endpoints: list[str]) -> list[str]:
    """host:port endpoints with each host name replaced by its first IPv4 address."""
    loop = asyncio.get_running_loop()
    out = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            socket.inet_aton(host)
            out.append(endpoint)
            continue
        except OSError:
            pass
        try:
            infos = await loop.getaddrinfo(
                host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise NodeUnavailable(f"cannot resolve etcd host {host!r}: {exc}") from None
        out.append(f"{infos[0][4][0]}:{port}")
    return out


@dataclass
class _Registration:
    record: NodeRecord
    ttl: int  # requested TTL (whole seconds)
    lease_id: int
    granted_ttl: int  # what etcd granted (it may raise a TTL to its minimum)
    pending_lease_id: int | None = None  # granted during a re-register, not yet adopted
    task: asyncio.Task[None] | None = None
    keepalive: grpc.aio.StreamStreamCall | None = None  # its LeaseKeepAlive stream


class EtcdRegistry(NodeRegistry):
    """Registry on etcd v3.

    Connects lazily. Every unary call has a deadline of `timeout_s` and fails with
    NodeUnavailable when etcd cannot be reached. Leases are whole seconds:
    ``max(1, ceil(ttl_s))`` (etcd may raise it further to its minimum TTL).

    Each registration has its own keepalive task: every granted_ttl/3 s one
    LeaseKeepAlive round trip, and every third round the record written again on its
    lease (with the TTL in it), the renewal only its owner can make. Readers (`list`,
    `get`, `watch`) take a record that promises renewals as gone once they have not
    seen it rewritten for 3 TTLs, even while its lease lives: etcd lets any client keep any lease
    alive (`registry.renewals`). If etcd reports the lease gone (TTL <= 0, or
    NOT_FOUND) or etcd has been unreachable for longer than the TTL, the task grants a
    new lease and puts the record again, retrying every 0.5 s until it succeeds: a
    node whose lease ran out during an etcd stall is back within milliseconds of etcd
    answering again.

    `recently_unreachable(s)` says whether a call failed, or was answered only after
    `slow_call_s`, within the last `s` seconds, or is pending for longer than that now:
    how the conductor tells the leaves an outage causes from nodes dying.

    `watch()` lists the prefix (one linearizable read at revision R), emits the
    differences from what the consumer was told (on the first pass: a join per node),
    then streams events from R+1 on its own Watch stream. When the stream fails, ends,
    or is cancelled/compacted, it backs off, lists again and emits the differences:
    leaves for nodes that vanished meanwhile, joins for new ones, updates for changed
    ones. That also covers an etcd that came back without its data (revisions restart).

    With `tls` the connection is mutual TLS: the server must hold a certificate of
    `tls.ca` for the name `quillcache`, and ours (`tls.cert`, whose common name etcd
    takes as the user: the role) goes along. A call etcd refuses for that role fails
    with `RegistryAccessDenied` (e.g. a store registering an engine record).

    Two etcd3aio internals are used (no public API exists): the client's channel, for
    the watch stream, and its channel options, to shorten gRPC's reconnect backoff.
    The stream is a raw write/read bidi call rather than etcd3aio's
    `WatchService.watch`, which reconnects silently (hiding gaps) and leaks a pending
    request-iterator task per failed stream.
    """

    def __init__(
        self,
        endpoints: Iterable[str],
        *,
        tls: Tls | None = None,
        timeout_s: float = 5.0,
        reconnect_backoff_s: float = 0.1,
        max_reconnect_backoff_s: float = 2.0,
        slow_call_s: float = 0.5,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        endpoints = [ep for ep in endpoints if ep.strip()]
        if tls is None and any(ep.strip().startswith("https://") for ep in endpoints):
            raise InvalidArgument("an https:// etcd endpoint needs the client's certificates (tls)")
        self._endpoints = [normalize_endpoint(ep) for ep in endpoints]
        if not self._endpoints:
            raise InvalidArgument("EtcdRegistry needs at least one endpoint")
        self._tls = tls
        self._tls_args: dict[str, Any] = {}
        if tls is not None:
            from quillcache_core.security.certs import SERVER_NAME

            try:
                self._tls_args = {
                    "ca_cert": tls.ca.read_bytes(),
                    "cert_key": tls.key.read_bytes(),
                    "cert_chain": tls.cert.read_bytes(),
                    "tls_server_name": SERVER_NAME,
                }
            except OSError as exc:
                raise InvalidArgument(f"cannot read the etcd client certificates: {exc}") from None
        if not timeout_s > 0:
            raise InvalidArgument("timeout_s must be > 0")
        self._timeout_s = float(timeout_s)
        self._backoff_s = reconnect_backoff_s
        self._max_backoff_s = max_reconnect_backoff_s
        self._client: Etcd3Client | None = None
        self._regs: dict[NodeKey, _Registration] = {}
        self._key_locks: dict[NodeKey, asyncio.Lock] = {}  # serialize (de)register per node
        self._watch_tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # Outage tracking (`recently_unreachable`): calls in flight by start time, and
        # when a call last failed or was answered late.
        self._slow_call_s = slow_call_s
        self._inflight: dict[int, float] = {}
        self._call_ids = itertools.count()
        self._trouble_at = -math.inf
        self._renewals = RenewalTracker(time.monotonic)

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def tls(self) -> Tls | None:
        return self._tls

    # -- connection -----------------------------------------------------------------

    async def _conn(self) -> Etcd3Client:
        if self._closed:
            raise NodeUnavailable("registry is closed")
        if self._client is None:
            # etcd3aio dials "ipv4:host:port", which takes addresses only: resolve names
            # (docker compose service names, k8s DNS) here.
            client = Etcd3Client(await _resolve_ipv4(self._endpoints), **self._tls_args)
            _tune_reconnect(client)
            # connect() only builds the channel (no await inside), so no lock is needed.
            await client.connect()
            self._client = client
            log.info(
                "etcd registry using %s (%s)",
                ",".join(self._endpoints),
                f"TLS as {self._tls.role}" if self._tls is not None else "plaintext",
            )
        return self._client

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        """Times one etcd call for `recently_unreachable`: a failure (not a refusal) or
        a late answer marks trouble."""
        call_id = next(self._call_ids)
        started = self._inflight[call_id] = time.monotonic()
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, _ETCD_ERRORS) and not _is_denial(exc):
                self._trouble_at = time.monotonic()
            raise
        else:
            if time.monotonic() - started > self._slow_call_s:
                self._trouble_at = time.monotonic()
        finally:
            del self._inflight[call_id]

    def recently_unreachable(self, within_s: float) -> bool:
        now = time.monotonic()
        if now - self._trouble_at < within_s:
            return True
        return any(now - started > self._slow_call_s for started in self._inflight.values())

    def _failure(self, what: str, exc: BaseException, key: str = "") -> QuillCacheError:
        """The domain error of a failed etcd call: RegistryAccessDenied when etcd
        refused us, else NodeUnavailable."""
        where = ",".join(self._endpoints)
        if _is_denial(exc):
            who = f"role {self._tls.role!r}" if self._tls is not None else "this client"
            on = f" on {key}" if key else ""
            hint = "; a role may write only its own kind's records" if what == "put" else ""
            return RegistryAccessDenied(
                f"etcd ({where}) denied {what}{on} to {who}: {_detail(exc)}{hint}"
            )
        return NodeUnavailable(f"etcd {what} failed ({where}): {exc!r}")

    # -- registration -------------------------------------------------------------

    def _key_lock(self, key: NodeKey) -> asyncio.Lock:
        lock = self._key_locks.get(key)
        if lock is None:
            lock = self._key_locks[key] = asyncio.Lock()
        return lock

    async def register(self, record: NodeRecord, ttl_s: float) -> None:
        ttl = max(1, math.ceil(check_ttl(ttl_s)))
        key = (record.kind, record.id)
        async with self._key_lock(key):
            await self._register_locked(key, record, ttl)

    async def _register_locked(self, key: NodeKey, record: NodeRecord, ttl: int) -> None:
        old = self._regs.pop(key, None)
        if old is not None:
            await _cancel_task(old.task)
        try:
            lease_id, granted = await self._grant_and_put(record, ttl, None)
        except BaseException:
            if old is not None and not self._closed:  # keep the previous registration
                self._regs[key] = old
                self._start_keepalive(old)
            raise
        reg = _Registration(record, ttl, lease_id, granted)
        self._regs[key] = reg
        self._start_keepalive(reg)
        log.info(
            "registered %s/%s (lease %x, ttl %ds granted %ds)",
            record.kind,
            record.id,
            lease_id,
            ttl,
            granted,
        )
        if old is not None:
            await self._revoke_quietly(old.lease_id, old.pending_lease_id)

    async def _grant_and_put(
        self, record: NodeRecord, ttl: int, reg: _Registration | None
    ) -> tuple[int, int]:
        """Grant a lease and put the record on it. Returns (lease id, granted TTL)."""
        try:
            client = await self._conn()
            with self._tracked():
                lease = await client.lease.grant(ttl, timeout=self._timeout_s)
        except _ETCD_ERRORS as exc:
            raise self._failure("lease grant", exc) from exc
        if reg is not None:
            reg.pending_lease_id = lease.ID
        granted = int(lease.TTL) or ttl
        try:
            with self._tracked():
                await client.kv.put(
                    record.key, _stored(record, granted), lease=lease.ID, timeout=self._timeout_s
                )
        except BaseException as exc:
            if reg is not None:
                reg.pending_lease_id = None
            await self._revoke_quietly(lease.ID)
            if isinstance(exc, _ETCD_ERRORS):
                raise self._failure("put", exc, record.key) from exc
            raise
        return lease.ID, granted

    async def _rewrite(self, reg: _Registration, timeout_s: float) -> None:
        """Write the record again on its lease: the renewal readers trust, as only its
        owner may write it (`registry.renewals`). A failure waits for the next round."""
        key = reg.record.key
        try:
            client = await self._conn()
            with self._tracked():
                await client.kv.put(
                    key, _stored(reg.record, reg.granted_ttl), lease=reg.lease_id, timeout=timeout_s
                )
        except _ETCD_ERRORS as exc:
            failure = self._failure("put", exc, key)
            level = logging.ERROR if isinstance(failure, RegistryAccessDenied) else logging.DEBUG
            log.log(level, "rewrite of %s failed: %s", key, failure)

    def _start_keepalive(self, reg: _Registration) -> None:
        reg.task = asyncio.create_task(
            self._keepalive_loop(reg), name=f"registry-keepalive-{reg.record.kind}/{reg.record.id}"
        )
        reg.task.add_done_callback(lambda _: _close_keepalive(reg))

    async def _keepalive_once(self, reg: _Registration, timeout_s: float) -> int:
        """One LeaseKeepAlive round trip for `reg`'s lease; returns the TTL etcd reports
        (<= 0: gone).

        The registration keeps one stream open across rounds (write a request, read its
        answer: a new stream a round cost a call's setup each time); any failure closes
        it and the next round opens another. etcd answers TTL 0 for a lease it no longer
        has; a NOT_FOUND status (a proxy, another etcd version) means the same."""
        try:
            if reg.keepalive is None:
                client = await self._conn()
                reg.keepalive = LeaseStub(_channel_of(client)).LeaseKeepAlive()
            call = reg.keepalive
            with self._tracked():
                async with asyncio.timeout(timeout_s):
                    await call.write(LeaseKeepAliveRequest(ID=reg.lease_id))
                    resp = await call.read()
            if resp is grpc.aio.EOF:
                raise NodeUnavailable("keepalive stream closed without an answer")
            return int(resp.TTL)
        except BaseException as exc:
            _close_keepalive(reg)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            if isinstance(exc, _ETCD_ERRORS):
                raise self._failure("lease keepalive", exc) from exc
            raise

    async def _keepalive_loop(self, reg: _Registration) -> None:
        kind, node_id = reg.record.kind, reg.record.id
        last_ok = time.monotonic()
        lost = False
        rounds = 0
        while True:
            interval = max(0.1, reg.granted_ttl / 3.0)
            await asyncio.sleep(min(interval, 0.5) if lost else interval)
            if not lost:
                timeout_s = min(self._timeout_s, max(0.5, reg.granted_ttl / 2.0))
                try:
                    ttl = await self._keepalive_once(reg, timeout_s)
                except QuillCacheError as exc:  # unavailable, or denied: a new lease then
                    down_s = time.monotonic() - last_ok
                    if down_s > reg.granted_ttl:
                        log.warning(
                            "lease %x of %s/%s: etcd unreachable for %.1fs (> ttl %ds); "
                            "re-registering when it is back",
                            reg.lease_id,
                            kind,
                            node_id,
                            down_s,
                            reg.granted_ttl,
                        )
                        lost = True
                    else:
                        log.debug("keepalive of %s/%s failed: %s", kind, node_id, exc)
                    continue
                if ttl > 0:
                    last_ok = time.monotonic()
                    rounds += 1
                    if rounds % REWRITE_EVERY_ROUNDS == 0:
                        await self._rewrite(reg, timeout_s)
                    continue
                log.warning(
                    "lease %x of %s/%s expired; re-registering", reg.lease_id, kind, node_id
                )
                lost = True
            try:
                lease_id, granted = await self._grant_and_put(reg.record, reg.ttl, reg)
            except NodeUnavailable as exc:
                log.debug("re-register of %s/%s failed: %s", kind, node_id, exc)
                continue
            except RegistryAccessDenied as exc:  # until etcd's roles change
                log.error("re-register of %s/%s refused: %s", kind, node_id, exc)
                await asyncio.sleep(min(reg.granted_ttl, 5.0))
                continue
            old_lease, reg.lease_id, reg.granted_ttl = reg.lease_id, lease_id, granted
            reg.pending_lease_id = None
            lost = False
            last_ok = time.monotonic()
            log.info("re-registered %s/%s with lease %x", kind, node_id, lease_id)
            await self._revoke_quietly(old_lease)

    async def _revoke_quietly(self, *lease_ids: int | None) -> None:
        """Best-effort revoke (a lease that is gone or unreachable will expire anyway)."""
        for lease_id in lease_ids:
            if not lease_id or self._client is None:
                continue
            try:
                await self._client.lease.revoke(lease_id, timeout=min(self._timeout_s, 2.0))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.warning("could not revoke lease %x: %s", lease_id, exc.code().name)
            except _ETCD_ERRORS as exc:
                log.warning("could not revoke lease %x: %r", lease_id, exc)

    async def deregister(self, kind: str, id: str) -> None:
        key = (_check_part("kind", kind), _check_part("id", id))
        async with self._key_lock(key):
            reg = self._regs.pop(key, None)
            if reg is None:
                log.debug("deregister %s/%s: not registered here", kind, id)
                return
            await _cancel_task(reg.task)
            await self._revoke_quietly(reg.lease_id, reg.pending_lease_id)
        log.info("deregistered %s/%s (lease %x revoked)", kind, id, reg.lease_id)

    async def stop_keepalive(self, kind: str, id: str) -> None:
        key = (_check_part("kind", kind), _check_part("id", id))
        async with self._key_lock(key):
            reg = self._regs.pop(key, None)
            if reg is not None:
                await _cancel_task(reg.task)
        if reg is not None:
            log.info("keepalive of %s/%s stopped; lease %x will expire", kind, id, reg.lease_id)

    # -- reads ----------------------------------------------------------------------

    def _decode(self, kv: Any) -> NodeRecord | None:
        key = parse_node_key(kv.key)
        if key is None:
            log.debug("ignoring non-node key %r", kv.key)
            return None
        try:
            return NodeRecord.from_json(key[0], key[1], kv.value)
        except InvalidArgument as exc:
            log.warning("ignoring invalid node record at %r: %s", kv.key, exc)
            return None

    def _renewed(self, record: NodeRecord, kv: Any) -> bool:
        """Whether `record` (read from `kv`) is still rewritten by its owner."""
        return self._renewals.alive(
            record.key, kv.mod_revision, record.lease_ttl_s, self._trouble_at
        )

    def _live(self, kv: Any) -> NodeRecord | None:
        """The record at `kv`; None if unreadable or no longer renewed by its owner."""
        record = self._decode(kv)
        return record if record is not None and self._renewed(record, kv) else None

    def _first_due(self, told: dict[NodeKey, NodeRecord]) -> float:
        """When the first of `told` turns stale unless its owner rewrites it (inf: never)."""
        return min(
            (
                self._renewals.due_at(rec.key, rec.lease_ttl_s, self._trouble_at)
                for rec in told.values()
            ),
            default=math.inf,
        )

    async def _range(self, prefix: str) -> Any:
        try:
            client = await self._conn()
            with self._tracked():
                return await client.kv.get(
                    prefix, range_end=prefix_range_end(prefix), timeout=self._timeout_s
                )
        except _ETCD_ERRORS as exc:
            raise self._failure("list", exc, prefix) from exc

    async def list(self, kind: str | None = None) -> list[NodeRecord]:
        resp = await self._range(kind_prefix(kind))
        records = [rec for rec in map(self._live, resp.kvs) if rec is not None]
        return sorted(records, key=lambda rec: (rec.kind, rec.id))

    async def get(self, kind: str, id: str) -> NodeRecord | None:
        """The record, or None (also for one its owner no longer renews). Raises
        InvalidArgument if the stored value is unreadable."""
        key = node_key(kind, id)
        try:
            client = await self._conn()
            with self._tracked():
                resp = await client.kv.get(key, timeout=self._timeout_s)
        except _ETCD_ERRORS as exc:
            raise self._failure("get", exc, key) from exc
        if not resp.kvs:
            return None
        record = NodeRecord.from_json(kind, id, resp.kvs[0].value)
        return record if self._renewed(record, resp.kvs[0]) else None

    # -- watch ----------------------------------------------------------------------

    def watch(self, kind: str | None = None) -> AsyncIterator[NodeEvent]:
        return self._watch(kind_prefix(kind))

    async def _watch(self, prefix: str) -> AsyncIterator[NodeEvent]:
        if self._closed:
            return
        queue: asyncio.Queue[object] = asyncio.Queue()
        task = asyncio.create_task(
            self._watch_producer(prefix, queue), name=f"registry-watch {prefix}"
        )
        self._watch_tasks.add(task)

        def _done(t: asyncio.Task[None]) -> None:
            self._watch_tasks.discard(t)
            if t.cancelled() or t.exception() is None:
                queue.put_nowait(WATCH_END)
            else:
                queue.put_nowait(WatchFailure(t.exception()))  # type: ignore[arg-type]

        task.add_done_callback(_done)
        try:
            while True:
                item = await queue.get()
                if item is WATCH_END:
                    return
                if isinstance(item, WatchFailure):
                    raise item.exc
                assert isinstance(item, NodeEvent)
                yield item
        finally:
            task.cancel()

    async def _watch_producer(self, prefix: str, out: asyncio.Queue[object]) -> None:
        told: dict[NodeKey, NodeRecord] = {}
        backoff = self._backoff_s
        synced = False
        while not self._closed:
            try:
                snap = await self._range(prefix)
            except NodeUnavailable as exc:
                log.debug("watch %s: list failed: %s", prefix, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            current: dict[NodeKey, NodeRecord] = {}
            for rec in map(self._live, snap.kvs):
                if rec is not None:
                    current[(rec.kind, rec.id)] = rec
            events = diff_records(told, current)
            for event in events:
                out.put_nowait(event)
            told = current
            revision = snap.header.revision
            if synced:
                log.info(
                    "watch %s: re-listed at revision %d (%d changes)", prefix, revision, len(events)
                )
            synced = True
            reason, healthy = await self._follow(prefix, revision, told, out)
            if healthy:
                backoff = self._backoff_s
            if reason == _RENEWAL_DUE:  # the re-list's read decides which are stale
                log.debug("watch %s: %s; re-listing", prefix, reason)
                continue
            log.warning("watch %s: %s; re-listing in %.2fs", prefix, reason, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _follow(
        self,
        prefix: str,
        revision: int,
        told: dict[NodeKey, NodeRecord],
        out: asyncio.Queue[object],
    ) -> tuple[str, bool]:
        """Apply live events after `revision` to `told`, emitting them, until the stream
        needs a re-list, or a record of `told` is due for its owner's renewal (the
        re-list judges it). Returns (why, whether the stream had been created)."""
        created = False
        call = None
        pending: asyncio.Future[Any] | None = None
        try:
            client = await self._conn()
            # Write/read style (no request iterator): nothing is left behind when the
            # stream dies, and no silent reconnect hides a gap from us.
            call = WatchStub(_channel_of(client)).Watch()
            create = WatchCreateRequest(
                key=prefix.encode(),
                range_end=prefix_range_end(prefix),
                start_revision=revision + 1,
                prev_kv=True,
            )
            await call.write(WatchRequest(create_request=create))
            # Deadlines only move later as owners rewrite: recomputed once one passes.
            due = self._first_due(told)
            pending = asyncio.ensure_future(call.read())
            while True:
                wait_s = None if math.isinf(due) else max(0.0, due - time.monotonic())
                done, _ = await asyncio.wait({pending}, timeout=wait_s)
                if not done:
                    due = self._first_due(told)
                    if due <= time.monotonic():
                        return _RENEWAL_DUE, created
                    continue
                resp = pending.result()
                if resp is grpc.aio.EOF:
                    return "watch stream ended", created
                if resp.created:
                    created = True
                    log.debug("watch %s: live from revision %d", prefix, revision + 1)
                if resp.canceled or resp.compact_revision:
                    return (
                        f"watch cancelled (compact_revision={resp.compact_revision} "
                        f"reason={resp.cancel_reason!r})",
                        created,
                    )
                for ev in resp.events:
                    event = self._apply(ev, told)
                    if event is not None:
                        out.put_nowait(event)
                        due = min(
                            due,
                            self._renewals.due_at(
                                event.record.key, event.record.lease_ttl_s, self._trouble_at
                            ),
                        )
                pending = asyncio.ensure_future(call.read())
        except _ETCD_ERRORS as exc:
            if not _is_denial(exc):
                self._trouble_at = time.monotonic()
            detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            return f"watch stream failed ({detail})", created
        finally:
            if pending is not None:
                pending.cancel()
            if call is not None:
                call.cancel()

    def _apply(self, ev: Any, told: dict[NodeKey, NodeRecord]) -> NodeEvent | None:
        key = parse_node_key(ev.kv.key)
        if key is None:
            return None
        if ev.type == _EV_DELETE:
            last = told.pop(key, None)
            if last is None:
                return None  # never reported, so nothing to take back
            if ev.HasField("prev_kv") and ev.prev_kv.value:
                last = self._decode(ev.prev_kv) or last
            return NodeEvent(LEAVE, last)
        if ev.type != _EV_PUT:
            return None
        last = told.get(key)
        if last is not None and ev.HasField("prev_kv") and ev.prev_kv.value == ev.kv.value:
            self._renewals.observe(last.key, ev.kv.mod_revision)
            return None  # its owner's renewal: the same bytes, nothing to decode
        record = self._decode(ev.kv)
        if record is None:  # now unreadable: treat it as gone
            last = told.pop(key, None)
            return NodeEvent(LEAVE, last) if last is not None else None
        self._renewals.observe(record.key, ev.kv.mod_revision)
        old, told[key] = told.get(key), record
        if old == record:
            return None  # its owner's renewal
        return NodeEvent(UPDATE if old is not None else JOIN, record)

    # -- shutdown -------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        watch_tasks = list(self._watch_tasks)
        for task in watch_tasks:
            task.cancel()
        regs = list(self._regs.values())
        self._regs.clear()
        for reg in regs:
            await _cancel_task(reg.task)
        if regs:
            await asyncio.gather(
                *(self._revoke_quietly(r.lease_id, r.pending_lease_id) for r in regs)
            )
        await asyncio.gather(*watch_tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        log.info("etcd registry closed (%d registrations removed)", len(regs))


def _stored(record: NodeRecord, ttl: int) -> bytes:
    """The value an owner writes: its record with the TTL it renews it within."""
    return dataclasses.replace(record, lease_ttl_s=float(ttl)).to_json()


def _detail(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details() or ''}".strip()
    cause = exc.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        return f"{cause.code().name} {cause.details() or ''}".strip()
    return str(exc) or type(exc).__name__


async def _cancel_task(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _close_keepalive(reg: _Registration) -> None:
    if reg.keepalive is not None:
        reg.keepalive.cancel()
        reg.keepalive = None


def _channel_of(client: Etcd3Client) -> grpc.aio.Channel:
    """The client's gRPC channel (etcd3aio has no public accessor for it)."""
    channel = getattr(client, "_channel", None)
    if channel is None:
        raise NodeUnavailable("etcd client is not connected")
    return channel


def _tune_reconnect(client: Etcd3Client) -> None:
    """Reconnect quickly after etcd restarts (gRPC's default backoff grows to 120 s).

    etcd3aio keeps its channel options on a private attribute; skip if that changes."""
    manager = getattr(client, "_manager", None)
    options = getattr(manager, "grpc_options", None)
    if isinstance(options, list):
        options.extend(
            [
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
        )
