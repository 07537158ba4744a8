"""toymlx's chat template environment (toymlx.data.chat_template) on the real templates llama.cpp
keeps in its source tree (`models/templates/*.jinja`, from the llama-cpp-python sdist:
llamacpp_source.py), against transformers' own renderer (`render_jinja_template`, the function
its tokenizers' `apply_chat_template` calls), and trained: the tokens that carry loss are the
assistant's text and the end-of-turn text as each template writes them.

Dates: templates that print today's date (`strftime_now`: Llama 3.2/3.3, Granite) see one
pinned day in both renderers, so a run across midnight cannot differ.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.data.chat import DataError, Example, tokenize_example
from toymlx.data.chat_template import compile_template, render_context

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is a list?"}
ANSWER1 = {"role": "assistant", "content": "A sequence."}
USER2 = {"role": "user", "content": "And a dict?"}
ANSWER2 = {"role": "assistant", "content": "A mapping."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [USER1],
    "system+user": [SYSTEM, USER1],
    "multi-turn": [SYSTEM, USER1, ANSWER1, USER2],
    "ends with assistant": [USER1, ANSWER1, USER2, ANSWER2],
}
BOS, EOS = "<BOS>", "<EOS>"
PINNED = datetime.datetime(2026, 3, 14, 15, 9, 26)


class PinnedClock(datetime.datetime):
    """`datetime.datetime` whose now() is PINNED, for both renderers' `strftime_now`."""

    @classmethod
    def now(cls, tz=None):
        return PINNED


@pytest.fixture
def pinned_clock(monkeypatch):
    import transformers.utils.chat_template_utils as hf

    monkeypatch.setattr(hf, "datetime", PinnedClock)  # it imported the class
    monkeypatch.setattr(datetime, "datetime", PinnedClock)  # toymlx imports it when rendering


@dataclass(frozen=True)
class Turn:
    """What a template writes around an assistant's text, read off the template: the
    architecture it serves, the text after the answer that ends the turn (`end`; `last_end` for
    the conversation's last turn, where it differs), and text the model writes before the answer
    (`before`; `last_before` in the last turn)."""

    arch: str
    end: str
    last_end: str | None = None
    before: str = ""
    last_before: str | None = None


EOT, IM_END, R1_END = "<|eot_id|>", "<|im_end|>\n", "<｜end▁of▁sentence｜>"
# Each template in llama.cpp's folder of an architecture toymlx loads (toymlx.gguf.llama.ARCHS).
LOADED = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": Turn("llama", EOT),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": Turn("llama", EOT),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": Turn("llama", EOT),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": Turn("llama", IM_END),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": Turn("llama", IM_END),
    "fireworks-ai-llama-3-firefunction-v2.jinja": Turn("llama", EOT),
    "meetkai-functionary-medium-v3.1.jinja": Turn("llama", EOT),
    # v3.2's generation prompt ends in ">>>": the model writes the recipient, then the answer
    "meetkai-functionary-medium-v3.2.jinja": Turn("llama", EOT, before="all\n"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": Turn("llama", R1_END),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": Turn("llama", EOS),
    "unsloth-mistral-Devstral-Small-2507.jinja": Turn("llama", EOS),
    "Bielik-11B-v3.0-Instruct.jinja": Turn("llama", IM_END),
    "Qwen-Qwen2.5-7B-Instruct.jinja": Turn("qwen2", IM_END),
    "Qwen-QwQ-32B.jinja": Turn("qwen2", IM_END),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": Turn("qwen2", R1_END),
    # an empty reasoning block in the last turn only (after the last user message)
    "Qwen-Qwen3-0.6B.jinja": Turn("qwen3", IM_END, last_before="<think>\n\n</think>\n\n"),
    "google-gemma-2-2b-it.jinja": Turn("gemma2", "<end_of_turn>\n"),
    # the EOS token after the last message when no generation prompt follows
    "microsoft-Phi-3.5-mini-instruct.jinja": Turn("phi3", "<|end|>\n", "<|end|>\n" + EOS),
    "HuggingFaceTB-SmolLM3-3B.jinja": Turn("smollm3", IM_END),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": Turn("granite", "<|end_of_text|>\n"),
    "ibm-granite-granite-4.0.jinja": Turn("granite", "<|end_of_text|>\n"),
}
VARIABLES = {"fireworks-ai-llama-3-firefunction-v2.jinja": {"functions": "[]",
                                                            "datetime": "2026-03-14"}}
"""Variables of a template's own that it cannot render without (firefunction's function list
and date): given to both renderers here; training with it is a DataError naming the variable
(toymlx passes none of a template's own)."""
TOOL_USE = {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"}
"""Hermes' `tool_use` templates (a GGUF's `tokenizer.chat_template.tool_use`) iterate `tools`
without a test: transformers raises without a list, as toymlx does; they render with TOOLS."""


def template_text(tree: Path, name: str) -> str:
    path = tree / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"{path}: not in this llama.cpp source tree")
    return path.read_text(encoding="utf-8")


def toymlx_render(source: str, messages: list[dict[str, Any]], generation_prompt: bool,
                  tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
    """toymlx's rendering, as `Tokenizer.apply_chat_template` does it."""
    extra = {"tools": tools, **variables} if tools else variables
    return compile_template(source, "test").render(
        messages=messages, add_generation_prompt=generation_prompt,
        **render_context(BOS, EOS, **extra))


def hf_render(source: str, messages: list[dict[str, Any]], generation_prompt: bool,
              tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
    """transformers' rendering, with the special tokens its tokenizer passes."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=source,
                                        add_generation_prompt=generation_prompt,
                                        bos_token=BOS, eos_token=EOS, **variables)
    return rendered[0]


def outcome(render, *args, **variables) -> str:
    """The rendering, or the error a template raises (both renderers must raise the same)."""
    try:
        return render(*args, **variables)
    except Exception as e:  # noqa: BLE001  (a template fails in many ways)
        return f"raised {type(e).__name__}: {e}"


def differences(source: str, variables: dict[str, Any] | None = None) -> list[str]:
    """Each conversation x generation prompt x tools (where the template reads them) that the
    two renderers render differently, named; `variables`: the template's own."""
    variables = variables or {}
    takes_tools = "tools" in source
    out = []
    for name, messages in CONVERSATIONS.items():
        for tools in [None, TOOLS] if takes_tools else [None]:
            for gen in (True, False):
                ours = outcome(toymlx_render, source, messages, gen, tools, **variables)
                theirs = outcome(hf_render, source, messages, gen, tools, **variables)
                if ours != theirs:
                    out.append(f"{name}, add_generation_prompt={gen}, tools={bool(tools)}: "
                               f"toymlx {ours[-200:]!r} != transformers {theirs[-200:]!r}")
    return out


@pytest.mark.parametrize("name", sorted(LOADED))
def test_templates_of_loaded_architectures_render_as_transformers(name, llamacpp_source,  # noqa: F811
                                                                  pinned_clock):
    source = template_text(llamacpp_source, name)
    variables = VARIABLES.get(name, {})
    assert differences(source, variables) == []
    # each renders a conversation (no template error hides behind two equal errors)
    tools = TOOLS if name in TOOL_USE else None
    turn = LOADED[name]
    rendered = toymlx_render(source, CONVERSATIONS["ends with assistant"], False, tools,
                             **variables)
    assert ANSWER2["content"] + (turn.last_end or turn.end) in rendered


def test_every_template_in_the_folder_renders_as_transformers(llamacpp_source,  # noqa: F811
                                                              pinned_clock):
    """The environment itself, on all of llama.cpp's templates (most of them for
    architectures toymlx does not load): the same text, or the same error, as transformers."""
    folder = llamacpp_source / "models" / "templates"
    names = sorted(p.name for p in folder.glob("*.jinja"))
    assert len(names) >= 60, f"{folder}: expected llama.cpp's templates, found {len(names)}"
    found = {n: d for n in names
             if (d := differences((folder / n).read_text("utf-8"), VARIABLES.get(n)))}
    assert found == {}


# ------------------------------------------------------------------------------- training
class TextTokenizer:
    """One id per UTF-8 byte, so the trained tokens read back as the exact text they cover; it
    renders with toymlx's environment as `Tokenizer.apply_chat_template` does."""

    eos_id, bos_id, eos_token = 256, None, EOS

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        return compile_template(self.chat_template, "test").render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **render_context(BOS, EOS, **kw))


def trained_texts(tok: TextTokenizer, example: Example, turns: str = "assistant"
                  ) -> tuple[str, list[str]]:
    """The example's text and each run of its trained tokens, as text."""
    ids, mask = tokenize_example(example, tok, True, turns)
    runs: list[list[int]] = []
    for k, (i, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            if k == 0 or not mask[k - 1]:
                runs.append([])
            runs[-1].append(i)
    return bytes(ids).decode(), [bytes(r).decode() for r in runs]


CHAT = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2]
PROMPT_ONLY = {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "<think>\n",
               "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "<think>\n</think>",
               "Qwen-QwQ-32B.jinja": "<think>\n</think>"}
"""Generation prompts that end in text the template never writes into a rendered turn
(DeepSeek-R1's `<｜Assistant｜><think>\\n`, llama.cpp's copies adding `</think>` where
`enable_thinking` is not true, against `<｜Assistant｜>` + answer in the turn): not trained."""
REFUSED = {
    "Qwen-Qwen3-0.6B.jinja": "turns",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "system",
}
"""Templates that write a turn of CHAT one way while it is the last and another once a message
follows, so training every assistant turn of CHAT is refused: Qwen3 writes an empty `<think>`
block in the last turn only ("turns": --data.train-turns last trains the last as generation
writes it); Mistral-Nemo writes the system text into the last user message, and drops it when an
assistant's turn ends the conversation ("system": refused with it, trained without it)."""


@pytest.mark.parametrize("name", sorted(set(LOADED) - set(VARIABLES)))
def test_training_trains_the_answers_and_end_of_turn_as_the_template_writes_them(
        name, llamacpp_source, pinned_clock):  # noqa: F811
    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    turn = LOADED[name]
    last_end, last_before = turn.last_end or turn.end, turn.before if turn.last_before is None \
        else turn.last_before
    tools = TOOLS if name in TOOL_USE else None
    chat = CHAT[1:] if REFUSED.get(name) == "system" else CHAT
    merged = "System role not supported" in source  # Gemma's: no system role
    rendered_as = ([{**USER1, "content": f"{SYSTEM['content']}\n\n{USER1['content']}"},
                    *CHAT[2:]] if merged else chat)
    full = hf_render(source, rendered_as, False, tools)
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tools and tuple(tools))
    if name in REFUSED:
        refused = Example("d.jsonl:1", messages=tuple(CHAT))
        with pytest.raises(DataError, match=r"messages\[2\] cannot be located; the template "
                                            r"writes it one way as the last turn"):
            trained_texts(tok, refused)
    if REFUSED.get(name) == "turns":
        text, runs = trained_texts(tok, example, "last")
        assert runs == [last_before + ANSWER2["content"] + last_end]
    else:
        text, runs = trained_texts(tok, example)
        assert runs == [turn.before + ANSWER1["content"] + turn.end,
                        last_before + ANSWER2["content"] + last_end]
    assert text == full  # toymlx's pieces make up transformers' rendering
    # the last turn trains as generation writes it: what follows the generation prompt
    prompt = hf_render(source, rendered_as[:-1], True, tools)
    assert full.endswith(runs[-1])
    assert prompt == full[:-len(runs[-1])] + PROMPT_ONLY.get(name, "")
    if "tools" in source:  # a tools list beside a one-turn chat
        example = Example("d.jsonl:2", messages=(USER1, ANSWER1), tools=tuple(TOOLS))
        text, runs = trained_texts(tok, example)
        assert text == hf_render(source, [USER1, ANSWER1], False, TOOLS)
        assert runs == [last_before + ANSWER1["content"] + last_end]


def test_a_template_needing_variables_of_its_own_is_a_one_line_error(llamacpp_source):  # noqa: F811
    name = "fireworks-ai-llama-3-firefunction-v2.jinja"
    tok = TextTokenizer(template_text(llamacpp_source, name))
    with pytest.raises(DataError, match=r"^d\.jsonl:1: chat template failed on 2 messages: "
                                        r"UndefinedError: 'functions' is undefined$"):
        trained_texts(tok, Example("d.jsonl:1", messages=(USER1, ANSWER1)))


REAL_VOCABS = {"meta-llama-Llama-3.1-8B-Instruct.jinja": "llama-bpe",
               "Qwen-Qwen2.5-7B-Instruct.jinja": "qwen2",
               "microsoft-Phi-3.5-mini-instruct.jinja": "phi-3"}
"""Templates trained again with their family's real vocabulary (llama.cpp's
models/ggml-vocab-NAME.gguf), where the end-of-turn markers are single special tokens."""


@pytest.mark.parametrize("name", sorted(REAL_VOCABS))
def test_trained_tokens_with_a_real_vocabulary_are_the_answer_and_end_of_turn(
        name, llamacpp_source):  # noqa: F811
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.data.vocab import K_TEMPLATE
    from toymlx.gguf.reader import read_metadata

    vocab = llamacpp_source / "models" / f"ggml-vocab-{REAL_VOCABS[name]}.gguf"
    meta = {**read_metadata(vocab), K_TEMPLATE: template_text(llamacpp_source, name)}
    tok = Tokenizer.from_metadata(meta, vocab)
    turn = LOADED[name]
    ids, mask = tokenize_example(Example("d.jsonl:1", messages=tuple(CHAT)), tok, True)
    trained = [[i for i, m in zip(ids[:k], mask[:k], strict=True) if m]
               for k in (ids.index(tok.encode("And", add_bos=False)[0]), len(ids))]
    # the ids of the answer and end-of-turn text, encoded alone (Phi-3's `<|end|>` takes the
    # newline after it, as llama.cpp's tokenizer strips right of it)
    first = tok.encode(ANSWER1["content"] + turn.end, add_bos=False)
    last = tok.encode(ANSWER2["content"] + (turn.last_end or turn.end).replace(EOS, tok.eos_token),
                      add_bos=False)
    assert trained == [first, first + last]
    marker = tok.encode(turn.end.strip(), add_bos=False)  # one special token, trained
    assert len(marker) == 1 and (first + last).count(marker[0]) == 2


def test_null_tool_fields_render_as_transformers_leaves_them_out(tmp_path, llamacpp_source,  # noqa: F811
                                                                 pinned_clock):
    """OpenAI's exports write `"tool_calls": null` on a plain answer and `"content": null`
    beside tool calls. transformers' apply_chat_template drops null keys; toymlx kept them, and
    Llama 3.1's template (`'tool_calls' in message`) then took the answer for a tool call and
    raised. Both now render as transformers renders the messages without those keys."""
    import json

    from toymlx.data.chat import load_examples

    source = template_text(llamacpp_source, "meta-llama-Llama-3.1-8B-Instruct.jinja")
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    written = [{**USER1}, {**ANSWER1, "tool_calls": None},
               {"role": "assistant", "content": None, "tool_calls": [call]}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": written, "tools": TOOLS}) + "\n", encoding="utf-8")
    (example,) = load_examples(path)
    meant = [USER1, ANSWER1, {"role": "assistant", "tool_calls": [call]}]
    text, runs = trained_texts(TextTokenizer(source), example)
    assert text == hf_render(source, meant, False, TOOLS)
    assert runs == [ANSWER1["content"] + EOT,
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}' + EOT]
