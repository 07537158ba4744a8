"""No command writes over what it reads: its inputs, a run bundle, an Ollama or LM Studio store
(`toymlx.bundle.outputs.check_output`, called by every writer before it writes)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from cli_errors import error_line
from test_lora import ARGS, tok_meta

from toymlx.gguf.llama import write_llama
from toymlx.models.llama import Llama


def _train(argv: list[str]) -> int:
    from toymlx_cli.train import main

    return main(argv)


def _export(argv: list[str]) -> int:
    from toymlx_cli.export import main

    return main(argv)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A tiny base GGUF and a 2-step LoRA run on it, runs/r1 (its only checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("outputs")
    mx.random.seed(3)
    write_llama(root / "base.gguf", Llama(ARGS), tok_meta(), name="tiny test llama")
    assert _train(["--recipe", "lora", "--base", str(root / "base.gguf"), "--runs-root",
                   str(root / "runs"), "--run-id", "r1", "--steps", "2", "--batch-size", "2",
                   "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1",
                   "--checkpoint-every", "2", "--no-progress", "--no-compile"]) == 0
    return root


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file under `root` (links as their targets): what a refused command must keep."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = p.read_bytes()
    return out


def refused(capsys, root: Path, prog: str, run, argv: list[str], *names: str) -> str:
    """Run a command that must refuse: exit 2, one line naming `names`, every file unchanged."""
    before = snapshot(root)
    capsys.readouterr()
    assert run(argv) == 2
    line = error_line(capsys, prog)
    for name in names:
        assert name in line, line
    assert snapshot(root) == before
    return line


# ---- toymlx-export --------------------------------------------------------------------------
def out_cases(root: Path) -> dict[str, tuple[str, str]]:
    """--out spelling -> (the path the error names as the victim, the kind of refusal)."""
    run = root / "runs" / "r1"
    (root / "x").mkdir(exist_ok=True)
    link, hard = root / "link.gguf", root / "hard.gguf"
    if not link.is_symlink():
        link.symlink_to(root / "base.gguf")
        os.link(root / "base.gguf", hard)
    return {
        str(root / "base.gguf"): (str(root / "base.gguf"), "the same file"),
        str(root / "x" / ".." / "base.gguf"): (str(root / "base.gguf"), "the same file"),
        str(link): (str(root / "base.gguf"), "the same file"),
        str(hard): (str(root / "base.gguf"), "the same file"),
        str(run / "weights" / "adapter_step_2.gguf"): (str(run), "inside"),
        str(run / "weights" / "latest"): (str(run), "inside"),
        str(run / "config.json"): (str(run), "inside"),
    }


@pytest.mark.parametrize("fuse", [True, False])
def test_export_refuses_every_output_that_is_an_input_or_in_a_run(made, capsys, fuse):
    for out, (victim, kind) in out_cases(made).items():
        argv = ["--base", str(made / "base.gguf"), "--adapter", str(made / "runs" / "r1"),
                "--out", out] + (["--fuse"] if fuse else [])
        line = refused(capsys, made, "toymlx-export", _export, argv, out, victim, kind)
        assert len(line) < 300, line


def test_export_refuses_out_equal_to_the_adapter_file(made, capsys):
    ckpt = made / "runs" / "r1" / "weights" / "adapter_step_2.gguf"
    line = refused(capsys, made, "toymlx-export", _export,
                   ["--base", str(made / "base.gguf"), "--adapter", str(ckpt), "--out", str(ckpt)],
                   str(ckpt))
    assert "found the --adapter file" in line and "(the same file)" in line


def test_export_refuses_a_bundle_it_does_not_read(made, capsys):
    """--out into another run's weights/: refused as a run bundle, not as an input."""
    ckpt = made / "runs" / "r1" / "weights" / "adapter_step_3.gguf"
    refused(capsys, made, "toymlx-export", _export,
            ["--base", str(made / "base.gguf"), "--out", str(ckpt)],
            str(ckpt), f"inside the run bundle {made / 'runs' / 'r1'}")


def test_export_refuses_model_stores(made, capsys, monkeypatch, tmp_path):
    ollama, lmstudio = tmp_path / "ollama", tmp_path / "lmstudio"
    blob = ollama / "blobs" / ("sha256-" + "ab" * 32)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"a model's bytes")
    (ollama / "manifests").mkdir()
    (lmstudio / "pub" / "repo").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(lmstudio))
    for out, store in ((blob, ollama), (ollama / "manifests" / "m", ollama),
                       (lmstudio / "pub" / "repo" / "x.gguf", lmstudio)):
        before = snapshot(tmp_path)
        refused(capsys, made, "toymlx-export", _export,
                ["--base", str(made / "base.gguf"), "--out", str(out)], str(out), str(store),
                "inside Ollama's model store" if store == ollama else
                "inside LM Studio's models folder")
        assert snapshot(tmp_path) == before
    assert blob.read_bytes() == b"a model's bytes"


def test_modelfile_refuses_a_folder_in_the_run(made, capsys):
    out = made / "runs" / "r1" / "ollama"
    refused(capsys, made, "toymlx-export", _export,
            ["--adapter", str(made / "runs" / "r1"), "--format", "modelfile", "--fuse",
             "--out", str(out)], str(out), str(made / "runs" / "r1"))
    assert not out.exists()


def test_safetensors_refuses_its_own_checkpoint(tmp_path, capsys):
    from test_timm_export import ARGS as VIT_ARGS
    from test_timm_export import NAMES, NORM

    from toymlx.gguf.vit import write_vit
    from toymlx.models.vit import ViT

    mx.random.seed(3)
    ckpt = tmp_path / "vit.gguf"
    write_vit(ckpt, ViT(VIT_ARGS), NORM, class_names=NAMES)
    refused(capsys, tmp_path, "toymlx-export", _export,
            ["--model", str(ckpt), "--format", "safetensors", "--out", str(ckpt)],
            str(ckpt), "found the --model file")


def test_an_existing_output_is_refused_unless_overwrite(made, capsys, tmp_path):
    """toymlx-report --out, toymlx-export --out (a file; the files it writes into a folder) and
    toymlx-eval --plot wrote over an existing file without a word: an earlier output, or a
    file of the user's own of that name. Each refuses it now, in one line naming it and
    --overwrite (toymlx-train's way with an existing run), before any work; --overwrite
    replaces it."""
    from test_timm_export import ARGS as VIT_ARGS
    from test_timm_export import NAMES, NORM
    from toymlx_cli.eval import main as evaluate
    from toymlx_cli.report import main as report

    from toymlx.gguf.vit import write_vit
    from toymlx.models.vit import ViT

    mx.random.seed(3)
    vit = tmp_path / "vit.gguf"
    write_vit(vit, ViT(VIT_ARGS), NORM, class_names=NAMES)
    run, base = made / "runs" / "r1", made / "base.gguf"
    for name in ("r.png", "x.gguf", "w.safetensors", "timm/config.json", "ollama/Modelfile",
                 "cm.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"the user's own " + name.encode())
    # (command, its flags, --out or --plot, the existing file it names: a folder's own file)
    cases = [("toymlx-report", report, [str(run), "--out"], "r.png", "r.png"),
             ("toymlx-export", _export, ["--base", str(base), "--adapter", str(run), "--out"],
              "x.gguf", "x.gguf"),
             ("toymlx-export", _export, ["--model", str(vit), "--format", "safetensors",
                                         "--out"], "w.safetensors", "w.safetensors"),
             ("toymlx-export", _export, ["--model", str(vit), "--format", "safetensors",
                                         "--out"], "timm", "timm/config.json"),
             ("toymlx-export", _export, ["--adapter", str(run), "--format", "modelfile",
                                         "--out"], "ollama", "ollama/Modelfile"),
             ("toymlx-eval", evaluate, ["--model", str(vit), "--plot"], "cm.png", "cm.png")]
    for prog, command, argv, out, victim in cases:
        flag = argv[-1]
        line = refused(capsys, tmp_path, prog, command, [*argv, str(tmp_path / out)])
        assert line == (f"{prog}: error: {tmp_path / victim}: {flag}: expected a new file, found "
                        f"an existing file; pass --overwrite to replace it, or choose another "
                        f"{flag}")
    for prog, command, argv, out, victim in cases[:-1]:  # eval's plot: test_vit_images
        capsys.readouterr()
        assert command([*argv, str(tmp_path / out), "--overwrite"]) == 0, capsys.readouterr()
        assert b"the user's own" not in (tmp_path / victim).read_bytes()


# ---- the other writers ----------------------------------------------------------------------
def test_train_refuses_a_run_folder_inside_another_run(made, capsys):
    root = made / "runs" / "r1" / "weights"
    refused(capsys, made, "toymlx-train", _train,
            ["--recipe", "lora", "--base", str(made / "base.gguf"), "--runs-root", str(root),
             "--run-id", "nested", "--steps", "1", "--no-progress"],
            str(root / "nested"), f"inside the run bundle {made / 'runs' / 'r1'}")


def test_train_overwrite_refuses_a_run_folder_holding_its_base(made, tmp_path, capsys):
    run = tmp_path / "runs" / "again"
    (run / "weights").mkdir(parents=True)
    base = run / "fused.gguf"
    base.write_bytes((made / "base.gguf").read_bytes())
    refused(capsys, tmp_path, "toymlx-train", _train,
            ["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path / "runs"),
             "--run-id", "again", "--overwrite", "--steps", "1", "--no-progress"],
            str(run), f"the --base {base} inside it")


@pytest.mark.parametrize("where", ["sweep-id", "runs-root"])
def test_sweep_refuses_a_folder_in_a_run_naming_the_flag_that_put_it_there(made, capsys, where):
    """A --sweep-id that names a run's folder (docs once used one id for both) is --sweep-id's
    error, not --runs-root's; a --runs-root inside a run stays --runs-root's."""
    from toymlx_cli.sweep import main as sweep

    run = made / "runs" / "r1"
    root, sweep_id = ((made / "runs", "r1") if where == "sweep-id" else (run / "weights", "s"))
    line = refused(capsys, made, "toymlx-sweep", sweep,
                   ["--recipe", "vit-tiny", "--grid", "lr=1e-3", "--steps", "1", "--runs-root",
                    str(root), "--sweep-id", sweep_id, "--no-progress"])
    at = root / sweep_id if where == "sweep-id" else root
    assert line == (
        f"toymlx-sweep: error: {at}: --{where}: expected a path outside run bundles, found it "
        f"inside the run bundle {run} (its checkpoints, weights/latest and config.json are the "
        f"run's own); choose another --{where}")


def test_report_refuses_a_runs_config(made, capsys):
    from toymlx_cli.report import main as report

    out = made / "runs" / "r1" / "config.json"
    refused(capsys, made, "toymlx-report", report, [str(made / "runs" / "r1"), "--out", str(out)],
            str(out), str(made / "runs" / "r1"))


def test_eval_plot_refuses_its_model(made, capsys):
    from toymlx_cli.eval import main as evaluate

    refused(capsys, made, "toymlx-eval", evaluate,
            ["--model", str(made / "base.gguf"), "--plot", str(made / "x" / ".." / "base.gguf")],
            "--plot", str(made / "base.gguf"), "(the same file)")


def test_check_output_lets_a_writer_into_the_bundle_it_owns(made, tmp_path):
    from toymlx.bundle.outputs import OutputError, check_output

    run = made / "runs" / "r1"
    assert check_output(run / "fused-f32.gguf", [], "--fuse-at-end", owns=[run]) == \
        run / "fused-f32.gguf"
    with pytest.raises(OutputError, match="inside the run bundle"):
        check_output(run / "fused-f32.gguf", [], "--fuse-at-end", owns=[tmp_path])
    assert check_output(tmp_path / "new.gguf", [("--base", made / "base.gguf")]) == \
        tmp_path / "new.gguf"


def test_a_device_or_fifo_as_out_is_refused_not_replaced(made, capsys, tmp_path):
    """`--out /dev/null` (to check that an export works) renamed a regular file over the
    device: run as root, /dev/null itself became a 21 KB GGUF. A FIFO was replaced the same
    way (its reader left waiting). Every writer's --out now refuses both, naming the kind."""
    from toymlx_cli.report import main as report

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    cases = [(fifo, "a FIFO (named pipe)")]
    null = tmp_path / "null.png"
    try:
        os.mknod(null, 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's own device
        cases.append((null, "a character device"))
    except PermissionError:  # not root: the FIFO alone (as root /dev/null is the case)
        pass
    for out, kind in cases:
        for prog, run, argv in (
                ("toymlx-export", _export, ["--adapter", str(made / "runs" / "r1"), "--out",
                                            str(out)]),
                ("toymlx-export", _export, ["--adapter", str(made / "runs" / "r1"), "--fuse",
                                            "--out", str(out)]),
                ("toymlx-report", report, [str(made / "runs" / "r1"), "--out", str(out)])):
            line = refused(capsys, made, prog, run, argv)
            assert line == (f"{prog}: error: {out}: --out: expected a regular file or a new "
                            f"name, found {kind} (writing would replace it with a regular "
                            f"file); choose another --out")
            assert os.stat(out).st_mode & 0o170000 in (0o010000, 0o020000)  # still FIFO/device


def test_a_folder_where_a_file_is_written_is_refused_before_the_work(made, capsys, tmp_path):
    """`--out somefolder` for a GGUF: the export did its work (a fused model: minutes on a
    7B), then failed its rename with "[Errno 21] Is a directory: '.somefolder.tmp-123' ->
    'somefolder'". A file where a folder is written (a Modelfile's --out) said "[Errno 17]
    File exists". Both are refused first, naming what was expected."""
    from toymlx_cli.eval import main as evaluate

    folder, file = tmp_path / "folder", tmp_path / "file"
    folder.mkdir()
    file.write_text("a file")
    run = str(made / "runs" / "r1")
    for prog, main, argv, out, want in (
            ("toymlx-export", _export, ["--adapter", run, "--fuse", "--out", str(folder)],
             "--out", ("expected a file name, found a folder; name a file in it, or choose "
                       "another --out")),
            ("toymlx-export", _export, ["--adapter", run, "--out", str(folder)], "--out",
             ("expected a file name, found a folder; name a file in it, or choose another "
              "--out")),
            ("toymlx-eval", evaluate, ["--model", str(made / "base.gguf"), "--plot",
                                       str(folder)], "--plot",
             ("expected a file name, found a folder; name a file in it, or choose another "
              "--plot")),
            ("toymlx-export", _export, ["--adapter", run, "--format", "modelfile", "--out",
                                        str(file)], "--out",
             "expected a folder (new or existing), found a file; choose another --out")):
        path = folder if "file name" in want else file
        line = refused(capsys, tmp_path, prog, main, argv)
        assert line == f"{prog}: error: {path}: {out}: {want}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
    assert list(folder.iterdir()) == []


# ---- what a run records is an input of every command given the run --------------------------
def test_export_refuses_out_equal_to_the_runs_recorded_data(made, tmp_path, capsys, monkeypatch):
    """`toymlx-export --adapter runs/r --fuse --out chat.jsonl` wrote the fused GGUF over the
    run's training data (then failed to read it for the held-out note): the files a run's
    config.json records are inputs of a command given the run, in any spelling."""
    monkeypatch.chdir(tmp_path)
    rows = "".join(f'{{"prompt": "q {i}", "completion": "answer number {i}"}}\n'
                   for i in range(20))
    (tmp_path / "chat.jsonl").write_text(rows)
    (tmp_path / "link.jsonl").symlink_to("chat.jsonl")
    (tmp_path / "sub").mkdir()
    assert _train(["--recipe", "lora", "--base", str(made / "base.gguf"), "--data.path",
                   "chat.jsonl", "--run-id", "r", "--steps", "1", "--batch-size", "2",
                   "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1",
                   "--no-progress", "--no-compile"]) == 0
    data = tmp_path / "chat.jsonl"
    for out in ("chat.jsonl", "./sub/../chat.jsonl", "link.jsonl"):
        for fuse in (["--fuse"], []):
            line = refused(capsys, tmp_path, "toymlx-export", _export,
                           ["--adapter", "runs/r", *fuse, "--out", out])
            assert line == (f"toymlx-export: error: {Path(out)}: --out: expected a new file, found "
                            f"the run's --data.path file {data} itself (the same file); writing "
                            f"it would destroy the input: choose another --out")
    assert data.read_text() == rows


def test_eval_plot_refuses_the_runs_recorded_data(tmp_path, capsys, monkeypatch):
    """`toymlx-eval --model runs/vit --plot img.npz` drew the confusion matrix over the images
    the run trained on (read from its config.json, not given as --data.path)."""
    import numpy as np
    from toymlx_cli.eval import main as evaluate

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.savez("img.npz", x=(rng.random((30, 8, 8)) * 255).astype(np.uint8),
             y=np.arange(30) % 3)
    assert _train(["--recipe", "vit-tiny", "--data.path", "img.npz", "--run-id", "vit",
                   "--steps", "1", "--batch-size", "8", "--model.d-model", "16",
                   "--model.n-layers", "1", "--model.n-heads", "2", "--model.ffn-dim", "32",
                   "--no-progress", "--no-compile"]) == 0
    data = tmp_path / "img.npz"
    for model in ("runs/vit", "runs/vit/weights/step_1.gguf"):
        line = refused(capsys, tmp_path, "toymlx-eval", evaluate,
                       ["--model", model, "--plot", "./img.npz"])
        assert line == (f"toymlx-eval: error: img.npz: --plot: expected a new file, found the "
                        f"run's --data.path file {data} itself (the same file); writing it "
                        f"would destroy the input: choose another --plot")


# ---- the -c/--config file is an input of every command ----------------------------------------
def test_export_and_eval_refuse_their_config_file_as_output(made, capsys, monkeypatch):
    """`toymlx-export -c exp.yaml --out exp.yaml` wrote the GGUF over the options file it was
    read from, and `toymlx-eval -c ev.yaml --plot ev.yaml` drew the plot over it."""
    from toymlx_cli.eval import main as evaluate

    monkeypatch.chdir(made)
    (made / "exp.yaml").write_text("adapter: runs/r1\nfuse: true\n")
    (made / "ev.yaml").write_text("model: base.gguf\n")
    line = refused(capsys, made, "toymlx-export", _export, ["-c", "exp.yaml", "--out",
                                                             "x/../exp.yaml"])
    assert line == ("toymlx-export: error: x/../exp.yaml: --out: expected a new file, found the "
                    "-c/--config file exp.yaml itself (the same file); writing it would destroy "
                    "the input: choose another --out")
    line = refused(capsys, made, "toymlx-eval", evaluate, ["-c", "ev.yaml", "--plot", "./ev.yaml"])
    assert line == ("toymlx-eval: error: ev.yaml: --plot: expected a new file, found the "
                    "-c/--config file ev.yaml itself (the same file); writing it would destroy "
                    "the input: choose another --plot")


def test_train_overwrite_refuses_the_run_its_config_file_is_in(made, capsys):
    """`toymlx-train -c runs/r1/config.json --run-id r1 --overwrite` replaced the run whose
    config.json it had just read."""
    run = made / "runs" / "r1"
    line = refused(capsys, made, "toymlx-train", _train,
                   ["-c", str(run / "config.json"), "--runs-root", str(made / "runs"),
                    "--run-id", "r1", "--overwrite", "--no-progress"])
    assert line == (f"toymlx-train: error: {run}: --runs-root/--run-id: expected a path that "
                    f"holds no input, found the -c/--config {run / 'config.json'} inside it; "
                    f"choose another --runs-root/--run-id")


def test_sweep_refuses_a_sweep_folder_holding_its_config_file_or_data(made, tmp_path, capsys,
                                                                     monkeypatch):
    """A sweep folder that holds the -c file (named run-options.json, which the sweep writes)
    or a run's data: the sweep wrote its files into it before any run's own check."""
    from toymlx_cli.sweep import main as sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "run-options.json").write_text(
        '{"recipe": "vit-tiny", "grid": {"lr": [0.001]}, "steps": 1, "no_progress": true}\n')
    line = refused(capsys, tmp_path, "toymlx-sweep", sweep,
                   ["-c", "sw/run-options.json", "--runs-root", ".", "--sweep-id", "sw"])
    assert line == ("toymlx-sweep: error: sw: --sweep-id: expected a path that holds no input, "
                    "found the -c/--config sw/run-options.json inside it; choose another "
                    "--sweep-id")
    (tmp_path / "sw" / "run-options.json").unlink()
    (tmp_path / "sw" / "data.txt").write_text("some text to train on\n" * 50)
    line = refused(capsys, tmp_path, "toymlx-sweep", sweep,
                   ["--recipe", "from-scratch", "--data.path", "sw/data.txt", "--grid",
                    "lr=1e-3", "--steps", "1", "--runs-root", ".", "--sweep-id", "sw",
                    "--no-progress"])
    assert line == ("toymlx-sweep: error: sw: --sweep-id: expected a path that holds no input, "
                    "found the --data.path sw/data.txt inside it; choose another --sweep-id")


def test_an_output_under_a_file_is_refused_before_the_work(tmp_path):
    """`--out notes.txt/x.gguf` (a file where a folder is named) ended toymlx-export with
    "[Errno 17] File exists: 'notes.txt'", naming neither the option nor the fault."""
    from toymlx.bundle.outputs import OutputError, check_output

    (tmp_path / "notes.txt").write_text("x")
    for out in (tmp_path / "notes.txt" / "x.gguf", tmp_path / "notes.txt" / "d" / "x.gguf"):
        with pytest.raises(OutputError) as e:
            check_output(out, [], "--out")
        assert str(e.value) == (f"{out}: --out: expected a path in a folder, found "
                                f"{tmp_path / 'notes.txt'} is a file, not a folder; choose "
                                "another --out")
    assert check_output(tmp_path / "new" / "x.gguf", [], "--out") == tmp_path / "new" / "x.gguf"


def test_an_input_folder_named_as_the_output_is_called_a_folder(tmp_path):
    """A run folder given both as --data.path and as the output (train --overwrite into the
    data's folder): the line calls both folders, not files."""
    from toymlx.bundle.outputs import OutputError, check_output

    data = tmp_path / "victim"
    data.mkdir()
    with pytest.raises(OutputError) as e:
        check_output(data, [("--data.path", data)], "--out-dir", folder=True)
    assert str(e.value) == (f"{data}: --out-dir: expected a new folder, found the --data.path "
                            f"folder {data} itself (the same folder); writing it would destroy "
                            "the input: choose another --out-dir")


def test_a_gguf_written_under_another_suffix_is_refused_naming_the_gguf_name(made, capsys,
                                                                          monkeypatch):
    """`toymlx-export --out lm.txt` wrote a GGUF named lm.txt without a word (LM Studio lists
    only *.gguf; a `model` without a suffix is not found either): refused before writing,
    naming the .gguf name to use."""
    monkeypatch.chdir(made)
    cases = [(["--adapter", "runs/r1", "--out", "lm.txt"], "'.txt'", "lm.gguf"),
             (["--adapter", "runs/r1", "--fuse", "--out", "out/model"], "no suffix",
              "out/model.gguf"),
             (["--base", "base.gguf", "--dtype", "q8_0", "--out", "m.GGUF.bin"], "'.bin'",
              "m.GGUF.gguf")]
    for argv, found, fix in cases:
        line = refused(capsys, made, "toymlx-export", _export, argv)
        assert line == (f"toymlx-export: error: {argv[-1]}: --out: expected a .gguf file name "
                        f"(the GGUF it writes; LM Studio and llama.cpp's tools name them so), "
                        f"found {found}; use --out {fix}")
        assert not Path(argv[-1]).exists() and not (made / "out").exists()
    assert _export(["--adapter", "runs/r1", "--out", "LM.GGUF"]) == 0  # any case of .gguf
