"""The one GGUF writer: typed metadata, aligned tensor data, written atomically.

A file is written through `toymlx.backend.atomic` (a temporary in the same folder, fsynced, renamed
over the target), so a crash at any instant leaves either the old file or the complete new one.
Every file carries `toy.tensor_sha256`, the SHA-256 of its tensor data section (the bytes from
the aligned data start to the end of the file), so a damaged checkpoint is found on resume.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from toymlx.backend.atomic import atomic_open, room_for
from toymlx.gguf.reader import (
    ARRAY,
    BOOL,
    DEFAULT_ALIGNMENT,
    DIGEST_KEY,
    FLOAT32,
    FLOAT64,
    INT32,
    INT64,
    SCALAR_DTYPES,
    STRING,
    UINT32,
    UINT64,
)

# Keys whose GGUF type llama.cpp checks and that Python values cannot express on their own,
# and a fused file's --data.val-fraction (`toymlx.gguf.fuse.RUN_DATA`), read back exactly as
# the run split its examples by (a float32 0.1 is 0.10000000149).
KNOWN_TYPES: dict[str, tuple[int, int | None]] = {
    "toy.run_data.data.val_fraction": (FLOAT64, None),
    "tokenizer.ggml.token_type": (ARRAY, INT32),
    "tokenizer.ggml.scores": (ARRAY, FLOAT32),
    "tokenizer.ggml.merges": (ARRAY, STRING),
    "tokenizer.ggml.tokens": (ARRAY, STRING),
}
_NP_TYPES = {np.dtype("float32"): GGMLQuantizationType.F32,
             np.dtype("float16"): GGMLQuantizationType.F16,
             np.dtype("int8"): GGMLQuantizationType.I8,
             np.dtype("int16"): GGMLQuantizationType.I16,
             np.dtype("int32"): GGMLQuantizationType.I32}


@dataclass(frozen=True)
class QuantTensor:
    """Already-encoded tensor bytes (e.g. Q8_0 from gguf.quants.quantize) with its numpy shape."""

    type: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Deferred:
    """A tensor `write_gguf` makes (`make()`: an array or a `QuantTensor`) when it writes it, so
    that a file's tensors are not all held at once; its GGUF type and numpy shape, known
    before (`encoded_type`)."""

    type: GGMLQuantizationType
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray | QuantTensor]


def encoded_type(shape: tuple[int, ...], dtype: str) -> GGMLQuantizationType:
    """The GGUF type `encode_tensor` writes a float32 tensor of `shape` in as `dtype`."""
    if len(shape) < 2 or dtype == "f32":
        return GGMLQuantizationType.F32
    return GGMLQuantizationType[dtype.upper()]


SAVE_DTYPES = ("f32", "f16", "bf16", "q8_0")
"""Tensor types toymlx writes a checkpoint's matrices in (1-D tensors, the norms, stay F32)."""
GGUF_PY_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
"""Tensor types `encode_tensor` writes (gguf-py's own encoders for the quantized ones); every
other export type is llama.cpp's quantizer's (`toymlx.gguf.quantize`)."""
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
"""general.file_type (llama_ftype) for each: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_BF16."""


def encode_tensor(name: str, w: np.ndarray, dtype: str) -> np.ndarray | QuantTensor:
    """A float32 tensor in GGUF tensor type `dtype` (one of GGUF_PY_TYPES); 1-D tensors (norms)
    always stay F32. bf16 rounds to nearest even, as llama.cpp's converter does."""
    if dtype not in GGUF_PY_TYPES:
        raise ValueError(f"tensor type: expected one of {', '.join(GGUF_PY_TYPES)}, found "
                         f"{dtype!r}")
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim < 2 or dtype == "f32":
        return w
    if dtype == "f16":
        return w.astype(np.float16)
    if dtype == "bf16":
        u = w.view(np.uint32)
        rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        nan = np.isnan(w)
        if nan.any():  # keep NaN a NaN (rounding could carry it into the infinities)
            rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return QuantTensor(GGMLQuantizationType.BF16, rounded, tuple(w.shape))
    from gguf.quants import quantize  # only for quantized exports

    qtype = GGMLQuantizationType[dtype.upper()]
    block = GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        raise ValueError(f"--dtype {dtype}: tensor {name!r}: expected rows a multiple of "
                         f"{block} values, found shape {w.shape}; use --dtype f16 or f32")
    return QuantTensor(qtype, quantize(w, qtype), tuple(w.shape))


def _infer_type(key: str, value: Any) -> tuple[int, int | None]:
    if key in KNOWN_TYPES:
        return KNOWN_TYPES[key]
    if isinstance(value, bool):
        return BOOL, None
    if isinstance(value, (int, np.integer)):
        if 0 <= value < 2**32:
            return UINT32, None
        return (UINT64 if value >= 0 else (INT32 if value >= -(2**31) else INT64)), None
    if isinstance(value, (float, np.floating)):
        return FLOAT32, None
    if isinstance(value, str):
        return STRING, None
    if isinstance(value, (list, tuple)):
        if not value:
            return ARRAY, UINT32
        if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
            lo, hi = min(value), max(value)
            if lo >= 0:
                return ARRAY, (UINT32 if hi < 2**32 else UINT64)
            return ARRAY, (INT32 if lo >= -(2**31) and hi < 2**31 else INT64)
        et, _ = _infer_type("", value[0])
        return ARRAY, et
    raise TypeError(f"GGUF metadata {key!r}: expected str, bool, int, float or list, "
                    f"found {type(value).__name__}")


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(vtype: int, etype: int | None, value: Any) -> bytes:
    if vtype == STRING:
        return _pack_string(value)
    if vtype == ARRAY:
        head = struct.pack("<IQ", etype, len(value))
        if etype == STRING:
            return head + b"".join(_pack_string(s) for s in value)
        return head + np.asarray(value, dtype=SCALAR_DTYPES[etype]).tobytes()
    return np.asarray(value, dtype=SCALAR_DTYPES[vtype]).tobytes()


def _pad(f: BinaryIO, align: int) -> None:
    f.write(b"\0" * (-f.tell() % align))


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any],
               tensors: dict[str, np.ndarray | QuantTensor | Deferred],
               types: dict[str, tuple[int, int | None]] | None = None,
               alignment: int = DEFAULT_ALIGNMENT, digest: bool = True,
               progress: str | None = None) -> Path:
    """Write a GGUF v3 file atomically; `types` overrides inferred metadata value types.
    digest=False leaves out `toy.tensor_sha256` (for a file another tool rewrites); `progress`
    names a progress bar (on stderr) over the tensor data written. A `Deferred` tensor is made
    as it is written and dropped after, so that one at a time is held; the digest is hashed as
    the data is written and put in its place in the header at the end."""
    path = Path(path)
    types = dict(types or {})
    infos, blobs, offset = [], [], 0
    for name, t in tensors.items():
        if isinstance(t, Deferred):
            qtype, shape, data = t.type, tuple(t.shape), t
        else:
            qtype, shape, data = _typed(name, t)
        block, tsize = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * tsize
        if not isinstance(data, Deferred) and data.nbytes != nbytes:
            raise ValueError(f"GGUF tensor {name!r}: expected {nbytes} bytes for {qtype.name} "
                             f"{shape}, found {data.nbytes}")
        ne = list(reversed(shape))
        infos.append(_pack_string(name) + struct.pack("<I", len(ne))
                     + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", qtype, offset))
        blobs.append((name, qtype, shape, nbytes, data))
        offset += nbytes + (-nbytes % alignment)
    if digest:  # a placeholder of the digest's length, replaced once the data is written
        metadata = {**metadata, DIGEST_KEY: "0" * 64}
    else:
        metadata = {k: v for k, v in metadata.items() if k != DIGEST_KEY}
    kv, digest_at = [], None
    for key, value in metadata.items():
        vt, et = types.get(key) or _infer_type(key, value)
        kv.append(struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vt)
                  + _pack_value(vt, et, value))
        if key == DIGEST_KEY:  # the digest's hex digits end this entry
            digest_at = 24 + sum(len(k) for k in kv) - 64

    path.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    head = 24 + sum(map(len, kv)) + sum(map(len, infos))
    with (room_for(head + (-head % alignment) + offset), atomic_open(path) as f,
          tqdm(total=offset, desc=progress, unit="B", unit_scale=True, disable=progress is None,
               file=sys.stderr) as bar):
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
        f.writelines(kv + infos)
        _pad(f, alignment)
        for name, qtype, shape, nbytes, data in blobs:
            if isinstance(data, Deferred):
                data = _made(name, data, qtype, shape, nbytes)
            pad = b"\0" * (-data.nbytes % alignment)
            f.write(memoryview(data).cast("B"))
            f.write(pad)
            if digest:  # the data section exactly as written, padding included
                sha.update(memoryview(data).cast("B"))
                sha.update(pad)
            bar.update(data.nbytes + len(pad))
            del data
        if digest_at is not None:
            f.seek(digest_at)
            f.write(sha.hexdigest().encode())
    return path


def _typed(name: str, t: np.ndarray | QuantTensor
           ) -> tuple[GGMLQuantizationType, tuple[int, ...], np.ndarray]:
    """(GGUF type, numpy shape, bytes to write) of a tensor given whole."""
    if isinstance(t, QuantTensor):
        return t.type, tuple(t.shape), np.ascontiguousarray(t.data)
    arr = np.ascontiguousarray(t)
    if arr.dtype not in _NP_TYPES:
        raise TypeError(f"GGUF tensor {name!r}: expected float32/float16/int, found {arr.dtype}")
    return _NP_TYPES[arr.dtype], arr.shape, arr


def _made(name: str, d: Deferred, qtype: GGMLQuantizationType, shape: tuple[int, ...],
          nbytes: int) -> np.ndarray:
    """A `Deferred` tensor's bytes, made now; ValueError where they are not what its type and
    shape (written in the header already) promised."""
    made_type, made_shape, data = _typed(name, d.make())
    if (made_type, tuple(made_shape), data.nbytes) != (qtype, shape, nbytes):
        raise ValueError(f"GGUF tensor {name!r}: expected {qtype.name} {shape} ({nbytes} bytes) "
                         f"as declared, found {made_type.name} {tuple(made_shape)} "
                         f"({data.nbytes} bytes)")
    return data
