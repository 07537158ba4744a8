"""The file people run, given back: a LoRA trained on SmolLM2-135M-Instruct (Q4_1, and a
Q4_K_M copy llama.cpp's quantizer makes): fused by `toymlx-export --fuse` with no type given
(a 4-step fine-tune no file within 1.10x the base keeps half of: the file grows past it); with the base's own
type as --dtype; with --exact-size; and `--dtype q4_k_m` from the Q4_1 base.

Each --dtype file is checked against `llama-quantize` (llama.cpp's `llama_model_quantize` in a
child process) run on the F32 fused export: every tensor's type and bytes equal, every
metadata key equal, the whole file equal; each file's size against the base's; and llama.cpp's logits on it against its
logits on the F32 fused model (f32 KV cache, flash attention off). The margin: llama.cpp on a
quantized file differs from the same model in F32 by its own rounding of the weights (and of
the activations, to 8 bits) -- `base_margin`, measured on the base (the quantized base vs its
F32 copy) -- and re-quantizing a fine-tune onto a 4-bit grid can round away at most the
fine-tune's own effect (`effect`, F32 fused vs F32 base): the fused file's logits stay within
`base_margin + effect` of the F32 fused model's, and the figures are printed for
docs/RESULTS.md, with the share of the adapter's update each file holds (`adapter_kept`, and `along`: `adapter_retention`). Last, a killed export (SIGTERM, SIGKILL) leaves nothing under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from llamacpp_runner import llamacpp_logits, quantize
from smollm import smollm_gguf  # noqa: F401  (session fixture)

from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.reader import DIGEST_KEY, GGUFFile
from toymlx.interop.merge import write_merged
from toymlx.training.fused import adapter_retention, kept_note

pytestmark = [pytest.mark.smollm, pytest.mark.interop]

TEXT = ("What does Python's functools.lru_cache do, and when should I avoid it?",
        "It caches the results of a function so that repeated calls with the same arguments")


def export(*argv: str) -> str:
    """toymlx-export in a child process, as a user runs it; its "wrote" line, and after it the
    held-out line of a fused export."""
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.export", *argv], check=False,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return "\n".join(s for s in r.stderr.splitlines()
                     if s.startswith(("toymlx-export: wrote", "toymlx-export: held-out")))


def check_gain(said: str, regrid: bool) -> float:
    """The held-out line's share of the fine-tune's gain against (base - fused) / (base - base +
    adapter) of its three printed losses (4 decimals each: the percentage within that rounding),
    and its --dtype remark where the export rounded the base's own tensors onto another grid
    (`regrid`) and kept under half; where the line says the gain is noise (the run's
    --eval-batches 1 x --batch-size 2 rows are fewer than 5), the gain it prints instead;
    returns the share."""
    held = said.splitlines()[-1]
    m = re.fullmatch(r"toymlx-export: held-out loss .*: base ([\d.]+) \(scored here\), base \+ "
                     r"adapter ([\d.]+) \(.+\), fused file ([\d.]+) \(.+?\); (.+)", held)
    assert m, said
    base, tuned, fused = (float(m[i]) for i in (1, 2, 3))
    gain = base - tuned
    assert gain > 0.001, said  # the fixture's 4 steps at 2e-3 lower the held-out loss
    share = (base - fused) / gain
    slack = 100 * 2e-4 / gain + 0.5  # three losses rounded to 4 decimals, the share to 1%
    noise = re.match(r"the fine-tune's held-out gain on \d+ validation rows? (?:is within|cannot "
                     r"be told from) noise(?: on so few rows)? \(([\d.]+) ", m[4])
    if noise:  # no share given: the gain it names is the printed losses' (each to 4 decimals)
        assert abs(float(noise[1]) - gain) <= 1e-4 + 1e-9, said
        return share
    pct = re.match(r"the fused file keeps (\d+)% of the fine-tune's held-out gain", m[4])
    if pct:
        assert abs(int(pct[1]) - 100 * share) <= slack, (said, share)
    else:
        assert m[4].startswith("the fused file keeps all" if share > 1 else
                               "the fused file keeps none"), (said, share)
    assert ("rounded the base's own tensors onto its grid too" in m[4]) == (
        regrid and share < 0.5), said
    return share


def train(base: Path, runs: Path, run_id: str) -> Path:
    """A LoRA trained a few steps on `base` (toymlx-train in a child process)."""
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.train", "--recipe", "lora",
                        "--base", str(base), "--runs-root", str(runs), "--run-id", run_id,
                        "--steps", "4", "--batch-size", "2", "--seq-len", "96", "--lr", "2e-3",
                        "--warmup", "1", "--lora.targets", "q,v", "--eval-every", "0",
                        "--eval-batches", "1", "--no-progress"],
                       check=False, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return runs / run_id


@pytest.fixture(scope="module")
def work(smollm_gguf, tmp_path_factory) -> Iterator[dict]:  # noqa: F811
    """The Q4_1 base, its F32 copy, a Q4_K_M base made from that by llama.cpp, a LoRA run on
    each, and the evaluation tokens (a chat prompt and the start of an answer). The folder,
    where the tests also write their exports (with the F32 copy, three F32 fused files of
    513 MiB each: ~3.3 GB in all), is removed after the module: pytest keeps the last few temp
    folders."""
    d = tmp_path_factory.mktemp("fusequant")
    f32 = write_merged(d / "base-f32.gguf", smollm_gguf, None, "f32")
    q4km = d / "base-q4_k_m.gguf"
    quantize(f32, q4km, "Q4_K_M")
    tok = Tokenizer.from_gguf(smollm_gguf)
    text = tok.apply_chat_template([{"role": "user", "content": TEXT[0]}], True) + TEXT[1]
    yield {"dir": d, "q4_1": smollm_gguf, "f32": f32, "q4_k_m": q4km,
           "run_q4_1": train(smollm_gguf, d / "runs", "q4_1"),
           "run_q4_k_m": train(q4km, d / "runs", "q4_k_m"),
           "ids": tok.encode(text, add_bos=False)}
    shutil.rmtree(d, ignore_errors=True)


def mean_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(mean |a - b|, max |a - b|, top-1 agreement) of two (T, V) logit arrays."""
    d = np.abs(a - b)
    return float(d.mean()), float(d.max()), float((a.argmax(-1) == b.argmax(-1)).mean())


def check_fused(work: dict, base: Path, run: Path, dtype: str, qtype: str,
                base_q: Path) -> dict:
    """Fuse `run` into `base` at `dtype`, and check the file against llama-quantize's from the
    F32 fused export, and its logits; returns the figures."""
    d = work["dir"]
    name = f"{base.stem}-{dtype}"
    out = d / f"{name}.gguf"
    t0 = time.perf_counter()
    said = export("--base", str(base), "--adapter", str(run), "--fuse", "--out", str(out),
                  "--dtype", dtype)
    seconds = time.perf_counter() - t0
    kept = adapter_retention(out, base, run)  # as the export's line reports it
    f32 = d / f"{name}-f32.gguf"
    export("--base", str(base), "--adapter", str(run), "--fuse", "--dtype", "f32",
           "--out", str(f32))
    mine = GGUFFile(out)
    assert f"it {kept_note(kept, dtype)} in " in said
    # base_q is the base itself where --dtype is the base's own type, else its grid's copy
    gain = check_gain(said, regrid=base_q != base)
    ref = d / f"{name}-llama-quantize.gguf"
    quantize(f32, ref, qtype)
    theirs = GGUFFile(ref)
    assert mine.metadata["general.file_type"] == theirs.metadata["general.file_type"]
    assert list(mine.tensors) == list(theirs.tensors)
    for t in mine.tensors:
        assert mine.tensors[t].type == theirs.tensors[t].type, t
        assert mine.raw(t).tobytes() == theirs.raw(t).tobytes(), t
    assert theirs.metadata == mine.metadata and DIGEST_KEY not in mine.metadata
    assert out.read_bytes() == ref.read_bytes()
    ids = work["ids"]
    cpp = {k: llamacpp_logits(p, ids)[0] for k, p in
           (("fused", out), ("fused_f32", f32), ("base_q", base_q), ("base_f32", work["f32"]))}
    figures = {"type": qtype, "bytes": out.stat().st_size, "base_bytes": base.stat().st_size,
               "export_s": round(seconds, 1), "types": _type_counts(out),
               "adapter_kept": round(kept.kept, 3), "along": round(kept.along, 3),
               "gain_kept": round(gain, 3)}
    for key, (a, b) in {"fused_vs_f32": ("fused", "fused_f32"),
                        "base_margin": ("base_q", "base_f32"),
                        "effect": ("fused_f32", "base_f32"),
                        "fused_vs_base_q": ("fused", "base_q")}.items():
        figures[key] = [round(x, 4) for x in mean_diff(cpp[a], cpp[b])]
    print(f"\n[fuse-quant] {name}: {json.dumps(figures)}")
    m_fused, m_base, effect = (figures[k][0] for k in ("fused_vs_f32", "base_margin", "effect"))
    assert m_fused <= m_base + effect  # mean |logits| difference, llama.cpp on both
    assert figures["fused_vs_f32"][2] >= 0.85  # top-1 agreement with the F32 fused model
    return figures


@pytest.mark.parametrize("own", ["q4_1", "q4_k_m"])
def test_a_four_step_fine_tune_grows_the_default_file_and_is_rounded_on_its_data(work, own):
    """This fixture's 4-step LoRA moves the weights less than Q8_0's step: no file within 1.10x
    the base keeps half of its change, so the default export grows past 1.10x until the changed
    tensors keep it (saying what 1.10x would keep): every other tensor the base's bytes, and
    llama.cpp's logits on it nearer the F32 fused model's than on the base's own type (--dtype,
    llama-quantize's file, which keeps less than half); --exact-size writes the base's types
    and tensor sizes, rounded on the run's own activations."""
    base, run = work[own], work[f"run_{own}"]
    grown = work["dir"] / f"grown-{own}.gguf"
    said = export("--base", str(base), "--adapter", str(run), "--fuse", "--out", str(grown))
    m = re.search(r"it keeps (\d+)% of the fine-tune's change on the changed layers' outputs "
                  r".*; ([\d.]+)x the base's size \(within 1\.10x it would keep (\d+)%: "
                  r"--exact-size keeps the base's size, --dtype picks one type\)", said)
    assert m and int(m[1]) >= 90 and float(m[2]) > 1.10 and int(m[3]) < 50, said
    g, b = GGUFFile(grown), GGUFFile(base)
    changed = {n for n in b.tensors if g.raw(n).tobytes() != b.raw(n).tobytes()}
    assert changed and all(".attn_q." in n or ".attn_v." in n for n in changed), changed
    naive = check_fused(work, base, run, own, own.upper(), base)
    assert naive["adapter_kept"] < 0.5 and naive["types"] == _type_counts(base)
    f32 = work["dir"] / f"{base.stem}-{own}-f32.gguf"  # check_fused's F32 fused export
    ids = work["ids"]
    ref = llamacpp_logits(f32, ids)[0]
    near = {k: mean_diff(llamacpp_logits(p, ids)[0], ref)[0] for k, p in
            (("grown", grown), ("naive", work["dir"] / f"{base.stem}-{own}.gguf"))}
    print(f"\n[fuse-quant] {own}: {said}\n[fuse-quant] {own}: mean |logits - F32 fused| {near}")
    assert near["grown"] < near["naive"]
    exact = work["dir"] / f"exact-{own}.gguf"
    said = export("--base", str(base), "--adapter", str(run), "--fuse", "--exact-size",
                  "--out", str(exact))
    assert re.search(r"it keeps \d+% of the adapter's change on those activations", said)
    e = GGUFFile(exact)
    assert {n: (t.type, t.nbytes) for n, t in e.tensors.items()} == {
        n: (t.type, t.nbytes) for n, t in b.tensors.items()}
    print(f"[fuse-quant] {own}: {said}")


def test_dtype_q4_k_m_from_the_q4_1_base(work):
    """--dtype q4_k_m on a Q4_1 base's fine-tune: llama.cpp's mixture, bytes equal to
    llama-quantize's; the margin measured on the base quantized the same way."""
    base_q = work["dir"] / "base-q4_1-to-q4_k_m.gguf"
    quantize(work["f32"], base_q, "Q4_K_M")
    f = check_fused(work, work["q4_1"], work["run_q4_1"], "q4_k_m", "Q4_K_M", base_q)
    assert f["types"] == _type_counts(base_q)
    # docs/LORA.md's fallbacks, as the file holds them: SmolLM2's 576-wide rows are no multiple
    # of 256, so Q4_K_M's k-quants are in ffn_down alone (1,536-wide rows), every other matrix
    # in a 32-value block type: Q4_K's fallback Q5_0, and Q6_K's Q8_0 for the tied token table
    # and the v that Q4_K_M gives more bits (blocks 0-2, 5, 8, ... 26 and the last 3)
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    fused = GGUFFile(work["dir"] / f"{work['q4_1'].stem}-q4_k_m.gguf")  # check_fused's file
    types = {n: t.type.name for n, t in fused.tensors.items()}
    want = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32"}
    for i in range(30):
        want.update({f"blk.{i}.{n}.weight": "Q5_0" for n in
                     ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")})
        want.update({f"blk.{i}.attn_norm.weight": "F32", f"blk.{i}.ffn_norm.weight": "F32",
                     f"blk.{i}.attn_v.weight": "Q8_0" if i in more else "Q5_0",
                     f"blk.{i}.ffn_down.weight": "Q6_K" if i in more else "Q4_K"})
    assert types == want
    assert f["types"] == {"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15}
    # 100.6 MiB, 1.07x the Q4_1 base's 93.8
    assert (round(f["bytes"] / 2**20, 1), round(f["base_bytes"] / 2**20, 1)) == (100.6, 93.8)
    # another grid than the base's: the change survives under the noise, and the line says so
    assert f["along"] > 0.9, f


def _type_counts(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in GGUFFile(path).tensors.values():
        counts[t.type.name] = counts.get(t.type.name, 0) + 1
    return dict(sorted(counts.items()))


def _start_and_wait_for_quantizer(work: dict, out: Path) -> subprocess.Popen:
    """toymlx-export started, and returned once llama.cpp is writing its temporary."""
    p = subprocess.Popen([sys.executable, "-m", "toymlx_cli.export", "--base", str(work["q4_1"]),
                          "--adapter", str(work["run_q4_1"]), "--fuse", "--dtype", "q4_k_m",
                          "--out", str(out)], stderr=subprocess.PIPE, text=True)
    tmp = out.with_name(f".{out.name}.tmp-{p.pid}")
    while not tmp.exists():
        assert p.poll() is None, p.stderr.read()[-2000:]
        time.sleep(0.05)
    return p


def test_killed_export_leaves_nothing_under_the_final_name(work, tmp_path):
    """SIGTERM while llama.cpp quantizes: exit 143 (128 + SIGTERM), no file, no temporary. SIGKILL: no file;
    its temporaries go at the next export of that name, which succeeds."""
    out = tmp_path / "fused.gguf"
    p = _start_and_wait_for_quantizer(work, out)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=600) == 143
    assert not list(tmp_path.iterdir())
    p = _start_and_wait_for_quantizer(work, out)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    left = sorted(q.name for q in tmp_path.iterdir())
    assert left == [f".fused.gguf.f32.tmp-{p.pid}", f".fused.gguf.tmp-{p.pid}"]
    export("--base", str(work["q4_1"]), "--adapter", str(work["run_q4_1"]), "--fuse",
           "--dtype", "q4_k_m", "--out", str(out))
    assert sorted(q.name for q in tmp_path.iterdir()) == ["fused.gguf"]
    assert GGUFFile(out).metadata["general.file_type"] == 15
