"""The fused file that keeps the fine-tune: per-tensor types chosen by measurement.

Fusing a small update D into weights that already sit on a quantization grid and rounding
W + D back onto that grid erases most of D (a LoRA delta is mostly below half a Q4 step). Only
the adapted tensors change, so `write_kept` writes:
- every tensor the fine-tune does not touch: the base's own bytes (raw blocks, no dequantize
  or requantize);
- each changed tensor in the smallest tensor type (`LADDER`, those this install writes) that
  keeps its change: output error ||(Q - F) x|| at most `1 - KEEP` of the change's ||D x||,
  with F = W + D the fused float weights and Q the written ones. Inputs are isotropic
  (E||E x||^2 is ||E||_F^2 up to a constant), so the measure is the Frobenius ratio, the same
  for every tensor and needing no data.
- within `MAX_SIZE` times the base's file: when every changed tensor cannot keep its change
  within that, the bytes go where they remove the most output error per byte (`choose_types`,
  greedy). Where the file would then keep less than `GROW_BELOW` of the change (a short run's
  small delta, a full fine-tune changing every tensor), it grows past `MAX_SIZE` instead, the
  same way, until each changed tensor keeps its change, and says so: a default fused file never
  loses most of the fine-tune, and is never refused for it.
general.file_type stays the base's (as llama.cpp's own mixtures, Q4_K_M, mix types per tensor).
No candidate is ever smaller than the base tensor's own type, so each changed tensor's error is
at most naive rounding's (the fused tensor in the base's type), which is itself a candidate.

`kept_share` is the retention figure every fused export prints: over the changed tensors,
1 - sqrt(sum ||Q - F||^2 / sum ||D||^2), clipped to [0, 1] (the share of the change's output
energy kept; 0 when the rounding noise is as large as the change or larger).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from toymlx.backend.files import counted
from toymlx.gguf.quantize import (
    GGUF_PY_TENSOR_TYPES,
    dequantize_tensor,
    ggml_quantize_chunk,
    quantize_tensor,
)
from toymlx.gguf.reader import DIGEST_KEY, GGUFFile
from toymlx.gguf.writer import QuantTensor, write_gguf

T = GGMLQuantizationType
LADDER = (T.Q4_0, T.Q4_K, T.Q4_1, T.Q5_0, T.Q5_K, T.Q5_1, T.Q6_K, T.Q8_0, T.F16, T.F32)
"""Tensor types a changed tensor may be written in, smallest first (bits per weight)."""
KEEP = 0.9
"""A changed tensor keeps its change when its output error is at most 1 - KEEP of ||D x||."""
MAX_SIZE = 1.10
"""The fused file is at most this many times the base's file, unless that loses the change."""
GROW_BELOW = 0.5
"""A fused file that would keep less of the change than this within `MAX_SIZE` grows past it."""
RUN_DATA = "toy.run_data."
"""The GGUF metadata namespace in which a fused file records the settings of the LoRA run it
was fused from that decide that run's held-out rows (`toymlx.training.fused.run_data_metadata`),
so that toymlx-eval scores the file on the run's rows without the run folder; llama.cpp ignores
keys it does not know. A base's own (a fused file fine-tuned again) are never inherited: they
describe another run's weights."""


def bits_per_weight(t: GGMLQuantizationType) -> float:
    block, size = GGML_QUANT_SIZES[t]
    return 8.0 * size / block


def tensor_nbytes(t: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[t]
    return int(np.prod(shape)) // block * size


@dataclass(frozen=True)
class Option:
    """One way to write a changed tensor: its type, bytes and squared output error ||Q - F||^2."""

    type: GGMLQuantizationType
    nbytes: int
    err2: float


@dataclass
class Choice:
    """What `choose_types` decided for one changed tensor."""

    name: str
    base_type: GGMLQuantizationType
    options: list[Option]
    """Pareto options, fewest bytes first, each with less error than every cheaper one."""
    naive: Option | None
    """The fused tensor in the base tensor's own type (None when nothing here writes that)."""
    delta2: float
    """||D||^2: the change's output energy."""
    at: int = 0

    @property
    def chosen(self) -> Option:
        return self.options[self.at]

    def kept(self) -> float:
        return kept_from(self.chosen.err2, self.delta2)


def kept_from(err2: float, delta2: float) -> float:
    """The share of a change kept, from the squared output error and the change's energy."""
    if delta2 <= 0.0:
        return 1.0
    return float(min(1.0, max(0.0, 1.0 - np.sqrt(err2 / delta2))))


def tensor_types_written() -> set[GGMLQuantizationType]:
    """Tensor types `quantize_tensor` writes here: every type llama.cpp quantizes without an
    importance matrix where llama-cpp-python is installed, else gguf-py's."""
    if ggml_quantize_chunk() is not None:
        return set(LADDER) | {GGMLQuantizationType[n] for n in GGUF_PY_TENSOR_TYPES}
    return {GGMLQuantizationType[n] for n in GGUF_PY_TENSOR_TYPES}



def candidates(base_type: GGMLQuantizationType, n_in: int) -> list[GGMLQuantizationType]:
    """The types a changed tensor of the base type `base_type` and rows of `n_in` values may be
    written in here: the base's own and every larger `LADDER` type whose block divides the row."""
    written = tensor_types_written()
    own = bits_per_weight(base_type)
    out = [base_type] if base_type in written and n_in % GGML_QUANT_SIZES[base_type][0] == 0 else []
    out += [t for t in LADDER if t in written and t != base_type and bits_per_weight(t) > own
            and n_in % GGML_QUANT_SIZES[t][0] == 0]
    return out


def measure(name: str, base_type: GGMLQuantizationType, fused: np.ndarray,
            delta: np.ndarray) -> Choice:
    """Every candidate type of a changed tensor, its bytes and its output error."""
    fused = np.ascontiguousarray(fused, np.float32)
    f64 = fused.astype(np.float64)
    opts = []
    for t in candidates(base_type, fused.shape[-1]):
        q = dequantize_tensor(quantize_tensor(fused, t), t, fused.shape)
        opts.append(Option(t, tensor_nbytes(t, fused.shape), float(np.sum((q - f64) ** 2))))
    naive = next((o for o in opts if o.type == base_type), None)
    pareto: list[Option] = []
    for o in sorted(opts, key=lambda o: (o.nbytes, o.err2)):
        if not pareto or o.err2 < pareto[-1].err2:
            pareto.append(o)
    return Choice(name, base_type, pareto, naive, float(np.sum(delta.astype(np.float64) ** 2)))


def choose_types(choices: list[Choice], budget: int) -> None:
    """Move choices up their options while `budget` extra bytes (over each tensor's cheapest
    option) last: always the move (to any larger option of one tensor) removing the most output
    error per byte, so a cheap small step never spends the bytes a big gain needs; a tensor
    stops once it keeps `KEEP` of its change."""
    left = budget
    while True:
        best, ratio = None, 0.0
        for c in choices:
            if c.kept() >= KEEP:
                continue
            cur = c.chosen
            for j in range(c.at + 1, len(c.options)):
                nxt = c.options[j]
                cost = nxt.nbytes - cur.nbytes
                r = (cur.err2 - nxt.err2) / max(cost, 1)
                if cost <= left and r > ratio:
                    best, ratio = (c, j), r
        if best is None:
            return
        c, j = best
        left -= c.options[j].nbytes - c.chosen.nbytes
        c.at = j


def kept_share(choices: Iterable[Choice]) -> float:
    """The retention figure over changed tensors (see the module docstring)."""
    choices = list(choices)
    return kept_from(sum(c.chosen.err2 for c in choices), sum(c.delta2 for c in choices))


@dataclass(frozen=True)
class KeptFile:
    """What `write_kept` wrote: the file, its choices, and the base's size."""

    path: Path
    choices: list[Choice]
    base_bytes: int
    within: tuple[float, float] | None = None
    """(max_size, the share it would keep) where the file grew past max_size; else None."""

    @property
    def kept(self) -> float:
        return kept_share(self.choices)

    def summary(self) -> str:
        """One line for the user: types chosen, tensors copied, the share kept, the size."""
        counts: dict[str, int] = {}
        for c in self.choices:
            key = c.chosen.type.name
            counts[key] = counts.get(key, 0) + 1
        naive = kept_share([Choice(c.name, c.base_type, [c.naive], c.naive, c.delta2)
                            for c in self.choices if c.naive is not None])
        size = self.path.stat().st_size
        grown = ("" if self.within is None else
                 f" (within {self.within[0]:.2f}x it would keep {self.within[1]:.0%}: "
                 "--exact-size keeps the base's size, --dtype picks one type)")
        return (f"{counted(len(self.choices), 'changed tensor')} written as "
                f"{', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}, the rest copied "
                f"from the base; it keeps {self.kept:.0%} of the fine-tune's change on the "
                f"changed layers' outputs (the base's own type would keep {naive:.0%}); "
                f"{size / self.base_bytes:.3f}x the base's size{grown}")


ChangeFn = Callable[[str, np.ndarray], np.ndarray]
"""(tensor name, base weights float32) -> the fused float32 weights."""


def write_kept(out: str | os.PathLike, base: str | os.PathLike, changed: Iterable[str],
               fuse_tensor: ChangeFn, extra: dict[str, Any] | None = None,
               max_size: float = MAX_SIZE, progress: bool = False) -> KeptFile:
    """Write `base` with each tensor in `changed` replaced by `fuse_tensor(name, w)`, in the
    types `choose_types` picks within `max_size` times the base's file, or past it where that
    would keep less than `GROW_BELOW` of the change (`KeptFile.within` says so); every other
    tensor and every metadata key (general.file_type included) as the base has them."""
    base = Path(base)
    out = Path(out)
    changed = list(dict.fromkeys(changed))
    with GGUFFile(base) as g:
        base_bytes = g.file_bytes  # a multi-part base: every part
        choices = []
        for i, name in enumerate(changed):
            info = g.tensors[name]
            w = g.load(name, np.float32)
            f = fuse_tensor(name, w)
            choices.append(measure(name, info.type, f, f.astype(np.float64) - w))
            g.release(name)
            if progress:
                print(f"\rmeasuring tensor types: {i + 1}/{len(changed)}", end="",
                      file=sys.stderr, flush=True)
        if progress and changed:
            print(file=sys.stderr)
        # bytes over the base's file before any choice: each tensor's cheapest option, and
        # room for the added metadata and each changed tensor's alignment padding
        start = sum(c.options[0].nbytes - tensor_nbytes(c.base_type, g.tensors[c.name].shape)
                    for c in choices) + sum(64 + len(k) + len(str(v)) for k, v in
                                            (extra or {}).items()) + 32 * len(choices)
        choose_types(choices, int((max_size - 1.0) * base_bytes) - start)
        within = None
        if changed and kept_share(choices) < GROW_BELOW:
            within = (max_size, kept_share(choices))
            choose_types(choices, sum(c.options[-1].nbytes for c in choices))  # no bound
        written = {}
        for c in choices:
            f = np.ascontiguousarray(fuse_tensor(c.name, g.load(c.name, np.float32)), np.float32)
            written[c.name] = QuantTensor(c.chosen.type, quantize_tensor(f, c.chosen.type),
                                          g.tensors[c.name].shape)
        write_with_tensors(out, g, written, extra, progress)
    return KeptFile(out, choices, base_bytes, within)


def write_with_tensors(out: str | os.PathLike, g: GGUFFile,
                       written: dict[str, QuantTensor | np.ndarray],
                       extra: dict[str, Any] | None = None, progress: bool = False) -> Path:
    """The base `g` with the tensors in `written` replaced (raw bytes of the base's own type, or
    `QuantTensor`s), atomically: every other tensor the base's own bytes (raw blocks), every
    metadata key the base's (general.file_type included; not its `RUN_DATA`) plus `extra`."""
    from toymlx.backend import atomic

    out = Path(out)
    tensors: dict[str, QuantTensor] = {}
    for name, info in g.tensors.items():
        t = written.get(name)
        if t is None:
            t = g.raw(name)
        tensors[name] = t if isinstance(t, QuantTensor) else QuantTensor(info.type, t,
                                                                         info.shape)
    # the base's run record (`RUN_DATA`) is of other weights: `extra` records this file's
    drop = {"general.alignment", DIGEST_KEY} | {k for k in g.metadata if k.startswith(RUN_DATA)}
    meta = {k: v for k, v in g.metadata.items() if k not in drop}
    types = {k: t for k, t in g.metadata_types.items() if k not in drop}
    meta.update(extra or {})
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale(out)
    try:
        write_gguf(out, meta, tensors, types=types, digest=False,
                   progress=f"writing {out.name}" if progress else None)
    except OSError as e:
        raise OSError(f"{out}: could not write the fused model ({e}); nothing was written "
                      "under this name") from e
    return out
