"""llama.cpp's vocabulary in GGUF metadata: the `tokenizer.ggml.*` keys, token types and the
attribute bits llama.cpp derives from them, and the from-scratch byte vocabulary
(`byte_metadata`: `<unk>`, `<s>`, `</s>`, then byte b as id b + 3)."""

from __future__ import annotations

from typing import Any

import numpy as np

# llama.cpp's token types (`llama_token_type`, the values of tokenizer.ggml.token_type).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# llama.cpp's token attributes (`llama_token_attr` bits), derived from the types at load time.
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER, A_BYTE = 1, 2, 4, 8, 16, 32
A_LSTRIP, A_RSTRIP = 128, 256
TYPE_ATTR = {UNKNOWN: A_UNKNOWN, UNUSED: A_UNUSED, NORMAL: A_NORMAL, CONTROL: A_CONTROL,
             USER_DEFINED: A_USER, BYTE: A_BYTE}
SPECIAL = A_CONTROL | A_USER | A_UNKNOWN  # cut out of the text before tokenizing

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

BYTE_OFFSET = 3
"""In `byte_tokenizer()`, byte value b is token id b + BYTE_OFFSET."""

SPACE = "\u2581"  # "▁", SentencePiece's escaped space


class TokenizerError(ValueError):
    """Tokenizer metadata that cannot be used; one line naming file, key, expected and found."""


def plain_value(value: Any) -> Any:
    """numpy scalars/arrays (from some readers) to plain Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def is_byte_token(text: str) -> bool:
    """Whether a token's text is a byte token's, `<0xXX>`."""
    return (len(text) == 6 and text.startswith("<0x") and text.endswith(">")
            and all(c in "0123456789ABCDEFabcdef" for c in text[3:5]))


def byte_ids(text: str) -> np.ndarray:
    """The byte vocabulary's ids of raw text: one per UTF-8 byte."""
    # llama.cpp escapes spaces to "▁", which the byte vocabulary stores as the space token;
    # a literal "▁" therefore encodes as a space too
    if SPACE in text:
        text = text.replace(SPACE, " ")
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return data.astype(np.int32) + BYTE_OFFSET


def byte_metadata() -> dict[str, Any]:
    """GGUF tokenizer metadata of the byte vocabulary (see `byte_tokenizer`)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    # llama.cpp's SPM tokenizer replaces every space by "▁" before looking tokens up, so the
    # space byte's token is stored as a normal "▁" token: llama.cpp then encodes " " to it
    # and decodes it back to " " (a "<0x20>" byte token would never be produced).
    tokens[0x20 + BYTE_OFFSET] = SPACE
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



def encode_bytes_np(text: str | bytes, add_bos: bool = True) -> np.ndarray:
    """Byte-tokenizer ids as int32 without special-token parsing: [1] + (bytes + 3)."""
    data = text if isinstance(text, bytes) else text.replace(SPACE, " ").encode("utf-8")
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
    if add_bos:
        ids = np.concatenate([np.array([1], dtype=np.int32), ids])
    return ids
