"""Prompt rendering and tokenization: the token ids an engine computes for a request.

The gateway must produce exactly the engine's token ids for a request, or its block
hashes never match what the engine caches. Three kinds of tokenizer:

- `ModelTokenizer`: a Hugging Face model directory (tokenizer.json, tokenizer_config.json,
  the chat template), tokenized by vLLM's rules: a completion prompt gets the special
  tokens its post-processor adds (`add_special_tokens`, default true), a chat is the
  model's own template rendered (`chat_template`) and tokenized without adding any
  (default false), as vLLM's OpenAI server does;
- `HfTokenizer`: a bare tokenizer.json, and
- `BuiltinTokenizer`: deterministic words and punctuation, each mapped through BLAKE2b
  to an id in a 32,000-entry vocabulary;

the last two, with the sim engine's ChatML-style rendering (`render_chat`) and no
special tokens, are what the sim engine computes with the same settings.
`request_tokens` applies the right rules to an OpenAI request body.

What a tokenizer remembers to go faster (the built-in one's piece ids, recent long
texts and pieces with their ids) lives in a `TokenMemo`, bounded in bytes. The gateway
gives each tenant its own and tokenizes a request with `scoped(memo)`: what one tenant
sent never changes what another's prompt finds, nor how fast it is tokenized; and what
a request would add is kept only by the view's `commit`, once the request is admitted.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
from array import array
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from itertools import accumulate, islice
from operator import itemgetter
from pathlib import Path
from typing import Protocol

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.messages import text_parts
from quillcache_core.identity.prefix_memo import PrefixMemo

logger = logging.getLogger(__name__)

BUILTIN_VOCAB = 32_000
DEFAULT_MEMO_BYTES = 64 * 1024 * 1024
WORD_BYTES = 104  # a kept piece's dict slot and id, beyond its str (sys.getsizeof)
PREFIX_KEY_CHARS = 2048  # BuiltinTokenizer(prefix_cache): only texts longer are kept
PREFIX_CHUNK_CHARS = 512  # and found by their whole chunks of this many characters
_PIECES = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)
ROLES = ("system", "user", "assistant", "tool", "developer")


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


class TokenizerView(Tokenizer, Protocol):
    """A tokenizer for one request with a memo (`scoped`): `commit` keeps its work there."""

    def commit(self) -> None: ...


class TokenMemo:
    """What tokenizing remembers, at most `max_bytes`: the built-in tokenizer's piece ids
    (at most a quarter of it; cleared when full) and recent long texts with their ids
    (`PrefixMemo`, at most `texts` of them: the built-in tokenizer's prompts, a Hugging
    Face tokenizer's pieces). Not thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES, texts: int = 64) -> None:
        self.words: dict[str, int] = {}
        self.words_bytes = 0
        self.max_words_bytes = max_bytes // 4
        self.texts = PrefixMemo(texts, PREFIX_CHUNK_CHARS, max_bytes - self.max_words_bytes)
        self.piecewise = 0  # texts a Hugging Face tokenizer split here (every Nth is checked)

    @property
    def nbytes(self) -> int:
        return self.words_bytes + self.texts.nbytes

    def add_words(self, fresh: Mapping[str, int]) -> None:
        cost = sum(map(sys.getsizeof, fresh)) + WORD_BYTES * len(fresh)
        if self.words_bytes + cost > self.max_words_bytes:
            self.words.clear()
            self.words_bytes = 0
        if cost <= self.max_words_bytes:
            self.words.update(fresh)
            self.words_bytes += cost


class _Work:
    """What tokenizing a request found worth keeping in `memo`, kept only by `commit`."""

    __slots__ = ("memo", "words", "texts")

    def __init__(self, memo: TokenMemo) -> None:
        self.memo = memo
        self.words: dict[str, int] = {}  # pieces the memo has no id for
        self.texts: list[tuple] = []  # (Lookup, text, payload, payload bytes) to keep

    def commit(self) -> None:
        if self.words:
            self.memo.add_words(self.words)
        keep = self.memo.texts.keep
        for found, text, payload, payload_bytes in self.texts:
            keep(found, text, payload, payload_bytes)
        self.words, self.texts = {}, []


class BuiltinTokenizer:
    """Deterministic fallback: every word, space run and symbol is one token.

    Piece ids are memoised (`TokenMemo.words`), so a prompt of known pieces costs one
    regex pass and one lookup per piece.

    With a memo that keeps texts (`prefix_cache` for `encode`'s own; the gateway's
    tenants' memos), texts longer than PREFIX_KEY_CHARS characters are kept (by whole
    chunks of PREFIX_CHUNK_CHARS); a text is matched with the kept one sharing the most
    chunks of its opening, reuses its ids up to the last piece that ends before where
    the two texts differ and splits only the rest (a document asked about again, a
    conversation's next turn among many that open with the same system prompt). The
    ids are those of a full pass: a piece's extent depends only on its characters and
    the one after.
    """

    name = "builtin-v1"

    def __init__(self, prefix_cache: int = 0, memo_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self._memo = TokenMemo(memo_bytes, prefix_cache)  # `encode`'s own

    def encode(self, text: str) -> list[int]:
        work = _Work(self._memo)
        ids = self.encode_with(text, work)
        work.commit()
        return ids

    def scoped(self, memo: TokenMemo) -> _Scoped:
        """This tokenizer for one request, with `memo` (a tenant's)."""
        return _Scoped(self, memo)

    def encode_with(self, text: str, work: _Work) -> list[int]:
        """`encode` with `work.memo`; what it would keep goes to `work`."""
        if work.memo.texts.size and len(text) > PREFIX_KEY_CHARS:
            return self._encode_reusing(text, work)
        return _encode_pieces(_PIECES.findall(text), work)

    def _encode_reusing(self, text: str, work: _Work) -> list[int]:
        found = work.memo.texts.lookup(self.name, text)
        # The ids and each piece's end of the kept text it opens like, 4 bytes each.
        old_ids, old_ends = found.payload or (_NO_INTS, _NO_INTS)
        # Pieces ending before the first difference are the same in both texts.
        kept = bisect_left(old_ends, found.shared)
        start = old_ends[kept - 1] if kept else 0
        pieces = _PIECES.findall(text, start)
        ids = old_ids[:kept]
        ids.extend(_encode_pieces(pieces, work))
        ends = old_ends[:kept]
        ends.extend(islice(accumulate(map(len, pieces), initial=start), 1, None))
        work.texts.append((found, text, (ids, ends), 4 * (len(ids) + len(ends))))
        return ids.tolist()


_NO_INTS = array("I")


def _encode_pieces(pieces: list[str], work: _Work) -> list[int]:
    known = work.memo.words
    try:
        return list(map(known.__getitem__, pieces))
    except KeyError:
        fresh = work.words
        for piece in pieces:
            if piece not in known and piece not in fresh:
                fresh[piece] = _piece_id(piece)
        return [known[p] if p in known else fresh[p] for p in pieces]


class _Scoped:
    """A BuiltinTokenizer working with one memo for one request (BuiltinTokenizer.scoped):
    what it would keep is kept by `commit`."""

    __slots__ = ("_tokenizer", "_work", "name")

    def __init__(self, tokenizer: BuiltinTokenizer, memo: TokenMemo) -> None:
        self._tokenizer, self._work, self.name = tokenizer, _Work(memo), tokenizer.name

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode_with(text, self._work)

    def commit(self) -> None:
        self._work.commit()


def _piece_id(piece: str) -> int:
    digest = blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % BUILTIN_VOCAB


class HfTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (no special tokens added by default).

    A long text piece between added tokens (a chat template's `<|im_start|>`) reuses
    the ids of a kept piece it opens like (`_PieceCache`), kept in `encode`'s own memo
    or, with `scoped`, in the memo given (the gateway's tenant's).
    """

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        from tokenizers import Tokenizer as _HfTokenizer

        try:
            self._tok = _HfTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise InvalidArgument(f"cannot load tokenizer {path}: {exc}") from None
        self.name = name or Path(path).stem
        self._pieces = _PieceCache.of(Path(path))
        self._memo = TokenMemo(texts=PIECE_ENTRIES)  # `encode`'s own
        self._work: _Work | None = None  # a view's (`scoped`)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = self._pieces
        if add_special_tokens or pieces is None or len(text) < PIECE_CHARS or not pieces.on:
            return _encode(self._tok, text, add_special_tokens)
        if self._work is not None:
            return pieces.encode(self._tok, text, self._work)
        work = _Work(self._memo)
        ids = pieces.encode(self._tok, text, work)
        work.commit()
        return ids

    def scoped(self, memo: TokenMemo):
        """This tokenizer for one request, its pieces' ids reused from and kept (by
        `commit`) in `memo` only (a tenant's)."""
        view = copy.copy(self)
        view._work = _Work(memo)
        return view

    def commit(self) -> None:
        """Keep what a view (`scoped`) tokenized in its memo."""
        if self._work is not None:
            self._work.commit()

    @property
    def piece_counts(self) -> dict[str, int]:
        pieces = self._pieces
        return {} if pieces is None else dict(pieces.counts)


# A text piece between added tokens at least this long keeps its ids (a document, a
# conversation's earlier turns); shorter runs are tokenized as they come.
PIECE_CHARS = 256
PIECE_ENTRIES = 512
PIECE_CHECK_EVERY = 64
# A kept piece is found by its whole chunks of this many characters (`PrefixMemo`).
PIECE_CHUNK_CHARS = 256
PIECE_ID_BYTES = 36  # a kept id: its list slot and int
_first = itemgetter(0)
_CUT_AFTER = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")


class _PieceCache:
    """Ids of long text pieces between added tokens, reused by (memo, opening).

    `tokenizers` splits a text at its added tokens (leftmost-longest) before it
    normalizes, pre-tokenizes and merges each piece alone, so a text's ids are the ids
    of its pieces and added tokens in order. A long piece is matched with the kept piece
    of the same memo that shares the most of its opening (`PrefixMemo`: a document
    asked about again with another question, a conversation's earlier turns) and reuses
    its ids up to the last cut before where the two differ; only the rest is tokenized.

    A cut is taken before a space that follows an ASCII letter or digit. The
    pre-tokenizers of byte-level BPE (GPT-2's and Llama 3's patterns, BERT's whitespace
    split) end the pre-token holding that letter or digit right there, since none of
    their alternatives runs from a letter or digit into a space, and start the next one
    with the space; none looks behind, and merges never cross a pre-token. So the ids of
    a text are those of its two halves, and the kept piece's ids before a cut (its
    tokens that start before it: `tokenizers`' offsets) are the new piece's too wherever
    the space is shared.

    That holds for the tokenizers `of` accepts (no normalizer, no Metaspace
    pre-tokenizer, whose "first" prepend depends on the piece's place, no added token
    that strips or matches whole words only); every PIECE_CHECK_EVERY'th text of a memo
    is also tokenized whole, and a difference turns the cache off for good
    (`counts["mismatches"]`). Pieces are kept in the memo of the `_Work` given, under
    this cache as their scope: piece -> (its ids, where each of its tokens starts).
    """

    def __init__(self, split: re.Pattern) -> None:
        self._split = split
        self.on = True
        self.counts = {
            "texts": 0,
            "hits": 0,
            "misses": 0,
            "reused_chars": 0,
            "checks": 0,
            "mismatches": 0,
        }

    @classmethod
    def of(cls, path: Path) -> _PieceCache | None:
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        added = spec.get("added_tokens") or []
        if (
            spec.get("normalizer") is not None
            or "Metaspace" in json.dumps(spec.get("pre_tokenizer"))
            or not added
            or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added)
        ):
            return None
        contents = sorted({t["content"] for t in added if t.get("content")}, key=len, reverse=True)
        return cls(re.compile("(" + "|".join(map(re.escape, contents)) + ")"))

    def encode(self, tok, text: str, work: _Work) -> list[int]:
        counts = self.counts
        ids: list[int] = []
        run: list[str] = []  # short pieces and added tokens, tokenized together
        for i, part in enumerate(self._split.split(text)):
            if i % 2 or len(part) < PIECE_CHARS:
                run.append(part)
                continue
            if run:
                ids += _encode(tok, "".join(run), False)
                run = []
            ids += self._piece(tok, part, work)
        if run:
            ids += _encode(tok, "".join(run), False)
        counts["texts"] += 1
        work.memo.piecewise += 1  # the memo's own count: another tenant's never matters
        if work.memo.piecewise % PIECE_CHECK_EVERY == 0:
            counts["checks"] += 1
            whole = _encode(tok, text, False)
            if whole != ids:
                counts["mismatches"] += 1
                self.on = False
                work.texts.clear()
                logger.error("piece-wise token ids differ from a whole pass: piece reuse off")
                return whole
        return ids

    def _piece(self, tok, piece: str, work: _Work) -> list[int]:
        """`piece`'s ids: those of the kept piece it opens like, up to the last cut
        before their first difference (all of them for the same piece again), then the
        rest's. The token starts are kept as an array of 4-byte integers (a list costs
        36 bytes an int)."""
        found = work.memo.texts.lookup(self, piece, PIECE_CHUNK_CHARS)
        if found.payload is None:
            start = 0
        elif found.extends is not None and found.shared == len(piece):
            self.counts["hits"] += 1  # the same piece
            self.counts["reused_chars"] += len(piece)
            return found.payload[0]
        else:
            start = _last_cut(piece, found.shared)
        if start:
            old_ids, old_starts = found.payload
            kept = bisect_left(old_starts, start)  # the tokens before the cut
            ids, starts = old_ids[:kept], old_starts[:kept]
            rest = _encoding(tok, piece[start:])
            ids += rest.ids
            starts.extend([start + first for first, _ in rest.offsets])
        else:
            whole = _encoding(tok, piece)
            ids, starts = whole.ids, array("I", map(_first, whole.offsets))
        self.counts["hits" if start else "misses"] += 1
        self.counts["reused_chars"] += start
        work.texts.append(
            (found, piece, (ids, starts), PIECE_ID_BYTES * len(ids) + 4 * len(starts))
        )
        return ids  # the kept list itself: the caller copies it into its own


def _last_cut(text: str, before: int) -> int:
    """The last cut (see `_PieceCache`) in `text[:before]`, 0 when there is none."""
    at = text.rfind(" ", 0, before)
    while at > 0 and text[at - 1] not in _CUT_AFTER:
        at = text.rfind(" ", 0, at)
    return max(at, 0)


class ModelTokenizer(HfTokenizer):
    """A Hugging Face model directory's tokenizer and chat template, by vLLM's rules."""

    def __init__(self, directory: str | Path, name: str | None = None) -> None:
        from quillcache_core.identity.chat_template import ChatTemplate, special_tokens_of

        directory = Path(directory)
        super().__init__(directory / "tokenizer.json", name or str(directory))
        try:
            config_path = directory / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read {directory}'s tokenizer config: {exc}") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: vLLM takes "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = directory / "chat_template.jinja"
        if not isinstance(source, str) and jinja.exists():
            source = jinja.read_text()
        self.template = (
            ChatTemplate(source, special_tokens_of(config)) if isinstance(source, str) else None
        )
        self.directory = directory

    def chat_ids(self, payload: Mapping) -> list[int]:
        """A chat request's prompt ids, as vLLM renders and tokenizes it."""
        if self.template is None:
            raise InvalidArgument(f"model {self.name} has no chat template: use completions")
        kwargs = payload.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise InvalidArgument("'chat_template_kwargs' must be an object")
        text = self.template.render(
            payload["messages"],
            tools=_list_or_none(payload.get("tools"), "tools"),
            documents=_list_or_none(payload.get("documents"), "documents"),
            add_generation_prompt=_flag(payload, "add_generation_prompt", True),
            continue_final_message=_flag(payload, "continue_final_message", False),
            template_kwargs=kwargs,
        )
        return self.encode(text, _flag(payload, "add_special_tokens", False))


def _encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    return _encoding(tok, text, add_special_tokens).ids


def _encoding(tok, text: str, add_special_tokens: bool = False):
    """A `tokenizers` encode that refuses what it cannot encode (a lone surrogate from
    JSON's "\\ud800") with InvalidArgument instead of the library's TypeError."""
    try:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"the prompt holds text that cannot be tokenized: {exc}") from None


def _flag(payload: Mapping, name: str, default: bool) -> bool:
    value = payload.get(name, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"'{name}' must be a boolean")
    return value


def _list_or_none(value, name: str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidArgument(f"'{name}' must be an array")
    return value


def load_tokenizer(path: str | Path, name: str | None = None) -> Tokenizer:
    """A model directory (tokenizer.json beside its config and template) or a tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        return ModelTokenizer(path, name)
    return HfTokenizer(path, name)


def load_tokenizers(spec: str) -> dict[str, Tokenizer]:
    """Parse "model=PATH,model2=PATH" (a model directory or a tokenizer.json) per model."""
    out: dict[str, Tokenizer] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        model, sep, path = part.partition("=")
        if not sep or not model or not path:
            raise InvalidArgument(
                f"tokenizer spec {part!r} is not model=DIR or model=path/to/tokenizer.json"
            )
        out[model] = load_tokenizer(path, name=f"{model}:{Path(path).name}")
    return out


def request_tokens(kind: str, payload: Mapping, tokenizer: Tokenizer) -> list[int]:
    """The prompt ids an engine computes for an OpenAI request body (`kind` "chat" or
    "completion"; a batch of prompts is planned by its first). Raises InvalidArgument."""
    if kind == "chat":
        if isinstance(tokenizer, ModelTokenizer):
            return tokenizer.chat_ids(payload)
        return tokenizer.encode(render_chat(payload["messages"]))
    prompt = payload["prompt"]
    if isinstance(tokenizer, ModelTokenizer):
        special = _flag(payload, "add_special_tokens", True)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, special)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return tokenizer.encode(prompt[0], special)
    return prompt_tokens(prompt, tokenizer)[0]


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
        return "".join(text for text in text_parts(content, index) if text is not None)
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
