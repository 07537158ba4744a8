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
