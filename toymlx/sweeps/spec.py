"""A sweep's plan: its runs (`RunSpec`) from a grid of values (`grid`) or random draws
(`random`), the `--grid` text and config-file axes they come from, the sweep's id and a
machine's shard of it, and its record on disk (sweep.json: `write_sweep_file`, checked
against a sweep started again by `changed_options`)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import os
import random as _random
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.bundle.model_store import is_store_name
from toymlx.bundle.options import BUNDLE_PICK, flag_name
from toymlx.runner import report
from toymlx.sweeps.draws import RANGE, parse_range

RESERVED = ("--recipe", *(flag_name(k) for k in BUNDLE_PICK))
"""Flags the sweep sets on each run itself."""

MAX_RUNS = 10_000
"""The most runs one sweep plans (a grid's combinations, --random N): more is a typo, and
planning them would not end."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its folder name, swept values, and `toymlx-train` flags."""

    name: str
    params: dict[str, Any] = field(hash=False)
    args: tuple[str, ...]
    """Flags for toymlx-train: the base options, then the swept values (no --recipe,
    --run-id, --runs-root: the sweep adds those)."""


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")


def key_to_flag(key: str) -> str:
    """Config key to command-line flag: `model.d_model` -> `--model.d-model`."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"--grid {key!r}: expected an option name such as lr or lora.rank")
    return flag_name(key)


def value_args(key: str, value: Any, flag_bool: bool = True) -> list[str]:
    """The flags that set `key` to `value` (plain bools as --x / --no-x, as tyro spells them)."""
    flag = key_to_flag(key)
    if isinstance(value, bool) and flag_bool:
        head, _, last = flag[2:].rpartition(".")
        return [f"--{head + '.' if head else ''}{'' if value else 'no-'}{last}"]
    if isinstance(value, (list, tuple)):
        return [flag, *(_arg_str(v) for v in value)]
    return [flag, _arg_str(value)]


def _arg_str(v: Any) -> str:
    return repr(v) if isinstance(v, float) else "None" if v is None else str(v)


def run_name(params: Mapping[str, Any]) -> str:
    """Folder name of a run from its swept values: `lr=0.0003_lora.rank=8` (stable)."""
    name = "_".join(f"{k}={report.value_text(v)}" for k, v in params.items()) or "base"
    name = re.sub(r"[^A-Za-z0-9._=+-]", "-", name)
    if len(name) > 100:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[:90]}-{digest}"
    return name


def _field_types(recipe: str | None) -> dict[str, Any]:
    """Dotted option key -> type annotation, for every field of the recipe's Config."""
    if recipe is None:
        return {}
    from toymlx.recipes import get_recipe

    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = t
    walk(get_recipe(recipe).Config, "")
    return out


def _norm_key(key: str) -> str:
    return key.replace("-", "_")


def _option_axes(axes: Mapping[str, Any], types: dict[str, Any], recipe: str | None
                 ) -> dict[str, Any]:
    """`axes` keyed by option name (`_norm_key`: `batch-size` and `batch_size` are both
    --batch-size), each key checked against the recipe: a spelling made other run names, and
    so another sweep id and other run ids, for the same runs. ValueError for one option given
    under two spellings."""
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for k, values in axes.items():
        _check_key(k, types, recipe)
        name = _norm_key(k)
        if name in out:
            raise ValueError(f"--grid {k}: expected each option once, found {key_to_flag(k)} "
                             f"as both {spelt[name]} and {k}; keep one")
        out[name], spelt[name] = values, k
    return out


def _check_key(key: str, types: dict[str, Any], recipe: str | None,
               where: str | None = None) -> None:
    """ValueError (starting with `where`, default `--grid KEY`) unless `key` is an option of
    the recipe."""
    flag = key_to_flag(key)
    where = where or f"--grid {key}"
    if flag == "--recipe":
        raise ValueError(f"{where}: expected an option of the runs, found --recipe, the sweep's "
                         "own flag (one sweep runs one recipe); to compare recipes, run one "
                         "sweep for each (toymlx-sweep --recipe lora ..., then toymlx-sweep "
                         "--recipe from-scratch ...)")
    if flag in RESERVED:  # --grid run-id=a,b ran each run under a folder the sweep then lost
        raise ValueError(f"{where}: expected an option of the runs, found {flag}, which the "
                         "sweep sets for each run; remove it")
    if types and _norm_key(key) not in types:
        close = ([k for k in types if k.rsplit(".", 1)[-1] == _norm_key(key).rsplit(".", 1)[-1]]
                 or difflib.get_close_matches(_norm_key(key), types, n=1))  # lrr: lr
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"{where}: expected an option of recipe {recipe}, "
                         f"found no option {flag}{hint}")


def _flags(key: str, value: Any, types: dict[str, Any]) -> list[str]:
    t = types.get(_norm_key(key))
    return value_args(key, value, flag_bool=t is None or t is bool)


def _base_args(base: Sequence[str] | Mapping[str, Any], types: dict[str, Any],
               recipe: str | None) -> list[str]:
    if isinstance(base, Mapping):
        out: list[str] = []
        for k, v in base.items():
            _check_key(k, types, recipe)
            out += _flags(k, v, types)
        base = out
    base = [str(a) for a in base]
    for a in base:
        if a.split("=", 1)[0] in RESERVED:
            raise ValueError(f"{a.split('=', 1)[0]}: the sweep sets this for each run; remove it "
                             "from the options passed through")
    return base


def _check_no_clash(base: list[str], keys: Sequence[str]) -> None:
    """Refuse a grid key also among every run's options (`base`), naming both: "--steps: given
    both as a fixed option and in the sweep" named neither the --grid nor the value given."""
    for k in keys:
        flag = key_to_flag(k)
        head, _, last = flag[2:].rpartition(".")
        neg = f"--{head + '.' if head else ''}no-{last}"
        for i, a in enumerate(base):
            name, eq, _ = a.partition("=")
            if name in (flag, neg):
                value = base[i + 1:i + 2] if not eq and name == flag else []
                given = " ".join([a, *(v for v in value if not v.startswith("--"))])
                raise ValueError(f"--grid {k}: expected {flag} in the grid or among every run's "
                                 f"options, found it in both ({given}); keep one")


def _make_specs(base: list[str], combos: list[dict[str, Any]],
                types: dict[str, Any]) -> list[RunSpec]:
    specs, seen = [], {}
    for params in combos:
        args = list(base)
        for k, v in params.items():
            args += _flags(k, v, types)
        spec = RunSpec(run_name(params), dict(params), tuple(args))
        if spec.name in seen:
            raise ValueError(f"sweep: values {seen[spec.name]} and {params} give the same run "
                             f"name {spec.name!r}; make the values distinct")
        seen[spec.name] = params
        specs.append(spec)
    return specs


def grid(base_args: Sequence[str] | Mapping[str, Any], axes: Mapping[str, Sequence[Any]],
         recipe: str | None = None) -> list[RunSpec]:
    """Every combination of `axes` ({"lr": [1e-4, 3e-4], "lora.rank": [4, 8]}) on top of
    `base_args` (toymlx-train flags, or a {key: value} dict), first key slowest; a key is the
    option's name whichever way it is spelt (`model.d-model`: model.d_model). With `recipe`,
    keys are checked against its options (and typed bools spelled right)."""
    types = _field_types(recipe)
    base = _base_args(base_args, types, recipe)
    axes = _option_axes(axes, types, recipe)
    _check_no_clash(base, list(axes))
    values = []
    for k, vs in axes.items():
        vs = list(vs) if isinstance(vs, (list, tuple, range)) else [vs]
        if not vs:
            raise ValueError(f"--grid {k}: expected at least one value, found none")
        values.append(vs)
    if math.prod(len(vs) for vs in values) > MAX_RUNS:
        raise ValueError(f"--grid: expected at most {MAX_RUNS} runs, found "
                         f"{' x '.join(str(len(vs)) for vs in values)} = "
                         f"{math.prod(len(vs) for vs in values)} combinations")
    combos = [dict(zip(axes, c)) for c in itertools.product(*values)]
    return _make_specs(base, combos, types)


def random(base_args: Sequence[str] | Mapping[str, Any], space: Mapping[str, Any], n: int,
           seed: int = 0, recipe: str | None = None) -> list[RunSpec]:
    """`n` distinct random draws from `space` (each value a list to choose from, or a
    LogUniform / Uniform / IntUniform), deterministic in `seed`; fewer if the space is smaller."""
    if not 1 <= n <= MAX_RUNS:
        raise ValueError(f"--random: expected 1..{MAX_RUNS} runs, found {n}")
    types = _field_types(recipe)
    base = _base_args(base_args, types, recipe)
    space = _option_axes(space, types, recipe)
    _check_no_clash(base, list(space))
    rng = _random.Random(seed)
    combos: dict[str, dict[str, Any]] = {}
    for _ in range(100 * n):  # a space smaller than n stops repeating its draws by then
        if len(combos) == n:
            break
        params = {}
        for k, dist in space.items():
            if hasattr(dist, "sample"):
                params[k] = dist.sample(rng)
            else:
                choices = list(dist) if isinstance(dist, (list, tuple, range)) else [dist]
                params[k] = rng.choice(choices)
        combos.setdefault(run_name(params), params)
    return _make_specs(base, list(combos.values()), types)


def parse_axis(text: str, recipe: str | None = None) -> tuple[str, Any]:
    """`--grid` text to (key, values): `lr=1e-4,3e-4` -> ("lr", [0.0001, 0.0003]);
    `lr=log:1e-4:1e-2`, `x=uniform:0:1`, `x=int:4:16` -> a distribution (for --random).
    Values are typed by the recipe's option types when the recipe is known."""
    key, sep, vals = text.partition("=")
    key = key.strip()
    # an empty value (`lr=1e-3,,3e-3`, a trailing comma) read as "--grid lr=: expected a number"
    if not sep or not key or not all(v.strip() for v in vals.split(",")):
        raise ValueError(f"--grid {text!r}: expected KEY=V1,V2,... with no empty value (e.g. "
                         "lr=1e-4,3e-4)")
    types = _field_types(recipe)
    _check_key(key, types, recipe)
    t = types.get(_norm_key(key))
    m = RANGE.fullmatch(vals.strip())
    if m:
        return key, parse_range(*m.groups(), where=f"--grid {text!r}", integer=_takes_int(t))
    return key, _distinct([_parse_value(v.strip(), t, key) for v in vals.split(",")],
                          f"--grid {text!r}")


def _distinct(values: list[Any], where: str) -> list[Any]:
    """`values`, or ValueError starting with `where` naming one given twice (`lr=1e-3,0.001`:
    it was "sweep: values {'lr': 0.001} and {'lr': 0.001} give the same run name")."""
    for i, v in enumerate(values):
        if v in values[:i]:
            raise ValueError(f"{where}: expected distinct values, found "
                             f"{report.value_text(v)} twice")
    return values


def file_axis(key: str, values: Any, recipe: str | None, where: str) -> Any:
    """A grid axis as a config file gives it (`where` names the file and the key): a list of
    values, each typed by the recipe's option as `parse_axis` types a --grid value, or a
    "log:LO:HI" (uniform:, int:) range for --random; ValueError starting with `where`."""
    types = _field_types(recipe)
    _check_key(key, types, recipe, where)
    m = RANGE.fullmatch(values.strip()) if isinstance(values, str) else None
    if m:
        return parse_range(*m.groups(), where=where, integer=_takes_int(types.get(_norm_key(key))))
    if not isinstance(values, list) or not values or any(isinstance(v, (list, dict))
                                                         for v in values):
        raise ValueError(f'{where}: expected a list of values or a "log:LO:HI" range, found '
                         f"{json.dumps(values)}")
    t = types.get(_norm_key(key))
    return _distinct([_parse_value(_arg_str(v), t, key, where, json.dumps(v)) for v in values],
                     where)


_TYPE_NAMES = {int: "an integer", float: "a number"}


def _takes_int(t: Any) -> bool:
    """Whether an option of type `t` (`_field_types`) takes an integer (int, or int | None)."""
    return _unwrapped(t) is int


def _unwrapped(t: Any) -> Any:
    """An option's type without its `| None` (`X | None`: X; several others: None, any), else
    `t` itself."""
    args = typing.get_args(t)
    if t is None or type(None) not in args:
        return t
    inner = [a for a in args if a is not type(None)]
    return inner[0] if len(inner) == 1 else None


def _parse_value(s: str, t: Any, key: str, where: str | None = None,
                 shown: str | None = None) -> Any:
    """A --grid value (text) as the option's type `t` wants it; ValueError starting with
    `where` (default `--grid KEY=VALUE`), naming the value as `shown` (a file's value as the
    file holds it: 32.5, not "32.5")."""
    args = typing.get_args(t)
    if s == "None" and (t is None or type(None) in args):
        return None
    t = _unwrapped(t)
    found = f", found {shown or json.dumps(s)}" if where else ""
    where = where or f"--grid {key}={s}"
    if t is bool or (t is None and s.lower() in ("true", "false")):
        if s.lower() not in ("true", "false"):
            raise ValueError(f"{where}: expected true or false{found}")
        return s.lower() == "true"
    for cast in ((int,) if t is int else (float,) if t is float else
                 () if t is not None else (int, float)):
        try:
            return cast(s)
        except ValueError:
            if t is not None:
                raise ValueError(f"{where}: expected {_TYPE_NAMES[cast]}{found}") from None
    return s


def default_sweep_id(recipe: str, specs: Sequence[RunSpec],
                     run_options: Mapping[str, Any] | None = None) -> str:
    """A stable id from the recipe, the specs and the options every run takes from a config
    file, so the same command resumes the same sweep."""
    blob = json.dumps([recipe, [[s.name, list(s.args)] for s in specs],
                       *([run_options] if run_options else [])], sort_keys=True, default=str)
    return f"sweep-{recipe}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def shard_specs(specs: Sequence[RunSpec], shard: tuple[int, int]) -> list[RunSpec]:
    """The runs machine `i` of `n` owns: every n-th spec from the i-th (deterministic)."""
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard: expected I/N with 0 <= I < N, found {i}/{n}")
    return [s for k, s in enumerate(specs) if k % n == i]


INPUT_FILES_KEY = "input_files"
"""sweep.json's {"FLAG PATH" (as typed): the absolute file it named, links resolved, when the
sweep first met it}: a run started later (another --shard, a retry) reads the same typed path
from the current folder, so a sweep continued where it names another file is refused
(`changed_options`)."""


def input_files(inputs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """{"FLAG PATH": its absolute file} of the existing paths among (flag, path) `inputs`."""
    return {f"{flag} {path}": os.path.realpath(path) for flag, path in inputs
            if isinstance(path, str) and not is_store_name(path) and os.path.exists(path)}


def write_sweep_file(sweep_dir: Path, recipe: str, specs: Sequence[RunSpec],
                     run_options: Mapping[str, Any] | None = None,
                     inputs: Iterable[tuple[str, Any]] = ()) -> None:
    """sweep.json: the recipe, the config file's options, each run's flags and the runs' input
    files (`INPUT_FILES_KEY`), merged with what an earlier start recorded."""
    path = sweep_dir / report.SWEEP_FILE
    runs: dict[str, dict] = {}
    files: dict[str, str] = {}
    try:
        old = json.loads(path.read_text())
        if old.get("recipe") == recipe:
            runs = {r["name"]: r for r in old.get("runs", [])}
            files = dict(old.get(INPUT_FILES_KEY) or {})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for s in specs:
        runs[s.name] = {"name": s.name, "params": s.params, "args": list(s.args)}
    files = {**input_files(inputs), **files}  # the first start's file wins
    atomic.write_text(path, json.dumps({"recipe": recipe, "sweep_id": sweep_dir.name,
                                        **({"run_options": run_options} if run_options else {}),
                                        **({INPUT_FILES_KEY: files} if files else {}),
                                        "runs": list(runs.values())}, indent=1, default=str))


def _flag_values(args: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """{flag: the values after it} of a run's toymlx-train arguments."""
    out: dict[str, tuple[str, ...]] = {}
    flag = None
    for a in args:
        if a.startswith("--"):
            flag, _, value = a.partition("=")
            out[flag] = (value,) if value else ()
        elif flag is not None:
            out[flag] += (a,)
    return out


def _leaves(options: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key with underscores: value} of a config file's (nested) options."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        key = prefix + str(k).replace("-", "_")
        out.update(_leaves(v, key + ".") if isinstance(v, Mapping) else {key: v})
    return out


def _grid_keys(keys: Iterable[str]) -> str:
    """A grid's keys as the messages name them: `lr x lora.rank` (every combination)."""
    return " x ".join(keys)


def _grid_changed(runs: Iterable[Mapping[str, Any]], specs: Sequence[RunSpec]) -> str | None:
    """What `changed_options` says of a grid of other keys than the recorded runs' (None: the
    same keys, in the same order): its runs, named by other keys, matched none recorded, and
    the two grids shared one sweep folder, table and report (`--grid lr=...`, then
    `--grid lora.rank=...` under the same --sweep-id). The record holds one grid's runs:
    `_check_one_grid` refuses a mixed one first."""
    then = next((tuple(r["params"]) for r in runs if isinstance(r.get("params"), dict)), None)
    now = tuple(specs[0].params) if specs else ()
    if then is None or now == then:
        return None
    # the same keys in another order name the same runs otherwise (lr=0.001_lora.rank=4 and
    # lora.rank=4_lr=0.001): each would run twice
    order = ": runs are named by the keys in order" if set(now) == set(then) else ""
    return (f"the grid's keys ({_grid_keys(now)} now, {_grid_keys(then)} when the sweep "
            f"started{order})")


def _was(key: str, now: str, then: str) -> str:
    """A changed option as `changed_options` names it: `--steps (3 now, 2 when the sweep
    started)`."""
    return f"{key} ({now} now, {then} when the sweep started)"


def _check_one_grid(path: Path, runs: Iterable[Mapping[str, Any]], names: int = 4) -> None:
    """Refuse a record whose runs are of several grids (keys, or their order), naming each
    grid's runs and what to do: a toymlx before `_grid_changed` ran another grid's runs into a
    sweep folder, and either grid, run again there, went on mixed with the other in one table
    and report."""
    grids: dict[tuple, list[str]] = {}
    for r in runs:
        if isinstance(r.get("params"), dict):
            grids.setdefault(tuple(r["params"]), []).append(str(r.get("name")))
    if len(grids) < 2:
        return
    said = "; ".join(f"{_grid_keys(keys)}: {', '.join(who[:names])}"
                     + (f", and {len(who) - names} more" if len(who) > names else "")
                     for keys, who in grids.items())
    raise ValueError(f"{path}: expected the runs of one grid, found {len(grids)} grids' runs "
                     f"mixed in one sweep folder by an earlier toymlx ({said}); give a new "
                     f"--sweep-id to run a grid in a folder of its own (the runs here stay as "
                     f"they are: toymlx-report {path.parent} shows them)")


def changed_options(sweep_dir: Path, recipe: str, specs: Sequence[RunSpec],
                    run_options: Mapping[str, Any] | None,
                    inputs: Iterable[tuple[str, Any]] = ()) -> list[str]:
    """What differs from the sweep already in `sweep_dir` (its sweep.json; one whose runs are
    of several grids is refused: `_check_one_grid`): the recipe, keys of the options every run
    takes from the config file, the grid's keys (`_grid_changed`), flags of a run of the same
    name, and an input path (`inputs`, (flag, path) as typed) that names another file than when
    the sweep started ("FLAG (PATH: FILE here, FILE then)"); [] for a new sweep, or the same one
    (more values of its keys add runs)."""
    try:
        old = json.loads((sweep_dir / report.SWEEP_FILE).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ValueError(f"{sweep_dir / report.SWEEP_FILE}: expected the sweep's record (JSON), "
                         f"found {e}") from None
    if not isinstance(old, dict):  # a damaged file: bad input, one line
        raise ValueError(  # noqa: TRY004
f"{sweep_dir / report.SWEEP_FILE}: expected the sweep's record (a JSON "
                         f"object), found {type(old).__name__}")
    runs = {r.get("name"): r for r in old.get("runs", []) if isinstance(r, dict)}
    _check_one_grid(sweep_dir / report.SWEEP_FILE, runs.values())
    if old.get("recipe") != recipe:
        return ["recipe"]
    before, now = _leaves(old.get("run_options") or {}), _leaves(run_options or {})
    # each with its value now and then: "found --steps changed" left the user to dig the old
    # value out of sweep.json to put it back
    changed = [_was(k, *(json.dumps(x[k], default=str) if k in x else "none"
                         for x in (now, before)))
               for k in sorted(before.keys() | now.keys()) if before.get(k, ...) != now.get(k, ...)]
    if grid := _grid_changed(runs.values(), specs):
        changed.insert(0, grid)
    said = set()
    for s in specs:
        if s.name in runs:
            a, b = _flag_values(runs[s.name].get("args", [])), _flag_values(s.args)
            for f in sorted(a.keys() | b.keys()):
                if a.get(f) != b.get(f) and f not in said:
                    said.add(f)
                    changed.append(_was(f, *(" ".join(x[f]) or "given" if f in x else "not given"
                                             for x in (b, a))))
    then = old.get(INPUT_FILES_KEY) or {}
    for flag, path in inputs:
        was = then.get(f"{flag} {path}") if isinstance(path, str) else None
        if was is not None and (here := os.path.realpath(path)) != was:
            changed.append(f"{flag} ({path}: {here} here, {was} when the sweep started)")
    return changed
