import pytest

from quillcache_conductor.config import ConductorConfig
from quillcache_core.process.settings import load_settings
from quillcache_gateway.config import GatewayConfig
from tests.support.tls import certs_dir

pytestmark = pytest.mark.unit


def load(cls, argv, env):
    """Settings as a development run gives them (--insecure in the environment)."""
    return load_settings(cls, argv, prog="t", description="t", env={"QC_INSECURE": "1", **env})


def test_tls_is_required_unless_insecure_is_asked_for(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        load_settings(ConductorConfig, [], prog="t", description="t", env={})
    assert done.value.code == 2
    assert "TLS is required: pass --tls-dir DIR" in capsys.readouterr().err
    bare = load_settings(ConductorConfig, ["--insecure"], prog="t", description="t", env={})
    assert bare.insecure and bare.tls("conductor") is None
    off = ["--insecure", "false"]
    with pytest.raises(SystemExit):
        load_settings(ConductorConfig, off, prog="t", description="t", env={})
    secure = load_settings(
        ConductorConfig, [], prog="t", description="t", env={"QC_TLS_DIR": str(certs_dir())}
    )
    assert secure.tls("conductor").cert.name == "conductor.pem"


def test_cli_beats_env_beats_default():
    cfg = load(ConductorConfig, [], {})
    assert (cfg.port, cfg.policy, cfg.kv_events) == (0, "quillcache", True)
    cfg = load(
        ConductorConfig, [], {"QC_PORT": "7000", "QC_POLICY": "dynamo", "QC_KV_EVENTS": "false"}
    )
    assert (cfg.port, cfg.policy, cfg.kv_events) == (7000, "dynamo", False)
    cfg = load(
        ConductorConfig,
        ["--port", "7001", "--policy", "sglang"],
        {"QC_PORT": "7000", "QC_POLICY": "dynamo"},
    )
    assert (cfg.port, cfg.policy) == (7001, "sglang")


@pytest.mark.parametrize(
    ("argv", "env", "text"),
    [
        (["--policy", "best"], {}, "invalid choice"),
        ([], {"QC_POLICY": "best"}, "QC_POLICY"),
        ([], {"QC_PORT": "eighty"}, "QC_PORT"),
        (["--index-backend", "lmdb"], {}, "--index-path is required"),
        (["--reservation-ttl-s", "0"], {}, "--reservation-ttl-s"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag(argv, env, text, capsys):
    with pytest.raises(SystemExit) as done:
        load(ConductorConfig, argv, env)
    assert done.value.code == 2
    assert text in capsys.readouterr().err


def test_gateway_keys_and_salts():
    cfg = load(
        GatewayConfig,
        ["--conductor", "h:1", "--api-keys", "acme=k1,globex=k2", "--cache-salts", "acme=s-acme"],
        {},
    )
    assert cfg.tenants_by_key() == {"k1": "acme", "k2": "globex"}
    assert cfg.salts_by_tenant() == {"acme": "s-acme"}


@pytest.mark.parametrize("argv", [["--api-keys", "acme"], ["--cache-salts", "=x"], []])
def test_gateway_rejects_malformed_pairs_and_a_missing_conductor(argv, capsys):
    conductor = ["--conductor", "h:1"] if argv else []
    with pytest.raises(SystemExit):
        load(GatewayConfig, [*conductor, *argv], {})
    assert capsys.readouterr().err
