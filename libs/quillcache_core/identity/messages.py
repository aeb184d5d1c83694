"""OpenAI chat messages' content, checked: read by the builtin renderer (`tokenize`)
and a model's own chat template (`chat_template`) alike."""

from __future__ import annotations

from collections.abc import Mapping

from quillcache_core.errors import InvalidArgument


def text_parts(content: list, index: int) -> list[str | None]:
    """OpenAI content parts, checked: each text part's text, None for other kinds."""
    out: list[str | None] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidArgument(f"messages[{index}].content[{j}] must be an object with a type")
        if part["type"] != "text":
            out.append(None)
            continue
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(f"messages[{index}].content[{j}].text must be a string")
        out.append(part["text"])
    return out
