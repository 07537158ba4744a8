"""The standard streams as users' scripts hand them over (`toymlx_cli.console_streams`): closed
(`<&-`, `>&-`, `2>&-`: cron, daemons, some CI runners), the work done and the output discarded
as `>/dev/null` would; an encoding that lacks a character (PYTHONIOENCODING=ascii, a Latin-1
locale), the character escaped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_runs import TINY, TRAIN

from toymlx.bundle.events import read_events

CLOSED = {"stdout": (1,), "stderr": (2,), "stdin, stdout and stderr": (0, 1, 2)}


def _closing(fds: tuple[int, ...]):
    def close() -> None:
        for fd in fds:
            os.close(fd)
    return close


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


@pytest.mark.parametrize("closed", list(CLOSED))
def test_a_run_started_with_a_closed_stream_trains_to_its_end(tmp_path, data, closed):
    """`toymlx-train ... >&-`: Python starts with sys.stdout None, and the huge-page restart's
    `sys.stdout.flush()` raised: an AttributeError traceback, exit 1, no run folder (`2>&-`:
    exit 1 without a word). Now the run trains, checkpoints and ends `completed`, exit 0."""
    r = subprocess.run([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                        "--runs-root", str(tmp_path), "--run-id", "c", "--steps", "3"],
                       preexec_fn=_closing(CLOSED[closed]), capture_output=False, timeout=300,
                       check=False)
    assert r.returncode == 0
    end = read_events(tmp_path / "c")[-1]
    assert (end["kind"], end["reason"], end["final_step"]) == ("run_end", "completed", 3)
    assert os.readlink(tmp_path / "c" / "weights" / "latest") == "step_3.gguf"


def test_a_forward_command_with_stdout_closed_says_what_it_says_on_stderr(tmp_path):
    """`toymlx-eval ... >&-`: the same traceback (exit 1) before the command's own error; now
    its one line and exit status 2, as with stdout open."""
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.eval", "--model", "nowhere.gguf"],
                       preexec_fn=_closing((1,)), stderr=subprocess.PIPE, text=True,
                       timeout=120, check=False, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, (
        "toymlx-eval: error: nowhere.gguf: --model: expected a GGUF file or a run directory, "
        "found nothing at that path\n"))


def test_a_closed_descriptor_is_not_given_to_the_next_file_opened():
    """With fd 1 closed, the next file the command opened took descriptor 1, so a child's
    console output (a sweep's runs) went into it. Now fd 1 is os.devnull, inherited by a child
    or the huge-page restart's exec (os.open's own descriptors are not), and a new file gets
    the next free one."""
    code = ("import os, sys; from toymlx_cli import open_closed_streams; open_closed_streams(); "
            "fd = os.open(os.devnull, os.O_RDONLY); print('to devnull'); sys.stdout.flush(); "
            "null = os.path.samestat(os.fstat(1), os.stat(os.devnull)); "
            "sys.stderr.write(f'{fd} {null} {sys.stdout.fileno()} {os.get_inheritable(1)}')")
    r = subprocess.run([sys.executable, "-c", code], preexec_fn=_closing((1,)),
                       stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    assert (r.returncode, r.stderr) == (0, "3 True 1 True")  # inheritable: an exec keeps it


def test_a_run_id_stdout_cannot_encode_is_escaped_and_the_run_completes(tmp_path, data):
    """PYTHONIOENCODING=ascii and `--run-id é🙂`: the checkpoint line raised
    UnicodeEncodeError after the checkpoint was written, and the run ended as run_end "error",
    exit 1. Now the line is printed with backslash escapes, as Python's stderr prints it, and
    the run completes."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                        "--runs-root", "r", "--run-id", "é🙂", "--steps", "3"], cwd=tmp_path,
                       env=env, capture_output=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.decode("ascii").splitlines()[-1] == (
        "step 3: checkpoint r/\\xe9\\U0001f642/weights/step_3.gguf")
    end = read_events(tmp_path / "r" / "é🙂")[-1]
    assert (end["reason"], end["exit_code"], end["final_step"]) == ("completed", 0, 3)


@pytest.mark.parametrize("stderr", ["/dev/full", "closed"])
def test_a_failing_stderr_neither_stops_a_command_nor_loses_its_stdout(stories_path, stderr):
    """`toymlx-generate ... 2>/dev/full` (a log on a full disk): its first note on stderr raised
    ENOSPC, which ended the command with exit 1 and no generated text on stdout. Now its notes
    are discarded and stdout has the answer, exit 0."""
    cmd = [sys.executable, "-m", "toymlx_cli.generate", "--model", str(stories_path), "--prompt",
           "Once", "--max-tokens", "10", "--temperature", "0"]
    if stderr == "closed":
        r = subprocess.run(cmd, preexec_fn=_closing((2,)), stdout=subprocess.PIPE, text=True,
                           timeout=120, check=False)
    else:
        with open("/dev/full", "w") as full:
            r = subprocess.run(cmd, stderr=full, stdout=subprocess.PIPE, text=True, timeout=120,
                               check=False)
    assert (r.returncode, r.stdout) == (0, " upon a time, there was a little gir\n")


def test_a_full_stdout_is_an_error_naming_stdout(stories_path):
    """`toymlx-generate ... >/dev/full`: "error: [Errno 28] No space left on device", not
    saying which file was full (the model? a cache?). Now it names `<stdout>`; exit status 2."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "toymlx_cli.generate", "--model",
                            str(stories_path), "--prompt", "Once", "--max-tokens", "10",
                            "--temperature", "0"], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120, check=False)
    assert (r.returncode, r.stderr) == (2, (
        f"toymlx-generate: model {stories_path}\n"
        "toymlx-generate: error: [Errno 28] No space left on device: '<stdout>'\n"))



def test_mlx_launch_relays_into_a_console_that_cannot_be_written_without_raising():
    """`toymlx-launch -n 2 -- toymlx-train ... >/dev/full` (or `| head -1`): mlx.launch's relay
    loop (`sys.stdout.buffer.write`, `.flush()`) raised, an `OSError: [Errno 28]` or
    BrokenPipeError traceback on stderr while the ranks trained on. Its streams are now
    `_relay`s, which discard what cannot be written; other errors still raise."""
    from toymlx.runner.launch import _relay

    with open("/dev/full", "w") as full:
        out = _relay(full)
        assert (out.buffer.write(b"step 1/3\n"), out.buffer.flush()) == (9, None)
        assert (out.write("toymlx: done\n"), out.flush()) == (13, None)
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as pipe:
        out = _relay(pipe)
        assert (out.buffer.write(b"x" * 70000), out.buffer.flush()) == (70000, None)
    # read-only: EBADF is no console gone
    with open(os.devnull) as wrong_way, pytest.raises(OSError, match="Bad file descriptor"):
        out = _relay(wrong_way)
        out.buffer.write(b"x\n")
        out.buffer.flush()
