"""tests/llamacpp_source.py unpacks the llama-cpp-python sdist with its own member checks, on
every Python the installer accepts (tarfile's `filter="data"` needs 3.11.4+; Debian 12 has
3.11.2): a member that would land outside the folder stops the unpacking, naming it, and writes
nothing outside. Each case runs with tarfile's data filter and without it (as on 3.10-3.11.3)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from llamacpp_source import extract_inside


def _tar(path: Path, members: list[tuple[str, str, str]]) -> Path:
    """A .tar.gz of (name, kind, content or link target); kind: file, dir, sym, hard, fifo."""
    types = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
             "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}
    with tarfile.open(path, "w:gz") as t:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            info.type = types[kind]
            info.mode = 0o6777 if kind == "file" else 0o755
            data = value.encode() if kind == "file" else b""
            if kind in ("sym", "hard"):
                info.linkname = value
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(params=["data filter", "no data filter"])
def filter_kind(request, monkeypatch) -> str:
    if request.param == "no data filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile has no data filter (3.11.4+ has)")
    return request.param


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_a_plain_archive_unpacks_whole(tmp_path, filter_kind):
    tar = _tar(tmp_path / "ok.tar.gz", [
        ("pkg", "dir", ""), ("pkg/a.txt", "file", "alpha"), ("pkg/sub", "dir", ""),
        ("pkg/sub/b.txt", "file", "beta"), ("pkg/link", "sym", "sub/b.txt"),
        ("pkg/up", "sym", "../pkg/a.txt"), ("pkg/hard", "hard", "pkg/a.txt")])
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(tar) as t:
        extract_inside(t, out)
    assert _files(out) == ["pkg", "pkg/a.txt", "pkg/hard", "pkg/link", "pkg/sub",
                           "pkg/sub/b.txt", "pkg/up"]
    assert [(out / "pkg" / n).read_text() for n in ("a.txt", "hard", "link", "up")] == \
        ["alpha", "alpha", "beta", "alpha"]
    assert (out / "pkg" / "a.txt").stat().st_mode & 0o7777 == 0o755  # no set-id, no o+w


@pytest.mark.parametrize("members, bad, why", [
    ([("../evil.txt", "file", "x")], "../evil.txt", "its path leaves the folder"),
    ([("pkg/../../evil.txt", "file", "x")], "pkg/../../evil.txt", "its path leaves the folder"),
    ([("/tmp/toymlx-abs-evil.txt", "file", "x")], "/tmp/toymlx-abs-evil.txt",
     "its path leaves the folder"),
    ([("etc", "sym", "../../etc")], "etc", "a symbolic link to '../../etc', outside the folder"),
    ([("passwd", "sym", "/etc/passwd")], "passwd",
     "a symbolic link to '/etc/passwd', outside the folder"),
    ([("h", "hard", "../evil.txt")], "h", "a hard link to '../evil.txt', outside the folder"),
    # a link unpacked first that a later member goes through: here -> ".", then here/.. is the
    # folder's parent
    ([("here", "sym", "."), ("up", "sym", "here/.."), ("up/evil.txt", "file", "x")], "up",
     "a symbolic link to 'here/..', outside the folder"),
    ([("dir", "dir", ""), ("dir/to-out", "sym", "../.."), ("dir/to-out/evil.txt", "file", "x")],
     "dir/to-out", "a symbolic link to '../..', outside the folder"),
    ([("pipe", "fifo", "")], "pipe", "not a file, folder or link"),
])
def test_a_member_leading_out_stops_the_unpacking(tmp_path, filter_kind, members, bad, why):
    tar = _tar(tmp_path / "bad.tar.gz", [("pkg", "dir", ""), ("pkg/a.txt", "file", "a"),
                                         *members])
    out = tmp_path / "x" / "out"
    out.mkdir(parents=True)
    before = _files(tmp_path)
    with tarfile.open(tar) as t, pytest.raises(tarfile.TarError) as e:
        extract_inside(t, out)
    assert str(e.value) == (f"{tar}: member {bad!r}: expected a path inside {out}, found "
                            f"{why}; unpacking stopped")
    # nothing outside the folder; inside it, only the members before the bad one
    after = _files(tmp_path)
    assert [f for f in after if not f.startswith("x/out/")] == before
    assert not Path("/tmp/toymlx-abs-evil.txt").exists()
    assert "x/out/pkg/a.txt" in after
