"""Tests for toymlx.data.chat: file formats, one-line errors, loss masks, rows and batches."""

from __future__ import annotations

import json
import re
from typing import ClassVar

import jinja2
import numpy as np
import pytest
from chat_templates import GEMMA2, GEMMA_CONVERSATION, GEMMA_LLAMACPP, GEMMA_SYSTEM

from toymlx.data import chat
from toymlx.data.chat import (
    FIRST_BYTES,
    HELD_OUT_ROWS,
    DataError,
    DataFiles,
    DataSource,
    Example,
    Fit,
    SFTData,
    SplitExamples,
    data_files,
    drawn_rows,
    first_kind,
    fit_rows,
    load_examples,
    pack_or_pad,
    sft_batch,
    sft_val_batches,
    split_examples,
    tokenize_example,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
S, E = 258, 259  # <|im_start|>, <|im_end|>


class FakeTokenizer:
    """UTF-8 bytes as ids 0..255 plus four single-id special tokens; Jinja chat template."""

    specials: ClassVar[dict[str, int]] = {"<s>": 256, "</s>": 257, "<|im_start|>": S, "<|im_end|>": E}
    bos_id, eos_id, vocab_size = 256, 257, 260

    def __init__(self, chat_template: str | None = CHATML, add_bos: bool = True) -> None:
        self.chat_template = chat_template
        self.add_bos = add_bos

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []
        for part in re.split("(" + "|".join(map(re.escape, self.specials)) + ")", text):
            ids.extend([self.specials[part]] if part in self.specials else part.encode())
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.specials.items()}
        out, buf = [], bytearray()
        for i in ids:
            if i in names:
                out.append(buf.decode() + names[i])
                buf = bytearray()
            else:
                buf.append(i)
        return "".join(out) + buf.decode()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **kw)


def b(text: str) -> list[int]:
    return list(text.encode())


def write(tmp_path, name: str, content: str):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    return path


# ------------------------------------------------------------------------- loading


def test_jsonl_parses_each_shape_with_line_numbers(tmp_path):
    lines = [
        json.dumps({"text": "hello", "id": 7}),  # extra keys are ignored
        "",
        json.dumps({"prompt": "2+2?", "completion": "4"}),
        json.dumps({"messages": [{"role": "system", "content": ""},
                                 {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo", "name": "x"}]}),
    ]
    paths = [write(tmp_path, f"{i}.jsonl", "\n" * i + line + "\n")  # one shape a file
             for i, line in enumerate(lines) if line]
    ex = [e for path in paths for e in load_examples(path)]
    assert [e.kind for e in ex] == ["text", "completion", "messages"]
    assert [e.source for e in ex] == [f"{paths[0]}:1", f"{paths[1]}:3", f"{paths[2]}:4"]
    assert ex[0].text == "hello"
    assert (ex[1].prompt, ex[1].completion) == ("2+2?", "4")
    assert ex[2].messages == ({"role": "system", "content": ""}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "yo", "name": "x"})  # as given


def test_sharegpt_and_alpaca_records_read_as_the_shapes_they_mean(tmp_path):
    """The two layouts Hugging Face's chat datasets come in most were refused ("expected one of
    {"text": ...}, ... found keys ['conversations']", as mlx-lm's "Unsupported data format"):
    ShareGPT's turns read as messages, Alpaca's instruction and input as the prompt."""
    share = write(tmp_path, "share.jsonl", json.dumps({"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"}, {"role": "user", "content": "and?"},
        {"from": "chatgpt", "value": "bye"}]}) + "\n")
    [ex] = load_examples(share)
    assert ex.kind == "messages" and ex.messages == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "bye"})
    alpaca = write(tmp_path, "alpaca.jsonl", "".join(json.dumps(r) + "\n" for r in (
        {"instruction": "Add them.", "input": "2 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Say bye.", "output": "bye"})))
    assert [(e.kind, e.prompt, e.completion) for e in load_examples(alpaca)] == [
        ("completion", "Add them.\n\n2 3", "5"), ("completion", "Say hi.", "hi"),
        ("completion", "Say bye.", "bye")]
    for record, want in (
            ({"conversations": []}, ('expected "conversations" (ShareGPT\'s) to be a non-empty '
                                    'array of {"from", "value"} objects, found array []')),
            ({"conversations": [{"from": "bot", "value": "x"}]},
             ("expected conversations[0].from to be one of system, human, user, gpt, assistant, "
             'chatgpt, model, tool, found string "bot"')),
            ({"conversations": [{"from": "human"}]},
             ('expected conversations[0] to be an object with "from" and "value" (ShareGPT\'s), '
             "found object with keys ['from']")),
            ({"instruction": "x", "output": 5},
             'expected "output" (Alpaca\'s) to be a string, found number 5')):
        bad = write(tmp_path, "bad.jsonl", json.dumps(record) + "\n")
        with pytest.raises(DataError) as e:
            load_examples(bad)
        assert str(e.value) == f"{bad}:1: {want}"


def test_plain_text_splits_documents_at_blank_lines(tmp_path):
    path = write(tmp_path, "notes.txt", "para one\nline two\n\n  \n\npara two\r\n")
    ex = load_examples(path)
    assert [(e.kind, e.text, e.source) for e in ex] == [
        ("text", "para one\nline two", f"{path}:1"), ("text", "para two", f"{path}:6")]


def test_a_split_that_holds_out_none_is_said_before_the_run(tmp_path):
    """--data.val-fraction 0.1 of 4 examples rounds to none: the run would train without
    validation, said only by its last line ("held-out: none"), so a note says it first."""
    text = write(tmp_path, "story.txt", "one long document\nwith no blank line\n")
    assert SplitExamples.of(text).note == (
        f"{text}: --data.val-fraction 0.1 of 1 example holds out none, so the run validates "
        "nothing (a plain-text file's examples are its documents, separated by blank lines); "
        "add examples, raise --data.val-fraction, or use a data folder with a valid.jsonl")
    rows = write(tmp_path, "rows.jsonl", "".join(f'{{"text": "t{i}"}}\n' for i in range(4)))
    assert SplitExamples.of(rows).note == (
        f"{rows}: --data.val-fraction 0.1 of 4 examples holds out none, so the run validates "
        "nothing; add examples, raise --data.val-fraction, or use a data folder with a "
        "valid.jsonl")
    assert SplitExamples.of(rows, val_fraction=0.25).note is None  # one example validates
    assert SplitExamples.of(rows, val_fraction=0.0).note is None  # none asked for


def test_json_array_file_with_line_numbers(tmp_path):
    content = '[\n  {"prompt": "q",\n   "completion": "a"},\n  {"prompt": "p",\n   "completion": "c"}\n]\n'
    path = write(tmp_path, "data.json", content)
    ex = load_examples(path)
    assert [(e.kind, e.source) for e in ex] == [("completion", f"{path}:2"),
                                                ("completion", f"{path}:4")]
    bad = write(tmp_path, "bad.json", '[\n  {"text": "a"},\n  {"text": 5}\n]\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:3: expected \"text\" to be a string")):
        load_examples(bad)
    trailing = write(tmp_path, "trail.json", '[{"text": "a"}] x')
    with pytest.raises(DataError, match=re.escape(f"{trailing}:1: bad JSON")):
        load_examples(trailing)
    # A .json file that is not an array is read as JSON lines.
    assert load_examples(write(tmp_path, "lines.json", '{"text": "a"}\n{"text": "b"}'))[1].text == "b"


@pytest.mark.parametrize("name,rows,bad,found", [
    ("mixed.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"},
                     {"text": "t"}], 3, '{"text": ...}'),
    ("mixed.jsonl", [{"text": "t"}, {"messages": [{"role": "user", "content": "hi"}]}], 2,
     '{"messages": [...]}'),
])
def test_a_file_mixing_shapes_is_refused_at_the_first_other_row(tmp_path, name, rows, bad, found):
    """mlx-lm picks a file's dataset class by its first row's keys; a row of another shape
    later in the file was taken silently here (and trained another way than in mlx-lm)."""
    path = write(tmp_path, name, "".join(json.dumps(r) + "\n" for r in rows))
    first = {"text": '{"text": ...}', "prompt": '{"prompt": ..., "completion": ...}'}[
        next(iter(rows[0]))]
    with pytest.raises(DataError) as e:
        load_examples(path)
    assert str(e.value) == (f"{path}:{bad}: expected {first}, the shape the first row "
                            f"({path}:1) set for this file, found {found}; put each shape in a "
                            "file of its own")
    as_array = write(tmp_path, "mixed.json", json.dumps(rows, indent=0))
    with pytest.raises(DataError, match=re.escape(f"found {found}")):
        load_examples(as_array)


MALFORMED = [
    ('{bad json', ["bad JSON", "expected one object per line"]),
    ('[1, 2]', ["expected a JSON object", "found array [1, 2]"]),
    ('"just a string"', ["expected a JSON object", "found string"]),
    ('{"foo": 1}', ["expected one of", "found keys ['foo']"]),
    ('{}', ["expected one of", "found an empty object"]),
    ('{"text": "a", "messages": []}', ["expected only one of", "found keys ['messages', 'text']"]),
    ('{"text": 3}', ['expected "text" to be a string, found number 3']),
    ('{"text": "  "}', ['expected "text" to be a non-empty string']),
    ('{"prompt": "a"}', ['expected both "prompt" and "completion"', "found keys ['prompt']"]),
    ('{"prompt": "a", "completion": null}', ['"completion" to be a string, found null']),
    ('{"prompt": ["a"], "completion": "b"}', ['"prompt" to be a string, found array']),
    ('{"messages": []}', ['"messages" to be a non-empty array', "found array []"]),
    ('{"messages": "hi"}', ['"messages" to be a non-empty array', 'found string "hi"']),
    ('{"messages": [{"role": "bot", "content": "x"}]}',
     ["messages[0].role to be one of system, user, assistant, tool", 'found string "bot"']),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "user"}]}',
     ['messages[1] to be an object with "role" and "content"', "found object with keys ['role']"]),
    ('{"messages": [{"role": "user", "content": 5}]}',
     ['"messages[0].content" to be a string, found number 5']),
]


@pytest.mark.parametrize("bad_line, expected", MALFORMED)
def test_malformed_line_names_file_line_and_expectation(tmp_path, bad_line, expected):
    path = write(tmp_path, "train.jsonl", '{"text": "fine"}\n\n' + bad_line + "\n")
    with pytest.raises(DataError) as err:
        load_examples(path)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert msg.startswith(f"{path}:3: ")
    assert "\n" not in msg
    for part in expected:
        assert part in msg


@pytest.mark.parametrize("name,value,found", [
    ("train.jsonl", [{"prompt": "a", "completion": "b"}],
     ("'[' alone, the start of a pretty-printed JSON array; a file that is one array of "
      "objects reads as such named .json")),
    ("train.json", {"train": [{"prompt": "a", "completion": "b"}]},
     "'{' alone, the start of a pretty-printed JSON object"),
])
def test_a_pretty_printed_file_is_named_as_one_not_as_cut_short(tmp_path, name, value, found):
    """`json.dump(rows, f, indent=2)` saved as train.jsonl was "bad JSON (Expecting value at
    column 2, where the text ends: cut short?)" at line 1: the file is whole, laid out over
    lines."""
    path = write(tmp_path, name, json.dumps(value, indent=2))
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == (f"{path}:1: expected one object per line {chat.SHAPES}, found "
                              f"{found}")
    assert load_examples(write(tmp_path, "rows.json", json.dumps([{"prompt": "a", "completion":
                                                                   "b"}], indent=2)))


def test_a_null_value_is_named_once(tmp_path):
    """A null where a string belongs read "found null null" (its kind, then its JSON text)."""
    path = write(tmp_path, "train.jsonl", '{"text": null}\n')
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == f'{path}:1: expected "text" to be a string, found null'


def test_file_level_errors(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl: not valid UTF-8 at byte offset 28 \(line 2"):
        load_examples(path)
    with pytest.raises(DataError, match=r"empty\.jsonl: empty file"):
        load_examples(write(tmp_path, "empty.jsonl", ""))
    with pytest.raises(DataError, match=r"arr\.json: no examples"):
        load_examples(write(tmp_path, "arr.json", "[ ]"))


def test_split_examples_last_fraction():
    ex = [Example(f"f:{i}", text=str(i)) for i in range(10)]
    train, val = split_examples(ex, 0.2)
    assert [e.text for e in train] == [str(i) for i in range(8)]
    assert [e.text for e in val] == ["8", "9"]
    assert split_examples(ex[:1], 0.1) == ([ex[0]], [])
    with pytest.raises(DataError, match="none for training"):
        split_examples(ex[:1], 0.9)


# ------------------------------------------------------------------------- tokenizing


def test_text_example_gets_bos_and_eos_all_trained():
    ids, mask = tokenize_example(Example("f:1", text="hi"), FakeTokenizer(), mask_prompt=True)
    assert ids == [256, 104, 105, 257]
    assert mask == [1, 1, 1, 1]
    ids, _ = tokenize_example(Example("f:1", text="hi"), FakeTokenizer(add_bos=False), True)
    assert ids == [104, 105, 257]


def test_prompt_completion_without_template_trains_completion_only():
    tok = FakeTokenizer(chat_template=None)
    ex = Example("f:1", prompt="ab", completion="cd")
    ids, mask = tokenize_example(ex, tok, mask_prompt=True)
    assert ids == [256, 97, 98, 99, 100, 257]
    assert mask == [0, 0, 0, 1, 1, 1]  # BOS and prompt not trained; completion and EOS are
    assert tokenize_example(ex, tok, mask_prompt=False) == (ids, [1] * 6)


def test_messages_without_a_template_name_the_model_file():
    """Chat rows on a tokenizer without a chat template: the line named the data file and "this
    one" (which?); it names the file the tokenizer came from and the key it lacks."""
    tok = FakeTokenizer(chat_template=None)
    tok.source = "base.gguf"
    ex = Example("f:1", messages=[{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "yo"}])
    with pytest.raises(DataError) as e:
        tokenize_example(ex, tok, mask_prompt=True)
    assert str(e.value) == (
        "f:1: 'messages' examples need a chat template, and base.gguf has none (no "
        "tokenizer.chat_template); use 'text' or 'prompt'/'completion' examples, or a base that "
        "has one")


def test_prompt_completion_with_template_hand_computed_positions():
    ids, mask = tokenize_example(Example("f:1", prompt="ab", completion="cd"), FakeTokenizer(),
                                 mask_prompt=True)
    # <S>user\nab<E>\n<S>assistant\ncd<E>\n : header "<S>assistant\n" is indices 10..20.
    expected = [S, *b("user\nab"), E, 10, S, *b("assistant\n"), *b("cd"), E, 10]
    assert ids == expected and len(ids) == 25
    assert [i for i, m in enumerate(mask) if m] == [21, 22, 23, 24]  # c, d, <E>, \n
    assert [ids[i] for i in (21, 22, 23)] == [ord("c"), ord("d"), E]


def test_messages_mask_covers_exactly_assistant_turns():
    tok = FakeTokenizer()
    msgs = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "done"})
    ids, mask = tokenize_example(Example("f:1", messages=msgs), tok, mask_prompt=True)
    pieces = [  # (text, trained)
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
         + "<|im_start|>assistant\n", 0),
        ("yo<|im_end|>\n", 1),
        ("<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("done<|im_end|>\n", 1),
    ]
    assert ids == [i for text, _ in pieces for i in tok.encode(text, add_bos=False)]
    assert mask == [t for text, t in pieces for _ in tok.encode(text, add_bos=False)]
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "yo<|im_end|>\ndone<|im_end|>\n"
    assert sum(mask) == (2 + 2) + (4 + 2)  # "yo", "done", each + <E> + \n
    assert tokenize_example(Example("f:1", messages=msgs), tok, False) == (ids, [1] * len(ids))


def test_trailing_user_turn_is_not_trained():
    msgs = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"})
    ids, mask = tokenize_example(Example("f:1", messages=msgs), FakeTokenizer(), True)
    assert FakeTokenizer().decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        "b<|im_end|>\n")
    assert mask[-1] == 0


def _completion(p: str) -> Example:
    return Example("f:1", prompt=p, completion="answer!")


def _chat(p: str) -> Example:
    return Example("f:1", messages=({"role": "user", "content": p},
                                    {"role": "assistant", "content": "answer!"}))


@pytest.mark.parametrize("make, tok", [
    (_completion, FakeTokenizer()),
    (_completion, FakeTokenizer(chat_template=None)),
    (_chat, FakeTokenizer()),
])
def test_prompt_tokens_never_change_counted_positions(make, tok):
    base_ids, base_mask = tokenize_example(make("what is up"), tok, mask_prompt=True)
    for prompt in ("WHAT IS UP", "xxxxxxxxxx", "what_is_up"):  # same length, other tokens
        ids, mask = tokenize_example(make(prompt), tok, mask_prompt=True)
        assert mask == base_mask
        changed = [i for i, (x, y) in enumerate(zip(ids, base_ids, strict=True)) if x != y]
        assert changed and all(base_mask[i] == 0 for i in changed)
    # A longer prompt shifts the span but trains the same tokens.
    ids, mask = tokenize_example(make("a much longer prompt than before"), tok, mask_prompt=True)
    assert sum(mask) == sum(base_mask) == len(b("answer!")) + (1 if tok.chat_template is None
                                                               else 2)
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [
        i for i, m in zip(base_ids, base_mask, strict=True) if m]


def test_messages_errors_name_the_example():
    msgs = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
    with pytest.raises(DataError, match=r"^d\.jsonl:4: 'messages' examples need .* chat template"):
        tokenize_example(Example("d.jsonl:4", messages=msgs), FakeTokenizer(None), True)
    # A generation prompt that is not what an assistant turn starts with cannot be located.
    odd = CHATML.replace("{% if add_generation_prompt %}<|im_start|>assistant",
                         "{% if add_generation_prompt %}<|im_start|>bot")
    with pytest.raises(DataError,
                       match=r"^d\.jsonl:4: .*inconsistently.*set --data\.no-mask-prompt to"):
        tokenize_example(Example("d.jsonl:4", messages=msgs), FakeTokenizer(odd), True)
    ids, mask = tokenize_example(Example("d.jsonl:4", messages=msgs), FakeTokenizer(odd), False)
    assert sum(mask) == len(ids)
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match=r"^d\.jsonl:4: chat template failed"):
        tokenize_example(Example("d.jsonl:4", messages=msgs), FakeTokenizer(raising), True)


class HFTemplateTokenizer(FakeTokenizer):
    """FakeTokenizer rendering its template as a GGUF's is (`compile_template`: HF's sandbox
    with `raise_exception`)."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        from toymlx.data.chat_template import compile_template

        return compile_template(self.chat_template, "fake").render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<s>", **kw)


def test_a_system_message_on_a_template_without_the_role_starts_the_first_user_message():
    """Gemma 2's template refuses a system message; training refused such examples while
    toymlx-generate --system put the text where llama.cpp's Gemma template does. Training now
    puts it there too (`system_in_user`: llama.cpp's rendering, GEMMA_LLAMACPP), trains the
    answers alone, and says once per split how many examples it moved."""
    from toymlx.data.chat_template import system_in_user, system_refused

    tok = HFTemplateTokenizer(GEMMA2)
    answer = {"role": "assistant", "content": "A dict."}
    msgs = ({"role": "system", "content": GEMMA_SYSTEM}, *GEMMA_CONVERSATION, answer)
    ids, mask = tokenize_example(Example("d.jsonl:4", messages=msgs), tok, True)
    assert tok.decode(ids) == "<s>" + GEMMA_LLAMACPP + "A dict.<end_of_turn>\n"
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "A sequence.<end_of_turn>\nA dict.<end_of_turn>\n"
    assert system_refused(tok) == "System role not supported"
    assert system_refused(HFTemplateTokenizer(CHATML)) is None
    assert system_refused(HFTemplateTokenizer("{{ raise_exception('no') }}")) is None
    moved = system_in_user(GEMMA_CONVERSATION, GEMMA_SYSTEM)
    assert tok.apply_chat_template(moved) == "<s>" + GEMMA_LLAMACPP
    # one line a split, naming how many examples were moved (3 of 4 training examples here)
    plain = Example("d.jsonl:5", messages=(*GEMMA_CONVERSATION, answer))
    train = [Example(f"d.jsonl:{k}", messages=msgs) for k in (1, 2, 3)] + [plain]
    data = SFTData.from_examples(train, [], tok, 256, source=DataSource("d.jsonl"))
    assert data.fits["train"].merged == 3
    assert data.notes() == [(
        "d.jsonl: train: of 4 examples, 3 with a system message, which this base's chat "
        "template has no role for: its text starts the first user message, a blank line after "
        "it (as llama.cpp and toymlx-generate --system put it)")]
    # a system message anywhere else is still the template's error, with where to put it
    late = (*GEMMA_CONVERSATION[:2], {"role": "system", "content": "Be brief."},
            GEMMA_CONVERSATION[2], answer)
    with pytest.raises(DataError, match=r"^d\.jsonl:4: chat template failed on 5 messages: "
                                        r"TemplateError: Conversation roles must alternate.*"
                                        r"; this base's template has no system role: toymlx puts "
                                        r"a first system message"):
        tokenize_example(Example("d.jsonl:4", messages=late), tok, True)


R1_LIKE = ("{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}{% else %}"
           "<Assistant>{{ m.content }}</s>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<Assistant><think>\n{% endif %}")
"""DeepSeek-R1's shape: a generation prompt that goes on past the header a turn is written
with (`<think>\n`), which the turns never contain."""


@pytest.mark.parametrize("answer", ["a", "<t", "A sequence.", "ss"])
def test_a_generation_prompt_longer_than_the_turn_header_trains_the_answer(answer):
    """The answer is found after the header the prompt and the turn share, even where it also
    stands inside the header ("a", "ss" in "Assistant") or starts as the prompt goes on ("<t" as
    "<think>"); what the prompt adds is not trained."""
    tok = HFTemplateTokenizer(R1_LIKE)
    msgs = ({"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "r"}, {"role": "assistant", "content": answer})
    ids, mask = tokenize_example(Example("d.jsonl:1", messages=msgs), tok, True)
    assert tok.decode(ids) == f"<U>q<Assistant>{answer}</s><U>r<Assistant>{answer}</s>"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        f"{answer}</s>{answer}</s>")


LAST_USER_MARKED = ("{% set last = (messages | selectattr('role', 'equalto', 'user') | list)[-1] %}"
                    "{% for m in messages %}{% if m.role == 'user' %}[INST{% if m == last %}!"
                    "{% endif %}]{{ m.content }}[/INST]{% else %}HEAD{{ m.content }}</s>"
                    "{% endif %}{% endfor %}{% if add_generation_prompt %}HEAD{% endif %}")
"""Mistral-Nemo's shape (its tool list): text before the last user message only, so no earlier
turn's prefix render starts the conversation's; "HEAD" the assistant's header."""


@pytest.mark.parametrize("header", ["<|im_start|>", ""])
def test_turns_a_later_message_rewrites_train_where_the_conversation_writes_them(header):
    """Each turn trains its answer and end where the whole render writes it, after the previous
    trained turn: three equal answers, users' messages holding the answer's text, with and
    without an assistant header; --data.train-turns last trains the last only."""
    tok = FakeTokenizer(LAST_USER_MARKED.replace("HEAD", header))
    users, answer = ["say same", "same again", "x"], "same"
    msgs = tuple(m for u in users for m in ({"role": "user", "content": u},
                                            {"role": "assistant", "content": answer}))
    marks = ["", "", "!"]
    pieces = [p for u, mark in zip(users, marks, strict=True)
              for p in ((f"[INST{mark}]{u}[/INST]{header}", 0), (f"{answer}</s>", 1))]
    for turns, trained in (("assistant", [1, 3, 5]), ("last", [5])):
        ids, mask = tokenize_example(Example("d.jsonl:1", messages=msgs), tok, True, turns)
        assert ids == [i for text, _ in pieces for i in tok.encode(text, add_bos=False)]
        assert mask == [int(k in trained) for k, (text, _) in enumerate(pieces)
                        for _ in tok.encode(text, add_bos=False)]


def test_system_refused_renders_once_per_template(monkeypatch):
    """`system_refused` renders the template twice to answer; toymlx-generate asks it twice a
    call and training once an example, so the answer is kept per template text."""
    from toymlx.data.chat_template import system_refused

    calls = []
    tok = HFTemplateTokenizer(GEMMA2.replace("System role", "System  role"))  # a new text
    render = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda m, *a, **k: calls.append(m) or
                        render(m, *a, **k))
    assert [system_refused(tok) for _ in range(3)] == ["System  role not supported"] * 3
    assert len(calls) == 2


@pytest.mark.interop
def test_gemma_llamacpp_is_llamacpps_own_rendering():
    """GEMMA_LLAMACPP (the reference above) is what llama.cpp's built-in Gemma template
    renders today for the system message and GEMMA_CONVERSATION."""
    import ctypes

    import llama_cpp

    msgs = [("system", GEMMA_SYSTEM)] + [(m["role"], m["content"]) for m in GEMMA_CONVERSATION]
    chat_msgs = (llama_cpp.llama_chat_message * len(msgs))(
        *[llama_cpp.llama_chat_message(role=r.encode(), content=c.encode()) for r, c in msgs])
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(b"gemma", chat_msgs, len(msgs), True, buf, 4096)
    assert buf.raw[:n].decode() == GEMMA_LLAMACPP


def test_sharegpt_conversations_without_a_chat_template_name_what_the_user_wrote(tmp_path):
    """ShareGPT's records on a base with no chat template said "'messages' examples need a
    tokenizer with a chat template ... use 'text' or 'prompt'/'completion' examples": a key the
    user never wrote. It names "conversations" and says how to train without a template."""
    path = write(tmp_path, "share.jsonl", "".join(json.dumps({"conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}) + "\n"
        for i in range(4)))
    with pytest.raises(DataError) as e:
        SFTData.from_file(path, FakeTokenizer(None), seq_len=32)
    assert str(e.value) == (
        f'{path}:1: "conversations" (ShareGPT\'s, read as \'messages\'): expected a tokenizer '
        "with a chat template to render the turns, found none in this one; use a base with a "
        'chat template (an instruct model), or write each example as {"prompt", "completion"} '
        "(the human turn and the gpt answer), which trains without one")
    # the same turns written as messages keep their own words
    msgs = write(tmp_path, "msgs.jsonl", json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(DataError, match=r"msgs\.jsonl:1: 'messages' examples need a chat template"):
        SFTData.from_file(msgs, FakeTokenizer(None), seq_len=32)


# ------------------------------------------------------------------------- rows


def test_padding_mode_rows_truncation_and_zero_mask_padding():
    short = ([1, 2, 3], [0, 1, 1])
    long = (list(range(10, 22)), [1] * 12)  # 12 tokens > seq_len + 1
    rows = pack_or_pad([short, long], seq_len=8, pad_id=99, pack=False)
    assert {k: (v.shape, v.dtype) for k, v in rows.items()} == {
        "inputs": ((2, 8), np.int32), "targets": ((2, 8), np.int32), "mask": ((2, 8), np.float32)}
    np.testing.assert_array_equal(rows["inputs"][0], [1, 2, 3, 99, 99, 99, 99, 99])
    np.testing.assert_array_equal(rows["targets"][0], [2, 3, 99, 99, 99, 99, 99, 99])
    np.testing.assert_array_equal(rows["mask"][0], [1, 1, 0, 0, 0, 0, 0, 0])
    assert (rows["mask"][rows["targets"] == 99] == 0).all()  # every padding target is masked
    np.testing.assert_array_equal(rows["inputs"][1], range(10, 18))
    np.testing.assert_array_equal(rows["targets"][1], range(11, 19))  # cut after 9 tokens
    np.testing.assert_array_equal(rows["mask"][1], np.ones(8))


def test_rows_without_trained_targets_are_dropped():
    rows = pack_or_pad([([1, 2, 3], [1, 0, 0]), ([4, 5], [0, 1])], 4, 0, pack=False)
    np.testing.assert_array_equal(rows["inputs"], [[4, 5, 0, 0]])
    empty = pack_or_pad([([1], [1])], 4, 0, pack=True)
    assert empty["inputs"].shape == (0, 4)


def test_packing_keeps_every_token_once():
    tok = FakeTokenizer()
    texts = ["a", "hello there", "x" * 30, "end of it"]
    seqs = [tokenize_example(Example("f", text=t), tok, True) for t in texts]
    stream = [i for ids, _ in seqs for i in ids]
    rows = pack_or_pad(seqs, seq_len=8, pad_id=0, pack=True)
    n = len(stream)  # 3 + 13 + 32 + 11 = 59 -> ceil(58 / 8) = 8 rows
    assert n == 59 and rows["inputs"].shape == (8, 8)
    flat_targets = rows["targets"].reshape(-1)
    assert [rows["inputs"][0, 0], *flat_targets[: n - 1]] == stream
    np.testing.assert_array_equal(rows["inputs"][1:, 0], rows["targets"][:-1, -1])  # overlap 1
    flat_mask = rows["mask"].reshape(-1)
    np.testing.assert_array_equal(flat_mask[n - 1 :], 0)  # tail padding
    starts = np.cumsum([0] + [len(ids) for ids, _ in seqs[:-1]])[1:]  # later examples' BOS
    np.testing.assert_array_equal(flat_mask[starts - 1], 0)
    assert flat_mask.sum() == n - 1 - len(starts)


def test_packing_keeps_prompt_masks_on_targets():
    tok = FakeTokenizer(chat_template=None)
    seqs = [tokenize_example(Example("f", prompt="q" * 5, completion=c), tok, True)
            for c in ("aa", "bbbb")]
    rows = pack_or_pad(seqs, seq_len=4, pad_id=0, pack=True)
    trained = rows["targets"][rows["mask"] > 0].tolist()
    assert trained == [*b("aa"), 257, *b("bbbb"), 257]
    assert rows["mask"].sum() == sum(sum(m[1:]) for _, m in seqs)


# ------------------------------------------------------------------------- batches


def _numbered_rows(n: int, seq_len: int = 4) -> dict[str, np.ndarray]:
    inputs = np.repeat(np.arange(n, dtype=np.int32)[:, None], seq_len, axis=1)
    return {"inputs": inputs, "targets": inputs + 1, "mask": np.ones((n, seq_len), np.float32)}


def test_sft_batch_pure_and_epoch_complete():
    rows = _numbered_rows(12)
    batch = sft_batch(rows, step=0, seed=3, batch_size=3, accum=2)
    assert {k: v.shape for k, v in batch.items()} == {k: (2, 3, 4) for k in rows}
    again = sft_batch(rows, step=0, seed=3, batch_size=3, accum=2)
    for key in batch:
        np.testing.assert_array_equal(batch[key], again[key])
    ids = [sft_batch(rows, s, 3, 3, 2)["inputs"][..., 0].ravel().tolist() for s in range(4)]
    assert ids[0] != ids[1]
    assert sorted(ids[0] + ids[1]) == list(range(12))  # epoch 0: every row once
    assert sorted(ids[2] + ids[3]) == list(range(12))  # epoch 1 likewise
    assert ids[0] + ids[1] != ids[2] + ids[3]
    other_seed = sft_batch(rows, 0, 4, 3, 2)["inputs"][..., 0].ravel().tolist()
    assert other_seed != ids[0]
    # A batch larger than the data spans epochs and still counts every row per epoch.
    big = sft_batch(_numbered_rows(5), 0, 0, batch_size=10)["inputs"][0, :, 0].tolist()
    assert sorted(big) == sorted(list(range(5)) * 2)


def test_sft_val_batches_fixed_with_a_short_last_batch():
    rows = _numbered_rows(5)
    batches = sft_val_batches(rows, batch_size=2, max_batches=10)
    assert len(batches) == 3 and batches[0]["inputs"].shape == (1, 2, 4)
    assert [b["inputs"][0, :, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert [b["inputs"][0, :, 0].tolist() for b in sft_val_batches(rows, 2, 1)] == [[0, 1]]


def test_sft_data_from_file(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "completion": "a" * (i + 1)}) for i in range(10)]
    path = write(tmp_path, "train.jsonl", "\n".join(lines))
    tok = FakeTokenizer(chat_template=None)
    data = SFTData.from_file(path, tok, seq_len=8, val_fraction=0.2)
    assert data.train["inputs"].shape == (8, 8) and data.val["inputs"].shape == (2, 8)
    # q_i + completion of i+1 + EOS, BOS first: 1 + 2 + (i + 1) + 1 > 9 for i >= 5
    assert data.n_truncated == 3
    assert data.batch(0, 0, 4, 2)["inputs"].shape == (2, 4, 8)
    assert len(data.val_batches(4, 10)) == 1
    packed = SFTData.from_file(path, tok, seq_len=8, pack=True, val_fraction=0.2)
    assert packed.n_truncated == 0 and packed.train["mask"].sum() == sum(i + 2 for i in range(8))
    hopeless = write(tmp_path, "long.jsonl", json.dumps({"prompt": "p" * 20, "completion": "c"}))
    with pytest.raises(DataError) as e:
        SFTData.from_file(hopeless, tok, seq_len=8, val_fraction=0.0)
    # the fixes named as the command line takes them (not the Python field mask_prompt=False)
    assert str(e.value) == (f"{hopeless}: no training example has a trained token within its "
                            "first 9 tokens (--seq-len 8 + 1); raise --seq-len, shorten the "
                            "prompts, or set --data.no-mask-prompt")


def test_rows_cut_or_dropped_at_seq_len_are_said_per_split(tmp_path):
    tok = FakeTokenizer(chat_template=None)
    folder = tmp_path / "data"
    folder.mkdir()
    # BOS + prompt + completion + EOS: 1 + 2 + 12 + 1 = 16 > 9 tokens, the answer cut
    write(folder, "train.jsonl", "\n".join(
        [json.dumps({"prompt": "q1", "completion": "a" * 12})] +
        [json.dumps({"prompt": "q2", "completion": "b"})] * 2))
    write(folder, "valid.jsonl", "\n".join(
        [json.dumps({"prompt": "p" * 20, "completion": "c"}),   # prompt past seq_len: no row
         json.dumps({"prompt": "q", "completion": "c"})]))
    write(folder, "test.jsonl", json.dumps({"prompt": "p" * 20, "completion": "c"}))
    data = SFTData.from_file(folder, tok, seq_len=8)
    assert data.n_truncated == 1 and len(data.val["inputs"]) == 1
    assert data.notes(test=False) == [
        (f"{folder}/train.jsonl: train: of 3 examples, 1 cut to their first 9 tokens "
         "(--seq-len 8; what follows is not trained)"),
        (f"{folder}/valid.jsonl: validation: of 2 examples, 1 dropped (no trained token within "
         "the first 9: prompts longer than --seq-len 8)")]
    assert len(data.notes(test=True)) == 3
    data.check_held_out(test=False)  # test.jsonl is not scored: no error
    with pytest.raises(DataError) as e:
        data.check_held_out(test=True)
    assert str(e.value) == (f"{folder}/test.jsonl: test: expected rows to score, found none: "
                            "of its 1 example, 1 with no trained token within the first 9 "
                            "(prompts longer than --seq-len 8); raise --seq-len or shorten "
                            "the prompts")
    # packing cuts nothing: an example runs on into the next row
    assert SFTData.from_file(folder, tok, seq_len=8, pack=True).notes(test=False) == []


def test_messages_with_no_assistant_turn_are_named_as_such(tmp_path):
    tok = FakeTokenizer()
    row = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    path = write(tmp_path, "chat.jsonl", "\n".join([row] * 3))
    with pytest.raises(DataError) as e:
        SFTData.from_file(path, tok, seq_len=64, val_fraction=0.0)
    assert str(e.value) == (f"{path}: no training example has a trained token: no assistant "
                            "turn (messages) or completion to train; add one, or set "
                            "--data.no-mask-prompt")
    answered = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "yo"}]})
    write(tmp_path, "chat.jsonl", f"{answered}\n{row}")
    assert SFTData.from_file(path, tok, seq_len=64, val_fraction=0.0).notes() == [
        (f"{path}: train: of 2 examples, 1 dropped (nothing to train: no assistant turn or "
         "completion)")]


def test_unpacked_training_batches_cut_to_longest_row_rounded_to_32(tmp_path):
    import mlx.core as mx

    from toymlx.models.llama import Llama, tiny
    from toymlx.models.losses import lm_loss
    from toymlx.models.ops import Ops

    lines = [json.dumps({"prompt": f"q{i}", "completion": "a" * (3 * i + 1)}) for i in range(12)]
    path = write(tmp_path, "train.jsonl", "\n".join(lines))
    tok = FakeTokenizer(chat_template=None)
    data = SFTData.from_file(path, tok, seq_len=128, val_fraction=0.0)
    assert data.train["inputs"].shape == (12, 128)
    whole = sft_batch(data.train, 3, 0, 4, 2)  # (2, 4, 128): what training drew before
    cut = data.batch(3, 0, 4, 2)
    # the longest drawn row's last trained target, rounded up to a multiple of 32
    last = max(int(np.flatnonzero(m)[-1]) + 1 for m in whole["mask"].reshape(-1, 128))
    assert cut["inputs"].shape == (2, 4, -(-last // 32) * 32) and cut["inputs"].shape[2] < 128
    for k in whole:
        np.testing.assert_array_equal(cut[k], whole[k][..., : cut[k].shape[-1]])
    assert whole["mask"][..., cut["mask"].shape[-1]:].sum() == 0
    mx.random.seed(0)
    model = Llama(tiny(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=64), Ops(kernels="vectorised"))
    for a in range(2):  # each micro-batch's loss and count, whole rows against cut rows
        lw, nw = lm_loss(model, {k: mx.array(v[a]) for k, v in whole.items()})
        lc, nc = lm_loss(model, {k: mx.array(v[a]) for k, v in cut.items()})
        assert float(nc) == float(nw) > 0
        assert abs(float(lc) - float(lw)) <= 1e-6
    packed = SFTData.from_file(path, tok, seq_len=128, pack=True, val_fraction=0.0)
    assert packed.batch(0, 0, 2)["inputs"].shape == (1, 2, 128)  # packed rows stay whole


def test_fit_rows_rounds_up_and_never_grows():
    mask = np.zeros((2, 3, 100), np.float32)
    mask[1, 2, 40] = 1.0  # the last trained target anywhere in the batch: position 40
    batch = {"inputs": np.ones((2, 3, 100), np.int32), "mask": mask}
    assert fit_rows(batch)["mask"].shape == (2, 3, 64)
    mask[0, 0, 97] = 1.0
    assert fit_rows(batch)["inputs"].shape == (2, 3, 100)  # 128 > 100: the rows as they are
    assert fit_rows({"mask": np.ones((1, 31), np.float32)})["mask"].shape == (1, 31)


SMOLLM2_TEMPLATE = (  # SmolLM2-Instruct's template: a default system turn when none is given
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_smollm2_template_default_system_turn_is_not_trained():
    tok = FakeTokenizer(SMOLLM2_TEMPLATE, add_bos=False)
    ids, mask = tokenize_example(Example("f:1", prompt="hi", completion="hello"), tok, True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "hello<|im_end|>\n"
    assert mask == [0] * (len(ids) - 7) + [1] * 7


@pytest.mark.parametrize("last_role", ["assistant", "user"])
def test_train_turns_last_trains_the_positions_mlx_lm_trains(last_role):
    """--data.train-turns last on a 2-turn conversation (SmolLM2's template): the trained token
    positions are mlx-lm's (ChatDataset.process under --mask-prompt): every token from the
    offset, the length of the rendered messages[:-1] (with the generation prompt when the last
    role is the assistant's), to the end; the default trains both assistant turns."""
    tok = FakeTokenizer(SMOLLM2_TEMPLATE, add_bos=False)
    msgs = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "two"})
    if last_role == "user":
        msgs = (*msgs, {"role": "user", "content": "bye"})
    ex = Example("f:1", messages=msgs)
    # mlx-lm's rule, computed here: tokens of the whole render, offset of the prefix's
    theirs = tok.encode(tok.apply_chat_template(list(msgs), add_generation_prompt=False),
                        add_bos=False)
    offset = len(tok.encode(tok.apply_chat_template(
        list(msgs[:-1]), add_generation_prompt=msgs[-1]["role"] == "assistant"), add_bos=False))
    ids, mask = tokenize_example(ex, tok, True, turns="last")
    assert ids == theirs
    assert [i for i, m in enumerate(mask) if m] == list(range(offset, len(ids)))
    want = "two<|im_end|>\n" if last_role == "assistant" else "<|im_start|>user\nbye<|im_end|>\n"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == want
    assert offset == len(ids) - len(tok.encode(want, add_bos=False))
    ids2, every = tokenize_example(ex, tok, True)  # toymlx's default: every assistant turn
    assert ids2 == ids
    assert tok.decode([i for i, m in zip(ids, every, strict=True) if m]) == (
        "one<|im_end|>\ntwo<|im_end|>\n")
    assert tokenize_example(ex, tok, False, turns="last") == (ids, [1] * len(ids))


def test_data_folder_in_mlx_lm_layout(tmp_path):
    """train.jsonl / valid.jsonl / test.jsonl: each file is its split, none cut from another."""
    tok = FakeTokenizer(chat_template=None)
    folder = tmp_path / "data"
    folder.mkdir()
    for name, n in (("train", 6), ("valid", 2), ("test", 3)):
        write(folder, f"{name}.jsonl", "".join(
            json.dumps({"prompt": f"{name}{i}", "completion": "ab"}) + "\n" for i in range(n)))
    data = SFTData.from_file(folder, tok, seq_len=16, val_fraction=0.5)
    assert data.train["inputs"].shape == (6, 16) and data.val["inputs"].shape == (2, 16)
    assert data.test["inputs"].shape == (3, 16) and data.test_source == str(folder / "test.jsonl")
    assert str(data.source) == f"{folder / 'train.jsonl'} + {folder / 'valid.jsonl'}"
    # the first test row is BOS + "test0" + "ab" + EOS, completion and EOS trained
    assert tok.decode(data.test["targets"][0, :8].tolist()) == "test0ab</s>"
    assert data.test["mask"][0].sum() == 3
    # held-out batches hold HELD_OUT_ROWS (4) training batches' rows: the 3 test rows in one
    # batch even at batch size 1 (sft_val_batches' own test splits a short last batch off)
    assert HELD_OUT_ROWS == 4
    assert [b["inputs"].shape for b in data.test_batches(2)] == [(1, 3, 16)]
    assert [b["inputs"].shape for b in data.test_batches(1)] == [(1, 3, 16)]
    # with --grad-checkpoint a call holds one training batch's rows (memory the run saves)
    assert [b["inputs"].shape for b in data.test_batches(2, grad_checkpoint=True)] == [
        (1, 2, 16), (1, 1, 16)]
    # without valid.jsonl: the split of train.jsonl; without test.jsonl: no test rows
    (folder / "valid.jsonl").unlink()
    (folder / "test.jsonl").unlink()
    data = SFTData.from_file(folder, tok, seq_len=16, val_fraction=0.5)
    assert data.train["inputs"].shape == (3, 16) and data.val["inputs"].shape == (3, 16)
    assert data.test is None and data.test_batches(4) == []
    # said, since mlx-lm trains on all of train.jsonl without a valid.jsonl
    assert data.notes() == [(f"{folder}: no valid.jsonl: the last 3 of train.jsonl's 6 "
                             "examples validate and are not trained on (--data.val-fraction "
                             "0.5; mlx-lm trains on all 6 and validates nothing, as "
                             "--data.val-fraction 0 does)")]
    # a file given alone is split as documented, without a note
    assert SFTData.from_file(folder / "train.jsonl", tok, seq_len=16).notes() == []
    # --data.val-fraction 0 trains on all 6 and validates nothing, as mlx-lm: no note (it said
    # "the last 0 of train.jsonl's 6 examples validate and are not trained on")
    none = SplitExamples.of(folder, 0.0)
    assert (len(none.train), len(none.val), none.note) == (6, 0, None)
    # one held out: "the last 1 of train.jsonl's 6 examples validate and are" was said
    assert SplitExamples.of(folder, 0.1).note == (
        f"{folder}: no valid.jsonl: the last 1 of train.jsonl's 6 examples validates and is not "
        "trained on (--data.val-fraction 0.1; mlx-lm trains on all 6 and validates nothing, as "
        "--data.val-fraction 0 does)")


QA = [("What is 2+2, in words?", 'It is "four".'), ("List two fruits.", "apple,\npear"),
      ("", "an empty prompt trains the completion alone"), ("Say hi.", "hi")]
"""Prompts and completions with the commas, quotes and line breaks a CSV quotes."""


def _cell(value: str, sep: str) -> str:
    """`value` as RFC 4180 writes it: in double quotes (each doubled) where it needs them."""
    quote = any(c in value for c in (sep, '"', "\n"))
    return '"' + value.replace('"', '""') + '"' if quote else value


def _table(columns: list[str], rows: list[tuple[str, ...]], sep: str = ",",
           end: str = "\n") -> str:
    return "".join(sep.join(_cell(v, sep) for v in r) + end for r in [tuple(columns), *rows])


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.mark.parametrize("pack", [True, False])
def test_a_csv_or_tsv_table_gives_the_rows_of_the_same_records_as_jsonl(tmp_path, pack):
    """A .csv or .tsv file with a header was read as plain text (its lines one document, a
    note said); its rows are now the JSONL records of the same keys, through the same record
    reader: quoted commas, doubled quotes and a multi-line field, a tab-separated file with
    CRLF line ends, a UTF-8 BOM, Alpaca's columns, a text column, and unnamed or other
    columns (pandas' index) left out: the same tokenized rows, array for array."""
    tok = FakeTokenizer()
    records = [{"prompt": p, "completion": c} for p, c in QA]
    alpaca = [{"instruction": p, "input": i, "output": c}
              for (p, c), i in zip(QA, ("", "red ones", "", "x"))]
    texts = [{"text": c} for _, c in QA]
    cases = [
        ("qa.csv", _table(["prompt", "completion"], QA), records),
        ("qa.tsv", _table(["prompt", "completion"], QA, "\t", "\r\n"), records),
        ("bom.csv", "\ufeff" + _table(["prompt", "completion"], QA), records),
        ("alpaca.csv", _table(["instruction", "input", "output"],
                              [tuple(r.values()) for r in alpaca]), alpaca),
        ("text.csv", _table(["", "text", "source"], [(str(k), c, "web") for k, (_, c)
                                                     in enumerate(QA)]), texts),
    ]
    for name, table, same in cases:
        data = SFTData.from_file(write(tmp_path, name, table), tok, seq_len=96, pack=pack,
                                 val_fraction=0.25)
        want = SFTData.from_file(write(tmp_path, name + ".jsonl", _jsonl(same)), tok,
                                 seq_len=96, pack=pack, val_fraction=0.25)
        for split in ("train", "val"):
            got, ref = getattr(data, split), getattr(want, split)
            assert got.keys() == ref.keys() and len(ref["inputs"]), (name, split)
            for key in ref:
                np.testing.assert_array_equal(got[key], ref[key], err_msg=f"{name} {split} {key}")
        assert data.notes() == want.notes() == []  # no longer "read as plain text"
    ex = load_examples(tmp_path / "qa.csv")
    assert [(e.source, e.prompt, e.completion) for e in ex] == [
        (f"{tmp_path / 'qa.csv'}: row {r}", p, c) for r, (p, c) in zip((2, 3, 4, 5), QA)]
    assert load_examples(tmp_path / "bom.csv")[0].prompt == QA[0][0]
    assert [first_kind(tmp_path / n) for n in ("qa.tsv", "alpaca.csv", "text.csv")] == [
        "completion", "completion", "text"]


def test_a_table_s_rows_are_numbered_as_a_spreadsheet_shows_them(tmp_path):
    """Row 1 is the header; a quoted field's line breaks stay in its row; blank rows and rows
    of empty fields count, and are skipped as blank JSONL lines are."""
    path = write(tmp_path, "qa.csv", 'prompt,completion\n"a\nb","c\n\nd"\n\n,\nx,y\n')
    assert [(e.source, e.prompt, e.completion) for e in load_examples(path)] == [
        (f"{path}: row 2", "a\nb", "c\n\nd"), (f"{path}: row 5", "x", "y")]


@pytest.mark.parametrize("name, table, want", [
    ("qa.csv", "question,answer\nq,a\n",
     ("row 1 (the header): expected the columns of one record shape (text; prompt and "
     "completion; or Alpaca's instruction, input (optional) and output; others are ignored), "
     "found ['question', 'answer']")),
    ("qa.csv", "text,prompt,completion\nt,p,c\n",
     ("row 1 (the header): expected the columns of one record shape (text; prompt and "
     "completion; or Alpaca's instruction, input (optional) and output; others are ignored), "
     "found ['text', 'prompt', 'completion']")),
    ("chat.csv", 'id,messages\n1,"[{""role"": ""user""}]"\n',
     ('row 1 (the header): column "messages": chat turns need JSON, not a CSV cell; write the '
     'examples as JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} a line')),
    ("chat.tsv", "conversations\nx\n",
     ('row 1 (the header): column "conversations": chat turns need JSON, not a TSV cell; write '
     'the examples as JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} a line')),
    ("qa.csv", "prompt,text,prompt\na,b,c\n",
     'row 1 (the header): expected each column once, found "prompt" twice'),
    ("qa.csv", "prompt,completion\na,b\nWhat is 1,2?,3\n",
     ('row 3: expected 2 fields (prompt, completion), found 3: field 3 is past the last column '
     '("completion"); a field that holds a comma goes in double quotes')),
    ("qa.csv", "prompt;completion\na;b\n",
     ("row 1 (the header): expected the columns of one record shape (text; prompt and "
      "completion; or Alpaca's instruction, input (optional) and output; others are ignored), "
      "found ['prompt;completion']: one column holding ';', where a .csv's columns are "
      "separated by commas; save it with commas (or tabs, as a .tsv)")),
    ("qa.csv", "prompt\tcompletion\na\tb\n",
     ("row 1 (the header): expected the columns of one record shape (text; prompt and "
      "completion; or Alpaca's instruction, input (optional) and output; others are ignored), "
      "found ['prompt\\tcompletion']: one column holding '\\t', where a .csv's columns are "
      "separated by commas; name it .tsv")),
    ("qa.tsv", ",prompt\tcompletion\n0\tp\tc\nno tab\n",
     ("row 1 (the header): expected the columns of one record shape (text; prompt and "
     "completion; or Alpaca's instruction, input (optional) and output; others are ignored), "
     "found [',prompt', 'completion']")),
    ("text.csv", "text\na\nb,c\n",
     ('row 3: expected 1 field (text), found 2: field 2 is past the last column ("text"); a '
      "field that holds a comma goes in double quotes")),
    ("qa.tsv", "\tprompt\tcompletion\n0\tp\tc\n1\tline\n",
     ('row 3: expected 3 fields ((unnamed), prompt, completion), found 2: none for column '
     '"completion"; a field that holds a line break goes in double quotes')),
    ("qa.csv", "prompt,completion\na,b\n\nc, \n",
     "row 4: expected column \"completion\" to be a non-empty string, found ' '"),
    ("text.csv", "text,id\n,7\nb,8\n",
     "row 2: expected column \"text\" to be a non-empty string, found ''"),
    ("alpaca.csv", "instruction,input,output\nAdd,2 3,\n",
     "row 2: expected column \"output\" (Alpaca's) to be a non-empty string, found ''"),
    ("qa.csv", 'prompt,completion\na,b\nc,"d\ne\n',
     ('row 3 (from line 3): bad CSV (unexpected end of data); a field that holds a comma, a '
     'double quote or a line break goes in double quotes, each double quote in it doubled: '
     '"say ""hi"""')),
    ("qa.csv", 'prompt,completion\n"a" b,c\n',
     ('row 2 (from line 2): bad CSV (\',\' expected after \'"\'); a field that holds a comma, a '
     'double quote or a line break goes in double quotes, each double quote in it doubled: '
     '"say ""hi"""')),
    ("qa.csv", ",,\n\n,\n", ("expected a CSV header row (text; prompt and completion; or "
                               "Alpaca's instruction, input (optional) and output), found only "
                               "empty rows")),
    ("qa.csv", "prompt,completion\n\n", ("no examples; expected rows after the header (row 1), "
     "found none")),
])
def test_a_table_s_errors_name_its_file_row_and_column(tmp_path, name, table, want):
    path = write(tmp_path, name, table)
    # the header and first row's errors the same before the run (mlx-lm's mask_prompt check)
    for read in (load_examples, *[first_kind] * (not want.startswith(("row 3", "row 4")))):
        with pytest.raises(DataError) as e:
            read(path)
        assert str(e.value) == f"{path}: {want}"


def test_a_table_cell_past_csv_s_field_limit_is_read_whole(tmp_path):
    """A cell of a long document (300,000 characters, over Python csv's 131,072) was refused as
    "bad CSV (field larger than field limit (131072))"; it is read whole, and csv's limit, a
    setting of the whole process, is the same after (and between the rows of a paused
    read) as before."""
    import csv

    before = csv.field_size_limit()
    long = "".join(chr(ord("a") + i % 26) for i in range(300_000))
    for name, sep in (("long.csv", ","), ("long.tsv", "\t")):
        path = write(tmp_path, name, _table(["text", "id"], [(long, "1"), ("short", "2")], sep))
        ex = load_examples(path)
        assert [(e.source, len(e.text)) for e in ex] == [(f"{path}: row 2", 300_000),
                                                         (f"{path}: row 3", 5)]
        assert ex[0].text == long and first_kind(path) == "text"
        assert csv.field_size_limit() == before
    rows = chat._table_examples(path, chat._lines([path.read_text()]))
    assert next(rows).text == long and csv.field_size_limit() == before  # paused after a row
    rows.close()


def test_an_empty_alpaca_output_is_named_as_written(tmp_path):
    """An empty Alpaca "output" was refused as an empty "completion", a key the file never had."""
    bad = write(tmp_path, "alpaca.jsonl", _jsonl([{"instruction": "x", "output": " "}]))
    with pytest.raises(DataError) as e:
        load_examples(bad)
    assert str(e.value) == f"{bad}:1: expected \"output\" (Alpaca's) to be a non-empty string, found ' '"


def test_split_files_are_kept_apart_not_parsed_from_the_display(tmp_path):
    """Each split names its own file where a path holds " + " (the shown "TRAIN + VALID"
    joins them): it was split back out of that text, so a folder "chat + more" without
    valid.jsonl named "more/train.jsonl" as its validation file, and a file "a + b.jsonl"
    given with "c + d.jsonl" named "a" and "d.jsonl"."""
    tok = FakeTokenizer(chat_template=None)
    rows = "".join(json.dumps({"prompt": f"p{i}", "completion": "ab"}) + "\n" for i in range(4))
    folder = tmp_path / "chat + more"
    folder.mkdir()
    write(folder, "train.jsonl", rows)
    data = SFTData.from_file(folder, tok, seq_len=16, val_fraction=0.5)
    train = str(folder / "train.jsonl")
    assert data.split_source("train") == data.split_source("validation") == train
    assert str(data.source) == train
    write(tmp_path, "a + b.jsonl", rows)
    write(tmp_path, "c + d.jsonl", rows)
    data = SFTData.from_file(tmp_path / "a + b.jsonl", tok, seq_len=16,
                             val_path=tmp_path / "c + d.jsonl")
    assert data.split_source("train") == str(tmp_path / "a + b.jsonl")
    assert data.split_source("validation") == str(tmp_path / "c + d.jsonl")
    assert str(data.source) == f"{tmp_path / 'a + b.jsonl'} + {tmp_path / 'c + d.jsonl'}"
    ex = SplitExamples.of(folder, 0.5)
    assert ex.source == DataSource(train) and ex.source.of("validation") == train


def test_an_empty_valid_jsonl_is_one_line(tmp_path):
    """An empty valid.jsonl (which mlx-lm trains without) is named with what to do, not as
    'empty file; expected UTF-8 text'."""
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "train.jsonl", json.dumps({"text": "abc"}) + "\n")
    write(folder, "valid.jsonl", "")
    with pytest.raises(DataError) as e:
        SFTData.from_file(folder, FakeTokenizer(chat_template=None), seq_len=16)
    assert str(e.value) == (
        f"{folder / 'valid.jsonl'}: empty file; expected one example a line "
        '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}, or no '
        "valid.jsonl (the last --data.val-fraction 0.1 of train.jsonl then validates; mlx-lm "
        "would train without validation)")
    write(folder, "valid.jsonl", "\n \n\n")  # blank lines alone: the same words
    with pytest.raises(DataError) as blank:
        SplitExamples.of(folder)
    assert str(blank.value) == str(e.value)


@pytest.mark.parametrize("text", ["", "\n\n", "\ufeff \n\t\n"])
def test_an_empty_valid_jsonl_under_val_fraction_0_is_no_valid_jsonl(tmp_path, text):
    """Under --data.val-fraction 0 (an mlx-lm config's) a valid.jsonl without examples (no byte,
    blank lines) was refused; mlx-lm trains on every example and validates none, as
    --data.val-fraction 0 does without valid.jsonl: the same split, source and no note."""
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "train.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in "abc"))
    alone = SplitExamples.of(folder, 0.0)
    write(folder, "valid.jsonl", text)
    ex = SplitExamples.of(folder, 0.0)
    assert ex == alone
    assert ([e.text for e in ex.train], ex.val, ex.note) == (["a", "b", "c"], [], None)
    assert ex.source == DataSource(str(folder / "train.jsonl"))


@pytest.mark.parametrize("pack", [True, False])
def test_a_data_folder_of_tables_gives_the_rows_of_its_jsonl_files(tmp_path, pack):
    """A data folder holding train.csv (valid.tsv, test.json) where mlx-lm's has train.jsonl
    was refused ("expected train.jsonl"); each split's file is read as that file alone is: the
    same rows, array for array, as the folder of the same records in JSONL, and the note of a
    folder without a validation file names train.csv."""
    tok = FakeTokenizer(chat_template=None)
    split_rows = {name: [(f"{name} {i}, quoted", f'"{i}"\nok') for i in range(n)]
                  for name, n in (("train", 6), ("valid", 2), ("test", 3))}
    tables, jsonl = tmp_path / "tables", tmp_path / "jsonl"
    tables.mkdir()
    jsonl.mkdir()
    write(tables, "train.csv", _table(["prompt", "completion"], split_rows["train"]))
    write(tables, "valid.tsv", _table(["instruction", "output"], split_rows["valid"], "\t"))
    write(tables, "test.json", json.dumps([{"prompt": p, "completion": c}
                                           for p, c in split_rows["test"]]))
    for name, rows in split_rows.items():
        write(jsonl, f"{name}.jsonl", _jsonl([{"prompt": p, "completion": c} for p, c in rows]))
    assert data_files(tables) == DataFiles(tables / "train.csv", tables / "valid.tsv",
                                           tables / "test.json")
    for drop in ((), ("valid",)):
        for folder in (tables, jsonl):
            for f in folder.iterdir():
                if f.stem in drop:
                    f.unlink()
        data = SFTData.from_file(tables, tok, seq_len=32, pack=pack, val_fraction=0.5)
        want = SFTData.from_file(jsonl, tok, seq_len=32, pack=pack, val_fraction=0.5)
        for split in ("train", "val", "test"):
            got, ref = getattr(data, split), getattr(want, split)
            assert len(ref["inputs"]), split
            for key in ref:
                np.testing.assert_array_equal(got[key], ref[key], err_msg=f"{split} {key}")
    assert data.test_source == str(tables / "test.json")
    assert data.notes() == [(f"{tables}: no valid.jsonl: the last 3 of train.csv's 6 examples "
                             "validate and are not trained on (--data.val-fraction 0.5; mlx-lm "
                             "trains on all 6 and validates nothing, as --data.val-fraction "
                             "0 does)")]


def test_a_split_given_twice_in_a_data_folder_is_one_line(tmp_path):
    """train.jsonl beside train.csv: which one trains would be a guess, so neither does."""
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "train.jsonl", '{"text": "a"}\n')
    write(folder, "train.csv", "text\nb\n")
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder}: data folder: expected one train file, found train.jsonl "
                            "and train.csv; keep the one to read and move the other out")
    write(folder, "valid.json", "[]")
    write(folder, "valid.tsv", "text\nc\n")
    write(folder, "valid.jsonl", "")
    (folder / "train.jsonl").unlink()
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder}: data folder: expected one valid file, found valid.jsonl, "
                            "valid.json and valid.tsv; keep the one to read and move the "
                            "others out")


def test_data_folder_without_train_jsonl_is_one_line(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "training.jsonl", "{}")
    write(folder, "valid.jsonl", "{}")
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder}: data folder: expected train.jsonl (required), "
                            "valid.jsonl and test.jsonl (optional) (mlx-lm's layout; .json, "
                            ".csv or .tsv in place of .jsonl), found training.jsonl, valid.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="found an empty folder"):
        data_files(tmp_path / "empty")


def test_an_image_folder_given_as_text_data_is_named_as_one(tmp_path):
    """`toymlx-eval --model LLAMA_RUN --data.path imgs` (class folders of images) said "found
    cat, dog", as if those were misnamed splits; it now says what the folder is and what reads
    it, as an image file given as text is told."""
    folder = tmp_path / "imgs"
    for cls in ("dog", "cat"):
        (folder / cls).mkdir(parents=True)
        write(folder / cls, "0.PNG", "x")
    (folder / "notes").mkdir()  # no images: not a class
    write(folder / "notes", "a.txt", "x")
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder}: data folder: expected train.jsonl (required), "
                            "valid.jsonl and test.jsonl (optional) (mlx-lm's layout; .json, "
                            ".csv or .tsv in place of .jsonl), found an image folder (class "
                            "folders cat, dog): images train a classifier, toymlx-train --recipe "
                            "vit-tiny --data.path FOLDER (a subfolder of images per class)")


def test_data_folder_of_text_files_says_to_join_them(tmp_path):
    """A folder of notes (.txt, .md) as --data.path read only "expected train.jsonl ...,
    found a.txt, b.md": the one text file it takes, and the command that makes it, named (the
    text recipes read such a folder as one text; a fine-tune's examples are a file's)."""
    folder = tmp_path / "my notes"
    folder.mkdir()
    for name in ("b.md", "a.txt", "c.TXT", "d.png"):
        write(folder, name, "text")
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder}: data folder: expected train.jsonl (required), "
                            "valid.jsonl and test.jsonl (optional) (mlx-lm's layout; .json, "
                            ".csv or .tsv in place of .jsonl), found a.txt, b.md, c.TXT, d.png; "
                            "a folder of text files is one text to from-scratch and warm-start, "
                            f"not examples: join them into one file (cat '{folder}'/*.TXT "
                            f"'{folder}'/*.md '{folder}'/*.txt > all.txt) and give --data.path "
                            "all.txt")


def test_a_data_folder_s_files_are_named_up_to_six(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(8):
        write(folder, f"part-{i}.jsonl", "{}")
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value).endswith("in place of .jsonl), found part-0.jsonl, part-1.jsonl, "
                                 "part-2.jsonl, part-3.jsonl, part-4.jsonl, part-5.jsonl and "
                                 "2 more")


@pytest.mark.parametrize("name", ["val.jsonl", "Valid.jsonl", "validation.jsonl", "val.csv",
                                  "Train.tsv"])
def test_a_jsonl_file_a_data_folder_would_not_read_is_named(tmp_path, name):
    """A misnamed validation file (mlx-lm refuses the folder: no valid.jsonl) was left out
    without a word: the run held out a slice of train.jsonl instead, or nothing
    ("held-out: n/a"). Now it is named; other files (a README) are not examples."""
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "train.jsonl", '{"text": "a"}\n')
    write(folder, "README.md", "about the data")
    assert data_files(folder) == DataFiles(folder / "train.jsonl")
    write(folder, name, '{"text": "b"}\n')
    with pytest.raises(DataError) as e:
        data_files(folder)
    assert str(e.value) == (f"{folder / name}: data folder: expected only train.jsonl "
                            "(required), valid.jsonl and test.jsonl (optional) (mlx-lm's "
                            "layout; .json, .csv or .tsv in place of .jsonl), found "
                            f"{name} too, which would not be read; rename it (valid.jsonl: the "
                            "validation examples) or move it out")


NAMED = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n"
         "{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with a message's `name` after its role, as Kimi-K3's and StepFun's templates read it."""


def test_other_message_keys_reach_the_template_as_transformers_hands_them(tmp_path):
    """transformers and mlx-lm hand a chat template each message whole: a key it reads (a
    user's `name`) is rendered, one it reads nowhere (`id`, `weight`) changes nothing; a null
    one is left out, as transformers leaves it. A reasoning field that is no string is a
    one-line error naming the file, line and key."""
    record = {"messages": [{"role": "user", "content": "Hi", "name": "Ann", "id": 7},
                           {"role": "assistant", "content": "Hello.", "weight": 0,
                            "reasoning": None}]}
    (ex,) = load_examples(write(tmp_path, "named.jsonl", json.dumps(record) + "\n"))
    assert ex.messages == ({"role": "user", "content": "Hi", "name": "Ann", "id": 7},
                           {"role": "assistant", "content": "Hello.", "weight": 0})
    tok = FakeTokenizer(NAMED, add_bos=False)
    ids, mask = tokenize_example(ex, tok, mask_prompt=True)
    assert tok.decode(ids) == ("<|im_start|>user Ann\nHi<|im_end|>\n<|im_start|>assistant\n"
                               "Hello.<|im_end|>\n")
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "Hello.<|im_end|>\n"
    for key, value, found in (("reasoning_content", ["a"], 'array ["a"]'),
                              ("thinking", 5, "number 5"), ("reasoning", {}, "object with keys []")):
        record["messages"][1][key] = value
        path = write(tmp_path, "bad.jsonl", '{"text": "x"}\n' + json.dumps(record) + "\n")
        with pytest.raises(DataError) as err:
            load_examples(path)
        assert str(err.value) == (f'{path}:2: expected "messages[1].{key}" to be a string, '
                                  f"found {found}")
        del record["messages"][1][key]


TOOLS_TEMPLATE = (  # a template that lists the tools first, as Qwen2.5's and Llama 3.1's do
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_drop_tools_trains_what_a_record_without_tools_trains(tmp_path):
    """"tools" on a template that never reads them were refused, the only way on editing every
    record (--data.keys renames none); mlx-lm drops them unsaid. The refusal names
    --data.drop-tools, which leaves them out with a line saying how many: the rows of the
    records without "tools", token for token."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    plain = [{"messages": [{"role": "user", "content": f"Weather {i}?"},
                           {"role": "assistant", "content": f"Sunny {i}."}]} for i in range(6)]
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder, "train.jsonl", "".join(json.dumps({**r, "tools": [tool]} if i % 2 else r) + "\n"
                                         for i, r in enumerate(plain[:4])))
    write(folder, "valid.jsonl", "".join(json.dumps({**r, "tools": [tool]}) + "\n"
                                         for r in plain[4:]))
    tok = FakeTokenizer(CHATML)
    with pytest.raises(DataError) as e:
        SFTData.from_file(folder, tok, seq_len=64)
    assert str(e.value) == (
        f'{folder / "train.jsonl"}:2: "tools": expected a chat template that renders tools, '
        "found one that never reads them (mlx-lm drops them unsaid); give --data.drop-tools to "
        "leave every example's \"tools\" out (a line says how many), or use a base whose "
        "template takes tools")
    dropped = SFTData.from_file(folder, tok, seq_len=64, drop_tools=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    write(bare, "train.jsonl", "".join(json.dumps(r) + "\n" for r in plain[:4]))
    write(bare, "valid.jsonl", "".join(json.dumps(r) + "\n" for r in plain[4:]))
    want = SFTData.from_file(bare, tok, seq_len=64)
    for split in ("train", "val"):
        for k in ("inputs", "targets", "mask"):
            np.testing.assert_array_equal(getattr(dropped, split)[k], getattr(want, split)[k])
    assert dropped.notes() == [(
        f'{folder / "train.jsonl"} + {folder / "valid.jsonl"}: --data.drop-tools: the "tools" '
        "(function schemas) of 4 examples left out, not rendered by the chat template")]
    assert want.notes() == []


def test_drop_tools_counts_the_test_file_only_where_it_is_read(tmp_path):
    """--data.drop-tools' line counted test.jsonl's examples in a run without --test, which
    never scores them, under a name (train + valid) that left the file out; now only with
    --test, naming it."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    rows = [json.dumps({"messages": [{"role": "user", "content": f"Weather {i}?"},
                                     {"role": "assistant", "content": f"Sunny {i}."}],
                        "tools": [tool]}) + "\n" for i in range(9)]
    folder = tmp_path / "data"
    folder.mkdir()
    for name, part in (("train", rows[:4]), ("valid", rows[4:6]), ("test", rows[6:])):
        write(folder, f"{name}.jsonl", "".join(part))
    data = SFTData.from_file(folder, FakeTokenizer(CHATML), seq_len=64, drop_tools=True)
    said = '--data.drop-tools: the "tools" (function schemas) of {} examples left out, not ' \
        "rendered by the chat template"
    files = f'{folder / "train.jsonl"} + {folder / "valid.jsonl"}'
    assert data.notes(test=False) == [f"{files}: {said.format(6)}"]
    assert data.notes(test=True) == [f'{files} + {folder / "test.jsonl"}: {said.format(9)}']


def test_tools_field_reaches_the_template(tmp_path):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    record = {"messages": [{"role": "user", "content": "Weather?"},
                           {"role": "assistant", "tool_calls": [call]},
                           {"role": "tool", "name": "get_weather", "content": "sun"},
                           {"role": "assistant", "content": "Sunny."}], "tools": [tool]}
    path = write(tmp_path, "tools.jsonl", json.dumps(record) + "\n")
    (ex,) = load_examples(path)
    assert ex.tools == (tool,) and ex.messages[1] == {"role": "assistant", "content": "",
                                                      "tool_calls": [call]}
    tok = FakeTokenizer(TOOLS_TEMPLATE, add_bos=False)
    ids, mask = tokenize_example(ex, tok, mask_prompt=True)
    assert tok.decode(ids) == ("<|im_start|>system\nget_weather;<|im_end|>\n<|im_start|>user\n"
                               "Weather?<|im_end|>\n<|im_start|>assistant\ncall get_weather"
                               "<|im_end|>\n<|im_start|>tool\nsun<|im_end|>\n<|im_start|>"
                               "assistant\nSunny.<|im_end|>\n")
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "call get_weather<|im_end|>\nSunny.<|im_end|>\n"
    with pytest.raises(DataError, match=r'tools\.jsonl:1: "tools": expected a chat template '
                                        r"that renders tools, found one that never reads them"):
        tokenize_example(ex, FakeTokenizer(CHATML), mask_prompt=True)
    # without "tools", a template that never reads tool_calls would train an empty answer
    calls_only = write(tmp_path, "calls.jsonl", json.dumps({"messages": record["messages"]}))
    (ex,) = load_examples(calls_only)
    with pytest.raises(DataError, match=r"calls\.jsonl:1: messages\[1\]\.tool_calls: expected a "
                                        r"chat template that renders tool calls"):
        tokenize_example(ex, FakeTokenizer(CHATML), mask_prompt=True)
    bad = write(tmp_path, "bad.jsonl", json.dumps({**record, "tools": "get_weather"}))
    with pytest.raises(DataError, match=r'bad\.jsonl:1: expected "tools" to be an array of '
                                        r"function objects, found string"):
        load_examples(bad)


def test_unpacked_runs_meet_their_widest_batch_at_step_0(tmp_path):
    """Unpacked, step 0's batch holds the row that trains farthest, so the run's widest batch
    (and its peak memory) comes first; epoch 0 still draws every row once, later epochs and
    packed runs draw as before, and `batch_widths` names each batch's width."""
    lines = [json.dumps({"prompt": f"q{i}", "completion": "a" * (9 * (i % 7) + 1)})
             for i in range(40)]
    path = write(tmp_path, "train.jsonl", "\n".join(lines))
    tok = FakeTokenizer(chat_template=None)
    data = SFTData.from_file(path, tok, seq_len=128, val_fraction=0.0)
    ends = [int(np.flatnonzero(m)[-1]) + 1 for m in data.train["mask"]]
    longest = int(np.argmax(ends))
    assert data.first_row == longest
    assert drawn_rows(40, np.arange(4), 5, longest)[0] == longest
    assert longest not in drawn_rows(40, np.arange(4), 5).tolist()  # seed 5 drew it later
    widths = [data.batch(s, 5, 4)["inputs"].shape[-1] for s in range(30)]
    assert widths[0] == -(-max(ends) // 32) * 32 == max(widths) > min(widths)
    drawn = np.concatenate([drawn_rows(40, np.arange(s * 4, s * 4 + 4), 5, longest)
                            for s in range(10)])
    assert sorted(drawn.tolist()) == list(range(40))  # epoch 0: every row once
    np.testing.assert_array_equal(drawn_rows(40, np.arange(40, 80), 5, longest),
                                  drawn_rows(40, np.arange(40, 80), 5))  # epoch 1 as before
    np.testing.assert_array_equal(data.batch_widths(range(30), 5, 4), widths)
    packed = SFTData.from_file(path, tok, seq_len=128, pack=True, val_fraction=0.0)
    assert packed.first_row is None
    np.testing.assert_array_equal(packed.batch(0, 5, 2)["inputs"],
                                  sft_batch(packed.train, 0, 5, 2)["inputs"])


def test_the_first_kind_of_an_example_file_is_read_no_further_than_its_first_example(
        tmp_path):
    """`first_kind` stops where the first example ends: a byte no UTF-8 reader takes, three
    blocks further on, is not met (`load_examples` meets it); each format's first example."""
    big = tmp_path / "train.jsonl"
    big.write_bytes(b"\n" + json.dumps({"text": "one"}).encode() + b"\n"
                    + b"x" * (3 * FIRST_BYTES) + b"\xff\n")
    assert first_kind(big) == "text"
    with pytest.raises(DataError, match="not valid UTF-8"):
        load_examples(big)
    chat_row = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    files = {"a.jsonl": f"\n{chat_row}\nnot json",
             "b.json": '[{"prompt": "p", "completion": "c"}, ', "c.txt": "\n\nsome prose\n", "d.jsonl": json.dumps({"text": "no newline"})}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert {n: first_kind(tmp_path / n) for n in files} == {
        "a.jsonl": "messages", "b.json": "completion", "c.txt": "text", "d.jsonl": "text"}
    (tmp_path / "e.jsonl").write_text("{bad\n" + chat_row + "\n")  # as load_examples says it
    with pytest.raises(DataError) as e:
        first_kind(tmp_path / "e.jsonl")
    with pytest.raises(DataError) as whole:
        load_examples(tmp_path / "e.jsonl")
    assert str(e.value) == str(whole.value)


# ------------------------------------------------------------------- large files


def _chat_rows(n: int) -> list[str]:
    """`n` JSONL chat rows with characters of 1 to 4 UTF-8 bytes (one past U+FFFF)."""
    return [json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Question {i}: café, 日本語 or 🙂?"},
        {"role": "assistant", "content": f"Answer {i}: {'naïve ' * (i % 7)}über 🙂."}]},
        ensure_ascii=False) for i in range(n)]


def test_files_read_in_small_blocks_give_the_examples_and_rows_of_one_read(tmp_path,
                                                                          monkeypatch):
    """`load_examples` reads a JSONL or plain-text file a block at a time, parsing each line as
    it comes: reads of 5 bytes (lines and characters cut across reads) give the examples,
    sources and errors of one read of the whole file, and `SFTData.from_file` the rows and
    fits the examples' ids and masks give as lists in one `pack_or_pad` call."""
    import toymlx.data.text as text_mod

    rows = _chat_rows(12)
    files = {
        "train.jsonl": "\ufeff" + "\n".join(rows[:5]) + "\n\n  \r\n" + "\r\n".join(rows[5:]),
        "notes.txt": "first doc 🙂\r\nline two\n\n \npara 日本\n\n\n\nend",
        "arr.json": "  \n\n[\n" + ",\n".join(rows[:3]) + "\n]\n",
        "bad.jsonl": "\n".join(rows[:4]) + '\n{"messages": 3}\n',
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")

    def load_all() -> dict:
        out = {}
        for name in files:
            try:
                out[name] = load_examples(tmp_path / name)
            except DataError as e:
                out[name] = str(e)
        return out

    whole = load_all()
    monkeypatch.setattr(text_mod, "READ_BYTES", 5)
    assert load_all() == whole
    assert [e.source.rsplit(":", 1)[1] for e in whole["train.jsonl"]] == [
        "1", "2", "3", "4", "5", *map(str, range(8, 15))]
    assert [e.text for e in whole["notes.txt"]] == ["first doc 🙂\nline two", "para 日本", "end"]
    assert whole["bad.jsonl"] == (f'{tmp_path / "bad.jsonl"}:5: expected "messages" to be a '
                                  "non-empty array of {\"role\", \"content\"} objects, found "
                                  "number 3")

    tok = FakeTokenizer()
    examples = whole["train.jsonl"]
    seqs = [tokenize_example(e, tok, True) for e in examples]
    for pack in (False, True):
        data = SFTData.from_file(tmp_path / "train.jsonl", tok, 100, pack=pack, val_fraction=0.0)
        want = pack_or_pad(seqs, 100, tok.eos_id, pack)
        assert data.train.keys() == want.keys()
        for key in want:
            assert data.train[key].dtype == want[key].dtype
            np.testing.assert_array_equal(data.train[key], want[key])
        assert data.fits["train"] == Fit.of(seqs, 100, pack)
        assert data.fits["train"].truncated == (0 if pack else 10)


def test_a_jsonl_file_is_never_held_whole_while_its_examples_are_read(tmp_path, monkeypatch):
    """The text of a 100 MB train.jsonl was read whole, then split into a list of its lines,
    before one example was parsed: 1 GB at the peak for 100,000 chat rows (a character past
    U+FFFF makes Python hold every character in 4 bytes). Read a block at a time, what is held
    besides the examples is a few blocks and their list, not the file: here under a quarter of
    its size (the whole text and its lines were 7.7 times it)."""
    import tracemalloc

    import toymlx.data.text as text_mod

    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(_chat_rows(3000)) + "\n", encoding="utf-8")
    size = path.stat().st_size
    monkeypatch.setattr(text_mod, "READ_BYTES", 1 << 13)
    tracemalloc.start()
    try:
        examples = load_examples(path)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(examples) == 3000
    assert peak - held < size / 4, (peak - held, size)


def test_tokenized_examples_are_held_as_compact_arrays(monkeypatch):
    """Every example's ids and mask stay held until all rows are built; as lists of Python ints
    they took 16 bytes a token at least (8 a pointer each, 28 more an id past 256), and
    `pack_or_pad` copied them all again (int64 and float32) while it built the rows. Held as
    int32 and uint8, each token costs 5 bytes, and building rows from them copies none: the
    peak is the held ids and masks, the (N, seq_len + 1) buffers and the rows (12 bytes a
    position each), within 10% (here 2.6 MB; the old path took 5.3 MB)."""
    import tracemalloc

    from toymlx.data.chat import fitted_rows

    tok = FakeTokenizer(chat_template=None)
    examples = [Example(f"f:{i}", prompt="q" * 40, completion=f"{i:04d}" * 40)
                for i in range(400)]
    seq_len = 255
    tracemalloc.start()
    try:
        rows, fit = fitted_rows(examples, tok, seq_len, True, False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tokens = 400 * (1 + 40 + 160 + 1)
    assert fit.examples == 400 and rows["inputs"].shape == (400, seq_len)
    assert peak < 1.1 * (5 * tokens + 2 * 12 * 400 * (seq_len + 1)), (peak, tokens)


class _Terminal:
    """A stderr that is a terminal, keeping what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_tokenizing_shows_a_bar_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    """Tokenizing 100,000 conversations took two minutes of silence on a terminal; with
    `progress` each split's examples get a bar there (gone when they are done), and nothing is
    written where stderr is a file or pipe, or without `progress`."""
    import sys

    path = write(tmp_path, "train.jsonl", "\n".join(_chat_rows(10)))
    tok = FakeTokenizer()
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    SFTData.from_file(path, tok, 100, val_fraction=0.2, progress=True)
    assert "tokenizing training examples:   0%" in term.text and "0/8" in term.text
    assert "tokenizing validation examples:   0%" in term.text and "0/2" in term.text
    assert term.text.endswith("\r")  # the bar cleared: the run's own lines follow on a clean line
    term.text = ""
    SFTData.from_file(path, tok, 100, val_fraction=0.2)
    assert term.text == ""
    monkeypatch.undo()
    SFTData.from_file(path, tok, 100, val_fraction=0.2, progress=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("pack", [True, False])
def test_fitted_rows_first_are_the_first_of_all_rows_from_the_fewest_examples(pack):
    """`fitted_rows(first=N)` (toymlx-eval --max-examples) gives the first N of the rows every
    example makes, packed or padded, with examples that make no row among them (no completion
    under mask_prompt; a prompt longer than the row), and tokenizes no example after the one
    that completes them: `Fit` counts those tokenized."""
    from toymlx.data.chat import fitted_rows

    tok = FakeTokenizer(chat_template=None)
    seq_len = 16
    examples = [Example(f"f:{i}", prompt="q" * (3 + 29 * (i % 7 == 3)),
                        completion="" if i % 5 == 2 else f"a{i}" * (1 + i % 4))
                for i in range(60)]
    whole, _ = fitted_rows(examples, tok, seq_len, True, pack)
    assert len(whole["inputs"]) > 20

    def same(i: int, n: int) -> bool:  # the first i examples' rows begin with the first n
        part = fitted_rows(examples[:i], tok, seq_len, True, pack)[0]
        return len(part["inputs"]) >= min(n, len(whole["inputs"])) and all(
            np.array_equal(part[k][:n], v[:n]) for k, v in whole.items())

    for n in (1, 2, 5, 13, len(whole["inputs"]), 10**6):
        rows, fit = fitted_rows(examples, tok, seq_len, True, pack, first=n)
        for k, v in whole.items():
            np.testing.assert_array_equal(rows[k], v[:n], err_msg=f"{k}, first={n}")
        # more rows than all make: every example is tokenized to find that out
        assert fit.examples == (60 if n > len(whole["inputs"]) else
                                next(i for i in range(1, 61) if same(i, n))), n


class BatchFakeTokenizer(FakeTokenizer):
    """`FakeTokenizer` with `encode_batch`, as `Tokenizer` has it, counting its calls."""

    def __init__(self, chat_template: str | None = CHATML) -> None:
        super().__init__(chat_template)
        self.calls: list[tuple[int, bool | None]] = []

    def encode_batch(self, texts: list[str], add_bos: bool | None = None) -> list[np.ndarray]:
        self.calls.append((len(texts), add_bos))
        return [np.array(self.encode(t, add_bos), np.int32) for t in texts]


VARIED = [
    Example("v:1", messages=({"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "café 日本語 🙂?"},
                             {"role": "assistant", "content": "Oui, naïve 🙂."})),
    Example("v:2", text="plain text <|im_end|> with a special"),
    Example("v:3", messages=({"role": "user", "content": ""},
                             {"role": "assistant", "content": ""},
                             {"role": "user", "content": "again"},
                             {"role": "assistant", "content": "a\n\nb"},
                             {"role": "tool", "content": "{}"})),
    Example("v:4", messages=({"role": "user", "content": "no answer"},)),
    Example("v:5", text="x" * 70),
    Example("v:6", messages=({"role": "user", "content": "q"},
                             {"role": "assistant", "content": "long " * 20})),
    Example("v:7", text="ü"),
]


@pytest.mark.parametrize("mask_prompt", [True, False])
@pytest.mark.parametrize("turns", ["assistant", "last"])
@pytest.mark.parametrize("pack", [False, True])
def test_examples_tokenized_together_give_each_example_s_own_ids_and_mask(
        monkeypatch, mask_prompt, turns, pack):
    """`fitted_rows` tokenizes examples a batch at a time, with one `encode_batch` call for
    the pieces of each `add_bos` in a batch (SmolLM2's chat examples: 1.3 ms each, one call a
    piece): the rows and their fit are those of each example tokenized alone (`tokenize_example`
    with a tokenizer that has no `encode_batch`), for chat, text and completion examples mixed
    in one batch (their pieces encoded with and without BOS), batches cut mid-list."""
    import toymlx.data.chat as chat_mod

    monkeypatch.setattr(chat_mod, "TOKENIZE_EXAMPLES", 3)
    for template, examples in ((CHATML, VARIED), (None, [
            Example("c:1", prompt="2+2?", completion="4"), Example("c:2", text="text"),
            Example("c:3", prompt="", completion="é"), Example("c:4", prompt="q" * 30,
                                                              completion="a" * 30)])):
        alone = [tokenize_example(e, FakeTokenizer(template), mask_prompt, turns)
                 for e in examples]
        tok = BatchFakeTokenizer(template)
        rows, fit = chat_mod.fitted_rows(examples, tok, 16, mask_prompt, pack, turns)
        want = pack_or_pad(alone, 16, tok.eos_id, pack)
        assert fit == Fit.of(alone, 16, pack)
        assert {k: v.tolist() for k, v in rows.items()} == {k: v.tolist() for k, v in want.items()}
        # one call per add_bos a batch of 3, not one a piece
        want_calls = []
        for i in range(0, len(examples), 3):
            bos = [b for e in examples[i:i + 3]
                   for _, b, _ in chat_mod._pieces(e, tok, mask_prompt, turns)[0]]
            want_calls += [(bos.count(b), b) for b in dict.fromkeys(bos)]
        assert tok.calls == want_calls
        assert len(want_calls) < sum(n for n, _ in want_calls)


@pytest.fixture(scope="module")
def smol(shared_file):
    from toymlx.data.tokenizer import Tokenizer

    return Tokenizer.from_gguf(shared_file("tokenizers/ggml-vocab-smollm2.gguf"))


SMOL_CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 日本語 🙂?"},
     {"role": "assistant", "content": " Oui,\n\n naïve 🙂."}, {"role": "user", "content": ""},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "12345 again"},
     {"role": "assistant", "content": "\nLast <|im_end|> one\t"}],
    [{"role": "user", "content": "no answer"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "q " * 40},
     {"role": "assistant", "content": "a " * 40}, {"role": "tool", "content": "{\"x\": 1}"}],
]


def _smol_rows_digests(tok) -> dict[str, str]:
    """sha256 of the rows (inputs, targets, mask) and fit of `SMOL_CHATS` for each option."""
    import hashlib

    from toymlx.data.chat import fitted_rows

    examples = [Example(f"s:{i}", messages=tuple(m)) for i, m in enumerate(SMOL_CHATS)]
    out = {}
    for mask_prompt in (True, False):
        for turns in ("assistant", "last"):
            for pack in (False, True):
                rows, fit = fitted_rows(examples, tok, 24, mask_prompt, pack, turns)
                assert fit.merged == 0  # SmolLM2's template has a system role
                # Fit's fields as a4e0387 had them (and its repr): `merged` came later
                h = hashlib.sha256(f"Fit(examples={fit.examples}, truncated={fit.truncated}, "
                                   f"dropped={fit.dropped}, untrained={fit.untrained})".encode())
                for k in ("inputs", "targets", "mask"):
                    h.update(repr((rows[k].dtype.str, rows[k].shape)).encode() + rows[k].tobytes())
                out[f"{mask_prompt}-{turns}-{pack}"] = h.hexdigest()[:16]
    return out


def test_smollm2_chat_rows_are_those_of_one_tokenizer_call_a_piece(smol):
    """SmolLM2's chat rows (system, multi-turn, unicode, empty turns, a special token's text in
    a turn, a last turn not the assistant's; each `turns`, with and without mask_prompt and
    packing) are bit for bit those session 40's loader made with one tokenizer call a piece
    (digests taken at a4e0387), and a turn's ids are its text's own, encoded apart."""
    ids, mask = tokenize_example(Example("s", messages=tuple(SMOL_CHATS[0])), smol, True)
    prompt = smol.apply_chat_template(SMOL_CHATS[0][:1], add_generation_prompt=True)
    want = smol.encode(prompt, add_bos=False), smol.encode("Yo<|im_end|>\n", add_bos=False)
    assert (ids, mask) == (want[0] + want[1], [0] * len(want[0]) + [1] * len(want[1]))
    assert _smol_rows_digests(smol) == SMOL_DIGESTS


SMOL_DIGESTS = {  # mask_prompt-turns-pack; without mask_prompt `turns` changes nothing
    "True-assistant-False": "b61e5a4b49a00ed0", "True-assistant-True": "dc39e69170b20df2",
    "True-last-False": "c87d9f82fe0c8da7", "True-last-True": "f4bff10e874d582c",
    "False-assistant-False": "a983430f6ef6076c", "False-assistant-True": "e09c5b0a0e210955",
    "False-last-False": "a983430f6ef6076c", "False-last-True": "e09c5b0a0e210955"}


def test_renamed_row_keys_read_and_are_named_as_the_file_writes_them(tmp_path):
    """`--data.keys` (mlx-lm's prompt_feature, ...): each row's NAME read as its KEY, and every
    error names the key the file holds, not toymlx's name for it."""
    keys = chat.row_keys(["prompt=question", "completion=answer", "messages=chat",
                          "text=text"])
    assert keys == {"prompt": "question", "completion": "answer", "messages": "chat"}
    f = write(tmp_path, "qa.jsonl", json.dumps({"question": "2+2?", "answer": "4",
                                                "prompt": "ignored"}) + "\n")
    [ex] = load_examples(f, keys)
    assert (ex.kind, ex.prompt, ex.completion) == ("completion", "2+2?", "4")
    wants = [
        ({"question": "q", "prompt": "p"},
         "expected both \"question\" and \"answer\", found keys ['prompt', 'question']"),
        ({"question": "q", "answer": " "}, "expected \"answer\" to be a non-empty string, found ' '"),
        ({"chat": [{"role": "bot", "content": "x"}]},
         'expected chat[0].role to be one of system, user, assistant, tool, found string "bot"'),
        ({"chat": [{"role": "user", "content": 3}]},
         'expected "chat[0].content" to be a string, found number 3'),
        ({"body": "x"},
         ('expected one of {"text": ...}, {"question": ..., "answer": ...} or {"chat": [...]}, '
          "found keys ['body']"))]
    for record, want in wants:
        f.write_text(json.dumps(record) + "\n")
        with pytest.raises(DataError) as e:
            load_examples(f, keys)
        assert str(e.value) == f"{f}:1: {want}"
    refused = [
        (["prompt"], ("--data.keys: expected KEY=NAME with KEY one of prompt, completion, text, "
                      "messages (a row's NAME read as its KEY), found 'prompt'")),
        (["prompt=a", "prompt=b"], "--data.keys: expected prompt once, found prompt=a and prompt=b"),
        (["prompt=a", "completion=a"], ("--data.keys: expected each row key read once, found 'a' "
                                        "read as prompt and as completion"))]
    for pairs, want in refused:
        with pytest.raises(ValueError) as e:
            chat.row_keys(pairs)
        assert str(e.value) == want
