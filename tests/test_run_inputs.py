"""A run's paths mean the files it started on, from any folder: config.json keeps the options as
typed and records each data and model file's absolute path and fingerprint (`runs.model_files`,
`runs.data_files`); eval, generate, export and resume read the recorded file, check a file found
any other way against the recorded SHA-256, and say which file they used."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from cli_errors import error_line
from test_lora import ARGS, mlx_lm_folder, tok_meta

from toymlx.gguf.llama import write_llama
from toymlx.models.llama import Llama


def _cli(name: str):
    import importlib

    return importlib.import_module(f"toymlx_cli.{name}").main


def tiny(path: Path, seed: int) -> Path:
    mx.random.seed(seed)
    write_llama(path, Llama(ARGS), tok_meta(), name="tiny test llama")
    return path


TRAIN = ["--steps", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
         "--eval-batches", "10", "--checkpoint-every", "2", "--no-progress", "--no-compile"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """`where/`: smol.gguf, data/ (mlx-lm layout), and runs/rel: a LoRA run trained from `where`
    with `--base smol.gguf --data.path data --test` (relative paths); `elsewhere/`: another
    smol.gguf (other weights, same shape) and another data/."""
    root = tmp_path_factory.mktemp("inputs")
    where, elsewhere = root / "where", root / "elsewhere"
    for d in (where, elsewhere):
        d.mkdir()
    tiny(where / "smol.gguf", 3)
    tiny(elsewhere / "smol.gguf", 5)
    mlx_lm_folder(where / "data")
    mlx_lm_folder(elsewhere / "data", n_train=14, n_valid=5, n_test=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                              "--test", "--runs-root", "runs", "--run-id", "rel", *TRAIN]) == 0
    return root


def run_eval(run: Path, split: str) -> dict:
    return [e for e in (json.loads(x) for x in (run / "events.jsonl").read_text().splitlines())
            if e["kind"] == "eval" and e.get("split", "val") == split][-1]


def test_config_keeps_the_typed_paths_and_records_the_files(trained):
    saved = json.loads((trained / "where" / "runs" / "rel" / "config.json").read_text())
    assert saved["config"]["base"] == "smol.gguf" and saved["config"]["data"]["path"] == "data"
    base = saved["model_files"]["base"]
    assert base["path"] == "smol.gguf" and base["file"] == str(trained / "where" / "smol.gguf")
    import hashlib

    assert base["sha256"] == hashlib.sha256(
        (trained / "where" / "smol.gguf").read_bytes()).hexdigest()
    assert saved["data_files"]["data.path"]["file"] == str(trained / "where" / "data")


def test_eval_from_another_folder_reads_the_recorded_base_and_data(trained, capsys,
                                                                   monkeypatch):
    """main scored elsewhere/smol.gguf on elsewhere/data (or refused the --test run)."""
    run = trained / "where" / "runs" / "rel"
    monkeypatch.chdir(trained / "elsewhere")
    capsys.readouterr()
    assert _cli("eval")(["--model", str(run), "--split", "test"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["test_loss"] == pytest.approx(run_eval(run, "test")["test_loss"], rel=1e-5)
    assert got["data"] == str(trained / "where" / "data" / "test.jsonl")
    assert (f"toymlx-eval: model {trained / 'where' / 'smol.gguf'} (the run's --base "
            "smol.gguf) + adapter") in err
    assert _cli("eval")(["--model", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(
        run_eval(run, "val")["val_loss"], rel=1e-5)
    assert _cli("generate")(["--model", str(run), "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert f"toymlx-generate: model {trained / 'where' / 'smol.gguf'} (the run's --base" in \
        capsys.readouterr().err


def test_a_moved_base_is_taken_only_with_its_recorded_sha256(trained, tmp_path, capsys,
                                                            monkeypatch):
    run = tmp_path / "runs" / "rel"
    shutil.copytree(trained / "where" / "runs" / "rel", run, symlinks=True)
    recorded = trained / "where" / "smol.gguf"
    monkeypatch.chdir(trained / "elsewhere")
    kept = tmp_path / "kept.gguf"
    shutil.move(recorded, kept)
    try:
        # gone: ./smol.gguf (elsewhere's, other weights) is refused, naming both files
        assert _cli("eval")(["--model", str(run)]) == 2
        line = error_line(capsys, "toymlx-eval")
        assert f"{trained / 'elsewhere' / 'smol.gguf'}: --base: expected the run's base, " \
               f"recorded as {recorded}" in line and "found other contents" in line
        # the same bytes found by the typed name: used, and said so
        monkeypatch.chdir(tmp_path)
        shutil.copy(kept, tmp_path / "smol.gguf")
        (tmp_path / "data").symlink_to(trained / "where" / "data")
        assert _cli("eval")(["--model", str(run)]) == 0
        assert (f"model {tmp_path / 'smol.gguf'} (the run's --base smol.gguf: {recorded} is "
                "gone, this file has its recorded SHA-256)") in capsys.readouterr().err
    finally:
        shutil.move(kept, recorded)


def test_a_changed_base_is_one_line_naming_the_file(trained, tmp_path, capsys):
    where = tmp_path / "w"
    where.mkdir()
    base = tiny(where / "b.gguf", 3)
    assert _cli("train")(["--recipe", "lora", "--base", str(base), "--runs-root",
                          str(tmp_path / "runs"), "--run-id", "c", *TRAIN]) == 0
    tiny(base, 7)  # the same name, other weights
    capsys.readouterr()
    for prog, argv in (("eval", ["--model", str(tmp_path / "runs" / "c")]),
                       ("export", ["--adapter", str(tmp_path / "runs" / "c"), "--fuse", "--out",
                                   str(tmp_path / "x.gguf")])):
        assert _cli(prog)(argv) == 2
        line = error_line(capsys, f"toymlx-{prog}")
        assert f"{base}: --base: expected the file the run started on (sha256" in line
        assert "found other contents" in line
    assert not (tmp_path / "x.gguf").exists()


def test_export_without_base_writes_the_same_bytes(trained, tmp_path, capsys, monkeypatch):
    run = trained / "where" / "runs" / "rel"
    monkeypatch.chdir(trained / "elsewhere")  # its ./smol.gguf must not be taken
    export = _cli("export")
    capsys.readouterr()
    assert export(["--adapter", str(run), "--fuse", "--out", str(tmp_path / "a.gguf")]) == 0
    err = capsys.readouterr().err
    assert (f"toymlx-export: no --base given: base {trained / 'where' / 'smol.gguf'} (the "
            "run's --base smol.gguf)") in err
    assert export(["--adapter", str(run), "--fuse", "--base", str(trained / "where" / "smol.gguf"),
                   "--out", str(tmp_path / "b.gguf")]) == 0
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert export(["--adapter", str(run), "--format", "modelfile", "--out",
                   str(tmp_path / "m")]) == 0
    assert f"FROM {trained / 'where' / 'smol.gguf'}\n" in (tmp_path / "m" / "Modelfile").read_text()


def test_export_onto_another_base_of_the_same_shape_says_so_and_writes_it(trained, tmp_path,
                                                                          capsys, monkeypatch):
    """`toymlx-export --adapter RUN --base OTHER --fuse`, OTHER a model of the same shape with
    other weights (a slip, or another quantization on purpose): fused without a word. It is
    still written, as llama.cpp applies an adapter to any base it fits, with a note naming
    both files; the run's own base gets none. OTHER is read whole once for the note, not once
    to see whether it is the run's base moved and again to say it is not."""
    from toymlx.bundle import model_store

    run, other = trained / "where" / "runs" / "rel", trained / "elsewhere" / "smol.gguf"
    recorded = trained / "where" / "smol.gguf"
    export = _cli("export")
    hashed, file_sha256 = [], model_store.file_sha256
    monkeypatch.setattr(model_store, "file_sha256",
                        lambda path: hashed.append(Path(path)) or file_sha256(path))
    capsys.readouterr()
    assert export(["--adapter", str(run), "--base", str(other), "--fuse", "--no-held-out",
                   "--out", str(tmp_path / "o.gguf")]) == 0
    assert hashed.count(other) == 1
    note = capsys.readouterr().err.splitlines()[0]
    digest = hashlib.sha256
    assert note == (f"toymlx-export: note: --base {other} (sha256 "
                    f"{digest(other.read_bytes()).hexdigest()[:12]}) is not the base the run "
                    f"{run} trained on ({recorded}, sha256 "
                    f"{digest(recorded.read_bytes()).hexdigest()[:12]}): the adapter is applied "
                    "to it as given")
    assert (tmp_path / "o.gguf").is_file()
    assert export(["--adapter", str(run), "--base", str(recorded), "--fuse", "--no-held-out",
                   "--out", str(tmp_path / "r.gguf")]) == 0
    assert "note:" not in capsys.readouterr().err


def test_resume_from_another_folder_trains_on_the_recorded_files(trained, tmp_path, capsys,
                                                                monkeypatch):
    where = trained / "where"
    monkeypatch.chdir(where)
    assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                          "--runs-root", str(tmp_path), "--run-id", "cut", "--stop-at", "2",
                          *TRAIN, "--steps", "4"]) == 0
    assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                          "--runs-root", str(tmp_path), "--run-id", "whole", *TRAIN,
                          "--steps", "4"]) == 0
    monkeypatch.chdir(trained / "elsewhere")  # other smol.gguf and data/ of the same names
    capsys.readouterr()
    assert _cli("train")(["--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (f"toymlx-train: --resume reads --base from {where / 'smol.gguf'} (the run's --base "
            "smol.gguf)\n") in err
    assert (f"toymlx-train: --resume reads --data.path from {where / 'data'} (the run's "
            "--data.path data)\n") in err

    def losses(run: str) -> list[float]:
        return [e["loss"] for e in (json.loads(x) for x in
                                    (tmp_path / run / "events.jsonl").read_text().splitlines())
                if e["kind"] == "step"]

    assert losses("cut") == pytest.approx(losses("whole"), abs=1e-5)


def test_a_resume_from_the_same_folder_names_no_input(trained, tmp_path, capsys, monkeypatch):
    """Each input read where its option as typed still leads (`--base smol.gguf --data.path
    data`, resumed from the folder they were typed in): no `--resume reads` line, which is for
    an input read from elsewhere than the option names."""
    monkeypatch.chdir(trained / "where")
    assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                          "--runs-root", str(tmp_path), "--run-id", "here", "--stop-at", "2",
                          *TRAIN, "--steps", "4"]) == 0
    capsys.readouterr()
    assert _cli("train")(["--resume", str(tmp_path / "here"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "--resume reads" in line] == []
    events = [json.loads(x) for x in (tmp_path / "here" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "step"][-2:] == [3, 4]


def test_the_inputs_a_resume_names_follow_the_bundle_s_record(trained, monkeypatch):
    """`Bundle.told` (the `used` inputs read from elsewhere than their options as recorded
    lead) was stored at open beside the `used`, `saved` and `config` it is computed from, so a
    bundle whose `used` changed kept naming the old inputs; it is computed from them now."""
    from toymlx.runner.bundle import Bundle

    run = trained / "where" / "runs" / "rel"
    monkeypatch.chdir(trained / "where")  # where the options were typed: nothing to name
    here = Bundle.open(run)
    assert set(here.used) == {"base", "data.path"} and here.told == {}
    monkeypatch.chdir(trained / "elsewhere")  # ./smol.gguf and ./data are others here
    there = Bundle.open(run)
    assert there.told == there.used and set(there.told) == {"base", "data.path"}
    there.used = {"base": there.used["base"]}
    assert there.told == {"base": there.used["base"]}


def test_a_lora_adapter_given_as_the_base_is_one_short_line(trained, tmp_path, capsys):
    ckpt = trained / "where" / "runs" / "rel" / "weights" / "adapter_step_2.gguf"
    for prog, argv in (("export", ["--base", str(ckpt), "--out", str(tmp_path / "x.gguf")]),
                       ("train", ["--recipe", "lora", "--base", str(ckpt), "--runs-root",
                                  str(tmp_path), *TRAIN])):
        capsys.readouterr()
        assert _cli(prog)(argv) == 2
        line = error_line(capsys, f"toymlx-{prog}")
        assert line.endswith(f"{ckpt}: expected a model GGUF, found a LoRA adapter (a LoRA "
                             "run's checkpoint); pass it as --adapter, with its base model as "
                             "--base (toymlx-generate: --model)")
        assert len(line) < 250 + len(str(ckpt))


def test_an_adapter_given_as_the_base_beside_adapter_names_base_and_its_model(trained, tmp_path,
                                                                             capsys):
    """`toymlx-export --base ADAPTER --adapter ADAPTER --fuse` said "tensor ...lora_a: expected
    a projection weight of the base ADAPTER, found no such weight": --base is named, with the
    base the adapter records; nothing is written."""
    ckpt = trained / "where" / "runs" / "rel" / "weights" / "adapter_step_2.gguf"
    out = tmp_path / "fused.gguf"
    assert _cli("export")(["--base", str(ckpt), "--adapter", str(ckpt), "--fuse",
                           "--no-held-out", "--out", str(out)]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: {ckpt}: --base: expected a model GGUF, found a LoRA adapter (a "
        "LoRA run's checkpoint), which holds no tokenizer or base weights; pass its base model "
        "(smol.gguf)")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_adapter_outside_its_run_given_to_eval_names_what_eval_takes(trained, tmp_path,
                                                                       capsys):
    """`toymlx-eval --model adapter.gguf` (copied out of its run) said "pass it as --adapter,
    with its base model as --base", flags toymlx-eval does not have; it now gives the run
    folder, or the export that fuses it with the base it records (`toy.base`)."""
    import shutil

    ckpt = tmp_path / "my adapter.gguf"
    shutil.copy(trained / "where" / "runs" / "rel" / "weights" / "adapter_step_2.gguf", ckpt)
    assert _cli("eval")(["--model", str(ckpt)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {ckpt}: --model: expected a model GGUF or a run folder, found a "
        "LoRA adapter outside its run (no tokenizer or base weights); give its run folder "
        "(--model runs/RUN), or fuse it with its base first: toymlx-export --adapter "
        f"'{ckpt}' --base smol.gguf --fuse --out fused.gguf, then toymlx-eval --model "
        "fused.gguf")


def test_moved_data_is_taken_only_with_its_recorded_fingerprint(trained, tmp_path, capsys,
                                                               monkeypatch):
    run = trained / "where" / "runs" / "rel"
    recorded, kept = trained / "where" / "data", tmp_path / "kept"
    monkeypatch.chdir(trained / "elsewhere")  # its data/ holds other examples
    shutil.move(recorded, kept)
    try:
        assert _cli("eval")(["--model", str(run), "--split", "test"]) == 2
        line = error_line(capsys, "toymlx-eval")
        assert f"{trained / 'elsewhere' / 'data'}: --data.path: expected the run's data.path, " \
               f"recorded as {recorded} (" in line and " bytes, sha256 " in line
        assert "found other contents (2773 bytes, sha256 " in line
    finally:
        shutil.move(kept, recorded)


def test_a_path_utf8_cannot_hold_is_named_and_a_file_name_inside_is_fingerprinted(
        trained, tmp_path, capsys):
    """A latin-1 file name (byte 0xe9) as --data.path, --base or --run-id failed writing
    config.json with "'utf-8' codec can't encode character '\\udce9' in position 1112",
    naming neither the flag nor the file: now the flag and the byte are named, and no run
    folder is made. Inside a data folder such a name is fine: its bytes are fingerprinted
    where the folder is taken whole, and an mlx-lm folder's record leaves it out (not read)."""
    import os

    where = trained / "where"
    latin = tmp_path / os.fsdecode(b"donn\xe9es")
    shutil.copytree(where / "data", latin)
    common = ["--recipe", "lora", "--runs-root", str(tmp_path / "runs"), *TRAIN]
    for flags, flag, value in (
            (["--base", str(where / "smol.gguf"), "--data.path", str(latin), "--run-id", "a"],
             "--data.path", str(latin)),
            (["--base", str(where / "smol.gguf"), "--run-id", os.fsdecode(b"r\xe9n")],
             "--run-id", os.fsdecode(b"r\xe9n"))):
        assert _cli("train")([*common, *flags]) == 2
        at = value.index("\udce9")
        assert error_line(capsys) == (
            f"toymlx-train: error: {value!r}: {flag}: expected UTF-8 text (config.json records "
            f"it), found the byte 0xe9 at character {at}; use a UTF-8 name")
    assert not (tmp_path / "runs").exists()
    folder = tmp_path / "data"
    shutil.copytree(where / "data", folder)
    (folder / os.fsdecode(b"notes-\xe9.txt")).write_text("not read: not a split")
    assert _cli("train")([*common, "--base", str(where / "smol.gguf"), "--data.path",
                          str(folder), "--run-id", "b"]) == 0
    saved = json.loads((tmp_path / "runs" / "b" / "config.json").read_text())
    assert len(saved["data_files"]["data.path"]["sha256"]) == 64
    assert sorted(saved["data_files"]["data.path"]["files"]) == ["train.jsonl", "valid.jsonl"]
    import hashlib

    from toymlx.bundle.inputs import fingerprint

    names = sorted(os.listdir(os.fsencode(folder)))  # the folder whole: the name's own bytes
    head = b"".join(b"%s|%d\n" % (n, os.path.getsize(os.fsencode(folder) + b"/" + n))
                    for n in names)
    body = b"".join((folder / os.fsdecode(n)).read_bytes() for n in names)
    assert fingerprint(folder)["sha256"] == hashlib.sha256(head + body).hexdigest()


def test_a_base_given_as_a_link_is_the_file_it_named_then(trained, tmp_path, capsys):
    """`--base current.gguf` (or another run's `weights/latest` as warm-start's --donor): the
    link moved on to other weights later, and every reader of the run still reads the file it
    started on (it was "expected the file the run started on ..., found other contents")."""
    first, second = tiny(tmp_path / "v1.gguf", 3), tiny(tmp_path / "v2.gguf", 7)
    link = tmp_path / "current.gguf"
    link.symlink_to(first.name)
    assert _cli("train")(["--recipe", "lora", "--base", str(link), "--runs-root",
                          str(tmp_path / "runs"), "--run-id", "l", *TRAIN]) == 0
    run = tmp_path / "runs" / "l"
    saved = json.loads((run / "config.json").read_text())["model_files"]["base"]
    assert (saved["path"], saved["file"]) == (str(link), str(first))
    capsys.readouterr()
    assert _cli("eval")(["--model", str(run)]) == 0
    before = json.loads(capsys.readouterr().out)["val_loss"]
    link.unlink()
    link.symlink_to(second.name)  # the link moves on
    assert _cli("eval")(["--model", str(run)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["val_loss"] == before
    assert f"toymlx-eval: model {first} (the run's --base {link}) + adapter" in err
    assert _cli("train")(["--resume", str(run), "--steps", "4", "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --base from {first} (the run's --base {link})\n"
            in capsys.readouterr().err)


def test_a_lora_run_folder_as_the_base_names_its_base_and_init_adapter(trained, tmp_path,
                                                                      capsys):
    """It was "found a Hugging Face model folder (config.json, as mlx-lm's --model takes)"."""
    run = trained / "where" / "runs" / "rel"
    capsys.readouterr()
    assert _cli("train")(["--recipe", "lora", "--base", str(run), "--runs-root", str(tmp_path),
                          *TRAIN]) == 2
    assert error_line(capsys, "toymlx-train") == (
        f"toymlx-train: error: {run}: --base: expected a GGUF file, found a toymlx run folder; "
        f"its checkpoints are LoRA adapters: pass its base (--base {trained / 'where' / 'smol.gguf'})"
        f" and --lora.init-adapter {run} to start from its adapter")


def test_a_lora_adapter_or_run_as_donor_or_tokenizer_names_the_option_and_its_base(
        trained, tmp_path, capsys):
    """An adapter GGUF as warm-start's --donor was "metadata key 'llama.embedding_length':
    expected present, found missing", as from-scratch's --tokenizer "tokenizer.ggml.model:
    expected one of [...], found missing key"; a LoRA run folder as --donor advised
    `--base` and `--lora.init-adapter`, which warm-start does not take."""
    run = trained / "where" / "runs" / "rel"
    ckpt = run / "weights" / "adapter_step_2.gguf"
    for recipe, flag in (("warm-start", "--donor"), ("from-scratch", "--tokenizer")):
        capsys.readouterr()
        assert _cli("train")(["--recipe", recipe, flag, str(ckpt), "--runs-root",
                              str(tmp_path), *TRAIN]) == 2
        assert error_line(capsys) == (
            f"toymlx-train: error: {ckpt}: {flag}: expected a model GGUF, found a LoRA adapter (a "
            "LoRA run's checkpoint), which holds no tokenizer or base weights; pass its base "
            "model (smol.gguf)")
    assert _cli("train")(["--recipe", "warm-start", "--donor", str(run), "--runs-root",
                          str(tmp_path), *TRAIN]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --donor: expected a GGUF file, found a toymlx run folder; "
        f"its checkpoints are LoRA adapters: pass its base (--donor "
        f"{trained / 'where' / 'smol.gguf'})")
    assert not any(tmp_path.iterdir())


def test_from_scratch_takes_its_vocabulary_from_tokenizer_and_a_changed_file_is_refused(
        tmp_path, capsys, shared_file):
    """`--tokenizer FILE.gguf` (llama.cpp's vocab-only Llama SPM file, 32,000 tokens): the model's
    vocabulary and its checkpoint's tokenizer are the file's, config.json records the file like
    a --base, a resume refuses it changed, and a run folder given for it names a checkpoint."""
    from toymlx.bundle.checkpoint import resolve_latest
    from toymlx.gguf.reader import GGUFFile

    vocab_file = tmp_path / "vocab.gguf"
    shutil.copyfile(shared_file("tokenizers/ggml-vocab-llama-spm.gguf"), vocab_file)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a tokenizer. " * 200)
    runs = tmp_path / "runs"
    argv = ["--recipe", "from-scratch", "--tokenizer", str(vocab_file), "--data.path", str(text),
            "--model.d-model", "32", "--model.n-layers", "1", "--runs-root", str(runs),
            "--run-id", "t", *TRAIN[:-4], "--seq-len", "32", "--no-progress", "--no-compile"]
    assert _cli("train")(argv) == 0
    tokens = GGUFFile(vocab_file).metadata["tokenizer.ggml.tokens"]
    g = GGUFFile(resolve_latest(runs / "t"))
    assert len(tokens) == 32000 and g.metadata["tokenizer.ggml.tokens"] == tokens
    assert tuple(g.tensors["token_embd.weight"].shape) == (32000, 32)
    rec = json.loads((runs / "t" / "config.json").read_text())["model_files"]["tokenizer"]
    assert rec["file"] == str(vocab_file) and len(rec["sha256"]) == 64
    kept = shutil.copy2(vocab_file, tmp_path / "kept.gguf")
    with open(vocab_file, "ab") as f:
        f.write(b"\0" * 32)  # other contents under the same name
    capsys.readouterr()
    assert _cli("train")(["--resume", str(runs / "t"), "--steps", "4"]) == 2
    line = error_line(capsys, "toymlx-train")
    assert f"{vocab_file}: --tokenizer: expected the file the run started on (sha256" in line
    # the same contents elsewhere, given on the resume: taken, said, and trained on
    assert _cli("train")(["--resume", str(runs / "t"), "--steps", "4", "--tokenizer",
                          str(kept)]) == 0
    said = capsys.readouterr()
    assert f"reads --tokenizer from {kept} (moved; same contents" in said.out + said.err
    assert GGUFFile(resolve_latest(runs / "t")).metadata["tokenizer.ggml.tokens"] == tokens
    assert _cli("train")([*argv[:4], "--tokenizer", str(runs / "t"), "--run-id", "u"]) == 2
    assert error_line(capsys, "toymlx-train") == (
        f"toymlx-train: error: {runs / 't'}: --tokenizer: expected a GGUF file, found a toymlx "
        f"run folder; pass one of its checkpoints: --tokenizer {runs / 't' / 'weights' / 'step_4.gguf'}")


def _moved(run: Path) -> dict | None:
    """The `inputs_moved` record of the run's latest resume event."""
    resumes = [e for e in (json.loads(x) for x in (run / "events.jsonl").read_text().splitlines())
               if e["kind"] == "resume"]
    return resumes[-1].get("inputs_moved") if resumes else None


def _cut_and_whole(tmp_path: Path, argv: list[str]) -> tuple[Path, Path]:
    """runs/cut (stopped at step 2 of 4) and runs/whole (4 steps in one go), both on `argv`."""
    runs = tmp_path / "runs"
    for run_id, stop in (("cut", ["--stop-at", "2"]), ("whole", [])):
        assert _cli("train")([*argv, "--runs-root", str(runs), "--run-id", run_id, *TRAIN,
                              "--steps", "4", *stop]) == 0
    return runs / "cut", runs / "whole"


def _losses(run: Path) -> list[float]:
    return [e["loss"] for e in (json.loads(x) for x in (run / "events.jsonl").read_text()
                                .splitlines()) if e["kind"] == "step"]


@pytest.mark.parametrize("kind", ["folder", "text file"])
def test_moved_data_given_on_resume_is_taken_by_its_contents_and_recorded(
        kind, trained, tmp_path, capsys, monkeypatch):
    """`mv data1 data2`, then `--resume RUN --data.path data2`: the same contents are accepted
    with one line saying so, the resumed run's losses are those of a run never stopped, the
    resume event records the new place, and a second reader (toymlx-eval, a resume) finds it
    with no flag; other contents under a new path are one line naming both paths. Before,
    --data.path data2 was refused as a changed option and the run could not be resumed."""
    from toymlx.bundle.events import check_toy_v1, read_events

    monkeypatch.chdir(tmp_path)
    if kind == "folder":
        mlx_lm_folder(tmp_path / "data1")
        argv = ["--recipe", "lora", "--base", str(trained / "where" / "smol.gguf")]
        new, other = "data2", mlx_lm_folder(tmp_path / "other", n_train=14)
    else:
        (tmp_path / "data1").write_text("Once upon a time there was a moved file. " * 60)
        argv = ["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers", "1",
                "--seq-len", "32"]
        new, other = "data2.txt", tmp_path / "other.txt"
        other.write_text("Some other text entirely. " * 60)
    cut, whole = _cut_and_whole(tmp_path, [*argv, "--data.path", "data1"])
    (tmp_path / "data1").rename(tmp_path / new)
    capsys.readouterr()
    was = json.loads((cut / "config.json").read_text())["data_files"]["data.path"]
    assert _cli("train")(["--resume", str(cut), "--data.path", str(other), "--stop-at", "3",
                          "--no-progress"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: {other}: --data.path: expected the run's "
                           f"data.path, recorded as {tmp_path / 'data1'} ({was['bytes']} bytes, "
                           f"sha256 {was['sha256'][:12]}), found other contents (")
    assert _cli("train")(["--resume", str(cut), "--data.path", new, "--stop-at", "3",
                          "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --data.path from {new} (moved; same contents as the "
            "run's data1)\n") in capsys.readouterr().err
    assert _moved(cut) == {"data.path": {"path": new, "file": str(tmp_path / new),
                                         "was": str(tmp_path / "data1")}}
    if kind == "folder":  # toymlx-eval without the flag: the moved data's held-out rows
        assert _cli("eval")(["--model", str(cut)]) == 0
        assert json.loads(capsys.readouterr().out)["data"].startswith(f"{tmp_path / new}/")
    monkeypatch.chdir(trained)  # a second resume, from elsewhere, with no flag
    assert _cli("train")(["--resume", str(cut), "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --data.path from {tmp_path / new} (the run's "
            f"--data.path data1, moved from {tmp_path / 'data1'}, as a resume recorded)\n"
            ) in capsys.readouterr().err
    assert _moved(cut)["data.path"]["file"] == str(tmp_path / new)  # carried on
    assert _losses(cut) == pytest.approx(_losses(whole), abs=1e-5)
    assert check_toy_v1(read_events(cut)) == []


def test_large_data_copied_without_its_time_is_taken_by_its_bytes(tmp_path, capsys,
                                                                   monkeypatch):
    """Data over WHOLE_DIGEST_BYTES (64 MiB; here 4 KiB, samples of 64 bytes) was recorded by
    size, modification time and 16 samples: `cp big.txt copy.txt` (a new time) given on a
    resume was refused as "other contents" showing the same digest twice. Now a new time
    makes all its bytes decide: the copy is taken, a copy with one byte changed between the
    samples is refused with the SHA-256 of all of it, and so is the file edited in place."""
    import hashlib
    import os

    from toymlx.bundle import inputs

    monkeypatch.setattr(inputs, "WHOLE_DIGEST_BYTES", 4096)
    monkeypatch.setattr(inputs, "SAMPLE_BYTES", 64)
    monkeypatch.chdir(tmp_path)
    text = "".join(f"line {i}: once upon a time there was a large file.\n" for i in range(400))
    big = tmp_path / "big.txt"
    big.write_text(text)
    argv = ["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers", "1",
            "--seq-len", "32", "--data.path", "big.txt", "--runs-root", "runs",
            "--run-id", "r", *TRAIN, "--steps", "4", "--stop-at", "2"]
    assert _cli("train")(argv) == 0
    rec = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["data_files"][
        "data.path"]
    assert rec["sha256"] == hashlib.sha256(f"|{len(text)}\n{text}".encode()).hexdigest()
    assert {"mtime_ns", "sample_sha256"} <= set(rec)
    copy = tmp_path / "copy.txt"
    shutil.copyfile(big, copy)  # `cp`: the same bytes, a new modification time
    os.utime(copy, ns=(rec["mtime_ns"] + 10**9, rec["mtime_ns"] + 10**9))
    capsys.readouterr()
    assert _cli("train")(["--resume", "runs/r", "--data.path", "copy.txt", "--stop-at", "3",
                          "--no-progress"]) == 0
    assert ("toymlx-train: --resume reads --data.path from copy.txt (moved; same contents as "
            "the run's big.txt)\n") in capsys.readouterr().err
    # one byte between the samples (sample 0 covers bytes 0-63, sample 1 starts past 1000)
    edited = text[:500] + "X" + text[501:]
    (tmp_path / "other.txt").write_text(edited)
    digest = hashlib.sha256(f"|{len(edited)}\n{edited}".encode()).hexdigest()
    assert inputs.fingerprint("other.txt", whole=False)["sample_sha256"] == rec["sample_sha256"]
    assert _cli("train")(["--resume", "runs/r", "--data.path", "other.txt", "--stop-at", "3",
                          "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {tmp_path / 'other.txt'}: --data.path: expected the run's "
        f"data.path, recorded as {big} ({len(text)} bytes, sha256 {rec['sha256'][:12]}), found "
        f"other contents ({len(text)} bytes, sha256 {digest[:12]}); a run keeps its inputs: "
        "give the path that holds the run's data.path, or start a new run on this one")
    big.write_text(edited)  # in place: the resume without the flag reads the moved copy, so
    assert inputs.same_data(big, rec) == (False, inputs.fingerprint(big))  # ask the check


def test_large_data_recorded_without_a_whole_digest_is_not_guessed(tmp_path, monkeypatch):
    """A record of large data written before toymlx kept its whole SHA-256: same size and
    samples under another modification time cannot be told apart from a change between the
    samples, so it is one line saying so and how to assert it, not "changed"."""
    import os

    from toymlx.bundle import inputs
    from toymlx.bundle.options import RunError

    monkeypatch.setattr(inputs, "WHOLE_DIGEST_BYTES", 4096)
    data = tmp_path / "big.txt"
    data.write_text("x" * 5000)
    rec = inputs.fingerprint(data)
    del rec["sha256"]
    assert inputs.same_data(data, rec)[0] is True  # unchanged: the cheap check, nothing read
    os.utime(data, ns=(rec["mtime_ns"] + 1, rec["mtime_ns"] + 1))
    with pytest.raises(RunError) as e:
        inputs.same_data(data, rec)
    t = rec["mtime_ns"]
    assert str(e.value) == (
        f"{data}: expected the run's data (5000 bytes, samples' sha256 "
        f"{rec['sample_sha256'][:12]}, modification time {t}), found the same size and samples "
        f"with modification time {t + 1}; the run's record holds no SHA-256 of all of it "
        "(recorded before toymlx kept one), so whether the rest is the same cannot be told; "
        f"if it is the run's data, give it the recorded modification time: touch -d "
        f"@{t // 10**9}.{t % 10**9:09d} {data}")


def test_an_init_adapter_is_read_from_the_recorded_file_from_another_folder(trained, tmp_path,
                                                                           capsys, monkeypatch):
    """--lora.init-adapter given relative: a resume from step 0 in another folder read that
    folder's adapter of the same name (recorded nowhere but as typed); it is now recorded with
    the data, and the restarted run's losses are the ones it trained from its own folder."""
    where, elsewhere = trained / "where", trained / "elsewhere"
    monkeypatch.chdir(elsewhere)  # a decoy adapter: elsewhere/runs/rel is another run
    assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                          "--runs-root", "runs", "--run-id", "rel", "--lr", "0.05", *TRAIN]) == 0
    adapter = "runs/rel/weights/adapter_step_2.gguf"
    assert (where / adapter).read_bytes() != (elsewhere / adapter).read_bytes()
    monkeypatch.chdir(where)
    assert _cli("train")(["--recipe", "lora", "--base", "smol.gguf", "--data.path", "data",
                          "--lora.init-adapter", adapter, "--runs-root", str(tmp_path),
                          "--run-id", "init", *TRAIN]) == 0
    saved = json.loads((tmp_path / "init" / "config.json").read_text())
    assert saved["data_files"]["lora.init_adapter"]["file"] == str(where / adapter)

    def losses() -> list[float]:
        return [e["loss"] for e in (json.loads(x) for x in
                                    (tmp_path / "init" / "events.jsonl").read_text().splitlines())
                if e["kind"] == "step"][-2:]

    first = losses()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert _cli("train")(["--resume", str(tmp_path / "init"), "--from", "step_0",
                          "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --lora.init-adapter from {where / adapter} (the run's "
            f"--lora.init-adapter {adapter})\n") in capsys.readouterr().err
    assert losses() == first


def test_a_moved_init_adapter_given_on_resume_is_taken_by_its_contents(trained, tmp_path,
                                                                      capsys, monkeypatch):
    """A run started from mlx-lm's adapters (`--lora.init-adapter ad1/adapters.safetensors`, or
    an mlx-lm config's resume_adapter_file), `mv ad1 ad2`, then `--resume RUN
    --lora.init-adapter ad2/adapters.safetensors`: the same bytes are accepted as moved data is
    (one line, the resume event's record, the never-stopped run's losses), other contents are
    one line naming both files. Before, the flag was refused as a changed option, while the
    missing file's message told the user to give it."""
    from mlx_lm_adapters import lora_config, make_adapter

    monkeypatch.chdir(tmp_path)
    make_adapter(trained / "where" / "smol.gguf", tmp_path / "ad1", lora_config(3, 4, 2.0))
    cut, whole = _cut_and_whole(tmp_path, [
        "--recipe", "lora", "--base", str(trained / "where" / "smol.gguf"), "--data.path",
        str(trained / "where" / "data"), "--lora.init-adapter", "ad1/adapters.safetensors",
        "--lora.targets", "q,k,v,o,gate,up,down", "--lora.rank", "4", "--lora.alpha", "8"])
    (tmp_path / "ad1").rename(tmp_path / "ad2")
    capsys.readouterr()
    assert _cli("train")(["--resume", str(cut), "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {tmp_path / 'ad1' / 'adapters.safetensors'}: "
        "--lora.init-adapter: expected the run's "
        f"lora.init_adapter ({(tmp_path / 'ad2' / 'adapters.safetensors').stat().st_size} bytes when it "
        "started), found nothing there; put it back, or give where it is now: "
        "--lora.init-adapter PATH")
    other = trained / "where" / "runs" / "rel" / "weights" / "adapter_step_2.gguf"
    was = json.loads((cut / "config.json").read_text())["data_files"]["lora.init_adapter"]
    assert _cli("train")(["--resume", str(cut), "--lora.init-adapter", str(other),
                          "--no-progress"]) == 2
    assert error_line(capsys).startswith(
        f"toymlx-train: error: {other}: --lora.init-adapter: expected the run's "
        f"lora.init_adapter, recorded as {tmp_path / 'ad1' / 'adapters.safetensors'} "
        f"({was['bytes']} bytes, sha256 {was['sha256'][:12]}), found other contents (")
    new = "ad2/adapters.safetensors"
    assert _cli("train")(["--resume", str(cut), "--lora.init-adapter", new, "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --lora.init-adapter from {new} (moved; same contents "
            "as the run's ad1/adapters.safetensors)\n") in capsys.readouterr().err
    assert _moved(cut) == {"lora.init_adapter": {
        "path": new, "file": str(tmp_path / new),
        "was": str(tmp_path / "ad1" / "adapters.safetensors")}}
    assert _losses(cut) == pytest.approx(_losses(whole), abs=1e-5)


def test_a_data_folder_s_fingerprint_reads_through_linked_subfolders(tmp_path):
    """The images a run trains on through a linked class folder are part of its data's
    fingerprint, so a resume notices them changed (before: the walk did not follow the link, and
    an edited image behind it resumed without a word)."""
    from toymlx.bundle.inputs import fingerprint

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.png").write_bytes(b"one")
    (tmp_path / "data" / "cat").mkdir(parents=True)
    (tmp_path / "data" / "cat" / "b.png").write_bytes(b"two")
    (tmp_path / "data" / "dog").symlink_to(tmp_path / "elsewhere")
    before = fingerprint(tmp_path / "data")
    assert before["bytes"] == 6
    (tmp_path / "elsewhere" / "a.png").write_bytes(b"ONE")
    assert fingerprint(tmp_path / "data")["sha256"] != before["sha256"]


def test_a_model_or_a_full_model_run_as_the_adapter_to_export_is_named(tmp_path, capsys):
    """`toymlx-export --adapter RUN` of a from-scratch run (or a model GGUF), no --base, read
    "--base: expected the GGUF RUN was trained on (not recorded by its run or adapter), found
    none; pass --base": a model has no base; it is exported as --base."""
    model = tiny(tmp_path / "m.gguf", 3)
    assert _cli("export")(["--adapter", str(model), "--out", str(tmp_path / "o.gguf")]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: {model}: --adapter: expected a LoRA adapter or a LoRA run, found "
        f"a model ({model}); export a model as --base {model}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def _folder_digest(folder: Path, names: list[str]) -> tuple[int, str]:
    """(bytes, SHA-256) of the files `names` of `folder` as `fingerprint` defines them: each
    "name|size" line, then their bytes, in name order (hashlib, apart from toymlx)."""
    import hashlib

    files = [folder / n for n in sorted(names)]
    digest = hashlib.sha256(b"".join(f"{p.name}|{p.stat().st_size}\n".encode() for p in files))
    for p in files:
        digest.update(p.read_bytes())
    return sum(p.stat().st_size for p in files), digest.hexdigest()


def _stopped_lora_run(tmp_path: Path, data: Path) -> Path:
    """A LoRA run on `data` stopped at step 2 of 4 (a checkpoint there)."""
    base = tiny(tmp_path / "smol.gguf", 3)
    assert _cli("train")(["--recipe", "lora", "--base", str(base), "--data.path", str(data),
                          "--runs-root", str(tmp_path / "runs"), "--run-id", "r", *TRAIN[2:],
                          "--steps", "4", "--stop-at", "2"]) == 0
    return tmp_path / "runs" / "r"


def _final_step(run: Path) -> int:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()][-1][
        "final_step"]


SPLITS = ["test.jsonl", "train.jsonl", "valid.jsonl"]


READ = ["train.jsonl", "valid.jsonl"]
"""The split files a run of no --test reads in an mlx-lm folder"""


def _names_read(test: bool) -> list[str]:
    """The split file names a run records as read (`only`), test's with --test: written out
    here, apart from toymlx's list."""
    splits = ("train", "valid", "test") if test else ("train", "valid")
    return [f"{s}{x}" for s in splits for x in (".jsonl", ".json", ".csv", ".tsv")]


def _grown(path: Path) -> int:
    """`path`'s size before a row of 21 bytes is added to it."""
    was = path.stat().st_size
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    return was


def _refused_for(capsys, run: Path, name: str, was: int, *flags: str) -> None:
    """A --resume of `run` is refused naming the split file `name`, grown from `was` bytes."""
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), *flags, "--no-progress"]) == 2
    assert error_line(capsys).endswith(
        f": {name} changed ({was} -> {was + 21} bytes)); a resumed run trains on its own "
        "data: restore it, or start a new run on this data")


def test_an_mlx_lm_folder_s_record_covers_the_files_the_run_reads(tmp_path, capsys):
    """An mlx-lm data folder's fingerprint covered every file in it, so an edited README.md
    beside train/valid/test.jsonl (never read) blocked --resume; config.json then recorded the
    split files alone, test.jsonl too, whose edit blocked a run that never reads it (no
    --test). It now records train's and valid's names (`only`): a README.md or test.jsonl
    edit resumes (and `toymlx-eval --split test` scores the test.jsonl as it is), and a
    train.jsonl edit is refused naming it."""
    data = mlx_lm_folder(tmp_path / "data")
    (data / "README.md").write_text("# my data\n")
    run = _stopped_lora_run(tmp_path, data)
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    size, sha = _folder_digest(data, READ)
    assert (rec["bytes"], rec["sha256"], rec["only"]) == (size, sha, _names_read(False))
    assert sorted(rec["files"]) == READ
    (data / "README.md").write_text("# my data, described at length\n")
    (data / "test.jsonl").write_text(json.dumps({"text": "another test set"}) + "\n")
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert _final_step(run) == 4
    capsys.readouterr()  # never read by the run: toymlx-eval --split test scores it as it is
    assert _cli("eval")(["--model", str(run), "--split", "test", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1
    was = _grown(data / "train.jsonl")
    now_size, now_sha = _folder_digest(data, READ)
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--steps", "5", "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {data}: --data.path: expected the data the run started on "
        f"({size} bytes, sha256 {sha[:12]}), found its size changed ({now_size} bytes, sha256 "
        f"{now_sha[:12]}: train.jsonl changed ({was} -> {was + 21} bytes)); a resumed run "
        "trains on its own data: restore it, or start a new run on this data")


def test_an_empty_valid_jsonl_gone_or_added_at_val_fraction_0_still_resumes(tmp_path, capsys):
    """At --data.val-fraction 0 an empty valid.jsonl is read as none (mlx-lm's meaning), yet
    deleting it stopped a --resume as changed data ("valid.jsonl gone"); now an empty one gone
    or added is no change, and a valid.jsonl with an example in it, added, is refused naming it,
    as a train.jsonl edit is."""
    data = mlx_lm_folder(tmp_path / "data", n_valid=0)
    (data / "valid.jsonl").write_text("")
    base = tiny(tmp_path / "smol.gguf", 3)
    assert _cli("train")(["--recipe", "lora", "--base", str(base), "--data.path", str(data),
                          "--runs-root", str(tmp_path / "runs"), "--run-id", "r", *TRAIN[2:],
                          "--steps", "4", "--stop-at", "2", "--data.val-fraction", "0"]) == 0
    run = tmp_path / "runs" / "r"
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert rec["files"]["valid.jsonl"]["bytes"] == 0
    (data / "valid.jsonl").unlink()
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert _final_step(run) == 4
    (data / "valid.jsonl").write_text("")
    assert _cli("train")(["--resume", str(run), "--steps", "5", "--no-progress"]) == 0
    assert _final_step(run) == 5
    (data / "valid.jsonl").write_text(json.dumps({"text": "a validation row"}) + "\n")
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--steps", "6", "--no-progress"]) == 2
    assert error_line(capsys).endswith(
        ": valid.jsonl added); a resumed run trains on its own data: restore it, or start a new "
        "run on this data")  # the empty one recorded was none
    (data / "valid.jsonl").unlink()
    _refused_for(capsys, run, "train.jsonl", _grown(data / "train.jsonl"), "--steps", "6")


def test_a_valid_jsonl_of_blank_lines_gone_at_val_fraction_0_still_resumes(tmp_path):
    """A valid.jsonl of blank lines alone is read as none at --data.val-fraction 0, as an empty
    one is (`blank_file`), yet deleting it stopped a --resume as changed data ("valid.jsonl
    gone") where an empty one's did not: the record knew its size alone. Now the record marks
    it blank, the run resumes, and its losses are those of a run never stopped on that data;
    a blank one put back is no change either."""
    data = mlx_lm_folder(tmp_path / "data", n_valid=0)
    (data / "valid.jsonl").write_text("\n  \n\t\n")
    base = tiny(tmp_path / "smol.gguf", 3)

    def train(run_id: str, *more: str) -> int:
        return _cli("train")(["--recipe", "lora", "--base", str(base), "--data.path", str(data),
                              "--runs-root", str(tmp_path / "runs"), "--run-id", run_id,
                              *TRAIN[2:], "--steps", "4", "--data.val-fraction", "0", *more])

    assert train("whole") == 0
    assert train("r", "--stop-at", "2") == 0
    run = tmp_path / "runs" / "r"
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert (rec["files"]["valid.jsonl"]["bytes"], rec["files"]["valid.jsonl"]["blank"]) == (6, True)
    (data / "valid.jsonl").unlink()
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert _final_step(run) == 4
    assert _losses(run) == pytest.approx(_losses(tmp_path / "runs" / "whole"), abs=1e-5)
    assert len(_losses(run)) == 4
    (data / "valid.jsonl").write_text("\n\n")  # another blank one: none again
    assert _cli("train")(["--resume", str(run), "--steps", "5", "--no-progress"]) == 0
    assert _final_step(run) == 5


def test_a_resume_that_adds_test_is_refused_naming_toymlx_eval(tmp_path, capsys):
    """A run of no --test records train and valid alone (`only`): a --resume adding --test
    would score a test.jsonl the run's record never covered (edited or added since, unchecked).
    It is refused in one line, whose fix was "start a new run to change it": it now names
    toymlx-eval --split test (mlx_lm.lora --test on an adapter folder), which scores it; the
    record and the events are as the run left them."""
    data = mlx_lm_folder(tmp_path / "data")
    run = _stopped_lora_run(tmp_path, data)
    config = (run / "config.json").read_text()
    events = (run / "events.jsonl").read_text()
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--test", "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --resume: --test: expected the run's saved test = False, "
        "found True; a resumed run keeps its configuration (only --steps and run-local options "
        f"such as --eval-every may change): score its test set with toymlx-eval --model {run} "
        "--split test, or start a new run with --test")
    assert (run / "config.json").read_text() == config
    assert (run / "events.jsonl").read_text() == events
    assert _cli("eval")(["--model", str(run), "--split", "test", "--no-progress"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert (scored["split"], scored["data"]) == ("test", str(data / "test.jsonl"))


def test_a_run_of_test_records_test_jsonl_and_an_older_record_of_it_still_resumes(
        tmp_path, capsys, monkeypatch):
    """A run of --test reads test.jsonl at its end: its record covers it, so a test.jsonl edit
    is refused naming it. A run recorded while every run's record covered test.jsonl (session
    56: `only` of every split name) reads the same without --test: a test.jsonl edit now
    resumes it, decided by the records of train.jsonl and valid.jsonl, and a train.jsonl edit
    is refused naming train.jsonl, not the test.jsonl edited too."""
    from toymlx.recipes.lora import ChatDataOptions

    tested = mlx_lm_folder(tmp_path / "tested" / "data")
    base = tiny(tmp_path / "tested" / "smol.gguf", 3)
    assert _cli("train")(["--recipe", "lora", "--base", str(base), "--data.path", str(tested),
                          "--runs-root", str(tmp_path / "tested" / "runs"), "--run-id", "r",
                          *TRAIN[2:], "--steps", "4", "--stop-at", "2", "--test"]) == 0
    run = tmp_path / "tested" / "runs" / "r"
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert (rec["only"], sorted(rec["files"])) == (_names_read(True), SPLITS)
    assert (rec["bytes"], rec["sha256"]) == _folder_digest(tested, SPLITS)
    _refused_for(capsys, run, "test.jsonl", _grown(tested / "test.jsonl"))

    older = mlx_lm_folder(tmp_path / "older" / "data")
    with monkeypatch.context() as m:  # reads_only as session 56 had it: every split's names
        m.setattr(ChatDataOptions, "reads_only", staticmethod(
            lambda path, test: tuple(_names_read(True))))
        run = _stopped_lora_run(tmp_path / "older", older)
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert (rec["only"], sorted(rec["files"])) == (_names_read(True), SPLITS)
    (older / "test.jsonl").write_text(json.dumps({"text": "another test set"}) + "\n")
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert _final_step(run) == 4
    _refused_for(capsys, run, "train.jsonl", _grown(older / "train.jsonl"), "--steps", "5")


def test_an_older_record_of_every_file_in_the_folder_still_resumes(tmp_path, capsys,
                                                                   monkeypatch):
    """A run recorded before toymlx kept `only` (its fingerprint of every file of the folder,
    README.md included, and each file's own): a README.md edit resumes, decided by the
    records of train/valid/test.jsonl, also of the folder moved and given again; a
    valid.jsonl edit is refused naming it, not the README.md edited too. Without each file's record (a folder of over 16 files) the change
    cannot be placed: one line says so, and what to do."""
    from toymlx.recipes.lora import ChatDataOptions

    data = mlx_lm_folder(tmp_path / "data")
    (data / "README.md").write_text("# my data\n")
    with monkeypatch.context() as m:  # the options without `reads_only`: toymlx before it
        m.delattr(ChatDataOptions, "reads_only")
        run = _stopped_lora_run(tmp_path, data)
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert "only" not in rec and sorted(rec["files"]) == ["README.md", *SPLITS]
    assert (rec["bytes"], rec["sha256"]) == _folder_digest(data, ["README.md", *SPLITS])
    (data / "README.md").write_text("# my data, described at length\n")
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert _final_step(run) == 4
    data = data.rename(tmp_path / "data2")  # moved, given again: taken by the same files
    (data / "README.md").write_text("# my data, moved\n")
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--steps", "5", "--data.path", str(data),
                          "--no-progress"]) == 0
    assert (f"toymlx-train: --resume reads --data.path from {data} (moved; same contents as "
            f"the run's {tmp_path / 'data'})") in capsys.readouterr().err
    assert _final_step(run) == 5
    was = (data / "valid.jsonl").stat().st_size
    (data / "valid.jsonl").write_text((data / "valid.jsonl").read_text()[:-2] + "X\n")
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--steps", "6", "--no-progress"]) == 2
    line = error_line(capsys)
    assert line.endswith(f": valid.jsonl changed ({was} -> {was} bytes)); a resumed run trains "
                         "on its own data: restore it, or start a new run on this data"), line

    many = mlx_lm_folder(tmp_path / "many" / "data")
    for i in range(14):
        (many / f"notes{i:02d}.md").write_text(f"note {i}\n")
    with monkeypatch.context() as m:
        m.delattr(ChatDataOptions, "reads_only")
        run = _stopped_lora_run(tmp_path / "many", many)
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert "files" not in rec and "only" not in rec
    (many / "notes03.md").write_text("note 3, longer\n")
    size, sha = _folder_digest(many, sorted(p.name for p in many.iterdir()))
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {many}: expected the run's data ({rec['bytes']} bytes, sha256 "
        f"{rec['sha256'][:12]}), found other contents ({size} bytes, sha256 {sha[:12]}); the "
        "run's record (written before toymlx recorded which files of a folder a run reads) "
        "covers every file in the folder, not each file's own, so whether a file the run "
        "reads changed or only one beside them cannot be told: restore the folder as it was, "
        "or start a new run on this data")


def test_a_gone_data_folder_is_named_where_the_run_read_it(tmp_path, capsys, monkeypatch):
    """A run on `--data.path data` (relative), the folder then renamed: --resume from another
    folder named "data" (the path as typed, which means another folder there), and
    toymlx-eval said "data: expected a UTF-8 text file, found nothing at that path" (a folder
    taken for a file; toymlx-export --fuse's held-out line the same). All now name the folder
    the run read, and what to give; once resumed with `--data.path data2`, a file fused from
    the run records data2 (it recorded data)."""
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    mlx_lm_folder(tmp_path / "here" / "data")
    monkeypatch.chdir(tmp_path / "here")
    run = _stopped_lora_run(tmp_path, Path("data"))
    size = json.loads((run / "config.json").read_text())["data_files"]["data.path"]["bytes"]
    (tmp_path / "here" / "data").rename(tmp_path / "here" / "data2")
    monkeypatch.chdir(tmp_path / "elsewhere")
    gone = (f"{tmp_path / 'here' / 'data'}: --data.path: expected the run's data ({size} bytes "
            "when it started), found nothing there")
    want = f"{gone}; put it back, or give where it is now: --data.path PATH"
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert _cli("eval")(["--model", str(run), "--no-progress"]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {want}"
    assert _cli("export")(["--adapter", str(run), "--fuse", "--out", "gone.gguf"]) == 0
    assert f"toymlx-export: held-out loss not measured: {gone} (toymlx-eval --model gone.gguf " \
           "--data.path DATA measures it)\n" in capsys.readouterr().err
    assert _cli("train")(["--resume", str(run), "--data.path", "../here/data2",
                          "--no-progress"]) == 0
    assert _final_step(run) == 4
    # a file fused from it records where its data is now (it recorded the gone folder)
    from toymlx.gguf.reader import GGUFFile

    assert _cli("export")(["--adapter", str(run), "--fuse", "--out", "f.gguf"]) == 0
    with GGUFFile("f.gguf") as g:
        assert g.metadata["toy.run_data.data.path"] == str(tmp_path / "here" / "data2")


def test_a_linked_data_folder_led_elsewhere_is_taken_by_the_files_the_run_reads(tmp_path,
                                                                              capsys):
    """`--data.path link` (link -> data), then `cp -r data copy`, a README.md edited in the
    copy, `ln -sfn copy link` and data gone: --resume takes the copy (its split files are the
    run's) and says so of the folder (it said "this file has its recorded SHA-256")."""
    data = mlx_lm_folder(tmp_path / "data")
    (data / "README.md").write_text("# my data\n")
    link = tmp_path / "link"
    link.symlink_to("data")
    run = _stopped_lora_run(tmp_path, link)
    assert json.loads((run / "config.json").read_text())["data_files"]["data.path"][
        "file"] == str(data)
    shutil.copytree(data, tmp_path / "copy")
    (tmp_path / "copy" / "README.md").write_text("# my data, copied\n")
    link.unlink()
    link.symlink_to("copy")
    shutil.rmtree(data)
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0
    assert f"toymlx-train: --resume reads --data.path from {link} (the run's --data.path " \
           f"{link}: {data} is gone, this folder has its recorded contents)\n" in \
           capsys.readouterr().err
    assert _final_step(run) == 4


@pytest.mark.parametrize("recipe", ["lora", "from_scratch", "warm_start"])
def test_every_text_recipe_records_an_mlx_lm_folder_s_split_files(tmp_path, recipe):
    """The text recipes read a data folder in mlx-lm's layout alike: each records its split
    files alone (a train.csv in place of train.jsonl too), and a single file whole."""
    import importlib

    from toymlx.bundle.inputs import data_files

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text("text\nhello there\n")
    (data / "valid.jsonl").write_text('{"text": "held out"}\n')
    (data / "README.md").write_text("# notes\n")
    (data / "dataset_info.json").write_text("{}\n")  # not a split's name: never read
    cfg = importlib.import_module(f"toymlx.recipes.{recipe}").Config()
    cfg.data.path = str(data)
    rec = data_files(cfg)[0]["data.path"]
    assert (rec["only"], sorted(rec["files"])) == (_names_read(False),
                                                   ["train.csv", "valid.jsonl"])
    assert (rec["bytes"], rec["sha256"]) == _folder_digest(data, ["train.csv", "valid.jsonl"])
    cfg.data.path = str(data / "valid.jsonl")
    rec = data_files(cfg)[0]["data.path"]
    assert "only" not in rec and rec["bytes"] == 21


def test_a_folder_of_text_files_is_recorded_resumed_and_scored_as_the_run_read_it(tmp_path,
                                                                                  capsys):
    """A from-scratch run on a folder of text files records each file (`only`: the text
    suffixes; a notes.png beside them is not read), toymlx-eval of the run scores the
    validation windows it scored (the folder read as one text again), and an edited chapter
    blocks --resume naming it."""
    from toymlx.data.chat import TEXT_SUFFIXES

    book = tmp_path / "book"
    (book / "part2").mkdir(parents=True)
    (book / "ch1.txt").write_text("It was the best of times, it was the worst of times.\n" * 12)
    (book / "part2" / "ch2.md").write_text("# Two\n\nA tale of two cities, told again.\n" * 12)
    (book / "cover.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    run = tmp_path / "runs" / "r"
    assert _cli("train")(["--recipe", "from-scratch", "--data.path", str(book), "--runs-root",
                          str(tmp_path / "runs"), "--run-id", "r", "--model.d-model", "32",
                          "--model.n-layers", "1", "--model.n-heads", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
                          "--checkpoint-every", "2", "--no-progress", "--no-compile",
                          "--steps", "4", "--stop-at", "2"]) == 0
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    assert (rec["only"], sorted(rec["files"])) == (list(TEXT_SUFFIXES),
                                                   ["ch1.txt", "part2/ch2.md"])
    (book / "cover.png").write_bytes(b"\x89PNG\r\n\x1a\n another cover")
    assert _cli("train")(["--resume", str(run), "--no-progress"]) == 0  # not read: no matter
    assert _final_step(run) == 4
    capsys.readouterr()
    assert _cli("eval")(["--model", str(run)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["data"] == str(book)
    assert got["val_loss"] == pytest.approx(run_eval(run, "val")["val_loss"], rel=1e-5)
    with open(book / "part2" / "ch2.md", "a") as f:
        f.write("An epilogue.\n")
    capsys.readouterr()
    assert _cli("train")(["--resume", str(run), "--steps", "6", "--no-progress"]) == 2
    assert "part2/ch2.md changed (492 -> 505 bytes)); a resumed run trains on its own data" in \
        error_line(capsys)
