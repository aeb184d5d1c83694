"""k8s/monitoring/ against the tools that read it and the cluster it watches:

- alerts.yaml passes `promtool check rules`, and its unit tests (alerts-test.yaml,
  `promtool test rules`) pass with a firing case for every alert;
- the Grafana dashboard parses, every panel has the Prometheus datasource variable and
  a query, and every query is valid PromQL (promtool checks each as a recording rule);
- prometheus.yml passes `promtool check config`;
- every metric a panel or a rule names is on a live scrape of a real local cluster
  (`LocalCluster`, as `quillcache up` starts it) after requests through the gateway,
  every /metrics port read with the endpoints file's operator certificate; and every
  one of those ports takes the `monitor` role's certificate prometheus.yml presents;
- the names only vLLM engines expose (the KV connector's, vLLM's own) are checked on a
  real vLLM by tests/e2e/test_vllm_connector.py, on its fleet.

promtool comes from Debian's `prometheus` package (`scripts/tools.sh install`, which
`make test` runs).
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.certs import make_certs
from quillcache_core.security.tls import Tls
from tests.support.cluster import https, openai_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "k8s" / "monitoring"
DASHBOARD = MONITORING / "quillcache-dashboard.json"
ALERTS = MONITORING / "alerts.yaml"
ALERTS_TEST = MONITORING / "alerts-test.yaml"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
MODEL = "sim-model"

# Made by Prometheus itself, not by a scrape.
SYNTHETIC = frozenset({"up"})
# Only on vLLM engines: the KV connector's ports, and vLLM's own counters (a sim engine
# mimics three vllm: gauges, no more).
VLLM_ONLY = ("quillcache_connector_", "vllm:prompt_tokens_by_source")

# --- PromQL: the metric names an expression reads --------------------------------------

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
_IDENTIFIER = re.compile(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: every identifier that is no function, keyword,
    label name (in a matcher or a grouping), duration or Grafana variable."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # $__rate_interval, ${datasource}
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name, call = match.groups()
        if call is None and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_names_of_an_expression() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, engine) (rate(a_bucket{job=~"x|y"}'
        "[$__rate_interval]))) / ignoring (source) group_left sum(vllm:b_total offset 5m) "
        '> 1e3 and on () (c == bool 1) or max_over_time(d[15m:1m]) + label_replace(e, "f", '
        '"$1", "g", "(.*)")'
    )
    assert metric_names(expr) == {"a_bucket", "vllm:b_total", "c", "d", "e"}


# --- what the files name ---------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    """Every panel that shows data (rows are only headings), nested ones too."""
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_exprs() -> dict[str, str]:
    """Each panel query's PromQL, by "<panel title> / <refId>"."""
    return {
        f"{p['title']} / {t['refId']}": t["expr"] for p in panels(dashboard()) for t in p["targets"]
    }


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: `scripts/tools.sh install` (Debian's prometheus)"
    return found


def run_promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# --- rules -----------------------------------------------------------------------------


def test_alerting_rules_pass_promtool_check() -> None:
    result = run_promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_alerting_rules_unit_tests_fire_every_alert() -> None:
    result = run_promtool("test", "rules", ALERTS_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert len(alerts) >= 8, alerts
    fired = {
        case["alertname"]
        for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts <= fired, f"no firing case for {sorted(alerts - fired)}"


def test_a_wrong_expectation_fails_the_rules_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: with one alert's threshold raised, its case does."""
    cases = yaml.safe_load(ALERTS_TEST.read_text())
    cases["tests"] = [
        test
        for test in cases["tests"]
        if any(c["alertname"] == "QuillCachePlanFallbacksRising" for c in test["alert_rule_test"])
    ]
    (tmp_path / ALERTS_TEST.name).write_text(yaml.safe_dump(cases))
    text = ALERTS.read_text()
    assert text.count("> 0.05") == 1
    (tmp_path / ALERTS.name).write_text(text.replace("> 0.05", "> 0.5"))
    result = run_promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "alertname: QuillCachePlanFallbacksRising" in result.stdout + result.stderr


# --- dashboard -------------------------------------------------------------------------


def test_dashboard_panels_have_the_datasource_and_a_query() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36  # Grafana 10+
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Pool", "Control plane"]
    shown = list(panels(board))
    assert len(shown) >= 20
    ids = [p["id"] for p in board["panels"]] + [p["id"] for p in shown if p not in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    expected = {"type": "prometheus", "uid": "${datasource}"}
    for panel in shown:
        assert panel["datasource"] == expected, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]
            assert target["expr"].strip() and target["refId"], panel["title"]


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query as a recording rule (Grafana's $__rate_interval as 5m), for promtool."""
    exprs = dashboard_exprs()
    recording = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, expr in enumerate(exprs.values())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recording}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [e for e in exprs.values() if "$" in e.replace("$__rate_interval", "")]


# --- scrape config ---------------------------------------------------------------------


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """promtool checks the scrape config and the rule files it loads. What it checks is
    a copy: Debian's promtool is built without Kubernetes service discovery (the pods'
    discovery becomes file discovery there), and the certificate files exist only in
    the Prometheus pod (the copy names empty files of the same names)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job in jobs.values():
        assert job["scheme"] == "https", job["job_name"]
        tls = job["tls_config"] = dict(job["tls_config"])  # the jobs share one (a YAML alias)
        assert tls["server_name"] == "quillcache"
        assert {"ca_file", "cert_file", "key_file"} <= set(tls), job["job_name"]
        assert "quillcache-monitor-tls" in tls["cert_file"], "the monitor role's pair"
        for key in ("ca_file", "cert_file", "key_file"):
            tls[key] = str(tmp_path / Path(tls[key]).name)
            Path(tls[key]).touch()
        assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"]
        job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    (tmp_path / "targets.json").write_text("[]")
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_promtool("check", "config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout
    # The job names alerts.yaml and the dashboard filter on, as the relabelling makes them.
    relabel = {
        r.get("target_label"): r
        for r in jobs["quillcache"]["relabel_configs"]
        if "target_label" in r
    }
    assert re.fullmatch(relabel["job"]["regex"], "sim-engine").group(1) == "engine"
    assert set(config["rule_files"]) == {ALERTS.name}


# --- a live cluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, dict]]:
    """The local cluster (etcd, conductor, two stores, transfer, two sim engines, the
    gateway) after a few requests through the gateway, as a tenant."""
    lc = LocalCluster(tmp_path_factory.mktemp("monitoring"), log=lambda *_: None)
    endpoints = lc.start()
    try:
        client = openai_client(endpoints, "acme", max_retries=0)
        system = "You answer questions about the QuillCache KV pool. " * 20
        for i in range(4):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}?"},
            ]
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        yield lc, endpoints
    finally:
        lc.stop()


def scrape(url: str, context: ssl.SSLContext | None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as reply:
        assert reply.status == 200, url
        return reply.read().decode()


def exposed_names(text: str) -> set[str]:
    """The names a scrape carries: every sample's and every declared (# TYPE) one's.
    A declared histogram without a sample yet (labelled, nothing observed) counts with
    its _bucket, _sum and _count; one with samples, with those it has (a histogram of
    negative buckets has no _sum)."""
    samples, histograms = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            samples.add(name)
            if kind.strip() in ("histogram", "summary"):
                histograms.add(name)
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[^\s{]+", line).group(0))
    names = set(samples)
    for name in histograms:
        series = {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        if not series & samples:
            names |= series
    return names


def test_exposed_names_of_a_scrape() -> None:
    text = (
        "# TYPE a_total counter\na_total 1\n"
        "# TYPE h histogram\n"
        'h_bucket{le="+Inf"} 2\nh_count 2\n'
        "# TYPE idle_seconds histogram\n"
        'vllm:x{model_name="m"} 1\n'
    )
    assert exposed_names(text) == {
        "a_total",
        *("h", "h_bucket", "h_count"),
        *("idle_seconds", "idle_seconds_bucket", "idle_seconds_sum", "idle_seconds_count"),
        "vllm:x",
    }


def named_by_monitoring() -> dict[str, set[str]]:
    """Metric name -> where it is named (a dashboard query or a rule), without the
    names the rules record themselves."""
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    wheres = {
        **dashboard_exprs(),
        **{rule.get("alert") or rule["record"]: rule["expr"] for rule in rules()},
    }
    named: dict[str, set[str]] = {}
    for where, expr in wheres.items():
        for name in metric_names(expr) - recorded - SYNTHETIC:
            named.setdefault(name, set()).add(where)
    return named


def test_every_metric_the_dashboard_and_rules_name_is_scraped(cluster) -> None:
    _, endpoints = cluster
    scraped = {name: scrape(url, https(endpoints)) for name, url in endpoints["metrics"].items()}
    assert {"gateway", "conductor", "store-0", "store-1", "transfer", "engine-0"} <= set(scraped)
    exposed = set().union(*(exposed_names(text) for text in scraped.values()))
    named = named_by_monitoring()
    assert len(named) >= 40
    missing = {
        name: sorted(where)
        for name, where in named.items()
        if not name.startswith(VLLM_ONLY) and name not in exposed
    }
    assert not missing, "named but on no /metrics:\n" + "\n".join(
        f"  {name}  ({'; '.join(where)})" for name, where in sorted(missing.items())
    )


def test_every_metrics_port_takes_the_monitor_certificate(cluster) -> None:
    """What prometheus.yml presents: the role `monitor`'s pair from the cluster's CA."""
    lc, endpoints = cluster
    make_certs(lc.certs_dir, roles=("monitor",))  # kept if the cluster made it
    monitor = Tls.from_dir(lc.certs_dir, "monitor").client_context()
    anonymous = ssl.create_default_context(cafile=endpoints["tls"]["ca"])
    anonymous.check_hostname = False
    for name, url in endpoints["metrics"].items():
        assert "# TYPE" in scrape(url, monitor), name
        with pytest.raises((urllib.error.HTTPError, urllib.error.URLError, ssl.SSLError, OSError)):
            scrape(url, anonymous)
