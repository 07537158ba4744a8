"""Tokenizers built from a GGUF file's own `tokenizer.*` metadata, tokenizing as llama.cpp does.

Three llama.cpp vocabulary types are supported (`tokenizer.ggml.model`):

- ``"gpt2"``: byte-level BPE (`tokens` + `merges`). The text is cut by the regexes llama.cpp
  uses for `tokenizer.ggml.pre` (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`), each regex
  splitting the pieces of the previous one, matches and the text between them both kept as
  pieces; every piece is byte-mapped (GPT-2's bytes->unicode table) and merged by rank.
  GPT-2, Llama 3 (`llama-bpe`), Qwen2.5/Qwen3 (`qwen2`), Qwen3.5 (`qwen35`), SmolLM, ...
- ``"llama"``: SentencePiece BPE (`tokens` + `scores` + `token_type`). llama.cpp prepends a
  space to every raw-text fragment when `add_space_prefix` (default true), replaces every space
  by U+2581 "▁", then repeatedly merges the adjacent pair whose concatenation is the
  highest-scoring token (ties: leftmost); characters that end up in no token fall back to the
  `<0xXX>` byte tokens. Llama 2, Phi-3, Gemma 1-3.
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

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from toymlx.gguf.reader import read_metadata

__all__ = [
    "BYTE_OFFSET",
    "SUPPORTED_MODELS",
    "SUPPORTED_PRE",
    "Tokenizer",
    "TokenizerError",
    "byte_tokenizer",
    "encode_bytes_np",
]

# llama.cpp's token types (`llama_token_type`, the values of tokenizer.ggml.token_type).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# llama.cpp's token attributes (`llama_token_attr` bits), derived from the types at load time.
_A_UNKNOWN, _A_UNUSED, _A_NORMAL, _A_CONTROL, _A_USER, _A_BYTE = 1, 2, 4, 8, 16, 32
_A_LSTRIP, _A_RSTRIP = 128, 256
_TYPE_ATTR = {UNKNOWN: _A_UNKNOWN, UNUSED: _A_UNUSED, NORMAL: _A_NORMAL, CONTROL: _A_CONTROL,
              USER_DEFINED: _A_USER, BYTE: _A_BYTE}
_SPECIAL = _A_CONTROL | _A_USER | _A_UNKNOWN  # cut out of the text before tokenizing

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

K_MODEL = "tokenizer.ggml.model"
K_PRE = "tokenizer.ggml.pre"
K_TOKENS = "tokenizer.ggml.tokens"
K_SCORES = "tokenizer.ggml.scores"
K_TYPES = "tokenizer.ggml.token_type"
K_MERGES = "tokenizer.ggml.merges"
K_BOS = "tokenizer.ggml.bos_token_id"
K_EOS = "tokenizer.ggml.eos_token_id"
K_UNK = "tokenizer.ggml.unknown_token_id"
K_ADD_BOS = "tokenizer.ggml.add_bos_token"
K_ADD_EOS = "tokenizer.ggml.add_eos_token"
K_ADD_PREFIX = "tokenizer.ggml.add_space_prefix"
K_TEMPLATE = "tokenizer.chat_template"
K_NAME = "general.name"  # llama.cpp gives Phi-3's special tokens right-stripping by model name


# ------------------------------------------------------------------ pre-tokenizers
@dataclass(frozen=True)
class _Pre:
    """What llama.cpp's BPE tokenizer does for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    """Applied in turn to every piece the previous ones produced (`llm_tokenizer_bpe`)."""
    ignore_merges: bool = False
    """A piece that is itself a token is that token, unmerged."""
    add_bos: bool = False
    """add_bos when the GGUF has no `add_bos_token` key."""
    force_bos: bool = False
    """add_bos even when the GGUF says false (llama.cpp's Gemma 4 override)."""
    spm_style: bool = False
    """Spaces escaped to "▁", raw UTF-8 pieces (no GPT-2 byte map), `<0xXX>` byte fallback."""


# The regexes of src/llama-vocab.cpp, as llama.cpp writes them (case-insensitive groups spelled
# out, so that llama.cpp picks its hand-written splitter for each).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_NEWLINE_RUNS_RE = r"[^\n]+|[\n]+"
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_SMOLLM_RES = (r"\p{N}", _GPT2_RE)

# pre name -> what llama.cpp does; names grouped as llama.cpp groups them.
_PRE: dict[str, _Pre] = {"default": _Pre(_DEFAULT_RES)}
for _name in ("gpt-2", "phi-2", "mpt", "olmo", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
              "gigachat", "mellum", "exaone4"):
    _PRE[_name] = _Pre((_GPT2_RE,))
for _name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
              "mellum2"):
    _PRE[_name] = _Pre(_SMOLLM_RES)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2"):
    _PRE[_name] = _Pre((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
for _name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"):
    _PRE[_name] = _Pre((_QWEN2_RE,))
_PRE["qwen35"] = _Pre((_QWEN35_RE,))
_PRE["gemma4"] = _Pre((_NEWLINE_RUNS_RE,), force_bos=True, spm_style=True)
SUPPORTED_PRE = tuple(_PRE)

# Token texts llama.cpp makes end-of-generation (and control) tokens (llama_vocab::impl::load).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["})
# Fill-in-the-middle tokens llama.cpp recognises by text when their id key is absent; the
# first found of a kind becomes a control token; pad, repo and file-separator ones end generation.
_FIM_TEXTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "tokenizer.ggml.fim_pre_token_id": (("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                         "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
                                         "<|prefix|>"), False),
    "tokenizer.ggml.fim_suf_token_id": (("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                         "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
                                         "<|suffix|>"), False),
    "tokenizer.ggml.fim_mid_token_id": (("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                         "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
                                         "<|middle|>"), False),
    "tokenizer.ggml.fim_pad_token_id": (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                         "[PAD]"), True),
    "tokenizer.ggml.fim_rep_token_id": (("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                         "<reponame>"), True),
    "tokenizer.ggml.fim_sep_token_id": (("<|file_sep|>",), True),
}
_FIM_OLD_KEYS = {"tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
                 "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
                 "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id"}
# gpt-oss: llama.cpp always renders these, as user-defined tokens
_ALWAYS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

BYTE_OFFSET = 3
"""In `byte_tokenizer()`, byte value b is token id b + BYTE_OFFSET."""

_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_C_SPACE = " \t\n\v\f\r"  # C's isspace, which llama.cpp's special-token stripping uses


class TokenizerError(ValueError):
    """Tokenizer metadata that cannot be used; one line naming file, key, expected and found."""


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_UNICODE = _gpt2_byte_table()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


def _describe(value: Any) -> str:
    if isinstance(value, list):
        inner = type(value[0]).__name__ if value else "nothing"
        return f"a list of {len(value)} ({inner})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ the tokenizer
class Tokenizer:
    """A llama.cpp-compatible tokenizer made from GGUF `tokenizer.*` metadata.

    Build one with `Tokenizer.from_metadata(meta)` / `Tokenizer.from_gguf(path)` or
    `byte_tokenizer()`.
    """

    def __init__(self, meta: Mapping[str, Any], source: str | os.PathLike | None = None):
        self.source = str(source) if source is not None else "tokenizer metadata"
        self._meta = {k: _plain(v) for k, v in meta.items()
                      if k.startswith("tokenizer.ggml.") or k == K_TEMPLATE}
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
        pre_rules: _Pre | None = None
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
                if pre not in _PRE:
                    self._fail(K_PRE, f"one of {list(SUPPORTED_PRE)}", repr(pre))
                default_bos, default_eos, default_unk = 11, 11, None
            self.pre = pre
            pre_rules = _PRE[pre]
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
        self._set_attributes(name.lower() if isinstance(name, str) else "")
        # special tokens cut out of the text before tokenizing, longest text first
        self._partition: list[tuple[str, int, int]] = sorted(
            ((tokens[i], i, self._attrs[i]) for i in np.flatnonzero(self._attr_arr & _SPECIAL)
             .tolist()),
            key=lambda x: (-len(x[0].encode("utf-8")), x[1]))

        self._pieces: list[bytes | None] = [None] * n  # filled on first use
        self._byte_layout = self._is_byte_layout()
        if pre_rules is not None:
            merges = self._get_list(K_MERGES, str, "a list of 'left right' merge strings")
            self._hf = self._build_bpe(merges, pre_rules)
        else:
            self._hf = None if self._byte_layout else self._build_spm()

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

    def _set_attributes(self, model_name: str) -> None:
        """llama.cpp's token attributes: the GGUF types, then what its loader changes by text."""
        tokens, ids = self._tokens, self._token_to_id
        attrs = [_TYPE_ATTR.get(t, 0) for t in self._types]
        eog = {ids[t] for t in _EOG_TEXTS if t in ids}
        for key, (texts, ends) in _FIM_TEXTS.items():
            fim = self._meta.get(key, self._meta.get(_FIM_OLD_KEYS.get(key, ""), -1))
            if isinstance(fim, int) and 0 <= fim < len(tokens):
                found = fim
            else:
                found = next((ids[t] for t in texts if t in ids), None)
                if found is not None:
                    attrs[found] |= _A_CONTROL
            if ends and found is not None:
                eog.add(found)
        for i in eog:
            if tokens[i] in _EOG_TEXTS:
                attrs[i] |= _A_CONTROL
        for t in _ALWAYS_USER:
            if t in ids:
                attrs[ids[t]] = _A_USER
        for key in (K_EOS, "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            i = self._eos if key == K_EOS else self._meta.get(key)
            if isinstance(i, int) and 0 <= i < len(tokens):
                eog.add(i)
        texts = {tokens[i] for i in eog}
        # o200k_harmony and solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(ids["<|end|>"])
            attrs[ids["<|end|>"]] = _A_USER
        # gemma4 and plamo2 have a normal "</s>"
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(ids["</s>"])
            attrs[ids["</s>"]] = _A_NORMAL
        if "phi-3" in model_name or "phi3" in model_name:
            for i, a in enumerate(attrs):
                if a & _SPECIAL:
                    attrs[i] = a | _A_RSTRIP
            if "</s>" in ids:
                attrs[ids["</s>"]] |= _A_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in ids:
                    attrs[ids[t]] &= ~_A_RSTRIP
        self._attrs = attrs
        self._attr_arr = np.array(attrs, dtype=np.int32)
        self._eog = frozenset(eog)
        # dropped when decoding with skip_special
        self._special_mask = (self._attr_arr & (_A_CONTROL | _A_UNKNOWN)) != 0
        # after these, llama.cpp's SPM encoder has prefixed a space to the following text
        self._prefix_after = (self._attr_arr & _SPECIAL) != 0

    def _piece(self, i: int) -> bytes:
        """The bytes of token i as llama.cpp's token_to_piece(special=True) gives them."""
        piece = self._pieces[i]
        if piece is None:
            text, attr = self._tokens[i], self._attrs[i]
            if attr & _SPECIAL:
                piece = text.encode("utf-8")
            elif attr & _A_NORMAL:
                if self.model == "llama" or self._spm_style:
                    piece = text.replace(_SPACE, " ").encode("utf-8")
                else:
                    piece = b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE
                                     else c.encode("utf-8") for c in text)
            elif attr & _A_BYTE and _is_byte_token(text):
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
            if b == 0x20 and text == _SPACE and ty == NORMAL:
                continue
            if ty != BYTE or text != f"<0x{b:02X}>":
                return False
        return True

    def _build_bpe(self, merges: list[str], rules: _Pre):
        vocab = self._token_to_id
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        if not all(len(p) == 2 and p[0] for p in pairs):
            pairs = []  # llama.cpp cuts at the first space after the first character
            for i, m in enumerate(merges):
                cut = m.find(" ", 1)
                if cut < 0:
                    self._fail(K_MERGES, "'left right' strings", f"{m!r} at index {i}")
                pairs.append((m[:cut], m[cut + 1:]))
        byte_fallback = rules.spm_style
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=rules.ignore_merges,
                             byte_fallback=byte_fallback)
        except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception for a non-token)
            # llama.cpp keeps merges whose parts are not tokens, but they can never fire
            pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=rules.ignore_merges,
                             byte_fallback=byte_fallback)
        hf = HFTokenizer(bpe)
        if not rules.spm_style:  # gemma4 cuts at newline runs itself (`_encode_spm_style`)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rules.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _build_spm(self):
        """SentencePiece BPE as HF BPE: every split of a token into two tokens is a merge,
        ranked by the merged token's score (highest first). Equal scores go lower id first,
        where llama.cpp takes the leftmost pair: the same for vocabularies whose scores differ
        (Llama 2, Phi-3, Gemma)."""
        vocab = self._token_to_id
        scores = np.asarray(self._scores, dtype=np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores)).tolist()
        texts = [self._tokens[i] for i in order]
        merges = [(a, b) for t in texts for cut in range(1, len(t))
                  if (a := t[:cut]) in vocab and (b := t[cut:]) in vocab]
        unk = self._tokens[self._unk] if self._unk is not None else None
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True)
        return HFTokenizer(bpe)

    # -------------------------------------------------------------- properties
    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

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
        if not isinstance(text, str):
            raise TypeError(f"encode: expected str, found {type(text).__name__}")
        bos = self.add_bos if add_bos is None else bool(add_bos)
        if bos and self._bos is None:
            raise TokenizerError(f"{self.source}: {K_BOS}: expected a bos token id to add, "
                                 "found missing")
        if add_eos and self._eos is None:
            raise TokenizerError(f"{self.source}: {K_EOS}: expected an eos token id to add, "
                                 "found missing")
        fragments = self._split_special(text, parse_special)
        parts: list[np.ndarray] = []
        if bos:
            parts.append(np.array([self._bos], dtype=np.int32))
        raw = [f for f in fragments if isinstance(f, str)]
        encoded = iter(self._encode_raw(raw))
        for frag in fragments:
            parts.append(next(encoded) if isinstance(frag, str)
                         else np.array([frag], dtype=np.int32))
        if add_eos:
            parts.append(np.array([self._eos], dtype=np.int32))
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts).astype(np.int32, copy=False)

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: raw-text fragments and special token ids."""
        frags: list[str | int] = [text] if text else []
        for tok_text, tok_id, attr in self._partition:
            if not parse_special and attr & (_A_CONTROL | _A_UNKNOWN):
                continue
            if not any(isinstance(f, str) and tok_text in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, str) and tok_text in f:
                    pieces = f.split(tok_text)
                    last = len(pieces) - 1
                    for j, p in enumerate(pieces):
                        if j:
                            out.append(tok_id)
                        if j and attr & _A_RSTRIP:  # C isspace: " \t\n\v\f\r"
                            p = p.lstrip(_C_SPACE)
                        if j < last and attr & _A_LSTRIP:
                            p = p.rstrip(_C_SPACE)
                        if p:
                            out.append(p)
                else:
                    out.append(f)
            frags = out
        return frags

    def _encode_raw(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        if self._byte_layout:
            return [_bytes_ids(t) for t in texts]
        if self._spm_style:
            return [self._encode_spm_style(t) for t in texts]
        if self.model == "llama":
            prefix = " " if self.add_space_prefix else ""
            texts = [(prefix + t).replace(" ", _SPACE) for t in texts]
        if len(texts) == 1:
            encs = [self._hf.encode(texts[0], add_special_tokens=False)]
        else:
            encs = self._hf.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def _encode_spm_style(self, text: str) -> np.ndarray:
        """Gemma 4: spaces to "▁", runs of newlines apart from the rest; a run of newlines
        that is a token is that token, unmerged (llama.cpp's fix for Gemma 4)."""
        runs = [r for r in re.split("(\n+)", text.replace(" ", _SPACE)) if r]
        ids: list[int | None] = [self._token_to_id.get(r) if r[0] == "\n" else None for r in runs]
        todo = [r for r, i in zip(runs, ids) if i is None]
        encs = iter(self._hf.encode_batch(todo, add_special_tokens=False) if todo else [])
        out: list[int] = []
        for i in ids:
            if i is None:
                out.extend(next(encs).ids)
            else:
                out.append(i)
        return np.asarray(out, dtype=np.int32)

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
        trim_blocks + lstrip_blocks; variables messages, add_generation_prompt, bos_token,
        eos_token, plus any `kwargs`)."""
        if not self._chat_template:
            raise TokenizerError(f"{self.source}: {K_TEMPLATE}: expected a Jinja chat template, "
                                 "found missing key")
        template = _compile_template(self._chat_template, self.source)
        bos = self._tokens[self._bos] if self._bos is not None else ""
        eos = self._tokens[self._eos] if self._eos is not None else ""
        context = {"bos_token": bos, "eos_token": eos, **kwargs}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)

    # -------------------------------------------------------------- metadata out
    def to_metadata(self) -> dict[str, Any]:
        """The `tokenizer.ggml.*` (+ `tokenizer.chat_template`) keys, for writing a GGUF.

        Lists are the originals (token_type ints, scores floats); ids are ints; flags bools.
        """
        meta: dict[str, Any] = {}
        for key, value in self._meta.items():
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


def _plain(value: Any) -> Any:
    """numpy scalars/arrays (from some readers) to plain Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def _is_byte_token(text: str) -> bool:
    return (len(text) == 6 and text.startswith("<0x") and text.endswith(">")
            and all(c in "0123456789ABCDEFabcdef" for c in text[3:5]))


def _bytes_ids(text: str) -> np.ndarray:
    # llama.cpp escapes spaces to "▁", which the byte vocabulary stores as the space token;
    # a literal "▁" therefore encodes as a space too
    if _SPACE in text:
        text = text.replace(_SPACE, " ")
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return data.astype(np.int32) + BYTE_OFFSET


_TEMPLATES: dict[str, Any] = {}


def _compile_template(source_text: str, where: str):
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


# ------------------------------------------------------------------ the byte tokenizer
def byte_metadata() -> dict[str, Any]:
    """GGUF tokenizer metadata of the byte vocabulary (see `byte_tokenizer`)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    # llama.cpp's SPM tokenizer replaces every space by "▁" before looking tokens up, so the
    # space byte's token is stored as a normal "▁" token: llama.cpp then encodes " " to it
    # and decodes it back to " " (a "<0x20>" byte token would never be produced).
    tokens[0x20 + BYTE_OFFSET] = _SPACE
    types[0x20 + BYTE_OFFSET] = NORMAL
    return {
        K_MODEL: "llama",
        K_PRE: "default",
        K_TOKENS: tokens,
        K_SCORES: [0.0] * len(tokens),
        K_TYPES: types,
        K_BOS: 1,
        K_EOS: 2,
        K_UNK: 0,
        K_ADD_BOS: True,
        K_ADD_EOS: False,
        K_ADD_PREFIX: False,
    }


def byte_tokenizer() -> Tokenizer:
    """The from-scratch tokenizer: `<unk>`=0, `<s>`=1, `</s>`=2, byte b = id b + 3 (259 ids).

    Encoding gives bos + one id per UTF-8 byte (llama.cpp gives the same ids for this
    vocabulary); decoding inverts it.
    """
    return Tokenizer(byte_metadata(), source="byte_tokenizer()")


def encode_bytes_np(text: str | bytes, add_bos: bool = True) -> np.ndarray:
    """Byte-tokenizer ids as int32 without special-token parsing: [1] + (bytes + 3)."""
    data = text if isinstance(text, bytes) else text.replace(_SPACE, " ").encode("utf-8")
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
    if add_bos:
        ids = np.concatenate([np.array([1], dtype=np.int32), ids])
    return ids
