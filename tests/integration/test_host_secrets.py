"""What another user of the host can learn of a running `quillcache up`: no tenant's API
key on any process's command line (`ps`, /proc/<pid>/cmdline, readable by everyone),
and the endpoints file, the API-key file and every log readable by their owner only.
The gateway takes its keys from a file (`--api-keys-file`) that must be its owner's
alone, or from its environment.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from quillcache_core.launch.process import ManagedProcess
from quillcache_core.process.settings import load_settings
from quillcache_gateway.config import GatewayConfig
from tests.support.host import processes_naming

pytestmark = pytest.mark.integration


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.timeout(180)
def test_a_running_cluster_shows_no_api_key_to_other_users_of_the_host(tmp_path):
    data = tmp_path / "data"
    endpoints_file = tmp_path / "endpoints.json"
    argv = [sys.executable, "-m", "quillcache_core.launch.cli", "up"]
    argv += ["--data-dir", str(data), "--endpoints-file", str(endpoints_file)]
    with ManagedProcess(argv, log_path=tmp_path / "up.log", name="quillcache up") as up:
        up.wait_ready(lambda: endpoints_file.stat().st_size > 0, timeout_s=150)
        endpoints = json.loads(endpoints_file.read_text())
        keys = list(endpoints["api_keys"].values())
        assert keys and all(keys)
        cluster = processes_naming(data)
        assert any(" gateway " in cmdline for cmdline in cluster.values()), cluster
        # Every process of the host, as `ps` shows them to anyone.
        everyone = processes_naming("")
        shown = {pid: cmd for pid, cmd in everyone.items() if any(k in cmd for k in keys)}
        assert not shown, f"API keys on a command line: {shown}"

        assert _mode(endpoints_file) == 0o600
        assert _mode(data) == 0o700
        assert _mode(data / "logs") == 0o700
        logs = sorted(data.rglob("*.log"))
        assert {"gateway.log", "conductor.log", "etcd.log"} <= {p.name for p in logs}
        wide = {str(p): oct(_mode(p)) for p in logs if _mode(p) != 0o600}
        assert not wide, f"logs others may read: {wide}"
        small = [p for p in data.rglob("*") if p.is_file() and p.stat().st_size < 1 << 20]
        key_files = [p for p in small if keys[0] in p.read_text("latin-1")]
        assert key_files, "the file the gateway reads its keys from"
        wide = {str(p): oct(_mode(p)) for p in key_files if _mode(p) & 0o077}
        assert not wide, f"files with an API key others may read: {wide}"


def _gateway(argv: list[str]) -> GatewayConfig:
    return load_settings(GatewayConfig, ["--conductor", "h:1", "--insecure", *argv], prog="gw",
                         description="", env={})  # fmt: skip


def test_the_gateway_reads_its_keys_from_a_file_of_its_owner(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("acme=k-acme\nglobex=k-globex\n")
    keys.chmod(0o600)
    config = _gateway(["--api-keys-file", str(keys)])
    assert config.tenants_by_key() == {"k-acme": "acme", "k-globex": "globex"}
    assert "k-acme" not in repr(config)
    from_env = load_settings(GatewayConfig, [], prog="gw", description="",
                             env={"QC_CONDUCTOR": "h:1", "QC_INSECURE": "true",
                                  "QC_API_KEYS": "acme=k-env"})  # fmt: skip
    assert from_env.tenants_by_key() == {"k-env": "acme"}


@pytest.mark.parametrize(
    ("mode", "content", "says"),
    [
        (0o644, "acme=k\n", "open to other users (mode 0644): chmod 600"),
        (0o640, "acme=k\n", "open to other users (mode 0640)"),
        (0o600, "acme\n", "'acme' is not name=value"),
        (None, "", "cannot read"),
    ],
    ids=["world-readable", "group-readable", "malformed", "missing"],
)
def test_the_gateway_refuses_a_key_file_others_may_read_or_it_cannot(
    tmp_path, capsys, mode, content, says
):
    keys = tmp_path / "api-keys"
    if mode is not None:
        keys.write_text(content)
        keys.chmod(mode)
    with pytest.raises(SystemExit) as exited:
        _gateway(["--api-keys-file", str(keys)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--api-keys-file" in error and says in error, error
