"""A model's own chat template, rendered as vLLM renders it for an OpenAI chat request.

The template is the Jinja source a Hugging Face model directory carries
(`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja`). It is rendered
in the environment transformers' `apply_chat_template` uses (a sandbox with
trim_blocks and lstrip_blocks, loop controls, its `tojson`, `raise_exception` and
`strftime_now`, the special tokens as variables), with the inputs vLLM gives it:

- content format: a template that loops over a message's content gets OpenAI's parts
  (a string content becomes one text part), any other gets a string (text parts joined
  with newlines), as vLLM's "auto" content format detects;
- assistant tool calls' `arguments` strings are parsed into objects, as vLLM does
  before rendering, so `tojson` writes them the way the engine's template did;
- `tools` in vLLM's validated shape (`{"type", "function": {"name", "description",
  "parameters"}}`, unset optional fields as null), `documents`, `add_generation_prompt`
  (default true), `continue_final_message` and the request's `chat_template_kwargs`.

The rendered text is tokenized without adding special tokens (the template writes
them), as vLLM does for chat.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.messages import text_parts

# A `{% for x in message['content'] %}`-like loop: the template reads content parts.
_CONTENT_LOOP = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content(?!\w))"
)
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplate:
    """One model's template; `render` is thread-safe (the compiled template is shared)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.openai_content = bool(_CONTENT_LOOP.search(source))
        self._template = env.from_string(source)
        self._error = TemplateError

    def render(
        self,
        messages: Sequence[Mapping],
        *,
        tools: Sequence[Mapping] | None = None,
        documents: Sequence[Mapping] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text. Raises InvalidArgument for malformed messages or a template
        that refuses them (its raise_exception)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true"
            )
        prepared = self._messages(messages)
        variables = {**self.special_tokens, **dict(template_kwargs or {})}
        for name in _RESERVED:
            variables.pop(name, None)
        try:
            text = self._template.render(
                messages=prepared,
                tools=[_tool(t, i) for i, t in enumerate(tools)] if tools else None,
                documents=list(documents) if documents else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except self._error as exc:
            raise InvalidArgument(
                f"the model's chat template refused the messages: {exc}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidArgument(
                f"the model's chat template failed on the messages: {exc}"
            ) from None
        if continue_final_message:
            text = _strip_after_final(text, prepared)
        return text

    def _messages(self, messages: Sequence[Mapping]) -> list[dict]:
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
            raise InvalidArgument("'messages' must be a non-empty array")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidArgument(f"messages[{i}] must be an object with a string role")
            item = copy.deepcopy(dict(message))
            item["content"] = self._content(item.get("content"), i)
            calls = item.get("tool_calls")
            if calls is not None:
                item["tool_calls"] = _parsed_tool_calls(calls, i)
            out.append(item)
        return out

    def _content(self, content: Any, index: int) -> Any:
        if content is None:
            return [] if self.openai_content else None
        if isinstance(content, str):
            return [{"type": "text", "text": content}] if self.openai_content else content
        if isinstance(content, list):
            parts = []
            for j, text in enumerate(text_parts(content, index)):
                if text is None:
                    raise InvalidArgument(
                        f"messages[{index}].content[{j}]: only text parts are supported, "
                        f"not {content[j]['type']!r}"
                    )
                parts.append({"type": "text", "text": text})
            if self.openai_content:
                return parts
            return "\n".join(p["text"] for p in parts)
        raise InvalidArgument(f"messages[{index}].content must be a string or an array of parts")


def _tool(tool: Any, index: int) -> dict:
    """A tool as vLLM hands it to the template: its request model, dumped."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f"tools[{index}].function must be an object with a string name")
    if tool.get("type", "function") != "function":
        raise InvalidArgument(f"tools[{index}].type must be 'function'")
    out_function = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for optional in ("strict", "defer_loading"):
        if function.get(optional) is not None:
            out_function[optional] = function[optional]
    out = {"type": "function", "function": out_function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _parsed_tool_calls(calls: Any, index: int) -> list:
    if not isinstance(calls, list):
        raise InvalidArgument(f"messages[{index}].tool_calls must be an array")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidArgument(f"messages[{index}].tool_calls[{j}].function must be an object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # the template gets the string as sent
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _strip_after_final(text: str, messages: list[dict]) -> str:
    """The render cut right after the final message's content (continue_final_message)."""
    final = messages[-1].get("content")
    if isinstance(final, list):
        final = "".join(p["text"] for p in final)
    if not final:
        return text
    at = text.rfind(final.strip())
    if at < 0:
        raise InvalidArgument("continue_final_message: the final message is not in the render")
    return text[: at + len(final.strip())]


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... of a tokenizer_config.json, as template variables."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token"):
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out
