"""toymlx-train --recipe NAME [options]: train one model and write its run bundle."""

from __future__ import annotations

import argparse
import atexit
import sys

from toymlx_cli import console_command, console_streams, output_may_close, print_version
from toymlx_cli.config_file import CONFIG_HELP

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)


def _split_recipe(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """--recipe's and --resume's values, and the command line without --recipe. Spelt out only:
    argparse's abbreviations took PEFT's (Unsloth's) `--r 16` for --recipe or --resume ("ambiguous
    option"), where tyro then names it as --lora.rank (`usage.HF_FLAGS`)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recipe")
    pre.add_argument("--resume")
    known, _ = pre.parse_known_args(argv)
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--recipe":
            skip = True
            continue
        if a.startswith("--recipe="):
            continue
        rest.append(a)
    return known.recipe, known.resume, rest


def _given_inputs(argv: list[str]) -> dict[str, str]:
    """{option: path} of the input options (`--data.path`, `--data.*-path`, `--base`,
    `--donor`, `--tokenizer`, `--lora.init-adapter`) a resume's command line gives: the bundle
    opens with them (`Bundle.open`'s `given`), so data, a model or an init adapter moved since
    the run started is read from its new place once its contents are checked."""
    from toymlx.bundle.inputs import FILE_OPTIONS, MODEL_OPTIONS

    out = {}
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        key = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if key in MODEL_OPTIONS or key in FILE_OPTIONS or key.startswith("data.") and (
                key == "data.path" or key.endswith("_path")):
            if eq:
                out[key] = value
            elif i + 1 < len(argv):
                out[key] = argv[i + 1]
    return out


def _usage() -> str:
    from toymlx.recipes import RECIPES, SUMMARIES

    return ("usage: toymlx-train --recipe NAME [-c FILE] [options]\n\nrecipes:\n"
            + "".join(f"  {n:<14}{SUMMARIES[n]}\n" for n in RECIPES)
            + "\n`toymlx-train --recipe NAME --help` lists every option of a recipe.\n"
            + CONFIG_HELP + " A run's config.json starts a new run with its settings:\n"
            "  toymlx-train -c runs/<id>/config.json --run-id new\n"
            "Start here: toymlx-train --recipe vit-tiny\n"
            "toymlx-train --version prints toymlx's and MLX's versions.\n")


def _no_recipe(config_path: str, options: dict) -> str:
    """Why a -c file without --recipe names no recipe: tyro's usage would not name the file."""
    from toymlx.recipes import RECIPES

    if not options:
        return f"{config_path}: expected a mapping of options, found an empty file"
    return (f"{config_path}: expected a 'recipe' key (one of {', '.join(RECIPES)}), found none; "
            "or give --recipe NAME")


def _ignore_late_signals() -> None:
    """At exit, after the run ended: Python puts the stop signals back to the system default
    while it finalizes, so a late Ctrl-C would kill the exiting process (status -2, exit code
    lost)."""
    from toymlx.backend.stop import ignore_stop_signals

    ignore_stop_signals()


@console_command("toymlx-train")
def main(argv: list[str] | None = None) -> int:
    from toymlx.backend.device import restart_with_huge_pages
    from toymlx.backend.lifeline import watch_parent
    from toymlx.backend.stop import RANK_SIGNALS, SIGNALS, how_stopped, stops_raise
    from toymlx.runner.launch import launched_as_rank, rank_status

    if argv is None:  # the console script (or python -m): the heap on huge pages
        console_streams()
        restart_with_huge_pages()

    watch_parent()  # started by toymlx-sweep / toymlx-launch: stop when that parent dies
    atexit.unregister(_ignore_late_signals)  # once, however often main runs in one process
    atexit.register(_ignore_late_signals)
    # under toymlx-launch: report how this rank ended; a closed console's output is discarded
    # (a pipe whose reader has gone, `| head -3`, then stops the loop as Ctrl-C does:
    # StopSignals); a stop signal before the loop ends the process as Ctrl-C does (a rank also
    # counts toymlx-launch's relays: see StopSignals)
    signals = RANK_SIGNALS if launched_as_rank() else SIGNALS
    with rank_status() as status, output_may_close(), stops_raise(signals):
        try:
            status.code = _main(argv)
        except KeyboardInterrupt as e:  # Ctrl-C while parsing or importing: no traceback
            what, status.code = how_stopped(e)
            print(f"toymlx-train: {what}", file=sys.stderr)
    return status.code


def _main(argv: list[str] | None) -> int:
    from toymlx_cli.config_file import (
        defaults_from_file,
        file_flags,
        file_key_error,
        is_run_config,
        read_config_file,
        run_config,
        split_config,
        under_the_flags,
    )
    from toymlx_cli.mlx_lm_config import (
        flags_given,
        is_mlx_lm_config,
        mlx_lm_error,
        mlx_lm_parsed,
        mlx_lm_read,
        mlx_lm_table,
    )
    from toymlx_cli.usage import UsageError, line_as_typed, parse_options

    from toymlx.bundle.checkpoint import train_command
    from toymlx.bundle.options import RunError
    from toymlx.recipes import get_recipe
    from toymlx.runner.api import check_given_types
    from toymlx.runner.bundle import Bundle
    from toymlx.runner.launch import refused_alike
    from toymlx.runner.run import run_training

    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print_version()
        return 0
    default, bundle, mlx_lm, in_file = None, None, False, {}
    # {flag: key} of the options a config file of options sets (not a run's config.json): given,
    # as the command line's flags are, and named by the file's key where a check refuses them
    file_keys: dict[str, str] = {}
    run_file = False
    notes: list[str] = []  # an mlx-lm file's, said once the run is not refused (`run_training`)
    try:
        config_path, argv = split_config(argv)
        recipe, resume, rest = _split_recipe(argv)
        if resume == "":  # not a new run, as an empty --resume would otherwise start
            raise ValueError("--resume: expected a non-empty run folder (runs/<id>), got an "
                             "empty string")
        options: dict = {}
        if config_path is not None:
            if resume:  # the command that works: the one typed, without -c FILE
                raise ValueError(f"-c/--config {config_path}: a resumed run keeps its saved "
                                 f"configuration (only --steps and run-local options may "
                                 f"change); give either --resume or -c/--config: "
                                 f"{train_command(argv)}")
            data = read_config_file(config_path)
            run_file = is_run_config(data, config_path)
            file_recipe, options = run_config(data, config_path)
            recipe = recipe or file_recipe  # --recipe on the command line wins, as flags do
            if recipe in (None, "lora") and is_mlx_lm_config(options, file_recipe is not None):
                recipe, mlx_lm = "lora", True  # mlx-lm's lora config, with mlx-lm's meaning
                in_file = options
                options, rows, notes = mlx_lm_read(in_file, config_path, rest)
                print(f"{config_path}: read as mlx-lm's lora config:\n" + mlx_lm_table(rows))
        if resume:
            bundle = Bundle.open(resume, "--resume", given=_given_inputs(rest))
            if recipe and recipe != bundle.recipe:
                raise RunError(f"{resume}: --resume: expected a run of recipe {recipe!r}, found "
                               f"a {bundle.recipe!r} run")
            recipe, module = bundle.recipe, bundle.module
            # The saved options are the defaults; run_training refuses any change that is not
            # run-local. A resumed run continues to the end unless told otherwise here.
            default = bundle.resume_defaults(resume)
        elif recipe is None and config_path is not None and not {"--help", "-h"} & set(argv):
            raise ValueError(_no_recipe(config_path, options))
        elif recipe is None:
            if "--help" in argv or "-h" in argv:
                print(_usage(), file=sys.stderr if "--help" not in argv else sys.stdout)
                return 0
            return refused_alike(_usage())
        else:
            module = get_recipe(recipe)
            if config_path is not None:
                # a `toymlx.train(config=FILE)` call's keywords, by the recipe the file names
                check_given_types(module.Config)
                try:
                    default = defaults_from_file(module.Config, options, config_path,
                                                 f"toymlx-train --recipe {recipe}")
                except ValueError as e:  # an mlx-lm file: named by its own key
                    raise ValueError(mlx_lm_error(str(e), rows, config_path) if mlx_lm
                                     else str(e)) from None
                if mlx_lm:  # the rows of the file's own keys, its toymlx options
                    file_keys = {o: k for k, o, _, f in rows if f.startswith("file")}
                elif not run_file:
                    file_keys = under_the_flags(file_flags(module.Config, options, config_path),
                                                rest)
    except (ValueError, OSError) as e:  # RunError, LockHeld, an unknown --recipe; a path the
        # system refuses (a name too long)
        return refused_alike(f"toymlx-train: error: {e}")
    try:
        cfg = parse_options(module.Config, rest, f"toymlx-train --recipe {recipe}", default,
                            f"{module.__doc__}\n\n{CONFIG_HELP}")
    except UsageError as e:
        return refused_alike(f"toymlx-train: error: {e}")
    try:
        if mlx_lm:
            cfg, more = mlx_lm_parsed(cfg, in_file, config_path, rest)
            notes += more
    except ValueError as e:
        return refused_alike(f"toymlx-train: error: {e}")
    def named(message: str) -> str:
        """A refusal before the first step naming its options as the user gave them: a config
        file's value by the file's key, not the flag (an mlx-lm file's, as mlx-lm spells it);
        each flag the command line gives, as typed (`--weight_decay`, HF's and mlx-lm's
        spelling, was named --weight-decay)."""
        keyed = (mlx_lm_error(message, rows, config_path) if mlx_lm
                 else file_key_error(message, file_keys, config_path) if file_keys else message)
        return line_as_typed(keyed, rest, module.Config)

    return run_training(recipe, module, cfg, bundle, config_path, name_keys=named, notes=notes,
                        given=frozenset(flags_given(rest)) | set(file_keys))


if __name__ == "__main__":
    sys.exit(main())
