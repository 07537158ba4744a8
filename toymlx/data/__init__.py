"""Data loading: text, chat/JSONL and images, as numpy batches pure in (seed, step)."""

from importlib import resources
from pathlib import Path


def fixture_path(*parts: str) -> Path:
    """A file of the default datasets shipped inside the package, e.g.
    `fixture_path("digits", "digits.npz")` (`toymlx/fixtures/`, in the wheel too)."""
    return Path(str(resources.files("toymlx").joinpath("fixtures", *parts)))
