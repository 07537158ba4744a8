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

from toymlx.data.chat import TURNS, DataError, Example, tokenize_example
from toymlx.data.chat_template import compile_template, reasoning_aliased, render_context

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
    # reasoning in each of its fields (transformers hands each on under its other names)
    "reasoning fields": [
        USER1, {**ANSWER1, "reasoning_content": "Lists hold items."}, USER2,
        {**ANSWER2, "thinking": "Maps hold pairs."}, {"role": "user", "content": "And a set?"},
        {"role": "assistant", "content": "A bag.", "reasoning": "Sets hold each item once."}],
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
    # Ministral 3 (mistral3): its reasoning system prompt where a chat has none, answers ended
    # by the EOS token, [THINK] blocks only where a message's content is a list of chunks
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": Turn("mistral3", EOS),
    "Bielik-11B-v3.0-Instruct.jinja": Turn("llama", IM_END),
    "Qwen-Qwen2.5-7B-Instruct.jinja": Turn("qwen2", IM_END),
    "Qwen-QwQ-32B.jinja": Turn("qwen2", IM_END),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": Turn("qwen2", R1_END),
    # an empty reasoning block in the last turn only (after the last user message)
    "Qwen-Qwen3-0.6B.jinja": Turn("qwen3", IM_END, last_before="<think>\n\n</think>\n\n"),
    # the generation prompt opens the reasoning block (`<think>\n`): the last turn trains the
    # rest of it, as generation writes it; an earlier turn is written without one
    "Qwen3.5-4B.jinja": Turn("qwen35", IM_END, last_before="\n</think>\n\n"),
    "google-gemma-2-2b-it.jinja": Turn("gemma2", "<end_of_turn>\n"),
    "google-gemma-4-31B-it.jinja": Turn("gemma4", "<turn|>\n"),
    "google-gemma-4-31B-it-interleaved.jinja": Turn("gemma4", "<turn|>\n"),
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
        messages=reasoning_aliased(messages), add_generation_prompt=generation_prompt,
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
            messages=reasoning_aliased(messages), add_generation_prompt=add_generation_prompt,
            **render_context(BOS, EOS, **kw))


def trained_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Each run of consecutive trained ids."""
    runs: list[list[int]] = []
    for k, (i, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            if k == 0 or not mask[k - 1]:
                runs.append([])
            runs[-1].append(i)
    return runs


def trained_texts(tok: TextTokenizer, example: Example, turns: str = "assistant"
                  ) -> tuple[str, list[str]]:
    """The example's text and each run of its trained tokens, as text."""
    ids, mask = tokenize_example(example, tok, True, turns)
    return bytes(ids).decode(), [bytes(r).decode() for r in trained_runs(ids, mask)]


CHAT = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2]
PROMPT_ONLY = {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "<think>\n",
               "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "<think>\n</think>",
               "Qwen-QwQ-32B.jinja": "<think>\n</think>",
               "google-gemma-4-31B-it.jinja": "<|channel>thought\n<channel|>",
               "google-gemma-4-31B-it-interleaved.jinja": "<|channel>thought\n<channel|>"}
"""Generation prompts that end in text the template never writes into a rendered turn
(DeepSeek-R1's `<｜Assistant｜><think>\\n`, llama.cpp's copies adding `</think>` where
`enable_thinking` is not true, Gemma 4's empty thought channel where it is not, against
`<｜Assistant｜>` / `<|turn>model\\n` + answer in the turn): not trained."""
NEMO = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
SYSTEM_IN_LAST_PROMPT = {NEMO}
"""Templates that leave a system message out of a conversation ending in an assistant's turn:
Mistral-Nemo writes the system text into the last message only when that is a user's, so it is
in the last turn's generation prompt alone. A conversation trains as the model meets its last
turn: that prompt, as transformers renders it, then the turn as the whole render writes it; the
earlier turns as both write them (without the system text, which the model never sees there)."""
REWRITTEN = {"Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", NEMO}
"""Templates that write an assistant turn one way while it is the last and another once a user
message follows (Qwen3: an empty `<think>` block in the last turn only; Qwen3.5: a `<think>`
block; Mistral-Nemo: the system text before the last user message), so an earlier turn
trains as the whole conversation writes it (`_history_span`): `Turn.before` + text + `Turn.end`,
no `last_before`."""


def rendered_as_trained(source: str, name: str, chat: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None, last: str) -> str:
    """transformers' rendering of `chat` as toymlx trains it: the whole conversation; with
    SYSTEM_IN_LAST_PROMPT's template, the last turn's prompt, then `last` (the turn as
    trained)."""
    if name in SYSTEM_IN_LAST_PROMPT:
        return hf_render(source, chat[:-1], True, tools) + last
    return hf_render(source, chat, False, tools)


@pytest.mark.parametrize("name", sorted(set(LOADED) - set(VARIABLES)))
def test_training_trains_the_answers_and_end_of_turn_as_the_template_writes_them(
        name, llamacpp_source, pinned_clock):  # noqa: F811
    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    turn = LOADED[name]
    last_end, last_before = turn.last_end or turn.end, turn.before if turn.last_before is None \
        else turn.last_before
    tools = TOOLS if name in TOOL_USE else None
    merged = "System role not supported" in source  # Gemma's: no system role
    rendered_as = ([{**USER1, "content": f"{SYSTEM['content']}\n\n{USER1['content']}"},
                    *CHAT[2:]] if merged else CHAT)
    example = Example("d.jsonl:1", messages=tuple(CHAT), tools=tools and tuple(tools))
    text, runs = trained_texts(tok, example)
    assert runs == [turn.before + ANSWER1["content"] + turn.end,
                    last_before + ANSWER2["content"] + last_end]
    full = rendered_as_trained(source, name, rendered_as, tools, runs[-1])
    assert text == full  # toymlx's pieces make up transformers' rendering
    assert SYSTEM["content"] in full
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
                                        r"UndefinedError: 'functions' is undefined; a variable "
                                        r"of the template's own, which toymlx passes none of "
                                        r"\(.*firefunction-v2's reads `functions` and `datetime`"
                                        r", which its callers pass per call\): use a base whose "
                                        r"template renders from those alone$"):
        trained_texts(tok, Example("d.jsonl:1", messages=(USER1, ANSWER1)))


REAL_VOCABS = {"meta-llama-Llama-3.1-8B-Instruct.jinja": "llama-bpe",
               "Qwen-Qwen2.5-7B-Instruct.jinja": "qwen2",
               "microsoft-Phi-3.5-mini-instruct.jinja": "phi-3",
               "google-gemma-4-31B-it.jinja": "gemma-4",
               "google-gemma-4-31B-it-interleaved.jinja": "gemma-4"}
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


# ------------------------------------------------------------- turns the history rewrites
USER3 = {"role": "user", "content": "And a set?"}
ANSWER3 = {"role": "assistant", "content": "A bag."}
CHAT3 = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2, USER3, ANSWER3]


def trained_spans(tok: TextTokenizer, example: Example, turns: str = "assistant"
                  ) -> tuple[str, list[tuple[int, str]]]:
    """The example's text and each run of its trained tokens as (character offset, text)."""
    text, runs = trained_texts(tok, example, turns)
    ids, mask = tokenize_example(example, tok, True, turns)
    starts = [k for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1])]
    return text, [(len(bytes(ids[:k]).decode()), r) for k, r in zip(starts, runs, strict=True)]


def untrained(text: str, spans: list[tuple[int, str]]) -> list[str]:
    """The text around the trained runs `spans` (`trained_spans`'s), in order."""
    cuts = [0] + [c for at, r in spans for c in (at, at + len(r))] + [len(text)]
    return [text[a:b] for a, b in zip(cuts[::2], cuts[1::2], strict=True)]


@pytest.mark.parametrize("name", sorted(set(LOADED) - set(VARIABLES)))
def test_three_turns_train_each_answer_where_the_whole_render_writes_it(
        name, llamacpp_source, pinned_clock, monkeypatch):  # noqa: F811
    """Every assistant turn of a 3-turn chat trains its text and end of turn, between the user
    messages around it, and nothing else. The templates whose prefix renders locate every turn
    (all but REWRITTEN) never reach `_history_span`: their masks are those of the prefix rule
    alone, as before it was added."""
    import toymlx.data.chat as chat_module

    source = template_text(llamacpp_source, name)
    tok, turn = TextTokenizer(source), LOADED[name]
    last_end = turn.last_end or turn.end
    last_before = turn.before if turn.last_before is None else turn.last_before
    tools = TOOLS if name in TOOL_USE else None
    rendered_as = ([{**USER1, "content": f"{SYSTEM['content']}\n\n{USER1['content']}"},
                    *CHAT3[2:]] if "System role not supported" in source else CHAT3)
    if name not in REWRITTEN:
        def unreached(*args, **kwargs):
            raise AssertionError("_history_span reached")
        monkeypatch.setattr(chat_module, "_history_span", unreached)
    example = Example("d.jsonl:1", messages=tuple(CHAT3), tools=tools and tuple(tools))
    text, spans = trained_spans(tok, example)
    assert text == rendered_as_trained(source, name, rendered_as, tools, spans[-1][1])
    answers = [ANSWER1, ANSWER2, ANSWER3]
    assert [r for _, r in spans] == [turn.before + a["content"] + turn.end for a in answers[:2]
                                     ] + [last_before + ANSWER3["content"] + last_end]
    users = [text.index(u["content"]) for u in (USER1, USER2, USER3)] + [len(text)]
    for k, (at, run) in enumerate(spans):  # the k-th answer's, after the k-th user's message
        assert users[k] < at and at + len(run) <= users[k + 1]
        assert text.index(answers[k]["content"], users[k]) == at + len(turn.before if k < 2
                                                                       else last_before)
    # --data.train-turns last: the last turn only, as generation writes it
    assert [r for _, r in trained_spans(tok, example, "last")[1]] == [
        last_before + ANSWER3["content"] + last_end]


QWEN3 = "Qwen-Qwen3-0.6B.jinja"


def test_qwen3_trains_earlier_turns_as_the_history_writes_them(llamacpp_source):  # noqa: F811
    """Qwen3 writes an empty `<think>` block before the last turn only (after the last user
    message): the earlier answers train without it, as the conversation's render writes them
    (what Unsloth's train_on_responses_only and TRL's assistant masks train), the last with it;
    the untrained text is the render's headers and user messages."""
    tok = TextTokenizer(template_text(llamacpp_source, QWEN3))
    text, spans = trained_spans(tok, Example("d.jsonl:1", messages=tuple(CHAT3)))
    assert [r for _, r in spans] == ["A sequence.<|im_end|>\n", "A mapping.<|im_end|>\n",
                                     "<think>\n\n</think>\n\nA bag.<|im_end|>\n"]
    assert untrained(text, spans) == [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is a list?"
         "<|im_end|>\n<|im_start|>assistant\n"),
        "<|im_start|>user\nAnd a dict?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nAnd a set?<|im_end|>\n<|im_start|>assistant\n", ""]
    assert trained_texts(tok, Example("d.jsonl:1", messages=tuple(CHAT3)), "last")[1] == [
        "<think>\n\n</think>\n\nA bag.<|im_end|>\n"]


WEATHER_CALL = {"type": "function", "function": {"name": "get_weather",
                                                "arguments": {"city": "Paris"}}}
TOOL_CHAT = [USER1, {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
             {"role": "tool", "name": "get_weather", "content": "Sunny"}, ANSWER1]
"""An agent's turn that only calls a tool, the tool's answer, the final answer."""


def test_qwen3_tool_call_turn_trains_the_call_as_the_history_writes_it(llamacpp_source,  # noqa: F811
                                                                       pinned_clock):
    """An agent's turn that only calls a tool (no content) before the tool's answer and the
    final answer: Qwen3 writes it with a `<think>` block when last, without once the tool
    answers; the call and its end train as the history writes them."""
    source = template_text(llamacpp_source, QWEN3)
    chat = TOOL_CHAT
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS))
    text, runs = trained_texts(TextTokenizer(source), example)
    assert text == hf_render(source, chat, False, TOOLS)
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert runs == [f"<tool_call>\n{call_text}\n</tool_call><|im_end|>\n",
                    "<think>\n\n</think>\n\nA sequence.<|im_end|>\n"]


THOUGHT = {"role": "assistant", "content": "<think>\nLists hold items.\n</think>\n\nA sequence."}
R1_QWEN, R1_LLAMA = ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                     "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")
QWEN35 = "Qwen3.5-4B.jinja"
THOUGHT_DROPPED = {
    QWEN3: ["A sequence.<|im_end|>\n", "<think>\n\n</think>\n\nA mapping.<|im_end|>\n"],
    QWEN35: ["A sequence.<|im_end|>\n", "\n</think>\n\nA mapping.<|im_end|>\n"],
    "Qwen-QwQ-32B.jinja": ["A sequence.<|im_end|>\n", "A mapping.<|im_end|>\n"],
    # R1 keeps what follows `</think>` as it is: the blank line before the answer
    R1_QWEN: ["\n\nA sequence.<｜end▁of▁sentence｜>", "A mapping.<｜end▁of▁sentence｜>"],
    R1_LLAMA: ["\n\nA sequence.<｜end▁of▁sentence｜>", "A mapping.<｜end▁of▁sentence｜>"],
}
"""The trained runs of [USER1, THOUGHT, USER2, ANSWER2]: the earlier turn as the conversation's
render writes it, its reasoning dropped by the template, the last as generation writes it."""


def unwritten(i: int) -> str:
    """The start of the error for assistant turn `messages[i]`, whose content the template
    writes nowhere (a pattern)."""
    return (rf"^d\.jsonl:1: chat template writes assistant turn messages\[{i}\] without part "
            r"of its content \(it is nowhere in the turn's own render: .*\), so the turn cannot "
            r"be trained as written; remove that part of the content, ")


@pytest.mark.parametrize("name", sorted(THOUGHT_DROPPED))
def test_an_earlier_turn_whose_reasoning_the_template_drops_trains_its_answer_and_says_so(
        name, llamacpp_source):  # noqa: F811
    """An earlier assistant turn whose content holds `<think>` reasoning, on a template that
    drops it once a user message follows: the model meets that turn at inference as the render
    writes it (the answer alone), so it trains so, found by position; the dropped reasoning is
    counted in the split's note, under mask_prompt (every turn) and without it (the whole
    render, which drops it as mlx-lm's does), not under --data.train-turns last (not trained)."""
    from toymlx.data.chat import fitted_rows

    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    chat = [USER1, THOUGHT, USER2, ANSWER2]
    example = Example("d.jsonl:1", messages=tuple(chat))
    text, runs = trained_texts(tok, example)
    assert text == hf_render(source, chat, False)
    assert runs == THOUGHT_DROPPED[name]
    assert "Lists hold items." not in text
    for mask_prompt, turns, thoughts in ((True, "assistant", 1), (False, "assistant", 1),
                                         (True, "last", 0)):
        fit = fitted_rows([example] * 2, tok, 512, mask_prompt, False, turns)[1]
        assert fit.thoughts == 2 * thoughts
    assert fit.note("d.jsonl", "train", 512) is None
    fit = fitted_rows([example] * 2, tok, 512)[1]
    assert fit.note("d.jsonl", "train", 512) == (
        "d.jsonl: train: of 2 examples, 2 assistant turns with reasoning (<think>...</think>, "
        "<|channel>...<channel|>) the chat template leaves out of the conversation it renders, "
        "as the model meets those turns at inference, so only their answers train; "
        "--data.train-turns last trains only each final turn, as generation writes it")


@pytest.mark.parametrize("name", sorted(THOUGHT_DROPPED))
def test_a_last_turn_with_reasoning_trains_it_where_the_template_writes_it(
        name, llamacpp_source):  # noqa: F811
    """The last turn's reasoning: Qwen3, Qwen3.5 and QwQ write it in the last turn, which
    trains it as generation writes it (Qwen3.5's prompt holds the `<think>\n`); DeepSeek-R1's
    drop it from every turn, so training it is a one-line error (mask_prompt=False trains the
    whole render without it, counted)."""
    from toymlx.data.chat import fitted_rows

    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    chat = [USER1, ANSWER1, USER2, THOUGHT]
    example = Example("d.jsonl:1", messages=tuple(chat))
    if name in (R1_QWEN, R1_LLAMA):
        for turns in ("assistant", "last"):
            with pytest.raises(DataError, match=unwritten(3) + r"or set --data\.no-mask-prompt "
                                                r"to train on the whole conversation as the "
                                                r"template renders it$"):
                trained_texts(tok, example, turns)
        assert fitted_rows([example], tok, 512, False)[1].thoughts == 1
        return
    text, runs = trained_texts(tok, example)
    assert text == hf_render(source, chat, False)
    thought = {QWEN35: "Lists hold items.\n</think>\n\nA sequence.<|im_end|>\n"}.get(
        name, "<think>\nLists hold items.\n</think>\n\nA sequence.<|im_end|>\n")
    assert runs == ["A sequence.<|im_end|>\n", thought]
    assert text.endswith(thought)
    assert hf_render(source, chat[:-1], True) == text[:-len(thought)] + PROMPT_ONLY.get(name, "")
    assert fitted_rows([example], tok, 512)[1].thoughts == 0


FIELD = {"role": "assistant", "content": "A sequence.", "reasoning_content": "Lists hold items."}
"""THOUGHT with its reasoning in DeepSeek's API field (`reasoning_content`), not its content."""


def in_content(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat` with FIELD written as THOUGHT (its reasoning as `<think>` in the content)."""
    return [THOUGHT if m is FIELD else m for m in chat]


@pytest.mark.parametrize("name", sorted(THOUGHT_DROPPED))
def test_reasoning_in_a_field_trains_as_the_template_writes_it(name, llamacpp_source):  # noqa: F811
    """Reasoning in `reasoning_content` reaches the template as transformers hands it the
    message. Qwen3 and Qwen3.5 read it: an earlier turn's and the last turn's train exactly as
    the same reasoning in `<think>` in the content does (the render the same, found by position
    with the mark standing for both), the earlier one counted as dropped; the last trains its
    thought, pinned. QwQ and DeepSeek-R1 read no field: the render is that of the answer alone,
    trained so, and the field is counted as never written (not refused: transformers and mlx-lm
    train so)."""
    from toymlx.data.chat import fitted_rows

    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    last = {QWEN3: "<think>\nLists hold items.\n</think>\n\nA sequence.<|im_end|>\n",
            QWEN35: "Lists hold items.\n</think>\n\nA sequence.<|im_end|>\n"}
    for chat in ([USER1, FIELD, USER2, ANSWER2], [USER1, ANSWER1, USER2, FIELD]):
        field = Example("d.jsonl:1", messages=tuple(chat))
        text, runs = trained_texts(tok, field)
        assert text == hf_render(source, chat, False)
        fit = fitted_rows([field], tok, 512)[1]
        if name in last:
            think = Example("d.jsonl:1", messages=tuple(in_content(chat)))
            assert (text, runs) == trained_texts(tok, think)
            assert (fit.thoughts, fit.unread) == (int(chat[1] is FIELD), {})
            assert fitted_rows([think], tok, 512)[1].thoughts == fit.thoughts
            if chat[-1] is FIELD:
                assert runs == ["A sequence.<|im_end|>\n", last[name]]
            continue
        plain = [ANSWER1 if m is FIELD else m for m in chat]
        assert (text, runs) == trained_texts(tok, Example("d.jsonl:1", messages=tuple(plain)))
        assert "Lists hold items." not in text
        assert (fit.thoughts, fit.unread) == (0, {"reasoning_content": 1})


def test_a_reasoning_field_the_template_never_writes_is_counted_or_refused(llamacpp_source):  # noqa: F811
    """A reasoning field no render writes: Llama 3.1's template reads none, so the answers
    train as without it and the split's note counts the messages, naming the field and the
    template by the model's name. Qwen3's reads `reasoning_content`, which transformers fills
    from OpenRouter's `reasoning` too: trained as that field is. Solar Open's reads only
    `reasoning`, which transformers fills from no other: DeepSeek's `reasoning_content` there
    would train every turn without its thought, a one-line error naming the field to rename it
    to."""
    from toymlx.data.chat import fitted_rows

    class Named(TextTokenizer):
        name = "Llama 3.1 8B Instruct"

    llama = Named(template_text(llamacpp_source, "meta-llama-Llama-3.1-8B-Instruct.jinja"))
    chat = [USER1, FIELD, USER2, {**ANSWER2, "reasoning": "Maps hold pairs."}]
    example = Example("d.jsonl:1", messages=tuple(chat))
    plain = Example("d.jsonl:1", messages=(USER1, ANSWER1, USER2, ANSWER2))
    assert tokenize_example(example, llama, True) == tokenize_example(plain, llama, True)
    fit = fitted_rows([example] * 3, llama, 512, False)[1]
    assert fit.unread == {"reasoning_content": 3, "reasoning": 3}
    assert fit.note("d.jsonl", "train", 512) == (
        "d.jsonl: train: of 3 examples, 6 messages with a reasoning_content or reasoning field "
        "Llama 3.1 8B Instruct's chat template never writes, so that reasoning is not trained "
        "(as transformers and mlx-lm leave it out)")

    qwen3 = TextTokenizer(template_text(llamacpp_source, QWEN3))
    renamed = [{**USER1}, {"role": "assistant", "content": "A sequence.",
                           "reasoning": "Lists hold items."}]
    assert trained_texts(qwen3, Example("d.jsonl:1", messages=tuple(renamed))) == \
        trained_texts(qwen3, Example("d.jsonl:1", messages=(USER1, FIELD)))
    assert fitted_rows([Example("d.jsonl:1", messages=tuple(renamed))], qwen3, 512)[1].unread == {}

    solar = TextTokenizer(template_text(llamacpp_source, "upstage-Solar-Open-100B.jinja"))
    with pytest.raises(DataError) as err:
        fitted_rows([Example("d.jsonl:1", messages=(USER1, FIELD))], solar, 512)
    assert str(err.value) == (
        "d.jsonl:1: messages[1].reasoning_content: expected the field this chat template reads "
        "the reasoning from, reasoning, found reasoning_content, which it never writes (the "
        "turn would train without its thought); rename the field reasoning")


def test_mistral_nemo_with_tools_trains_turns_its_tool_list_moves(llamacpp_source):  # noqa: F811
    """Mistral-Nemo writes the tool list before the last user message, so an earlier turn's
    prefix render has it where the conversation's has not; its header is empty, and each
    answer trains where it and the EOS after it follow the previous one."""
    name = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    source = template_text(llamacpp_source, name)
    example = Example("d.jsonl:1", messages=tuple(CHAT3[1:]), tools=tuple(TOOLS))
    text, spans = trained_spans(TextTokenizer(source), example)
    assert text == hf_render(source, CHAT3[1:], False, TOOLS)
    assert [r for _, r in spans] == ["A sequence.<EOS>", "A mapping.<EOS>", "A bag.<EOS>"]
    assert [text[:at][-7:] for at, _ in spans] == ["[/INST]"] * 3
    assert text.index("[AVAILABLE_TOOLS]") > spans[1][0]  # before the last user message only


def test_qwen3_trained_tokens_with_its_real_vocabulary(llamacpp_source):  # noqa: F811
    """Qwen3's template with Qwen's vocabulary (llama.cpp's models/ggml-vocab-qwen2.gguf, the
    one Qwen3's GGUFs carry): each run of trained ids is its answer and `<|im_end|>\\n` encoded
    alone, `<|im_end|>` one special token, the ids of the whole render those of the text."""
    from toymlx.data.chat import fitted_rows
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.data.vocab import K_TEMPLATE
    from toymlx.gguf.reader import read_metadata

    vocab = llamacpp_source / "models" / "ggml-vocab-qwen2.gguf"
    meta = {**read_metadata(vocab), K_TEMPLATE: template_text(llamacpp_source, QWEN3)}
    tok = Tokenizer.from_metadata(meta, vocab)
    ids, mask = tokenize_example(Example("d.jsonl:1", messages=tuple(CHAT3)), tok, True)
    runs = trained_runs(ids, mask)
    assert runs == [tok.encode(t, add_bos=False) for t in (
        "A sequence.<|im_end|>\n", "A mapping.<|im_end|>\n",
        "<think>\n\n</think>\n\nA bag.<|im_end|>\n")]
    assert ids == tok.encode(tok.apply_chat_template(list(CHAT3), False), add_bos=False)
    (im_end,) = tok.encode("<|im_end|>", add_bos=False)
    assert [run.count(im_end) for run in runs] == [1, 1, 1]
    # reasoning in DeepSeek's field: the ids and mask of the same reasoning in the content;
    # the earlier turn's dropped, the last turn's trained where the template writes it
    maps = {"role": "assistant", "content": "A mapping.", "reasoning_content": "Maps hold pairs."}
    field = Example("d.jsonl:1", messages=(USER1, FIELD, USER2, maps))
    think = Example("d.jsonl:1", messages=(USER1, THOUGHT, USER2, {
        "role": "assistant", "content": "<think>\nMaps hold pairs.\n</think>\n\nA mapping."}))
    ids, mask = tokenize_example(field, tok, True)
    assert (ids, mask) == tokenize_example(think, tok, True)
    assert trained_runs(ids, mask) == [tok.encode(t, add_bos=False) for t in (
        "A sequence.<|im_end|>\n", "<think>\nMaps hold pairs.\n</think>\n\nA mapping.<|im_end|>\n")]
    # QwQ's template reads no field: the note names it by the file's general.name
    qwq_template = template_text(llamacpp_source, "Qwen-QwQ-32B.jinja")
    qwq = Tokenizer.from_metadata({**meta, K_TEMPLATE: qwq_template}, vocab)
    assert fitted_rows([field], qwq, 512)[1].note("d.jsonl", "train", 512) == (
        "d.jsonl: train: of 1 example, 2 messages with a reasoning_content field qwen2's chat "
        "template never writes, so that reasoning is not trained (as transformers and mlx-lm "
        "leave it out)")


def test_mistral_nemo_with_a_system_message_trains_as_its_last_turns_prompt_meets_it(
        llamacpp_source):  # noqa: F811
    """Mistral-Nemo writes the system text before the last user message, and only where that
    is the last message: the whole render of a chat ending in an answer has none. Each answer
    trains as the model meets it at inference: the earlier ones in the history, without the
    system text; the last after its generation prompt, which holds it."""
    source = template_text(llamacpp_source, NEMO)
    tok = TextTokenizer(source)
    text, spans = trained_spans(tok, Example("d.jsonl:1", messages=tuple(CHAT3)))
    assert text == ("<BOS>[INST]What is a list?[/INST]A sequence.<EOS>[INST]And a dict?[/INST]"
                    "A mapping.<EOS>[INST]You are terse.\n\nAnd a set?[/INST]A bag.<EOS>")
    assert text == hf_render(source, CHAT3[:-1], True) + "A bag.<EOS>"
    assert spans == [(33, "A sequence.<EOS>"), (73, "A mapping.<EOS>"), (127, "A bag.<EOS>")]
    assert trained_spans(tok, Example("d.jsonl:1", messages=tuple(CHAT3)), "last")[1] == [
        (127, "A bag.<EOS>")]
    ids, mask = tokenize_example(Example("d.jsonl:1", messages=tuple(CHAT3)), tok, False)
    assert bytes(ids).decode() == text and all(mask)
    # a last answer after a tool's result: the template writes the system text nowhere
    call = {"id": "abcdefghi", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chat = [SYSTEM, USER1, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "abcdefghi",
             "content": "Sunny"}, ANSWER1]
    assert SYSTEM["content"] not in hf_render(source, chat[:-1], True, TOOLS)
    with pytest.raises(DataError, match=r"^d\.jsonl:1: chat template leaves the system message "
                                        r"messages\[0\] out of the conversation's render and of "
                                        r"the last turn's prompt, so the model would train "
                                        r"without it; .*: move it to the start of the first "
                                        r"user message$"):
        trained_texts(tok, Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS)))


MISTRAL_TOOLS = {
    NEMO: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
          '"id": "abcdefghi"}]<EOS>',
    "unsloth-mistral-Devstral-Small-2507.jinja": '[TOOL_CALLS]get_weather[ARGS]{"city": '
                                                 '"Paris"}<EOS>',
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": '[TOOL_CALLS]get_weather[CALL_ID]abcdefghi'
                                                 '[ARGS]{"city": "Paris"}<EOS>',
}
"""Each Mistral template's tool-call turn as trained: written from `tool_calls` alone."""


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("name", sorted(MISTRAL_TOOLS))
def test_mistral_tool_call_turns_before_a_later_question_train_after_the_message_before(
        name, system, llamacpp_source, pinned_clock):  # noqa: F811
    """A tool-call turn, its result, an answer, then another question and answer, on the
    Mistral templates (Nemo's and Mistral-Small-3.2's tool list and system text move to the
    last user message): the tool-call turn never writes its content, so it is located after
    the message before it, by position; every turn trains as the template writes it, and the
    pieces make up transformers' rendering (Nemo's with a system message: the last turn's
    prompt and the last turn). This failed before with the tool list on Nemo and Small-3.2."""
    source = template_text(llamacpp_source, name)
    call = {"id": "abcdefghi", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chat = [*([SYSTEM] if system else []), USER1,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "tool_call_id": "abcdefghi",
             "content": "Sunny"}, ANSWER1, USER2, ANSWER2]
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS))
    text, spans = trained_spans(TextTokenizer(source), example)
    runs = [MISTRAL_TOOLS[name], "A sequence.<EOS>", "A mapping.<EOS>"]
    assert [r for _, r in spans] == runs
    assert text == rendered_as_trained(source, name if system else "", chat, TOOLS, runs[-1])
    results = text.index("Sunny")
    assert spans[0][0] + len(runs[0]) <= results < spans[1][0]


def test_an_answer_a_user_message_quotes_trains_where_the_render_writes_the_turn(
        llamacpp_source):  # noqa: F811
    """Mistral-Nemo's assistant turn has no header and its tool list moves, so an earlier turn
    was found by searching the render for its answer and EOS after the previous turn: a user
    message quoting them ("Say A sequence.<EOS> back.") took the turn's place, and its text
    trained instead of the answer (span at 15, inside the user message). Turns are now found
    by position."""
    source = template_text(llamacpp_source, NEMO)
    quoting = {"role": "user", "content": "Say A sequence.<EOS> back."}
    chat = [quoting, ANSWER1, USER2, ANSWER2, USER3, ANSWER3]
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS))
    text, spans = trained_spans(TextTokenizer(source), example)
    assert text == hf_render(source, chat, False, TOOLS)
    assert text.startswith("<BOS>[INST]Say A sequence.<EOS> back.[/INST]A sequence.<EOS>")
    assert spans[0][0] == 44
    assert [r for _, r in spans] == ["A sequence.<EOS>", "A mapping.<EOS>", "A bag.<EOS>"]
    assert [text[:at][-7:] for at, _ in spans] == ["[/INST]"] * 3


def test_qwen35_trains_earlier_turns_as_the_history_writes_them_with_its_real_vocabulary(
        llamacpp_source, pinned_clock):  # noqa: F811
    """Qwen3.5's generation prompt opens the reasoning block (`<|im_start|>assistant\\n<think>\\n`)
    and its last turn writes one (empty without reasoning), an earlier turn none: the earlier
    answers train as the conversation's render writes them, the last as generation goes on
    after the prompt. With Qwen3.5's vocabulary (llama.cpp's models/ggml-vocab-qwen35.gguf) each
    run of trained ids is its text encoded alone, `<|im_end|>` one special token a run, and the
    ids those of transformers' generation prompt for the last turn and of the turn; the same
    with a tools list and a tool-call turn."""
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.data.vocab import K_TEMPLATE
    from toymlx.gguf.reader import read_metadata

    source = template_text(llamacpp_source, QWEN35)
    text, spans = trained_spans(TextTokenizer(source), Example("d.jsonl:1", messages=tuple(CHAT3)))
    assert text == hf_render(source, CHAT3, False)
    runs = ["A sequence.<|im_end|>\n", "A mapping.<|im_end|>\n", "\n</think>\n\nA bag.<|im_end|>\n"]
    assert [r for _, r in spans] == runs
    assert untrained(text, spans) == [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is a list?"
         "<|im_end|>\n<|im_start|>assistant\n"),
        "<|im_start|>user\nAnd a dict?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nAnd a set?<|im_end|>\n<|im_start|>assistant\n<think>\n", ""]

    vocab = llamacpp_source / "models" / "ggml-vocab-qwen35.gguf"
    meta = {**read_metadata(vocab), K_TEMPLATE: source}
    tok = Tokenizer.from_metadata(meta, vocab)
    (im_end,) = tok.encode("<|im_end|>", add_bos=False)
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    tool_chat = [SYSTEM, USER1, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "name": "get_weather", "content": "Sunny"}, ANSWER1,
                 USER2, ANSWER2]
    call_text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</tool_call><|im_end|>\n")
    for chat, tools, texts in (
            (CHAT3, None, runs),
            (tool_chat, TOOLS, [call_text, "A sequence.<|im_end|>\n",
                                "\n</think>\n\nA mapping.<|im_end|>\n"])):
        example = Example("d.jsonl:1", messages=tuple(chat), tools=tools and tuple(tools))
        ids, mask = tokenize_example(example, tok, True)
        trained = trained_runs(ids, mask)
        assert trained == [tok.encode(t, add_bos=False) for t in texts]
        # the ids of transformers' generation prompt for the last turn, then of the turn: the
        # prompt ends "<think>\n" and the turn starts "\n</think>", which the whole text's
        # BPE would merge into one "\n\n" token the model never meets after that prompt
        prompt = hf_render(source, chat[:-1], True, tools)
        assert ids == tok.encode(prompt, add_bos=False) + tok.encode(texts[-1], add_bos=False)
        assert hf_render(source, chat, False, tools) == prompt + texts[-1]
        assert [run.count(im_end) for run in trained] == [1, 1, 1]
    # reasoning in DeepSeek's field: the ids and mask of the same reasoning in the content,
    # the last turn's thought trained after the prompt's `<think>\n`, as generation writes it
    maps = {"role": "assistant", "content": "A mapping.", "reasoning_content": "Maps hold pairs."}
    chat = [USER1, FIELD, USER2, maps]
    think = [USER1, THOUGHT, USER2, {
        "role": "assistant", "content": "<think>\nMaps hold pairs.\n</think>\n\nA mapping."}]
    ids, mask = tokenize_example(Example("d.jsonl:1", messages=tuple(chat)), tok, True)
    assert (ids, mask) == tokenize_example(Example("d.jsonl:1", messages=tuple(think)), tok, True)
    last = "Maps hold pairs.\n</think>\n\nA mapping.<|im_end|>\n"
    assert trained_runs(ids, mask) == [tok.encode(t, add_bos=False)
                                       for t in ("A sequence.<|im_end|>\n", last)]
    assert ids == tok.encode(hf_render(source, chat[:-1], True), add_bos=False) + \
        tok.encode(last, add_bos=False)


# ------------------------------------------------------------------------------- Gemma 4
GEMMA4 = ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"]


def gemma4_tokenizer(tree: Path, name: str):
    """llama.cpp's Gemma 4 vocabulary (models/ggml-vocab-gemma-4.gguf) with template `name`."""
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.data.vocab import K_TEMPLATE
    from toymlx.gguf.reader import read_metadata

    vocab = tree / "models" / "ggml-vocab-gemma-4.gguf"
    return Tokenizer.from_metadata({**read_metadata(vocab), K_TEMPLATE: template_text(tree, name)},
                                   vocab)


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_trains_each_answer_trimmed_as_its_template_writes_it(name, llamacpp_source):  # noqa: F811
    """Gemma 4 writes an answer trimmed (`strip_thinking(...) | trim`) and its generation prompt
    goes on past the turn's header (`<|turn>model\\n<|channel>thought\\n<channel|>`), so an
    answer with spaces or newlines around it was found in neither prefix render and refused.
    With its real vocabulary: each run of trained ids is the trimmed answer and `<turn|>\\n`
    encoded alone, `<turn|>` one special token, the ids of the whole those of the render (as
    transformers renders it); the empty thought channel is in no trained run."""
    tok = gemma4_tokenizer(llamacpp_source, name)
    padded = [SYSTEM, USER1, {**ANSWER1, "content": "  A sequence.\n"}, USER2,
              {**ANSWER2, "content": "\nA mapping.  "}, USER3, ANSWER3]
    full = hf_render(tok.chat_template, padded, False).replace(BOS, "<bos>")
    assert tok.apply_chat_template(padded, False) == full
    assert full.startswith("<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\n")
    for turns, answers in (("assistant", ("A sequence.", "A mapping.", "A bag.")),
                           ("last", ("A bag.",))):
        ids, mask = tokenize_example(Example("d.jsonl:1", messages=tuple(padded)), tok, True,
                                     turns)
        assert ids == tok.encode(full, add_bos=False) and ids[0] == tok.bos_id
        runs = trained_runs(ids, mask)
        assert runs == [tok.encode(a + "<turn|>\n", add_bos=False) for a in answers]
        assert [run.count(106) for run in runs] == [1] * len(answers)  # <turn|>: one token
        assert 100 not in ids  # <|channel>: only the generation prompt writes it


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_thought_in_the_last_answer_is_refused_in_an_earlier_one_not_trained(name, llamacpp_source):  # noqa: F811
    """Gemma 4's template strips a `<|channel>...<channel|>` thought from every answer, the last
    too, so a last answer holding one cannot be trained as written: refused in one line, in
    both --data.train-turns modes. An earlier answer's trains as the render writes it, as the
    model meets it at inference (the answer alone), counted in the split's note."""
    from toymlx.data.chat import fitted_rows

    tok = TextTokenizer(template_text(llamacpp_source, name))
    thought = {**ANSWER1, "content": "<|channel>thought\nLists hold items.<channel|>A sequence."}
    last_only = r"or set --data\.no-mask-prompt to train on the whole conversation as the " \
                r"template renders it$"
    for turns in TURNS:
        with pytest.raises(DataError, match=unwritten(4) + last_only):
            trained_texts(tok, Example("d.jsonl:1", messages=(*CHAT[:3], USER2, thought)), turns)
    example = Example("d.jsonl:1", messages=(USER1, thought, USER2, ANSWER2))
    text, runs = trained_texts(tok, example)
    assert text == hf_render(tok.chat_template, list(example.messages), False)
    assert runs == ["A sequence.<turn|>\n", "A mapping.<turn|>\n"]
    assert fitted_rows([example], tok, 512)[1].thoughts == 1
    assert trained_texts(tok, example, "last")[1] == ["A mapping.<turn|>\n"]
    # the template's own thought-stripping, as transformers renders it
    assert "Lists hold items" not in hf_render(tok.chat_template, list(example.messages), False)


GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_tool_call_turn_trains_the_call_as_the_template_ends_it(name, llamacpp_source,  # noqa: F811
                                                                      pinned_clock):
    """A turn that only calls a tool, the tool's answer, the final answer. Gemma 4's generation
    prompt and the call share `<|` after `<|turn>model\\n` (`<|channel>`, `<|tool_call>`): the
    call trains whole, from the header a plain answer has. It ends as the template ends it when
    last: `<|tool_response>` (an end-of-generation token, where the tool's answer goes in) in
    the 31B template, `<turn|>\\n` in the interleaved one; the tool's answer is not trained. A
    call beside text the 31B template writes after the tool's answer is refused in one line."""
    source = template_text(llamacpp_source, name)
    chat = TOOL_CHAT
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS))
    text, runs = trained_texts(TextTokenizer(source), example)
    assert text == hf_render(source, chat, False, TOOLS)
    interleaved = name.endswith("-interleaved.jinja")
    call_end = "<turn|>\n" if interleaved else "<|tool_response>"
    assert runs == [GEMMA4_CALL + call_end, "A sequence.<turn|>\n"]
    tok = gemma4_tokenizer(llamacpp_source, name)
    ids, mask = tokenize_example(example, tok, True)
    trained = trained_runs(ids, mask)
    assert trained == [tok.encode(r, add_bos=False) for r in runs]
    assert trained[0][0] == 48 and trained[0].count(49) == 1  # <|tool_call>, <tool_call|>
    # one end-of-generation token, at the call's end: <turn|> (then "\n"), <|tool_response>
    assert [t for t in trained[0] if t in tok.eog_ids] == [106 if interleaved else 50]
    assert trained[0][-1] == (107 if interleaved else 50)
    said = (*chat[:1], {**chat[1], "content": "Let me check."}, *chat[2:])
    said_example = Example("d.jsonl:1", messages=said, tools=tuple(TOOLS))
    if interleaved:  # the text after the call, in the same turn
        assert trained_texts(TextTokenizer(source), said_example)[1][0] == (
            GEMMA4_CALL + "Let me check.<turn|>\n")
    else:  # written after the tool's answer once it follows
        with pytest.raises(DataError, match=r"^d\.jsonl:1: chat template renders message "
                                            r"prefixes inconsistently, so assistant turn "
                                            r"messages\[1\] cannot be located; "):
            trained_texts(TextTokenizer(source), said_example)
