"""Tokenizers built from a GGUF file's own `tokenizer.*` metadata, tokenizing as llama.cpp does.

Three llama.cpp vocabulary types are supported (`tokenizer.ggml.model`):

- ``"gpt2"``: byte-level BPE (`tokens` + `merges`). The text is cut by the regexes llama.cpp
  uses for `tokenizer.ggml.pre` (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`), each regex
  splitting the pieces of the previous one, matches and the text between them both kept as
  pieces; every piece is byte-mapped (GPT-2's bytes->unicode table) and merged by rank.
  GPT-2, Llama 3 (`llama-bpe`), Qwen2.5/Qwen3 (`qwen2`), Qwen3.5 (`qwen35`), SmolLM,
  SmolLM3 (`smaug-bpe`), OLMo 2 (`dbrx`; its SuperBPE variant `superbpe`), Granite 3
  (`refact`), Phi-4 and Phi-4-mini (`gpt-4o`), Mistral-Nemo and Ministral (`tekken`),
  DeepSeek-Coder (`deepseek-coder`), DeepSeek-LLM (`deepseek-llm`), Seed-Coder
  (`seed-coder`), Viking (`viking`), ...
- ``"llama"``: SentencePiece BPE (`tokens` + `scores` + `token_type`). llama.cpp prepends a
  space to every raw-text fragment when `add_space_prefix` (default true), replaces every space
  by U+2581 "▁", then repeatedly merges the adjacent pair whose concatenation is the
  highest-scoring token (ties: leftmost), a character that is no token itself merging too;
  characters that end up in no token fall back to the `<0xXX>` byte tokens. Llama 2, Phi-3,
  Gemma 1-3.
- ``"gemma4"``: BPE by merge rank on raw UTF-8 (no byte mapping) after the "▁" escape, the
  text cut only into runs of newlines and runs of other characters, `<0xXX>` byte fallback;
  llama.cpp always adds bos for it (Gemma 4).

The merging runs in the Rust `tokenizers` library: for "llama" the score-ordered merges are
derived from the vocabulary (every split of a token into two tokens, ranked by the token's
score). Special tokens are cut out of the text first exactly as llama.cpp's
`tokenizer_st_partition` does, with the token attributes llama.cpp derives at load time (the
GGUF token types, then end-of-generation and fill-in-the-middle tokens recognised by their
text made control tokens, Phi-3's right-stripping specials): user-defined tokens always,
control and unknown tokens only with `parse_special=True`; longer token texts are matched first.

`byte_tokenizer()` is the from-scratch vocabulary: `<unk>`, `<s>`, `</s>`, then one token per
byte value (byte b is id b + 3), stored as a "llama" vocabulary llama.cpp loads as it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, normalizers

from toymlx.backend import notice
from toymlx.data.chat_template import compile_template, reasoning_aliased, render_context
from toymlx.data.merges import (
    PRE_TOKENIZERS,
    SUPPORTED_PRE,
    UNICODE_TO_BYTE,
    PreTokenizer,
    build_bpe,
    build_spm,
    encode_spm_style,
    resegment,
)
from toymlx.data.special_tokens import C_SPACE, split_special, token_attributes
from toymlx.data.vocab import (
    A_BYTE,
    A_CONTROL,
    A_NORMAL,
    A_UNKNOWN,
    BYTE,
    BYTE_OFFSET,
    K_ADD_BOS,
    K_ADD_EOS,
    K_ADD_PREFIX,
    K_BOS,
    K_EOS,
    K_MERGES,
    K_MODEL,
    K_NAME,
    K_PRE,
    K_SCORES,
    K_TEMPLATE,
    K_TOKENS,
    K_TYPES,
    K_UNK,
    NORMAL,
    SPACE,
    SPECIAL,
    SUPPORTED_MODELS,
    TokenizerError,
    byte_ids,
    byte_metadata,
    is_byte_token,
    plain_value,
)
from toymlx.gguf.reader import read_metadata

ENCODE_CHARS = 1 << 18
"""How much text one call of the `tokenizers` library encodes in `Tokenizer.encode_stream`, and
the longest raw-text fragment `Tokenizer.encode_batch` encodes in one call (longer ones are cut)."""

CARRY_CHARS = 1 << 20
"""The most text `Tokenizer.encode_stream` holds while it finds no safe cut (`_safe_cut`):
beyond it the text is cut anyway (`_forced_cut`). A text with no safe cut at all (one run of
letters: a DNA sequence, a script written without spaces or punctuation) was held whole and
encoded in one call: ~150 bytes a character in `tokenizers` (a 200 MB file: 30 GB), each piece
appended to the held text by a copy of it (quadratic), and no Ctrl-C seen until the call
returned."""

# Where each `tokenizer.ggml.pre`'s regexes cut, written over a string of one class letter per
# character (`_classes`): R "\r"/"\n", W other whitespace (\s), L \p{L}, M \p{M}, N \p{N},
# A "'", P the rest of [\p{P}$+<=>^~|] (the "default" pre's first regex), O anything else.
# No regex looks behind, so the pieces after a cut are those of the text after it alone when
# no piece runs across the cut, and those before it are the same when no match before it looks
# past it (only (?!\S) and the greedy runs do: each rule ends such a run at the cut). Apostrophes
# are kept off the left of a cut, where they could begin a contraction ('s 'll ...).
_GPT2_CUTS = (r"(?<=L)(?=[^L])|(?<=N)(?=[^N])"  # a letter run, a digit run ends
              r"|(?<=[MPO])(?=[LNWR])"  # a run of other characters ends
              # two whitespace before a non-space: \s+(?!\S) backs off to the first
              r"|(?<=[WR])(?=[WR][^WR])")
# every digit is a piece of its own first; then GPT-2's regex within what lies between
_SMOLLM_CUTS = (r"(?<=N)|(?=N)|(?<=L)(?=[^L])|(?<=[MPO])(?=[LWR])"
                r"|(?<=[WR])(?=[WR][LMAPO])")
# punctuation runs are pieces first; then GPT-2's regex within what lies between
_DEFAULT_CUTS = (r"(?<=[PA])(?=[^PA])|(?<=[^PA])(?=[PA])"
                 r"|(?<=L)(?=[NMOWR])|(?<=N)(?=[LMOWR])|(?<=[MO])(?=[LNWR])"
                 r"|(?<=[WR])(?=[WR][LNMO])")


def _llama3_cuts(letter: str, other: str, digits: str, *, letter_tail: str = "",
                 newline_tail: str = "") -> str:
    """Cuts of Llama 3's regex and its kin, Qwen's, GPT-4o's (`letter`, `other`: the class
    letters of their letter runs and of what is neither letter, digit nor whitespace; `digits`:
    the cuts among and around digits; `letter_tail`: what a letter run takes after it, GPT-4o's
    contractions; `newline_tail`: what a run of other characters takes after its newlines,
    GPT-4o's "/")."""
    return (rf"(?<=R)(?=[^WR{newline_tail}])"  # after newlines, before a non-space
            rf"|(?<=[{letter}])(?=[^{letter}{letter_tail}])"  # a letter run ends
            rf"|{digits}"
            rf"|(?<=[{other}])(?=W)"  # a run of other characters ends (not before a newline)
            r"|(?<=W)(?=W[^WR])")  # two spaces before a non-space: \s+(?!\S) backs off


# \p{N}{1,3}: digits are cut in threes from the start of their run, so only at its ends
_LLAMA3_CUTS = _llama3_cuts("L", "MAPO", r"(?<=N)(?=[^N])|(?<=[LMAPO])(?=N)")
_QWEN2_CUTS = _llama3_cuts("L", "MAPO", r"(?<=N)|(?<=[LMAPO])(?=N)")  # \p{N}: one a piece
_QWEN35_CUTS = _llama3_cuts("LM", "APO", r"(?<=N)|(?<=[LMAPO])(?=N)")  # [\p{L}\p{M}]+ runs
# Phi-4's (a letter run ends at a case change or takes a contraction) and Mistral-Nemo's (no
# contractions, digits one a piece): Llama 3's cuts where no case is looked at
_GPT4O_CUTS = _llama3_cuts("L", "MAPO", r"(?<=N)(?=[^N])|(?<=[LMAPO])(?=N)", letter_tail="A",
                           newline_tail="P")
_TEKKEN_CUTS = _llama3_cuts("L", "MAPO", r"(?<=N)|(?<=[LMAPO])(?=N)", newline_tail="P")
# only digit runs are cut out, and cut counting from their right end
_SUPERBPE_CUTS = r"(?<=N)(?=[^N])|(?<=[^N])(?=N)"
# newlines, digits (each a piece in the end: a CJK run holding one is cut there too), a letter
# run's end, and its start where no whitespace before it joins it
_DEEPSEEK_CODER_CUTS = r"(?<=R)|(?=R)|(?<=N)|(?=N)|(?<=L)(?=[^L])|(?<=[MNAPO])(?=L)"
# DeepSeek LLM's letter runs are of some scripts only, and "\s+$" takes the whitespace at the
# end of a piece: only newlines, and digit runs' ends where no whitespace is before them
_DEEPSEEK_LLM_CUTS = r"(?<=R)|(?=R)|(?<=N)(?=[^N])|(?<=[LMAPO])(?=N)"
# Viking's: a word's end before whitespace, its start after a newline (what lies between words
# is one piece, and a word takes the one space before it), digits where no space is before them
_VIKING_CUTS = r"(?<=N)|(?<=[^W])(?=N)|(?<=[LMN])(?=[WR])|(?<=R)(?=[LMN])"
_CUTS = {PRE_TOKENIZERS[name].regexes: re.compile(cuts) for name, cuts in (
    ("gpt-2", _GPT2_CUTS), ("smollm", _SMOLLM_CUTS), ("default", _DEFAULT_CUTS),
    ("llama3", _LLAMA3_CUTS), ("qwen2", _QWEN2_CUTS), ("qwen35", _QWEN35_CUTS),
    ("gpt-4o", _GPT4O_CUTS), ("tekken", _TEKKEN_CUTS), ("seed-coder", _QWEN2_CUTS),
    ("superbpe", _SUPERBPE_CUTS), ("deepseek-coder", _DEEPSEEK_CODER_CUTS),
    ("deepseek-llm", _DEEPSEEK_LLM_CUTS), ("viking", _VIKING_CUTS))}
"""Cut places by the regexes of a `tokenizer.ggml.pre` (gemma4's are SentencePiece's)."""

# the class letters, an earlier one winning, each tested by the regex engine the pre-tokenizers
# run in: its Unicode tables are not Python's (with tokenizers 0.23 and Python 3.11, \p{L}
# holds ~9,000 letters that unicodedata does not know)
_CLASS_RES = (("R", r"[\r\n]"), ("W", r"\s"), ("L", r"\p{L}"), ("M", r"\p{M}"), ("N", r"\p{N}"),
              ("A", r"'"), ("P", r"[\p{P}\$\+<=>\^~\|]"))
_CLASS_OF = np.zeros(0x110000, np.uint8)  # code point -> class letter, 0 until first seen


def _classes(text: str) -> str:
    """One class letter per character of `text` (see `_GPT2_CUTS`)."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    found = _CLASS_OF[points]
    if not found.all():
        new = "".join(map(chr, np.unique(points[found == 0]).tolist()))
        letters = ["O"] * len(new)
        for letter, pattern in reversed(_CLASS_RES):
            # a character the pattern matches comes back NUL (NUL itself is in no class)
            marked = normalizers.Replace(Regex(pattern), "\0").normalize_str(new)
            for i, (a, b) in enumerate(zip(new, marked, strict=True)):
                if a != b:
                    letters[i] = letter
        _CLASS_OF[[ord(c) for c in new]] = np.frombuffer("".join(letters).encode(), np.uint8)
        found = _CLASS_OF[points]
    return found.tobytes().decode("ascii")


def _class_cuts(text: str, end: int, low: int, cuts: re.Pattern) -> Iterator[int]:
    """The places in `text` from `low` to `end` where `cuts` matches its class letters, last
    first, looking back a growing window at a time."""
    hi, size = end + 1, 1 << 12
    while hi > low:
        lo = max(low, hi - size)
        start = lo - 1  # the character before a cut, for the look-behind (low >= 1)
        classes = _classes(text[start:hi + 2])
        yield from reversed([start + m.start() for m in cuts.finditer(classes, 1)
                             if start + m.start() < hi])
        hi, size = lo, size * 4


def _describe(value: Any) -> str:
    if isinstance(value, list):
        inner = type(value[0]).__name__ if value else "nothing"
        return f"a list of {len(value)} ({inner})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Tokenizer:
    """A llama.cpp-compatible tokenizer made from GGUF `tokenizer.*` metadata.

    Build one with `Tokenizer.from_metadata(meta)` / `Tokenizer.from_gguf(path)` or
    `byte_tokenizer()`.
    """

    def __init__(self, meta: Mapping[str, Any], source: str | os.PathLike | None = None):
        self.source = str(source) if source is not None else "tokenizer metadata"
        self._meta = {k: plain_value(v) for k, v in meta.items()
                      if k.startswith("tokenizer.ggml.") or k == K_TEMPLATE}
        arch = meta.get("general.architecture")
        if K_MODEL not in self._meta and plain_value(arch) == "vit":  # a toymlx-classify model
            self._fail(K_MODEL, f"one of {list(SUPPORTED_MODELS)}", "missing key: an image "
                       "classifier (general.architecture 'vit') holds no tokenizer; give a "
                       "language model's GGUF")
        model = self._get(K_MODEL, str, f"one of {list(SUPPORTED_MODELS)}")
        if model not in SUPPORTED_MODELS:
            self._fail(K_MODEL, f"one of {list(SUPPORTED_MODELS)}", repr(model))
        self.model: str = model

        tokens = self._get_list(K_TOKENS, str, "a non-empty list of token strings")
        if not tokens:
            self._fail(K_TOKENS, "a non-empty list of token strings", "an empty list")
        n = len(tokens)
        types = self._get_list(K_TYPES, int, f"a list of {n} ints", required=False)
        if types is not None and len(types) != n:
            self._fail(K_TYPES, f"{n} entries (one per token)", f"{len(types)}")
        scores = self._get_list(K_SCORES, (int, float), f"a list of {n} floats",
                                required=model == "llama")
        if scores is not None and len(scores) != n:
            self._fail(K_SCORES, f"{n} entries (one per token)", f"{len(scores)}")
        token_to_id = {t: i for i, t in enumerate(tokens)}
        if len(token_to_id) != n:
            first: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in first:
                    self._fail(K_TOKENS, "unique token strings", f"{t!r} at ids {first[t]} and {i}")
                first[t] = i
        self._tokens: list[str] = list(tokens)
        self._types: list[int] = [NORMAL] * n if types is None else list(types)
        self._scores: list[float] | None = scores
        self._token_to_id = token_to_id

        # flags and special ids, with llama.cpp's defaults per vocabulary type
        pre_rules: PreTokenizer | None = None
        if model == "llama":
            self.pre: str | None = None
            default_add_bos = True
            default_bos, default_eos, default_unk = 1, 2, 0
            self.add_space_prefix = bool(self._get(K_ADD_PREFIX, bool, "a bool", default=True))
        else:
            if model == "gemma4":  # llama.cpp sets this pre-tokenizer whatever the file says
                pre = "gemma4"
                default_bos = default_eos = default_unk = None
            else:
                pre = self._get(K_PRE, str, f"one of {list(SUPPORTED_PRE)}", default="default")
                if pre not in PRE_TOKENIZERS:
                    self._fail(K_PRE, f"one of {list(SUPPORTED_PRE)}", repr(pre))
                default_bos, default_eos, default_unk = 11, 11, None
            self.pre = pre
            pre_rules = PRE_TOKENIZERS[pre]
            default_add_bos = pre_rules.add_bos
            self.add_space_prefix = False  # llama.cpp never prefixes a space for BPE vocabularies
        self._spm_style = pre_rules is not None and pre_rules.spm_style
        self._bos = self._special_id(K_BOS, default_bos)
        self._eos = self._special_id(K_EOS, default_eos)
        self._unk = self._special_id(K_UNK, default_unk)
        self.add_bos: bool = bool(self._get(K_ADD_BOS, bool, "a bool", default=default_add_bos))
        if pre_rules is not None and pre_rules.force_bos:
            self.add_bos = True
        self.add_eos: bool = bool(self._get(K_ADD_EOS, bool, "a bool", default=False))
        if self.add_bos and self._bos is None:
            self._fail(K_BOS, f"a token id below {n} (add_bos_token is true)", "missing")
        template = self._get(K_TEMPLATE, str, "a Jinja template string", default=None)
        self._chat_template: str | None = template or None

        name = meta.get(K_NAME)
        self.name: str | None = name.strip() if isinstance(name, str) and name.strip() else None
        """The model's name (GGUF `general.name`) where the metadata gives one: the data notes
        name a chat template by it."""
        attrs, eog = token_attributes(self._tokens, self._token_to_id, self._types, self._meta,
                                      self._eos, name.lower() if isinstance(name, str) else "")
        self._attrs = attrs
        self._attr_arr = np.array(attrs, dtype=np.int32)
        self._eog = frozenset(eog)
        # dropped when decoding with skip_special
        self._special_mask = (self._attr_arr & (A_CONTROL | A_UNKNOWN)) != 0
        # after these, llama.cpp's SPM encoder has prefixed a space to the following text
        self._prefix_after = (self._attr_arr & SPECIAL) != 0
        # special tokens cut out of the text before tokenizing, longest text first
        self._partition: list[tuple[str, int, int]] = sorted(
            ((tokens[i], i, self._attrs[i]) for i in np.flatnonzero(self._attr_arr & SPECIAL)
             .tolist()),
            key=lambda x: (-len(x[0].encode("utf-8")), x[1]))

        self._pieces: list[bytes | None] = [None] * n  # filled on first use
        self._byte_layout = self._is_byte_layout()
        # what `_safe_cut` looks at: the longest special token text, for SentencePiece BPE
        # (and gemma4's) every two characters side by side in a token, for byte-level BPE
        # where its pre-tokenizer's regexes cut
        self._special_len = max((len(t) for t, _, _ in self._partition), default=0)
        self._pairs: frozenset[str] | None = frozenset(
            t[i:i + 2] for t in tokens for i in range(len(t) - 1)) \
            if not self._byte_layout and (pre_rules is None or pre_rules.spm_style) else None
        self._cuts = _CUTS[pre_rules.regexes] \
            if pre_rules is not None and not pre_rules.spm_style else None
        self._loose: list[list[int]] = []  # build_spm's stand-ins' ids, for `resegment`
        if pre_rules is not None:
            merges = self._get_list(K_MERGES, str, "a list of 'left right' merge strings")
            self._hf = build_bpe(self._token_to_id, merges, pre_rules, self.source)
        elif self._byte_layout:
            self._hf = None
        else:
            self._hf, self._loose = build_spm(self._tokens, self._scores, self._token_to_id,
                                              self._unk)

    # -------------------------------------------------------------- construction helpers
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str | os.PathLike | None = None
                      ) -> Tokenizer:
        """Build from GGUF metadata (plain Python values); `source` names the file in errors.

        Besides the `tokenizer.*` keys only `general.name` is read: llama.cpp gives Phi-3's
        special tokens right-stripping by that name."""
        return cls(meta, source)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from the `tokenizer.*` metadata of a GGUF file."""
        path = Path(path)
        return cls(read_metadata(path), path)

    def _fail(self, key: str, expected: str, found: str):
        raise TokenizerError(f"{self.source}: {key}: expected {expected}, found {found}")

    def _get(self, key: str, kind: type | tuple, expected: str, default: Any = ...) -> Any:
        if key not in self._meta:
            if default is ...:
                self._fail(key, expected, "missing key")
            return default
        value = self._meta[key]
        if kind is bool:  # some writers store flags as 0/1 integers
            ok = isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            self._fail(key, expected, _describe(value))
        return value

    def _get_list(self, key: str, kind: type | tuple, expected: str, required: bool = True):
        if key not in self._meta:
            if required:
                self._fail(key, expected, "missing key")
            return None
        value = self._meta[key]
        if not isinstance(value, list):
            self._fail(key, expected, _describe(value))
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not set(map(type, value)) <= set(kinds):  # the exact types first: fast on 250k entries
            for i, v in enumerate(value):
                if not isinstance(v, kind) or isinstance(v, bool):
                    self._fail(key, expected, f"{_describe(v)} at index {i}")
        return value

    def _special_id(self, key: str, default: int | None) -> int | None:
        n = len(self._tokens)
        if default is not None and default >= n:
            default = None
        if key not in self._meta:
            return default
        value = self._get(key, int, f"a token id below {n}")
        if value in (-1, 0xFFFFFFFF):  # "not set" as some converters write it
            return default
        if not 0 <= value < n:
            self._fail(key, f"a token id below {n}", str(value))
        return int(value)

    def _piece(self, i: int) -> bytes:
        """The bytes of token i as llama.cpp's token_to_piece(special=True) gives them."""
        piece = self._pieces[i]
        if piece is None:
            text, attr = self._tokens[i], self._attrs[i]
            if attr & SPECIAL:
                piece = text.encode("utf-8")
            elif attr & A_NORMAL:
                if self.model == "llama" or self._spm_style:
                    piece = text.replace(SPACE, " ").encode("utf-8")
                else:
                    piece = b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE
                                     else c.encode("utf-8") for c in text)
            elif attr & A_BYTE and is_byte_token(text):
                piece = bytes([int(text[3:5], 16)])
            else:  # unused / undefined: llama.cpp renders nothing
                piece = b""
            self._pieces[i] = piece
        return piece

    def _is_byte_layout(self) -> bool:
        """True for exactly the `byte_tokenizer()` vocabulary layout (fast numpy path)."""
        if (self.model != "llama" or len(self._tokens) != 256 + BYTE_OFFSET
                or self.add_space_prefix):
            return False
        if any(ty == NORMAL for ty in self._types[:BYTE_OFFSET]):
            return False
        for b in range(256):
            text, ty = self._tokens[b + BYTE_OFFSET], self._types[b + BYTE_OFFSET]
            if b == 0x20 and text == SPACE and ty == NORMAL:
                continue
            if ty != BYTE or text != f"<0x{b:02X}>":
                return False
        return True

    # -------------------------------------------------------------- properties
    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eos_token(self) -> str:
        """The EOS token's text, a chat template's `eos_token` ("" without an EOS)."""
        return self._tokens[self._eos] if self._eos is not None else ""

    @property
    def unk_id(self) -> int | None:
        return self._unk

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def is_byte_tokenizer(self) -> bool:
        """Whether this is the `byte_tokenizer()` layout (byte b <-> id b + 3)."""
        return self._byte_layout

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation as llama.cpp's `llama_vocab_is_eog` says: eos, the
        end-of-turn tokens it recognises by text, fill-in-the-middle pad/repo/file separators."""
        return self._eog

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of a token id."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos={self._bos}, eos={self._eos}, add_bos={self.add_bos}, "
                f"source={self.source!r})")

    # -------------------------------------------------------------- encoding
    def encode(self, text: str, add_bos: bool | None = None, *, add_eos: bool = False,
               parse_special: bool = True) -> list[int]:
        """Token ids of `text` as llama.cpp's `llama_tokenize` gives them.

        `add_bos=None` uses the GGUF's `tokenizer.ggml.add_bos_token` (llama.cpp's default per
        vocabulary type when absent). `parse_special=True` turns the text of control/unknown
        tokens (e.g. "<|im_start|>") into those tokens, as llama.cpp does for prompts and
        Hugging Face does by default; llama.cpp's tokenizer test vectors use False.
        """
        return self.encode_np(text, add_bos, add_eos=add_eos, parse_special=parse_special).tolist()

    def encode_np(self, text: str, add_bos: bool | None = None, *, add_eos: bool = False,
                  parse_special: bool = True) -> np.ndarray:
        """`encode` as an int32 numpy array (vectorised for the byte tokenizer)."""
        ids = self.encode_batch([text], add_bos, parse_special=parse_special)[0]
        if add_eos:
            self._check_added(add_bos, add_eos)
            ids = np.append(ids, np.int32(self._eos))
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None, *,
                     parse_special: bool = True) -> list[np.ndarray]:
        """`encode_np(text, add_bos)` of each of `texts`, the same int32 ids, with one call into
        `tokenizers` for the raw text of them all (its `encode_batch`) instead of one a text:
        a chat file's examples are cut into many short pieces (`toymlx.data.chat`), and a call
        costs more than its few tokens do. A raw-text fragment longer than `ENCODE_CHARS` is
        encoded apart, in parts cut where its ids stay those of the whole (`_encode_cut`):
        `tokenizers` holds ~150 bytes a character while it merges (a 50 MB chat message: 10 GB)."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"encode: expected str, found {type(text).__name__}")
        bos = self._check_added(add_bos, False)
        fragments = [split_special(text, self._partition, parse_special) for text in texts]
        raw = [f for frags in fragments for f in frags if isinstance(f, str)]
        short = iter(self._encode_raw([f for f in raw if not self._is_long(f)]))
        encoded = iter([self._encode_long(f, parse_special) if self._is_long(f) else next(short)
                        for f in raw])
        head = [np.array([self._bos], dtype=np.int32)] if bos else []
        return [np.concatenate(head + [next(encoded) if isinstance(f, str)
                                       else np.array([f], dtype=np.int32) for f in frags]
                               ).astype(np.int32, copy=False)
                if head or frags else np.zeros(0, dtype=np.int32) for frags in fragments]

    def _is_long(self, fragment: str) -> bool:
        """Whether `encode_batch` encodes this raw-text fragment in parts (the byte vocabulary
        holds one id a byte, whatever the length)."""
        return not self._byte_layout and len(fragment) > ENCODE_CHARS

    def _encode_long(self, fragment: str, parse_special: bool) -> np.ndarray:
        """The ids `_encode_raw` gives one raw-text fragment, encoded in parts; where no safe
        cut comes the text is held until one does, never cut by force: the ids never change."""
        return np.concatenate(list(self._encode_cut([fragment], parse_special=parse_special)))

    @property
    def id_dtype(self) -> type[np.integer]:
        """The smallest array type of this vocabulary's ids that `encode_stream` gives: uint16
        for at most 65,536 ids, else int32."""
        return np.uint16 if len(self._tokens) <= 1 << 16 else np.int32

    def encode_stream(self, texts: Iterable[str], add_bos: bool | None = None, *,
                      size: int | None = None, source: str | None = None) -> np.ndarray:
        """`encode_np("".join(texts), add_bos)`, the same ids, as an `id_dtype` array, without
        ever holding the whole text: each piece is cut where the ids of the text before the
        cut and after it are those of the whole (`_safe_cut`), and what follows the cut waits
        for the next piece. Where no such cut comes within `CARRY_CHARS` characters, the text
        is cut there anyway (`_forced_cut`), with one warning naming `source` (the file) and
        where: the ids beside such a cut may differ from the whole text's. `size`: the text's
        size in UTF-8 bytes, where known (the byte vocabulary then writes into one array of
        that many ids, none copied)."""
        bos = self._check_added(add_bos, False)
        dtype = self.id_dtype
        # the byte vocabulary gives at most one id per byte, plus bos
        out = (np.empty(size + 1, dtype) if self._byte_layout and size is not None else None)
        parts: list[np.ndarray] = []
        n = 0

        def put(ids: np.ndarray) -> None:
            nonlocal n
            if out is not None:
                out[n:n + len(ids)] = ids
            else:
                parts.append(ids.astype(dtype))
            n += len(ids)

        if bos:
            put(np.array([self._bos], np.int32))
        for ids in self._encode_cut(texts, force=source or "the text"):
            put(ids)
        if out is not None:
            return out[:n]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def _encode_cut(self, texts: Iterable[str], *, parse_special: bool = True,
                    force: str | None = None) -> Iterator[np.ndarray]:
        """The ids of `"".join(texts)` part by part, never holding the whole text: it is read
        `ENCODE_CHARS` characters at a time (a GGUF vocabulary's: `tokenizers` holds ~150 bytes
        a character while it merges), each part cut where the ids of the text before the cut
        and after it are those of the whole (`_safe_cut`), what follows the cut waiting for the
        next piece. `force`: the text's name (the file) where a cut is forced once `CARRY_CHARS`
        characters pass without a safe one (`_forced_cut`, one warning naming it); None: the
        text is held until a safe cut comes, so the ids are always those of the whole."""
        step = None if self._byte_layout else ENCODE_CHARS
        pieces = (p[i:i + step] if step else p for p in texts
                  for i in range(0, len(p), step or max(len(p), 1)))
        carry, continued = "", False  # the text after the last cut; whether it follows a cut
        done, forced = 0, False  # characters before `carry`; whether a cut was forced
        for piece in pieces:
            text = carry + piece if carry else piece
            # where the carry held no cut before, it holds none now: look after it alone
            cut = self._safe_cut(text, max(1, len(carry) - self._special_len - 1))
            if not cut and force is not None and len(text) > CARRY_CHARS:
                cut = self._forced_cut(text)
                if cut and not forced:
                    forced = True
                    notice.warn(
                        f"{force}: no place to cut the text where its ids stay "
                        f"those of the whole in the {len(text):,} characters from character "
                        f"{done:,} (one run of letters, digits or symbols, as a DNA sequence or "
                        "a script without spaces); cut there anyway, and again wherever "
                        f"{CARRY_CHARS:,} characters pass without a place: the few ids beside "
                        "each such cut may differ from those of the text encoded whole",
                        stacklevel=3)  # the caller of encode_stream
            if cut:
                done += cut
                yield self._encode_part(text[:cut], continued, parse_special=parse_special)
                carry, continued = text[cut:], True
            else:
                carry = text
        if carry:
            yield self._encode_part(carry, continued, parse_special=parse_special)

    def _check_added(self, add_bos: bool | None, add_eos: bool) -> bool:
        bos = self.add_bos if add_bos is None else bool(add_bos)
        if bos and self._bos is None:
            raise TokenizerError(f"{self.source}: {K_BOS}: expected a bos token id to add, "
                                 "found missing")
        if add_eos and self._eos is None:
            raise TokenizerError(f"{self.source}: {K_EOS}: expected an eos token id to add, "
                                 "found missing")
        return bos

    def _encode_part(self, text: str, continued: bool, *, parse_special: bool = True
                     ) -> np.ndarray:
        """The ids of `text`, a part of a longer text cut by `_safe_cut` (`continued`: it
        follows such a cut, so SentencePiece's space prefix of a fragment is not added again),
        special tokens cut out as `encode` does with `parse_special`."""
        fragments = split_special(text, self._partition, parse_special)
        raw = [f for f in fragments if isinstance(f, str)]
        if continued and self.model == "llama" and self.add_space_prefix and fragments:
            # the cut was in raw text away from any special token, so this fragment is raw
            head = self._hf_ids(self._hf.encode(raw[0].replace(" ", SPACE),
                                                add_special_tokens=False).ids) \
                if not self._byte_layout else byte_ids(raw[0])
            encoded = iter([head, *self._encode_raw(raw[1:])])
        else:
            encoded = iter(self._encode_raw(raw))
        return np.concatenate([next(encoded) if isinstance(f, str) else np.array([f], np.int32)
                               for f in fragments] or [np.zeros(0, np.int32)])

    def _safe_cut(self, text: str, low: int = 1) -> int:
        """The last place in `text` where it can be cut and its two parts encoded apart with
        the ids of the whole, one part's after the other's; 0 where none is known. Away from
        special tokens (their text, and the whitespace they strip, never at a cut), it is:
        any character boundary for the byte vocabulary (one id per byte); for byte-level BPE,
        where its `tokenizer.ggml.pre`'s regexes cut the text into the same pieces as they cut
        the two parts (`_CUTS`: where a run of letters, digits or other characters ends, after
        a newline, ...); for SentencePiece BPE (and gemma4's form, whose pieces it merges
        whole), between two characters that no token holds side by side, so no merge can join
        them. Only cuts at `low` or after are looked for."""
        # the text after a cut must show any special across it, or just after it
        margin = self._special_len + 1
        if len(text) <= margin:
            return 0
        if self._byte_layout:
            candidates: Iterable[int] = range(len(text) - margin, low - 1, -1)
        elif self._cuts is not None:  # byte-level BPE: the regexes split there
            candidates = _class_cuts(text, len(text) - margin, low, self._cuts)
        else:
            pairs = self._pairs  # spaces are "▁" where the merges see them
            candidates = (c for c in range(len(text) - margin, low - 1, -1)
                          if text[c - 1:c + 1].replace(" ", SPACE) not in pairs)
        for c in candidates:
            if self._clear_of_specials(text, c):
                return c
        return 0

    def _forced_cut(self, text: str) -> int:
        """Where `encode_stream` cuts `text` that holds no safe cut (`_safe_cut`): the last
        character boundary that leaves special tokens whole (`_clear_of_specials`), as far
        from the end as a safe cut would be; 0 where there is none."""
        end = len(text) - self._special_len - 1
        return next((c for c in range(end, 0, -1) if self._clear_of_specials(text, c)), 0)

    def _clear_of_specials(self, text: str, cut: int) -> bool:
        if not self._partition:
            return True
        lo, hi = cut, cut  # the whitespace llama.cpp's stripping could take across the cut
        while lo > 0 and text[lo - 1] in C_SPACE:
            lo -= 1
        while hi < len(text) and text[hi] in C_SPACE:
            hi += 1
        # a cut's rule may look one character past it (`_GPT2_CUTS`): a special there ends
        # the raw text the rule saw go on
        near = text[max(0, lo - self._special_len):hi + self._special_len + 1]
        return not any(t in near for t, _, _ in self._partition)

    def _encode_raw(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        if self._byte_layout:
            return [byte_ids(t) for t in texts]
        if self._spm_style:
            return [encode_spm_style(self._hf, self._token_to_id, t) for t in texts]
        if self.model == "llama":
            prefix = " " if self.add_space_prefix else ""
            texts = [(prefix + t).replace(" ", SPACE) for t in texts]
        if len(texts) == 1:
            encs = [self._hf.encode(texts[0], add_special_tokens=False)]
        else:
            encs = self._hf.encode_batch(texts, add_special_tokens=False)
        return [self._hf_ids(e.ids) for e in encs]

    def _hf_ids(self, ids: list[int]) -> np.ndarray:
        """The `tokenizers` library's ids of a raw-text fragment as llama.cpp's."""
        return resegment(ids, len(self._tokens), self._loose)

    # -------------------------------------------------------------- decoding
    def piece_bytes(self, token_id: int) -> bytes:
        """The raw bytes llama.cpp's token_to_piece gives one token (specials as their text)."""
        return self._piece(token_id)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of token ids: byte tokens as bytes, "▁" as space (SPM), GPT-2 byte mapping.

        Control/unknown tokens (and unused ones) are dropped when `skip_special`, else written
        as their text. For SPM vocabularies with `add_space_prefix`, the one space encoding
        put in front of each raw-text run (at the start and after a special token) is removed,
        so `decode(encode(s)) == s`. Invalid UTF-8 becomes U+FFFD. Unlike llama.cpp's
        `clean_spaces` detokenizer option, spaces before punctuation are kept.
        """
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"decode: expected a 1-d sequence of token ids, found shape "
                             f"{arr.shape}")
        n = len(self._tokens)
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            bad = int(arr[(arr < 0) | (arr >= n)][0])
            raise ValueError(f"decode: expected token ids in [0, {n}), found {bad}")
        if self._byte_layout:
            mask = arr >= BYTE_OFFSET
            if mask.all() or skip_special:
                return (arr[mask] - BYTE_OFFSET).astype(np.uint8).tobytes().decode(
                    "utf-8", errors="replace")
        out: list[bytes] = []
        strip_next = self.model == "llama" and self.add_space_prefix
        for t in arr.tolist():
            if self._special_mask[t] and skip_special:
                piece = b""
            else:
                piece = self._piece(t)
            if self._prefix_after[t]:
                out.append(piece)
                strip_next = self.model == "llama" and self.add_space_prefix
                continue
            if strip_next and piece:
                if piece.startswith(b" "):
                    piece = piece[1:]
                strip_next = False
            out.append(piece)
        return b"".join(out).decode("utf-8", errors="replace")

    # -------------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the GGUF's `tokenizer.chat_template` as Hugging Face does (jinja2 sandbox,
        trim_blocks + lstrip_blocks; variables messages, add_generation_prompt and
        `render_context`'s: bos_token, eos_token, tools and documents, plus any `kwargs`), each
        message's reasoning field under the names transformers gives it (`reasoning_aliased`)."""
        if not self._chat_template:
            raise TokenizerError(f"{self.source}: {K_TEMPLATE}: expected a Jinja chat template, "
                                 "found missing key")
        template = compile_template(self._chat_template, self.source)
        bos = self._tokens[self._bos] if self._bos is not None else ""
        return template.render(messages=reasoning_aliased(messages),
                               add_generation_prompt=add_generation_prompt,
                               **render_context(bos, self.eos_token, **kwargs))

    # -------------------------------------------------------------- metadata out
    def to_metadata(self, chat_template: bool = True) -> dict[str, Any]:
        """The `tokenizer.ggml.*` (+ `tokenizer.chat_template`) keys, for writing a GGUF.

        Lists are the originals (token_type ints, scores floats); ids are ints; flags bools.
        `chat_template=False` leaves the template out: a model trained on plain text never saw
        its turns, and llama-cli and Ollama wrap every prompt in a template the GGUF carries.
        """
        meta: dict[str, Any] = {}
        for key, value in self._meta.items():
            if key == K_TEMPLATE and not chat_template:
                continue
            if key == K_TYPES:
                value = [int(v) for v in value]
            elif key == K_SCORES:
                value = [float(v) for v in value]
            elif key.startswith("tokenizer.ggml.add_") and isinstance(value, int):
                value = bool(value)
            elif isinstance(value, list):
                value = list(value)
            meta[key] = value
        return meta


def byte_tokenizer() -> Tokenizer:
    """The from-scratch tokenizer: `<unk>`=0, `<s>`=1, `</s>`=2, byte b = id b + 3 (259 ids).

    Encoding gives bos + one id per UTF-8 byte (llama.cpp gives the same ids for this
    vocabulary); decoding inverts it.
    """
    return Tokenizer(byte_metadata(), source="byte_tokenizer()")
