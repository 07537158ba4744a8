"""How a case is made: one to three mutations of a seed file, structure-aware and byte-level.

Structure mutations edit a parsed `Doc` (header counts, key/value types and payloads, float64
metadata, tensor dims/types/offsets/names, alignment, llama and tokenizer hyperparameters);
byte mutations edit the serialised bytes (bit flips, interesting integers, truncation,
insertions, splices). A case is a pure function of (fuzz seed, case index).
"""

from __future__ import annotations

import random
import struct

from .doc import (
    ARR,
    BOOL,
    F32,
    F64,
    FMT,
    I8,
    I16,
    I32,
    I64,
    KV,
    STR,
    TI,
    U8,
    U16,
    U32,
    U64,
    Doc,
    enc_array,
    enc_scalar,
    enc_str,
    parse_doc,
    relayout,
    tensor_nbytes,
)

INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 255, 256, 4095, 65535, 65536, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**40, 2**40 + 1, 2**48, 2**62, 2**63 - 1, 2**63,
               2**64 - 1]
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
            size = struct.calcsize(FMT.get(et, "<B"))
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
        doc.trailer = bytes(r.randrange(256) for _ in range(r.randrange(1, 100)))
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


# Small seeds are cheap; the 50k-token vocabularies take ~0.2 s just to parse.
SEED_WEIGHTS = {"toy-checkpoint": 8, "toy-mixed-types": 6, "stories260K": 5, "lora-adapter": 4,
                "vocab-llama-spm-1500": 2, "vocab-gpt-2-1500": 2, "vocab-smollm2-1500": 2,
                "vocab-llama-spm": 1, "vocab-gpt-2": 1, "vocab-smollm2": 1}


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
