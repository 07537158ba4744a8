"""Chat templates: a GGUF's `tokenizer.chat_template` compiled as Hugging Face renders it
(jinja2 sandbox, trim_blocks + lstrip_blocks, loop controls, `raise_exception`, `tojson`,
`strftime_now`, the `{% generation %}` block that marks an assistant's text), once per template
text. `render_context` gives the variables Hugging Face always passes (`tools` and `documents`,
None unless given)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from toymlx.data.vocab import K_TEMPLATE, TokenizerError

_TEMPLATES: dict[str, Any] = {}
_REFUSED: dict[str, str | None] = {}
"""`system_refused`'s answer, by template text."""


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` block of Hugging Face's templates (LFM2.5,
    Laguna): it marks the assistant's text for `return_assistant_tokens_mask` and renders its
    body unchanged, which is all toymlx needs (it finds the assistant's text by rendering
    prefixes). Without it such a template is a syntax error."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            # a call block, as Hugging Face's is: a `set` inside stays inside, as there
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    return Generation


def render_context(bos_token: str, eos_token: str, **kwargs: Any) -> dict[str, Any]:
    """The variables a template renders with besides `messages` and `add_generation_prompt`:
    the special tokens, `tools` and `documents` (None unless in `kwargs`, as Hugging Face
    passes them: a template that tests `tools is not none` without `is defined` first would
    otherwise take an undefined list for a given one), and `kwargs`."""
    return {"bos_token": bos_token, "eos_token": eos_token, "tools": None, "documents": None,
            **kwargs}


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The fields a message's reasoning comes in beside its content, in transformers' order
(`_REASONING_FIELDS`): DeepSeek's API and vLLM's `reasoning_content` (Qwen3's, Qwen3.5's,
GLM's, MiniMax's templates read it), gpt-oss's `thinking` (LFM2.5's, Command A's), OpenRouter's
`reasoning` (Laguna's, Solar Open's)."""


def reasoning_aliased(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the reasoning of each that has one (its first `REASONING_FIELDS` field
    that is not null) also under `reasoning_content` and, where it has none, `thinking`: what
    transformers' render gives a template (`_alias_reasoning_fields`, 5.x), so that Qwen3's reads
    OpenRouter's `reasoning` and gpt-oss's DeepSeek's `reasoning_content`. `reasoning` itself is
    filled from neither."""
    out = []
    for m in messages:
        thought = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if thought is None else {"thinking": thought, **m,
                                              "reasoning_content": thought})
    return out


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
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _generation_extension()])
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
    refuses more than the role. Asked once per template text (it renders twice)."""
    source = tokenizer.chat_template
    if source not in _REFUSED:
        _REFUSED[source] = _system_refused(tokenizer)
    return _REFUSED[source]


def _system_refused(tokenizer) -> str | None:
    # a template fails in many ways (its raise_exception, a TypeError on a missing `tools`)
    try:
        tokenizer.apply_chat_template([{"role": "system", "content": "s"},
                                       {"role": "user", "content": "u"}])
        return None
    except Exception as e:  # noqa: BLE001
        refused = str(e)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "s\n\nu"}])
    except Exception:  # noqa: BLE001
        return None
    return refused


def system_in_user(messages: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """`messages` (a user's first) with `system` at the start of the first user message, a
    blank line between, as llama.cpp's own Gemma template puts a system message
    (llm_chat_apply_template: Gemma has no system role)."""
    first = messages[0]
    return [{**first, "content": f"{system.strip()}\n\n{first['content']}"}, *messages[1:]]
