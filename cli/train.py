"""toymlx-train --recipe NAME [options]: train one model and write its run bundle."""

from __future__ import annotations

import argparse
import sys

from toymlx_cli import version_text

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)


def _split_recipe(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    pre = argparse.ArgumentParser(add_help=False)
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


def _usage() -> str:
    from toymlx.recipes import RECIPES

    return ("usage: toymlx-train --recipe NAME [options]\n\nrecipes:\n"
            + "".join(f"  {n}\n" for n in RECIPES)
            + "\n`toymlx-train --recipe NAME --help` lists every option of a recipe.\n"
            "Start here: toymlx-train --recipe vit-tiny\n"
            "toymlx-train --version prints toymlx's and MLX's versions.\n")


def main(argv: list[str] | None = None) -> int:
    from toymlx.launch import rank_status

    with rank_status() as status:  # under toymlx-launch: report how this rank ended
        status.code = _main(argv)
    return status.code


def _main(argv: list[str] | None) -> int:
    import tyro

    from toymlx.recipes import get_recipe
    from toymlx.runs import RunError, load_config

    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print(version_text())
        return 0
    recipe, resume, rest = _split_recipe(argv)
    saved = None
    try:
        if resume:
            saved_recipe, saved = load_config(resume)
            if recipe and recipe != saved_recipe:
                raise RunError(f"{resume}: --resume: expected a run of recipe {recipe!r}, found "
                               f"a {saved_recipe!r} run")
            recipe = saved_recipe
        if recipe is None:
            print(_usage(), file=sys.stderr if "--help" not in argv else sys.stdout)
            return 0 if ("--help" in argv or "-h" in argv) else 2
        module = get_recipe(recipe)
    except (RunError, ValueError) as e:
        print(f"toymlx-train: error: {e}", file=sys.stderr)
        return 2
    default = None
    if saved is not None:
        from toymlx.runs import config_from_dict

        default = config_from_dict(module.Config, saved)
        # A resumed run continues to the end unless told otherwise on this command line.
        default.stop_at, default.resume, default.overwrite = None, resume, False
    cfg = tyro.cli(module.Config, args=rest, default=default,
                   prog=f"toymlx-train --recipe {recipe}", description=module.__doc__)
    from toymlx.run import run_training

    return run_training(recipe, module, cfg)


if __name__ == "__main__":
    sys.exit(main())
