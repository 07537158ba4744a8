"""The Python entry point `toymlx.train` (toymlx.runner.api): the command's flags from keyword options,
and the command's speed in a process that imported and used MLX before toymlx (the 40x cliff of
MLX's reference BLAS on Linux)."""

from __future__ import annotations

import gc
import json
import shlex
import statistics
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from toymlx.bundle.events import read_events
from toymlx.runner.api import _run_child, keyword_message, option_flags

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

    with pytest.raises(ValueError) as caught:
        toymlx.train("from-scratch", no_such_flag=1, runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == ('toymlx-train: error: no_such_flag: expected an option of '
                                 'toymlx.train("from-scratch"), got an unknown one')


def test_a_refused_option_is_told_once_in_the_keywords(tmp_path, capsys):
    """Relayed (echo, the default), the command's refusal showed twice: its own line
    (`--steps: expected >= 1, found 0`), then the exception's (`steps: ...`). Now the exception
    alone tells it, and nothing was written."""
    import toymlx

    capsys.readouterr()
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("vit-tiny", steps=0, runs_root=str(tmp_path))
    assert str(caught.value) == "toymlx-train: error: steps: expected >= 1, found 0"
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []


def test_a_failed_runs_last_line_is_told_once_by_its_exception(tmp_path, capsys):
    """A diverged run's last line showed twice too: relayed, then as the TrainError's message.
    The relay shows the run's lines up to it; the exception tells it."""
    import toymlx

    capsys.readouterr()
    with pytest.raises(toymlx.TrainError) as caught:
        toymlx.train("from-scratch", **{**TINY, "steps": 20}, lr=1e4, runs_root=str(tmp_path),
                     run_id="div")
    out = capsys.readouterr().out
    assert str(caught.value).startswith("toymlx: diverged at step ")
    assert "diverged" not in out and out.count("\n") >= 1, out  # the warm-up note came through


def test_the_relay_holds_back_only_a_refusal_at_the_end(capsys):
    """The child's lines come through whole, an error line followed by more output too (it is
    not the refusal raised) and an unterminated last line; only the trailing refusal is held,
    for the exception to tell, and written where no exception does."""
    said = ("print('a'); print('toymlx-train: error: not the last'); print('b'); "
            "print('toymlx-train: error: --steps: expected >= 1, found 0'); "
            "import sys; sys.exit(2)")
    out = _run_child([sys.executable, "-c", said], echo=True)
    assert capsys.readouterr().out == "a\ntoymlx-train: error: not the last\nb\n"
    assert out.held == ["toymlx-train: error: --steps: expected >= 1, found 0\n"]
    out.relay_held(out.message())  # what the OptionError tells: nothing more written
    assert capsys.readouterr().out == ""
    out = _run_child([sys.executable, "-c", said.replace("sys.exit(2)", "print('end', end='')")],
                     echo=True)
    assert (out.held, out.last_line) == ([], "end")
    assert capsys.readouterr().out.endswith("b\ntoymlx-train: error: --steps: expected >= 1, "
                                            "found 0\nend")
    out = _run_child([sys.executable, "-c", said], echo=True)
    capsys.readouterr()
    out.relay_held("another message")  # one it does not tell: written, not lost
    assert capsys.readouterr().out == "toymlx-train: error: --steps: expected >= 1, found 0\n"
    # Ctrl-C before the run's first step (while it imports or parses): its line is what the
    # KeyboardInterrupt tells, so it is held too (it showed twice: "toymlx-train: interrupted",
    # then "KeyboardInterrupt: toymlx-train: interrupted")
    for line in ("toymlx-train: interrupted",
                 "toymlx-train: stopped by SIGTERM before the first step; nothing was trained"):
        out = _run_child([sys.executable, "-c", f"print('a'); print({line!r})"], echo=True)
        assert (capsys.readouterr().out, out.held) == ("a\n", [line + "\n"])
        out.relay_held(out.last_line)
        assert capsys.readouterr().out == ""


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
    # its last line, held back until the call returns (an exception would tell it), is written
    assert out.endswith(f"toymlx: completed at step 4. held-out: val_loss "
                        f"{evals[-1]['val_loss']:.4f}. bundle: {tmp_path / 'r'}\n"), out


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
    assert end["message"] == ("stopped by SIGPIPE; resume "
                              f"with --resume {tmp_path / 'r'}")
    assert any(e["kind"] == "checkpoint" and e["step"] == end["final_step"]
               for e in read_events(tmp_path / "r"))


def test_ctrl_c_in_the_relays_write_stops_the_run_and_is_raised_after(tmp_path):
    """Ctrl-C landing in `sys.stdout.write` (a notebook's cell output, a slow console), not in
    the wait for the child's output: the child is stopped as by Ctrl-C (checkpoint, run_end,
    resumable) before KeyboardInterrupt is raised here, with the run's last line. It escaped at
    once, leaving the child training unread, holding its bundle's lock, its events without a
    run_end; the next train() of the same run was refused as locked."""
    script = textwrap.dedent(f"""
        import io, os, signal, sys, time, toymlx

        # Python's own Ctrl-C, as a notebook or a terminal has it (a job a script started in the
        # background inherits SIGINT ignored, and Python then keeps it ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)

        class Console(io.TextIOBase):  # Ctrl-C while the first step's line is being written
            def write(self, s):
                if "step 1/" in s:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
                return len(s)

        sys.stdout = Console()
        try:
            toymlx.train("from-scratch", model={{"d_model": 32, "n_layers": 1}}, seq_len=32,
                         batch_size=4, steps=100000, report_every=1, eval_every=0,
                         compile=False, runs_root={str(tmp_path)!r}, run_id="r")
        except KeyboardInterrupt as e:
            last = open({str(tmp_path / "r" / "events.jsonl")!r}).read().splitlines()[-1]
            print("raised", repr(e), "after", last.split(",")[0], file=sys.stderr)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, check=False)
    end = read_events(tmp_path / "r")[-1]
    assert (end["kind"], end["signal"], end["exit_code"]) == ("run_end", "SIGINT", 130), end
    n, run = end["final_step"], tmp_path / "r"
    assert p.stderr.strip().splitlines()[-1] == (
        f"raised KeyboardInterrupt('toymlx: interrupted at step {n}: by SIGINT (Ctrl-C); "
        f"resume with resume=\"{run}\". held-out: not measured yet (no validation before the "
        f"stop). bundle: {run}') after "
        '{"kind": "run_end"'), p.stderr


def test_a_terminal_s_ctrl_c_reaches_the_run_once(tmp_path):
    """A script's `toymlx.train` in a terminal: Ctrl-C goes to every process of the job, the
    run's process too, and `train` passes it on to the run as well: two requests, so the run
    left without its final checkpoint (a second one skips it). The run now has a session of
    its own, and gets the one `train` passes on: it checkpoints the step it stopped after."""
    import os
    import signal
    import time

    # steps of ~0.4 s: the job's Ctrl-C and the one `train` passes on land in the same step
    script = textwrap.dedent(f"""
        import signal, sys, toymlx
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Python has it
        try:
            toymlx.train("from-scratch", model={{"d_model": 256, "n_layers": 2}}, seq_len=128,
                         batch_size=16, steps=100000, report_every=0, eval_every=0,
                         compile=False, runs_root={str(tmp_path)!r}, run_id="r")
        except KeyboardInterrupt:
            print("raised KeyboardInterrupt", file=sys.stderr)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = tmp_path / "r"
    try:
        t0 = time.monotonic()
        while not any(e["kind"] == "step" and e["step"] >= 2 for e in read_events(run)):
            assert p.poll() is None and time.monotonic() - t0 < 300, p.stderr.read()[-3000:]
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C: to the whole job
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert err.strip().splitlines()[-1] == "raised KeyboardInterrupt", err[-3000:]
    end = read_events(run)[-1]
    n = end["final_step"]
    assert (end["kind"], end["signal"], end["exit_code"], end["message"]) == (
        "run_end", "SIGINT", 130, f"by SIGINT (Ctrl-C); resume with --resume {run}")
    assert (run / "weights" / f"step_{n}.gguf").is_file()


def test_train_leaves_the_calling_process_as_it_found_it(tmp_path):
    """A notebook's process after toymlx.train: the same signal handlers, streams, working
    directory, environment and warning filters (the image reader's import once added a global
    filter silencing Pillow's DecompressionBombWarning; numpy's first import, reading the
    summary, once added its 4 "size changed" filters ahead of the notebook's own), and a second run with the same options
    gives the same losses, bit for bit. A small ViT: none of it depends on the model's size."""
    script = textwrap.dedent(f"""
        import json, os, signal, sys, warnings
        import toymlx  # numpy not imported yet: its first import, in train, adds 4 filters
        from toymlx.bundle.events import read_events

        def state():
            return [[repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM,
                                                         signal.SIGPIPE, signal.SIGHUP)],
                    id(sys.stdout), id(sys.stderr), os.getcwd(), dict(os.environ),
                    [repr(f) for f in warnings.filters]]

        before, losses = state(), []
        for run_id in ("one", "two"):
            run = toymlx.train("vit-tiny", steps=2, batch_size=8, eval_batches=1, seed=4,
                               model={{"d_model": 48, "n_layers": 2, "n_heads": 2,
                                       "ffn_dim": 96}},
                               runs_root={str(tmp_path)!r}, run_id=run_id, echo=False)
            losses.append([e["loss"] for e in read_events(run["path"]) if e["kind"] == "step"])
        print(json.dumps({{"same": state() == before, "losses": losses}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, check=True)
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["same"] is True
    assert len(got["losses"][0]) == 2 and got["losses"][0] == got["losses"][1], got


def test_each_call_closes_the_pipe_it_read_the_child_from():
    """The relay's pipe is closed when the child's output ends: it was left to the garbage
    collector, a ResourceWarning ("unclosed file") and an open descriptor after every call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        out = _run_child([sys.executable, "-c", "print('done')"], echo=False)
        gc.collect()
    assert (out.returncode, out.last_line) == (0, "done")
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []


def test_a_folder_named_toymlx_where_it_is_called_does_not_hide_the_package(tmp_path,
                                                                            monkeypatch):
    """Called from the folder that holds a clone (`toymlx/`, no `__init__.py` at that level),
    the child imported that folder as a namespace package in place of an editable install's
    toymlx (`python -m` puts the working folder first) and failed: "cannot import name
    '__version__' from 'toymlx' (unknown location)". The child now runs without that entry
    (`lifeline.module_command`), and a lock names it as `python -m` would."""
    import toymlx
    from toymlx.backend.lifeline import module_command, shown_command

    (tmp_path / "toymlx" / "toymlx").mkdir(parents=True)
    (tmp_path / "toymlx_cli").mkdir()
    monkeypatch.chdir(tmp_path)
    run = toymlx.train("from-scratch", **TINY, runs_root="runs", run_id="here", echo=False)
    assert (run["status"], run["step"]) == ("completed", 2)
    cmd = module_command("toymlx_cli.train", "--version")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"toymlx {toymlx.__version__} ")
    assert shown_command(cmd) == [sys.executable, "-m", "toymlx_cli.train", "--version"]


def test_a_ctrl_c_while_the_child_imports_is_the_command_s_one_line(tmp_path, monkeypatch):
    """`toymlx.train` interrupted while its child still imported: the child printed a
    traceback of the import, and the KeyboardInterrupt raised here said only
    "KeyboardInterrupt". Now the child's one line and Ctrl-C's exit status (the module here
    raises KeyboardInterrupt as it is imported, as a Ctrl-C passed on then did)."""
    from toymlx.backend.lifeline import module_command

    (tmp_path / "toymlx_cli_stub.py").write_text("raise KeyboardInterrupt\n")
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    out = subprocess.run(module_command("toymlx_cli_stub"), capture_output=True, text=True,
                         check=False)
    assert (out.returncode, out.stdout, out.stderr) == (130, "",
                                                        "toymlx_cli_stub: interrupted\n")


def test_numpy_scalars_are_numbers(tmp_path):
    """A hand sweep over `np.logspace`/`np.arange` values: numpy's int64 and float32 are numbers,
    spelled as numpy prints them (np.float32(1e-3) is --lr 0.001, not its float64 widening
    0.0010000000474974513); they were refused as 'found int64'. A complex is still refused."""
    import numpy as np

    import toymlx

    run = toymlx.train("from-scratch", **{**TINY, "steps": np.int64(2)}, lr=np.float32(1e-3),
                       runs_root=str(tmp_path), run_id="np", echo=False)
    assert (run["status"], run["step"], run["config"]["steps"], run["config"]["lr"]) == (
        "completed", 2, 2, 0.001)
    with pytest.raises(toymlx.OptionError, match=r"^lr: expected a str, number, bool, path, "
                                                 r"dict \(a group of options\) or list, "
                                                 r"found complex$"):
        toymlx.train("from-scratch", lr=1j, runs_root=str(tmp_path), echo=False)


def test_an_on_off_option_given_another_value_is_named_with_true_or_false(tmp_path):
    """`compile="yes"` became `--compile yes`, which the command refused as "compile=True:
    expected no value (a flag; compile=False sets it false), got 'yes'"; now the keyword and
    what it takes, before anything starts."""
    import toymlx

    for options, want in [({"compile": "yes"}, "compile: expected True or False, found 'yes'"),
                          ({"compile": 1}, "compile: expected True or False, found 1"),
                          ({"data": {"flip": "no"}},
                           'data={"flip": ...}: expected True or False, found \'no\'')]:
        with pytest.raises(toymlx.OptionError) as e:
            toymlx.train("vit-tiny", runs_root=str(tmp_path), echo=False, **options)
        assert str(e.value) == want
    assert list(tmp_path.iterdir()) == []


def test_a_number_given_for_a_path_or_name_and_a_stray_echo_are_refused(tmp_path,
                                                                        monkeypatch):
    """`run_id=5` and `resume=5` raised a bare TypeError from pathlib; `data={"path": 5}` ran
    the command on a file named 5, `base=3` on one named 3; `echo="no"` relayed every line, as
    True does. Now each is an OptionError naming the keyword and what it takes, before anything
    starts; a step number for from_step stays a step (`from_step=10` is `--from 10`)."""
    import toymlx

    monkeypatch.chdir(tmp_path)
    takes = "expected a str (a path or name, as its flag takes) or a pathlib.Path"
    for recipe, options, want in [
            ("vit-tiny", {"run_id": 5}, f"run_id: {takes}, found 5 (int)"),
            (None, {"resume": 5}, f"resume: {takes}, found 5 (int)"),
            (None, {"config": 2.0}, f"config: {takes}, found 2.0 (float)"),
            ("vit-tiny", {"data": {"path": 5}}, f'data={{"path": ...}}: {takes}, found 5 (int)'),
            ("lora", {"base": 3}, f"base: {takes}, found 3 (int)"),
            ("vit-tiny", {"wandb_project": True}, f"wandb_project: {takes}, found True (bool)"),
            ("vit-tiny", {"echo": "no"}, "echo: expected True or False, found 'no'")]:
        with pytest.raises(toymlx.OptionError) as e:
            toymlx.train(*[recipe][:recipe is not None], **{"echo": False, **options})
        assert str(e.value) == want
    assert list(tmp_path.iterdir()) == []


def test_refused_options_and_failed_runs_are_told_apart_by_type(tmp_path):
    """`except toymlx.OptionError` (a ValueError: nothing trained, no bundle) against
    `except toymlx.TrainError` (a RuntimeError: the run started and failed, its summary
    attached); the failed run's message is its own last line, naming the bundle once (it read
    '... bundle: DIR (bundle: DIR)')."""
    import toymlx
    from toymlx.runner.api import OptionError, TrainError

    assert (toymlx.OptionError, toymlx.TrainError) == (OptionError, TrainError)
    assert issubclass(OptionError, ValueError) and not issubclass(TrainError, ValueError)
    with pytest.raises(toymlx.OptionError, match=r"^toymlx-train: error: batch_sise: "
                                                 r"expected an option of toymlx.train\("
                                                 r'"from-scratch"\), got an unknown one; did you '
                                                 r"mean batch_size\?$"):
        toymlx.train("from-scratch", batch_sise=2, runs_root=str(tmp_path), echo=False)
    with pytest.raises(toymlx.OptionError, match=r"^recipe: expected one of from-scratch, "
                                                 r"warm-start, lora, vit-tiny, found None$"):
        toymlx.train(None, steps=2, runs_root=str(tmp_path))  # was Popen's TypeError
    assert list(tmp_path.iterdir()) == []
    run = tmp_path / "div"
    with pytest.raises(toymlx.TrainError) as caught:
        toymlx.train("from-scratch", **{**TINY, "steps": 20}, lr=1e4, runs_root=str(tmp_path),
                     run_id="div", echo=False)
    e = caught.value
    assert (e.returncode, e.summary["status"]) == (2, "diverged")
    assert str(e).startswith("toymlx: diverged at step ") and str(e).count("bundle:") == 1
    assert str(e).endswith(f"; stopped without checkpointing the bad weights; last good "
                           f"checkpoint: none. held-out: not measured yet (no validation "
                           f"before the stop). bundle: {run}"), str(e)


def test_the_commands_flags_are_told_as_the_keywords_train_takes():
    """One translation (`keyword_message`) of every flag form the command's messages use; a
    quoted command other than toymlx-train keeps its own flags (toymlx-export's --base is not
    train's base=, mlx-lm's --iters is mlx-lm's), and so does a word that is not a value."""
    told = keyword_message(
        "start it over with toymlx-train --resume runs/x --from step_0 (--no-compile: eager; "
        "--data.no-pack, --data.path a.jsonl, --lora.rank 8, --fine-tune-type full, --lr 1e-4); "
        "fuse it: toymlx-export --base runs/x --adapter y; or pass --base m.gguf; --steps is "
        "the run's total (mlx-lm's --iters); --full.layers N; or give --recipe NAME; "
        "--lora.init-adapter: expected a file; --grad-checkpoint to save memory",
        {}, ["lora"])
    assert told == (
        'start it over with toymlx.train(resume="runs/x", from_step="step_0") (compile=False: '
        'eager; data={"pack": False}, data={"path": "a.jsonl"}, lora={"rank": 8}, '
        'fine_tune_type="full", lr=1e-4); fuse it: toymlx-export --base runs/x --adapter y; or '
        'pass base="m.gguf"; steps is the run\'s total (mlx-lm\'s --iters); full={"layers": N}; '
        'or give recipe=NAME; lora={"init_adapter": ...}: expected a file; grad_checkpoint=True '
        "to save memory")
    assert option_flags({"from_step": "step_0"}) == ["--from", "step_0"]


def test_another_tool_s_flag_a_hint_names_is_kept_as_that_tool_spells_it(tmp_path):
    """A hint naming llama.cpp's --lora-scaled (timm's --drop-path, HF Trainer's --optim,
    torchrun's --nproc-per-node) said it as train's keyword where the call gave that name
    (`llama.cpp's lora_scaled=FILE S`): only toymlx's own flags are keywords. Every peer's flag
    of the usage tables is kept, given as a keyword or not."""
    from toymlx_cli.usage import LAUNCHER_FLAGS, LLAMA_CPP_FLAGS, OPTIMIZER_FLAGS, TIMM_FLAGS

    import toymlx

    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("lora", lora_scaled=0.5, runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == (
        'toymlx-train: error: lora_scaled: expected an option of toymlx.train("lora"), got an '
        "unknown one; llama.cpp's --lora-scaled FILE S and mlx-lm's LoRA scale are the "
        'adapters\' scale, here lora={"alpha": ...} / lora={"rank": ...} (scale 20 at rank 8: '
        'lora={"alpha": 160}); lora={"init_adapter": FILE} starts them from a file')
    kept = 0
    for table in (LLAMA_CPP_FLAGS, TIMM_FLAGS, OPTIMIZER_FLAGS, LAUNCHER_FLAGS):
        for flag, pairs in table.items():
            for _, text in pairs:
                if f"'s {flag} " not in text:  # a text naming toymlx's options alone
                    continue
                for recipe in ("lora", "vit-tiny"):
                    told = keyword_message(text, {flag.lstrip("-").replace("-", "_"): 1},
                                           [recipe])
                    assert f"'s {flag} " in told, (flag, recipe, told)
                    kept += 1
    assert kept == 2 * 59  # the texts naming a peer's flag, each under both recipes
    # toymlx's own flags beside them are still keywords
    assert keyword_message("llama.cpp's --ctx-size is --seq-len here", {"ctx_size": 1},
                           ["lora"]) == "llama.cpp's --ctx-size is seq_len here"


def test_refusals_and_resume_are_told_in_keywords_and_resume_needs_no_recipe(tmp_path):
    """The command's refusals, raised by `train`, name the keywords a Python user types
    (`resume="runs/x"`, `overwrite=True`), not the flags (`pass --resume runs/x`); a resumed run
    needs no recipe (its bundle records it, as `toymlx-train --resume` needs none); one with
    neither is refused as before."""
    import toymlx

    run = tmp_path / "r"
    toymlx.train("from-scratch", **TINY, runs_root=str(tmp_path), run_id="r", echo=False)
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("from-scratch", **TINY, runs_root=str(tmp_path), run_id="r", echo=False)
    assert str(caught.value) == (
        f"toymlx-train: error: {run}: run bundle already exists; continue it with "
        f'toymlx.train(resume="{run}"), pass overwrite=True to replace it, or choose another '
        "run_id")
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train(resume=str(run), seq_len=64, echo=False)
    assert str(caught.value) == (
        f"toymlx-train: error: {run}: resume: seq_len: expected the run's saved seq_len = 32, "
        "found 64; a resumed run keeps its configuration (only steps and run-local options such "
        "as eval_every may change): start a new run to change it")
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train(resume=str(run), steps=1, echo=False)
    assert str(caught.value) == (
        f"toymlx-train: error: {run}: steps: expected more than the checkpoint's step 2 to "
        "train on, found 1; steps is the run's total, not steps to add (mlx-lm's --iters): "
        "steps=3 trains 1 more")
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("vit-tiny", resume=str(run), echo=False)
    assert str(caught.value) == (f"toymlx-train: error: {run}: resume: expected a run of "
                                 "recipe 'vit-tiny', found a 'from-scratch' run")
    resumed = toymlx.train(resume=str(run), steps=3, echo=False)  # was a TypeError
    assert (resumed["recipe"], resumed["status"], resumed["step"], resumed["path"]) == (
        "from-scratch", "completed", 3, str(run))
    with pytest.raises(toymlx.OptionError, match=r"^recipe: expected one of from-scratch, "
                                                 r"warm-start, lora, vit-tiny, found None$"):
        toymlx.train(steps=2, runs_root=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_numpy_and_mlx_0d_values_are_the_scalars_they_hold(tmp_path):
    """`np.bool_` is a flag (it was refused as 'found bool_'; a bool spelled `--compile False`
    would be tyro's error), a 0-d numpy or MLX array its number (refused as 'found ndarray' /
    'found array'), a float32 spelled as numpy prints it."""
    import mlx.core as mx
    import numpy as np

    import toymlx

    run = toymlx.train("from-scratch", **{**TINY, "steps": np.array(2), "compile": np.bool_(True),
                                          "eval_every": mx.array(1)},
                       lr=mx.array(1e-3), progress=np.bool_(False), runs_root=str(tmp_path),
                       run_id="np", echo=False)
    cfg = run["config"]
    assert (run["status"], run["step"], cfg["steps"], cfg["lr"], cfg["compile"],
            cfg["progress"], cfg["eval_every"]) == ("completed", 2, 2, 0.001, True, False, 1)


def test_a_config_file_names_the_recipe_and_the_run(tmp_path):
    """`config=` a file naming the recipe needs none here, as `toymlx-train -c FILE` needs none
    (it was a TypeError), and the file's run_id names the bundle (the default id train chose
    overrode it, a command-line --run-id); a file naming no recipe is the command's refusal."""
    import toymlx

    (tmp_path / "run.yaml").write_text(json.dumps({"recipe": "from-scratch", "run_id": "filed",
                                                   **TINY}))
    (tmp_path / "none.yaml").write_text("steps: 2\n")
    run = toymlx.train(config=str(tmp_path / "run.yaml"), runs_root=str(tmp_path), echo=False)
    assert (run["recipe"], run["status"], run["step"], run["path"]) == (
        "from-scratch", "completed", 2, str(tmp_path / "filed"))
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train(config=str(tmp_path / "none.yaml"), runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == (
        f"toymlx-train: error: {tmp_path / 'none.yaml'}: expected a 'recipe' key (one of "
        "from-scratch, warm-start, lora, vit-tiny), found none; or give recipe=NAME")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["filed", "none.yaml", "run.yaml"]


def test_a_model_shape_it_cannot_build_is_told_in_the_keywords_given(tmp_path):
    """toymlx-train names the flags of a shape it cannot build (`--model.n-heads`); `train`
    names the keywords (`model={"n_heads": ...}`), as for every other option."""
    import toymlx

    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("from-scratch", model={"n_heads": 5}, runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == ('toymlx-train: error: model={"n_heads": ...}: expected a divisor '
                                 'of model={"d_model": ...} (256, the preset\'s), found 5')
    assert not any(tmp_path.iterdir())


def test_a_list_for_an_option_of_one_value_is_named_by_its_keyword(tmp_path):
    """`lora={"targets": ["q", "v"]}` became `--lora.targets q v`, refused as the stray word
    `'v'` ("expected an option of toymlx.train("lora"), got a value no option takes"), which
    named neither the keyword nor the list; an option of several values takes a list."""
    import toymlx
    from toymlx.recipes import get_recipe
    from toymlx.runner.api import _many_flags

    for recipe, options, want in [
            ("lora", {"base": "b.gguf", "lora": {"targets": ["q", "v"]}},
             'lora={"targets": ...}: expected one value (a string), found a list [\'q\', \'v\']'),
            ("from-scratch", {"steps": (1, 2)},
             "steps: expected one value (an integer), found a tuple [1, 2]"),
            ("from-scratch", {"lr": [1e-3]},
             "lr: expected one value (a number), found a list [0.001]")]:
        with pytest.raises(toymlx.OptionError) as e:
            toymlx.train(recipe, runs_root=str(tmp_path), echo=False, **options)
        assert str(e.value) == want
    assert {"--data.keys", "--lr-schedule-args"} <= _many_flags(get_recipe("lora").Config)
    assert list(tmp_path.iterdir()) == []


def test_a_keyword_of_the_wrong_type_is_refused_naming_it_and_its_type(tmp_path):
    """`steps="10"` ran as `--steps 10` (the command read the text), `steps=True` was a flag's
    text the command refused; every option's value is now checked against the type its flag
    takes before anything starts: an int takes no bool or float, a float takes an int, a choice
    one of its values, an option of several values a list of its type, a group a dict."""
    import numpy as np

    import toymlx

    lora = {"base": "b.gguf"}
    for recipe, options, want in [
            ("from-scratch", {"steps": "10"}, "steps: expected an integer, found the str '10'"),
            ("from-scratch", {"steps": True}, "steps: expected an integer, found the bool True"),
            ("from-scratch", {"steps": 10.0}, "steps: expected an integer, found the float 10.0"),
            ("from-scratch", {"lr": "1e-3"}, "lr: expected a number, found the str '1e-3'"),
            ("from-scratch", {"model": {"d_model": "32"}},
             'model={"d_model": ...}: expected an integer, found the str \'32\''),
            ("lora", {**lora, "optimizer": "adamx"},
             ('optimizer: expected one of "adamw", "adam", "sgd", "adafactor", "muon", found '
              "the str 'adamx'")),
            ("lora", {**lora, "lr_schedule_args": (0.5, "x")},
             "lr_schedule_args: expected a number for each value, found the str 'x'"),
            ("from-scratch", {"data": "d.txt"},
             "data: expected a dict (a group of options), found the str 'd.txt'"),
            ("from-scratch", {"from_step": 1.5},
             "from_step: expected a step (an int, or step_N), found the float 1.5")]:
        with pytest.raises(toymlx.OptionError) as e:
            toymlx.train(recipe, runs_root=str(tmp_path), echo=False, **options)
        assert str(e.value) == want
    assert list(tmp_path.iterdir()) == []
    run = tmp_path / "run"  # a resume's keywords, by the run's recipe
    run.mkdir()
    (run / "config.json").write_text('{"recipe": "from-scratch", "config": {}}')
    with pytest.raises(toymlx.OptionError) as e:
        toymlx.train(resume=str(run), steps="10", echo=False)
    assert str(e.value) == "steps: expected an integer, found the str '10'"
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]
    # what each type takes: a float an int, an int a numpy int, a choice its value
    from toymlx.recipes import get_recipe
    from toymlx.runner.api import check_types

    check_types({"lr": 1, "steps": np.int64(3), "seq_len": 8, "optimizer": "sgd",
                 "lr_schedule_args": [1, 0.5], "from_step": 5, "run_id": tmp_path,
                 "compile": False}, get_recipe("lora").Config)
    check_types({"model": {"d_model": 32}, "from_step": "step_2"},
                get_recipe("from-scratch").Config)


def test_a_config_file_s_keywords_are_checked_by_the_recipe_it_names(tmp_path):
    """train(config=FILE) without recipe= left its keywords unchecked (the file, which names the
    recipe, is read by the command): steps="10" ran as --steps 10. The command checks them, sent
    as JSON, once it has read the recipe, a toymlx file's `recipe:` or an mlx-lm file's lora;
    nothing is written."""
    import toymlx

    toy = tmp_path / "toy.yaml"
    toy.write_text("recipe: from-scratch\nsteps: 2\n")
    mlx = tmp_path / "mlx.yaml"  # an mlx-lm lora config: the lora recipe's options
    mlx.write_text("model: none.gguf\niters: 2\nlearning_rate: 1e-4\n")
    for config, options, want in (
            (toy, {"steps": "10"}, "steps: expected an integer, found the str '10'"),
            (toy, {"model": {"d_model": "64"}},
             'model={"d_model": ...}: expected an integer, found the str \'64\''),
            (mlx, {"lr": "3e-4"}, "lr: expected a number, found the str '3e-4'"),
            (mlx, {"data": {"pack": "no"}},
             'data={"pack": ...}: expected True or False, found \'no\''),
            (mlx, {"compile": 1}, "compile: expected True or False, found 1")):
        with pytest.raises(toymlx.OptionError) as e:
            toymlx.train(config=str(config), runs_root=str(tmp_path / "runs"), echo=False,
                         **options)
        assert str(e.value) == f"toymlx-train: error: {want}", options  # the command's line
    assert not (tmp_path / "runs").exists()


def test_the_config_file_is_named_as_the_config_keyword(tmp_path):
    """A -c file's own fault read `-c/config:` to a caller of `train(config=...)`."""
    import toymlx

    missing = tmp_path / "none.yaml"
    with pytest.raises(toymlx.OptionError) as e:
        toymlx.train("from-scratch", config=str(missing), runs_root=str(tmp_path), echo=False)
    assert str(e.value) == (f"toymlx-train: error: {missing}: config: expected a readable UTF-8 "
                            "YAML or JSON file, found No such file or directory")
    with pytest.raises(toymlx.OptionError) as e:  # before: the command's usage, as one line
        toymlx.train(config={"iters": 2, "learning_rate": 1e-4}, runs_root=str(tmp_path),
                     echo=False)
    assert str(e.value) == ("config: expected the path of a YAML or JSON file of options (an "
                            "mlx-lm lora config too), found a dict; write it to a file "
                            "(json.dump) and pass its path, or pass toymlx's options as keywords")
    assert list(tmp_path.iterdir()) == []
    assert keyword_message("toymlx-train: error: -c/--config: expected one config file, found "
                           "a.yaml and b.yaml", {}, ["lora"]) == (
        "toymlx-train: error: config: expected one config file, found a.yaml and b.yaml")


def test_an_mlx_lm_key_s_hint_names_train_s_keyword(tmp_path, capsys):
    """mlx-lm's `iters` in a config file (or as a keyword) is refused with a hint naming its
    toymlx counterpart; to a caller of `train` it said toymlx's --steps, a flag, as the clause
    that names mlx-lm's key is kept whole by the relay. It names train's keyword now (steps),
    and the file's key (steps) where the command read the file (it named the flag --steps
    there); the flag where a flag was given."""
    from toymlx_cli.train import main

    import toymlx

    file = tmp_path / "f.yaml"
    file.write_text("base: m.gguf\nseq_len: 64\niters: 5\n")  # toymlx's keys: not mlx-lm's file
    unknown = f"{file}: key 'iters': expected an option of "
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("lora", config=str(file), runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == (f'toymlx-train: error: {unknown}toymlx.train("lora"), found '
                                 "an unknown key; mlx-lm's iters is toymlx's steps")
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("lora", base="m.gguf", iters=5, runs_root=str(tmp_path), echo=False)
    assert str(caught.value) == (
        'toymlx-train: error: iters: expected an option of toymlx.train("lora"), got an unknown '
        "one; mlx-lm's --iters is toymlx's steps")
    assert main(["--recipe", "lora", "-c", str(file), "--runs-root", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-train: error: {unknown}toymlx-train --recipe lora, found an unknown key; "
        "mlx-lm's iters is toymlx's steps")
    assert main(["--recipe", "lora", "--base", "m.gguf", "--iters", "5"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("mlx-lm's --iters is toymlx's --steps")
    assert list(tmp_path.iterdir()) == [file]


def test_the_commands_notes_are_told_in_the_keywords_train_takes(tmp_path, capsys):
    """A note the run says at start (a default it keeps, a key of an mlx-lm file it does not
    use) names the keywords `train` takes, through the translation its refusals use, where the
    same note from toymlx-train names the flags."""
    from toymlx_cli.train import main

    import toymlx

    toymlx.train("from-scratch", **TINY, warmup=5, lr=1e-3, runs_root=str(tmp_path),
                 run_id="api")
    assert main(["--recipe", "from-scratch", *option_flags(TINY), "--warmup", "5", "--lr", "1e-3",
                 "--runs-root", str(tmp_path), "--run-id", "cli", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    note = ("toymlx-train: {warmup} is longer than {steps}: the learning rate is still warming up "
            "when the run ends (2/5 of the way) and never reaches {lr}; lower {w} to reach it")
    assert note.format(warmup="warmup=5", steps="steps=2", lr="lr=0.001", w="warmup") in \
        out.splitlines()
    assert note.format(warmup="--warmup 5", steps="--steps 2", lr="--lr 0.001", w="--warmup") in \
        err.splitlines()
    assert "--warmup" not in out
    # an mlx-lm config (mlx_lm.lora -c's) whose adapter_path the run's own folder replaces
    config = _mlx_lm_config(tmp_path, iters=1, batch_size=2, max_seq_length=32,
                            adapter_path="adapters", num_layers=1)
    toymlx.train(config=str(config), runs_root=str(tmp_path), run_id="m", compile=False)
    assert main(["-c", str(config), "--runs-root", str(tmp_path), "--run-id", "m2",
                 "--no-compile"]) == 0
    out, err = capsys.readouterr()
    note = (f"toymlx-train: {config}: key 'adapter_path': not used ({{}}, given, name the run's "
            "folder)")
    assert note.format("runs_root and run_id") in out.splitlines()
    assert note.format("--runs-root and --run-id") in err.splitlines()


def _mlx_lm_config(tmp_path: Path, **keys) -> Path:
    """An mlx-lm lora config file of `keys` (mlx_lm.lora -c's) over a tiny byte-level base
    b.gguf and a data folder of eight {"text"} rows, written into `tmp_path`."""
    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama, tiny

    write_llama(tmp_path / "b.gguf", Llama(tiny(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                ffn_dim=48, context=64)),
                byte_tokenizer().to_metadata())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"row {i} " * 8}) + "\n" for i in range(8)))
    config = tmp_path / "lora.yaml"
    config.write_text(json.dumps({"model": str(tmp_path / "b.gguf"),
                                  "data": str(tmp_path / "data"), **keys}))
    return config


def _key_table(text: str) -> dict[str, tuple[str, str, str]]:
    """An mlx-lm key table's rows, {mlx-lm key: (option, value, from)}, cut at the header's
    columns (an option may hold spaces: `lora={"alpha": ...}`)."""
    lines = text.splitlines()
    at = next(i for i, s in enumerate(lines) if s.startswith("mlx-lm key "))
    head = lines[at]
    cuts = [head.index(h) for h in ("toymlx option", "value", "from")]
    rows = {}
    for line in lines[at + 1:]:
        if not line or line.startswith(("toymlx", "step ")):  # the run's lines
            break
        key, option, value, origin = (line[a:b].strip() for a, b in
                                      zip([0, *cuts], [*cuts, len(line)]))
        rows[key] = (option, value, origin)
    return rows


def test_an_mlx_lm_files_key_table_names_the_keywords_train_takes(tmp_path, capsys):
    """`train(config=F)` with an mlx-lm file prints its key table in the caller's words: the
    keywords `train` takes, Python's values, the keywords given over the file; the table had
    toymlx-train's flags (`--eval-batches`, `--lora.alpha`, true), which a Python caller does
    not write. toymlx-train -c F prints the same table in flags, as before."""
    from toymlx_cli.train import main

    import toymlx

    config = _mlx_lm_config(tmp_path, iters=2, batch_size=2, max_seq_length=32, num_layers=1,
                            val_batches=1,
                            lora_parameters={"rank": 4, "scale": 10.0, "dropout": 0.0})
    toymlx.train(config=str(config), runs_root=str(tmp_path), run_id="py", compile=False,
                 steps=1, lora={"rank": 2})
    py = _key_table(capsys.readouterr().out)
    assert main(["-c", str(config), "--runs-root", str(tmp_path), "--run-id", "cli",
                 "--no-compile", "--steps", "1", "--lora.rank", "2"]) == 0
    cli = _key_table(capsys.readouterr().out)
    assert py["val_batches"] == ("eval_batches", "1", "file")
    assert cli["val_batches"] == ("--eval-batches", "1", "file")
    assert py["iters"] == ("steps", "1", "keywords, over the file")
    assert cli["iters"] == ("--steps", "1", "command line, over the file")
    assert py["lora_parameters.scale"] == ('lora={"alpha": ...}', "20.0",
                                           'file scale 10 x lora={"rank": 2}')
    assert cli["lora_parameters.scale"] == ("--lora.alpha", "20.0", "file scale 10 x --lora.rank 2")
    assert py["mask_prompt"] == ('data={"mask_prompt": ...}', "False", "mlx-lm default")
    assert cli["mask_prompt"] == ("--data.mask-prompt", "false", "mlx-lm default")
    assert py.keys() == cli.keys()
    assert not [o for o, _, f in py.values() if "--" in o + f]  # no flag left
