"""The one way toymlx replaces a file: write a temporary beside it, fsync, rename, fsync the folder.

A crash at any instant leaves either the old file or the complete new one, never a mix: the
temporary `.<name>.tmp-<pid>` lives in the target's folder (so the rename is atomic on one
filesystem), the process id keeps two writers' temporaries apart, and the folder is fsynced so
the rename itself survives a power cut. On any failure the temporary is removed and the old
file stays as it was; an OSError (a full disk, a file-size limit) names the target file. `checkpoint.clean_temporaries` sweeps what a killed writer leaves.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from toymlx.backend.lifeline import alive

TMP_TAG = ".tmp-"
"""Every temporary's name holds this (`.<name>.tmp-<pid>`), so leftovers can be found."""


def temporary(path: Path) -> Path:
    """The temporary name this process writes `path` through."""
    return path.with_name(f".{path.name}{TMP_TAG}{os.getpid()}")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def discard(tmp: Path) -> None:
    """Remove a failed write's temporary if it can be: on a read-only disk even removing a
    missing file fails (EROFS, naming the temporary), which hid the error that ended the write;
    one left behind is swept by the next write (`remove_stale`)."""
    with suppress(OSError):
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary name for a writer that takes a file name (llama.cpp's quantizer); what it
    wrote there replaces `path` when the block ends without an error, and is removed if not."""
    path = Path(path)
    tmp = temporary(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        discard(tmp)
        raise named(e, path) from None
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb",
                encoding: str | None = None) -> Iterator[IO]:
    """A file object whose contents replace `path` when the block ends without an error."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: expected mode 'wb' or 'w', found {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding if mode == "w" else None
                                         ) as f:
        yield f


def remove_stale(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of `path` (`.<name>*.tmp-<pid>`, and a temporary's own,
    `..<name>.f32.tmp-<pid>.tmp-<pid>`: llama.cpp's F32 input killed as it was written) whose
    writer process is gone (killed mid-write); return them. Another live writer's temporaries
    are kept."""
    path = Path(path)
    stale = []
    if not path.parent.is_dir():
        return stale
    for p in sorted(path.parent.iterdir()):
        if _is_temporary(p, path) and is_stale(p):
            p.unlink(missing_ok=True)
            stale.append(p)
    return stale


def is_stale(p: Path) -> bool:
    """`p` is a temporary (`.<name>.tmp-<pid>`) whose writer process is gone: killed mid-write."""
    pid = p.name.rpartition(TMP_TAG)[2]
    return (p.name.startswith(".") and TMP_TAG in p.name and pid.isdigit()
            and int(pid) != os.getpid() and not alive(int(pid)))


def named(e: OSError, path: str | os.PathLike) -> OSError:
    """`e` naming the file it failed on: a write's ENOSPC or EFBIG names none by itself, and
    one refused at the temporary (a read-only or full disk) named `.<name>.tmp-<pid>`, a file
    the user never asked for."""
    if e.errno is None or (e.filename is not None and not _is_temporary(e.filename, path)):
        return e
    return OSError(e.errno, e.strerror or str(e), str(path))


def free_bytes(folder: str | os.PathLike) -> int | None:
    """The bytes this user may still write on the disk that holds `folder`; None where that
    cannot be measured."""
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


@contextmanager
def room_for(size: int) -> Iterator[None]:
    """A block that writes one file of about `size` bytes (outside its `atomic_open`, so its
    temporary is gone): a full disk's OSError (ENOSPC, EDQUOT) then says how much the file takes
    against what is free on its disk, "No space left on device (the file takes 812.3 MiB;
    402.0 MiB are free there)"; any other error passes as it is."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or e.filename is None:
            raise
        if (free := free_bytes(Path(e.filename).parent)) is None:
            raise e from None
        raise OSError(e.errno, f"{e.strerror or e} (the file takes {size / 2**20:.1f} MiB; "
                      f"{free / 2**20:.1f} MiB are free there)", e.filename) from None


def _is_temporary(name: str | os.PathLike, path: str | os.PathLike) -> bool:
    """`name` is one of `path`'s temporaries (`.<name>*.tmp-<pid>` beside it, or a temporary's
    temporary, `..<name>*.tmp-<pid>.tmp-<pid>`)."""
    name, path = Path(name), Path(path)
    return (name.parent == path.parent and TMP_TAG in name.name
            and re.match(rf"\.+{re.escape(path.name)}", name.name) is not None)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace `path` with `data` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace `path` with UTF-8 `text` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def symlink(target: str, link: str | os.PathLike) -> None:
    """Point the symlink `link` at `target` (a name relative to its folder), atomically."""
    link = Path(link)
    tmp = temporary(link)
    discard(tmp)
    try:
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except OSError as e:  # named for the link: os.symlink's names the target and the temporary
        discard(tmp)
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(link)) from None
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(link.parent)


@contextmanager
def output_folder(path: str | os.PathLike) -> Iterator[Path]:
    """`path` made (its missing parents too) for the block to write into; if the block fails,
    each folder this call made is removed again where it is empty, so a failed export (a full
    disk) leaves no empty `--out DIR` behind. A folder that was there before is never removed,
    nor one that holds anything."""
    path = Path(path)
    made = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        made.append(folder)  # deepest first
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        for folder in made:
            with suppress(OSError):
                folder.rmdir()
        raise
