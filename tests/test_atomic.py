"""The one atomic writer, used by every kind of file toymlx writes: a process killed between
the write and the rename leaves the old file intact (and its complete new temporary beside it,
named for the writer's process, for the next run to sweep away)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toymlx.backend import atomic

# Each child writes the file once for real (the "old" file), prints its digest, then makes
# every rename kill the process (SIGKILL: nothing runs after it) and writes it again.
CHILD = r"""
import hashlib, json, os, signal, sys
from pathlib import Path
import numpy as np
import mlx.core as mx
import toymlx
from toymlx.bundle import checkpoint, events
from toymlx.bundle import folder as runs
from toymlx.runner import launch, report
from toymlx.sweeps import spec as sweep
from toymlx.gguf.writer import write_gguf
from toymlx.recipes import from_scratch

kind, d, stories = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
target = {"gguf": d / "m.gguf", "state": d / "s.state.safetensors", "latest": d / "latest",
          "config": d / "config.json", "summary": d / "summary.csv", "png": d / "r.png",
          "html": d / "r.html", "rank-status": d / "rank0.start", "sweep-file": d / "sweep.json",
          "export": d / "out.gguf", "events": d / "events.jsonl"}[kind]
rows = report.summarize([d / "nothing"])
params = report.add_params(rows)


def write(version):
    if kind == "gguf":
        write_gguf(target, {"general.architecture": "x", "v": version},
                   {"t": np.full(64, version, np.float32)})
    elif kind == "state":
        checkpoint.save_state(target, {"a": mx.full((8,), version)}, {"step": version})
    elif kind == "latest":
        checkpoint.update_latest(d, d / f"step_{version}.gguf")
    elif kind == "config":
        runs.save_config(d, "from-scratch", from_scratch.Config(steps=version))
    elif kind == "summary":
        rows[0]["message"] = f"v{version}"
        report.write_summary(rows, params, d)
    elif kind in ("png", "html"):
        rows[0]["run"] = f"v{version}"
        report.render([], target, rows, params)
    elif kind == "rank-status":
        os.environ.update(TOYMLX_RANK_STATUS=str(d), MLX_RANK="0")
        with launch.rank_status() as st:
            st.code = version
    elif kind == "sweep-file":
        specs = sweep.grid(["--steps", str(version)], {"lr": [1e-3]})
        sweep.write_sweep_file(d, "from-scratch", specs)
    elif kind == "export":
        if version == 1:
            target.write_bytes(b"an earlier export")
            return
        from toymlx.gguf.llama import load_llama
        from toymlx.models.lora import apply_lora
        from toymlx.training.adapter import write_adapter
        model, g = load_llama(stories)
        apply_lora(model, ["q"], None, 2, 4.0, 0.0)
        os.replace = real_replace  # the adapter it exports is not the file under test
        write_adapter(d / "adapter.gguf", model, {"general.architecture": "llama"})
        os.replace = die
        from toymlx_cli.export import main
        main(["--base", stories, "--adapter", str(d / "adapter.gguf"), "--out", str(target),
              "--overwrite"])
    elif kind == "events":
        if version == 1:
            log = events.EventLog(target)
            for s in range(1, 5):
                log.emit("step", step=s, loss=1.0)
            log.close()
        else:
            events.cut_back(d, 2)


def die(src, dst, *a, **k):
    if Path(dst).parent != d:  # another file's rename (MLX's kernel folder relinked at start-up)
        return real_replace(src, dst, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)


real_replace = os.replace
write(1)
data = os.readlink(target).encode() if target.is_symlink() else target.read_bytes()
print(hashlib.sha256(data).hexdigest(), flush=True)
os.replace = die
write(2)
print("survived", flush=True)
"""

KINDS = ["gguf", "state", "latest", "config", "summary", "png", "html", "rank-status",
         "sweep-file", "export", "events"]


def test_killed_between_write_and_rename_every_writer_keeps_the_old_file(tmp_path,
                                                                       stories_path):
    procs = {}
    for kind in KINDS:  # all at once: each child pays the imports
        d = tmp_path / kind
        d.mkdir()
        procs[kind] = (d, subprocess.Popen([sys.executable, "-c", CHILD, kind, str(d),
                                            str(stories_path)], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True))
    problems = []
    for kind, (d, p) in procs.items():
        out, err = p.communicate(timeout=300)
        lines = out.split()
        if p.returncode != -9 or len(lines) != 1:
            problems.append(f"{kind}: exit {p.returncode}, stdout {lines}, {err[-1500:]}")
            continue
        names = {"latest": "latest", "rank-status": "rank0.start", "png": "r.png",
                 "html": "r.html", "summary": "summary.csv", "config": "config.json",
                 "sweep-file": "sweep.json", "export": "out.gguf", "events": "events.jsonl",
                 "gguf": "m.gguf", "state": "s.state.safetensors"}
        target = d / names[kind]
        data = os.readlink(target).encode() if target.is_symlink() else target.read_bytes()
        if hashlib.sha256(data).hexdigest() != lines[0]:
            problems.append(f"{kind}: {target.name} changed")
        tmps = [f.name for f in d.iterdir() if f.name.startswith(f".{target.name}.tmp-")]
        if len(tmps) != 1 or not tmps[0].endswith(f".tmp-{p.pid}"):
            problems.append(f"{kind}: expected one temporary .{target.name}.tmp-{p.pid}, "
                            f"found {sorted(f.name for f in d.iterdir())}")
    assert not problems, "\n".join(problems)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    atomic.write_text(path, "old")

    class Full(Exception):
        pass

    with pytest.raises(Full), atomic.atomic_open(path) as f:
        f.write(b"half of the new")
        raise Full
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]
    with pytest.raises(OSError) as e:
        atomic.write_text(tmp_path / "no-such-dir" / "x", "y")
    assert e.value.errno == errno.ENOENT


def test_temporaries_are_named_for_their_writer(tmp_path):
    assert atomic.temporary(tmp_path / "a.gguf") == tmp_path / f".a.gguf.tmp-{os.getpid()}"
    assert atomic.TMP_TAG in atomic.temporary(Path("x")).name


def test_a_read_only_disk_names_the_file_not_its_temporary(tmp_path, monkeypatch):
    """On a read-only disk the temporary cannot be created, and removing it (missing) fails
    too (EROFS): that second error, naming `.plot.png.tmp-<pid>`, replaced the first
    (toymlx-eval --plot, toymlx-report --out, toymlx-export --fuse), and a link's naming the
    link's target and temporary. Each names the file being written."""
    real_open, real_unlink = open, Path.unlink

    def ro(path):
        return OSError(errno.EROFS, "Read-only file system", str(path))

    def refuse_open(path, *a, **k):
        if atomic.TMP_TAG in str(path):
            raise ro(path)
        return real_open(path, *a, **k)

    def refuse_unlink(self, missing_ok=False):
        if atomic.TMP_TAG in self.name:  # Linux: EROFS before it looks for the file
            raise ro(self)
        return real_unlink(self, missing_ok=missing_ok)

    def refuse_symlink(src, dst, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", src, None, dst)

    monkeypatch.setattr(atomic, "open", refuse_open, raising=False)
    monkeypatch.setattr(Path, "unlink", refuse_unlink)
    monkeypatch.setattr(atomic.os, "symlink", refuse_symlink)
    for name, write in (("plot.png", lambda p: atomic.write_text(p, "x")),
                        ("latest", lambda p: atomic.symlink("step_2.gguf", p))):
        with pytest.raises(OSError) as e:
            write(tmp_path / name)
        assert str(e.value) == f"[Errno 30] Read-only file system: '{tmp_path / name}'"
    monkeypatch.undo()
    # a temporary of the target's own (llama.cpp's F32 input beside a Q4_K_M export) too
    staged = OSError(errno.ENOSPC, "No space left on device",
                     str(tmp_path / f".f.gguf.f32{atomic.TMP_TAG}12"))
    assert atomic.named(staged, tmp_path / "f.gguf").filename == str(tmp_path / "f.gguf")
    other = OSError(errno.ENOENT, "No such file or directory", "/elsewhere/x")
    assert atomic.named(other, tmp_path / "f.gguf") is other
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_output_folder_is_removed_when_its_write_fails_where_it_made_it(tmp_path):
    """The folders `output_folder` made (the deepest first) go again when the block fails; one
    that was there, or that holds a file, stays."""
    with pytest.raises(OSError, match="full"), \
            atomic.output_folder(tmp_path / "a" / "b" / "c") as out:
        assert out.is_dir()
        raise OSError(errno.ENOSPC, "full")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    with pytest.raises(OSError), atomic.output_folder(tmp_path / "there"):
        raise OSError(errno.ENOSPC, "full")
    with pytest.raises(OSError), atomic.output_folder(tmp_path / "x" / "y") as out:
        (out.parent / "kept.txt").write_text("x")
        raise OSError(errno.ENOSPC, "full")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "there", "x", "x/kept.txt"]
    with atomic.output_folder(tmp_path / "ok" / "d") as out:  # no failure: kept
        pass
    assert out.is_dir()


def test_a_gguf_on_a_full_disk_says_what_it_takes_against_what_is_free(tmp_path, monkeypatch):
    """A GGUF write a full disk stops (an export, a checkpoint) names the file, the size it
    takes (the size it has once written) and what is free there, and leaves nothing behind
    (before: "No space left on device" alone, the user left to guess how much to free)."""
    import numpy as np

    from toymlx.gguf.writer import write_gguf

    tensors = {"w": np.arange(70_000, dtype=np.float32).reshape(700, 100)}
    size = write_gguf(tmp_path / "whole.gguf", {"general.name": "x"}, tensors).stat().st_size
    real_open = open

    def full_disk(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "w" in mode and atomic.TMP_TAG in str(path):
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr(atomic, "open", full_disk, raising=False)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(OSError) as e:
        write_gguf(out, {"general.name": "x"}, tensors)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize / 2**20
    said = str(e.value)
    assert said.startswith(f"[Errno 28] No space left on device (the file takes "
                           f"{size / 2**20:.1f} MiB; "), said
    assert said.endswith(f" MiB are free there): '{out}'"), said
    assert abs(float(said.split("; ")[1].split(" MiB")[0]) - free) < 64, said  # others write
    assert list(out.parent.iterdir()) == []
    # any other error passes as it is
    with pytest.raises(OSError) as e, atomic.room_for(10):
        raise OSError(errno.EACCES, "Permission denied", str(out))
    assert str(e.value) == f"[Errno 13] Permission denied: '{out}'"


def test_a_killed_writers_temporaries_are_swept_with_a_temporarys_own(tmp_path):
    """`remove_stale` sweeps every temporary a killed writer left beside the target, also the
    temporary of llama.cpp's F32 input (`..q8.gguf.f32.tmp-P.tmp-P`: an export or
    --fuse-at-end killed as it wrote that file), which it missed, leaving a model-sized F32
    file (540 MB for SmolLM2-135M) behind every killed q8_0 export; a live writer's and another
    target's stay."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag, live = atomic.TMP_TAG, os.getppid()
    names = [f".q8.gguf{tag}{dead.pid}", f".q8.gguf.f32{tag}{dead.pid}",
             f"..q8.gguf.f32{tag}{dead.pid}{tag}{dead.pid}", f".q8.gguf{tag}{live}",
             f".other.gguf{tag}{dead.pid}", "q8.gguf"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    swept = atomic.remove_stale(tmp_path / "q8.gguf")
    assert sorted(p.name for p in swept) == sorted(names[:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])
    assert atomic.remove_stale(tmp_path / "no-such-dir" / "q8.gguf") == []


def test_a_timm_export_on_a_full_disk_says_what_it_takes_against_what_is_free(tmp_path,
                                                                               monkeypatch):
    """toymlx-export --format safetensors onto a full disk said "No space left on device" alone
    (a GGUF export says the room it takes and what is free): now the same, the size that of
    the file once written (20.4 MiB for vit-tiny), nothing left behind."""
    import numpy as np

    from toymlx.interop.timm_export import write_safetensors

    tensors = {"w": np.ones((700, 1000), np.float32), "b": np.ones(300, np.float32)}
    whole = tmp_path / "whole.safetensors"
    write_safetensors(whole, tensors, {"format": "pt"})
    size = whole.stat().st_size
    real_open = open

    def full_disk(path, mode="r", *a, **k):
        if "w" in mode and atomic.TMP_TAG in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(atomic, "open", full_disk, raising=False)
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 1 << 20)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(OSError) as e:
        write_safetensors(out, tensors, {"format": "pt"})
    assert str(e.value) == (f"[Errno 28] No space left on device (the file takes "
                            f"{size / 2**20:.1f} MiB; 1.0 MiB are free there): '{out}'")
    assert list(out.parent.iterdir()) == []
