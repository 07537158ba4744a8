"""Hyper-parameter sweeps: run specs from a grid or random draws, run as `toymlx-train`
subprocesses in parallel workers, resumable, shardable over machines sharing a runs folder.

    specs = grid(["--steps", "200"], {"lr": [1e-3, 3e-3], "model.d_model": [64, 128]})
    result = run_sweep("from-scratch", specs, root="runs", workers=2)

Every combination is its own run bundle, `<root>/<sweep_id>/<run name>`, named from its
values. A sweep folder also holds `sweep.json` (the specs), `logs/<run>.log` (each run's
output), `.locks/` (one `flock` per run while a sweep runs it, so two sweeps, or machines
sharing the folder over a filesystem with locks such as NFS, never run one run twice; the lock
dies with its holder), `.status/` (exit codes), and at the end `summary.csv`, `summary.jsonl`
and `report.png`. Each run is a `toymlx-train` child tied to the sweep: if the sweep is
killed, its children checkpoint and stop. Starting the same sweep again skips completed runs,
resumes torn or interrupted ones from their latest checkpoint, retries failed ones, and leaves
alone any run whose bundle another live process still owns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import random as _random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from toymlx.backend import atomic
from toymlx.backend.lifeline import child_env
from toymlx.backend.lock import LOCK_FILE, Lock, LockHeld, acquire
from toymlx.bundle.checkpoint import resolve_latest
from toymlx.bundle.events import parse_event, read_events
from toymlx.bundle.outputs import check_output
from toymlx.bundle.runs import BUNDLE_PICK, flag_name
from toymlx.runner import report

RESERVED = ("--recipe", *(flag_name(k) for k in BUNDLE_PICK))
"""Flags the sweep sets on each run itself."""

MAX_RUNS = 10_000
"""The most runs one sweep plans (a grid's combinations, --random N): more is a typo, and
planning them would not end."""

RUN_OPTIONS_FILE = "run-options.json"
"""In the sweep folder: the options every run takes from the sweep's config file, handed to each
new run as `toymlx-train -c` (its flags, the grid's values among them, over it)."""


# ---------------------------------------------------------------- specs

@dataclass(frozen=True)
class LogUniform:
    """Random-search distribution: log-uniform on [lo, hi], rounded to 3 significant digits."""

    lo: float
    hi: float

    def sample(self, rng: _random.Random) -> float:
        return _round3(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi))))


@dataclass(frozen=True)
class Uniform:
    """Random-search distribution: uniform on [lo, hi], rounded to 3 significant digits."""

    lo: float
    hi: float

    def sample(self, rng: _random.Random) -> float:
        return _round3(rng.uniform(self.lo, self.hi))


@dataclass(frozen=True)
class IntUniform:
    """Random-search distribution: an integer in [lo, hi], both included."""

    lo: int
    hi: int

    def sample(self, rng: _random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def _round3(x: float) -> float:
    return float(f"{x:.3g}")


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


def _name_str(v: Any) -> str:
    if isinstance(v, float):
        short = f"{v:g}"
        return short if float(short) == v else repr(v)
    if isinstance(v, (list, tuple)):
        return "+".join(_name_str(x) for x in v)
    return str(v)


def run_name(params: Mapping[str, Any]) -> str:
    """Folder name of a run from its swept values: `lr=0.0003_lora.rank=8` (stable)."""
    name = "_".join(f"{k}={_name_str(v)}" for k, v in params.items()) or "base"
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


def _check_key(key: str, types: dict[str, Any], recipe: str | None,
               where: str | None = None) -> None:
    """ValueError (starting with `where`, default `--grid KEY`) unless `key` is an option of
    the recipe."""
    key_to_flag(key)
    if types and _norm_key(key) not in types:
        close = [k for k in types if k.rsplit(".", 1)[-1] == _norm_key(key).rsplit(".", 1)[-1]]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"{where or f'--grid {key}'}: expected an option of recipe {recipe}, "
                         f"found no option {key_to_flag(key)}{hint}")


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
    given = {a.split("=", 1)[0] for a in base if a.startswith("--")}
    for k in keys:
        flag = key_to_flag(k)
        head, _, last = flag[2:].rpartition(".")
        neg = f"--{head + '.' if head else ''}no-{last}"
        if flag in given or neg in given:
            raise ValueError(f"{flag}: given both as a fixed option and in the sweep; keep one")


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
    `base_args` (toymlx-train flags, or a {key: value} dict), first key slowest. With
    `recipe`, keys are checked against its options (and typed bools spelled right)."""
    types = _field_types(recipe)
    base = _base_args(base_args, types, recipe)
    for k in axes:
        _check_key(k, types, recipe)
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
    for k in space:
        _check_key(k, types, recipe)
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
    if not sep or not key or not vals.strip():
        raise ValueError(f"--grid {text!r}: expected KEY=V1,V2,... (e.g. lr=1e-4,3e-4)")
    types = _field_types(recipe)
    _check_key(key, types, recipe)
    m = _RANGE.fullmatch(vals.strip())
    if m:
        return key, _range(*m.groups(), where=f"--grid {text!r}")
    t = types.get(_norm_key(key))
    return key, [_parse_value(v.strip(), t, key) for v in vals.split(",")]


def file_axis(key: str, values: Any, recipe: str | None, where: str) -> Any:
    """A grid axis as a config file gives it (`where` names the file and the key): a list of
    values, each typed by the recipe's option as `parse_axis` types a --grid value, or a
    "log:LO:HI" (uniform:, int:) range for --random; ValueError starting with `where`."""
    types = _field_types(recipe)
    _check_key(key, types, recipe, where)
    m = _RANGE.fullmatch(values.strip()) if isinstance(values, str) else None
    if m:
        return _range(*m.groups(), where=where)
    if not isinstance(values, list) or not values or any(isinstance(v, (list, dict))
                                                         for v in values):
        raise ValueError(f'{where}: expected a list of values or a "log:LO:HI" range, found '
                         f"{json.dumps(values)}")
    t = types.get(_norm_key(key))
    return [_parse_value(_arg_str(v), t, key, where) for v in values]


_RANGE = re.compile(r"(log|uniform|int):([^:]+):([^:]+)")
"""A --random range: log:LO:HI, uniform:LO:HI or int:LO:HI."""


def _range(kind: str, lo: str, hi: str, where: str) -> LogUniform | Uniform | IntUniform:
    try:
        if kind == "int":
            dist: Any = IntUniform(int(lo), int(hi))
        else:
            dist = (LogUniform if kind == "log" else Uniform)(float(lo), float(hi))
    except ValueError:
        raise ValueError(f"{where}: expected {kind}:LO:HI with numbers") from None
    if dist.lo > dist.hi or (kind == "log" and dist.lo <= 0):
        raise ValueError(f"{where}: expected 0 < LO <= HI" if kind == "log"
                         else f"{where}: expected LO <= HI")
    return dist


def _parse_value(s: str, t: Any, key: str, where: str | None = None) -> Any:
    """A --grid value (text) as the option's type `t` wants it; ValueError starting with
    `where` (default `--grid KEY=VALUE`)."""
    args = typing.get_args(t)
    if s == "None" and (t is None or type(None) in args):
        return None
    if t is not None and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        t = inner[0] if len(inner) == 1 else None
    found = f", found {json.dumps(s)}" if where else ""
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
                raise ValueError(f"{where}: expected a {cast.__name__}{found}") from None
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


# ---------------------------------------------------------------- bundle state

def run_state(run_dir: Path) -> str:
    """new | completed | diverged | failed (error) | resumable (torn, interrupted, stopped).

    A diverged run is a result (that configuration blows up), not a fault: like a completed
    one it is not run again."""
    status = report.run_status(read_events(run_dir))[0] if run_dir.is_dir() else "empty"
    if status in ("completed", "diverged"):
        return status
    if status == "error":
        return "failed"
    if status == "empty":
        return "new"
    return "resumable"


def _has_checkpoint(run_dir: Path) -> bool:
    try:
        resolve_latest(run_dir)
        return True
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------- live view

class _Tail:
    """New complete events of a growing events.jsonl (a torn last line waits). A file replaced
    by a resume (cut back to its checkpoint) is read again from its start."""

    def __init__(self, path: Path, skip_existing: bool = False):
        self.path = path
        self.ino, self.offset = None, 0
        if skip_existing and path.is_file():
            st = path.stat()
            self.ino, self.offset = st.st_ino, st.st_size

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.ino or st.st_size < self.offset:
                    self.ino, self.offset = st.st_ino, 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = (parse_event(raw) for raw in data[:end].splitlines())
        return [ev for ev in events if ev is not None]


@dataclass
class _Run:
    spec: RunSpec
    dir: Path
    state: str = "pending"
    """pending, waiting, running, done, skipped, failed, stopped, interrupted, elsewhere"""
    proc: subprocess.Popen | None = None
    lock: Lock | None = None
    """This sweep's claim on the run, held while its child trains."""
    log: Any = None
    tail: _Tail | None = None
    action: str = ""
    step: int = 0
    steps: int | None = None
    loss: float | None = None
    metric: str = "val_loss"
    val: float | None = None
    rate: float | None = None
    unit: str = ""
    started: float = 0.0
    wall: float | None = None
    message: str | None = None
    reason: str | None = None
    """run_end reason seen in this attempt's events"""
    wait_until: float = 0.0
    retry_at: float = 0.0
    """While "waiting" for another process to release the bundle: until when, and when next."""

    def absorb(self, events: list[dict]) -> None:
        for e in events:
            kind = e["kind"]
            if kind == "run_start":
                self.steps = (e.get("config") or {}).get("steps", self.steps)
                self.step = int(e.get("start_step") or 0)
            elif kind == "resume":
                self.steps = e.get("steps", self.steps)
                self.step = int(e.get("from_step") or 0)
            elif kind == "step":
                self.step = e.get("step", self.step)
                self.loss = report.number(e.get("loss"))
                for k, v in e.items():
                    if k.endswith("_per_s"):
                        self.rate, self.unit = report.number(v), k.replace("_per_s", "/s")
            elif kind == "eval":
                if "accuracy" in e:
                    self.metric = "accuracy"
                self.val = report.number(e.get(self.metric))
            elif kind == "run_end":
                self.reason, self.message = e.get("reason"), e.get("message")

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class _View:
    """The live progress table: redrawn in place on a TTY, one line per change otherwise."""

    def __init__(self, stream: TextIO, enabled: bool):
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.drawn = 0
        self.last: dict[str, str] = {}
        self.t_draw = 0.0

    def cells(self, r: _Run) -> list[str]:
        steps = f"{r.step}/{r.steps}" if r.steps else str(r.step or "-")
        wall = r.wall if r.wall is not None else (time.time() - r.started if r.started else None)
        state = r.state + (f" ({r.action})" if r.action and r.state == "running" else "")
        return [r.spec.name, state, steps, report.fmt(r.loss),
                f"{r.metric} {report.fmt(r.val)}" if r.val is not None else "-",
                f"{report.fmt(r.rate)} {r.unit}" if r.rate is not None else "-",
                f"{wall:.0f}s" if wall is not None else "-"]

    def update(self, runs: list[_Run], force: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            now = time.time()
            if not force and now - self.t_draw < 0.5:
                return
            self.t_draw = now
            shown = runs
            room = shutil.get_terminal_size((100, 40)).lines - 3
            if len(runs) > room:  # too tall to redraw in place: the live runs, and counts
                shown = [r for r in runs if r.state == "running"][:max(room - 1, 1)]
            rows = [["run", "state", "step", "loss", "val", "speed", "time"]]
            rows += [self.cells(r) for r in shown]
            widths = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
            text = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in rows]
            if shown is not runs:
                counts: dict[str, int] = {}
                for r in runs:
                    counts[r.state] = counts.get(r.state, 0) + 1
                text.append(", ".join(f"{n} {k}" for k, n in counts.items()))
            if self.drawn > len(text):  # a shorter table: clear the old tail too
                text += [""] * (self.drawn - len(text))
            up = f"\x1b[{self.drawn}F" if self.drawn else ""
            self.stream.write(up + "".join(f"\x1b[2K{t}\n" for t in text))
            self.stream.flush()
            self.drawn = len(text)
            return
        for r in runs:  # plain lines: a run's state, or a new validation figure
            key = f"{r.state}|{r.val}"
            if self.last.get(r.spec.name) != key and r.state not in ("pending",):
                self.last[r.spec.name] = key
                c = self.cells(r)
                self.stream.write(f"sweep: {c[0]}  {c[1]}  step {c[2]}  loss {c[3]}  {c[4]}  "
                                  f"{c[5]}  {c[6]}\n")
                self.stream.flush()


# ---------------------------------------------------------------- the sweep

@dataclass
class SweepResult:
    """What `run_sweep` did, and the summary of every run in the sweep folder."""

    sweep_dir: Path
    rows: list[dict[str, Any]]
    """summary rows (toymlx.runner.report.summarize plus `params`), best first"""
    params: list[str]
    states: dict[str, str]
    """run name -> what this call did: done, skipped, diverged, failed, stopped, interrupted,
    elsewhere (locked by another worker)"""

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.states.items() if s == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and "interrupted" not in self.states.values()


def _write_sweep_file(sweep_dir: Path, recipe: str, specs: Sequence[RunSpec],
                      run_options: Mapping[str, Any] | None = None) -> None:
    path = sweep_dir / report.SWEEP_FILE
    runs: dict[str, dict] = {}
    try:
        old = json.loads(path.read_text())
        if old.get("recipe") == recipe:
            runs = {r["name"]: r for r in old.get("runs", [])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for s in specs:
        runs[s.name] = {"name": s.name, "params": s.params, "args": list(s.args)}
    atomic.write_text(path, json.dumps({"recipe": recipe, "sweep_id": sweep_dir.name,
                                        **({"run_options": run_options} if run_options else {}),
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


def changed_options(sweep_dir: Path, recipe: str, specs: Sequence[RunSpec],
                    run_options: Mapping[str, Any] | None) -> list[str]:
    """What differs from the sweep already in `sweep_dir` (its sweep.json): the recipe, keys of
    the options every run takes from the config file, and flags of a run of the same name; []
    for a new sweep, or the same one (more runs may be added)."""
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
    if old.get("recipe") != recipe:
        return ["recipe"]
    before, now = _leaves(old.get("run_options") or {}), _leaves(run_options or {})
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k, ...) != now.get(k, ...))
    runs = {r.get("name"): r for r in old.get("runs", []) if isinstance(r, dict)}
    for s in specs:
        if s.name in runs:
            a, b = _flag_values(runs[s.name].get("args", [])), _flag_values(s.args)
            changed += [f for f in sorted(a.keys() | b.keys())
                        if a.get(f) != b.get(f) and f not in changed]
    return changed


def _recorded(sweep_dir: Path, r: _Run, key: str = "state") -> Any:
    """A field of the sweep's record of how the run's last attempt ended (None if none)."""
    try:
        return json.loads((sweep_dir / ".status" / f"{r.spec.name}.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _last_error(log: Path) -> str | None:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return None
    for x in reversed(lines):
        if x.startswith(("toymlx-train: error:", "toymlx:")):
            return x
    return lines[-1] if lines else None


class _Runner:
    """One machine's share of a sweep in flight: runs started as `toymlx-train` children,
    `workers` at a time, watched until they end, and stopped on SIGINT/SIGTERM.

    Each child is tied to this process (`lifeline`): if the sweep dies, even by SIGKILL, its
    children stop with a final checkpoint instead of training on unwatched. A child gets its
    own process group so that a terminal's Ctrl-C reaches it once, forwarded from here."""

    def __init__(self, recipe: str, sweep_dir: Path, runs: list[_Run], workers: int,
                 retry_failed: bool, busy_wait: float, python: str, view: _View,
                 stream: TextIO, run_options: Path | None = None):
        self.recipe, self.sweep_dir, self.runs, self.workers = recipe, sweep_dir, runs, workers
        self.run_options = run_options
        """The file of options every new run takes as `-c` (None: none)."""
        self.retry_failed, self.busy_wait = retry_failed, busy_wait
        self.python, self.view, self.stream = python, view, stream
        self.env = child_env(dict(os.environ, PYTHONUNBUFFERED="1"))
        # K runs share the cores: give each run's BLAS its share instead of all of them
        self.env.setdefault("OPENBLAS_NUM_THREADS",
                            str(max(1, (os.cpu_count() or 1) // workers)))
        self.signals, self.forwarded, self.stop_by = 0, 0, None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1

    def run(self) -> bool:
        """Run every run; returns whether a signal stopped the sweep."""
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: no signal handling
                pass
        try:
            pending = list(self.runs)
            while True:
                active = [r for r in self.runs if r.state == "running"]
                for r in list(pending):
                    if len(active) >= self.workers or self.signals:
                        break
                    if r.retry_at > time.time():
                        continue
                    pending.remove(r)
                    self._start(r)
                    if r.state == "running":
                        active.append(r)
                    elif r.state == "waiting":
                        pending.append(r)
                if not active and (not pending or self.signals):
                    break
                for r in active:
                    r.absorb(r.tail.read())
                    if r.proc.poll() is not None:
                        self._finish(r)
                if self.signals > self.forwarded:
                    self._forward([r for r in self.runs if r.state == "running"])
                elif self.stop_by is not None and time.time() > self.stop_by:
                    self._kill([r for r in self.runs if r.state == "running"])
                self.view.update(self.runs)
                time.sleep(0.25)
            self.view.update(self.runs, force=True)
        finally:
            self._kill([r for r in self.runs if r.state == "running"])  # on an error here
            for sig, h in old.items():
                signal.signal(sig, h)
        return self.signals > 0

    def _lock_path(self, r: _Run) -> Path:
        return self.sweep_dir / ".locks" / f"{r.spec.name}.lock"

    def _claim(self, r: _Run) -> bool:
        """Take this sweep's lock on the run (else another sweep runs it: "elsewhere"), and
        check that no process owns its bundle. One that does (a killed sweep's child writing its
        last checkpoint, a user's toymlx-train) is waited for up to `busy_wait` seconds
        ("waiting"), then left to it ("elsewhere")."""
        try:
            r.lock = acquire(self._lock_path(r), f"sweep run {r.spec.name}")
        except LockHeld as e:
            r.state, r.message = "elsewhere", str(e)
            return False
        try:
            if (r.dir / LOCK_FILE).exists():
                acquire(r.dir / LOCK_FILE, f"{r.dir}: run bundle").release()
        except LockHeld as e:
            r.release()
            now = time.time()
            r.wait_until = r.wait_until or now + self.busy_wait
            r.state = "waiting" if now < r.wait_until else "elsewhere"
            r.message, r.retry_at = str(e), now + 1.0
            return False
        return True

    def _start(self, r: _Run) -> None:
        if not self._claim(r):
            return
        state = run_state(r.dir)
        if state in ("completed", "diverged"):
            r.state = "skipped"
            r.absorb(read_events(r.dir))
            r.wall = report.summarize_run(r.dir)["wall_s"]
            r.release()
            return
        failed = state == "failed" or _recorded(self.sweep_dir, r) == "failed"
        if not self.retry_failed and failed:
            r.state = "failed"  # as recorded by the bundle, or by the sweep if it has none
            r.absorb(read_events(r.dir))
            r.message = r.message or _recorded(self.sweep_dir, r, "message")
            r.release()
            return
        if state == "resumable" and _has_checkpoint(r.dir):
            r.action = "resume"
            cmd = ["--resume", str(r.dir), "--no-progress"]
        else:  # new, failed, or stopped before its first checkpoint: start (over)
            r.action = "restart" if r.dir.exists() else "start"
            cmd = ["--recipe", self.recipe, "--runs-root", str(self.sweep_dir), "--run-id",
                   r.spec.name, "--no-progress",
                   *(["-c", str(self.run_options)] if self.run_options else []), *r.spec.args,
                   *(["--overwrite"] if r.dir.exists() else [])]
        log_path = self.sweep_dir / "logs" / f"{r.spec.name}.log"
        r.log = open(log_path, "ab")  # noqa: SIM115  (open for the run's lifetime)
        r.log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {r.action}: toymlx-train "
                    f"{' '.join(cmd)}\n".encode())
        r.log.flush()
        # a resumed run's history is shown, but its outcome is read from what it adds
        r.tail = _Tail(r.dir / "events.jsonl", skip_existing=True)
        if r.action == "resume":
            r.absorb(read_events(r.dir))
        r.reason, r.message = None, None
        r.proc = subprocess.Popen([self.python, "-m", "toymlx_cli.train", *cmd], stdout=r.log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=self.env, start_new_session=True)
        r.state, r.started = "running", time.time()

    def _finish(self, r: _Run) -> None:
        code = r.proc.wait()
        r.log.close()
        r.absorb(r.tail.read())
        r.wall = time.time() - r.started
        reason = r.reason
        if code == 0 and reason == "completed":
            r.state = "done"
        elif code == 0 and reason == "stopped":
            r.state = "stopped"
        elif reason == "diverged":
            r.state = "diverged"
        elif reason == "interrupted" or code in (130, -signal.SIGINT):
            r.state = "interrupted"
        else:
            r.state = "failed"
            r.message = r.message or _last_error(self.sweep_dir / "logs" /
                                                 f"{r.spec.name}.log") or f"exit code {code}"
        atomic.write_text(self.sweep_dir / ".status" / f"{r.spec.name}.json", json.dumps({
            "state": r.state, "exit_code": code, "message": r.message, "wall_s": r.wall,
            "host": socket.gethostname(), "finished_at": time.time()}))
        r.release()

    def _forward(self, active: list[_Run], grace: float = 120.0) -> None:
        """Pass each new signal on (SIGINT: the run checkpoints and ends; a second one skips
        that checkpoint); after `grace` seconds the rest are killed."""
        if not self.forwarded:
            self.stream.write(f"sweep: stopping {len(active)} run(s) (they checkpoint first)...\n")
            self.stop_by = time.time() + grace
        self.forwarded = self.signals
        for r in active:
            try:
                os.killpg(r.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def _kill(self, active: list[_Run]) -> None:
        for r in active:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
            self._finish(r)


def run_sweep(recipe: str, specs: Sequence[RunSpec], root: str | os.PathLike = "runs",
              workers: int = 1, shard: tuple[int, int] = (0, 1), sweep_id: str | None = None,
              *, retry_failed: bool = True, progress: bool = True, stream: TextIO | None = None,
              python: str | None = None, report_png: bool = True,
              busy_wait: float = 60.0, run_options: Mapping[str, Any] | None = None
              ) -> SweepResult:
    """Run this machine's share of `specs` as `toymlx-train` subprocesses, `workers` at a
    time, under `<root>/<sweep_id>/`; then summarize the whole sweep (summary.csv/.jsonl,
    report.png). Completed (and diverged) runs are skipped, torn ones resumed, failed ones
    retried (`retry_failed`); a run whose bundle another process owns is waited for up to
    `busy_wait` seconds, then left to it. A failure is reported and does not stop the others.
    `run_options` (a config file's, as toymlx-train -c reads one) is written to the sweep
    folder's RUN_OPTIONS_FILE and given to every new run as `-c`, the specs' flags over it."""
    if workers < 1:
        raise ValueError(f"--workers: expected >= 1, found {workers}")
    if not specs:
        raise ValueError("sweep: expected at least one run, found none")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("sweep: run names repeat; give each run distinct values")
    mine = shard_specs(specs, shard)
    stream = stream or sys.stderr
    sweep_id = sweep_id or default_sweep_id(recipe, specs, run_options)
    if "/" in sweep_id or sweep_id in ("", ".", ".."):
        raise ValueError(f"--sweep-id: expected a single folder name, found {sweep_id!r}")
    # its runs' inputs are checked by each toymlx-train; the sweep's own folder here
    sweep_dir = check_output(Path(root) / sweep_id, [], "--runs-root")
    changed = changed_options(sweep_dir, recipe, specs, run_options)
    if changed:
        raise ValueError(f"{sweep_dir}: --sweep-id {sweep_id}: expected the options this sweep "
                         f"was started with, found {', '.join(changed)} changed; give a new "
                         "--sweep-id to run the changed sweep, or put them back")
    for sub in ("logs", ".locks", ".status"):
        (sweep_dir / sub).mkdir(parents=True, exist_ok=True)
    _write_sweep_file(sweep_dir, recipe, specs, run_options)
    options_file = None
    if run_options:
        options_file = sweep_dir / RUN_OPTIONS_FILE
        atomic.write_text(options_file, json.dumps(run_options, indent=1))
    stream.write(f"sweep {sweep_dir}: {len(specs)} runs, {len(mine)} on this shard "
                 f"({shard[0]}/{shard[1]}), {workers} worker(s)\n")
    runs = [_Run(s, sweep_dir / s.name) for s in mine]
    interrupted = _Runner(recipe, sweep_dir, runs, workers, retry_failed, busy_wait,
                          python or sys.executable, _View(stream, progress), stream,
                          options_file).run()

    result = summarize_sweep(sweep_dir, report_png=report_png, stream=stream)
    result.states = {r.spec.name: r.state for r in runs}
    for r in runs:
        if r.state in ("failed", "diverged"):
            stream.write(f"sweep: {r.state.upper()} {r.spec.name}: {r.message} "
                         f"(log: {sweep_dir / 'logs' / (r.spec.name + '.log')})\n")
        elif r.state == "elsewhere":
            stream.write(f"sweep: {r.spec.name}: skipped here: {r.message}\n")
    if interrupted:
        stream.write("sweep: interrupted; run the same command again to resume\n")
    return result


def summarize_sweep(sweep_dir: str | os.PathLike, report_png: bool = True,
                    stream: TextIO | None = None) -> SweepResult:
    """Summary of every run listed in sweep_dir/sweep.json: printed, written as summary.csv
    and summary.jsonl (best first), and drawn as report.png when matplotlib is installed."""
    sweep_dir = Path(sweep_dir)
    stream = stream or sys.stderr
    names = report.sweep_order(sweep_dir)
    rows = report.summarize([sweep_dir / n for n in names])
    for r in rows:  # runs that failed before writing a bundle: the sweep's own record
        if r["status"] in ("missing", "empty"):
            try:
                st = json.loads((sweep_dir / ".status" / f"{r['run']}.json").read_text())
            except (OSError, ValueError):
                r["status"] = "pending" if r["status"] == "missing" else r["status"]
                continue
            if st.get("state") == "failed":
                r["status"], r["message"] = "failed", st.get("message")
                r["wall_s"] = round(st["wall_s"], 2) if st.get("wall_s") else None
    rows = report.sort_rows(rows)
    params = report.add_params(rows)
    report.write_summary(rows, params, sweep_dir)
    print(report.format_table(rows, params), flush=True)
    if report_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            stream.write("sweep: matplotlib is not installed (pip install 'toymlx[report]'); "
                         "no report.png\n")
        else:
            report.render([Path(r["path"]) for r in rows], sweep_dir / "report.png", rows,
                          params)
    stream.write(f"sweep: summary in {sweep_dir / 'summary.csv'}\n")
    return SweepResult(sweep_dir, rows, params, {})
