"""Language-model data: a text file -> token ids -> train/val split -> batches for a step.

Design choices:
- The split is fixed and positional: the LAST `val_fraction` of the ids is validation, so it
  never depends on the seed and never overlaps the training windows.
- `lm_batch` is a pure function of `(seed, step)`: window starts come from
  `np.random.default_rng([seed, step])`, so resuming at step `s` replays exactly the batches
  an uninterrupted run would have seen, with no data-loader state to save.
- Validation windows are fixed, non-overlapping (consecutive windows share at most the one
  boundary token, so no target is scored twice) and spread evenly over the validation split.
- Everything here is numpy; the trainer turns arrays into `mx.array`s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from toymlx.backend.files import special_kind


class DataError(ValueError):
    """A user's data file or data settings cannot be used; the message is one line."""


class Encoder(Protocol):
    """The part of `toymlx.data.tokenizer.Tokenizer` this module needs."""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]: ...


def read_text(path: str | Path) -> str:
    """Read a whole file as UTF-8 text, with one-line errors for empty and non-UTF-8 files."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: expected a UTF-8 text file, found a directory")
    if kind := special_kind(path):
        raise DataError(f"{path}: expected a UTF-8 text file, found {kind}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: not valid UTF-8 at byte offset {e.start} (line {line}, byte "
            f"0x{data[e.start]:02x}); expected UTF-8 text, re-save the file as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")  # a UTF-8 BOM is not content
    if not text.strip():
        what = "empty file" if not text else "file has only whitespace"
        raise DataError(f"{path}: {what}; expected UTF-8 text")
    return text


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise DataError(f"{name} must be a positive integer, got {value!r}")


def _need_window(n: int, seq_len: int, what: str, source: str, hint: str) -> None:
    if n < seq_len + 1:
        raise DataError(
            f"{source}: {what} has {n} tokens but one window needs seq_len+1 = {seq_len + 1}; "
            f"{hint}"
        )


def lm_batch(
    tokens: np.ndarray,
    step: int,
    seed: int,
    batch_size: int,
    seq_len: int,
    accum: int = 1,
    *,
    source: str = "<tokens>",
) -> dict[str, np.ndarray]:
    """Random training windows for one optimizer step, a pure function of `(seed, step)`.

    Returns numpy `{"inputs", "targets"}` int32 and `"mask"` float32 (all ones), each
    `(accum, batch_size, seq_len)`; `targets` is `inputs` shifted left by one token.
    """
    _check_sizes(batch_size=batch_size, seq_len=seq_len, accum=accum)
    if step < 0 or seed < 0:
        raise DataError(f"step and seed must be >= 0, got step={step}, seed={seed}")
    tokens = np.asarray(tokens)
    _need_window(len(tokens), seq_len, "training split", source, "use a shorter seq_len")
    rng = np.random.default_rng([seed, step])
    # The last valid start leaves room for seq_len inputs plus the one extra target.
    starts = rng.integers(0, len(tokens) - seq_len, size=(accum, batch_size))
    windows = tokens[starts[..., None] + np.arange(seq_len + 1)]  # (A, B, T+1)
    return {
        "inputs": windows[..., :-1].astype(np.int32),  # (A, B, T)
        "targets": windows[..., 1:].astype(np.int32),  # (A, B, T)
        "mask": np.ones((accum, batch_size, seq_len), np.float32),
    }


def val_batches(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_batches: int,
    *,
    source: str = "<tokens>",
    what: str = "validation split",
) -> list[dict[str, np.ndarray]]:
    """Fixed validation (or test: `what`) batches, each `(1, batch_size, seq_len)`, independent
    of any seed.

    Takes up to `max_batches * batch_size` non-overlapping windows spread evenly from the
    start to the end of `tokens`. When fewer windows exist than a full last batch needs,
    the missing rows are zeros with mask 0, so every batch has the same shape (no recompile)
    and the loss, weighted by the mask count, is unchanged. An empty `tokens` gives `[]`.
    """
    _check_sizes(batch_size=batch_size, seq_len=seq_len, max_batches=max_batches)
    tokens = np.asarray(tokens)
    if len(tokens) == 0:
        return []
    _need_window(len(tokens), seq_len, what, source, "use a shorter seq_len")
    n_avail = (len(tokens) - 1) // seq_len  # windows with disjoint targets
    n_batches = min(max_batches, math.ceil(n_avail / batch_size))
    n_win = min(n_avail, n_batches * batch_size)
    last_start = len(tokens) - seq_len - 1
    # Integer spacing k*last/(n-1) >= seq_len whenever n <= n_avail, so targets never overlap.
    starts = np.array([k * last_start // max(n_win - 1, 1) for k in range(n_win)], np.int64)
    windows = np.zeros((n_batches * batch_size, seq_len + 1), np.int32)
    windows[:n_win] = tokens[starts[:, None] + np.arange(seq_len + 1)]
    mask = np.zeros((n_batches * batch_size, seq_len), np.float32)
    mask[:n_win] = 1.0
    shape = (n_batches, 1, batch_size, seq_len)
    inputs = windows[:, :-1].reshape(shape)  # (n_batches, 1, B, T)
    targets = windows[:, 1:].reshape(shape)  # (n_batches, 1, B, T)
    mask = mask.reshape(shape)
    return [{"inputs": inputs[i], "targets": targets[i], "mask": mask[i]} for i in range(n_batches)]


@dataclass(frozen=True)
class TokenData:
    """Train and validation token ids (np.int32) split from one id sequence (or each from its
    own file), and optional held-out test ids."""

    train: np.ndarray
    """Training ids: the first `1 - val_fraction` of the sequence"""
    val: np.ndarray
    """Validation ids: the last `val_fraction` of the sequence (may be empty)"""
    source: str = "<tokens>"
    """Where the ids came from, for error messages"""
    test: np.ndarray | None = None
    """Held-out test ids (`--test`), None without a test set"""
    test_source: str | None = None
    """Where the test ids came from"""

    @classmethod
    def from_ids(
        cls,
        ids: Sequence[int] | np.ndarray,
        seq_len: int,
        val_fraction: float = 0.1,
        source: str = "<tokens>",
        windows: bool = True,
    ) -> TokenData:
        """Split `ids`; the last `round(len * val_fraction)` ids are validation. `windows`:
        each split must hold one window (training's check; False: the caller checks the split
        it reads, as toymlx-eval does with its own flags)."""
        _check_sizes(seq_len=seq_len)
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"{source}: val_fraction must be in [0, 1), got {val_fraction}")
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise DataError(f"{source}: expected a 1-D id sequence, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise DataError(f"{source}: token ids must fit int32, got [{ids.min()}, {ids.max()}]")
        n = len(ids)
        n_val = round(n * val_fraction)  # round, not int(): 0.29 * 100 == 28.999...
        train, val = ids[: n - n_val], ids[n - n_val :]
        if not windows:
            return cls(train.astype(np.int32), val.astype(np.int32), source)
        _need_window(
            len(train), seq_len, "training split", source,
            "use a longer text or a shorter seq_len",
        )
        if val_fraction > 0:
            _need_window(
                len(val), seq_len, f"validation split ({val_fraction:g} of {n})", source,
                "use a longer text, a shorter seq_len or a larger val_fraction",
            )
        return cls(train.astype(np.int32), val.astype(np.int32), source)

    @classmethod
    def from_file(
        cls, path: str | Path, tokenizer: Encoder, seq_len: int, val_fraction: float = 0.1,
        windows: bool = True,
    ) -> TokenData:
        """Read a UTF-8 text file, encode it whole (tokenizer's default BOS), and split it."""
        ids = tokenizer.encode(read_text(path))
        return cls.from_ids(ids, seq_len, val_fraction, source=str(path), windows=windows)

    def batch(
        self, step: int, seed: int, batch_size: int, seq_len: int, accum: int = 1
    ) -> dict[str, np.ndarray]:
        """`lm_batch` over the training split."""
        return lm_batch(self.train, step, seed, batch_size, seq_len, accum, source=self.source)

    def val_batches(
        self, batch_size: int, seq_len: int, max_batches: int
    ) -> list[dict[str, np.ndarray]]:
        """`val_batches` over the validation split."""
        return val_batches(self.val, batch_size, seq_len, max_batches, source=self.source)

    def test_batches(self, batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
        """`val_batches` over every window of the test ids ([] without a test set)."""
        if self.test is None:
            return []
        return val_batches(self.test, batch_size, seq_len, max(1, len(self.test)),
                           source=self.test_source or self.source, what="test set")

    def describe(self) -> dict[str, Any]:
        """Sizes for logging."""
        return {"source": self.source, "train_tokens": len(self.train), "val_tokens": len(self.val)}
