"""Fuzz every GGUF reader path of toymlx with mutated real files.

    python scripts/fuzz_gguf.py --cases 5000              # long run, summary on stdout
    python scripts/fuzz_gguf.py --cases 400 --json out.json
    python scripts/fuzz_gguf.py --replay saved.gguf       # rerun one saved input in-process
    python scripts/fuzz_gguf.py --seed 0 --show-case 17   # rebuild case 17's bytes

Seeds are real files: a checkpoint written by a 2-step `toymlx-train --recipe from-scratch`
run (or, while toymlx.tokenizer is missing, a tiny Llama written by write_llama), the same
model with mixed quantized tensor types, `stories260K.gguf`, and the llama.cpp tokenizer
GGUFs from ../shared/data. Each case applies one to three mutations, structure-aware (header
counts, key/value types and payloads, float64 metadata, tensor dims/types/offsets/names,
alignment, llama and tokenizer hyperparameters) and byte-level (bit flips, interesting
integers, truncation, insertions, splices), then feeds the result to every reader path that
exists. A case passes when each path either loads or raises one ValueError (GGUFError is
one) whose message is a single line naming the file. Anything else -- another exception
type, a multi-line or anonymous message, MemoryError, a hang, or a crash of the process --
is a defect, and its input is saved under --out.

Cases are a pure function of (--seed, case index), so a defect is reproducible from its
number. Cases run in a worker subprocess under a 4 GiB address-space limit; the supervisor
restarts it after a crash or a hang and records the case that was running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOYMLX_SHARED", REPO.parent / "shared")) / "data"

# GGUF value types (spec numbering).
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}
INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 255, 256, 4095, 65535, 65536, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**40, 2**40 + 1, 2**48, 2**62, 2**63 - 1, 2**63,
               2**64 - 1]
PAYLOAD_CAP = 1 << 20  # a structure mutation never writes more than this much real payload


# ---------------------------------------------------------------------------------------------
# A mutable GGUF document: parsed from a valid seed, serialised with any field overridden.
# ---------------------------------------------------------------------------------------------
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
        if vt in _FMT:
            take(struct.calcsize(_FMT[vt]))
        elif vt == STR:
            take(u64())
        elif vt == ARR:
            et, n = u32(), u64()
            if et == STR:
                for _ in range(n):
                    take(u64())
            else:
                take(struct.calcsize(_FMT[et]) * n)
        else:
            raise ValueError(f"seed value type {vt}")

    assert take(4) == b"GGUF"
    version, n_t, n_kv = u32(), u64(), u64()
    kvs, align = [], 32
    for _ in range(n_kv):
        key = take(u64())
        vt = u32()
        start = pos
        skip_value(vt)
        kvs.append(KV(key, vt, buf[start:pos]))
        if key == b"general.alignment":
            align = struct.unpack(_FMT[vt], buf[start:pos])[0]
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
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_scalar(vt: int, v) -> bytes:
    fmt = _FMT[vt]
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
    n = len(values) if n is None else n
    head = struct.pack("<IQ", et & 0xFFFFFFFF, n & (2**64 - 1))
    if et == STR:
        return head + b"".join(enc_str(v) for v in values)
    if et in _FMT:
        return head + b"".join(enc_scalar(et, v) for v in values)
    return head


def tensor_nbytes(t: TI) -> int | None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

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


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------
LLAMA_KEYS = ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
              "llama.attention.head_count_kv", "llama.feed_forward_length",
              "llama.context_length", "llama.attention.key_length",
              "llama.rope.dimension_count", "llama.rope.freq_base",
              "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size",
              "general.architecture", "general.alignment", "general.step",
              "adapter.lora.alpha", "adapter.type", "general.type"]
TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]


def rand_value(r: random.Random) -> tuple[int, bytes]:
    """A random (type, payload), valid or not, of every GGUF value kind."""
    k = r.randrange(14)
    if k < 11:
        vt = [U8, I8, U16, I16, U32, I32, F32, BOOL, U64, I64, F64][k]
        if vt in (F32, F64):
            v = r.choice([0.0, -1.0, 1e-5, 1e38, float("nan"), float("inf"), -float("inf"),
                          1e300, 5e-324, 10000.0])
        else:
            v = r.choice(INTERESTING + [-1, -(2**31), -(2**63), r.randrange(-5, 300)])
        return vt, enc_scalar(vt, v)
    if k == 11:
        return STR, enc_str(r.choice([b"", b"llama", b"gpt2", b"\xff\xfe", b"a" * 300,
                                      "ŝnøw ☃\n".encode(), b"\x00"]))
    if k == 12:  # an array of random element type (possibly nested, unknown or huge)
        et = r.choice([U8, I32, F32, F64, BOOL, STR, ARR, U64, 13, 99, 2**32 - 1])
        n = r.choice([0, 1, 3, 10])
        if et in (F32, F64):
            vals = [r.choice([0.5, -1.0, float("nan")]) for _ in range(n)]
        elif et == STR:
            vals = [r.choice([b"a", b"\xc3", b""]) for _ in range(n)]
        elif et == BOOL:
            vals = [r.choice([0, 1, 2, 255]) for _ in range(n)]
        else:
            vals = [r.choice(INTERESTING[:10] + [-1]) for _ in range(n)]
        if et == ARR:
            return ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", U8, 1) + b"\1"
        claimed = r.choice([None, None, 2**32, 2**62, 2**64 - 1, n + 1])
        return ARR, enc_array(et, vals, claimed)
    return r.choice([13, 14, 255, 2**31, 2**32 - 1]), b"\0" * r.choice([0, 4, 8])


def m_version(doc, r, seeds):
    doc.version = r.choice([0, 1, 2, 4, 0xFFFFFFFF, 3 << 16])
    return f"version={doc.version}"


def m_counts(doc, r, seeds):
    which = r.choice(["n_tensors", "n_kv"])
    real = len(doc.tis) if which == "n_tensors" else len(doc.kvs)
    v = r.choice([0, real + 1, max(real - 1, 0), 2**31, 2**32 - 1, 2**63, 2**64 - 1])
    setattr(doc, which, v)
    return f"{which}={v}"


def m_kv_type_tag(doc, r, seeds):
    if not doc.kvs:
        return "noop"
    kv = r.choice(doc.kvs)
    old = kv.vtype
    kv.vtype = r.choice([U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64, 13,
                         2**32 - 1])
    return f"type tag of {kv.key[:40]!r} {old}->{kv.vtype}"


def m_kv_value(doc, r, seeds):
    if not doc.kvs:
        return "noop"
    kv = r.choice(doc.kvs)
    kv.vtype, kv.payload = rand_value(r)
    return f"value of {kv.key[:40]!r} -> type {kv.vtype} ({len(kv.payload)} bytes)"


def m_float64(doc, r, seeds):
    """float64 metadata: re-type a float32 key (a valid file), or add f64 scalars/arrays."""
    f32 = [kv for kv in doc.kvs if kv.vtype == F32]
    choice = r.randrange(4)
    if choice == 0 and f32:
        kv = r.choice(f32)
        kv.vtype, kv.payload = F64, enc_scalar(F64, struct.unpack("<f", kv.payload)[0])
        return f"{kv.key!r} re-typed float64"
    if choice == 1:
        key = r.choice(["toy.f64", "general.f64_note", "llama.rope.freq_base",
                        "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.scores"])
        i = doc.find(key)
        if key == "tokenizer.ggml.scores" and i is not None:
            raw = doc.kvs[i].payload
            et, n = struct.unpack("<IQ", raw[:12])
            if et == F32:
                vals = struct.unpack(f"<{n}f", raw[12:12 + 4 * n])
                doc.kvs[i] = KV(key.encode(), ARR, enc_array(F64, vals))
                return "tokenizer scores as float64 array"
        kv = KV(key.encode(), F64, enc_scalar(F64, r.choice([1e-5, 10000.0, 1e300, 0.5])))
        if i is None:
            doc.kvs.insert(r.randrange(len(doc.kvs) + 1), kv)
        else:
            doc.kvs[i] = kv
        return f"float64 scalar {key}"
    if choice == 2:
        doc.kvs.insert(r.randrange(len(doc.kvs) + 1),
                       KV(b"toy.f64_array", ARR, enc_array(F64, [0.1 * i for i in range(8)])))
        return "float64 array inserted"
    doc.kvs.append(KV(b"general.f64", F64, enc_scalar(F64, 2.5)))
    return "float64 scalar appended"


def m_key(doc, r, seeds):
    if not doc.kvs:
        return "noop"
    i = r.randrange(len(doc.kvs))
    op = r.randrange(5)
    if op == 0:
        doc.kvs.insert(r.randrange(len(doc.kvs) + 1), KV(doc.kvs[i].key, doc.kvs[i].vtype,
                                                         doc.kvs[i].payload))
        return f"duplicated key {doc.kvs[i].key[:40]!r}"
    if op == 1:
        kv = doc.kvs.pop(i)
        return f"deleted key {kv.key[:40]!r}"
    if op == 2:
        doc.kvs[i].key = r.choice([b"", b"\xff\xfe", b"a\nb", b"x" * 70000, b"\x00key"])
        return "weird key bytes"
    if op == 3:
        r.shuffle(doc.kvs)
        return "shuffled keys"
    doc.kvs[i].payload = doc.kvs[i].payload[: r.randrange(len(doc.kvs[i].payload) + 1)]
    return f"short payload for {doc.kvs[i].key[:40]!r}"


def _set(doc, key, vt, payload):
    i = doc.find(key)
    kv = KV(key.encode(), vt, payload)
    if i is None:
        doc.kvs.append(kv)
    else:
        doc.kvs[i] = kv


def m_llama_key(doc, r, seeds):
    key = r.choice(LLAMA_KEYS)
    op = r.choices(range(4), [50, 15, 20, 15])[0]
    if op == 0:  # right kind, absurd size
        vt = r.choice([U32, U32, I32, U64, I64, U8])
        v = r.choice(INTERESTING + [-1, -8, 5, 6, 9, 12, 48])
        _set(doc, key, vt, enc_scalar(vt, v))
        return f"{key}={v} (type {vt})"
    if op == 1:  # a float, possibly float64, possibly non-finite
        vt = r.choice([F32, F64])
        v = r.choice([0.0, -1e-5, 1e-30, float("nan"), float("inf"), 1e30, 2.5, 10000.0])
        _set(doc, key, vt, enc_scalar(vt, v))
        return f"{key}={v} (type {vt})"
    if op == 2:
        vt, payload = rand_value(r)
        _set(doc, key, vt, payload)
        return f"{key} -> random type {vt}"
    i = doc.find(key)
    if i is not None:
        doc.kvs.pop(i)
    return f"{key} removed"


def _arr(doc, key):
    i = doc.find(key)
    if i is None or doc.kvs[i].vtype != ARR:
        return None, None, None
    raw = doc.kvs[i].payload
    et, n = struct.unpack("<IQ", raw[:12])
    return i, et, n


def _str_items(raw: bytes, n: int) -> list[bytes]:
    out, pos = [], 12
    for _ in range(n):
        ln = struct.unpack("<Q", raw[pos:pos + 8])[0]
        out.append(raw[pos + 8:pos + 8 + ln])
        pos += 8 + ln
    return out


def m_tokenizer_key(doc, r, seeds):
    key = r.choice(TOKENIZER_KEYS)
    op = r.randrange(6)
    i, et, n = _arr(doc, key)
    if op == 0 and i is not None:  # shorter or longer array than the vocabulary
        raw = doc.kvs[i].payload
        if et == STR:
            items = _str_items(raw, n)
            cut = r.choice([0, 1, max(n - 1, 0), n // 2])
            items = items[:cut] if r.random() < 0.7 else items + [b"extra", b"<s>"]
            doc.kvs[i].payload = enc_array(STR, items)
        else:
            size = struct.calcsize(_FMT.get(et, "<B"))
            cut = r.choice([0, 1, max(n - 1, 0), n // 2])
            doc.kvs[i].payload = struct.pack("<IQ", et, cut) + raw[12:12 + cut * size]
        return f"{key} resized"
    if op == 1 and i is not None and et == STR:  # malformed entries
        items = _str_items(doc.kvs[i].payload, n)
        for _ in range(r.randrange(1, 5)):
            if items:
                j = r.randrange(len(items))
                items[j] = r.choice([b"", b"a", b"a b c", b"  ", b"\xff", b"<0xZZ>", b"<0x100>",
                                     items[0], b"\xc4\xa0 \xc4\xa0", b"a" * 5000])
        doc.kvs[i].payload = enc_array(STR, items)
        return f"{key} malformed entries"
    if op == 2 and i is not None and et in (I32, U32, F32):  # out-of-range numbers
        raw = bytearray(doc.kvs[i].payload)
        for _ in range(r.randrange(1, 5)):
            if n:
                j = r.randrange(n)
                v = r.choice([-1, 7, 99, 2**31 - 1, -(2**31)]) if et != F32 else \
                    r.choice([float("nan"), float("inf"), -1e38])
                raw[12 + 4 * j:16 + 4 * j] = enc_scalar(et, v)
        doc.kvs[i].payload = bytes(raw)
        return f"{key} out-of-range entries"
    if op == 3:  # an array of the wrong element type
        vals = r.choice([[1, 2, 3], [0.5], []])
        et2 = r.choice([I32, F32, U8, F64, BOOL])
        _set(doc, key, ARR, enc_array(et2, vals))
        return f"{key} -> array of type {et2}"
    if op == 4:  # scalar ids out of range / wrong type
        vt = r.choice([U32, I32, U64, STR, BOOL, F32])
        v = r.choice([2**32 - 1, -1, 10**6, 2**63, 0])
        payload = enc_str(r.choice([b"llama", b"gpt2", b"bert", b"no_vocab", b"", b"{{ oops",
                                    b"{% for %}", b"\xff"])) if vt == STR else enc_scalar(vt, v)
        _set(doc, key, vt, payload)
        return f"{key} -> type {vt}"
    vt, payload = rand_value(r)
    _set(doc, key, vt, payload)
    return f"{key} -> random type {vt}"


def m_alignment(doc, r, seeds):
    v = r.choice([0, 1, 3, 16, 48, 64, 128, 4096, 1 << 20, 1 << 21, 2**31, 2**32 - 1])
    vt = r.choice([U32, U32, U32, I32, U64, STR, F32, F64, BOOL])
    payload = enc_str(str(v)) if vt == STR else enc_scalar(vt, v)
    _set(doc, "general.alignment", vt, payload)
    if vt in (U32, U64) and v in (1, 16, 64, 128, 4096) and r.random() < 0.7:
        relayout(doc, v)
        return f"alignment {v} (re-laid out)"
    return f"alignment {v} type {vt}"


def m_tensor(doc, r, seeds):
    if not doc.tis:
        return "noop"
    t = r.choice(doc.tis)
    op = r.randrange(9)
    if op == 0:
        t.n_dims = r.choice([0, 5, 8, 2**31, 2**32 - 1, len(t.dims) + 1, max(len(t.dims) - 1, 0)])
        return f"{t.name!r} n_dims={t.n_dims}"
    if op == 1:
        j = r.randrange(len(t.dims))
        t.dims[j] = r.choice(INTERESTING + [t.dims[j] + 1, t.dims[j] * 2, t.dims[j] // 2])
        return f"{t.name!r} dim{j}={t.dims[j]}"
    if op == 2:
        t.dims = list(reversed(t.dims)) if len(t.dims) > 1 else t.dims + [1]
        return f"{t.name!r} dims swapped/extended"
    if op == 3:
        t.ttype = r.choice(list(range(42)) + [2**31, 2**32 - 1])
        return f"{t.name!r} type={t.ttype}"
    if op == 4:
        t.offset = r.choice([1, 31, t.offset + 1, t.offset + 32, len(doc.data), len(doc.data) + 32,
                             2**40, 2**63, 2**64 - 32, 2**64 - 1, 0])
        return f"{t.name!r} offset={t.offset}"
    if op == 5:
        t.name = r.choice([b"", b"\xff", b"blk.99.attn_q.weight", b"token_embd.weight",
                           b"output.weight", b"blk.0.attn_q.weight", t.name + b"x",
                           b"blk.-1.ffn_up.weight", b"n" * 300])
        return f"tensor renamed {t.name[:40]!r}"
    if op == 6:
        doc.tis.remove(t)
        return f"tensor {t.name!r} dropped"
    if op == 7:
        doc.tis.insert(r.randrange(len(doc.tis) + 1), TI(t.name + r.choice([b"", b".x"]),
                                                          list(t.dims), t.ttype, t.offset))
        return f"tensor {t.name!r} duplicated"
    # data full of non-finite floats (a valid file: must load)
    nb = tensor_nbytes(t) or 0
    if nb and t.offset + nb <= len(doc.data):
        fill = r.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\xff\xff"])
        d = bytearray(doc.data)
        d[t.offset:t.offset + nb] = (fill * (nb // 4 + 1))[:nb]
        doc.data = bytes(d)
    return f"{t.name!r} data non-finite"


def m_data_size(doc, r, seeds):
    op = r.randrange(3)
    if op == 0:
        doc.data = doc.data[: r.randrange(len(doc.data) + 1)]
        return "data truncated"
    if op == 1:
        doc.trailer = os.urandom(0) + bytes(r.randrange(256) for _ in range(r.randrange(1, 100)))
        return "garbage appended"
    doc.align = r.choice([1, 8, 16, 64])
    return f"header padded to {doc.align} instead"


STRUCT_OPS = [(m_version, 1), (m_counts, 3), (m_kv_type_tag, 4), (m_kv_value, 5),
              (m_float64, 6), (m_key, 4), (m_llama_key, 14), (m_tokenizer_key, 12),
              (m_alignment, 4), (m_tensor, 12), (m_data_size, 2)]


def header_end(buf: bytes, doc: Doc | None) -> int:
    if doc is None:
        return min(len(buf), 4096)
    return min(len(buf), len(buf) - len(doc.data) - len(doc.trailer))


def b_bitflip(buf, r, hend):
    hend = min(hend, len(buf))
    b = bytearray(buf)
    for _ in range(r.randrange(1, 9)):
        if not b:
            break
        i = r.randrange(hend) if (hend and r.random() < 0.85) else r.randrange(len(b))
        b[i] ^= 1 << r.randrange(8)
    return bytes(b), "bit flips"


def b_interesting(buf, r, hend):
    hend = min(hend, len(buf))
    b = bytearray(buf)
    size = r.choice([1, 4, 8])
    if len(b) <= size:
        return buf, "noop"
    i = r.randrange(min(hend or len(b), len(b) - size))
    v = r.choice(INTERESTING + [-1])
    b[i:i + size] = (v & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    return bytes(b), f"u{size * 8} {v} at {i}"


def b_truncate(buf, r, hend):
    hend = min(hend, len(buf))
    n = r.randrange(hend + 1) if (hend and r.random() < 0.7) else r.randrange(len(buf) + 1)
    return buf[:n], f"truncated to {n}"


def b_chunk(buf, r, hend):
    hend = min(hend, len(buf))
    i = r.randrange(max(hend, 1))
    n = r.randrange(1, 64)
    if r.random() < 0.5:
        return buf[:i] + buf[i + n:], f"deleted {n} at {i}"
    return buf[:i] + bytes(r.randrange(256) for _ in range(n)) + buf[i:], f"inserted {n} at {i}"


def b_splice(buf, r, hend, other: bytes = b""):
    i = r.randrange(len(buf) + 1)
    j = r.randrange(len(other) + 1)
    return buf[:i] + other[j:j + r.randrange(1, 4096)], f"spliced at {i}"


BYTE_OPS = [b_bitflip, b_bitflip, b_interesting, b_interesting, b_truncate, b_chunk, b_splice]


def make_case(seeds: dict[str, bytes], seed: int, index: int) -> tuple[str, bytes, list[str]]:
    """The bytes of case `index`: (seed name, mutated bytes, mutation log)."""
    r = random.Random(f"{seed}:{index}")
    names = sorted(seeds)
    weights = [SEED_WEIGHTS.get(n, 1) for n in names]
    name = r.choices(names, weights)[0]
    doc = parse_doc(seeds[name])
    log = [name]
    n_struct = r.choice([0, 1, 1, 1, 1, 2, 3])
    # a single semantic mutation often reaches checks that several mutations never pass
    n_byte = r.choice([0, 0, 0, 1, 2]) if n_struct else r.choice([1, 1, 2, 3])
    for _ in range(n_struct):
        op = r.choices([o for o, _ in STRUCT_OPS], [w for _, w in STRUCT_OPS])[0]
        try:
            log.append(op.__name__ + ": " + op(doc, r, seeds))
        except (struct.error, ValueError, IndexError, KeyError):
            # an earlier mutation left nothing this one understands (e.g. a cut payload)
            log.append(op.__name__ + ": skipped")
    buf = doc.serialise()
    hend = header_end(buf, doc)
    for _ in range(n_byte):
        op = r.choice(BYTE_OPS)
        if op is b_splice:
            buf, what = b_splice(buf, r, hend, seeds[r.choice(names)])
        else:
            buf, what = op(buf, r, hend)
        log.append(op.__name__ + ": " + what)
    return name, buf, log


# Small seeds are cheap; the 50k-token vocabularies take ~0.2 s just to parse.
SEED_WEIGHTS = {"toy-checkpoint": 8, "toy-mixed-types": 6, "stories260K": 5, "lora-adapter": 4,
                "vocab-llama-spm-1500": 2, "vocab-gpt-2-1500": 2, "vocab-smollm2-1500": 2,
                "vocab-llama-spm": 1, "vocab-gpt-2": 1, "vocab-smollm2": 1}


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------
def build_seeds(folder: Path, full: bool = True) -> dict[str, str]:
    """Write the seed files into `folder` and return {name: path}; `full` adds the 50k-token
    vocabularies as they are (each costs ~1 s per case to read and build)."""
    import numpy as np

    import toymlx  # noqa: F401
    folder.mkdir(parents=True, exist_ok=True)
    seeds: dict[str, str] = {}
    notes: dict[str, str] = {}
    toy = folder / "toy-checkpoint.gguf"
    made = _train_two_steps(folder / "runs")
    if made is not None:
        shutil.copyfile(made, toy)
        notes["toy-checkpoint"] = "2-step toymlx-train --recipe from-scratch checkpoint"
    else:
        _write_tiny_llama(toy)
        notes["toy-checkpoint"] = ("tiny Llama written by write_llama (toymlx-train could not "
                                   "run: see notes.train)")
    seeds["toy-checkpoint"] = str(toy)

    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quantize

    from toymlx.gguf.reader import GGUFFile
    from toymlx.gguf.writer import QuantTensor, write_gguf

    g = GGUFFile(toy)
    meta = dict(g.metadata)
    types = dict(g.metadata_types)
    tensors = {n: g.load(n) for n in g.tensors}
    # Projections in the three types load_llama(weights="quantized") keeps quantized; the rest elsewhere.
    plan = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "token_embd": T.F16}
    out: dict = {}
    for n, a in tensors.items():
        kind = next((q for k, q in plan.items() if f"{k}." in n), None)
        if kind is T.F16:
            out[n] = a.astype(np.float16)
        elif kind is not None and a.shape[-1] % 32 == 0:
            out[n] = QuantTensor(kind, quantize(a, kind), a.shape)
        else:
            out[n] = a
    rng = np.random.default_rng(0)
    for q in (T.BF16, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K, T.IQ4_NL, T.TQ2_0, T.MXFP4):
        x = rng.standard_normal((2, 256)).astype(np.float32)
        try:
            out[f"extra.{q.name.lower()}"] = QuantTensor(q, quantize(x, q), x.shape)
        except NotImplementedError:  # gguf-py cannot encode it: random blocks decode too
            from gguf.constants import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[q]
            raw = rng.integers(0, 256, (2, 256 // block * size), dtype=np.uint8)
            out[f"extra.{q.name.lower()}"] = QuantTensor(q, raw, x.shape)
    mixed = folder / "toy-mixed-types.gguf"
    write_gguf(mixed, meta, out, types=types)
    seeds["toy-mixed-types"] = str(mixed)

    adapter = _write_adapter(folder, toy)
    if adapter:
        seeds["lora-adapter"] = str(adapter)
    else:
        notes["lora-adapter"] = "no adapter seed: toymlx.lora has no GGUF adapter writer yet"
    p = SHARED / "models" / "stories260K.gguf"
    if p.is_file():
        seeds["stories260K"] = str(p)
    else:
        notes["stories260K"] = f"missing {p}"
    for name in ("llama-spm", "gpt-2", "smollm2"):
        p = SHARED / "tokenizers" / f"ggml-vocab-{name}.gguf"
        if not p.is_file():
            notes[f"vocab-{name}"] = f"missing {p}"
            continue
        small = folder / f"vocab-{name}-1500.gguf"
        _small_vocab(p, small, 1500)
        seeds[f"vocab-{name}-1500"] = str(small)
        if full:
            seeds[f"vocab-{name}"] = str(p)
    (folder / "seeds.json").write_text(json.dumps({"seeds": seeds, "notes": notes}, indent=1))
    return seeds


def _small_vocab(src: Path, dst: Path, n: int) -> None:
    """A real vocabulary cut to its first `n` tokens (merges and special ids kept consistent)."""
    from toymlx.gguf.reader import GGUFFile
    from toymlx.gguf.writer import write_gguf

    g = GGUFFile(src)
    meta, types = dict(g.metadata), dict(g.metadata_types)
    toks = meta["tokenizer.ggml.tokens"][:n]
    meta["tokenizer.ggml.tokens"] = toks
    for k in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if k in meta:
            meta[k] = meta[k][:n]
    if "tokenizer.ggml.merges" in meta:
        have = set(toks)
        meta["tokenizer.ggml.merges"] = [
            m for m in meta["tokenizer.ggml.merges"]
            if len(m.split(" ")) == 2 and all(x in have for x in m.split(" "))
            and m.replace(" ", "") in have]
    for k, v in list(meta.items()):
        if k.endswith("_token_id") and isinstance(v, int) and v >= n:
            meta[k] = n - 1
        if k.endswith(".vocab_size"):
            meta[k] = n
    write_gguf(dst, meta, {}, types=types)


def _train_two_steps(runs: Path) -> Path | None:
    """A real checkpoint: 2 steps of a tiny from-scratch run (None if the recipe cannot run)."""
    try:
        import toymlx.tokenizer  # noqa: F401
    except ImportError:
        return None
    entry = "import sys; from toymlx_cli.train import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", entry, "--recipe", "from-scratch", "--steps", "2",
           "--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
           "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
           "--seq-len", "32", "--batch-size", "2", "--warmup", "1", "--eval-batches", "1",
           "--no-compile", "--no-progress", "--runs-root", str(runs), "--run-id", "seed",
           "--data.path", str(SHARED / "text" / "tinystories_sample.txt")]
    p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=300)
    latest = runs / "seed" / "weights" / "latest"
    if p.returncode != 0 or not latest.exists():
        (runs / "train-failed.txt").parent.mkdir(parents=True, exist_ok=True)
        (runs / "train-failed.txt").write_text(p.stderr[-4000:])
        return None
    return latest.resolve()


def _byte_tokenizer_meta() -> dict:
    try:
        from toymlx.tokenizer import byte_tokenizer

        return byte_tokenizer().to_metadata()
    except ImportError:
        toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks,
                "tokenizer.ggml.scores": [0.0] * len(toks),
                "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256,
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 2}


def _write_tiny_llama(path: Path) -> None:
    import mlx.core as mx

    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama, LlamaArgs

    mx.random.seed(0)
    args = LlamaArgs(vocab_size=259, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     ffn_dim=64, context=64)
    write_llama(path, Llama(args), _byte_tokenizer_meta(), {"general.step": 2})


def _write_adapter(folder: Path, base: Path) -> Path | None:
    """A LoRA adapter GGUF for the toy base, written by toymlx.lora.write_adapter."""
    try:
        from toymlx import lora
    except ImportError:
        return None
    import mlx.core as mx

    from toymlx.gguf.llama import load_llama

    model, g = load_llama(base)
    lora.apply_lora(model, targets="q,v,down", rank=4, alpha=8.0)
    for m in lora.lora_layers(model).values():  # non-zero B, so the adapter does something
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.01
    path = folder / "lora-adapter.gguf"
    lora.write_adapter(path, model, g.metadata)
    return path


# ---------------------------------------------------------------------------------------------
# Reader paths
# ---------------------------------------------------------------------------------------------
def reader_paths() -> tuple[dict, dict[str, str]]:
    """{name: fn(path, seed_name)} for every reader that exists, and {name: why missing}."""
    import numpy as np

    from toymlx.gguf.llama import load_llama
    from toymlx.gguf.reader import GGUFFile, read_metadata

    paths: dict = {}
    missing: dict[str, str] = {}

    def gguf_all_tensors(p, seed):
        g = GGUFFile(p)
        for n in g.tensors:
            a = g.load(n)
            np.isfinite(a).all()  # touch the data
        g.close()

    paths["GGUFFile+load(all tensors)"] = gguf_all_tensors
    paths["read_metadata"] = lambda p, seed: read_metadata(p)

    def llama(p, seed):
        model, _ = load_llama(p)
        import mlx.core as mx

        logits = model(mx.array([[1, 2, 3]]) % model.args.vocab_size)
        mx.eval(logits)

    paths["load_llama(+forward)"] = llama

    try:
        from toymlx.checkpoint import load_checked
        from toymlx.gguf.llama import args_from_gguf, load_llama_into

        base_args: dict = {}

        def resume(p, seed):
            if seed not in base_args:  # the unmutated seed's shape: what resume builds
                try:
                    base_args[seed] = args_from_gguf(GGUFFile(SEED_FILES[seed]))
                except ValueError:
                    base_args[seed] = None
            if base_args[seed] is None:
                return "n/a"
            from toymlx.models.llama import Llama

            model = Llama(base_args[seed])
            # what trainer.train does on --resume: the recipe's load, shapes checked after
            load_checked(load_llama_into, Path(p), model)
            import mlx.core as mx
            mx.eval(model(mx.array([[1, 2, 3]])))

        paths["resume: load_checked(load_llama_into)"] = resume
    except ImportError as e:
        missing["resume: load_checked(load_llama_into)"] = str(e)

    try:
        from toymlx.tokenizer import Tokenizer

        def tok(p, seed):
            t = Tokenizer.from_gguf(p)
            ids = t.encode("Hello world, ŝnøw ☃ 123")
            t.decode(ids)

        paths["Tokenizer.from_gguf(+encode/decode)"] = tok
    except ImportError as e:
        missing["Tokenizer.from_gguf"] = f"toymlx.tokenizer not importable ({e})"

    try:
        from toymlx import lora
        from toymlx.gguf.llama import load_llama

        paths["load_llama(bfloat16)"] = lambda p, seed: load_llama(p, weights="bfloat16")
        paths["load_llama(quantized)"] = lambda p, seed: load_llama(p, weights="quantized")
        paths["lora.load_adapter"] = lambda p, seed: lora.load_adapter(p)

        def apply(p, seed):
            import mlx.core as mx

            lora.load_adapter(p)  # apply_adapter's first step: fail before building a base
            model, _ = load_llama(SEED_FILES["toy-checkpoint"])
            lora.apply_adapter(model, p)
            mx.eval(model(mx.array([[1, 2, 3]])))

        paths["lora.apply_adapter(toy base)"] = apply

        def adapter_resume(p, seed):
            from toymlx.checkpoint import load_checked

            lora.load_adapter(p)  # load_adapter_weights' first step, before building a base
            model, _ = load_llama(SEED_FILES["toy-checkpoint"])
            lora.apply_lora(model, targets="q,v,down", rank=4, alpha=8.0)  # the seed's layout
            load_checked(lambda path, m: lora.load_adapter_weights(m, path), Path(p), model)

        paths["resume: load_checked(lora.load_adapter_weights)"] = adapter_resume
    except ImportError as e:
        missing["LoRA base/adapter loaders"] = f"toymlx.lora not importable ({e})"

    try:
        from toymlx import warm

        paths["warm.read_donor"] = lambda p, seed: warm.read_donor(p)
    except ImportError as e:
        missing["warm-start donor loader"] = f"toymlx.warm not importable ({e})"
    return paths, missing


SEED_FILES: dict[str, str] = {}


def classify(exc: BaseException, path: str) -> str | None:
    """None when `exc` is an acceptable clean error for input `path`, else why not."""
    msg = str(exc)
    if not isinstance(exc, ValueError):
        return f"{type(exc).__name__} is not a ValueError/GGUFError"
    if "\n" in msg.strip():
        return "message spans several lines"
    if path not in msg:
        return "message does not name the file"
    return None


def run_case(paths: dict, file: str, seed: str) -> dict[str, dict]:
    import warnings

    out = {}
    for name, fn in paths.items():
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy overflow warnings on garbage floats
                res = fn(file, seed)
            out[name] = {"outcome": "n/a" if res == "n/a" else "ok"}
        except Exception as e:  # noqa: BLE001 -- judging every exception is the point
            bad = classify(e, file)
            rec = {"outcome": "clean_error" if bad is None else "defect",
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if bad:
                rec["why"] = bad
                rec["trace"] = traceback.format_exc()[-2500:]
            out[name] = rec
        except MemoryError as e:
            out[name] = {"outcome": "defect", "why": "MemoryError", "error": str(e)[:300]}
        except RecursionError as e:
            out[name] = {"outcome": "defect", "why": "RecursionError", "error": str(e)[:300]}
        out[name]["s"] = round(time.perf_counter() - t0, 4)
    return out


# ---------------------------------------------------------------------------------------------
# Worker and supervisor
# ---------------------------------------------------------------------------------------------
def worker(args) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (args.mem_gb << 30, args.mem_gb << 30))
    sys.path.insert(0, str(REPO))
    import toymlx  # noqa: F401

    work = Path(args.work)
    info = json.loads((work / "seeds" / "seeds.json").read_text())
    SEED_FILES.update(info["seeds"])
    seeds = {n: Path(p).read_bytes() for n, p in info["seeds"].items()}
    paths, missing = reader_paths()
    current: list[int | None] = [None]
    if args.selftest:  # prove the guard: case 1 segfaults, case 2 hangs
        def selftest(p, seed):
            if current[0] == 1:
                import ctypes

                ctypes.string_at(0)
            if current[0] == 2:
                time.sleep(3600)

        paths["selftest"] = selftest
    print(json.dumps({"paths": list(paths), "missing": missing}), flush=True)
    if args.start == 0:  # the unmutated seeds: which paths each one exercises to success
        base = {n: run_case(paths, p, n) for n, p in info["seeds"].items()}
        print(json.dumps({"baseline": base}), flush=True)
    case_file = str(work / "case.gguf")
    for i in range(args.start, args.end):
        seed_name, buf, log = make_case(seeds, args.seed, i)
        with open(case_file, "wb") as f:
            f.write(buf)
        print(json.dumps({"start": i, "log": log}), flush=True)
        current[0] = i
        res = run_case(paths, case_file, seed_name)
        print(json.dumps({"done": i, "seed": seed_name, "log": log, "res": res}), flush=True)
    return 0


def supervise(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    t_start = time.time()
    seeds = build_seeds(work / "seeds", full=args.profile == "full")
    seed_info = json.loads((work / "seeds" / "seeds.json").read_text())
    summary: dict = {"seed": args.seed, "profile": args.profile, "cases": 0, "seeds": seed_info, "paths": [],
                     "missing_paths": {}, "per_path": {}, "defects": [], "crashes": [],
                     "hangs": [], "per_seed": {}, "ops": {}, "path_seconds": {}}
    nxt = 0
    while nxt < args.cases:
        if args.time_budget and time.time() - t_start > args.time_budget:
            summary["stopped_early"] = f"time budget {args.time_budget}s reached"
            break
        cmd = [sys.executable, __file__, "--worker", "--work", str(work), "--seed",
               str(args.seed), "--start", str(nxt), "--end", str(args.cases),
               "--mem-gb", str(args.mem_gb)] + (["--selftest"] if args.selftest else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, cwd=REPO)
        current, current_log, buf, hung = None, None, b"", False
        last = time.time()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    last = time.time()
                    if "paths" in msg:
                        summary["paths"], summary["missing_paths"] = msg["paths"], msg["missing"]
                    elif "baseline" in msg:
                        summary["baseline"] = {n: {p: r["outcome"] for p, r in res.items()}
                                               for n, res in msg["baseline"].items()}
                        for n, res in msg["baseline"].items():
                            for p, r in res.items():
                                if r["outcome"] == "defect":
                                    summary["defects"].append(
                                        {"case": f"seed {n}", "path": p, "log": [n],
                                         "why": r.get("why"), "error": r.get("error"),
                                         "trace": r.get("trace"), "input": None})
                    elif "start" in msg:
                        current, current_log = msg["start"], msg["log"]
                    elif "done" in msg:
                        _record(summary, msg, out, work)
                        current = None
                        nxt = msg["done"] + 1
            # the first case also pays for imports and seed parsing
            limit = args.case_timeout if current is not None else args.case_timeout + 120
            if time.time() - last > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                hung = True
                break
        rc = proc.wait()
        err = proc.stderr.read().decode(errors="replace")
        if current is not None and (hung or rc != 0):
            kind = "hang" if hung else "crash"
            summary["hangs" if hung else "crashes"].append(
                {"case": current, "log": current_log, "input": _save_input(out, work, current, kind),
                 "returncode": rc, "stderr": err[-2000:]})
            summary["cases"] += 1
            nxt = current + 1
        elif rc != 0 or hung:
            summary["worker_failed"] = {"returncode": rc, "stderr": err[-4000:]}
            break
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    shutil.rmtree(work, ignore_errors=True)
    del seeds
    return summary


def _save_input(out: Path, work: Path, case, kind: str) -> str | None:
    src = work / "case.gguf"
    if case is None or not src.exists():
        return None
    dst = out / f"{kind}-case{case}.gguf"
    shutil.copyfile(src, dst)
    return str(dst)


def _record(summary: dict, msg: dict, out: Path, work: Path) -> None:
    summary["cases"] += 1
    seed_name = msg["seed"]
    summary["per_seed"][seed_name] = summary["per_seed"].get(seed_name, 0) + 1
    for entry in msg["log"][1:]:
        op = entry.split(":", 1)[0]
        summary["ops"][op] = summary["ops"].get(op, 0) + 1
    saved = None
    for path, rec in msg["res"].items():
        counts = summary["per_path"].setdefault(path, {})
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        summary["path_seconds"][path] = round(summary["path_seconds"].get(path, 0) + rec["s"], 3)
        if rec["outcome"] == "defect":
            if saved is None:
                saved = _save_input(out, work, msg["done"], "defect")
            summary["defects"].append({"case": msg["done"], "path": path, "log": msg["log"],
                                       "why": rec.get("why"), "error": rec.get("error"),
                                       "trace": rec.get("trace"), "input": saved})


def replay(file: str) -> int:
    sys.path.insert(0, str(REPO))
    import toymlx  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-replay-"))
    info = build_seeds(work)
    SEED_FILES.update(info)
    paths, missing = reader_paths()
    res = run_case(paths, file, "toy-checkpoint")
    for name, rec in res.items():
        print(f"{name}: {rec['outcome']} {rec.get('error', '')}")
        if rec.get("trace"):
            print(rec["trace"])
    for name, why in missing.items():
        print(f"{name}: not covered ({why})")
    shutil.rmtree(work, ignore_errors=True)
    return int(any(r["outcome"] == "defect" for r in res.values()))


def report(s: dict) -> str:
    lines = [f"fuzz_gguf: {s['cases']} cases, seed {s['seed']}, {s['elapsed_s']} s"]
    lines.append("seeds: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["per_seed"].items())))
    for k, v in s["seeds"].get("notes", {}).items():
        lines.append(f"  note {k}: {v}")
    for p, c in s["per_path"].items():
        lines.append(f"  {p}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                     + f" ({s['path_seconds'].get(p, 0):.1f} s)")
    for n, res in s.get("baseline", {}).items():
        ok = [p.split("(")[0] for p, o in res.items() if o == "ok"]
        lines.append(f"  seed {n} loads through: {', '.join(ok) or 'nothing'}")
    for p, why in s["missing_paths"].items():
        lines.append(f"  NOT COVERED {p}: {why}")
    lines.append(f"defects {len(s['defects'])}, crashes {len(s['crashes'])}, "
                 f"hangs {len(s['hangs'])}")
    for d in s["defects"][:20]:
        lines.append(f"  defect case {d['case']} {d['path']}: {d['why']}: {d['error']} "
                     f"[{' | '.join(d['log'])}] -> {d['input']}")
    for d in s["crashes"] + s["hangs"]:
        lines.append(f"  crash/hang case {d['case']}: {' | '.join(d['log'] or [])} -> "
                     f"{d['input']} rc={d.get('returncode')}")
    if s.get("worker_failed"):
        lines.append("worker failed: " + s["worker_failed"]["stderr"][-1500:])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="number of fuzz cases")
    ap.add_argument("--seed", type=int, default=0, help="fuzz seed (cases are a pure function)")
    ap.add_argument("--out", default="fuzz-out", help="folder for offending inputs")
    ap.add_argument("--json", help="write the summary JSON here")
    ap.add_argument("--case-timeout", type=float, default=30.0, help="seconds before a hang")
    ap.add_argument("--time-budget", type=float, default=0, help="stop after this many s")
    ap.add_argument("--mem-gb", type=int, default=4, help="worker address-space limit (GiB)")
    ap.add_argument("--profile", choices=["quick", "full"], default="full",
                    help="quick: small seeds only (vocabularies cut to 1500 tokens); full: "
                    "also the 50k-token vocabularies as they are")
    ap.add_argument("--replay", help="run every reader on one saved file and print outcomes")
    ap.add_argument("--show-case", type=int, help="write case N's bytes to --out and exit")
    ap.add_argument("--selftest", action="store_true",
                    help="add a reader that segfaults on case 1 and hangs on case 2, to check "
                    "that both are caught and saved")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--end", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replay:
        return replay(args.replay)
    if args.show_case is not None:
        work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-show-"))
        info = build_seeds(work)
        seeds = {n: Path(p).read_bytes() for n, p in info.items()}
        _, buf, log = make_case(seeds, args.seed, args.show_case)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        dst = Path(args.out) / f"case{args.show_case}.gguf"
        dst.write_bytes(buf)
        print(f"{dst}: {' | '.join(log)}")
        shutil.rmtree(work, ignore_errors=True)
        return 0
    s = supervise(args)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    print(report(s))
    bad = s["defects"] or s["crashes"] or s["hangs"] or s.get("worker_failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
