"""`-c/--config FILE`: a command's options from a YAML or JSON file, command-line flags on top.

Keys are spelled as the flags are (`batch_size` or `batch-size` for `--batch-size`; nested
`lora: {rank: 8}` or dotted `lora.rank: 8` for `--lora.rank`). The file's values, each checked
against the option's type, become the defaults tyro parses the command line over (tyro's own
support for defaults), so any flag given overrides the file. A run bundle's `config.json`
(`{"recipe": ..., "config": {...}}`) is such a file too: `toymlx-train -c runs/<id>/config.json`
starts a new run with that run's settings, less the options that only name or steer that run
(`RUN_NAMING`). `toymlx-sweep -c FILE` reads one file as the whole sweep (`sweep_config`): its
own options, its grid, and the options every run takes as toymlx-train -c takes them. Bad input
is one line naming the file and the key; an unknown key names the closest flag (and the toymlx
flag for an mlx-lm key).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import typing
from pathlib import Path
from typing import Any

import yaml

CONFIG_FLAGS = ("-c", "--config")
CONFIG_HELP = ("-c/--config FILE: options from a YAML or JSON file, keys spelled as the flags "
               "(lora.rank or lora: {rank: ...}); flags given override the file.")
RUN_NAMING = frozenset({"run_id", "resume", "from_step", "overwrite", "stop_at"})
"""Options of a run's config.json that a new run started from it does not take over: they
name that run's bundle or steer that one process."""

MLX_LM_KEYS = {
    "model": "--base", "data": "--data.path", "fine_tune_type": "--fine-tune-type",
    "iters": "--steps", "learning_rate": "--lr", "num_layers": "--lora.layers",
    "lora_parameters": "--lora.rank, --lora.alpha (scale x rank), --lora.dropout and "
                       "--lora.targets (for keys)",
    "max_seq_length": "--seq-len", "grad_accumulation_steps": "--grad-accum",
    "steps_per_eval": "--eval-every", "val_batches": "--eval-batches",
    "save_every": "--checkpoint-every", "resume_adapter_file": "--lora.init-adapter",
    "adapter_path": "--runs-root and --run-id (the run folder holds the adapters)",
    "mask_prompt": "--data.mask-prompt", "train": "nothing (toymlx-train always trains)",
    "steps_per_report": "--report-every",
    "test_batches": "nothing (--test scores all of test.jsonl)",
    "optimizer": "nothing (toymlx trains with AdamW)",
}
"""mlx_lm.lora's config keys -> toymlx's flags, named when such a key is unknown here."""


class ConfigFileError(ValueError):
    """A config file that cannot be used; one line naming the file and the key."""


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the -c/--config FILE, the other arguments); ConfigFileError for a -c without a file or
    given twice."""
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # what follows is another command's (toymlx-launch, toymlx-sweep)
            rest += argv[i:]
            break
        value = None
        if a in CONFIG_FLAGS:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ConfigFileError(f"{a}: expected a YAML or JSON file after it, found "
                                      f"{'nothing' if i + 1 >= len(argv) else argv[i + 1]}")
            value, i = argv[i + 1], i + 2
        elif a.startswith("--config="):
            value, i = a.partition("=")[2], i + 1
        else:
            rest.append(a)
            i += 1
            continue
        if path is not None:
            raise ConfigFileError(f"-c/--config: expected one config file, found {path} and "
                                  f"{value}")
        path = value
    return path, rest


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's floats: `1e-5` is a number, as JSON and mlx-lm
    read it (YAML 1.1 wants `1.0e-5`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def read_config_file(path: str) -> dict[str, Any]:
    """The file as a mapping: JSON for `.json`, else YAML (PyYAML's safe loader)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        what = getattr(e, "strerror", None) or e
        raise ConfigFileError(f"{p}: -c/--config: expected a readable UTF-8 YAML or JSON file, "
                              f"found {what}") from None
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"{p}: expected JSON, found {e.msg} at line {e.lineno} "
                                  f"column {e.colno}") from None
    else:
        try:
            data = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise ConfigFileError(f"{p}: expected YAML, found {getattr(e, 'problem', None) or e}"
                                  f"{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{p}: expected a mapping of option: value, found a "
                              f"{type(data).__name__}")
    return data


def is_run_config(data: dict[str, Any]) -> bool:
    """Whether a config file is a run bundle's config.json (`{"recipe": ..., "config": {...}}`)."""
    return isinstance(data.get("config"), dict) and isinstance(data.get("recipe"), str)


def run_config(data: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(recipe, options) of a config file: a run's config.json (less RUN_NAMING), or a plain
    mapping whose `recipe` key, if any, names the recipe (toymlx-train)."""
    if is_run_config(data):
        return data["recipe"], {k: v for k, v in data["config"].items() if k not in RUN_NAMING}
    data = dict(data)
    recipe = data.pop("recipe", None)
    return (str(recipe) if recipe is not None else None), data


# ---- options of a dataclass, as flags ------------------------------------------------------
def _norm(key: str) -> str:
    return key.lstrip("-").replace("-", "_")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _spellings(cls: type, f: dataclasses.Field) -> list[str]:
    """A field's own name and the names tyro gives it (`tyro.conf.arg(name=..., aliases=...)`)."""
    names = [f.name]
    for meta in getattr(typing.get_type_hints(cls, include_extras=True)[f.name],
                        "__metadata__", ()):
        names += [n for n in [getattr(meta, "name", None)] if isinstance(n, str)]
        names += [a for a in getattr(meta, "aliases", None) or () if isinstance(a, str)]
    return [_norm(n) for n in names]


def _table(cls: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """Every option of `cls` under each of its spellings (dotted, underscores) -> field path."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out.update({k: (f.name, *p) for k, p in _table(hints[f.name], f"{prefix}{f.name}.")
                        .items()})
            continue
        for name in _spellings(cls, f):
            out[f"{prefix}{name}"] = (f.name,)
    return out


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = prefix + _norm(str(k))
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _unknown(source: str, key: str, table: dict[str, tuple[str, ...]], prog: str) -> str:
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.6)
    hint = f"; did you mean {_flag(close[0])}?" if close else ""
    top = key.split(".")[0]
    if top in MLX_LM_KEYS and key not in table:
        hint = f"; mlx-lm's {top} is toymlx's {MLX_LM_KEYS[top]}"
    return f"{source}: key {key!r}: expected an option of {prog}, found an unknown key{hint}"


def defaults_from_file(cls: type, options: dict[str, Any], source: str, prog: str) -> Any:
    """An instance of the options dataclass `cls` holding the file's values (each checked
    against its option's type) and every other option's default, for `tyro.cli(default=...)`;
    required options the file leaves out stay required (`tyro.MISSING`)."""
    import tyro

    from toymlx.runs import RunError, config_from_dict

    table = _table(cls)
    nested: dict[str, Any] = {}
    for key, value in _flatten(options).items():
        if key not in table:
            raise ConfigFileError(_unknown(source, key, table, prog))
        if key in ("resume", "from", "from_step"):
            raise ConfigFileError(f"{source}: key {key!r}: expected on the command line "
                                  f"({_flag(key)}), found it in a config file")
        *parents, leaf = table[key]
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    # the file's values checked as a saved config is (types, one line naming the key); only the
    # keys it gives are set, so a required option it leaves out stays required
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    given = dataclasses.make_dataclass(cls.__name__, [(f.name, hints[f.name],
                                                       dataclasses.field(default=None))
                                                      for f in fields])
    try:
        checked = config_from_dict(given, nested, source, prefix="", complete=False)
    except RunError as e:
        raise ConfigFileError(str(e)) from None
    kw = {f.name: getattr(checked, f.name) if f.name in nested else
          (tyro.MISSING if f.default is dataclasses.MISSING
           and f.default_factory is dataclasses.MISSING else
           f.default if f.default is not dataclasses.MISSING else f.default_factory())
          for f in fields}
    return cls(**kw)


def file_defaults(cls: type, argv: list[str], prog: str) -> tuple[Any, list[str]]:
    """(tyro's default instance from `-c FILE`, or None without one; the other arguments)."""
    path, rest = split_config(argv)
    if path is None:
        return None, rest
    return defaults_from_file(cls, read_config_file(path), path, prog), rest


def _parser_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """An argparse command's options under each of their spellings (underscores)."""
    return {_norm(o): a for a in parser._actions for o in a.option_strings
            if a.dest not in ("help", "version", "config")}


def _set_default(action: argparse.Action, key: str, value: Any, path: str) -> None:
    """A file's value as the default of an argparse option (flags given override it), checked
    against the option's type."""
    many = isinstance(action, argparse._AppendAction)
    items = value if many and isinstance(value, list) else [value]
    kind = action.type or (bool if action.nargs == 0 else str)
    want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    for v in items:
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
              isinstance(v, kind) and (kind is bool or not isinstance(v, bool)))
        if not ok:
            raise ConfigFileError(f"{path}: key {key!r}: expected "
                                  f"{want.get(kind, kind.__name__)}"
                                  f"{' or a list of them' if many else ''}, found "
                                  f"{json.dumps(v)}")
    if action.nargs == 0 and value != (action.const is True):
        raise ConfigFileError(f"{path}: key {key!r}: expected "
                              f"{json.dumps(action.const is True)} (the flag's only "
                              f"setting), found {json.dumps(value)}")
    action.default = [str(v) for v in items] if many else value
    action.required = False


def parser_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`-c FILE` for an argparse command (toymlx-report, toymlx-launch): the file's values become
    its options' defaults (argparse's own `default`), checked against each option's type;
    returns the other arguments."""
    path, rest = split_config(argv)
    if path is None:
        return rest
    table = _parser_table(parser)
    for key, value in _flatten(read_config_file(path)).items():
        if key not in table:
            raise ConfigFileError(_unknown(path, key, table, parser.prog))
        _set_default(table[key], key, value, path)
    return rest


SWEEP_RUN_KEYS = frozenset({"seed"})
"""Keys of a sweep file that are the runs' although the sweep has a flag of that name: `seed`
seeds every run's training, as in toymlx-train -c (the sweep's --seed, the seed of its --random
draws, is `random_seed` in a file)."""


def sweep_config(parser: argparse.ArgumentParser, data: dict[str, Any], path: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`toymlx-sweep -c FILE`: (grid, run options) of the file, its sweep keys set on `parser`.

    The sweep's own keys (its flags, spelled as `parser_defaults` reads them, less
    `SWEEP_RUN_KEYS`) become the parser's defaults, so flags given override them; `grid`, a
    mapping of option: [values] or "log:LO:HI" (uniform:, int:), is returned as it is, dotted
    keys with underscores, for the command line's --grid to replace key by key. Every other key
    is returned for the runs, which take it as toymlx-train -c does; a run's config.json gives
    its recipe and all of its options to the runs."""
    from toymlx.runs import BUNDLE_PICK, flag_name

    recipe, options = run_config(data)
    table = _parser_table(parser)
    if recipe is not None:
        _set_default(table["recipe"], "recipe", recipe, path)
    if is_run_config(data):
        return {}, options
    grid: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    for key, value in options.items():
        name = _norm(str(key))
        if name == "grid":
            if not isinstance(value, dict):
                raise ConfigFileError(f"{path}: key 'grid': expected a mapping of option: [values] "
                                      f"or \"log:LO:HI\", found {json.dumps(value)}")
            grid = _flatten(value)
        elif name in table and name not in SWEEP_RUN_KEYS:
            _set_default(table[name], name, value, path)
        elif name in BUNDLE_PICK or name == "from":  # run_id, resume, from, overwrite
            flag = flag_name("from_step" if name == "from" else name)
            raise ConfigFileError(f"{path}: key {key!r}: expected no {flag} in a sweep file "
                                  f"(the sweep sets it for each run), found {json.dumps(value)}; "
                                  "remove it")
        else:
            runs[key] = value
    return grid, runs
