"""Chat templates: a GGUF's `tokenizer.chat_template` compiled as Hugging Face renders it
(jinja2 sandbox, trim_blocks + lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`),
once per template text."""

from __future__ import annotations

import json
from typing import Any

from toymlx.data.vocab import K_TEMPLATE, TokenizerError

_TEMPLATES: dict[str, Any] = {}


def compile_template(source_text: str, where: str):
    """The template of `source_text`, compiled once; TokenizerError naming `where` when
    it is not valid Jinja."""
    if source_text in _TEMPLATES:
        return _TEMPLATES[source_text]
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        template = env.from_string(source_text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: {K_TEMPLATE}: expected a valid Jinja template, found "
                             f"a syntax error at line {e.lineno}: {e.message}") from None
    _TEMPLATES[source_text] = template
    return template


def system_refused(tokenizer) -> str | None:
    """The error of a chat template that refuses a system message but renders its text in the
    user's (Gemma's "System role not supported"); None for a template that takes one, or that
    refuses more than the role."""
    import jinja2

    try:
        tokenizer.apply_chat_template([{"role": "system", "content": "s"},
                                       {"role": "user", "content": "u"}])
        return None
    except jinja2.TemplateError as e:
        refused = str(e)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "s\n\nu"}])
    except jinja2.TemplateError:
        return None
    return refused


def system_in_user(messages: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """`messages` (a user's first) with `system` at the start of the first user message, a
    blank line between, as llama.cpp's own Gemma template puts a system message
    (llm_chat_apply_template: Gemma has no system role)."""
    first = messages[0]
    return [{**first, "content": f"{system.strip()}\n\n{first['content']}"}, *messages[1:]]
