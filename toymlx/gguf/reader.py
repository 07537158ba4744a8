"""A validated GGUF parser.

Every count, length, type and offset in the header is checked against the file before it is
used, so a hostile or truncated file ends in one `GGUFError` naming the file, the key or
tensor, and the expected and found values. MLX's own reader (`mx.load`) segfaults on
float64 metadata and decodes Q4_K wrongly, so tensor data is decoded here with numpy
(exact for F32/F16/BF16, `gguf.quants.dequantize` for quantized types).

A multi-part GGUF (llama.cpp's `gguf-split` layout: `NAME-00001-of-0000N.gguf` ...
`NAME-0000N-of-0000N.gguf`, each part with `split.no` (0-based), `split.count` and
`split.tensors.count`, the model's metadata in the first part and the tensors spread over
the parts) opens as one model from its first part, as llama.cpp loads it: `GGUFFile` maps
every part and reads each tensor from the part that holds it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from toymlx.backend.files import counted, nothing_there, special_kind

MAGIC = b"GGUF"


def not_gguf_kind(head: bytes, size: int) -> str:
    """What a file that is not a GGUF is, by its first bytes `head` (of `size`), as ": KIND"
    after "not a GGUF file" ("" where unknown): a run's optimizer state or the timm export,
    toymlx's own safetensors, with what to read instead; Hugging Face's safetensors weights
    (an 8-byte header length, then its JSON) with the converter that makes a GGUF of them, or
    text (a data file given where a model goes)."""
    n = int.from_bytes(head[:8], "little") if len(head) >= 9 else 0
    if 2 <= n <= size - 8 and head[8:9] == b"{" and b'\\"checkpoint_id\\"' in head[:n + 8]:
        # `checkpoint.state_path`'s: its metadata's "toy" record names the checkpoint
        return (": a toymlx run's optimizer state, which --resume reads beside its checkpoint; "
                "the weights are the .gguf of the same step beside it")
    if 2 <= n <= size - 8 and head[8:9] == b"{" and any(
            k in head[:n + 8] for k in (b'"timm_architecture"', b'"label_names"')):
        # toymlx-export --format safetensors's, for timm (convert_hf_to_gguf.py takes no ViT):
        # its metadata's keys in order, a long label_names before timm_architecture
        return (": timm safetensors weights, as toymlx-export --format safetensors writes "
                "from a run; toymlx reads the run, or a GGUF of its weights/")
    if 2 <= n <= size - 8 and head[8:9] == b"{":
        return (": Hugging Face safetensors weights; llama.cpp's convert_hf_to_gguf.py makes "
                "a GGUF of the model's folder")
    if head.lstrip().startswith(b"{") and b'"added_tokens"' in head:
        # the `tokenizers` library writes this key fourth, after version, truncation, padding
        return (": a Hugging Face tokenizer.json; llama.cpp's convert_hf_to_gguf.py makes a "
                "GGUF of the model's folder (--vocab-only: its tokenizer alone)")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut by the end of `head` is still text
        if e.start < len(head) - 3 or e.reason != "unexpected end of data":
            return ""
    return ": UTF-8 text" if head and b"\0" not in head else ""
DIGEST_KEY = "toy.tensor_sha256"
"""Metadata key: the SHA-256 of the file's tensor data section, written by toymlx's writer."""
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
"""Metadata keys of a multi-part GGUF's parts (llama.cpp's `LLM_KV_SPLIT_*`, gguf-py's
`Keys.Split`): this part's index from 0, the number of parts, the tensors of all parts."""
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF metadata value types (gguf spec numbering).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
SCALAR_DTYPES = {
    UINT8: np.dtype("<u1"), INT8: np.dtype("<i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("u1"),
    UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8"),
}
TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32",
              INT32: "int32", FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array",
              UINT64: "uint64", INT64: "int64", FLOAT64: "float64"}


VOCAB_ONLY = ("the file holds no tensors, a tokenizer-only GGUF (as llama.cpp's ggml-vocab-*.gguf), "
              "not a model")
"""What a GGUF without tensors is: a vocabulary, no weights for any command to run."""

class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message is one line naming file, key and values."""


def refuse_adapter(path: str | os.PathLike, metadata: dict[str, Any], flag: str | None = None) -> None:
    """GGUFError where the file is a LoRA adapter (`general.type` 'adapter': no tokenizer, no
    base weights) given where a model is read; with `flag` (--donor, --tokenizer), the option
    and its fix: the adapter's base, as toymlx's adapters record it (`toy.base`)."""
    if metadata.get("general.type") != "adapter":
        return
    if flag is None:
        raise GGUFError(f"{path}: expected a model GGUF, found a LoRA adapter (a LoRA run's "
                        "checkpoint); pass it as --adapter, with its base model as --base "
                        "(toymlx-generate: --model)")
    base = metadata.get("toy.base")
    raise GGUFError(f"{path}: {flag}: expected a model GGUF, found a LoRA adapter (a LoRA run's "
                    "checkpoint), which holds no tokenizer or base weights; pass its base model"
                    + (f" ({base})" if isinstance(base, str) else ""))


def split_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) of a multi-part GGUF's file name
    `PREFIX-00001-of-00003.gguf` (llama.cpp's `llama_split_path`), None for any other name."""
    m = _SPLIT_NAME.match(name)
    return (m["prefix"], int(m["no"]), int(m["count"])) if m else None


def split_part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part `no` (from 1) of `count` (llama.cpp's naming)."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def tensor_label(name: str) -> str:
    """A tensor as a message names it: `'blk.3.attn_q.weight' (block 3)`."""
    parts = name.split(".")
    block = f" (block {parts[1]})" if parts[0] == "blk" and len(parts) > 1 else ""
    return f"{name!r}{block}"


def check_finite(path: str, name: str, values: np.ndarray, what: str = "values",
                 rows: tuple[int, ...] | None = None, start: int | None = None) -> None:
    """GGUFError (one line: the file, the tensor and its block, how many values are NaN or
    infinite, and where the first one is) unless every one of `values` is finite. `values` are
    tensor `name`'s decoded values (`what` "values": the first's index in them), or its blocks'
    fields (`what` names them, "block scales ('d')"), led by (row, block) with `rows` the
    tensor's leading dimensions, (experts, out) or (out,): the first's expert, row and block.
    With `start`, `values` are the rows of the tensor's leading dimensions flattened from row
    `start` on (a loader's slice; decoded, (rows, in)): the first is named at its place in the
    tensor, and the count is the slice's. Integer arrays pass."""
    if values.dtype.kind != "f" or np.isfinite(values).all():
        return
    bad = ~np.isfinite(values)
    first = np.unravel_index(int(np.argmax(bad)), values.shape)
    v = values[first]
    kinds = "/".join(k for k, m in (("NaN", np.isnan(values)), ("+Inf", values == np.inf),
                                    ("-Inf", values == -np.inf)) if m.any())
    of = str(values.size)
    if start is not None:  # a slice of rows
        of = f"the {values.size} in rows {start}-{start + len(values) - 1}"
    if rows is None:
        at = str(tuple(int(i) for i in first))
    else:  # the row as the tensor's leading dimensions, then the column or (block, fields...)
        lead = np.unravel_index((start or 0) + int(first[0]), rows)
        if what == "values":
            at = str(tuple(int(i) for i in (*lead, first[1])))
        else:
            names = ("expert", "row") if len(rows) == 2 else ("row",)
            at = (", ".join(f"{n} {int(i)}" for n, i in zip(names, lead))
                  + f", block {int(first[1])}")
    raise GGUFError(f"{path}: tensor {tensor_label(name)}: expected finite {what}, found "
                    f"{kinds} in {int(bad.sum())} of {of} (the first, {v}, at "
                    f"{at}); the file is damaged or was written from a model that diverged: "
                    "use another copy of it")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """numpy order: GGML ne reversed, so a weight is (out, in)."""
    type: GGMLQuantizationType
    offset: int
    """Absolute byte offset of the data in the file (of a multi-part GGUF: in its part)."""
    nbytes: int
    part: int = 0
    """Which part of a multi-part GGUF holds the data (0: the first, or a one-file GGUF)."""

    @property
    def type_name(self) -> str:
        return self.type.name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str, expected: str, found: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}: expected {expected}, found {found}")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, f"{n} more bytes at offset {self.pos}",
                            f"end of file at {self.size} (file truncated, or still being written?)")
        out = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"{what} (string length)")
        raw = self.take(n, f"{what} (string of {n} bytes)")
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(what, "UTF-8 text", f"invalid byte at position {e.start}") from None


def _read_value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, int, int | None]:
    """Return (value, type, array element type)."""
    if vtype in SCALAR_DTYPES:
        dt = SCALAR_DTYPES[vtype]
        v = np.frombuffer(c.take(dt.itemsize, f"value of {key!r}"), dtype=dt)[0]
        if vtype == BOOL:
            return bool(v), vtype, None
        return (float(v) if dt.kind == "f" else int(v)), vtype, None
    if vtype == STRING:
        return c.string(f"value of {key!r}"), vtype, None
    if vtype == ARRAY:
        if depth:
            raise c.fail(f"value of {key!r}", "an array of scalars or strings", "nested array")
        etype = c.u32(f"array type of {key!r}")
        n = c.u64(f"array length of {key!r}")
        if etype in SCALAR_DTYPES:
            dt = SCALAR_DTYPES[etype]
            if n > (c.size - c.pos) // dt.itemsize:
                raise c.fail(f"array length of {key!r}", f"at most {(c.size - c.pos) // dt.itemsize}"
                             " elements (bytes left in file)", str(n))
            arr = np.frombuffer(c.take(n * dt.itemsize, f"array {key!r}"), dtype=dt)
            if etype == BOOL:
                return [bool(x) for x in arr], vtype, etype
            return arr.tolist(), vtype, etype
        if etype == STRING:
            if n > (c.size - c.pos) // 8:
                raise c.fail(f"array length of {key!r}", f"at most {(c.size - c.pos) // 8} strings "
                             "(bytes left in file)", str(n))
            return [c.string(f"{key}[{i}]") for i in range(n)], vtype, etype
        raise c.fail(f"array type of {key!r}", "a known GGUF value type (0-12, not array)",
                     str(etype))
    raise c.fail(f"value type of {key!r}", "a known GGUF value type 0-12", str(vtype))


class GGUFFile:
    """A parsed GGUF header plus lazy, exact access to tensor data. Given the first part of a
    multi-part GGUF, the whole model: the first part's metadata (less the `SPLIT_KEYS`) and
    every part's tensors; `paths` lists the parts."""

    def __init__(self, path: str | os.PathLike, whole: bool = True):
        """`whole=False` opens one part of a multi-part GGUF as the file it is."""
        self.path = str(path)
        if kind := special_kind(self.path):
            raise GGUFError(f"{self.path}: file: expected a GGUF file, found {kind}")
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise GGUFError(f"{self.path}: file: expected a GGUF file, found an empty file")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (FileNotFoundError, NotADirectoryError):
            raise GGUFError(f"{self.path}: file: expected an existing GGUF file, found "
                            f"{nothing_there(self.path)}") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: file: expected a GGUF file, found a directory") from None
        except PermissionError:
            raise GGUFError(f"{self.path}: file: expected a readable file, found permission "
                            "denied") from None
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, tuple[int, int | None]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.parts: list[GGUFFile] = [self]
        if not HEADERS.restore(self):
            self._parse()
            HEADERS.store(self)
        if whole and self.metadata.get(SPLIT_COUNT, 1) not in (0, 1):  # llama.cpp: n_split > 1
            try:
                self._join_parts()
            except BaseException:
                self.close()
                raise

    # ---- a multi-part GGUF -------------------------------------------------------------
    def _join_parts(self) -> None:
        """Open parts 2..N beside this first part, check each is the part its name says of
        this model, and index their tensors (llama.cpp's llama_model_loader checks the same)."""
        count = self.get(SPLIT_COUNT, int)
        first, name = Path(self.path), Path(self.path).name
        split = split_name(name)
        if count < 1 or count > 99999:
            raise GGUFError(f"{self.path}: metadata key {SPLIT_COUNT!r}: expected a part count "
                            f"1..99999, found {count}")
        no = self.get(SPLIT_NO, int)
        want = split_part_name(split[0] if split else first.stem, 1, count)
        if no != 0:
            raise GGUFError(f"{self.path}: metadata key {SPLIT_NO!r}: expected 0 (the first "
                            f"part of a {count}-part GGUF), found {no}; give the first part, "
                            f"{split_part_name(split[0], 1, count) if split else 'its 00001 file'}")
        if split is None or split[1:] != (1, count):
            raise GGUFError(f"{self.path}: file name: expected {want} (the first of "
                            f"{count} parts, metadata key {SPLIT_COUNT!r} {count}), found {name}; "
                            "the parts are found by their llama.cpp names: rename them as "
                            "llama-gguf-split named them")
        for i in range(1, count):
            part_path = first.with_name(split_part_name(split[0], i + 1, count))
            if not part_path.exists():
                raise GGUFError(f"{part_path}: part {i + 1} of {count}: expected the GGUF file "
                                f"(metadata key {SPLIT_COUNT!r} of {name} is {count}), found "
                                "nothing at that path; put every part beside the first")
            part = GGUFFile(part_path, whole=False)
            self.parts.append(part)
            got = part.get(SPLIT_COUNT, int, None)
            if got != count:
                raise GGUFError(f"{part_path}: metadata key {SPLIT_COUNT!r}: expected {count} "
                                f"(as in {name}), found {got}; this file is a part of another "
                                "model: put this model's part there")
            got = part.get(SPLIT_NO, int, None)
            if got != i:
                raise GGUFError(f"{part_path}: metadata key {SPLIT_NO!r}: expected {i} (part "
                                f"{i + 1} of {count}), found {got}; the parts are out of order "
                                "or renamed: give each its llama.cpp name")
            for tname, info in part.tensors.items():
                if tname in self.tensors:
                    held = self.parts[self.tensors[tname].part].path
                    raise GGUFError(f"{part_path}: tensor {tensor_label(tname)}: expected "
                                    f"unique names over the parts, found it also in {held}")
                self.tensors[tname] = replace(info, part=i)
        total = self.get(SPLIT_TENSORS, int)
        if total != len(self.tensors):
            raise GGUFError(f"{self.path}: metadata key {SPLIT_TENSORS!r}: expected the "
                            f"{len(self.tensors)} tensors its {count} parts hold, found {total}; "
                            "a part is damaged or from another model")
        for key in SPLIT_KEYS:  # the whole model's metadata, as one file would have it
            self.metadata.pop(key, None)
            self.metadata_types.pop(key, None)

    @property
    def paths(self) -> list[str]:
        """Every file of the model: its parts in order (one for a one-file GGUF)."""
        return [p.path for p in self.parts]

    @property
    def file_bytes(self) -> int:
        """The size of the model's files, every part together."""
        return sum(len(p._mm) for p in self.parts)

    def _parse(self) -> None:
        c = _Cursor(self._mm, self.path)
        magic = bytes(c.take(4, "magic"))
        if magic == bytes(4):
            # llama-quantize and llama-gguf-split write zeros where the header goes and the
            # header itself last, so a file they are still writing starts so
            raise GGUFError(f"{self.path}: magic: expected b'GGUF', found zero bytes (a GGUF "
                            "still being written: llama-quantize writes its header last; or "
                            "an incomplete copy): wait for its writer to finish")
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: magic: expected b'GGUF', found {magic!r} (not a GGUF "
                            f"file{not_gguf_kind(bytes(self._mm[:4096]), len(self._mm))})")
        self.version = c.u32("version")
        if self.version not in (2, 3):
            raise c.fail("version", "2 or 3", str(self.version))
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Each key/value takes at least 8+4 bytes, each tensor info at least 8+4+8+4+8.
        if n_kv > c.size // 12:
            raise c.fail("metadata count", f"at most {c.size // 12} for a {c.size}-byte file",
                         str(n_kv))
        if n_tensors > c.size // 32:
            raise c.fail("tensor count", f"at most {c.size // 32} for a {c.size}-byte file",
                         str(n_tensors))
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.u32(f"value type of {key!r}")
            value, t, et = _read_value(c, vtype, key)
            if key in self.metadata:
                raise c.fail(f"metadata key {key!r}", "unique keys", "a duplicate")
            self.metadata[key] = value
            self.metadata_types[key] = (t, et)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise c.fail("general.alignment", "a power of two", repr(align))
        self.alignment = align
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name")
            n_dims = c.u32(f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor {name!r} n_dims", f"1..{MAX_DIMS}", str(n_dims))
            ne = [c.u64(f"tensor {name!r} dim {d}") for d in range(n_dims)]
            ttype = c.u32(f"tensor {name!r} type")
            offset = c.u64(f"tensor {name!r} offset")
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise c.fail(f"tensor {name!r} type", "a known GGML type", str(ttype)) from None
            if qtype not in GGML_QUANT_SIZES:
                raise c.fail(f"tensor {name!r} type", "a GGML type with a known size", qtype.name)
            infos.append((name, ne, qtype, offset))
        self._header_end = c.pos
        data_start = -(-c.pos // align) * align
        for name, ne, qtype, offset in infos:
            if any(d == 0 for d in ne) or any(d > 1 << 40 for d in ne):
                raise GGUFError(f"{self.path}: tensor {name!r} shape: expected dims in 1..2^40, "
                                f"found ne={ne}")
            block, tsize = GGML_QUANT_SIZES[qtype]
            if ne[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} shape: expected first dim a "
                                f"multiple of {block} for {qtype.name}, found {ne[0]}")
            n = int(np.prod(ne, dtype=object))
            nbytes = n // block * tsize
            start = data_start + offset
            if offset % align:
                raise GGUFError(f"{self.path}: tensor {name!r} offset: expected a multiple of "
                                f"{align}, found {offset}")
            if start + nbytes > c.size:
                raise GGUFError(f"{self.path}: tensor {name!r} data: expected {nbytes} bytes at "
                                f"offset {start}, found file end at {c.size} (file truncated, or "
                                "still being written?)")
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r}: expected unique names, "
                                "found a duplicate")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype,
                                            start, nbytes)
        self.data_start = data_start

    # ---- metadata helpers -------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def has_float64_metadata(self) -> bool:
        return any(t == FLOAT64 or et == FLOAT64 for t, et in self.metadata_types.values())

    def get(self, key: str, kind: type | tuple = (int, float), default: Any = ...) -> Any:
        """The value of `key`, checked to be of `kind`; GGUFError when missing or mistyped."""
        if key not in self.metadata:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata key {key!r}: expected present, "
                                "found missing")
            return default
        v = self.metadata[key]
        if not isinstance(v, kind) or (kind != bool and isinstance(v, bool) and bool not in
                                       (kind if isinstance(kind, tuple) else (kind,))):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise GGUFError(f"{self.path}: metadata key {key!r}: expected {want}, "
                            f"found {type(v).__name__} {v!r:.60}")
        return v

    # ---- tensor data ------------------------------------------------------------------
    def raw(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name`'s bytes as stored, a view of the mapping of the part holding it; with
        `rows` (start, stop), those rows' of its leading dimensions flattened."""
        info = self._info(name)
        first, size = self._span(info, rows)
        return np.frombuffer(self.parts[info.part]._mm, dtype=np.uint8, count=size, offset=first)

    @staticmethod
    def _span(info: TensorInfo, rows: tuple[int, int] | None) -> tuple[int, int]:
        """(offset, bytes) of a tensor's data, or of `rows` of it (`raw`, `release`)."""
        if rows is None:
            return info.offset, info.nbytes
        block, tsize = GGML_QUANT_SIZES[info.type]
        row_bytes = info.shape[-1] // block * tsize
        return info.offset + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r}: expected present, found "
                            f"{self.missing()}")
        return self.tensors[name]

    def missing(self) -> str:
        """What a tensor this file lacks is found as: "missing", or where the file holds no
        tensors at all, that it is a vocabulary-only GGUF (as llama.cpp's ggml-vocab-*.gguf)."""
        return "missing" if self.tensors else f"missing: {VOCAB_ONLY}"

    def load(self, name: str, dtype=np.float32, rows: tuple[int, int] | None = None
             ) -> np.ndarray:
        """Tensor `name` decoded to `dtype` in numpy (out, in) order; exact for float types.
        With `rows` (start, stop), only those rows of its leading dimensions flattened, as a
        (stop - start, in) array: a loader decodes a large tensor a slice at a time
        (`toymlx.gguf.llama.float_weight`)."""
        info = self._info(name)
        raw = self.raw(name, rows)
        t = info.type
        T = GGMLQuantizationType
        if t == T.F32:
            out = raw.view("<f4")
        elif t == T.F16:
            out = raw.view("<f2")
        elif t == T.BF16:
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif t == T.F64:
            out = raw.view("<f8")
        elif t in (T.I8, T.I16, T.I32, T.I64):
            out = raw.view({T.I8: "i1", T.I16: "<i2", T.I32: "<i4", T.I64: "<i8"}[t])
        else:
            from gguf.quants import dequantize

            block, tsize = GGML_QUANT_SIZES[t]
            row_bytes = info.shape[-1] // block * tsize
            try:
                with np.errstate(invalid="ignore", over="ignore"):  # check_finite names them
                    out = dequantize(raw.reshape(-1, row_bytes), t)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {name!r} type: expected a type gguf-py can "
                                f"dequantize, found {t.name}") from None
        if rows is None:
            out = out.reshape(info.shape)
            check_finite(self.path, name, out)  # as decoded: a cast to float16 may overflow
        else:
            out = out.reshape(-1, info.shape[-1])
            check_finite(self.path, name, out, rows=info.shape[:-1], start=rows[0])
        return np.asarray(out, dtype=dtype)

    def verify_digest(self) -> None:
        """GGUFError naming the file when its tensor data does not match `toy.tensor_sha256`
        (a damaged file); files without the key (not written by toymlx) pass."""
        want = self.metadata.get(DIGEST_KEY)
        if not isinstance(want, str):
            return
        # split from one file, the parts' data sections in order are that file's (each tensor
        # padded to the alignment in both)
        got = data_digest(self.path, self.data_start,
                          *[(p.path, p.data_start) for p in self.parts[1:]])
        if got != want:
            where = self.path if len(self.parts) == 1 else (
                f"{self.path} (and its {counted(len(self.parts) - 1, 'other part')})")
            raise GGUFError(f"{where}: tensor data: expected sha256 {want[:16]} (recorded "
                            f"when it was written), found {got[:16]}: the file is damaged")

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Drop tensor `name`'s pages of the file mapping from this process (they stay in the
        page cache and fault back in if read again): a loader that has copied a tensor into
        MLX calls this, so a whole model is not resident twice (mapping + copy). With `rows`
        (start, stop), the pages of those rows of its leading dimensions flattened (as `load`
        reads them)."""
        info = self._info(name)
        mm = self.parts[info.part]._mm
        first, size = self._span(info, rows)
        page = mmap.PAGESIZE
        start = first // page * page
        end = min(-(-(first + size) // page) * page, len(mm))
        if end > start and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        for p in self.parts:
            try:
                p._mm.close()
            except BufferError:  # a numpy view is still alive; the map closes when it is freed
                pass

    def __enter__(self) -> GGUFFile:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HeaderCache:
    """The parsed headers of the GGUF files this process has opened, so that opening the same
    file again (a command's checks, tokenizer, loader and export each open the base) maps it
    without parsing its metadata again: a 49k-token vocabulary is ~0.2 s of CPU a parse, a
    128k one with its merges over a second.

    Owned by `GGUFFile` (its one instance is `HEADERS`); an entry is keyed by the file's
    resolved path and size and holds only what the header parse makes (metadata values, their
    types, the tensor index of offsets, version, alignment), never a mapping or tensor data,
    so the cache keeps no file pages alive. A hit needs the same header bytes: their BLAKE2b
    (~1 ms a MB) is checked on every open, so a file rewritten in between (in place or
    replaced, within one mtime tick or not) is parsed again. Each open gets its own dicts (its
    metadata may be edited, a multi-part GGUF's first part drops its split keys) and its own
    lists: the cache holds each array value (the token lists) as a tuple, copied from the
    parsing open's list and to each later open's, so a caller that appends to or sorts its
    vocabulary changes no other open's (callers, the tokenizer first, take GGUF arrays as
    lists; the copies are ~1 ms for a 128k vocabulary with its merges, against the parse's
    second). At most `size` files, the least recently opened dropped first."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: dict[tuple[str, int], dict[str, Any]] = {}

    @staticmethod
    def _key(g: GGUFFile) -> tuple[str, int]:
        return os.path.realpath(g.path), len(g._mm)

    @staticmethod
    def _digest(g: GGUFFile, end: int) -> bytes:
        return hashlib.blake2b(memoryview(g._mm)[:end], digest_size=16).digest()

    def restore(self, g: GGUFFile) -> bool:
        """Fill `g`'s header from the cache when its file's header is the cached one."""
        key = self._key(g)
        e = self._entries.get(key)
        if e is None or self._digest(g, e["header_end"]) != e["digest"]:  # size: in the key
            return False
        self._entries[key] = self._entries.pop(key)  # most recently used last
        g.metadata = {k: list(v) if isinstance(v, tuple) else v for k, v in e["metadata"].items()}
        g.metadata_types, g.tensors = dict(e["metadata_types"]), dict(e["tensors"])
        g.version, g.alignment, g.data_start = e["version"], e["alignment"], e["data_start"]
        g._header_end = e["header_end"]
        return True

    def store(self, g: GGUFFile) -> None:
        """Remember `g`'s freshly parsed header (before any multi-part join edits it)."""
        key = self._key(g)
        self._entries.pop(key, None)
        self._entries[key] = {
            "metadata": {k: tuple(v) if isinstance(v, list) else v for k, v in g.metadata.items()},
            "metadata_types": dict(g.metadata_types),
            "tensors": dict(g.tensors), "version": g.version, "alignment": g.alignment,
            "data_start": g.data_start, "header_end": g._header_end,
            "digest": self._digest(g, g._header_end)}
        while len(self._entries) > self.size:
            del self._entries[next(iter(self._entries))]

    def clear(self) -> None:
        """Forget every header (the next open of each file parses it)."""
        self._entries.clear()


HEADERS = HeaderCache()
"""The process's parsed GGUF headers (`HeaderCache`); `GGUFFile` reads and fills it."""


def data_digest(path: str | os.PathLike, data_start: int,
                *more: tuple[str | os.PathLike, int]) -> str:
    """SHA-256 of a GGUF file's tensor data section (what `toy.tensor_sha256` records); a
    multi-part GGUF's: its parts' data sections in order (`more`: (path, data start) of the
    parts after the first)."""
    digest = hashlib.sha256()
    for part, start in ((path, data_start), *more):
        with open(part, "rb") as f:
            f.seek(start)
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a GGUF file as plain Python values (validated, never via mx.load)."""
    return dict(GGUFFile(Path(path)).metadata)
