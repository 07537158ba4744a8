"""toymlx-report [RUN_OR_SWEEP_DIR...] [--out report.png|report.html]: curves and a summary."""

from __future__ import annotations

import argparse
import os
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

DEFAULT_DIR = "runs"
"""What `toymlx-report` alone reports: every run and sweep under --runs-root's default."""


def _parser() -> argparse.ArgumentParser:
    """toymlx-report's options."""
    p = OneLineParser(
        prog="toymlx-report", allow_abbrev=False,
        description="Draw training loss, validation and learning-rate curves of run bundles "
                    "side by side, with a summary table (also printed).")
    p.add_argument("dirs", nargs="*", metavar="RUN_OR_SWEEP_DIR",
                   help=f"run bundles (runs/<id>), or sweep folders holding run bundles "
                        f"(default: {DEFAULT_DIR}, the folder toymlx-train and toymlx-sweep "
                        f"write into)")
    p.add_argument("--out", default="report.png",
                   help="report.png (curves + table panel) or report.html (self-contained); "
                        "default report.png")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file (without it, an existing one is "
                        "refused, unless it is a report toymlx-report drew)")
    p.add_argument("--version", action=VersionAction)
    p.epilog = CONFIG_HELP
    return p


@console_command("toymlx-report")
def main(argv: list[str] | None = None) -> int:
    from toymlx.backend.stop import SIGNALS, how_stopped, stops_raise

    if argv is None:  # the console script
        console_streams()
    p = _parser()
    with output_may_close():  # `| head`: the table is cut short, the report file still drawn
        try:
            # Ctrl-C (a kill, a closed terminal) while the runs are read or the report drawn
            # ended in a traceback (a kill without a word): the report in flight is abandoned
            # whole (an atomic write), an older one left as it was
            with stops_raise(SIGNALS):
                return _main(p, argv)
        except KeyboardInterrupt as e:
            what, code = how_stopped(e)
            print(f"\ntoymlx-report: {what}; no report was written (an existing --out file is "
                  "as it was): run it again to draw it", file=sys.stderr)
            return code


def _main(p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    from toymlx.backend import atomic
    from toymlx.bundle.outputs import check_output
    from toymlx.runner import report
    from toymlx.sweeps.summary import recorded_states

    try:
        with readable_width():
            args = p.parse_args(parser_defaults(p, sys.argv[1:] if argv is None else argv))
        if not args.dirs and not os.path.lexists(DEFAULT_DIR):
            raise ValueError(f"{DEFAULT_DIR}: expected the runs folder toymlx-train writes "
                             f"here (toymlx-report alone reports it), found nothing at that "
                             f"path; name the runs: toymlx-report RUN_OR_SWEEP_DIR ...")
        dirs = report.expand_dirs(args.dirs or [DEFAULT_DIR])
        # a new file beside the runs, never inside one; an existing one only with --overwrite,
        # or where it is a report this command drew (drawn again, as its runs went on)
        check_output(args.out, [], overwrite=args.overwrite or report.is_report(args.out))
        report.check_report_name(args.out)  # before the work, not after the table
        rows = report.sort_rows(recorded_states(report.summarize(dirs)))
        params = report.add_params(rows)
        print(report.format_table(rows, params))
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--out: drawing needs matplotlib; pip install 'toymlx[report]'") \
                from None
        try:
            out = report.render(dirs, args.out, rows, params)
        except OSError as e:  # was the bare "[Errno 2] No such file or directory: '/proc/x'"
            raise OSError(f"{args.out}: --out: could not write the report "
                          f"({atomic.named(e, args.out)}); nothing was written under this "
                          "name") from e
    except (ValueError, OSError) as e:
        print(f"toymlx-report: error: {e}", file=sys.stderr)
        return 2
    print(f"toymlx-report: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
