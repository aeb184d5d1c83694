"""The product speaks of itself: no file of it names a work item (an issue number) or a
work session, and every relative link of the README and the docs leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# What ships: the code, the deploy files and the prose an operator reads.
PRODUCT_DIRS = ("services", "libs", "protos", "scripts", "k8s", "docs")
PRODUCT_FILES = ("README.md", "docker-compose.yml", "Makefile")
SKIPPED_SUFFIXES = frozenset({".pyc", ".so", ".png", ".jpg", ".gif", ".ico", ".whl"})

# A work item or a work session named in product text. "session" alone is a chat
# session, an HTTP session or a pytest fixture's scope, and "issuer" a certificate's:
# neither is matched.
WORK_NOTE = re.compile(
    "|".join(
        (
            r"[Ii]ssue ?#?[0-9]",  # "issue 4", "Issue #12"
            r"\(#[0-9]+\)",  # "(#12)"
            r"\b[Tt](?:his|he) issue(?:'s|s')?(?=[\s.,;:)]|$)",  # "the issue's goal"
            r"\b[Ss]ession notes?\b",
            r"\b[Tt]his session\b",
            r"\b(?:earlier|later|previous|next|last|first|second|third|fourth) sessions?\b",
            r"\bthe session before\b",
            r"\bsessions? of the day\b",
        )
    ),
)

# Markdown links and images: [text](target) and ![alt](target).
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def product_files() -> list[Path]:
    found = [ROOT / name for name in PRODUCT_FILES if (ROOT / name).is_file()]
    found += sorted(ROOT.glob("Dockerfile*"))
    for top in PRODUCT_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                if path.suffix not in SKIPPED_SUFFIXES:
                    found.append(path)
    return found


def work_notes(text: str) -> list[tuple[int, str]]:
    """(line number, the line) of every line naming an issue number or a work session."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        # the literal test first: a regex alternation over every line is slow
        if ("ssue" in line or "ession" in line or "(#" in line) and WORK_NOTE.search(line)
    ]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(markdown: str) -> list[str]:
    """The link targets outside code, without their #anchor; web and mail links left out."""
    prose = INLINE_CODE.sub("", FENCE.sub("", markdown))
    targets = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("Goal (issue 4): plan p99 under 2 ms", True),
        ("see #12 (#12) for the history", True),
        ("the issue's bar: at most 0.5% failed", True),
        ("as this issue asks", True),
        ("what this session found", True),
        ("the runs of the session before", True),
        ("Latest runs (fourth session of the day)", True),
        ("the certificate's issuer is the cluster's CA", False),
        ("one aiohttp session, kept-alive connections", False),
        ("a session per user, whose turns the driver sends", False),
        ('@pytest.fixture(scope="session")', False),
        ("an issue with the disk shows as corrupt blocks", False),
    ],
)
def test_work_notes_are_told_from_the_words_of_the_product(line, flagged):
    assert bool(work_notes(line)) is flagged


def test_no_product_file_names_an_issue_or_a_work_session():
    files = product_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary data, not prose
        offenders += [f"{path.relative_to(ROOT)}:{n}: {line[:120]}" for n, line in work_notes(text)]
    assert not offenders, "product text names a work item or session:\n" + "\n".join(offenders)


def test_relative_links_are_found_outside_code_and_without_anchors():
    text = (
        "See [ops](operations.md#runbook), ![plot](../bench/x.png 'a plot'),\n"
        "[web](https://example.com), [here](#top) and `[not](a-link.md)`.\n"
        "```sh\necho '[nor](this.md)'\n```\n"
    )
    assert relative_links(text) == ["operations.md", "../bench/x.png"]


def test_every_relative_link_of_the_readme_and_the_docs_resolves_to_a_file():
    docs = doc_files()
    assert (ROOT / "docs" / "architecture.md") in docs
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in docs
        for target in relative_links(doc.read_text(encoding="utf-8"))
        if not (doc.parent / target).exists()
    ]
    assert not broken, "links to no file:\n" + "\n".join(broken)
