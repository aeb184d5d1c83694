"""Every `quillcache` command line the README and the docs show in a ```sh or ```bash
block names a subcommand that exists and only flags its parser accepts."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from quillcache_core.launch import cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SHELL_BLOCK = re.compile(
    r"^```(?:sh|bash|shell|console)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL
)
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")
PUNCTUATION = ";&|()`"  # what ends a command in a shell line
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
PREFIXES = frozenset({"exec", "time", "sudo", "env", "nohup"})


class _Parser(Exception):
    """Raised instead of parsing: carries the parser a command's main built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def commands() -> dict[str, tuple[str, str]]:
    return {**cli.COMMANDS, **cli.plugin_commands()}


def accepted_flags(command: str, monkeypatch: pytest.MonkeyPatch) -> frozenset[str]:
    """The long options `quillcache <command>` takes, read from the parser its main builds
    (stopped before it parses anything: nothing starts)."""

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        module = importlib.import_module(commands()[command][0])
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                module.main([])
        except _Parser as found:
            return frozenset(FLAG.findall(found.parser.format_usage()))
    raise AssertionError(f"quillcache {command}: its main parsed no arguments")


def shell_commands(markdown: str) -> list[list[str]]:
    """The argument lists after each `quillcache` at a command's position in the shell
    blocks of `markdown` (continuation lines joined, comments and [optional] brackets
    dropped)."""
    found = []
    for block in SHELL_BLOCK.findall(markdown):
        # Continuations joined; then every line starts with a ";", which ends the
        # command before it even where a comment swallowed that line's newline.
        script = block.replace("\\\n", " ").replace("\n", "\n;")
        lexer = shlex.shlex(script, posix=True, punctuation_chars=PUNCTUATION)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: not a command line
            continue
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if all(c in PUNCTUATION for c in token):
                found += _quillcache_args(segment)
                segment = []
            else:
                segment.append(token)
    return found


def _quillcache_args(segment: list[str]) -> list[list[str]]:
    words = list(segment)
    while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in PREFIXES):
        words.pop(0)
    if not words or Path(words[0]).name != "quillcache":
        return []
    return [[word.strip("[]") for word in words[1:] if word.strip("[]")]]


def problems(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What is wrong with `quillcache ARGS`: an unknown subcommand or flag."""
    if not args or args[0] in ("-h", "--help", "help"):
        return []
    command, rest = args[0], args[1:]
    if command not in commands():
        return [f"no subcommand {command!r}"]
    allowed = accepted_flags(command, monkeypatch)
    flags = [word.split("=", 1)[0] for word in rest if FLAG.fullmatch(word.split("=", 1)[0])]
    return [f"quillcache {command} takes no {flag}" for flag in flags if flag not in allowed]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_command_lines_are_read_from_shell_blocks_only_at_a_commands_position():
    text = (
        "Run `quillcache nosuch` in prose: not a block.\n"
        "```sh\n"
        "QC_X=1 quillcache up --engines 2 \\\n  --stores 3   # a comment --not-a-flag\n"
        "KEY=$(quillcache certs d --hosts a,b) && .venv/bin/quillcache drain e-1 [--timeout-s 5]\n"
        "grpcurl -authority quillcache 127.0.0.1:50051 list\n"
        "```\n"
        "```python\nquillcache bench --nope\n```\n"
    )
    assert shell_commands(text) == [
        ["up", "--engines", "2", "--stores", "3"],
        ["certs", "d", "--hosts", "a,b"],
        ["drain", "e-1", "--timeout-s", "5"],
    ]


def test_an_unknown_subcommand_or_flag_is_found(monkeypatch):
    assert problems(["up", "--engines", "2", "--conductors=3"], monkeypatch) == []
    assert problems(["up", "--engine-count", "2"], monkeypatch) == [
        "quillcache up takes no --engine-count"
    ]
    assert problems(["bench-everything"], monkeypatch) == ["no subcommand 'bench-everything'"]
    assert problems(["gateway", "--api-keys-file", "f", "--tls"], monkeypatch) == [
        "quillcache gateway takes no --tls"
    ]


def test_every_documented_quillcache_command_exists_with_the_flags_it_shows(monkeypatch):
    shown = {
        doc.relative_to(ROOT): shell_commands(doc.read_text(encoding="utf-8"))
        for doc in doc_files()
    }
    assert sum(len(lines) for lines in shown.values()) >= 20, shown
    wrong = [
        f"{doc}: quillcache {' '.join(args)}: {problem}"
        for doc, lines in shown.items()
        for args in lines
        for problem in problems(args, monkeypatch)
    ]
    assert not wrong, "\n".join(wrong)
