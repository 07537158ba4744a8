"""The Python entry point: train a recipe from a script or a notebook at the command's speed.

    import toymlx

    run = toymlx.train("lora", base="SmolLM2-135M-Instruct.Q4_1.gguf",
                       data={"path": "chat.jsonl"}, steps=50, seq_len=256)
    run["status"], run["final_loss"], run["path"]

`train` runs `toymlx-train --recipe NAME` in a fresh child process, with `options` spelled as
its flags (`seq_len=256` is `--seq-len 256`, `data={"path": p}` is `--data.path p`, `True`/
`False` are `--flag`/`--no-flag`), relays its output, and returns the bundle's summary row
(`toymlx.runner.report.summarize_run`). Bad options are the command's own one-line error, raised as
`OptionError` (a `ValueError`); a run that fails raises `TrainError` (a `RuntimeError`), naming its
bundle; both are `toymlx.OptionError` and `toymlx.TrainError` too. Their messages, and Ctrl-C's,
name the keywords `train` takes where the command's name its flags (`keyword_message`), and so
do the notes the run says as it starts (`toymlx-train: warmup=5 is longer than steps=2: ...`).

Why a child process and not this one: MLX fixes some of its CPU set-up once per process, before
toymlx can act, and a script that imported `mlx.core` first (every mlx-lm script, most
notebooks) has already fixed it. On Linux the `mlx[cpu]` wheel then keeps its reference BLAS
(a LoRA step about 40x slower), and MLX's evaluation width is read at the first evaluation
(`toymlx.backend.device`). A child that imports toymlx first trains exactly as `toymlx-train` does,
whatever this process did before; Ctrl-C here stops it cleanly (final checkpoint, resumable),
and so does a reader of this process's output gone (`python script.py | head -3`).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import numbers
import os
import re
import signal
import subprocess
import sys
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from toymlx.backend.lifeline import child_env, module_command
from toymlx.backend.stop import READER_GONE


class OptionError(ValueError):
    """An option `toymlx.train` refused before any training: a name or value the command does
    not take, or a value no flag can carry. Nothing was trained and no bundle was written; a
    `ValueError`, so code catching that still catches it."""


class TrainError(RuntimeError):
    """A `toymlx.train` run that did not complete: its exit status, last message and bundle."""

    def __init__(self, message: str, returncode: int, summary: dict[str, Any] | None):
        super().__init__(message)
        self.returncode, self.summary = returncode, summary


def option_flags(options: dict[str, Any], prefix: str = "") -> list[str]:
    """`toymlx-train` flags for keyword options: names with `-` for `_`, nested dicts as
    dotted groups (`data={"path": p}` -> `--data.path p`), bools as `--x` / `--no-x`, lists as
    several values; None is left to the recipe's default."""
    flags: list[str] = []
    for key, value in options.items():
        key = str(key)
        name = "from" if prefix + key == "from_step" else prefix + key.replace("_", "-")
        if isinstance(value, dict):
            flags += option_flags(value, name + ".")
        elif value is None:
            continue
        elif isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--{_negated(name)}")
        elif isinstance(value, (list, tuple)):
            flags += [f"--{name}", *map(str, value)]
        else:
            flags += [f"--{name}", os.fspath(value) if isinstance(value, Path) else str(value)]
    return flags


def _negated(name: str) -> str:
    group, _, leaf = name.rpartition(".")  # tyro negates the last part: --data.no-shuffle
    return f"{group}.no-{leaf}" if group else f"no-{leaf}"


def train(recipe: str | None = None, *, echo: bool = True, **options: Any) -> dict[str, Any]:
    """Train `recipe` with `options` (the flags of `toymlx-train --recipe RECIPE --help`) in a
    fresh process; return the run's summary (status, steps, final loss, held-out metric,
    throughput, path). With `resume=`, or `config=` a file naming one, the recipe is the run's
    or the file's, as the command's.
    `echo=False` keeps the child's output to the error message."""
    if not isinstance(echo, bool):  # `echo="no"` relayed every line, as True does
        raise OptionError(f"echo: expected True or False, found {echo!r}")
    with warnings.catch_warnings():  # the summary's first numpy import adds numpy's filters
        return _train(recipe, echo, options)


def _train(recipe: str | None, echo: bool, options: dict[str, Any]) -> dict[str, Any]:
    from toymlx.bundle.options import default_run_id
    from toymlx.recipes import RECIPES, get_recipe
    from toymlx.runner.report import summarize_run

    options = _python_names(options)
    for name in ("resume", "config", "run_id", "runs_root"):  # read here, whatever the recipe:
        # `run_id=5` was a TypeError from pathlib, `resume=5` another
        if isinstance(options.get(name), numbers.Real):
            raise OptionError(_not_text(name, options[name]))
    resume, config = options.get("resume"), options.get("config")
    if isinstance(config, dict):  # as a group of options it was `--config.iters 2`: the usage
        raise OptionError("config: expected the path of a YAML or JSON file of options (an "
                          "mlx-lm lora config too), found a dict; write it to a file "
                          "(json.dump) and pass its path, or pass toymlx's options as keywords")
    # a str the command checks, naming the recipes; None only where the run or file names it
    if not isinstance(recipe, str) and not (recipe is None and (resume or config) is not None):
        raise OptionError(f"recipe: expected one of {', '.join(RECIPES)}, found {recipe!r}")
    # a resume's keywords (steps=, a run-local option) too, by the run's recipe; a config
    # file's recipe is known once the command reads the file (cli code): the keywords go to it
    # as JSON, checked there (`KEYWORDS_ENV`)
    typed = None
    if (checked := recipe if recipe is not None else _resumed_recipe(resume)) in RECIPES:
        check_types(options, get_recipe(checked).Config)
    elif recipe is None and resume is None:
        typed = json.dumps(_json_tree(options))
    if resume is None and config is None and options.get("run_id") is None:
        options["run_id"] = default_run_id(recipe)  # known here, so the bundle can be read
    # a config file's runs_root and run_id are the child's to read: its bundle is then the
    # one its last line names
    run_dir = (Path(resume) if resume is not None else None if config is not None
               else Path(options.get("runs_root") or "runs") / options["run_id"])
    cmd = module_command("toymlx_cli.train",
                         *(["--recipe", recipe] if recipe is not None else []),
                         *option_flags(options))
    before = _stamp(run_dir / "events.jsonl") if run_dir is not None else None
    # the command's notes relayed as its refusals are raised: in the keywords `train` takes
    tail = _run_child(cmd, echo, lambda note: keyword_message(note, options, [recipe]),
                      {} if typed is None else {KEYWORDS_ENV: typed})
    if run_dir is None and (named := re.search(r"bundle: (.+)$", tail.last_line)):
        run_dir = Path(named.group(1))  # new to this call: a record there is the run's own
    summary = (summarize_run(run_dir) if run_dir is not None
               and (run_dir / "events.jsonl").exists() else None)
    recipes = [recipe or (summary or {}).get("recipe")]
    if isinstance(tail.stopped, KeyboardInterrupt):
        tail.relay_held(tail.last_line)
        # the run's own last line: the step it stopped at and how to resume it
        raise KeyboardInterrupt(keyword_message(tail.last_line or f"stopped; bundle: {run_dir}",
                                                options, recipes))
    if tail.stopped is not None:
        raise tail.stopped
    if tail.returncode == 0:
        tail.relay_held()  # not an exception's message: the command's own lines, as they were
        return summary if summary is not None else {"path": str(run_dir), "status": "empty"}
    last = tail.last_line or f"exit status {tail.returncode}"
    # exit 2 is a refusal of the options, or a run that diverged: only the latter writes the
    # bundle's record (a refused --run-id of an existing run leaves that run's as it was)
    if tail.returncode == 2 and (run_dir is None or _stamp(run_dir / "events.jsonl") == before):
        tail.relay_held(tail.message())
        raise OptionError(keyword_message(tail.message(), options, recipes))
    tail.relay_held(last)
    if not last.endswith(f"bundle: {run_dir}"):  # the run's own last line names it already
        last = f"{last} (bundle: {run_dir})"
    raise TrainError(keyword_message(last, options, recipes), tail.returncode, summary)


_COMMAND = re.compile(r"(?<![\w./-])(toymlx-[a-z]+|llama-[a-z-]+|mlx-lm's|mlx_lm\.[a-z_]+) ")
"""A command line quoted in a message: toymlx-train's is a call of `train`; another's, up to
the end of its clause, is left as it is (toymlx-export --base is not train's base=)."""
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9._-]*[a-z0-9]")
_PEER_FLAG = re.compile(r"(?<![\w./-])((?:llama\.cpp|timm|mlx_lm\.lora|HF Trainer|torchrun|"
                        rf"accelerate launch)'s {_FLAG.pattern})")
"""Another tool's flag as a hint names it (`llama.cpp's --lora-scaled FILE S`, the peers of
cli/usage.py's PeerFlags tables): its own, kept as it is though toymlx has a flag so spelt (or
the call gave that keyword: `lora_scaled=`)."""
_TOKEN = re.compile(f"{_COMMAND.pattern}|{_PEER_FLAG.pattern}|{_FLAG.pattern}")
_CLAUSE_END = re.compile(r"[;)`]|[.,:](?=\s|$)|$")
_VALUE_END = ".,;:)`'\""


def keyword_message(message: str, options: dict[str, Any],
                    recipes: list[str | None]) -> str:
    """`message` (the command's) with toymlx-train's flags as the keywords `train` takes:
    `--resume runs/x` is `resume="runs/x"`, `--overwrite` `overwrite=True`, `--no-compile`
    `compile=False`, `--data.path p` `data={"path": "p"}`, a flag named alone (`--seq-len:`)
    its keyword (`seq_len:`), `toymlx-train --resume R --from step_0` the call
    `toymlx.train(resume="R", from_step="step_0")`. Only the flags of the `recipes` (all of them
    where none is known) and those `options` gave are translated; another command's, quoted
    (`toymlx-export --base B`, mlx-lm's --iters), and another tool's flag named as its
    (`_PEER_FLAG`: llama.cpp's --lora-scaled) are its own."""
    kinds = _flag_kinds(recipes, options)
    message = message.replace("-c/--config", "--config")  # the file is train's config=
    values = sorted({str(v) for v in _leaves(options) if isinstance(v, (str, os.PathLike))},
                    key=len, reverse=True)
    out, pos = [], 0
    while m := _TOKEN.search(message, pos):
        start, end = m.start(), m.end()
        out.append(message[pos:start])
        if m.group(1) == "toymlx-train":
            args, end = [], end - 1
            while f := re.match(r" (--[a-z][a-z0-9._-]*[a-z0-9])", message[end:]):
                flag, value, after = _flag_value(message, end + f.end(), f.group(1), kinds,
                                                 values)
                if f.group(1) == "--recipe" and value is not None:
                    args.insert(0, value)
                elif f.group(1) in kinds:
                    args.append(_keyword(flag, value, kinds))
                else:
                    break
                end = after
            out.append(f"toymlx.train({', '.join(args)})" if args else message[start:end])
        elif m.group(1):  # another command: its clause as it is
            end += _CLAUSE_END.search(message[end:]).start()
            out.append(message[start:end])
        elif m.group(2):  # another tool's flag
            out.append(m.group(2))
        elif m.group(0) in kinds:
            flag, value, end = _flag_value(message, end, m.group(0), kinds, values)
            out.append(_keyword(flag, value, kinds))
        else:
            out.append(message[start:end])
        pos = end
    return "".join(out) + message[pos:]


CALLER_ENV, CALLER = "TOYMLX_CALLER", "toymlx.train"
"""Set in the command `train` runs: the lines the command lays out itself (the mlx-lm key
table's columns), which the relay cannot re-spell as it does a note (`keyword_message`) without
breaking them, name the keywords `train` takes (`called_by_train`)."""


def called_by_train() -> bool:
    """Whether this process is the command a `toymlx.train` call runs (`CALLER_ENV`): what it
    lays out itself then names `train`'s keywords (`caller_option`), not flags."""
    return os.environ.get(CALLER_ENV) == CALLER


def caller_option(flag: str) -> str:
    """`flag` (`--lora.alpha`) as this process's caller writes it: where `called_by_train`, the
    keyword `train` takes (`lora={"alpha": ...}`, as `keyword_message` names a flag alone), else
    the flag; a text not a flag as it is."""
    if not (flag.startswith("--") and called_by_train()):
        return flag
    return _keyword(flag, None, {})


def caller_text(text: str, recipe: str) -> str:
    """`text` (the command's, of `recipe`) as this process's caller reads it: where
    `called_by_train`, its flags as the keywords `train` takes (`keyword_message`: `--lora.rank
    2` is `lora={"rank": 2}`) and its command line the keywords, else as it is."""
    if not called_by_train():
        return text
    return keyword_message(text.replace("command line", "keywords"), {}, [recipe])


def _flag_value(message: str, end: int, flag: str, kinds: dict[str, Any],
                values: list[str]) -> tuple[str, str | None, int]:
    """(flag, its value as Python spells it or None, where it ends) for `flag` ending at
    `end`: a value follows only where the flag takes one and the next word is one (a number
    of a number option, a choice of a choice option, a path, a value `options` gave, or a
    placeholder in capitals such as RUN)."""
    kind = kinds.get(flag)
    if kind in (True, False, None) or not message[end:].startswith(" "):
        return flag, None, end
    rest = message[end + 1:]
    given = next((v for v in values if rest.startswith(v) and
                  (len(rest) == len(v) or rest[len(v)] in " " + _VALUE_END)), None)
    word = given or re.match(r"\S*", rest).group(0).rstrip(_VALUE_END)
    if not word:
        return flag, None, end
    if word.isupper() and word.replace("_", "").isalpha():
        return flag, word, end + 1 + len(word)  # a placeholder
    if given is None and not (
            kind is int and re.fullmatch(r"-?\d+", word)
            or kind is float and re.fullmatch(r"-?[\d.]+(e-?\d+)?", word)
            or isinstance(kind, tuple) and word in kind
            or kind is str and re.search(r"[/\\._~\d]", word)):
        return flag, None, end
    spelled = word if kind in (int, float) else json.dumps(word)
    return flag, spelled, end + 1 + len(word)


def _keyword(flag: str, value: str | None, kinds: dict[str, Any]) -> str:
    """`flag` (with `value`, as Python spells it) as the keyword `train` takes."""
    kind = kinds.get(flag)
    if isinstance(kind, bool):
        flag, value = ("--" + flag[2:].replace("no-", "", 1) if not kind else flag,
                       str(kind))
    key = "from_step" if flag == "--from" else flag[2:].replace("-", "_")
    group, _, leaf = key.partition(".")
    if not leaf:
        return key if value is None else f"{key}={value}"
    return f'{group}={{"{leaf}": {"..." if value is None else value}}}'


def _flag_kinds(recipes: list[str | None], options: dict[str, Any]) -> dict[str, Any]:
    """{flag: what it takes} for the recipes' options and the flags `options` gave: True or
    False for a flag that sets a bool (--x, --no-x), int, float, str, or a tuple of choices."""
    from toymlx.recipes import RECIPES, get_recipe

    names = [r for r in recipes if r in RECIPES] or list(RECIPES)
    kinds: dict[str, Any] = {"--recipe": tuple(RECIPES), "--config": str}
    for f in option_flags(options):
        if f.startswith("--"):
            kinds[f] = str
    for name in names:
        kinds.update(_config_kinds(get_recipe(name).Config))
    return kinds


def _config_kinds(cls: type, prefix: str = "") -> dict[str, Any]:
    """{flag: what it takes} of a (nested) config dataclass (see `_flag_kinds`)."""
    hints, kinds = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], prefix + f.name
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--from" if key == "from_step" else "--" + key.replace("_", "-")
        if dataclasses.is_dataclass(kind):
            kinds.update(_config_kinds(kind, key + "."))
        elif kind is bool:
            kinds[flag] = True
            kinds["--" + _negated(flag[2:])] = False
        elif typing.get_origin(kind) is Literal:
            kinds[flag] = tuple(map(str, typing.get_args(kind)))
        else:
            kinds[flag] = kind if kind in (int, float) else str
    return kinds


def _many_flags(cls: type, prefix: str = "") -> set[str]:
    """The flags of a (nested) config dataclass that take several values (a list or tuple
    field: `--data.keys`, `--lr-schedule-args`)."""
    hints, many = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], prefix + f.name
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if dataclasses.is_dataclass(kind):
            many |= _many_flags(kind, key + ".")
        elif typing.get_origin(kind) in (list, tuple):
            many.add("--" + key.replace("_", "-"))
    return many


def _resumed_recipe(resume: Any) -> str | None:
    """The recipe of the run `resume` names, as its config.json records it; None where it
    cannot be read (the command then says why)."""
    from toymlx.bundle.folder import read_config

    if resume is None:
        return None
    try:
        return read_config(Path(resume), "--resume")["recipe"]
    except (OSError, ValueError):  # RunError
        return None


KEYWORDS_ENV = "TOYMLX_TRAIN_KEYWORDS"
"""Set in the command a `train(config=FILE)` call without recipe= runs: its keywords as JSON
(`_json_tree`), whose types the command checks (`check_types`) once it has read the recipe the
file names, which only the command's code reads."""


def _json_tree(options: Any) -> Any:
    """Keywords as JSON holds them, each value `_json_like` (a tuple a list; a value JSON has no
    type for as its repr, which no option takes)."""
    if isinstance(options, dict):
        return {str(k): _json_tree(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return [_json_tree(v) for v in options]
    value = _json_like(options)
    return value if value is None or isinstance(value, (str, int, float, bool)) else repr(value)


def check_given_types(cls: type) -> None:
    """In the command a `train(config=FILE)` call runs (`KEYWORDS_ENV`): its keywords checked
    against the options of the recipe the file named (`check_types`); nothing elsewhere."""
    if (typed := os.environ.get(KEYWORDS_ENV)) is not None:
        check_types(json.loads(typed), cls)


def check_types(options: dict[str, Any], cls: type, group: str = "") -> None:
    """OptionError for a keyword whose value the recipe's option (a field of its config
    dataclass `cls`, the type its flag takes) does not take, before anything starts, naming the
    keyword, what it takes and what was given: `steps="10"` ran as `--steps 10`, `steps=True`
    as `--steps True`, refused by the command only as a flag's text. A float takes an int
    (`lr=1`), an int no bool; an on/off option takes True or False (`compile="yes"` was
    `--compile yes`); an option of a path or name a str or `pathlib.Path` (`_not_text`); an
    option of one value no list (its values after the first were stray words), one of several
    values a list or tuple of its type; a group of options (`data=`) a dict. None, and a
    keyword the recipe does not have, are left to the command."""
    from toymlx.bundle.options import type_mismatch

    hints = typing.get_type_hints(cls)
    for key, value in options.items():
        if key not in hints or value is None:
            continue
        shown = f'{group}={{"{key}": ...}}' if group else key
        kind = hints[key]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: None is
            kind = next(a for a in typing.get_args(kind) if a is not type(None))  # skipped
        many = typing.get_origin(kind) in (list, tuple)
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise OptionError(f"{shown}: expected a dict (a group of options), found "
                                  f"{_given(value)}")
            check_types(value, kind, f"{group}.{key}" if group else key)
        elif kind is bool:
            if not isinstance(value, bool):
                raise OptionError(f"{shown}: expected True or False, found {value!r}")
        elif isinstance(value, (list, tuple)) and not many:
            want = {int: "an integer", float: "a number"}.get(kind, "a string")
            raise OptionError(f"{shown}: expected one value ({want}), found a "
                              f"{type(value).__name__} {list(value)!r}")
        elif kind is str and not group and key == "from_step":  # step_N, or N
            if not isinstance(value, (str, os.PathLike, numbers.Integral)) \
                    or isinstance(value, bool):
                raise OptionError(f"{shown}: expected a step (an int, or step_N), found "
                                  f"{_given(value)}")
        elif kind is str:
            if not isinstance(value, (str, os.PathLike)):
                raise OptionError(_not_text(shown, value))
        else:
            item, each = (typing.get_args(kind)[0], " for each value") if many else (kind, "")
            for v in value if many and isinstance(value, (list, tuple)) else [value]:
                if (want := type_mismatch(item, _json_like(v))) is not None:
                    raise OptionError(f"{shown}: expected {want}{each}, found {_given(v)}")


def _json_like(value: Any) -> Any:
    """A keyword's value as a config file would hold it, for `type_mismatch`: a numpy scalar
    (`_scalar`) as the Python number it holds, a path as its text."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _given(value: Any) -> str:
    """A keyword's value as a refusal names it: its type and its repr (`the str '10'`)."""
    return f"the {type(value).__name__} {value!r}"


def _not_text(shown: str, value: Any) -> str:
    """Why a number (or bool) given to an option that takes a path or name (`data={"path": 5}`,
    `run_id=5`) is refused: the command read "5" as a file of that name, or a call failed in
    pathlib; a str, as the flag's value is, says which was meant."""
    return (f"{shown}: expected a str (a path or name, as its flag takes) or a pathlib.Path, "
            f"found {value!r} ({type(value).__name__})")


def _leaves(options: dict[str, Any]) -> list[Any]:
    return [x for v in options.values() for x in (_leaves(v) if isinstance(v, dict) else [v])]


def _python_names(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with each name as Python spells it (`**{"run-id": x}` is run_id=x, `**{"from":
    s}` from_step=s), so the names `train` reads itself (run_id, resume, runs_root) are found
    however they were given; OptionError for one option given in both spellings, or a value no
    flag can carry (a numpy scalar is a number: `np.int64(20)` is `--steps 20`,
    `np.float32(1e-3)` `--lr 0.001`; see `_scalar`)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = "from_step" if key == "from" else str(key).replace("-", "_")
        if name in out:
            raise OptionError(f"{key}: given twice, as {name} and {key}")
        value = _scalar(value)
        if not isinstance(value, (str, numbers.Real, bool, os.PathLike, dict, list, tuple,
                                  type(None))):
            raise OptionError(
                f"{name}: expected a str, number, bool, path, dict (a group of "
                f"options) or list, found {type(value).__name__}")
        out[name] = _python_names(value) if isinstance(value, dict) else value
    return out


def _scalar(value: Any) -> Any:
    """A numpy or MLX scalar (`np.bool_(True)`, `np.array(4)`, `mx.array(1e-3)`) as the Python
    scalar it holds: a bool stays a flag (`--compile`, not `--compile 1`), a float32 keeps its
    own shortest spelling (numpy's: 0.001, not its float64 widening 0.0010000000474974513)."""
    if isinstance(value, (str, bool, int, float, os.PathLike, dict, list, tuple, type(None))) \
            or getattr(value, "ndim", None) != 0 or not hasattr(value, "item"):
        return value
    import numpy as np  # a 0-d array: numpy is loaded already, or MLX's array converts to it

    try:
        value = np.asarray(value)[()]
    except (TypeError, ValueError, RuntimeError):  # a dtype numpy lacks (MLX's bfloat16)
        value = value.item()
    return bool(value) if isinstance(value, np.bool_) else value


def _stamp(path: Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of `path`, None where it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


HELD = re.compile(r"toymlx-train: (?:error:|interrupted|stopped by SIG)|[╭│╰]"
                  r"|toymlx: \w+ at step \d")
"""How a line an exception of `train` may tell starts: the command's refusal (its one line, or
tyro's own box), or the run's last line (`toymlx: diverged at step 3: ...`, a TrainError's;
`toymlx: interrupted at step 7: ...`, Ctrl-C's; `toymlx-train: interrupted` before there was a
step, Ctrl-C's too)."""


NOTE = re.compile(r"toymlx(?:-train)?: ")
"""How a line the command says in its own name starts (`toymlx-train: --warmup 10 (the recipe's
default) is longer than --steps 3: ...`, a recipe's `toymlx: ...`): relayed in the keywords
`train` takes (`_Output.said`), as its refusals are raised; a step's or a table's line as it
is."""


class _Output:
    """What `_run_child` keeps of the child's output: the exit status, the last line, why
    this process stopped it (None: it ran to its own end), and the lines it has held back
    from the relay (`relay`). `say`: how a note of the command (`NOTE`) is relayed (None: as
    it is)."""

    def __init__(self, say: Callable[[str], str] | None = None) -> None:
        self.returncode, self.last_line, self._buf = -1, "", b""
        self.stopped: BaseException | None = None
        self._partial, self.held = "", []
        self.say = say

    def said(self, line: str) -> str:
        """`line` as the relay writes it: a note of the command through `say`, its line end
        kept."""
        if self.say is None or not NOTE.match(line):
            return line
        text = line.rstrip("\r\n")
        return self.say(text) + line[len(text):]

    def relay(self, text: str, end: bool = False) -> None:
        """Write `text` of the child's output to `sys.stdout`, line by line (`end`: the last
        line too, unterminated), but hold back a refusal's lines and the run's last line
        (`HELD`) until another line follows: a call that ends refused, failed or stopped
        raises them as its exception's message, in the keywords `train` takes; relayed too,
        they showed twice (`--steps: expected >= 1, found 0`, then the exception's
        `steps: ...`)."""
        lines = (self._partial + text).splitlines(keepends=True)
        self._partial = "" if end or not lines or lines[-1].endswith(("\n", "\r")) \
            else lines.pop()
        for line in lines:
            if HELD.match(line):
                self.held.append(line)
                continue
            self.held, held = [], self.held
            sys.stdout.write("".join(map(self.said, [*held, line])))
        sys.stdout.flush()

    def relay_held(self, told: str = "") -> None:
        """Write the held lines but those the exception raised tells (`told`, the command's
        text it is made from): nothing the child said is lost."""
        self.held, held = [], self.held
        if kept := [s for s in held if s.strip(" │╭╮╰╯─\r\n") not in told]:
            sys.stdout.write("".join(map(self.said, kept)))
            sys.stdout.flush()

    def stop(self, child: subprocess.Popen, sig: int, why: BaseException) -> None:
        """Ask `child` to stop with `sig`, keeping the first reason to raise once it has."""
        child.send_signal(sig)
        if self.stopped is None:
            self.stopped = why

    def feed(self, chunk: bytes) -> None:
        self._buf = (self._buf + chunk)[-8192:]
        self.last_line = next((s for s in reversed(self._lines()) if s), self.last_line)

    def _lines(self) -> list[str]:
        text = self._buf.decode(errors="replace").replace("\r", "\n")
        return [s.strip(" │╭╮╰╯─") for s in text.split("\n")]

    def message(self) -> str:
        """The command's last message in one line (tyro draws its errors in a box)."""
        lines = [s for s in self._lines() if s]
        start = max((i for i, s in enumerate(lines) if "error" in s.lower()), default=0)
        kept = [s for s, after in zip(lines[start:], lines[start + 1:] + [""])
                if not after.startswith(s)]  # a box's title repeats its first line
        return " ".join(kept) or self.last_line


def _run_child(cmd: list[str], echo: bool, say: Callable[[str], str] | None = None,
               env: dict[str, str] | None = None) -> _Output:
    """Run `cmd` tied to this process (it stops if this one dies), its stdout and stderr relayed
    to `sys.stdout` (a notebook's cell output too) a line as it comes (a refusal and the run's
    last line held back: `_Output.relay`), and return once it has ended.
    Ctrl-C here, wherever it lands (waiting for output, or in `sys.stdout.write`), is passed on
    as the child's own Ctrl-C, once: the child runs in a session of its own, where a terminal's
    Ctrl-C, sent to every process of its job, does not reach it too (two, they were a second
    request: the run left without its final checkpoint); a reader of this process's output
    gone (`python script.py | head -3`) as the child's own reader gone (SIGPIPE), and any
    other failure to relay as a
    Ctrl-C: the run checkpoints and ends, its output still read (a child left writing into a
    pipe nobody reads would hang, holding its bundle's lock); `_Output.stopped` then holds what
    `train` raises (KeyboardInterrupt, BrokenPipeError, the relay's error). `say`: how the
    command's notes are relayed (`_Output.said`); `env`: variables set for it besides."""
    out, text = _Output(say), codecs.getincrementaldecoder("utf-8")(errors="replace")
    # unbuffered, as a sweep's runs are: its stdout and stderr reach the one pipe in the order
    # written (a table printed before a refusal came after it, at exit, where stdout was
    # block-buffered), and each line as it is written
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**child_env(), "PYTHONUNBUFFERED": "1", CALLER_ENV: CALLER,
                                  **(env or {})},
                             start_new_session=True)
    assert child.stdout is not None
    fd, relaying = child.stdout.fileno(), echo
    with child.stdout:  # closed once read to its end: each call's pipe, not left to the GC
        while True:
            try:
                chunk = os.read(fd, 65536)
                if not chunk:
                    if relaying:  # the last line, were it unterminated
                        out.relay(text.decode(b"", final=True), end=True)
                    break
                out.feed(chunk)
                if relaying:
                    out.relay(text.decode(chunk))
            except KeyboardInterrupt as e:
                out.stop(child, signal.SIGINT, e)  # the run checkpoints and ends cleanly
            except BrokenPipeError as e:
                # raised at once, it left the child orphaned, stopped by its lifeline as a
                # SIGTERM
                relaying = False
                out.stop(child, READER_GONE, e)  # the run checkpoints and ends with exit 141
            except Exception as e:  # noqa: BLE001  (sys.stdout closed or replaced: raised below)
                relaying = False
                out.stop(child, signal.SIGINT, e)
    while True:
        try:
            out.returncode = child.wait()
            break
        except KeyboardInterrupt as e:
            out.stop(child, signal.SIGINT, e)
    return out
