"""GGUF's Q4_0, Q4_1, Q8_0 and Q4_K blocks as MLX's affine quantization, exactly.

MLX's quantized layers (`nn.QuantizedLinear`: packed uint32 weights, per-group scales and
biases, group size 32) hold these GGUF types bit for bit: the fast path on a GPU (MLX's
quantized matmul). Q4_K's 32-value sub-blocks become MLX groups with float32 scales d*sc and
biases -dmin*m (6 bits a value against the file's 4.5). Every other quantized type is held as
its own blocks (`toymlx.gguf.blocks`) or dequantized by gguf-py (`GGUFFile.load`).
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

from toymlx.gguf.blocks import k_scales_mins
from toymlx.gguf.reader import GGUFError, GGUFFile, check_finite

GROUP_SIZE = 32
"""GGUF's Q4_0/Q4_1/Q8_0 block size (Q4_K's sub-block), which MLX's affine groups reproduce."""
EXACT_QUANTS = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                GGMLQuantizationType.Q4_K)
"""The GGUF types MLX's quantized layers hold exactly."""


def projection_types(g: GGUFFile) -> dict[str, str]:
    """GGML type name of every 2-D block projection in a llama GGUF, by tensor name."""
    return {n: t.type.name for n, t in g.tensors.items()
            if n.startswith("blk.") and len(t.shape) == 2}


def gguf_to_mlx_quant(g: GGUFFile, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(packed uint32, scales, biases, bits) of a Q4_0/Q4_1/Q8_0/Q4_K tensor: exact MLX affine
    form.

    GGUF blocks of 32 values become MLX groups of 32: Q8_0 `d*q` (q int8) is `d*(q+128) - 128d`,
    Q4_0 `d*(q-8)` is `d*q - 8d`, Q4_1 `d*q + m`. Each block's 4-bit nibbles hold value j in
    the low and j+16 in the high half of byte j; MLX packs value i of a word at bit bits*i.
    """
    info = g.tensors[name]
    n_out, n_in = info.shape
    raw = g.raw(name)
    nb = n_in // GROUP_SIZE
    T = GGMLQuantizationType
    if info.type == T.Q8_0:
        blk = raw.reshape(n_out, nb, 34)
        d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, nb)
        q = blk[..., 2:].copy().view(np.int8).astype(np.int32) + 128  # (out, nb, 32)
        bits, bias = 8, -128.0 * d
    elif info.type in (T.Q4_0, T.Q4_1):
        size = 18 if info.type == T.Q4_0 else 20
        blk = raw.reshape(n_out, nb, size)
        d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, nb)
        qs = blk[..., size - 16:]  # (out, nb, 16)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int32)  # (out, nb, 32)
        bits = 4
        bias = (-8.0 * d if info.type == T.Q4_0
                else blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    elif info.type == T.Q4_K:  # 8 sub-blocks of 32 a 256-value block; nibble h of 32-byte row a
        blk = raw.reshape(n_out, n_in // 256, 144)
        d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)  # (out, nb, 1)
        dmin = blk[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = k_scales_mins(blk[..., 4:16])  # (out, nb, 8) each, sub-block a*2 + h
        qs = blk[..., 16:144].reshape(n_out, n_in // 256, 4, 1, 32)
        q = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0xF).astype(np.int32)
        bits = 4
        d = (d * sc.astype(np.float32)).reshape(n_out, -1)  # (out, n_in / 32)
        bias = -(dmin * mn.astype(np.float32)).reshape(n_out, -1)
    else:
        raise GGUFError(f"{g.path}: tensor {name!r} type: expected Q4_0, Q4_1, Q8_0 or Q4_K to "
                        f"keep as MLX's quantized layer, found {info.type.name}")
    check_finite(g.path, name, d, "block scales")
    check_finite(g.path, name, bias, "block minimums" if info.type != T.Q8_0 else "block scales")
    per = 32 // bits
    q = q.astype(np.uint32).reshape(n_out, n_in // per, per)  # (out, in/per, per)
    packed = np.zeros((n_out, n_in // per), np.uint32)
    for i in range(per):
        packed |= q[..., i] << np.uint32(bits * i)
    return packed, d, bias.astype(np.float32), bits
