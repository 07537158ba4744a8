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
SYSTEM_DROPPED = {"mistralai-Mistral-Nemo-Instruct-2407.jinja"}
"""Templates that leave a system message out of a conversation ending in an assistant's turn:
Mistral-Nemo writes the system text into the last message only when that is a user's, so
training CHAT is refused (every turn, and the last) and trains without the system message."""
REWRITTEN = {"Qwen-Qwen3-0.6B.jinja"}
"""Templates that write an assistant turn one way while it is the last and another once a user
message follows (Qwen3: an empty `<think>` block in the last turn only), so an earlier turn
trains as the whole conversation writes it (`_history_span`): `Turn.before` + text + `Turn.end`,
no `last_before`."""


@pytest.mark.parametrize("name", sorted(set(LOADED) - set(VARIABLES)))
def test_training_trains_the_answers_and_end_of_turn_as_the_template_writes_them(
        name, llamacpp_source, pinned_clock):  # noqa: F811
    source = template_text(llamacpp_source, name)
    tok = TextTokenizer(source)
    turn = LOADED[name]
    last_end, last_before = turn.last_end or turn.end, turn.before if turn.last_before is None \
        else turn.last_before
    tools = TOOLS if name in TOOL_USE else None
    chat = CHAT[1:] if name in SYSTEM_DROPPED else CHAT
    merged = "System role not supported" in source  # Gemma's: no system role
    rendered_as = ([{**USER1, "content": f"{SYSTEM['content']}\n\n{USER1['content']}"},
                    *CHAT[2:]] if merged else chat)
    full = hf_render(source, rendered_as, False, tools)
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tools and tuple(tools))
    if name in SYSTEM_DROPPED:
        refused = Example("d.jsonl:1", messages=tuple(CHAT))
        for mask_prompt, turns in ((True, "assistant"), (True, "last"), (False, "assistant")):
            with pytest.raises(DataError, match=r"^d\.jsonl:1: chat template leaves the system "
                                                r"message messages\[0\] out of the conversation's"
                                                r" render .*, so the model would train without "
                                                r"it; .*: move it to the start of the first user "
                                                r"message$"):
                tokenize_example(refused, tok, mask_prompt, turns)
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
    chat = CHAT3[1:] if name in SYSTEM_DROPPED else CHAT3
    rendered_as = ([{**USER1, "content": f"{SYSTEM['content']}\n\n{USER1['content']}"},
                    *CHAT3[2:]] if "System role not supported" in source else chat)
    if name not in REWRITTEN:
        def unreached(*args, **kwargs):
            raise AssertionError("_history_span reached")
        monkeypatch.setattr(chat_module, "_history_span", unreached)
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tools and tuple(tools))
    text, spans = trained_spans(tok, example)
    assert text == hf_render(source, rendered_as, False, tools)
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
    cuts = [0] + [c for at, r in spans for c in (at, at + len(r))] + [len(text)]
    assert [text[a:b] for a, b in zip(cuts[::2], cuts[1::2], strict=True)] == [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is a list?"
         "<|im_end|>\n<|im_start|>assistant\n"),
        "<|im_start|>user\nAnd a dict?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nAnd a set?<|im_end|>\n<|im_start|>assistant\n", ""]
    assert trained_texts(tok, Example("d.jsonl:1", messages=tuple(CHAT3)), "last")[1] == [
        "<think>\n\n</think>\n\nA bag.<|im_end|>\n"]


def test_qwen3_tool_call_turn_trains_the_call_as_the_history_writes_it(llamacpp_source,  # noqa: F811
                                                                       pinned_clock):
    """An agent's turn that only calls a tool (no content) before the tool's answer and the
    final answer: Qwen3 writes it with a `<think>` block when last, without once the tool
    answers; the call and its end train as the history writes them."""
    source = template_text(llamacpp_source, QWEN3)
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    chat = [USER1, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "get_weather", "content": "Sunny"}, ANSWER1]
    example = Example("d.jsonl:1", messages=tuple(chat), tools=tuple(TOOLS))
    text, runs = trained_texts(TextTokenizer(source), example)
    assert text == hf_render(source, chat, False, TOOLS)
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert runs == [f"<tool_call>\n{call_text}\n</tool_call><|im_end|>\n",
                    "<think>\n\n</think>\n\nA sequence.<|im_end|>\n"]


@pytest.mark.parametrize("name", [QWEN3, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"])
def test_an_earlier_turn_whose_reasoning_the_template_strips_is_a_one_line_error(
        name, llamacpp_source):  # noqa: F811
    """Qwen3 and DeepSeek-R1 write an earlier turn without the `<think>` reasoning its content
    holds: the content is nowhere in the render, so the turn cannot be located."""
    tok = TextTokenizer(template_text(llamacpp_source, name))
    thought = {"role": "assistant", "content": "<think>\nLists hold items.\n</think>\n\nA sequence."}
    example = Example("d.jsonl:1", messages=(USER1, thought, USER2, ANSWER2))
    with pytest.raises(DataError, match=r"^d\.jsonl:1: chat template renders message prefixes "
                                        r"inconsistently, so assistant turn messages\[1\] cannot "
                                        r"be located; .*--data.train-turns last.*mask_prompt=False"
                                        r" to train on the whole conversation$"):
        trained_texts(tok, example)
    assert trained_texts(tok, example, "last")[1] == [
        ("<think>\n\n</think>\n\n" if name == QWEN3 else "") + ANSWER2["content"]
        + LOADED[name].end]


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
