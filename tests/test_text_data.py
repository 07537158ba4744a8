"""Tests for toymlx.data.text: split sizes, window alignment, determinism, fixed validation."""

from __future__ import annotations

import gc
import hashlib
import shlex
import warnings

import numpy as np
import pytest

from toymlx.data import text as text_module
from toymlx.data import tokenizer as tokenizer_module
from toymlx.data.text import DataError, TokenData, lm_batch, open_text, read_text, val_batches
from toymlx.data.tokenizer import Tokenizer, byte_tokenizer


class ByteEncoder:
    """UTF-8 bytes as ids, with an optional BOS of 256."""

    bos_id = 256

    def __init__(self, add_bos: bool = False) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        bos = self.add_bos if add_bos is None else add_bos
        return ([self.bos_id] if bos else []) + list(text.encode("utf-8"))

    def encode_stream(self, texts, add_bos: bool | None = None, *, size=None,
                      source=None) -> np.ndarray:
        return np.asarray(self.encode("".join(texts), add_bos), np.int32)


# ------------------------------------------------------------------------- read_text


def test_read_text_rejects_empty_and_whitespace_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt: empty file"):
        read_text(empty)
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b" \n\n\t")
    with pytest.raises(DataError, match=r"blank\.txt: file has only whitespace"):
        read_text(blank)


def test_read_text_names_byte_offset_of_bad_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello\nw\xe9rld")  # latin-1 e-acute at byte 7, line 2
    with pytest.raises(DataError) as err:
        read_text(path)
    msg = str(err.value)
    assert "latin1.txt" in msg and "byte offset 7" in msg and "line 2" in msg and "0xe9" in msg
    assert "\n" not in msg


def test_read_text_strips_bom_and_keeps_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffh\u00e9\n".encode())
    assert read_text(path) == "h\u00e9\n"


def test_read_text_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.txt: expected a UTF-8 text file, found nothing at that path$"):
        read_text(tmp_path / "nope.txt")


def test_read_text_in_pieces_names_the_byte_offset_and_line_across_reads(tmp_path):
    """A file read 4 bytes at a time: a character cut by a read waits for the next; the first
    bad byte is named by its offset in the file, as a whole-file read names it."""
    path = tmp_path / "cut.txt"
    path.write_bytes("\ufeffa\u00e9\r\n\U0001f44b b\n".encode() + b"c\xe2\x82x\n")
    size, pieces = open_text(path, block=4)
    assert size == 20
    with pytest.raises(DataError) as err:
        list(pieces)
    assert str(err.value) == (f"{path}: not valid UTF-8 at byte offset 16 (line 3, byte 0xe2); "
                              "expected UTF-8 text, re-save the file as UTF-8")
    path.write_bytes("\ufeffa\u00e9\r\n\U0001f44b b\n".encode())
    size, pieces = open_text(path, block=1)
    assert "".join(pieces) == "a\u00e9\r\n\U0001f44b b\n"
    path.write_bytes("\ufeff \u3000\r\n".encode())  # U+3000: whitespace, as str.strip says
    with pytest.raises(DataError, match=r"cut\.txt: file has only whitespace; expected"):
        list(open_text(path, block=2)[1])


def test_an_iterator_dropped_unread_closes_its_file(tmp_path):
    """`open_text`'s file is closed with its iterator even where no piece was read (a tokenizer
    that refuses before reading: no bos id to add): it stayed open until the garbage
    collector closed it, with a ResourceWarning ("unclosed file")."""
    path = tmp_path / "t.txt"
    path.write_text("hello\n")
    with warnings.catch_warnings():  # files other tests left to the collector, warned here
        warnings.simplefilter("ignore", ResourceWarning)  # (a failed test's Popen pipe) not
        gc.collect()  # counted against this one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        size, pieces = open_text(path)
        del pieces
        gc.collect()
    assert size == 6 and [str(w.message) for w in caught if w.category is ResourceWarning] == []
    assert "".join(open_text(path)[1]) == "hello\n"


# one text of emoji, CRLF line ends, "▁", special-token texts, CJK and digits
MIXED = ("Hello \U0001f44b world\r\nCaf\u00e9 \u2581 na\u00efve \U0001f1eb\U0001f1f7 <s> x </s>"
         "\r\n\r\n  indented <|endoftext|>tail  <|im_start|>user\r\n\u6570\u5b57 123456 and 'll "
         "we're\r\n\t\tend \U0001f389\U0001f389\r\n")
# today's ids (main at 6587dbb: tok.encode(read_text(file))): count, sha256 of the int32 ids
TODAYS_IDS = {
    ("bytes", "shakespeare"): (1115395, "3f56641886d5d561"),
    ("bytes", "mixed"): (5761, "0f183a3d100029f4"),
    ("models/stories260K.gguf", "shakespeare"): (693364, "e8aa5db962327fd5"),
    ("models/stories260K.gguf", "mixed"): (4760, "4a7304b10aa88e8c"),
    ("tokenizers/ggml-vocab-gpt-2.gguf", "shakespeare"): (338025, "0c00ab83dc7f4666"),
    ("tokenizers/ggml-vocab-gpt-2.gguf", "mixed"): (2800, "a2462742bd205958"),
    ("tokenizers/ggml-vocab-llama-spm.gguf", "shakespeare"): (368634, "a5686ccf53d989fc"),
    ("tokenizers/ggml-vocab-llama-spm.gguf", "mixed"): (3481, "22dcf1d4b79bb3b1"),
    ("tokenizers/ggml-vocab-smollm2.gguf", "shakespeare"): (341094, "48e900acd0e3537d"),
    ("tokenizers/ggml-vocab-smollm2.gguf", "mixed"): (2559, "003b95fbb5a35449"),
}


@pytest.mark.parametrize("vocab,which", sorted(TODAYS_IDS))
def test_from_file_in_pieces_gives_todays_ids_as_uint16(vocab, which, shared_file, tmp_path,
                                                         monkeypatch):
    """A file read a few KiB (the mixed text: 7 bytes, encoded 5 characters of text at a time)
    at a time, each piece encoded up to a
    safe cut: the ids of the whole text as today, one uint16 array (2 bytes an id) that train
    and val are views of."""
    tok = byte_tokenizer() if vocab == "bytes" else Tokenizer.from_gguf(shared_file(vocab))
    if which == "shakespeare":
        path, block = shared_file("text/tinyshakespeare.txt"), 1 << 12
    else:
        path, block = tmp_path / "mixed.txt", 7
        monkeypatch.setattr(tokenizer_module, "ENCODE_CHARS", 5)
        path.write_bytes(("\ufeff" + MIXED * 40).encode())
    monkeypatch.setattr(text_module, "READ_BYTES", block)
    data = TokenData.from_file(path, tok, seq_len=8, val_fraction=0.1)
    ids = np.concatenate([data.train, data.val])
    n, digest = TODAYS_IDS[vocab, which]
    assert (len(ids), hashlib.sha256(ids.astype(np.int32).tobytes()).hexdigest()[:16]) == \
        (n, digest)
    assert (data.train.dtype, data.val.dtype) == (np.uint16, np.uint16)
    assert data.train.nbytes + data.val.nbytes == 2 * n
    assert data.train.base is not None and data.train.base is data.val.base


# ------------------------------------------------------------------------- split


def test_split_sizes_last_fraction_is_validation():
    data = TokenData.from_ids(np.arange(1000), seq_len=8)
    assert data.train.dtype == np.int32 and data.val.dtype == np.int32
    assert (len(data.train), len(data.val)) == (900, 100)
    np.testing.assert_array_equal(data.train, np.arange(900))
    np.testing.assert_array_equal(data.val, np.arange(900, 1000))
    assert len(TokenData.from_ids(np.arange(100), 8, val_fraction=0.29).val) == 29  # not 28
    assert len(TokenData.from_ids(np.arange(1000), 8, val_fraction=0.25).val) == 250
    no_val = TokenData.from_ids(np.arange(20), 8, val_fraction=0.0)
    assert (len(no_val.train), len(no_val.val)) == (20, 0)
    assert no_val.val_batches(4, 8, 10) == []


def test_split_too_short_errors_name_source_sizes_and_the_flags_that_fit():
    """A 3-line file said "use a longer text, a shorter seq_len or a larger val_fraction": no
    flag is spelt so (--seq-len, --data.val-fraction), and no value was named; the training
    split's --seq-len fitted it alone, and the validation split then refused that too. A text
    whose validation split holds 1 token said only "use a longer text": it names the largest
    --seq-len the whole text fits without validation."""
    with pytest.raises(DataError) as err:
        TokenData.from_ids(np.arange(50), seq_len=8, source="tiny.txt")
    assert str(err.value) == (
        "tiny.txt: validation split (the last 0.1 of the text's 50 tokens): expected at least 9 "
        "tokens (a window of --seq-len 8 and the token after it), found 5; use a longer text, "
        "--seq-len 4 or less, --data.val-fraction 0.18 or more or --data.val-fraction 0 (no "
        "validation)")
    assert len(TokenData.from_ids(np.arange(50), 8, 0.18).val) == 9  # the least that fits
    assert len(TokenData.from_ids(np.arange(50), 4, 0.1).val) == 5
    with pytest.raises(DataError) as err:  # no fraction leaves both splits a window
        TokenData.from_ids(np.arange(12), seq_len=8, source="tiny.txt")
    assert str(err.value).endswith("found 1; use a longer text or --data.val-fraction 0 (no "
                                   "validation)")
    with pytest.raises(DataError) as err:
        TokenData.from_ids(np.arange(36), seq_len=64, source="three.txt")
    assert str(err.value) == (
        "three.txt: training split: expected at least 65 tokens (a window of --seq-len 64 and "
        "the token after it), found 32 (of the text's 36); use a longer text or --seq-len 3 or "
        "less")  # 3, not 31: the validation split's 4 tokens hold no longer window
    with pytest.raises(DataError) as err:  # a 1-token validation split: no --seq-len fits it
        TokenData.from_ids(np.arange(13), seq_len=32, source="hi.txt")
    assert str(err.value).endswith("found 12 (of the text's 13); use a longer text or --seq-len "
                                   "12 or less with --data.val-fraction 0 (no validation)")
    assert len(TokenData.from_ids(np.arange(13), 12, 0.0).train) == 13  # the largest that fits
    with pytest.raises(DataError) as err:
        TokenData.from_ids(np.arange(8), seq_len=8, val_fraction=0.0, source="tiny.txt")
    assert str(err.value).endswith("found 8 (of the text's 8); use a longer text or --seq-len "
                                   "7 or less")
    with pytest.raises(DataError, match="val_fraction"):
        TokenData.from_ids(np.arange(50), seq_len=8, val_fraction=1.0)


def test_from_file_encodes_and_names_file_in_errors(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefghij" * 10, encoding="utf-8")
    data = TokenData.from_file(path, ByteEncoder(add_bos=True), seq_len=8)
    assert (len(data.train), len(data.val)) == (91, 10)  # 101 ids with BOS
    assert data.train[0] == 256 and data.train[1] == ord("a")
    assert data.describe() == {"source": str(path), "train_tokens": 91, "val_tokens": 10}
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")
    with pytest.raises(DataError, match=r"short\.txt: training split: .*, found 3 \(of"):
        TokenData.from_file(short, ByteEncoder(), seq_len=8)


def test_a_large_file_is_tokenized_under_a_progress_bar(tmp_path, monkeypatch, capsys):
    """A 200 MB text took ~3 minutes to tokenize with a BPE tokenizer on 2 cores, with nothing
    on the screen: from `BAR_BYTES` on, a terminal gets a bar of the bytes read (a log file
    nothing), and the ids are the same."""
    import sys

    path = tmp_path / "big.txt"
    path.write_text("abcdefghij" * 500, encoding="utf-8")
    monkeypatch.setattr(text_module, "BAR_BYTES", 5000)
    plain = TokenData.from_file(path, byte_tokenizer(), seq_len=8)
    assert capsys.readouterr().err == ""  # not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    barred = TokenData.from_file(path, byte_tokenizer(), seq_len=8)
    assert "tokenizing big.txt: " in capsys.readouterr().err
    np.testing.assert_array_equal(barred.train, plain.train)
    monkeypatch.setattr(text_module, "BAR_BYTES", 5001)  # a smaller file: no bar
    TokenData.from_file(path, byte_tokenizer(), seq_len=8)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------- lm_batch


def test_lm_batch_shapes_and_shifted_targets():
    tokens = np.arange(1000, dtype=np.int32)
    batch = lm_batch(tokens, step=3, seed=7, batch_size=3, seq_len=8, accum=2)
    for key, dtype in (("inputs", np.int32), ("targets", np.int32), ("mask", np.float32)):
        assert batch[key].shape == (2, 3, 8) and batch[key].dtype == dtype
    np.testing.assert_array_equal(batch["targets"][..., :-1], batch["inputs"][..., 1:])
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # contiguous windows
    np.testing.assert_array_equal(batch["mask"], np.ones((2, 3, 8)))


def test_lm_batch_is_pure_in_seed_and_step():
    tokens = np.arange(5000, dtype=np.int32)
    a = lm_batch(tokens, 5, 0, 4, 16, 2)
    b = lm_batch(tokens.copy(), 5, 0, 4, 16, 2)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["inputs"], lm_batch(tokens, 6, 0, 4, 16, 2)["inputs"])
    assert not np.array_equal(a["inputs"], lm_batch(tokens, 5, 1, 4, 16, 2)["inputs"])
    # Independent of what else was drawn before: step 5 after step 4 is still step 5.
    lm_batch(tokens, 4, 0, 4, 16, 2)
    np.testing.assert_array_equal(a["inputs"], lm_batch(tokens, 5, 0, 4, 16, 2)["inputs"])


def test_lm_batch_reaches_every_start_including_the_last():
    tokens = np.arange(20, dtype=np.int32)  # starts 0..11 with seq_len 8
    starts = {int(s) for step in range(200) for s in lm_batch(tokens, step, 0, 4, 8)["inputs"][
        ..., 0].ravel()}
    assert starts == set(range(12))


def test_lm_batch_errors():
    with pytest.raises(DataError, match=r"corpus: training split has 8 tokens .* = 9"):
        lm_batch(np.arange(8), 0, 0, 1, 8, source="corpus")
    with pytest.raises(DataError, match="batch_size must be a positive integer"):
        lm_batch(np.arange(100), 0, 0, 0, 8)
    with pytest.raises(DataError, match="step and seed"):
        lm_batch(np.arange(100), -1, 0, 1, 8)


def test_token_data_batches_use_only_their_split():
    data = TokenData.from_ids(np.arange(1000), seq_len=8)
    for step in range(20):
        assert data.batch(step, 0, 8, 8)["targets"].max() < 900
    for batch in data.val_batches(4, 8, 100):
        real = batch["mask"] > 0
        assert batch["inputs"][real].min() >= 900


# ------------------------------------------------------------------------- val_batches


def test_val_batches_cover_split_evenly_without_overlap():
    tokens = np.arange(101, dtype=np.int32)  # 10 windows of 10 targets
    batches = val_batches(tokens, batch_size=4, seq_len=10, max_batches=10)
    assert len(batches) == 3
    for b in batches:
        assert {k: v.shape for k, v in b.items()} == {k: (1, 4, 10) for k in b}
    np.testing.assert_array_equal([b["mask"][0, :, 0] for b in batches],
                                  [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batches[2]["inputs"][0, 2:], 0)
    starts = np.concatenate([b["inputs"][0, :, 0] for b in batches])[:10]
    np.testing.assert_array_equal(starts, np.arange(0, 100, 10))
    targets = np.concatenate([b["targets"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(np.sort(targets), np.arange(1, 101))  # each once


def test_val_batches_spread_when_capped_and_fixed():
    tokens = np.arange(1001, dtype=np.int32)
    batches = val_batches(tokens, batch_size=2, seq_len=10, max_batches=2)
    starts = np.concatenate([b["inputs"][0, :, 0] for b in batches])
    np.testing.assert_array_equal(starts, [0, 330, 660, 990])  # first to last, evenly
    again = val_batches(tokens, batch_size=2, seq_len=10, max_batches=2)
    for b1, b2 in zip(batches, again, strict=True):
        for key in b1:
            np.testing.assert_array_equal(b1[key], b2[key])


@pytest.mark.parametrize("n, seq_len, batch_size, max_batches",
                         [(9, 8, 1, 1), (17, 8, 3, 5), (250, 7, 4, 3), (1000, 16, 5, 7)])
def test_val_batches_targets_never_overlap(n, seq_len, batch_size, max_batches):
    batches = val_batches(np.arange(n, dtype=np.int32), batch_size, seq_len, max_batches)
    targets = np.concatenate([b["targets"][b["mask"] > 0] for b in batches])
    assert len(targets) == len(set(targets.tolist())) > 0
    assert len(batches) <= max_batches
    np.testing.assert_array_equal(
        np.concatenate([b["targets"] for b in batches])[..., :-1],
        np.concatenate([b["inputs"] for b in batches])[..., 1:],
    )


# ---- a folder of text files: one text, each file a document ended by the tokenizer's EOS ----
def _book(tmp_path):
    """A folder of a user's text files: two chapters, one in a subfolder, a suffix in capitals,
    beside a hidden file, a hidden folder's copy and an image, none of them text to train on."""
    folder = tmp_path / "my book"
    (folder / "part 2").mkdir(parents=True)
    texts = {"b.txt": "Chapter two.\n", "a.md": "# Chapter one\n\nIt was a dark night.",
             "part 2/c.TXT": "Épilogue: fin.\n"}
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    (folder / ".notes.txt").write_text("hidden\n")
    (folder / ".ipynb_checkpoints").mkdir()  # Jupyter's copy of a note it opened
    (folder / ".ipynb_checkpoints" / "a-checkpoint.md").write_text("# Chapter one\n")
    (folder / "cover.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return folder, texts


def test_a_folder_of_text_files_is_one_text_each_file_ended_by_eos(tmp_path):
    """nanoGPT users give a folder of text files; it was refused with a `cat ... > all.txt`
    line. Its files (sorted by path, subfolders too) are read as one text: each file's ids as a
    file's (the byte tokenizer's <s> first), then </s>, by hand: [1] + (byte + 3)... + [2]; the
    last --data.val-fraction of those ids is validation, as of one file's."""
    from toymlx.recipes.common import TextData, load_token_data

    folder, texts = _book(tmp_path)
    want = []
    for name in ("a.md", "b.txt", "part 2/c.TXT"):  # path order
        want += [1, *(b + 3 for b in texts[name].encode("utf-8")), 2]
    td = load_token_data(TextData(str(folder), 0.25), byte_tokenizer(), 8)
    assert np.concatenate([td.train, td.val]).tolist() == want
    assert len(td.val) == round(len(want) * 0.25) and td.source == str(folder)


def test_a_folder_read_with_a_gguf_tokenizer_ends_each_file_with_its_eos(tmp_path, shared_file):
    """GPT-2's vocabulary adds no BOS: each file's ids, then <|endoftext|> (50256), as
    nanoGPT's prepare.py writes them; no BPE merge crosses a file's end."""
    from toymlx.recipes.common import TextData, load_token_data

    tok = Tokenizer.from_gguf(shared_file("tokenizers/ggml-vocab-gpt-2.gguf"))
    assert (tok.add_bos, tok.eos_id) == (False, 50256)
    folder, texts = _book(tmp_path)
    want = []
    for name in ("a.md", "b.txt", "part 2/c.TXT"):
        want += [*tok.encode(texts[name]), 50256]
    td = load_token_data(TextData(str(folder), 0.0), tok, 4)
    assert td.train.tolist() == want and td.val.size == 0


def test_a_utf16_file_in_a_text_folder_is_named_with_the_line_that_converts_it(tmp_path):
    """A UTF-16 file in a folder of texts is refused with its iconv line; run as printed, the
    line converts the file in place, and the folder then reads as one written in UTF-8 from the
    start. Before: the line wrote d-utf8.txt beside d.txt, which stayed in the folder to be
    refused again, and its unquoted path (the folder "my book") split in a shell."""
    import subprocess

    from toymlx.recipes.common import TextData, load_token_data

    folder, _ = _book(tmp_path)
    bad = folder / "part 2" / "d.txt"
    bad.write_bytes("Notepad's Unicode\n".encode("utf-16"))
    with pytest.raises(DataError) as e:
        load_token_data(TextData(str(folder)), byte_tokenizer(), 8)
    line = f"iconv -f UTF-16 -t UTF-8 '{bad}' > '{bad}.utf8' && mv '{bad}.utf8' '{bad}'"
    assert str(e.value) == (f"{bad}: expected UTF-8 text, found UTF-16 text: re-save it as UTF-8 "
                            f"({line})")
    subprocess.run(line, shell=True, check=True, cwd=tmp_path)  # as a user's shell runs it
    assert sorted(p.name for p in bad.parent.iterdir()) == ["c.TXT", "d.txt"]
    ref, _ = _book(tmp_path / "ref")
    (ref / "part 2" / "d.txt").write_text("Notepad's Unicode\n", encoding="utf-8")
    got, want = (load_token_data(TextData(str(f), 0.0), byte_tokenizer(), 8).train.tolist()
                 for f in (folder, ref))
    assert got == want and want[-20:] == [1, *(b + 3 for b in b"Notepad's Unicode\n"), 2]


def test_a_text_folder_with_records_beside_its_texts_names_the_file_not_read(tmp_path):
    from toymlx.recipes.common import TextData, load_token_data

    folder, _ = _book(tmp_path)
    (folder / "valid.jsonl").write_text('{"text": "held out"}\n')
    with pytest.raises(DataError) as e:
        load_token_data(TextData(str(folder)), byte_tokenizer(), 8)
    assert str(e.value) == (
        f"{folder / 'valid.jsonl'}: data folder of text files: expected only text files (.txt, "
        ".md, .text, .markdown, .rst) or train.jsonl (required), valid.jsonl and test.jsonl "
        "(optional) (mlx-lm's layout; .json, .csv or .tsv in place of .jsonl), found "
        "valid.jsonl too, which would not be read; move it out, or name the records "
        "train.jsonl (mlx-lm's layout)")


def test_test_of_a_text_folder_says_it_has_no_test_split(tmp_path):
    """--test scores a data folder's test.jsonl: a folder of text files is one text, no test
    split (it read "expected train.jsonl ..., found a.md, b.txt" instead)."""
    from toymlx.recipes.common import check_test_folder

    folder, _ = _book(tmp_path)
    with pytest.raises(ValueError) as e:
        check_test_folder(str(folder))
    assert str(e.value) == (
        f"--test: expected --data.path to be a data folder with test.jsonl, found {folder}, a "
        "folder of text files, one text with no test split (give a folder with train.jsonl and "
        "test.jsonl, mlx-lm's layout)")


def test_a_folder_of_text_files_records_the_files_it_reads_not_a_hidden_folders(tmp_path):
    """config.json recorded the files in hidden folders that the run never read (Jupyter's
    .ipynb_checkpoints/ copy), so Jupyter saving a checkpoint stopped --resume and toymlx-eval
    with ".ipynb_checkpoints/a-checkpoint.md changed". The record names the files read, and an
    edit in a hidden folder leaves it as it was; an edit to a file read still changes it."""
    from toymlx.bundle.inputs import fingerprint, same_data
    from toymlx.data.chat import TEXT_SUFFIXES, text_folder_files

    folder, _ = _book(tmp_path)
    rec = fingerprint(folder, only=TEXT_SUFFIXES, each=True)
    read = [p.relative_to(folder).as_posix() for p in text_folder_files(folder)]
    assert sorted(rec["files"]) == read == ["a.md", "b.txt", "part 2/c.TXT"]
    (folder / ".ipynb_checkpoints" / "a-checkpoint.md").write_text("# Chapter one, edited\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "notes.txt").write_text("a file git keeps\n")
    assert fingerprint(folder, only=TEXT_SUFFIXES, each=True) == rec
    assert same_data(folder, rec, TEXT_SUFFIXES)[0]
    # a run recorded before: its record holds the hidden folder's file too, and still resumes
    was = {**rec, "bytes": rec["bytes"] + 14, "sha256": "0" * 64, "files": {
        **rec["files"], ".ipynb_checkpoints/a-checkpoint.md": {"bytes": 14, "sha256": "0" * 64}}}
    assert same_data(folder, was, TEXT_SUFFIXES)[0]
    (folder / "b.txt").write_text("Chapter two, edited.\n")
    assert not same_data(folder, rec, TEXT_SUFFIXES)[0]
    assert not same_data(folder, was, TEXT_SUFFIXES)[0]


def test_a_link_back_up_in_a_folder_of_text_files_is_refused_by_name(tmp_path):
    """`part 2/up -> ..` (a link back up to the data folder) was skipped without a word in a
    folder of text files, while the same link in an image folder's class was refused: the one
    walk (`names_below`) now refuses every link to a folder that holds it, naming the link."""
    from toymlx.data.chat import text_folder_files

    folder, _ = _book(tmp_path)
    (folder / "part 2" / "up").symlink_to("..")
    with pytest.raises(DataError) as e:
        text_folder_files(folder)
    assert str(e.value) == (
        f"{folder / 'part 2' / 'up'}: expected a file or a folder within {folder}, found a link "
        f"back up to {folder.resolve()}, which holds it: a loop, its names read again through "
        "it; remove the link")


def test_a_loop_inside_a_hidden_folder_is_not_followed(tmp_path):
    """`.git/up -> ..` (a link in a folder toymlx never reads) refused the whole data folder
    as a loop; hidden folders are no longer entered, so the folder is read and fingerprinted as
    without it. A loop outside a hidden folder is still refused."""
    from toymlx.bundle.inputs import fingerprint
    from toymlx.data.chat import TEXT_SUFFIXES, text_folder_files

    folder, _ = _book(tmp_path)
    want = text_folder_files(folder)
    rec = fingerprint(folder, only=TEXT_SUFFIXES, each=True)
    (folder / ".git").mkdir()
    (folder / ".git" / "up").symlink_to("..")
    (folder / "part 2" / ".cache").symlink_to(folder)
    assert text_folder_files(folder) == want
    assert fingerprint(folder, only=TEXT_SUFFIXES, each=True) == rec
    (folder / "part 2" / "up").symlink_to("..")
    with pytest.raises(DataError, match="found a link back up to"):
        text_folder_files(folder)


def test_a_folder_of_text_files_names_the_files_it_does_not_read(tmp_path):
    """A folder's cover.png, script.py and README (no suffix) were left out without a word, so
    notes kept as .org files trained on nothing of theirs; one line names them, counted by
    kind, as an image folder's notes.txt is; the hidden ones are not counted."""
    from toymlx.backend.notice import ToymlxWarning
    from toymlx.recipes.common import TextData, load_token_data

    folder, _ = _book(tmp_path)
    (folder / "part 2" / "script.py").write_text("print(1)\n")
    (folder / "README").write_text("about\n")
    with pytest.warns(ToymlxWarning) as got:
        load_token_data(TextData(str(folder), 0.25), byte_tokenizer(), 8)
    assert [str(w.message) for w in got] == [
        (f"{folder}: 3 files not read, not named as text (*.txt, *.md, *.text, ...): 1 no "
         "extension, 1 .png, 1 .py (README, cover.png, part 2/script.py); rename any text "
         "among them to .txt to train on it")]


def test_a_windows_1252_file_is_refused_with_the_iconv_line_that_re_saves_it(tmp_path):
    """An old Project Gutenberg text in Latin-1 was told "re-save the file as UTF-8" with no
    way to; a UTF-16 file had its iconv line. A bad byte after ASCII alone is of a single-byte
    encoding: named as Windows-1252 reads it, with the line (run here: it gives the text). A
    bad byte after UTF-8 characters is a cut UTF-8 file, told as before."""
    import subprocess

    path = tmp_path / "gutenberg.txt"
    path.write_bytes(b"Il \xe9tait une fois.\n")
    with pytest.raises(DataError) as err:
        read_text(path)
    sh, tmp = shlex.quote(str(path)), shlex.quote(f"{path}.utf8")
    line = f"iconv -f CP1252 -t UTF-8 {sh} > {tmp} && mv {tmp} {sh}"
    assert str(err.value) == (
        f"{path}: not valid UTF-8 at byte offset 3 (line 1, byte 0xe9); expected UTF-8 text, "
        f"re-save the file as UTF-8 (0xe9 is 'é' in Windows-1252, Latin-1's superset: {line})")
    subprocess.run(line, shell=True, check=True, cwd=tmp_path)  # the line, as a shell runs it
    assert read_text(path) == "Il était une fois.\n"  # in place: the file given is UTF-8 now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gutenberg.txt"]
    path.write_bytes("déjà \xe9".encode() + b" \xe9\n")  # UTF-8 first: no guess
    with pytest.raises(DataError) as err:
        read_text(path)
    assert str(err.value).endswith("re-save the file as UTF-8")
