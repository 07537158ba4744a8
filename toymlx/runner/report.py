"""Summaries and plots of run bundles: the code `toymlx-report` and `toymlx-sweep` share.

`summarize(run_dirs)` reads each bundle's `events.jsonl` (torn, resumed, eval-less or missing
bundles included) into one flat row per run; `render(run_dirs, out)` draws the training loss,
validation metric and learning-rate curves side by side, with the summary table, to a PNG or a
self-contained HTML page. matplotlib is imported only when drawing (the `report` extra).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.backend.files import counted
from toymlx.backend.lock import LOCK_FILE, held_by
from toymlx.backend.notice import warn
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import damage_note, moved_damage, read_events, read_log
from toymlx.bundle.folder import CONFIG_FILE, saved_config
from toymlx.bundle.options import RunError, is_run_local
from toymlx.runner.bundle import Bundle

SWEEP_FILE = "sweep.json"
# metric -> True when higher is better
METRICS = {"val_loss": False, "accuracy": True}


def _series(events: list[dict], kind: str) -> list[dict]:
    """Events of `kind` by step, as the finished bundle tells them: when a resumed segment
    starts at step S, what an earlier segment logged after S was redone, so it is dropped."""
    out: dict[int, dict] = {}
    for e in events:
        if e["kind"] == "run_start":
            start = int(e.get("start_step") or 0)
            out = {s: v for s, v in out.items() if s <= start}
        elif (e["kind"] == kind and isinstance(e.get("step"), int)
              and e.get("split", "val") != "test"):  # a test score is no point of a curve
            out[e["step"]] = e
    return [out[s] for s in sorted(out)]


def test_scores(events: list[dict]) -> dict[str, float]:
    """The run's held-out test figures (`--test`: the `eval` event with split "test" a completed
    run ends with), {} without one."""
    tests = [e for e in events if e["kind"] == "eval" and e.get("split") == "test"]
    return {k: tests[-1][k] for k in TEST_COLUMNS if number(tests[-1].get(k)) is not None
            } if tests else {}


def number(v: Any) -> float | None:
    """A finite float from an event field (NaN/inf are stored as strings), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"d_model": 32}} -> {"model.d_model": 32}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_status(events: list[dict]) -> tuple[str, str | None]:
    """completed | error | diverged | interrupted | stopped | torn | empty, and its message,
    of a bundle's events (`torn`: started or resumed, and no run_end since: killed, or
    `running` where `summarize_run` finds its process holding the run's lock)."""
    status, message = "empty", None
    for e in events:
        if e["kind"] in ("run_start", "resume"):
            status, message = "torn", None
        elif e["kind"] == "run_end":
            status, message = e.get("reason", "unknown"), e.get("message")
    return status, message


def summarize_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """One run bundle as a flat summary row (see `summarize`)."""
    run_dir = Path(run_dir)
    try:
        bundle = Bundle.open(run_dir, "toymlx-report")
        saved: dict[str, Any] | None = bundle.saved
        log = bundle.log
    except RunError as e:  # a damaged or unfinished bundle: show what its files still tell
        if (run_dir / CONFIG_FILE).is_file():  # damaged, as every other reader would say
            warn(f"{e}; its row shows what its files still tell")
        saved = saved_config(run_dir)
        log = read_log(run_dir) if run_dir.is_dir() else None
    events = log.events if log is not None else []
    status, message = run_status(events)
    if status == "torn" and run_dir.is_dir() and held_by(run_dir / LOCK_FILE) is not None:
        status = "running"  # its process holds the lock: training now, not killed
    if log is not None and (note := damage_note(log.path, log.damaged)):
        # a killed run's torn line is said by its status; a garbled line no kill leaves is not
        if status == "torn":
            note += (f"; its last line, {log.lines}, is cut short too" if log.cut_short else
                     "") + ", so its status \"torn\" (no run_end) may be the damage's, not a kill's"
        warn(f"{note}; its row shows what the other lines tell")
    if log is not None and (moved := moved_damage(events)):
        warn(f"{log.path}: {moved}")  # cut out by a resume: no other trace of it is left
    if run_dir.is_dir() and held_by(run_dir / LOCK_FILE) is None:  # not a resume cutting it now
        try:
            cut = ck.read_rewind(run_dir)
        except ck.ResumeError as e:
            warn(str(e))
            cut = None
        if cut is not None:
            warn(f"{run_dir / ck.REWIND}: a resume --from step_{cut['step']} was stopped while "
                 f"it cut the run back to step_{cut['step']} (its checkpoint, as every reader "
                 "takes it): its row shows the record as the cut left it; toymlx-train --resume "
                 f"{run_dir} finishes the cut")
    if not run_dir.exists():
        status = "missing"
    starts = [e for e in events if e["kind"] == "run_start"]
    config: dict[str, Any] = {}
    recipe = starts[-1].get("recipe") if starts else None
    if saved is not None:
        config, recipe = saved["config"], recipe or saved.get("recipe")
    elif starts:
        config = starts[-1].get("config", {})
    steps = [e for e in _series(events, "step") if number(e.get("loss")) is not None]
    evals = _series(events, "eval")
    metric = ("accuracy" if any(number(e.get("accuracy")) is not None for e in evals)
              else "val_loss")
    scored = [(e["step"], number(e.get(metric))) for e in evals]
    scored = [(s, v) for s, v in scored if v is not None]
    best = (max if METRICS[metric] else min)(scored, key=lambda sv: sv[1]) if scored else None
    rate_key = next((k for e in steps for k in e if k.endswith("_per_s")), None)
    rates = [e[rate_key] for e in steps if number(e.get(rate_key)) is not None] if rate_key else []
    # wall time: each process's event clock starts at 0, so add up the segments' last clocks
    wall, seg = 0.0, 0.0
    for e in events:
        if e["kind"] == "run_start":
            wall, seg = wall + seg, 0.0
        seg = max(seg, number(e.get("t")) or 0.0)
    wall += seg
    end = next((e for e in reversed(events) if e["kind"] == "run_end"), {})
    # a resume that extended the run records its new length (config.json is never rewritten)
    planned = next((e["steps"] for e in reversed(events)
                    if e["kind"] == "resume" and isinstance(e.get("steps"), int)),
                   config.get("steps"))
    return {
        "run": run_dir.name,
        "path": str(run_dir),
        "recipe": recipe,
        "status": status,
        "message": message,
        "step": steps[-1]["step"] if steps else 0,
        "steps": planned,
        "final_loss": number(steps[-1]["loss"]) if steps else None,
        "metric": metric,
        "best": best[1] if best else None,
        "best_step": best[0] if best else None,
        "final": scored[-1][1] if scored else None,
        "final_step": scored[-1][0] if scored else None,
        **test_scores(events),
        "throughput": statistics.median(rates) if rates else None,
        "unit": rate_key.replace("_per_s", "/s") if rate_key else None,
        "wall_s": round(wall, 2) if events else None,
        # the last segment's: a resume may run on another number of ranks (toymlx-launch -n)
        "world_size": next((e.get("world_size", 1) for e in reversed(events)
                            if e["kind"] in ("run_start", "resume")), None),
        "peak_memory_mb": end.get("peak_memory_mb"),
        # the table's `steps` column: the length the run was last given, as the `step` beside it
        "config": {**flatten(config), **({"steps": planned} if "steps" in config else {})},
    }


def summarize(run_dirs: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Flat summary rows, one per bundle, in the order given.

    Each row: run, path, recipe, status (completed / error / diverged / interrupted / stopped
    / torn: no run_end / empty: no events / missing), message, step reached, steps planned,
    final_loss, metric (val_loss, or accuracy when the eval events carry it), best and
    best_step, final and final_step of that metric (None without eval), test_loss and
    test_perplexity (a language model) or test_accuracy (a classifier) where the run has a test
    score (`--test`), throughput (median of
    the step events' tokens/s or images/s) and unit, wall_s (summed over resumed segments),
    world_size, peak_memory_mb, and config (config.json flattened to dotted keys).
    """
    return [summarize_run(d) for d in run_dirs]


def sort_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first by each row's best metric (val_loss ascending, accuracy descending):
    completed runs, then the others (torn, diverged, ...), then rows without a metric, each
    group in metric order (given order among equals)."""
    def key(r):
        if r.get("best") is None:
            return (2, False, 0.0)
        sign = -1.0 if METRICS.get(r["metric"], False) else 1.0
        return (0 if r["status"] == "completed" else 1, r["metric"] != "val_loss",
                sign * r["best"])
    return sorted(rows, key=key)


def expand_dirs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Run bundles named by `paths`: each is a bundle, or a folder of bundles (a sweep); a run
    named twice (a sweep and one of its runs) is shown once."""
    out: list[Path] = []
    for p in map(Path, paths):
        if _is_bundle(p):
            subs = [p]
        elif p.is_dir():
            names = sweep_order(p)
            subs = [p / n for n in names] if names else sorted(
                (c for c in p.iterdir() if _is_bundle(c)), key=lambda c: c.name)
            if not subs:
                # `toymlx-report runs`, the folder of sweeps: "found neither" did not say where
                # the runs were
                sweeps = sorted(c.name for c in p.iterdir() if sweep_order(c))
                found = (f"a folder of sweeps ({', '.join(sweeps[:3])}"
                         f"{', ...' if len(sweeps) > 3 else ''}): name them, as in "
                         f"toymlx-report {p / sweeps[0]}" if sweeps
                         else ck.not_one_run(p) or "neither")  # a run's weights/: the run
                raise ValueError(f"{p}: expected a run bundle (events.jsonl or config.json) or a "
                                 f"folder of run bundles, found {found}")
        else:
            run = next((d for d in (p.parent, p.parent.parent) if p.is_file() and _is_bundle(d)
                        and (d == p.parent or p.parent.name == "weights")), None)
            found = (f"a file of the run {run}; name the run: {run}" if run is not None
                     else "a file" if p.exists() else "nothing")
            raise ValueError(f"{p}: expected a run bundle or sweep folder, found {found}")
        seen = {d.resolve() for d in out}
        out.extend(d for d in subs if d.resolve() not in seen)
    return out


def _is_bundle(p: Path) -> bool:
    return (p / "events.jsonl").is_file() or (p / "config.json").is_file()


def sweep_order(p: Path) -> list[str]:
    """The run names of the sweep folder `p` in sweep.json's order ([] without one)."""
    try:
        return [r["name"] for r in json.loads((p / SWEEP_FILE).read_text())["runs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def sweep_params(run_dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """run path -> its swept values, for bundles that belong to a sweep (sweep.json beside)."""
    out: dict[str, dict[str, Any]] = {}
    for parent in {Path(d).parent for d in run_dirs}:
        try:
            runs = json.loads((parent / SWEEP_FILE).read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for r in runs:
            out[str(parent / r["name"])] = r.get("params", {})
    return out


def add_params(rows: list[dict[str, Any]]) -> list[str]:
    """Give each row a `params` dict and return the parameter names in column order: a sweep's
    swept values; else the config keys that differ between the rows, and where the rows are of
    several recipes (`recipes`), only those that differ among runs of the same recipe (each
    recipe's options differ from another's by being its own: a vit-tiny, a from-scratch and a
    lora run side by side differed in ~30, the table then ~40 columns; `all_options` keeps them
    for the CSV)."""
    swept = sweep_params([Path(r["path"]) for r in rows])
    if rows and all(r["path"] in swept for r in rows):
        names: list[str] = []
        for r in rows:
            r["params"] = swept[r["path"]]
            names += [k for k in r["params"] if k not in names]
        return names
    names = all_options(rows)
    if len(recipes(rows)) > 1:
        groups = [[r for r in rows if r.get("recipe") == name] for name in recipes(rows)]
        names = [k for k in names if any(len(g) > 1 and _differ(g, k) for g in groups)]
    for r in rows:
        r["params"] = {k: r["config"].get(k) for k in names}
    return names


def recipes(rows: list[dict[str, Any]]) -> list[str]:
    """The rows' recipes, in order of first appearance ("-" only where no row knows one): a run
    with no bundle yet (pending, or failed before writing one) is of no other recipe; counted as
    one, it gave a one-recipe sweep a recipe column and every option as a summary.csv column."""
    out: list[str] = []
    for r in rows:
        if (name := r.get("recipe")) and name not in out:
            out.append(name)
    return out or ["-"]


def _differ(rows: list[dict[str, Any]], key: str) -> bool:
    return len({json.dumps(r["config"].get(key), sort_keys=True) for r in rows}) > 1


def all_options(rows: list[dict[str, Any]]) -> list[str]:
    """The config keys (not run-local ones) whose values differ between the rows, in order of
    first appearance."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["config"] if k not in keys and not is_run_local(k)]
    return [k for k in keys if _differ(rows, k)]


LABEL_PARAMS = 3
"""A legend label names at most this many parameters; a row differing in more (runs of other
recipes side by side) is labelled by its run folder's name, the table naming the values."""


def run_label(row: dict[str, Any]) -> str:
    """A short legend label: the row's parameter values (those it has), or where the rows differ
    in more than `LABEL_PARAMS` parameters, the run folder name."""
    p = row.get("params") or {}
    if len(p) > LABEL_PARAMS:
        return row["run"]
    return " ".join(f"{k.rsplit('.', 1)[-1]}={fmt(v)}" for k, v in p.items()
                    if v is not None) or row["run"]


COLUMNS = ["status", "step", "final_loss", "metric", "best", "best_step", "final", "throughput",
           "unit", "wall_s"]


TEST_COLUMNS = ["test_loss", "test_perplexity", "test_accuracy"]
"""Shown after `final`, each where a run has it (`--test`)."""


def table_rows(rows: list[dict[str, Any]], params: list[str]) -> tuple[list[str], list[list[Any]]]:
    """Header and cells of the summary table: run, its recipe where the rows are of several,
    parameters, then the figures."""
    columns = list(COLUMNS)
    tests = [c for c in TEST_COLUMNS if any(r.get(c) is not None for r in rows)]
    columns[columns.index("final") + 1:columns.index("final") + 1] = tests
    mixed = len(recipes(rows)) > 1
    header = ["run", *(["recipe"] if mixed else []), *params, *columns]
    cells = [[r["run"], *([r.get("recipe")] if mixed else []),
              *[r.get("params", {}).get(k) for k in params],
              *[r.get(c) for c in columns]] for r in rows]
    return header, cells


FIXED_MAX = 1e6
"""Floats from this size on are shown to 3 significant digits with an exponent (2.73e+18), not
as grouped digits lined up with their column's (`table_texts`)."""


def fmt(v: Any) -> str:
    """A table cell: "-" for None, floats to 4 significant digits (large ones grouped)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= FIXED_MAX:
            return f"{v:.3g}"
        if abs(v) >= 1e4:
            return f"{v:,.0f}"
        return f"{v:.4g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3g}"
    return str(v)


FIGURES = {"final_loss": 6, "best": 6, "final": 6, "test_loss": 6, "test_perplexity": 6,
           "test_accuracy": 6, "throughput": 6, "wall_s": 2}
"""The table's measured columns, each shown with one number of decimals down the column (at
most this many: wall_s is kept to 0.01 s), so their points line up."""


def _fixed(v: Any) -> bool:
    """Whether the table shows the number `v` with its column's decimals (see `FIXED_MAX`)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (isinstance(v, int) or abs(v) < FIXED_MAX))


def value_text(v: Any) -> str:
    """An option's value as a run's name and the table's parameter columns give it: a float in
    its shortest exact form (0.0003, 1e+08, 0.999999), a list joined by "+"."""
    if isinstance(v, float):
        short = f"{v:g}"
        return short if float(short) == v else repr(v)
    if isinstance(v, (list, tuple)):
        return "+".join(value_text(x) for x in v)
    return str(v)


def table_texts(header: list[str], cells: list[list[Any]],
                params: Sequence[str] = ()) -> list[list[str]]:
    """The cells as the printed, drawn and HTML tables show them: `fmt`, except a column of
    `FIGURES`, whose numbers get the decimals that show its largest to 4 significant digits
    (losses 5.145 and 4.900, not 5.145 and 4.9; throughput 1,132 and 931, not 1132 and 931.4),
    and the `params` columns, each value as the run's name gives it (`value_text`): to 4
    digits, a sweep's data.val_fraction=0.999999 read 1."""
    texts = [[fmt(v) for v in row] for row in cells]
    for i, name in enumerate(header):
        if name in params:
            for row, text in zip(cells, texts):
                text[i] = "-" if row[i] is None else value_text(row[i])
            continue
        # a number past FIXED_MAX (a diverged run's loss, 2.73e+18) keeps `fmt`'s form and sets
        # no decimals: it made the column's other losses 2 and 2 instead of 2.166 and 2.228
        values = [row[i] for row in cells if _fixed(row[i])]
        if name not in FIGURES or not values:
            continue
        largest = max(abs(v) for v in values)
        digits = 3 - math.floor(math.log10(largest)) if largest > 0 else 0
        decimals = min(max(digits, 0), FIGURES[name])
        for row, text in zip(cells, texts):
            if _fixed(row[i]):
                text[i] = f"{row[i]:,.{decimals}f}"
    return texts


def format_table(rows: list[dict[str, Any]], params: list[str]) -> str:
    """The summary as aligned plain text: numbers to the right of their column, text to the
    left."""
    header, cells = table_rows(rows, params)
    text = [header] + table_texts(header, cells, params)
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    numeric = [all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                   for v in (row[i] for row in cells)) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if right else c.ljust(w)
                       for c, w, right in zip(r, widths, numeric)).rstrip() for r in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_summary(rows: list[dict[str, Any]], params: list[str], out_dir: Path) -> None:
    """summary.csv (the table, full precision; for runs of several recipes also every other
    option that differs between them, `all_options`) and summary.jsonl (every field) in
    out_dir."""
    header, cells = table_rows(rows, params)
    more = [k for k in all_options(rows) if k not in params] if len(recipes(rows)) > 1 else []
    header += [*more, "message", "path"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for r, row in zip(rows, cells):
        w.writerow(["" if v is None else v for v in [*row, *[r["config"].get(k) for k in more],
                                                      r.get("message"), r["path"]]])
    atomic.write_text(out_dir / "summary.csv", buf.getvalue())
    lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
    atomic.write_text(out_dir / "summary.jsonl", lines)


def _curves(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    events = read_events(run_dir) if Path(run_dir).is_dir() else []
    steps, evals = _series(events, "step"), _series(events, "eval")
    out = {"loss": [], "lr": [], "val_loss": [], "accuracy": []}
    for e in steps:
        for k in ("loss", "lr"):
            if number(e.get(k)) is not None:
                out[k].append((e["step"], float(e[k])))
    for e in evals:
        for k in ("val_loss", "accuracy"):
            if number(e.get(k)) is not None:
                out[k].append((e["step"], float(e[k])))
    return out


def _ema(ys: list[float], span: int) -> list[float]:
    a, out, m = 2.0 / (span + 1), [], ys[0]
    for y in ys:
        m = a * y + (1 - a) * m
        out.append(m)
    return out


def figure(rows: list[dict[str, Any]], params: list[str], table: bool = True):
    """A matplotlib Figure: loss, validation metric and LR curves side by side, and (with
    `table`) the summary table below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n_rows = len(rows)
    table_h = 0.32 * (n_rows + 1) + 0.4 if table else 0.0
    fig = plt.figure(figsize=(16, 4.6 + table_h), dpi=110)
    grid = fig.add_gridspec(2 if table else 1, 3, height_ratios=[4.6, table_h] if table else [1],
                            hspace=0.35, wspace=0.25)
    ax_loss, ax_val, ax_lr = (fig.add_subplot(grid[0, i]) for i in range(3))
    colors = plt.get_cmap("tab10" if n_rows <= 10 else "tab20")
    # runs of several recipes: each by its folder's name (a value names no run across recipes)
    labels = [run_label(r) if len(recipes(rows)) == 1 else r["run"] for r in rows]
    if len(set(labels)) < len(labels):
        labels = [r["run"] if lab == r["run"] else f"{r['run']}: {lab}"
                  for r, lab in zip(rows, labels)]
    metrics = {r["metric"] for r in rows if r.get("best") is not None}
    lr_curves: list[list[tuple[int, float]]] = []
    for i, r in enumerate(rows):
        c = colors(i % colors.N)
        cur = _curves(r["path"])
        label = labels[i] + ("" if r["status"] == "completed" else f" [{r['status']}]")
        if cur["loss"]:
            xs, ys = zip(*cur["loss"])
            if len(ys) >= 20:
                ax_loss.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
                ax_loss.plot(xs, _ema(list(ys), max(5, len(ys) // 20)), color=c, lw=1.6,
                             label=label)
            else:
                ax_loss.plot(xs, ys, color=c, lw=1.4, label=label)
        else:
            ax_loss.plot([], [], color=c, label=label + " (no steps)")
        metric = r["metric"]
        if cur[metric]:
            xs, ys = zip(*cur[metric])
            ax_val.plot(xs, ys, color=c, lw=1.4, marker="o", ms=3.5)
        lr_curves.append(cur["lr"])
        if cur["lr"]:
            xs, ys = zip(*cur["lr"])
            ax_lr.plot(xs, ys, color=c, lw=1.4)
    ax_loss.set_title("training loss")
    ax_val.set_title("validation: " + " / ".join(sorted(metrics) or ["(no eval events)"]))
    ax_lr.set_title("learning rate")
    for ax in (ax_loss, ax_val, ax_lr):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 on a short run
        ax.grid(alpha=0.3)
    peaks = [max(y for _, y in c) for c in lr_curves if c]
    if peaks and min(peaks) > 0 and max(peaks) / min(peaks) > 10:
        ax_lr.set_yscale("log")  # peak LRs a decade or more apart: keep the small ones visible
    else:
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_loss.legend(fontsize=8, loc="upper right")
    if table:
        ax_t = fig.add_subplot(grid[1, :])
        ax_t.axis("off")
        header, cells = table_rows(rows, params)
        t = ax_t.table(cellText=table_texts(header, cells, params), colLabels=header,
                       loc="upper center", cellLoc="center")
        t.auto_set_font_size(False)
        t.set_fontsize(8)
        t.auto_set_column_width(list(range(len(header))))  # a long run name inside its cell
        t.scale(1, 1.25)
        for (ri, _), cell in t.get_celld().items():
            if ri == 0:
                cell.set_facecolor("#e8e8e8")
            elif ri - 1 < n_rows:
                cell.get_text().set_color(colors((ri - 1) % colors.N))
    return fig


REPORT_MARK = "toymlx-report"
"""What a report this module draws says wrote it: the PNG's `Software` text chunk, the HTML's
generator meta tag. `toymlx-report` run again replaces a file so marked (its curves drawn
afresh, as TensorBoard's are) and refuses any other file of that name without --overwrite."""
HTML_MARK = f"<meta name='generator' content='{REPORT_MARK}'>"


def is_report(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file `render` wrote (it bears `REPORT_MARK`): the PNG's text
    chunks come before its image data, the HTML's meta tag in its head, both in the first KiB."""
    path = Path(path)
    if not path.is_file():  # missing, a folder, a FIFO (never opened: it could block)
        return False
    with open(path, "rb") as f:
        head = f.read(4096)
    return (head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + REPORT_MARK.encode() in head
            or HTML_MARK.encode() in head)


def check_report_name(out: str | os.PathLike) -> Path:
    """`out` as a Path; ValueError unless it names a .png or .html file (what `render` draws),
    so a command checks it before summarizing anything."""
    out = Path(out)
    if out.suffix.lower() not in (".png", ".html", ".htm"):
        raise ValueError(f"--out: expected a .png or .html file name, found {out.name!r}")
    return out


def render(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike,
           rows: list[dict[str, Any]] | None = None,
           params: list[str] | None = None) -> Path:
    """Write the report of `run_dirs` to `out` (.png: curves + table panel; .html: curves
    and an HTML table, self-contained); returns the path written."""
    out = check_report_name(out)
    if rows is None:
        rows = sort_rows(summarize(run_dirs))
    if params is None:
        params = add_params(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    import matplotlib.pyplot as plt

    if out.suffix.lower() == ".png":
        fig = figure(rows, params, table=True)
        try:
            with atomic.atomic_open(out) as f:
                fig.savefig(f, format="png", bbox_inches="tight",
                            metadata={"Software": REPORT_MARK})
        finally:
            plt.close(fig)
        return out
    fig = figure(rows, params, table=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    atomic.write_text(out, _html(rows, params, base64.b64encode(buf.getvalue()).decode()))
    return out


def _html(rows: list[dict[str, Any]], params: list[str], png_b64: str) -> str:
    header, cells = table_rows(rows, params)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = ""
    for r, row in zip(rows, table_texts(header, cells, params)):
        tds = "".join(f"<td>{html.escape(v)}</td>" for v in row)
        title = html.escape(r.get("message") or r["path"], quote=True)
        body += f'<tr title="{title}">{tds}</tr>\n'
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"{HTML_MARK}<title>toymlx report</title>\n"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;"
        "font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#eee}img{max-width:100%}</style></head><body>\n"
        f"<h2>toymlx report: {counted(len(rows), 'run')}</h2>\n"
        f"<img alt='loss, validation and learning-rate curves' "
        f"src='data:image/png;base64,{png_b64}'>\n"
        f"<table><tr>{head}</tr>\n{body}</table>\n"
        "<p>best/final: the validation metric (val_loss: lower is better; accuracy: higher is "
        "better); throughput: median over step events; hover a row for its path or error."
        "</p>\n</body></html>\n")
