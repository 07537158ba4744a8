"""A GGUF file as an editable document: parsed from a valid seed, serialised with any field
overridden (counts, types, dims, offsets, padding) whether or not the result is valid.

This parser reads seeds only, which are valid files; toymlx's own reader is what is tested.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value types (spec numbering).
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
       U64: "<Q", I64: "<q", F64: "<d"}


@dataclass
class KV:
    key: bytes
    vtype: int
    payload: bytes  # encoded value, after the type tag


@dataclass
class TI:
    name: bytes
    dims: list[int]  # GGML ne order
    ttype: int
    offset: int
    n_dims: int | None = None  # override of len(dims)


@dataclass
class Doc:
    version: int
    kvs: list[KV]
    tis: list[TI]
    data: bytes
    align: int = 32  # padding used between header and data on serialisation
    n_tensors: int | None = None
    n_kv: int | None = None
    trailer: bytes = b""

    def serialise(self) -> bytes:
        """The file's bytes, with every override applied."""
        out = [b"GGUF", struct.pack("<IQQ", self.version & 0xFFFFFFFF,
                                     len(self.tis) if self.n_tensors is None else self.n_tensors,
                                     len(self.kvs) if self.n_kv is None else self.n_kv)]
        for kv in self.kvs:
            out += [struct.pack("<Q", len(kv.key)), kv.key, struct.pack("<I", kv.vtype),
                    kv.payload]
        for t in self.tis:
            nd = len(t.dims) if t.n_dims is None else t.n_dims
            out += [struct.pack("<Q", len(t.name)), t.name, struct.pack("<I", nd & 0xFFFFFFFF)]
            out += [struct.pack("<Q", d & (2**64 - 1)) for d in t.dims]
            out += [struct.pack("<IQ", t.ttype & 0xFFFFFFFF, t.offset & (2**64 - 1))]
        head = b"".join(out)
        pad = b"\0" * (-len(head) % self.align) if self.align > 0 else b""
        return head + pad + self.data + self.trailer

    def find(self, key: str) -> int | None:
        """The index of metadata `key`, or None."""
        k = key.encode()
        return next((i for i, kv in enumerate(self.kvs) if kv.key == k), None)


def parse_doc(buf: bytes) -> Doc:
    """Parse a *valid* GGUF into a Doc (seeds only; the library's reader is what is tested)."""
    pos = 0

    def take(n):
        nonlocal pos
        out = buf[pos:pos + n]
        if len(out) != n:
            raise ValueError("seed truncated")
        pos += n
        return out

    def u32():
        return struct.unpack("<I", take(4))[0]

    def u64():
        return struct.unpack("<Q", take(8))[0]

    def skip_value(vt):
        if vt in FMT:
            take(struct.calcsize(FMT[vt]))
        elif vt == STR:
            take(u64())
        elif vt == ARR:
            et, n = u32(), u64()
            if et == STR:
                for _ in range(n):
                    take(u64())
            else:
                take(struct.calcsize(FMT[et]) * n)
        else:
            raise ValueError(f"seed value type {vt}")

    if take(4) != b"GGUF":
        raise ValueError("seed is not a GGUF file")
    version, n_t, n_kv = u32(), u64(), u64()
    kvs, align = [], 32
    for _ in range(n_kv):
        key = take(u64())
        vt = u32()
        start = pos
        skip_value(vt)
        kvs.append(KV(key, vt, buf[start:pos]))
        if key == b"general.alignment":
            align = struct.unpack(FMT[vt], buf[start:pos])[0]
    tis = []
    for _ in range(n_t):
        name = take(u64())
        nd = u32()
        dims = [u64() for _ in range(nd)]
        tt, off = u32(), u64()
        tis.append(TI(name, dims, tt, off))
    data_start = -(-pos // align) * align
    return Doc(version, kvs, tis, buf[data_start:], align)


def enc_str(s: bytes | str) -> bytes:
    """A GGUF string: u64 length, then the bytes."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_scalar(vt: int, v) -> bytes:
    """`v` as GGUF value type `vt`, wrapped (integers) or saturated (floats) to fit."""
    fmt = FMT[vt]
    if fmt[-1] in "fd":
        try:
            return struct.pack(fmt, float(v))
        except OverflowError:  # beyond float32: the nearest float32 is inf
            return struct.pack(fmt, float("inf") if v > 0 else float("-inf"))
    bits = struct.calcsize(fmt) * 8
    v = int(v) & ((1 << bits) - 1)
    if fmt[-1].islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return struct.pack(fmt, v)


def enc_array(et: int, values, n: int | None = None) -> bytes:
    """A GGUF array payload of element type `et`, claiming `n` elements (default: as many as
    there are)."""
    n = len(values) if n is None else n
    head = struct.pack("<IQ", et & 0xFFFFFFFF, n & (2**64 - 1))
    if et == STR:
        return head + b"".join(enc_str(v) for v in values)
    if et in FMT:
        return head + b"".join(enc_scalar(et, v) for v in values)
    return head


def tensor_nbytes(t: TI) -> int | None:
    """Bytes of `t`'s data as its type and dims say (None for an unknown type)."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ttype)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in t.dims:
        n *= d
    return n // block * size


def relayout(doc: Doc, align: int) -> None:
    """Re-place every tensor's bytes at offsets aligned to `align` (a valid re-alignment)."""
    blobs = []
    for t in doc.tis:
        nb = tensor_nbytes(t) or 0
        blobs.append(doc.data[t.offset:t.offset + nb])
    data, off = bytearray(), 0
    for t, b in zip(doc.tis, blobs):
        t.offset = off
        data += b + b"\0" * (-len(b) % align)
        off = len(data)
    doc.data, doc.align = bytes(data), align


