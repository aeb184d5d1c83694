"""Deterministic output: what the sim engine "generates" for a prompt.

The text depends only on the prompt's token ids, never on what the cache held, so an
answer computed over reused KV equals the one over recomputed KV; `max_tokens` only
cuts it, as a model's budget does (a shorter answer is the longer one's beginning: the
first token a one-token prefill samples is a whole answer's first token). Every output
token is one word (with a leading space after the first).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["generate"]

WORDS = (
    "the", "cache", "block", "prefix", "engine", "token", "store", "fetch",
    "quill", "page", "tensor", "layer", "head", "value", "key", "hit",
    "warm", "cold", "fast", "slow", "reuse", "plan", "route", "node",
    "rack", "lease", "event", "batch", "stream", "chunk", "model", "prompt",
    "and", "of", "to", "in", "is", "it", "that", "with",
    "a", "for", "on", "as", "by", "at", "from", "we",
    "ink", "paper", "letter", "word", "line", "verse", "note", "margin",
    "draft", "scroll", "press", "type", "serif", "glyph", "quire", "folio",
)  # fmt: skip


def generate(prompt_tokens: Sequence[int], max_tokens: int) -> list[str]:
    """`max_tokens` text pieces (one per output token), a pure function of the inputs:
    the first `max_tokens` of the prompt's one sequence."""
    h = blake2b(b"quillcache/sim-engine/output/v2", digest_size=32)
    h.update(array("Q", prompt_tokens).tobytes())
    state = h.digest()
    pieces: list[str] = []
    while len(pieces) < max_tokens:
        for byte in state:
            if len(pieces) >= max_tokens:
                break
            word = WORDS[byte % len(WORDS)]
            pieces.append(word if not pieces else " " + word)
        state = blake2b(state, digest_size=32).digest()
    return pieces
