"""Hostile GGUF input: every reader path either loads a file or raises one clean error.

A clean error is a ValueError (GGUFError, TokenizerError, ...) whose message is one line naming
the file. The mutation fuzzer is `scripts/fuzz_gguf.py` (long runs: `--cases N`); here a
bounded batch of it runs in a subprocess, so a segfault or hang fails this test with the
offending input saved, and a hypothesis property fuzzes the pure-Python header parser in
process. The rest pins down the bugs the fuzzer found.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toymlx.bundle.checkpoint import ResumeError, load_checked
from toymlx.data.tokenizer import Tokenizer, byte_tokenizer
from toymlx.gguf.llama import load_llama, load_llama_into, write_llama
from toymlx.gguf.reader import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    GGUFError,
    GGUFFile,
    read_metadata,
)
from toymlx.gguf.writer import write_gguf
from toymlx.models.llama import Llama, LlamaArgs

REPO = Path(__file__).resolve().parents[1]
TINY = LlamaArgs(vocab_size=259, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                 context=64)


def clean(err: BaseException, path: Path) -> bool:
    """The contract: a ValueError with a one-line message naming the file."""
    return isinstance(err, ValueError) and "\n" not in str(err) and str(path) in str(err)


# ---- the mutation fuzzer, in a subprocess -----------------------------------------------------
def test_fuzz_batch_every_reader_path(tmp_path, shared_file):
    for name in ("models/stories260K.gguf", "tokenizers/ggml-vocab-llama-spm.gguf",
                 "tokenizers/ggml-vocab-gpt-2.gguf", "tokenizers/ggml-vocab-smollm2.gguf"):
        shared_file(name)  # the script's seeds (scripts/gguf_fuzzer/seeds.py reads the same folder)
    out = tmp_path / "fuzz"
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(REPO / "scripts" / "fuzz_gguf.py"), "--profile", "quick",
           "--cases", "400", "--seed", "0", "--out", str(out), "--json", str(summary),
           "--case-timeout", "60"]
    p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=600, cwd=REPO)
    print(p.stdout)  # counts per reader path and seed (shown with -s)
    assert summary.exists(), p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert not s["crashes"] and not s["hangs"] and not s["defects"], p.stdout
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert s["cases"] == 400
    need = ["GGUFFile+load(all tensors)", "read_metadata", "load_llama(+forward)",
            "resume: load_checked(load_llama_into)",
            "Tokenizer.from_gguf(+encode/decode)", "load_llama(bfloat16)",
            "load_llama(quantized)", "lora.load_adapter", "lora.apply_adapter(toy base)",
            "resume: load_checked(lora.load_adapter_weights)", "warm.read_donor"]
    assert s["paths"] == need
    assert s["seeds"]["notes"]["toy-checkpoint"].startswith("2-step toymlx-train")
    assert {"toy-checkpoint", "toy-mixed-types", "lora-adapter"} <= set(s["seeds"]["seeds"])
    for path in need:  # each path both loads something and rejects something
        counts = s["per_path"][path]
        assert counts.get("clean_error", 0) > 0, (path, counts)
        assert counts.get("ok", 0) > 0, (path, counts)


def test_fuzz_guard_catches_crash_and_hang(tmp_path, shared_file):
    """The harness itself: a reader that segfaults (case 1) or hangs (case 2) is reported
    with its input saved, and the supervisor goes on with the next case."""
    shared_file("models/stories260K.gguf")  # the seed file scripts/fuzz_gguf.py mutates
    summary = tmp_path / "s.json"
    cmd = [sys.executable, str(REPO / "scripts" / "fuzz_gguf.py"), "--profile", "quick",
           "--cases", "3", "--selftest", "--case-timeout", "2", "--out", str(tmp_path),
           "--json", str(summary)]
    p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    s = json.loads(summary.read_text())
    assert [c["case"] for c in s["crashes"]] == [1] and s["crashes"][0]["returncode"] == -11
    assert [c["case"] for c in s["hangs"]] == [2]
    assert Path(s["crashes"][0]["input"]).exists() and Path(s["hangs"][0]["input"]).exists()
    assert s["cases"] == 3 and sum(s["per_path"]["read_metadata"].values()) == 1  # case 0


# ---- a generative property on the header parser (pure Python: safe in process) -----------------
_SCALARS = {UINT8: st.integers(0, 255), INT8: st.integers(-128, 127),
            UINT16: st.integers(0, 2**16 - 1), INT16: st.integers(-(2**15), 2**15 - 1),
            UINT32: st.integers(0, 2**32 - 1), INT32: st.integers(-(2**31), 2**31 - 1),
            UINT64: st.integers(0, 2**64 - 1), INT64: st.integers(-(2**63), 2**63 - 1),
            FLOAT32: st.floats(width=32, allow_nan=False), FLOAT64: st.floats(allow_nan=False),
            BOOL: st.booleans(), STRING: st.text(max_size=20)}


@st.composite
def gguf_inputs(draw):
    meta, types = {}, {}
    for i in range(draw(st.integers(0, 6))):
        key = f"k{i}." + draw(st.text(min_size=0, max_size=8))
        if draw(st.booleans()):
            t = draw(st.sampled_from(sorted(_SCALARS)))
            meta[key], types[key] = draw(_SCALARS[t]), (t, None)
        else:
            t = draw(st.sampled_from(sorted(_SCALARS)))
            meta[key] = draw(st.lists(_SCALARS[t], max_size=5))
            types[key] = (ARRAY, t)
    tensors = {}
    for i in range(draw(st.integers(0, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        dt = draw(st.sampled_from([np.float32, np.float16, np.int8, np.int32]))
        tensors[f"t{i}"] = np.arange(int(np.prod(shape)), dtype=dt).reshape(shape)
    align = draw(st.sampled_from([32, 32, 1, 8, 64]))
    if align != 32:
        meta["general.alignment"], types["general.alignment"] = align, (UINT32, None)
    # then damage it: nothing, a truncation, bit flips, or an overwritten 8-byte word
    damage = draw(st.sampled_from(["none", "truncate", "flip", "word"]))
    where = draw(st.floats(0, 1))
    extra = draw(st.integers(0, 2**64 - 1))
    return meta, types, tensors, align, damage, where, extra


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=gguf_inputs())
def test_header_parser_roundtrip_or_clean_error(tmp_path, case):
    meta, types, tensors, align, damage, where, extra = case
    path = tmp_path / "h.gguf"
    write_gguf(path, meta, tensors, types=types, alignment=align)
    buf = bytearray(path.read_bytes())
    if damage == "none":  # exact round trip, float64 and uint64 included
        g = GGUFFile(path)
        for k, v in meta.items():
            want = float(np.float32(v)) if types[k] == (FLOAT32, None) else v
            if types[k] == (ARRAY, FLOAT32):
                want = [float(np.float32(x)) for x in v]
            assert _same(g.metadata[k], want), (k, g.metadata[k], want)
            assert g.metadata_types[k] == types[k]
        for n, t in tensors.items():
            np.testing.assert_array_equal(g.load(n, t.dtype), t)
        g.close()
        return
    i = int(where * (len(buf) - 1))
    if damage == "truncate":
        buf = buf[:i]
    elif damage == "flip":
        buf[i] ^= 1 << (extra % 8)
    else:
        buf[i:i + 8] = extra.to_bytes(8, "little")
    path.write_bytes(bytes(buf))
    try:
        g = GGUFFile(path)
        for n in g.tensors:
            g.load(n)
        g.close()
        read_metadata(path)
    except Exception as e:  # noqa: BLE001 -- the contract is about every exception
        assert clean(e, path), f"{type(e).__name__}: {e}"


def test_writer_uint64_array_is_exact(tmp_path):
    """Found by the property above: a uint64 array written with an explicit type loses its
    low bits when small and >= 2**63 values are mixed."""
    write_gguf(tmp_path / "u.gguf", {"k": [0, 2**63 + 1]}, {}, types={"k": (ARRAY, UINT64)})
    assert GGUFFile(tmp_path / "u.gguf").metadata["k"] == [0, 2**63 + 1]


@pytest.mark.parametrize("values", [[0, 2**63 + 1], [-1, 2**32]])
def test_writer_never_truncates_an_int_list_silently(tmp_path, values):
    try:
        write_gguf(tmp_path / "i.gguf", {"k": values}, {})
    except (TypeError, ValueError):
        return  # refusing is fine
    assert GGUFFile(tmp_path / "i.gguf").metadata["k"] == values


# ---- the bugs the fuzzer found, pinned ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    mx.random.seed(0)
    return Llama(TINY)


def _tiny(path: Path, model, **override) -> Path:
    write_llama(path, model, byte_tokenizer().to_metadata(), override)
    return path


@pytest.mark.parametrize("key,value", [
    ("llama.block_count", 2**40),  # spun in expected_shapes (a hang) before the fix
    ("llama.block_count", 0),
    ("llama.attention.layer_norm_rms_epsilon", 0.0),  # MLX's RMSNorm error, no file named
    ("llama.attention.layer_norm_rms_epsilon", float("nan")),
    ("llama.rope.freq_base", -1.0),
    ("llama.context_length", 0),
])
def test_absurd_hyperparameters_fail_fast_and_clean(tmp_path, tiny_model, key, value):
    path = _tiny(tmp_path / "m.gguf", tiny_model, **{key: value})
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as e:
        load_llama(path)
    assert time.perf_counter() - t0 < 2
    assert clean(e.value, path) and repr(key) in str(e.value)


def test_float64_metadata_loads_everywhere_without_mx_load(tmp_path, tiny_model, monkeypatch):
    """mx.load segfaults on float64 metadata: no reader may hand such a file to it."""
    base = _tiny(tmp_path / "f32.gguf", tiny_model)
    g = GGUFFile(base)
    meta, types = dict(g.metadata), dict(g.metadata_types)
    tensors = {n: g.load(n) for n in g.tensors}
    for k in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
        types[k] = (FLOAT64, None)
    meta["toy.f64_array"], types["toy.f64_array"] = [0.1, 0.2], (ARRAY, FLOAT64)
    meta["tokenizer.ggml.scores"] = [float(x) for x in meta["tokenizer.ggml.scores"]]
    types["tokenizer.ggml.scores"] = (ARRAY, FLOAT64)
    f64 = tmp_path / "f64.gguf"
    write_gguf(f64, meta, tensors, types=types)
    assert GGUFFile(f64).has_float64_metadata

    def no_mx_load(*a, **k):
        raise AssertionError(f"mx.load called with {a}: it segfaults on float64 metadata")

    monkeypatch.setattr(mx, "load", no_mx_load)
    m64, _ = load_llama(f64)
    m32, _ = load_llama(base)
    x = mx.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(np.array(m64(x)), np.array(m32(x)))
    tok = Tokenizer.from_gguf(f64)
    assert tok.decode(tok.encode("float64 ok")) == "float64 ok"
    from toymlx.recipes import warm

    load_llama(f64, weights="bfloat16")
    assert warm.read_donor(f64).table.shape == (259, 32)


def test_resume_rejects_a_checkpoint_of_another_shape(tmp_path, tiny_model):
    """strict=False loads checked no shapes: a wrong one failed later inside a matmul."""
    path = _tiny(tmp_path / "m.gguf", tiny_model)
    g = GGUFFile(path)
    tensors = {n: g.load(n) for n in g.tensors}
    tensors["blk.0.attn_v.weight"] = np.zeros((32, 16), np.float32)  # (out, in) swapped
    bad = tmp_path / "bad.gguf"
    write_gguf(bad, dict(g.metadata), tensors, types=dict(g.metadata_types))
    model = Llama(TINY)
    with pytest.raises(ResumeError) as e:
        load_checked(load_llama_into, bad, model)
    assert clean(e.value, bad) and "blk.0.attn_v.weight" in str(e.value)
    load_checked(load_llama_into, path, Llama(TINY))  # the right shape loads


def test_truncated_and_bitflipped_real_model(tmp_path, stories_path):
    """A few deterministic byte-level cases on stories260K through load_llama (in process)."""
    buf = stories_path.read_bytes()
    rng = np.random.default_rng(0)
    p = tmp_path / "s.gguf"
    for cut in [0, 3, 4, 8, 23, 24, 100, 5000, len(buf) // 2, len(buf) - 1]:
        p.write_bytes(buf[:cut])
        with pytest.raises(ValueError) as e:
            load_llama(p)
        assert clean(e.value, p), str(e.value)
    head = len(buf) - sum(GGUFFile(stories_path).tensors[n].nbytes
                          for n in GGUFFile(stories_path).tensors)
    for _ in range(30):
        b = bytearray(buf)
        i = int(rng.integers(0, head))
        b[i] ^= 1 << int(rng.integers(0, 8))
        p.write_bytes(bytes(b))
        try:
            load_llama(p)
        except Exception as e:  # noqa: BLE001
            assert clean(e, p), f"flip at {i}: {type(e).__name__}: {e}"


def test_u64_counts_and_lengths_are_bounded(tmp_path):
    """Claimed sizes of 2**64-1 never turn into allocations."""
    p = tmp_path / "c.gguf"
    for n_t, n_kv in [(2**64 - 1, 0), (0, 2**64 - 1), (2**63, 2**63)]:
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv) + b"\0" * 64)
        with pytest.raises(GGUFError) as e:
            GGUFFile(p)
        assert clean(e.value, p)
    # one key whose string length, then array length, claims 2**64-1
    key = struct.pack("<Q", 1) + b"k"
    for payload in [struct.pack("<IQ", STRING, 2**64 - 1),
                    struct.pack("<IIQ", ARRAY, UINT8, 2**64 - 1),
                    struct.pack("<IIQ", ARRAY, STRING, 2**64 - 1)]:
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + payload + b"\0" * 32)
        with pytest.raises(GGUFError) as e:
            GGUFFile(p)
        assert clean(e.value, p)


@pytest.mark.parametrize("vocab,arch", [("smollm2", "llama"), ("gpt-2", "gpt2")])
@pytest.mark.parametrize("prog,argv", [
    ("toymlx-generate", ["--prompt", "hi", "--model"]),
    ("toymlx-train", ["--recipe", "warm-start", "--steps", "1", "--no-progress", "--donor"]),
    ("toymlx-eval", ["--model"]),
    ("toymlx-export", ["--out", "x.gguf", "--base"]),
])
def test_a_tokenizer_only_gguf_given_as_a_model_says_so(tmp_path, shared_file, capsys, prog,
                                                        argv, vocab, arch, monkeypatch):
    """llama.cpp's ggml-vocab-smollm2.gguf given as the model or donor was "tensor
    'token_embd.weight': expected present, found missing": it holds no tensor at all; its
    ggml-vocab-gpt-2.gguf was "expected one of llama, ..., found 'gpt2'" (an architecture no
    model of which was asked for)."""
    from cli_errors import error_line
    from toymlx_cli import eval as eval_cli
    from toymlx_cli import export, generate, train

    monkeypatch.chdir(tmp_path)
    path = shared_file(f"tokenizers/ggml-vocab-{vocab}.gguf")
    main = {"toymlx-generate": generate.main, "toymlx-train": train.main,
            "toymlx-eval": eval_cli.main, "toymlx-export": export.main}[prog]
    assert main([*argv, str(path), *(["--runs-root", str(tmp_path)]
                                     if prog == "toymlx-train" else [])]) == 2
    assert error_line(capsys, prog) == (
        f"{prog}: error: {path}: expected a model, found a '{arch}' vocabulary only: the file "
        "holds no tensors, a tokenizer-only GGUF (as llama.cpp's ggml-vocab-*.gguf), not a model")
    assert not any(tmp_path.iterdir())
