"""A multi-part GGUF (llama.cpp's gguf-split layout, written here by gguf-py's own GGUFWriter)
reads as the one file it was split from: every tensor bit for bit, the same LoRA losses, every
part recorded; a missing, foreign or misplaced part is one line naming the file, the key and the
expected value."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_errors import error_line
from gguf_split import split_gguf
from mlx.utils import tree_flatten
from toymlx_cli.export import main as export_main
from toymlx_cli.train import main as train_main

from toymlx.bundle import model_store
from toymlx.bundle.inputs import locate_input, model_record
from toymlx.bundle.options import RunError
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import load_llama, write_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.llama import Llama, tiny

CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
N_TENSORS = 20  # tiny(n_layers=2): token_embd, output_norm, 9 per block (tied output)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> tuple[Path, list[Path]]:
    """(a tiny Llama GGUF written by toymlx, its 3 parts) in a folder of their own."""
    root = tmp_path_factory.mktemp("split")
    mx.random.seed(5)
    meta = byte_tokenizer().to_metadata()
    meta["tokenizer.chat_template"] = CHATML
    single = root / "whole" / "tiny.gguf"
    single.parent.mkdir()
    write_llama(single, Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                   context=256)), meta, name="tiny split llama")
    (root / "parts").mkdir()
    parts = split_gguf(single, root / "parts" / "tiny.gguf", per_part=8)
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return single, parts


def _copy(parts: list[Path], where: Path) -> list[Path]:
    where.mkdir(parents=True)
    return [Path(shutil.copy(p, where / p.name)) for p in parts]


def test_the_parts_read_as_the_one_file(model_files):
    single, parts = model_files
    with GGUFFile(single) as one, GGUFFile(parts[0]) as whole:
        assert whole.paths == [str(p) for p in parts]
        assert sorted({i.part for i in whole.tensors.values()}) == [0, 1, 2]
        assert len(whole.tensors) == N_TENSORS
        assert whole.metadata == one.metadata  # split.* keys are the parts', not the model's
        assert not any(k.startswith("split.") for k in whole.metadata_types)
        for name, info in one.tensors.items():
            assert (whole.tensors[name].shape, whole.tensors[name].type) == (info.shape,
                                                                             info.type)
            assert whole.raw(name).tobytes() == one.raw(name).tobytes(), name
        whole.verify_digest()  # toymlx's digest of the data, over the parts in order
        assert whole.file_bytes == sum(p.stat().st_size for p in parts)
    a, ga = load_llama(single)
    b, gb = load_llama(parts[0])
    ga.close()
    gb.close()
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert sorted(pa) == sorted(pb)
    for k, v in pa.items():  # bit for bit
        assert np.array(v).tobytes() == np.array(pb[k]).tobytes(), k


def test_a_damaged_part_fails_the_digest(model_files, tmp_path):
    parts = _copy(model_files[1], tmp_path / "p")
    data = bytearray(parts[2].read_bytes())
    data[-40] ^= 0xFF  # inside the last tensor of the last part
    parts[2].write_bytes(bytes(data))
    with GGUFFile(parts[0]) as g, pytest.raises(GGUFError) as e:
        g.verify_digest()
    assert str(e.value).startswith(f"{parts[0]} (and its 2 other parts): tensor data: expected "
                                   "sha256 ")


def test_a_missing_part_is_named(model_files, tmp_path):
    parts = _copy(model_files[1], tmp_path / "p")
    parts[1].unlink()
    with pytest.raises(GGUFError) as e:
        GGUFFile(parts[0])
    assert str(e.value) == (f"{parts[1]}: part 2 of 3: expected the GGUF file (metadata key "
                            "'split.count' of tiny-00001-of-00003.gguf is 3), found nothing at "
                            "that path; put every part beside the first")


def test_a_part_of_another_model_is_named(model_files, tmp_path):
    single, parts = model_files
    other = split_gguf(single, tmp_path / "other.gguf", per_part=10)  # 2 parts
    parts = _copy(parts, tmp_path / "p")
    shutil.copy(other[1], parts[1])
    with pytest.raises(GGUFError) as e:
        GGUFFile(parts[0])
    assert str(e.value) == (f"{parts[1]}: metadata key 'split.count': expected 3 (as in "
                            "tiny-00001-of-00003.gguf), found 2; this file is a part of another "
                            "model: put this model's part there")


def test_parts_out_of_order_are_named(model_files, tmp_path):
    parts = _copy(model_files[1], tmp_path / "p")
    swap = tmp_path / "swap"
    parts[1].rename(swap)
    parts[2].rename(parts[1])
    swap.rename(parts[2])
    with pytest.raises(GGUFError) as e:
        GGUFFile(parts[0])
    assert str(e.value) == (f"{parts[1]}: metadata key 'split.no': expected 1 (part 2 of 3), "
                            "found 2; the parts are out of order or renamed: give each its "
                            "llama.cpp name")


def test_a_later_part_or_a_renamed_first_part_is_refused(model_files, tmp_path, capsys):
    parts = _copy(model_files[1], tmp_path / "p")
    with pytest.raises(GGUFError) as e:
        GGUFFile(parts[1])
    assert str(e.value) == (f"{parts[1]}: metadata key 'split.no': expected 0 (the first part of "
                            "a 3-part GGUF), found 1; give the first part, "
                            "tiny-00001-of-00003.gguf")
    renamed = parts[0].rename(tmp_path / "p" / "tiny.gguf")
    with pytest.raises(GGUFError) as e:
        GGUFFile(renamed)
    assert str(e.value) == (f"{renamed}: file name: expected tiny-00001-of-00003.gguf (the first "
                            "of 3 parts, metadata key 'split.count' 3), found tiny.gguf; the "
                            "parts are found by their llama.cpp names: rename them as "
                            "llama-gguf-split named them")
    assert train_main(["--recipe", "lora", "--base", str(parts[1]), "--runs-root",
                       str(tmp_path / "runs"), "--run-id", "r", "--steps", "1",
                       "--no-progress", "--no-compile"]) == 2
    assert error_line(capsys).endswith("found 1; give the first part, tiny-00001-of-00003.gguf")


LORA = ["--steps", "3", "--batch-size", "2", "--seq-len", "64", "--warmup", "1",
        "--eval-every", "0", "--checkpoint-every", "0", "--no-progress", "--no-compile"]


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "events.jsonl").read_text().splitlines()
            if json.loads(ln).get("kind") == "step"]


def test_lora_on_the_parts_trains_as_on_the_one_file(model_files, tmp_path, capsys):
    single, parts = model_files
    for run, base in (("one", single), ("parts", parts[0])):
        rc = train_main(["--recipe", "lora", "--base", str(base), "--runs-root",
                         str(tmp_path / "runs"), "--run-id", run, *LORA])
        assert rc == 0, capsys.readouterr().err
    one, split = _losses(tmp_path / "runs" / "one"), _losses(tmp_path / "runs" / "parts")
    assert len(one) == 3 and all(np.isfinite(one))
    assert split == one  # the same numbers, to the last bit
    saved = json.loads((tmp_path / "runs" / "parts" / "config.json").read_text())
    rec = saved["model_files"]["base"]
    want = [(str(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in parts]
    assert rec["file"] == str(parts[0])
    assert [(p["file"], p["sha256"]) for p in rec["parts"]] == want
    start = json.loads((tmp_path / "runs" / "parts" / "events.jsonl").read_text()
                       .splitlines()[0])
    assert [(p["file"], p["sha256"]) for p in start["config"]["base_parts"]] == want
    assert "parts" not in json.loads((tmp_path / "runs" / "one" / "config.json").read_text()
                                     )["model_files"]["base"]
    # the fused export of the parts' run: one file, the same tensors as the one file's run's
    for run in ("one", "parts"):
        assert export_main(["--adapter", str(tmp_path / "runs" / run), "--fuse", "--out",
                            str(tmp_path / f"fused-{run}.gguf")]) == 0
    with GGUFFile(tmp_path / "fused-one.gguf") as a, GGUFFile(tmp_path / "fused-parts.gguf") as b:
        assert b.paths == [str(tmp_path / "fused-parts.gguf")]
        assert not any(k.startswith("split.") for k in b.metadata)
        assert sorted(b.tensors) == sorted(a.tensors)
        assert all(a.raw(n).tobytes() == b.raw(n).tobytes() for n in a.tensors)


@pytest.mark.interop
def test_llama_cpp_reads_the_parts_and_their_fused_export_as_the_one_file(model_files,
                                                                          tmp_path, capsys):
    from llamacpp_runner import llamacpp_logits

    single, parts = model_files
    ids = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    one, parted = llamacpp_logits(single, ids)[0], llamacpp_logits(parts[0], ids)[0]
    assert one.shape == (len(ids), 259) and np.array_equal(parted, one)
    assert train_main(["--recipe", "lora", "--base", str(parts[0]), "--runs-root",
                       str(tmp_path / "runs"), "--run-id", "r", "--lr", "1e-2", *LORA]) == 0
    fused = tmp_path / "fused.gguf"
    assert export_main(["--adapter", str(tmp_path / "runs" / "r"), "--fuse", "--out",
                        str(fused)]) == 0
    got = llamacpp_logits(fused, ids)[0]
    assert np.abs(got - one).max() > 1e-4  # the fine-tune is in it
    model, g = load_llama(fused)
    g.close()
    ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(got - ours).max() < 1e-3, np.abs(got - ours).max()


def test_a_resume_names_a_part_that_changed(model_files, tmp_path):
    parts = _copy(model_files[1], tmp_path / "p")
    rec = model_record(str(parts[0]), "--base")
    assert len(rec["parts"]) == 3
    assert locate_input("base", rec, "config.json")[0] == str(parts[0])
    data = bytearray(parts[2].read_bytes())
    data[-40] ^= 0xFF
    parts[2].write_bytes(bytes(data))
    digest = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(RunError) as e:
        locate_input("base", rec, "config.json")
    assert str(e.value) == (f"{parts[0]}: --base: expected the file the run started on (sha256 "
                            f"{rec['sha256'][:12]}, and 2 more parts), found other contents "
                            f"(part 3 {parts[2]} with sha256 {digest[:12]}); put the run's base "
                            "back there")


def test_a_store_name_of_a_multi_part_gguf_opens_whole(model_files, tmp_path, monkeypatch):
    parts = model_files[1]
    root = tmp_path / "lms"
    _copy(parts, root / "pub")  # LM Studio's PUBLISHER/REPO folder, flattened to one level
    monkeypatch.setenv("LMSTUDIO_MODELS", str(root))
    assert model_store.list_lmstudio(root) == ["pub/tiny-00001-of-00003.gguf"]
    found = model_store.resolve("lmstudio:tiny", "--base")
    assert found.path == root / "pub" / "tiny-00001-of-00003.gguf"
    assert [Path(p["file"]).name for p in found.record("base")["base_parts"]] == [
        p.name for p in parts]


def test_a_gguf_of_two_parts_names_its_other_part_as_one(model_files, tmp_path):
    """A two-part GGUF's messages said "its 1 other parts" and "and 1 more parts"."""
    (tmp_path / "two").mkdir()
    parts = split_gguf(model_files[0], tmp_path / "two" / "tiny.gguf", per_part=10)
    assert len(parts) == 2
    rec = model_record(str(parts[0]), "--base")
    data = bytearray(parts[1].read_bytes())
    data[-40] ^= 0xFF  # inside the last tensor of the second part
    parts[1].write_bytes(bytes(data))
    with GGUFFile(parts[0]) as g, pytest.raises(GGUFError) as e:
        g.verify_digest()
    assert str(e.value).startswith(f"{parts[0]} (and its 1 other part): tensor data: expected "
                                   "sha256 ")
    with pytest.raises(RunError) as e:
        locate_input("base", rec, "config.json")
    assert f"(sha256 {rec['sha256'][:12]}, and 1 more part), found other contents" in str(e.value)
