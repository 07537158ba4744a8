"""The warm-start recipe: donor errors, lens properties, folded export, freezing, resume,
and (slow) warm start beating the same student from a random table."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from toymlx_cli.train import main

from toymlx.bundle.checkpoint import resolve_latest
from toymlx.bundle.events import read_events
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import expected_shapes, load_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import QuantTensor, write_gguf
from toymlx.models.losses import lm_loss
from toymlx.recipes import lora, warm
from toymlx.recipes import warm_start as ws
from toymlx.recipes.common import LlamaOptions, TextData
from toymlx.runner.run import run_ops
from toymlx.training.step import make_step
from toymlx.training.trainer import train

W32 = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}
W32_FLAGS = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4",
             "--model.n-kv-heads", "2", "--model.ffn-dim", "64"]


@pytest.fixture(scope="module")
def text_file(shared_file, tmp_path_factory) -> str:
    """The first 40k characters of tiny Shakespeare (fast to tokenise, plenty for 32-token windows)."""
    text = shared_file("text/tinyshakespeare.txt").read_text()[:40_000]
    path = tmp_path_factory.mktemp("text") / "shakespeare40k.txt"
    path.write_text(text)
    return str(path)


def _donor(path: Path, width: int = 32, rows: int | None = None, arch: str = "llama",
           table: bool = True, table_width: int | None = None, qtype: Q | None = None,
           seed: int = 0, chat_template: str | None = None) -> Path:
    """A small donor GGUF: the byte tokenizer's 259 tokens (and `chat_template`, a chat
    model's) and a random table."""
    meta = {"general.architecture": arch, f"{arch}.embedding_length": width,
            **byte_tokenizer().to_metadata()}
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    t = np.random.default_rng(seed).normal(0, 0.3, (rows or 259, table_width or width))
    t = t.astype(np.float32)
    tensors = {}
    if table:
        tensors["token_embd.weight"] = t if qtype is None else _quantized(t, qtype, seed)
    tensors["output_norm.weight"] = np.ones(width, np.float32)
    write_gguf(path, meta, tensors)
    return path


# byte offsets of the float16 super-block scales gguf-py cannot write for K-quants
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _quantized(t: np.ndarray, qtype: Q, seed: int) -> QuantTensor:
    if qtype not in _K_SCALES:
        return QuantTensor(qtype, quantize(t, qtype), t.shape)
    # gguf-py has no K-quant encoder: random blocks with sane float16 scales instead
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = t.size // block
    raw = np.random.default_rng(seed).integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in _K_SCALES[qtype]:
        raw[:, off:off + 2] = np.full((n_blocks, 1), 0.01, np.float16).view(np.uint8)
    return QuantTensor(qtype, raw.reshape(t.shape[0], -1), t.shape)


def _build(cfg: ws.Config):
    return ws.build(cfg, run_ops(cfg))


def _cfg(donor, text_file: str, **kw) -> ws.Config:
    warm_kw = {k: kw.pop(k) for k in ("lens", "init", "freeze_embeddings", "vocab") if k in kw}
    model = LlamaOptions(**kw.pop("model", W32))
    base = {"seq_len": 32, "batch_size": 4, "steps": 6, "warmup": 2, "eval_batches": 2,
            "progress": False}
    return ws.Config(donor=None if donor is None else str(donor), model=model,
                     data=TextData(path=text_file), warm=ws.WarmOptions(**warm_kw),
                     **{**base, **kw})


def test_the_donor_s_unread_tensors_are_said_in_one_line(tmp_path, text_file, capsys,
                                                        monkeypatch):
    """Warm start reads the donor's token table and tokenizer alone: its other tensors were left
    without a word; now one line names what is taken and how many tensors are not read."""
    donor = _donor(tmp_path / "d.gguf", qtype=Q.Q8_0)
    _build(_cfg(donor, text_file))
    assert capsys.readouterr().err == (
        f"toymlx: --donor {donor}: takes token_embd.weight (259 x 32, Q8_0) and its tokenizer; "
        "its 1 other tensors (blocks, norm, head) are not read: the student's blocks start "
        "from random init\n")
    # an Ollama name: the name, then its blob (the blob's sha256 name alone said nothing)
    import hashlib
    import json

    root = tmp_path / "ollama"
    digest = hashlib.sha256(donor.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(donor.read_bytes())
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "d" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{
        "mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    _build(_cfg("ollama:d", text_file))
    assert capsys.readouterr().err.startswith(
        f"toymlx: --donor ollama:d ({blob}): takes token_embd.weight (259 x 32, Q8_0)")


# ---- bad donors: one line each, naming file, key/tensor, expected and found ----------------
def _fails(cfg: ws.Config, *parts: str) -> str:
    with pytest.raises(ValueError) as e:
        ws.build(cfg, run_ops(cfg))
    msg = str(e.value)
    assert "\n" not in msg
    for p in parts:
        assert p in msg, msg
    return msg


def test_no_donor(text_file):
    """`toymlx-train --recipe warm-start` alone, a newcomer's first command: the line names a
    donor to give, as lora's names a --base."""
    assert _fails(_cfg(None, text_file)) == (
        "--donor: expected a llama GGUF to take the token table from, found none (e.g. --donor "
        "SmolLM2-135M-Instruct.Q4_1.gguf)")


def test_missing_donor(tmp_path, text_file):
    p = tmp_path / "nope.gguf"
    _fails(_cfg(p, text_file), f"{p}: --donor: expected an existing GGUF file, found nothing")


def test_unreadable_donor(tmp_path, text_file):
    _fails(_cfg(tmp_path, text_file), str(tmp_path), "expected a GGUF file", "found a directory")


def test_a_hugging_face_folder_as_donor_or_tokenizer_is_named(tmp_path, text_file):
    """--donor or --tokenizer given a Hugging Face model folder (config.json, model.safetensors,
    tokenizer.json) said "expected a GGUF file, found a directory", where --base and --model
    name the folder and say that toymlx reads the model's GGUF instead."""
    from toymlx.recipes import from_scratch as fs

    hf = tmp_path / "SmolLM2-135M"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": []}')
    mx.save_safetensors(str(hf / "model.safetensors"), {"w": mx.zeros((2, 2))})
    named = ("expected a GGUF file, found a Hugging Face model folder (config.json and "
             "model.safetensors, as mlx-lm's --model takes; toymlx reads that model's GGUF file "
             "instead)")
    assert _fails(_cfg(hf, text_file)) == f"{hf}: --donor: {named}"
    with pytest.raises(ValueError) as e:
        fs.validate(fs.Config(tokenizer=str(hf)))
    assert str(e.value) == f"{hf}: --tokenizer: {named}"


def test_nanogpts_gpt2_as_tokenizer_names_llama_cpps_file(tmp_path, monkeypatch):
    """--tokenizer gpt2 (nanoGPT's prepare.py takes tiktoken's gpt2; TEXT.md says --tokenizer
    takes a GGUF's "as nanoGPT takes GPT-2's") said only "found nothing at that path", and
    hf:gpt2 only "not a Hugging Face model name"."""
    from toymlx.recipes import from_scratch as fs

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        fs.validate(fs.Config(tokenizer="gpt2"))
    assert str(e.value) == (
        "gpt2: --tokenizer: expected an existing GGUF file, found nothing at that path; "
        "nanoGPT's gpt2 (tiktoken's) is in llama.cpp's vocab-only models/ggml-vocab-gpt-2.gguf: "
        "--tokenizer ggml-vocab-gpt-2.gguf")
    # as a Hugging Face name, which needs USER/REPO (and a GGUF repository)
    from toymlx.bundle.model_store import ModelStoreError, resolve

    with pytest.raises(ModelStoreError) as e:
        resolve("hf:gpt2", "--tokenizer")
    assert str(e.value) == (
        "--tokenizer hf:gpt2: not a Hugging Face model name: expected hf:USER/REPO[:QUANT] or "
        "hf:USER/REPO/FILE.gguf; nanoGPT's gpt2 (tiktoken's) is in llama.cpp's vocab-only "
        "models/ggml-vocab-gpt-2.gguf: --tokenizer ggml-vocab-gpt-2.gguf")


def test_a_run_folder_as_donor_names_its_checkpoint(tmp_path, text_file):
    """--donor runs/ID (the folder every other command takes) was "file: expected a GGUF file,
    found a directory"; lora's --base runs/ID called it a Hugging Face model folder."""
    run = tmp_path / "runs" / "d"
    assert main(["--recipe", "from-scratch", *W32_FLAGS, "--seq-len", "32", "--batch-size", "2",
                 "--steps", "2", "--eval-every", "0", "--no-progress", "--no-compile",
                 "--data.path", text_file, "--runs-root", str(tmp_path / "runs"),
                 "--run-id", "d"]) == 0
    for recipe, flag in (("warm-start", "--donor"), ("lora", "--base")):
        with pytest.raises(ValueError) as e:
            (ws if recipe == "warm-start" else lora).validate(
                (ws if recipe == "warm-start" else lora).Config(**{flag[2:]: str(run)}))
        assert str(e.value) == (f"{run}: {flag}: expected a GGUF file, found a toymlx run "
                                f"folder; pass one of its checkpoints: {flag} "
                                f"{run / 'weights' / 'step_2.gguf'}")


def test_not_gguf(tmp_path, text_file):
    """A donor that is not a GGUF said "found b'hell' (not a GGUF file)": now what it is, the
    text given where the model goes, or Hugging Face's weights with the converter to a GGUF."""
    import mlx.core as mx

    p = tmp_path / "donor.gguf"
    p.write_text("hello, not a model\n" * 215 + "0123456789\u00e9")  # \u00e9 cut at byte 4,096
    assert _fails(_cfg(p, text_file)) == (f"{p}: magic: expected b'GGUF', found b'hell' (not a "
                                          "GGUF file: UTF-8 text)")
    st = tmp_path / "model.safetensors"
    mx.save_safetensors(str(st), {"w": mx.zeros((2, 2))})
    assert _fails(_cfg(st, text_file)) == (
        f"{st}: magic: expected b'GGUF', found b'M\\x00\\x00\\x00' (not a GGUF file: Hugging Face "
        "safetensors weights; llama.cpp's convert_hf_to_gguf.py makes a GGUF of the model's "
        "folder)")
    tok = tmp_path / "tokenizer.json"  # Hugging Face's, as `tokenizers` writes it
    tok.write_text('{\n  "version": "1.0",\n  "truncation": null,\n  "padding": null,\n  '
                   '"added_tokens": [],\n  "model": {"type": "BPE"}\n}')
    assert _fails(_cfg(tok, text_file)) == (
        f"{tok}: magic: expected b'GGUF', found b'{{\\n  ' (not a GGUF file: a Hugging Face "
        "tokenizer.json; llama.cpp's convert_hf_to_gguf.py makes a GGUF of the model's folder "
        "(--vocab-only: its tokenizer alone))")
    p.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    assert _fails(_cfg(p, text_file)).endswith("found b'\\x1f\\x8b\\x08\\x00' (not a GGUF file)")


def test_non_llama_donor(tmp_path, text_file):
    p = _donor(tmp_path / "gpt2.gguf", arch="gpt2")
    _fails(_cfg(p, text_file), str(p), "'general.architecture'", "expected one of llama, qwen2",
           "found 'gpt2'")


def test_missing_table(tmp_path, text_file):
    p = _donor(tmp_path / "d.gguf", table=False)
    _fails(_cfg(p, text_file), str(p), "tensor 'token_embd.weight'", "expected present",
           "found missing")


def test_missing_width_key(tmp_path, text_file):
    p = tmp_path / "d.gguf"
    write_gguf(p, {"general.architecture": "llama"},
               {"token_embd.weight": np.zeros((259, 32), np.float32)})
    _fails(_cfg(p, text_file), str(p), "'llama.embedding_length'", "expected present",
           "found missing")


def test_width_mismatch(tmp_path, text_file):
    p = _donor(tmp_path / "d.gguf", width=64, table_width=32)
    _fails(_cfg(p, text_file), str(p), "tensor 'token_embd.weight' shape",
           "expected (n_vocab, 64)", "llama.embedding_length=64", "found (259, 32)")


def test_vocab_smaller_than_asked(tmp_path, text_file):
    p = _donor(tmp_path / "d.gguf")
    assert _fails(_cfg(p, text_file, vocab=300)) == (
        f"{p}: tensor 'token_embd.weight' rows: expected at least 300 (--warm.vocab), found 259; "
        "use --warm.vocab 259 or less (the donor's whole vocabulary)")
    small = _donor(tmp_path / "small.gguf", rows=200)
    _fails(_cfg(small, text_file), str(small), "expected at least 259",
           "tokenizer.ggml.tokens", "found 200")


def test_identity_needs_equal_widths(tmp_path, text_file):
    p = _donor(tmp_path / "d.gguf", width=64)
    _fails(_cfg(p, text_file, lens="identity"), "--warm.lens identity", "donor width 64",
           "found 32")


def test_bad_data_is_refused_before_the_lens_is_computed(tmp_path, stories_path, monkeypatch):
    """A mistyped --data.path was read only after the donor's PCA lens, an SVD of the whole
    table (SmolLM2's: 6-7 s quiet, 60 s on a busy host; the refusal came after 2 minutes,
    from-scratch's in 3 s): the data is read first now, and the lens never computed."""
    calls = []
    monkeypatch.setattr(warm, "make_lens", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match="nope.txt: expected a UTF-8 text file, found nothing"):
        _build(_cfg(stories_path, str(tmp_path / "nope.txt")))
    assert calls == []


def test_cli_fails_before_training(tmp_path, text_file, capsys):
    p = _donor(tmp_path / "gpt2.gguf", arch="gpt2")
    rc = main(["--recipe", "warm-start", "--donor", str(p), "--data.path", text_file,
               *W32_FLAGS, "--runs-root", str(tmp_path / "runs"), "--run-id", "x",
               "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected one of llama" in err[0] and str(p) in err[0]
    assert not (tmp_path / "runs" / "x" / "events.jsonl").exists()


# ---- quantized donors through the same reader -------------------------------------------
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_quantized_donor(tmp_path, qtype):
    p = _donor(tmp_path / "q.gguf", width=256, qtype=qtype)
    d = warm.read_donor(p)
    g = GGUFFile(p)
    want = dequantize(np.asarray(g.raw("token_embd.weight")).reshape(259, -1), qtype)
    assert d.tensor_type == qtype.name and d.width == 256 and d.table.shape == (259, 256)
    assert np.isfinite(d.table).all() and d.table.std() > 0
    np.testing.assert_array_equal(d.table, want.astype(np.float32))


# ---- lenses --------------------------------------------------------------------------------
def _variance_kept(table: np.ndarray, basis: np.ndarray) -> float:
    c = table - table.mean(axis=0)
    return float(np.sum((c @ basis) ** 2))


def test_pca_lens_orthonormal_and_keeps_most_variance(stories_path):
    d = warm.read_donor(stories_path)
    rng = np.random.default_rng(0)
    lens = warm.make_lens("pca", d.table, 32, rng).astype(np.float64)
    scale = np.linalg.norm(lens[:, 0])
    basis = lens / scale
    np.testing.assert_allclose(basis.T @ basis, np.eye(32), atol=1e-5)  # orthonormal columns
    # the folded table starts at the donor table's per-element RMS
    assert warm.rms(d.table @ lens) == pytest.approx(warm.rms(d.table), rel=1e-4)
    # it keeps the top-32 eigen-variance, and at least as much as any other rank-32 projection
    c = d.table.astype(np.float64) - d.table.mean(axis=0)
    eig = np.sort(np.linalg.eigvalsh(c.T @ c))[::-1]
    kept = _variance_kept(d.table, basis)
    assert kept == pytest.approx(eig[:32].sum(), rel=1e-5)
    for seed in range(20):
        other = warm.random_basis(64, 32, np.random.default_rng(seed))
        np.testing.assert_allclose(other.T @ other, np.eye(32), atol=1e-10)
        assert _variance_kept(d.table, other) < kept
    # a random lens is scaled the same way
    r = warm.make_lens("random", d.table, 32, rng)
    assert warm.rms(d.table @ r) == pytest.approx(warm.rms(d.table), rel=1e-4)


def test_pca_lens_in_its_child_is_the_same_lens_bit_for_bit(stories_path):
    """make_lens computes pca in a child process (`pca_lens`): the numbers this process gave."""
    d = warm.read_donor(stories_path)
    here = warm.scaled_lens(d.table, warm.pca_basis(d.table, 32))
    got = warm.make_lens("pca", d.table, 32, np.random.default_rng(0))
    assert got.dtype == np.float32 and got.shape == (64, 32)
    assert got.tobytes() == here.tobytes()


def test_random_lens_in_its_child_is_the_same_lens_bit_for_bit(stories_path, monkeypatch):
    """make_lens computes random's scaling in a child process too (`random_lens`: its float64
    RMS and `table @ basis` held a SIGTERM 12 s for a 49152 x 3072 table): once, through
    `in_child`, with the numbers this process gave for the same draw."""
    d = warm.read_donor(stories_path)
    here = warm.scaled_lens(d.table, warm.random_basis(64, 32, np.random.default_rng(5)))
    calls = []
    real = warm.in_child
    monkeypatch.setattr(warm, "in_child", lambda what, *a: calls.append(what) or real(what, *a))
    got = warm.make_lens("random", d.table, 32, np.random.default_rng(5))
    assert calls == ["--warm.lens random"]
    assert got.dtype == np.float32 and got.shape == (64, 32)
    assert got.tobytes() == here.tobytes()


def test_a_stop_during_a_child_s_long_call_acts_at_once():
    """`in_child` (warm-start's pca lens: SmolLM2's SVD held a SIGTERM for 6-7 s in one numpy
    call) waits in slices: a SIGTERM 0.3 s into a 20 s child raises `Stopped` within a second,
    with its exit code, and kills the child."""
    import os
    import signal
    import threading
    import time

    from toymlx.backend.stop import SIGNALS, Stopped, how_stopped, in_child, stops_raise

    before = {s: signal.getsignal(s) for s in SIGNALS}
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    try:
        with pytest.raises(Stopped) as e, stops_raise(SIGNALS):
            timer.start()
            in_child("a test", "timeit", ["-n1", "-r1", "import time; time.sleep(20)"], b"")
        took = time.monotonic() - t0
    finally:
        timer.cancel()
        for s, h in before.items():
            signal.signal(s, h)
    assert how_stopped(e.value) == ("stopped by SIGTERM", 143)
    assert 0.3 <= took < 1.5


def test_a_failed_child_is_one_line_naming_it():
    from toymlx.backend.stop import in_child

    with pytest.raises(OSError, match=r"^a test: its process \(.* -m timeit\) failed: "
                                      r"ZeroDivisionError: division by zero$"):
        in_child("a test", "timeit", ["-n1", "-r1", "1/0"], b"")


def test_pca_lens_wider_student_keeps_everything(stories_path):
    d = warm.read_donor(stories_path)
    lens = warm.pca_basis(d.table, 96)
    np.testing.assert_allclose(lens @ lens.T, np.eye(64), atol=1e-10)  # orthonormal rows
    assert not lens[:, 64:].any()


def test_identity_lens_at_equal_widths(stories_path, text_file):
    cfg = _cfg(stories_path, text_file, lens="identity",
               model={"d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
                      "ffn_dim": 128})
    task = ws.build(cfg, run_ops(cfg))
    m = task.model
    donor = warm.read_donor(stories_path)
    np.testing.assert_array_equal(np.array(m.lens), np.eye(64, dtype=np.float32))
    np.testing.assert_array_equal(np.array(m.table), donor.table)
    np.testing.assert_array_equal(np.array(m.embed.folded()), donor.table)
    tokens = mx.array([[1, 5, 300, 7]])
    np.testing.assert_array_equal(np.array(m.embed_tokens(tokens))[0], donor.table[[1, 5, 300, 7]])


def test_random_init_changes_only_the_table(stories_path, text_file):
    a = _build(_cfg(stories_path, text_file)).model
    b = _build(_cfg(stories_path, text_file, init="random")).model
    from mlx.utils import tree_flatten

    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    # the tied head's norm follows the same rule from each folded table (of about one RMS)
    for k, v in pa.items():
        same = np.array_equal(np.array(v), np.array(pb[k]))
        assert same == (k not in ("embed.weight", "embed.lens", "norm.weight")), k
    assert warm.rms(np.array(b.table)) == pytest.approx(warm.rms(np.array(a.table)), rel=0.02)
    for m in (a, b):
        want = warm.head_norm_weight(np.array(m.embed.folded()))
        np.testing.assert_array_equal(np.array(m.norm.weight), np.float32(want))
    np.testing.assert_allclose(np.array(b.norm.weight), np.array(a.norm.weight), rtol=0.02)


def test_first_loss_near_uniform(stories_path, text_file):
    """A tied head starts at unit logit spread: the first loss within 1 nat of ln V, where a
    norm weight of 1 gives the input token's own row a logit of D * rms(table) (64 * 0.31 = 20)
    and a first loss over 13 nats; the embedding is still exactly the donor's table."""
    cfg = _cfg(stories_path, text_file, lens="identity",
               model={"d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
                      "ffn_dim": 128})
    m = _build(cfg).model
    donor = warm.read_donor(stories_path).table
    np.testing.assert_array_equal(np.array(m.embed.folded()), donor)
    weight = 1 / (8 * warm.rms(donor))  # 1 / (sqrt(64) * 0.309)
    assert weight == pytest.approx(0.405, abs=0.001)
    np.testing.assert_allclose(np.array(m.norm.weight), np.full(64, weight), rtol=1e-6)
    batch = {k: mx.array(v[0]) for k, v in _build(cfg).train_batch(0).items()}
    ln_v = np.log(512)
    assert abs(lm_loss(m, batch)[0].item() - ln_v) < 1
    m.norm.weight = mx.ones(64)  # the head as it was: confident first guesses
    assert lm_loss(m, batch)[0].item() > ln_v + 6


# ---- training: folded export, freezing, resume ------------------------------------------
def test_a_chat_donor_s_template_stays_out_of_the_checkpoint(tmp_path, text_file):
    """The student trains on plain text alone: its checkpoint takes the donor's tokenizer but
    not its `tokenizer.chat_template` (llama-cli and Ollama would wrap prompts in it)."""
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    donor = _donor(tmp_path / "chat_donor.gguf", chat_template=template)
    assert GGUFFile(donor).metadata["tokenizer.chat_template"] == template
    cfg = _cfg(donor, text_file, steps=1)
    run = tmp_path / "run"
    run.mkdir()
    assert train(_build(cfg), cfg, run, {})["reason"] == "completed"
    meta = GGUFFile(resolve_latest(run)).metadata
    assert "tokenizer.chat_template" not in meta
    assert meta["tokenizer.ggml.tokens"] == byte_tokenizer().to_metadata()[
        "tokenizer.ggml.tokens"]


@pytest.mark.parametrize("context", [None, 48])
def test_the_checkpoint_s_context_is_the_trained_window_unless_given(tmp_path, stories_path,
                                                                     text_file, context):
    """The student's blocks start from random init (only the table is the donor's), so no
    position past --seq-len is trained: its llama.context_length, llama.cpp's n_ctx_train, is
    the window (it was the tiny preset's 1,024), and config.json records it as
    --model.context; a --model.context given is written as given. stories260K's own context
    (2,048) is no student's."""
    from toymlx_cli.train import main

    given = [] if context is None else ["--model.context", str(context)]
    assert main(["--recipe", "warm-start", "--donor", str(stories_path), *W32_FLAGS,
                 "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--warmup", "0",
                 "--data.path", text_file, "--runs-root", str(tmp_path), "--run-id", "w",
                 "--no-compile", "--no-progress", *given]) == 0
    want = context or 32
    assert GGUFFile(resolve_latest(tmp_path / "w")).metadata["llama.context_length"] == want
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    assert saved["config"]["model"]["context"] == want


@pytest.mark.parametrize("tied", [True, False])
def test_folded_checkpoint_matches_training_logits(tmp_path, stories_path, text_file, tied):
    cfg = _cfg(stories_path, text_file, steps=5, model={**W32, "tie_embeddings": tied})
    task = ws.build(cfg, run_ops(cfg))
    run = tmp_path / "run"
    run.mkdir()
    end = train(task, cfg, run, {})
    assert end["reason"] == "completed"
    ckpt = resolve_latest(run)
    exported, g = load_llama(ckpt)
    # a plain llama GGUF: exactly the llama tensors, token_embd folded to the student width
    assert set(g.tensors) == set(expected_shapes(exported.args))
    assert ("output.weight" in g.tensors) == (not tied)
    assert g.tensors["token_embd.weight"].shape == (512, 32)
    assert g.metadata["tokenizer.ggml.tokens"] == GGUFFile(stories_path).metadata[
        "tokenizer.ggml.tokens"]
    assert g.metadata["toy.warm.lens"] == "pca"
    assert warm.warm_path(ckpt).exists()
    batch = task.val_batches[0]["inputs"][0]
    want = np.array(task.model(mx.array(batch)))
    got = np.array(exported(mx.array(batch)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # the donor table really moved (it is trained), and the lens too
    donor = warm.read_donor(stories_path).table
    assert not np.array_equal(np.array(task.model.table), donor)
    # Task.load restores table and lens exactly
    fresh = ws.build(cfg, run_ops(cfg))
    fresh.load(ckpt, fresh.model)
    for name in ("table", "lens"):
        np.testing.assert_array_equal(np.array(getattr(fresh.model, name)),
                                      np.array(getattr(task.model, name)))
    np.testing.assert_array_equal(np.array(fresh.model(mx.array(batch))), want)
    events = [e for e in read_events(run) if e["kind"] == "run_start"]
    assert events[0]["config"]["donor"] == str(stories_path)
    assert events[0]["config"]["donor_width"] == 64
    assert events[0]["model"]["lens"] == "pca"


def test_load_rejects_a_side_file_of_another_checkpoint(tmp_path, stories_path, text_file):
    cfg = _cfg(stories_path, text_file, steps=4, checkpoint_every=2)
    task = ws.build(cfg, run_ops(cfg))
    run = tmp_path / "run"
    run.mkdir()
    train(task, cfg, run, {})
    w = run / "weights"
    (w / "step_2.warm.safetensors").replace(w / "step_4.warm.safetensors")
    with pytest.raises(GGUFError, match="expected to equal step_4.gguf's token_embd.weight"):
        task.load(w / "step_4.gguf", ws.build(cfg, run_ops(cfg)).model)
    (w / "step_4.warm.safetensors").unlink()
    with pytest.raises(ValueError, match="step_4.warm.safetensors: .*expected present"):
        task.load(w / "step_4.gguf", ws.build(cfg, run_ops(cfg)).model)


@pytest.mark.parametrize("compile_", [True, False])
def test_freezing_keeps_the_table_bit_identical(stories_path, text_file, compile_):
    k = 3
    cfg = _cfg(stories_path, text_file, steps=6, freeze_embeddings=k, compile=compile_)
    task = ws.build(cfg, run_ops(cfg))
    m = task.model
    table0, lens0 = np.array(m.table), np.array(m.lens)
    opt = task.optimizer(cfg)
    opt.init(m.trainable_parameters())
    step = make_step(m, task.loss_fn, opt, cfg.grad_clip, compile=cfg.compile)
    for s in range(cfg.steps):
        out = step({key: mx.array(v) for key, v in task.train_batch(s).items()})
        mx.eval(out, m.state, opt.state)
        frozen = np.array_equal(np.array(m.table), table0)
        assert frozen == (s + 1 <= k), f"after step {s + 1}"
        assert not np.array_equal(np.array(m.lens), lens0)


def test_freeze_embeddings_help_says_the_lens_still_trains(capsys):
    """The help said "Keep the table fixed", read as the student's embeddings; with -1 (the
    whole run) the checkpoints' token_embd.weight still changed (stories260K, steps 2 to 4: by
    up to 0.0086 against an RMS of 0.31), as the lens trains."""
    with pytest.raises(SystemExit):
        main(["--recipe", "warm-start", "--help"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert ("--warm.freeze-embeddings INT Keep the donor's table fixed for the first K steps (0: "
            "never, -1: the whole run); the lens still trains, so the student's embeddings "
            "(table @ lens, the checkpoint's token_embd.weight) still change. (default: 0)"
            ) in out


def test_freezing_whole_run(tmp_path, stories_path, text_file):
    cfg = _cfg(stories_path, text_file, steps=3, freeze_embeddings=-1)
    task = ws.build(cfg, run_ops(cfg))
    table0 = np.array(task.model.table)
    run = tmp_path / "run"
    run.mkdir()
    train(task, cfg, run, {})
    np.testing.assert_array_equal(np.array(task.model.table), table0)
    start = next(e for e in read_events(run) if e["kind"] == "run_start")
    assert start["model"]["n_trainable"] == start["model"]["n_params"] - table0.size


def test_resume_across_the_unfreeze_is_exact(tmp_path, stories_path, text_file):
    flags = ["--recipe", "warm-start", "--donor", str(stories_path), "--data.path", text_file,
             *W32_FLAGS, "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2",
             "--steps", "8", "--checkpoint-every", "4", "--eval-every", "4",
             "--warm.freeze-embeddings", "5", "--no-progress", "--runs-root", str(tmp_path)]
    assert main([*flags, "--run-id", "full"]) == 0
    assert main([*flags, "--run-id", "part", "--stop-at", "4"]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--no-progress"]) == 0

    def losses(run):
        return [e["loss"] for e in read_events(tmp_path / run) if e["kind"] == "step"]

    assert len(losses("part")) == 8
    np.testing.assert_allclose(losses("part"), losses("full"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_half_precision_checkpoint_resumes_exactly(tmp_path, stories_path, text_file, dtype):
    """--save-dtype f16 or bf16 rounds the folded token_embd.weight in the GGUF, and the resume
    compared it with the side file's table @ lens at 1e-5: every such run stopped with "table @
    lens: expected to equal step_2.gguf's token_embd.weight, found a mismatch ...; no intact
    checkpoint is left". Now it resumes, with the losses of a run never stopped."""
    flags = ["--recipe", "warm-start", "--donor", str(stories_path), "--data.path", text_file,
             *W32_FLAGS, "--seq-len", "32", "--batch-size", "4", "--steps", "4",
             "--checkpoint-every", "2", "--save-dtype", dtype, "--no-progress",
             "--runs-root", str(tmp_path)]
    assert main([*flags, "--run-id", "full"]) == 0
    assert main([*flags, "--run-id", "part", "--stop-at", "2"]) == 0
    assert main(["--resume", str(tmp_path / "part"), "--no-progress"]) == 0

    def losses(run):
        return [e["loss"] for e in read_events(tmp_path / run) if e["kind"] == "step"]

    assert len(losses("part")) == 4 and losses("part") == losses("full")


def test_a_modelfile_of_a_run_without_an_adapter_says_the_line_to_write(tmp_path, stories_path,
                                                                         text_file, capsys):
    """`toymlx-export --base RUN --format modelfile` of a warm-start (or from-scratch) run said
    "expected --adapter ..., found no --adapter": now it says the one-line Modelfile such a model
    takes, with its checkpoint's absolute path, and writes nothing."""
    from cli_errors import error_line
    from toymlx_cli.export import main as export_main

    assert main(["--recipe", "warm-start", "--donor", str(stories_path), "--data.path", text_file,
                 *W32_FLAGS, "--seq-len", "32", "--batch-size", "4", "--steps", "1",
                 "--no-progress", "--runs-root", str(tmp_path), "--run-id", "w"]) == 0
    capsys.readouterr()
    out = tmp_path / "ollama-out"
    assert export_main(["--base", str(tmp_path / "w"), "--format", "modelfile", "--out",
                        str(out)]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: --format modelfile: expected --adapter (a LoRA run or adapter "
        f"GGUF), found --base {tmp_path / 'w'} alone: a model with no adapter takes a Modelfile "
        f"of one line, FROM {(tmp_path / 'w' / 'weights' / 'step_1.gguf').absolute()} (then "
        "ollama create NAME -f Modelfile)")
    assert not out.exists()


def test_vocab_cut(stories_path, text_file):
    task = _build(_cfg(stories_path, text_file, vocab=300))
    assert task.model.table.shape == (300, 64) and task.model.args.vocab_size == 300


def test_a_vocab_cut_that_loses_byte_tokens_is_refused(stories_path, text_file, shared_file):
    """`--warm.vocab 100` of stories260K (SentencePiece, byte tokens <0x00>..<0xFF> at ids
    3-258) read every letter from "a" (<0x61>, id 100) up as the unknown token: 84% of the
    Python docs' tokens were <unk>, and the run trained on them without a word. With a
    byte-level BPE donor (SmolLM2) such letters were left out of the text ("naïve world" as
    "naveworld")."""
    from toymlx.gguf.reader import GGUFFile

    for vocab in (100, 258):
        with pytest.raises(ValueError) as e:
            _build(_cfg(stories_path, text_file, vocab=vocab))
        assert str(e.value) == (
            "--warm.vocab: expected at least 259 (the donor's byte tokens, which spell any text, "
            f"end at id 258), found {vocab}: a character whose bytes' tokens are cut would be "
            "read as the unknown token")
    assert _build(_cfg(stories_path, text_file, vocab=259)).model.args.vocab_size == 259
    # byte-level BPE: SmolLM2's byte characters (235 of the 256: bytes never in UTF-8 text
    # left out) are ids 17-251, after its 17 special tokens
    meta = dict(GGUFFile(shared_file("tokenizers/ggml-vocab-smollm2.gguf")).metadata)
    assert ws.byte_tokens_end(meta) == 252
    with pytest.raises(ValueError) as e:
        ws.check_bytes_kept(meta, 200)
    assert str(e.value) == (
        "--warm.vocab: expected at least 252 (the donor's byte tokens, which spell any text, end "
        "at id 251), found 200: a character whose bytes' tokens are cut would be left out of "
        "the text")
    ws.check_bytes_kept(meta, 252)


# ---- the learning figure -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("student", ["pca32", "identity64"])
def test_warm_beats_random_table(tmp_path, shared_file, stories_path, student):
    """Same student, seed, data and steps; only the table's values differ (donor vs noise)."""
    text = str(shared_file("text/tinyshakespeare.txt"))
    shape = ({"d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}
             if student == "pca32" else
             {"d_model": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 172})
    lens = "pca" if student == "pca32" else "identity"
    val: dict[str, list[float]] = {"donor": [], "random": []}
    for seed in range(3):
        for init, losses in val.items():
            cfg = _cfg(stories_path, text, model=shape, lens=lens, init=init, seed=seed,
                       steps=150, warmup=20, seq_len=128, batch_size=16, eval_batches=16,
                       eval_every=0, checkpoint_every=0)
            run = tmp_path / f"{student}-{init}-{seed}"
            run.mkdir()
            train(ws.build(cfg, run_ops(cfg)), cfg, run, {})
            evals = [e for e in read_events(run) if e["kind"] == "eval"]
            losses.append(evals[-1]["val_loss"])
    # measured (scripts/warm_vs_scratch.py, 200 steps): pca32 -0.29, identity64 -0.13 nats
    assert all(w < r for w, r in zip(val["donor"], val["random"])), val
    assert np.mean(val["donor"]) < np.mean(val["random"]) - 0.03, val


def test_test_scores_the_folders_test_jsonl_in_the_donors_tokens(tmp_path, stories_path,
                                                                  text_file, capsys):
    """--test on an mlx-lm data folder: test.jsonl tokenized by the donor's tokenizer, scored at
    the end as toymlx-eval --split test scores it; a single text file is refused before
    training."""
    import json

    from cli_errors import error_line
    from toymlx_cli.eval import main as eval_main

    from toymlx.data.tokenizer import Tokenizer

    paras = [p for p in Path(text_file).read_text().split("\n\n") if p.strip()]
    data = tmp_path / "data"
    data.mkdir()
    for name, part in (("train", paras[:-10]), ("valid", paras[-10:-5]), ("test", paras[-5:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in part))
    flags = ["--recipe", "warm-start", "--donor", str(stories_path), *W32_FLAGS, "--seq-len",
             "32", "--batch-size", "4", "--eval-batches", "2", "--steps", "2", "--no-compile",
             "--no-progress", "--runs-root", str(tmp_path), "--test"]
    assert main([*flags, "--data.path", str(data), "--run-id", "w"]) == 0
    events = read_events(tmp_path / "w")
    g = GGUFFile(stories_path)
    ids = Tokenizer.from_metadata(g.metadata).encode("\n\n".join(paras[-5:]))
    assert events[0]["config"]["test_tokens"] == len(ids)
    test = events[-2]
    assert (test["kind"], test["split"]) == ("eval", "test")
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "w"), "--split", "test"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"] == str(data / "test.jsonl")
    assert out["test_loss"] == pytest.approx(test["test_loss"], abs=1e-5)
    assert main([*flags, "--data.path", text_file, "--run-id", "x"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: --test: expected --data.path to be a data folder with test.jsonl, "
        f"found {text_file}, a single file with no test split (give a folder with train.jsonl "
        "and test.jsonl, mlx-lm's layout)")
    assert not (tmp_path / "x").exists()
