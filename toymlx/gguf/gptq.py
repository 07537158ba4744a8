"""Rounding that knows the data: a fused weight written in the base's own type (its size, byte
for byte) so that its outputs, not its weights, match the fused float model's (GPTQ, Frantar et
al. 2023, on llama.cpp's 32-value block types).

For a layer with inputs x (rows of X) and fused float weights F, the output error of written
weights Q is tr((Q - F) H (Q - F)^T) with H = X^T X. Columns are rounded left to right; each
column's rounding error is pushed onto the columns not yet rounded, weighted by H's inverse
(its upper Cholesky factor U): W[:, j+1:] -= (w_j - q_j) / U[j, j] * U[j, j+1:]. The block's
grid (its fp16 scale, and Q4_1's fp16 minimum) is fixed from the updated weights when the
rounding reaches the block, as llama.cpp's reference encoder fixes it from the block's values;
the levels are then packed into the type's blocks here (`pack`), which llama.cpp and gguf-py
decode. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (`GPTQ_TYPES`; llama.cpp's Q4_K_M writes rows that
are no multiple of 256, such as SmolLM2's 576, in Q5_0).
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

T = GGMLQuantizationType
GPTQ_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
_TOP = {T.Q4_0: 15, T.Q4_1: 15, T.Q5_0: 31, T.Q5_1: 31}
"""The highest level of each unsigned type (Q8_0's levels are -127..127)."""
BLOCK = 32
DAMP = 0.01
"""H's diagonal is raised by this share of its mean (GPTQ's dampening), so H inverts."""


def _grid(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a (n_out, 32) block: (scale d, offset m) as stored (fp16) by llama.cpp's
    reference encoder; a value is level * d + m."""
    if qtype == T.Q8_0:
        d = np.abs(w).max(axis=1) / 127.0
        return d.astype(np.float16).astype(np.float64), np.zeros(len(w))
    half = (_TOP[qtype] + 1) // 2
    if qtype in (T.Q4_0, T.Q5_0):  # symmetric: the largest magnitude, signed, at level 0
        idx = np.abs(w).argmax(axis=1)
        d = w[np.arange(len(w)), idx] / -half
        d = d.astype(np.float16).astype(np.float64)
        return d, -half * d
    lo, hi = w.min(axis=1), w.max(axis=1)
    d = ((hi - lo) / _TOP[qtype]).astype(np.float16).astype(np.float64)
    return d, lo.astype(np.float16).astype(np.float64)


def _levels(x: np.ndarray, d: np.ndarray, m: np.ndarray, qtype: GGMLQuantizationType
            ) -> np.ndarray:
    """The nearest level of each value on its row's grid."""
    safe = np.where(d == 0, 1.0, d)
    lv = np.rint((x - m) / safe)
    if qtype == T.Q8_0:  # int8 levels -127..127 around 0 (m = 0)
        return np.where(d == 0, 0, np.clip(lv, -127, 127))
    zero = (_TOP[qtype] + 1) // 2 if qtype in (T.Q4_0, T.Q5_0) else 0  # the level of 0.0
    return np.where(d == 0, zero, np.clip(lv, 0, _TOP[qtype]))


def pack(levels: np.ndarray, d: np.ndarray, m: np.ndarray, qtype: GGMLQuantizationType
         ) -> np.ndarray:
    """Blocks of `qtype` (raw bytes) from levels (n_out, n_in) and each block's d and m
    (n_out, n_in / 32)."""
    n_out, n_in = levels.shape
    nb = n_in // BLOCK
    lv = levels.reshape(n_out * nb, BLOCK)
    dh = d.reshape(-1).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == T.Q8_0:
        qs = lv.astype(np.int8).view(np.uint8)
        return np.concatenate([dh, qs], axis=1).reshape(-1)
    q = lv.astype(np.uint8)
    qs = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    parts = [dh]
    if qtype in (T.Q4_1, T.Q5_1):
        parts.append(m.reshape(-1).astype(np.float16).view(np.uint8).reshape(-1, 2))
    if qtype in (T.Q5_0, T.Q5_1):  # the fifth bits: element j's in bit j of a uint32
        bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)
        parts.append(bits.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8)
                     .reshape(-1, 4))
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(-1)


def gptq_quantize(f: np.ndarray, h: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The fused float weights `f` (n_out, n_in) as `qtype` blocks (raw bytes) rounded to keep
    the outputs on inputs whose second moment is `h` (n_in, n_in)."""
    if qtype not in GPTQ_TYPES:
        raise ValueError(f"tensor type {qtype.name}: expected one of "
                         f"{', '.join(t.name for t in GPTQ_TYPES)} for data-aware rounding")
    w = np.array(f, np.float64)
    n_out, n_in = w.shape
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(n_in)] += DAMP * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    levels = np.zeros((n_out, n_in))
    ds, ms = np.zeros((n_out, n_in // BLOCK)), np.zeros((n_out, n_in // BLOCK))
    for b, b0 in enumerate(range(0, n_in, BLOCK)):
        b1 = b0 + BLOCK
        d, m = _grid(w[:, b0:b1], qtype)
        ds[:, b], ms[:, b] = d, m
        err = np.zeros((n_out, BLOCK))
        for j in range(b0, b1):
            lv = _levels(w[:, j], d, m, qtype)
            levels[:, j] = lv
            e = (w[:, j] - (lv * d + m)) / u[j, j]
            w[:, j + 1:b1] -= np.outer(e, u[j, j + 1:b1])
            err[:, j - b0] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return pack(levels, ds, ms, qtype)
