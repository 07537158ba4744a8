"""Every flag and `-c` key of every command, given hostile values, run in process.

A corpus of attempts is built from the commands' own option tables (each recipe's Config,
toymlx-eval/-generate/-export's Args, toymlx-sweep's parser, toymlx-report's options): each
option gets values a careless or hostile user types (empty, huge, negative, nan/inf, the wrong
type, bytes that are not UTF-8, a lone surrogate, folders, missing paths, /dev/null, an input
of the command itself), on the command line and in a `-c` file (YAML, or JSON where YAML cannot
carry the value), and every `-c` key is also given twice. Around a small valid baseline (tiny
runs of 1 step, `--stop-at 1`), each attempt must end with exit 0 (the value was fine), 2 (one
`PROG: error:` line, or tyro's and argparse's usage message) or 1 (a run that started and
failed or diverged): never an exception out of the command or a traceback, and every input
file byte-identical afterwards. The default tier draws one value per option (both forms,
seeded) within a small budget; `-m slow` tries every value in both forms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import os
import random
import shutil
import signal
import stat
import sys
import time
import traceback
import typing
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from toymlx.bundle.options import flag_name

HUGE_TEXT = "x" * 100_000
VALUES: list[Any] = [
    "", "-1", "0", "-0.0", "nan", "inf", "-inf", "1e400", "1e15", "9223372036854775808",
    "1.5", "true", "none", "[1]", "ab\udcffc",  # the last: argv's undecodable byte 0xff
    HUGE_TEXT, "{empty_dir}", "{empty_dir}/", "{missing}", "/dev/null", "{data}", "{base}",
]
"""Hostile command-line values ({...}: paths made per test)."""
FILE_VALUES: list[Any] = [
    None, True, -1, 0, 10**15, 2**64, 1.5, float("nan"), float("inf"), "", [], [1, "a"],
    {"a": 1}, "2024-01-01", "ab\ud800", HUGE_TEXT, "{empty_dir}", "{missing}", "/dev/null",
    "{data}",
]
"""Hostile `-c` values; "2024-01-01" is written unquoted (a YAML date), "ab\\ud800" as JSON."""
DEFAULT_BUDGET_S = 45.0
SLOW_BUDGET_S = float(os.environ.get("TOYMLX_FUZZ_BUDGET_S", "100"))
"""The slow tier's budget: every value of every option in both forms (11,000 attempts) takes
~20 minutes on 2 cores, so CI tries ~1,100 of them in 100 s (of its 90 minutes), in an order
drawn from the day (TOYMLX_FUZZ_BUDGET_S=inf: all of them)."""
SLOW_SEED = int(os.environ.get("TOYMLX_FUZZ_SEED", datetime.date.today().toordinal()))
"""The slow tier's order: each day's CI tries another part of the whole corpus; the report
prints the seed, and TOYMLX_FUZZ_SEED=N tries that day's order again."""


@dataclasses.dataclass
class Command:
    """A command under test: its entry point, its baseline options and the options to fuzz."""

    prog: str
    main: Callable[[list[str]], int]
    base: dict[str, list[str]]
    """Option key -> its baseline arguments (left out when that key is fuzzed)."""
    keys: list[str]
    positional: list[str] = dataclasses.field(default_factory=list)
    may_fail: bool = False
    """A run may start and fail (exit 1): training and sweeps."""
    output: str | None = None
    """The option naming the file it writes: given a file that is not one of its own inputs
    (the baseline's), writing there is what was asked."""
    reads: tuple[str, ...] = ()
    limit_s: int = 60
    """Seconds an attempt may take before it counts as hung."""
    """World.paths() names of the files its baseline reads."""


def dataclass_keys(cls: type, prefix: str = "") -> list[str]:
    """Every option of an options dataclass, dotted (model.d_model)."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out += dataclass_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def parser_keys(parser) -> list[str]:
    return [a.option_strings[-1][2:].replace("-", "_") for a in parser._actions
            if a.option_strings and a.dest not in ("help", "version", "config")]


def flag(key: str) -> str:
    return {"seed": "--seed"}.get(key, flag_name(key)) if key != "from_step" else "--from"


class World:
    """The inputs (files whose bytes must not change) and the commands around them."""

    def __init__(self, root: Path, shared: Callable[[str], Path]):
        self.root = root
        self.inputs = root / "inputs"
        self.out = root / "out"
        (self.inputs / "empty").mkdir(parents=True)
        self.out.mkdir()
        self.data = self.inputs / "stories.txt"
        shutil.copy(shared("text/tinystories_sample.txt"), self.data)
        self.chat = self.inputs / "chat.jsonl"
        self.chat.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "completion":
                                                 f"It is {2 * i}."}) + "\n" for i in range(12)))
        self.base = self.inputs / "stories260K.gguf"
        shutil.copy(shared("models/stories260K.gguf"), self.base)
        self.originals = {p: p.read_bytes() for p in (self.data, self.chat, self.base)}
        self.n = 0
        self._hashed: dict[tuple, str] = {}

    def restore(self) -> None:
        """Put back an input a command was asked to overwrite (as not its own input)."""
        for p, data in self.originals.items():
            if not p.is_file() or p.read_bytes() != data:
                if p.is_dir():
                    shutil.rmtree(p)
                p.write_bytes(data)

    def paths(self) -> dict[str, str]:
        return {"empty_dir": str(self.inputs / "empty"), "missing": str(self.root / "nope"),
                "data": str(self.data), "base": str(self.base)}

    def snapshot(self) -> dict[str, str]:
        """Each input file's SHA-256 by its name, a file read again only where its stat (inode,
        size, modification and change times) differs from when it was last read: hashing every
        input, and pathlib's walk over the ~500 files the attempts leave, after each of ~800
        attempts took a third of the test's time (a write always changes the change time)."""
        out, root = {}, str(self.inputs)
        for folder, _, names in os.walk(root):  # as rglob: symlinked folders not entered
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:  # a dangling link: no file
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = (path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if key not in self._hashed:
                    with open(path, "rb") as f:
                        self._hashed[key] = hashlib.sha256(f.read()).hexdigest()
                out[path[len(root) + 1:]] = self._hashed[key]
        return out

    def run_id(self) -> list[str]:
        self.n += 1
        return ["--run-id", f"r{self.n}"]


TINY_LLAMA = {"model.d_model": ["--model.d-model", "32"], "model.n_layers": ["--model.n-layers", "1"],
              "model.n_heads": ["--model.n-heads", "4"], "model.n_kv_heads": ["--model.n-kv-heads", "2"],
              "model.ffn_dim": ["--model.ffn-dim", "64"], "model.context": ["--model.context", "64"]}


def commands(w: World, run: Path) -> list[Command]:
    from toymlx_cli import eval as eval_cli
    from toymlx_cli import export as export_cli
    from toymlx_cli import generate as generate_cli
    from toymlx_cli.report import main as report_main
    from toymlx_cli.sweep import _parser
    from toymlx_cli.sweep import main as sweep_main
    from toymlx_cli.train import main as train_main

    from toymlx.recipes import RECIPES, get_recipe

    loop = {"steps": ["--steps", "1"], "stop_at": ["--stop-at", "1"],
            "compile": ["--no-compile"], "eval_batches": ["--eval-batches", "1"],
            "eval_every": ["--eval-every", "0"], "batch_size": ["--batch-size", "2"],
            "runs_root": ["--runs-root", str(w.out / "runs")], "progress": ["--no-progress"]}
    text = {**loop, **TINY_LLAMA, "seq_len": ["--seq-len", "32"],
            "data.path": ["--data.path", str(w.data)]}
    bases = {
        "from-scratch": text,
        "warm-start": {**text, "donor": ["--donor", str(w.base)]},
        "lora": {**loop, "base": ["--base", str(w.base)], "seq_len": ["--seq-len", "32"],
                 "data.path": ["--data.path", str(w.chat)]},
        "vit-tiny": {**loop, "model.d_model": ["--model.d-model", "32"],
                     "model.n_layers": ["--model.n-layers", "1"],
                     "data.workers": ["--data.workers", "0"]},
    }
    out = []
    for recipe in RECIPES:
        cfg = get_recipe(recipe).Config
        keys = dataclass_keys(cfg)
        out.append(Command(f"toymlx-train --recipe {recipe}",
                           lambda a, r=recipe: train_main(["--recipe", r, *a]),
                           bases[recipe], keys, may_fail=True))
    out += [
        Command("toymlx-eval", eval_cli.main, {"model": ["--model", str(run)],
                                               "batch_size": ["--batch-size", "8"]},
                dataclass_keys(eval_cli.Args)),
        Command("toymlx-generate", generate_cli.main,
                {"model": ["--model", str(w.base)], "prompt": ["--prompt", "Once"],
                 "max_tokens": ["--max-tokens", "2"],
                 "context_shift": ["--no-context-shift"]}, dataclass_keys(generate_cli.Args),
                # a huge --max-tokens decodes to the end of the model's 2,048-token context:
                # 46 s on a busy 2-core host (the generation stops there); with the context
                # shift it goes on as asked (stories260K: no end-of-text in 10 minutes)
                limit_s=300),
        Command("toymlx-export", export_cli.main,
                {"base": ["--base", str(w.base)], "out": ["--out", str(w.out / "x.gguf")],
                 "dtype": ["--dtype", "f32"]}, dataclass_keys(export_cli.Args), output="out",
                reads=("base",)),
        Command("toymlx-sweep", sweep_main,
                {"recipe": ["--recipe", "from-scratch"], "grid": ["--grid", "lr=1e-3"],
                 "shard": ["--shard", "1/2"], "runs_root": ["--runs-root", str(w.out / "sw")],
                 "no_progress": ["--no-progress"], "no_report": ["--no-report"]},
                parser_keys(_parser()), may_fail=True),
        Command("toymlx-report", report_main, {"out": ["--out", str(w.out / "r.html")]},
                ["out"], positional=[str(run)], output="out"),
    ]
    return out


@dataclasses.dataclass(frozen=True)
class Attempt:
    command: int
    key: str
    form: str  # flag | file | twice
    value: Any


def corpus(cmds: list[Command], everything: bool, seed: int) -> list[Attempt]:
    """Every (command, option, form, value) with `everything`, else one value per option and
    form, drawn with `seed`; the options of every command in turn."""
    rng = random.Random(seed)
    out = []
    for i, c in enumerate(cmds):
        for key in c.keys:
            for form, values in (("flag", VALUES), ("file", FILE_VALUES)):
                out += [Attempt(i, key, form, v) for v in
                        (values if everything else [rng.choice(values)])]
            if key not in ("resume", "from_step"):
                out.append(Attempt(i, key, "twice", None))
    rng.shuffle(out)
    return out


def _fill(value: Any, paths: dict[str, str]) -> Any:
    return value.format(**paths) if isinstance(value, str) and value.startswith("{") and \
        value.endswith(("}", "}/")) else value


def _config_file(w: World, key: str, value: Any, form: str) -> Path:
    w.n += 1
    if form == "twice":
        p = w.inputs / f"c{w.n}.yaml"
        p.write_text(f"{key}: 1\n{key}: 2\n")
        return p
    if isinstance(value, str) and any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        p = w.inputs / f"c{w.n}.json"
        p.write_text(json.dumps({key: value}))
        return p
    p = w.inputs / f"c{w.n}.yaml"
    text = f"{key}: 2024-01-01\n" if value == "2024-01-01" else yaml.safe_dump({key: value})
    p.write_text(text)
    return p


def argv_of(w: World, c: Command, a: Attempt) -> list[str]:
    value = _fill(a.value, w.paths())
    args = [x for k, v in c.base.items() if k != a.key for x in v] + list(c.positional)
    if c.prog.startswith("toymlx-train") and a.key != "run_id":
        args += w.run_id()
    if c.prog == "toymlx-sweep" and a.key != "sweep_id":
        w.n += 1
        args += ["--sweep-id", f"s{w.n}"]
    if a.form == "flag":
        return [*args, flag(a.key), str(value)]
    return [*args, "-c", str(_config_file(w, a.key, value, a.form))]


class Hung(Exception):
    """An attempt still running after its command's `limit_s`."""


def _hung(signum: int, frame: Any) -> None:
    raise Hung


def attempt(c: Command, argv: list[str]) -> tuple[str, str]:
    """(outcome, what was printed to stderr) of one run of the command, in process."""
    err = io.StringIO()
    stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(b"hi\n\xff\n/quit\n"), encoding="utf-8")
    old = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(c.limit_s)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = c.main(argv)
            except SystemExit as e:  # tyro's and argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
                if rc == 2:
                    return "usage error", err.getvalue()
            except Hung:
                return "hung", err.getvalue() + traceback.format_exc()
            except Exception:  # noqa: BLE001 (the finding itself)
                return "traceback", err.getvalue() + traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        sys.stdin = stdin
    text = err.getvalue()
    if "Traceback (most recent call last)" in text:
        return "traceback", text
    if rc == 0:
        return "accepted", text
    lines = [ln for ln in text.splitlines() if ln.startswith(f"{c.prog.split()[0]}: error:")]
    if rc == 2 and len(lines) == 1:
        return "refused, one line", text
    if rc == 2 and c.may_fail and "toymlx: diverged at step" in text:
        return "run diverged", text  # a run's end (exit 2, its own final line), not input
    if rc == 1 and c.may_fail:
        return "run failed", text
    return f"exit {rc}" + (", unclear" if rc == 2 else ""), text


def fuzz(tmp_path: Path, shared: Callable[[str], Path], everything: bool,
         budget_s: float | None, seed: int = 39) -> dict:
    from toymlx_cli.train import main as train_main

    w = World(tmp_path, shared)
    run = w.inputs / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert train_main(["--recipe", "from-scratch", *[x for v in TINY_LLAMA.values() for x in v],
                           "--seq-len", "32", "--steps", "2", "--no-compile", "--eval-every", "0",
                           "--eval-batches", "1", "--no-progress", "--data.path", str(w.data),
                           "--runs-root", str(w.inputs), "--run-id", "run"]) == 0
    cmds = commands(w, run)
    todo = corpus(cmds, everything, seed=seed)
    outcomes: Counter = Counter()
    bad: list[str] = []
    t0 = time.perf_counter()
    before = w.snapshot()
    tried = 0
    slow: list[tuple[float, str]] = []
    for a in todo:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        c = cmds[a.command]
        argv = argv_of(w, c, a)
        shown = f"{c.prog} {a.form} {a.key}={str(a.value)[:40]!r}"
        with open(tmp_path / "attempts.log", "a") as log:  # what is tried, should one hang
            log.write(shown)
        t1 = time.perf_counter()
        outcome, text = attempt(c, argv)
        slow.append((time.perf_counter() - t1, shown))
        with open(tmp_path / "attempts.log", "a") as log:
            log.write(f": {outcome} in {slow[-1][0]:.2f} s\n")
        tried += 1
        outcomes[outcome] += 1
        after = w.snapshot()
        changed = [k for k in before if after.get(k) != before[k]]
        named = a.value.strip("{}/") if isinstance(a.value, str) else None
        if a.key == c.output and named in ("data", "base") and named not in c.reads:
            # asked to write over a file that is not its input: what was asked, put back
            target = str(Path(w.paths()[named]).relative_to(w.inputs))
            changed = [k for k in changed if k != target]
            w.restore()
            after = w.snapshot()
        if outcome in ("traceback", "hung") or outcome.startswith("exit"):
            bad.append(f"{shown}: {outcome}: {text.strip()[-600:]}")
        if changed:
            bad.append(f"{shown}: changed its inputs {changed}")
        before = after  # a -c file written for the next attempt is an input from then on
        shutil.rmtree(w.out, ignore_errors=True)
        w.out.mkdir()
    return {"attempts": tried, "planned": len(todo), "seed": seed,
            "seconds": time.perf_counter() - t0,
            "commands": len(cmds), "options": sum(len(c.keys) for c in cmds),
            "outcomes": dict(outcomes), "bad": bad, "slowest": sorted(slow)[-5:]}


def report(result: dict, tier: str) -> str:
    host = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                 .splitlines() if ln.startswith("model name")), "unknown CPU")
    return (f"fuzz ({tier}, seed {result['seed']}): {result['attempts']} of "
            f"{result['planned']} attempts over "
            f"{result['options']} options of {result['commands']} commands in "
            f"{result['seconds']:.0f} s on {host}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items()))
            + f"; {len(result['bad'])} bad")


def test_fuzz_every_flag_and_key_small_budget(tmp_path, shared_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths the values name land here
    result = fuzz(tmp_path, shared_file, everything=False, budget_s=DEFAULT_BUDGET_S)
    with capsys.disabled():
        print("\n" + report(result, "default tier"))
    assert result["attempts"] >= 50
    assert result["bad"] == [], "\n".join(result["bad"])


@pytest.mark.slow
def test_fuzz_every_flag_and_key_every_value(tmp_path, shared_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = fuzz(tmp_path, shared_file, everything=True, budget_s=SLOW_BUDGET_S,
                  seed=SLOW_SEED)
    with capsys.disabled():
        print("\n" + report(result, "slow tier"))
    assert result["attempts"] >= min(result["planned"], 500)
    assert result["bad"] == [], "\n".join(result["bad"])


# ---- what the fuzz found, each case on its own -----------------------------------------------
@pytest.mark.parametrize("argv,want", [
    (["--recipe", "from-scratch", "--resume", "x" * 300],
     f"[Errno 36] File name too long: '{'x' * 300}'"),
    (["--recipe", "from-scratch", "--warmup", str(2**64)],
     f"--warmup: expected at most 2147483647 in size, found {2**64}"),
    (["--recipe", "from-scratch", "--cpu-streams", "100"],
     "--cpu-streams: expected 0..64 (0: auto), found 100"),
    (["--recipe", "from-scratch", "--model.rope-base", "0"],
     "--model.rope-base: expected > 0, found 0.0"),
])
def test_train_findings_are_one_line(tmp_path, capsys, argv, want):
    """A traceback (a name too long, 2**64 inside MLX), a run that never started (10**15 CPU
    streams) and a run diverged from step 0 (RoPE base 0), each found by the fuzz."""
    from cli_errors import error_line
    from toymlx_cli.train import main as train_main

    assert train_main([*argv, *[x for v in TINY_LLAMA.values() for x in v], "--seq-len", "32",
                       "--steps", "1", "--no-compile", "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,want", [
    (["--seed", str(2**64)], f"--seed: expected 0..{2**64 - 1}, found {2**64}"),
])
def test_generate_findings_are_one_line(stories_path, capsys, argv, want):
    from cli_errors import error_line
    from toymlx_cli.generate import main as generate_main

    assert generate_main(["--model", str(stories_path), "--prompt", "hi", *argv]) == 2
    assert error_line(capsys, "toymlx-generate") == f"toymlx-generate: error: {want}"


def test_an_output_named_in_a_config_file_too_long_for_the_file_system_is_one_line(
        tmp_path, capsys, stories_path, monkeypatch):
    """`toymlx-export -c c.json` whose `out` is 300 characters (the slow tier's fuzz, seed
    739951): checking the -c file's outputs met "File name too long" as a traceback."""
    from cli_errors import error_line
    from toymlx_cli.export import main as export_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps({"base": str(stories_path), "out": "x" * 300}))
    assert export_main(["-c", str(tmp_path / "c.json")]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: [Errno 36] File name too long: '{tmp_path / ('x' * 300)}'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_eval_out_of_memory_is_one_line(tmp_path, capsys, shared_file):
    """`toymlx-eval --batch-size 10**12` asked numpy for 7.5 TiB: a MemoryError traceback."""
    from cli_errors import error_line
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.train import main as train_main

    data = str(shared_file("text/tinystories_sample.txt"))
    assert train_main(["--recipe", "from-scratch", *[x for v in TINY_LLAMA.values() for x in v],
                       "--seq-len", "32", "--steps", "1", "--no-compile", "--eval-batches", "1",
                       "--data.path", data, "--runs-root", str(tmp_path), "--run-id", "m",
                       "--no-progress"]) == 0
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "m"), "--batch-size", str(10**12)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: out of memory: Unable to allocate 7.50 TiB for an array with shape "
        "(62500000000, 33) and data type int32; lower --batch-size")


# ---- hostile files (issue 47): values, kinds, sizes and edits no flag value reaches ----------
def _poison(src: Path, dst: Path, name: str, value: float, index: int) -> Path:
    from toymlx.gguf.reader import GGUFFile

    shutil.copy(src, dst)
    info = GGUFFile(src).tensors[name]
    with open(dst, "r+b") as f:
        f.seek(info.offset + 4 * index)  # stories260K is F32
        f.write(np.float32(value).tobytes())
    return dst


def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"lr: *a{levels}"]) + "\n"


def _edited_runs(w: World, run: Path, other: Path) -> dict[str, Path]:
    """Copies of `run` edited as a user might: config.json's lr, another run's config.json or
    checkpoint pair copied in, events.jsonl emptied or deleted, weights/ made a file."""
    out = {}
    for edit in ("lr", "config", "pair", "empty", "gone", "weights"):
        r = out[edit] = w.inputs / f"run_{edit}"
        shutil.copytree(run, r, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
        if edit == "lr":
            saved = json.loads((r / "config.json").read_text())
            saved["config"]["lr"] = 0.5
            (r / "config.json").write_text(json.dumps(saved, indent=2))
        elif edit == "config":
            shutil.copy(other / "config.json", r / "config.json")
        elif edit == "pair":
            for name in ("step_2.gguf", "step_2.state.safetensors"):
                shutil.copy(other / "weights" / name, r / "weights" / name)
        elif edit == "empty":
            (r / "events.jsonl").write_text("")
        elif edit == "gone":
            (r / "events.jsonl").unlink()
        else:
            shutil.rmtree(r / "weights")
            (r / "weights").write_text("not a folder")
    return out


def hostile_files(w: World, run: Path, other: Path) -> list[tuple[str, str, list[str], str]]:
    """(class, prog, argv, what the one line must say) of every hostile-file attempt, over every command that reads the
    kind of file: NaN/Inf values in a base, FIFOs and devices, alias bombs and deep nesting in
    -c, surrogates and deep lines in data, edited and swapped run files, and plain folders
    under --overwrite. Each must be refused in one line, quickly, changing no input."""
    from toymlx.recipes import RECIPES

    base = str(w.base)
    tiny = [x for v in TINY_LLAMA.values() for x in v]
    loop = ["--steps", "1", "--no-compile", "--eval-batches", "1", "--no-progress",
            "--seq-len", "32", "--batch-size", "2", "--runs-root", str(w.out / "runs")]
    models = {  # prog -> argv around a model file
        "toymlx-generate": lambda m: ["--model", m, "--prompt", "Once", "--max-tokens", "2"],
        "toymlx-eval": lambda m: ["--model", m, "--data.path", str(w.data), "--seq-len", "32"],
        "toymlx-export": lambda m: ["--base", m, "--out", str(w.out / "x.gguf")],
        "toymlx-train --recipe lora": lambda m: ["--base", m, "--data.path", str(w.chat), *loop],
        "toymlx-train --recipe warm-start": lambda m: ["--donor", m, "--data.path",
                                                       str(w.data), *tiny, *loop],
    }
    out = []
    nan = {"nan q": ("blk.0.attn_q.weight", float("nan"), 7),
           "+inf table": ("token_embd.weight", float("inf"), 3),
           "-inf norm": ("output_norm.weight", -float("inf"), 0)}
    for label, (name, value, index) in nan.items():
        p = _poison(w.base, w.inputs / f"{label.replace(' ', '_')}.gguf", name, value, index)
        out += [(f"NaN/Inf base ({label})", prog, argv(str(p)), "expected finite values")
                for prog, argv in models.items()
                if not (prog.endswith("warm-start") and name != "token_embd.weight")]
    fifo = w.inputs / "pipe"
    os.mkfifo(fifo)
    for special, kind in ((str(fifo), "a FIFO (named pipe)"), ("/dev/zero", "a character device")):
        cls = f"special file ({special.rsplit('/', 1)[-1]})"
        out += [(cls, prog, argv(special), f"found {kind}") for prog, argv in models.items()]
        out += [(cls, "toymlx-train --recipe from-scratch", ["--data.path", special, *tiny, *loop],
                 f"found {kind}"),
                (cls, "toymlx-eval", ["--model", base, "--data.path", special, "--seq-len", "32"],
                 f"found {kind}")]
    depth = "nested at most 32 deep"
    configs = {"alias bomb": ("bomb.yaml", _bomb(9), "expected at most 100,000 values"),
               "self alias": ("self.yaml", "lr: &a [1, *a]\n", depth),
               "deep yaml": ("deep.yaml", "lr: " + "[" * 60 + "]" * 60 + "\n", depth),
               "deep json": ("deep.json", '{"lr": ' + "[" * 50_000 + "]" * 50_000 + "}",
                             "nested too deeply")}
    progs = [*(f"toymlx-train --recipe {r}" for r in RECIPES), "toymlx-eval", "toymlx-generate",
             "toymlx-export", "toymlx-sweep"]
    for label, (name, text, want) in configs.items():
        (w.inputs / name).write_text(text)
        out += [(f"config ({label})", prog, ["-c", str(w.inputs / name)], want) for prog in progs]
    out += [("config (FIFO)", prog, ["-c", str(fifo)], "found a FIFO") for prog in progs]
    good = json.dumps({"prompt": "What is 1 + 1?", "completion": "It is 2."})
    for label, (line, want) in {
            "surrogate": ('{"prompt": "a\\ud800", "completion": "b"}', "lone surrogate U+D800"),
            "deep line": ("[" * 100_000 + "]" * 100_000, "nested too deeply")}.items():
        p = w.inputs / f"{label.replace(' ', '_')}.jsonl"
        p.write_text("\n".join([good] * 3 + [line] + [good] * 3) + "\n")
        out.append((f"data ({label})", "toymlx-train --recipe lora",
                    ["--base", base, "--data.path", str(p), *loop], want))
    says = {"lr": "config.json was edited", "config": "the two files belong to different runs",
            "pair": "expected a checkpoint of this run", "empty": "expected the run's record",
            "gone": "expected the run's record", "weights": "expected the run's checkpoint folder"}
    for edit, r in _edited_runs(w, run, other).items():
        out.append((f"edited run ({edit})", "toymlx-train --recipe from-scratch",
                    ["--resume", str(r), "--steps", "3"], says[edit]))
    plain = w.inputs / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    fits = [*tiny, "--seq-len", "32"]  # within tiny's --model.context 64
    needs = {"from-scratch": ["--data.path", str(w.data), *fits],
             "warm-start": ["--donor", base, "--data.path", str(w.data), *fits],
             "lora": ["--base", base, "--data.path", str(w.chat)], "vit-tiny": []}
    for recipe in RECIPES:
        out.append(("plain folder under --overwrite", f"toymlx-train --recipe {recipe}",
                    [*needs.get(recipe, []), "--steps", "1", "--runs-root", str(w.inputs),
                     "--run-id", "plain", "--overwrite"], "found a folder that is not a run"))
    return out


def fuzz_hostile_files(tmp_path: Path, shared: Callable[[str], Path]) -> dict:
    from toymlx_cli.train import main as train_main

    w = World(tmp_path, shared)
    runs = {}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for name, seed in (("run", "0"), ("other", "1")):
            assert train_main(["--recipe", "from-scratch", *[x for v in TINY_LLAMA.values()
                                                             for x in v],
                               "--seq-len", "32", "--steps", "2", "--no-compile", "--seed", seed,
                               "--eval-every", "0", "--eval-batches", "1", "--no-progress",
                               "--data.path", str(w.data), "--runs-root", str(w.out),
                               "--run-id", name]) == 0
            runs[name] = w.out / name
    cmds = {c.prog: c for c in commands(w, runs["run"])}
    todo = hostile_files(w, runs["run"], runs["other"])
    before = w.snapshot()
    classes: dict[str, Counter] = {}
    bad = []
    t0 = time.perf_counter()
    for cls, prog, argv, want in todo:
        c = dataclasses.replace(cmds[prog], limit_s=20)  # the bound: 20 s
        if prog.startswith("toymlx-train") and "--resume" not in argv:
            argv = [*argv, *([] if "--run-id" in argv else w.run_id())]
        t1 = time.perf_counter()
        outcome, text = attempt(c, argv)
        classes.setdefault(cls, Counter())[outcome] += 1
        after = w.snapshot()
        changed = [k for k in before if after.get(k) != before[k]]
        shown = f"{cls}: {prog} {' '.join(a[:60] for a in argv)}"
        if outcome != "refused, one line" or want not in text:
            bad.append(f"{shown}: {outcome} in {time.perf_counter() - t1:.1f} s: "
                       f"{text.strip()[-400:]}")
        if changed:
            bad.append(f"{shown}: changed its inputs {changed}")
        before = after
    return {"attempts": len(todo), "seconds": time.perf_counter() - t0,
            "classes": {k: dict(v) for k, v in classes.items()}, "bad": bad}


def test_fuzz_hostile_files(tmp_path, shared_file, capsys, monkeypatch):
    """Every hostile file of `hostile_files` over every command that reads it: one line each
    (no traceback, no hang past 20 s, nothing accepted), and every input byte-identical."""
    monkeypatch.chdir(tmp_path)
    result = fuzz_hostile_files(tmp_path, shared_file)
    with capsys.disabled():
        print(f"\nfuzz (hostile files): {result['attempts']} attempts in "
              f"{result['seconds']:.0f} s: " + "; ".join(
                  f"{k}: {', '.join(f'{o} {n}' for o, n in v.items())}"
                  for k, v in result["classes"].items()) + f"; {len(result['bad'])} bad")
    assert result["attempts"] >= 60
    assert result["bad"] == [], "\n".join(result["bad"])
