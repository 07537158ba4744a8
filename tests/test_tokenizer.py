"""toymlx.data.tokenizer against llama.cpp's own tokenizer test vectors and known ids."""

from __future__ import annotations

import ctypes
import random
import time
from pathlib import Path

import numpy as np
import pytest
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.data.merges import PRE_TOKENIZERS
from toymlx.data.special_tokens import split_special
from toymlx.data.tokenizer import _CUTS, Tokenizer, _classes, byte_tokenizer
from toymlx.data.vocab import BYTE_OFFSET, TokenizerError, encode_bytes_np
from toymlx.generation.generate import stop_ids
from toymlx.gguf.reader import read_metadata

SEP = "\n__ggml_vocab_test__\n"


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """`<vocab>.inp` / `.out` split exactly as llama.cpp's tests/test-tokenizer-0.cpp does."""
    raw = Path(str(vocab) + ".inp").read_bytes().decode("utf-8")
    cases, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            cases.append(raw[pos:])
            break
        cases.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    out = Path(str(vocab) + ".out").read_bytes().decode("utf-8")
    lines = out.split("\n")
    if out.endswith("\n"):
        lines.pop()  # std::getline yields no empty last line
    assert len(lines) == len(cases)
    return [(c, [int(x) for x in line.strip().split()]) for c, line in zip(cases, lines)]


@pytest.fixture(scope="module")
def gpt2(shared_file) -> Tokenizer:
    return Tokenizer.from_gguf(shared_file("tokenizers/ggml-vocab-gpt-2.gguf"))


@pytest.fixture(scope="module")
def spm(shared_file) -> Tokenizer:
    return Tokenizer.from_gguf(shared_file("tokenizers/ggml-vocab-llama-spm.gguf"))


@pytest.fixture(scope="module")
def smol(shared_file) -> Tokenizer:
    return Tokenizer.from_gguf(shared_file("tokenizers/ggml-vocab-smollm2.gguf"))


@pytest.fixture(scope="module")
def stories(stories_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(stories_path)


@pytest.fixture(scope="module")
def bt() -> Tokenizer:
    return byte_tokenizer()


# ------------------------------------------------------------------ llama.cpp test vectors
@pytest.mark.parametrize("name,fixture", [("ggml-vocab-gpt-2.gguf", "gpt2"),
                                          ("ggml-vocab-llama-spm.gguf", "spm")])
def test_llama_cpp_vectors_all_match(request, shared_file, name, fixture):
    tok = request.getfixturevalue(fixture)
    for ext in (".inp", ".out"):  # its test vectors: skips naming a missing one
        shared_file(f"tokenizers/{name}{ext}")
    cases = read_vectors(shared_file(f"tokenizers/{name}"))
    assert len(cases) == 46
    # test-tokenizer-0 calls common_tokenize(ctx, text, add_special=false, parse_special=false)
    failed = [(text, want, got) for text, want in cases
              if (got := tok.encode(text, add_bos=False, parse_special=False)) != want]
    assert failed == [], f"{len(failed)} of {len(cases)} cases differ: {failed[:3]}"
    matched = len(cases) - len(failed)
    assert matched == 46
    # and every case decodes back to its text
    assert [t for t, w in cases if tok.decode(w) != t] == []


def test_vector_spot_checks(gpt2, spm):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" Hello world") == [18435, 995]
    assert gpt2.encode("   ") == [220, 220, 220]
    # SPM: llama.cpp prefixes a space to each raw-text fragment, then "▁"-escapes spaces
    assert spm.encode("Hello world", add_bos=False) == [15043, 3186]
    assert spm.encode(" ", add_bos=False) == [259]
    assert spm.encode("", add_bos=False) == []
    assert spm.encode("") == [1]


# ------------------------------------------------------------------ flags, specials
def test_defaults_per_model_type(gpt2, spm, smol, stories):
    assert (gpt2.model, gpt2.pre, gpt2.add_bos) == ("gpt2", "gpt-2", False)
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.vocab_size) == (50256, 50256, 50257)
    assert (spm.model, spm.add_bos, spm.add_space_prefix) == ("llama", True, True)
    assert (spm.bos_id, spm.eos_id, spm.unk_id, spm.vocab_size) == (1, 2, 0, 32000)
    assert (smol.pre, smol.add_bos, smol.bos_id, smol.eos_id) == ("smollm", False, 1, 2)
    # stories260K has no add_bos_token key: llama.cpp's "llama" default is true
    assert (stories.add_bos, stories.add_space_prefix, stories.vocab_size) == (True, True, 512)
    # <|endoftext|>, <|im_end|>, <reponame> (llama.cpp's llama_vocab_is_eog)
    assert smol.eog_ids == frozenset({0, 2, 4})


def test_parse_special(gpt2, spm):
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]
    plain = gpt2.encode("a<|endoftext|>b", parse_special=False)
    assert 50256 not in plain and gpt2.decode(plain) == "a<|endoftext|>b"
    # after a special token llama.cpp's SPM prefixes a space again
    assert spm.encode("<s>Hi", add_bos=False) == [1] + spm.encode("Hi", add_bos=False)
    assert spm.encode("Hi</s>", add_bos=False) == spm.encode("Hi", add_bos=False) + [2]
    assert 1 not in spm.encode("<s>Hi", add_bos=False, parse_special=False)
    assert spm.encode("x", add_eos=True) == [1, 921, 2]


def test_decode_skips_specials(smol, spm):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids == [1, 4093, 198, 6004, 2, 198]
    assert smol.decode(ids) == "user\nhi\n"
    assert smol.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>\n"
    text = "<s> a </s> b"
    ids = spm.encode(text, add_bos=False)
    assert ids[0] == 1 and ids.count(2) == 1
    assert spm.decode(ids, skip_special=False) == text
    assert spm.decode(ids) == " a  b"
    assert spm.decode(spm.encode(text), skip_special=False) == "<s>" + text
    with pytest.raises(ValueError, match="32000"):
        spm.decode([32000])


# ------------------------------------------------------------------ stories260K (SPM, 512)
def test_stories_once_upon_a_time(stories):
    ids = stories.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    assert [stories.token_text(i) for i in ids] == ["<s>", "▁Once", "▁upon", "▁a", "▁time"]
    assert stories.decode(ids) == "Once upon a time"
    text = "Lily saw a big red ball. She said, \"Wow!\"\n\nThe end. 123 Zürich"
    assert stories.decode(stories.encode(text)) == text


# ------------------------------------------------------------------ SmolLM2 (gpt2 / smollm)
ROUND_TRIP = [
    "Hello world",
    "plain ASCII, with punctuation: (a) [b] {c}; 'quotes' \"double\"!?",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs, newlines\n\n\nand\r\nCRLF",
    "multiple     spaces    here",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語, 한국어, عربى",
    "emoji 🦙😀👍🏽 and ZWJ 👩‍👩‍👧",
    "def f(x):\n    return {k: v ** 2 for k, v in x.items()}  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-5 0xFF",
    "I'm sure you'll see they've done it; we'd've",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm2_round_trip(smol, text):
    ids = smol.encode(text)
    assert all(0 <= i < 49152 for i in ids)
    assert smol.decode(ids) == text


def test_smollm2_known_ids(smol):
    # smollm pre-tokenizer isolates every digit; ids cross-checked with llama.cpp
    assert smol.encode("Hello world") == [19556, 905]
    assert smol.encode("12345") == [33, 34, 35, 36, 37]
    assert smol.encode("  multiple") == [216, 2701]


def test_smollm2_chat_template(smol):
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    text = smol.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    text = smol.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "Hello!"}],
                                    add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = smol.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 3


BATCH_TEXTS = ["Hello world", "", "<|im_start|>user\n12345<|im_end|>\n", "  multiple",
               "café 東京 🙂\n\n", "<|im_end|>", " \t\n", "x" * 300]


@pytest.mark.parametrize("name", ["smol", "spm", "byte"])
@pytest.mark.parametrize("add_bos", [None, False, True])
def test_encode_batch_gives_each_text_s_own_ids(spm, smol, name, add_bos):
    """`encode_batch` (one call into `tokenizers` for the raw text of all the texts, as chat
    data is tokenized) gives each text the int32 ids `encode` gives it alone: specials, empty
    texts, BOS and unicode in any order."""
    tok = {"smol": smol, "spm": spm, "byte": byte_tokenizer()}[name]
    batch = tok.encode_batch(BATCH_TEXTS, add_bos)
    assert all(ids.dtype == np.int32 for ids in batch)
    assert [ids.tolist() for ids in batch] == [tok.encode(t, add_bos) for t in BATCH_TEXTS]
    assert [ids.tolist() for ids in tok.encode_batch(BATCH_TEXTS[::-1], add_bos)] == [
        ids.tolist() for ids in batch[::-1]]
    if name == "smol" and not add_bos:
        assert [ids.tolist() for ids in batch[:4]] == [
            [19556, 905], [], [1, 4093, 198, 33, 34, 35, 36, 37, 2, 198], [216, 2701]]


def test_no_chat_template_is_a_clear_error(spm):
    assert spm.chat_template is None
    with pytest.raises(TokenizerError, match="tokenizer.chat_template: expected"):
        spm.apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------ byte tokenizer
def test_byte_tokenizer_ids(bt):
    assert (bt.vocab_size, bt.bos_id, bt.eos_id, bt.unk_id) == (259, 1, 2, 0)
    assert bt.is_byte_tokenizer and bt.add_bos and not bt.add_space_prefix
    assert bt.encode("Hi é") == [1, 75, 108, 35, 198, 172]
    assert bt.encode("Hi", add_bos=False) == [75, 108]
    text = "byte\x00\x7f\n ünï 🦙"
    want = [1] + [b + BYTE_OFFSET for b in text.encode("utf-8")]
    assert bt.encode(text) == want
    assert bt.decode(want) == text
    arr = bt.encode_np(text)
    assert arr.dtype == np.int32 and arr.tolist() == want
    assert encode_bytes_np(text).tolist() == want
    assert encode_bytes_np(text.encode("utf-8"), add_bos=False).tolist() == want[1:]


def test_byte_tokenizer_random_round_trip(bt):
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000),
                                       rng.randrange(0x1F300, 0x1F600)]))
                       for _ in range(rng.randrange(0, 64)))
        ids = bt.encode(text)
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert bt.decode(ids) == text
    assert bt.decode([1, 75, 2, 108]) == "Hi"
    assert bt.decode([1, 75, 2, 108], skip_special=False) == "<s>H</s>i"


def test_byte_tokenizer_fast_on_a_megabyte(bt, shared_file):
    text = shared_file("text/tinyshakespeare.txt").read_text(encoding="utf-8")
    t0 = time.perf_counter()
    ids = bt.encode(text)
    elapsed = time.perf_counter() - t0
    assert len(ids) == 1 + len(text.encode("utf-8")) == 1_115_395
    assert elapsed < 0.5
    assert bt.decode(ids) == text


def test_byte_tokenizer_metadata(bt):
    meta = bt.to_metadata()
    assert meta["tokenizer.ggml.model"] == "llama"
    toks, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert toks[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and toks[-1] == "<0xFF>"
    assert len(toks) == len(types) == len(meta["tokenizer.ggml.scores"]) == 259
    assert types[:3] == [2, 3, 3] and types[BYTE_OFFSET + 0x0A] == 6
    # llama.cpp turns spaces into "▁" before lookup, so the space byte is the "▁" token
    assert (toks[BYTE_OFFSET + 0x20], types[BYTE_OFFSET + 0x20]) == ("▁", 1)
    assert toks[BYTE_OFFSET + 0x0A] == "<0x0A>"  # llama.cpp's linefeed lookup
    assert all(type(t) is int for t in types)
    assert all(type(s) is float and s == 0.0 for s in meta["tokenizer.ggml.scores"])
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    again = Tokenizer.from_metadata(meta)
    assert again.is_byte_tokenizer and again.to_metadata() == meta
    for text in ["Hello, world!", "ünï 🦙\n", ""]:
        assert again.encode(text) == bt.encode(text)


def test_byte_tokenizer_through_a_gguf_file(bt, tmp_path):
    from toymlx.gguf.writer import write_gguf

    path = tmp_path / "bytes.gguf"
    write_gguf(path, {"general.architecture": "llama", **bt.to_metadata()}, {})
    again = Tokenizer.from_gguf(path)
    assert again.to_metadata() == bt.to_metadata()
    assert again.encode("round trip ✓") == bt.encode("round trip ✓")


# ------------------------------------------------------------------ metadata round trips
@pytest.mark.parametrize("fixture", ["gpt2", "spm", "smol", "stories"])
def test_to_metadata_round_trip(request, fixture):
    tok = request.getfixturevalue(fixture)
    meta = tok.to_metadata()
    assert all(k.startswith("tokenizer.") for k in meta)
    assert meta["tokenizer.ggml.tokens"] == [tok.token_text(i) for i in range(tok.vocab_size)]
    assert all(type(t) is int for t in meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        assert all(type(s) is float for s in meta["tokenizer.ggml.scores"])
    again = Tokenizer.from_metadata(meta)
    assert again.to_metadata() == meta
    text = "Round-trip: Hello, wörld! 12345\n  <s> <|im_end|>"
    assert again.encode(text) == tok.encode(text)


def test_smollm2_metadata_keys(smol):
    meta = smol.to_metadata()
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == smol.chat_template


def test_own_reader_agrees_with_gguf_py(stories_path):
    """toymlx's GGUF reader gives the tokenizer the same metadata as gguf-py's GGUFReader."""
    from gguf import GGUFReader

    from toymlx.gguf.reader import read_metadata

    reader = GGUFReader(str(stories_path), "r")
    slow = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    fast = read_metadata(stories_path)
    keys = [k for k in fast if k.startswith("tokenizer.")]
    assert keys and {k: slow[k] for k in keys} == {k: fast[k] for k in keys}


# ------------------------------------------------------------------ errors
def _spm_meta(**changes):
    meta = byte_tokenizer().to_metadata()
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("changes,pattern", [
    ({"tokenizer.ggml.tokens": None},
     r"^x\.gguf: tokenizer\.ggml\.tokens: expected a non-empty list .*found missing key$"),
    ({"tokenizer.ggml.scores": None},
     r"^x\.gguf: tokenizer\.ggml\.scores: expected a list of 259 floats, found missing key$"),
    ({"tokenizer.ggml.scores": [0.0] * 10},
     r"^x\.gguf: tokenizer\.ggml\.scores: expected 259 entries \(one per token\), found 10$"),
    ({"tokenizer.ggml.token_type": [1] * 300},
     r"^x\.gguf: tokenizer\.ggml\.token_type: expected 259 entries .*found 300$"),
    ({"tokenizer.ggml.model": "bert"},
     (r"^x\.gguf: tokenizer\.ggml\.model: expected one of \['gpt2', 'llama', 'gemma4'\], "
      r"found 'bert'$")),
    ({"tokenizer.ggml.model": None},
     r"^x\.gguf: tokenizer\.ggml\.model: expected one of .*found missing key$"),
    ({"tokenizer.ggml.bos_token_id": 999},
     r"^x\.gguf: tokenizer\.ggml\.bos_token_id: expected a token id below 259, found 999$"),
    ({"tokenizer.ggml.tokens": ["a", "a"] + [f"b{i}" for i in range(257)]},
     r"^x\.gguf: tokenizer\.ggml\.tokens: expected unique token strings, found 'a' at ids 0 "),
    ({"tokenizer.ggml.add_bos_token": "yes"},
     r"^x\.gguf: tokenizer\.ggml\.add_bos_token: expected a bool, found 'yes'$"),
])
def test_bad_metadata_errors(changes, pattern):
    with pytest.raises(TokenizerError, match=pattern) as info:
        Tokenizer.from_metadata(_spm_meta(**changes), source="x.gguf")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_gpt2_errors(smol):
    meta = smol.to_metadata()
    no_merges = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(TokenizerError, match=r"^f\.gguf: tokenizer\.ggml\.merges: expected "
                                             r"a list of 'left right' merge strings, found "
                                             r"missing key$"):
        Tokenizer.from_metadata(no_merges, source="f.gguf")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.pre: expected one of \['default"
                                             r"', 'gpt-2', .*'smollm'.*found 'qwen9'$"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen9"}, source="f.gguf")
    # no pre key: llama.cpp falls back to its "default" regexes
    default = Tokenizer.from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"})
    assert default.pre == "default"
    # ids from llama.cpp on this vocabulary without its pre key
    assert default.encode("Hello world!!") == [19556, 905, 10095]
    assert default.encode("Pay $12345, ok?!") == [25017, 216, 20, 33, 34, 35, 36, 37, 28, 10907,
                                                   17593]


def test_from_gguf_names_the_file(tmp_path):
    from toymlx.gguf.writer import write_gguf

    path = tmp_path / "nomodel.gguf"
    meta = byte_tokenizer().to_metadata()
    del meta["tokenizer.ggml.model"]
    write_gguf(path, {"general.architecture": "llama", **meta}, {})
    with pytest.raises(TokenizerError, match=rf"^{path}: tokenizer\.ggml\.model: expected"):
        Tokenizer.from_gguf(path)


# ------------------------------------------------------------------ llama.cpp's vocab test files
# models/ggml-vocab-<name>.gguf of llama.cpp's source tree (the llama-cpp-python sdist), with the
# ids llama.cpp's test-tokenizer-0 expects: name -> number of vectors
UPSTREAM = {"qwen2": 46, "llama-bpe": 46, "phi-3": 46, "gemma-4": 46, "qwen35": 50,
            "deepseek-coder": 46, "deepseek-llm": 46}


@pytest.fixture(scope="module")
def models_dir(llamacpp_source: Path) -> Path:  # noqa: F811  (the imported fixture)
    return llamacpp_source / "models"


@pytest.fixture(scope="module")
def upstream(models_dir):
    """name -> Tokenizer of llama.cpp's ggml-vocab-<name>.gguf, each built once on first use."""
    built: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in built:
            built[name] = Tokenizer.from_gguf(upstream_path(models_dir, name))
        return built[name]

    return get


def upstream_path(models: Path, name: str) -> Path:
    return models / f"ggml-vocab-{name}.gguf"


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_vectors_all_match(upstream, models_dir, name):
    tok = upstream(name)
    cases = read_vectors(upstream_path(models_dir, name))
    assert len(cases) == UPSTREAM[name]
    failed = [(text, want, got) for text, want in cases
              if (got := tok.encode(text, add_bos=False, parse_special=False)) != want]
    assert failed == [], f"{len(failed)} of {len(cases)} cases differ: {failed[:3]}"
    assert [t for t, w in cases if tok.decode(w) != t] == []


# model, pre, add_bos, bos, eos, eog ids: as llama.cpp's llama_vocab_* functions give them
UPSTREAM_FLAGS = {
    "qwen2": ("gpt2", "qwen2", False, 151643, 151643, {128247, 151643, 151645}),
    "qwen35": ("gpt2", "qwen35", False, 151643, 151643, {128247, 151643, 151645}),
    "llama-bpe": ("gpt2", "llama-bpe", True, 128000, 128001, {128001, 128009}),
    "phi-3": ("llama", None, True, 1, 32000, {2, 32000, 32007}),
    "gemma-4": ("gemma4", "gemma4", True, 2, 1, {1, 50, 106}),
    "deepseek-coder": ("gpt2", "deepseek-coder", True, 32013, 32014, {32014}),
    "deepseek-llm": ("gpt2", "deepseek-llm", True, 100000, 100001, {100001}),
}


@pytest.mark.parametrize("name", list(UPSTREAM_FLAGS))
def test_upstream_flags(upstream, name):
    tok = upstream(name)
    model, pre, add_bos, bos, eos, eog = UPSTREAM_FLAGS[name]
    assert (tok.model, tok.pre, tok.add_bos, tok.bos_id, tok.eos_id) == (model, pre, add_bos,
                                                                         bos, eos)
    assert tok.eog_ids == frozenset(eog)
    assert tok.add_space_prefix == (model == "llama")  # SPM's default; never for BPE


# text -> (ids with parse_special=False, ids with parse_special=True), from llama.cpp
UPSTREAM_IDS = {
    "qwen2": {"12345": ([16, 17, 18, 19, 20],) * 2,  # one digit per piece
              "<|im_start|>user\nhi<|im_end|>\n": (
                  [27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 397],
                  [151644, 872, 198, 6023, 151645, 198]),
              # "</s>" is a normal Qwen token llama.cpp makes an end-of-generation control token
              "</s> x": ([522, 82, 29, 856], [128247, 856])},
    "qwen35": {"résumé": ([42611, 1242, 963],) * 2},
    "llama-bpe": {"12345": ([4513, 1774],) * 2,  # up to three digits per piece
                  "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>": (
                      [27, 91, 2527, 8932, 851, 91, 29, 882, 27, 91, 408, 8932, 851, 91, 1363,
                       6151, 27, 91, 68, 354, 851, 91, 29],
                      [128006, 882, 128007, 271, 6151, 128009])},
    # llama.cpp strips the whitespace after Phi-3's special tokens, except <s>, <unk> and
    # <|endoftext|> ("phi3" in general.name)
    "phi-3": {"<|user|>\nHi<|end|>\n<|assistant|>\n": (
                  [529, 29989, 1792, 29989, 29958, 13, 18567, 29966, 29989, 355, 29989, 29958, 13,
                   29966, 29989, 465, 22137, 29989, 29958, 13],
                  [32010, 6324, 32007, 32001]),
              "a</s>  b": ([263, 829, 29879, 29958, 29871, 289], [263, 2, 289]),
              "a<|endoftext|>  b": ([263, 29966, 29989, 355, 974, 726, 29989, 29958, 29871, 289],
                                    [263, 32000, 259, 289])},
    # a run of newlines that is a token stays one token; characters out of the vocabulary
    # fall back to <0xXX>; "</s>" is a normal Gemma 4 token
    "gemma-4": {"a\n\n\nb": ([236746, 109, 236763],) * 2,
                "<|turn>user\nHi<turn|>\n": (
                    [236820, 236909, 887, 236813, 2364, 107, 10979, 236820, 887, 111038, 107],
                    [105, 2364, 107, 10979, 106, 107]),
                "</s> x": ([954, 236751, 236813, 1123],) * 2,
                "  two  spaces": ([138, 13498, 138, 35220],) * 2,
                "🦙€": ([478, 397, 404, 391, 237762],) * 2},
}


@pytest.mark.parametrize("name", list(UPSTREAM_IDS))
def test_upstream_known_ids(upstream, name):
    tok = upstream(name)
    for text, (plain, special) in UPSTREAM_IDS[name].items():
        assert tok.encode(text, add_bos=False, parse_special=False) == plain, text
        assert tok.encode(text, add_bos=False, parse_special=True) == special, text
        assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_phi3_right_strip_needs_the_model_name(upstream):
    """llama.cpp decides Phi-3's right-stripping by general.name, which `to_metadata` (the
    tokenizer.* keys) does not carry; a GGUF written with the name keeps it."""
    meta = upstream("phi-3").to_metadata()
    assert "general.name" not in meta
    text = "<|user|>\nHi"
    # both as llama.cpp gives them for the file written without and with general.name
    assert Tokenizer.from_metadata(meta).encode(text) == [1, 32010, 29871, 13, 18567]
    assert Tokenizer.from_metadata({**meta, "general.name": "Phi3"}).encode(text) == [1, 32010,
                                                                                      6324]


def test_gemma4_always_adds_bos(upstream):
    meta = {**upstream("gemma-4").to_metadata(), "tokenizer.ggml.add_bos_token": False}
    tok = Tokenizer.from_metadata(meta)
    assert tok.add_bos and tok.encode("Hi") == [2, 10979]  # llama.cpp overrides the file


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
# renderings checked against transformers' render_jinja_template
RENDERED = {
    "qwen2": ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
              "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
              "<|im_start|>assistant\n"),
    "phi-3": ("<s><|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\n2+2?<|end|>\n"
              "<|assistant|>\n"),
    "gemma-4": ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n"
                "<|turn>model\nHello!<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n"
                "<|channel>thought\n<channel|>"),
}
RENDERED["qwen35"] = RENDERED["qwen2"]


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_chat_templates(upstream, name):
    tok = upstream(name)
    if name not in RENDERED:
        assert tok.chat_template is None
        return
    text = tok.apply_chat_template(MESSAGES)
    assert text == RENDERED[name]
    ids = tok.encode(text, add_bos=False)
    # <|im_start|> / <|end|> / <|turn>: one per turn (Phi-3's template drops the system one)
    turn, count = {"qwen2": (151644, 5), "qwen35": (151644, 5), "phi-3": (32007, 3),
                   "gemma-4": (105, 5)}[name]
    assert ids.count(turn) == count
    if name != "phi-3":  # Phi-3's specials swallow the newline after them
        assert tok.decode(ids, skip_special=False) == text


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_to_metadata_round_trip(upstream, name):
    tok = upstream(name)
    meta = tok.to_metadata()
    assert all(k.startswith("tokenizer.") for k in meta)
    again = Tokenizer.from_metadata(meta)
    assert again.to_metadata() == meta
    text = "Round-trip: Hello, wörld! 12345\n\n\n  <s> <|im_end|> <turn|>x 🦙"
    for special in (False, True):
        assert again.encode(text, parse_special=special) == tok.encode(text,
                                                                       parse_special=special)
    assert (again.eog_ids, again.add_bos, again.bos_id) == (tok.eog_ids, tok.add_bos, tok.bos_id)


def test_upstream_build_time(models_dir):
    """A 152k-token, 151k-merge vocabulary (Qwen2.5) builds in about half a second; the bound
    leaves room for a busy machine."""
    meta = read_metadata(upstream_path(models_dir, "qwen2"))
    t0 = time.process_time()
    Tokenizer.from_metadata(meta)
    assert time.process_time() - t0 < 5.0


def test_unknown_pre_is_refused(upstream):
    meta = upstream("qwen2").to_metadata()
    with pytest.raises(TokenizerError, match=r"^q\.gguf: tokenizer\.ggml\.pre: expected one of "
                                             r"\['default', .*'qwen2', .*'qwen35', .*'gemma4'\], "
                                             r"found 'qwen9'$"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen9"}, source="q.gguf")


# ------------------------------------------------------------------ pre names of other files
# pre name -> the upstream vocabulary it is tried on, one whose regexes llama.cpp gives it too:
# OLMo 2's files say "dbrx", SmolLM3's "smaug-bpe", Granite 3.x's "refact" (Gemma 2's are
# SentencePiece); the rest share a case of llama.cpp's regex switch with a name toymlx had.
# Then the names of `NEW_PRE`, whose regexes no other name has: their own vocabulary where
# llama.cpp ships one (DeepSeek's), else Llama 3's, a 128k byte-level BPE like theirs.
RENAMED = {"dbrx": "llama-bpe", "smaug-bpe": "llama-bpe", "jina-v5-nano": "llama-bpe",
           "refact": "refact", "kormo": "qwen2", "f2llmv2": "qwen2", "solar-open": "qwen2",
           "a.x-4.0": "gpt-2", "jais": "gpt-2", "trillion": "gpt-2", "granite-docling": "gpt-2",
           "grok-2": "qwen2", "gpt-4o": "llama-bpe", "tekken": "llama-bpe",
           "seed-coder": "llama-bpe", "superbpe": "llama-bpe", "deepseek-coder": "deepseek-coder",
           "deepseek-llm": "deepseek-llm", "viking": "llama-bpe"}
# ids llama.cpp gives (add_bos as the file leaves it: Llama 3's has no add_bos_token key) with
# Llama 3's vocabulary under each name: " việc" and " Việt" are tokens, which llama-bpe
# (ignore_merges) takes whole and dbrx and smaug-bpe reach by no merge; only llama-bpe adds bos
RENAMED_IDS = {
    "llama-bpe": {" việc": [128000, 100769], " Việt Nam": [128000, 101798, 31074],
                  "12345 don't": [128000, 4513, 1774, 1541, 956]},
    "dbrx": {" việc": [3355, 26298, 66], " Việt Nam": [11655, 26298, 83, 31074],
             "12345 don't": [4513, 1774, 1541, 956]}}
RENAMED_IDS["smaug-bpe"] = RENAMED_IDS["dbrx"]


# Files of architectures toymlx loads: Phi-4 and Phi-4-mini say "gpt-4o", Mistral-Nemo and
# Ministral-8B "tekken", Seed-Coder-8B "seed-coder", OLMo 2 SuperBPE "superbpe", DeepSeek-Coder
# 1.3B/6.7B "deepseek-coder", DeepSeek-LLM 7B "deepseek-llm", Viking 7B "viking". Text -> ids (add_bos False) as
# llama.cpp gives them with each name's `RENAMED` vocabulary, each showing what the name does
# that Llama 3's regex does not; and (add_bos as the file leaves it, ignore_merges)
NEW_PRE = {
    # a letter run splits where lower case turns upper; three digits a piece; "/" after newlines
    "gpt-4o": ({"JavaScript YouTube iPhone": [15391, 6035, 1472, 12115, 602, 7084],
                "12345 don't": [4513, 1774, 1541, 956], "a./\n/b": [64, 1761, 198, 14, 65]},
               (False, False)),
    # as gpt-4o, but one digit a piece; a piece that is a token is that token (" việc")
    "tekken": ({"JavaScript YouTube": [15391, 6035, 1472, 12115], "12345": [16, 17, 18, 19, 20],
                " việc": [100769]}, (True, True)),
    # as Qwen2, but punctuation takes no newlines after it
    "seed-coder": ({"x.\n\ny": [87, 13, 271, 88], "12345": [16, 17, 18, 19, 20]},
                   (False, False)),
    # pieces run across spaces; digit runs cut in threes from the right
    "superbpe": ({"12345 1234567": [717, 12901, 220, 16, 11727, 19282],
                  "  two   spaces": [256, 20375, 262, 45385]}, (False, False)),
    # each newline alone, apostrophes apart, digits one a piece
    "deepseek-coder": ({"x.\n\ny": [87, 13, 185, 185, 88],
                        "DON'T don't": [35, 1236, 6, 51, 1115, 6, 83], "12345": [16, 17, 18, 19, 20]},
                       (True, False)),
    # U+3000 is a piece of its own; Arabic is none of its letters' scripts: the words and the
    # space between them are one piece (merged as far as the vocabulary goes)
    "deepseek-llm": ({"中文\u3000中文。\u3000。": [43757, 88946, 43757, 398, 88946, 398],
                      "مرحبا بالعالم 1": [24048, 21437, 78930, 41737, 12241, 49838, 61072, 64040,
                                          61072, 24048, 207, 16]}, (True, False)),
    # words take the space before them, what is between them is one piece, digits one a piece
    "viking": ({"Hello, world. a  b": [9906, 11, 1917, 13, 264, 220, 293],
                "hyvää päivää!\n\nNo niin… 123": [8671, 85, 43543, 93464, 344, 43543, 2268, 2822,
                                                 13080, 258, 1981, 220, 16, 17, 18]},
               (False, False)),
}


@pytest.mark.parametrize("name", list(NEW_PRE))
def test_pre_names_of_other_regexes_known_ids(models_dir, name):
    tok = Tokenizer.from_metadata(renamed_meta(models_dir, name))
    cases, (add_bos, ignore_merges) = NEW_PRE[name]
    assert (tok.pre, tok.add_bos, PRE_TOKENIZERS[name].ignore_merges) == (name, add_bos,
                                                                         ignore_merges)
    for text, want in cases.items():
        assert tok.encode(text, add_bos=False) == want, text
        assert tok.decode(want) == text


def renamed_meta(models: Path, name: str) -> dict:
    """The tokenizer.* metadata of upstream vocabulary `RENAMED[name]`, its pre set to `name`."""
    meta = {k: v for k, v in read_metadata(upstream_path(models, RENAMED[name])).items()
            if k.startswith("tokenizer.")}
    return {**meta, "tokenizer.ggml.pre": name}


@pytest.mark.parametrize("name", list(RENAMED_IDS))
def test_pre_names_of_other_files_known_ids(models_dir, name):
    tok = Tokenizer.from_metadata(renamed_meta(models_dir, name) if name in RENAMED else
                                  read_metadata(upstream_path(models_dir, name)))
    assert (tok.pre, tok.add_bos) == (name, name == "llama-bpe")
    for text, want in RENAMED_IDS[name].items():
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text


def cut_spm_meta(path: Path, n: int) -> dict:
    """The tokenizer.* metadata of the SentencePiece vocabulary at `path` cut to its first `n`
    tokens, as `tests/hf_tiny.py` cuts one: llama-spm's first 512 hold the byte tokens and
    merged pieces ("er", "▁t") but none of the characters alone ("e", "▁")."""
    meta = {k: v for k, v in read_metadata(path).items() if k.startswith("tokenizer.")}
    cut = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    return {k: v[:n] if k in cut else v for k, v in meta.items()}


# ids llama.cpp gives with llama-spm's first 512 tokens: a character that is no token ("H",
# "▁", "e") still merges into the tokens that hold it ("▁H" 379), left alone it is its bytes
CUT_SPM_IDS = {"Hello world": [1, 379, 295, 417, 281, 272, 430],
               " Hello world": [1, 229, 153, 132, 379, 295, 417, 281, 272, 430],
               "a\n\nb": [1, 263, 13, 13, 101]}


def test_cut_sentencepiece_vocabulary_known_ids(shared_file):
    tok = Tokenizer.from_metadata(cut_spm_meta(shared_file("tokenizers/ggml-vocab-llama-spm.gguf"),
                                               512))
    assert tok.vocab_size == 512
    for text, want in CUT_SPM_IDS.items():
        assert tok.encode(text) == want, text
    assert tok.decode(CUT_SPM_IDS["Hello world"]) == "Hello world"


# ------------------------------------------------------------------ llama.cpp itself (interop)
@pytest.mark.interop
def test_against_llama_cpp(shared_file, models_dir, tmp_path):
    """Random text tokenized by llama.cpp (llama-cpp-python, vocab_only) and by us; where
    llama.cpp's detokenizer gives the text back, ours does too."""
    llama_cpp = pytest.importorskip("llama_cpp")
    bytes_path = vocab_gguf(tmp_path / "bytes.gguf", byte_tokenizer().to_metadata())
    paths = [shared_file("tokenizers/ggml-vocab-gpt-2.gguf"),
             shared_file("tokenizers/ggml-vocab-llama-spm.gguf"),
             shared_file("tokenizers/ggml-vocab-smollm2.gguf"),
             shared_file("models/stories260K.gguf"), bytes_path]
    paths += [upstream_path(models_dir, name) for name in UPSTREAM]
    alphabet = (list("abcdefXYZ0123456789 \t\n.,!?'\"-()<>/|$+=^~") + list("éßЖ中日🦙€“’\u00a0▁")
                + ["'s", "'ll", "'RE", "  ", "\n\n", "\n\n\n", "\r\n", "<s>", "</s>", "<unk>",
                   "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|user|>", "<|end|>",
                   "<|eot_id|>", "<|turn>", "<turn|>", "<|tool_response>", " the", "ing", "é",
                   "\u0301", "ें", "1234"])
    rng = random.Random(1)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for path in paths:
        ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(ref.model)
        tok = Tokenizer.from_gguf(path)
        extra = [tok.apply_chat_template(MESSAGES)] if tok.chat_template else []
        for text in texts + extra:
            for special in (False, True):
                want = ref.tokenize(text.encode("utf-8"), add_bos=True, special=special)
                assert tok.encode(text, parse_special=special) == want, (path.name, text)
            ids = ref.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            if _llama_detokenize(llama_cpp, vocab, ids) == text:
                assert tok.decode(ids) == text, (path.name, text)


def vocab_gguf(path: Path, tokenizer_meta: dict) -> Path:
    """A GGUF of `tokenizer_meta` and a llama header, no tensors: enough for llama.cpp's
    vocab_only load."""
    from toymlx.gguf.writer import write_gguf

    return write_gguf(path, {"general.architecture": "llama", "llama.context_length": 64,
                             "llama.embedding_length": 64, "llama.block_count": 1,
                             "llama.feed_forward_length": 64, "llama.attention.head_count": 8,
                             "llama.attention.layer_norm_rms_epsilon": 1e-5,
                             **tokenizer_meta}, {})


# digit runs, contractions in both cases, runs of newlines and spaces, carriage returns, marks,
# scripts without spaces, emoji, and special-token texts
HARD_TEXTS = ["1", "12", "123", "1234", "1234567890", "3.14159", "1,000,000", "x2024y", "٣٤٥",
              "don't", "DON'T", "I'm", "we'LL", "they're", "you've", "'s", "it''s", "' s",
              "\n", "\n\n", "\n\n\n", "a\n\nb", " \n", "\r\n", "a\r\n\r\nb", "\t\tx",
              "  ", "   a", "a   ", "a  \n  b", "\u00a0x", "\u3000y", "e\u0301", "résumé",
              "Ünïcödé", "中文的句子没有空格", "日本語のテキスト", "Привет, мир!", "مرحبا بالعالم",
              "🦙🦙 llamas", "👨‍👩‍👧", "<|begin_of_text|>hi<|eot_id|>",
              "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> x", "<fim_prefix>a<fim_suffix>",
              "```python\nprint('x')\n```", "$+<=>^~|", "a.b,c;d:e!f?g"]


def inp_texts(models: Path) -> list[str]:
    """Every test string of llama.cpp's models/ggml-vocab-*.gguf.inp files, split as
    test-tokenizer-0 splits them."""
    return [text for inp in sorted(models.glob("ggml-vocab-*.gguf.inp"))
            for text in inp.read_bytes().decode("utf-8").split(SEP)]


def assert_ids_of_llama_cpp(path: Path, texts: list[str]) -> tuple[int, int]:
    """toymlx's ids of every text are llama.cpp's (llama-cpp-python, vocab_only) for the GGUF
    at `path`, with and without bos and the parsing of special tokens; and where llama.cpp's
    detokenizer gives a text back from its ids, toymlx's decode does too. Returns the number
    of ids compared and of texts llama.cpp gives back."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    tok = Tokenizer.from_gguf(path)
    compared = given_back = 0
    try:
        for text in texts:
            data = text.encode("utf-8")
            for special in (False, True):
                for add_special in (True, False):  # llama.cpp's: bos where the file adds it
                    want = ref.tokenize(data, add_bos=add_special, special=special)
                    got = tok.encode(text, add_bos=None if add_special else False,
                                     parse_special=special)
                    assert got == want, (text, add_special, special)
                    compared += len(want)
            ids = ref.tokenize(data, add_bos=False, special=False)
            if _llama_detokenize(llama_cpp, vocab, ids) == text:
                assert tok.decode(ids) == text, text
                given_back += 1
    finally:  # freed now: a model left to the interpreter's exit leaks llama-cpp's /dev/null
        ref.close()
    return compared, given_back


# Gemma 4's own: its visible (user-defined) tokens, which llama.cpp cuts out however specials
# are parsed, beside its control ones; runs of newlines longer than any newline token, and
# split by other text; "▁" written in the text; characters no token holds (<0xXX> bytes)
GEMMA4_TEXTS = ["\n" * 40, "\n" * 7 + "x" + "\n" * 33, "\r\n\r\n", "a\tb\t\tc", "    four",
                "\t\n \n", "▁x ▁ y", "\u2581\u2581", "\ue000\U000f0000", "\U00031350", "\x00a",
                "<|channel>thought\n<channel|>Hi", "<|tool_call>call:f{x:<|\"|>a<|\"|>}<tool_call|>",
                "<|turn>model\n", "<bos><eos><pad>", "<|tool_response>", "<turn|>", "<|think|>",
                "<|image|><|audio|>", "x" * 300, "ab " * 50]


@pytest.mark.interop
@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_vocabularies_against_llama_cpp(models_dir, name):
    """Each of llama.cpp's vocabulary files with every test string of its .inp files, the hard
    texts and Gemma 4's: the ids (with and without bos, specials parsed or not) and the decoded
    text are llama.cpp's. gemma-4: 777 texts, 3,108 encodings, 26,456 ids, 745 texts given back."""
    texts = inp_texts(models_dir) + HARD_TEXTS + GEMMA4_TEXTS
    compared, given_back = assert_ids_of_llama_cpp(upstream_path(models_dir, name), texts)
    assert compared > 4 * len(texts) and given_back > len(texts) * 0.9, (compared, given_back)


@pytest.mark.interop
@pytest.mark.parametrize("name", list(RENAMED))
def test_pre_names_of_other_files_against_llama_cpp(models_dir, tmp_path, name):
    """A vocabulary under each pre name of `RENAMED`, written to a file and loaded by llama.cpp:
    the ids of llama.cpp's own test strings and of hard ones are llama.cpp's."""
    path = vocab_gguf(tmp_path / f"{name}.gguf", renamed_meta(models_dir, name))
    texts = inp_texts(models_dir) + HARD_TEXTS
    assert Tokenizer.from_gguf(path).pre == name and len(texts) > 600
    assert_ids_of_llama_cpp(path, texts)


@pytest.mark.interop
@pytest.mark.parametrize("prefix", [True, False])
def test_cut_sentencepiece_vocabulary_against_llama_cpp(shared_file, models_dir, tmp_path,
                                                        prefix):
    """llama-spm's first 512 tokens (`cut_spm_meta`), with add_space_prefix as Llama's files
    have it and without as Gemma's: llama.cpp's ids on its test strings and hard ones."""
    meta = cut_spm_meta(shared_file("tokenizers/ggml-vocab-llama-spm.gguf"), 512)
    path = vocab_gguf(tmp_path / "cut.gguf", {**meta, "tokenizer.ggml.add_space_prefix": prefix})
    assert_ids_of_llama_cpp(path, inp_texts(models_dir) + HARD_TEXTS)


def _llama_detokenize(llama_cpp, vocab, ids: list[int], remove_special: bool = True,
                      unparse_special: bool = False) -> str:
    """llama.cpp's own llama_detokenize (by default: bos removed, specials not rendered)."""
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 16 * len(ids) + 16
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special,
                                       unparse_special)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = -n
    raise AssertionError(f"llama_detokenize wanted {size} bytes twice")


@pytest.mark.interop
@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_specials_against_llama_cpp(upstream, models_dir, name):
    """End-of-generation ids and every special token's text (each way of parsing) as llama.cpp
    has them after its load-time fixes (control tokens by text, Phi-3's right-strip); the ids
    toymlx-generate stops before are llama.cpp's end-of-generation set (Gemma 4's: <eos>,
    <|tool_response>, <turn|>; its "</s>" a normal token)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(upstream_path(models_dir, name)), vocab_only=True,
                          verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    tok = upstream(name)
    n = tok.vocab_size
    assert llama_cpp.llama_vocab_n_tokens(vocab) == n
    eog = {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eog_ids == eog == stop_ids(tok) == UPSTREAM_FLAGS[name][5]
    special = 1 | 8 | 16  # llama_token_attr: unknown, control, user-defined
    ids = [i for i in range(n)
           if llama_cpp.llama_vocab_get_attr(vocab, i) & special or tok.token_type(i) != 1]
    assert ids
    for i in ids:
        text = f"x{tok.token_text(i)} \n y"
        for parse in (False, True):
            want = ref.tokenize(text.encode("utf-8"), add_bos=False, special=parse)
            assert tok.encode(text, add_bos=False, parse_special=parse) == want, (i, parse)


@pytest.mark.interop
def test_gemma4_decode_against_llama_cpp(upstream, models_dir):
    """Gemma 4's ids of a rendered chat with its control tokens (<bos>, <|turn>, <turn|>, <eos>),
    visible ones (<|channel>, <|tool_call>, <|"|>; <|tool_response>, which llama.cpp makes a
    control token as it ends generation), byte tokens and newline runs: decoded with the
    specials as llama_detokenize renders them, and without (skip_special: bos removed, control
    tokens dropped, visible ones kept); token by token as generation streams them."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(upstream_path(models_dir, "gemma-4")), vocab_only=True,
                          verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    tok = upstream("gemma-4")
    text = ("<bos><|turn>system\nBe  brief. <turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
            '<|tool_call>call:f{x:<|"|>a<|"|>}<tool_call|><|tool_response>é 🦙\ue000 \n\n\n x<eos>')
    try:
        ids = ref.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.encode(text, add_bos=False) == ids and {48, 50, 52, 100, 105} < set(ids)
        assert tok.decode(ids, skip_special=False) == _llama_detokenize(
            llama_cpp, vocab, ids, remove_special=False, unparse_special=True) == text
        shown = _llama_detokenize(llama_cpp, vocab, ids)
        assert tok.decode(ids) == shown and shown.startswith("system\nBe  brief. \nmodel\n<|chan")
        assert [tok.piece_bytes(i) for i in ids] == [ref.detokenize([i], special=True)
                                                     for i in ids]
    finally:
        ref.close()


# ------------------------------------------------------------------ where encode_stream cuts
# text without an ASCII letter before a space and a letter (byte-level BPE's only cut before)
NOT_ENGLISH = {
    "zh": "中文的句子没有空格。第二句也没有空格，只有标点和汉字\n第三段的文字在这里",
    "ru": "Привет мир, это проверка без латинских букв и цифр",
    "json": '{"a":[1,2,{"b":"c"}],"d":true,"e":null,"f":[3,4]}',
    "csv": "12,345,6789\n1,22,333\n4444,55555,666666\n77,8\n",
    "ar": "كَتَبَ الوَلَدُ الدَّرْسَ فِي البَيْتِ ثُمَّ ذَهَبَ",
}
# the last cut `_safe_cut` finds in each (0: none; Llama 3's longest special token text is 30
# characters, and a cut leaves that many after it)
NOT_ENGLISH_CUTS = {
    "gpt2": {"zh": 19, "ru": 28, "json": 34, "csv": 26, "ar": 37},  # after "，", before " л"
    "smol": {"zh": 19, "ru": 28, "json": 32, "csv": 27, "ar": 34},  # csv: between two digits
    "llama-bpe": {"zh": 0, "ru": 15, "json": 17, "csv": 13, "ar": 19},
    "qwen2": {"zh": 18, "ru": 28, "json": 32, "csv": 30, "ar": 37},  # zh: before "，"
    "qwen35": {"zh": 18, "ru": 28, "json": 32, "csv": 30, "ar": 29},  # ar: marks join letters
    # Llama 3's vocabulary: as llama-bpe's cuts, but superbpe's only beside digits
    "gpt-4o": {"zh": 0, "ru": 15, "json": 17, "csv": 13, "ar": 19},
    "tekken": {"zh": 0, "ru": 15, "json": 17, "csv": 13, "ar": 19},
    "seed-coder": {"zh": 0, "ru": 15, "json": 17, "csv": 13, "ar": 19},
    "superbpe": {"zh": 0, "ru": 0, "json": 9, "csv": 13, "ar": 0},
    "deepseek-coder": {"zh": 10, "ru": 28, "json": 25, "csv": 22, "ar": 29},  # zh: after "。"
    "deepseek-llm": {"zh": 0, "ru": 0, "json": 9, "csv": 21, "ar": 0},  # newlines, digits only
    "viking": {"zh": 0, "ru": 15, "json": 9, "csv": 13, "ar": 15},
}


def _vocab(request, name: str) -> Tokenizer:
    if name == "gpt2-default":  # GPT-2's vocabulary cut by the "default" pre's four regexes
        meta = request.getfixturevalue("gpt2").to_metadata()
        return Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "default"})
    if name in UPSTREAM:
        return request.getfixturevalue("upstream")(name)
    if name in NEW_PRE:  # Llama 3's vocabulary under the name
        return Tokenizer.from_metadata(renamed_meta(request.getfixturevalue("models_dir"), name))
    return request.getfixturevalue(name)


def _parts(tok: Tokenizer, text: str, cut: int) -> list[int]:
    return np.concatenate([tok._encode_part(text[:cut], False),
                           tok._encode_part(text[cut:], True)]).tolist()


@pytest.mark.parametrize("name", list(NOT_ENGLISH_CUTS))
def test_byte_level_bpe_cuts_text_that_is_not_english(request, name):
    """Chinese, Russian, minified JSON, numbers, Arabic: byte-level BPE finds a cut where its
    pre-tokenizer's regexes cut (there was none before: the text waited for the next piece
    without end), and the two parts encode to the ids of the whole."""
    tok = _vocab(request, name)
    for kind, text in NOT_ENGLISH.items():
        cut = tok._safe_cut(text)
        assert (kind, cut) == (kind, NOT_ENGLISH_CUTS[name][kind])
        if cut:
            assert _parts(tok, text, cut) == tok.encode(text, add_bos=False), kind


def test_cut_classes_are_the_regex_engines():
    """Characters are classed by the engine the pre-tokenizers run in, not by Python: U+001C is
    whitespace to str.isspace and not to \\s; a combining mark is no letter; U+0085 is \\s."""
    assert _classes("a\x1c\x85\u00a0\n\r'$\u0301\u0663\u00bd\u20ac\u3002 ") == "LOWWRRAPMNNOPW"


def test_every_byte_level_pre_tokenizer_has_cut_rules():
    assert set(_CUTS) == {r.regexes for r in PRE_TOKENIZERS.values() if not r.spm_style}


# mixed scripts, digits of other scripts, every kind of whitespace (some \s only to Python or
# only to the regex engine), contractions, punctuation, "▁", emoji, special-token texts
FUZZ_ATOMS = (
    list("abcXYZ") + ["'s", "'S", "'ll", "'re", "'", "'d", "'T"] + list("0123456789")
    + ["\u0663", "\uff13", "\u00b2", "\u216b", "\u00bd"] + list("жЖяЁ中文日本語ひカ")
    + ["\u0628\u064e", "\u064e", "e\u0301", "\u0301"]
    + [" ", " ", " ", "  ", "\t", "\n", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u2028",
       "\x0b", "\x0c", "\x1c", "\x85", "\x00"]
    + list("!.,;:$+<=>^~|-_()[]{}\"/\\@#%&*")
    + ["\u2014", "\u3002", "\uff0c", "\u3001", "\u00ab", "\u2026", "\u20ac", "\u2581",
       "\u2581\u2581", "\U0001f44b", "\U0001f1eb\U0001f1f7", "\U00031350", "\u1c89", "\ua7cb"]
    + ["<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", " <s> ",
       "\n<|im_end|>\n", "<|turn>", "<turn|>", "<|user|>", "<|end|>", "<|begin_of_text|>"])
FUZZ_VOCABS = ["bt", "gpt2", "spm", "smol", "stories", "gpt2-default", "llama-bpe", "qwen2",
               "qwen35", "gemma-4", "phi-3", *NEW_PRE]


@pytest.mark.parametrize("name", FUZZ_VOCABS)
def test_every_safe_cut_keeps_the_ids_of_the_whole(request, name):
    """A seeded fuzz of 300 texts of the atoms above: `encode_stream` of the text in random
    pieces gives `encode`'s ids, and every cut `_safe_cut` finds splits the text into two
    parts that encode to them; for byte-level BPE the pre-tokenizer's pieces of the two parts
    are those of the whole too (ids alone can agree by chance where no merge joins)."""
    tok = _vocab(request, name)
    rng = random.Random(name)
    margin, checked = tok._special_len + 1, 0
    for _ in range(300):
        pool = FUZZ_ATOMS if rng.random() < 0.5 else rng.sample(FUZZ_ATOMS, rng.randint(2, 8))
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 120)))
        whole = tok.encode(text, add_bos=False)
        cuts, end = [], len(text)
        while cut := tok._safe_cut(text[:end]):  # every cut, each search ending before the last
            cuts.append(cut)
            end = cut + margin - 1
        for c in rng.sample(cuts, min(len(cuts), 8)):
            assert _parts(tok, text, c) == whole, (text[:c], text[c:])
        if tok._cuts is not None:
            raw = [f for f in split_special(text, tok._partition, True) if isinstance(f, str)]
            pieces = [p for f in raw for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(f)]
            for c in cuts:
                raw = [f for part in (text[:c], text[c:])
                       for f in split_special(part, tok._partition, True) if isinstance(f, str)]
                assert [p for f in raw for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(f)] \
                    == pieces, (text[:c], text[c:])
        checked += len(cuts)
        sizes, at = [], 0
        while at < len(text):
            sizes.append(text[at:at + (n := rng.randint(1, 40))])
            at += n
        assert tok.encode_stream(sizes, add_bos=False).tolist() == whole, text
    assert checked > 2000  # the cuts are there to be checked


DNA_WARNING = ("{source}: no place to cut the text where its ids stay those of the whole in the "
               "1,024 characters from character 0 (one run of letters, digits or symbols, as a "
               "DNA sequence or a script without spaces); cut there anyway, and again wherever "
               "1,000 characters pass without a place: the few ids beside each such cut may "
               "differ from those of the text encoded whole")


@pytest.fixture
def dna(monkeypatch) -> str:
    """5,000 random bases, one run of letters: no place to cut for byte-level BPE, with the
    text `encode_stream` holds without one cut to 1,000 characters (encoded 256 at a time)."""
    from toymlx.data import tokenizer

    monkeypatch.setattr(tokenizer, "CARRY_CHARS", 1000)
    monkeypatch.setattr(tokenizer, "ENCODE_CHARS", 256)
    rng = random.Random(0)
    return "".join(rng.choice("ACGT") for _ in range(5000))


def test_a_text_without_a_safe_cut_is_cut_anyway_and_said_once(gpt2, dna, monkeypatch):
    """One run of letters (a DNA sequence, a script without spaces or punctuation) holds no
    place where byte-level BPE's ids stay those of the whole: it was held whole and encoded in
    one call (a 200 MB file: ~30 GB in `tokenizers`, each piece appended by a copy of all
    before it, and no Ctrl-C seen until the call returned). Past `CARRY_CHARS` characters it is
    cut anyway, with one warning naming the file and where: each call encodes at most
    CARRY_CHARS + ENCODE_CHARS characters, and the ids are still those of the text's bytes."""
    from toymlx.backend.notice import ToymlxWarning

    assert gpt2._safe_cut(dna) == 0
    encoded, part = [], gpt2._encode_part
    monkeypatch.setattr(gpt2, "_encode_part", lambda text, continued, **kw: encoded.append(
        len(text)) or part(text, continued, **kw))
    with pytest.warns(ToymlxWarning) as caught:
        ids = gpt2.encode_stream([dna], add_bos=False, source="dna.txt")
    assert [str(w.message) for w in caught] == [DNA_WARNING.format(source="dna.txt")]
    assert sum(encoded) == len(dna) and max(encoded) <= 1000 + 256
    assert gpt2.decode(ids) == dna


def test_a_training_file_cut_anyway_is_named(gpt2, dna, tmp_path, shared_file):
    """The warning names the file a run reads (`--data.path`), and the run trains on it."""
    from toymlx_cli.train import main

    from toymlx.backend.notice import ToymlxWarning
    from toymlx.bundle.events import read_events

    path = tmp_path / "dna.txt"
    path.write_text(dna)
    with pytest.warns(ToymlxWarning) as caught:
        assert main(["--recipe", "from-scratch", "--tokenizer",
                     str(shared_file("tokenizers/ggml-vocab-gpt-2.gguf")), "--data.path",
                     str(path), "--model.d-model", "32", "--model.n-layers", "1",
                     "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.ffn-dim", "64",
                     "--model.context", "64", "--seq-len", "32", "--batch-size", "2",
                     "--steps", "1", "--no-compile", "--no-progress", "--runs-root",
                     str(tmp_path), "--run-id", "r"]) == 0
    assert DNA_WARNING.format(source=path) in [str(w.message) for w in caught]
    assert read_events(tmp_path / "r")[-1]["reason"] == "completed"


def test_a_plain_text_run_on_a_chat_model_s_tokenizer_writes_no_chat_template(
        smol, shared_file, tmp_path, capsys):
    """from-scratch with SmolLM2's tokenizer (which holds a chat template) trains on plain text
    alone: its checkpoint carries every other tokenizer key of the file but no
    `tokenizer.chat_template`, so llama-cli starts no conversation mode and toymlx-generate
    continues the prompt as it is (`--system` is refused: no template to put it in)."""
    from toymlx_cli.generate import main as generate
    from toymlx_cli.train import main

    from toymlx.bundle.checkpoint import resolve_latest
    from toymlx.data.vocab import K_TEMPLATE

    assert smol.chat_template and not smol.to_metadata(chat_template=False).get(K_TEMPLATE)
    vocab = shared_file("tokenizers/ggml-vocab-smollm2.gguf")
    text = tmp_path / "t.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 40)
    assert main(["--recipe", "from-scratch", "--tokenizer", str(vocab), "--data.path", str(text),
                 "--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
                 "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
                 "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--no-compile",
                 "--no-progress", "--runs-root", str(tmp_path), "--run-id", "r"]) == 0
    meta = read_metadata(resolve_latest(tmp_path / "r"))
    want = {k: v for k, v in read_metadata(vocab).items() if k.startswith("tokenizer.")}
    assert K_TEMPLATE in want
    got = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    assert K_TEMPLATE not in got and sorted(got) == sorted(set(want) - {K_TEMPLATE})
    assert got["tokenizer.ggml.tokens"] == want["tokenizer.ggml.tokens"]
    capsys.readouterr()
    run = tmp_path / "r"
    assert generate(["--model", str(run), "--prompt", "ROMEO:", "--system", "Be brief",
                     "--max-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "toymlx-generate: error: --system: expected a prompt rendered through a chat "
        f"template, found {run} has no tokenizer.chat_template")


# ------------------------------------------------------------- long fragments in encode_batch
class _CountingHF:
    """A `tokenizers.Tokenizer` that records the length of every text it is given."""

    def __init__(self, hf):
        self._hf, self.lengths = hf, []

    def encode(self, text, **kw):
        self.lengths.append(len(text))
        return self._hf.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.lengths.extend(map(len, texts))
        return self._hf.encode_batch(texts, **kw)


def _whole_ids(tok: Tokenizer, texts: list[str], parse_special: bool, monkeypatch
               ) -> list[list[int]]:
    """`encode_batch`'s ids with every raw-text fragment encoded whole in one call."""
    from toymlx.data import tokenizer

    bound = tokenizer.ENCODE_CHARS
    monkeypatch.setattr(tokenizer, "ENCODE_CHARS", 1 << 40)
    ids = tok.encode_batch(texts, False, parse_special=parse_special)
    monkeypatch.setattr(tokenizer, "ENCODE_CHARS", bound)
    return [i.tolist() for i in ids]


@pytest.mark.parametrize("name", [v for v in FUZZ_VOCABS if v != "bt"])
def test_encode_batch_cuts_a_long_fragment_with_the_ids_of_the_whole(request, name,
                                                                     monkeypatch):
    """A raw-text fragment longer than `ENCODE_CHARS` (here 64) is encoded in parts cut where
    the ids stay those of the whole (a 50 MB chat message held ~10 GB in `tokenizers`): a
    seeded fuzz of 60 texts of the atoms above, special-token texts inside and beside the cuts,
    with and without `parse_special`, gives the ids of every fragment encoded whole."""
    from toymlx.data import tokenizer

    monkeypatch.setattr(tokenizer, "ENCODE_CHARS", 64)
    tok = _vocab(request, name)
    rng = random.Random(name)
    texts = []
    for _ in range(60):
        pool = FUZZ_ATOMS if rng.random() < 0.5 else rng.sample(FUZZ_ATOMS, rng.randint(2, 8))
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(100, 400))))
    texts += ["short", "<|im_start|>hi<|im_end|>", ""]
    for parse in (True, False):
        whole = _whole_ids(tok, texts, parse, monkeypatch)
        counting = _CountingHF(tok._hf)
        monkeypatch.setattr(tok, "_hf", counting)
        assert [i.tolist() for i in tok.encode_batch(texts, False, parse_special=parse)] == whole
        monkeypatch.setattr(tok, "_hf", counting._hf)
        for text, ids in zip(texts, whole):
            assert tok.encode(text, False, parse_special=parse) == ids, text
        # most of the long texts hold a safe cut: most calls are short
        assert sorted(counting.lengths)[len(counting.lengths) * 9 // 10] <= 200, parse


def test_encode_batch_encodes_a_long_message_in_parts(smol, monkeypatch):
    """A chat message of 200,000 characters is encoded `ENCODE_CHARS` (here 1,000) at a time,
    not in one call of all of it, with the ids of the whole; the short texts beside it go into
    `tokenizers` in one batch, as before."""
    from toymlx.data import tokenizer

    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "a", "mat,", "and", "then", "42", "times.\n", "東京"]
    long = " ".join(rng.choice(words) for _ in range(60_000))[:200_000]
    texts = ["<|im_start|>user\n", long, "<|im_end|>\n<|im_start|>assistant\n", "Hi."]
    whole = [i.tolist() for i in smol.encode_batch(texts, False)]
    assert len(whole[1]) > 40_000
    monkeypatch.setattr(tokenizer, "ENCODE_CHARS", 1000)
    counting = _CountingHF(smol._hf)
    monkeypatch.setattr(smol, "_hf", counting)
    batched = []
    monkeypatch.setattr(counting, "encode_batch", lambda texts, **kw: batched.append(
        list(map(len, texts))) or counting._hf.encode_batch(texts, **kw))
    assert [i.tolist() for i in smol.encode_batch(texts, False)] == whole
    assert batched == [[5, 1, 10, 3]]  # "user\n", "\n", "assistant\n", "Hi." in one call
    # 200 pieces, each cut at its last safe place, what follows it carried to the next
    assert len(counting.lengths) >= 190 and max(counting.lengths) <= 1100


def test_encode_batch_holds_a_text_without_a_safe_cut_whole(gpt2, dna, monkeypatch):
    """Where a long fragment holds no safe cut (5,000 bases, `CARRY_CHARS` 1,000), encode_batch
    does not cut it by force as `encode_stream` does: the text is held to the first safe cut
    after it and encoded in one call, the ids those of the whole, with no warning."""
    import warnings

    texts = [dna + "\n\nGATTACA is a film", "x"]
    whole = _whole_ids(gpt2, texts, True, monkeypatch)
    counting = _CountingHF(gpt2._hf)
    monkeypatch.setattr(gpt2, "_hf", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [i.tolist() for i in gpt2.encode_batch(texts, False)] == whole
    # "x", then the bases held to the first safe cut after them (a newline ends the run)
    assert counting.lengths[0] == 1 and 5000 <= counting.lengths[1] <= 5002


def test_an_image_classifier_given_as_a_tokenizer_says_what_it_is():
    """A vit-tiny checkpoint given as from-scratch's --tokenizer was "tokenizer.ggml.model:
    expected one of [...], found missing key": now the line says the file is an image
    classifier, which holds no tokenizer."""
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_metadata({"general.architecture": "vit", "vit.block_count": 12}, "v.gguf")
    assert str(e.value) == (
        "v.gguf: tokenizer.ggml.model: expected one of ['gpt2', 'llama', 'gemma4'], found "
        "missing key: an image classifier (general.architecture 'vit') holds no tokenizer; give "
        "a language model's GGUF")
