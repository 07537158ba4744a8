"""Data parallelism over 2 ranks on loopback (mlx.launch, ring backend), through toymlx-launch:
the same losses as one process with the same global batch, one writer of the run bundle, a
failing rank that fails the launch, and Ctrl-C (or a SIGTERM to the launcher or to every
process) that ends the ranks as it ends one process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import end_child
from toymlx_cli.train import main as train_main

from toymlx.backend.stop import (
    RANK_SIGNALS,
    SIGNALS,
    Stopped,
    StopSignals,
    how_stopped,
    ignore_stop_signals,
    relayed,
    stops_raise,
)
from toymlx.bundle.checkpoint import list_checkpoints
from toymlx.bundle.events import read_events
from toymlx.runner.launch import (
    _SILENT,
    SESSION_GRACE,
    _free_port_base,
    _terminate_unstopped,
    left_waiting,
)
from toymlx.training.trainer import _shard

ARGS = ["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers", "2",
        "--seq-len", "32", "--batch-size", "4", "--grad-accum", "2", "--steps", "20",
        "--eval-every", "10", "--eval-batches", "2", "--no-progress"]
# no periodic checkpoint and no evaluation: every step since the start is one only a final
# checkpoint keeps
STOP_ARGS = ["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers", "2",
             "--seq-len", "32", "--batch-size", "4", "--grad-accum", "2", "--steps", "40",
             "--eval-every", "0", "--checkpoint-every", "1000", "--no-progress", "--no-compile"]
LAUNCH = [sys.executable, "-m", "toymlx_cli.launch", "-n", "2", "--"]
TRAIN = [sys.executable, "-m", "toymlx_cli.train"]

# rank 1 raises at its 4th step, while rank 0 waits for it in the gradient all_sum
FAIL_RANK1 = """
import os, sys
import toymlx
import toymlx.training.trainer as t
if os.environ.get("MLX_RANK") == "1":
    seed = t.step_seed
    def step_seed(s0, step):
        if step == 3:
            raise RuntimeError("injected failure on rank 1")
        return seed(s0, step)
    t.step_seed = step_seed
from toymlx_cli.train import main
sys.exit(main())
"""

# rank 0 waits 3 s before each checkpoint it writes: a rank 1 that exited without waiting for it
# had mlx.launch stop rank 0 mid-write
SLOW_SAVE_RANK0 = """
import os, sys, time
import toymlx
import toymlx.bundle.checkpoint as ck
if os.environ.get("MLX_RANK") == "0":
    save = ck.save_checkpoint
    def save_checkpoint(*args, **kwargs):
        time.sleep(3)
        return save(*args, **kwargs)
    ck.save_checkpoint = save_checkpoint
from toymlx_cli.train import main
sys.exit(main())
"""

# rank 1 sleeps in its 4th step (in Python, where its SIGINT handler runs and the sleep goes
# on), while rank 0 waits for it in the gradient all_sum (in C++, where no handler runs)
STUCK_RANK1 = """
import os, sys, time
import toymlx
import toymlx.training.trainer as t
if os.environ.get("MLX_RANK") == "1":
    seed = t.step_seed
    def step_seed(s0, step):
        if step == 3:
            time.sleep(1000)
        return seed(s0, step)
    t.step_seed = step_seed
from toymlx_cli.train import main
sys.exit(main())
"""

# every rank sleeps 0.5 s in each step (in Python, where its handlers run): a signal to every
# process and toymlx-launch's relay of it (0.2 s later at most) both come within one step
SLOW_STEPS = """
import sys, time
import toymlx
import toymlx.training.trainer as t
seed = t.step_seed
def step_seed(s0, step):
    time.sleep(0.5)
    return seed(s0, step)
t.step_seed = step_seed
from toymlx_cli.train import main
sys.exit(main())
"""

# each rank says it is setting up (a file in the working folder), then sleeps there: the window
def _wait_for_setups(p: subprocess.Popen, tmp_path: Path) -> None:
    """Until both ranks of `slow_script`'s launch `p` have touched their setup<RANK> files."""
    t0 = time.monotonic()
    while not all((tmp_path / f"setup{r}").exists() for r in range(2)):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)


def slow_script(name: str, rank: int | None = None) -> str:
    """A toymlx-train whose `toymlx.runner.run.<name>` touches setup<RANK>, then sleeps on rank
    `rank` (every rank: None) before doing its work:
    - `_prepare`: set-up before the loop counts stop signals (loading a model, reading data);
    - `init_distributed` on rank 0: it sleeps before connecting (in Python, where its handlers
      run), while rank 1 waits for it in mx.distributed.init (in C++, holding the GIL: no
      handler runs);
    - `_build` on rank 1: it sleeps as it builds the task (after the ranks connected), while
      rank 0 goes on into its loop and waits for it in the first step's all_sum."""
    sleeps = "True" if rank is None else f'os.environ["MLX_RANK"] == "{rank}"'
    return f"""
import os, sys, time
from pathlib import Path
import toymlx
import toymlx.runner.run as run
done = run.{name}
def slow(*args, **kwargs):
    Path(f"setup{{os.environ['MLX_RANK']}}").touch()
    if {sleeps}:
        time.sleep(1000)
    return done(*args, **kwargs)
run.{name} = slow
from toymlx_cli.train import main
sys.exit(main())
"""


class _World:
    def __init__(self, rank: int, size: int):
        self._r, self._n = rank, size

    def rank(self) -> int:
        return self._r

    def size(self) -> int:
        return self._n


def test_each_rank_gets_its_own_slice_of_the_global_batch():
    batch = {"inputs": np.arange(2 * 4 * 3).reshape(2, 4, 3)}  # (accum, B, T)
    parts = [_shard(batch, _World(r, 2))["inputs"] for r in range(2)]
    assert parts[0].shape == parts[1].shape == (2, 2, 3)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), batch["inputs"])
    with pytest.raises(ValueError, match="--batch-size: expected a multiple of the 3"):
        _shard(batch, _World(0, 3))


def test_a_rank_counts_a_relayed_sigterm_as_sigterm():
    """toymlx-launch passes a SIGTERM on as SIGUSR1 (a rank's SIGTERM stays "exit now"): the
    rank names it SIGTERM and ends with 143, whatever comes after it."""
    with StopSignals(RANK_SIGNALS) as stop:
        assert (stop.count, stop.first, stop.name, stop.exit_code) == (0, None, None, 130)
        signal.raise_signal(relayed(signal.SIGTERM))
        signal.raise_signal(relayed(signal.SIGINT))
    assert relayed(signal.SIGTERM) == signal.SIGUSR1
    assert (stop.count, stop.name, stop.exit_code, stop.last) == (2, "SIGTERM", 143,
                                                                  signal.SIGINT)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back


def test_a_sigterm_a_rank_gets_itself_and_relayed_is_one_request():
    """A SIGTERM to every process at once (a job scheduler, `systemctl stop`) reaches a rank
    itself and again as toymlx-launch's relay: one request, so the final checkpoint is written;
    a second SIGTERM, either way, is a second request. SIGTERM was not counted on a rank at all
    (it killed the rank mid-run: no final checkpoint, no run_end)."""
    assert signal.SIGTERM in RANK_SIGNALS
    with StopSignals(RANK_SIGNALS) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert (stop.count, stop.name, stop.exit_code) == (1, "SIGTERM", 143)
        signal.raise_signal(relayed(signal.SIGTERM))
        assert stop.count == 1
        signal.raise_signal(relayed(signal.SIGTERM))  # a second SIGTERM, to the launcher alone
        assert stop.count == 2
        signal.raise_signal(signal.SIGTERM)  # ... and its copy to every process
        assert (stop.count, stop.name, stop.exit_code) == (2, "SIGTERM", 143)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_sigint_or_sighup_a_rank_gets_itself_and_relayed_is_one_request(sig):
    """A SIGINT or SIGHUP to every process at once (`kill -INT -- -PGID` of each group) reaches
    a rank itself and again as toymlx-launch's relay, a signal of its own (`relayed`): one
    request, named as sent, so the final checkpoint is written; a second, either way, is a
    second request. Relayed as itself, the two copies counted as two requests."""
    assert len({relayed(s) for s in SIGNALS} | set(SIGNALS)) == 2 * len(SIGNALS)
    assert relayed(sig) in RANK_SIGNALS
    with StopSignals(RANK_SIGNALS) as stop:
        signal.raise_signal(sig)
        signal.raise_signal(relayed(sig))
        assert (stop.count, stop.name, stop.exit_code) == (1, sig.name, 128 + sig)
        signal.raise_signal(relayed(sig))  # a second one, to the launcher alone
        assert stop.count == 2
        signal.raise_signal(sig)  # ... and its copy to every process
        signal.raise_signal(relayed(signal.SIGTERM))  # then a SIGTERM to the launcher
        assert (stop.count, stop.name, stop.last) == (3, sig.name, signal.SIGTERM)
    assert signal.getsignal(relayed(sig)) == signal.SIG_DFL  # put back


def test_before_the_loop_a_stop_signal_raises_as_ctrl_c_does():
    """`stops_raise` (toymlx-train's setup): a SIGTERM, relayed or not, or a SIGHUP raises
    `Stopped`, named as the sender meant it, with its exit code, once: after it the signals are
    ignored until exit (a whole-group SIGTERM's relay, a moment later, killed the rank before it
    reported how it ended: SIGUSR1's default). Without a stop the handlers come back after,
    but signals ignored until exit (a rank after its last barrier) stay ignored."""
    sigs = RANK_SIGNALS
    before = {s: signal.getsignal(s) for s in sigs}
    try:
        for sig, want in [(signal.SIGTERM, ("stopped by SIGTERM", 143)),
                          (relayed(signal.SIGTERM), ("stopped by SIGTERM", 143)),
                          (signal.SIGHUP, ("stopped by SIGHUP", 129)),
                          (relayed(signal.SIGHUP), ("stopped by SIGHUP", 129)),
                          (signal.SIGINT, ("interrupted", 130)),
                          (relayed(signal.SIGINT), ("interrupted", 130))]:
            with pytest.raises(Stopped) as e, stops_raise(RANK_SIGNALS):
                signal.raise_signal(sig)
                signal.raise_signal(relayed(signal.SIGTERM))  # not raised: a second signal
            assert how_stopped(e.value) == want
            assert {s: signal.getsignal(s) for s in sigs} == dict.fromkeys(sigs, signal.SIG_IGN)
            for s, h in before.items():
                signal.signal(s, h)
        with stops_raise(RANK_SIGNALS):
            pass
        assert {s: signal.getsignal(s) for s in sigs} == before
        assert how_stopped(KeyboardInterrupt()) == ("interrupted", 130)
        with stops_raise(RANK_SIGNALS):
            ignore_stop_signals()
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in sigs)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _launch(tmp: Path, cmd: list[str], timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout,
                          check=False, env=env and {**os.environ, **env})


def _losses(run: Path) -> list[float]:
    return [e["loss"] for e in read_events(run) if e["kind"] == "step"]


# an evaluation every 10 steps: it changes no training state (a run with it and one without log
# the same losses, to the bit), so the 2-rank run below is both the parity test's and the
# uninterrupted run the stop tests resume to
EVAL = ["--eval-every", "10", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """The losses of one process's run of STOP_ARGS (40 steps), made once for the tests that
    compare with it."""
    root = tmp_path_factory.mktemp("one")
    assert train_main([*STOP_ARGS, "--runs-root", str(root), "--run-id", "one"]) == 0
    return _losses(root / "one")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-rank run of STOP_ARGS and EVAL that never stopped, under the ranks' shared default
    run id, and the temp folder (TMPDIR) its launch had: made once for the tests that read
    it."""
    tmp = tmp_path_factory.mktemp("dp")
    (tmp / "tmp").mkdir()
    p = _launch(tmp, [*LAUNCH, *TRAIN, *STOP_ARGS, *EVAL, "--runs-root", str(tmp / "runs")],
                env={"TMPDIR": str(tmp / "tmp")})
    assert p.returncode == 0, p.stderr[-3000:]
    (dp,) = (tmp / "runs").iterdir()
    return dp, tmp / "tmp"


def _check_parity(one: list[float], dp: Path, steps: int) -> None:
    """The 2-rank run `dp` logged the losses `one` of one process with the same global batch,
    each line once, and rank 0 alone wrote its bundle."""
    two = _losses(dp)
    assert len(one) == len(two) == steps
    np.testing.assert_allclose(two, one, atol=1e-4, rtol=0)
    ev = read_events(dp)
    lines = (dp / "events.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) == len(ev)  # no line written twice
    starts = [e for e in ev if e["kind"] == "run_start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2
    assert [e["step"] for e in ev if e["kind"] == "step"] == list(range(1, steps + 1))
    assert [e["kind"] for e in ev].count("run_end") == 1 and ev[-1]["reason"] == "completed"
    if starts[0]["backend"].get("blas") in ("openblas", "mkl"):  # ranks share the cores
        assert starts[0]["backend"]["blas_threads"] == 1
    # rank 0 alone writes the bundle: its files and nothing else
    files = sorted(str(f.relative_to(dp)) for f in dp.rglob("*"))
    assert files == ["config.json", "events.jsonl", "weights", "weights/latest",
                     f"weights/step_{steps}.gguf", f"weights/step_{steps}.state.safetensors"]


def test_two_ranks_match_one_process_eager(one_process, two_ranks):
    """... and leave nothing in the temp folder: mlx.launch's launch script left each rank's
    pidfile and hostfile there (`mktemp`'s tmp.*: 4 files a launch), which toymlx-launch now
    removes once its ranks have ended."""
    dp, tmp = two_ranks
    _check_parity(one_process, dp, 40)
    assert sorted(f.name for f in tmp.glob("tmp.*")) == []


@pytest.mark.slow
def test_two_ranks_match_one_process_compiled(tmp_path):
    """The compiled step with its all_sums (a cold g++ cache took 4.5 min on 2 busy cores)."""
    root = tmp_path / "runs"
    assert train_main([*ARGS, "--runs-root", str(root), "--run-id", "one"]) == 0
    p = _launch(tmp_path, [*LAUNCH, *TRAIN, *ARGS, "--runs-root", str(root)])
    assert p.returncode == 0, p.stderr[-3000:]
    (dp,) = [d for d in root.iterdir() if d.name != "one"]  # the shared default run id
    _check_parity(_losses(root / "one"), dp, 20)


def test_a_run_resumes_on_another_number_of_ranks_as_if_uninterrupted(tmp_path, one_process):
    """2 ranks to step 4 resumed by one process to 8, and one process to 4 resumed by 2 ranks:
    the uninterrupted run's losses (measured equal to the bit), each segment's world_size. The
    uninterrupted run is one process's 40 steps, its first 8: the warm-up's 20 steps do not
    depend on --steps (as the segments, --steps 4 resumed with --steps 8, need)."""
    root = tmp_path / "runs"
    args = [*ARGS, "--no-compile", "--checkpoint-every", "4", "--runs-root", str(root)]
    p = _launch(tmp_path, [*LAUNCH, *TRAIN, *args, "--steps", "4", "--run-id", "two"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert train_main(["--resume", str(root / "two"), "--steps", "8"]) == 0
    assert train_main([*args, "--steps", "4", "--run-id", "one"]) == 0
    p = _launch(tmp_path, [*LAUNCH, *TRAIN, "--resume", str(root / "one"), "--steps", "8"])
    assert p.returncode == 0, p.stderr[-3000:]
    whole = one_process[:8]
    for run, sizes in (("two", [2, 1]), ("one", [1, 2])):
        np.testing.assert_allclose(_losses(root / run), whole, atol=1e-4, rtol=0)
        ev = read_events(root / run)
        assert [e["world_size"] for e in ev if e["kind"] in ("run_start", "resume")] == sizes
        assert [e["from_step"] for e in ev if e["kind"] == "resume"] == [4]


def test_a_failing_rank_fails_the_launch(tmp_path):
    script = tmp_path / "fail_rank1.py"
    script.write_text(FAIL_RANK1)
    root = tmp_path / "runs"
    args = [*ARGS, "--no-compile", "--runs-root", str(root)]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _launch(tmp_path, [*LAUNCH, sys.executable, str(script), *args, "--run-id", "w"],
                env={"TMPDIR": str(tmp)})
    assert p.returncode == 1
    # the ranks' pidfiles and hostfiles in mktemp's folder, removed once they ended (4 before)
    assert sorted(f.name for f in tmp.glob("tmp.*")) == []
    assert "toymlx-launch: rank 1: exit code 1: RuntimeError: injected failure on rank 1" \
        in p.stderr
    assert "toymlx-launch: failed: 2 of 2 ranks did not finish cleanly" in p.stderr
    # mlx.launch's own warning still shows for a rank that failed (only stops are left out)
    # (its line may run into the rank's own traceback: stderr of two processes interleaves)
    assert re.search(r"Node with rank 1 exited with code 1\b", p.stderr), p.stderr[-3000:]
    _check_rank0_did_not_complete(root / "w")


# `ssh [-tt] [-o OPTION] HOST COMMAND`, as mlx.launch runs a rank (and its kill script) on
# another host: COMMAND run by bash on this machine as if on HOST, with HOST's own temp folder
# ($FAKE_HOSTS/HOST) and host name (FAKE_HOSTNAME, which FAKE_SITE's sitecustomize reports)
FAKE_SSH = """#!/bin/bash
while [[ $1 == -* ]]; do
    if [[ $1 == -o ]]; then shift; fi
    shift
done
host=$1
shift
export TMPDIR="$FAKE_HOSTS/$host" FAKE_HOSTNAME="$host"
export PYTHONPATH="$FAKE_SITE${PYTHONPATH:+:$PYTHONPATH}"
exec bash -c "$*"
"""
FAKE_HOSTNAME = """import os, socket
if os.environ.get("FAKE_HOSTNAME"):
    socket.gethostname = lambda: os.environ["FAKE_HOSTNAME"]
"""
HOSTS = ("127.0.0.2", "127.0.0.3")  # on Linux all of 127/8 is this machine's loopback


def _fake_hosts(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """toymlx-launch's arguments and environment for a 2-rank launch over two fake hosts
    (`FAKE_SSH`), each with its own temp folder (`tmp/hosts/HOST`), this host's its own
    (`tmp/tmp`)."""
    for h in HOSTS:
        try:
            with socket.socket() as s:
                s.bind((h, 0))
        except OSError:
            pytest.skip(f"the fake hosts need {h} to be this machine's (Linux loopback)")
    bin_, site = tmp / "bin", tmp / "site"
    for folder in (bin_, site, tmp / "tmp", *(tmp / "hosts" / h for h in HOSTS)):
        folder.mkdir(parents=True)
    (bin_ / "ssh").write_text(FAKE_SSH)
    (bin_ / "stty").write_text("#!/bin/sh\n")  # the launch script's `stty -echo`: no terminal
    for tool in ("ssh", "stty"):
        (bin_ / tool).chmod(0o755)
    (site / "sitecustomize.py").write_text(FAKE_HOSTNAME)
    env = {"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp / "tmp"),
           "FAKE_HOSTS": str(tmp / "hosts"), "FAKE_SITE": str(site)}
    launch = [sys.executable, "-m", "toymlx_cli.launch", "-n", "1", "--hosts", ",".join(HOSTS),
              "--port", str(_free_port_base(2))]
    return launch, env


def _left_behind(tmp: Path) -> list[str]:
    """The files named as `mktemp` names them left in the fake hosts' temp folders and this
    host's (MLX's own cache, `mlx/VERSION/`, stays there by design)."""
    return sorted(str(f.relative_to(tmp)) for d in ("hosts", "tmp")
                  for f in (tmp / d).rglob("tmp.*"))


def test_a_launch_over_other_hosts_leaves_no_temp_files_there(tmp_path):
    """mlx.launch's launch script leaves each rank's pidfile and hostfile (`mktemp`'s tmp.*) in
    the temp folder of the host the rank ran on; toymlx-launch removed them on this host only,
    and a launch over two hosts left 2 on each."""
    launch, env = _fake_hosts(tmp_path)
    root = tmp_path / "runs"
    p = _launch(tmp_path, [*launch, "--", *TRAIN, *ARGS, "--no-compile", "--steps", "2",
                           "--runs-root", str(root), "--run-id", "dp"], env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [e["world_size"] for e in read_events(root / "dp") if e["kind"] == "run_start"] == [2]
    assert _left_behind(tmp_path) == []


def test_a_failing_rank_on_another_host_leaves_no_temp_files(tmp_path):
    """... nor does a failing rank, which removes its files as it ends: mlx.launch's kill script
    for another rank, run after that rank removed its pidfile, does not fail. `-n 1` over two
    hosts is 2 ranks (mlx.launch's -n is per host): toymlx-launch watched only rank 0, and
    named rank 1's failure nowhere ("failed: 1 of 1 ranks")."""
    launch, env = _fake_hosts(tmp_path)
    script = tmp_path / "fail_rank1.py"
    script.write_text(FAIL_RANK1)
    p = _launch(tmp_path, [*launch, "--", sys.executable, str(script), *ARGS, "--no-compile",
                           "--runs-root", str(tmp_path / "runs"), "--run-id", "w"], env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "rank 1: exit code 1: RuntimeError: injected failure on rank 1" in p.stderr
    assert "CalledProcessError" not in p.stderr  # mlx.launch's kill script, its pidfile gone
    assert _left_behind(tmp_path) == []


def test_ctrl_c_on_a_launch_over_other_hosts_leaves_no_temp_files(tmp_path):
    """... nor does Ctrl-C: mlx.launch's kill script for the rank still ending once the other
    ended with 130 printed a CalledProcessError traceback where that rank had removed its
    pidfile."""
    launch, env = _fake_hosts(tmp_path)
    run = tmp_path / "runs" / "part"
    p = subprocess.Popen([*launch, "--", *TRAIN, *STOP_ARGS, "--runs-root", str(run.parent),
                          "--run-id", "part"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, **env})
    try:
        _wait_for_step(p, run, 3)
        os.killpg(p.pid, signal.SIGINT)  # as a terminal sends Ctrl-C
        _, err = p.communicate(timeout=300)
    finally:
        end_child(p)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "[WARN]" not in err, err[-3000:]
    assert read_events(run)[-1]["reason"] == "interrupted"
    assert _left_behind(tmp_path) == []


EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]
WARN_3 = "[WARN] Node with rank 0 exited with code 3"


def _launch_on_a_terminal(tmp: Path, cmd: list[str], env: dict[str, str]) -> str:
    """`cmd`'s stderr written to a pseudo-terminal, as read from it."""
    import pty

    leader, follower = pty.openpty()
    try:
        subprocess.run(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=follower, timeout=60,
                       env={**os.environ, **env}, check=False)
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: every writer has closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    return out.decode().replace("\r\n", "\n")


@pytest.mark.parametrize("env,terminal", [({}, False), ({"NO_COLOR": "1"}, True),
                                          ({"TERM": "dumb"}, True)])
def test_mlx_launch_s_warnings_carry_no_colour_where_none_is_wanted(tmp_path, env, terminal):
    """mlx.launch wrote `\\033[33m[WARN] ... \\033[0m` into a file or pipe and under NO_COLOR=1
    or TERM=dumb; now the line in its words alone."""
    cmd = [sys.executable, "-m", "toymlx_cli.launch", "-n", "1", "--", *EXIT_3]
    env = {"TERM": "xterm", **env}
    if terminal:
        err = _launch_on_a_terminal(tmp_path, cmd, env)
    else:
        err = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env}, check=False).stderr
    assert err.splitlines()[0] == WARN_3, err


def test_mlx_launch_s_warnings_keep_their_colour_on_a_terminal(tmp_path):
    cmd = [sys.executable, "-m", "toymlx_cli.launch", "-n", "1", "--", *EXIT_3]
    env = {"TERM": "xterm", "NO_COLOR": ""}
    err = _launch_on_a_terminal(tmp_path, cmd, env)
    assert err.splitlines()[0] == f"\033[33m{WARN_3} \033[0m", err



def test_a_command_that_is_not_toymlx_s_passes_on_its_exit_code_and_leaves_no_files(tmp_path):
    """`toymlx-launch -n 2 -- python -c "...sys.exit(3)"` said "ranks 0-1: never reported
    starting" and exited 1, not 3 (only toymlx-train reports how it ended), and left each rank's
    mlx.launch pidfile and hostfile (`mktemp`'s tmp.*) in TMPDIR: as torchrun does, the exit code
    passed on, the rank named with it, and nothing left behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _launch(tmp_path, [*LAUNCH, *EXIT_3], timeout=60, env={"TMPDIR": str(tmp)})
    assert p.returncode == 3, p.stderr
    # each rank exits 3, or, where one did first, mlx.launch stops the other (SIGTERM)
    assert re.search(r"^toymlx-launch: ranks? (0|1|0-1): exit code 3$", p.stderr,
                     re.MULTILINE), p.stderr
    assert "never reported" not in p.stderr
    assert sorted(f.name for f in tmp.iterdir()) == []


def test_a_rank_that_never_reported_is_named_by_how_mlx_launch_saw_it_end():
    """A rank of a command that is not toymlx-train is named by its exit code, or by the signal
    that ended it as a sweep's run is (`killed_by`: one Python has no name for by its number)."""
    from toymlx.runner.launch import _unreported

    assert _unreported(1, {"code": 0}) == {}
    assert _unreported(1, {"code": 3}) == {1: (3, "exit code 3")}
    assert _unreported(0, {"code": -signal.SIGTERM}) == {0: (143, "ended by SIGTERM")}
    assert _unreported(2, {"code": -50}) == {2: (178, "ended by signal 50")}


def _sleeping_launch(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A 2-rank launch of a plain Python command (not toymlx's) whose ranks each mark
    `tmp_path/setupN` and sleep, with TMPDIR `tmp_path/tmp` (returned, to check it is left
    empty)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rank = ("import os, sys, time; open(os.path.join(sys.argv[1], 'setup' + os.environ['MLX_RANK'])"
            ", 'w').close(); time.sleep(60)")
    return subprocess.Popen([*LAUNCH, sys.executable, "-c", rank, str(tmp_path)], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}), tmp


def test_ctrl_c_on_a_command_that_is_not_toymlx_s_is_its_ctrl_c_and_leaves_no_files(tmp_path):
    """... and Ctrl-C: the ranks got toymlx-train's relay of it (SIGUSR2), which killed them
    ("ended by SIGUSR2", exit status 140); now the signal itself (a Python rank's
    KeyboardInterrupt, 130), and no files left in TMPDIR."""
    p, tmp = _sleeping_launch(tmp_path)
    try:
        _wait_for_setups(p, tmp_path)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
    finally:
        end_child(p)
    assert p.returncode == 130, err
    assert "SIGUSR2" not in err and err.count("KeyboardInterrupt") == 2, err
    assert sorted(f.name for f in tmp.iterdir()) == []


def test_a_killed_launcher_leaves_no_folder_of_its_own(tmp_path):
    """`kill -9` of toymlx-launch with no --status-dir left its report folder
    (toymlx-launch-XXXXXXXX) in TMPDIR: only toymlx-launch removed it, as it ended. Now
    mlx.launch's child, which outlives it to stop the ranks, removes it."""
    p, tmp = _sleeping_launch(tmp_path)
    try:
        _wait_for_setups(p, tmp_path)
        launcher = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)],
                                                   capture_output=True, text=True,
                                                   check=False).stdout.split()]
        assert len(launcher) == 1 and any(tmp.glob("toymlx-launch-*"))
        p.kill()
        p.wait()
        t0 = time.monotonic()
        while _running(launcher[0]):
            assert time.monotonic() - t0 < 30, "mlx.launch outlived its killed launcher"
            time.sleep(0.1)
    finally:
        end_child(p)
    assert sorted(f.name for f in tmp.iterdir()) == []


def test_a_port_in_use_is_one_line_per_rank_not_a_traceback(tmp_path):
    """`toymlx-launch --port P` with P taken: each rank printed MLX's bare RuntimeError
    ("[ring] Couldn't bind socket (error: 98)") as a traceback. Now one line names the cause
    and the flag; no run folder is made."""
    import socket

    port = _free_port_base(2)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        p = _launch(tmp_path, [sys.executable, "-m", "toymlx_cli.launch", "-n", "2", "--port",
                               str(port), "--", *TRAIN, *ARGS, "--runs-root",
                               str(tmp_path / "runs"), "--run-id", "p"])
    assert p.returncode == 2  # the first failed rank's status
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    line = ("toymlx-train: error: data parallel: expected the ranks to connect, found [ring] "
            "Couldn't bind socket (error: 98); a port of the ring is in use: give "
            "toymlx-launch another --port, or none (it picks free ones)")
    assert line in p.stderr.splitlines(), p.stderr[-3000:]
    assert not (tmp_path / "runs" / "p").exists()


def _check_rank0_did_not_complete(run: Path) -> None:
    """Rank 0 either sees the ring connection drop (run_end "error"), or, blocked in the
    all_sum, is stopped by mlx.launch: killed there (a torn bundle), or its SIGTERM counted
    before the all_sum fails (run_end "interrupted", naming the lost rank and the signal);
    --resume continues each."""
    ends = [e for e in read_events(run) if e["kind"] == "run_end"]
    assert ends == [] or (ends[0]["reason"] == "error"
                          and "connection to a peer was lost" in ends[0]["message"]) or (
        ends[0]["reason"] == "interrupted" and ends[0].get("signal") == "SIGTERM"
        and ends[0]["exit_code"] == 143
        and "which lost another rank (its own line says how)" in ends[0]["message"]
        and f"--resume {run}" in ends[0]["message"]), ends



@pytest.mark.slow
def test_plain_mlx_launch_exits_0_on_a_failed_rank_without_hanging(tmp_path):
    """Why toymlx-launch exists: mlx.launch reports success whatever its ranks do. With
    SIGTERM left at its default under data parallelism, it no longer hangs on a rank blocked
    in the all_sum. In a TMPDIR of its own: mlx.launch leaves its ranks' mktemp files there,
    which toymlx-launch avoids (`_own_temp_files`)."""
    script = tmp_path / "fail_rank1.py"
    script.write_text(FAIL_RANK1)
    root, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()
    code = ("import sys; from mlx._distributed_utils.launch import main; "
            "sys.argv[0] = 'mlx.launch'; main()")
    mlx_launch = [sys.executable, "-c", code, "--backend", "ring", "-n", "2",
                  "-p", str(_free_port_base(2)), "--"]
    p = _launch(tmp_path, [*mlx_launch, sys.executable, str(script), *ARGS, "--no-compile",
                           "--runs-root", str(root), "--run-id", "m"], timeout=120,
                env={"TMPDIR": str(tmp)})
    # Which rank mlx.launch sees fail first is a race: rank 1 raising (code 1), or rank 0
    # erroring in its all_sum (code 1) before rank 1 is stopped (code -15). Either way the
    # launch itself says 0.
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"Node with rank [01] exited with code 1\b", p.stderr), p.stderr[-2000:]
    _check_rank0_did_not_complete(root / "m")


def test_a_killed_launcher_leaves_no_rank_running(tmp_path):
    """Issue 17 case 1: `kill -9` of toymlx-launch once left both ranks training with nothing
    watching them. Now mlx.launch (run tied to toymlx-launch) ends its session, and each rank,
    tied to mlx.launch, stops too. mlx.launch's files for the ranks (`_own_temp_files`) go with
    it."""
    status = tmp_path / "status"
    root = tmp_path / "runs"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([*LAUNCH[:-1], "--status-dir", str(status), "--", *TRAIN, *ARGS,
                          "--no-compile", "--steps", "100000", "--runs-root", str(root),
                          "--run-id", "dp"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    t0 = time.monotonic()
    while not any(e["kind"] == "step" and e["step"] >= 3 for e in read_events(root / "dp")):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 180
        time.sleep(0.1)
    ranks = [json.loads((status / f"rank{r}.start").read_text())["pid"] for r in range(2)]
    launcher = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                               text=True, check=False).stdout.split()]
    assert len(launcher) == 1 and all(_running(r) for r in ranks)
    p.kill()
    p.wait()
    t0 = time.monotonic()
    while any(_running(x) for x in [*launcher, *ranks]):
        assert time.monotonic() - t0 < 30, "a rank outlived its killed launcher"
        time.sleep(0.1)
    assert [f.name for f in tmp.iterdir() if f.name != "mlx"] == []  # MLX's cache stays


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_stuck_rank_running(tmp_path):
    """The lifeline's SIGTERM now asks the ranks to stop after their step (a final checkpoint),
    which a rank blocked in a collective never reads: mlx.launch's session is killed
    SESSION_GRACE seconds later. Here rank 1 sleeps in its 4th step and rank 0 waits for it in
    the all_sum when toymlx-launch is killed (about 70 s). The launch's folders in TMPDIR (its
    reports, mlx.launch's files) were left there: mlx.launch's child, killed with its session,
    now removes them first."""
    script = tmp_path / "stuck_rank1.py"
    script.write_text(STUCK_RANK1)
    root, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen([*LAUNCH[:-1], "--", sys.executable, str(script), *STOP_ARGS,
                          "--runs-root", str(root), "--run-id", "st"],
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "TMPDIR": str(tmp)})
    _wait_for_step(p, root / "st", 3)
    [status] = [f for f in tmp.glob("toymlx-launch-*") if "-files-" not in f.name]
    ranks = [json.loads((status / f"rank{r}.start").read_text())["pid"] for r in range(2)]
    launcher = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                               text=True, check=False).stdout.split()]
    p.kill()
    p.wait()
    t0 = time.monotonic()
    time.sleep(5)
    assert all(_running(x) for x in [*launcher, *ranks])  # asked to stop: they cannot
    while any(_running(x) for x in [*launcher, *ranks]):
        assert time.monotonic() - t0 < SESSION_GRACE + 30, "a stuck rank outlived its launcher"
        time.sleep(0.5)
    assert time.monotonic() - t0 >= SESSION_GRACE - 1
    assert [f.name for f in tmp.iterdir() if f.name != "mlx"] == []  # MLX's cache stays


def _running(pid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                         check=False).stdout.strip()
    return bool(out) and not out.startswith("Z")


def _start(tmp: Path, cmd: list[str]) -> subprocess.Popen:
    """`cmd` in a process group of its own, as a terminal starts a command: Ctrl-C there is
    SIGINT to the group."""
    return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_step(p: subprocess.Popen, run: Path, step: int) -> None:
    t0 = time.monotonic()
    while not any(e["kind"] == "step" and e["step"] >= step for e in read_events(run)):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)


# how a stop reaches the 2-rank run: the signal, sent to the launcher's process group (a terminal's
# Ctrl-C), to the launcher alone (`kill`, systemd's KillMode=mixed), to every process at once
# (a job scheduler, systemd's KillMode=control-group, `kill -TERM -- -PGID` of each group), or
# to rank 1 alone
STOPS = {"Ctrl-C": (signal.SIGINT, "group"), "SIGTERM": (signal.SIGTERM, "launcher"),
         "SIGTERM to every process": (signal.SIGTERM, "all"),
         "SIGHUP": (signal.SIGHUP, "launcher"), "SIGINT to rank 1": (signal.SIGINT, "rank 1")}


def _every_rank_ended(p: subprocess.Popen, err: str, status: Path, code: int) -> None:
    """The launch and both its ranks ended with `code`, with no traceback, failure or
    mlx.launch warning on stderr."""
    assert p.returncode == code, err[-3000:]
    assert "Traceback" not in err and "failed" not in err and "[WARN]" not in err, err[-3000:]
    for r in range(2):
        assert json.loads((status / f"rank{r}.exit").read_text()) == {"code": code,
                                                                      "error": None}


def _groups(p: subprocess.Popen, status: Path) -> set[int]:
    """The process groups of a launch: toymlx-launch's, and the session mlx.launch and the
    ranks run in."""
    ranks = [json.loads((status / f"rank{r}.start").read_text())["pid"] for r in range(2)]
    return {p.pid, *(os.getpgid(pid) for pid in ranks)}


# SIGTERM in the default tier: its path (relayed as SIGUSR1, named back) is Ctrl-C's and SIGHUP's
@pytest.mark.parametrize("how", ["SIGTERM", *(pytest.param(h, marks=pytest.mark.slow) for h in
                                              ("SIGTERM to every process", "Ctrl-C", "SIGHUP",
                                               "SIGINT to rank 1"))])
def test_a_stop_signal_stops_every_rank_after_one_step_with_its_checkpoint(tmp_path, two_ranks,
                                                                           how):
    """Ctrl-C, SIGTERM or SIGHUP on toymlx-launch ends a 2-rank run as it ends one process:
    every rank stops after the same step S, rank 0 writes the checkpoint of S and run_end
    "interrupted" naming the signal, the launch exits 128 + its number (130, 143, 129) without
    a traceback or mlx.launch's warnings, and --resume continues to the losses of a 2-rank run
    never interrupted, bit for bit. Each rank counts its signal and the next step's all_sum
    shares the most any rank counted, so a SIGINT that reaches rank 1 alone (`kill -INT`)
    stops rank 0 too, and the one signal each rank gets from the launcher is not a second.
    A SIGTERM to every process at once (mlx.launch and the ranks too) killed the ranks mid-run
    (their own SIGTERM kept its default) and mlx.launch with them: no final checkpoint, no
    run_end, "2 of 2 ranks did not finish cleanly" and exit code 1.
    Rank 0 waits 3 s before writing: ranks used to exit without waiting for it, and mlx.launch
    then stopped rank 0 mid-write; before that, each rank ended on a KeyboardInterrupt with no
    checkpoint at all. A SIGTERM or SIGHUP to the launcher used to end it at once, and its
    ranks with it: no final checkpoint, no run_end."""
    sig, to = STOPS[how]
    script = tmp_path / "slow_save_rank0.py"
    script.write_text(SLOW_SAVE_RANK0)
    run, status = tmp_path / "runs" / "part", tmp_path / "status"
    p = _start(tmp_path, [*LAUNCH[:-1], "--status-dir", str(status), "--", sys.executable,
                          str(script), *STOP_ARGS, "--runs-root", str(run.parent),
                          "--run-id", "part"])
    try:
        _wait_for_step(p, run, 5)
        if to == "group":  # as a terminal sends Ctrl-C: to the foreground process group
            os.killpg(p.pid, sig)
        elif to == "all":
            for group in _groups(p, status):
                os.killpg(group, sig)
        elif to == "launcher":
            p.send_signal(sig)
        else:
            os.kill(json.loads((status / "rank1.start").read_text())["pid"], sig)
        _, err = p.communicate(timeout=300)
    finally:
        end_child(p)  # its ranks stop with it (test_a_killed_launcher_...)
    code = 128 + sig
    _every_rank_ended(p, err, status, code)
    ev = read_events(run)
    end = ev[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
    assert end["exit_code"] == code and end.get("signal") == (
        None if to == "rank 1" else sig.name), end  # rank 0 got no signal of its own
    s = end["final_step"]
    assert 5 <= s < 40, end
    what = "by SIGINT (Ctrl-C)" if sig == signal.SIGINT else f"stopped by {sig.name}"
    assert f"toymlx: interrupted at step {s}: {what}; resume with " in err
    assert [e["step"] for e in ev if e["kind"] == "step"] == list(range(1, s + 1))
    assert [step for step, _ in list_checkpoints(run / "weights")] == [s]

    resumed = _launch(tmp_path, [*LAUNCH, *TRAIN, "--resume", str(run), "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_events(run)[-1]["reason"] == "completed"
    uninterrupted = _losses(two_ranks[0])  # its evaluations change no loss (EVAL)
    assert len(uninterrupted) == 40
    assert _losses(run) == uninterrupted  # bit for bit


# SIGINT and SIGHUP in the slow tier: their two copies counted as one request are tested in
# the default tier in one process (test_a_sigint_or_sighup_a_rank_gets_itself_and_relayed_...),
# and a launch's SIGTERM case runs this same path end to end
@pytest.mark.parametrize("sig", [signal.SIGTERM, *(pytest.param(s, marks=pytest.mark.slow)
                                                   for s in (signal.SIGINT, signal.SIGHUP))])
def test_a_stop_signal_to_every_process_ends_the_run_with_its_checkpoint(tmp_path, sig):
    """The default tier's check of a stop signal to every process of a 2-rank run at once (a
    job scheduler, `systemctl stop`, `kill -INT -- -PGID` of each group): the launch exits
    128 + its number, both ranks report it, and run_end "interrupted" by it follows the
    checkpoint of its final step: each rank gets it twice, itself and relayed by toymlx-launch,
    and that is one request. A SIGTERM killed the ranks at once (its default) and mlx.launch
    with them: exit code 1, no checkpoint, no run_end; a SIGINT or SIGHUP was relayed as
    itself, so the two counted as two requests: no final checkpoint. The resume, bit for bit,
    is `test_a_stop_signal_stops_every_rank_...[SIGTERM to every process]` (slow)."""
    script = tmp_path / "slow_steps.py"
    script.write_text(SLOW_STEPS)
    run, status = tmp_path / "runs" / "all", tmp_path / "status"
    p = _start(tmp_path, [*LAUNCH[:-1], "--status-dir", str(status), "--", sys.executable,
                          str(script), *STOP_ARGS, "--runs-root", str(run.parent),
                          "--run-id", "all"])
    try:
        _wait_for_step(p, run, 3)
        for group in _groups(p, status):
            os.killpg(group, sig)
        _, err = p.communicate(timeout=120)
    finally:
        end_child(p)
    code = 128 + sig
    _every_rank_ended(p, err, status, code)
    ev = read_events(run)
    s = ev[-1]["final_step"]
    assert {k: ev[-1][k] for k in ("kind", "reason", "exit_code", "signal")} == {
        "kind": "run_end", "reason": "interrupted", "exit_code": code, "signal": sig.name}
    assert [e["step"] for e in ev if e["kind"] == "step"] == list(range(1, s + 1))
    assert [step for step, _ in list_checkpoints(run / "weights")] == [s]
    assert 3 <= s < 40


def test_a_reader_gone_stops_every_rank_as_ctrl_c_does_and_exits_141(tmp_path):
    """`toymlx-launch -n 2 -- toymlx-train ... | head -1`: the ranks write into mlx.launch's
    pipes, so they never saw the reader go, and the launch trained to its last step and exited
    0 (while `toymlx-train ... | head -1` stops with 141). Now toymlx-launch sees its own
    stdout's reader go and passes Ctrl-C on to every rank: they stop after the same step, rank 0
    writes that step's checkpoint and run_end "interrupted", and the launch exits 141."""
    status, run = tmp_path / "status", tmp_path / "runs" / "gone"
    args = [*STOP_ARGS, "--steps", "100000", "--runs-root", str(run.parent), "--run-id", "gone"]
    p = subprocess.Popen([*LAUNCH[:-1], "--status-dir", str(status), "--", *TRAIN, *args],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        _wait_for_step(p, run, 3)
        p.stdout.close()
        err = p.communicate(timeout=120)[1].decode()
    finally:
        end_child(p)
    assert p.returncode == 128 + signal.SIGPIPE, err[-3000:]
    assert "toymlx-launch: the reader of its output has gone: Ctrl-C passed on to every rank " \
           "(toymlx-train stops them all after the same step, with a final checkpoint)" \
           in err.splitlines(), err[-3000:]
    assert "Traceback" not in err and "failed" not in err and "[WARN]" not in err, err[-3000:]
    for r in range(2):
        assert json.loads((status / f"rank{r}.exit").read_text()) == {"code": 130,
                                                                      "error": None}
    ev = read_events(run)
    s = ev[-1]["final_step"]
    assert {k: ev[-1][k] for k in ("kind", "reason", "exit_code", "signal")} == {
        "kind": "run_end", "reason": "interrupted", "exit_code": 130, "signal": "SIGINT"}
    assert 3 <= s < 100000
    assert [step for step, _ in list_checkpoints(run / "weights")] == [s]


# "all" in the slow tier: a rank's own SIGTERM and its relay met before the loop are one stop,
# tested in one process in the default tier (test_before_the_loop_a_stop_signal_raises_...),
# and "launcher" runs this path end to end
@pytest.mark.parametrize("to", ["launcher", pytest.param("all", marks=pytest.mark.slow)])
def test_a_sigterm_before_the_first_step_ends_the_ranks_as_ctrl_c_does(tmp_path, to):
    """SIGTERM to toymlx-launch (or to every process) while its ranks set up: each ends at
    once, as on Ctrl-C there, with one line and exit code 143, and so does the launch. Ranks
    passed the signal on before their loop counted it were killed by it (SIGUSR1's default),
    and the launch failed: "2 of 2 ranks did not finish cleanly"; so were ranks that got it
    themselves (SIGTERM's default), and mlx.launch with them."""
    script = tmp_path / "slow_setup.py"
    script.write_text(slow_script("_prepare"))
    status = tmp_path / "status"
    p = _start(tmp_path, [*LAUNCH[:-1], "--status-dir", str(status), "--", sys.executable,
                          str(script), *STOP_ARGS, "--runs-root", str(tmp_path / "runs"),
                          "--run-id", "s"])
    try:
        _wait_for_setups(p, tmp_path)
        if to == "launcher":
            p.send_signal(signal.SIGTERM)
        else:
            for group in _groups(p, status):
                os.killpg(group, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        end_child(p)
    assert p.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "failed" not in err and "[WARN]" not in err, err[-3000:]
    line = "toymlx-train: stopped by SIGTERM before the first step; nothing was trained"
    assert err.splitlines().count(line) == 2, err[-3000:]
    for r in range(2):
        assert json.loads((status / f"rank{r}.exit").read_text()) == {"code": 143,
                                                                      "error": None}


def test_a_rank_left_waiting_for_one_stopped_before_the_first_step_is_stopped_not_failed(
        tmp_path):
    """SIGTERM to toymlx-launch while rank 0 sets up and rank 1 already waits to connect to it:
    rank 0 ends at once (143, its line), rank 1 can never end by itself (it waits in C++), so
    the launch kills it after --grace seconds and says so in one line; the launch exits 143, as
    for a stop, with no "failed". It said "rank 1: ended without reporting: killed, crashed, or
    stopped by mlx.launch after another rank failed" and "failed: 2 of 2 ranks did not finish
    cleanly"."""
    script = tmp_path / "slow_rank0_connect.py"
    script.write_text(slow_script("init_distributed", 0))
    status = tmp_path / "status"
    p = _start(tmp_path, [*LAUNCH[:-1], "--grace", "2", "--status-dir", str(status), "--",
                          sys.executable, str(script), *STOP_ARGS, "--runs-root",
                          str(tmp_path / "runs"), "--run-id", "w"])
    try:
        _wait_for_setups(p, tmp_path)
        time.sleep(2)  # rank 1 in mx.distributed.init
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        end_child(p)
    assert p.returncode == 143, err[-3000:]
    assert "failed" not in err and "Traceback" not in err and "[WARN]" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if not x.startswith("toymlx-launch: SIGTERM passed")]
    waited = ("toymlx-launch: rank 1: stopped: killed after --grace 2 s, still waiting for "
              "rank 0, which had stopped (exit code 143) before it could meet it")
    assert lines == ["toymlx-train: stopped by SIGTERM before the first step; nothing was trained",
                     waited], err[-3000:]
    assert json.loads((status / "rank0.exit").read_text()) == {"code": 143, "error": None}
    assert not (tmp_path / "runs" / "w").exists()


def test_a_rank_in_its_first_step_when_another_stops_before_it_ends_as_a_stop(tmp_path):
    """SIGTERM to toymlx-launch while rank 1 builds the task and rank 0 already waits for it
    in the first step's all_sum: rank 1 ends at once, MLX's ring fails rank 0's all_sum, and
    rank 0 ends interrupted too (run_end naming the signal, 143, one line saying why), so the
    launch exits 143 within seconds, and the new run, which trained nothing, is removed (the
    same command starts it again). Rank 0 ended with a RuntimeError traceback ("[ring]
    connection to a peer was lost"), run_end "error", and "failed: 2 of 2 ranks"."""
    script = tmp_path / "slow_rank1_build.py"
    script.write_text(slow_script("_build", 1))
    status, run = tmp_path / "status", tmp_path / "runs" / "b"
    p = _start(tmp_path, [*LAUNCH[:-1], "--grace", "30", "--status-dir", str(status), "--",
                          sys.executable, str(script), *STOP_ARGS, "--runs-root",
                          str(run.parent), "--run-id", "b"])
    try:
        t0 = time.monotonic()
        while not (all((tmp_path / f"setup{r}").exists() for r in range(2))
                   and any(e["kind"] == "run_start" for e in read_events(run))):
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300
            time.sleep(0.05)
        time.sleep(2)  # rank 0 in the first step's all_sum
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        end_child(p)
    _every_rank_ended(p, err, status, 143)
    # nothing was trained: the new run's folder goes, as a stop before the loop leaves none
    assert "toymlx-train: stopped by SIGTERM before the first step; nothing was trained" in \
        err.splitlines(), err[-3000:]
    assert not run.exists()


def test_left_waiting_names_only_ranks_killed_waiting_for_a_stopped_one():
    """A rank killed without a report, beside ranks a signal stopped, stopped as they did; a
    rank that failed (exit code 1) leaves every outcome as it was."""
    silent = (None, _SILENT)
    waited = ("stopped: killed after --grace 10 s, still waiting for rank 0, which had stopped "
              "(exit code 130) before it could meet it")
    assert left_waiting({0: (130, "exit code 130"), 1: silent, 2: silent}, 10) == {
        0: (130, "exit code 130"), 1: (130, waited), 2: (130, waited)}
    failed = {0: (1, "exit code 1: RuntimeError: x"), 1: (130, "exit code 130"), 2: silent}
    assert left_waiting(failed, 10) == failed
    assert left_waiting({0: silent, 1: silent}, 10) == {0: silent, 1: silent}


def test_a_command_left_out_after_the_dashes_is_named(capsys):
    """`toymlx-launch -n 2 -- --recipe lora`: toymlx-train left out. Each rank ran bash's
    `exec --recipe`: "exec: --: invalid option", then "rank 0: never reported starting"."""
    from toymlx_cli.launch import main as launch_main

    assert launch_main(["-n", "2", "--", "--recipe", "lora", "--lora.rank", "4"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-launch: error: command: expected the command each rank runs, found the option "
        "--recipe; did you mean -- toymlx-train --recipe lora --lora.rank 4?\n")
    assert launch_main(["-n", "2"]) == 2  # none at all: a launch as it is typed
    assert capsys.readouterr().err == (
        "toymlx-launch: error: command: expected the command each rank runs, found none; e.g. "
        "toymlx-launch -n 2 -- toymlx-train --recipe vit-tiny\n")


@pytest.mark.parametrize("argv,want", [
    (["--grace", "nan"], "--grace: expected seconds >= 0 (inf: wait for them), found nan"),
    (["--grace", "-1"], "--grace: expected seconds >= 0 (inf: wait for them), found -1"),
    (["-n", "2", "--port", "70000"],
     "--port: expected 1..65534 (the ring listens on 2 ports from it), found 70000"),
    (["-n", "50000"], ("-n: expected at most 40000 ranks on this host (each listens on its own "
                       "port, from a free run of 20000..60000; --port P chooses the first), "
                       "found 50000")),
    (["--hosts", "localhost,,localhost"], ("--hosts 'localhost,,localhost': expected a comma "
                                           "list of host names, found an empty name")),
    (["--backend", "bogus"], "--backend bogus: expected one of ring, mpi, nccl, jaccl, jaccl-ring"),
    (["--env", "NOEQUALS"], "--env NOEQUALS: expected KEY=VALUE, KEY of letters, digits and _"),
    (["--env", "A-B=1"], "--env A-B=1: expected KEY=VALUE, KEY of letters, digits and _"),
    (["--status-dir", "{file}"],
     "--status-dir {file}: expected a folder the ranks can write their reports in, found a file"),
    (["--status-dir", "{file}/sub"], ("--status-dir {file}/sub: expected a folder the ranks "
                                      "can write their reports in, found Not a directory at "
                                      "{file}/sub")),
])
def test_launch_options_out_of_range_are_one_line(tmp_path, capsys, monkeypatch, argv, want):
    """--grace nan never stopped the other ranks of a failed one (the wait compared with NaN);
    -n 50000 was random's "empty range for randrange()"; --hosts with an empty name was "does
    not exist on , "; a bad --backend was mlx.launch's error and "ranks never reported
    starting"; --port past 65535 and a bad --env (mlx.launch set a bare KEY to "" and only warned of a bad
    name) reached the ranks; a --status-dir that is a file was a FileExistsError traceback."""
    from toymlx_cli.launch import main as launch_main

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"launched {a}"))
    (tmp_path / "f").write_text("mine")
    argv = [a.format(file=tmp_path / "f") for a in argv]
    assert launch_main([*argv, "--", sys.executable]) == 2
    assert capsys.readouterr().err == f"toymlx-launch: error: {want.format(file=tmp_path / 'f')}\n"


def test_launch_with_mpi_and_no_mpirun_is_one_line(capsys, monkeypatch):
    """--backend mpi where no mpirun is on PATH was mlx.launch's CalledProcessError traceback,
    then "ranks 0-1: never reported starting"."""
    import shutil

    from toymlx_cli.launch import main as launch_main

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"launched {a}"))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "mpirun"
                        else sys.executable)
    assert launch_main(["--backend", "mpi", "--", sys.executable]) == 2
    assert capsys.readouterr().err == (
        "toymlx-launch: error: --backend mpi: expected mpirun on PATH (mlx.launch starts the "
        "ranks with it), found none; install Open MPI, or use --backend ring\n")


def test_launch_leaves_a_status_folders_other_files(tmp_path, monkeypatch):
    """`--status-dir FOLDER` removes an earlier launch's rank reports there, and nothing else:
    every `rank*.*` went, so `--status-dir .` deleted rankings.csv."""
    from toymlx.runner.launch import launch

    class Launched(Exception):
        pass

    def popen(*a, **k):
        raise Launched

    status = tmp_path / "status"
    status.mkdir()
    for name in ("rankings.csv", "rank0.start", "rank0.exit", "rank12.exit", "rank1.exit.txt"):
        (status / name).write_text("x")
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Launched):
        launch(2, [sys.executable], status_dir=str(status))
    assert sorted(p.name for p in status.iterdir()) == ["rank1.exit.txt", "rankings.csv"]


def test_other_machines_without_a_shared_status_folder_are_refused(capsys, monkeypatch):
    """`toymlx-launch --hosts A,B` without --status-dir: each rank on another machine wrote its
    start report into a temporary folder made on this one, which does not exist there, and
    failed before training (FileNotFoundError). Refused before anything is launched; a host
    that is this machine (loopback, its own name) needs no shared folder."""
    from toymlx_cli.launch import main as launch_main

    from toymlx.runner.launch import other_machines

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"launched {a}"))
    away = "192.0.2.7"  # TEST-NET-1 (RFC 5737): never one of this machine's addresses
    assert launch_main(["-n", "1", "--hosts", f"127.0.0.1,{away}", "--", "toymlx-train"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-launch: error: --hosts 127.0.0.1,{away}: expected --status-dir FOLDER, a "
        "folder every host sees at the same path (a shared file system): each rank reports "
        "there how it ended, and a temporary folder made here does not exist on "
        f"{away}\n")
    assert other_machines(["127.0.0.1", "localhost", socket.gethostname(), away]) == [away]


@pytest.mark.parametrize("argv,flag,whose", [
    (["--nproc_per_node", "2"], "--nproc_per_node", "torchrun's"),
    (["--num_processes=2"], "--num_processes", "accelerate launch's"),
    (["-np", "2"], "-np", "mpirun's"),
    (["--nproc-per-node=2"], "--nproc-per-node", "torchrun's"),
    (["--num-processes", "2"], "--num-processes", "accelerate launch's"),
])
def test_another_launcher_s_process_count_names_n(capsys, argv, flag, whose):
    """`toymlx-launch --nproc_per_node 2 -- ...` (torchrun's habit) said only "unrecognized
    arguments: --nproc_per_node 2", and `-np 2` "argument -n: invalid int value: 'p'"."""
    from toymlx_cli.launch import main as launch_main

    assert launch_main([*argv, "--", "toymlx-train", "--recipe", "lora"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-launch: error: {flag}: {whose} {flag} is toymlx-launch's -n; use toymlx-launch "
        "-n 2 -- toymlx-train ...\n")


@pytest.mark.parametrize("prog, argv, want", [
    ("launch", ["-n", "two", "--", "toymlx-train"], "-n: expected an integer, found 'two'"),
    ("launch", ["-n", "--", "toymlx-train"], "-n: expected a value, found none"),
    ("launch", ["--grace", "soon", "--", "toymlx-train"],
     "--grace: expected a number, found 'soon'"),
    ("launch", ["--hots", "a,b", "--", "toymlx-train"],
     "--hots: expected an option of toymlx-launch, got an unknown one; did you mean --hosts?"),
    ("sweep", ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--workers", "two"],
     "--workers: expected an integer, found 'two'"),
    ("report", ["--ovewrite"], ("--ovewrite: expected an option of toymlx-report, got an "
                                "unknown one; did you mean --overwrite?")),
])
def test_the_argparse_commands_refuse_a_flag_in_one_line(capsys, prog, argv, want):
    """`toymlx-launch -n two` was argparse's usage line, then "argument -n: invalid int value:
    'two'", naming nothing expected; toymlx-sweep's and toymlx-report's parsers alike
    ("unrecognized arguments: --ovewrite", no hint). One line now, as the tyro commands say it."""
    import importlib

    main = importlib.import_module(f"toymlx_cli.{prog}").main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"toymlx-{prog}: error: {want}\n"


def test_torchrun_s_world_size_is_refused_before_the_run_folder(tmp_path, capsys, monkeypatch):
    """`torchrun --nproc_per_node 2 toymlx-train ...` (WORLD_SIZE=2, RANK, LOCAL_RANK): each
    process trained alone on the whole batch, into a folder of its own, and both exited 0."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    root = tmp_path / "runs"
    assert train_main([*ARGS, "--runs-root", str(root), "--run-id", "t"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-train: error: WORLD_SIZE=2: expected ranks started by toymlx-launch, found "
        "torchrun's or accelerate's environment (toymlx does not read WORLD_SIZE, RANK, "
        "LOCAL_RANK: each process would train alone on the whole batch); use toymlx-launch -n 2 "
        "-- toymlx-train ..., or unset WORLD_SIZE\n")
    assert not root.exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to refuse
    assert train_main([*ARGS, "--steps", "1", "--runs-root", str(root), "--run-id", "t"]) == 0


def test_a_command_beside_this_python_runs_without_the_environment_activated(monkeypatch):
    """`.venv/bin/toymlx-launch -n 2 -- toymlx-train ...` with the environment not activated:
    each rank failed "exec: toymlx-train: not found", and the launch said "rank 0: never
    reported starting". Now the script beside this Python is the one run; one not found
    anywhere is named before any rank starts."""
    from toymlx.runner import launch as launch_module

    bindir = Path(sys.executable).parent
    if not os.access(bindir / "toymlx-train", os.X_OK):
        pytest.skip(f"toymlx-train is not installed beside {sys.executable}")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert launch_module._local_command("toymlx-train") == str(bindir / "toymlx-train")
    assert launch_module._local_command("/bin/true") == "/bin/true"
    with pytest.raises(ValueError) as e:
        launch_module.launch(2, ["toymlx-trian", "--recipe", "lora"])
    assert str(e.value) == (
        f"command: expected a program each rank can run, found 'toymlx-trian', which is not on "
        f"PATH nor beside {sys.executable}; give its path, or activate the environment toymlx "
        "is installed in")


def test_mlx_launch_s_kill_shell_outlives_a_stop_passed_on_as_it_runs():
    """mlx.launch stops the other ranks when one fails through a shell that kills each
    (`RemoteProcess.terminate`); a stop passed on to the session while that shell ran (a
    SIGTERM to every process, as a rank ended from it) killed the shell: "died with
    <Signals.SIGUSR1: 10>", a CalledProcessError traceback. With `_terminate_unstopped` the
    shell, sent the relayed SIGTERM itself, runs to its end."""
    import types

    class RemoteProcess:
        def terminate(self):
            self.out = subprocess.run(f"kill -{relayed(signal.SIGTERM).name[3:]} $$; echo alive",
                                      shell=True, executable="/bin/bash", check=True,
                                      capture_output=True, text=True).stdout

    fake = types.SimpleNamespace(RemoteProcess=RemoteProcess)
    with pytest.raises(subprocess.CalledProcessError, match="SIGUSR1"):
        RemoteProcess().terminate()  # as mlx.launch has it
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    _terminate_unstopped(fake)
    rank = RemoteProcess()
    rank.terminate()
    assert rank.out == "alive\n"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before  # the mask put back


def test_the_failed_ranks_summary_is_a_line_per_outcome_not_per_rank(tmp_path):
    """toymlx-launch -n N closed with a line per failed rank: 8 where one rank failed and
    mlx.launch stopped the other 7. Ranks with the same outcome now share a line; the ranks
    that differ are named on their own (the outcomes read from fake status files)."""
    from toymlx.runner.launch import _SILENT, failure_lines, failures

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no longer running on this host: a rank killed without a report
    for r in range(8):
        (tmp_path / f"rank{r}.start").write_text(json.dumps(
            {"pid": gone.pid, "host": socket.gethostname()}))
    (tmp_path / "rank1.exit").write_text(json.dumps({"code": 1, "error": "RuntimeError: x"}))
    assert failure_lines(failures(tmp_path, 8, final=True), 8) == [
        "ranks 0, 2-7: " + _SILENT,
        "rank 1: exit code 1: RuntimeError: x",
        "failed: 8 of 8 ranks did not finish cleanly"]
    bad = {r: (None, "never reported starting") for r in range(8)}
    assert failure_lines(bad, 8) == ["ranks 0-7: never reported starting",
                                     "failed: 8 of 8 ranks did not finish cleanly"]
    bad = {0: (3, "exit code 3"), 2: (3, "exit code 3"), 3: (3, "exit code 3"),
           4: (None, _SILENT), 6: (1, "exit code 1"), 7: (3, "exit code 3")}
    assert failure_lines(bad, 8) == ["ranks 0, 2-3, 7: exit code 3",
                                     "rank 4: " + _SILENT,
                                     "rank 6: exit code 1",
                                     "failed: 6 of 8 ranks did not finish cleanly"]


def test_a_second_ctrl_c_stops_ranks_stuck_in_a_collective(tmp_path):
    """A rank blocked in an all_sum never returns to count a Ctrl-C: the first Ctrl-C leaves
    the ranks to stop by themselves, the second gives them --grace seconds, then stops them,
    and the launch says which ranks did not end cleanly."""
    script = tmp_path / "stuck_rank1.py"
    script.write_text(STUCK_RANK1)
    root = tmp_path / "runs"
    p = _start(tmp_path, [*LAUNCH[:-1], "--grace", "2", "--", sys.executable, str(script),
                          *STOP_ARGS, "--runs-root", str(root), "--run-id", "stuck"])
    try:
        _wait_for_step(p, root / "stuck", 3)
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(1)
        assert p.poll() is None  # nothing can end: rank 1 sleeps, rank 0 waits for it
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=300)
    finally:
        end_child(p)
    assert p.returncode == 1, err[-3000:]
    assert "toymlx-launch: Ctrl-C passed on again; the ranks get 2 s to end" in err
    assert "toymlx-launch: failed: 2 of 2 ranks did not finish cleanly" in err, err[-3000:]
    assert [e["step"] for e in read_events(root / "stuck") if e["kind"] == "step"] == [1, 2, 3]



def test_one_rank_trains_as_one_process_and_stops_with_its_checkpoint(tmp_path, one_process):
    """`toymlx-launch -n 1` (a script's `-n $N` with N=1): mlx.launch hands its only rank an
    MLX_HOSTFILE holding no hosts, and the rank failed at once with MLX's JSON parse error
    ("data parallel: expected the ranks to connect, found [json.exception.parse_error.101]
    ..."), exit status 2. Now the rank trains as one process; the launcher's Ctrl-C, relayed
    as SIGUSR2, is counted as a stop request like a rank's (it used to raise into the step:
    run_end "interrupted during step N", no final checkpoint, the steps since the last one
    lost), and --resume continues to one process's losses, bit for bit."""
    root = tmp_path / "runs"
    status = tmp_path / "status"
    p = _start(tmp_path, [sys.executable, "-m", "toymlx_cli.launch", "-n", "1", "--status-dir",
                          str(status), "--", *TRAIN, *STOP_ARGS, "--runs-root", str(root),
                          "--run-id", "n1"])
    try:
        _wait_for_step(p, root / "n1", 3)
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C in the launcher's terminal
        _, err = p.communicate(timeout=300)
    finally:
        end_child(p)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "failed" not in err, err[-3000:]
    assert json.loads((status / "rank0.exit").read_text()) == {"code": 130, "error": None}
    ev = read_events(root / "n1")
    start, end = ev[0], ev[-1]
    assert start["kind"] == "run_start" and start["world_size"] == 1
    s = end["final_step"]
    assert end["reason"] == "interrupted" and end["signal"] == "SIGINT" and 3 <= s < 40, end
    assert end["message"] == f"by SIGINT (Ctrl-C); resume with --resume {root / 'n1'}"
    assert [step for step, _ in list_checkpoints(root / "n1" / "weights")] == [s]
    assert train_main(["--resume", str(root / "n1"), "--no-progress"]) == 0
    assert _losses(root / "n1") == one_process  # bit for bit, 40 steps
    assert len(one_process) == 40


# slow: the refusal, said by rank 0 alone before any folder is made, is tested in one process
# in the default tier (test_a_refusal_every_rank_meets_is_said_by_rank_0_alone); here, through
# a real 2-rank launch
@pytest.mark.slow
def test_a_batch_the_ranks_cannot_split_is_refused_before_the_run_folder(tmp_path):
    """`toymlx-launch -n 2 -- toymlx-train --batch-size 5`: found at the first step, it left a
    run folder (run_start, run_end "error") that the corrected command then met as "run bundle
    already exists", and exit status 1 (or 143 for a rank stopped first). Now it is refused
    before any folder is made, in one line (rank 0's: each rank said it, `-n 8` eight times,
    or a rank stopped by mlx.launch said "stopped by SIGTERM" instead), and the launch exits
    2, adding no line of its own."""
    root = tmp_path / "runs"
    args = [a if a != "4" else "5" for a in STOP_ARGS]  # --batch-size 5 (the only "4")
    assert args[args.index("--batch-size") + 1] == "5"
    p = _launch(tmp_path, [*LAUNCH, *TRAIN, *args, "--runs-root", str(root), "--run-id", "b"])
    assert p.returncode == 2, p.stderr[-3000:]
    line = ("toymlx-train: error: --batch-size: expected a multiple of the 2 data-parallel "
            "ranks (it is global, split over them), found 5; use --batch-size 4 or 6")
    # that line alone: the launcher's "rank 0 failed (exit code 2); the other ranks get 10 s
    # to end", mlx.launch's "[WARN] Node with rank R exited with code 2" for each rank, "ranks
    # 0-1: exit code 2" and "failed: 2 of 2 ranks did not finish cleanly" followed it
    assert p.stderr == line + "\n", p.stderr[-3000:]
    assert not (root / "b").exists()


def test_a_refusal_every_rank_meets_is_said_by_rank_0_alone(tmp_path, capsys, monkeypatch):
    """A batch the ranks cannot split is refused alike on every rank, and each printed it:
    N identical lines under `toymlx-launch -n N`. Rank 0 says it; every rank waits until it has
    (a collective all ranks reach: a rank ending first had mlx.launch stop rank 0 before its
    line) and exits 2; a refusal that is a rank's own (a port in use) is still each rank's."""
    from toymlx.runner import run

    waited = []
    monkeypatch.setattr(run, "_after_rank_0", lambda world: waited.append(
        (world.rank(), capsys.readouterr().err)))
    root = tmp_path / "runs"
    line = ("toymlx-train: error: --batch-size: expected a multiple of the 3 data-parallel "
            "ranks (it is global, split over them), found 2; use --batch-size 3\n")
    args = [a if a != "4" else "2" for a in ARGS]  # --batch-size 2 (the only "4")
    assert args[args.index("--batch-size") + 1] == "2"
    for rank in (1, 2, 0):
        monkeypatch.setattr(run, "init_distributed", lambda r=rank: _World(r, 3))
        assert train_main([*args, "--runs-root", str(root)]) == 2
    assert waited == [(1, ""), (2, ""), (0, line)]  # rank 0's line before the wait
    assert capsys.readouterr().err == "" and not root.exists()
    assert run._refused("toymlx-train: error: x", None) == 2  # not alike: said, no wait
    assert capsys.readouterr().err == "toymlx-train: error: x\n" and len(waited) == 3



STPES = ("toymlx-train: error: --stpes: expected an option of toymlx-train --recipe "
         "from-scratch, got an unknown one; did you mean --steps?\n")


def test_a_command_line_every_rank_refuses_is_said_by_rank_0_alone(tmp_path, capsys,
                                                                    monkeypatch):
    """`toymlx-launch -n 2 -- toymlx-train --stpes 3`: tyro's refusal, met by every rank before
    the ranks can meet, was printed by each. Rank 0 says it; another rank says it has refused
    and waits for rank 0's exit report (its own exit would have mlx.launch stop rank 0 before
    its line) and exits 2 without a word, or says it itself where rank 0 ended without one."""
    status = tmp_path / "status"
    status.mkdir()
    monkeypatch.setenv("TOYMLX_RANK_STATUS", str(status))
    argv = ["--recipe", "from-scratch", "--stpes", "3", "--runs-root", str(tmp_path / "runs")]
    (status / "rank0.exit").write_text('{"code": 2, "error": null}')
    monkeypatch.setenv("MLX_RANK", "1")
    assert train_main(argv) == 2
    assert capsys.readouterr().err == ""
    assert (status / "rank1.refused").exists()  # what rank 0 waits for before it exits
    (status / "rank0.exit").unlink()  # rank 0 gone without its report: rank 1 says it
    (status / "rank0.start").write_text(json.dumps({"pid": 2 ** 22 + 1,
                                                    "host": socket.gethostname()}))
    assert train_main(argv) == 2
    assert capsys.readouterr().err == STPES
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("TOYMLX_LAUNCH_RANKS", "2")
    assert train_main(argv) == 2
    assert capsys.readouterr().err == STPES


def test_a_launch_of_a_command_line_every_rank_refuses_says_it_once(tmp_path):
    """... as a real 3-rank launch: the line once, exit status 2. It was 3 lines, or, where
    one rank refused first, rank 0's line, "toymlx-train: stopped by SIGTERM" from the ranks
    mlx.launch then stopped, and three lines of the launch's."""
    p = _launch(tmp_path, [*LAUNCH[:-2], "3", "--", *TRAIN, "--recipe", "from-scratch",
                           "--stpes", "3"], timeout=120)
    assert (p.returncode, p.stderr) == (2, STPES)

@pytest.mark.interop  # the resume writes the file with llama.cpp's own quantizer
def test_a_stop_during_rank_0_s_export_ends_every_rank_alike(tmp_path, stories_path):
    """A 2-rank lora run with --fuse-at-end q4_k_m, SIGTERM to toymlx-launch while rank 0's
    export is in llama.cpp's quantizer (a stand-in that runs 2 minutes): rank 0 ended
    interrupted, exit 143, and rank 1, past its last step and waiting for rank 0, exited 0, so
    toymlx-launch reported "rank 0: exit code 143" and "failed: 1 of 2 ranks did not finish
    cleanly". Now every rank exits with rank 0's code (shared at the barrier before they
    leave): the launch exits 143 as a stop, no failure named, and a resume writes the export
    (llama.cpp's own quantizer) and completes."""
    from slow_llama_cpp import slow_llama_cpp

    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("train", 16), ("valid", 3)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(
            {"text": f"Once upon a time there was a cat number {i}. It liked fish."}) + "\n"
            for i in range(n)))
    root, status = tmp_path / "runs", tmp_path / "status"
    run = root / "r"
    p = subprocess.Popen(
        [*LAUNCH[:-1], "--status-dir", str(status), "--", *TRAIN, "--recipe", "lora", "--base",
         str(stories_path),
         "--data.path", str(data), "--runs-root", str(root), "--run-id", "r", "--steps", "2",
         "--batch-size", "4", "--seq-len", "64", "--warmup", "1", "--eval-every", "0",
         "--no-progress", "--no-compile", "--fuse-at-end", "q4_k_m"], cwd=tmp_path,
        env=slow_llama_cpp(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not list(run.glob(".fused-q4_k_m.gguf.tmp-*")):
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        end_child(p)
    _every_rank_ended(p, err, status, 143)
    end = read_events(run)[-1]
    assert (end["reason"], end["exit_code"], end["signal"]) == ("interrupted", 143, "SIGTERM")
    assert end["message"].startswith("stopped by SIGTERM during the export (all 2 steps "
                                     "trained, checkpoint step_2 written): left undone: the "
                                     "export; ")
    assert not [f for f in run.iterdir() if "fused" in f.name]
    resumed = _launch(tmp_path, [*LAUNCH, *TRAIN, "--resume", str(run), "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_events(run)[-1]["reason"] == "completed"
    assert (run / "fused-q4_k_m.gguf").is_file()
