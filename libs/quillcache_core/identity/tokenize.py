"""Prompt rendering and tokenization shared by the gateway and the sim engine.

Both sides must produce the same token ids for the same request, or the gateway's
block hashes would never match what the engine caches. Chat messages are rendered
with a ChatML-style template (the whole conversation, then the assistant prefix)
before tokenizing. The tokenizer is a Hugging Face `tokenizers` tokenizer.json when
one is configured for the model, else a deterministic built-in one (words and
punctuation, each mapped through BLAKE2b to an id in a 32,000-entry vocabulary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from pathlib import Path
from typing import Protocol

from quillcache_core.errors import InvalidArgument

BUILTIN_VOCAB = 32_000
BUILTIN_CACHE_PIECES = 200_000
_PIECES = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)
ROLES = ("system", "user", "assistant", "tool", "developer")


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


class BuiltinTokenizer:
    """Deterministic fallback: every word, space run and symbol is one token.

    Piece ids are memoised in a dict (at most about BUILTIN_CACHE_PIECES entries), so
    a prompt of known pieces costs one regex pass and one lookup per piece.
    """

    name = "builtin-v1"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        pieces = _PIECES.findall(text)
        ids = self._ids
        try:
            return list(map(ids.__getitem__, pieces))
        except KeyError:
            if len(ids) >= BUILTIN_CACHE_PIECES:
                ids.clear()
            for piece in pieces:
                if piece not in ids:
                    ids[piece] = _piece_id(piece)
            return list(map(ids.__getitem__, pieces))


def _piece_id(piece: str) -> int:
    digest = blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % BUILTIN_VOCAB


class HfTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (no special tokens added)."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        from tokenizers import Tokenizer as _HfTokenizer

        try:
            self._tok = _HfTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise InvalidArgument(f"cannot load tokenizer {path}: {exc}") from None
        self.name = name or Path(path).stem

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizers(spec: str) -> dict[str, Tokenizer]:
    """Parse "model=path/tokenizer.json,model2=..." into per-model tokenizers."""
    out: dict[str, Tokenizer] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        model, sep, path = part.partition("=")
        if not sep or not model or not path:
            raise InvalidArgument(f"tokenizer spec {part!r} is not model=path/to/tokenizer.json")
        out[model] = HfTokenizer(path, name=f"{model}:{Path(path).name}")
    return out


def render_chat(messages: Sequence[Mapping]) -> str:
    """The prompt an engine sees for a chat conversation (ChatML-style).

    Content may be a string or OpenAI's list of parts (text parts are joined).
    Raises InvalidArgument for a malformed message.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidArgument("'messages' must be a non-empty array")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        out.append(f"<|im_start|>{role}\n{_content_text(message.get('content'), i)}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise InvalidArgument(
                    f"messages[{index}].content[{j}] must be an object with a type"
                )
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{index}].content[{j}].text must be a string")
                texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(f"messages[{index}].content must be a string or an array of parts")


def prompt_tokens(prompt, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of an OpenAI `prompt`: a string, a list of strings, token ids, or lists of them.

    Returns one token list per prompt (OpenAI allows a batch). Token ids are used as given.
    """
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [_check_ids(prompt, "prompt")]
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [_check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidArgument(
        "'prompt' must be a string, an array of strings, an array of token ids, "
        "or an array of token-id arrays"
    )


def _check_ids(ids: list, what: str) -> list[int]:
    if not ids:
        raise InvalidArgument(f"{what} is empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**32:
            raise InvalidArgument(f"{what} holds {t!r}, not a token id in [0, 2**32)")
    return ids
