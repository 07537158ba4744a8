"""toymlx-sweep --recipe NAME --grid KEY=V1,V2 ... [toymlx-train options for every run]."""

from __future__ import annotations

import argparse
import sys

from toymlx_cli import version_text

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)

EPILOG = """\
Every other option is passed to each run as in toymlx-train (after a `--`, options
that the sweep also has, such as --seed, go to the runs too); so is -c/--config FILE, whose
options every run takes, with the grid's values over them. Grid keys are option names:
lr -> --lr, lora.rank -> --lora.rank, model.d_model -> --model.d-model.

examples:
  toymlx-sweep --recipe from-scratch --grid lr=1e-3,3e-3 --grid model.d_model=64,128 \\
      --workers 2 --steps 200
  toymlx-sweep --recipe lora --base model.gguf --grid lora.rank=4,8,16
  toymlx-sweep --recipe from-scratch --random 8 --seed 0 --grid lr=log:1e-4:1e-2 \\
      --grid model.n_layers=2,4 --steps 100
  toymlx-sweep ... --shard 0/2   # and --shard 1/2 on a second machine, same --runs-root

Runs go to RUNS_ROOT/SWEEP_ID/<run name>; running the same command again skips completed
runs, resumes torn ones and retries failed ones. At the end: summary.csv, summary.jsonl
and report.png in the sweep folder. Exit status 1 if a run failed.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toymlx-sweep", allow_abbrev=False, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Run a grid or random search of toymlx-train runs.")
    p.add_argument("--recipe", required=True, help="recipe of every run (as in toymlx-train)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="values of one option (repeat for more); with --random also "
                        "KEY=log:LO:HI, KEY=uniform:LO:HI or KEY=int:LO:HI")
    p.add_argument("--random", type=int, metavar="N",
                   help="run N random draws from the --grid space instead of every combination")
    p.add_argument("--seed", type=int, help="seed of the --random draws (default 0)")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="runs at a time on this machine (default 1)")
    p.add_argument("--shard", default="0/1", metavar="I/N",
                   help="run only this machine's share: machine I of N (default 0/1)")
    p.add_argument("--sweep-id", help="sweep folder name (default: a hash of the recipe and "
                                      "runs, so the same command finds the same sweep)")
    p.add_argument("--runs-root", default="runs", help="folder of sweeps (default runs)")
    p.add_argument("--no-retry-failed", action="store_true",
                   help="on a restart, report failed runs instead of running them again")
    p.add_argument("--no-report", action="store_true", help="skip report.png")
    p.add_argument("--no-progress", action="store_true", help="no live progress table")
    p.add_argument("--version", action="version", version=version_text())
    return p


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected I/N such as 0/2, found {text!r}") from None
    return i, n


def main(argv: list[str] | None = None) -> int:
    from toymlx import sweep

    argv = sys.argv[1:] if argv is None else list(argv)
    after = []
    if "--" in argv:
        k = argv.index("--")
        argv, after = argv[:k], argv[k + 1:]
    args, rest = _parser().parse_known_args(argv)
    passthrough = rest + after
    try:
        if args.seed is not None and args.random is None:
            raise ValueError("--seed: is the seed of --random draws; give runs a training seed "
                             "with --grid seed=S, or after `--`")
        if not args.grid:
            raise ValueError("--grid: expected at least one KEY=V1,V2 (e.g. --grid lr=1e-4,3e-4)")
        axes = dict(sweep.parse_axis(g, args.recipe) for g in args.grid)
        if args.random is None:
            ranged = [k for k, v in axes.items() if not isinstance(v, list)]
            if ranged:
                raise ValueError(f"--grid {ranged[0]}: a LO:HI range needs --random N")
            specs = sweep.grid(passthrough, axes, recipe=args.recipe)
        else:
            specs = sweep.random(passthrough, axes, args.random, args.seed or 0,
                                 recipe=args.recipe)
        result = sweep.run_sweep(args.recipe, specs, args.runs_root, args.workers,
                                 _shard(args.shard), args.sweep_id,
                                 retry_failed=not args.no_retry_failed,
                                 progress=not args.no_progress, report_png=not args.no_report)
    except (ValueError, OSError) as e:
        print(f"toymlx-sweep: error: {e}", file=sys.stderr)
        return 2
    if "interrupted" in result.states.values():
        return 130
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
