"""The gateway's status page (/dashboard) on the local cluster, rendered by headless
Chromium: the requests just sent (their engines and block counts), the engines, the
stores and the conductor replica, for the operator's certificate and an admin's key
only; a tenant's key, another role's certificate or no credential get 401/403 and no
figure.

Chromium is given the operator's certificate by a loopback proxy of this test (a
browser's client certificate needs a certificate store set up first): the proxy
speaks HTTPS to the gateway with the certificate the endpoints file names, as a
browser holding it would. Set QC_STATUS_PAGE_PNG=path to keep the screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import operator_context, tenant_context
from quillcache_core.security.tls import Tls
from tests.support.cluster import openai_client
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MODEL = "sim-model"
ADMIN = "acme"  # --admin-tenants: acme's key also opens the page; globex's does not
# In every prompt: the page and its JSON must never show it.
SECRET_WORDS = "zanzibar-ledger-7781"
SYSTEM = (
    "You are the assistant of the Acme Rocket Company. Answer about rockets, orders and "
    f"deliveries politely and precisely ({SECRET_WORDS}). "
) * 10
QUESTIONS = (
    ("acme", "Where is my order 1234?", True),
    ("acme", "Where is my order 1234? And when does it ship?", True),
    ("globex", "What does a rocket cost?", True),
    ("acme", "Can I change my delivery address?", False),
    ("globex", "What does a rocket cost? And a second one?", True),
)

needs_chromium = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM}"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = LocalCluster(
        tmp_path_factory.mktemp("status"),
        extra_args={"gateway": ["--admin-tenants", ADMIN]},
        log=lambda *_: None,
    )
    endpoints = lc.start()
    try:
        yield lc, endpoints
    finally:
        lc.stop()


@pytest.fixture(scope="module")
def sent(cluster):
    """The requests of QUESTIONS, sent through the gateway: each one's decision headers."""
    _, endpoints = cluster
    clients = {t: openai_client(endpoints, t, max_retries=0) for t in ("acme", "globex")}
    answers = []
    for tenant, question, stream in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        chat = clients[tenant].chat.completions
        if stream:
            with chat.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=6, stream=True
            ) as answer:
                headers = dict(answer.headers)
                chunks = list(answer.parse())  # to its end: the answer is delivered
                assert any(c.choices for c in chunks)
        else:
            answer = chat.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)
            headers = dict(answer.headers)
            assert answer.parse().choices
        answers.append({"tenant": tenant, "stream": stream, **headers})
    return answers


def get(url: str, context: ssl.SSLContext | None, key: str | None = None):
    """(status, headers, body) of a GET; a 4xx/5xx is an answer, not an exception."""
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def kept(base: str, sent: list[dict]) -> bool:
    """Whether the state lists every sent request (kept once its last byte went out)."""
    status, _, body = get(base + "/dashboard/state", None)
    ids = {r["request_id"] for r in json.loads(body)["requests"]} if status == 200 else set()
    return ids >= {a["x-quillcache-request-id"] for a in sent}


class OperatorProxy:
    """Plain HTTP on loopback to the gateway's HTTPS with the operator's certificate."""

    def __init__(self, gateway_url: str, context: ssl.SSLContext) -> None:
        upstream, ctx = gateway_url.rstrip("/"), context

        class Forward(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                status, headers, body = get(upstream + self.path, ctx)
                self.send_response(status)
                for name in ("Content-Type", "Content-Security-Policy", "Cache-Control"):
                    if name in headers:
                        self.send_header(name, headers[name])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OperatorProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    """Headless Chromium, offline but for the page: no sync, no updates, no QUIC.

    `--virtual-time-budget` lets the page's first fetch of its state land before the
    DOM is dumped or the screenshot taken."""
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


class Rows(HTMLParser):
    """The page's table rows: for each `tr` with a data-request, data-engine,
    data-store or data-replica attribute, its cells' text by their data-col."""

    KINDS = ("data-request", "data-store", "data-replica", "data-engine")

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, dict[str, str]]] = {k[5:]: {} for k in self.KINDS}
        self.loaded = False
        self._row: dict[str, str] | None = None
        self._col: str | None = None

    def handle_starttag(self, tag, attrs):
        found = dict(attrs)
        if tag == "body" and found.get("data-loaded") == "1":
            self.loaded = True
        if tag == "tr":
            kind = next((k for k in self.KINDS if k in found), None)
            if kind is not None:
                self._row = {}
                self.rows[kind[5:]][found[kind]] = self._row
        elif tag == "td" and self._row is not None:
            self._col = found.get("data-col")
            if self._col:
                self._row[self._col] = ""

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._col = None

    def handle_data(self, data):
        if self._row is not None and self._col:
            self._row[self._col] += data


@needs_chromium
def test_the_page_shows_the_requests_engines_stores_and_replicas(cluster, sent, tmp_path):
    lc, endpoints = cluster
    with OperatorProxy(endpoints["gateway_url"], operator_context(endpoints)) as proxy:
        wait_until(lambda: kept(proxy.url, sent), timeout_s=10, what="the requests kept")
        done = chromium(["--dump-dom", proxy.url + "/dashboard"], tmp_path / "profile")
        shot = tmp_path / "status-page.png"
        chromium(
            [f"--screenshot={shot}", "--window-size=1400,1000", proxy.url + "/dashboard"],
            tmp_path / "profile-shot",
        )
    dom = done.stdout
    page = Rows()
    page.feed(dom)
    assert page.loaded, "the page never rendered its state: " + dom[-1500:]
    assert SECRET_WORDS not in dom and "Where is my order" not in dom  # no prompt text

    requests = page.rows["request"]
    for answer in sent:
        row = requests.get(answer["x-quillcache-request-id"])
        assert row is not None, f"{answer['x-quillcache-request-id']} not on the page"
        assert row["engine"] == answer["x-quillcache-engine"]
        assert row["tenant"] == answer["tenant"]
        for col in ("hit", "fetch", "recompute"):
            assert row[col] == answer[f"x-quillcache-{col}-blocks"], (col, row, answer)
        assert row["ttft-predicted"].endswith(" ms")
        assert row["ttft"].endswith(" ms") == answer["stream"]  # a first token: streams only
    # The same prompt again hit the engine that served it first.
    assert int(requests[sent[1]["x-quillcache-request-id"]]["hit"]) > 0

    engines = page.rows["engine"]
    for i in range(lc.engines):
        engine = engines[f"engine-{i}"]
        assert engine["role"] == "both" and engine["state"] == "serving", engine
        served = sum(a["x-quillcache-engine"] == f"engine-{i}" for a in sent)
        assert int(engine["requests"]) == served
    stores = page.rows["store"]
    assert sorted(stores) == ["store-0", "store-1"]
    for store in stores.values():
        assert store["dram"].endswith(" / 512.0 MiB") and store["ssd"].endswith(" / 4.00 GiB")
    (replica,) = page.rows["replica"].values()
    assert replica["health"] == "healthy" and replica["in-use"] == "primary"

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("QC_STATUS_PAGE_PNG")
    if keep:
        shutil.copyfile(shot, keep)


def test_an_admin_key_reads_the_state_as_json(cluster, sent):
    _, endpoints = cluster
    url = endpoints["gateway_url"] + "/dashboard/state"
    key = endpoints["api_keys"][ADMIN]
    wanted = [a["x-quillcache-request-id"] for a in reversed(sent)]

    def shown():  # a row is kept once its answer's last byte went out
        status, headers, body = get(url, tenant_context(endpoints), key)
        assert status == 200 and headers["Cache-Control"] == "no-store", (status, body)
        state = json.loads(body)
        ids = [r["request_id"] for r in state["requests"]]
        return (body, state) if ids[: len(sent)] == wanted else None

    body, state = wait_until(shown, timeout_s=10, what="the requests in the state")
    assert SECRET_WORDS.encode() not in body
    assert state["viewer"] == f"admin {ADMIN}"
    rows = {r["request_id"]: r for r in state["requests"]}
    for answer in sent:
        row = rows[answer["x-quillcache-request-id"]]
        # What the engine said it had cached, beside the plan's prediction.
        assert isinstance(row["cached_tokens"], int) and row["status"] == 200
        # Planned from a current view: the engines, idle when the conductor subscribed,
        # were known current from their replay at start, not behind until they published.
        assert row["replica_behind_ms"] == 0, row
    assert [e["id"] for e in state["engines"]] == ["engine-0", "engine-1"]
    assert sum(e["recent"]["requests"] for e in state["engines"] if e["recent"]) == len(sent)
    assert all(s["dram"]["capacity_bytes"] == 512 * 1024 * 1024 for s in state["stores"])


def test_tenants_other_roles_and_strangers_get_401_or_403_and_no_figures(cluster, sent):
    lc, endpoints = cluster
    base = endpoints["gateway_url"]
    tenant = tenant_context(endpoints)
    store_cert = Tls.from_dir(lc.certs_dir, "store").client_context()
    callers = [
        ("no credential", tenant, None, 401),
        ("an unknown key", tenant, "qc-not-a-key", 401),
        ("a tenant's key", tenant, endpoints["api_keys"]["globex"], 403),
        ("a store's certificate", store_cert, None, 403),
    ]
    for path in ("/dashboard", "/dashboard/state"):
        for who, context, key, expected in callers:
            status, headers, body = get(base + path, context, key)
            assert status == expected, (path, who, status, body)
            assert headers["Content-Type"].startswith("application/json"), (path, who)
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request_error" and error["message"], (path, who)
            for figure in ("engine-0", "store-0", sent[0]["x-quillcache-request-id"]):
                assert figure.encode() not in body, (path, who, figure)
