"""toymlx-launch -n N -- toymlx-train ...: mlx.launch that fails when any rank fails."""

from __future__ import annotations

import argparse
import sys

from toymlx_cli import (
    OneLineParser,
    VersionAction,
    console_command,
    console_streams,
    output_may_close,
    readable_width,
)
from toymlx_cli.config_file import CONFIG_HELP, parser_defaults
from toymlx_cli.usage import LAUNCHER_FLAGS, peer_hint


def _peer_flag(argv: list[str]) -> str | None:
    """The line naming -n for the first of another launcher's rank-count flags in argv
    (`usage.LAUNCHER_FLAGS`, beside the other tools' flags toymlx names)."""
    for i, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if said := peer_hint(LAUNCHER_FLAGS, name, ("n",)):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "N")
            n = value if value.isdigit() else "N"
            return f"{name}: {said}; use toymlx-launch -n {n} -- toymlx-train ..."
    return None


def _parser() -> argparse.ArgumentParser:
    """toymlx-launch's options (the command after `--` is not among them)."""
    p = OneLineParser(
        prog="toymlx-launch", allow_abbrev=False,
        usage="toymlx-launch [-n N] [--hosts H] [--grace S] -- COMMAND ...",
        description="Run COMMAND (e.g. toymlx-train --recipe ...) as N data-parallel ranks "
                    "through mlx.launch. Unlike mlx.launch, the exit status is 0 only if every "
                    "rank exited 0; when one rank fails the others are stopped after --grace "
                    "seconds instead of waiting on a collective that never completes. Ctrl-C, "
                    "SIGTERM or SIGHUP stops every rank after the same step, with a final "
                    "checkpoint; the exit status is then 128 + the signal's number.")
    p.add_argument("-n", type=int, default=2,
                   help="ranks (default 2); with --hosts, ranks on each host")
    p.add_argument("--hosts", help="comma-separated hosts for mlx.launch (default: this one)")
    p.add_argument("--backend", default="ring", help="mlx.launch backend (default ring)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get to end after one fails, or after a second "
                        "Ctrl-C, SIGTERM or SIGHUP (default 10)")
    p.add_argument("--status-dir", help="where ranks report how they ended (default: a "
                                        "temporary folder; use a shared one across hosts)")
    p.add_argument("--port", type=int, help="first ring port (default: a free one on this "
                                           "host; mlx.launch's own default is 32323)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for every rank (repeatable)")
    p.add_argument("--version", action=VersionAction)
    p.epilog = CONFIG_HELP
    return p


@console_command("toymlx-launch")
def main(argv: list[str] | None = None) -> int:
    from toymlx.backend.device import restart_with_huge_pages
    from toymlx.runner.launch import launch

    if argv is None:  # the console script: its ranks inherit the huge-page heap setting
        console_streams()
        restart_with_huge_pages()
    argv = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, command = argv[:k], argv[k + 1:]
    p = _parser()
    if peer := _peer_flag(argv):
        print(f"toymlx-launch: error: {peer}", file=sys.stderr)
        return 2
    try:
        # `--help | head`: argparse exits after its help; `| head` while the ranks train: the
        # launch's own lines are discarded as it stops them (`launch`: exit 141)
        with output_may_close():
            with readable_width():
                args = p.parse_args(parser_defaults(p, argv))
            return launch(args.n, command, hosts=args.hosts, backend=args.backend,
                          grace=args.grace, status_dir=args.status_dir, env=args.env,
                          port=args.port)
    except ValueError as e:
        print(f"toymlx-launch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
