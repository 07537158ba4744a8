"""The Python entry point: train a recipe from a script or a notebook at the command's speed.

    import toymlx

    run = toymlx.train("lora", base="SmolLM2-135M-Instruct.Q4_1.gguf",
                       data={"path": "chat.jsonl"}, steps=50, seq_len=256)
    run["status"], run["final_loss"], run["path"]

`train` runs `toymlx-train --recipe NAME` in a fresh child process, with `options` spelled as
its flags (`seq_len=256` is `--seq-len 256`, `data={"path": p}` is `--data.path p`, `True`/
`False` are `--flag`/`--no-flag`), relays its output, and returns the bundle's summary row
(`toymlx.runner.report.summarize_run`). Bad options are the command's own one-line error, raised as
`ValueError`; a run that fails raises `TrainError`, naming its bundle.

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
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from toymlx.backend.lifeline import child_env
from toymlx.backend.stop import READER_GONE


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
        name = prefix + str(key).replace("_", "-")
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


def train(recipe: str, *, echo: bool = True, **options: Any) -> dict[str, Any]:
    """Train `recipe` with `options` (the flags of `toymlx-train --recipe RECIPE --help`) in a
    fresh process; return the run's summary (status, steps, final loss, held-out metric,
    throughput, path). `echo=False` keeps the child's output to the error message."""
    from toymlx.bundle.options import default_run_id
    from toymlx.runner.report import summarize_run

    options = _python_names(options)
    resume = options.get("resume")
    if resume is None and options.get("run_id") is None:
        options["run_id"] = default_run_id(recipe)  # known here, so the bundle can be read
    run_dir = (Path(resume) if resume is not None
               else Path(options.get("runs_root") or "runs") / options["run_id"])
    cmd = [sys.executable, "-m", "toymlx_cli.train", "--recipe", recipe, *option_flags(options)]
    record = run_dir / "events.jsonl"
    before = _stamp(record)
    tail = _run_child(cmd, echo)
    summary = summarize_run(run_dir) if record.exists() else None
    if tail.returncode == 0:
        return summary if summary is not None else {"path": str(run_dir), "status": "empty"}
    last = tail.last_line or f"exit status {tail.returncode}"
    # exit 2 is a refusal of the options, or a run that diverged: only the latter writes the
    # bundle's record (a refused --run-id of an existing run leaves that run's as it was)
    if tail.returncode == 2 and _stamp(record) == before:
        raise ValueError(tail.message())
    raise TrainError(f"{last} (bundle: {run_dir})", tail.returncode, summary)


def _python_names(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with each name as Python spells it (`**{"run-id": x}` is run_id=x), so the
    names `train` reads itself (run_id, resume, runs_root) are found however they were given;
    ValueError for one option given in both spellings, or a value no flag can carry."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name in out:
            raise ValueError(f"{key}: given twice, as {name} and {key}")
        if not isinstance(value, (str, int, float, bool, os.PathLike, dict, list, tuple,
                                  type(None))):
            raise ValueError(  # noqa: TRY004  (a bad option: ValueError, as the module says)
                f"{name}: expected a str, number, bool, path, dict (a group of "
                f"options) or list, found {type(value).__name__}")
        out[name] = _python_names(value) if isinstance(value, dict) else value
    return out


def _stamp(path: Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of `path`, None where it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class _Output:
    """What `_run_child` keeps of the child's output: the exit status and the last line."""

    def __init__(self) -> None:
        self.returncode, self.last_line, self._buf = -1, "", b""

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


def _run_child(cmd: list[str], echo: bool) -> _Output:
    """Run `cmd` tied to this process (it stops if this one dies), its stdout and stderr relayed
    to `sys.stdout` (a notebook's cell output too) as they come; Ctrl-C here is passed on as
    the child's own Ctrl-C, then raised here once the child has stopped; so is a reader of this
    process's output gone (`python script.py | head -3`: the child's own reader gone, SIGPIPE,
    then BrokenPipeError here)."""
    out, text = _Output(), codecs.getincrementaldecoder("utf-8")(errors="replace")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=child_env())
    interrupted, reader_gone = False, None
    assert child.stdout is not None
    while True:
        try:
            chunk = os.read(child.stdout.fileno(), 65536)
        except KeyboardInterrupt:
            interrupted = True
            child.send_signal(signal.SIGINT)  # the run checkpoints and ends cleanly
            continue
        if not chunk:
            break
        out.feed(chunk)
        if echo and reader_gone is None:
            try:
                sys.stdout.write(text.decode(chunk))
                sys.stdout.flush()
            except BrokenPipeError as e:
                # raised now, it left the child orphaned, stopped by its lifeline as a SIGTERM
                reader_gone = e
                child.send_signal(READER_GONE)  # the run checkpoints and ends with exit 141
    out.returncode = child.wait()
    if interrupted:
        raise KeyboardInterrupt
    if reader_gone is not None:
        raise reader_gone
    return out
