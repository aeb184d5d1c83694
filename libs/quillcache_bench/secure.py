"""How the benchmarks talk to a secure cluster, as the tests do: each call carries the
credentials of the role that makes it in a real deployment (a gateway plans, an engine
observes and puts blocks, a store reports what it holds, the operator reads stats).

A bench that starts its own processes makes a certificate dir in its temp dir
(`bench_certs`) and passes `--tls-dir` to each (`security_args`); a bench against a
`LocalCluster` or an endpoints file takes the operator's certificate from the
endpoints' "tls" entry. With `--insecure` (a bench's flag for measuring the plaintext
stack, e.g. to see what TLS costs) every helper gives None and the
processes get `--insecure`.
"""

from __future__ import annotations

from pathlib import Path

from quillcache_core.security.certs import make_certs

INSECURE_HELP = (
    "measure the plaintext stack (no certificates, no role checks; development mode), "
    "e.g. to see what TLS costs; the default is mutual TLS everywhere"
)


def bench_certs(directory: Path, insecure: bool = False) -> Path | None:
    """A CA and every role's certificate in `directory`/certs; None when insecure."""
    return None if insecure else make_certs(Path(directory) / "certs")
