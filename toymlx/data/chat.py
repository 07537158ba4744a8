"""Supervised fine-tuning data: example files -> token ids + loss masks -> fixed-length rows.

File formats (`load_examples`):
- `.jsonl` (and `.json`): one JSON object per line, the three shapes mlx-lm's LoRA trainer
  reads: `{"text": ...}`, `{"prompt": ..., "completion": ...}` and
  `{"messages": [{"role": ..., "content": ...}, ...]}`, the last optionally with mlx-lm's
  `"tools": [...]` (handed to a chat template that takes `tools`; assistant messages may
  carry `tool_calls`, tool messages `name` and `tool_call_id`). A message's reasoning may come
  in a field (`reasoning_content`, `thinking` or `reasoning`, a string: `REASONING_FIELDS`),
  trained where the template writes it as `<think>` reasoning in the content is; one it never
  writes is counted in the split's note (`unread_fields`). Each message goes to the template
  whole, as transformers and mlx-lm hand it: a key the template reads nowhere (`id`, `weight`)
  changes nothing, and a null one is left out. Other keys of a record are ignored; blank lines
  are skipped. A `.json` file may instead hold one JSON array of such objects.
- `.csv` (comma) and `.tsv` (tab): a table with a header row (RFC 4180 quoting, as Python's
  `csv` reads it), each further row one record keyed by the header, read as the JSONL record
  of those keys would be (`_table_examples`): columns `text`, `prompt` and `completion`, or
  Alpaca's `instruction`, `input` and `output`; other columns are ignored. Chat turns
  (`messages`) need JSONL.
- a folder in mlx-lm's layout (`data_files`): `train.jsonl`, optional `valid.jsonl` and
  `test.jsonl`; each may be a `.json`, `.csv` or `.tsv` file instead (`train.csv`), read as
  that file alone is.
- a record's `text`, `prompt`, `completion` and `messages` may be read from other keys
  (`row_keys`: `--data.keys prompt=question`, mlx-lm's `prompt_feature` and the like).
- any other file is plain UTF-8 text split into documents at blank lines (a line with only
  whitespace counts as blank). Each document becomes one `{"text": ...}` example, which is
  what the same paragraphs written as JSONL would give; to train on a whole file as one
  stream, use `toymlx.data.text` instead (or `pack=True` here).

Loss masks (`tokenize_example`): `loss_mask[j] == 1` means token `ids[j]` is trained as a
TARGET, i.e. the loss counts the prediction of `ids[j]` from `ids[:j]`. Rows built from an
example use `inputs = ids[:-1]`, `targets = ids[1:]`, `mask = loss_mask[1:]`.

Chat-template spans are found by rendering message prefixes as strings (see
`_message_pieces`) and tokenizing the conversation piece by piece at those string
boundaries, so the span edges are exact even where a BPE tokenizer would merge across them.
Rendered templates are encoded with `add_bos=False`, as Hugging Face does
(`add_special_tokens=False`): templates that want a BOS write it themselves.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
import json
import math
import os
import shlex
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from toymlx.backend.files import (
    counted,
    hidden_below,
    json_fault,
    names_below,
    not_read_line,
    shortlist,
)
from toymlx.backend.progress import pass_bar
from toymlx.data.chat_template import REASONING_FIELDS, system_in_user, system_refused
from toymlx.data.text import IMAGES_TRAIN, DataError, open_text
from toymlx.data.vocab import TokenizerError

__all__ = [
    "DataError",
    "DataFiles",
    "DataSource",
    "Example",
    "Fit",
    "NoShapeError",
    "SFTData",
    "SplitExamples",
    "chat_flags_on_text",
    "data_files",
    "empty_split_error",
    "first_kind",
    "fit_rows",
    "fitted_rows",
    "fitted_width",
    "load_examples",
    "pack_or_pad",
    "sft_batch",
    "sft_val_batches",
    "split_examples",
    "test_file",
    "text_rows_file",
    "tokenize_example",
    "trained_positions",
]

ROLES = ("system", "user", "assistant", "tool")
TURNS = ("assistant", "last")
"""Which messages of a conversation train under mask_prompt: every assistant turn (toymlx's),
or the last message (mlx-lm's)."""
SHAPES = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}'
ROW_KEYS = ("prompt", "completion", "text", "messages")
"""The keys a record's parts are read from, unless `row_keys` renames them."""


class NoShapeError(DataError):
    """A record holding none of the keys a shape is read from (nor ShareGPT's or Alpaca's): a
    recipe that takes `--data.keys` adds how to name its own keys."""


def row_keys(pairs: Sequence[str]) -> dict[str, str]:
    """--data.keys's KEY=NAME pairs as {KEY: NAME}: each record's NAME is read as its KEY (one
    of `ROW_KEYS`), as mlx-lm's prompt_feature, completion_feature, text_feature and
    chat_feature say (`prompt=question`: a row's "question" is its prompt); a pair that names
    its KEY again is left out. ValueError (one line) for a pair that is not KEY=NAME, a KEY not
    in ROW_KEYS, a KEY given twice or a NAME given two KEYs."""
    keys: dict[str, str] = {}
    for pair in pairs:
        key, eq, name = pair.partition("=")
        if not eq or not name or key not in ROW_KEYS:
            raise ValueError(f"--data.keys: expected KEY=NAME with KEY one of "
                             f"{', '.join(ROW_KEYS)} (a row's NAME read as its KEY), found "
                             f"{pair!r}")
        if key in keys:
            raise ValueError(f"--data.keys: expected {key} once, found {key}={keys[key]} and "
                             f"{pair}")
        twice = next((k for k, n in keys.items() if n == name), None)
        if twice is not None:
            raise ValueError(f"--data.keys: expected each row key read once, found {name!r} "
                             f"read as {twice} and as {key}")
        keys[key] = name
    return {k: n for k, n in keys.items() if k != n}


def _renamed(obj: dict, keys: Mapping[str, str]) -> dict:
    """A record with `row_keys`' renames made: each KEY's value the record's NAME's; a record's
    own KEY that is renamed, and each NAME, left out (mlx-lm reads the named key alone)."""
    out = {k: v for k, v in obj.items() if k not in keys and k not in keys.values()}
    out.update({k: obj[n] for k, n in keys.items() if n in obj})
    return out


class ChatTokenizer(Protocol):
    """The part of `toymlx.data.tokenizer.Tokenizer` this module needs."""

    eos_id: int
    chat_template: str | None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]: ...

    # optional: `encode_batch(texts, add_bos) -> list of id arrays`, `encode` of each text in
    # one call (`Tokenizer.encode_batch`); `_encode_pieces` uses it where the tokenizer has it

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


@dataclass(frozen=True)
class Example:
    """One training example; exactly one of `text`, `prompt`+`completion`, `messages` is set."""

    source: str
    """`path:line` where the example starts (a table's `path: row N`), for error messages"""
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    """mlx-lm's `tools` beside `messages`: function schemas the chat template renders"""
    read_from: str | None = None
    """The key of another tool's layout the record was written in, where it was read as one of
    toymlx's shapes (`_peer_record`): "conversations" (ShareGPT's, read as `messages`); None for
    toymlx's own. An error about the shape names what the user wrote."""

    @property
    def kind(self) -> str:
        """`"text"`, `"completion"` or `"messages"`."""
        if self.text is not None:
            return "text"
        return "completion" if self.prompt is not None else "messages"


# ---------------------------------------------------------------------------- loading


def _found(value: Any) -> str:
    kind = {type(None): "null", bool: "boolean", int: "number", float: "number",
            str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
    if isinstance(value, dict):
        return f"object with keys {sorted(value)}"
    if value is None:  # its kind is its text: "null", not "null null"
        return "null"
    text = json.dumps(value, ensure_ascii=False)
    return f"{kind} {text[:40] + '...' if len(text) > 40 else text}"


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
                  "tool": "tool"}
"""ShareGPT's `from` names, as the roles of toymlx's (and mlx-lm's) `messages`."""


def _quoted(key: str) -> str:
    """A record's key as a JSONL record's errors name it; a table's are its columns
    (`_column`)."""
    return f'"{key}"'


def _column(key: str) -> str:
    """A table's key, as its errors name it: the column."""
    return f'column "{key}"'


def _named_as(name: Callable[[str], str], keys: Mapping[str, str]) -> Callable[[str], str]:
    """`name` (how errors name a key) for a record read through `row_keys`' renames: a KEY, or
    a path into it (`messages[0].content`), named by the record's own key."""
    def named(key: str) -> str:
        head = key.split("[", 1)[0]
        return name(keys[head] + key[len(head):]) if head in keys else name(key)
    return named


def _shapes(keys: Mapping[str, str] | None) -> str:
    """`SHAPES`, with `row_keys`' renames."""
    if not keys:
        return SHAPES
    k = {**{key: key for key in ROW_KEYS}, **keys}
    return (f'{{"{k["text"]}": ...}}, {{"{k["prompt"]}": ..., "{k["completion"]}": ...}} or '
            f'{{"{k["messages"]}": [...]}}')


def _peer_record(obj: dict, where: str, name: Callable[[str], str] = _quoted) -> dict | None:
    """A record in one of the two layouts Hugging Face's chat datasets come in most, as the shape
    it means, where it has none of toymlx's keys: ShareGPT's {"conversations": [{"from",
    "value"}]} as {"messages"} (its roles by `SHAREGPT_ROLES`; turns already {"role",
    "content"} kept), Alpaca's {"instruction", "input", "output"} as {"prompt", "completion"}
    (the prompt the instruction, then a blank line and the input where there is one). None
    for any other record. mlx-lm reads neither and says "Unsupported data format". `name`:
    how errors name a key (`_quoted`; a table's `_column`)."""
    if any(k in obj for k in ("text", "prompt", "completion", "messages")):
        return None
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f'{where}: expected "conversations" (ShareGPT\'s) to be a non-empty '
                            f'array of {{"from", "value"}} objects, found {_found(turns)}')
        messages = []
        for j, turn in enumerate(turns):
            if isinstance(turn, dict) and "role" in turn:
                messages.append(turn)
                continue
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise DataError(f'{where}: expected conversations[{j}] to be an object with '
                                f'"from" and "value" (ShareGPT\'s), found {_found(turn)}')
            role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
            if role is None:
                raise DataError(f"{where}: expected conversations[{j}].from to be one of "
                                f"{', '.join(SHAREGPT_ROLES)}, found {_found(turn['from'])}")
            if not isinstance(turn["value"], str):
                raise DataError(f'{where}: expected conversations[{j}].value to be a string, '
                                f"found {_found(turn['value'])}")
            messages.append({"role": role, "content": turn["value"]})
        return {"messages": messages, **({"tools": obj["tools"]} if "tools" in obj else {})}
    if "instruction" in obj and "output" in obj:
        for key in ("instruction", "input", "output"):
            if not isinstance(obj.get(key, ""), str):
                raise DataError(f"{where}: expected {name(key)} (Alpaca's) to be a string, found "
                                f"{_found(obj[key])}")
        if not obj["output"].strip():  # the completion it becomes, named as the user wrote it
            raise DataError(f"{where}: expected {name('output')} (Alpaca's) to be a non-empty "
                            f"string, found {obj['output']!r}")
        given = obj.get("input", "")
        return {"prompt": obj["instruction"] + (f"\n\n{given}" if given.strip() else ""),
                "completion": obj["output"]}
    return None


def _parse_record(obj: Any, where: str, name: Callable[[str], str] = _quoted,
                  keys: Mapping[str, str] | None = None) -> Example:
    """A record (a JSON object, or a table's row keyed by its header) as its example; `name`:
    how errors name a key (`_quoted`; a table's `_column`); `keys`: `row_keys`' renames (the
    errors name the record's own keys)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object {SHAPES}, found {_found(obj)}")
    given = obj  # as the file writes it, as errors name its keys
    if keys:
        obj = _renamed(obj, keys)
        name = _named_as(name, keys)
    peer = _peer_record(obj, where, name)
    read_from = "conversations" if peer is not None and "messages" in peer else None
    obj = peer or obj
    shapes = [s for s, parts in (("text", ("text",)), ("prompt/completion", ("prompt", "completion")),
                                 ("messages", ("messages",))) if any(k in obj for k in parts)]
    if len(shapes) != 1:
        found = f"keys {sorted(given)}" if given else "an empty object"
        qualifier = "one of" if not shapes else "only one of"
        error = NoShapeError if not shapes and given else DataError
        raise error(f"{where}: expected {qualifier} {_shapes(keys)}, found {found}")

    def string(key: str, value: Any, non_empty: bool) -> str:
        if not isinstance(value, str):
            raise DataError(f"{where}: expected {name(key)} to be a string, found {_found(value)}")
        if non_empty and not value.strip():
            raise DataError(f"{where}: expected {name(key)} to be a non-empty string, found "
                            f"{value!r}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": text no tokenizer can encode
            raise DataError(f"{where}: expected {name(key)} to be UTF-8 text, found a lone "
                            f"surrogate U+{ord(value[e.start]):04X} at character {e.start}"
                            ) from None
        return value

    if shapes[0] == "text":
        return Example(where, text=string("text", obj["text"], non_empty=True))
    if shapes[0] == "prompt/completion":
        missing = [k for k in ("prompt", "completion") if k not in obj]
        if missing:
            raise DataError(f"{where}: expected both {name('prompt')} and {name('completion')}, "
                            f"found keys {sorted(given)}")
        return Example(where, prompt=string("prompt", obj["prompt"], non_empty=False),
                       completion=string("completion", obj["completion"], non_empty=True))
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected {name('messages')} to be a non-empty array of "
                        f'{{"role", "content"}} objects, found {_found(messages)}')
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise DataError(f'{where}: expected "tools" to be an array of function objects, found '
                        f"{_found(tools)}")
    out = []
    chat = (keys or {}).get("messages", "messages")  # the record's own key, as errors name it
    for j, m in enumerate(messages):
        # an assistant turn that only calls tools may leave its content out (mlx-lm's format)
        if not isinstance(m, dict) or "role" not in m or (
                "content" not in m and "tool_calls" not in m):
            raise DataError(f'{where}: expected {chat}[{j}] to be an object with "role" and '
                            f'"content", found {_found(m)}')
        if m["role"] not in ROLES:
            raise DataError(f"{where}: expected {chat}[{j}].role to be one of "
                            f"{', '.join(ROLES)}, found {_found(m['role'])}")
        # OpenAI's exports write `"content": null` beside tool calls: no content, as left out
        content = m.get("content", "")
        if content is None and m.get("tool_calls"):
            content = ""
        # every other key goes to the template as transformers and mlx-lm hand it the whole
        # message (mlx-lm's tool fields, the reasoning fields; one no template reads changes
        # nothing); a null one is left out, as no field (`"tool_calls": null` is no tool call to
        # a template asking `'tool_calls' in message`, as Llama 3.1's does)
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = string(f"messages[{j}].content", content, non_empty=False)
        for key in REASONING_FIELDS:
            if key in msg:
                string(f"messages[{j}].{key}", msg[key], non_empty=False)
        out.append(msg)
    return Example(where, messages=tuple(out), tools=tuple(tools) if tools else None,
                   read_from=read_from)


def _json_array(path: Path, text: str, keys: Mapping[str, str] | None = None
                ) -> list[Example]:
    """Parse a top-level JSON array element by element, so errors can give line numbers."""
    decoder = json.JSONDecoder()

    def line(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    pos = text.index("[") + 1
    examples: list[Example] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == "]" and not examples:
            pos += 1
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _unreadable(f"{path}:{e.lineno}", e, "an array of objects") from None
        except RecursionError as e:
            raise _unreadable(f"{path}:{line(pos)}", e, "an array of objects") from None
        examples.append(_parse_record(obj, f"{path}:{line(pos)}", keys=keys))
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            pos += 1
            break
        found = repr(text[pos:pos + 10]) if pos < len(text) else "end of file"
        raise DataError(f"{path}:{line(pos)}: bad JSON; expected ',' or ']' after "
                        f"array item {len(examples)}, found {found}")
    if text[pos:].strip():
        raise DataError(f"{path}:{line(pos)}: bad JSON; expected nothing after the final ']', "
                        f"found {text[pos:].strip()[:10]!r}")
    return examples


TABLES = {".csv": ",", ".tsv": "\t"}
"""The example files read as tables (`_table_examples`), by suffix, and their delimiters."""
TABLE_COLUMNS = "text; prompt and completion; or Alpaca's instruction, input (optional) and output"
"""The columns of each record shape a table's header may give (the record reader decides)."""
TABLE_FIELD_LIMIT = 2**31 - 1
"""The most characters a table's cell may hold (`_table_row`): Python's csv refuses a field over
131,072 ("field larger than field limit"), a long document's text; this one a C long holds on
every platform (sys.maxsize overflows csv's limit where a long is 32 bits, as on Windows)."""


def is_plain_text(path: Path) -> bool:
    """Whether `load_examples` reads `path` as plain text (documents at blank lines): any file
    but a .jsonl, .json, .csv or .tsv, whatever the case of its suffix."""
    return path.suffix.lower() not in (".jsonl", ".json", *TABLES)


def check_not_empty(path: Path) -> None:
    """An empty example file (.jsonl, .json, .csv, .tsv): one line saying what it should hold,
    not `open_text`'s "empty file; expected UTF-8 text" (a plain-text file keeps that)."""
    if is_plain_text(path) or not path.is_file() or path.stat().st_size:
        return
    what = (f"a header row ({TABLE_COLUMNS}) and one example a row"
            if path.suffix.lower() in TABLES else f"one example a line {SHAPES}")
    raise DataError(f"{path}: empty file; expected {what}")


def blank_file(path: Path) -> bool:
    """Whether the file `path` holds no example: no byte, or whitespace alone (blank lines, a
    UTF-8 BOM first), read a block at a time up to its first other byte; False where it cannot
    be read (its reader, `load_examples`, names why)."""
    try:
        with open(path, "rb") as f:
            first = f.read(2**16).removeprefix(b"\xef\xbb\xbf")
            return not any(block.strip() for block in itertools.chain(
                (first,), iter(lambda: f.read(2**16), b"")))
    except OSError:
        return False


def load_examples(path: str | Path, keys: Mapping[str, str] | None = None) -> list[Example]:
    """Read a `.jsonl`/`.json` example file, a `.csv`/`.tsv` table (`_table_examples`) or a
    plain-text file (documents at blank lines); `keys`: `row_keys`' renames. A JSONL, table or plain-text file is read a
    block at a time (`_lines`), each line parsed as it comes: a 100 MB train.jsonl never held
    whole, nor as a list of its lines, beside its examples (its text alone, as one string, took
    1 GB with a character past U+FFFF in it)."""
    path = Path(path)
    check_not_empty(path)
    pieces = open_text(path)[1]
    try:
        head = _head(pieces)  # the text up to its first non-space character
        if path.suffix.lower() == ".json" and head.lstrip().startswith("["):
            return _examples(path, _json_array(path, head + "".join(pieces), keys))
        lines = _lines(itertools.chain((head,), pieces))
        if path.suffix.lower() in TABLES:
            return list(_table_examples(path, lines, keys))
        if is_plain_text(path):
            return _documents(path, lines)
        return _examples(path, [_jsonl_record(raw, path, lineno, keys)
                                for lineno, raw in lines if raw.strip()])
    finally:
        pieces.close()


def _head(pieces: Iterator[str]) -> str:
    """The pieces of `open_text` up to and with the first that holds more than whitespace
    (all of them for a file of whitespace alone, whose error the iterator raises)."""
    head = ""
    for piece in pieces:
        head += piece
        if not piece.isspace():
            break
    return head


def _lines(pieces: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number from 1, line without its "\n") of a text given in pieces, as
    `enumerate(text.split("\n"), start=1)` gives them for the whole text. A line longer than a
    piece is joined once, when it ends (not grown a piece at a time: its length squared)."""
    lineno, parts = 1, []  # the pieces of the line not yet ended
    for piece in pieces:
        lines = piece.split("\n")
        if len(lines) == 1:
            parts.append(piece)
            continue
        lines[0] = "".join([*parts, lines[0]]) if parts else lines[0]
        parts = [lines.pop()]
        for line in lines:
            yield lineno, line
            lineno += 1
    yield lineno, "".join(parts)


def _documents(path: Path, lines: Iterable[tuple[int, str]]) -> list[Example]:
    """A plain-text file's documents: runs of non-blank lines, each a {"text": ...} example."""
    examples: list[Example] = []
    start, block = 0, []
    for lineno, raw in itertools.chain(lines, ((0, ""),)):
        if raw.strip():
            start = start or lineno
            block.append(raw.rstrip("\r"))
        elif block:
            examples.append(Example(f"{path}:{start}", text="\n".join(block)))
            start, block = 0, []
    return examples


def _table_examples(path: Path, lines: Iterable[tuple[int, str]],
                    keys: Mapping[str, str] | None = None) -> Iterator[Example]:
    """A .csv or .tsv file's examples (`lines`: `_lines`'s), one a row after its header, each
    the example its JSONL record would give: the row's cells keyed by the header's columns
    (unnamed ones left out), through the same record reader (`_parse_record`). Rows are
    numbered as a spreadsheet shows them, the header row 1 (a quoted field's line breaks stay
    in its row); rows of empty fields only are skipped, as blank JSONL lines are. One-line
    DataErrors: a header whose columns make no record (`TABLE_COLUMNS`), or give `messages`
    (chat turns need JSON); a row of too many or too few fields; a field the reader refuses (an
    empty completion: `found ''`, naming the column); text that is not RFC 4180 CSV."""
    sep = TABLES[path.suffix.lower()]
    kind, sep_name = ("CSV", "comma") if sep == "," else ("TSV", "tab")
    header: list[str] | None = None
    header_row = count = 0  # the header's row, examples so far
    for row, cells in _table_rows(path, lines):
        if header is None:
            header, header_row = cells, row
            _table_header(path, header, row, sep, keys)
            continue
        if len(cells) != len(header):
            few = len(cells) < len(header)
            extra = (f'none for column "{header[len(cells)]}"; a field that holds a line break '
                     f"goes in double quotes" if few else
                     f'field {len(header) + 1} is past the last column ("{header[-1]}"); a '
                     f"field that holds a {sep_name} goes in double quotes")
            columns = ", ".join(c or "(unnamed)" for c in header)
            raise DataError(f"{path}: row {row}: expected {counted(len(header), 'field')} "
                            f"({columns}), found {len(cells)}: {extra}")
        count += 1
        yield _parse_record({k: v for k, v in zip(header, cells) if k}, f"{path}: row {row}",
                            _column, keys)
    if header is None:
        raise DataError(f"{path}: expected a {kind} header row ({TABLE_COLUMNS}), found only "
                        f"empty rows")
    if not count:
        raise DataError(f"{path}: no examples; expected rows after the header (row "
                        f"{header_row}), found none")


def _table_rows(path: Path, lines: Iterable[tuple[int, str]]) -> Iterator[tuple[int, list[str]]]:
    """(row number, cells) of each row of a .csv or .tsv file (`lines`: `_lines`'s) that holds
    a non-empty field, rows numbered as a spreadsheet shows them (a blank line, or a row of
    empty fields, is skipped but counted); DataError (one line) at text that is not RFC 4180
    CSV."""
    sep = TABLES[path.suffix.lower()]
    kind, sep_name = ("CSV", "comma") if sep == "," else ("TSV", "tab")
    reader = csv.reader((raw + "\n" for _, raw in lines), delimiter=sep, strict=True)
    row = 0  # the row read last
    while True:
        start = reader.line_num + 1
        try:
            cells = _table_row(reader)
        except csv.Error as e:
            raise DataError(
                f"{path}: row {row + 1} (from line {start}): bad {kind} ({e}); a field that "
                f"holds a {sep_name}, a double quote or a line break goes in double quotes, each "
                f'double quote in it doubled: "say ""hi"""') from None
        if cells is None:
            return
        row += 1
        if any(cells):
            yield row, cells


def table_header(path: str | Path) -> tuple[int, list[str]] | None:
    """A .csv or .tsv file's header (`TABLES`): its row number and columns, read no further
    than that row (`FIRST_BYTES` at a time); None for a file of empty rows (`load_examples`
    names it)."""
    path = Path(path)
    pieces = open_text(path, FIRST_BYTES)[1]
    try:
        return next(_table_rows(path, _lines(pieces)), None)
    finally:
        pieces.close()


def _table_row(reader: Iterator[list[str]]) -> list[str] | None:
    """The csv reader's next row (None at the end), its cells up to `TABLE_FIELD_LIMIT`
    characters each. csv's limit is one setting of the whole process: raised for this call
    alone and put back, so other readers in the process (a user's own, in a notebook) keep
    theirs, and a generator paused between rows holds nothing changed."""
    limit = csv.field_size_limit(TABLE_FIELD_LIMIT)
    try:
        return next(reader, None)
    finally:
        csv.field_size_limit(limit)


def _table_header(path: Path, header: list[str], row: int, sep: str,
                  keys: Mapping[str, str] | None = None) -> None:
    """DataError (one line) where a table's header (its row `row`, fields separated by `sep`)
    names a column twice, gives chat turns, or makes no record: the record its columns would
    give, each cell filled, is what the reader refuses (a header of one column holding another
    separator, a European spreadsheet's ';', says so)."""
    where = f"{path}: row {row} (the header)"
    kind = "CSV" if sep == "," else "TSV"
    twice = next((c for j, c in enumerate(header) if c and c in header[:j]), None)
    if twice is not None:
        raise DataError(f'{where}: expected each column once, found "{twice}" twice')
    chat = next((c for c in header if c in ("messages", "conversations")), None)
    if chat is not None:
        raise DataError(f'{where}: column "{chat}": chat turns need JSON, not a {kind} cell; '
                        f"write the examples as JSONL, one "
                        f'{{"messages": [{{"role": ..., "content": ...}}, ...]}} a line')
    try:
        _parse_record({c: "x" for c in header if c}, where, _column, keys)
    except DataError as e:
        other = next((c for c in (";", "\t", ",", "|") if c != sep and len(header) == 1
                      and c in header[0]), None)
        fix = {"\t": "; name it .tsv", ",": "; name it .csv"}.get(
            other or "", "; save it with commas (or tabs, as a .tsv)")
        hint = (f": one column holding {other!r}, where a .{kind.lower()}'s columns are "
                f"separated by {'commas' if sep == ',' else 'tabs'}{fix}" if other else "")
        error = NoShapeError if isinstance(e, NoShapeError) and not other else DataError
        raise error(f"{where}: expected the columns of one record shape ({TABLE_COLUMNS}; "
                    f"others are ignored), found {header}{hint}") from None


def _examples(path: Path, examples: list[Example]) -> list[Example]:
    """A JSONL or JSON file's examples, checked: at least one, one shape (`check_one_shape`)."""
    if not examples:
        raise DataError(f"{path}: no examples; expected objects {SHAPES}")
    check_one_shape(examples)
    return examples


def _jsonl_record(raw: str, path: Path, lineno: int, keys: Mapping[str, str] | None = None
                  ) -> Example:
    """Line `lineno` (not blank) of a JSONL example file as its example (`keys`: `row_keys`')."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        if (first := raw.strip()) in ("[", "{"):  # json.dump(rows, f, indent=2): not "cut short?"
            what = ("array; a file that is one array of objects reads as such named .json"
                    if first == "[" else "object")
            raise DataError(f"{path}:{lineno}: expected one object per line {SHAPES}, found "
                            f"{first!r} alone, the start of a pretty-printed JSON {what}"
                            ) from None
        raise _unreadable(f"{path}:{lineno}", e, "one object per line") from None
    return _parse_record(obj, f"{path}:{lineno}", keys=keys)


def _unreadable(where: str, e: json.JSONDecodeError | RecursionError, expected: str) -> DataError:
    """The error for an example file's JSON at `where` (PATH:LINE) that does not read: bad JSON
    (the file's layout being `expected`), or nested past Python's recursion limit."""
    if isinstance(e, RecursionError):
        return DataError(f"{where}: expected an object {SHAPES}, found arrays or objects nested "
                         "too deeply to read")
    return DataError(f"{where}: bad JSON ({json_fault(e, line=False)}); expected {expected} "
                     f"{SHAPES}")


FIRST_BYTES = 1 << 16
"""How much of an example file `first_kind` reads at a time, until its first example ends."""


def first_kind(path: str | Path, keys: Mapping[str, str] | None = None) -> str:
    """The kind (`Example.kind`) of the first example of a file `load_examples` reads, which is
    the whole file's (`check_one_shape`: the first row sets it, as mlx-lm's `create_dataset`
    picks a file's dataset class), read no further than that example ends: a check made before
    the run (mlx-lm's mask_prompt on text data) then costs a block of a large train.jsonl, not
    a second read of all of it. DataError as `load_examples` gives it for what is read; a file
    whose first example is not found before its end is `load_examples`'s to answer."""
    path = Path(path)
    check_not_empty(path)
    if path.suffix.lower() in TABLES:  # the header sets every row's kind: the first row's
        pieces = open_text(path, FIRST_BYTES)[1]
        try:
            return next(_table_examples(path, _lines(pieces), keys)).kind
        finally:
            pieces.close()
    pieces = open_text(path, FIRST_BYTES)[1]
    parts: list[str] = []
    size = tried = 0
    try:
        for piece in pieces:
            parts.append(piece)
            size += len(piece)
            if size >= 2 * tried:  # each try on twice the text of the last: a long first
                tried = size       # line costs its length, not its length squared
                if (kind := _first_kind_in("".join(parts), path, keys)) is not None:
                    return kind
    finally:
        pieces.close()
    return load_examples(path, keys)[0].kind  # its last line, or no example: the reader's answer


def text_rows_file(path: str | Path, keys: Mapping[str, str] | None = None,
                   splits: Sequence[str] = ("train", "valid")) -> Path | None:
    """The first example file of the data path `path` (a file, or those of a data folder's
    `splits` that are there) whose rows are text (`first_kind`: {"text": ...} rows, a plain-text
    file), where mask_prompt has no prompt to mask, as mlx-lm's create_dataset finds it ("Prompt
    masking not supported for text dataset"); None for none. A file that does not read is
    left to the reader, which names it."""
    try:
        files = data_files(path)
        found = [f for f in (getattr(files, s) for s in splits) if f is not None] \
            if Path(path).is_dir() else [files.train]  # a file is every split
        return next((f for f in found if first_kind(f, keys) == "text"), None)
    except (ValueError, OSError):
        return None


_ON_TEXT: dict[str, tuple[str, str]] = {
    "--data.mask-prompt": ("prompt and completion or messages rows (a prompt to mask)",
                           ("nothing to mask: every token {scored}; mlx-lm refuses prompt "
                            "masking on a text dataset")),
    "--data.train-turns": ("messages rows (the turns it picks from)",
                           "no turns to pick: every token {scored}")}
"""The flags that shape chat rows and mean nothing on text rows -> (the rows they expect, what
text rows make of them)."""


def chat_flags_on_text(path: str | Path, flags: Collection[str],
                       keys: Mapping[str, str] | None = None,
                       splits: Sequence[str] = ("train", "valid"), scored: str = "trains"
                       ) -> None:
    """DataError (one line) for the first of `flags` (those given) that is `_ON_TEXT`'s, on text
    data (`text_rows_file`), where --data.mask-prompt masks nothing and --data.train-turns picks
    no turn, every token `scored` (trains, is scored): mlx-lm refuses the first; toymlx took
    both without a word. "drop it": the line's head names the option as it was given, which a
    config file's key (`file_key_error`) or `toymlx.train`'s keyword replaces."""
    flag = next((f for f in _ON_TEXT if f in flags), None)
    if flag is not None and (f := text_rows_file(path, keys, splits)) is not None:
        want, found = _ON_TEXT[flag]
        raise DataError(f"{flag}: expected {want}, found {{'text': ...}} rows in {f} "
                        f"({found.format(scored=scored)}); drop it")


def _first_kind_in(text: str, path: Path, keys: Mapping[str, str] | None = None
                   ) -> str | None:
    """The first example's kind in the start `text` of the file `path`, None until a whole
    example is there: a JSONL line with its newline, a JSON array's first item."""
    if is_plain_text(path):  # each document is {"text": ...}
        return "text" if text.strip() else None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        start = text.index("[") + 1
        start += len(text[start:]) - len(text[start:].lstrip())
        try:
            obj = json.JSONDecoder().raw_decode(text, start)[0]
        except (json.JSONDecodeError, RecursionError):  # cut short, or left to _json_array
            return None
        return _parse_record(obj, f"{path}:{text.count(chr(10), 0, start) + 1}",
                             keys=keys).kind
    for lineno, raw in enumerate(text.split("\n")[:-1], start=1):
        if raw.strip():
            return _jsonl_record(raw, path, lineno, keys).kind
    return None


_SHAPE_OF = {"text": '{"text": ...}', "completion": '{"prompt": ..., "completion": ...}',
             "messages": '{"messages": [...]}'}


def check_one_shape(examples: Sequence[Example]) -> None:
    """DataError (one line) naming the first example whose shape is not the first example's:
    mlx-lm picks a file's dataset class by its first row's keys (`datasets.create_dataset`),
    so a file mixing {"text"}, {"prompt", "completion"} and {"messages"} rows trains one way
    there and another here; one shape a file, as mlx-lm means it."""
    first = examples[0]
    for ex in examples[1:]:
        if ex.kind != first.kind:
            raise DataError(f"{ex.source}: expected {_SHAPE_OF[first.kind]}, the shape the "
                            f"first row ({first.source}) set for this file, found "
                            f"{_SHAPE_OF[ex.kind]}; put each shape in a file of its own")


@dataclass(frozen=True)
class DataFiles:
    """The example files of one data path: a single file, or an mlx-lm data folder."""

    train: Path
    valid: Path | None = None
    """Validation examples (None: the last `val_fraction` of `train`)"""
    test: Path | None = None
    """Held-out test examples (`--test`), if any"""


FOLDER_LAYOUT = "train.jsonl (required), valid.jsonl and test.jsonl (optional)"
SPLIT_SUFFIXES = (".jsonl", ".json", *TABLES)
"""The suffixes a data folder's split files may have, read as a single file of that suffix is
(`load_examples`): mlx-lm's .jsonl, or a .json, .csv or .tsv file in its place."""
FOLDER_FILES = f"{FOLDER_LAYOUT} (mlx-lm's layout; .json, .csv or .tsv in place of .jsonl)"
SPLIT_NAMES = tuple(f"{split}{suffix}" for split in ("train", "valid", "test")
                    for suffix in SPLIT_SUFFIXES)
"""Every name a data folder's split file may have (`data_files`): the files of the folder a run
may read, so its record of its data covers these alone (not a README.md beside them)."""
VALID_NAMES = tuple(n for n in SPLIT_NAMES if n.startswith("valid."))
"""The names a data folder's validation file may have (valid.jsonl, ...)."""


def split_files_read(path: str | Path, test: bool) -> tuple[str, ...] | None:
    """The names of the files a run reads in the data folder `path`, as
    `toymlx.bundle.inputs.fingerprint`'s `only`: an mlx-lm folder's `SPLIT_NAMES` (train and
    valid, and test only where the run scores it, `test`: its --test, so an edited test.jsonl
    does not block a resume of a run that never reads it), a folder of text files'
    `TEXT_SUFFIXES` (`text_folder_files`); None for a single file (all of it)."""
    if not Path(path).is_dir():
        return None
    if not any((Path(path) / f"train{suffix}").exists() for suffix in SPLIT_SUFFIXES):
        return TEXT_SUFFIXES
    return tuple(n for n in SPLIT_NAMES if test or not n.startswith("test."))


TEXT_SUFFIXES = (".txt", ".md", ".text", ".markdown", ".rst")
"""Plain-text files (any case) that a data folder without a train file holds (a user's notes, a
book's chapters): the text recipes read them as one text (`text_folder_files`)."""


def text_folder_files(path: str | Path) -> list[Path] | None:
    """The files a data folder without a train file is read as, one text (from-scratch,
    warm-start): every file below it (its subfolders too, as `names_below` walks them) whose
    suffix is one of `TEXT_SUFFIXES`, sorted by path, hidden names skipped, and what hidden
    folders hold (Jupyter's .ipynb_checkpoints/ copies of the notes, .git/): the files
    `fingerprint` covers with `split_files_read`'s `only` (`hidden_below` decides for both, so
    an edit in a hidden folder neither trains nor stops a resume). None for a single file or an mlx-lm
    data folder (a train file there); DataError (one line) for a folder with no text file
    (`data_files`' error, naming what it holds) or with a .jsonl, .csv or .tsv file beside its
    text files, which would not be read."""
    path = Path(path)
    if not path.is_dir() or _split_file(path, "train") is not None:
        return None
    try:
        below = list(names_below(path))
    except ValueError as e:  # a link back up the tree
        raise DataError(str(e)) from None
    shown = [p for p in below if not hidden_below(p, path)]
    files = sorted(p for p in shown if p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        data_files(path)  # raises, naming what the folder holds
    unread = sorted(p for p in shown if p.suffix.lower() in (".jsonl", *TABLES))
    if unread:
        raise DataError(f"{unread[0]}: data folder of text files: expected only text files "
                        f"({', '.join(TEXT_SUFFIXES)}) or {FOLDER_FILES}, found "
                        f"{unread[0].relative_to(path)} too, which would not be read; move it "
                        "out, or name the records train.jsonl (mlx-lm's layout)")
    return files


def text_folder_note(path: str | Path, texts: Sequence[Path]) -> str | None:
    """One line naming the files of a folder of text files that are not read (`texts`: its
    `text_folder_files`): every other file below it, hidden ones aside (a notes.org, a
    script.py, a README without a suffix, a cover.png); None for none."""
    path, read = Path(path), set(texts)
    others = [p for p in names_below(path)
              if p.is_file() and not hidden_below(p, path) and p not in read]
    return not_read_line(path, others, "text", TEXT_SUFFIXES,
                         "rename any text among them to .txt to train on it")


def data_files(path: str | Path) -> DataFiles:
    """A file as itself, or an mlx-lm data folder (`FOLDER_LAYOUT`), each split's file with one
    of `SPLIT_SUFFIXES` (train.csv read as a train.csv given alone is); DataError names what a
    folder without a train file holds, a split given twice (train.jsonl and train.csv), or an
    example file beside them that would not be read."""
    path = Path(path)
    if not path.is_dir():
        return DataFiles(path)
    found = sorted(p.name for p in path.iterdir())
    splits = {split: _split_file(path, split) for split in ("train", "valid", "test")}
    if splits["train"] is None:
        from toymlx.data.image_folder import IMAGE_EXTENSIONS

        # an ImageFolder (`--data.path imgs` for a text model) listed as "found cat, dog"
        classes = [d.name for d in sorted(path.iterdir()) if d.is_dir()
                   and not d.name.startswith(".") and any(
                       f.suffix.lower() in IMAGE_EXTENSIONS for f in d.iterdir())]
        if classes:
            raise DataError(f"{path}: data folder: expected {FOLDER_FILES}, found an image "
                            f"folder (class folders {shortlist(classes, 6)}): {IMAGES_TRAIN}")
        texts = sorted({Path(n).suffix for n in found  # as written: a shell glob is exact
                        if Path(n).suffix.lower() in TEXT_SUFFIXES and not n.startswith(".")})
        globs = " ".join(f"{shlex.quote(str(path))}/*{suffix}" for suffix in texts)
        join = ("" if not texts else "; a folder of text files is one text to from-scratch "
                f"and warm-start, not examples: join them into one file (cat {globs} > "
                "all.txt) and give --data.path all.txt")
        raise DataError(f"{path}: data folder: expected {FOLDER_FILES}, found "
                        f"{shortlist(found, 6) or 'an empty folder'}{join}")

    # a misnamed split (val.jsonl, Valid.csv) was left out without a word; a .json is often
    # something else (a dataset's dataset_info.json), so only a split's own name is read as one
    unread = [n for n in found if n.lower().endswith((".jsonl", *TABLES)) and not n.startswith(".")
              and path / n not in splits.values()]
    if unread:
        raise DataError(f"{path / unread[0]}: data folder: expected only {FOLDER_FILES}, found "
                        f"{unread[0]} too, which would not be read; rename it (valid.jsonl: the "
                        f"validation examples) or move it out")
    return DataFiles(splits["train"], splits["valid"], splits["test"])


def _split_file(folder: Path, split: str) -> Path | None:
    """The file of `split` ("train", "valid", "test") in a data folder: the one of
    `SPLIT_SUFFIXES` there, None for none; DataError for a name there that is not a file (a
    folder) or for two (train.jsonl and train.csv: which one trains would be a guess)."""
    given = [folder / f"{split}{suffix}" for suffix in SPLIT_SUFFIXES
             if (folder / f"{split}{suffix}").exists()]
    for f in given:
        if not f.is_file():
            raise DataError(f"{f}: data folder: expected a file, found "
                            f"{'a directory' if f.is_dir() else 'a device or pipe'}")
    if len(given) > 1:
        names = ", ".join(f.name for f in given[:-1]) + f" and {given[-1].name}"
        other = "other" if len(given) == 2 else "others"
        raise DataError(f"{folder}: data folder: expected one {split} file, found {names}; "
                        f"keep the one to read and move the {other} out")
    return given[0] if given else None


def test_file(path: str | Path) -> Path:
    """The test examples of a data path: a folder's test.jsonl, or a file itself."""
    path = Path(path)
    if not path.is_dir():
        return path
    test = data_files(path).test
    if test is None:
        raise DataError(f"{path}: data folder: expected a test.jsonl to score, found "
                        f"{', '.join(sorted(p.name for p in path.iterdir()))}")
    return test


def none_held_out(train: Path, n: int, val_fraction: float) -> str:
    """`SFTData.val_note` where --data.val-fraction of too few examples rounds to none: the run
    trains without validation, said before the first step (not only by its last line)."""
    documents = (" (a plain-text file's examples are its documents, separated by blank lines)"
                 if is_plain_text(train) else "")
    return (f"{train}: --data.val-fraction {val_fraction} of {counted(n, 'example')} holds "
            f"out none, so the run validates nothing{documents}; add examples, raise "
            f"--data.val-fraction, or use a data folder with a valid.jsonl")


def split_examples(
    examples: Sequence[Example], val_fraction: float = 0.1
) -> tuple[list[Example], list[Example]]:
    """Fixed split: the last `round(n * val_fraction)` examples are validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = round(len(examples) * val_fraction)
    if len(examples) - n_val < 1:
        raise DataError(f"{counted(len(examples), 'example')} leave none for training at "
                        f"val_fraction={val_fraction}; add examples or lower val_fraction")
    return list(examples[: len(examples) - n_val]), list(examples[len(examples) - n_val :])


# ------------------------------------------------------------------------- tokenizing


def _render(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], gen: bool,
            source: str, tools: Sequence[dict[str, Any]] | None = None) -> str:
    extra = {"tools": list(tools)} if tools else {}
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=gen, **extra)
    except TokenizerError:
        raise  # the template itself (not valid Jinja): the model file's, which it names
    # Templates fail in many ways (Jinja errors, their own raise_exception(), a KeyError on a
    # missing field); all of them mean this example cannot be rendered.
    except Exception as e:  # noqa: BLE001
        hint = ""
        if any(m.get("role") == "system" for m in messages) and system_refused(tokenizer):
            hint = ("; this base's template has no system role: toymlx puts a first system "
                    "message, before a user's, at the start of that user message (as "
                    "toymlx-generate --system and llama.cpp do for Gemma); move this one's text "
                    "into a user message")
        elif type(e).__name__ == "UndefinedError" and str(e).endswith("' is undefined"):
            # jinja2's for a top-level name nothing passes (not a message's missing field)
            hint = ("; a variable of the template's own, which toymlx passes none of (it renders "
                    "the messages, tools and special tokens, as transformers does by default; "
                    "firefunction-v2's reads `functions` and `datetime`, which its callers pass "
                    "per call): use a base whose template renders from those alone")
        raise DataError(f"{source}: chat template failed on {counted(len(messages), 'message')}: "
                        f"{type(e).__name__}: {e}{hint}") from None


def without_tools(examples: Sequence[Example]) -> tuple[list[Example], int]:
    """(`examples` with each one's "tools" left out, --data.drop-tools; how many had any)."""
    dropped = sum(e.tools is not None for e in examples)
    return [dataclasses.replace(e, tools=None) if e.tools else e for e in examples], dropped


def tools_note(source: str, dropped: int) -> str | None:
    """The line --data.drop-tools says of the `dropped` examples of `source` whose "tools" it
    left out (None: none had any)."""
    if not dropped:
        return None
    return (f'{source}: --data.drop-tools: the "tools" (function schemas) of '
            f"{counted(dropped, 'example')} left out, not rendered by the chat template")


def template_takes_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the `tools` variable (so a `tools` field is shown
    to the model rather than silently dropped)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False  # the render reports the template's own error


class Rendered(NamedTuple):
    """A render of a conversation's messages in which its assistant turns are located
    (`_history_span`): the messages, whether with a generation prompt, the text; and, for the
    last turn's prompt (`_last_turn_prompt`), where the last turn starts in the conversation's
    own render."""

    messages: Sequence[dict[str, Any]]
    gen: bool
    text: str
    turn_at: int = 0


def _last_turn_prompt(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], full: str,
                      source: str, tools: Sequence[dict[str, Any]] | None) -> Rendered | None:
    """The conversation as the model meets its last turn, for a template that writes the system
    message only into the prompt of the last turn (Mistral-Nemo's, into the last user message):
    the generation prompt `render(messages[:-1], add_generation_prompt=True)`, then the turn as
    the conversation's render `full` writes it. Located by position (`_around`): the render of
    each with `CONTENT_MARK` in place of the last user message ends the same after it up to the
    prompt's end (the user's text, its end, the assistant's header); what `full` writes after
    that is the turn. None where the conversation does not end in a user's message and an
    assistant's, or where the two do not end so."""
    n = len(messages)
    if n < 2 or messages[-1]["role"] != "assistant" or messages[-2]["role"] != "user":
        return None
    prompt = _render(tokenizer, messages[:-1], True, source, tools)
    asked = _around(tokenizer, messages[:-1], n - 2, True, source, tools)
    said = _around(tokenizer, messages, n - 2, False, source, tools)
    if asked is None or said is None or not (prompt.endswith(asked[1]) and full.endswith(said[1])
                                             and said[1].startswith(asked[1])):
        return None
    return Rendered(messages[:-1], True, prompt, len(full) - len(said[1]) + len(asked[1]))


Piece = tuple[str, bool | None, int]
"""A text of an example to encode, the `add_bos` to encode it with, and the loss mask of its
tokens: an example's ids are its pieces' ids one after another (`_pieces`)."""


def no_chat_template(source: str, whose: str, read_from: str | None = None) -> DataError:
    """The refusal of `source`'s 'messages' examples (`Example.read_from`: as another tool
    wrote them) on a tokenizer (`whose`: the file it came from) without a chat template."""
    if read_from == "conversations":  # the key the user wrote, and how to train without one
        return DataError(f'{source}: "conversations" (ShareGPT\'s, read as \'messages\'): '
                         "expected a tokenizer with a chat template to render the turns, found "
                         "none in this one; use a base with a chat template (an instruct model), "
                         'or write each example as {"prompt", "completion"} (the human turn and '
                         "the gpt answer), which trains without one")
    return DataError(f"{source}: 'messages' examples need a chat template, and {whose} has none "
                     "(no tokenizer.chat_template); use 'text' or 'prompt'/'completion' "
                     "examples, or a base that has one")


def _message_pieces(
    messages: Sequence[dict[str, Any]], tokenizer: ChatTokenizer, mask_prompt: bool, source: str,
    tools: Sequence[dict[str, Any]] | None = None, turns: str = "assistant",
) -> list[Piece]:
    """Render with the chat template; with `mask_prompt`, train only the `turns` (`TURNS`).

    assistant: turn i spans the characters from the end of
    `render(messages[:i], add_generation_prompt=True)` (so the header announcing the
    assistant is not trained) to the end of `render(messages[:i+1], False)` (so its content
    and end-of-turn token are). last (mlx-lm's ChatDataset under --mask-prompt): one span from
    the end of `render(messages[:-1], add_generation_prompt=<the last role is assistant>)` to
    the end of the conversation, whatever the last message's role (an assistant's: its
    `_turn_span`). Each turn must be found in the full render as `_turn_span` says; a template
    that rewrites an earlier assistant turn (Qwen3's drops the empty `<think>` block it writes
    for the last) trains that turn as the full render writes it (`_history_span`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise no_chat_template(source, getattr(tokenizer, "source", None) or "this tokenizer")
    if tools and not template_takes_tools(tokenizer.chat_template):
        raise DataError(f'{source}: "tools": expected a chat template that renders tools, found '
                        f"one that never reads them (mlx-lm drops them unsaid); give "
                        f'--data.drop-tools to leave every example\'s "tools" out (a line says '
                        f"how many), or use a base whose template takes tools")
    calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    if calls and "tool_calls" not in tokenizer.chat_template:  # Jinja reads it as m.tool_calls
        raise DataError(f"{source}: messages[{calls[0]}].tool_calls: expected a chat template "
                        "that renders tool calls, found one that never reads them (the turn "
                        "would be trained as an empty answer); remove the tool calls or use a "
                        "base whose template renders them")
    full = _render(tokenizer, messages, False, source, tools)
    whole = Rendered(messages, False, full)
    system = messages[0]["content"].strip() if messages[0]["role"] == "system" else ""
    if system and system not in full:
        whole = _last_turn_prompt(tokenizer, messages, full, source, tools)
        if whole is None or system not in whole.text:
            raise DataError(f"{source}: chat template leaves the system message messages[0] out "
                            f"of the conversation's render and of the last turn's prompt, so the "
                            f"model would train without it; expected the system text in the "
                            f"render, found none: move it to the start of the first user message")
        full = whole.text + full[whole.turn_at:]  # the last turn as its prompt meets it
    if not mask_prompt:
        return [(full, False, 1)]
    spans: list[tuple[int, int]] = []
    if turns == "last" and messages[-1]["role"] != "assistant":
        before = _render(tokenizer, messages[:-1], False, source, tools)
        if not full.startswith(before):
            raise DataError(f"{source}: chat template renders message prefixes inconsistently, "
                            f"so the last message messages[{len(messages) - 1}] cannot be "
                            f"located; set --data.no-mask-prompt to train on the whole "
                            f"conversation")
        spans.append((len(before), len(full)))
    else:
        last = turns == "last"
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and (not last or i == len(messages) - 1):
                prev_end = spans[-1][1] if spans else 0
                if i == len(whole.messages):  # the last turn, after its prompt `whole`
                    spans.append((len(whole.text), len(full)))
                    continue
                spans.append(_turn_span(tokenizer, messages, i, full, prev_end, source, tools,
                                        whole))
    cuts = sorted({0, len(full), *(c for span in spans for c in span)})
    return [(full[a:b], False, int(any(s <= a and b <= e for s, e in spans)))
            for a, b in itertools.pairwise(cuts)]


def _turn_span(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], i: int, full: str,
               prev_end: int, source: str, tools: Sequence[dict[str, Any]] | None,
               whole: Rendered | None = None) -> tuple[int, int]:
    """The characters of `full` (the conversation rendered) that train assistant turn
    `messages[i]`: what the template writes for the turn when it is the last, after the
    assistant's header, i.e. `render(messages[:i+1])` after `render(messages[:i],
    add_generation_prompt=True)`. Two kinds of template render these as no prefix of `full`:
    - a generation prompt longer than the header of a rendered turn (DeepSeek-R1's
      `<｜Assistant｜><think>\n`, the turn `<｜Assistant｜>` + answer): the span starts where the
      turn's content does, after the header both share (`_header_end`); the rest of the prompt,
      which the template never writes into the conversation, is not trained;
    - the EOS token after the last message without a generation prompt (Phi-3's and Phi-4's
      `{% else %}{{ eos_token }}`): a turn before the last ends before it; the last trains it.
    A template that rewrites an earlier turn once another follows (Qwen3's and Qwen3.5's drop
    the `<think>` block; Mistral-Nemo's moves the system text into the last user message)
    trains the turn as `full` writes it, as the model meets it in the history at inference
    (`_history_span`; `whole` as its); where that fails too, or the conversation's last message
    is not found after its generation prompt (a prompt whose header no turn is written with,
    or DeepSeek-R1's dropping the turn's own reasoning), a DataError."""
    before = _render(tokenizer, messages[:i], True, source, tools)
    upto = _render(tokenizer, messages[: i + 1], False, source, tools)
    start = len(before)
    if not (upto.startswith(before) and full.startswith(before)):
        start = _header_end(tokenizer, messages, i, upto, before, source, tools)
    end = len(upto)
    eos = getattr(tokenizer, "eos_token", "")
    if not full.startswith(upto) and eos and upto.endswith(eos) and full.endswith(eos):
        end -= len(eos)
    if start is not None and full.startswith(upto[:end]) and prev_end <= start <= end:
        return start, end
    final = i == len(messages) - 1  # trained as generation writes it, or not at all
    span = None if final else _history_span(tokenizer, messages, i, prev_end, upto, source,
                                            tools, whole or Rendered(messages, False, full))
    content = (messages[i].get("content") or "").strip()
    if span is None and content not in upto:
        last = "" if final else "set --data.train-turns last to train the last turn only, "
        raise DataError(f"{source}: chat template writes assistant turn messages[{i}] without "
                        f"part of its content (it is nowhere in the turn's own render: Gemma "
                        f"4's strips <|channel>...<channel|> thoughts from every answer, "
                        f"DeepSeek-R1's <think> reasoning), so the turn cannot be trained as "
                        f"written; remove that part of the content, {last}or set "
                        f"--data.no-mask-prompt to train on the whole conversation as the "
                        f"template renders it")
    if span is None:
        fix = "" if final else (
            "the template writes it one way as the last turn and another once a message "
            "follows, and where the whole conversation's render writes its content is not "
            "followed by the end the turn has as the last: set --data.train-turns last to train "
            "the last turn as the template renders it for generation, split the conversation "
            "into one example per assistant turn, or ")
        raise DataError(f"{source}: chat template renders message prefixes inconsistently, so "
                        f"assistant turn messages[{i}] cannot be located; {fix}set "
                        f"--data.no-mask-prompt to train on the whole conversation")
    return span


CONTENT_MARK = "toymlx\u00b7content\u00b7mark"
"""Text put in place of a message's content to find, by position, where a render writes it
(`_around`): no whitespace for a template to trim, no `</think>` for one to split at."""


def _around(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], i: int, gen: bool,
            source: str, tools: Sequence[dict[str, Any]] | None) -> tuple[str, str] | None:
    """What the render of `messages` (with a generation prompt where `gen`) writes before and
    after the content of `messages[i]`: the render with `CONTENT_MARK` in place of that content,
    cut at the mark; None where the mark is not written once. The mark stands for the message's
    reasoning fields too (`REASONING_FIELDS`, left out), as it stands for `<think>` reasoning in a
    content: what the render writes of either lies between the two parts."""
    marked = [*messages[:i], _unreasoned(messages[i], CONTENT_MARK), *messages[i + 1:]]
    text = _render(tokenizer, marked, gen, source, tools)
    if text.count(CONTENT_MARK) != 1:
        return None
    head, tail = text.split(CONTENT_MARK)
    return head, tail


def _unreasoned(message: dict[str, Any], content: str) -> dict[str, Any]:
    """`message` with `content`, without its reasoning fields (`REASONING_FIELDS`)."""
    return {**{k: v for k, v in message.items() if k not in REASONING_FIELDS}, "content": content}


def _history_span(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], i: int,
                  prev_end: int, upto: str, source: str, tools: Sequence[dict[str, Any]] | None,
                  whole: Rendered) -> tuple[int, int] | None:
    """The characters of `full` that train assistant turn `messages[i]` as the whole
    conversation writes it, for a template whose prefix renders are no prefixes of `full`
    (`_turn_span`): Unsloth's `train_on_responses_only` and TRL's assistant masks train a turn
    of the history so, as the model reads it at inference. Located by render positions, not by
    searching text: `full` is the render of `whole` (its messages, and whether with a generation
    prompt: the last turn's prompt, `_last_turn_prompt`'s), and the same render with
    `CONTENT_MARK` in place of the turn's content (`_around`) gives the text before it (a prefix
    of `full`) and after it (a suffix); between them lies the content as `full` writes it (its
    `<think>` reasoning dropped by Qwen3's, Qwen3.5's, QwQ's, DeepSeek-R1's). The span is that,
    and the end the turn has as the last (`upto`: `render(messages[:i+1])`; after its content,
    `<|im_end|>\n`, a tool call and its end), which `full` must write next. A content that
    `full` writes as nothing (a turn that only calls a tool, or its reasoning alone) trains the
    end `upto` writes with an empty content, where `full` writes that next. None where neither
    holds."""
    full = whole.text
    around = _around(tokenizer, whole.messages, i, whole.gen, source, tools)
    last = _around(tokenizer, messages[: i + 1], i, False, source, tools)
    if around is None or last is None:  # a content the template never writes (a tool call's)
        return _after_previous(tokenizer, messages, i, prev_end, source, tools, whole)
    if not full.startswith(around[0]):
        return None
    start = len(around[0])
    if start < prev_end:
        return None
    if len(full) - len(around[1]) >= start and full.endswith(around[1]) and \
            upto.endswith(last[1]) and around[1].startswith(last[1]):
        return start, len(full) - len(around[1]) + len(last[1])
    # the content written as nothing: the turn's end, as it is with an empty content
    empty = [*messages[:i], _unreasoned(messages[i], "")]
    end = _render(tokenizer, empty, False, source, tools)
    if end.startswith(last[0]) and full.startswith(end[len(last[0]):], start):
        return start, start + len(end) - len(last[0])
    return None


def _after_previous(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], i: int,
                    prev_end: int, source: str, tools: Sequence[dict[str, Any]] | None,
                    whole: Rendered) -> tuple[int, int] | None:
    """`_history_span` for a turn whose content the template never writes (Mistral's tool-call
    turn, written from its `tool_calls` alone), located after the message before it, by
    position: the renders with `CONTENT_MARK` in place of that message's content (`_around`)
    give what each writes after it: the generation prompt its end and the assistant's header,
    the turn's own render (as the last) that and the turn; `whole.text` must write the same
    header and turn there. None where not so, or where no message precedes it."""
    if i == 0:
        return None
    full = whole.text
    ours = _around(tokenizer, whole.messages, i - 1, whole.gen, source, tools)
    asked = _around(tokenizer, messages[:i], i - 1, True, source, tools)
    said = _around(tokenizer, messages[: i + 1], i - 1, False, source, tools)
    if ours is None or asked is None or said is None or not (
            full.startswith(ours[0]) and full.endswith(ours[1])):
        return None
    header = os.path.commonprefix([asked[1], said[1]])
    turn = said[1][len(header):]
    start = len(full) - len(ours[1]) + len(header)
    if not (turn and ours[1].startswith(header + turn) and prev_end <= start):
        return None
    return start, start + len(turn)


REASONING_ENDS = ("</think>", "<channel|>")
"""The ends of the reasoning an assistant's content may open with, which chat templates drop
from the turns they render (Qwen3's, Qwen3.5's, QwQ's, DeepSeek-R1's `<think>...</think>`;
Gemma 4's `<|channel>thought...<channel|>`): a content holding one is checked for it
(`untrained_thoughts`)."""


def thought_dropped(content: str, written: str) -> bool:
    """Whether a render writes an assistant's `content` (holding reasoning: `REASONING_ENDS`) as
    `written` without part of it: the reasoning, which the template drops (its trimming of
    the whole content aside)."""
    return any(end in content for end in REASONING_ENDS) and content.strip() not in written


def _header_end(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], i: int, upto: str,
                before: str, source: str, tools: Sequence[dict[str, Any]] | None) -> int | None:
    """Where assistant turn `messages[i]`'s content starts in `upto` (the conversation rendered
    up to it) when the generation prompt `before` is the turn's header and more: the history
    `render(messages[:i])` is a prefix of both, the content follows it after a header that
    `before` starts with. The last place the content starts within the text `before` and
    `upto` share: an earlier one lies in the header ("a" in `<｜Assistant｜>`); the shared text
    may run into the content ("<b>" after `<｜Assistant｜>`, the prompt going on `<think>`).
    The content as written, else trimmed, as Gemma's templates write an answer (`| trim`;
    Gemma 4's prompt goes on `<|channel>thought\n<channel|>`). None when not so."""
    history = _render(tokenizer, messages[:i], False, source, tools)
    content = messages[i].get("content") or ""
    if not upto.startswith(history):
        return None
    shared = len(os.path.commonprefix([before, upto]))
    for text in filter(None, dict.fromkeys((content, content.strip()))):
        at = upto.rfind(text, len(history), shared + len(text))
        if at >= 0:
            return at
    # no content there (a turn that only calls a tool, or writes its call first: Gemma 4's
    # `<|turn>model\n<|tool_call>...`, whose `<|` the prompt's `<|channel>` shares): after the
    # header the template writes before a plain answer, where the prompt starts with it too
    # and the content is written after it
    probe = [*messages[:i], {"role": "assistant", "content": _PROBE}]
    try:
        answered = _render(tokenizer, probe, False, source, tools)
    except DataError:
        return None
    at = answered.find(_PROBE, len(history))
    if not (answered.startswith(history) and at >= 0):
        return None
    header = answered[len(history):at]
    if (before.startswith(history + header) and upto.startswith(history + header)
            and content.strip() in upto[at:]):  # a content the template drops is not found
        return at
    return None


_PROBE = "toymlx-answer-probe"
"""The content of the assistant message `_header_end` renders to find where a template's
answer starts (no whitespace, no markup a template would trim or split on)."""


def tokenize_example(
    example: Example, tokenizer: ChatTokenizer, mask_prompt: bool, turns: str = "assistant"
) -> tuple[list[int], list[int]]:
    """Token ids and a same-length target loss mask (1 = train on predicting this token), as
    `_tokenized` gives them for a list of examples.

    - text: `encode(text)` (the tokenizer's default BOS) + EOS, all trained.
    - prompt/completion: with a chat template, the conversation user=prompt,
      assistant=completion; without one, `encode(prompt)` + `encode(completion)` + EOS,
      tokenized separately so the boundary is exact. `mask_prompt` trains the completion
      (and EOS) only.
    - messages: the chat template; `mask_prompt` trains the `turns`: every assistant turn
      (content and end-of-turn tokens, not the header that announces the assistant), or the
      last message only (mlx-lm's rule; see `_message_pieces`).
    """
    ids, mask = _tokenized([example], tokenizer, mask_prompt, turns)[0]
    return ids.tolist(), mask.tolist()


def _pieces(example: Example, tokenizer: ChatTokenizer, mask_prompt: bool, turns: str
            ) -> tuple[list[Piece], bool]:
    """The pieces of `example` (`Piece`) and whether a trained EOS follows them, by the rules
    `tokenize_example` gives."""
    if example.text is not None:
        return [(example.text, None, 1)], True
    if example.prompt is not None:
        assert example.completion is not None
        if getattr(tokenizer, "chat_template", None):
            messages = ({"role": "user", "content": example.prompt},
                        {"role": "assistant", "content": example.completion})
            return _message_pieces(messages, tokenizer, mask_prompt, example.source), False
        prompt = [(example.prompt, None, int(not mask_prompt))] if example.prompt else []
        return [*prompt, (example.completion, False, 1)], True
    assert example.messages is not None
    if example.read_from == "conversations" and not getattr(tokenizer, "chat_template", None):
        raise no_chat_template(example.source, "", example.read_from)
    messages = example.messages
    if system_merged(example, tokenizer):
        messages = system_in_user(list(messages[1:]), messages[0]["content"])
    return _message_pieces(messages, tokenizer, mask_prompt, example.source, example.tools,
                           turns), False


def system_merged(example: Example, tokenizer: ChatTokenizer) -> bool:
    """Whether `example` opens with a system message and then a user's, on a chat template with
    no system role (`system_refused`: Gemma's): its text then starts the first user message
    (`system_in_user`), as toymlx-generate --system and llama.cpp put it."""
    m = example.messages
    return (m is not None and len(m) > 1 and m[0]["role"] == "system" and m[1]["role"] == "user"
            and bool(getattr(tokenizer, "chat_template", None))
            and system_refused(tokenizer) is not None)


def _chat_messages(example: Example, tokenizer: ChatTokenizer) -> list[dict[str, Any]]:
    """The messages of `example` as its render takes them (`system_merged`: the system text in
    the first user message)."""
    messages = list(example.messages or ())
    if system_merged(example, tokenizer):
        messages = system_in_user(messages[1:], messages[0]["content"])
    return messages


def _field_thought(message: dict[str, Any]) -> str:
    """The reasoning a message gives in a field (`REASONING_FIELDS`, the first not blank), "" for
    none."""
    return next((message[k] for k in REASONING_FIELDS if message.get(k, "").strip()), "")


def untrained_thoughts(example: Example, tokenizer: ChatTokenizer, mask_prompt: bool,
                       turns: str, unread: Sequence[tuple[int, str]] | None = None) -> int:
    """How many assistant turns of `example` hold reasoning that the chat template leaves out of
    the conversation it renders (`thought_dropped`: Qwen3's, Qwen3.5's and QwQ's drop `<think>`
    reasoning from a turn once a user message follows, DeepSeek-R1's and Gemma 4's from every
    turn; Qwen3's and Qwen3.5's drop a `reasoning_content` field so too), so that it is not
    trained: their answers train as the render writes them, which is how the model meets those
    turns at inference; `Fit.thoughts` counts them so that it is said, not silent. A field the
    template never writes, in any turn, is `unread_fields`'s (`unread`, where already found),
    not counted here. 0 where only the last turn trains (`mask_prompt` with `turns` "last": the
    others are prompt), or for no messages. Found by position where the template writes a
    marked content once (`_around`, which leaves the fields out), else by the thought's text
    missing from the render."""
    if example.messages is None or (mask_prompt and turns == "last") or not any(
            m["role"] == "assistant" and (_field_thought(m) or
                                          thought_dropped(m.get("content") or "", ""))
            for m in example.messages) or not getattr(tokenizer, "chat_template", None):
        return 0
    messages = _chat_messages(example, tokenizer)
    unread_at = {i for i, _ in (unread_fields(example, tokenizer) if unread is None else unread)}
    full = _render(tokenizer, messages, False, example.source, example.tools)
    count = 0
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        field = "" if i in unread_at else _field_thought(m)
        if m["role"] != "assistant" or not (field or thought_dropped(content, "")):
            continue
        around = _around(tokenizer, messages, i, False, example.source, example.tools)
        if around is not None and full.startswith(around[0]) and full.endswith(around[1]):
            written = full[len(around[0]):len(full) - len(around[1])]
        else:  # the content itself, as a text of the render
            written = full
        count += field.strip() not in written if field else thought_dropped(content, written)
    return count


def unread_fields(example: Example, tokenizer: ChatTokenizer) -> list[tuple[int, str]]:
    """(index, key) of each reasoning field (`REASONING_FIELDS`, not blank) of `example`'s
    messages that the chat template never writes: the message's render as the last, with and
    without the field, is the same (`reasoning_content` on Llama 3.1's, or on DeepSeek-R1's,
    which read no field; transformers hands a template the field under `reasoning_content` and
    `thinking` too, `reasoning_aliased`). transformers and mlx-lm train without it alike, as
    toymlx does; `Fit.unread` counts them so that it is said. A DataError where the template
    writes the same text given under another of the keys (a template that reads only
    `reasoning`, given `reasoning_content`): that field's thought would be lost in every turn,
    which renaming it saves."""
    if example.messages is None or not getattr(tokenizer, "chat_template", None) or not any(
            m.get(k, "").strip() for m in example.messages for k in REASONING_FIELDS):
        return []
    messages = _chat_messages(example, tokenizer)
    out = []
    for i, m in enumerate(messages):
        for key in (k for k in REASONING_FIELDS if m.get(k, "").strip()):
            left = {k: v for k, v in m.items() if k != key}
            without = _render(tokenizer, [*messages[:i], left], False, example.source,
                              example.tools)
            if without != _render(tokenizer, messages[:i + 1], False, example.source,
                                  example.tools):
                continue
            other = next((k for k in REASONING_FIELDS if k not in m and _render(
                tokenizer, [*messages[:i], {**left, k: m[key]}], False, example.source,
                example.tools) != without), None)
            if other is not None:
                raise DataError(f"{example.source}: messages[{i}].{key}: expected the field this "
                                f"chat template reads the reasoning from, {other}, found {key}, "
                                f"which it never writes (the turn would train without its "
                                f"thought); rename the field {other}")
            out.append((i, key))
    return out


def _encode_pieces(tokenizer: ChatTokenizer, pieces: Sequence[Piece]) -> list[np.ndarray]:
    """The int32 ids of each piece, `tokenizer.encode(text, add_bos)`: one `encode_batch` call
    for the pieces of each `add_bos` where the tokenizer has one (a `Tokenizer`), not a call
    a piece: 100,000 SmolLM2 chat examples (5 pieces each) took 164 CPU seconds to build rows
    from with a call a piece, 93 this way (session 41, a 2-core AMD EPYC)."""
    out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(pieces)
    batch = getattr(tokenizer, "encode_batch", None)
    for bos in dict.fromkeys(p[1] for p in pieces):  # None, False, True in order of first use
        at = [k for k, p in enumerate(pieces) if p[1] is bos]
        texts = [pieces[k][0] for k in at]
        encoded = (batch(texts, add_bos=bos) if batch is not None
                   else [tokenizer.encode(t, add_bos=bos) for t in texts])
        for k, ids in zip(at, encoded, strict=True):
            out[k] = np.asarray(ids, np.int32)
    return out


def _tokenized(examples: Sequence[Example], tokenizer: ChatTokenizer, mask_prompt: bool,
               turns: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """`tokenize_example` of each of `examples`, as int32 ids and a uint8 mask, with one
    tokenizer call for all their pieces (`_encode_pieces`)."""
    plans = [_pieces(e, tokenizer, mask_prompt, turns) for e in examples]
    encoded = iter(_encode_pieces(tokenizer, [p for pieces, _ in plans for p in pieces]))
    eos = np.array([tokenizer.eos_id], np.int32) if any(end for _, end in plans) else None
    out = []
    for pieces, end in plans:
        parts = [next(encoded) for _ in pieces] + ([eos] if end else [])
        bits = [bit for _, _, bit in pieces] + ([1] if end else [])
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        out.append((ids, np.repeat(np.array(bits, np.uint8), [len(p) for p in parts])))
    return out


# ------------------------------------------------------------------------------- rows


def pack_or_pad(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    seq_len: int,
    pad_id: int,
    pack: bool = False,
) -> dict[str, np.ndarray]:
    """Fixed-length rows `{"inputs", "targets"}` int32 and `"mask"` float32, each `(N, seq_len)`.

    `sequences` are `(ids, loss_mask)` pairs from `tokenize_example`.
    - padding (`pack=False`): one example per row, cut to its first `seq_len + 1` tokens
      (the end is dropped), padded with `pad_id` under mask 0.
    - packing (`pack=True`): all examples concatenated in order and cut into rows of
      `seq_len + 1` tokens that overlap by one, so every token after the first is a target
      exactly once; the tail row is padded. The first token of each example gets mask 0:
      predicting a new document from the previous one's EOS is not something to learn.
      Attention still crosses example boundaries inside a row (no block-diagonal mask).
    Rows with no trained target are dropped in both modes: they cost compute, and a
    micro-batch of only such rows would have zero tokens to average over.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len}")
    for ids, mask in sequences:
        if len(ids) != len(mask):
            raise ValueError(f"ids and loss_mask differ in length: {len(ids)} vs {len(mask)}")
    # arrays (`fitted_rows`'s int32 ids, uint8 masks) as they are: no copy of every token
    seqs = [(np.asarray(i), np.asarray(m)) for i, m in sequences if len(i)]
    width = seq_len + 1
    if pack and seqs:
        ids = np.concatenate([i for i, _ in seqs])
        mask = np.concatenate([m for _, m in seqs]).astype(np.float32)
        starts = np.cumsum([0] + [len(i) for i, _ in seqs[:-1]])
        mask[starts] = 0.0
        n_rows = math.ceil((len(ids) - 1) / seq_len)
        total = n_rows * seq_len + 1
        ids = np.concatenate([ids, np.full(total - len(ids), pad_id, ids.dtype)])
        mask = np.concatenate([mask, np.zeros(total - len(mask), np.float32)])
        index = np.arange(n_rows)[:, None] * seq_len + np.arange(width)  # (N, T+1)
        windows, wmask = ids[index], mask[index]
    else:
        windows = np.full((len(seqs), width), pad_id, np.int32)  # (N, T+1)
        wmask = np.zeros((len(seqs), width), np.float32)
        for r, (i, m) in enumerate(seqs):
            windows[r, : min(len(i), width)] = i[:width]
            wmask[r, : min(len(m), width)] = m[:width]
    keep = wmask[:, 1:].sum(axis=1) > 0
    return {
        # each a new array already (`keep` picks rows), so an int32 one is not copied again
        "inputs": windows[keep, :-1].astype(np.int32, copy=False),  # (N, T)
        "targets": windows[keep, 1:].astype(np.int32, copy=False),  # (N, T)
        "mask": wmask[keep, 1:],  # (N, T), on target positions
    }


def sft_batch(
    rows: dict[str, np.ndarray], step: int, seed: int, batch_size: int, accum: int = 1,
    first: int | None = None,
) -> dict[str, np.ndarray]:
    """Rows for one optimizer step, `(accum, batch_size, seq_len)`, a pure function of (seed, step).

    Rows are drawn by epochs: global draw `g = step * accum * batch_size + k` takes row
    `perm_e[g % N]` of the permutation `default_rng([seed, e]).permutation(N)` for epoch
    `e = g // N`, so each row is seen once per epoch and resume needs only the step.
    `first`: a row that epoch 0 draws first (swapped with the one its permutation put there).
    """
    n = len(rows["inputs"])
    if n == 0:
        raise DataError("no training rows to draw batches from")
    if batch_size < 1 or accum < 1 or step < 0 or seed < 0:
        raise DataError(f"need batch_size, accum >= 1 and step, seed >= 0, got "
                        f"batch_size={batch_size}, accum={accum}, step={step}, seed={seed}")
    draws = step * accum * batch_size + np.arange(accum * batch_size)
    index = drawn_rows(n, draws, seed, first).reshape(accum, batch_size)
    return {k: v[index] for k, v in rows.items()}  # (A, B, T)


def drawn_rows(n: int, draws: np.ndarray, seed: int, first: int | None = None) -> np.ndarray:
    """The rows (of `n`) that global draws `draws` take: `sft_batch`'s epochs of permutations,
    epoch 0's with row `first` (if given) moved to its front."""
    epochs = draws // n
    index = np.empty_like(draws)
    for e in np.unique(epochs):
        sel = epochs == e
        perm = np.random.default_rng([seed, int(e)]).permutation(n)
        if e == 0 and first is not None:
            at = int(np.flatnonzero(perm == first)[0])
            perm[[0, at]] = perm[[at, 0]]
        index[sel] = perm[draws[sel] % n]
    return index


PAD_MULTIPLE = 32
"""Unpacked training batches and held-out batches are as long as their longest row rounded up
to this, so that the compiled step and validation see few shapes."""


def trained_ends(mask: np.ndarray) -> np.ndarray:
    """(..., T) mask -> (...): one past each row's last trained target (0 for a row with none)."""
    trained = mask != 0
    return np.where(trained.any(axis=-1), mask.shape[-1] - np.argmax(trained[..., ::-1], axis=-1),
                    0)


def fit_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A batch `(..., T)` cut to its last trained target rounded up to `PAD_MULTIPLE` (at most
    T): the positions cut hold only padding and targets under mask 0, and attention is causal,
    so the loss and its gradients are those of the whole rows."""
    keep = int(fitted_width(trained_ends(batch["mask"]).max(initial=0), batch["mask"].shape[-1]))
    return {k: v[..., :keep] for k, v in batch.items()}


def fitted_width(last: Any, width: int) -> Any:
    """The width `fit_rows` cuts a batch of rows `width` wide to, given one past its last
    trained target `last` (an int or an array of them): `last` rounded up to `PAD_MULTIPLE`
    (at least one multiple), at most `width`."""
    return np.minimum(width, -(-np.maximum(last, 1) // PAD_MULTIPLE) * PAD_MULTIPLE)


def trained_positions(mask: np.ndarray, multiple: int = PAD_MULTIPLE
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Where each row of `mask` (..., B, W) trains a target: positions (..., B, P) int32 and
    their weights (..., B, P) float32 (the mask's values; 0 on the padding entries, which point
    at position 0), P the most any row has rounded up to `multiple`, at most W. A held-out
    loss computes logits there alone (`toymlx.models.losses.lm_held_out_sums`)."""
    width = mask.shape[-1]
    flat = mask.reshape(-1, width)
    counts = (flat != 0).sum(axis=1)
    p = min(width, -(-max(int(counts.max(initial=0)), 1) // multiple) * multiple)
    positions = np.zeros((len(flat), p), np.int32)
    weights = np.zeros((len(flat), p), np.float32)
    for r, row in enumerate(flat):
        at = np.flatnonzero(row)
        positions[r, :len(at)], weights[r, :len(at)] = at, row[at]
    return positions.reshape(*mask.shape[:-1], p), weights.reshape(*mask.shape[:-1], p)


HELD_OUT_ROWS = 4
"""A held-out batch holds this many training batches' rows. A forward pass keeps no
activations for a backward one, so a call of four batches' rows takes less memory than a
training step of one, and each call's fixed costs (tracing a batch shape once a run, decoding a
block-held base's weights, the call itself) are shared by four times the rows: on SmolLM2's
default data the 15 held-out rows are one call, one trace a CPU stream (docs/RESULTS.md)."""


def held_out_call_rows(batch_size: int, grad_checkpoint: bool) -> int:
    """Rows of one held-out call: `HELD_OUT_ROWS` training batches', or with --grad-checkpoint
    one batch's (a forward pass holds one block's activations for its rows, more than a
    checkpointed step holds for its own: the 1B shape at 1 x 512 peaked at 1.62 GB RSS
    validating 4-row calls against its step's 1.36)."""
    return batch_size if grad_checkpoint else HELD_OUT_ROWS * batch_size


def sft_val_batches(
    rows: dict[str, np.ndarray], batch_size: int, max_batches: int, rows_per_batch: int = 0
) -> list[dict[str, np.ndarray]]:
    """The first `max_batches * batch_size` rows in file order, in order of length (their last
    trained target, as mlx-lm's batches are: rows of a batch are alike, so little is padding),
    as `(1, rows_per_batch, W)` batches (default `batch_size` rows; the last one may hold fewer)
    cut by `fit_rows` (W: the longest row rounded up to a multiple of 32, not the rows'
    seq_len: padding costs a CPU as much as tokens do), with their `trained_positions`
    (`positions` and `position_mask`, (1, rows, P))."""
    n = min(len(rows["inputs"]), max_batches * batch_size)
    per = rows_per_batch or batch_size
    order = np.argsort(trained_ends(rows["mask"][:n]), kind="stable")
    out = []
    for b in range(math.ceil(n / per)):
        pick = order[b * per:(b + 1) * per]
        batch = {k: np.ascontiguousarray(v) for k, v in fit_rows(
            {k: v[pick][None] for k, v in rows.items()}).items()}  # (1, B, W)
        batch["positions"], batch["position_mask"] = trained_positions(batch["mask"])
        out.append(batch)
    return out


@dataclass(frozen=True)
class Fit:
    """How one split's examples fit rows of `seq_len + 1` tokens: what `pack_or_pad` cut or
    left out (packing cuts nothing: an example runs on into the next row)."""

    examples: int
    truncated: int = 0
    """Padding mode: examples longer than seq_len + 1 tokens kept with their end cut off"""
    dropped: int = 0
    """Padding mode: examples whose first trained target lies beyond seq_len + 1 tokens (a
    prompt as long as the row), so they make no row"""
    untrained: int = 0
    """Examples with no trained target at all (e.g. messages with no assistant turn under
    mask_prompt), so they make no row"""
    merged: int = 0
    """Examples whose system message starts their first user message instead, the chat
    template having no system role (`system_merged`)"""
    thoughts: int = 0
    """Assistant turns whose reasoning (`<think>...</think>`) the chat template leaves out of the
    conversation it renders, so that it is not trained (`untrained_thoughts`)"""
    unread: dict[str, int] = dataclasses.field(default_factory=dict)
    """Messages by reasoning field (`REASONING_FIELDS`) whose field the chat template never
    writes, so that it is not trained (`unread_fields`)"""
    template: str = ""
    """The chat template's model name (GGUF `general.name`), for the note on `unread`; "" for
    none"""

    @classmethod
    def of(cls, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int,
           pack: bool) -> Fit:
        """The counts for `(ids, loss_mask)` pairs built into rows by `pack_or_pad`."""
        width = seq_len + 1
        # a row's targets are mask[1:width]; an example's first token is never a target
        trained = [bool(np.any(m[1:])) for _, m in sequences]
        within = [bool(np.any(m[1:width])) for _, m in sequences]
        untrained = sum(not t for t in trained)
        if pack:
            return cls(len(sequences), untrained=untrained)
        return cls(len(sequences),
                   truncated=sum(len(i) > width and w for (i, _), w in zip(sequences, within)),
                   dropped=sum(t and not w for t, w in zip(trained, within)),
                   untrained=untrained)

    def note(self, source: str, split: str, seq_len: int, scored: bool = False) -> str | None:
        """One console line saying what of `split` (read from `source`) was cut or left out and
        why, None when nothing was; `scored`: of rows toymlx-eval scores (what follows a cut
        is not scored), not a run's."""
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} cut to their first {seq_len + 1} tokens (--seq-len "
                         f"{seq_len}; what follows is not {'scored' if scored else 'trained'})")
        if self.dropped:
            parts.append(f"{self.dropped} dropped (no trained token within the first "
                         f"{seq_len + 1}: prompts longer than --seq-len {seq_len})")
        if self.untrained:
            parts.append(f"{self.untrained} dropped (nothing to train: no assistant turn or "
                         f"completion)")
        if self.merged:
            parts.append(f"{self.merged} with a system message, which this base's chat template "
                         f"has no role for: its text starts the first user message, a blank line "
                         f"after it (as llama.cpp and toymlx-generate --system put it)")
        if self.thoughts:
            parts.append(f"{counted(self.thoughts, 'assistant turn')} with reasoning "
                         f"(<think>...</think>, <|channel>...<channel|>) the chat template leaves "
                         f"out of the conversation it renders, as the model meets those turns at "
                         f"inference, so only their answers train; --data.train-turns last "
                         f"trains only each final turn, as generation writes it")
        if self.unread:
            fields = " or ".join(self.unread)
            which = f"{self.template}'s chat template" if self.template else "the chat template"
            parts.append(f"{counted(sum(self.unread.values()), 'message')} with a {fields} field "
                         f"{which} never writes, so that reasoning is not trained (as "
                         f"transformers and mlx-lm leave it out)")
        if not parts:
            return None
        return f"{source}: {split}: of {counted(self.examples, 'example')}, {', '.join(parts)}"


def empty_split_error(source: str, split: str, fit: Fit, seq_len: int) -> DataError:
    """The one-line error for a split whose examples all made no row (`fit` says why)."""
    why = []
    if fit.dropped:
        why.append(f"{fit.dropped} with no trained token within the first {seq_len + 1} "
                   f"(prompts longer than --seq-len {seq_len})")
    if fit.untrained:
        why.append(f"{fit.untrained} with nothing to train (no assistant turn or completion)")
    fix = "raise --seq-len or shorten the prompts" if fit.dropped else "add answers to train"
    return DataError(f"{source}: {split}: expected rows to score, found none: of its "
                     f"{counted(fit.examples, 'example')}, {' and '.join(why)}; {fix}")


@dataclass(frozen=True)
class DataSource:
    """The files a data path's training and validation examples came from: `train`, and `valid`
    where a validation file is given (else the last part of `train` validates)."""

    train: str
    valid: str | None = None

    def __str__(self) -> str:
        """"TRAIN + VALID" with a validation file, else TRAIN: as run_start's `data_source` and
        the messages name the data."""
        return self.train if self.valid is None else f"{self.train} + {self.valid}"

    def of(self, split: str) -> str:
        """The file a split's examples came from ("train" or "validation")."""
        return (self.valid or self.train) if split == "validation" else self.train


@dataclass(frozen=True)
class SplitExamples:
    """A data path's examples by split, read but not tokenized: what `SFTData.from_file`
    tokenizes, and what `toymlx-eval --split val` needs alone (the validation examples, without
    tokenizing a 100,000-row train.jsonl it does not score)."""

    train: list[Example]
    val: list[Example]
    source: DataSource
    """The training file, and the validation file where one is given."""
    note: str | None
    """`SFTData.val_note`: a folder without valid.jsonl, validated by train.jsonl's last part; or a
    split that holds out none (`none_held_out`)."""
    test: Path | None
    """A folder's test.jsonl."""

    @classmethod
    def of(cls, path: str | Path, val_fraction: float = 0.1,
           val_path: str | Path | None = None, keys: Mapping[str, str] | None = None
           ) -> SplitExamples:
        """`path`'s examples (a file, or an mlx-lm data folder: `data_files`), each record read
        through `keys` (`row_keys`'); validation is `val_path` or the folder's valid.jsonl if
        given, else the last `val_fraction` of the training file. A folder's valid.jsonl without
        examples (`blank_file`) is refused, but taken as none under `val_fraction` 0: every
        example trains and none validates either way (mlx-lm's meaning of an empty one)."""
        files = data_files(path)
        valid = files.valid
        if val_path is None and valid is not None and blank_file(valid):
            if val_fraction > 0:  # no valid.jsonl or the split of toymlx's default: a guess
                raise DataError(f"{valid}: empty file; expected one example a line {SHAPES}, "
                                f"or no {valid.name} (the last --data.val-fraction "
                                f"{val_fraction} of {files.train.name} then validates; mlx-lm "
                                "would train without validation)")
            valid = None  # as no valid.jsonl, which --data.val-fraction 0 (an mlx-lm config's)
            # trains on every example without: what mlx-lm does with an empty one
        val_path = val_path if val_path is not None else valid
        examples = load_examples(files.train, keys)
        note = None
        if val_path is not None:
            train, val = examples, load_examples(val_path, keys)
        else:
            train, val = split_examples(examples, val_fraction)
            if not val and val_fraction > 0:  # too few examples: the run would validate nothing
                note = none_held_out(files.train, len(examples), val_fraction)
            elif val and files.train != Path(path):  # a folder in mlx-lm's layout, whose
                # valid.jsonl mlx-lm would go without: it trains on every example and validates
                # none (as --data.val-fraction 0 does: nothing to say)
                one = len(val) == 1
                note = (f"{path}: no valid.jsonl: the last {len(val)} of {files.train.name}'s "
                        f"{len(examples)} examples {'validates' if one else 'validate'} and "
                        f"{'is' if one else 'are'} not trained on "
                        f"(--data.val-fraction {val_fraction}; mlx-lm trains on all "
                        f"{len(examples)} and validates nothing, as --data.val-fraction 0 "
                        "does)")
        source = DataSource(str(files.train), None if val_path is None else str(val_path))
        return cls(train, val, source, note, files.test)


@dataclass(frozen=True)
class SFTData:
    """Train, validation and (optional) test rows for fine-tuning, built once from example
    files."""

    train: dict[str, np.ndarray]
    """Training rows, each array `(N, seq_len)`"""
    val: dict[str, np.ndarray]
    """Validation rows, each array `(M, seq_len)`; M may be 0"""
    source: DataSource
    """The file(s) the examples came from (`str`: as run_start's data_source shows them)"""
    n_truncated: int = 0
    """Padding mode: examples longer than seq_len + 1 tokens whose end was cut off"""
    test: dict[str, np.ndarray] | None = None
    """Held-out test rows (a data folder's test.jsonl), None without a test file"""
    test_source: str | None = None
    pack: bool = False
    """Rows are packed; unpacked training batches are cut to their longest row (`fit_rows`)"""
    fits: dict[str, Fit] = dataclasses.field(default_factory=dict)
    """How each split's examples fit --seq-len ("train", "validation", "test": `Fit`)"""
    seq_len: int = 0
    """The rows' --seq-len, for the notes and errors"""
    val_note: str | None = None
    """A data folder without valid.jsonl: which training examples validate instead"""
    tools_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """--data.drop-tools: how many examples' "tools" were left out, by split ("train",
    "validation", "test"), said by `notes` for the splits a run reads (`tools_note`)"""

    def split_source(self, split: str) -> str:
        """The file a split's examples came from ("train", "validation" or "test")."""
        return str(self.test_source) if split == "test" else self.source.of(split)

    def notes(self, test: bool = True) -> list[str]:
        """The validation split's and --data.drop-tools' lines, then one console line per split
        whose examples were cut or left out (`Fit.note`); the test split's (its examples in the
        --data.drop-tools count too) only with `test` (when it is scored)."""
        read = {k: n for k, n in self.tools_dropped.items() if test or k != "test"}
        source = str(self.source) + (f" + {self.test_source}" if read.get("test") else "")
        tools = tools_note(source, sum(read.values()))
        return [n for n in (self.val_note, tools) if n] + [
            line for split, fit in self.fits.items() if test or split != "test"
            if (line := fit.note(self.split_source(split), split, self.seq_len))]

    def check_held_out(self, test: bool) -> None:
        """DataError when validation (always scored: at the end of a run if not before) or,
        with `test`, the test set had examples but none made a row."""
        for split, rows in (("validation", self.val), ("test", self.test if test else None)):
            fit = self.fits.get(split)
            if rows is not None and fit is not None and fit.examples and not len(rows["inputs"]):
                raise empty_split_error(self.split_source(split), split, fit, self.seq_len)

    @classmethod
    def from_examples(
        cls,
        train: Sequence[Example],
        val: Sequence[Example],
        tokenizer: ChatTokenizer,
        seq_len: int,
        mask_prompt: bool = True,
        pack: bool = False,
        source: DataSource = DataSource("<examples>"),
        turns: str = "assistant",
        progress: bool = False,
    ) -> SFTData:
        """Tokenize and build rows (`turns`: which messages train, `TURNS`); the pad id is the
        tokenizer's EOS (always under mask 0). `progress`: a bar over each split's examples
        on a terminal (`fitted_rows`)."""
        rows, fit = fitted_rows(train, tokenizer, seq_len, mask_prompt, pack, turns,
                                "training" if progress else None)
        if len(rows["inputs"]) == 0:
            if fit.untrained == fit.examples:
                raise DataError(f"{source}: no training example has a trained token: no "
                                f"assistant turn (messages) or completion to train; add one, "
                                f"or set --data.no-mask-prompt")
            raise DataError(f"{source}: no training example has a trained token within its "
                            f"first {seq_len + 1} tokens (--seq-len {seq_len} + 1); raise "
                            f"--seq-len, shorten the prompts, or set --data.no-mask-prompt")
        val_rows, val_fit = fitted_rows(val, tokenizer, seq_len, mask_prompt, pack, turns,
                                        "validation" if progress else None)
        return cls(rows, val_rows, source, fit.truncated, pack=pack,
                   fits={"train": fit, "validation": val_fit}, seq_len=seq_len)

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer: ChatTokenizer,
        seq_len: int,
        mask_prompt: bool = True,
        pack: bool = False,
        val_fraction: float = 0.1,
        val_path: str | Path | None = None,
        turns: str = "assistant",
        progress: bool = False,
        keys: Mapping[str, str] | None = None,
        drop_tools: bool = False,
        test: bool = True,
    ) -> SFTData:
        """Load `path` (a file, or an mlx-lm data folder: `data_files`), each record read
        through `keys` (`row_keys`'); validation is `val_path` or the folder's valid.jsonl if
        given, else the last `val_fraction` of the training file; with `test` (a run that scores
        it: --test), a folder's test.jsonl becomes `test`, else it is not read (a test.jsonl
        that would be refused blocks no run that never scores it); every split's rows as
        `turns` says (`TURNS`); `progress` as
        `from_examples`'s; `drop_tools`: every example's "tools" left out (`without_tools`),
        said by a note."""
        ex = SplitExamples.of(path, val_fraction, val_path, keys)
        train, val, dropped = ex.train, ex.val, {}
        if drop_tools:
            (train, dropped["train"]), (val, dropped["validation"]) = (without_tools(train),
                                                                       without_tools(val))
        data = cls.from_examples(train, val, tokenizer, seq_len, mask_prompt, pack,
                                 ex.source, turns, progress)
        data = dataclasses.replace(data, val_note=ex.note, tools_dropped=dropped)
        if ex.test is None or not test:
            return data
        test_examples = load_examples(ex.test, keys)
        if drop_tools:
            test_examples, dropped["test"] = without_tools(test_examples)
        test, fit = fitted_rows(test_examples, tokenizer, seq_len, mask_prompt, pack, turns,
                                "test" if progress else None)
        return dataclasses.replace(data, test=test, test_source=str(ex.test),
                                   fits={**data.fits, "test": fit}, tools_dropped=dropped)

    @functools.cached_property
    def first_row(self) -> int | None:
        """Unpacked: the row that trains to the farthest position, which step 0's batch holds,
        so that the run's widest batch, and its peak memory, come at its first step (a run
        that cannot fit fails there, and no later step stops to fault in new memory or build
        new kernels for it); None when packed (every batch is as wide)."""
        if self.pack:
            return None
        return int(np.argmax(trained_ends(self.train["mask"])))

    def batch(self, step: int, seed: int, batch_size: int, accum: int = 1) -> dict[str, np.ndarray]:
        """`sft_batch` over the training rows; unpacked, cut to the batch's longest row
        (`fit_rows`), step 0's holding the training set's longest (`first_row`)."""
        batch = sft_batch(self.train, step, seed, batch_size, accum, self.first_row)
        return batch if self.pack else fit_rows(batch)

    def batch_widths(self, steps: range, seed: int, batch_size: int, accum: int = 1
                     ) -> np.ndarray:
        """The width of `batch(step, ...)` for each step of `steps`, from the drawn rows' last
        trained targets alone (no batch is built)."""
        width = self.train["mask"].shape[-1]
        if self.pack:
            return np.full(len(steps), width)
        per = accum * batch_size
        draws = (np.asarray(steps)[:, None] * per + np.arange(per)).ravel()
        rows = drawn_rows(len(self.train["mask"]), draws, seed, self.first_row)
        ends = trained_ends(self.train["mask"])[rows]
        return fitted_width(ends.reshape(len(steps), per).max(axis=1), width)

    def val_batches(self, batch_size: int, max_batches: int | None,
                    grad_checkpoint: bool = False) -> list[dict[str, np.ndarray]]:
        """`sft_val_batches` over the validation rows (the first `max_batches` batches' worth;
        None: every row), `held_out_call_rows` a batch."""
        most = math.ceil(len(self.val["inputs"]) / batch_size) if max_batches is None \
            else max_batches
        return sft_val_batches(self.val, batch_size, most,
                               held_out_call_rows(batch_size, grad_checkpoint))

    def test_batches(self, batch_size: int, grad_checkpoint: bool = False
                     ) -> list[dict[str, np.ndarray]]:
        """Every test row as `(1, held_out_call_rows, W)` batches ([] without a test file)."""
        if self.test is None:
            return []
        return sft_val_batches(self.test, batch_size, math.ceil(len(self.test["inputs"])
                                                                / batch_size),
                               held_out_call_rows(batch_size, grad_checkpoint))


def held_out_rows(examples: Sequence[Example], tokenizer: ChatTokenizer, seq_len: int,
                  mask_prompt: bool = True, pack: bool = False, turns: str = "assistant"
                  ) -> dict[str, np.ndarray]:
    """Rows of validation or test examples, built as the training rows are."""
    return fitted_rows(examples, tokenizer, seq_len, mask_prompt, pack, turns)[0]


TOKENIZE_EXAMPLES = 256
"""`fitted_rows` tokenizes this many examples at a time (`_tokenized`): one tokenizer call for
all their pieces, and a step of its bar."""


def fitted_rows(examples: Sequence[Example], tokenizer: ChatTokenizer, seq_len: int,
                mask_prompt: bool = True, pack: bool = False, turns: str = "assistant",
                split: str | None = None, first: int | None = None
                ) -> tuple[dict[str, np.ndarray], Fit]:
    """`pack_or_pad` rows of `examples` and how they fit (`Fit`: what was cut or left out);
    `turns` as `tokenize_example`'s. Each example's ids and mask are kept as int32 and uint8
    arrays as soon as it is tokenized (5 bytes a token), not as lists of Python ints (16 to
    44), which `pack_or_pad` then copied whole: `SFTData.from_file` on 100,000 SmolLM2 chat
    examples peaked at 2.1 GB that way, 0.97 GB this way. `split`: the split named on a bar over
    the examples ("training": `tokenizing training examples`), drawn where stderr is a terminal
    (those 100,000 took over a minute), a step for each `TOKENIZE_EXAMPLES`; None: none.
    `first`: only the first that many rows, the same as the first of all the examples' rows,
    from no example after the one that completes them (`Fit` counts the examples up to it;
    the rest of its batch is tokenized and dropped)."""
    seqs: list[tuple[np.ndarray, np.ndarray]] = []
    done = None if first is None else _RowsDone(first, seq_len, pack)
    with pass_bar(len(examples), split and f"tokenizing {split} examples", "example") as bar:
        for start in range(0, len(examples), TOKENIZE_EXAMPLES):
            chunk = examples[start:start + TOKENIZE_EXAMPLES]
            seqs.extend(_tokenized(chunk, tokenizer, mask_prompt, turns))
            if bar is not None:
                bar.update(len(chunk))
            if done is not None:  # the example that completes the rows ends them
                end = next((k + 1 for k in range(len(seqs) - len(chunk), len(seqs))
                            if done(seqs[k][1])), None)
                if end is not None:
                    del seqs[end:]
                    break
    rows = pack_or_pad(seqs, seq_len, tokenizer.eos_id, pack)
    if first is not None:
        rows = {k: v[:first] for k, v in rows.items()}
    merged = sum(system_merged(e, tokenizer) for e in examples[:len(seqs)])
    thoughts = 0
    unread: dict[str, int] = {}
    for e in examples[:len(seqs)]:
        fields = unread_fields(e, tokenizer)
        thoughts += untrained_thoughts(e, tokenizer, mask_prompt, turns, fields)
        for _, key in fields:
            unread[key] = unread.get(key, 0) + 1
    name = getattr(tokenizer, "name", None)
    return rows, dataclasses.replace(Fit.of(seqs, seq_len, pack), merged=merged,
                                     thoughts=thoughts, unread=unread,
                                     template=name if isinstance(name, str) else "")


class _RowsDone:
    """Whether `fitted_rows`'s examples so far make its `first` rows in full, as every example
    would make them, counting as `pack_or_pad` keeps rows (those
    with a trained target). Padded, an example makes one row or none; packed, row r is whole
    once the examples reach its last token, r * seq_len + seq_len, and holds a target when
    one of the trained flags of its positions r * seq_len + 1 on is set (an example's first
    token never is)."""

    def __init__(self, first: int, seq_len: int, pack: bool):
        self.first, self.seq_len, self.pack = first, seq_len, pack
        self.rows = 0  # rows kept so far (whole ones, packed)
        self.whole = 0  # packed: whole rows counted
        self.flags, self.at = np.zeros(0, np.uint8), 0  # packed: flags from position `at` on

    def __call__(self, mask: np.ndarray) -> bool:
        """Whether the rows are made, with the example of trained flags `mask` next."""
        t = self.seq_len
        if not self.pack:
            self.rows += bool(np.any(mask[1:t + 1]))
            return self.rows >= self.first
        if len(mask):
            self.flags = np.concatenate([self.flags, [0], mask[1:]]).astype(np.uint8)
        end = self.at + len(self.flags)  # positions held so far
        while (self.whole + 1) * t <= end - 1:
            lo = self.whole * t + 1 - self.at
            self.rows += bool(self.flags[lo:lo + t].any())
            self.whole += 1
        cut = self.whole * t + 1 - self.at  # positions of counted rows are not needed again
        self.flags, self.at = self.flags[cut:], self.at + cut
        return self.rows >= self.first
