"""Random-search draws: the distributions a `--random` sweep samples each option from, and
their `log:LO:HI` / `uniform:LO:HI` / `int:LO:HI` text (`parse_range`)."""

from __future__ import annotations

import math
import random as _random
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LogUniform:
    """Random-search distribution: log-uniform on [lo, hi], rounded to 3 significant digits."""

    lo: float
    hi: float

    def sample(self, rng: _random.Random) -> float:
        return _round3(math.exp(rng.uniform(math.log(self.lo), math.log(self.hi))))


@dataclass(frozen=True)
class Uniform:
    """Random-search distribution: uniform on [lo, hi], rounded to 3 significant digits."""

    lo: float
    hi: float

    def sample(self, rng: _random.Random) -> float:
        return _round3(rng.uniform(self.lo, self.hi))


@dataclass(frozen=True)
class IntUniform:
    """Random-search distribution: an integer in [lo, hi], both included."""

    lo: int
    hi: int

    def sample(self, rng: _random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def _round3(x: float) -> float:
    return float(f"{x:.3g}")



RANGE = re.compile(r"(log|uniform|int):([^:]+):([^:]+)")
"""A --random range: log:LO:HI, uniform:LO:HI or int:LO:HI."""


def parse_range(kind: str, lo: str, hi: str, where: str,
                integer: bool = False) -> LogUniform | Uniform | IntUniform:
    """The distribution a range's text names; ValueError starting with `where`. `integer`: the
    option takes an integer, and only int:LO:HI draws one (a uniform: range's 2.69 was refused
    as a run's value, naming no range)."""
    if integer and kind != "int":
        raise ValueError(f"{where}: expected int:{lo}:{hi} (the option takes an integer), found "
                         f"{kind}:{lo}:{hi}")
    try:
        if kind == "int":
            dist: Any = IntUniform(int(lo), int(hi))
        else:
            dist = (LogUniform if kind == "log" else Uniform)(float(lo), float(hi))
    except ValueError:
        raise ValueError(f"{where}: expected {kind}:LO:HI with numbers") from None
    if dist.lo > dist.hi or (kind == "log" and dist.lo <= 0):
        raise ValueError(f"{where}: expected {'0 < ' if kind == 'log' else ''}LO <= HI, found "
                         f"LO {lo} and HI {hi}")
    return dist
