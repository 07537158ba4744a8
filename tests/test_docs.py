"""Every command block in README.md and the guides in docs/ runs as written, so that a renamed
flag fails here instead of in a reader's shell.

How the markdown is read (the guides' own convention, stated in docs/RUNS.md):
- a ```sh block holds commands; its first line `# needs: REASON` (a Mac, a GPU, Ollama,
  llama.cpp, the network, ...) says it cannot run here, and then only its toymlx commands'
  flags are parsed, with each command's own parser (tyro, or argparse for toymlx-sweep,
  -report and -launch): a renamed or misspelt flag fails all the same;
- a plain ``` block is allowed only in README's "Set-up" section: the two commands .ci/run
  runs from a clean clone (checked against .ci/run here, not run again);
- a ```yaml block whose first line is `# NAME.yaml` is that file: it is written where the
  blocks run, before the blocks after it;
- ```text blocks show output and ```python blocks are run with python3 (the slow tier).

The blocks of one document run in order, in one fresh folder (the runs root `runs/` is inside
it), on the default tiny data, with each run shortened: every step count (`--steps`,
`--stop-at`, `--checkpoint-every`, `--eval-every`, `--report-every`, `step_N` in a path or
`--from`; `steps=` in Python) divided by 10, rounded up, so that a resume or a `--from` still
names a checkpoint the shortened run wrote; a new run without `--steps` gets its recipe's
default so divided; a sweep's runs take one step each; a run reports every step
(`--report-every 1`, unless given); generation is cut to 8 tokens. A GGUF model a command reads by a file name
that no block writes (`--base SmolLM2-135M-Instruct.Q4_1.gguf`, `--donor ...`, `--tokenizer ...`) is the shared
reference model stories260K.gguf under that name: a tiny llama the same commands accept.
README's blocks run in the default tier; the guides' in the slow tier (CI).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from smollm import smollm_gguf  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[1]
README = "README.md"
GUIDES = ["docs/LORA.md", "docs/MLX_LM.md", "docs/TEXT.md", "docs/RUNS.md", "docs/IMAGES.md",
          "docs/SWEEPS.md", "docs/PERFORMANCE.md", "docs/INSTALL.md"]
DOCS = [README, *GUIDES]
NEEDS = re.compile(r"^# needs: (\S.*)$")
FILE_BLOCK = re.compile(r"^# (\S+\.(?:yaml|yml|json))$")
SHRINK = 10
"""Step counts in a block are divided by this (rounded up) when it runs here."""
MAX_TOKENS = 8
MODEL_FLAGS = ("--base", "--donor", "--tokenizer", "--model")
STEP_FLAGS = ("--steps", "--stop-at", "--checkpoint-every", "--eval-every", "--report-every")
OPERATORS = {"&&", "||", ";", "|"}


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    text: str
    section: str

    @property
    def needs(self) -> str | None:
        """The reason this block cannot run here (its first line `# needs: ...`), or None."""
        first = self.text.splitlines()[0] if self.text else ""
        m = NEEDS.match(first)
        return m.group(1) if m else None

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of a markdown file, with the section heading each sits under."""
    out, section, lines = [], "", (REPO / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("#") and not ln.startswith("#!"):
            section = ln.lstrip("#").strip()
        if ln.startswith("```"):
            lang, start, i = ln[3:].strip(), i + 1, i + 1
            while not lines[i].startswith("```"):
                i += 1
            out.append(Block(doc, start, lang, "\n".join(lines[start:i]), section))
        i += 1
    return out


def logical_lines(text: str) -> list[str]:
    """A shell block's lines, continuations joined, here-documents' bodies left out."""
    out, pending, heredoc = [], "", None
    for ln in text.splitlines():
        if heredoc is not None:
            if ln.strip() == heredoc:
                heredoc = None
            continue
        if ln.rstrip().endswith("\\"):
            pending += ln.rstrip()[:-1] + " "
            continue
        full = pending + ln
        pending = ""
        m = re.search(r"<<-?\s*'?(\w+)'?", full)
        if m:
            heredoc = m.group(1)
        out.append(full)
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at && || ; |), comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok in OPERATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [c for c in out if c]


def toymlx_commands(block: Block) -> list[list[str]]:
    """Every toymlx-* command of a shell block (one inside `toymlx-launch ... --` included)."""
    found = []
    for ln in logical_lines(block.text):
        for argv in commands(ln):
            if argv[0].startswith("toymlx-"):
                found.append(argv)
    return found


# ---- parsing with the commands' own parsers ---------------------------------------------------

def _quiet(fn, *args, **kw):
    """Call a parser; its usage error (SystemExit 2) becomes an AssertionError with its text."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return fn(*args, **kw)
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(err.getvalue()[-2000:] or f"exit {e.code}") from None
        return None


def _file_recipe(config: str | None, files: dict[str, str]) -> str | None:
    import yaml

    if config and config in files:
        return yaml.safe_load(files[config]).get("recipe")
    return None


def parse_train(args: list[str], files: dict[str, str]) -> None:
    import tyro
    from toymlx_cli.config_file import split_config
    from toymlx_cli.train import _split_recipe

    from toymlx.recipes import RECIPES, get_recipe

    if "--version" in args:
        return
    config, args = split_config(args)
    recipe, _resume, rest = _split_recipe(args)
    recipe = recipe or _file_recipe(config, files)
    if recipe is not None and recipe not in RECIPES:
        raise AssertionError(f"--recipe {recipe}: not one of {', '.join(RECIPES)}")
    # a resume or a run's config.json names its recipe in the run: any recipe's parser may do
    names = [recipe] if recipe else list(RECIPES)
    errors = []
    for name in names:
        try:
            _quiet(tyro.cli, get_recipe(name).Config, args=rest,
                   prog=f"toymlx-train --recipe {name}")
            return
        except AssertionError as e:
            errors.append(str(e))
    raise AssertionError("\n".join(errors))


def parse_sweep(args: list[str], files: dict[str, str]) -> None:
    from toymlx_cli.config_file import split_config
    from toymlx_cli.sweep import _parser

    after = []
    if "--" in args:
        k = args.index("--")
        args, after = args[:k], args[k + 1:]
    config, args = split_config(args)
    if "--recipe" not in args and _file_recipe(config, files):
        args = ["--recipe", _file_recipe(config, files), *args]
    ns, rest = _quiet(_parser().parse_known_args, args)
    # an mlx-lm config file names no recipe (lora's): as toymlx-train -c with none
    parse_train([*(["--recipe", ns.recipe] if ns.recipe else []), *rest, *after], {})


def parse_forward(module: str, args: list[str]) -> None:
    import importlib

    import tyro
    from toymlx_cli.config_file import split_config

    if "--version" in args:
        return
    _config, args = split_config(args)
    cli = importlib.import_module(f"toymlx_cli.{module}")
    _quiet(tyro.cli, cli.Args, args=args, prog=f"toymlx-{module}")


def parse_command(argv: list[str], files: dict[str, str]) -> None:
    """Parse one toymlx command line with that command's own parser (nothing runs)."""
    from toymlx_cli.launch import _parser as launch_parser
    from toymlx_cli.report import _parser as report_parser

    prog, args = argv[0], argv[1:]
    if prog == "toymlx-train":
        parse_train(args, files)
    elif prog == "toymlx-sweep":
        parse_sweep(args, files)
    elif prog in ("toymlx-eval", "toymlx-generate", "toymlx-export", "toymlx-classify"):
        parse_forward(prog.removeprefix("toymlx-"), args)
    elif prog == "toymlx-report":
        _quiet(report_parser().parse_args, args)
    elif prog == "toymlx-launch":
        k = args.index("--")
        _quiet(launch_parser().parse_args, args[:k])
        parse_command(args[k + 1:], files)
    else:
        raise AssertionError(f"{prog}: not a toymlx command (pyproject.toml's scripts)")


def doc_files(doc: str) -> dict[str, str]:
    """The files a document's ```yaml blocks write (`# NAME.yaml` on their first line)."""
    out = {}
    for b in blocks(doc):
        m = FILE_BLOCK.match(b.text.splitlines()[0]) if b.text else None
        if b.lang in ("yaml", "json") and m:
            out[m.group(1)] = b.text
    return out


# ---- the documents' shape ---------------------------------------------------------------------

def test_every_block_is_runnable_or_says_what_it_needs():
    """Each code block has a kind the test knows; a plain block only in README's Set-up, and
    exactly the two commands .ci/run runs from a clean clone."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for doc in DOCS:
        for b in blocks(doc):
            assert b.lang in ("sh", "text", "yaml", "json", "python", ""), \
                f"{b.where()}: a ```{b.lang} block; the docs test knows sh, text, yaml, json, python"
            if b.lang == "":
                assert doc == README and b.section.startswith("Set-up"), \
                    f"{b.where()}: a plain ``` block; commands go in ```sh, output in ```text"
                assert b.text in ("python3 -m pytest",
                                  "source scripts/install.sh && toymlx-train --recipe vit-tiny")
                assert any(x == b.text or x == f"{b.text} || exit 1" for x in ci), b.text
            if b.lang == "sh":
                assert b.text.strip(), f"{b.where()}: an empty block"
                if b.needs is None:
                    assert not re.search(r"<[a-z][\w-]*>", b.text), \
                        f"{b.where()}: a placeholder (<...>) in a block that runs; give a real " \
                        f"name or mark the block `# needs: ...`"


def test_every_toymlx_command_parses_with_its_own_parser():
    """Every toymlx command in every block, runnable or not, parses: a flag renamed in the
    code and not in the docs fails here, naming the block."""
    n = 0
    for doc in DOCS:
        files = doc_files(doc)
        for b in blocks(doc):
            if b.lang not in ("sh", ""):
                continue
            for argv in toymlx_commands(b):
                try:
                    parse_command(argv, files)
                except AssertionError as e:
                    raise AssertionError(f"{b.where()}: {shlex.join(argv)}:\n{e}") from None
                n += 1
    assert n >= 40, n  # the guides hold more commands than this; a broken reader finds none


def test_a_renamed_flag_fails_the_parse():
    """The check above can fail: a flag that does not exist is refused by each parser."""
    for argv in (["toymlx-train", "--recipe", "lora", "--lora.rnk", "8"],
                 ["toymlx-train", "--resume", "runs/x", "--stepz", "3"],
                 ["toymlx-export", "--adapter", "runs/x", "--fused", "--out", "m.gguf"],
                 ["toymlx-sweep", "--recipe", "from-scratch", "--grid", "lr=1e-3", "--wokers", "2"],
                 ["toymlx-launch", "-n", "2", "--hots", "a", "--", "toymlx-train"],
                 ["toymlx-launch", "-n", "2", "--", "toymlx-train", "--recipe", "vit-tiny",
                  "--step", "3"]):
        with pytest.raises(AssertionError, match="--"):
            parse_command(argv, {})


def known_flags() -> set[str]:
    """Every flag of every toymlx command, from the commands' own parsers."""
    import importlib
    import warnings

    import tyro
    from toymlx_cli.launch import _parser as launch_parser
    from toymlx_cli.report import _parser as report_parser
    from toymlx_cli.sweep import _parser as sweep_parser

    from toymlx.recipes import RECIPES, get_recipe

    parsers = [launch_parser(), report_parser(), sweep_parser()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: tyro's own table
        for cls in [get_recipe(r).Config for r in RECIPES] + [
                importlib.import_module(f"toymlx_cli.{m}").Args
                for m in ("eval", "generate", "export", "classify")]:
            parsers.append(tyro.extras.get_parser(cls))
    return {o for p in parsers for a in p._actions for o in a.option_strings} | {
        "--recipe", "--version", "-c", "--config"}


OTHER_TOOLS = ("python", "pip", "llama-", "ollama", "benchmarks/", "mlx_lm", "unzip", "torchrun",
               "accelerate", "hf ")
"""Inline code that is another program's command line: its flags are not toymlx's."""


COMMON_OPTIONS = re.compile(r"Every recipe takes `([^`]+)`, and the text recipes \(([^)]+)\) "
                            r"`([^`]+)`")


def test_a_sweep_cut_short_by_head_pipes_its_progress():
    """`toymlx-sweep` prints its progress on stderr and only the final table on stdout, so a
    plain `toymlx-sweep ... | head -3` waits for the whole sweep (head never has its 3 lines);
    an example of a reader that stops reading pipes stderr too (`2>&1 | head -3`). SWEEPS.md
    once gave the plain one."""
    n = 0
    for doc in DOCS:
        for span in re.findall(r"`(toymlx-sweep [^`]*\|\s*head[^`]*)`", prose_rows(doc)):
            assert "2>&1" in span, f"{doc}: `{span}`: the sweep's progress is on stderr; " \
                                   f"write `toymlx-sweep ... 2>&1 | head -3`"
            n += 1
    assert n >= 1
"""RUNS.md's "Common options": the flags every recipe takes, then the text recipes' own."""


def test_a_random_sweep_shown_draws_every_value_of_its_lists():
    """A `toymlx-sweep --random` a guide shows draws each value of each list it gives (SWEEPS.md's
    `--random 4 --seed 0 ... --grid model.n_layers=2,4` drew 4 layers all four times, so the
    example's second axis never varied): its draws computed here as the sweep makes them."""
    from toymlx.sweeps.spec import parse_axis, random

    shown = 0
    for doc in DOCS:
        for b in blocks(doc):
            for argv in toymlx_commands(b) if b.lang == "sh" else []:
                if argv[0] != "toymlx-sweep" or "--random" not in argv:
                    continue
                value = dict(itertools.pairwise(argv))
                recipe = value["--recipe"]
                space = dict(parse_axis(v, recipe) for k, v in itertools.pairwise(argv)
                             if k == "--grid")
                runs = random([], space, int(value["--random"]), int(value.get("--seed", 0)),
                              recipe)
                for key, values in space.items():
                    if isinstance(values, list):
                        drawn = {r.params[key] for r in runs}
                        assert drawn == set(values), (
                            f"{b.where()}: --random draws {key} = {sorted(drawn)} only, of "
                            f"{values}: pick a --seed whose draws vary it")
                shown += 1
    assert shown, "no guide shows a toymlx-sweep --random"

def test_the_common_options_are_every_recipes():
    """Each flag RUNS.md says every recipe takes is one of each recipe's flags, and those it
    names for the text recipes are theirs (vit-tiny has no --seq-len: the guide once listed
    it among every recipe's)."""
    import warnings

    import tyro

    from toymlx.recipes import RECIPES, get_recipe

    quotes = COMMON_OPTIONS.findall(prose_rows("docs/RUNS.md"))
    assert len(quotes) == 1, quotes
    every, text_recipes, text_flags = quotes[0]
    wanted = {r: re.findall(r"--[a-z][\w.-]*", every) for r in RECIPES}
    for r in text_recipes.split(", "):
        wanted[r] += re.findall(r"--[a-z][\w.-]*", text_flags)
    assert len(wanted["vit-tiny"]) >= 20, wanted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for recipe, flags in wanted.items():
            parser = tyro.extras.get_parser(get_recipe(recipe).Config)
            has = {o for a in parser._actions for o in a.option_strings}
            missing = [f for f in flags if f not in has]
            assert not missing, f"docs/RUNS.md: {recipe} has no {missing}"


def test_every_flag_named_in_the_prose_exists():
    """A flag named in the prose (`--lora.rank`) is one a toymlx command has: a renamed flag
    fails here too, not only in the command blocks. mlx-lm's flags in MLX_LM.md's tables of
    equivalents (its first column) and other programs' command lines are not toymlx's."""
    flags = known_flags()
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.DOTALL)
        for row in prose.splitlines():
            if row.startswith(("| `mlx_lm", "| `--", "| `lora_parameters")):  # mlx-lm's column
                row = row.split("|", 2)[2]
            for span in re.findall(r"`([^`]+)`", row):
                if span.startswith(OTHER_TOOLS):
                    continue
                for flag in re.findall(r"(?<![\w-])--[a-z][\w.-]*", span):
                    # `--lora.*`, `--no-...`: a group of flags, named by its prefix
                    group = flag.endswith(".") and flag.rstrip(".")
                    ok = any(f.startswith(group) for f in flags) if group else flag in flags
                    assert ok, f"{doc}: `{span}` names {flag}, which no toymlx command has"


def prose_rows(doc: str) -> str:
    """A document's prose (code blocks left out), mlx-lm's column of MLX_LM.md's tables of
    equivalents dropped (its flags are mlx-lm's), lines joined so a quote may wrap."""
    rows = []
    for row in re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.DOTALL).splitlines():
        if row.startswith(("| `mlx_lm", "| `--", "| `lora_parameters")):
            row = row.split("|", 2)[2]
        rows.append(row)
    return re.sub(r"\s*\n\s*", " ", "\n".join(rows))


_VALUE = r"(`[\w.+]+`|\d[\d.e+-]*%?)"
QUOTED_DEFAULT = re.compile(
    r"`(--[a-z][\w.-]*)(?: [A-Z_]+)?`(?: [a-z]+){0,2}(?: is on by default)? \((?:default:? )?"
    + _VALUE + r"[);,]" + r"|`(--[a-z][\w.-]*)`, " + _VALUE + r"[),]")
"""A default the prose quotes: `--lr` (2e-4), `--report-every` (default 10), `--grace` seconds
(10), `--top-p` is on by default (0.9), (`--data.val-fraction`, 0.1) or `--x`, 10%, ..."""


def quoted_defaults(text: str) -> list[tuple[str, str]]:
    """(flag, value) for each default quoted in `text`."""
    return [(m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            for m in QUOTED_DEFAULT.finditer(text)]


def help_defaults() -> dict[str, set[str]]:
    """Each flag's defaults as the commands' --help prints them (`(default: X)`), over every
    command and recipe that has the flag."""
    import importlib
    import warnings

    import tyro
    from toymlx_cli.launch import _parser as launch_parser
    from toymlx_cli.report import _parser as report_parser
    from toymlx_cli.sweep import _parser as sweep_parser

    from toymlx.recipes import RECIPES, get_recipe

    parsers = [launch_parser(), report_parser(), sweep_parser()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for cls in [get_recipe(r).Config for r in RECIPES] + [
                importlib.import_module(f"toymlx_cli.{m}").Args
                for m in ("eval", "generate", "export", "classify")]:
            parsers.append(tyro.extras.get_parser(cls))
    out: dict[str, set[str]] = {}
    for p in parsers:
        for a in p._actions:
            m = re.search(r"\(default: (.*)\)\s*$", a.help or "", re.DOTALL)
            value = m.group(1) if m else str(a.default)
            for o in a.option_strings:
                out.setdefault(o, set()).add(value)
    return out


def same_default(quoted: str, printed: str) -> bool:
    """A quoted default and the one --help prints are the same value (2e-4 and 0.0002, 10% and
    0.1, `q` and q)."""
    quoted = quoted.strip("`")
    if quoted.endswith("%"):
        quoted = str(float(quoted[:-1]) / 100)
    try:
        return math.isclose(float(quoted), float(printed), rel_tol=1e-12)
    except ValueError:
        return quoted == printed


def test_every_default_the_docs_quote_is_the_one_help_prints():
    """A default the prose gives (`--lora.rank` (8)) is the default `--help` prints for that
    flag: a default changed in the code and not in the docs fails here, naming the doc."""
    printed = help_defaults()
    n = 0
    for doc in DOCS:
        for flag, value in quoted_defaults(prose_rows(doc)):
            assert flag in printed, f"{doc}: quotes a default of {flag}, which no command has"
            assert any(same_default(value, p) for p in printed[flag]), \
                f"{doc}: `{flag}` ({value}): --help prints the default {sorted(printed[flag])}"
            n += 1
    assert n >= 15, n  # the guides quote more defaults than this; a broken reader finds none


def test_a_changed_default_fails_the_check():
    """The check above can fail: a wrong default quoted is not the one --help prints."""
    printed = help_defaults()
    quotes = quoted_defaults("`--lora.rank` (16), `--report-every` (default 10) and "
                             "(`--data.val-fraction`, 20%)")
    assert quotes == [("--lora.rank", "16"), ("--report-every", "10"),
                      ("--data.val-fraction", "20%")]
    assert [any(same_default(v, p) for p in printed[f]) for f, v in quotes] == [
        False, True, False]


SCHEDULE_QUOTE = re.compile(r"\((\d+) -> (\d+) steps of ([\w-]+)(?: with `([^`]+)`)?: "
                            r"(\S+) against (\S+)\)")
"""RUNS.md's example of an extended --steps: `(20 -> 40 steps of vit-tiny with `--warmup 0`:
1.596e-04 against 3.000e-05)`, the rates the resume's line names."""


def test_the_extended_schedule_rates_quoted_are_the_schedules():
    """The two rates RUNS.md quotes for a run extended by `--resume --steps` are the schedule's
    for that recipe's defaults and the flags quoted (the next step's, the last step's): with
    vit-tiny's own --warmup (60) a 20-step run is still warming up, and the line reads
    1.050e-04 against 1.000e-04."""
    import tyro

    from toymlx.recipes import get_recipe
    from toymlx.training.schedule import lr_at

    quotes = SCHEDULE_QUOTE.findall(prose_rows("docs/RUNS.md"))
    assert len(quotes) == 1, quotes
    old, new, recipe, flags, next_lr, last_lr = quotes[0]
    cfg = _quiet(tyro.cli, get_recipe(recipe).Config, args=shlex.split(flags or ""))
    old, new = int(old), int(new)
    # step N+1 is optimizer step N (0-based) of the new total; step N was N-1 of the old one
    got = (f"{lr_at(old, cfg.lr, cfg.warmup, new, cfg.min_lr_ratio):.3e}",
           f"{lr_at(old - 1, cfg.lr, cfg.warmup, old, cfg.min_lr_ratio):.3e}")
    assert got == (next_lr, last_lr), f"docs/RUNS.md: {quotes[0]}: the schedule gives {got}"


def documented_event_keys() -> dict[str, set[str]]:
    """RUNS.md's table of events.jsonl's keys: each kind's keys (`split: "test"` is `split`)."""
    text = (REPO / "docs" / "RUNS.md").read_text()
    table = text[text.index("### events.jsonl"):].split("\n### ", 1)[0]
    return {m.group(1): set(re.findall(r"`(\w+)", m.group(2)))
            for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", table, flags=re.MULTILINE)}


def undocumented_event_keys(events: list[dict], documented: dict[str, set[str]]) -> set[str]:
    """`kind.key` for each key of `events` that RUNS.md's table leaves out (`kind`, `t`: every
    event's)."""
    return {f"{e['kind']}.{k}" for e in events for k in e
            if k not in ("kind", "t") and k not in documented.get(e["kind"], set())}


def test_the_documented_event_keys_fail_on_a_key_left_out():
    """The check of RUNS.md's event table against a run's events.jsonl can fail: a key the table
    lacks, or a kind it lacks, is named."""
    documented = documented_event_keys()
    assert {"run_start", "step", "eval", "checkpoint", "resume", "export", "run_end"} <= \
        set(documented), documented
    assert {"trained_images", "trained_tokens", "peak_rss_mb"} <= documented["step"]
    events = [{"kind": "step", "t": 0.1, "step": 1, "loss": 2.0, "new_key": 1},
              {"kind": "new_kind", "t": 0.2, "x": 1}]
    assert undocumented_event_keys(events, documented) == {"step.new_key", "new_kind.x"}


def test_every_run_end_reason_is_documented():
    """Each `reason` the trainer can write into run_end (`_end("diverged", ...)`, `stopped`,
    `completed`) is named in RUNS.md's list of reasons and exit statuses: a new way for a run
    to end fails here until the reference says what it means."""
    code = (REPO / "toymlx" / "training" / "trainer.py").read_text()
    reasons = set(re.findall(r'_end\(\s*"(\w+)"', code)) | set(
        re.findall(r'self\.reason(?:, [\w.]+)* = "(\w+)"', code))
    assert {"completed", "stopped", "interrupted", "diverged"} <= reasons, reasons
    prose = prose_rows("docs/RUNS.md")
    listed = re.search(r"`run_end`'s `reason` and exit status: (.*?)\. A crashed run has none",
                       prose)
    assert listed, "docs/RUNS.md: the list of run_end reasons moved"
    missing = reasons - set(re.findall(r"`(\w+)` \(", listed.group(1)))
    assert not missing, f"docs/RUNS.md: run_end reasons the list leaves out: {sorted(missing)}"


def test_every_environment_variable_the_docs_name_is_read():
    """Each TOYMLX_* variable a document names is read somewhere outside the docs (the package,
    the commands, the installer, the tests, CI): a variable renamed in the code fails here."""
    code = "\n".join(p.read_text(errors="replace")
                     for folder in ("toymlx", "cli", "scripts", "tests", ".ci")
                     for p in (REPO / folder).rglob("*")
                     if p.is_file() and p.suffix in ("", ".py", ".sh", ".ps1")
                     and p.name != "test_docs.py")
    named = {v: doc for doc in DOCS for v in re.findall(r"\bTOYMLX_[A-Z_]+\b",
                                                         (REPO / doc).read_text())}
    assert len(named) >= 8, named
    for var, doc in sorted(named.items()):
        assert var in code, f"{doc}: names {var}, which no code reads"


INTERNAL_VARIABLES = {
    "TOYMLX_PARENT_PID": "set by a toymlx parent for its children (toymlx/backend/lifeline.py)",
    "TOYMLX_RANK_STATUS": "set by toymlx-launch for its ranks (toymlx/runner/launch.py)",
    "TOYMLX_LAUNCH_RANKS": "set by toymlx-launch for its ranks (toymlx/runner/launch.py)",
    "TOYMLX_LAUNCH_TEMP": "set by toymlx-launch for mlx.launch's script (runner/launch.py)",
    "TOYMLX_LAUNCH_OWN_STATUS": "set by toymlx-launch for its mlx.launch (runner/launch.py)",
    "TOYMLX_RESTARTED": "set by a command's huge-page restart (toymlx/backend/device.py)",
    "TOYMLX_TRAIN_KEYWORDS": "set by toymlx.train(config=FILE) for its command (runner/api.py)",
}
"""TOYMLX_* variables the code reads that toymlx sets itself, for a process of its own: no
user sets them, so no guide names them."""


def test_every_environment_variable_the_code_reads_is_named():
    """The other way round: each TOYMLX_* variable the package, the commands or the installer
    read is named in README or a guide, where users look (TOYMLX_MEMORY_AVAILABLE, which sets
    the memory `--base-dtype auto`, the memory check and toymlx-generate plan for, was named
    only in RESULTS.md), unless toymlx sets it itself for its own children."""
    code = "\n".join(p.read_text(errors="replace")
                     for folder in ("toymlx", "cli", "scripts")
                     for p in (REPO / folder).rglob("*")
                     if p.is_file() and p.suffix in ("", ".py", ".sh", ".ps1"))
    read = set(re.findall(r"\bTOYMLX_[A-Z_]+\b", code))
    named = {v for doc in DOCS for v in re.findall(r"\bTOYMLX_[A-Z_]+\b", (REPO / doc).read_text())}
    assert set(INTERNAL_VARIABLES) <= read, sorted(set(INTERNAL_VARIABLES) - read)
    missing = sorted(read - named - set(INTERNAL_VARIABLES))
    assert not missing, f"no guide names {missing}, which the code reads: name each in the guide " \
        "users read for it (docs/INSTALL.md: installing; docs/PERFORMANCE.md: speed and memory)"


def pyproject_section(name: str) -> str:
    """The text of one `[name]` table of pyproject.toml (Python 3.10 has no tomllib)."""
    m = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", (REPO / "pyproject.toml").read_text(),
                  re.MULTILINE | re.DOTALL)
    assert m, f"pyproject.toml: no [{name}]"
    return m.group(1)


def test_install_guide_names_every_extra_and_test_tier():
    """docs/INSTALL.md names each extra pyproject.toml defines (`tensorboard` and `wandb`, which
    CI installs, and `test`, which the installer always adds, were missing) and each pytest
    marker, a test tier (`gpu` was missing); and the slow tiers it quotes are .ci/run's."""
    guide = (REPO / "docs/INSTALL.md").read_text()
    extras = re.findall(r"^([\w-]+) = \[", pyproject_section("project.optional-dependencies"),
                        re.MULTILINE)
    markers = re.findall(r'^\s*"([\w-]+): ', pyproject_section("tool.pytest.ini_options"),
                         re.MULTILINE)
    assert {"cpu", "cuda", "mkl", "test", "bench"} <= set(extras) and "slow" in markers
    for name in extras + markers:
        assert f"`{name}`" in guide, f"docs/INSTALL.md: no `{name}` (pyproject.toml defines it)"
    ci = re.search(r'-m "([^"]+)"', (REPO / ".ci/run").read_text()).group(1)
    assert f'-m "{ci}"' in guide, f"docs/INSTALL.md: .ci/run's slow tiers are -m \"{ci}\""


def anchors(path: Path) -> set[str]:
    """The anchors a markdown file has: its headings as GitHub spells them, and `<a id>`s."""
    text = path.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    heads = re.findall(r"^#+ (.*)$", prose, flags=re.MULTILINE)
    return set(re.findall(r'<a id="([\w-]+)"', text)) | {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


REPO_PATH = re.compile(r"(?<![\w/.-])((?:scripts|tests|toymlx|cli|benchmarks|docs|\.ci)/[\w./-]*\w)")


def test_every_link_and_repository_path_in_the_docs_exists():
    """Each relative link (`[LORA.md](docs/LORA.md)`, `#the-ggufs-it-takes`, `RUNS.md#locks`)
    names a file of the checkout and a heading or anchor it has, and each path into the
    checkout named in the prose (`tests/test_docs.py`, `toymlx/fixtures/digits/`) exists."""
    n = 0
    for doc in DOCS:
        path = REPO / doc
        text = path.read_text()
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            file = (path.parent / target) if target else path
            assert file.exists(), f"{doc}: a link to {link}, which is not in the checkout"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), f"{doc}: a link to {link}: no such heading"
            n += 1
        prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        for span in re.findall(r"`([^`]+)`", prose):
            for p in REPO_PATH.findall(span):
                if not any(c in p for c in "<*{"):
                    assert (REPO / p).exists(), f"{doc}: names {p}, which is not in the checkout"
                    n += 1
    assert n >= 40, n


def test_readme_is_short_and_every_figure_links_to_the_results_table():
    """README.md stays a five-minute read; each measured figure in its prose links to a row of
    docs/RESULTS.md's first table, and every such link names an anchor that table has."""
    readme = (REPO / README).read_text()
    assert len(readme.splitlines()) <= 150
    results = (REPO / "docs" / "RESULTS.md").read_text()
    first_table = results[:results.index("\n## ", results.index("| "))]
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', first_table))
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for anchor in re.findall(r"RESULTS\.md#([\w-]+)", text):
            assert anchor in anchors, f"{doc}: RESULTS.md#{anchor} is not a row of its first table"
    prose = re.sub(r"```.*?```", "", readme, flags=re.DOTALL)
    figure = re.compile(r"\d(?:\.\d+)?\s?(?:%|x\b|GB|MB|s\b|seconds|tokens/s|tok/s)")
    for para in re.split(r"\n\s*\n", prose):
        for row in para.splitlines() if para.lstrip().startswith("|") else [para]:
            if figure.search(re.sub(r"`[^`]*`", "", row)):
                assert "RESULTS.md#" in row, f"README.md: a figure without its RESULTS link:\n{row}"


def test_text_guides_vocabularies_and_parameter_counts_are_the_models():
    """docs/TEXT.md's "Bytes (259 ids ...)" and "SmolLM2's 49,152 tokens make the tiny preset
    15.5M parameters instead of 3.0M" are what the code builds: a changed preset or byte
    vocabulary fails here, naming the sentence."""
    from mlx.utils import tree_flatten

    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.models.llama import Llama, smollm2_135m, tiny

    text = " ".join((REPO / "docs" / "TEXT.md").read_text().split())
    ids = re.search(r"Bytes \(([\d,]+) ids", text)
    counts = re.search(r"SmolLM2's ([\d,]+) tokens make the tiny preset ([\d.]+)M parameters "
                       r"instead of ([\d.]+)M", text)
    assert ids and counts, "docs/TEXT.md: the byte vocabulary or the parameter counts moved"
    assert int(ids.group(1).replace(",", "")) == byte_tokenizer().vocab_size == tiny().vocab_size
    smol = int(counts.group(1).replace(",", ""))
    assert smol == smollm2_135m().vocab_size
    for vocab, quoted in ((smol, counts.group(2)), (tiny().vocab_size, counts.group(3))):
        n = sum(v.size for _, v in tree_flatten(Llama(tiny(vocab_size=vocab)).parameters()))
        assert f"{n / 1e6:.1f}" == quoted, f"docs/TEXT.md: {quoted}M parameters, built {n:,}"


# ---- running the blocks -----------------------------------------------------------------------

def _shrunk(n: int) -> int:
    return 0 if n <= 0 else max(1, math.ceil(n / SHRINK))


def _shrink_steps_in(arg: str) -> str:
    return re.sub(r"step_(\d+)", lambda m: f"step_{_shrunk(int(m.group(1)))}", arg)


def shorten(argv: list[str]) -> list[str]:
    """A toymlx command as it runs here: its step counts divided, its generation cut."""
    prog, args = argv[0], [_shrink_steps_in(a) for a in argv[1:]]
    if prog == "toymlx-launch":
        k = args.index("--")
        return [prog, *args[:k + 1], *shorten(args[k + 1:])]
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in STEP_FLAGS and i + 1 < len(args):
            out += [a, str(_shrunk(int(args[i + 1])))]
            i += 2
            continue
        if a == "--max-tokens" and i + 1 < len(args):
            out += [a, str(min(int(args[i + 1]), MAX_TOKENS))]
            i += 2
            continue
        out.append(a)
        i += 1
    new_run = "--resume" not in out and "-c" not in out and "--config" not in out
    if prog == "toymlx-train" and new_run and "--steps" not in out and \
            not {"--help", "--version"} & set(out):
        from toymlx_cli.train import _split_recipe

        from toymlx.recipes import get_recipe

        recipe = _split_recipe(out)[0]
        out += ["--steps", str(_shrunk(get_recipe(recipe).Config().steps))]
    if prog == "toymlx-train" and "--report-every" not in out and "--version" not in out:
        out += ["--report-every", "1"]  # a report line every step, as a long run prints them
    if prog == "toymlx-sweep":  # a sweep is many runs: one step each
        k = out.index("--steps") if "--steps" in out else len(out)
        out = [*out[:k], *out[k + 2:], "--steps", "1"]
    if prog == "toymlx-generate" and "--max-tokens" not in out:
        out += ["--max-tokens", str(MAX_TOKENS)]
    return [prog, *out]


def runnable_script(block: Block) -> str:
    """A shell block with each toymlx command shortened (the rest as written)."""
    out, heredoc = [], None
    for ln in logical_lines_keep_heredocs(block.text):
        if heredoc is not None:
            out.append(ln)
            if ln.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*'?(\w+)'?", ln)
        if m:
            heredoc = m.group(1)
        if "toymlx-" not in ln:
            out.append(ln)
            continue
        parts, cur = [], []
        lex = shlex.shlex(ln, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        for tok in lex:
            if tok in OPERATORS:
                parts += [cur, tok]
                cur = []
            else:
                cur.append(tok)
        parts.append(cur)
        out.append(" ".join(p if isinstance(p, str) else shlex.join(
            shorten(p) if p and p[0].startswith("toymlx-") else p) for p in parts if p))
    return "\n".join(out)


def logical_lines_keep_heredocs(text: str) -> list[str]:
    """A shell block's lines with continuations joined (here-documents kept)."""
    out, pending = [], ""
    for ln in text.splitlines():
        if ln.rstrip().endswith("\\"):
            pending += ln.rstrip()[:-1] + " "
            continue
        out.append(pending + ln)
        pending = ""
    return out


def shorten_python(text: str) -> str:
    text = re.sub(r"\bsteps=(\d+)", lambda m: f"steps={_shrunk(int(m.group(1)))}", text)
    return re.sub(r"\bmax_tokens=(\d+)", lambda m: f"max_tokens={min(int(m.group(1)), MAX_TOKENS)}",
                  text)


def stand_in_models(doc: str, folder: Path, stories: Path) -> None:
    """Every GGUF a block reads by a bare file name and no block writes: stories260K.gguf."""
    written, read = set(), set()
    for b in blocks(doc):
        if b.lang != "sh" or b.needs:
            continue
        for argv in toymlx_commands(b):
            for flag, value in itertools.pairwise(argv):
                if flag == "--out":
                    written.add(value)
                elif flag in MODEL_FLAGS and value.endswith(".gguf") and "/" not in value:
                    read.add(value)
    for name in read - written:
        (folder / name).symlink_to(stories)


def run_doc(doc: str, folder: Path, stories: Path, python: bool) -> list[str]:
    """Run a document's runnable blocks in order in `folder`; the blocks run, by line."""
    stand_in_models(doc, folder, stories)
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    ran, last = [], None
    for b in blocks(doc):
        m = FILE_BLOCK.match(b.text.splitlines()[0]) if b.text else None
        if b.lang in ("yaml", "json") and m:
            (folder / m.group(1)).write_text(b.text + "\n")
            continue
        if b.lang == "text" and last is not None and last[0].section == b.section:
            check_output_shown(b, last[1])
        last = None
        if b.lang == "python" and python:
            cmd = [sys.executable, "-c", shorten_python(b.text)]
        elif b.lang == "sh" and b.needs is None:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", runnable_script(b)]
        else:
            continue
        r = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
        assert r.returncode == 0, (f"{b.where()} failed (exit {r.returncode}):\n{cmd[-1]}\n"
                                   f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
        ran.append(b.where())
        last = (b, r.stdout + r.stderr)
    return ran


def shape(line: str) -> str:
    """A printed line with its numbers, absolute paths and BLAS left out (a shortened run prints
    other numbers, in another folder; `--version`'s BLAS is the host's: OpenBLAS, or MKL on an
    Intel CPU)."""
    line = re.sub(r"; BLAS .*\)$", "; BLAS HOST)", line.strip())
    line = re.sub(r"(?<![\w-])/[^\s,)]+", "PATH", line)
    return re.sub(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?", "N", line)


PRINTED_BY = re.compile(r"^# printed by \S+\.gguf\b")
"""A ```text block's first line `# printed by NAME.gguf ...`: its lines are that model's, whose
figures bring clauses the stand-in's do not (the types a fused export wrote, a note on its size),
so each line is matched by its first three words (the command and what it did)."""


def line_key(line: str, printed_by: bool) -> str:
    """What a shown line and a printed one must share: the shape, or its first three words."""
    return " ".join(shape(line).split()[:3]) if printed_by else shape(line)


def check_output_shown(block: Block, printed: str) -> None:
    """A ```text block right after a block that ran, in the same section, shows its output: each
    line toymlx prints (`step ...`, `toymlx...`) has the shape of a line it printed here (its
    first words, for a block `# printed by` another model)."""
    loose = bool(PRINTED_BY.match(block.text))
    got = {line_key(ln, loose) for ln in printed.splitlines()}
    for ln in block.text.splitlines():
        if ln.startswith(("step ", "toymlx")):
            assert line_key(ln, loose) in got, (
                f"{block.where()}: the docs show a line this block's commands no longer "
                f"print:\n{ln}\nthey printed:\n{printed[-3000:]}")
    for ln in missing_command_lines(block.text, printed, loose):
        raise AssertionError(f"{block.where()}: the docs show this command's lines but not "
                             f"this one, which it prints:\n{ln}")
    printed_keys = [k for ln in printed.splitlines() if (k := json_keys(ln)) is not None]
    for ln in block.text.splitlines():
        keys = json_keys(ln)
        assert keys is None or keys in printed_keys, (
            f"{block.where()}: the docs show a JSON line whose keys no printed line has:\n{ln}\n"
            f"printed: {[sorted(k) for k in printed_keys]}")


def json_keys(line: str) -> frozenset[str] | None:
    """The keys of a line that is one JSON object (`toymlx-eval`'s report), else None: a reader
    looks a key up by the name the guide shows, so a key added or renamed since must show."""
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return frozenset(obj) if isinstance(obj, dict) else None


def missing_command_lines(shown: str, printed: str, loose: bool = False) -> list[str]:
    """The lines a forward command prints (`toymlx-generate: ...`, `toymlx-export: ...`) that an
    output block leaves out while it shows others of the same command: a reader compares the
    block with the terminal line by line, so a line it lacks reads as something gone wrong."""
    shown_lines = {line_key(ln, loose) for ln in shown.splitlines()}
    shown_progs = {m.group(1) for ln in shown.splitlines()
                   if (m := re.match(r"(toymlx-[a-z]+): ", ln))}
    return [ln for ln in printed.splitlines()
            if (m := re.match(r"(toymlx-[a-z]+): ", ln)) and m.group(1) in shown_progs
            and line_key(ln, loose) not in shown_lines]


def test_an_output_block_that_leaves_out_a_command_line_fails():
    """README's generate-and-export block showed toymlx-generate's last line but not its first
    (the model and adapter it loaded), which a reader sees first: the check names that line, and
    takes the block once it shows it; a command the block shows nothing of is not asked for."""
    printed = (
        "toymlx-generate: model /tmp/x/SmolLM2-135M-Instruct.Q4_1.gguf (the run's --base "
        "SmolLM2-135M-Instruct.Q4_1.gguf) + adapter runs/chat/weights/adapter_step_3.gguf\n"
        "You can reverse a list in Python using slicing with a negative step.\n"
        "toymlx-generate: 39 prompt + 40 new tokens in 10.82 s (3.7 tok/s, mlx)\n"
        "toymlx-export: wrote ollama-out/Modelfile (FROM /tmp/x/m.gguf) in 3.3 s\n")
    shown = ("You can reverse a list in Python using slicing with a negative step.\n...\n"
             "toymlx-generate: 39 prompt + 40 new tokens in 3.99 s (10.0 tok/s, mlx)\n")
    assert missing_command_lines(shown, printed) == [printed.splitlines()[0]]
    first = ("toymlx-generate: model /home/you/SmolLM2-135M-Instruct.Q4_1.gguf (the run's --base "
             "SmolLM2-135M-Instruct.Q4_1.gguf) + adapter runs/chat/weights/adapter_step_30.gguf\n")
    assert missing_command_lines(first + shown, printed) == []


def test_an_output_block_printed_by_another_model_is_matched_by_its_first_words():
    """LORA.md's fused export prints, on SmolLM2's Q4_1, types and a size note the stand-in's
    F32 file does not bring: its block says `# printed by` that model and is matched by each
    line's first three words, which still fail a line the command no longer prints (a renamed
    verb) and a line the block leaves out."""
    printed = ("toymlx-export: no --base given: base /tmp/x/stories260K.gguf\n"
               "toymlx-export: wrote mine.gguf (1.1 MiB) from /tmp/x/stories260K.gguf: 5 changed "
               "tensors written as 5 F32; 1.000x the base's size in 0.4 s\n")
    smollm = ("toymlx-export: wrote mine.gguf (122.7 MiB) from /home/you/S.gguf: 30 changed "
              "tensors written as 5 F16, 25 F32; 1.308x the base's size (within 1.10x it would "
              "keep 36%) in 11.1 s\n")
    base_line = "toymlx-export: no --base given: base /home/you/S.gguf\n"
    block = Block("docs/LORA.md", 1, "text", "# printed by S.gguf\n" + base_line + smollm, "s")
    check_output_shown(block, printed)
    with pytest.raises(AssertionError, match="no longer print"):
        check_output_shown(Block("d", 1, "text", base_line + smollm, "s"), printed)
    renamed = block.text.replace("wrote mine", "saved mine")
    with pytest.raises(AssertionError, match="no longer print"):
        check_output_shown(Block("d", 1, "text", renamed, "s"), printed)
    with pytest.raises(AssertionError, match="leaves out|not this one"):
        check_output_shown(Block("d", 1, "text", "# printed by S.gguf\n" + smollm, "s"), printed)


def test_an_output_block_whose_json_keys_differ_from_the_printed_ones_fails():
    """LORA.md showed `toymlx-eval --split test`'s JSON without the `seq_len` and `tokens_scored`
    keys the command had printed for some sessions: a JSON line shown is checked for its keys
    (not its values, which a shortened run changes), so a key left out or renamed fails."""
    printed = ('toymlx-eval: model /tmp/x/S.gguf + adapter runs/t/weights/adapter_step_2.gguf\n'
               '{"model": "runs/t", "split": "test", "rows": 3, "test_loss": 6.1, "seq_len": 256, '
               '"tokens_scored": 51}\n')
    first = "toymlx-eval: model /home/you/S.gguf + adapter runs/t/weights/adapter_step_20.gguf\n"
    shown = first + '{"model": "runs/t", "split": "test", "rows": 3, "test_loss": 5.5}\n'
    with pytest.raises(AssertionError, match="JSON line whose keys"):
        check_output_shown(Block("d", 1, "text", shown, "s"), printed)
    fixed = shown.replace('5.5}', '5.5, "seq_len": 256, "tokens_scored": 40}')
    check_output_shown(Block("d", 1, "text", fixed, "s"), printed)


def test_readme_blocks_run(tmp_path, stories_path):
    """README's blocks, as a newcomer types them (shortened): the four recipes, a LoRA run on a
    GGUF stopped and resumed, its export for Ollama, generation from it."""
    ran = run_doc(README, tmp_path, stories_path, python=False)
    assert len(ran) >= 4, ran
    runs = tmp_path / "runs"
    assert {p.name for p in runs.iterdir()} == {"chat", "lm", "warm"}
    events = (runs / "chat" / "events.jsonl").read_text()
    assert '"kind": "resume"' in events.replace('"kind":"resume"', '"kind": "resume"')
    modelfile = (tmp_path / "ollama-out" / "Modelfile").read_text()
    # the guides say FROM and ADAPTER name the base and the adapter by absolute paths
    named = dict(ln.split(" ", 1) for ln in modelfile.splitlines() if ln.startswith(("FROM ", "ADAPTER ")))
    assert set(named) == {"FROM", "ADAPTER"} and all(Path(v).is_absolute() for v in named.values()), \
        modelfile
    assert named["ADAPTER"].endswith("runs/chat/weights/adapter_step_3.gguf"), modelfile


def test_lora_guides_test_set_is_held_out(tmp_path):
    """LORA.md's data folder holds out its test.jsonl: no test example is also a training one
    (the guide once made test.jsonl the first 3 lines of train.jsonl, so `--test` scored rows
    the run had trained on). The guide's shell commands run here without its toymlx ones."""
    for b in blocks("docs/LORA.md"):
        if b.lang == "sh" and b.needs is None:
            script = "\n".join(ln for ln in logical_lines_keep_heredocs(b.text)
                               if not ln.startswith("toymlx-"))
            subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, check=True)
    train = (tmp_path / "chat-data" / "train.jsonl").read_text().splitlines()
    test = (tmp_path / "chat-data" / "test.jsonl").read_text().splitlines()
    assert train and test
    assert not set(train) & set(test), f"LORA.md: test.jsonl rows also in train.jsonl: {test}"


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten"]


@pytest.mark.smollm
@pytest.mark.parametrize("doc, train", [("docs/LORA.md", "chat.jsonl"),
                                        ("docs/MLX_LM.md", "data/train.jsonl")])
def test_the_guides_packed_row_counts_are_smollm2_s(doc, train, tmp_path,
                                                    smollm_gguf):  # noqa: F811
    """The first fine-tune of LORA.md and of MLX_LM.md says how many rows its training
    examples make packed (why it passes --data.no-pack): counted here as the run packs them,
    with the real SmolLM2 tokenizer and chat template at the default --seq-len 256 (LORA.md
    said "Ten short examples make one row": its nine training examples make two)."""
    from toymlx.data.chat import fitted_rows, load_examples, split_examples
    from toymlx.generation.generate import load_tokenizer
    for b in blocks(doc):
        if b.lang == "sh" and b.needs is None:
            script = "\n".join(ln for ln in logical_lines_keep_heredocs(b.text)
                               if not ln.startswith("toymlx-"))
            subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, check=True)
    prose = " ".join(re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.DOTALL).split())
    said = re.search(r"(\w+) (?:short |training )*examples make (?:only )?(\w+) rows?\b", prose)
    assert said, f"{doc}: no sentence saying how many rows the examples make packed"
    examples = load_examples(tmp_path / train)
    if train.endswith("chat.jsonl"):  # a file: its last --data.val-fraction validates
        examples, _ = split_examples(examples, 0.1)
    tokenizer, _ = load_tokenizer(smollm_gguf)
    rows, _ = fitted_rows(examples, tokenizer, 256, pack=True)
    found = (len(examples), len(rows["inputs"]))
    assert tuple(NUMBER_WORDS.index(w.lower()) for w in said.groups()) == found, (
        f"{doc}: '{said.group(0)}': expected {NUMBER_WORDS[found[0]]} examples making "
        f"{NUMBER_WORDS[found[1]]} rows, as SmolLM2's tokens pack them")


@pytest.mark.slow
@pytest.mark.parametrize("doc", GUIDES)
def test_guide_blocks_run(doc, tmp_path, stories_path):
    """Each guide's runnable blocks, Python ones included, in a folder of their own."""
    ran = run_doc(doc, tmp_path, stories_path, python=True)
    assert ran, f"{doc}: no block ran"
    if doc == "docs/RUNS.md":  # its reference lists every key its runs' events carry
        from toymlx.bundle.events import read_events

        bundles = sorted((tmp_path / "runs").iterdir())
        assert len(bundles) >= 4, bundles
        events = [e for b in bundles for e in read_events(b)]
        missing = undocumented_event_keys(events, documented_event_keys())
        assert not missing, f"docs/RUNS.md: events.jsonl keys its table leaves out: {missing}"


def test_toymlx_train_alone_lists_the_readme_s_recipes_each_with_what_it_trains(capsys):
    """`toymlx-train` with no recipe listed the recipes' names alone; a newcomer's first command
    now says what each trains, and names the README table's recipes, no more and no fewer."""
    from toymlx_cli.train import main as train_main

    from toymlx.recipes import RECIPES, SUMMARIES

    assert train_main([]) == 2
    listed = capsys.readouterr().err.split("recipes:\n")[1].split("\n\n")[0].splitlines()
    assert listed == [f"  {n:<14}{SUMMARIES[n]}" for n in RECIPES]
    readme = (REPO / README).read_text(encoding="utf-8")
    table = re.findall(r"^\| `([a-z-]+)` \| ", readme.split("## Set-up")[0], re.MULTILINE)
    assert sorted(table) == sorted(RECIPES) == sorted(SUMMARIES)
