"""GGUF's quantized blocks kept as they are in the file, and decoded to float32 inside MLX.

A frozen base (LoRA, DoRA, generation, evaluation) holds each quantized tensor as its own
blocks: the file's bytes, split once at load into the arrays a block is made of (its codes,
its float16 scales, its small integer sub-scales), at about the file's size (Q4_K 4.6 bits a
value against the file's 4.5, Q6_K 6.6 against 6.6). Where a weight is used, `decode` turns
those arrays into float32 values with MLX's own integer and float ops, so the decoding is one
traced expression inside the compiled step, on every device, and nothing but the blocks stays
in memory between steps (`toymlx.models.layers.BlockLinear` decodes again in the backward pass
instead of keeping the floats).

Every codec's float32 values equal `gguf.quants.dequantize`'s bit for bit: the same integer
codes and the same float32 products in the same order (tests/test_blocks.py checks each type on
random blocks). Each codec lays its arrays out so that they broadcast to one array whose
row-major order is the block's value order, and the decode is a single elementwise expression.

| type | values a block | what a value is |
| --- | --- | --- |
| Q8_0 | 32 | d * q, q int8 |
| Q4_0, Q5_0 | 32 | d * (q - 8), d * (q - 16): 4 or 5-bit q |
| Q4_1, Q5_1 | 32 | d * q + m |
| Q2_K | 256 | (d * sc) * q - (dmin * m): 2-bit q, sc and m 4-bit a 16-value sub-block |
| Q3_K | 256 | (d * sc) * q: q = 2 low bits - 4 unless the high bit is set, sc 6-bit signed a 16 |
| Q4_K, Q5_K | 256 | (d * sc) * q - (dmin * m): sc and m 6-bit a 32-value sub-block |
| Q6_K | 256 | (d * sc) * (q - 32): 6-bit q, sc int8 a 16-value sub-block |
| IQ4_NL | 32 | d * kvalues[q] (a fixed 16-entry non-linear grid) |
| IQ4_XS | 256 | (d * sc) * kvalues[q]: sc 6-bit signed a 32-value sub-block |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
Parts = dict[str, mx.array]

IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl)."""


@dataclass(frozen=True)
class Codec:
    """One GGUF block type: how its bytes split into arrays, and how those decode."""

    type: GGMLQuantizationType
    split: Callable[[np.ndarray], dict[str, np.ndarray]]
    """(..., n_blocks, type_size) uint8 -> named arrays, each (..., n_blocks, *broadcast dims)."""
    decode: Callable[[Parts], mx.array]
    """those arrays (as MLX arrays) -> float32 (..., n_blocks, *dims) in the block's value order."""
    float16_at: tuple[int, ...]
    """Byte offsets of the block's float16 scales (d, and dmin or m)."""

    @property
    def block_values(self) -> int:
        return GGML_QUANT_SIZES[self.type][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.type][1]


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block: (..., n_blocks)."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]


def _c(values, dtype) -> mx.array:
    """A small constant array (shifts, bit positions, the IQ4 grid)."""
    return mx.array(np.asarray(values, dtype=dtype))


def _lead(raw: np.ndarray) -> tuple[int, ...]:
    return raw.shape[:-1]


def _f32(x: mx.array) -> mx.array:
    return x.astype(mx.float32)


def _factor(x: mx.array) -> mx.array:
    """A block's or sub-block's scale or offset, made on its own: `mx.contiguous` ends the
    fused kernel here, so the per-value kernel reads one small float array instead of
    recomputing it from several broadcast inputs (Q4_K on a CPU: 15x faster decoding)."""
    return mx.contiguous(x)


# ---- 32-value blocks: value k = h * 16 + j, its nibble in the low (h 0) or high (h 1) half of
# byte j; decoded as (..., n, 2, 16)
_NIBBLE = (0, 4)


def _nibbles(qs: mx.array) -> mx.array:
    """(..., 1, 16) bytes -> (..., 2, 16) 4-bit codes (low halves, then high halves)."""
    return (qs >> _c(_NIBBLE, np.uint8).reshape(2, 1)) & 15


def _split_q8_0(raw):
    return {"d": _f16(raw, 0)[..., None], "q": raw[..., 2:34].view(np.int8)}


def _decode_q8_0(p):
    return _factor(_f32(p["d"])) * _f32(p["q"])


def _split_q4(raw, with_min: bool):
    lead = _lead(raw)
    o = 4 if with_min else 2
    out = {"d": _f16(raw, 0).reshape(*lead, 1, 1), "qs": raw[..., o:o + 16].reshape(*lead, 1, 16)}
    if with_min:
        out["m"] = _f16(raw, 2).reshape(*lead, 1, 1)
    return out


def _decode_q4_0(p):
    return _factor(_f32(p["d"])) * (_f32(_nibbles(p["qs"])) - 8.0)


def _decode_q4_1(p):
    return _factor(_f32(p["d"])) * _f32(_nibbles(p["qs"])) + _factor(_f32(p["m"]))


_BIT32 = np.arange(32, dtype=np.uint32).reshape(2, 16)  # value k's high bit: bit k of qh


def _split_q5(raw, with_min: bool):
    lead = _lead(raw)
    o = 4 if with_min else 2
    out = {"d": _f16(raw, 0).reshape(*lead, 1, 1),
           "qh": np.ascontiguousarray(raw[..., o:o + 4]).view(np.uint32).reshape(*lead, 1, 1),
           "qs": raw[..., o + 4:o + 20].reshape(*lead, 1, 16)}
    if with_min:
        out["m"] = _f16(raw, 2).reshape(*lead, 1, 1)
    return out


def _q5_codes(p) -> mx.array:
    high = (p["qh"] >> _c(_BIT32, np.uint32)) & 1  # (..., 2, 16)
    return _f32(_nibbles(p["qs"])) + 16.0 * _f32(high)


def _decode_q5_0(p):
    return _factor(_f32(p["d"])) * (_q5_codes(p) - 16.0)


def _decode_q5_1(p):
    return _factor(_f32(p["d"])) * _q5_codes(p) + _factor(_f32(p["m"]))


def _decode_iq4_nl(p):
    return _factor(_f32(p["d"])) * mx.take(_c(IQ4_GRID, np.float32), _nibbles(p["qs"]))


# ---- 256-value super-blocks (the K-quants and IQ4_XS)
def k_scales_mins(s12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> (..., 8) uint8 each: sub-block
    i < 4 from the low 6 bits of bytes i and i+4; i >= 4 from byte i+4's nibbles and the top 2
    bits of bytes i-4 and i."""
    d, m, md = s12[..., 0:4], s12[..., 4:8], s12[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _split_q2_k(raw):
    # value v = a*128 + s*32 + j (a: half, s: 2-bit shift, j = jj*16 + jl: byte a*32 + j);
    # its 16-value sub-block a*8 + s*2 + jj. Decoded as (..., n, 2, 4, 2, 16).
    lead = _lead(raw)
    return {"sc": raw[..., 0:16].reshape(*lead, 2, 4, 2, 1),
            "qs": raw[..., 16:80].reshape(*lead, 2, 1, 2, 16),
            "d": _f16(raw, 80).reshape(*lead, 1, 1, 1, 1),
            "dmin": _f16(raw, 82).reshape(*lead, 1, 1, 1, 1)}


_SHIFT2 = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1, 1)


def _decode_q2_k(p):
    q = _f32((p["qs"] >> _c(_SHIFT2, np.uint8)) & 3)
    dl = _factor(_f32(p["d"]) * _f32(p["sc"] & 15))
    ml = _factor(_f32(p["dmin"]) * _f32(p["sc"] >> 4))
    return dl * q - ml


def _q3_k_scales(s12: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 signed 6-bit sub-block scales (..., 16) int8: low nibbles of
    bytes 0-7 then their high nibbles, each with 2 high bits from bytes 8-11."""
    low = np.concatenate([s12[..., 0:8] & 0x0F, s12[..., 0:8] >> 4], axis=-1)  # (..., 16)
    high = np.concatenate([(s12[..., 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def _split_q3_k(raw):
    # as Q2_K's layout; the high bit of value a*128 + s*32 + j is bit a*4 + s of hmask byte j
    lead = _lead(raw)
    return {"hmask": raw[..., 0:32].reshape(*lead, 1, 1, 2, 16),
            "qs": raw[..., 32:96].reshape(*lead, 2, 1, 2, 16),
            "sc": _q3_k_scales(raw[..., 96:108]).reshape(*lead, 2, 4, 2, 1),
            "d": _f16(raw, 108).reshape(*lead, 1, 1, 1, 1)}


_BIT8 = np.arange(8, dtype=np.uint8).reshape(2, 4, 1, 1)


def _decode_q3_k(p):
    low = _f32((p["qs"] >> _c(_SHIFT2, np.uint8)) & 3)
    high = _f32((p["hmask"] >> _c(_BIT8, np.uint8)) & 1)
    q = low + 4.0 * high - 4.0  # the high bit set means no offset
    return _factor(_f32(p["d"]) * _f32(p["sc"])) * q


def _split_q45_k(raw, five: bool):
    # value v = a*64 + h*32 + j (a: 32-byte group, h: nibble): sub-block a*2 + h.
    # Decoded as (..., n, 4, 2, 32). Q5_K's high bit of value (a*2+h, j): bit a*2+h of qh byte j.
    lead = _lead(raw)
    sc, mn = k_scales_mins(raw[..., 4:16])
    out = {"d": _f16(raw, 0).reshape(*lead, 1, 1, 1), "dmin": _f16(raw, 2).reshape(*lead, 1, 1, 1),
           "sc": sc.reshape(*lead, 4, 2, 1), "m": mn.reshape(*lead, 4, 2, 1)}
    o = 16
    if five:
        out["qh"] = raw[..., 16:48].reshape(*lead, 1, 1, 32)
        o = 48
    out["qs"] = raw[..., o:o + 128].reshape(*lead, 4, 1, 32)
    return out


_NIBBLE_K = np.array(_NIBBLE, np.uint8).reshape(2, 1)
_BIT8_K = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)


def _decode_q4_k(p, codes=None):
    q = _f32((p["qs"] >> _c(_NIBBLE_K, np.uint8)) & 15) if codes is None else codes
    return _factor(_f32(p["d"]) * _f32(p["sc"])) * q - _factor(_f32(p["dmin"]) * _f32(p["m"]))


def _decode_q5_k(p):
    low = _f32((p["qs"] >> _c(_NIBBLE_K, np.uint8)) & 15)
    high = _f32((p["qh"] >> _c(_BIT8_K, np.uint8)) & 1)
    return _decode_q4_k(p, low + 16.0 * high)


def _split_q6_k(raw):
    # value v = a*128 + h*64 + jj*32 + jh*16 + jl: low 4 bits in nibble h of ql byte
    # a*64 + jj*32 + jh*16 + jl, high 2 bits at shift 2*(h*2 + jj) of qh byte a*32 + jh*16 + jl;
    # its 16-value sub-block a*8 + h*4 + jj*2 + jh. Decoded as (..., n, 2, 2, 2, 2, 16).
    lead = _lead(raw)
    return {"ql": raw[..., 0:128].reshape(*lead, 2, 1, 2, 2, 16),
            "qh": raw[..., 128:192].reshape(*lead, 2, 1, 1, 2, 16),
            "sc": raw[..., 192:208].view(np.int8).reshape(*lead, 2, 2, 2, 2, 1),
            "d": _f16(raw, 208).reshape(*lead, 1, 1, 1, 1, 1)}


_NIBBLE_6 = np.array(_NIBBLE, np.uint8).reshape(2, 1, 1, 1)
_SHIFT_6 = np.array([[0, 2], [4, 6]], np.uint8).reshape(2, 2, 1, 1)


def _decode_q6_k(p):
    low = (p["ql"] >> _c(_NIBBLE_6, np.uint8)) & 15
    high = (p["qh"] >> _c(_SHIFT_6, np.uint8)) & 3
    q = low | (high << 4)  # the 6-bit code as a byte: one conversion to float a value, not two
    return _factor(_f32(p["d"]) * _f32(p["sc"])) * (_f32(q) - 32.0)


def _split_iq4_xs(raw):
    # value v = a*32 + h*16 + j (a: sub-block, nibble h of qs byte a*16 + j)
    lead = _lead(raw)
    sh = np.ascontiguousarray(raw[..., 2:4]).view(np.uint16)  # (..., n, 1)
    sl = raw[..., 4:8]
    low = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(*lead, 8)  # sub-block 2i, 2i+1
    high = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)  # (..., n, 8)
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    return {"d": _f16(raw, 0).reshape(*lead, 1, 1, 1), "sc": sc.reshape(*lead, 8, 1, 1),
            "qs": raw[..., 8:136].reshape(*lead, 8, 1, 16)}


def _decode_iq4_xs(p):
    grid = mx.take(_c(IQ4_GRID, np.float32), _nibbles(p["qs"]))  # (..., 8, 2, 16)
    return _factor(_f32(p["d"]) * _f32(p["sc"])) * grid


CODECS: dict[GGMLQuantizationType, Codec] = {c.type: c for c in (
    Codec(T.Q8_0, _split_q8_0, _decode_q8_0, (0,)),
    Codec(T.Q4_0, lambda r: _split_q4(r, False), _decode_q4_0, (0,)),
    Codec(T.Q4_1, lambda r: _split_q4(r, True), _decode_q4_1, (0, 2)),
    Codec(T.Q5_0, lambda r: _split_q5(r, False), _decode_q5_0, (0,)),
    Codec(T.Q5_1, lambda r: _split_q5(r, True), _decode_q5_1, (0, 2)),
    Codec(T.Q2_K, _split_q2_k, _decode_q2_k, (80, 82)),
    Codec(T.Q3_K, _split_q3_k, _decode_q3_k, (108,)),
    Codec(T.Q4_K, lambda r: _split_q45_k(r, False), _decode_q4_k, (0, 2)),
    Codec(T.Q5_K, lambda r: _split_q45_k(r, True), _decode_q5_k, (0, 2)),
    Codec(T.Q6_K, _split_q6_k, _decode_q6_k, (208,)),
    Codec(T.IQ4_NL, lambda r: _split_q4(r, False), _decode_iq4_nl, (0,)),
    Codec(T.IQ4_XS, _split_iq4_xs, _decode_iq4_xs, (0,)),
)}
"""Every GGUF type a frozen base keeps as blocks; any other is dequantized at load."""


def split_rows(codec: Codec, raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A tensor's raw bytes (as `GGUFFile.raw`) of numpy `shape` (rows, n_in) -> its codec's
    arrays, each led by (rows, n_in / block_values), contiguous."""
    rows, n_in = int(np.prod(shape[:-1])), shape[-1]
    blocks = np.asarray(raw, np.uint8).reshape(rows, n_in // codec.block_values, codec.block_bytes)
    return {k: np.ascontiguousarray(v) for k, v in codec.split(blocks).items()}


def decode_rows(codec: Codec, parts: Parts, lead: tuple[int, ...]) -> mx.array:
    """float32 (*lead, n_in) from arrays led by (*lead, n_blocks) (`split_rows`' arrays, or
    rows of them taken by token)."""
    return codec.decode(parts).reshape(*lead, -1)


def random_blocks(codec: Codec, rows: int, n_blocks: int, seed: int = 0) -> np.ndarray:
    """(rows, n_blocks, block_bytes) random bytes for every code and sub-scale, with finite
    float16 scales in N(0, 1): blocks to test or time a codec on."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, n_blocks, codec.block_bytes), dtype=np.uint8)
    for o in codec.float16_at:
        d = rng.standard_normal((rows, n_blocks)).astype(np.float16)
        raw[..., o:o + 2] = d[..., None].view(np.uint8)
    return raw


def held_bytes(codec: Codec, shape: tuple[int, ...]) -> int:
    """Bytes the split arrays of a tensor of `shape` take (for memory estimates)."""
    probe = np.zeros((1, 1, codec.block_bytes), np.uint8)
    per_block = sum(v.nbytes for v in codec.split(probe).values())
    return int(np.prod(shape)) // codec.block_values * per_block
