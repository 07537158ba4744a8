"""Thin command-line entry points (installed as `toymlx_cli`)."""

# first of all: a Ctrl-C from here on, while MLX, numpy and tyro import, is held for the command
from toymlx_cli.entry import console_command  # noqa: I001, F401  (the commands' mains use it)
import argparse
import contextlib
import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from toymlx import __version__
from toymlx.backend.device import blas_summary
from toymlx.backend.stop import CONSOLE_GONE, how_stopped


def version_text() -> str:
    """What every command's `--version` prints: `toymlx 0.2.0 (mlx 0.32.4; BLAS OpenBLAS
    0.3.34 SkylakeX kernels (pip scipy-openblas32 0.3.34))`: MLX's CPU BLAS, because a
    generic kernel set makes every CPU step several times slower."""
    try:
        mlx = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx = "not installed"
    return f"toymlx {__version__} (mlx {mlx}; BLAS {blas_summary()})"


HELP_WIDTH = 80
"""The fewest columns help and usage text is wrapped at (`readable_width`)."""


@contextlib.contextmanager
def readable_width(least: int = HELP_WIDTH) -> Iterator[None]:
    """Within it, help, usage and refusals (tyro's and argparse's, which both wrap at
    `shutil.get_terminal_size()`) are wrapped at no fewer than `least` columns: under COLUMNS=20
    or a narrow terminal pane tyro's help came out one character a line (toymlx-eval --help:
    1,046 lines). A terminal as wide or wider keeps its own width. Every command parses its
    options within it: `cli/usage.py:parse_options` and the argparse commands."""
    if shutil.get_terminal_size().columns >= least:
        yield
        return
    kept = os.environ.get("COLUMNS")  # what get_terminal_size reads before the terminal
    os.environ["COLUMNS"] = str(least)
    try:
        yield
    finally:
        if kept is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = kept


def print_version() -> None:
    """`--version`'s line on stdout; quiet when its reader has already gone (`| head -0`)."""
    try:
        print(version_text(), flush=True)
    except BrokenPipeError:
        drop_output()


class VersionAction(argparse.Action):
    """argparse's `--version` printing `version_text()` as it is (argparse's own version
    action wraps it at the terminal's width)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print toymlx's, MLX's and the BLAS's versions and exit", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print_version()
        parser.exit()


ARGPARSE_KINDS = {"int": "an integer", "float": "a number"}
"""argparse's `invalid int value` as the other commands' refusals say it (`usage._KINDS`)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, its refusals one line in the words of the tyro commands' (`FLAG: expected
    ..., found ...`), without the usage block: `toymlx-launch -n two` was the usage line and
    'argument -n: invalid int value: 'two'', naming nothing expected."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {self.one_line(message)}\n")

    def one_line(self, message: str) -> str:
        """argparse's `message` as the house's refusal: the flag first, what was expected, what
        was found; an unknown option with the closest of this command's."""
        import difflib
        import re

        if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.*)", message):
            kind = ARGPARSE_KINDS.get(m[2], f"a value of type {m[2]}")
            return f"{m[1]}: expected {kind}, found {m[3]}"
        if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected (one|\d+) arguments?", message):
            return f"{m[1]}: expected {'a value' if m[2] == 'one' else m[2] + ' values'}, " \
                   "found none"
        if message.startswith("unrecognized arguments: "):
            options = [o for a in self._actions for o in a.option_strings]
            parts, owed = [], False
            for token in message.removeprefix("unrecognized arguments: ").split():
                flag, eq, _ = token.partition("=")
                if not flag.startswith("-"):
                    if not owed:  # the value right after an unknown flag is its own
                        parts.append(f"{token!r}: expected an option of {self.prog}, got a "
                                     "value no option takes")
                    owed = False
                    continue
                owed = not eq
                close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
                parts.append(f"{flag}: expected an option of {self.prog}, got an unknown one"
                             + (f"; did you mean {close[0]}?" if close else ""))
            return "; ".join(parts)
        return message.removeprefix("argument ")


def drop_output(stream: Any = None) -> None:
    """Point `stream` (sys.stdout by default) at os.devnull once its reader has gone (`| head`):
    what is still buffered and whatever comes later is discarded, where another write (Python's
    own flush at exit too) would raise BrokenPipeError again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, (sys.stdout if stream is None else stream).fileno())
    os.close(null)


STANDARD_STREAMS = ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY),
                    (2, "stderr", os.O_WRONLY))


def open_closed_streams() -> None:
    """os.devnull on stdin, stdout or stderr where the command was started with it closed
    (`<&-`, `>&-`, `2>&-`, as some cron and daemon set-ups start it): the console scripts call
    it first thing. Python starts with that sys.stdout None, where `sys.stdout.flush()` raised
    (a traceback, exit 1, no run), and the next file the command opened took the free descriptor,
    so a child's or a C library's console output (a sweep's runs, a launch's ranks) would land in
    that file (events.jsonl, a checkpoint). The output is discarded, as `>/dev/null` would."""
    for fd, name, mode in STANDARD_STREAMS:
        try:
            os.fstat(fd)
            continue
        except OSError:
            null = os.open(os.devnull, mode)  # the lowest free descriptor: `fd` itself
        if null != fd:
            os.dup2(null, fd)  # inheritable, as the standard streams are
            os.close(null)
        else:  # os.open's descriptors are not: the huge-page restart's exec, or a child, would
            os.set_inheritable(fd, True)  # start with it closed again
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False,  # noqa: SIM115
                                    encoding="utf-8", errors="replace"))


def escape_unencodable() -> None:
    """stdout writes a character its encoding lacks as a backslash escape (`\\xe9`), as Python's
    stderr already does, instead of raising: under PYTHONIOENCODING=ascii or a Latin-1 locale a
    run id or path with "é" or an emoji in a report line raised UnicodeEncodeError, which ended
    a run that had trained and checkpointed as an error (run_end "error", exit 1). A stdout
    that already escapes (surrogateescape, Python's choice for the C locale) is kept."""
    if getattr(sys.stdout, "errors", None) == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def console_streams() -> None:
    """What every console script does first with its standard streams: closed ones opened on
    os.devnull (`open_closed_streams`), characters stdout cannot encode escaped
    (`escape_unencodable`)."""
    open_closed_streams()
    escape_unencodable()


class KeepOnClosed:
    """sys.stdout or sys.stderr for a command whose console output only displays (toymlx-train:
    the bundle records everything): a console gone (`CONSOLE_GONE`: `| head -3`,
    `2>&1 | head -1`, a closed terminal) discards the rest of the output instead of raising
    into the run, which stopped it as a failed bundle write without a checkpoint, or failed a
    completed run on its last line. A pipe whose reader has gone is kept as it is until
    `output_may_close` ends (its later writes discarded here), so that the run's loop can see
    it (`toymlx.backend.stop.console_gone`) and stop as `| head` asks; the others become
    os.devnull at once."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False
        """Its pipe's reader has gone (EPIPE): nothing more is written to it."""

    def _gone(self, e: OSError) -> None:
        if e.errno not in CONSOLE_GONE:
            raise e
        if e.errno == errno.EPIPE:
            self.reader_gone = True
        else:
            drop_output(self._stream)

    def write(self, text: str) -> int:
        if self.reader_gone:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as e:
            self._gone(e)
            return len(text)

    def flush(self) -> None:
        if self.reader_gone:
            return
        try:
            self._stream.flush()
        except OSError as e:
            self._gone(e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class NamedStdout:
    """sys.stdout for a forward command, whose stdout is its answer: a write that fails raises
    its error with the file named, `[Errno 28] No space left on device: '<stdout>'` (`>/dev/full`,
    a full disk), where the bare error did not say what was full. What it still buffers is then
    discarded (`drop_output`): Python 3.11.2 kept it, and its own flush at exit failed again
    (exit status 120 instead of the error's 2)."""

    def __init__(self, stream):
        self._stream = stream

    def _failed(self, e: OSError) -> OSError:
        if e.errno != errno.EPIPE:  # a BrokenPipeError is handled as `| head` by the caller
            drop_output(self._stream)
        return OSError(e.errno, e.strerror, "<stdout>")  # EPIPE: still a BrokenPipeError

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def stdout_named() -> Iterator[None]:
    """Within it, sys.stdout is a `NamedStdout`."""
    kept = sys.stdout
    sys.stdout = NamedStdout(kept)
    try:
        yield
    finally:
        sys.stdout = kept


@contextlib.contextmanager
def output_may_close(names: tuple[str, ...] = ("stdout", "stderr")) -> Iterator[None]:
    """Within it, the streams `names` of sys (stdout, stderr) are `KeepOnClosed`: for a command
    whose work goes on when its console reader goes (a training run, a report's file), and for
    every command's stderr, which only displays notes and timings."""
    kept = {name: getattr(sys, name) for name in names}
    for name, stream in kept.items():
        setattr(sys, name, KeepOnClosed(stream))
    try:
        yield
    finally:
        for name in names:  # what is still buffered, while a closed pipe is still handled
            stream = getattr(sys, name)
            stream.flush()
            if getattr(stream, "reader_gone", False):  # Python's flush at exit: quiet
                drop_output(stream._stream)
        for name, stream in kept.items():
            setattr(sys, name, stream)


def run_command(prog: str, args_type: type, run: Callable[[Any], int],
                argv: list[str] | None, errors: tuple[type[Exception], ...] = (ValueError,
                                                                           OSError),
                outputs: tuple[str, ...] = ()) -> int:
    """What the forward-only commands share: `--version`, the process set-up, `-c/--config FILE`
    (cli/config_file.py), tyro's parse (cli/usage.py), and bad input as one line
    `PROG: error: ...` with exit status 2 (Ctrl-C: 130); a reader that stops early (`| head`)
    ends it quietly with 0, as Unix tools do. `outputs`: the options (fields of `args_type`)
    that name a file the command writes, refused (`check_output`) where one is the -c file.
    A stderr that fails (2>/dev/full, closed, a hung-up terminal) is discarded: it once ended the
    command at its first note, exit 1, with stdout's answer never written. A stdout that fails
    is an error naming `<stdout>`, exit status 2."""
    if argv is None:  # the console script
        console_streams()
    with output_may_close(("stderr",)), stdout_named():
        return _run_command(prog, args_type, run, argv, errors, outputs)


def _run_command(prog: str, args_type: type, run: Callable[[Any], int],
                 argv: list[str] | None, errors: tuple[type[Exception], ...],
                 outputs: tuple[str, ...]) -> int:
    from toymlx_cli.config_file import (
        CONFIG_HELP,
        file_defaults,
        file_key_error,
        given_file_keys,
        split_config,
    )
    from toymlx_cli.usage import line_as_typed, parse_options  # here: --version, without tyro

    from toymlx.backend.device import restart_with_huge_pages, setup_process

    if argv is None:  # the console script: the heap on huge pages
        restart_with_huge_pages()
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print_version()
        return 0
    keys: dict[str, str] = {}
    config = None
    given = argv

    def named(e: Exception) -> str:
        """A refusal naming its options as the user gave them: a -c file's value refused by a
        later check, by the file's key; each flag the command line gives, as typed (-n,
        --temp)."""
        line = str(e)
        return line_as_typed(file_key_error(line, keys, config) if config else line, given,
                             args_type)

    try:
        setup_process()
        config = split_config(argv)[0]
        default, rest = file_defaults(args_type, argv, prog)
        keys = given_file_keys(args_type, argv)[1]
        argv = rest
        with output_may_close():  # `--help | head`: tyro exits after its help, and Python's
            args = parse_options(  # own flush at exit met the closed pipe (exit status 120)
                args_type, argv, prog, default, f"{args_type.__doc__}\n\n{CONFIG_HELP}")
        for name in outputs if config is not None else ():
            from toymlx.bundle.outputs import check_output

            if out := getattr(args, name):  # the -c file here; the rest by the command itself,
                check_output(out, [("-c/--config", config)],  # which knows file from folder
                             f"--{name.replace('_', '-')}", folder=os.path.isdir(out))
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted (an OSError)
        drop_output()
        return 0
    except (ValueError, OSError) as e:  # ConfigFileError, UsageError; an output the -c file
        # names that cannot be looked at (a name too long for the file system: a traceback)
        print(f"{prog}: error: {named(e)}", file=sys.stderr)
        return 2
    try:
        code = run(args)
        sys.stdout.flush()  # here: a closed pipe is met now, not in Python's flush at exit
        return code
    except BrokenPipeError:  # before `errors`: an OSError, but nothing went wrong
        drop_output()
        return 0
    except errors as e:  # GGUFError and ImageDataError are ValueErrors
        print(f"{prog}: error: {' '.join(named(e).split()) or type(e).__name__}",
              file=sys.stderr)
        return 2
    except MemoryError as e:  # numpy's message names the size and shape it wanted
        print(f"{prog}: error: out of memory: {e}; lower --batch-size", file=sys.stderr)
        return 2
    except RuntimeError as e:  # MLX's, where its compiler failed (a full disk): a screenful
        from toymlx.backend.device import kernel_build_failure

        if (why := kernel_build_failure(e)) is None:
            raise
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal a command raises (`Stopped`)
        what, code = how_stopped(e)
        # on a line of its own: Ctrl-C's ^C, or a generated text, may have left one open
        print(f"\n{prog}: {what}", file=sys.stderr)
        return code
