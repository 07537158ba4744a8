"""Thin command-line entry points (installed as `toymlx_cli`)."""

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from toymlx import __version__
from toymlx.backend.device import blas_summary
from toymlx.backend.stop import how_stopped


def version_text() -> str:
    """What every command's `--version` prints: `toymlx 0.2.0 (mlx 0.32.4; BLAS OpenBLAS
    0.3.34 SkylakeX kernels (pip scipy-openblas32 0.3.34))`: MLX's CPU BLAS, because a
    generic kernel set makes every CPU step several times slower."""
    try:
        mlx = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx = "not installed"
    return f"toymlx {__version__} (mlx {mlx}; BLAS {blas_summary()})"


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


def drop_output(stream: Any = None) -> None:
    """Point `stream` (sys.stdout by default) at os.devnull once its reader has gone (`| head`):
    what is still buffered and whatever comes later is discarded, where another write (Python's
    own flush at exit too) would raise BrokenPipeError again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, (sys.stdout if stream is None else stream).fileno())
    os.close(null)


CONSOLE_GONE = (errno.EPIPE, errno.EIO, errno.ENOSPC)
"""A console write's errors that mean no one can read the console any more: its reader gone
(`| head`), its terminal closed (a hung-up tty answers EIO), the disk of a redirected log full."""


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


@contextlib.contextmanager
def output_may_close() -> Iterator[None]:
    """Within it, sys.stdout and sys.stderr are `KeepOnClosed`: for a command whose work goes on
    when its console reader goes (a training run, a report's file)."""
    kept = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = KeepOnClosed(kept[0]), KeepOnClosed(kept[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):  # what is still buffered, while a closed pipe
            stream.flush()                         # is still handled
            if getattr(stream, "reader_gone", False):  # Python's flush at exit: quiet
                drop_output(stream._stream)
        sys.stdout, sys.stderr = kept


def run_command(prog: str, args_type: type, run: Callable[[Any], int],
                argv: list[str] | None, errors: tuple[type[Exception], ...] = (ValueError,
                                                                           OSError),
                outputs: tuple[str, ...] = ()) -> int:
    """What the forward-only commands share: `--version`, the process set-up, `-c/--config FILE`
    (cli/config_file.py), tyro's parse (cli/usage.py), and bad input as one line
    `PROG: error: ...` with exit status 2 (Ctrl-C: 130); a reader that stops early (`| head`)
    ends it quietly with 0, as Unix tools do. `outputs`: the options (fields of `args_type`)
    that name a file the command writes, refused (`check_output`) where one is the -c file."""
    from toymlx_cli.config_file import CONFIG_HELP, file_defaults, split_config
    from toymlx_cli.usage import parse_options  # here: --version answers without tyro

    from toymlx.backend.device import restart_with_huge_pages, setup_process

    if argv is None:  # the console script: the heap on huge pages
        restart_with_huge_pages()
    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print_version()
        return 0
    try:
        setup_process()
        config = split_config(argv)[0]
        default, argv = file_defaults(args_type, argv, prog)
        with output_may_close():  # `--help | head`: tyro exits after its help, and Python's
            args = parse_options(  # own flush at exit met the closed pipe (exit status 120)
                args_type, argv, prog, default, f"{args_type.__doc__}\n\n{CONFIG_HELP}")
        for name in outputs if config is not None else ():
            from toymlx.bundle.outputs import check_output

            if out := getattr(args, name):  # the -c file here; the rest by the command itself,
                check_output(out, [("-c/--config", config)],  # which knows file from folder
                             f"--{name.replace('_', '-')}", folder=os.path.isdir(out))
    except ValueError as e:  # ConfigFileError, UsageError
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        drop_output()
        return 0
    try:
        code = run(args)
        sys.stdout.flush()  # here: a closed pipe is met now, not in Python's flush at exit
        return code
    except BrokenPipeError:  # before `errors`: an OSError, but nothing went wrong
        drop_output()
        return 0
    except errors as e:  # GGUFError and ImageDataError are ValueErrors
        print(f"{prog}: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except MemoryError as e:  # numpy's message names the size and shape it wanted
        print(f"{prog}: error: out of memory: {e}; lower --batch-size", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal a command raises (`Stopped`)
        print(file=sys.stderr)
        return how_stopped(e)[1]
