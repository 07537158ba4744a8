"""toymlx-eval --max-examples N (alias --limit): the first N examples of the split, scored as
the whole split scores them, for every kind of model eval scores, with the report saying N of
how many."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_errors import error_line
from image_files import make_image_folder
from PIL import Image
from test_lora import events_of, mlx_lm_folder, number_stories_folder, tiny_gguf  # noqa: F401
from toymlx_cli.eval import main as eval_main
from toymlx_cli.train import main as train_main

from toymlx.data import chat
from toymlx.data import text as text_module
from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import load_llama


def vit_run(tmp_path) -> tuple[Path, Path]:
    """(a finished 2-step vit-tiny run of 8x8 images, the folder of 9 images it trained on)."""
    folder = make_image_folder(tmp_path / "imgs", per_class=3)
    assert train_main(["--recipe", "vit-tiny", "--model.d-model", "32", "--model.n-layers", "1",
                       "--model.n-heads", "2", "--model.ffn-dim", "64", "--batch-size", "4",
                       "--no-progress", "--steps", "2", "--data.image-size", "8",
                       "--data.path", str(folder), "--runs-root", str(tmp_path / "runs"),
                       "--run-id", "vit"]) == 0
    return tmp_path / "runs" / "vit", folder


def _json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert eval_main(["--model", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def _mean_ce(model, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """The mean cross-entropy of `model` over the masked targets, in float64 NumPy."""
    logits = np.asarray(model(mx.array(inputs)).astype(mx.float32), np.float64)  # (N, T, V)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, targets[..., None].astype(np.int64), -1)[..., 0]
    return float((ce * mask).sum() / mask.sum())


def test_the_confusion_matrix_heads_each_column_with_its_whole_class_name():
    """Cut to 6 characters, two classes sharing their first six (airplane_a, airplane_b)
    headed two columns `airpla airpla`; each column is now as wide as its name (at least 4,
    and its largest count), every row aligned under it."""
    from toymlx.generation.classify import format_report

    m = np.array([[3, 1, 0], [0, 2, 12], [0, 0, 4]])
    text = format_report(m, ["airplane_a", "airplane_b", "cat"])
    assert text.split("\n")[-5:] == [
        "confusion matrix (rows: true class, columns: predicted)",
        "           airplane_a airplane_b cat",
        "airplane_a          3          1   0",
        "airplane_b          0          2  12",
        "cat                 0          0   4"]
    assert format_report(np.array([[1234, 0], [5, 6]]), ["a", "b"]).split("\n")[-3:] == [
        "         a   b", "a     1234   0", "b        5   6"]


@pytest.mark.parametrize("flag", ["--max-examples", "--limit"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_count_below_one_is_one_line(flag, value, capsys):
    assert eval_main(["--model", "nowhere.gguf", flag, value]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-eval: error: {flag}: expected >= 1 examples to score (or leave it out: "
        f"the whole split), found {value}\n")


def test_the_console_script_sets_up_its_streams_and_heap(monkeypatch):
    """toymlx-eval's console script handed run_command sys.argv's list in place of None, so it
    skipped what every console script does first (closed streams opened on os.devnull, stdout
    escaping what it cannot encode, the heap on huge pages), which the other commands do."""
    import toymlx_cli

    from toymlx.backend import device

    done = []
    monkeypatch.setattr(toymlx_cli, "console_streams", lambda: done.append("streams"))
    monkeypatch.setattr(device, "restart_with_huge_pages", lambda: done.append("heap"))
    monkeypatch.setattr(sys, "argv", ["toymlx-eval", "--model", "nowhere.gguf"])
    assert eval_main() == 2
    assert done == ["streams", "heap"]


@pytest.mark.parametrize("flag", ["--max-examples", "--limit", "--limit=2"])
def test_the_subset_flag_is_named_as_typed(flag, capsys):
    """--limit (mlx_lm.evaluate's spelling) is named --limit back, not --max-examples, a flag the
    user never typed; the last of two spellings is the one tyro takes and the one named."""
    typed, _, value = flag.partition("=")
    assert eval_main(["--model", "nowhere.gguf", "--eval-batches", "3",
                      *([flag] if value else [flag, "2"])]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-eval: error: --eval-batches 3 {typed} 2: expected one of them ({typed} scores "
        "the first N of the whole split); drop one\n")
    assert eval_main(["--model", "nowhere.gguf", "--limit", "1", "--max-examples", "0"]) == 2
    assert capsys.readouterr().err.startswith("toymlx-eval: error: --max-examples: expected")


def test_a_config_file_s_subset_key_is_named_as_the_file_spells_it(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A -c file's `limit:` (mlx_lm.evaluate's name) was named --max-examples in the refusals
    and the report's words, a flag the user never typed; now its key as the file spells it, and
    another key a later check refuses (batch_size: 0) by the file too, not by its flag."""
    f = tmp_path / "e.yaml"
    for key, value, named in (("limit", 0, "key 'limit'"), ("max-examples", 0,
                                                           "key 'max-examples'")):
        f.write_text(f"model: nowhere.gguf\n{key}: {value}\n")
        assert eval_main(["-c", str(f)]) == 2
        assert capsys.readouterr().err == (
            f"toymlx-eval: error: {f}: {named}: expected >= 1 examples to score (or leave it "
            "out: the whole split), found 0\n")
    assert eval_main(["-c", str(f), "--limit", "0"]) == 2  # the command line's over the file
    assert capsys.readouterr().err.startswith("toymlx-eval: error: --limit: expected >= 1")
    f.write_text("model: nowhere.gguf\nbatch_size: 0\n")
    assert eval_main(["-c", str(f)]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-eval: error: {f}: key 'batch_size': expected >= 1 examples per forward pass, "
        "found 0\n")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    f.write_text(f"model: {tiny_gguf}\ndata.path: {text}\nseq_len: 16\nlimit: 3\njson: true\n")
    capsys.readouterr()
    assert eval_main(["-c", str(f)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["subset"].endswith(" windows of 16 tokens (limit 3)")


def test_overwrite_without_a_plot_is_one_line(capsys):
    """--overwrite replaces an existing --plot file, eval's only one: alone it did nothing."""
    assert eval_main(["--model", "nowhere.gguf", "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-eval: error: --overwrite: expected with --plot FILE (it replaces an existing "
        "--plot file), found no --plot\n")


def test_pack_where_no_chat_rows_are_built_is_one_line(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """--data.pack and --data.no-pack build chat/SFT rows: on plain text or images they would
    be taken and ignored (exit status 0); each is refused in one line naming what was found."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(text), "--data.pack"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-eval: error: --data.pack: expected chat/SFT examples to build rows of (a JSONL "
        "file or data folder of prompt/completion or messages), found "
        f"{text} (plain text, scored in windows of --seq-len tokens); drop it\n")
    run, _ = vit_run(tmp_path)
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--data.no-pack"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-eval: error: --data.no-pack: expected chat/SFT examples to build rows of (a "
        f"JSONL file or data folder of prompt/completion or messages), found a ViT ({run}), "
        "which scores images; drop it\n")


def test_an_empty_example_file_says_what_it_should_hold(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """An empty .jsonl (--data.path, or a data folder's test.jsonl with --split test) was
    "empty file; expected UTF-8 text", a plain-text file's words; an mlx-lm user's file holds
    JSON lines: the line now says which (a table: its header row), as an empty valid.jsonl's
    does."""
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    folder = mlx_lm_folder(tmp_path / "data", n_train=4, n_valid=0, n_test=0)
    (folder / "test.jsonl").write_text("")
    table = tmp_path / "none.csv"
    table.write_text("")
    lines = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}'
    for given, extra, f, want in [
            (empty, [], empty, f"one example a line {lines}"),
            (folder, ["--split", "test"], folder / "test.jsonl", f"one example a line {lines}"),
            (table, [], table, ("a header row (text; prompt and completion; or Alpaca's "
                                "instruction, input (optional) and output) and one example "
                                "a row"))]:
        capsys.readouterr()
        assert eval_main(["--model", str(tiny_gguf), "--data.path", str(given), *extra]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"toymlx-eval: error: {f}: empty file; expected {want}")


def test_a_count_not_an_integer_is_one_line(capsys):
    assert eval_main(["--model", "nowhere.gguf", "--limit", "1.5"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-eval: error: --limit: expected an integer or None, got '1.5'\n")


def test_vit_on_another_set_in_timm_s_layout_says_it_pools_train_and_val(tmp_path, capsys):
    """--data.path DIR in timm's layout (train/, val/) of a set the run did not train on is
    scored whole, its two splits pooled: the report said only "(all)". One line says so and
    names --split val; --split val scores val/ alone, without the line."""
    run, _ = vit_run(tmp_path)
    other = tmp_path / "other"
    make_image_folder(other / "train", per_class=2, seed=5)
    make_image_folder(other / "val", per_class=1, seed=6)
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--data.path", str(other), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["images"] == 9
    assert err == (f"toymlx-eval: {other}: train/, val/ are splits (timm's layout), not "
                   "classes: scoring the images of both; --split val: val/ alone\n")
    assert eval_main(["--model", str(run), "--data.path", str(other), "--split", "val",
                      "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["images"] == 3 and err == ""


def test_vit_scores_the_first_images_as_a_folder_of_them_alone(tmp_path, capsys):
    """A ViT on --split all of its 9 images (class folders in order), --max-examples 5: the same
    accuracy, matrix and loss as a folder holding those 5 images alone, in the JSON and the
    text report; more than the set holds scores it all."""
    run, folder = vit_run(tmp_path)
    files = sorted(p for p in folder.rglob("*") if p.is_file())  # cat/00.png, cat/01.png, ..
    first = tmp_path / "first"
    for f in files[:5]:
        (first / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, first / f.parent.name / f.name)
    want = _json(capsys, run, "--data.path", first, "--json")
    got = _json(capsys, run, "--data.path", folder, "--split", "all", "--json",
                "--max-examples", "5", "--batch-size", "2")
    assert want["images"] == 5 and got["confusion"] == want["confusion"]
    assert got["accuracy"] == want["accuracy"]
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert (got["subset"], got["scored"], got["of"]) == (
        "the first 5 of 9 images (--max-examples 5)", 5, 9)
    whole = _json(capsys, run, "--data.path", folder, "--split", "all", "--json")
    every = _json(capsys, run, "--data.path", folder, "--split", "all", "--json", "--limit",
                  "100")
    assert every.pop("subset") == "all 9 images (--limit 100)"
    assert {k: v for k, v in every.items() if k not in ("scored", "of")} == whole
    assert eval_main(["--model", str(run), "--data.path", str(folder), "--split", "all",
                      "--limit", "5"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"accuracy {want['accuracy']:.4f} on 5 images"
    assert text[-1] == "scored the first 5 of 9 images (--limit 5)"
    one = tmp_path / "one"  # a set of one image was "all 1 images"
    (one / files[0].parent.name).mkdir(parents=True)
    shutil.copy(files[0], one / files[0].parent.name / files[0].name)
    got = _json(capsys, run, "--data.path", one, "--split", "all", "--json", "--limit", "5")
    assert (got["subset"], got["scored"], got["of"]) == ("the only image (--limit 5)", 1, 1)


def test_a_float_npz_scores_as_its_8_bit_images_do(tmp_path, capsys):
    """A run trained on 8-bit files (pixels over 255), scored on a float .npz in [0, 1] of the
    same images: divided by the checkpoint's 255 too, its pixels were near 0 (on MNIST 0.14
    against 0.35 on the same images as PNGs or uint8). Scaled over its largest value, as the
    guide says a float .npz is, it scores as the uint8 .npz does."""
    run, _ = vit_run(tmp_path)
    rng = np.random.default_rng(1)
    x8 = rng.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8)
    x8[0, 0, 0, 0] = 255
    y = np.arange(12) % 3
    np.savez(tmp_path / "u8.npz", x=x8, y=y)
    np.savez(tmp_path / "f1.npz", x=x8.astype(np.float32) / 255, y=y)
    want = _json(capsys, run, "--data.path", tmp_path / "u8.npz", "--json")
    got = _json(capsys, run, "--data.path", tmp_path / "f1.npz", "--json")
    assert got["confusion"] == want["confusion"] and got["images"] == 12
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


def test_images_in_no_class_folder_are_named_on_stderr(tmp_path, capsys):
    """toymlx-eval --data.path of a folder with an image beside its class folders: scored
    without it, and a line on stderr says so (the report on stdout is unchanged)."""
    run, folder = vit_run(tmp_path)
    want = _json(capsys, run, "--data.path", folder, "--json")
    Image.new("RGB", (8, 8)).save(folder / "stray.png")
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--data.path", str(folder), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == want
    assert out.err == (f"toymlx-eval: {folder}: 1 image file directly in it, in no class folder "
                       "(stray.png): not read (an image's class is the subfolder it is in); "
                       "move it into one\n")


def test_plot_makes_its_folder(tmp_path, capsys):
    """--plot out/cm.png where out/ does not exist: the whole evaluation ran, then ended in
    "error: [Errno 2] No such file or directory: 'out/cm.png'" and no report. The folder is
    made, as toymlx-export makes its --out's."""
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'toymlx[report]'")
    run, _ = vit_run(tmp_path)
    plot = tmp_path / "out" / "deeper" / "cm.png"
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.splitlines()[-1] == f"plot {plot}"


def test_plot_without_matplotlib_is_one_line_before_the_work(tmp_path, capsys, monkeypatch):
    """--plot where matplotlib is not installed (it is the report extra): every image was
    scored, then a traceback (ModuleNotFoundError) ended it. Refused first, in one line."""
    run, _ = vit_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--plot", str(tmp_path / "cm.png")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        f"toymlx-eval: error: --plot {tmp_path / 'cm.png'}: drawing needs matplotlib; pip "
        "install 'toymlx[report]', or drop --plot\n")
    assert not (tmp_path / "cm.png").exists()


def test_a_subset_of_one_reads_as_one():
    """The report's words on --max-examples where a count is 1: "all 1 validation examples" and
    "the first 1 of 1 windows" were said."""
    from toymlx_cli.eval import subset

    assert subset(None, 1, 1, "val", "example") == {}
    assert subset(5, 1, 1, "val", "example", "1 row made of ")["subset"] == (
        "1 row made of the only validation example (--max-examples 5)")
    assert subset(1, 1, 2, "test", "example")["subset"] == (
        "the first 1 of 2 test examples (--max-examples 1)")
    assert subset(3, 1, 1, "all", "window", tail=" of 16 tokens")["subset"] == (
        "the only window of 16 tokens (--max-examples 3)")
    assert subset(3, 2, 2, "all", "window", tail=" of 16 tokens")["subset"] == (
        "all 2 windows of 16 tokens (--max-examples 3)")


def test_text_scores_the_first_windows_of_the_split(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A Llama on a text file (--split all): the first 3 of its windows of --seq-len tokens,
    the loss a NumPy cross-entropy over those windows gives, and the report says 3 of how
    many; more than it holds scores them all."""
    from toymlx.recipes.common import TextData, load_token_data

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    got = _json(capsys, tiny_gguf, "--data.path", text, "--seq-len", "16", "--max-examples",
                "3")
    model, g = load_llama(tiny_gguf, weights="float32")
    td = load_token_data(TextData(str(text)), Tokenizer.from_metadata(g.metadata), 16,
                         windows=False)
    g.close()
    tokens = np.concatenate([td.train, td.val])
    n = (len(tokens) - 1) // 16
    last = len(tokens) - 17  # windows spread evenly over the split (`toymlx.data.text`)
    starts = [k * last // (n - 1) for k in range(3)]
    win = np.stack([tokens[s:s + 17] for s in starts])
    assert got["val_loss"] == pytest.approx(_mean_ce(model, win[:, :-1], win[:, 1:],
                                                     np.ones((3, 16))), rel=1e-4)
    assert (got["subset"], got["scored"], got["of"], got["tokens_scored"]) == (
        f"the first 3 of {n} windows of 16 tokens (--max-examples 3)", 3, n, 48)
    whole = _json(capsys, tiny_gguf, "--data.path", text, "--seq-len", "16")
    every = _json(capsys, tiny_gguf, "--data.path", text, "--seq-len", "16", "--limit", "999")
    assert every["subset"] == f"all {n} windows of 16 tokens (--limit 999)"
    assert every["val_loss"] == whole["val_loss"] and every["tokens_scored"] == 16 * n



def test_split_valid_is_mlx_lm_s_name_for_val(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """--split valid (mlx-lm's valid.jsonl) was refused, "expected one of val, all, test, None":
    it scores the validation split as --split val does, and is reported as val."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    flags = (tiny_gguf, "--data.path", text, "--seq-len", "16")
    valid, val = _json(capsys, *flags, "--split", "valid"), _json(capsys, *flags, "--split", "val")
    every = _json(capsys, *flags, "--split", "all")
    assert valid == val and valid["split"] == "val"
    assert valid["tokens_scored"] < every["tokens_scored"]

def test_gguf_split_test_scores_the_first_packed_rows(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A Llama GGUF of its own, --split test on chat examples (--data.pack): --max-examples 2
    scores the first 2 rows of all the examples' rows (the loss NumPy gives on them), and
    counts as scored the examples up to the one that completes them."""
    test = mlx_lm_folder(tmp_path / "data", n_train=0, n_valid=0, n_test=40) / "test.jsonl"
    got = _json(capsys, tiny_gguf, "--split", "test", "--data.path", test, "--seq-len", "32",
                "--max-examples", "2", "--data.pack")
    model, g = load_llama(tiny_gguf, weights="float32")
    tok = Tokenizer.from_metadata(g.metadata)
    g.close()
    examples = chat.load_examples(test)
    rows = chat.pack_or_pad([chat.tokenize_example(e, tok, True) for e in examples], 32,
                            tok.eos_id, pack=True)
    assert len(rows["inputs"]) > 10
    want = _mean_ce(model, rows["inputs"][:2], rows["targets"][:2], rows["mask"][:2])
    assert got["test_loss"] == pytest.approx(want, rel=1e-4)
    k = got["scored"]
    assert got["rows"] == 2 and 2 <= k < 10  # stopped once 2 full rows were made
    fewer = chat.pack_or_pad([chat.tokenize_example(e, tok, True) for e in examples[:k - 1]],
                             32, tok.eos_id, pack=True)
    # the k-th example completes them: without it the second row is cut short (padded)
    assert not np.array_equal(fewer["inputs"][:2], rows["inputs"][:2])
    assert (got["subset"], got["scored"], got["of"]) == (
        f"2 rows made of the first {k} of 40 test examples (--max-examples 2)", k, 40)


def test_a_jsonl_file_of_chat_records_is_scored_as_rows_not_as_json_text(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A Llama GGUF of its own on a .jsonl file of prompt/completion records (no --split): its
    rows (--data.pack: the training split's, then the held-out split's, as training built them), the
    completions' tokens scored: the loss NumPy gives on them; not the text of the JSON, braces
    and keys and prompts, as it was scored before."""
    test = mlx_lm_folder(tmp_path / "data", n_train=0, n_valid=0, n_test=40) / "test.jsonl"
    one = tmp_path / "qa.jsonl"
    shutil.copyfile(test, one)
    got = _json(capsys, tiny_gguf, "--data.path", one, "--seq-len", "32", "--data.pack")
    model, g = load_llama(tiny_gguf, weights="float32")
    tok = Tokenizer.from_metadata(g.metadata)
    g.close()
    examples = chat.load_examples(one)  # the training split's rows, then the held-out 10%'s
    parts = [chat.pack_or_pad([chat.tokenize_example(e, tok, True) for e in part], 32,
                              tok.eos_id, pack=True) for part in (examples[:36], examples[36:])]
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    want = _mean_ce(model, rows["inputs"], rows["targets"], rows["mask"])
    assert got["split"] == "all" and got["rows"] == len(rows["inputs"])
    assert got["val_loss"] == pytest.approx(want, rel=1e-4)


def test_a_gguf_of_its_own_scores_chat_examples_one_a_row_as_mlx_lm_and_a_run_does(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A Llama GGUF of its own on chat examples was scored packed (SmolLM2-135M on python_qa's
    validation: 2.8780 where each example's own loss, mlx-lm's evaluate's, is 2.9515), said in
    its line but another figure
    than mlx_lm.lora's or a --data.no-pack run's. Now one example a row by default: the loss
    float64 NumPy gives on the padded rows, and the step-0 validation loss of a lora run of
    --data.no-pack on the same data; --data.pack scores the rows a default (packed) run
    validates, its step-0 loss; each said in the line; both flags at once are refused."""
    data = mlx_lm_folder(tmp_path / "data", n_train=8, n_valid=6, n_test=0)

    def step0(name: str, *extra: str) -> float:
        assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                           str(tmp_path), "--run-id", name, "--steps", "1", "--batch-size", "2",
                           "--seq-len", "64", "--eval-at-start", "--eval-batches", "3",
                           "--no-progress", "--data.path", str(data), *extra]) == 0
        events = [json.loads(x) for x in (tmp_path / name / "events.jsonl").read_text()
                  .splitlines()]
        return next(e for e in events if e["kind"] == "eval" and e["step"] == 0)["val_loss"]

    def scored(*extra: str) -> tuple[dict, str]:
        capsys.readouterr()
        assert eval_main(["--model", str(tiny_gguf), "--data.path", str(data), "--split",
                          "val", "--seq-len", "64", "--data.mask-prompt", "--no-progress",
                          *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err.splitlines()[-1]

    model, g = load_llama(tiny_gguf, weights="float32")
    tok = Tokenizer.from_metadata(g.metadata)
    g.close()
    seqs = [chat.tokenize_example(e, tok, True)
            for e in chat.load_examples(data / "valid.jsonl")]
    padded = chat.pack_or_pad(seqs, 64, tok.eos_id, pack=False)
    packed = chat.pack_or_pad(seqs, 64, tok.eos_id, pack=True)
    assert (len(padded["inputs"]), len(packed["inputs"])) == (6, 5)
    one_a_row = _mean_ce(model, padded["inputs"], padded["targets"], padded["mask"])
    run_together = _mean_ce(model, packed["inputs"], packed["targets"], packed["mask"])
    assert abs(one_a_row - run_together) > 1e-3  # the two figures the user could get

    got, line = scored()
    assert (got["rows"], got["packed"]) == (6, False)
    assert got["val_loss"] == pytest.approx(one_a_row, abs=1e-4)
    assert got["val_loss"] == pytest.approx(step0("own", "--data.no-pack"), abs=1e-4)
    assert got == scored("--data.no-pack")[0]
    said = ("toymlx-eval: 6 validation examples made {} of --seq-len 64 ({}; as mlx_lm.lora "
            "--test builds them: prompts masked, the last message trained (its --mask-prompt)): "
            "eval's rows for a model outside a run, not a run's; to "
            "score a run's eval rows give its --seq-len, {}, and --max-examples its "
            "--eval-batches x --batch-size where the split makes more rows (a run of other "
            "--data.mask-prompt or --data.train-turns: toymlx-eval --model RUN, or its fused "
            "file exported again, which records them)")
    assert line == said.format("6 rows", "one example a row, as mlx-lm's evaluate scores them",
                               "--data.pack where it packed them (toymlx-train's default)")
    got, line = scored("--data.pack")
    assert (got["rows"], got["packed"]) == (5, True)
    assert got["val_loss"] == pytest.approx(run_together, abs=1e-4)
    assert got["val_loss"] == pytest.approx(step0("packed"), abs=1e-4)
    assert line == said.format("5 rows", "packed", "--data.no-pack where it kept one example "
                               "a row")
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(data), "--data.pack",
                      "--data.no-pack"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--data.pack, --data.no-pack: expected one of them, got both")


def test_split_val_of_examples_without_a_validation_file_says_which(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A GGUF of its own, --split val on a data folder without valid.jsonl (mlx-lm validates
    nothing there) scored the last 10% of train.jsonl with nothing said but "data":
    "train.jsonl"; now a line says which examples, and where 10% holds none the refusal no
    longer speaks of a run that is not there."""
    folder = mlx_lm_folder(tmp_path / "data", n_train=12, n_valid=0, n_test=0)
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(folder), "--split", "val",
                      "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["data"] == str(folder / "train.jsonl")
    assert (f"toymlx-eval: --split val: the last 1 of {folder / 'train.jsonl'}'s 12 examples "
            "(--data.val-fraction 0.1, no validation file), as a run holds them out; --split "
            "all scores every example") in err.splitlines()
    few = mlx_lm_folder(tmp_path / "few", n_train=5, n_valid=0, n_test=0)
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(few), "--split", "val",
                      "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-eval: error: {few / 'train.jsonl'}: --split val: expected validation rows to "
        "score, found none: a run would hold out no examples (--data.val-fraction 0.1 of 5 "
        "examples, no valid.jsonl); score them all with --split all")


def test_split_val_of_a_run_whose_valid_jsonl_is_empty_says_it_is_empty(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A run of --data.val-fraction 0 on a folder whose valid.jsonl is empty (mlx-lm's meaning:
    validate nothing) validated none; --split val said "no valid.jsonl" of a file that is there,
    which led to looking for a missing file; now it says the file is empty."""
    folder = mlx_lm_folder(tmp_path / "data", n_train=6, n_valid=0, n_test=0)
    (folder / "valid.jsonl").write_text("")
    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--run-id", "e", "--steps", "1", "--batch-size", "2",
                       "--seq-len", "32", "--data.val-fraction", "0", "--no-progress",
                       "--no-compile", "--data.path", str(folder)]) == 0
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "e"), "--split", "val", "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-eval: error: {folder / 'valid.jsonl'}: --split val: expected validation rows "
        "to score, found none: the file is empty, and the run held out no examples of "
        f"{folder / 'train.jsonl'} (--data.val-fraction 0.0); score them all with --split all")


def test_examples_cut_at_seq_len_are_said(tmp_path, stories_path, capsys):
    """A GGUF of its own, one example a row: examples longer than --seq-len were cut, their
    ends left unscored, with nothing said (mlx-lm warns of sequences over its
    max_seq_length); the line a run prints of its own rows now says how many, and the tokens
    scored are those within the rows (every token of them: a data folder outside a run is
    scored as mlx_lm.lora --test scores it, no --mask-prompt)."""
    folder = number_stories_folder(tmp_path / "data", {"train": 4, "test": 5})
    capsys.readouterr()
    assert eval_main(["--model", str(stories_path), "--data.path", str(folder), "--split",
                      "test", "--seq-len", "20", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    f = folder / "test.jsonl"
    assert (f"toymlx-eval: {f}: test: of 5 examples, 5 cut to their first 21 tokens "
            "(--seq-len 20; what follows is not scored)") in err.splitlines()
    model, g = load_llama(stories_path, weights="float32")
    tok = Tokenizer.from_metadata(g.metadata)
    g.close()
    rows = chat.pack_or_pad([chat.tokenize_example(e, tok, False)
                             for e in chat.load_examples(f)], 20, tok.eos_id, pack=False)
    got = json.loads(out)
    assert got["tokens_scored"] == int(rows["mask"].sum())
    assert got["test_loss"] == pytest.approx(
        _mean_ce(model, rows["inputs"], rows["targets"], rows["mask"]), abs=1e-4)


def _reads_as_the_texts(path: Path, texts: list[str]):
    """`load_token_data` of --data.path `path`, checked to hold the ids a text file of `texts`
    (joined by blank lines, beside `path`) gives, split for split."""
    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.recipes.common import TextData, load_token_data

    plain = path.with_suffix(".txt")
    plain.write_text("\n\n".join(texts))
    got = load_token_data(TextData(str(path), 0.25), byte_tokenizer(), 8)
    want = load_token_data(TextData(str(plain), 0.25), byte_tokenizer(), 8)
    assert np.array_equal(got.train, want.train) and np.array_equal(got.val, want.val)
    return got


def test_a_jsonl_file_of_text_records_gives_their_text_not_their_json(tmp_path):
    """--data.path a .jsonl file of {"text"} records (from-scratch, warm-start, toymlx-eval):
    the ids of their texts joined by blank lines, as a text file of them gives, and as a data
    folder's train.jsonl is read; the JSON around them was trained before. Other records: one
    line naming the file, the line and the kind."""
    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.recipes.common import TextData, load_token_data

    texts = ["the quick brown fox", 'jumps "over" the lazy dog', "and naps.\nThe end"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert _reads_as_the_texts(jsonl, texts).source == str(jsonl)
    tok = byte_tokenizer()
    pc = tmp_path / "pc.jsonl"
    pc.write_text('{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(text_module.DataError, match=r"pc\.jsonl:1: expected a \{\"text\": "
                       r"\.\.\.\} record \(this recipe trains on plain text\), found a "
                       r"completion record; such records fine-tune a model: toymlx-train "
                       r"--recipe lora --base MODEL\.gguf --data\.path .*pc\.jsonl$"):
        load_token_data(TextData(str(pc)), tok, 8)


def test_a_table_without_a_text_column_is_one_line_naming_its_columns(tmp_path, capsys):
    """--data.path a .csv of texts (from-scratch, warm-start, toymlx-eval): its "text" column's
    cells, as a text file of them gives. A table without one was refused at row 2 as a
    prompt/completion record (Alpaca's columns too), or as a header of no record shape (with
    the fine-tune shapes this recipe never trains on); now the header's columns are named
    beside the one expected, before a run is made."""
    texts = ["the quick brown fox", 'jumps "over", the lazy dog', "and naps.\nThe end"]
    table = tmp_path / "t.csv"  # a row of empty fields last: skipped, as a blank line is
    table.write_text("id,text\n" + "".join(f'{i},"{t.replace(chr(34), 2 * chr(34))}"\n'
                                            for i, t in enumerate(texts)) + ",\n")
    _reads_as_the_texts(table, texts)
    hint = ("; such records fine-tune a model: toymlx-train --recipe lora --base MODEL.gguf "
            "--data.path {p}")
    for name, header, found in [("pc.csv", "prompt,completion", "prompt, completion" + hint),
                                ("alpaca.tsv", "instruction\tinput\toutput",
                                 "instruction, input, output" + hint),
                                ("qa.csv", "question,answer", "question, answer")]:
        p = tmp_path / name
        p.write_text("\n" + header + "\n" + header.replace("\t", "\ta") + "a\n")
        assert train_main(["--recipe", "from-scratch", "--data.path", str(p), "--runs-root",
                           str(tmp_path / "runs"), "--steps", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f'toymlx-train: error: {p}: row 2 (the header): expected a column "text" (this '
            f"recipe trains on plain text; other columns are ignored), found columns "
            + found.format(p=p)]
    assert not (tmp_path / "runs").exists()


def test_a_gguf_on_a_folder_without_test_jsonl_says_what_it_scores(tiny_gguf, tmp_path,  # noqa: F811
                                                                     capsys):
    """The guide's stand-in for `mlx_lm.lora --test` on a folder without test.jsonl (which
    mlx-lm refuses) scored train.jsonl and valid.jsonl with nothing said but the JSON's "split":
    "all"; now a line says so, the loss that of one file holding both."""
    folder = mlx_lm_folder(tmp_path / "data", n_train=6, n_valid=3, n_test=0)
    both = tmp_path / "both.jsonl"
    both.write_text((folder / "train.jsonl").read_text() + (folder / "valid.jsonl").read_text())
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(folder), "--seq-len", "64",
                      "--no-progress"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert (f"toymlx-eval: {folder}: no test.jsonl, which mlx_lm.lora --test scores (it refuses "
            "a folder without one): scoring its training and validation examples (--split all); "
            "--split val scores the validation ones alone") in err.splitlines()
    want = _json(capsys, tiny_gguf, "--data.path", both, "--seq-len", "64", "--no-progress",
                 "--data.no-pack", "--data.no-mask-prompt")
    assert (got["split"], got["rows"]) == ("all", 9)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    with_test = mlx_lm_folder(tmp_path / "t", n_train=6, n_valid=3, n_test=2)
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(with_test), "--seq-len",
                      "64", "--no-progress"]) == 0
    assert "no test.jsonl" not in capsys.readouterr().err


def test_lora_run_scores_the_first_validation_rows(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A LoRA run (one example a row, --data.no-pack) on its validation rows: --max-examples 3
    gives the loss of a file holding the first 3 validation examples alone; more than it
    holds scores them all."""
    data = mlx_lm_folder(tmp_path / "data", n_valid=8, n_test=0)
    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--run-id", "r", "--steps", "1", "--batch-size", "2",
                       "--seq-len", "64", "--no-progress", "--no-compile", "--data.no-pack",
                       "--data.path", str(data)]) == 0
    first = tmp_path / "first.jsonl"
    first.write_text("".join((data / "valid.jsonl").read_text().splitlines(True)[:3]))
    want = _json(capsys, tmp_path / "r", "--data.path", first)  # --split all of 3
    got = _json(capsys, tmp_path / "r", "--max-examples", "3")
    assert want["rows"] == got["rows"] == 3
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert (got["subset"], got["scored"], got["of"]) == (
        "3 rows made of the first 3 of 8 validation examples (--max-examples 3)", 3, 8)
    whole = _json(capsys, tmp_path / "r")
    every = _json(capsys, tmp_path / "r", "--limit", "50")
    assert every["subset"] == "8 rows made of all 8 validation examples (--limit 50)"
    assert every["val_loss"] == whole["val_loss"] and every["rows"] == 8


class _Terminal(io.StringIO):
    """A stderr that is a terminal (where toymlx draws its bars)."""

    def isatty(self) -> bool:
        return True


def _with_bars(monkeypatch, capsys, *argv: str) -> tuple[str, list[tuple], str]:
    """toymlx-eval `argv` with stderr a terminal: (stdout, (desc, unit, total, counted) of each
    bar drawn, what stderr got); then the same with --no-progress and with stderr not a
    terminal: no bar, and stdout byte for byte the same."""
    from toymlx.backend import progress

    bars: list[tuple] = []

    class Recorded(progress.tqdm):
        def close(self) -> None:
            if not self.disable:
                bars.append((self.desc, self.unit, self.total, self.n))
            super().close()

    monkeypatch.setattr(progress, "tqdm", Recorded)
    capsys.readouterr()
    term = _Terminal()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", term)
        assert eval_main(list(argv)) == 0
    out = capsys.readouterr().out
    drawn = bars[:]
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", _Terminal())
        assert eval_main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().out == out
    assert eval_main(list(argv)) == 0  # stderr captured: not a terminal
    assert capsys.readouterr().out == out
    assert bars == drawn  # neither drew one
    return out, drawn, term.getvalue()


def test_a_progress_bar_counts_what_eval_scores_and_leaves_the_report_alone(
        tiny_gguf, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Scoring a whole split printed nothing for minutes (a LoRA run's 1,658 chat rows: over
    20 minutes on 2 cores). On a terminal a bar on stderr now counts the images, windows or
    chat rows scored, to the total the report names (a text split's padding rows not among
    them); --no-progress or a stderr that is no terminal draws none; stdout is the same."""
    run, folder = vit_run(tmp_path)
    vit = ["--model", str(run), "--data.path", str(folder), "--split",
           "all", "--batch-size", "2"]
    for extra, n in [([], 9), (["--max-examples", "5"], 5)]:
        out, bars, err = _with_bars(monkeypatch, capsys, *vit, *extra)
        assert bars == [("toymlx-eval", "image", n, n)] and f" 0/{n} " in err
        assert f" on {n} images" in out.splitlines()[0]
        assert "toymlx-eval" not in out
    out, bars, _ = _with_bars(monkeypatch, capsys, *vit, "--json")
    assert json.loads(out)["images"] == 9 and bars == [("toymlx-eval", "image", 9, 9)]

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    size = text.stat().st_size
    monkeypatch.setattr(text_module, "BAR_BYTES", 100)  # a large file: tokenized under a bar
    for extra in ([], ["--max-examples", "3"]):
        out, bars, err = _with_bars(monkeypatch, capsys, "--model", str(tiny_gguf),
                                    "--data.path", str(text), "--seq-len", "16", *extra)
        n = json.loads(out)["tokens_scored"] // 16  # windows: batches of 16 rows
        assert n == 3 if extra else n % 16  # the last of them filled with padding rows
        # 3 windows, one call scores them all: said in place of a bar that would sit at 0/3
        # until it ends; 22 in two calls (16 + 6) are counted by a bar
        name = "toymlx-eval: scoring 3 windows in one pass" if extra else "toymlx-eval"
        assert bars == [("tokenizing t.txt", "B", size, size), (name, "window", n, n)]
        assert (f" 0/{n} " in err) != bool(extra)

    test = mlx_lm_folder(tmp_path / "data", n_train=0, n_valid=0, n_test=40) / "test.jsonl"
    out, bars, err = _with_bars(monkeypatch, capsys, "--model", str(tiny_gguf), "--split",
                                "test", "--data.path", str(test), "--seq-len", "32",
                                "--batch-size", "8", "--data.pack")
    rows = json.loads(out)["rows"]
    assert rows > 10 and bars == [("tokenizing test examples", "example", 40, 40),
                                  ("toymlx-eval", "row", rows, rows)]
    assert f" 0/{rows} " in err


def _last_eval(run: Path) -> float:
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "eval"][-1]["val_loss"]


def test_a_text_run_is_scored_on_its_own_eval_windows_by_default(tmp_path, capsys,
                                                                 shared_file):
    """toymlx-eval RUN scored every validation row where the run's eval events score the first
    --eval-batches x --batch-size (a gemma2 run: 6.5630 on 32 rows, toymlx-eval 6.5644 on 35):
    a from-scratch run's own windows are now scored by default, in its batches, the loss its
    last eval event's; --eval-batches -1 (mlx-lm's "all") scores every window; each against
    float64 NumPy over the same windows."""
    from toymlx.recipes.common import TextData, load_token_data

    text = tmp_path / "t.txt"
    text.write_text(shared_file("text/tinystories_sample.txt").read_text()[:6000])
    assert train_main(["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers",
                       "1", "--model.n-heads", "4", "--model.n-kv-heads", "2",
                       "--model.ffn-dim", "64", "--model.context", "64", "--seq-len", "16",
                       "--steps", "2", "--batch-size", "2", "--eval-batches", "2",
                       "--data.path", str(text), "--runs-root", str(tmp_path), "--run-id", "t",
                       "--no-progress"]) == 0
    run = tmp_path / "t"
    model, g = load_llama(run / "weights" / "step_2.gguf")
    td = load_token_data(TextData(str(text)), Tokenizer.from_metadata(g.metadata), 16)
    g.close()
    n = (len(td.val) - 1) // 16

    def by_numpy(batch_size: int, batches: int) -> float:
        b = {k: np.concatenate(list(v)) for k, v in zip(
            ("inputs", "targets", "mask"), zip(*[(x["inputs"][0], x["targets"][0], x["mask"][0])
                                                 for x in td.val_batches(batch_size, 16,
                                                                         batches)]))}
        return _mean_ce(model, b["inputs"], b["targets"], b["mask"])

    got = _json(capsys, run)
    assert abs(got["val_loss"] - _last_eval(run)) <= 1e-6
    assert got["val_loss"] == pytest.approx(by_numpy(2, 2), abs=1e-5)
    said = (f"the run's eval rows: 4 of {n} validation windows (--eval-batches 2 x --batch-size "
            "2, its config.json); --eval-batches -1 scores all")
    assert (got["subset"], got["scored"], got["of"]) == (said, 4, n)
    every = _json(capsys, run, "--eval-batches", "-1")
    assert (every["subset"], every["scored"]) == (f"all {n} validation windows (--eval-batches -1)",
                                                  n)
    assert every["tokens_scored"] == 16 * n
    assert every["val_loss"] == pytest.approx(by_numpy(n, 1), abs=1e-5)


def test_a_checkpoint_outside_its_run_is_scored_at_its_context_by_default(tmp_path, capsys,
                                                                          shared_file):
    """A from-scratch or warm-start checkpoint's context is its run's --seq-len (32 here): copied
    out of its run (or exported) and scored on a text file with no --seq-len, eval took its
    256 and refused it, "--seq-len: expected at most 32 (the context length of c.gguf), found
    256", a value never given. Now eval's 256 is cut to the model's context, as on a data
    folder: the loss of --seq-len 32 given."""
    text = tmp_path / "t.txt"
    text.write_text(shared_file("text/tinystories_sample.txt").read_text()[:3000])
    assert train_main(["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers",
                       "1", "--model.n-heads", "4", "--model.n-kv-heads", "2",
                       "--model.ffn-dim", "64", "--seq-len", "32", "--steps", "1",
                       "--batch-size", "2", "--data.path", str(text), "--runs-root",
                       str(tmp_path), "--run-id", "t", "--no-progress"]) == 0
    copy = tmp_path / "c.gguf"
    shutil.copy(tmp_path / "t" / "weights" / "step_1.gguf", copy)
    got = _json(capsys, copy, "--data.path", text)
    given = _json(capsys, copy, "--data.path", text, "--seq-len", "32")
    assert got["seq_len"] == 32 and got == given


def test_a_run_s_held_out_split_of_data_changed_since_is_refused(tmp_path, capsys):
    """toymlx-eval RUN scored its text file as it was now: after a line was appended, the
    seeded split held other windows (some the run trained on) and the figure moved (5.5018 to
    5.5073) without a word, where a resume refuses the same file. Now the run's own split is
    scored only from the data config.json recorded (exit 2, both digests named), --data.path
    scores the file as it is, and a restored file is scored again."""
    from toymlx.bundle.inputs import fingerprint

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    assert train_main(["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers",
                       "1", "--seq-len", "16", "--steps", "1", "--batch-size", "2",
                       "--eval-batches", "1", "--data.path", str(text), "--runs-root",
                       str(tmp_path), "--run-id", "t", "--no-progress", "--no-compile"]) == 0
    run, was, kept = tmp_path / "t", fingerprint(text), text.read_text()
    before = _json(capsys, run)["val_loss"]
    text.write_text(kept + "and one line more.\n")
    now = fingerprint(text)
    for split in ("val", "all"):
        assert eval_main(["--model", str(run), "--split", split]) == 2
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", (
            f"toymlx-eval: error: {text}: --split {split}: expected the "
            f"{'validation ' if split == 'val' else ''}data the run recorded at its start "
            f"(data.path): {was['bytes']} bytes, sha256 {was['sha256']}; found it changed: "
            f"{now['bytes']} bytes, sha256 {now['sha256']}; restore it, or score the data as it "
            f"is now with --data.path {text}\n"))
    assert _json(capsys, run, "--data.path", text)["val_loss"] != before
    text.write_text(kept)
    assert _json(capsys, run)["val_loss"] == before


def test_a_lora_run_is_scored_on_its_own_eval_rows_by_default(tmp_path, capsys, stories_path):
    """A LoRA run on ../shared's stories260K, 7 validation rows of which its eval events score
    the first --eval-batches 2 x --batch-size 2: toymlx-eval RUN scores those 4 in the run's
    batches, the loss its last eval event's; --eval-batches -1 all 7, as the whole split
    (--max-examples past its end) scores them."""
    data = number_stories_folder(tmp_path / "data", {"train": 12, "valid": 7})
    assert train_main(["--recipe", "lora", "--base", str(stories_path), "--runs-root",
                       str(tmp_path), "--run-id", "l", "--steps", "2", "--batch-size", "2",
                       "--eval-batches", "2", "--seq-len", "32", "--data.no-pack",
                       "--no-progress", "--data.path", str(data)]) == 0
    run = tmp_path / "l"
    got = _json(capsys, run)
    assert abs(got["val_loss"] - _last_eval(run)) <= 1e-6
    said = ("the run's eval rows: 4 of 7 validation rows (--eval-batches 2 x --batch-size 2, its "
            "config.json); --eval-batches -1 scores all")
    assert (got["subset"], got["scored"], got["of"], got["rows"]) == (said, 4, 7, 4)
    every = _json(capsys, run, "--eval-batches", "-1")
    whole = _json(capsys, run, "--max-examples", "100")
    assert (every["subset"], every["rows"], whole["rows"]) == (
        "all 7 validation rows (--eval-batches -1)", 7, 7)
    assert every["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    assert abs(every["val_loss"] - got["val_loss"]) > 1e-4  # other rows: another figure


@pytest.mark.parametrize("argv, said", [
    (["--eval-batches", "0"], ("--eval-batches: expected >= 1 batches, or -1 (every validation "
                               "row), found 0")),
    (["--eval-batches", "2", "--max-examples", "3"], ("--eval-batches 2 --max-examples 3: "
     "expected one of them (--max-examples scores the first N of the whole split); drop one")),
])
def test_eval_batches_out_of_place_is_one_line(argv, said, capsys):
    assert eval_main(["--model", "nowhere.gguf", *argv]) == 2
    assert capsys.readouterr().err == f"toymlx-eval: error: {said}\n"


@pytest.mark.parametrize("text, argv, said, subset", [
    ("eval_batches: 2\nlimit: 5\n", [], "keys 'eval_batches' (2) and 'limit' (5)", "limit"),
    ("eval-batches: 2\nmax-examples: 5\n", [], "keys 'eval-batches' (2) and 'max-examples' (5)",
     "max-examples"),
    ("eval_batches: 2\n", ["--limit", "3"], "key 'eval_batches' (2) and --limit 3", "--limit"),
    ("limit: 5\n", ["--eval-batches", "3"], "--eval-batches 3 and key 'limit' (5)", "limit"),
])
def test_eval_batches_and_limit_in_a_file_are_named_by_its_keys(text, argv, said, subset,
                                                                 tmp_path, capsys):
    """A -c file setting eval_batches and limit was refused as `--eval-batches 2 limit 5`, no
    file named and one key a flag; now the file and each key as it spells it."""
    f = tmp_path / "e.yaml"
    f.write_text(text)
    assert eval_main(["--model", "nowhere.gguf", "-c", str(f), *argv]) == 2
    assert capsys.readouterr().err == (f"toymlx-eval: error: {f}: {said}: expected one of them "
                                       f"({subset} scores the first N of the whole split); drop "
                                       "one\n")


def test_eval_batches_on_data_a_run_did_not_validate_is_one_line(
        tiny_gguf, tmp_path, capsys):  # noqa: F811
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(text), "--seq-len", "16",
                      "--eval-batches", "2"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-eval: error: --eval-batches 2: expected a run's own validation split to take "
        f"batches of (--split val on its data), found {tiny_gguf}, a model outside a run; drop "
        "--eval-batches (that split is scored whole)\n")


def test_a_vit_run_is_scored_on_its_own_eval_images_by_default(tmp_path, capsys):
    """A vit-tiny run scoring --eval-batches 1 x --batch-size 4 of its 6 validation images:
    toymlx-eval RUN scores those 4, its accuracy and loss the run's last eval event's;
    --eval-batches -1 all 6."""
    folder = make_image_folder(tmp_path / "imgs", per_class=4)
    assert train_main(["--recipe", "vit-tiny", "--model.d-model", "32", "--model.n-layers", "1",
                       "--model.n-heads", "2", "--model.ffn-dim", "64", "--batch-size", "4",
                       "--no-progress", "--steps", "2", "--data.image-size", "8",
                       "--eval-batches", "1", "--data.val-fraction", "0.5",
                       "--data.path", str(folder), "--runs-root", str(tmp_path / "runs"),
                       "--run-id", "vit"]) == 0
    run = tmp_path / "runs" / "vit"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["kind"] == "eval"][-1]
    got = _json(capsys, run, "--json")
    said = ("the run's eval rows: 4 of 6 validation images (--eval-batches 1 x --batch-size 4, "
            "its config.json); --eval-batches -1 scores all")
    assert (got["subset"], got["images"]) == (said, 4)
    assert got["accuracy"] == last["accuracy"]
    assert got["val_loss"] == pytest.approx(last["val_loss"], abs=1e-6)
    every = _json(capsys, run, "--json", "--eval-batches", "-1")
    assert (every["subset"], every["images"]) == ("all 6 validation images (--eval-batches -1)",
                                                  6)


def test_a_fused_export_outside_its_run_says_the_rows_it_built(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """A LoRA run of --seq-len 64 on a data folder of 2 validation examples scores them as 2
    packed rows; its fused export from before the file recorded the run's settings (here: the
    export without its toy.run_data.* keys), scored without the run (a GGUF of its own: no
    --seq-len, --data.pack of the run to read), was scored as 1 row of eval's default --seq-len 256 with
    nothing said: every trained token, but the second example read after the first, so a loss
    other than the run's. Now a line on stderr says the rows eval built with its own settings
    (on a data folder those of mlx_lm.lora --test: one example a row, every token scored) and
    how to score the run's; the report gives --seq-len and the tokens scored; with the run's
    --seq-len, --data.pack and --data.mask-prompt the rows and the loss are the run's last
    validation (F32 fuse: exact), and
    of a run validating its first --eval-batches 2 x --batch-size 2 of 8 rows, with
    --max-examples 4 too."""
    from toymlx_cli.export import main as export_main

    from toymlx.gguf.fuse import write_with_tensors
    from toymlx.gguf.reader import GGUFFile

    def fused_run(name: str, n_valid: int, *extra: str) -> tuple[Path, Path, dict]:
        """(its data folder, its fused export, its last eval event) of a --seq-len 64 run."""
        data = mlx_lm_folder(tmp_path / f"{name}-data", n_train=12, n_valid=n_valid, n_test=0)
        assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                           str(tmp_path), "--run-id", name, "--steps", "4", "--batch-size", "2",
                           "--seq-len", "64", "--lr", "1e-2", "--no-progress", "--data.path",
                           str(data), *extra]) == 0
        events = [json.loads(x) for x in (tmp_path / name / "events.jsonl").read_text()
                  .splitlines()]
        made = tmp_path / f"{name}-now.gguf"
        assert export_main(["--adapter", str(tmp_path / name), "--fuse", "--out",
                            str(made)]) == 0
        fused = tmp_path / f"{name}.gguf"
        with GGUFFile(made) as g:  # the base's metadata, not its toy.run_data.*: as before
            write_with_tensors(fused, g, {})
        return data, fused, [e for e in events if e["kind"] == "eval"][-1]

    data, fused, last = fused_run("r", 2)
    assert last["val_row_n"] == [9, 9]  # the run's 2 rows, 9 trained targets each
    flags = ["--data.path", str(data), "--split", "val", "--no-progress"]

    def scored(*extra: str) -> tuple[dict, str]:
        capsys.readouterr()
        assert eval_main(["--model", str(fused), *flags, *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err.splitlines()[-1]

    said = ("toymlx-eval: 2 validation examples made 2 rows of --seq-len {} ({}; as "
            "mlx_lm.lora --test builds them: {}): eval's rows for a model outside a run, not a "
            "run's; to score a run's eval rows give its --seq-len, {}, and --max-examples its "
            "--eval-batches x --batch-size where the split makes more rows (a run of other "
            "--data.mask-prompt or --data.train-turns: toymlx-eval --model RUN, or its fused "
            "file exported again, which records them)")
    one_a_row = ("one example a row, as mlx-lm's evaluate scores them",
                 "--data.pack where it packed them (toymlx-train's default)")
    masked = "prompts masked, the last message trained (its --mask-prompt)"
    got, line = scored()  # a data folder: mlx_lm.lora --test's rows, every token scored
    assert line == said.format("256", one_a_row[0], "--seq-len 256 from its max_seq_length 2048 "
                               "cut to the model's context 256, every token scored (no "
                               "--mask-prompt, its default)", one_a_row[1])
    assert (got["rows"], got["seq_len"], got["mask_prompt"]) == (2, 256, False)
    assert got["tokens_scored"] > 18  # the prompts too
    got, line = scored("--data.mask-prompt")
    assert line == said.format("256", one_a_row[0], "--seq-len 256 from its max_seq_length 2048 "
                               "cut to the model's context 256, " + masked, one_a_row[1])
    assert (got["rows"], got["seq_len"], got["tokens_scored"]) == (2, 256, 18)
    assert abs(got["val_loss"] - last["val_loss"]) > 1e-5  # other rows: another figure
    got, line = scored("--seq-len", "64", "--data.mask-prompt")
    assert line == said.format("64", one_a_row[0], masked, one_a_row[1])
    assert abs(got["val_loss"] - last["val_loss"]) > 1e-5  # still not the run's packed rows
    got, line = scored("--seq-len", "64", "--data.pack", "--data.mask-prompt")
    assert line == said.format("64", "packed", masked,
                               "--data.no-pack where it kept one example a row")
    assert (got["rows"], got["seq_len"], got["tokens_scored"]) == (2, 64, 18)
    assert abs(got["val_loss"] - last["val_loss"]) <= 1e-5
    data, fused, last = fused_run("b", 10, "--eval-batches", "2")
    assert len(last["val_row_n"]) == 4  # of the 8 rows the 10 examples make
    flags = ["--data.path", str(data), "--split", "val", "--no-progress"]
    got, _ = scored("--seq-len", "64", "--max-examples", "4", "--data.pack",
                    "--data.mask-prompt")
    assert (got["rows"], got["tokens_scored"]) == (4, sum(last["val_row_n"]))
    assert abs(got["val_loss"] - last["val_loss"]) <= 1e-5


def two_exchange_folder(path: Path, n_train: int, n_valid: int) -> Path:
    """`mlx_lm_folder`'s chat records with a second exchange, so that --data.train-turns last
    (the last answer alone) trains other tokens than assistant (both answers)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("valid", n_valid)):
        (path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"{name} question {i}?"},
            {"role": "assistant", "content": f"answer {i * 7 % 10}"},
            {"role": "user", "content": "and twice that?"},
            {"role": "assistant", "content": f"twice is {i * 14 % 20}"}]}) + "\n"
            for i in range(n)))
    return path


@pytest.mark.parametrize("settings,recorded", [
    ((), {}),
    (("--data.no-pack", "--data.train-turns", "last", "--seq-len", "128"),
     {"data.pack": False, "data.train_turns": "last", "seq_len": 128}),
    (("--data.no-mask-prompt", "--seq-len", "96"), {"data.mask_prompt": False, "seq_len": 96}),
])
def test_a_fused_file_is_scored_on_its_runs_rows(tiny_gguf, tmp_path, capsys, settings,  # noqa: F811
                                                 recorded):
    """The fused export records the run's data settings under toy.run_data.*, and toymlx-eval
    on the file alone (no run folder, no flags) rebuilds the run's rows from them: the loss of
    the run's last eval event (F32 fuse: within 1e-5, as the fused-eval test above holds) and
    its trained tokens, for a run of the default settings and for runs of --data.no-pack,
    --data.train-turns last, --data.no-mask-prompt and other --seq-len; one line says which
    settings came from the file. The same file without those keys (an older export) scores
    eval's own rows, as before: for a run of other settings, another loss and other tokens."""
    from toymlx_cli.export import main as export_main

    from toymlx.data.chat import SPLIT_NAMES
    from toymlx.gguf.fuse import write_with_tensors
    from toymlx.gguf.reader import GGUFFile

    data = two_exchange_folder(tmp_path / "data", n_train=12, n_valid=12)
    (data / "README.md").write_text("# two exchanges\n")  # beside the split files, never read
    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--run-id", "r", "--steps", "4", "--batch-size", "2",
                       "--eval-batches", "2", "--lr", "1e-2", "--no-progress", "--data.path",
                       str(data), "--fuse-at-end", "base", *settings]) == 0
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["kind"] == "eval"][-1]
    fused = tmp_path / "fused.gguf"
    assert export_main(["--adapter", str(tmp_path / "r"), "--fuse", "--out", str(fused)]) == 0

    def run_keys(path: Path) -> dict:
        with GGUFFile(path) as g:
            return {k: v for k, v in g.metadata.items() if k.startswith("toy.run_data.")}

    rec = run_keys(fused)
    assert run_keys(tmp_path / "r" / "fused-f32.gguf") == rec  # --fuse-at-end's file too
    defaults = {"data.pack": True, "data.mask_prompt": True, "data.train_turns": "assistant",
                "data.drop_tools": False, "seq_len": 256}
    assert rec == {
        "toy.run_data.data.path": str(data.resolve()),
        **{f"toy.run_data.{k}": v for k, v in {**defaults, **recorded}.items()},
        "toy.run_data.data.val_fraction": 0.1,
        "toy.run_data.batch_size": 2, "toy.run_data.eval_batches": 2,
        "toy.run_data.grad_checkpoint": False,
        "toy.run_data.fingerprint.bytes": sum(f.stat().st_size for f in data.iterdir()
                                              if f.suffix == ".jsonl"),
        "toy.run_data.fingerprint.sha256": json.loads((tmp_path / "r" / "config.json")
                                                      .read_text())["data_files"]["data.path"]
        ["sha256"],
        "toy.run_data.fingerprint.only": [n for n in SPLIT_NAMES if not n.startswith("test.")]}

    def scored(path: Path, *flags: str) -> tuple[dict, list[str]]:
        capsys.readouterr()
        assert eval_main(["--model", str(path), "--no-progress", *flags]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err.splitlines()

    got, err = scored(fused)
    run_tokens = sum(last["val_row_n"])
    assert abs(got["val_loss"] - last["val_loss"]) <= 1e-5
    assert (got["split"], got["rows"], got["tokens_scored"]) == (
        "val", len(last["val_row_n"]), run_tokens)
    assert got["subset"].startswith("the run's eval rows: 4 of ") and got["subset"].endswith(
        "(--eval-batches 2 x --batch-size 2, fused.gguf's toy.run_data.*); --eval-batches -1 "
        "scores all")
    flags = " ".join(f"--data.{'' if v else 'no-'}{k}" for k, v in (
        ("pack", rec["toy.run_data.data.pack"]),
        ("mask-prompt", rec["toy.run_data.data.mask_prompt"])))
    said = [x for x in err if " rows as " in x]
    assert said == [(
        f"toymlx-eval: rows as the run built them, from {fused}'s toy.run_data.*: --data.path "
        f"{data.resolve()} {flags} --data.train-turns "
        f"{rec['toy.run_data.data.train_turns']} --data.no-drop-tools --data.val-fraction 0.1 "
        "--seq-len "
        f"{rec['toy.run_data.seq_len']} --batch-size 2 --eval-batches 2 --no-grad-checkpoint")]
    # a copy of the data elsewhere is the run's data (its fingerprint): the same rows
    copy = shutil.copytree(data, tmp_path / "copy")
    again, err = scored(fused, "--data.path", str(copy))
    assert (again["val_loss"], again["tokens_scored"]) == (got["val_loss"], run_tokens)
    assert next(x for x in err if " rows as " in x).endswith("; from the flags here: --data.path")
    # a flag wins over the file: other windows, no longer the run's eval rows
    other, err = scored(fused, "--seq-len", "200")
    assert (other["seq_len"], other["subset"]) == (200, (
        f"4 of {other['of']} validation rows (--eval-batches 2 x --batch-size 2); "
        "--eval-batches -1 scores all"))
    said = next(x for x in err if " rows as " in x)
    assert said.endswith("; from the flags here: --seq-len") and " --seq-len " not in said
    # the same file without the keys: eval's own rows (seq-len 256, one example a row,
    # assistant turns)
    old = tmp_path / "older.gguf"
    with GGUFFile(fused) as g:
        write_with_tensors(old, g, {})
    before, err = scored(old, "--data.path", str(data), "--split", "val")
    assert "eval's rows for a model outside a run, not a run's" in err[-1]
    if settings:
        assert abs(before["val_loss"] - last["val_loss"]) > 1e-4
        assert before["tokens_scored"] != run_tokens
    # the file's fingerprint covers the split files (`only`): a README.md edit is still the
    # run's data, a train.jsonl edit is not
    (data / "README.md").write_text("# two exchanges, described at length\n")
    assert scored(fused)[0]["val_loss"] == got["val_loss"]
    with open(data / "train.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert eval_main(["--model", str(fused), "--no-progress"]) == 2
    line, sha = error_line(capsys, "toymlx-eval"), rec["toy.run_data.fingerprint.sha256"]
    assert line.startswith(f"toymlx-eval: error: {data.resolve()}: expected the data the run of "
                           f"{fused} trained on (sha256 {sha[:12]}, metadata key "
                           "'toy.run_data.fingerprint.sha256'), found other contents (sha256 "
                           ), line


def _two_kinds_test_folder(path: Path) -> Path:
    """An mlx-lm data folder whose test.jsonl holds 8 chat rows, every other one of two
    exchanges (so that mlx-lm's --mask-prompt, the last message alone, and a toymlx run's
    every assistant turn differ), beside a train.jsonl and a valid.jsonl eval must not read."""
    mlx_lm_folder(path, n_train=4, n_valid=2, n_test=0)
    rows = []
    for i in range(8):
        messages = [{"role": "user", "content": f"test question {i}?"},
                    {"role": "assistant", "content": f"answer {i * 7 % 10}"}]
        if i % 2:
            messages += [{"role": "user", "content": "and twice that?"},
                         {"role": "assistant", "content": f"twice is {i * 14 % 20}"}]
        rows.append(json.dumps({"messages": messages}) + "\n")
    (path / "test.jsonl").write_text("".join(rows))
    return path


@pytest.mark.parametrize("mask", [False, True])
def test_a_gguf_of_its_own_scores_a_data_folder_as_mlx_lm_lora_test_does(
        tiny_gguf, tmp_path, capsys, monkeypatch, mask):  # noqa: F811
    """`toymlx-eval --model BASE.gguf --data.path FOLDER` on an mlx-lm data folder scored
    --split all (train.jsonl and valid.jsonl), --seq-len 256, prompts masked (every assistant
    turn), with no flag to score every token. An mlx-lm user expects `mlx_lm.lora --test`:
    test.jsonl, max_seq_length 2048, mask_prompt off unless asked (then the last message
    alone). Now those are the defaults outside a run (--seq-len 2047; the tiny model's context,
    256, here), and --data.mask-prompt is mlx-lm's --mask-prompt: the loss is mlx-lm's own
    `evaluate` (its CacheDataset, batches and mask; mlx-lm's model built from the GGUF) on the
    rows' own targets within 1e-4 (mlx-lm's printed figure also counts a pad target after
    each row: docs/RESULTS.md, session 16)."""
    import argparse

    from mlx import nn
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import default_loss, evaluate
    from mlx_lm_adapters import hf_model
    from test_mlx_lm_config import _AsHuggingFace

    def own_targets_loss(model, batch, lengths):  # default_loss with `steps < lengths`
        logits = model(batch[:, :-1])
        steps = mx.arange(1, batch.shape[1])
        keep = mx.logical_and(steps >= lengths[:, 0:1], steps < lengths[:, 1:])
        ntoks = keep.sum()
        ce = (nn.losses.cross_entropy(logits, batch[:, 1:]) * keep).astype(mx.float32).sum()
        return ce / ntoks, ntoks

    folder = _two_kinds_test_folder(tmp_path / "data")
    _, g = load_llama(tiny_gguf, weights="float32")
    tok = Tokenizer.from_metadata(g.metadata)
    g.close()
    _, _, test = load_local_dataset(folder, _AsHuggingFace(tok),
                                    argparse.Namespace(mask_prompt=mask))
    ref = hf_model(tiny_gguf)
    # batches of 4 of the 8 rows: mlx-lm drops none (it leaves out the len % batch_size longest)
    theirs = evaluate(ref, CacheDataset(test), batch_size=4, num_batches=-1,
                      max_seq_length=2048, loss=own_targets_loss)
    printed = evaluate(ref, CacheDataset(test), batch_size=4, num_batches=-1,
                       max_seq_length=2048, loss=default_loss)
    capsys.readouterr()
    import toymlx.data.chat as chat_data

    passes = []  # the rows of each forward pass: mlx-lm's batch_size 4 (256 rows of 2047
    real = chat_data.sft_val_batches  # tokens a pass held 8 GB of attention for SmolLM2)
    monkeypatch.setattr(chat_data, "sft_val_batches", lambda *a, **k: [
        passes.append(b["inputs"].shape[1]) or b for b in real(*a, **k)])
    flags = ["--data.mask-prompt"] if mask else []
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(folder), "--no-progress",
                      *flags]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert (got["split"], got["data"], got["rows"], got["packed"], got["mask_prompt"],
            got["seq_len"]) == ("test", str(folder / "test.jsonl"), 8, False, mask, 256)
    assert passes == [4, 4]
    assert got["test_loss"] == pytest.approx(theirs, abs=1e-4)
    assert abs(printed - theirs) > 1e-3  # the pad target a row: another figure
    # the tokens scored are mlx-lm's: the last message's alone where masked, else every one
    processed = [test.process(test[i]) for i in range(len(test))]
    assert got["tokens_scored"] == sum(len(ids) - max(offset, 1) for ids, offset in processed)
    said = ("every token scored (no --mask-prompt, its default)" if not mask else
            "prompts masked, the last message trained (its --mask-prompt)")
    assert err.splitlines()[-1] == (
        "toymlx-eval: 8 test examples made 8 rows of --seq-len 256 (one example a row, as "
        "mlx-lm's evaluate scores them; as mlx_lm.lora --test builds them: --seq-len 256 from "
        f"its max_seq_length 2048 cut to the model's context 256, {said}): eval's rows for a "
        "model outside a run, not a run's; to score a run's eval rows give its --seq-len, "
        "--data.pack where it packed them (toymlx-train's default), and --max-examples its "
        "--eval-batches x --batch-size where the split makes more rows (a run of other "
        "--data.mask-prompt or --data.train-turns: toymlx-eval --model RUN, or its fused file "
        "exported again, which records them)")


def test_mask_prompt_flags_are_refused_where_no_chat_rows_are_built(tiny_gguf, tmp_path,  # noqa: F811
                                                                     capsys):
    """--data.mask-prompt and --data.no-mask-prompt (new) build chat/SFT rows: both at once, or
    either on plain text (scored in windows), is one line, not ignored, ending "drop it" (or
    "drop them") as train's refusal on text rows does (it ended "drop --data.no-mask-prompt")."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(text), "--data.mask-prompt",
                      "--data.no-mask-prompt"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --data.mask-prompt, --data.no-mask-prompt: expected one of them, "
        "got both")
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(text), "--seq-len", "16",
                      "--data.no-mask-prompt"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --data.no-mask-prompt: expected chat/SFT examples to build rows of "
        "(a JSONL file or data folder of prompt/completion or messages), found "
        f"{text} (plain text, scored in windows of --seq-len tokens); drop it")
    assert eval_main(["--model", str(tiny_gguf), "--data.path", str(text), "--seq-len", "16",
                      "--data.pack", "--data.mask-prompt"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --data.pack, --data.mask-prompt: expected chat/SFT examples to "
        "build rows of (a JSONL file or data folder of prompt/completion or messages), found "
        f"{text} (plain text, scored in windows of --seq-len tokens); drop them")


def test_data_keys_reads_other_keys_as_lora_does(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """toymlx-eval had no --data.keys: a model scored on {"question", "answer"} rows was refused,
    with no flag to read them. --data.keys reads them as a lora run's does (the loss of the same
    rows written as prompt and completion), a refusal without it names the flag, and a run
    trained with --data.keys is scored on its own keys (its last eval event's loss)."""
    pairs = [(f"what is {i} + {i}?", f" {2 * i}, as {i} and {i} make.") for i in range(12)]
    qa, pc = tmp_path / "qa.jsonl", tmp_path / "pc.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in pairs))
    pc.write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n" for q, a in pairs))
    keys = ["--data.keys", "prompt=question", "completion=answer"]
    common = ["--model", str(tiny_gguf), "--seq-len", "128", "--split", "all", "--no-progress"]
    assert eval_main([*common, "--data.path", str(pc)]) == 0
    want = json.loads(capsys.readouterr().out)
    assert eval_main([*common, "--data.path", str(qa), *keys]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["data"] == str(qa) and {**got, "data": str(pc)} == want
    assert eval_main([*common, "--data.path", str(qa)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {qa}:1: expected one of {{\"text\": ...}}, {{\"prompt\": ..., "
        "\"completion\": ...} or {\"messages\": [...]}, found keys ['answer', 'question']; "
        "--data.keys reads a record's own keys as these, KEY=NAME pairs: prompt=NAME "
        "completion=NAME (or text=NAME, or messages=NAME)")
    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--run-id", "keyed", "--steps", "2", "--seq-len", "128",
                       "--no-progress", "--no-compile", "--data.path", str(qa), *keys]) == 0
    last = [e for e in events_of(tmp_path / "keyed") if e["kind"] == "eval"][-1]
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "keyed"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(last["val_loss"],
                                                                           abs=1e-5)
