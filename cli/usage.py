"""tyro's parse of a command's options, a command line it refuses as one line.

tyro (1.0) draws a refused command line as a box of many lines on stderr and exits 2, where
toymlx's other bad input is one line `PROG: error: ...`. tyro's own way to take that over is its
parse-error hook (`tyro._errors.on_parse_error`): the hook gets the failure as an event (the
argument, the value or the unknown tokens) before anything is printed, and raising from it
replaces tyro's print-and-exit. tyro marks that module private and experimental, so it is used
here only, in `parse_options`, which every toymlx command parses its options through. Where the
hook is missing (an older tyro), or an event is one toymlx has no words for (subcommands and
mutually exclusive groups, which no toymlx command has), or tyro's event has changed shape,
tyro's own box is printed as before: a refusal is never lost, only longer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union

from toymlx_cli.config_file import closest_option, option_table


class UsageError(ValueError):
    """A command line tyro refuses, as one line naming the flag, the value given and what is
    expected."""


def parse_options(cls: type, argv: list[str], prog: str, default: Any = None,
                  description: str | None = None) -> Any:
    """tyro.cli(cls) over `argv`; UsageError (one line) for a command line it refuses. `--help`
    prints tyro's help and exits 0, as tyro does."""
    import tyro

    from toymlx.bundle.options import check_no_empty_text

    try:
        from tyro._errors import on_parse_error
    except ImportError:  # a tyro without the hook: its own box
        on_parse_error = None

    def refuse(event: Any) -> None:
        try:
            line = _one_line(event, cls, argv)
        except (AttributeError, TypeError):  # an event of another shape: tyro's box
            return
        if line is not None:
            raise UsageError(line)

    hooked = on_parse_error(refuse) if on_parse_error else contextlib.nullcontext()
    with hooked:
        options = tyro.cli(cls, args=argv, prog=prog, default=default, description=description)
    try:
        check_no_empty_text(options)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return options


def _one_line(event: Any, cls: type, argv: list[str]) -> str | None:
    """The event (tyro._errors' ParseErrorEvent) as one line, or None for tyro's own box."""
    kind = type(event).__name__
    if kind == "UnrecognizedArgs":
        return _unrecognized(event.tokens, cls, argv, event.prog)
    if kind == "MissingArgs":
        flags = _flags(cls)
        unknown = [t for t in argv if t.startswith("-") and not _is_number(t) and t != "--"
                   and t.partition("=")[0].lstrip("-").replace("-", "_") not in flags
                   and t.partition("=")[0] not in ("-h", "--help")]
        if unknown:  # `-m FILE` leaves --model missing: the unknown option is what to say
            return _unrecognized(unknown, cls, argv, event.prog)
        names = ", ".join(a.arg.display_name() for a in event.missing_arguments)
        each = " for each (they are required)" if len(event.missing_arguments) > 1 else \
            " (it is required)"
        return f"{names}: expected a value{each}, got none"
    if kind == "MutexConflict":
        return (f"{event.first_token}, {event.second_token}: expected one of them, got both")
    if kind not in ("BadValue", "InvalidChoice", "InstantiationFailure"):
        return None
    arg = event.argument
    if arg is None:  # a value refused by the options' own constructor
        return " ".join(event.message.split())
    at, values = _given(argv, arg.lowered.name_or_flags)
    flag = argv[at].partition("=")[0] if at is not None else arg.display_name()
    if kind == "InvalidChoice":  # in the type's order (tyro's order of a bool's may vary)
        choices = _choices(arg.field.type) or list(event.choices)
        return f"{flag}: expected one of {', '.join(choices)}, got {event.value!r}"
    if kind == "BadValue" and event.reason == "fixed":
        return (f"{flag}: expected no value (it is fixed to {arg.field.default!r}), got "
                f"{event.offending_value!r}")
    expected = _expected(arg.field.type) or str(arg.lowered.metavar)
    if kind == "BadValue":  # too few values: the flag last, or another option after it
        after = argv[at + 1] if at is not None and at + 1 < len(argv) else None
        return (f"{flag}: expected {expected} after it, got "
                + (f"the option {after}" if after else "nothing"))
    nargs = arg.lowered.nargs
    given = " ".join(values[:nargs] if isinstance(nargs, int) else values)
    if _expected(arg.field.type) is None:  # a type toymlx has no words for: tyro's reason
        return f"{flag}: {' '.join(event.message.split())} (got {given!r})"
    return f"{flag}: expected {expected}, got {given!r}"


_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a value", "values"), bool: ("True or False", "True or False values"),
          Path: ("a path", "paths")}


def _bare(tp: Any) -> Any:
    """A type without its Annotated wrappers (tyro.conf.arg, Positional)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _expected(tp: Any, plural: bool = False) -> str | None:
    """What an option of type `tp` takes, in words (`an integer or None`); None for a type
    without words here."""
    tp = _bare(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        kinds = [_expected(a, plural) for a in args if a is not type(None)]
        if None in kinds:
            return None
        return " or ".join(kinds + (["None"] if type(None) in args else []))
    if origin in (list, tuple, Sequence) and args:
        return _expected(args[0], plural=True)
    return _KINDS[tp][plural] if tp in _KINDS else None


def _choices(tp: Any) -> list[str] | None:
    """The values of a type of few values (Literal, bool, None, unions of them) in its
    declared order; None for another type."""
    tp = _bare(tp)
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        parts = [_choices(a) for a in typing.get_args(tp)]
        return None if None in parts else [c for p in parts for c in p]
    return ["True", "False"] if tp is bool else ["None"] if tp is type(None) else None


def _given(argv: list[str], names: Sequence[str]) -> tuple[int | None, list[str]]:
    """(where in argv, the values given) at the last use of an option (tyro takes the last);
    (None, []) where argv does not name it."""
    spelt = {n.replace("_", "-") for n in names}
    for i in range(len(argv) - 1, -1, -1):
        flag, eq, value = argv[i].partition("=")
        if flag.replace("_", "-") in spelt:
            if eq:
                return i, [value]
            values = []
            for token in argv[i + 1:]:
                if token.startswith("--"):
                    break
                values.append(token)
            return i, values
    return None, []


def _flags(cls: type) -> dict[str, bool]:
    """Every option of `cls` spelled as `option_table` spells them, tyro's `no_x` of a plain
    bool included -> whether it is a flag that takes no value (a plain bool)."""
    out = {}
    for key, path in option_table(cls).items():
        node, tp = cls, None
        for name in path:
            tp = typing.get_type_hints(node)[name]
            node = tp if dataclasses.is_dataclass(tp) else node
        out[key] = tp is bool
        if tp is bool:
            group, dot, leaf = key.rpartition(".")
            out[f"{group}{dot}no_{leaf}"] = True
    return out


LLAMA_CPP_FLAGS = {"-m": "model", "-p": "prompt", "-n": "max_tokens", "--n-predict": "max_tokens",
                   "-s": "seed"}
"""llama.cpp's short flags (llama-cli, llama-completion) -> the option a command names instead."""


def _unrecognized(tokens: list[str], cls: type, argv: list[str], prog: str) -> str:
    """tyro's unrecognized tokens as one line: each unknown option with the closest flag of
    `cls`; a value no option takes with the option before it (a flag that takes no value)."""
    flags = _flags(cls)
    parts, at, after_unknown = [], 0, False
    for token in tokens:
        flag, eq, value = token.partition("=")
        if flag.startswith("--") or (flag.startswith("-") and not _is_number(flag)):
            close = (f"--{LLAMA_CPP_FLAGS[flag].replace('_', '-')}"
                     if LLAMA_CPP_FLAGS.get(flag) in flags else closest_option(flag, flags))
            parts.append(f"{flag}: expected an option of {prog}, got an unknown one"
                         + (f"; did you mean {close}?" if close else ""))
            after_unknown = not eq  # a value after it is its own, not a second finding
            at = _position(argv, token, at)
            continue
        if after_unknown:
            after_unknown = False
            continue
        at = _position(argv, token, at)
        before, _, value = argv[at].partition("=") if at < len(argv) else ("", "", "")
        if value != token and at > 0:
            before = argv[at - 1].partition("=")[0]
        if flags.get(before.lstrip("-").replace("-", "_")):
            bool_flag = before.lstrip("-").replace("-", "_")
            group, dot, leaf = bool_flag.rpartition(".")
            other = (f"{group}{dot}{leaf[3:]}" if leaf.startswith("no_")
                     else f"{group}{dot}no_{leaf}")
            parts.append(f"{before}: expected no value (a flag; --{other.replace('_', '-')} "
                         f"{'sets it true' if leaf.startswith('no_') else 'sets it false'}), "
                         f"got {token!r}")
        else:
            parts.append(f"{token!r}: expected an option of {prog}, got a value no option "
                         "takes" + (f" (after {' '.join(argv[max(at - 2, 0):at])})"
                                    if at > 0 else ""))
    return "; ".join(parts)


def _position(argv: list[str], token: str, start: int) -> int:
    """Where `token` (or `--x=token`) is in argv from `start`; len(argv) where it is not."""
    for i in range(start, len(argv)):
        if argv[i] == token or argv[i].partition("=")[2] == token:
            return i
    return len(argv)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
