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

import codecs
import math
import os
import re
import shlex
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from toymlx.backend.files import IMAGE_MAGIC, counted, nothing_there, special_kind
from toymlx.backend.progress import pass_bar


class DataError(ValueError):
    """A user's data file or data settings cannot be used; the message is one line."""


class Encoder(Protocol):
    """The part of `toymlx.data.tokenizer.Tokenizer` this module needs."""

    source: str
    """What names the tokenizer (its GGUF file)"""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]: ...

    def encode_stream(self, texts: Iterable[str], add_bos: bool | None = None, *,
                      size: int | None = None, source: str | None = None) -> np.ndarray: ...

    @property
    def eos_id(self) -> int | None: ...


READ_BYTES = 1 << 22
"""How much of a text file is read, checked and handed on at a time (4 MiB)."""

BAR_BYTES = 1 << 24
"""A text file at least this large (16 MiB) is tokenized under a progress bar, where stderr is
a terminal: with a BPE tokenizer, 200 MB of text took ~3 minutes on a 2-core CPU."""


def _char_end(data: bytes) -> int:
    """Where the last whole UTF-8 character of `data` ends: a character cut by the end of a
    read waits for the next read (a byte that cannot start one is left to the decoder)."""
    for i in range(len(data) - 1, max(len(data) - 4, -1), -1):
        b = data[i]
        if b & 0xC0 != 0x80:  # not a continuation byte
            need = (2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else
                    4 if b >> 3 == 0b11110 else 1)
            return i if i + need > len(data) else len(data)
    return len(data)


def _resave_line(code: str, file: str, tmp: str) -> str:
    """The shell line that re-saves FILE, text in `code`, as UTF-8 in place: converted into TMP
    beside it, which replaces it once iconv has succeeded. A converted copy beside the original
    left the original in its folder of texts, refused again there; in place, the text keeps its
    name and suffix (which decide how it is read), and a conversion that fails leaves the file
    as it was."""
    return f"iconv -f {code} -t UTF-8 {file} > {tmp} && mv {tmp} {file}"


def _shell_names(path: Path) -> dict[str, str]:
    """`NOT_TEXT`'s names for `path`: {file} as it is, {sh} and {utf8} (PATH.utf8, a suffix no
    folder of texts reads, were a failed conversion to leave it there) quoted for a shell."""
    return {"file": str(path), "sh": shlex.quote(str(path)),
            "utf8": shlex.quote(f"{path}.utf8")}


IMAGES_TRAIN = ("images train a classifier, toymlx-train --recipe vit-tiny --data.path FOLDER "
                "(a subfolder of images per class)")
"""What to do with images given where text is read (an image file, a folder of class folders)."""
IDX_NAME = re.compile(r"-idx[13]-ubyte(\.gz)?$")
"""The names of MNIST's IDX files (images idx3, labels idx1), as toymlx's image data reads them."""

NOT_TEXT = {
    b"GGUF": ("a GGUF model file: --data.path takes text (a model is --base, --donor, "
              "--tokenizer or toymlx-eval's --model)"),
    b"PAR1": ("a Parquet file (Hugging Face datasets' files): convert it to JSONL first, e.g. "
              "pandas.read_parquet({file!r}).to_json('train.jsonl', orient='records', lines=True)"),
    b"ARROW1": ("an Arrow file (a Hugging Face datasets cache): save it as JSONL first, e.g. "
                "datasets.Dataset.from_file({file!r}).to_json('train.jsonl')"),
    # UTF-16 text, which Windows Notepad ("Unicode") and PowerShell 5's `>` write, byte-order
    # mark first; UTF-32's little-endian mark begins as UTF-16's does, so it is named first
    **{mark: f"{code} text: re-save it as UTF-8 ({_resave_line(code, '{sh}', '{utf8}')})"
       for mark, code in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                          (b"\xfe\xff", "UTF-16"))},
    b"\x1f\x8b": "a gzip-compressed file: decompress it first (gunzip {sh})",
    b"PK\x03\x04": "a zip archive: extract its files first (unzip {sh})",
    # a PNG or JPEG (the kinds not UTF-8 at their first byte) as text: "re-save it as UTF-8"
    **{magic: f"a {kind} image: {IMAGES_TRAIN}" for magic, kind in IMAGE_MAGIC},
}
"""Files people give as data that are not text, by their first bytes (read where the text is
not UTF-8): what each is and what to do instead of "re-save the file as UTF-8" (`_shell_names`:
{file} the file's path, in Python's quotes as {file!r}; {sh} the same for a shell; {utf8} the
copy `_resave_line` converts into)."""


def open_text(path: str | Path, block: int | None = None) -> tuple[int, Iterator[str]]:
    """(the file's size in bytes, its UTF-8 text in pieces of about `block` bytes, default
    `READ_BYTES`): the file is read once, a block at a time, so a large file is never held
    whole. The one-line
    DataErrors of `read_text`: a directory, FIFO or unreadable file here; a byte that is not
    UTF-8, an empty file or one of whitespace alone from the iterator, once it meets them
    (the last two at its end). A leading UTF-8 BOM is not content."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: expected a UTF-8 text file, found a directory")
    if kind := special_kind(path):
        raise DataError(f"{path}: expected a UTF-8 text file, found {kind}")
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the iterator)
        size = os.fstat(f.fileno()).st_size
    except (FileNotFoundError, NotADirectoryError):
        raise DataError(f"{path}: expected a UTF-8 text file, found {nothing_there(path)}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror or e})") from None
    pieces = _pieces(path, f, block or READ_BYTES)
    next(pieces)  # into its `with f`: the file closes with the iterator, read or not
    return size, pieces


def _pieces(path: Path, f: BinaryIO, block: int) -> Iterator[str]:
    """`open_text`'s pieces, after one "" that takes the iterator into `with f` (an iterator
    never started would leave `f` open: a consumer that fails before it reads, a tokenizer
    without the bos id it must add)."""
    offset = lines = 0  # the file offset of `rest`, and the newlines before it
    rest, first, seen, content = b"", True, False, False
    ascii_only = True  # every character so far ASCII: a bad byte is then of another encoding
    with f:
        yield ""
        while True:
            try:
                more = f.read(block)
            except OSError as e:
                raise DataError(f"{path}: cannot read data file ({e.strerror or e})") from None
            data = rest + more if rest else more
            end = _char_end(data) if more else len(data)
            try:
                text = codecs.utf_8_decode(memoryview(data)[:end], "strict", True)[0]
            except UnicodeDecodeError as e:
                # MNIST's IDX files (t10k-images-idx3-ubyte.gz) by their name: a gzip's
                # "decompress it first" would leave them as far from text
                found = ("MNIST's IDX images or labels: images train a classifier, "
                         "toymlx-train --recipe vit-tiny --data.path "
                         f"{shlex.quote(str(path.parent))} (the folder of the IDX files)"
                         if IDX_NAME.search(path.name) else
                         offset == 0 and next((what for magic, what in NOT_TEXT.items()
                                               if data.startswith(magic)), None))
                if found:  # advice for the file it is, not "re-save it as UTF-8"
                    raise DataError(f"{path}: expected UTF-8 text, found "
                                    f"{found.format(**_shell_names(path))}") from None
                line = lines + data.count(b"\n", 0, e.start) + 1
                single = ascii_only and data[:e.start].isascii()
                raise DataError(
                    f"{path}: not valid UTF-8 at byte offset {offset + e.start} (line {line}, "
                    f"byte 0x{data[e.start]:02x}); expected UTF-8 text, re-save the file as UTF-8"
                    f"{single_byte_hint(path, data[e.start]) if single else ''}") from None
            if first and text:
                text, first = text.removeprefix("\ufeff"), False  # a UTF-8 BOM is not content
            if text:
                seen, content = True, content or not text.isspace()
                ascii_only = ascii_only and text.isascii()
                yield text
            lines += data.count(b"\n", 0, end)
            offset, rest = offset + end, data[end:]
            if not more:
                break
    if not content:
        what = "file has only whitespace" if seen else "empty file"
        raise DataError(f"{path}: {what}; expected UTF-8 text")


def single_byte_hint(path: Path | None, byte: int) -> str:
    """The iconv line that re-saves `path` (None: stdin, piped through iconv) as UTF-8 where its
    first non-ASCII `byte` is not UTF-8 and nothing before it was (so not a UTF-8 file cut or
    spliced): a single-byte encoding, most often Windows-1252 (Latin-1's superset: old Project
    Gutenberg texts, files saved by Windows programs), named with the character the byte is
    there."""
    try:
        char = bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:  # 0x81, 0x8d, 0x8f, 0x90, 0x9d: not Windows-1252's
        return ""
    if path is None:
        fix = "pipe it through iconv -f CP1252 -t UTF-8"
    else:
        names = _shell_names(path)
        fix = _resave_line("CP1252", names["sh"], names["utf8"])
    return f" (0x{byte:02x} is {char!r} in Windows-1252, Latin-1's superset: {fix})"


def read_text(path: str | Path) -> str:
    """Read a whole file as UTF-8 text, with one-line errors for empty and non-UTF-8 files."""
    return "".join(open_text(path)[1])


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise DataError(f"{name} must be a positive integer, got {value!r}")


def _need_window(n: int, seq_len: int, what: str, source: str, hint: str) -> None:
    if n < seq_len + 1:
        raise DataError(
            f"{source}: {what} has {counted(n, 'token')} but one window needs seq_len+1 = "
            f"{seq_len + 1}; {hint}"
        )


def _either(*ways: str | bool) -> str:
    """The ways given (False: not one), as "a, b or c"."""
    said = [w for w in ways if w]
    return ", ".join(said[:-1]) + " or " + said[-1] if len(said) > 1 else said[0]


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


def _bar(path: str | Path, size: int, progress: bool = True) -> Any:
    """The progress bar of tokenizing a file of `size` bytes (None: none drawn), where the
    file holds at least `BAR_BYTES` (`pass_bar`) and `progress` asks for one."""
    return pass_bar(size, f"tokenizing {Path(path).name}" if progress else None, "B",
                    least=BAR_BYTES, unit_scale=True)


def _counted(texts: Iterable[str], bar: Any) -> Iterator[str]:
    """`texts`, each piece's UTF-8 bytes counted on `bar` once the next one is asked for."""
    for text in texts:
        yield text
        if bar is not None:
            bar.update(len(text.encode("utf-8")))


def _size(path: Path) -> int:
    """A file's size for a bar's total (0 where it cannot be read: `open_text` says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def document_ids(path: Path, tokenizer: Encoder, bar: Any = None) -> np.ndarray:
    """One file of a folder read as one text: its ids as `TokenData.from_file` encodes a file
    (the tokenizer's default BOS first), then the tokenizer's EOS. That is the boundary between
    documents llama.cpp's tokenizers give (Llama's `<s> ... </s>`) and nanoGPT's prepare.py
    writes (GPT-2's `<|endoftext|>` after each), and what llama.cpp ends a generation on; no
    BPE merge crosses it. `bar`: `_counted`'s, of the folder."""
    size, texts = open_text(path)
    ids = tokenizer.encode_stream(_counted(texts, bar), size=size, source=str(path))
    return np.append(ids, np.array([tokenizer.eos_id], ids.dtype))


@dataclass(frozen=True)
class TokenData:
    """Train and validation token ids split from one id sequence (or each from its own file),
    and optional held-out test ids. The ids are int32, or uint16 as a tokenizer of at most
    65,536 ids encodes a file (train and val then views of one array); batches are int32."""

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
        # uint16 and int32 ids are kept as they are: train and val are views of them, no copy
        kept = isinstance(ids, np.ndarray) and ids.dtype in (np.uint16, np.int32)
        ids = ids if kept else np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise DataError(f"{source}: expected a 1-D id sequence, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise DataError(f"{source}: token ids must fit int32, got [{ids.min()}, {ids.max()}]")
        if not kept:
            ids = ids.astype(np.int32)
        n = len(ids)
        n_val = round(n * val_fraction)  # round, not int(): 0.29 * 100 == 28.999...
        train, val = ids[: n - n_val], ids[n - n_val :]
        if not windows:
            return cls(train, val, source)
        need = seq_len + 1
        if len(train) < need:
            fits = min(len(train), len(val) if val_fraction > 0 else len(train)) - 1  # both
            # a validation split of 0 or 1 token holds no window at any --seq-len: the text's
            # whole length trains without one
            alone = n - 1 if fits <= 0 and 0 < val_fraction and len(val) <= 1 else 0
            most = math.floor((n - need) / n * 1000) / 1000 if n >= need else 0.0
            raise DataError(
                f"{source}: training split: expected at least {need} tokens (a window of "
                f"--seq-len {seq_len} and the token after it), found {len(train)} (of the "
                f"text's {n}); use " + _either(
                    "a longer text",
                    0 < most < val_fraction and n - round(n * most) >= need
                    and f"--data.val-fraction {most:g} or less",
                    fits > 0 and f"--seq-len {fits} or less",
                    alone > 0 and f"--seq-len {alone} or less with --data.val-fraction 0 (no "
                    "validation)"))
        if val_fraction > 0 and len(val) < need:
            # the least fraction whose split holds a window, where the rest still holds one
            least = math.ceil(need / n * 1000) / 1000
            raise DataError(
                f"{source}: validation split (the last {val_fraction:g} of the text's {n} "
                f"tokens): expected at least {need} tokens (a window of --seq-len {seq_len} and "
                f"the token after it), found {len(val)}; use " + _either(
                    "a longer text", len(val) > 1 and f"--seq-len {len(val) - 1} or less",
                    n - round(n * least) >= need and f"--data.val-fraction {least:g} or more",
                    "--data.val-fraction 0 (no validation)"))
        return cls(train, val, source)

    @classmethod
    def from_file(
        cls, path: str | Path, tokenizer: Encoder, seq_len: int, val_fraction: float = 0.1,
        windows: bool = True, progress: bool = True,
    ) -> TokenData:
        """Read a UTF-8 text file once, a piece at a time, encode it (the ids of the whole text,
        tokenizer's default BOS) into one array of the vocabulary's id type, and split it;
        `progress`: a bar on a terminal for a large file (`_bar`)."""
        size, texts = open_text(path)
        with _bar(path, size, progress) as bar:
            ids = tokenizer.encode_stream(_counted(texts, bar), size=size, source=str(path))
        return cls.from_ids(ids, seq_len, val_fraction, source=str(path), windows=windows)

    @classmethod
    def from_files(
        cls, folder: str | Path, files: Sequence[Path], tokenizer: Encoder, seq_len: int,
        val_fraction: float = 0.1, windows: bool = True, progress: bool = True,
    ) -> TokenData:
        """The text files `files` of a data folder (`chat.text_folder_files`) as one text, split
        as one file's ids are (`from_ids`): `document_ids` of each in turn, under one bar for
        the folder (`_bar`); DataError naming the tokenizer where it has no EOS."""
        if tokenizer.eos_id is None:
            raise DataError(f"{folder}: a folder of text files is read as one text, each file "
                            f"ended by the tokenizer's EOS, found {tokenizer.source} without "
                            "one (tokenizer.ggml.eos_token_id); join the files into one text "
                            "file and give --data.path that file")
        with _bar(folder, sum(_size(f) for f in files), progress) as bar:
            ids = np.concatenate([document_ids(f, tokenizer, bar) for f in files])
        return cls.from_ids(ids, seq_len, val_fraction, source=str(folder), windows=windows)

    def batch(
        self, step: int, seed: int, batch_size: int, seq_len: int, accum: int = 1
    ) -> dict[str, np.ndarray]:
        """`lm_batch` over the training split."""
        return lm_batch(self.train, step, seed, batch_size, seq_len, accum, source=self.source)

    def val_batches(
        self, batch_size: int, seq_len: int, max_batches: int | None
    ) -> list[dict[str, np.ndarray]]:
        """`val_batches` over the validation split (the first `max_batches` batches' worth;
        None: every window, as `test_batches` takes)."""
        most = max(1, len(self.val)) if max_batches is None else max_batches
        return val_batches(self.val, batch_size, seq_len, most, source=self.source)

    def test_batches(self, batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
        """`val_batches` over every window of the test ids ([] without a test set)."""
        if self.test is None:
            return []
        return val_batches(self.test, batch_size, seq_len, max(1, len(self.test)),
                           source=self.test_source or self.source, what="test set")

    def describe(self) -> dict[str, Any]:
        """Sizes for logging."""
        return {"source": self.source, "train_tokens": len(self.train), "val_tokens": len(self.val)}
