"""Render a model's Jinja chat template, the way HF transformers' `apply_chat_template` does.

Chat templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment mirrors transformers' (trim_blocks, lstrip_blocks, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, loop controls, `{% generation %}` blocks) so
that a prompt rendered here is byte-for-byte the prompt the model was tuned on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template", "validate_messages"]


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it only renders its body, but templates using it must parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`, which would change tool schemas and
    # arguments the model sees; this is transformers' replacement.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and return it as plain dicts, text-part lists flattened to strings.

    Each message needs a string `role` and a `content` that is a string or a list of text parts
    (`{"type": "text", "text": ...}`, as in the OpenAI API). Text parts are joined with newlines:
    most templates (SmolLM2's, Qwen2.5's) only know string content, and the ones that accept lists
    handle a string too. An assistant message that carries `tool_calls` may have no content.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"message {i} needs a string 'role', got {role!r}")
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"message {i} ({role}) has no 'content'")
        message = dict(message)
        message["content"] = _content_text(message.get("content"), i, role, message)
        out.append(message)
    return out


def _content_text(content: Any, i: int, role: str, message: Mapping[str, Any]) -> str | None:
    if isinstance(content, str):
        return content
    if content is None and message.get("tool_calls"):
        return None
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                if part.get("type", "text") != "text":
                    raise ValueError(f"message {i} ({role}): unsupported part {part.get('type')!r}")
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"message {i} ({role}): only text content parts are supported, got {kind!r}"
                )
        return "\n".join(texts)
    raise ValueError(
        f"message {i} ({role}): 'content' must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str | None = "",
    eos_token: str | None = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the Jinja chat `template`.

    `tools` (JSON schemas) and any extra keyword arguments (e.g. `unk_token`, `documents`,
    `enable_thinking`) are passed to the template as variables, as in transformers. Raises
    `ValueError` when there is no template, the messages are malformed, or the template fails
    (including the template's own `raise_exception`).
    """
    if not template:
        raise ValueError(
            "this model has no chat template; send a plain prompt (completions) instead of "
            "chat messages, or use a chat/instruct model"
        )
    chat = validate_messages(messages)
    if tools is not None:
        tools = [dict(t) for t in tools]
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=chat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        # Template code doing e.g. `str + list`, or indexing past the conversation.
        raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e
