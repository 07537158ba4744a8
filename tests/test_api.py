"""The Python entry point `toymlx.train` (toymlx.runner.api): the command's flags from keyword options,
and the command's speed in a process that imported and used MLX before toymlx (the 40x cliff of
MLX's reference BLAS on Linux)."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toymlx.bundle.events import read_events
from toymlx.runner.api import option_flags

MATMUL_HEAVY = {"model": {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                          "ffn_dim": 768, "context": 128},
                "seq_len": 128, "batch_size": 8, "steps": 6, "eval_every": 0, "eval_batches": 1,
                "checkpoint_every": 0, "progress": False}
"""A from-scratch run whose step is mostly sgemm: ~4 s a step on the reference BLAS, ~0.2 s on
OpenBLAS (2 cores)."""


def test_options_are_spelled_as_the_commands_flags():
    assert option_flags({"seq_len": 64, "data": {"path": Path("a b.txt"), "shuffle": False},
                         "compile": True, "run_id": None, "lora_targets": ["q", "v"]}) == [
        "--seq-len", "64", "--data.path", "a b.txt", "--data.no-shuffle", "--compile",
        "--lora-targets", "q", "v"]


def test_a_bad_option_is_the_commands_one_line_error(tmp_path):
    import toymlx

    with pytest.raises(ValueError, match="no-such-flag"):
        toymlx.train("from-scratch", no_such_flag=1, runs_root=str(tmp_path), echo=False)


def _median_step(run: Path) -> float:
    times = [e["step_time_s"] for e in read_events(run) if e["kind"] == "step"][1:]
    return statistics.median(times)  # the first step (compiles) apart


def test_the_python_entry_trains_at_the_commands_speed_after_mlx_was_imported(tmp_path,
                                                                              shared_file):
    """A script that imported mlx.core and mlx_lm and evaluated an array first, then trains with
    toymlx.train: same BLAS as the command, and a step within 5x of the command's (the cliff is
    10-40x; the two runs are ~1.0x apart on a quiet host, up to 3.7x while other work shares a
    2-core host, so the bound catches the cliff, not the noise). The script's own MLX is switched to OpenBLAS too, silently (toymlx.backend.blas_rebind)."""
    data = str(shared_file("text/tinystories_sample.txt"))
    opts = {**MATMUL_HEAVY, "data": {"path": data}, "runs_root": str(tmp_path)}
    script = textwrap.dedent(f"""
        import json, warnings
        import mlx.core as mx
        import mlx_lm  # noqa: F401
        mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import toymlx
            from toymlx.backend.device import backend_info, setup_process
            setup_process()
        print("WARNED", json.dumps([str(w.message) for w in caught]))
        print("BACKEND", json.dumps(backend_info()))
        toymlx.train("from-scratch", run_id="entry", echo=False, **json.loads({json.dumps(
            json.dumps(opts))}))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    warned = json.loads(p.stdout.split("WARNED ", 1)[1].splitlines()[0])
    assert not any("BLAS" in w for w in warned), warned
    own = json.loads(p.stdout.split("BACKEND ", 1)[1].splitlines()[0])
    assert own["blas"] in ("openblas", "mkl") and own["blas_bound"].endswith("of libmlx.so"), own

    from toymlx.runner.api import option_flags as flags

    cmd = [sys.executable, "-m", "toymlx_cli.train", "--recipe", "from-scratch",
           *flags({**opts, "run_id": "command"})]
    assert subprocess.run(cmd, capture_output=True, cwd=tmp_path, timeout=600,
                          check=False).returncode == 0
    entry, command = tmp_path / "entry", tmp_path / "command"
    backends = [next(e for e in read_events(r) if e["kind"] == "run_start")["backend"]
                for r in (entry, command)]
    assert [b["blas_core"] for b in backends] == [backends[0]["blas_core"]] * 2, backends
    assert backends[0]["blas"] == backends[1]["blas"], backends
    ratio = _median_step(entry) / _median_step(command)
    assert ratio < 5, f"toymlx.train's step is {ratio:.1f}x the command's"


def test_the_relay_passes_the_report_lines_through(tmp_path, capsys):
    """The child has no terminal, so it draws no bar: its report lines (and validation lines)
    come through the relay as it prints them, the figures those of its events."""
    import toymlx

    toymlx.train("from-scratch", model={"d_model": 32, "n_layers": 1}, seq_len=32, batch_size=4,
                 steps=4, report_every=2, eval_every=2, eval_batches=1, checkpoint_every=0,
                 compile=False, runs_root=str(tmp_path), run_id="r")
    out = capsys.readouterr().out
    events = read_events(tmp_path / "r")
    steps = {e["step"]: e for e in events if e["kind"] == "step"}
    for n in (2, 4):
        mean = (steps[n - 1]["loss"] + steps[n]["loss"]) / 2
        assert (f"step {n}/4: train loss {mean:.4f}, lr {steps[n]['lr']:.3e}, ") in out, out
        assert f"{steps[n]['trained_tokens']} tokens trained" in out
    evals = [e for e in events if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert f"step {e['step']}: val_loss {e['val_loss']:.4f} ({e['seconds']:.2f} s)" in out


TINY = {"model": {"d_model": 32, "n_layers": 1}, "seq_len": 32, "batch_size": 4, "steps": 2,
        "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0, "compile": False}


def test_names_as_a_dict_spells_them_and_refusals_are_value_errors(tmp_path):
    """`**{"run-id": x}` is run_id=x (it once trained into a default id instead); an existing
    --run-id is the command's refusal, a ValueError, not a failed run (its bundle untouched);
    a value no flag can carry is named before anything starts."""
    import toymlx

    run = toymlx.train("from-scratch", **TINY, **{"run-id": "b10", "runs-root": str(tmp_path)},
                       echo=False)
    assert Path(run["path"]) == tmp_path / "b10" and run["status"] == "completed"
    before = (tmp_path / "b10" / "events.jsonl").read_bytes()
    with pytest.raises(ValueError, match="b10"):
        toymlx.train("from-scratch", **TINY, run_id="b10", runs_root=str(tmp_path), echo=False)
    assert (tmp_path / "b10" / "events.jsonl").read_bytes() == before
    with pytest.raises(ValueError, match=r"^steps: expected a str, number, bool, path, dict "
                                         r"\(a group of options\) or list, found object$"):
        toymlx.train("from-scratch", steps=object(), runs_root=str(tmp_path), echo=False)
    with pytest.raises(ValueError, match=r"^run-id: given twice, as run_id and run-id$"):
        toymlx.train("from-scratch", run_id="a", **{"run-id": "b"}, runs_root=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b10"]


def test_a_reader_gone_stops_the_run_as_the_commands_own_and_is_raised_after(tmp_path):
    """`python script.py | head -1`: the relay's write finding the pipe closed is passed on as
    the child's own reader gone (SIGPIPE: checkpoint, run_end naming it, exit 141, resumable),
    then raised here as BrokenPipeError once the child has stopped; it was a traceback at once,
    and the child, orphaned, was stopped by its lifeline and recorded as SIGTERM (143)."""
    script = textwrap.dedent(f"""
        import sys, toymlx
        try:
            toymlx.train("from-scratch", model={{"d_model": 32, "n_layers": 1}}, seq_len=32,
                         batch_size=4, steps=100000, report_every=1, eval_every=0,
                         compile=False, runs_root={str(tmp_path)!r}, run_id="r")
        except BrokenPipeError:
            last = open({str(tmp_path / "r" / "events.jsonl")!r}).read().splitlines()[-1]
            print("raised BrokenPipeError after", last.split(",")[0], file=sys.stderr)
            sys.stdout = None  # nothing more to flush into the closed pipe
            sys.exit(141)
    """)
    p = subprocess.run(f"{sys.executable} -c {shlex.quote(script)} | head -1", shell=True,
                       capture_output=True, text=True, timeout=300, executable="/bin/bash", check=False)
    assert p.stdout.startswith("step 1/100000: train loss ")
    assert p.stderr.strip().splitlines()[-1] == ('raised BrokenPipeError after {"kind": '
                                                  '"run_end"'), p.stderr
    end = read_events(tmp_path / "r")[-1]
    assert (end["kind"], end["signal"], end["exit_code"]) == ("run_end", "SIGPIPE", 141)
    assert end["message"] == (f"stopped by SIGPIPE after step {end['final_step']}; resume "
                              f"with --resume {tmp_path / 'r'}")
    assert any(e["kind"] == "checkpoint" and e["step"] == end["final_step"]
               for e in read_events(tmp_path / "r"))
