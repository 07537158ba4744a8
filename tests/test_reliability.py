"""Runs that go wrong: divergence, a full or unwritable disk, and bad configuration.

Each must end with one clear line (and for configuration, exit code 2 before any training),
and never leave a bad or half-written checkpoint behind `weights/latest`.
"""

from __future__ import annotations

import errno
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_errors import error_line
from toymlx_cli.train import main

from toymlx.backend import atomic
from toymlx.bundle.checkpoint import list_checkpoints, open_checkpoint, resolve_latest, state_path
from toymlx.bundle.events import read_events
from toymlx.gguf import writer
from toymlx.gguf.llama import load_llama
from toymlx.gguf.reader import GGUFFile

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--eval-every", "0",
        "--no-compile", "--no-progress"]


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


def train(tmp: Path, run_id: str, *extra: str, data: str, recipe: str = "from-scratch") -> int:
    return main(["--recipe", recipe, *TINY, "--data.path", data, "--runs-root", str(tmp),
                 "--run-id", run_id, *extra])


def finite_checkpoint(path: Path) -> bool:
    g = GGUFFile(path)
    return all(np.isfinite(g.load(n)).all() for n in g.tensors)


def assert_bundle_intact(run: Path) -> int:
    """latest and every checkpoint load and verify, each with its state; no temporaries and no
    state file without its GGUF; latest's step."""
    latest = resolve_latest(run)
    load_llama(latest)
    for _, p in list_checkpoints(run / "weights"):
        load_llama(p)
        open_checkpoint(p)  # checksums of both files, and their shared id
        assert finite_checkpoint(p), p
    assert not list((run / "weights").glob(".*tmp-*")), list((run / "weights").iterdir())
    for st in (run / "weights").glob("*.state.safetensors"):
        assert st.with_name(st.name[: -len(".state.safetensors")] + ".gguf").exists(), st
    return int(latest.name[len("step_"):-len(".gguf")])


# ---- divergence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    ["--lr", "1e6", "--grad-clip", "0"],  # NaN gradients at step 2 while its loss is finite
    ["--lr", "1e30"],
    ["--lr", "1e3", "--warmup", "3", "--grad-clip", "0"],  # diverges a few steps in
])
def test_divergence_stops_before_writing_bad_weights(tmp_path, capsys, data, extra):
    rc = train(tmp_path, "d", "--steps", "40", "--warmup", "0", "--checkpoint-every", "1",
               *extra, data=data)
    assert rc != 0
    run = tmp_path / "d"
    end = read_events(run)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "diverged", end
    steps = [e["step"] for e in read_events(run) if e["kind"] == "step"]
    bad = end["final_step"] + 1  # the step whose update went non-finite
    assert f"at step {bad}" in end["message"], end["message"]
    assert end["exit_code"] == rc
    last_good = assert_bundle_intact(run)  # every checkpoint on disk is finite
    assert last_good == end["final_step"] and f"step {last_good}" in end["message"]
    assert not (run / "weights" / f"step_{bad}.gguf").exists()
    assert steps[-1] <= bad
    out = capsys.readouterr().err
    assert "diverged" in out and f"at step {bad}" in out


def test_overflowing_weights_are_never_written(tmp_path, capsys, data):
    """lr * weight decay overflows float32: the weights go inf while step 1's loss and
    gradients are finite; the checkpoint of step 1 must be refused."""
    rc = train(tmp_path, "w", "--steps", "5", "--lr", "1e38", "--weight-decay", "100",
               "--warmup", "0", "--checkpoint-every", "1", data=data)
    assert rc == 2
    run = tmp_path / "w"
    end = read_events(run)[-1]
    assert end["reason"] == "diverged" and "weights became non-finite at step 1" in end["message"]
    assert "last good checkpoint: none" in end["message"]
    assert not list_checkpoints(run / "weights")


# ---- a disk that fills up or refuses writes mid-run -------------------------------------------------
class _FullDisk:
    """A file whose writes fail with ENOSPC after `budget` bytes (a filling disk)."""

    def __init__(self, f, budget: int):
        self.f, self.budget = f, budget

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        if n > self.budget:
            self.f.write(bytes(memoryview(b).cast("B")[: self.budget]))
            self.budget = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= n
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("where", ["gguf-write", "gguf-rename", "state", "latest-link"])
def test_disk_full_mid_run_keeps_earlier_checkpoints(tmp_path, capsys, monkeypatch, data, where):
    """The 3rd checkpoint hits ENOSPC at one point of its write: the run ends with one line,
    exit 1, and checkpoints 1-2 (and `latest` -> 2) are untouched."""
    import os as _os

    import toymlx.bundle.checkpoint as ck

    calls = {"n": 0}
    real_open, real_replace, real_symlink = open, _os.replace, _os.symlink

    def fail(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "gguf-write":
        def fake_open(path, mode="r", *a, **k):
            f = real_open(path, mode, *a, **k)
            if "w" in mode and ".gguf.tmp-" in str(path):
                calls["n"] += 1
                if calls["n"] == 3:
                    return _FullDisk(f, 1000)
            return f
        monkeypatch.setattr(atomic, "open", fake_open, raising=False)
    elif where == "gguf-rename":
        def fake_replace(src, dst):
            if str(dst).endswith(".gguf"):
                calls["n"] += 1
                if calls["n"] == 3:
                    fail()
            return real_replace(src, dst)
        monkeypatch.setattr(writer.os, "replace", fake_replace)
    elif where == "state":
        real_save = ck.save_state

        def fake_save(path, arrays, meta):
            calls["n"] += 1
            if calls["n"] == 3:
                fail()
            return real_save(path, arrays, meta)
        monkeypatch.setattr(ck, "save_state", fake_save)
    else:
        def fake_symlink(src, dst, *a, **k):
            if "latest" in str(dst):
                calls["n"] += 1
                if calls["n"] == 3:
                    fail()
            return real_symlink(src, dst, *a, **k)
        monkeypatch.setattr(ck.os, "symlink", fake_symlink)
    rc = train(tmp_path, "full", "--steps", "10", "--checkpoint-every", "1", data=data)
    monkeypatch.undo()
    assert rc == 1
    line = error_line(capsys)
    assert "No space left on device" in line
    assert "earlier checkpoints are intact (weights/latest -> step_2.gguf)" in line
    run = tmp_path / "full"
    # how much room a checkpoint needs, against what is free: a retry on a disk with room for
    # one (--keep-last 1) failed the same way at each checkpoint, with no word of either size
    size = sum(f.stat().st_size for f in (run / "weights").glob("step_2.*"))
    assert f"; a checkpoint takes {size / 2**20:.1f} MiB here (step_2's files) and " in line
    assert line.endswith(" MiB are free: free space, or --runs-root on a larger disk (each "
                         "checkpoint is written in full before --keep-last removes an older "
                         f"one); then resume with --resume {run} (from step 2)")
    assert assert_bundle_intact(run) == 2
    end = read_events(run)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "error" and end["final_step"] == 3
    # and the run resumes from step 2 once there is room again
    assert main(["--resume", str(run), "--steps", "4", "--no-progress"]) == 0
    assert [e["from_step"] for e in read_events(run) if e["kind"] == "resume"] == [2]
    assert [e["step"] for e in read_events(run) if e["kind"] == "step"] == [1, 2, 3, 4]


def _mount_tmpfs(where: Path, size: str, ro: bool = False) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                       capture_output=True, check=False, text=True)
    return p.returncode == 0


def _umount(where: Path) -> None:
    # lazy: detached now even while a file there is still open (a plain umount then fails with
    # EBUSY and left a mount behind in every run)
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toymlx_cli.train", *args], capture_output=True, check=False,
                          text=True, timeout=600)


def test_real_full_disk(tmp_path, data, monkeypatch):
    """A real 1 MiB tmpfs fills up after a few checkpoints (root only; elsewhere the same
    failure is injected at the writer instead)."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "1m"):  # not root / no mount: inject ENOSPC instead (no skip)
        monkeypatch.setattr(writer.os, "replace", lambda *a: (_ for _ in ()).throw(
            OSError(errno.ENOSPC, "No space left on device")))
        assert train(tmp_path, "inj", "--steps", "5", "--checkpoint-every", "1", data=data) == 1
        return
    try:
        p = _cli("--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root", str(mnt),
                 "--run-id", "r", "--steps", "200", "--checkpoint-every", "1")
        assert p.returncode == 1, p.stderr[-3000:]
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        err = [ln for ln in p.stderr.splitlines() if ln.startswith("toymlx-train: error:")]
        assert len(err) == 1 and "No space left on device" in err[0], p.stderr[-3000:]
        run = mnt / "r"
        step = assert_bundle_intact(run)
        assert step >= 1
        assert err[0].endswith(f"; then resume with --resume {run} (from step {step})"), err[0]
        # free room (drop the oldest checkpoints) and resume from latest
        for s, ckpt in list_checkpoints(run / "weights")[:-1]:
            ckpt.unlink()
            state_path(ckpt).unlink()
        q = _cli("--resume", str(run), "--steps", str(step + 1), "--no-progress")
        assert q.returncode == 0, q.stderr[-3000:]
        resumes = [e for e in read_events(run) if e["kind"] == "resume"]
        assert resumes[-1]["from_step"] == step
    finally:
        _umount(mnt)


_UNBUILT = ('[Compile::eval_cpu] Failed to compile function Df4IBroadcastB_VCC_f4_829_contiguous: '
            'Failed to execute command with return code 1: "g++ -std=c++17 -O3 -Wall -fPIC -shared '
            '"/tmp/mlx/0.32.4/cpu/tmp_8b8c241f.cpp" -o "/tmp/mlx/0.32.4/cpu/tmp_8b8c241f.so" 2>&1", '
            'the output is: /usr/bin/ld: final link failed: No space left on device\n'
            'collect2: error: ld returned 1 exit status\n')
"""MLX 0.32's error where g++ could not write a kernel library (its kernel folder's disk full)."""


def test_kernel_build_on_a_full_disk_is_one_line(tmp_path, data, monkeypatch, capsys):
    """MLX's compiler fails mid-run (its kernel folder's disk is full): one line naming the
    folder, the compiler's error and what to do, then the --resume command from the last
    checkpoint, exit 1, no traceback (before: MLX's RuntimeError, a screen of traceback)."""
    from toymlx.backend import device
    from toymlx.training import trainer

    calls = {"n": 0}
    step = trainer.Stepper.step

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError(_UNBUILT)
        return step(self, *a, **k)

    monkeypatch.setattr(trainer.Stepper, "step", failing)
    assert train(tmp_path, "k", "--steps", "5", "--checkpoint-every", "2", data=data) == 1
    folder = device._mlx_kernel_dir().resolve()
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: MLX could not build a CPU kernel in {folder} "
                           "(its compiler: /usr/bin/ld: final link failed: No space left on "
                           "device); "), line
    assert line.endswith(": free space there, or set TOYMLX_KERNEL_CACHE to a folder on a larger "
                         "disk, or train with --no-compile (no kernels to build); earlier "
                         "checkpoints are intact (weights/latest -> step_2.gguf); then resume "
                         f"with --resume {tmp_path / 'k'} (from step 2)"), line
    assert assert_bundle_intact(tmp_path / "k") == 2
    monkeypatch.undo()
    assert main(["--resume", str(tmp_path / "k"), "--steps", "3", "--no-progress"]) == 0


def test_a_forward_only_command_s_kernel_build_on_a_full_disk_is_one_line(monkeypatch, capsys):
    """toymlx-eval, -generate, -classify, -export (`run_command`) compile too: MLX's compile
    failure there was a traceback and the compiler's command; one line now, exit 1, without
    toymlx-train's --no-compile, which they do not have."""
    from dataclasses import dataclass

    from toymlx_cli import run_command

    from toymlx.backend import device

    @dataclass
    class Args:
        """A command."""

        model: str = "m.gguf"

    def failing(args):
        raise RuntimeError(_UNBUILT)

    assert run_command("toymlx-eval", Args, failing, []) == 1
    folder = device._mlx_kernel_dir().resolve()
    err = capsys.readouterr().err
    assert err.startswith(f"toymlx-eval: error: MLX could not build a CPU kernel in {folder} "
                          "(its compiler: /usr/bin/ld: final link failed: No space left on "
                          "device); "), err
    assert err.endswith(" MiB are free there: free space there, or set TOYMLX_KERNEL_CACHE to "
                        "a folder on a larger disk\n"), err

    def other(args):
        raise RuntimeError("[matmul] Last dimension mismatch")

    with pytest.raises(RuntimeError, match="matmul"):  # not taken for one: raised as it is
        run_command("toymlx-eval", Args, other, [])


def test_other_runtime_errors_are_not_taken_for_a_kernel_build():
    """Only MLX's compile failure is read as one; another compiler error is named as it is."""
    from toymlx.backend.device import kernel_build_failure

    assert kernel_build_failure(RuntimeError("[matmul] Last dimension mismatch")) is None
    assert kernel_build_failure(RuntimeError(_UNBUILT.replace("No space left on device",
                                                              "undefined reference"))
                                ).endswith("(its compiler: /usr/bin/ld: final link failed: "
                                           "undefined reference)")


def test_runs_folder_turns_unwritable_mid_run(tmp_path, data, monkeypatch, capsys):
    """weights/ and the run folder are made immutable (chattr +i: refuses root too) after a
    few checkpoints: one line, exit 1, earlier checkpoints intact, and the run resumes once it
    is writable again. (The lock file's removal at the end, refused too, ended the run in a
    traceback after that line.)
    Where chattr is unavailable, EPERM is injected at the writer instead."""
    probe = tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True, check=False).returncode:
        monkeypatch.setattr(writer.os, "replace", lambda *a: (_ for _ in ()).throw(
            PermissionError(errno.EPERM, "Operation not permitted")))
        assert train(tmp_path, "inj", "--steps", "5", "--checkpoint-every", "1", data=data) == 1
        assert "Operation not permitted" in error_line(capsys)
        return
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    weights = tmp_path / "r" / "weights"
    frozen = [str(weights), str(weights.parent)]  # the run folder too: its lock file stays
    try:
        p = subprocess.Popen([sys.executable, "-m", "toymlx_cli.train", "--recipe", "from-scratch",
                              *TINY, "--data.path", data, "--runs-root", str(tmp_path),
                              "--run-id", "r", "--steps", "100000", "--checkpoint-every", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not (weights / "step_3.gguf").exists():
            assert p.poll() is None, p.stderr.read()[-3000:]
        subprocess.run(["chattr", "+i", *frozen], check=True)
        _, err = p.communicate(timeout=600)
        assert p.returncode == 1 and "Traceback" not in err, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("toymlx-train: error:")]
        assert len(lines) == 1 and "Operation not permitted" in lines[0], err[-3000:]
        assert "earlier checkpoints are intact" in lines[0]
        step = resolve_latest(tmp_path / "r").name
        subprocess.run(["chattr", "-i", *frozen], check=True)
        n = assert_bundle_intact(tmp_path / "r")
        assert step == f"step_{n}.gguf" and n >= 2  # 3 if the link swap got through
        q = _cli("--resume", str(tmp_path / "r"), "--steps", str(n + 2), "--no-progress")
        assert q.returncode == 0, q.stderr[-3000:]
    finally:
        subprocess.run(["chattr", "-i", *frozen], capture_output=True, check=False)


WANTS = ("--runs-root: expected a folder it can write (the run's folder, its lock file, "
         "config.json, events.jsonl and checkpoints), found")


def test_unwritable_runs_root_fails_before_training(tmp_path, capsys, data):
    """The path refused, why, and what to do, as `--resume` on such a disk says them (before:
    "runs folder: expected writable, found Read-only file system; choose another
    --runs-root")."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    rc = train(blocker / "runs", "x", "--steps", "2", data=data)
    assert rc == 2
    assert error_line(capsys) == (f"toymlx-train: error: {blocker / 'runs' / 'x'}: "
                                  "--runs-root/--run-id: expected a path in a folder, found "
                                  f"{blocker} is a file, not a folder; choose another "
                                  "--runs-root/--run-id")
    ro = tmp_path / "ro"
    if _mount_tmpfs(ro, "64k", ro=True):  # a read-only filesystem stops root too
        try:
            for root, at in ((ro, ro / "x"), (ro / "deeper", ro / "deeper")):
                rc = train(root, "x", "--steps", "2", data=data)
                assert rc == 2
                assert error_line(capsys) == (
                    f"toymlx-train: error: {root / 'x'}: {WANTS} Read-only file system at {at}; "
                    "make room or make it writable, or choose another --runs-root")
            assert not list(ro.iterdir())
        finally:
            _umount(ro)


def test_unwritable_sweep_root_is_one_line(tmp_path, capsys, data, monkeypatch):
    """`toymlx-sweep --runs-root` on a read-only disk said only "[Errno 30] Read-only file
    system: '...'" (and "[Errno 2] No such file or directory: '/proc/x'"): no flag, nothing
    expected. Now as toymlx-train's runs root says it (EROFS injected where nothing mounts)."""
    import pathlib

    from toymlx_cli.sweep import main as sweep_main

    ro = tmp_path / "ro"
    mounted = _mount_tmpfs(ro, "64k", ro=True)
    if not mounted:  # not root: the read-only disk's answer, injected at the sweep's mkdir
        real = pathlib.Path.mkdir

        def mkdir(self, *a, **k):
            if str(self).startswith(str(ro)) and self.name == ".locks":
                raise OSError(errno.EROFS, "Read-only file system", str(ro / "sw"))
            return real(self, *a, **k)

        ro.mkdir()
        monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    try:
        assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--sweep-id", "sw",
                           "--runs-root", str(ro), "--no-report", *TINY, "--steps", "1",
                           "--data.path", data]) == 2
        assert error_line(capsys, "toymlx-sweep") == (
            f"toymlx-sweep: error: {ro / 'sw'}: --sweep-id: expected a folder it can write (the "
            f"sweep's record, logs and each run's bundle), found Read-only file system at "
            f"{ro / 'sw'}; make room or make it writable, or choose another --runs-root")
        assert not list(ro.iterdir())
    finally:
        if mounted:
            _umount(ro)


def test_a_full_disk_at_the_start_leaves_no_empty_run_folder(tmp_path, capsys, data,
                                                            monkeypatch):
    """Measured on a full tmpfs: the run failed at its lock file with one line, exit 2, and
    left an empty runs/<id>/ behind (one per try without --run-id, each a new timestamp)."""
    import os as _os

    from toymlx.backend import lock

    real_open = _os.open

    def full(path, *a, **k):
        if str(path).endswith(".lock"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(lock.os, "open", full)
    (tmp_path / "kept").mkdir()  # a folder that was there before is left as it was
    for run_id in ("x", "kept"):
        assert train(tmp_path, run_id, "--steps", "2", data=data) == 2
        assert error_line(capsys) == (
            f"toymlx-train: error: {tmp_path / run_id}: {WANTS} No space left on device at "
            f"{tmp_path / run_id / '.lock'}; make room or make it writable, or choose another "
            "--runs-root")
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path / "runs"), "--steps", "2"]) == 2
    assert f"{WANTS} No space left on device at " in error_line(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept", "runs"]


def test_a_failed_claim_leaves_the_run_that_took_the_id_alone(tmp_path, monkeypatch):
    """Without --run-id two runs started in one second share the id: when this one's claim of
    the next suffix fails (a full disk), the folder and empty weights/ of the other run, just
    made, are left alone (before: removed as if this run had made them)."""
    import os as _os

    from toymlx.bundle import folder
    from toymlx.bundle.options import RunError

    other = tmp_path / "same-sec"
    (other / "weights").mkdir(parents=True)  # the other run, before its first checkpoint
    real_mkdir = _os.mkdir

    def full(path, *a, **k):
        if str(path) == str(tmp_path / "same-sec-2"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(folder.os, "mkdir", full)
    with pytest.raises(RunError) as e:
        folder.prepare_run_dir(str(tmp_path), "same-sec", overwrite=False, default_id=True)
    assert str(e.value) == (f"{other}: {WANTS} No space left on device at "
                            f"{tmp_path / 'same-sec-2'}; make room or make it writable, or "
                            "choose another --runs-root")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "same-sec", "same-sec/weights"]


# ---- bad configuration: one line, exit 2, nothing trained -------------------------------------------
@pytest.mark.parametrize("extra,flag", [
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--model.context", "64", "--seq-len", "128"], "--seq-len"),
    (["--batch-size", "4096"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--cpu-streams", "-1"], "--cpu-streams"),
    (["--data.path", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, data, extra, flag):
    rc = train(tmp_path, "bad", "--steps", "3", *extra, data=data)
    assert rc == 2
    line = error_line(capsys)
    assert flag in line, line
    assert not (tmp_path / "bad").exists()  # nothing left behind


def test_unknown_recipe(capsys):
    assert main(["--recipe", "no-such-recipe", "--steps", "1"]) == 2
    line = error_line(capsys)
    assert "--recipe" in line and "no-such-recipe" in line


def _digest(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_reused_run_id_never_overwrites(tmp_path, capsys, data):
    assert train(tmp_path, "r", "--steps", "2", data=data) == 0
    run = tmp_path / "r"
    before = _digest(run)
    capsys.readouterr()
    assert train(tmp_path, "r", "--steps", "3", data=data) == 2
    line = error_line(capsys)
    assert "already exists" in line and "--resume" in line and "--overwrite" in line
    assert _digest(run) == before
    assert train(tmp_path, "r", "--steps", "3", "--overwrite", data=data) == 0
    assert [e["start_step"] for e in read_events(run) if e["kind"] == "run_start"] == [0]
    assert resolve_latest(run).name == "step_3.gguf"


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys, data):
    """--overwrite replaces a run bundle, never a plain folder: the user's file stays, and the
    message says the folder is not a run (with or without --overwrite)."""
    plain = tmp_path / "d"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    assert train(tmp_path, "d", "--steps", "1", "--overwrite", data=data) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {plain}: --overwrite: expected a run bundle (toymlx's config.json "
        "and events.jsonl) or an empty folder, found a folder that is not a run, holding "
        "notes.txt; nothing was removed: choose another --run-id or --runs-root")
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]
    assert (plain / "notes.txt").read_text() == "mine"
    assert train(tmp_path, "d", "--steps", "1", data=data) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {plain}: expected a new or empty folder for the run, found a "
        "folder that is not a run bundle, holding notes.txt; choose another --run-id or "
        "--runs-root")
    assert sorted(p.name for p in plain.iterdir()) == ["notes.txt"]


def test_a_folder_that_is_not_a_run_is_named_by_its_first_four_names(tmp_path):
    from toymlx.bundle import folder
    from toymlx.bundle.options import RunError

    plain = tmp_path / "d"
    (plain / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt", "e.txt", "f.txt"):
        (plain / name).write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(RunError) as e:
            folder.prepare_run_dir(str(tmp_path), "d", overwrite=overwrite)
        assert "holding a.txt, b.txt, c.txt, e.txt and 2 more; " in str(e.value)
    assert sorted(p.name for p in plain.iterdir()) == ["a.txt", "b.txt", "c.txt", "e.txt",
                                                       "f.txt", "sub"]


def test_a_run_killed_as_it_started_leaves_a_folder_the_same_command_takes(tmp_path):
    """kill -9 while a run starts (building its model, hashing its base: seconds for
    SmolLM2-135M) left runs/ID with its lock file and an empty weights/ (a killed config.json
    write also `.config.json.tmp-PID`), and the same command again was refused: "found a
    folder that is not a run bundle, holding weights/; choose another --run-id" (--resume:
    no config.json). Now that folder is an empty one: taken, the dead writer's temporary
    removed. A live writer's temporary, or a file of the user's, is still refused."""
    import json
    import os

    from toymlx.backend.atomic import TMP_TAG
    from toymlx.bundle import folder
    from toymlx.bundle.options import RunError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "r"
    (run / "weights").mkdir(parents=True)
    (run / ".lock").write_text(json.dumps({"pid": dead.pid}))
    (run / f".config.json{TMP_TAG}{dead.pid}").write_text('{"recipe": "vit-ti')
    with pytest.raises(RunError) as e:  # nothing to resume: the same command is the way on
        folder.read_config(run, "--resume")
    assert str(e.value) == (f"{run / 'config.json'}: --resume: expected the run's saved config, "
                            "found no file: the run was killed as it started, before writing "
                            "it, so nothing of it is left; start it again with its command, "
                            "which takes this folder (without --resume)")
    (tmp_path / "mine").mkdir()  # a folder of the user's: no word of a kill
    with pytest.raises(RunError) as e:
        folder.read_config(tmp_path / "mine", "--resume")
    assert str(e.value).endswith("found no file (a run folder of toymlx-train has one)")
    run_dir, lock, _ = folder.prepare_run_dir(str(tmp_path), "r", overwrite=False)
    lock.release()
    assert run_dir == run and sorted(p.name for p in run.iterdir()) == ["weights"]
    live = f".config.json{TMP_TAG}{os.getppid()}"
    (run / live).write_text("{")
    with pytest.raises(RunError) as e:
        folder.prepare_run_dir(str(tmp_path), "r", overwrite=False)
    assert str(e.value) == (f"{run}: expected a new or empty folder for the run, found a folder "
                            f"that is not a run bundle, holding {live}, weights/; choose another "
                            "--run-id or --runs-root")


def test_overwrite_refuses_a_run_holding_files_toymlx_did_not_write(tmp_path, capsys, data):
    """--overwrite replaces what toymlx wrote in a run (TensorBoard and W&B files, superseded
    checkpoints, a fused export, temporaries included), never a user's own files beside it:
    those are named and nothing is removed."""
    assert train(tmp_path, "r", "--steps", "2", data=data) == 0
    run = tmp_path / "r"
    ours = ["events.superseded.jsonl", "rewinding.json", "data_index.json",
            "events.out.tfevents.1796058315.vm.17557.0", "wandb/debug.log", "fused-f16.gguf", ".config.json.tmp-99999",
            "weights/superseded/step_3.gguf", "weights/superseded/step_3.state.safetensors"]
    mine = ["my_notes.txt", "analysis/plot.csv", "weights/README"]
    for name in ours + mine:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    before = _digest(run)
    capsys.readouterr()
    assert train(tmp_path, "r", "--steps", "2", "--overwrite", data=data) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --overwrite: expected only the files toymlx writes in a "
        "run bundle, found others too: analysis/, my_notes.txt, weights/README; nothing was "
        "removed: move them out of the run folder, or choose another --run-id or --runs-root")
    assert _digest(run) == before
    for name in mine:
        (run / name).unlink()
    (run / "analysis").rmdir()
    assert train(tmp_path, "r", "--steps", "2", "--overwrite", data=data) == 0
    assert not any((run / name).exists() for name in ours)


def test_overwrite_takes_an_empty_folder_and_a_run_killed_before_its_first_step(
        tmp_path, capsys, data):
    """An empty folder is taken; a run killed while building (config.json alone) is named as
    such to a command of other options, and --overwrite replaces it; the same command starts
    it over, saying so."""
    (tmp_path / "e").mkdir()
    assert train(tmp_path, "e", "--steps", "1", data=data) == 0
    assert train(tmp_path, "k", "--steps", "1", data=data) == 0
    run = tmp_path / "k"
    (run / "events.jsonl").unlink()
    for p in (run / "weights").iterdir():
        p.unlink()
    capsys.readouterr()
    assert train(tmp_path, "k", "--steps", "2", data=data) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: a run bundle already exists but never reached its first "
        f"step (config.json, no events.jsonl); pass --overwrite to replace it, toymlx-train "
        f"--resume {run} --from step_0 to start it over, or choose another --run-id")
    assert train(tmp_path, "k", "--steps", "2", "--overwrite", data=data) == 0
    (run / "events.jsonl").unlink()
    for p in (run / "weights").iterdir():
        p.unlink()
    capsys.readouterr()
    assert train(tmp_path, "k", "--steps", "2", data=data) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"toymlx-train: {run}: the run of these same options there was killed as it started, "
        "before it trained a step (no step in events.jsonl, no checkpoint): starting it over")
    assert [e["kind"] for e in read_events(run)][:1] == ["run_start"]
    # killed so with an offline W&B run (its start's line named it to `wandb sync`): its files
    # go with the rest, and the line says so (it said nothing, the sync line left naming them)
    events = run / "events.jsonl"  # killed in its first step: run_start alone
    events.write_text(events.read_text().splitlines(keepends=True)[0])
    for p in (run / "weights").iterdir():
        p.unlink()
    (run / "wandb" / "offline-run-20261205_000000-0123456789abcdef").mkdir(parents=True)
    capsys.readouterr()
    assert train(tmp_path, "k", "--steps", "2", data=data) == 0
    assert capsys.readouterr().err.splitlines()[0].endswith(
        "starting it over; its offline W&B run goes with it: there is nothing of it to wandb sync")
    assert not (run / "wandb").exists()


def test_resume_with_another_recipe_or_shape_is_refused(tmp_path, capsys, data, stories_path):
    assert train(tmp_path, "r", "--steps", "2", data=data) == 0
    run = tmp_path / "r"
    before = _digest(run)
    capsys.readouterr()
    assert main(["--recipe", "lora", "--resume", str(run)]) == 2
    line = error_line(capsys)
    assert "'from-scratch'" in line and "lora" in line
    assert main(["--resume", str(run), "--model.d-model", "64", "--steps", "4"]) == 2
    line = error_line(capsys)
    assert "d_model" in line and "32" in line and "64" in line
    assert main(["--resume", str(tmp_path / "nothing-here")]) == 2
    error_line(capsys)
    assert _digest(run) == before  # config.json was not rewritten by the refused resumes
    assert main(["--resume", str(run), "--steps", "3", "--no-progress"]) == 0


def test_lora_bad_options(tmp_path, capsys, stories_path):
    base = ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
            "--run-id", "l", "--steps", "1", "--no-progress", "--no-compile"]
    for extra, flag in [(["--lora.rank", "0"], "--lora.rank"),
                        (["--lora.targets", "q,nope"], "--lora.targets"),
                        (["--lora.layers", "99"], "--lora.layers")]:
        assert main([*base, *extra]) == 2
        assert flag in error_line(capsys)
        assert not (tmp_path / "l").exists()
