"""What a path is before anything opens it: opening a FIFO waits for a writer that may never
come, and reading a device such as /dev/urandom never ends, so every file input is checked to
be a regular file (or a folder where one is expected) first (`special_kind`)."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"),
               (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
"""The first bytes of the image kinds toymlx reads (WEBP: RIFF....WEBP, in
`toymlx.data.image_folder._sniff`); a text reader names them too (`toymlx.data.text.NOT_TEXT`)."""


def special_kind(path: str | os.PathLike) -> str | None:
    """What `path` is (following links) when it is neither a regular file nor a folder: "a FIFO
    (named pipe)", "a character device", "a block device" or "a socket"; None for a regular
    file, a folder, or nothing there (the caller's own message covers those)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, unreadable, a name too long, a NUL byte
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def empty_folder(path: str | os.PathLike) -> bool:
    """True for a folder (or a link to one) with no entries at all, hidden ones included."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except (OSError, ValueError):  # not a folder, missing, unreadable, a NUL byte
        return False


def nothing_there(path: str | os.PathLike) -> str:
    """What is found at a path that holds nothing, for an error's "found ...": "an empty
    folder" (`empty_folder`), else "nothing at that path", with the likely cause where one is
    plain: a link to a missing file, a file where a folder is named (`x/y`), or a `~` the shell
    left as it is (quoted, after `--opt=`, or in a -c file), which names a folder `~` here, not
    the home folder."""
    text, p = str(path), Path(path)
    if empty_folder(p):
        return "an empty folder"
    if p.is_symlink():
        try:
            os.stat(p)
        except OSError as e:
            if e.errno == errno.ELOOP:  # not a missing file: no target is ever reached
                return (f"nothing at that path (a link to {os.readlink(p)}, a loop of links "
                        "that never reaches a file)")
        return f"nothing at that path (a link to {os.readlink(p)}, which is missing)"
    if text.startswith("~"):
        return (f"nothing at that path ({text.split(os.sep, 1)[0]} is expanded only by the "
                "shell, not inside quotes, after --opt= or in a -c file: write "
                f"{os.path.expanduser(text)})")
    above = next((a for a in p.parents if a.exists()), None)
    if above is not None and not above.is_dir():
        return f"nothing at that path ({above} is a file, not a folder)"
    return "nothing at that path"


def not_a_file(path: str | os.PathLike) -> str:
    """What stands at `path` where a regular file was expected, for an error's "found ...":
    "a directory", a special file's kind (`special_kind`), else `nothing_there`'s words."""
    if Path(path).is_dir():
        return "a directory"
    return special_kind(path) or nothing_there(path)


def shortlist(names: Sequence[str], cap: int) -> str:
    """`names` for an error's "found ..." or "holding ...", cut after the first `cap`: "a, b and
    3 more" (5 names, cap 2), "a, b" (2 names, cap 2 or more), "" (none). One helper, so every
    such list reads alike; each message keeps its own cap."""
    more = f" and {len(names) - cap} more" if len(names) > cap else ""
    return ", ".join(names[:cap]) + more


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun` for a message, the noun plural unless `n` is 1: "1 row", "2 rows", "0
    rows"; `plural` where an added s will not do ("1 class", "3 classes"). One helper, so a
    count a user can bring to 1 (one training row, a run stopped at step 1) reads right."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def json_fault(e: json.JSONDecodeError, line: bool = True) -> str:
    """json's complaint and where ("Expecting value at line 3 column 1"; `line` False: the
    column alone, for one line of JSONL), and "where the text ends: cut short?" where the text
    stops before its JSON does (a copy or download cut off, or for JSONL an object spread
    over several lines); "an empty file" for no text. json's own "Unterminated string starting
    at" read "at at column 11"."""
    if not e.doc.strip():
        return "an empty file" if line else "an empty line"
    at = f"line {e.lineno} column {e.colno}" if line else f"column {e.colno}"
    text = f"{e.msg} {at}" if e.msg.endswith(" at") else f"{e.msg} at {at}"
    if e.msg.startswith("Unterminated") or e.pos >= len(e.doc.rstrip()):
        text += ", where the text ends: cut short?"
    return text


def not_utf8(text: str) -> str | None:
    """The first thing in `text` that UTF-8 cannot encode, described ("the byte 0xe9 at
    character 3": a byte of a non-UTF-8 file name or command line, which Python carries as a
    surrogate escape U+DC80..U+DCFF; or "a lone surrogate U+D800 at character 0"); None when
    all of it can be written as UTF-8 (config.json, events.jsonl)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        found = (f"the byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else
                 f"a lone surrogate U+{c:04X}")
        return f"{found} at character {e.start}"
    return None


def not_read_line(root: Path, others: Sequence[Path], named: str, suffixes: Sequence[str],
                  advice: str) -> str | None:
    """One line naming the files below data folder `root` that are not read (`others`), their
    names not those of `named` (the kind read, by `suffixes`), counted by extension, then
    `advice`; None for none. Left out without a word, a class of .heic photos or a folder of
    notes kept as .org files trained on what remained."""
    if not others:
        return None
    by_ext: dict[str, int] = {}
    for f in others:
        ext = f.suffix.lower() or "no extension"
        by_ext[ext] = by_ext.get(ext, 0) + 1
    kinds = ", ".join(f"{n} {ext}" for ext, n in sorted(by_ext.items(), key=lambda e: -e[1]))
    names = shortlist([str(f.relative_to(root)) for f in others], 3)
    return (f"{root}: {counted(len(others), 'file')} not read, not named as {named} "
            f"(*{', *'.join(suffixes[:3])}, ...): {kinds} ({names}); {advice}")


def hidden_below(name: Path, folder: str | os.PathLike) -> bool:
    """Whether `name`, a path `names_below(folder)` gave, is hidden there: its own name or a
    folder on its way down from `folder` starts with "." (`.draft.txt`, Jupyter's
    `.ipynb_checkpoints/a.md`, `.git/`). Data folders skip such names, both where they are
    read and where they are fingerprinted, so an edit there neither trains nor stops a resume."""
    return any(part.startswith(".") for part in name.relative_to(folder).parts)


def names_below(folder: str | os.PathLike) -> Iterator[Path]:
    """Every name below `folder` that is not a folder (files, links to nothing, FIFOs: the
    caller decides), through linked subfolders as torchvision's ImageFolder walks them, each
    real folder once; hidden files are kept (`hidden_below` is the caller's), hidden folders not
    entered: no data folder reads what they hold, and a link in one (`.git/x -> ..`) refused the
    whole folder. Every data folder (an ImageFolder's classes, a folder of text files) is read
    with it and fingerprinted with it, so a linked class folder is both trained on and part of
    what a resume checks. ValueError naming a linked subfolder
    back up the tree, to a folder holding the link (`cat/up -> ..`, `notes/sub/up -> ..`): one
    that holds `folder` read the folders beside it (an ImageFolder's class took the other
    classes' images), one within it was skipped; both without a word, and by two rules."""
    seen = set()
    start = os.path.realpath(folder)
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # before their links are followed
        for link in (os.path.join(top, d) for d in dirs if os.path.islink(os.path.join(top, d))):
            target = os.path.realpath(link)
            if real == target or real.startswith(target.rstrip(os.sep) + os.sep):
                why = ("the names beside it would be read as this folder's"
                       if start.startswith(target.rstrip(os.sep) + os.sep) else
                       "a loop, its names read again through it")
                raise ValueError(f"{link}: expected a file or a folder within {folder}, found a "
                                 f"link back up to {target}, which holds it: {why}; remove the "
                                 "link")
        dirs.sort()
        for name in sorted(names):
            yield Path(top, name)
