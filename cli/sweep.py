"""toymlx-sweep --recipe NAME --grid KEY=V1,V2 ... [toymlx-train options for every run], or
toymlx-sweep -c SWEEP.yaml: the whole sweep in one file."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from functools import partial

from toymlx_cli import (
    OneLineParser,
    VersionAction,
    console_command,
    console_streams,
    output_may_close,
    readable_width,
)

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)

EPILOG = """\
Every other option is passed to each run as in toymlx-train (after a `--`, options
that the sweep also has, such as --seed, go to the runs too). Grid keys are option names:
lr -> --lr, lora.rank -> --lora.rank, model.d_model -> --model.d-model.

-c/--config FILE (YAML or JSON) holds a whole sweep: the sweep's own options, keys spelled as
its flags (recipe, grid, random, random_seed, workers, shard, sweep_id or sweep-id, runs_root,
no_retry_failed, no_report, no_progress), and every other key an option that each run takes
as toymlx-train -c takes it (seed included: it seeds the runs' training; the --random draws'
seed is random_seed). Flags given override the file, and a --grid KEY=... replaces the file's
values of KEY only. A run's config.json works too: its recipe and options for every run;
and so does mlx-lm's lora config (mlx_lm.lora -c's): each run is toymlx-train -c FILE with its
grid values as flags (--grid lr=1e-5,3e-5; see docs/MLX_LM.md).
  # sweep.yaml                          toymlx-sweep -c sweep.yaml [--workers 4] [--grid lr=...]
  recipe: from-scratch
  grid: {lr: [1e-3, 3e-3], model.d_model: [64, 128]}   # or lr: "log:1e-4:1e-2" with random: N
  workers: 2
  steps: 200

examples:
  toymlx-sweep --recipe from-scratch --grid lr=1e-3,3e-3 --grid model.d_model=64,128 \\
      --workers 2 --steps 200
  toymlx-sweep --recipe lora --base model.gguf --grid lora.rank=4,8,16
  toymlx-sweep --recipe from-scratch --random 8 --seed 0 --grid lr=log:1e-4:1e-2 \\
      --grid model.n_layers=2,4 --steps 100
  toymlx-sweep ... --shard 0/2   # and --shard 1/2 on a second machine, same --runs-root

Runs go to RUNS_ROOT/SWEEP_ID/<run name>; running the same command again skips completed
runs, resumes torn ones and retries failed ones. At the end: summary.csv, summary.jsonl
and report.png in the sweep folder, best first, and a line naming the best run (lowest
val_loss or highest accuracy; a diverged run is a result, never best). Exit status 1 if a run
failed or one of
those files could not be written (a full disk: named in a line, the others still written).
"""


EXAMPLE = "toymlx-sweep --recipe vit-tiny --grid lr=1e-3,3e-3 -- --steps 100"
"""A sweep as it is typed, for the line that says what `toymlx-sweep` alone lacks."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="toymlx-sweep", allow_abbrev=False, epilog=EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Run a grid or random search of toymlx-train runs.")
    p.add_argument("-c", "--config", metavar="FILE",
                   help="the sweep's options and every run's from a YAML or JSON file (below)")
    p.add_argument("--recipe", help="recipe of every run (as in toymlx-train; required)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="values of one option (repeat for more); with --random also "
                        "KEY=log:LO:HI, KEY=uniform:LO:HI or KEY=int:LO:HI")
    p.add_argument("--random", type=int, metavar="N",
                   help="run N random draws from the --grid space instead of every combination")
    p.add_argument("--seed", "--random-seed", dest="seed", type=int,
                   help="seed of the --random draws (default 0; random_seed in a -c file)")
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
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress (a table on a terminal, lines elsewhere)")
    p.add_argument("--version", action=VersionAction)
    return p


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected I/N such as 0/2, found {text!r}") from None
    return i, n


def _axes(args: argparse.Namespace, file_grid: dict, path: str | None,
          mlx_lm: bool = False) -> dict:
    """The sweep's axes: the file's grid, each key's values replaced by a --grid of that key
    (keys compared as option names: model.d-model is model.d_model). A grid key spelt as
    another tool's (nanoGPT's learning_rate, n_layer) is refused naming toymlx's option (--lr),
    as toymlx-train names it; `mlx_lm`: the runs' file is mlx-lm's, and its keys are named so
    first."""
    from toymlx_cli.config_file import file_words, mlx_lm_hint, option_table
    from toymlx_cli.usage import flag_hint

    from toymlx import sweeps as sweep
    from toymlx.recipes import get_recipe

    table = option_table(get_recipe(args.recipe).Config)

    def peer(key: str) -> str | None:
        """toymlx-train's hint for another tool's `key`; None for a spelling's (`did you mean`,
        which the refusal has already)."""
        said = flag_hint(key, dict.fromkeys(table, False), f"toymlx-train --recipe {args.recipe}")
        return None if said is None or said.startswith("did you mean") else said

    def axis(key: str, parse, in_file: bool = False):
        try:
            return parse()
        except ValueError as e:
            hint = "found no option" in str(e) and (
                (mlx_lm and mlx_lm_hint(key, "toymlx-train", in_file)) or peer(key))
            if not hint:
                raise
            if in_file:  # the file's grid key: named as the key to write there (lr, not --lr)
                hint = file_words(hint, table)
            # the option named by mlx-lm's meaning, not the closest by spelling: `iters` got
            # "(did you mean test?)" before naming --steps
            said = re.sub(r" \(did you mean [^)]*\)", "", str(e))
            raise ValueError(f"{said}; {hint}") from None

    axes = {k: axis(k, partial(sweep.file_axis, k, v, args.recipe, f"{path}: key 'grid.{k}'"),
                    in_file=True) for k, v in file_grid.items()}
    given: dict[str, str] = {}  # option name -> the --grid that gave it
    for g in args.grid:
        key, values = axis(g.partition("=")[0], partial(sweep.parse_axis, g, args.recipe))
        name = key.replace("-", "_")
        # a second --grid of one key replaced the first: `--grid lr=1e-3 --grid lr=3e-3` ran
        # 3e-3 alone, the 1e-3 run silently never made
        if name in given:
            raise ValueError(f"--grid {g}: expected each option in one --grid, found it also in "
                             f"--grid {given[name]}; give its values together "
                             f"(--grid {key}=V1,V2)")
        given[name] = g
        same = [k for k in axes if k.replace("-", "_") == name]
        axes[same[0] if same else key] = values
    return axes


def _mlx_lm_table(run_options: dict, path: str, argv: list[str], file_grid: dict,
                  args: argparse.Namespace) -> None:
    """An mlx-lm file's keys checked (ConfigFileError: one line naming the key, as toymlx-train
    -c says it) and its table printed as toymlx-train prints it, the options every run's flags
    (`argv`) and the grid give shown over the file's."""
    from toymlx_cli.mlx_lm_config import mlx_lm_read, mlx_lm_table, over_the_file

    from toymlx.bundle.options import flag_name

    grid = {flag_name(a.partition("=")[0].replace("-", "_")): a.partition("=")[2]
            for a in args.grid}
    grid = {**{flag_name(k): v for k, v in file_grid.items()}, **grid}
    _, rows, _ = mlx_lm_read(run_options, path, [*argv, "--runs-root", args.runs_root,
                                                 "--run-id", "RUN"])
    rows = over_the_file(rows, grid, "the sweep's grid, over the file")
    # on stderr with the sweep's other lines: stdout holds the final table alone
    print(f"{path}: read as mlx-lm's lora config:\n" + mlx_lm_table(rows), file=sys.stderr)


def _check_runs(recipe: str, specs: list, run_options: dict | None, path: str | None,
                run_config: bool = False, runs_root: str = "runs", mlx_lm: bool = False
                ) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Every run's options checked as toymlx-train checks a new run's (tyro's parse, then
    `check_config`, the options of the -c file given as the command line's are unless it is a
    run's config.json, `run_config`), and its data paths found, before any run starts: a bad
    grid value is one line naming its run, not a failure of each run that has it. `mlx_lm`:
    the file is mlx-lm's lora config, read as toymlx-train reads it (`mlx_lm_read`, then
    `mlx_lm_parsed`) with each run's flags over it, the run's folder (`runs_root`, its name)
    among them as the sweep gives it. Returns ((flag, path) of what the runs read
    (`run_inputs`, as typed), the first run's notes of the mlx-lm file and each run's notes
    of its examples (the recipe's `data_notes`), once each)."""
    from toymlx_cli.config_file import (
        defaults_from_file,
        file_flags,
        file_key_error,
        under_the_flags,
    )
    from toymlx_cli.mlx_lm_config import (
        flags_given,
        mlx_lm_error,
        mlx_lm_parsed,
        mlx_lm_read,
    )
    from toymlx_cli.usage import line_as_typed, parse_options

    from toymlx.backend.files import empty_folder, nothing_there
    from toymlx.bundle.inputs import data_paths
    from toymlx.bundle.options import flag_name
    from toymlx.recipes import get_recipe
    from toymlx.runner.run import run_inputs
    from toymlx.training.task import check_config

    module = get_recipe(recipe)
    prog = f"toymlx-train --recipe {recipe}"
    inputs: list[tuple[str, str | None]] = []
    notes: list[str] = []
    data_notes: list[str] = []
    read: set[str] = set()  # the data options whose examples were read
    for spec in specs:
        argv = list(spec.args)
        try:
            if mlx_lm:  # the run's flags as its toymlx-train gets them (`_Runner._start`)
                argv += ["--runs-root", str(runs_root), "--run-id", spec.name]
                options, rows, said = mlx_lm_read(run_options, path, argv)
                try:
                    default = defaults_from_file(module.Config, options, path, prog)
                    cfg, more = mlx_lm_parsed(parse_options(module.Config, argv, prog, default),
                                              run_options, path, argv)
                except ValueError as e:
                    raise ValueError(mlx_lm_error(str(e), rows, path)) from None
                notes = notes or said + more
                keys = {o: k for k, o, _, f in rows if f.startswith("file")}
                given = frozenset(flags_given(argv)) | set(keys)
                name_keys = partial(mlx_lm_error, rows=rows, source=path)
            else:
                default = (defaults_from_file(module.Config, run_options, path, prog)
                           if run_options else None)
                cfg = parse_options(module.Config, argv, prog, default)
                keys = (under_the_flags(file_flags(module.Config, run_options, path), argv)
                        if run_options and not run_config else {})
                given = frozenset(a for a in argv if a.startswith("--")) | set(keys)
                name_keys = partial(file_key_error, keys=keys, source=path)
            try:
                check_config(module, cfg, new_run=True, given=given)
            except ValueError as e:  # as the run's toymlx-train names it: by the file's key,
                # or by its flag as typed (`-- --weight_decay=-1`: --weight_decay)
                raise ValueError(line_as_typed(name_keys(str(e)), argv, module.Config)) from None
            # a data path that is not there, or an empty folder, failed each run that had it,
            # seconds into its start, the others running (a typo in one grid value found at the
            # end of the sweep); found as toymlx-train says it (`nothing_there`)
            for key, value in data_paths(cfg).items():
                if not os.path.exists(value) or empty_folder(value):
                    raise ValueError(f"{flag_name(key)} {value}: expected an existing file or "
                                     f"folder, found {nothing_there(value)}")
            # said in each run's log alone, the sweep silent: an mlx-lm folder without
            # valid.jsonl trained every run on 90% of train.jsonl, mlx-lm on all of it
            read_as = repr((cfg.data, getattr(cfg, "base", None)))  # a chat template is the base's
            if hasattr(module, "data_notes") and read_as not in read:
                read.add(read_as)
                data_notes += [n for n in module.data_notes(cfg) if n not in data_notes]
        except ValueError as e:
            raise ValueError(f"run {spec.name}: {e}; no run was started") from None
        inputs += [i for i in run_inputs(cfg) if i not in inputs]
    return inputs, notes + data_notes


@console_command("toymlx-sweep")
def main(argv: list[str] | None = None) -> int:
    # `2>&1 | head -3`: the rest of the output is discarded, and the sweep stops as on Ctrl-C
    # (its runs checkpoint; summary and report written; exit 141); `| head -3` alone reads
    # stdout, which has only the final table
    from toymlx.backend.stop import SIGNALS, how_stopped, stops_raise

    if argv is None:  # the console script
        console_streams()
    with output_may_close():
        # Ctrl-C (a kill, a closed terminal) while the runs are checked (a lora run's examples
        # read: seconds) ended in a traceback; the sweep, once begun, counts them itself
        try:
            with stops_raise(SIGNALS):
                checked = _main(argv)
        except KeyboardInterrupt as e:
            what, code = how_stopped(e)
            print(f"toymlx-sweep: {what} before any run started; nothing was run",
                  file=sys.stderr)
            return code
        return checked if isinstance(checked, int) else checked()


def _main(argv: list[str] | None) -> int | Callable[[], int]:
    """The sweep's options read and every run's checked: its exit status where they are
    refused, else the sweep to run (`_sweep`)."""
    from toymlx_cli.config_file import (
        check_sweep_flag_typos,
        check_sweep_typos,
        defaults_from_file,
        file_key_error,
        is_run_config,
        read_config_file,
        split_config,
        sweep_config,
        sweep_file_flags,
    )
    from toymlx_cli.mlx_lm_config import is_mlx_lm_config

    from toymlx import sweeps as sweep
    from toymlx.backend.device import restart_with_huge_pages
    from toymlx.recipes import RECIPES, get_recipe

    if argv is None:  # the console script: its runs inherit the huge-page heap setting
        restart_with_huge_pages()
    argv = sys.argv[1:] if argv is None else list(argv)
    after = []
    if "--" in argv:
        k = argv.index("--")
        argv, after = argv[:k], argv[k + 1:]
    parser = _parser()
    file_grid: dict = {}
    run_options, run_config, mlx_lm = None, False, False
    keys: dict[str, str] = {}  # the sweep's flags its -c file set: a refusal names the key
    try:
        path, argv = split_config(argv)
        if path is not None:
            data = read_config_file(path)
            run_config = is_run_config(data, path)
            file_grid, run_options = sweep_config(parser, data, path)
            keys = sweep_file_flags(parser, data, argv)
            # mlx-lm's lora config (its runs' keys), read as toymlx-train -c reads it, unless a
            # recipe other than lora is asked for (then refused as toymlx-train refuses it)
            mlx_lm = not run_config and is_mlx_lm_config(run_options, "recipe" in data)
            # argparse's "the following arguments are required: --recipe" said nothing of
            # the file that lacked it
            if not mlx_lm and parser.get_default("recipe") is None and not any(
                    a == "--recipe" or a.startswith("--recipe=") for a in argv):
                raise ValueError(f"{path}: key 'recipe': expected the runs' recipe (recipe: "
                                 "from-scratch, or --recipe NAME), found none")
    except ValueError as e:
        print(f"toymlx-sweep: error: {e}", file=sys.stderr)
        return 2
    with readable_width():
        args, rest = parser.parse_known_args(argv)
    passthrough = rest + after
    mlx_lm = mlx_lm and args.recipe in (None, "lora")
    if mlx_lm:
        args.recipe = "lora"
    try:
        if args.recipe is None:  # argparse's "the following arguments are required: --recipe"
            raise ValueError(f"--recipe: expected the runs' recipe (one of "
                             f"{', '.join(RECIPES)}), found none; e.g. {EXAMPLE}")
        if args.config is not None:  # a spelling split_config leaves to argparse (-cFILE)
            raise ValueError(f"-c/--config: expected -c FILE or --config=FILE, found "
                             f"-c{args.config}")
        if args.seed is not None and args.random is None:
            raise ValueError("--seed: expected with --random N (it seeds the random draws; "
                             "random_seed in a -c file), found no --random; give runs a "
                             "training seed with --grid seed=S, after `--`, or as seed in a -c "
                             "file")
        # flags after `--` are the runs' by the user's word; before it, a sweep flag misspelt
        check_sweep_flag_typos(parser, get_recipe(args.recipe).Config, rest)
        if mlx_lm:  # its keys checked, and the table shown, as toymlx-train -c shows it
            _mlx_lm_table(run_options, path, passthrough, file_grid, args)
        elif run_options:  # checked now, as toymlx-train -c would check it in every run
            check_sweep_typos(parser, get_recipe(args.recipe).Config, run_options, path)
            defaults_from_file(get_recipe(args.recipe).Config, run_options, path,
                               f"toymlx-train --recipe {args.recipe}")
        axes = _axes(args, file_grid, path, mlx_lm)
        if not axes:
            # a run's config.json holds no grid: "or a grid in runs/x/config.json" misled
            raise ValueError("--grid: expected at least one KEY=V1,V2 (e.g. --grid lr=1e-4,3e-4)"
                             + (f" or a grid in {path}" if path and not run_config else ""))
        if args.random is None:
            ranged = [k for k, v in axes.items() if not isinstance(v, list)]
            if ranged:
                raise ValueError(f"--grid {ranged[0]}: a LO:HI range needs --random N (random: "
                                 "N in a -c file)")
            specs = sweep.grid(passthrough, axes, recipe=args.recipe)
        else:
            specs = sweep.random(passthrough, axes, args.random, args.seed or 0,
                                 recipe=args.recipe)
            if len(specs) < args.random:  # the first line's "2 runs" alone, where 5 were asked
                print(f"toymlx-sweep: --random {args.random}: drew {len(specs)} distinct runs, "
                      f"not {args.random}: the grid holds no more; running the {len(specs)}",
                      file=sys.stderr)
        inputs, notes = _check_runs(args.recipe, specs, run_options, path, run_config,
                                    args.runs_root, mlx_lm)
        for note in notes:  # as each run's toymlx-train says them (its log, naming the copy)
            print(f"toymlx-sweep: {note}", file=sys.stderr)
        shard = _shard(args.shard)
    except (ValueError, OSError) as e:
        print(f"toymlx-sweep: error: {file_key_error(str(e), keys, path)}", file=sys.stderr)
        return 2
    return partial(_sweep, args, specs, shard, run_options, inputs, path, run_config, notes,
                   keys)


def _sweep(args: argparse.Namespace, specs: list, shard: tuple[int, int], run_options: dict | None,
           inputs: list, path: str | None, run_config: bool, notes: list[str],
           keys: dict[str, str]) -> int:
    """Run the sweep `_main` checked (`keys`: the sweep's flags its -c file set); its exit
    status."""
    from toymlx_cli.config_file import file_key_error

    from toymlx import sweeps as sweep
    from toymlx.backend.stop import SIGNALS, how_stopped, stop_outcome, stops_raise

    try:
        # the runs count the stop signals while they run (each checkpoints and ends); before
        # and after them (the summary and report.png written) one stops the sweep at once, its
        # file in flight abandoned whole (an atomic write), and the sweep says so in one line
        with stops_raise(SIGNALS):
            result = sweep.run_sweep(args.recipe, specs, args.runs_root, args.workers, shard,
                                     args.sweep_id, retry_failed=not args.no_retry_failed,
                                     progress=not args.no_progress,
                                     report_png=not args.no_report, run_options=run_options,
                                     inputs=inputs, config_file=path, run_config=run_config,
                                     said=notes)
    except (ValueError, OSError) as e:
        print(f"toymlx-sweep: error: {file_key_error(str(e), keys, path)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # run_sweep said what it stopped and how to finish it
        return how_stopped(e)[1]
    if "interrupted" in result.states.values() or result.signal:
        return stop_outcome(result.signal)[1]  # 128 + the signal's number (Ctrl-C: 130)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
