"""Fused exports in any file type (toymlx.gguf.quantize) on a tiny random Llama, as a user runs
them: the base's own type as the default, gguf-py's types without llama-cpp-python (hidden from
a child process by a shadowing package), one-line refusals, a full disk and a kill leaving
nothing under the final name, the Modelfile FROM the fused file, and --fuse-at-end. The same
against llama.cpp's quantizer and on SmolLM2 are in test_quantize_smollm.py."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from slow_llama_cpp import slow_llama_cpp

from toymlx.bundle.events import check_toy_v1
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import load_llama, write_llama
from toymlx.gguf.quantize import (
    EXPORT_TYPES,
    file_type,
    llama_quantize,
    own_type,
    write_model_gguf,
)
from toymlx.gguf.reader import DIGEST_KEY, GGUFError, GGUFFile
from toymlx.interop.merge import write_merged
from toymlx.interop.modelfile import parse_modelfile
from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import apply_lora, lora_layers
from toymlx.training.adapter import apply_adapter, write_adapter

ARGS = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, context=128)
TOKENS = mx.array([[1, 72, 101, 108, 108, 111, 35, 120, 44, 200, 3, 17]])
NO_LLAMA_CPP = "raise ImportError('llama_cpp hidden by the test: an install without it')\n"


def tiny_base(path: Path, file_type: int | None = None) -> Path:
    """A random tiny Llama as an F32 GGUF; `file_type` overrides what general.file_type says."""
    mx.random.seed(5)
    extra = {} if file_type is None else {"general.file_type": file_type}
    write_llama(path, Llama(ARGS), byte_tokenizer().to_metadata(), extra=extra, name="tiny")
    return path


@pytest.fixture(scope="module")
def base_and_run(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny base and a LoRA run folder (weights/latest) with a non-zero adapter."""
    d = tmp_path_factory.mktemp("quant")
    base = tiny_base(d / "tiny.gguf")
    model, g = load_llama(base)
    apply_lora(model, "q,v,down", rank=4, alpha=8.0)
    mx.random.seed(1)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.1
    run = d / "run"
    (run / "weights").mkdir(parents=True)
    write_adapter(run / "weights" / "adapter_step_4.gguf", model, dict(g.metadata))
    (run / "weights" / "latest").symlink_to("adapter_step_4.gguf")
    return base, run


def export(*argv: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """toymlx-export in a child process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "toymlx_cli.export", *argv], check=False,
                          capture_output=True, text=True, env=env, timeout=300, **kw)


def without_llama_cpp(tmp_path: Path) -> dict:
    """An environment whose `import llama_cpp` fails: a package of that name first on the path."""
    shim = tmp_path / "shim" / "llama_cpp"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(NO_LLAMA_CPP)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _stop_in_quantizer(cmd: list[str], out: Path, sig: int, env: dict
                       ) -> tuple[subprocess.Popen, int, str]:
    """`cmd` started, sent `sig` once llama.cpp's quantizer writes `out`'s temporary; the
    command, the quantizer's process id, and its stderr once it has ended (20 s at most)."""
    import time

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    tmp = out.with_name(f".{out.name}.tmp-{p.pid}")
    while not (tmp.exists() and tmp.read_text()):
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    quantizer = int(tmp.read_text())
    p.send_signal(sig)
    try:
        err = p.communicate(timeout=20)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{cmd[2]} still running 20 s after {signal.Signals(sig).name}, "
                             "in llama.cpp's quantizer") from None
    return p, quantizer, err


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_in_llama_cpp_s_quantizer_acts_at_once(base_and_run, tmp_path, sig):
    """toymlx-export --fuse --dtype q4_k_m stopped (Ctrl-C, SIGTERM) while llama.cpp's quantizer
    runs: it waited for the whole quantizer call (2.6-3.6 s on SmolLM2-135M; here 120 s) before
    exiting. Now the quantizer's child process is killed: exit 128 + the signal (130, 143: as toymlx-train) within 20 s, the quantizer
    gone, nothing left under the output's name, no temporary."""
    base, run = base_and_run
    out = tmp_path / "out" / "fused.gguf"
    out.parent.mkdir()
    p, quantizer, err = _stop_in_quantizer(
        [sys.executable, "-m", "toymlx_cli.export", "--base", str(base), "--adapter", str(run),
         "--fuse", "--dtype", "q4_k_m", "--out", str(out)], out, sig, slow_llama_cpp(tmp_path))
    assert p.returncode == 128 + sig, err
    # a line that says so (it printed an empty line)
    assert err.endswith("\ntoymlx-export: " + ("interrupted" if sig == signal.SIGINT else
                                                "stopped by SIGTERM") + "\n"), err[-500:]
    assert quantizer != p.pid and _gone(quantizer)
    assert list(out.parent.iterdir()) == []


FAILING_LLAMA_CPP = """\
# llama_cpp as a test stands it in: a quantizer that logs two tensors' progress, then fails
import ctypes
class _Params(ctypes.Structure):
    _fields_ = [("ftype", ctypes.c_int)]
_log = [None]
def llama_model_quantize_default_params():
    return _Params()
def llama_log_callback(f):
    return f
def llama_log_set(callback, user_data):
    _log[0] = callback
def llama_model_quantize(src, dst, params):
    for line in ("[   1/   2] token_embd.weight\\n", "[   2/   2] output.weight\\n",
                 "llama_model_quantize: failed to quantize: No space left on device\\n"):
        _log[0](2, line.encode(), None)
    return 1
"""


def test_llama_quantize_shows_its_bar_and_fails_in_llama_cpp_s_words(tmp_path, monkeypatch,
                                                                       capfd):
    """llama.cpp's quantizer in its child process (`in_child`): its progress bar on this
    process's stderr as it runs, and its own "failed" line in the OSError."""
    shim = tmp_path / "failing" / "llama_cpp"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(FAILING_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with pytest.raises(OSError, match=r"^llama\.cpp's quantizer \(q4_0\): its process \(.* -m "
                       r"toymlx\.gguf\.quantize\) failed: llama_model_quantize: failed to "
                       r"quantize: No space left on device$"):
        llama_quantize(tmp_path / "in.gguf", tmp_path / "out.gguf", "q4_0", progress=True)
    bar = r"\rquantizing q4_0 \(llama\.cpp\): 100%\|\S+\| 2/2 \["
    assert re.search(bar, capfd.readouterr().err)


@pytest.mark.interop  # the resume writes the file with llama.cpp's own quantizer
def test_a_stop_in_the_fuse_at_end_quantizer_acts_at_once(tmp_path):
    """toymlx-train --fuse-at-end q4_k_m stopped by SIGTERM in llama.cpp's quantizer: it waited
    for the whole call (1.6-1.7 s on SmolLM2-135M; here 120 s). Now it ends interrupted at once
    (exit 143, the export named as left undone), the quantizer gone, no file or temporary of
    the export; a resume writes it (llama.cpp's own quantizer)."""
    base = tiny_base(tmp_path / "tiny.gguf")
    run = tmp_path / "r"
    out = run / "fused-q4_k_m.gguf"
    p, quantizer, err = _stop_in_quantizer(
        [sys.executable, "-m", "toymlx_cli.train", "--recipe", "lora", "--base", str(base),
         "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "2", "--batch-size", "2",
         "--seq-len", "32", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1",
         "--lora.rank", "4", "--no-progress", "--no-compile", "--fuse-at-end", "q4_k_m"],
        out, signal.SIGTERM, slow_llama_cpp(tmp_path))
    assert p.returncode == 143, err
    assert err.splitlines()[-1].startswith(
        "toymlx: interrupted at step 2: stopped by SIGTERM during the export (all 2 steps "
        "trained, checkpoint step_2 written): left undone: the export; ")
    assert quantizer != p.pid and _gone(quantizer)
    assert not [f for f in run.iterdir() if "fused" in f.name]
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.train", "--resume", str(run),
                        "--no-progress"], check=False, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert GGUFFile(out).metadata["general.file_type"] == 15  # MOSTLY_Q4_K_M


def test_own_type_reads_general_file_type(tmp_path):
    assert own_type(GGUFFile(tiny_base(tmp_path / "f32.gguf"))) == "f32"
    assert own_type(GGUFFile(tiny_base(tmp_path / "km.gguf", 15))) == "q4_k_m"
    assert own_type(GGUFFile(tiny_base(tmp_path / "g.gguf", 3 | 1024))) == "q4_1"  # guessed
    with pytest.raises(GGUFError, match=r"iq2_xxs.gguf: metadata key 'general.file_type': its "
                       r"type iq2_xxs is not one toymlx writes .*; pass --dtype"):
        own_type(GGUFFile(tiny_base(tmp_path / "iq2_xxs.gguf", 19)))


def test_without_llama_cpp_gguf_py_types_work_and_others_are_refused(base_and_run, tmp_path):
    """Q8_0 is gguf-py's (every matrix, bytes equal to gguf.quants.quantize of the fused F32
    model); Q4_K_M, asked for or the base's own, is refused in one line naming the extra."""
    base, run = base_and_run
    env = without_llama_cpp(tmp_path)
    f32 = write_merged(tmp_path / "fused-f32.gguf", base, run, "f32")
    q8 = tmp_path / "fused-q8.gguf"
    r = export("--base", str(base), "--adapter", str(run), "--fuse", "--dtype", "q8_0",
               "--out", str(q8), env=env)
    assert r.returncode == 0, r.stderr
    g, ref = GGUFFile(q8), GGUFFile(f32)
    assert g.metadata["general.file_type"] == 7 and DIGEST_KEY not in g.metadata  # an export
    assert "general.quantization_version" not in g.metadata  # which llama.cpp would have added
    for name in ref.tensors:
        w = ref.load(name, np.float32)
        if w.ndim == 1:
            assert g.tensors[name].type.name == "F32"
            continue
        assert g.tensors[name].type.name == "Q8_0"
        assert g.raw(name).tobytes() == quantize(w, GGMLQuantizationType.Q8_0).tobytes(), name
    want = np.array(load_llama(f32)[0](TOKENS))
    assert 1e-4 < np.abs(np.array(load_llama(q8)[0](TOKENS)) - want).max() < 0.05
    out = tmp_path / "fused-q4km.gguf"
    r = export("--base", str(base), "--adapter", str(run), "--fuse", "--dtype", "q4_k_m",
               "--out", str(out), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [(
        "toymlx-export: error: --dtype q4_k_m: expected llama.cpp's quantizer for this type, "
        "found llama-cpp-python not installed (pip install \"toymlx[interop]\"); without it "
        "toymlx writes f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1")]
    assert not out.exists() and not list(tmp_path.glob(".*tmp-*"))
    km = tiny_base(tmp_path / "claims-q4_k_m.gguf", 15)  # a base whose own type is Q4_K_M
    r = export("--base", str(km), "--adapter", str(run), "--fuse", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr  # the default keeps the base's bytes: no quantizer needed
    g, b = GGUFFile(out), GGUFFile(km)
    assert g.metadata["general.file_type"] == 15
    adapted = {n for n in b.tensors if n.endswith(("attn_q.weight", "attn_v.weight",
                                                   "ffn_down.weight"))}
    assert len(adapted) == 6 and all(g.tensors[n].type.name == "F32" for n in adapted)
    assert all(g.raw(n).tobytes() == b.raw(n).tobytes() for n in set(b.tensors) - adapted)


def test_adapter_kept_measures_the_share_of_the_update_in_the_file(base_and_run, tmp_path):
    """1 for the F32 fused file (float32 rounding aside), 0 for the base itself, and for a
    file holding base + delta/2 (written by hand) one half."""
    from toymlx.training.adapter import load_adapter
    from toymlx.training.fused import adapter_kept, kept_note

    base, run = base_and_run
    f32 = write_merged(tmp_path / "f32.gguf", base, run, "f32")
    assert abs(adapter_kept(f32, base, run) - 1.0) < 1e-4
    assert adapter_kept(base, base, run) == 0.0
    ad, g = load_adapter(run), GGUFFile(base)
    half = {n: g.load(n, np.float32) for n in g.tensors}
    for n in ad.pairs:
        half[n] = (half[n] + 0.5 * ad.delta(n, half[n])).astype(np.float32)
    write_model_gguf(tmp_path / "half.gguf", dict(g.metadata), dict(g.metadata_types), half,
                     "f32")
    assert abs(adapter_kept(tmp_path / "half.gguf", base, run) - 0.5) < 1e-4
    assert kept_note(0.06, "q4_1") == (
        "keeps 6% of the adapter's change on the adapted layers' outputs (warning: the rest is "
        "lost to q4_1's rounding; to keep the fine-tune, export without --dtype (each adapted "
        "tensor in a type that keeps its change), or --dtype q8_0 or f16, or run the base with "
        "the adapter: llama-cli --lora)")
    # a type's warning suggests only finer types: never the one that lost the change
    assert kept_note(0.44, "f16") == (
        "keeps 44% of the adapter's change on the adapted layers' outputs (warning: the rest is "
        "lost to f16's rounding; to keep the fine-tune, export without --dtype (each adapted "
        "tensor in a type that keeps its change), or --dtype f32, or run the base with the "
        "adapter: llama-cli --lora)")
    assert "or --dtype f16 or f32, or run" in kept_note(0.3, "q8_0")
    assert "or --dtype f16 or f32, or run" in kept_note(0.3, "bf16")
    # never the type that lost it: q8_0 offers f16 or f32; --fuse-at-end names its own choices
    assert kept_note(0.0, "q8_0", "--fuse-at-end") == (
        "keeps 0% of the adapter's change on the adapted layers' outputs (warning: the rest is "
        "lost to q8_0's rounding; to keep the fine-tune, --fuse-at-end base (each adapted tensor "
        "in a type that keeps its change), or --fuse-at-end f16 or f32, or run the base with the "
        "adapter: llama-cli --lora)")
    assert "or --dtype f32, or run" in kept_note(0.1, "f16")


def test_adapter_retention_tells_rounding_noise_from_an_erased_change(base_and_run, tmp_path):
    """`along`, the share of the change the file's weights move along: 1 for the F32 fused file,
    0 for the base, 1/2 for base + delta/2, and still 1 for base + delta + noise 3x the change's
    size that knows nothing of it (`kept` 0 there: the noise counts against it). The note says
    such a file keeps the change under noise, and calls a change lost only where it is erased
    (a Q4_1 base fused into Q4_1; measured on SmolLM2 in RESULTS.md, session 45)."""
    from toymlx.training.adapter import load_adapter
    from toymlx.training.fused import Retention, adapter_retention, kept_note

    base, run = base_and_run
    f32 = adapter_retention(write_merged(tmp_path / "f32.gguf", base, run, "f32"), base, run)
    assert f32.kept > 0.9999 and f32.along > 0.9999 and f32.noise < 1e-4
    assert adapter_retention(base, base, run) == (0.0, 0.0, 1.0)
    ad, g = load_adapter(run), GGUFFile(base)
    w = {n: g.load(n, np.float32) for n in g.tensors}
    rng = np.random.default_rng(0)
    for name, share, noise in (("half", 0.5, 0.0), ("noisy", 1.0, 3.0)):
        t = dict(w)
        for n in ad.pairs:
            d = ad.delta(n, w[n]).astype(np.float64)
            e = rng.standard_normal(d.shape)
            e -= np.vdot(e, d) / np.vdot(d, d) * d  # no part along the change
            e *= noise * np.linalg.norm(d) / np.linalg.norm(e)
            t[n] = (w[n] + share * d + e).astype(np.float32)
        write_model_gguf(tmp_path / f"{name}.gguf", dict(g.metadata), dict(g.metadata_types), t,
                         "f32")
        r = adapter_retention(tmp_path / f"{name}.gguf", base, run)
        assert abs(r.along - share) < 1e-4 and abs(r.noise - max(noise, 1 - share)) < 1e-3
        assert abs(r.kept - max(0.0, 1 - r.noise)) < 1e-9
    # closed like the warning: toymlx-export appends " in 29.6 s", which read as llama-cli's
    assert kept_note(Retention(0.0, 0.97, 34.9), "q4_k_m") == (
        "keeps 97% of the adapter's change in its weights, under q4_k_m's rounding noise 34.9x "
        "the change's size on the adapted layers' outputs (so 0% kept by that measure: the noise "
        "of any file rounded to q4_k_m; the held-out gain measures what the fine-tune kept; to "
        "keep the change exact, export without --dtype (each adapted tensor in a type that keeps "
        "its change), or --dtype q8_0 or f16, or run the base with the adapter: llama-cli --lora)")
    # a change the rounding erased is still called lost, with the same figure as a float gives
    assert kept_note(Retention(0.0, 0.2, 1.05), "q4_1") == kept_note(0.0, "q4_1")
    assert "the rest is lost to q4_1's rounding" in kept_note(0.0, "q4_1")
    assert kept_note(Retention(0.9, 0.99, 0.1), "q8_0") == kept_note(0.9, "q8_0")


def test_default_is_the_base_own_type(base_and_run, tmp_path):
    """No --dtype: the base's general.file_type (here F32, and a base that says Q8_0 over F32
    tensors: its tensors stay F32); --dtype q8_0: every matrix re-quantized."""
    base, run = base_and_run
    out = write_merged(tmp_path / "a.gguf", base, run)
    assert GGUFFile(out).metadata["general.file_type"] == 0
    assert GGUFFile(out).tensors["blk.0.attn_q.weight"].type.name == "F32"
    q8base = tiny_base(tmp_path / "q8.gguf", 7)
    out = write_merged(tmp_path / "b.gguf", q8base, run)
    assert GGUFFile(out).metadata["general.file_type"] == 7
    assert GGUFFile(out).tensors["blk.1.ffn_down.weight"].type.name == "F32"
    out = write_merged(tmp_path / "c.gguf", q8base, run, "q8_0")
    assert GGUFFile(out).tensors["blk.1.ffn_down.weight"].type.name == "Q8_0"


def _limit_file_size(limit: int):
    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


@pytest.mark.parametrize("dtype", ["f32", "q4_0"])
def test_full_disk_leaves_nothing_under_the_final_name(base_and_run, tmp_path, dtype):
    """A write that cannot finish (files capped below the model's size, as a full disk does):
    exit 2, one line naming the file, the old file kept, no temporary left behind."""
    base, run = base_and_run
    out = tmp_path / "fused.gguf"
    out.write_bytes(b"the previous export")
    r = export("--base", str(base), "--adapter", str(run), "--fuse", "--dtype", dtype,
               "--out", str(out), "--overwrite", preexec_fn=_limit_file_size(40_000))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"toymlx-export: error: {out}: could not write the {dtype} model (")
    assert "File too large" in line and line.endswith("nothing was written under this name")
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.gguf"]


def test_full_disk_removes_the_folders_the_export_made(base_and_run, tmp_path):
    """--out in folders that do not exist yet: a write that cannot finish removes the folders
    it made (sub/dir), not the one that was there (sub, holding nothing)."""
    base, run = base_and_run
    (tmp_path / "sub").mkdir()
    out = tmp_path / "sub" / "dir" / "deeper" / "fused.gguf"
    r = export("--base", str(base), "--adapter", str(run), "--fuse", "--dtype", "f32",
               "--out", str(out), preexec_fn=_limit_file_size(40_000))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"toymlx-export: error: {out}: could not write the f32 model (")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["sub"]


def test_stale_temporaries_of_a_killed_export_are_removed(base_and_run, tmp_path):
    """What a SIGKILLed writer left (its pid gone) goes at the next write of the same name;
    a live writer's temporary stays."""
    base, run = base_and_run
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    out = tmp_path / "m.gguf"
    left = [tmp_path / f".m.gguf.f32.tmp-{dead}", tmp_path / f".m.gguf.tmp-{dead}"]
    live = tmp_path / f".m.gguf.tmp-{os.getppid()}"
    for p in [*left, live]:
        p.write_bytes(b"partial")
    write_merged(out, base, run, "f32")
    assert not any(p.exists() for p in left) and live.exists()
    assert GGUFFile(out).metadata["toy.merged_adapter"] == "adapter_step_4.gguf"


def test_modelfile_from_the_fused_file(base_and_run, tmp_path):
    """--format modelfile --fuse: DIR/fused-TYPE.gguf (the base's type) and FROM it, no ADAPTER."""
    from toymlx_cli.export import main

    base, run = base_and_run
    assert main(["--adapter", str(run), "--base", str(base), "--format", "modelfile", "--fuse",
                 "--out", str(tmp_path / "ollama")]) == 0
    fused = tmp_path / "ollama" / "fused-f32.gguf"
    lines = parse_modelfile((tmp_path / "ollama" / "Modelfile").read_text())
    assert ("FROM", str(fused.absolute())) in lines and not [c for c, _ in lines if
                                                            c == "ADAPTER"]
    adapted = apply_adapter(load_llama(base)[0], run)
    diff = np.abs(np.array(load_llama(fused)[0](TOKENS)) - np.array(adapted(TOKENS))).max()
    assert diff < 1e-5


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_fuse_at_end_writes_the_run_fused_model(tmp_path, kind):
    """--fuse-at-end base on a base whose own type is Q8_0: after the last step,
    <run>/fused-q8_0.gguf (an `export` event), the same bytes as toymlx-export --fuse of the
    run's final adapter (full: of its final checkpoint, whose export defaults to the type of
    the base it was trained from)."""
    from toymlx_cli.train import main

    base = tiny_base(tmp_path / "q8.gguf", 7)
    assert main(["--recipe", "lora", "--fine-tune-type", kind, "--base", str(base),
                 "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "2",
                 "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--warmup", "1",
                 "--eval-every", "0", "--eval-batches", "1",
                 *([] if kind == "full" else ["--lora.rank", "4"]),
                 "--no-progress", "--no-compile", "--fuse-at-end", "base"]) == 0
    run = tmp_path / "r"
    events = [json.loads(s) for s in (run / "events.jsonl").read_text().splitlines()]
    ex = [e for e in events if e["kind"] == "export"]
    assert events[-1]["kind"] == "run_end" and events[-1]["exit_code"] == 0
    assert check_toy_v1(events) == []
    assert len(ex) == 1 and ex[0]["path"] == "fused-q8_0.gguf" and ex[0]["type"] == "q8_0"
    fused = run / "fused-q8_0.gguf"
    assert ex[0]["bytes"] == fused.stat().st_size
    if kind == "full":
        assert "adapter_kept" not in ex[0]
        again = write_merged(tmp_path / "again.gguf", run, None)
    else:
        assert 0.9 < ex[0]["adapter_kept"] <= 1.1
        again = write_merged(tmp_path / "again.gguf", base, run)
    assert again.read_bytes() == fused.read_bytes()


def test_write_model_gguf_refuses_an_unknown_type(tmp_path):
    with pytest.raises(ValueError, match=r"--dtype: expected one of f32, f16, .*, found 'q4_k'"):
        write_model_gguf(tmp_path / "x.gguf", {}, {}, {}, "q4_k")
    assert not list(tmp_path.iterdir())


# ---- llama.cpp's quantizer, every architecture (interop) -----------------------------------
@pytest.mark.interop
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                  "smollm3", "granite", "olmo2"])
def test_every_architecture_fused_in_a_k_quant_mixture(kind, tmp_path):
    """The same path for every architecture: an adapter on every projection fused into
    Q4_K_M equals llama-quantize's output for the F32 fused export, byte for byte; llama.cpp
    runs it, its logits within 1.5 times its own Q4_K_M margin (the base quantized the same
    way, against the base) of the F32 fused model's."""
    from arch_files import arch_gguf
    from llamacpp_runner import llamacpp_logits, quantize

    base = arch_gguf(kind, tmp_path / f"{kind}.gguf")
    model, g = load_llama(base)
    apply_lora(model, "qkv,o,gate_up,down" if kind == "phi3" else "q,k,v,o,gate,up,down",
               rank=4, alpha=8.0)
    mx.random.seed(2)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    ad = write_adapter(tmp_path / "adapter.gguf", model, dict(g.metadata))
    out = write_merged(tmp_path / "fused-q4_k_m.gguf", base, ad, "q4_k_m")
    f32 = write_merged(tmp_path / "fused-f32.gguf", base, ad, "f32")
    ref = tmp_path / "llama-quantize.gguf"
    quantize(f32, ref, "Q4_K_M")
    assert GGUFFile(out).metadata["general.file_type"] == 15
    assert out.read_bytes() == ref.read_bytes()
    base_q = tmp_path / "base-q4_k_m.gguf"
    quantize(base, base_q, "Q4_K_M")
    ids = [int(x) for x in np.random.default_rng(1).integers(3, 259, 20)]
    cpp = {k: llamacpp_logits(p, ids)[0] for k, p in
           (("fused", out), ("fused_f32", f32), ("base_q", base_q), ("base", base))}

    def mean(a: str, b: str) -> float:
        return float(np.abs(cpp[a] - cpp[b]).mean())

    margin, effect = mean("base_q", "base"), mean("fused_f32", "base")
    print(f"\n[fuse-quant] {kind} q4_k_m: fused vs its f32 {mean('fused', 'fused_f32'):.4f}, "
          f"base margin {margin:.4f}, adapter effect {effect:.4f}")
    assert effect > 1e-2 and mean("fused", "fused_f32") <= 1.5 * margin


def test_fuse_at_end_that_cannot_write_ends_the_run_as_an_error(base_and_run, tmp_path):
    """The fused model cannot be written (files capped, as a full disk does): the run ends
    `error`, exit 1, naming the intact checkpoint; no fused file, no temporary."""
    base, _ = base_and_run
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.train", "--recipe", "lora", "--base",
                        str(base), "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "2",
                        "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
                        "--eval-batches", "1", "--lora.rank", "4", "--no-progress",
                        "--no-compile", "--fuse-at-end", "f32"], check=False,
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=_limit_file_size(40_000))
    assert r.returncode == 1, r.stderr
    end = json.loads((tmp_path / "r" / "events.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "run_end" and end["reason"] == "error" and end["exit_code"] == 1
    assert end["message"].startswith("training completed and step 2 was written, but its "
                                     f"export failed: {tmp_path / 'r' / 'fused-f32.gguf'}: "
                                     "could not write the f32 model (")
    assert (tmp_path / "r" / "weights" / "latest").resolve().name == "adapter_step_2.gguf"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "config.json", "events.jsonl", "weights"]


@pytest.mark.interop
@pytest.mark.parametrize("dtype", [t for t in EXPORT_TYPES if t != "f32"])
def test_every_export_type_is_llama_quantize_s_file(base_and_run, tmp_path, dtype):
    """Each type toymlx offers: the fused file equals llama-quantize's from the F32 fused
    export, has that general.file_type, and toymlx reads it back (gguf-py dequantizes it) to
    finite logits near the F32 fused model's (2-bit types included, so a loose bound)."""
    from llamacpp_runner import quantize

    base, run = base_and_run
    out = write_merged(tmp_path / f"fused-{dtype}.gguf", base, run, dtype)
    f32 = write_merged(tmp_path / "fused-f32.gguf", base, run, "f32")
    ref = tmp_path / "llama-quantize.gguf"
    quantize(f32, ref, dtype.upper())
    assert out.read_bytes() == ref.read_bytes()
    assert GGUFFile(out).metadata["general.file_type"] == int(file_type(dtype))
    got = np.array(load_llama(out)[0](TOKENS))
    want = np.array(load_llama(f32)[0](TOKENS))
    assert np.isfinite(got).all() and np.abs(got - want).mean() < 0.5 * np.abs(want).mean()


def test_a_file_without_its_file_type_exports_in_the_type_of_its_matrices(stories_path,
                                                                        smollm_like_q8):
    """As llama.cpp's loader guesses: stories260K (no general.file_type, F32 matrices) -> f32;
    the same with Q8_0 matrices and the key removed -> q8_0."""
    assert "general.file_type" not in GGUFFile(stories_path).metadata
    assert own_type(GGUFFile(stories_path)) == "f32"
    assert own_type(GGUFFile(smollm_like_q8)) == "q8_0"



@pytest.fixture
def smollm_like_q8(stories_path, tmp_path) -> Path:
    """stories260K's tensors with its matrices in Q8_0 where rows allow (gguf-py; most of
    them) and no general.file_type."""
    import gguf

    src, out = GGUFFile(stories_path), tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for name, t in src.tensors.items():
        arr = src.load(name)
        if len(t.shape) >= 2 and t.shape[-1] % 32 == 0:  # Q8_0's blocks (the FFN's 172 stay)
            w.add_tensor(name, quantize(arr, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K])
def test_quantize_tensor_hands_llama_cpp_whole_rows_a_chunk_at_a_time(qtype, monkeypatch):
    """`quantize_tensor` calls llama.cpp's `ggml_quantize_chunk` on `CHUNK_VALUES` values at a
    time (a stop's handler runs between two; one call on a 1B model's tensor held a SIGTERM
    to `toymlx-export --fuse` ~2.7 s): a (4100, 512) tensor in 3 calls of 2048, 2048 and 4 rows,
    the bytes of one call on it all."""
    from toymlx.gguf import quantize as qz
    from toymlx.gguf.fuse import tensor_nbytes

    fn = qz.ggml_quantize_chunk()
    if fn is None:
        pytest.skip("llama-cpp-python not installed")
    w = np.random.default_rng(3).standard_normal((4100, 512)).astype(np.float32)
    whole = np.empty(tensor_nbytes(qtype, w.shape), np.uint8)
    assert fn(int(qtype), w.ctypes.data, whole.ctypes.data, 0, 4100, 512, None) == whole.nbytes
    calls = []

    def counted(*a):
        calls.append((a[3], a[4]))
        return fn(*a)
    monkeypatch.setattr(qz, "ggml_quantize_chunk", lambda: counted)
    got = qz.quantize_tensor(w, qtype)
    assert calls == [(0, 2048), (2048 * 512, 2048), (4096 * 512, 4)]
    assert got.tobytes() == whole.tobytes()


def test_llama_cpp_s_quantizer_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """llama.cpp's quantizer stopped by a full disk says only "basic_ios::clear: iostream
    error" (toymlx-export --dtype q8_0 of SmolLM2-135M on a 600 MiB tmpfs): now the export's
    error is ENOSPC naming the file, with what its F32 input and the part written took; a
    failure on a disk with room stays llama.cpp's own words. Nothing is left either way."""
    import errno

    from toymlx.backend import atomic
    from toymlx.gguf import quantize as q

    iostream = ("llama.cpp's quantizer (q8_0): its process (python -m toymlx.gguf.quantize) "
                "failed: llama_model_quantize: failed to quantize: basic_ios::clear: iostream "
                "error")

    f32_sizes = []

    def part_written(src, dst, dtype, progress=False):
        f32_sizes.append(Path(src).stat().st_size)
        Path(dst).write_bytes(b"\0" * (3 << 19))  # 1.5 MiB
        raise OSError(iostream)

    monkeypatch.setattr(q, "llama_cpp_module", lambda: object())
    monkeypatch.setattr(q, "llama_quantize", part_written)
    tensors = {"token_embd.weight": np.zeros((1024, 256), np.float32)}  # 1 MiB
    out = tmp_path / "q8.gguf"
    with pytest.raises(OSError) as e:
        write_model_gguf(out, {"general.architecture": "llama"}, {}, tensors, "q8_0")
    assert str(e.value) == f"{out}: could not write the q8_0 model ({iostream}); nothing was " \
                           "written under this name"
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 4096)
    with pytest.raises(OSError) as e:
        write_model_gguf(out, {"general.architecture": "llama"}, {}, tensors, "q8_0")
    assert e.value.__cause__.errno == errno.ENOSPC
    assert str(e.value) == (
        f"{out}: could not write the q8_0 model ([Errno 28] No space left on device ({iostream};"
        f" its F32 input beside the file takes {f32_sizes[-1] / 2**20:.1f} MiB, and 1.5 MiB of the "
        f"q8_0 file were written as the disk filled): '{out}'); nothing was written under this "
        "name")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_at_llama_cpp_s_f32_input_says_which_file_takes_the_room(tmp_path,
                                                                              monkeypatch):
    """A full disk as the F32 input for llama.cpp is written (toymlx-export --dtype q8_0 of
    SmolLM2-135M on a 100 MiB disk) said "the file takes 514.8 MiB" of the q8_0 file, which
    takes 138 MiB: now it says the room is the F32 input's, the q8_0 file needing its own."""
    import errno

    from toymlx.backend import atomic
    from toymlx.gguf import quantize as q

    real_open = open

    def full_disk(path, mode="r", *a, **k):
        if "w" in mode and ".f32" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(q, "llama_cpp_module", lambda: object())
    monkeypatch.setattr(atomic, "open", full_disk, raising=False)
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 3 << 19)
    tensors = {"token_embd.weight": np.zeros((1024, 256), np.float32)}  # 1 MiB
    out = tmp_path / "q8.gguf"
    with pytest.raises(OSError) as e:
        write_model_gguf(out, {"general.architecture": "llama"}, {}, tensors, "q8_0")
    assert str(e.value) == (
        f"{out}: could not write the q8_0 model ([Errno 28] No space left on device (the file "
        "takes 1.0 MiB; 1.5 MiB are free there); that file is llama.cpp's F32 input, written "
        f"beside it first, and the q8_0 file then needs room beside it: '{out}'); nothing was "
        "written under this name")
    assert list(tmp_path.iterdir()) == []


def test_matrices_left_unquantized_for_their_rows_are_named(tmp_path):
    """llama-quantize keeps a matrix whose rows are not a multiple of 32 in F16 (a from-scratch
    model 48 wide: `--dtype q4_k_m` wrote 7 of 8 matrices F16 under file type Q4_K_M), said
    only in its log: the export now says how many, their rows and what quantizes them. A
    quantized matrix, a float one of whole blocks (a router kept F32) and 1-D norms are not
    counted."""
    from toymlx.gguf.quantize import unquantized_note
    from toymlx.gguf.writer import QuantTensor, write_gguf

    rng = np.random.default_rng(0)
    w64 = rng.standard_normal((8, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, {
        "blk.0.attn_q.weight": rng.standard_normal((48, 48)).astype(np.float16),
        "blk.0.ffn_down.weight": rng.standard_normal((48, 80)).astype(np.float16),
        "blk.0.ffn_gate_inp.weight": w64,
        "blk.0.ffn_up.weight": QuantTensor(GGMLQuantizationType.Q8_0,
                                           quantize(w64, GGMLQuantizationType.Q8_0), (8, 64)),
        "blk.0.attn_norm.weight": np.ones(48, np.float32)})
    assert unquantized_note(path, "q4_k_m") == (
        "2 of its 4 matrices stay F16, not q4_k_m: their rows (48, 80 values) are not a multiple "
        "of the 32 a quantized block holds; a model whose widths are multiples of 32 (256 for "
        "k-quants) quantizes them all (a new model's: --model.d-model, --model.ffn-dim; a base's "
        "are its own); 1 of its 4 matrices are quantized in a 32-value block type, not q4_k_m's "
        "256-value Q4_K: their rows (64 values) are not a multiple of 256, and llama.cpp's "
        "quantizer fell back (Q8_0: blk.0.ffn_up.weight); widths that are multiples of 256 get "
        "q4_k_m's own blocks")
    assert unquantized_note(path, "f16") is None  # asked for floats: nothing to say


@pytest.mark.interop
def test_an_export_quantized_where_rows_do_not_fit_a_block_says_so(tmp_path, capsys):
    """toymlx-export --dtype q4_k_m of a model 48 wide: the file says Q4_K_M, its matrices are
    F16 (llama.cpp's fallback); the warning line after the wrote line names them."""
    from toymlx_cli.export import main as export_main

    mx.random.seed(5)
    base = tmp_path / "w48.gguf"
    write_llama(base, Llama(tiny(d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                 context=64)), byte_tokenizer().to_metadata(), name="w48")
    out = tmp_path / "q.gguf"
    assert export_main(["--base", str(base), "--out", str(out), "--dtype", "q4_k_m"]) == 0
    g = GGUFFile(out)
    assert g.metadata["general.file_type"] == int(file_type("q4_k_m"))
    floats = sorted(n for n, t in g.tensors.items()
                    if len(t.shape) == 2 and t.type == GGMLQuantizationType.F16)
    mats = [n for n, t in g.tensors.items() if len(t.shape) == 2]
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"toymlx-export: warning: {out}: {len(floats)} of its {len(mats)} matrices stay F16, not "
        "q4_k_m: their rows (48 values) are not a multiple of the 32 a quantized block holds; a "
        "model whose widths are multiples of 32 (256 for k-quants) quantizes them all (a new "
        "model's: --model.d-model, --model.ffn-dim; a base's are its own); 1 of its 8 matrices are "
        "quantized in a 32-value block type, not q4_k_m's 256-value Q4_K: their rows (96 values) "
        "are not a multiple of 256, and llama.cpp's quantizer fell back (Q8_0: "
        "blk.0.ffn_down.weight); widths that are multiples of 256 get q4_k_m's own blocks")
    assert len(floats) == len(mats) - 1  # ffn_down's rows (96) are whole 32-value blocks


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_fuse_at_end_quantized_where_rows_do_not_fit_a_block_says_so(tmp_path, capsys, kind):
    """toymlx-train --fuse-at-end q8_0 on a base 48 wide: toymlx-export --dtype q8_0 warned that
    llama.cpp left its matrices F16, the run's own export said nothing (the adapter's fused
    file and a full fine-tune's alike); both now print the one warning after the file."""
    from toymlx_cli.train import main as train_main

    mx.random.seed(5)
    base = tmp_path / "w48.gguf"
    write_llama(base, Llama(tiny(d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                 context=64)), byte_tokenizer().to_metadata(), name="w48")
    assert train_main(["--recipe", "lora", "--fine-tune-type", kind, "--base", str(base),
                       "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "1",
                       "--batch-size", "2", "--seq-len", "32", "--warmup", "1",
                       "--eval-every", "0", "--eval-batches", "1", "--no-progress",
                       "--no-compile", "--fuse-at-end", "q8_0"]) == 0
    out = tmp_path / "r" / "fused-q8_0.gguf"
    mats = [t for t in GGUFFile(out).tensors.values() if len(t.shape) == 2]
    left = [t for t in mats if t.type == GGMLQuantizationType.F16]
    assert left and len(left) < len(mats)  # ffn_down's rows (96) are whole blocks
    assert (f"toymlx: warning: {out}: {len(left)} of its {len(mats)} matrices stay F16, not "
            "q8_0: their rows (48 values) are not a multiple of the 32 a quantized block holds; "
            "a model whose widths are multiples of 32 (256 for k-quants) quantizes them all (a "
            "new model's: --model.d-model, --model.ffn-dim; a base's are its own)"
            ) in capsys.readouterr().err.splitlines()


def test_k_quant_matrices_given_a_32_value_block_type_are_named(tmp_path):
    """A k-quant's rows not a multiple of 256 get a 32-value block type from llama-quantize
    (Q4_K_M: Q5_0 or Q8_0), said only in its log: the file was q4_k_m by name, no Q4_K in it,
    and the export said nothing. The note names the tensors and the type each got (each
    block's alike once, with their count); a Q4_K matrix 256 wide and q8_0 asked for are not
    counted."""
    from toymlx.gguf.quantize import block_type, unquantized_note
    from toymlx.gguf.writer import QuantTensor, write_gguf

    rng = np.random.default_rng(0)
    w64 = rng.standard_normal((8, 64)).astype(np.float32)

    def q(w: np.ndarray, t: GGMLQuantizationType) -> QuantTensor:
        return QuantTensor(t, quantize(w, t), w.shape)

    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, {
        "token_embd.weight": q(w64, GGMLQuantizationType.Q8_0),
        "blk.0.attn_q.weight": q(w64, GGMLQuantizationType.Q5_0),
        "blk.1.attn_q.weight": q(w64, GGMLQuantizationType.Q5_0),
        "blk.0.ffn_down.weight": q(w64, GGMLQuantizationType.Q8_0),
        "blk.0.ffn_up.weight": QuantTensor(GGMLQuantizationType.Q4_K,  # gguf-py encodes none
                                           np.zeros((8, 144), np.uint8), (8, 256)),
        "blk.0.attn_norm.weight": np.ones(64, np.float32)})
    assert unquantized_note(path, "q4_k_m") == (
        "4 of its 5 matrices are quantized in a 32-value block type, not q4_k_m's 256-value "
        "Q4_K: their rows (64 values) are not a multiple of 256, and llama.cpp's quantizer fell "
        "back (Q5_0: blk.*.attn_q.weight (2); Q8_0: token_embd.weight, blk.0.ffn_down.weight); "
        "widths that are multiples of 256 get q4_k_m's own blocks")
    assert unquantized_note(path, "q8_0") is None  # 32-value blocks were asked for
    assert [block_type(t) for t in ("q4_k_m", "q6_k", "iq4_xs", "q3_k_l", "q8_0")] == [
        GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ4_XS,
        GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q8_0]


@pytest.mark.interop
def test_an_export_to_a_k_quant_where_rows_do_not_fit_256_says_what_it_got(tmp_path, capsys):
    """toymlx-export --dtype q4_k_m of the tiny model (64 wide, ffn 96): llama.cpp gives every
    matrix Q5_0 or Q8_0; the warning after the wrote line names each with its type."""
    from toymlx_cli.export import main as export_main

    base = tiny_base(tmp_path / "tiny.gguf")
    out = tmp_path / "q.gguf"
    assert export_main(["--base", str(base), "--out", str(out), "--dtype", "q4_k_m"]) == 0
    types = {n: t.type.name for n, t in GGUFFile(out).tensors.items() if len(t.shape) == 2}
    assert set(types.values()) == {"Q5_0", "Q8_0"}
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-export: warning: {out}: 15 of its 15 matrices are quantized in a 32-value block "
        "type, not q4_k_m's 256-value Q4_K: their rows (64, 96 values) are not a multiple of "
        "256, and llama.cpp's quantizer fell back (Q5_0: blk.*.attn_k.weight (2), "
        "blk.*.attn_output.weight (2), blk.*.attn_q.weight (2), blk.0.attn_v.weight, "
        "blk.0.ffn_down.weight, blk.*.ffn_gate.weight (2), blk.*.ffn_up.weight (2); Q8_0: "
        "token_embd.weight, blk.1.attn_v.weight, blk.1.ffn_down.weight); widths that are "
        "multiples of 256 get q4_k_m's own blocks")
