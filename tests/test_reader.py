"""GGUFFile's header cache (toymlx.gguf.reader.HeaderCache): each command parses a GGUF's
vocabulary once, however many times it opens the file; a file rewritten in between is parsed
again (in place, same size, same mtime too); the model read through the cache computes the
same logits; the cache holds no file data."""

from __future__ import annotations

import collections
import json
import mmap
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from toymlx.gguf import reader
from toymlx.gguf.reader import HEADERS, GGUFFile
from toymlx.gguf.writer import write_gguf

VOCAB = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def run(stories_path, tmp_path_factory) -> Path:
    """A 2-step LoRA run on a copy of stories260K (512 tokens), its base beside it."""
    from toymlx_cli.train import main as train

    root = tmp_path_factory.mktemp("headers")
    base = root / "base.gguf"
    shutil.copyfile(stories_path, base)
    data = root / "data"
    data.mkdir()
    for name, n in (("train", 8), ("valid", 4)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({
            "prompt": f"Tell me about {i}.", "completion": f" Once upon a time {i}."}) + "\n"
            for i in range(n)))
    assert train(["--recipe", "lora", "--base", str(base), "--runs-root", str(root),
                  "--run-id", "r", "--steps", "2", "--batch-size", "2", "--eval-batches", "1",
                  "--seq-len", "64", "--eval-every", "0", "--data.path", str(data),
                  "--no-progress"]) == 0
    return root / "r"


@pytest.fixture
def vocab_parses(monkeypatch) -> collections.Counter:
    """Counts, by file name, each parse of a GGUF's `tokenizer.ggml.tokens` (a cold cache)."""
    counts: collections.Counter = collections.Counter()
    read_value = reader._read_value

    def counting(c, vtype, key, depth=0):
        if key == VOCAB:
            counts[Path(c.path).name] += 1
        return read_value(c, vtype, key, depth)

    monkeypatch.setattr(reader, "_read_value", counting)
    HEADERS.clear()
    yield counts
    HEADERS.clear()


def test_lora_start_parses_the_base_vocabulary_once(run, vocab_parses):
    from toymlx_cli.train import main as train

    base, data = str(run.parent / "base.gguf"), str(run.parent / "data")
    assert train(["--recipe", "lora", "--base", base, "--runs-root", str(run.parent),
                  "--run-id", "again", "--steps", "1", "--batch-size", "2", "--eval-batches",
                  "1", "--seq-len", "64", "--eval-every", "0", "--data.path", data,
                  "--no-progress"]) == 0
    assert dict(vocab_parses) == {"base.gguf": 1}  # was 2 (build's checks, load_llama)


def test_generate_parses_the_base_vocabulary_once(run, vocab_parses, capsys):
    from toymlx_cli.generate import main as generate

    assert generate(["--model", str(run), "--prompt", "Once upon a time", "--max-tokens", "1",
                     "--temperature", "0", "--engine", "mlx"]) == 0
    assert dict(vocab_parses) == {"base.gguf": 1}  # was 5


def test_eval_parses_the_base_vocabulary_once(run, vocab_parses, capsys):
    from toymlx_cli.eval import main as evaluate

    assert evaluate(["--model", str(run)]) == 0
    assert dict(vocab_parses) == {"base.gguf": 1}  # was 4


def test_export_fuse_parses_each_vocabulary_once(run, vocab_parses, tmp_path, capsys):
    from toymlx_cli.export import main as export

    assert export(["--adapter", str(run), "--fuse", "--out", str(tmp_path / "f.gguf")]) == 0
    assert dict(vocab_parses) == {"base.gguf": 1, "f.gguf": 1}  # was 2 and 3


def test_the_cached_header_gives_the_same_logits_and_ids(run):
    """A cold load (cache cleared) and warm ones (every header from the cache): equal logits,
    equal greedy ids."""
    from toymlx.generation.generate import generate, load_for_generation

    prompt = [1, 403, 407, 261, 378, 30]
    runs = []
    for cold in (True, False, False):  # every header parsed, then every one from the cache
        if cold:
            HEADERS.clear()
        model, tok = load_for_generation(run, weights="float32")
        logits = np.array(model(mx.array([prompt])))
        runs.append((logits, list(generate(model, tok, prompt, max_tokens=8))))
    for logits, ids in runs[1:]:
        np.testing.assert_array_equal(logits, runs[0][0])
        assert ids == runs[0][1]


def _tiny(path: Path, name: str) -> Path:
    return write_gguf(path, {"general.architecture": "toy", "general.name": name,
                             VOCAB: ["a", "b", name]},
                      {"w": np.arange(8, dtype=np.float32)})


def test_a_file_rewritten_in_place_with_the_same_size_and_mtime_is_read_again(tmp_path):
    path = _tiny(tmp_path / "m.gguf", "one")
    with GGUFFile(path) as g:
        assert g.get("general.name", str) == "one"
    st = os.stat(path)
    raw = path.read_bytes()
    assert raw.count(b"one") == 2
    with open(path, "r+b") as f:  # same inode, same size
        f.write(raw.replace(b"one", b"two"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    assert os.stat(path).st_size == st.st_size
    with GGUFFile(path) as g:
        assert (g.get("general.name", str), g.metadata[VOCAB]) == ("two", ["a", "b", "two"])


def test_a_file_replaced_is_read_again_and_an_unchanged_one_is_not(tmp_path, vocab_parses):
    path = _tiny(tmp_path / "m.gguf", "one")
    for _ in range(3):
        with GGUFFile(path) as g:
            assert g.get("general.name", str) == "one"
    assert vocab_parses["m.gguf"] == 1
    _tiny(path, "three")  # written atomically: a new file at the path, another size
    with GGUFFile(path) as g:
        assert g.metadata[VOCAB] == ["a", "b", "three"]
    with GGUFFile(tmp_path / "." / "m.gguf") as g:  # another spelling of the same file
        assert g.get("general.name", str) == "three"
    assert vocab_parses["m.gguf"] == 2


def test_each_open_has_its_own_dicts_and_the_cache_holds_no_file_data(tmp_path, vocab_parses):
    path = _tiny(tmp_path / "m.gguf", "one")
    with GGUFFile(path) as g:
        g.metadata["general.name"] = "edited"
        g.tensors.pop("w")
    with GGUFFile(path) as g:
        assert g.get("general.name", str) == "one" and list(g.tensors) == ["w"]

    def plain(v) -> bool:
        if isinstance(v, dict):
            return all(plain(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return not isinstance(v, (mmap.mmap, memoryview, np.ndarray, GGUFFile))

    assert all(plain(e) for e in HEADERS._entries.values())


def test_a_caller_s_edit_of_a_token_list_reaches_no_other_open(tmp_path, vocab_parses):
    """The cache shared each array value (the token lists) between opens: a caller that
    appended to or sorted its vocabulary changed every later open's (and `read_metadata`'s),
    the parsing open's included."""
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "toy", VOCAB: ["c", "a", "b"],
                                            "tokenizer.ggml.scores": [0.5, -1.0, 2.0]},
                      {"w": np.arange(8, dtype=np.float32)})
    want = {VOCAB: ["c", "a", "b"], "tokenizer.ggml.scores": [0.5, -1.0, 2.0]}
    for _ in range(3):  # the open that parsed (and filled the cache), then two from the cache
        with GGUFFile(path) as g:
            assert {k: g.metadata[k] for k in want} == want
            g.metadata[VOCAB].append("x")
            g.metadata[VOCAB].sort()
            g.metadata["tokenizer.ggml.scores"][0] = 9.0
        meta = reader.read_metadata(path)
        assert {k: meta[k] for k in want} == want
        meta[VOCAB].extend(["y", "z"])
    assert vocab_parses["m.gguf"] == 1  # every open after the first from the cache


def test_the_cache_keeps_the_most_recently_opened_files(tmp_path, vocab_parses):
    paths = [_tiny(tmp_path / f"m{i}.gguf", f"n{i}") for i in range(HEADERS.size + 1)]
    for p in paths:
        GGUFFile(p).close()
    assert len(HEADERS._entries) == HEADERS.size
    GGUFFile(paths[-1]).close()
    GGUFFile(paths[0]).close()  # dropped first: parsed again
    assert vocab_parses == {p.name: 2 if p == paths[0] else 1 for p in paths}


@pytest.fixture
def sliced_file(tmp_path) -> Path:
    """A GGUF of a Q8_0 matrix (40 x 64), an F16 3-D tensor (3 x 5 x 32) and an F32 vector."""
    from toymlx.gguf.writer import encode_tensor

    rng = np.random.default_rng(0)
    tensors = {"m.weight": encode_tensor("m.weight", rng.normal(size=(40, 64)).astype(np.float32),
                                         "q8_0"),
               "e.weight": rng.normal(size=(3, 5, 32)).astype(np.float16),
               "n.weight": rng.normal(size=(64,)).astype(np.float32)}
    return write_gguf(tmp_path / "sliced.gguf", {"general.architecture": "llama"}, tensors,
                      digest=False)


@pytest.mark.parametrize("want", ["float32", "bfloat16", "float16"])
def test_a_tensor_loaded_a_slice_at_a_time_equals_it_loaded_whole(sliced_file, monkeypatch,
                                                                  want):
    """`float_weight` decodes a tensor of more than SLICE_VALUES values by slices of rows into
    the array MLX holds: the same values, dtype and shape as the whole tensor decoded at once,
    however the slices fall (7 rows of 64, 1 of 32, a last slice shorter than the others)."""
    from toymlx.gguf import llama

    g = GGUFFile(sliced_file)
    dtype = getattr(mx, want)
    for name, per in (("m.weight", 7 * 64), ("e.weight", 32), ("e.weight", 4 * 32),
                      ("n.weight", 8)):
        whole = g.load(name, np.float16 if want == "float16" else np.float32)
        monkeypatch.setattr(llama, "SLICE_VALUES", per)
        w = llama.float_weight(g, name, dtype)
        assert w.dtype == dtype and w.shape == whole.shape, name
        assert np.array_equal(np.array(w.astype(mx.float32)),
                              np.array(mx.array(whole).astype(dtype).astype(mx.float32))), name
    for name in ("m.weight", "e.weight"):  # a slice of rows decodes as they do in the whole
        assert np.array_equal(g.load(name, rows=(2, 5)),
                              g.load(name).reshape(-1, g.tensors[name].shape[-1])[2:5]), name


def test_a_nan_in_a_later_slice_is_named_at_its_place_in_the_tensor(sliced_file, monkeypatch):
    """A NaN decoded in a slice of rows is refused with its index in the whole tensor (expert,
    row, column) and the rows of the slice it was found in."""
    from toymlx.gguf import llama
    from toymlx.gguf.reader import GGUFError

    info = GGUFFile(sliced_file).tensors["e.weight"]
    at = info.offset + 2 * (2 * 5 * 32 + 3 * 32 + 7)  # expert 2, row 3, column 7 (F16)
    with open(sliced_file, "r+b") as f:
        f.seek(at)
        f.write(np.float16("nan").tobytes())
    monkeypatch.setattr(llama, "SLICE_VALUES", 4 * 32)
    with pytest.raises(GGUFError) as e:
        llama.float_weight(GGUFFile(sliced_file), "e.weight", mx.float32)
    assert str(e.value) == (
        f"{sliced_file}: tensor 'e.weight': expected finite values, found NaN in 1 of the 96 in rows "
        "12-14 (the first, nan, at (2, 3, 7)); the file is damaged or was written from "
        "a model that diverged: use another copy of it")
