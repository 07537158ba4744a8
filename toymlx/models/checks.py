"""A model argument out of range, told so that a caller can name each field as its user gave
it (toymlx-train names the flags), while this package knows nothing of where they came from."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

_FIELD = re.compile(r"\{(\w+)\}")


def field_name(field: str) -> str:
    """A field as the model package names it: model.d_model."""
    return f"model.{field}"


class ArgsError(ValueError):
    """`field` of `args`: expected `expected` (in which `{other}` stands for another field, shown
    with its value), found `found` (default: the field's value). `alt` (field, expected) tells
    the same fault of another field (d_model "a multiple of {n_heads}" is n_heads "a divisor of
    {d_model}"), so the message can name the field its user gave."""

    def __init__(self, args: Any, field: str, expected: str, found: Any = None,
                 alt: tuple[str, str] | None = None):
        self.model, self.field, self.expected, self.alt = args, field, expected, alt
        self.found = getattr(args, field) if found is None else found
        super().__init__(self.text())

    def text(self, name: Callable[[str], str] = field_name, given: Collection[str] = (),
             preset: Collection[str] = ()) -> str:
        """The message, each field named by `name`; told of `alt`'s field where that one is
        among the fields `given` and `field` is not. A field of `preset` that the message
        names beside it is shown as the preset's value ("--model.n-kv-heads (4, the preset's)"):
        its user did not give it, and may not know it was there to give."""
        field, expected, found = self.field, self.expected, self.found
        if self.alt is not None and field not in given and self.alt[0] in given:
            field, expected = self.alt
            found = getattr(self.model, field)

        def shown(m: re.Match) -> str:
            whose = ", the preset's" if m[1] in preset else ""
            return f"{name(m[1])} ({getattr(self.model, m[1])}{whose})"

        expected = _FIELD.sub(shown, expected)
        return f"{name(field)}: expected {expected}, found {found}"
