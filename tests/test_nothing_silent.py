"""Inputs that used to pass silently, be lost, or hang (issue 47), each pinned to one line.

A base with NaN or Inf in one tensor is refused by every command that loads it, naming the
tensor, its block and the file; the file's values are checked where they are decoded
(`GGUFFile.load`, a frozen base's blocks, MLX's quantized layers).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from cli_errors import error_line

from toymlx.gguf.llama import SUPPORTED
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import encode_tensor, write_gguf


def poisoned(src: Path, dst: Path, name: str, value: float, index: int = 0) -> Path:
    """A copy of GGUF `src` with value `index` of F32 tensor `name` (or, for a quantized
    tensor, the float16 scale of block `index`) set to `value`."""
    shutil.copy(src, dst)
    info = GGUFFile(src).tensors[name]
    if info.type.name == "F32":
        at, packed = info.offset + 4 * index, struct.pack("<f", value)
    else:  # Q8_0 / Q4_0 / Q4_1: each block starts with its float16 scale
        from gguf.constants import GGML_QUANT_SIZES
        at, packed = info.offset + GGML_QUANT_SIZES[info.type][1] * index, \
            np.float16(value).tobytes()
    with open(dst, "r+b") as f:
        f.seek(at)
        f.write(packed)
    return dst


def quantized_copy(src: Path, dst: Path, dtype: str) -> Path:
    """`src` with every matrix of rows a multiple of 32 in gguf-py's `dtype` (the rest F32)."""
    g = GGUFFile(src)
    tensors = {n: encode_tensor(n, w, dtype if w.shape[-1] % 32 == 0 else "f32")
               for n in g.tensors if (w := g.load(n)) is not None}
    types = {k: v for k, v in g.metadata_types.items() if k != "general.alignment"}
    return write_gguf(dst, {k: v for k, v in g.metadata.items() if k in types}, tensors,
                      types=types, digest=False)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "completion":
                                     f"It is {2 * i}."}) + "\n" for i in range(12)))
    return p


def _nan_line(path: Path, name: str, block: int, what: str, found: str) -> str:
    return (f"{path}: tensor '{name}' (block {block}): expected finite {what}, found {found}; "
            "the file is damaged or was written from a model that diverged: use another copy "
            "of it")


def test_a_nan_base_is_refused_by_every_command(tmp_path, stories_path, chat, capsys,
                                                shared_file):
    """NaN in blk.0.attn_q.weight of an F32 base (-Inf in the token table of warm start's
    donor): train (lora --base, warm-start --donor), eval, generate and export each exit 2 with one line naming the tensor, its block and the
    file, and write nothing."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.export import main as export_main
    from toymlx_cli.generate import main as generate_main
    from toymlx_cli.train import main as train_main

    bad = poisoned(stories_path, tmp_path / "nan.gguf", "blk.0.attn_q.weight", float("nan"), 5)
    n = GGUFFile(bad).tensors["blk.0.attn_q.weight"].n_elements
    want = "toymlx-{}: error: " + _nan_line(bad, "blk.0.attn_q.weight", 0, "values",
                                            f"NaN in 1 of {n} (the first, nan, at (0, 5))")
    runs = tmp_path / "runs"
    small = ["--steps", "1", "--seq-len", "32", "--batch-size", "2", "--no-compile",
             "--no-progress", "--runs-root", str(runs)]
    assert train_main(["--recipe", "lora", "--base", str(bad), "--data.path", str(chat),
                       *small]) == 2
    assert error_line(capsys) == want.format("train")
    stories = str(shared_file("text/tinystories_sample.txt"))
    # warm start reads the donor's token table alone
    table = poisoned(stories_path, tmp_path / "inf.gguf", "token_embd.weight", -float("inf"), 70)
    n_table = GGUFFile(table).tensors["token_embd.weight"].n_elements
    assert train_main(["--recipe", "warm-start", "--donor", str(table), "--data.path", stories,
                       *small]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {table}: tensor 'token_embd.weight': expected finite values, "
        f"found -Inf in 1 of {n_table} (the first, -inf, at (1, 6)); the file is damaged or was "
        "written from a model that diverged: use another copy of it")
    assert not runs.exists() or not any(runs.iterdir())
    assert eval_main(["--model", str(bad), "--data.path", stories, "--seq-len", "32"]) == 2
    assert error_line(capsys, "toymlx-eval") == want.format("eval")
    assert generate_main(["--model", str(bad), "--prompt", "Once", "--max-tokens", "2"]) == 2
    assert error_line(capsys, "toymlx-generate") == want.format("generate")
    assert export_main(["--base", str(bad), "--out", str(tmp_path / "x.gguf")]) == 2
    assert error_line(capsys, "toymlx-export") == want.format("export")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("weights", ["float32", "blocks", "quantized"])
def test_an_infinite_block_scale_is_named(tmp_path, stories_path, weights):
    """+Inf in the float16 scale of one Q4_1 block of blk.1.attn_q: refused however the
    loader holds the tensor (dequantized, as its blocks, as MLX's quantized layer)."""
    from toymlx.gguf.llama import load_llama
    from toymlx.gguf.reader import GGUFError

    q = quantized_copy(stories_path, tmp_path / "q4_1.gguf", "q4_1")
    bad = poisoned(q, tmp_path / "inf.gguf", "blk.1.attn_q.weight", float("inf"), 3)
    with pytest.raises(GGUFError) as e:
        load_llama(bad, weights=weights)
    info = GGUFFile(bad).tensors["blk.1.attn_q.weight"]
    rows, blocks = info.shape[0], info.shape[1] // 32
    found = {"blocks": f"+Inf in 1 of {rows * blocks} (the first, inf, at row 1, block 1)",
             "quantized": f"+Inf in 1 of {rows * blocks} (the first, inf, at (1, 1))"}
    what = {"float32": "values", "blocks": "block scales ('d')",
            "quantized": "block scales"}[weights]
    assert str(e.value).startswith(f"{bad}: tensor 'blk.1.attn_q.weight' (block 1): "
                                   f"expected finite {what}, found "), str(e.value)
    if weights in found:  # dequantized, the block's 32 values are inf, or NaN where q*d is 0*inf
        assert str(e.value) == _nan_line(bad, "blk.1.attn_q.weight", 1, what, found[weights])


def test_an_expert_tensors_bad_scale_is_named_by_expert_row_and_block(tmp_path):
    """A 3-D expert tensor's blocks are led by its E * out rows: the refusal says which expert,
    row and block, not an index into the codec's arrays."""
    from toymlx.gguf.reader import GGUFError, check_finite

    E, n_out, n_blocks = 4, 6, 5
    d = np.ones((E * n_out, n_blocks, 1), np.float32)  # one float16 scale per block, as split
    d[2 * n_out + 3, 4, 0] = np.nan
    with pytest.raises(GGUFError) as e:
        check_finite("f.gguf", "blk.0.ffn_down_exps.weight", d, "block scales ('d')",
                     rows=(E, n_out))
    assert str(e.value) == _nan_line("f.gguf", "blk.0.ffn_down_exps.weight", 0,
                                     "block scales ('d')",
                                     f"NaN in 1 of {d.size} (the first, nan, at expert 2, "
                                     "row 3, block 4)")


# ---- nothing hangs ----------------------------------------------------------------------------
def _fifo(tmp_path: Path, name: str = "pipe") -> Path:
    p = tmp_path / name
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("prog,argv,want", [
    ("generate", ["--model", "{fifo}", "--prompt", "Once", "--max-tokens", "2"],
     "{fifo}: file: expected a GGUF file, found a FIFO (named pipe)"),
    ("eval", ["--model", "{fifo}", "--data.path", "{data}"],
     "{fifo}: file: expected a GGUF file, found a FIFO (named pipe)"),
    ("export", ["--base", "{fifo}", "--out", "{out}"],
     "{fifo}: file: expected a GGUF file, found a FIFO (named pipe)"),
    ("eval", ["--model", "{base}", "--data.path", "{fifo}", "--seq-len", "32"],
     "{fifo}: expected a UTF-8 text file, found a FIFO (named pipe)"),
    ("eval", ["--model", "{base}", "--data.path", "/dev/zero", "--seq-len", "32"],
     "/dev/zero: expected a UTF-8 text file, found a character device"),
])
def test_a_fifo_or_device_is_named_at_once(tmp_path, stories_path, shared_file, capsys, prog,
                                           argv, want):
    """A FIFO (no writer: opening it waits forever) or a device (/dev/zero never ends) given
    where a file is read: one line naming it, in well under 20 s."""
    import importlib

    main = importlib.import_module(f"toymlx_cli.{prog}").main
    paths = {"fifo": _fifo(tmp_path), "base": stories_path, "out": tmp_path / "x.gguf",
             "data": shared_file("text/tinystories_sample.txt")}
    t = time.perf_counter()
    assert main([a.format(**paths) for a in argv]) == 2
    assert time.perf_counter() - t < 20
    assert error_line(capsys, f"toymlx-{prog}") == f"toymlx-{prog}: error: " + \
        want.format(**paths)


def test_train_on_a_fifo_leaves_no_run_folder(tmp_path, capsys):
    from toymlx_cli.train import main as train_main

    fifo = _fifo(tmp_path)
    assert train_main(["--recipe", "from-scratch", "--data.path", str(fifo), "--runs-root",
                       str(tmp_path / "runs"), "--run-id", "f", "--steps", "1"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {fifo}: --data.path: expected a "
                                  "regular file or a folder, found a FIFO (named pipe)")
    assert not (tmp_path / "runs" / "f").exists()


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"lr: *a{levels}"]) + "\n"


DEPTH_LINE = ("key 'lr': expected mappings and lists nested at most 32 deep, found deeper (or a "
              "YAML alias used inside itself)")


@pytest.mark.parametrize("name,text,want", [
    ("bomb.yaml", _alias_bomb(), ("expected at most 100,000 values, found more (YAML aliases "
                                  "expand at each use); write the options out")),
    ("self.yaml", "lr: &a [1, *a]\n", DEPTH_LINE),
    ("deep.yaml", "lr: " + "[" * 40 + "]" * 40 + "\n", DEPTH_LINE),
    ("deep.json", '{"lr": ' + "[" * 50_000 + "]" * 50_000 + "}",
     "expected JSON, found objects or arrays nested too deeply"),
])
def test_a_config_bomb_is_one_line(tmp_path, capsys, name, text, want):
    """A 9-level alias bomb (387 million values expanded), an alias inside itself, and nesting
    past the cap: one line each, in well under 20 s, before any option is read."""
    from toymlx_cli.generate import main as generate_main
    from toymlx_cli.train import main as train_main

    p = tmp_path / name
    p.write_text(text)
    for prog, main in (("train", train_main), ("generate", generate_main)):
        t = time.perf_counter()
        assert main(["-c", str(p)]) == 2
        assert time.perf_counter() - t < 20
        assert error_line(capsys, f"toymlx-{prog}") == f"toymlx-{prog}: error: {p}: {want}"


SURROGATE = "to be UTF-8 text, found a lone surrogate"


@pytest.mark.parametrize("line,want", [
    ('{"prompt": "hi \\ud800", "completion": "ok"}',
     f'expected "prompt" {SURROGATE} U+D800 at character 3'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\udfff"}]}',
     f'expected "messages[1].content" {SURROGATE} U+DFFF at character 0'),
    ("[" * 100_000 + "]" * 100_000,
     ('expected an object {"text": ...}, {"prompt": ..., "completion": ...} or {"messages": '
      '[...]}, found arrays or objects nested too deeply to read')),
])
def test_a_bad_text_record_is_one_line(tmp_path, stories_path, capsys, line, want):
    """A lone surrogate in a record's text (once a TypeError in the tokenizer) and a line
    nested 100,000 deep (once a RecursionError): one line naming the file, the line and the
    key, and no run folder left."""
    from toymlx_cli.train import main as train_main

    data = tmp_path / "chat.jsonl"
    good = json.dumps({"prompt": "What is 1 + 1?", "completion": "It is 2."})
    data.write_text("\n".join([good] * 3 + [line] + [good] * 3) + "\n")
    want = f"{data}:4: {want}"
    assert train_main(["--recipe", "lora", "--base", str(stories_path), "--data.path", str(data),
                       "--runs-root", str(tmp_path / "runs"), "--steps", "1"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not (tmp_path / "runs").exists()  # nor runs/ made


# ---- a run's files are what the run wrote -----------------------------------------------------
TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--eval-every", "0",
        "--no-compile", "--no-progress", "--checkpoint-every", "1"]


def _run(root: Path, run_id: str, data: str, *extra: str) -> Path:
    from toymlx_cli.train import main as train_main

    assert train_main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                       str(root), "--run-id", run_id, "--steps", "2", *extra]) == 0
    return root / run_id


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture
def runs(tmp_path, shared_file, capsys) -> tuple[Path, Path]:
    """Two finished 2-step runs (seeds 0 and 1) of the same configuration otherwise."""
    data = str(shared_file("text/tinystories_sample.txt"))
    a, b = _run(tmp_path, "a", data), _run(tmp_path, "b", data, "--seed", "1")
    capsys.readouterr()
    return a, b


def _resume(run: Path, *extra: str) -> int:
    from toymlx_cli.train import main as train_main

    return train_main(["--resume", str(run), "--steps", "3", *extra])


def test_a_resume_refuses_an_edited_config_json(runs, capsys):
    """lr edited in config.json (0.0003 -> 0.5), or another run's config.json copied in (its
    seed): refused naming the key and both values, nothing changed; --from adopts it."""
    a, b = runs
    saved = json.loads((a / "config.json").read_text())
    lr = saved["config"]["lr"]
    saved["config"]["lr"] = 0.5
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'config.json'}: key 'config.lr': expected {lr!r} (recorded "
        "when the run started), found 0.5: config.json was edited after the run started, and a "
        "resumed run keeps its configuration: put it back, or adopt it as it is with --from "
        "step_N")
    assert _files(a) == before
    shutil.copy(b / "config.json", a / "config.json")
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'events.jsonl'}: --resume: expected the record of the run "
        f"{a / 'config.json'} holds (run_id 'b'), found that of run_id 'a': the two files "
        "belong to different runs; put back this run's own events.jsonl (or config.json)")
    assert _resume(a, "--from", "step_2") == 0
    resumed = [e for e in _events(a) if e["kind"] == "resume"]
    assert resumed[-1]["config_sha256"] != next(e for e in _events(a)
                                                if e["kind"] == "run_start")["config_sha256"]


def test_an_edited_config_json_names_the_key_edited_not_one_the_run_resolved(runs, capsys):
    """run_start records some options as resolved (from-scratch's tokenizer None as "bytes"),
    and the first key differing from that record was named: model.d_model edited read "key
    'config.tokenizer': expected 'bytes' ..., found None", whose fix ("put it back") is not
    one. Now the key named is the one whose recorded value gives back the recorded digest;
    where no one key does (two edited), the digests are named."""
    a, _ = runs
    saved = json.loads((a / "config.json").read_text())
    d_model = saved["config"]["model"]["d_model"]
    saved["config"]["model"]["d_model"] = 2 * d_model
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    assert _resume(a) == 2
    assert error_line(capsys).startswith(
        f"toymlx-train: error: {a / 'config.json'}: key 'config.model.d_model': expected "
        f"{d_model} (recorded when the run started), found {2 * d_model}: config.json was edited")
    saved["config"]["lr"] = 0.5
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    assert _resume(a) == 2
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: {a / 'config.json'}: expected the contents "
                           "recorded when the run started (sha256 "), line


def test_an_edit_of_config_json_a_check_refuses_is_named_as_the_edit(runs, capsys):
    """An edited value of config.json that its checks refuse was told as a flag nobody gave
    ("config.json: --batch-size: expected >= 1, found 0"), nothing saying the file was edited
    nor what it held. Now the key, its recorded value and the check's line; the value as JSON
    writes it (null, not Python's None)."""
    a, _ = runs
    saved = json.loads((a / "config.json").read_text())
    saved["config"]["batch_size"] = 0
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'config.json'}: key 'config.batch_size': expected 2 "
        "(recorded when the run started), found 0: config.json was edited after the run "
        "started, and the edit is refused (--batch-size: expected >= 1, found 0): put it back")
    assert _files(a) == before
    saved["config"]["batch_size"], saved["config"]["model"]["rope_base"] = 2, -1.0
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'config.json'}: key 'config.model.rope_base': expected null "
        "(recorded when the run started), found -1.0: config.json was edited after the run "
        "started, and the edit is refused (--model.rope-base: expected > 0, found -1.0): put it "
        "back")


def test_an_edited_recipe_in_config_json_is_named_as_the_edit(runs, capsys):
    """config.json's recipe edited (from-scratch -> warm-start) was refused on the first option
    the other recipe lacks ("key 'config.tokenizer': expected an option of this recipe"),
    nothing naming the key edited. Now that key, with the recipe run_start recorded."""
    a, _ = runs
    saved = json.loads((a / "config.json").read_text())
    saved["recipe"] = "warm-start"
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'config.json'}: key 'recipe': expected \"from-scratch\" "
        "(recorded when the run started), found \"warm-start\": config.json was edited after "
        "the run started: put it back")
    assert _files(a) == before


def test_a_resume_of_an_events_jsonl_cut_inside_its_first_line_says_so(runs, capsys):
    """events.jsonl cut inside its run_start line (a copy taken while the run started) was
    "found an empty file" for a file of hundreds of bytes."""
    a, _ = runs
    events = a / "events.jsonl"
    events.write_bytes(events.read_bytes()[:300])
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {events}: --resume: expected the run's record from its "
        "run_start, found 300 bytes but no event (a line cut short or garbled); resuming would "
        "start a new record and lose the steps before: put the run's events.jsonl back, or "
        "adopt the run as it is with --from step_N")


@pytest.mark.parametrize("fmt", [99, 0])
def test_a_config_json_of_a_format_this_toymlx_does_not_know_is_refused(runs, capsys, fmt):
    """config.json's `format` from a newer toymlx (99) was read as this one's: toymlx-eval and
    -generate scored the run with options it may lack, a resume blamed another key."""
    from toymlx_cli.eval import main as eval_main

    from toymlx.bundle.folder import CONFIG_FORMAT

    a, _ = runs
    saved = json.loads((a / "config.json").read_text())
    saved["format"] = fmt
    (a / "config.json").write_text(json.dumps(saved, indent=2))
    assert eval_main(["--model", str(a)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {a / 'config.json'}: key 'format': expected 1..{CONFIG_FORMAT} "
        f"(toymlx 0.2.0 writes {CONFIG_FORMAT}), found {fmt}" + ("; the run was made by a newer toymlx: use that one"
                                     if fmt == 99 else ""))


def test_a_resume_of_the_runs_root_or_a_runs_weights_names_the_run_to_pass(runs, capsys):
    """`--resume runs` or `--resume runs/a/weights` read "runs/config.json: --resume: expected
    the run's saved config, found no file", as for a damaged run."""
    from toymlx_cli.train import main as train_main

    a, _ = runs
    assert train_main(["--resume", str(a.parent)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a.parent}: --resume: expected a run bundle folder, found a "
        f"folder of 2 run bundles (a, b); name one of them, e.g. {a}")
    assert train_main(["--resume", str(a / "weights")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'weights'}: --resume: expected a run bundle folder, found "
        f"the weights folder of the run {a}; name the run: {a}")


def test_a_resume_of_a_checkpoint_file_names_the_run_and_its_from(runs, capsys):
    """timm's --resume and HF Trainer's resume_from_checkpoint take a checkpoint file:
    `--resume runs/a/weights/step_2.gguf` read only "expected a run bundle folder, found a
    file". The run is named, and for a step_N.gguf the --from that starts there; `latest` is
    the newest, which a resume takes anyway; a file of no run is still "a file"."""
    from toymlx_cli.train import main as train_main

    a, _ = runs
    before = _files(a)
    for given, start in ((a / "weights" / "step_2.gguf", (" (--from step_2: from this "
                                                          "checkpoint, not the newest)")),
                         (a / "weights" / "latest", ""), (a / "config.json", "")):
        assert train_main(["--resume", str(given)]) == 2
        assert error_line(capsys) == (
            f"toymlx-train: error: {given}: --resume: expected a run bundle folder, found a "
            f"file of the run {a}; name the run: {a}{start}")
    stray = a.parent / "notes.txt"
    stray.write_text("x")
    assert train_main(["--resume", str(stray)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {stray}: --resume: expected a run bundle folder, found a file")
    assert _files(a) == before


def test_a_run_s_optimizer_state_given_as_a_model_is_named_as_one(runs, capsys):
    """A checkpoint's .state.safetensors (beside its .gguf) given to toymlx-generate or
    toymlx-eval was "Hugging Face safetensors weights; llama.cpp's convert_hf_to_gguf.py makes
    a GGUF of the model's folder": it is toymlx's own, and its step's .gguf the weights."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.generate import main as generate_main

    a, _ = runs
    state = a / "weights" / "step_2.state.safetensors"
    assert state.is_file()
    for prog, main, extra in (("toymlx-generate", generate_main, ["--prompt", "x"]),
                              ("toymlx-eval", eval_main, [])):
        assert main(["--model", str(state), *extra]) == 2
        err = error_line(capsys, prog)
        assert err.startswith(f"{prog}: error: {state}: magic: expected b'GGUF', found "), err
        assert err.endswith("(not a GGUF file: a toymlx run's optimizer state, which --resume "
                            "reads beside its checkpoint; the weights are the .gguf of the same "
                            "step beside it)"), err


def test_an_mlx_lm_model_folder_given_as_a_run_is_named_as_one(tmp_path, capsys):
    """mlx-lm's --model folder (config.json and model.safetensors) read as a run: generate said
    "found no checkpoint", eval, export and --resume "config.json: expected an object with
    "recipe" and "config" keys, found {"model_type": "llama"}"."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.export import main as export_main
    from toymlx_cli.generate import main as generate_main
    from toymlx_cli.train import main as train_main

    m = tmp_path / "SmolLM2-4bit"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama"}')
    (m / "model.safetensors").write_bytes(b"x")
    what = ("a Hugging Face model folder (config.json and model.safetensors, as mlx-lm's --model "
            "takes; toymlx reads that model's GGUF file instead)")
    assert generate_main(["--model", str(m), "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate") == (
        f"toymlx-generate: error: {m}: expected a run bundle with weights/latest, found {what}")
    for prog, main, flags in (("toymlx-eval", eval_main, ["--model", str(m)]),
                              ("toymlx-export", export_main, ["--adapter", str(m), "--fuse",
                                                              "--out", str(tmp_path / "f.gguf")]),
                              ("toymlx-train", train_main, ["--resume", str(m)])):
        assert main(flags) == 2
        assert error_line(capsys, prog) == (
            f"{prog}: error: {m}: {flags[0]}: expected a run bundle folder, found {what}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-4bit"]


def test_a_resume_refuses_another_runs_events_jsonl(runs, capsys):
    """Another run's events.jsonl copied in beside an untouched config.json: the two files are
    named as different runs' (both run ids), not config.json as edited; nothing changed."""
    a, b = runs
    shutil.copy(b / "events.jsonl", a / "events.jsonl")
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'events.jsonl'}: --resume: expected the record of the run "
        f"{a / 'config.json'} holds (run_id 'a'), found that of run_id 'b': the two files "
        "belong to different runs; put back this run's own events.jsonl (or config.json)")
    assert _files(a) == before


def _events(run: Path) -> list[dict]:
    from toymlx.bundle.events import read_events

    return read_events(run)


def test_a_resume_refuses_another_runs_checkpoint_pair(runs, capsys):
    a, b = runs
    for name in ("step_2.gguf", "step_2.state.safetensors"):
        shutil.copy(b / "weights" / name, a / "weights" / name)
    ours = next(e for e in _events(a) if e["kind"] == "run_start")["run_uid"]
    theirs = next(e for e in _events(b) if e["kind"] == "run_start")["run_uid"]
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a / 'weights' / 'step_2.gguf'}: --resume: expected a checkpoint "
        f"of this run (run_uid {ours}), found one of run_uid {theirs} (run 'b'); put this run's "
        "checkpoint back, or adopt it with --from step_2")


def test_a_resume_refuses_a_record_missing_a_step_before_its_checkpoint(runs, capsys):
    """A step line deleted from events.jsonl (step 1 of the 2 before the checkpoint): the
    resume names the file and the step instead of going on with it missing for good; from a
    checkpoint before the gap (step_0 here) it goes on, each step once."""
    a, _ = runs
    events = a / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    events.write_text("".join(x for x in lines if not ('"kind": "step"' in x
                                                       and '"step": 1,' in x)))
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {events}: --resume: expected each step once up to the "
        "checkpoint's step 2, found no step 1; resuming would leave step 1 missing for good: "
        "put the run's events.jsonl back, or go on from a checkpoint before it with --from "
        "step_0")
    assert _files(a) == before
    assert _resume(a, "--from", "step_0") == 0
    assert [e["step"] for e in _events(a) if e["kind"] == "step"] == [1, 2, 3]


def test_readers_refuse_another_runs_checkpoint_pair_as_resume_does(runs, capsys):
    """toymlx-eval --model RUN (or a checkpoint in its weights/), toymlx-generate and
    toymlx-export once read another run's checkpoint pair copied over the run's own; it is
    refused as a resume refuses it, and the run's own pair, once put back, is scored, as is
    one the run adopted with --from."""
    from toymlx_cli.eval import main as eval_main

    a, b = runs
    own = {n: (a / "weights" / n).read_bytes() for n in ("step_2.gguf", "step_2.state.safetensors")}
    for name in own:
        shutil.copy(b / "weights" / name, a / "weights" / name)
    ours = next(e for e in _events(a) if e["kind"] == "run_start")["run_uid"]
    theirs = next(e for e in _events(b) if e["kind"] == "run_start")["run_uid"]
    ckpt = a / "weights" / "step_2.gguf"
    for model in (a, ckpt):
        assert eval_main(["--model", str(model)]) == 2
        assert error_line(capsys, "toymlx-eval") == (
            f"toymlx-eval: error: {ckpt}: --model: expected a checkpoint of this run (run_uid "
            f"{ours}), found one of run_uid {theirs} (run 'b'); put this run's checkpoint back")
    # every reader of a run's checkpoint resolves it in one place (checkpoint_file)
    from toymlx_cli.export import main as export_main
    from toymlx_cli.generate import main as generate_main

    assert generate_main(["--model", str(a), "--prompt", "Once", "--max-tokens", "1"]) == 2
    assert error_line(capsys, "toymlx-generate") == (
        f"toymlx-generate: error: {ckpt}: --model: expected a checkpoint of this run (run_uid "
        f"{ours}), found one of run_uid {theirs} (run 'b'); put this run's checkpoint back")
    out = a.parent / "exported.gguf"
    assert export_main(["--base", str(a), "--out", str(out)]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: {ckpt}: --base: expected a checkpoint of this run (run_uid "
        f"{ours}), found one of run_uid {theirs} (run 'b'); put this run's checkpoint back")
    assert not out.exists()
    for name, data in own.items():
        (a / "weights" / name).write_bytes(data)
    assert eval_main(["--model", str(a)]) == 0
    for name in own:  # adopted by the run (--from step_2): its record names it, so it is scored
        shutil.copy(b / "weights" / name, a / "weights" / name)
    assert _resume(a, "--from", "step_2") == 0
    assert eval_main(["--model", str(ckpt)]) == 0



def _readers_refuse(model, want: str, capsys) -> None:
    """toymlx-eval and toymlx-generate on `model` both refuse in the one line `want`."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.generate import main as generate_main

    assert eval_main(["--model", str(model)]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {want}"
    assert generate_main(["--model", str(model), "--prompt", "Once", "--max-tokens", "1"]) == 2
    assert error_line(capsys, "toymlx-generate") == f"toymlx-generate: error: {want}"

def test_readers_refusing_an_adopted_checkpoint_name_a_garbled_record(runs, capsys):
    """Another run's pair adopted with --from step_2, then the resume line that records it
    garbled: toymlx-eval and toymlx-generate refused the pair as another run's without a word
    about events.jsonl; the refusal now names the garbled line, which may be the record at
    fault, not the file."""
    from toymlx_cli.eval import main as eval_main

    a, b = runs
    for name in ("step_2.gguf", "step_2.state.safetensors"):
        shutil.copy(b / "weights" / name, a / "weights" / name)
    assert _resume(a, "--from", "step_2") == 0
    ours = next(e for e in _events(a) if e["kind"] == "run_start")["run_uid"]
    theirs = next(e for e in _events(b) if e["kind"] == "run_start")["run_uid"]
    events = a / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    n = next(i for i, x in enumerate(lines) if b'"kind": "resume"' in x)
    lines[n] = lines[n][:30] + b"\x00" + lines[n][31:]
    events.write_bytes(b"".join(lines))
    ckpt = a / "weights" / "step_2.gguf"
    want = (f"{ckpt}: --model: expected a checkpoint of this run (run_uid {ours}), found one of "
            f"run_uid {theirs} (run 'b'); put this run's checkpoint back; {events}: line "
            f"{n + 1}: expected an event (one JSON object a line), found a garbled line that no "
            "kill or resume explains: the file was damaged, and the resume event adopting this "
            "checkpoint (--from step_2) may be that line: if the run adopted it, put the run's "
            "events.jsonl back instead")
    _readers_refuse(ckpt, want, capsys)
    assert eval_main(["--model", str(a)]) == 0  # the run's latest, its own step_3, is read
    for p in (a / "weights").glob("step_3*"):  # killed before step_3: a resume goes on from 2
        p.unlink()
    (a / "weights" / "latest").unlink()
    before = _files(a)
    assert _resume(a, "--steps", "4") == 2
    assert error_line(capsys) == "toymlx-train: error: " + want.replace(
        "--model", "--resume").replace("back;", "back, or adopt it with --from step_2;")
    assert _files(a) == before


def test_a_resume_of_a_completed_run_names_its_steps_not_a_flag_never_given(runs, capsys):
    """--resume alone on a completed run once read "--steps: expected more than the
    checkpoint's step 2 ..., found 2" though no --steps was given; a --steps that is given
    and too small is still named as the flag."""
    from toymlx_cli.train import main as train_main

    a, _ = runs
    assert train_main(["--resume", str(a)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a}: completed at step 2 (its --steps); pass --steps N (more "
        "than 2) to train on")
    assert train_main(["--resume", str(a), "--steps", "1"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a}: --steps: expected more than the checkpoint's step 2 to "
        "train on, found 1; --steps is the run's total, not steps to add (mlx-lm's --iters): "
        "--steps 3 trains 1 more")


def test_a_resume_refuses_a_stop_at_it_has_passed(runs, capsys):
    """A --stop-at at or before the checkpoint's step trained past it without a word: a
    vit-tiny run resumed from step 20 with --stop-at 5 trained step 21 and "stopped at step
    21"; here the run went on to its end. Now it is refused, nothing run."""
    a, _ = runs
    before = _files(a)
    assert _resume(a, "--stop-at", "2") == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {a}: --stop-at: expected a step past the checkpoint's step 2, "
        "where the run resumes, found 2; --stop-at counts the run's steps: --stop-at 3 or more, "
        "or --from an earlier checkpoint")
    assert _files(a) == before


@pytest.mark.parametrize("damage,found", [("empty", "an empty file"), ("gone", "no file")])
def test_a_resume_refuses_an_emptied_or_missing_record(runs, capsys, damage, found):
    a, _ = runs
    events = a / "events.jsonl"
    events.write_text("") if damage == "empty" else events.unlink()
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {events}: --resume: expected the run's record from its "
        f"run_start, found {found}; resuming would start a new record and lose the steps "
        "before: put the run's events.jsonl back, or adopt the run as it is with --from step_N")
    assert _resume(a, "--from", "step_2") == 0
    assert [e["kind"] for e in _events(a)][:2] == ["run_start", "resume"]


@pytest.mark.parametrize("found", ["an empty file", "no file"])
def test_a_run_killed_before_its_run_start_line_is_started_over(runs, capsys, found):
    """A run killed before its first checkpoint and before its run_start line (events.jsonl is
    made empty just before that line is written) holds no step: a resume says so and how to
    start it over, for an empty events.jsonl as for none (the empty file was refused as a lost
    record, whose advice, --from step_N, named no step there is); `--from step_0` runs it."""
    a, _ = runs
    events = a / "events.jsonl"
    events.write_text("") if found == "an empty file" else events.unlink()
    for ckpt in (a / "weights").iterdir():
        shutil.rmtree(ckpt) if ckpt.is_dir() and not ckpt.is_symlink() else ckpt.unlink()
    assert _resume(a) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {events}: --resume: found {found} and no checkpoint: the run "
        f"stopped before its first step; start it over with its saved configuration: "
        f"toymlx-train --resume {a} --from step_0")
    assert _resume(a, "--from", "step_0") == 0
    ev = _events(a)
    assert [e["kind"] for e in ev][:2] == ["run_start", "resume"]
    assert [e["step"] for e in ev if e["kind"] == "step"] == [1, 2, 3]


def test_weights_replaced_by_a_file_never_advises_discarding_checkpoints(runs, capsys):
    a, _ = runs
    shutil.move(a / "weights", a / "weights.bak")
    (a / "weights").write_text("oops")
    assert _resume(a) == 2
    line = error_line(capsys)
    assert line == (f"toymlx-train: error: {a / 'weights'}: --resume: expected the run's "
                    "checkpoint folder, found a file; the events record checkpoints up to "
                    "step_2: put the folder back to resume from them")
    assert "step_0" not in line


def test_eval_json_is_valid_json_with_a_reason_for_null():
    """JSON has no NaN: a non-finite figure prints as null, with the reason beside it."""
    from toymlx_cli.eval import json_safe

    out = json.loads(json.dumps(json_safe({"val_loss": float("nan"), "perplexity": float("inf"),
                                           "rows": 7}), allow_nan=False))
    assert out == {"val_loss": None, "perplexity": None, "rows": 7, "not_finite": {
        "val_loss": "nan: the model's outputs are not finite on this data",
        "perplexity": "inf: the model's outputs are not finite on this data"}}
    assert json_safe({"val_loss": 1.5}) == {"val_loss": 1.5}


@pytest.mark.parametrize("flags,want", [
    (["--batch-size", "0"], "--batch-size: expected >= 1 examples per forward pass, found 0"),
    (["--seq-len", "0"], ("--seq-len: expected >= 1 tokens (or leave it out: the run's own, "
                          "else 256), found 0")),
    (["--seq-len", "100000"], "--seq-len: expected at most 2048 (the context length of "),
])
def test_eval_refuses_sizes_that_were_silently_replaced(stories_path, shared_file, capsys, flags,
                                                       want):
    """0 once became the default, and a window past the model's context scored a model RoPE
    never trained (both exit 0)."""
    from toymlx_cli.eval import main as eval_main

    text = str(shared_file("text/tinyshakespeare.txt"))
    assert eval_main(["--model", str(stories_path), "--data.path", text, *flags]) == 2
    assert want in error_line(capsys, "toymlx-eval")


@pytest.mark.parametrize("text,flags,want", [
    ("cat", [], ("--split all: expected at least 257 tokens to score (a window of --seq-len 256 "
                 "and the token after it), found 12; use a shorter --seq-len (11 or less) or a "
                 "longer --data.path file")),
    ("cat", ["--split", "val", "--seq-len", "4"], (
        "--split val: expected at least 5 tokens to score (a window of --seq-len 4 and the "
        "token after it), found 1 in its validation split (of its 12); use --split all (every "
        "token)")),
    ("cat", ["--split", "val"], (
        "--split val: expected at least 257 tokens to score (a window of --seq-len 256 and the "
        "token after it), found 1 in its validation split (of its 12); use --split all (every "
        "token) with --seq-len 11 or less")),
    ("", [], "empty file; expected UTF-8 text"),
])
def test_eval_of_a_text_too_short_names_evals_own_flags(tmp_path, stories_path, capsys, text,
                                                        flags, want):
    """A text file too short for one window was refused in training's words ("training split
    ... use a longer text or a shorter seq_len", "a larger val_fraction", "text to train on"),
    flags toymlx-eval does not have; now the split it scores, its flags and the file."""
    from toymlx_cli.eval import main as eval_main

    f = tmp_path / "short.txt"
    f.write_text("Once upon a time there was a cat.\n" if text else "")
    assert eval_main(["--model", str(stories_path), "--data.path", str(f), *flags]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {f}: {want}"


def test_eval_of_every_token_is_not_refused_for_a_short_validation_split(tmp_path, stories_path,
                                                                        capsys):
    """--split all scores the whole file: a 12-token file at --seq-len 4 was refused because
    its last 10% (1 token) held no window, a split --split all never reads."""
    from toymlx_cli.eval import main as eval_main

    f = tmp_path / "short.txt"
    f.write_text("Once upon a time there was a cat.\n")
    assert eval_main(["--model", str(stories_path), "--data.path", str(f), "--seq-len", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["split"], out["tokens_scored"], out["seq_len"]) == ("all", 8, 4)


def test_eval_test_split_of_a_run_trained_on_one_file_is_refused(tmp_path, stories_path, chat,
                                                                  capsys):
    """A LoRA run on one JSONL file has no test set: `--split test` once scored rows of the
    training file as "test_loss"; given explicitly, the same file is scored as asked."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.train import main as train_main

    assert train_main(["--recipe", "lora", "--base", str(stories_path), "--data.path", str(chat),
                       "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--eval-every",
                       "0", "--runs-root", str(tmp_path), "--run-id", "one"]) == 0
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "one"), "--split", "test"]) == 2
    line = error_line(capsys, "toymlx-eval")
    assert f"found a run trained on one file, {chat}" in line and "--data.path" in line
    assert eval_main(["--model", str(tmp_path / "one"), "--split", "test", "--data.path",
                      str(chat)]) == 0
    assert json.loads(capsys.readouterr().out)["data"] == str(chat)


def test_eval_plot_of_a_language_model_is_refused_not_skipped(tmp_path, stories_path, chat,
                                                              capsys):
    """--plot draws a ViT's confusion matrix; given for a Llama GGUF or a LoRA run it was
    skipped: exit 0, the loss printed, and no file where the user asked for one."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.train import main as train_main

    assert train_main(["--recipe", "lora", "--base", str(stories_path), "--data.path", str(chat),
                       "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--eval-every",
                       "0", "--runs-root", str(tmp_path), "--run-id", "one"]) == 0
    capsys.readouterr()
    plot = tmp_path / "m.png"
    for model, found in ((tmp_path / "one", "a LoRA run"), (stories_path, "a llama model")):
        assert eval_main(["--model", str(model), "--plot", str(plot)]) == 2
        assert error_line(capsys, "toymlx-eval") == (
            f"toymlx-eval: error: --plot {plot}: expected a ViT model (it draws the confusion "
            f"matrix of its classes), found {found} ({model}); drop --plot")
        assert not plot.exists()


def test_a_changed_embedding_length_is_named_itself(tmp_path, stories_path, capsys):
    """embedding_length 64 -> 96 in the metadata: the key named with the token table's width
    (its head width once failed first, blamed on rope.dimension_count)."""
    from toymlx_cli.generate import main as generate_main

    g = GGUFFile(stories_path)
    types = {k: v for k, v in g.metadata_types.items() if k != "general.alignment"}
    meta = {k: v for k, v in g.metadata.items() if k in types}
    meta["llama.embedding_length"] = 96
    bad = write_gguf(tmp_path / "wide.gguf", meta, {n: g.load(n) for n in g.tensors},
                     types=types, digest=False)
    assert generate_main(["--model", str(bad), "--prompt", "Once", "--max-tokens", "2"]) == 2
    assert error_line(capsys, "toymlx-generate").endswith(
        "metadata key 'llama.embedding_length': expected 64 (the width of tensor "
        "'token_embd.weight'), found 96")


def gguf_variant(src: Path, dst: Path, arch: str | None = None, add: dict | None = None,
                 tensors: dict | None = None) -> Path:
    """`src` rewritten by gguf-py's GGUFWriter (as llama.cpp's converter writes): its
    architecture renamed (its `<arch>.*` keys with it), the metadata `add` (key: (value, type))
    and the F32 `tensors` added."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = GGUFWriter(str(dst), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture itself
        vtype = GGUFValueType(f.types[0])
        w.add_key_value(arch + key[len(old):] if key.startswith(old + ".") else key,
                        f.contents(), vtype, sub_type=GGUFValueType(f.types[1])
                        if vtype == GGUFValueType.ARRAY else None)
    for key, (value, vtype) in (add or {}).items():
        w.add_key_value(key, value, getattr(GGUFValueType, vtype))
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type,
                     raw_shape=[int(d) for d in reversed(t.shape)])
    for name, value in (tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


_ONLY_KEYS = ("expected only keys toymlx computes with (llama.* for llama: attention.head_count, "
              "attention.head_count_kv, attention.key_length, attention.layer_norm_rms_epsilon, "
              "attention.value_length, block_count, context_length, embedding_length, "
              "expert_count, expert_used_count, feed_forward_length, rope.dimension_count, "
              "rope.freq_base, rope.scaling.factor, rope.scaling.finetuned, "
              "rope.scaling.original_context_length, rope.scaling.type, vocab_size; and "
              "general.*, tokenizer.*, quantize.*), found this one; not loaded, so that nothing "
              "is ignored")


@pytest.mark.parametrize("variant,want", [
    ({"tensors": {"blk.0.foo.weight": np.ones(64, np.float32)}},
     ("tensor 'blk.0.foo.weight': expected only the tensors a llama model of this shape computes "
     f"with, found this one too; not loaded, so that nothing is ignored (supported "
     f"architectures: {SUPPORTED})")),
    ({"add": {"llama.rope.scaling.type": ("longrope", "STRING"),
              "llama.rope.scaling.factor": (4.0, "FLOAT32")}},
     ("metadata key 'llama.rope.scaling.type': expected one of none, linear, yarn for llama, "
      "found 'longrope'")),
    # llama.cpp's llama does not read YaRN's betas: a file's other value would be ignored
    ({"add": {"llama.rope.scaling.type": ("yarn", "STRING"),
              "llama.rope.scaling.factor": (4.0, "FLOAT32"),
              "llama.rope.scaling.yarn_beta_fast": (16.0, "FLOAT32")}},
     ("metadata key 'llama.rope.scaling.yarn_beta_fast': expected 32 (llama.cpp does not read "
      "this key for llama and computes with 32; Hugging Face's model would use the file's), "
      "found 16")),
    ({"add": {"llama.attention.sliding_window": (32, "UINT32")}},
     "metadata key 'llama.attention.sliding_window': " + _ONLY_KEYS),
    ({"arch": "mamba"}, (f"metadata key 'general.architecture': expected one of {SUPPORTED}, "
     "found 'mamba'")),
    # read silently before: llama.cpp sizes the table by vocab_size and refuses the file
    ({"add": {"llama.vocab_size": (600, "UINT32")}},
     ("metadata key 'llama.vocab_size': expected 512 (the rows of tensor 'token_embd.weight'), "
     "found 600")),
    ({"add": {"general.type": ("mmproj", "STRING")}},
     ("metadata key 'general.type': expected a model (general.type 'model' or absent), found "
      "a multimodal projector (mmproj), which llama.cpp loads beside its language model "
      "(--mmproj); toymlx trains and runs the language model: pass that GGUF")),
    # an older projector says so by its architecture alone (llava's convert_image_encoder)
    ({"arch": "clip"},
     ("metadata key 'general.architecture': expected a model (general.type 'model' or "
      "absent), found a multimodal projector (mmproj), which llama.cpp loads beside its "
      "language model (--mmproj); toymlx trains and runs the language model: pass that GGUF")),
    ({"add": {"general.type": ("imatrix", "STRING")}},
     ("metadata key 'general.type': expected a model (general.type 'model' or absent), found "
      "an importance matrix (llama-imatrix's output, for llama-quantize --imatrix); pass the "
      "model GGUF")),
    ({"add": {"llama.expert_used_count": (2, "UINT32")}},
     ("metadata key 'llama.expert_used_count': expected 0 (expert_count is 0: a dense llama "
     "model), found 2")),
], ids=["extra-tensor", "longrope", "yarn-beta", "sliding-window", "architecture", "vocab-size",
        "general-type", "clip-architecture", "imatrix", "experts-used"])
def test_a_base_with_what_toymlx_does_not_compute_is_refused_by_every_command(
        tmp_path, stories_path, chat, shared_file, capsys, variant, want):
    """stories260K written again by gguf-py with one tensor or key toymlx does not compute
    with: `--recipe lora --base`, toymlx-eval and toymlx-generate each exit 2 with one line
    naming the file, the key or tensor and what was expected. (A warm-start --donor is read
    for its token table and tokenizer alone: `warm.read_donor` checks those.)"""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.generate import main as generate_main
    from toymlx_cli.train import main as train_main

    bad = gguf_variant(stories_path, tmp_path / "bad.gguf", **variant)
    runs = tmp_path / "runs"
    assert train_main(["--recipe", "lora", "--base", str(bad), "--data.path", str(chat),
                       "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--no-progress",
                       "--runs-root", str(runs)]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {bad}: {want}"
    assert not runs.exists() or not any(runs.iterdir())
    text, want_eval = str(shared_file("text/tinystories_sample.txt")), want
    assert eval_main(["--model", str(bad), "--data.path", text, "--seq-len", "32"]) == 2
    if variant.get("arch") == "mamba":  # eval reads ViT files too
        want_eval = want.replace("expected one of", "expected vit or one of")
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {bad}: {want_eval}"
    assert generate_main(["--model", str(bad), "--prompt", "Once", "--max-tokens", "2"]) == 2
    assert error_line(capsys, "toymlx-generate") == f"toymlx-generate: error: {bad}: {want}"


def test_a_first_step_that_overflows_blames_the_base_not_the_learning_rate(
        tmp_path, stories_path, chat, capsys):
    """A base whose values are all finite but whose final norm weights are 3e38 (its logits
    overflow float32): the lora run stops at step 1 as diverged, saying the loss came from the
    base as loaded, before any update, so not from the learning rate."""
    from toymlx_cli.train import main as train_main

    big = tmp_path / "big.gguf"
    shutil.copy(stories_path, big)
    info = GGUFFile(stories_path).tensors["output_norm.weight"]
    with open(big, "r+b") as f:
        f.seek(info.offset)
        f.write(np.full(info.n_elements, 3e38, "<f4").tobytes())
    rc = train_main(["--recipe", "lora", "--base", str(big), "--data.path", str(chat),
                     "--steps", "3", "--seq-len", "32", "--batch-size", "2", "--no-compile",
                     "--no-progress", "--runs-root", str(tmp_path / "runs"), "--run-id", "r"])
    assert rc == 2
    end = [json.loads(x) for x in (tmp_path / "runs" / "r" / "events.jsonl").read_text()
           .splitlines()][-1]
    assert end["reason"] == "diverged" and end["final_step"] == 0
    assert end["message"].startswith("loss became nan at step 1 (lr ")
    assert ", computed before any update from the base as loaded (its adapters are still " \
           "zero" in end["message"]
    assert "not the learning rate" in capsys.readouterr().err


def _set_metadata(path: Path, key: str, value: float) -> None:
    """Overwrite the scalar metadata value `key` of GGUF `path` in place (same type and size:
    what a hex editor or a flipped bit leaves; the recorded tensor digest still holds)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path), "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    r.data.flush()
    del r


def test_readers_refuse_a_checkpoint_whose_model_metadata_was_edited(runs, capsys):
    """A run's checkpoint with its RoPE base changed in the metadata (the tensor data, and so
    `toy.tensor_sha256`, untouched) was scored, generated from and exported as another model
    without a word; every reader and the resume now name the key, the run's value and the
    file's."""
    from toymlx_cli.eval import main as eval_main

    a, _ = runs
    ckpt = a / "weights" / "step_2.gguf"
    _set_metadata(ckpt, "llama.rope.freq_base", 20000.0)
    want = (f"{ckpt}: metadata key 'llama.rope.freq_base': expected 10000 (the run's model "
            "rope_base, as run_start records it), found 20000: the file was edited or damaged; "
            "put this run's checkpoint back")
    _readers_refuse(a, want, capsys)
    before = _files(a)
    assert _resume(a) == 2
    assert error_line(capsys).startswith(f"toymlx-train: error: {want}")
    assert _files(a) == before
    _set_metadata(ckpt, "llama.rope.freq_base", 10000.0)
    assert eval_main(["--model", str(a)]) == 0


@pytest.mark.parametrize("key,field", [("llama.attention.head_count", "n_heads"),
                                       ("llama.attention.head_count_kv", "n_kv_heads")])
def test_readers_refuse_a_llama_checkpoint_whose_head_count_was_edited(runs, capsys, key, field):
    """A Llama checkpoint's head counts set the attention's head width, not a tensor's shape:
    halved in the metadata, the same tensors were scored as another model without a word."""
    from toymlx_cli.eval import main as eval_main

    a, _ = runs
    ckpt = a / "weights" / "step_2.gguf"
    heads = next(e for e in _events(a) if e["kind"] == "run_start")["model"][field]
    _set_metadata(ckpt, key, heads // 2)
    assert eval_main(["--model", str(a)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {ckpt}: metadata key {key!r}: expected {heads} (the run's model "
        f"{field}, as run_start records it), found {heads // 2}: the file was edited or "
        "damaged; put this run's checkpoint back")
    _set_metadata(ckpt, key, heads)
    assert eval_main(["--model", str(a)]) == 0


@pytest.mark.parametrize("key,value,field,want,found", [
    ("vit.attention.layer_norm_epsilon", 1e-3, "norm_eps", "1e-06", "0.001"),
    ("vit.attention.head_count", 4, "n_heads", "2", "4")])
def test_readers_refuse_a_vit_checkpoint_whose_model_metadata_was_edited(
        tmp_path, capsys, key, value, field, want, found):
    """A vit run's checkpoint with its LayerNorm epsilon (which run_start did not record) or its
    head count (recorded, never compared) edited was scored as another model without a word;
    eval and the resume now name the key and both values. A run whose run_start predates the
    record (no norm_eps) still opens, is scored and resumes."""
    from test_eval import vit_run
    from toymlx_cli.eval import main as eval_main

    run, _ = vit_run(tmp_path)
    capsys.readouterr()
    ckpt = (run / "weights" / "latest").resolve()
    with GGUFFile(ckpt) as g:
        was = g.metadata[key]
    _set_metadata(ckpt, key, value)
    line = (f"{ckpt}: metadata key {key!r}: expected {want} (the run's model {field}, as "
            f"run_start records it), found {found}: the file was edited or damaged; put this "
            "run's checkpoint back")
    assert eval_main(["--model", str(run)]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {line}"
    before = _files(run)
    assert _resume(run) == 2
    assert error_line(capsys).startswith(f"toymlx-train: error: {line}")
    assert _files(run) == before
    _set_metadata(ckpt, key, was)
    assert eval_main(["--model", str(run)]) == 0
    # a run recorded before the model record held these: opened, scored and resumed as it is
    events = run / "events.jsonl"
    rows = [json.loads(ln) for ln in events.read_text().splitlines()]
    for e in rows:
        if e["kind"] == "run_start":
            for k in ("norm_eps", "pixel_scale", "pixel_mean", "pixel_std"):
                del e["model"][k]
    events.write_text("".join(json.dumps(e) + "\n" for e in rows))
    assert eval_main(["--model", str(run)]) == 0
    assert _resume(run, "--no-progress", "--no-compile") == 0


def _swap_class_names(path: Path, i: int, j: int) -> None:
    """Swap class names `i` and `j` (of one length) of GGUF `path` in place: the tensors, and
    so `toy.tensor_sha256`, untouched."""
    from gguf import GGUFReader

    r = GGUFReader(str(path), "r+")
    f = r.fields["toy.class_names"]
    a, b = f.parts[f.data[i]], f.parts[f.data[j]]
    a[:], b[:] = b.copy(), a.copy()
    r.data.flush()
    del r


def test_readers_refuse_a_vit_checkpoint_whose_class_names_were_swapped(tmp_path, capsys):
    """Two class names swapped in a vit run's checkpoint labelled every image of those classes
    under the other's name, in toymlx-classify and toymlx-eval, without a word: the readers and
    the resume now name the first differing item and both names. A run recorded before the
    count and digest is still compared by the names it lists, and opens."""
    from test_eval import vit_run
    from toymlx_cli.classify import main as classify_main
    from toymlx_cli.eval import main as eval_main

    run, folder = vit_run(tmp_path)
    capsys.readouterr()
    ckpt = (run / "weights" / "latest").resolve()
    start = next(e for e in _events(run) if e["kind"] == "run_start")["config"]
    assert (start["class_names"], start["class_count"]) == (["bird", "cat", "frog"], 3)
    _swap_class_names(ckpt, 0, 2)
    with GGUFFile(ckpt) as g:
        assert g.metadata["toy.class_names"] == ["frog", "cat", "bird"]
    line = (f"{ckpt}: metadata key 'toy.class_names': item 0: expected 'bird' (the run's class "
            "name, as run_start records it), found 'frog': the file was edited or damaged; put "
            "this run's checkpoint back")
    assert eval_main(["--model", str(run)]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {line}"
    image = str(folder / "bird" / "00.png")
    assert classify_main(["--model", str(run), image]) == 2
    assert error_line(capsys, "toymlx-classify") == f"toymlx-classify: error: {line}"
    before = _files(run)
    assert _resume(run) == 2
    assert error_line(capsys).startswith(f"toymlx-train: error: {line}")
    assert _files(run) == before
    # a run recorded before class_count and class_names_sha256: its names still compared
    events = run / "events.jsonl"
    rows = [json.loads(ln) for ln in events.read_text().splitlines()]
    for e in rows:
        if e["kind"] == "run_start":
            del e["config"]["class_count"], e["config"]["class_names_sha256"]
    events.write_text("".join(json.dumps(e) + "\n" for e in rows))
    assert eval_main(["--model", str(run)]) == 2
    assert error_line(capsys, "toymlx-eval") == f"toymlx-eval: error: {line}"
    _swap_class_names(ckpt, 0, 2)
    assert classify_main(["--model", str(run), image]) == 0


def test_class_names_past_those_run_start_lists_are_compared_by_count_and_digest(tmp_path):
    """run_start lists the first 100 class names; a checkpoint of 1000 classes with names 500
    and 501 swapped, or one name dropped, is refused by the recorded count and SHA-256."""
    from toymlx.bundle.checkpoint import ResumeError, check_recorded_classes
    from toymlx.gguf.vit import class_names_sha256

    names = [f"c{i}" for i in range(1000)]
    config = {"class_names": names[:100], "class_count": 1000,
              "class_names_sha256": class_names_sha256(names)}
    ckpt = tmp_path / "step_1.gguf"
    check_recorded_classes(ckpt, {"toy.class_names": names}, config)  # the same: passes
    swapped = [*names[:500], names[501], names[500], *names[502:]]
    with pytest.raises(ResumeError) as e:
        check_recorded_classes(ckpt, {"toy.class_names": swapped}, config)
    assert str(e.value) == (
        f"{ckpt}: metadata key 'toy.class_names': expected the run's 1000 names (sha256 "
        f"{class_names_sha256(names)[:12]}, as run_start records them), found others (sha256 "
        f"{class_names_sha256(swapped)[:12]}; the first 100, those run_start lists, agree): "
        "the file was edited or damaged; put this run's checkpoint back")
    with pytest.raises(ResumeError) as e:
        check_recorded_classes(ckpt, {"toy.class_names": names[:999]}, config)
    assert str(e.value) == (
        f"{ckpt}: metadata key 'toy.class_names': expected 1000 names (the run's classes, as "
        "run_start records them), found 999: the file was edited or damaged; put this run's "
        "checkpoint back")
    # an older record: the first 100 only, so a list of 1000 is compared by those
    check_recorded_classes(ckpt, {"toy.class_names": swapped}, {"class_names": names[:100]})
