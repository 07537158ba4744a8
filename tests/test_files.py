"""What a path holds, said before anything opens it (`toymlx.backend.files`)."""

from __future__ import annotations

import json
import os

import pytest
from cli_errors import error_line

from toymlx.backend.files import counted, json_fault, not_a_file, nothing_there, shortlist


def test_nothing_there_names_a_dangling_link_a_file_as_folder_and_an_unexpanded_tilde(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("x")
    (tmp_path / "link.gguf").symlink_to("gone.gguf")
    assert nothing_there("missing.gguf") == "nothing at that path"
    assert nothing_there("plain/m.gguf") == "nothing at that path (plain is a file, not a folder)"
    assert nothing_there("link.gguf") == ("nothing at that path (a link to gone.gguf, which is "
                                          "missing)")
    assert nothing_there("~/m.gguf") == (
        "nothing at that path (~ is expanded only by the shell, not inside quotes, after "
        f"--opt= or in a -c file: write {os.path.expanduser('~/m.gguf')})")


def test_not_a_file_names_what_stands_where_a_file_was_expected(tmp_path, monkeypatch):
    """One helper for --base, --donor, --tokenizer and the Modelfile's base (each had its own
    copy, one saying a bare "nothing")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link.gguf").symlink_to("gone.gguf")
    assert not_a_file("empty") == "a directory"
    assert not_a_file("pipe") == "a FIFO (named pipe)"
    assert not_a_file("missing.gguf") == "nothing at that path"
    assert not_a_file("link.gguf") == "nothing at that path (a link to gone.gguf, which is missing)"
    (tmp_path / "a.gguf").symlink_to("b.gguf")  # a loop was called a link to a missing file
    (tmp_path / "b.gguf").symlink_to("a.gguf")
    assert not_a_file("a.gguf") == ("nothing at that path (a link to b.gguf, a loop of links that "
                                    "never reaches a file)")


@pytest.mark.parametrize("prog,argv,flag", [
    ("eval", ["--model"], "--model: expected a GGUF file or a run directory"),
    ("train", ["--recipe", "from-scratch", "--data.path"], "expected a UTF-8 text file"),
    ("train", ["--recipe", "vit-tiny", "--data.path"],
     "expected a folder of images or a data set file"),
    ("train", ["--recipe", "lora", "--base"], "--base: expected an existing GGUF file"),
    ("train", ["--recipe", "from-scratch", "--tokenizer"],
     "--tokenizer: expected an existing GGUF file"),
    ("train", ["--recipe", "warm-start", "--donor"], "--donor: expected an existing GGUF file"),
])
def test_a_path_given_with_a_tilde_the_shell_left_is_named_with_its_expansion(
        tmp_path, capsys, monkeypatch, prog, argv, flag):
    """`--base='~/m.gguf'`, or `base: ~/m.gguf` in a -c file, reached the command as typed, and
    its "found nothing" (or "no such file or directory") gave no reason; it names the fix now."""
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"toymlx_cli.{prog}").main
    assert main([*argv, "~/toymlx-test-missing", "--runs-root", "runs"]
                if prog == "train" else [*argv, "~/toymlx-test-missing"]) == 2
    assert error_line(capsys, f"toymlx-{prog}") == (
        f"toymlx-{prog}: error: ~/toymlx-test-missing: {flag}, found nothing at that path (~ is "
        "expanded only by the shell, not inside quotes, after --opt= or in a -c file: write "
        f"{os.path.expanduser('~/toymlx-test-missing')})")
    assert not (tmp_path / "runs").exists()  # no run folder begun, nor the runs folder made


def _fault(text: str, line: bool = True) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return json_fault(e, line)
    raise AssertionError(text)


def test_json_fault_says_where_the_text_ends_before_its_json_and_reads_once_at():
    """json's "Unterminated string starting at" was printed "starting at at column 11"; a
    file cut short read like any typo, and an empty file as "Expecting value"."""
    assert _fault('{"a": 1,}') == "Expecting property name enclosed in double quotes at line 1 column 9"
    assert _fault('{"a": 1, "b": "tw', line=False) == (
        "Unterminated string starting at column 15, where the text ends: cut short?")
    assert _fault('{\n  "a": 1,\n') == ("Expecting property name enclosed in double quotes at "
                                        "line 3 column 1, where the text ends: cut short?")
    assert _fault(" \n") == "an empty file"


def test_shortlist_cuts_a_list_after_its_cap_and_counts_the_rest():
    """The one "a, b and N more" of every message that lists what it found (Ollama's and LM
    Studio's models, a data folder's files, a run folder's, events.jsonl's line numbers)."""
    names = ["a", "b", "c", "d", "e"]
    assert shortlist(names, 2) == "a, b and 3 more"
    assert shortlist(names, 4) == "a, b, c, d and 1 more"
    assert shortlist(names, 5) == shortlist(names, 6) == "a, b, c, d, e"
    assert shortlist(("x",), 1) == "x"
    assert shortlist([], 3) == ""


def test_counted_says_one_without_a_plural():
    """A count a user can bring to 1 read "1 rows", "1 steps lost", "1 examples"."""
    assert counted(1, "row") == "1 row"
    assert counted(2, "row") == "2 rows"
    assert counted(0, "step") == "0 steps"
    assert counted(1, "class", "classes") == "1 class"
    assert counted(3, "class", "classes") == "3 classes"
    assert counted(1, "run bundle") == "1 run bundle"


@pytest.mark.parametrize("cut", [0, 60])
def test_a_cut_chat_file_and_a_cut_config_json_say_the_text_ends(tmp_path, capsys, cut,
                                                                 shared_file):
    """A chat JSONL cut inside its last line, and a run's config.json cut or emptied (a copy
    stopped), each named for what it is."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.train import main as train_main

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"What is {i}?", "completion": f"{i}."}) + "\n"
                            for i in range(20))[:-10])
    assert train_main(["--recipe", "lora", "--base", str(shared_file("models/stories260K.gguf")),
                       "--data.path", str(chat), "--runs-root", str(tmp_path)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: {chat}:20: bad JSON (Unterminated string "
                           "starting at column ") and ", where the text ends: cut short?)" in line
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"format": 7, "recipe": "from-scratch",
                                                 "config": {"steps": 2}}, indent=2)[:cut])
    assert eval_main(["--model", str(run)]) == 2
    line = error_line(capsys, "toymlx-eval")
    assert line.startswith(f"toymlx-eval: error: {run / 'config.json'}: expected JSON, found ")
    assert line.endswith("found an empty file" if cut == 0 else
                         ", where the text ends: cut short?"), line


@pytest.mark.parametrize("name,head,want", [
    ("train.parquet", b"PAR1\x15\x04\x15\xa0", (
        "a Parquet file (Hugging Face datasets' files): convert it to JSONL first, e.g. "
        "pandas.read_parquet('{file}').to_json('train.jsonl', orient='records', lines=True)")),
    ("data.arrow", b"ARROW1\x00\x00\xff", (
        "an Arrow file (a Hugging Face datasets cache): save it as JSONL first, e.g. "
        "datasets.Dataset.from_file('{file}').to_json('train.jsonl')")),
    ("train.jsonl.gz", b"\x1f\x8b\x08\x00", ("a gzip-compressed file: decompress it first "
                                             "(gunzip {file})")),
    ("data.zip", b"PK\x03\x04\x14\x00\x08\x08\xa4", ("a zip archive: extract its files first "
                                                  "(unzip {file})")),
    # Windows Notepad's "Unicode" (UTF-16 LE, byte-order mark first) was "not valid UTF-8 at
    # byte offset 0 (line 1, byte 0xff)": the file's encoding and its conversion named
    ("notepad.txt", "hello".encode("utf-16"), ("UTF-16 text: re-save it as UTF-8 (iconv -f "
                                             "UTF-16 -t UTF-8 {file} > {utf8} && mv {utf8} "
                                             "{file})")),
    ("big_endian.txt", "hello".encode("utf-16-be").join((b"\xfe\xff", b"")), (
        "UTF-16 text: re-save it as UTF-8 (iconv -f UTF-16 -t UTF-8 {file} > {utf8} && mv "
        "{utf8} {file})")),
    # in place, its name and suffix kept: a .jsonl re-saved as .txt would train on the JSON
    # around its texts
    ("train.jsonl", '{"text": "hi"}'.encode("utf-32"), (
        "UTF-32 text: re-save it as UTF-8 (iconv -f UTF-32 -t UTF-8 {file} > {utf8} && mv "
        "{utf8} {file})")),
    # an image where the text goes was "re-save the file as UTF-8" too
    ("cat.png", b"\x89PNG\r\n\x1a\n", ("a PNG image: images train a classifier, toymlx-train "
                                       "--recipe vit-tiny --data.path FOLDER (a subfolder of "
                                       "images per class)")),
    ("cat.jpg", b"\xff\xd8\xff\xe0", ("a JPEG image: images train a classifier, toymlx-train "
                                    "--recipe vit-tiny --data.path FOLDER (a subfolder of images "
                                    "per class)")),
    # MNIST's t10k-images-idx3-ubyte.gz was "a gzip-compressed file: decompress it first",
    # which leaves images; the uncompressed file was "re-save the file as UTF-8"
    *((name, head, ("MNIST's IDX images or labels: images train a classifier, toymlx-train "
                    "--recipe vit-tiny --data.path {folder} (the folder of the IDX files)"))
      for name, head in (("t10k-images-idx3-ubyte.gz", b"\x1f\x8b"),
                         ("train-labels-idx1-ubyte", b"\x00\x00\x08\x01")))])
def test_data_files_that_are_not_text_are_named_with_what_to_do(tmp_path, capsys, name, head,
                                                                want):
    """A dataset's Parquet or Arrow file, a .jsonl.gz, a zip: each read "not valid UTF-8 at byte
    offset N ...; re-save the file as UTF-8", advice no one can take for them."""
    from toymlx_cli.train import main as train_main

    data = tmp_path / name
    data.write_bytes(head + bytes(range(128, 256)) * 4)
    assert train_main(["--recipe", "from-scratch", "--data.path", str(data), "--runs-root",
                       str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {data}: expected UTF-8 text, found "
                                  + want.format(file=data, utf8=f"{data}.utf8", folder=tmp_path))
    assert not list(tmp_path.glob("runs/*"))


def test_a_gguf_given_as_the_text_to_train_on_is_named_as_a_model(tmp_path, capsys, shared_file):
    """`--data.path model.gguf` (the model where the data goes) read "not valid UTF-8 at byte
    offset 7554 ...; re-save the file as UTF-8", advice no one can take for a GGUF."""
    from toymlx_cli.train import main as train_main

    gguf = shared_file("models/stories260K.gguf")
    assert train_main(["--recipe", "from-scratch", "--data.path", str(gguf), "--runs-root",
                       str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {gguf}: expected UTF-8 text, found a GGUF model file: --data.path "
        "takes text (a model is --base, --donor, --tokenizer or toymlx-eval's --model)")
    assert not list(tmp_path.glob("runs/*"))
