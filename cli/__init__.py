"""Thin command-line entry points (installed as `toymlx_cli`)."""

from importlib import metadata

from toymlx import __version__


def version_text() -> str:
    """What every command's `--version` prints: `toymlx 0.2.0 (mlx 0.32.4)`."""
    try:
        mlx = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx = "not installed"
    return f"toymlx {__version__} (mlx {mlx})"
