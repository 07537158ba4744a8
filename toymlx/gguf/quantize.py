"""A model's float32 tensors -> a GGUF of any file type llama.cpp's quantizer writes.

`write_model_gguf` is the one path every exported model takes (a fused LoRA, a full
fine-tune), for every architecture: the caller hands llama.cpp-named float32 tensors and the
metadata; the type decides who encodes them.
- `f32`: written as it is by the one GGUF writer.
- any other type with llama-cpp-python installed: the F32 GGUF goes to a temporary beside the
  target, then llama.cpp's own quantizer (`llama_model_quantize`, the engine of
  `llama-quantize`, at its default parameters, in a child process a stop kills:
  `llama_quantize`) writes the final file through
  `atomic.atomic_path`. The file then equals `llama-quantize F32.gguf OUT.gguf TYPE` byte for
  byte: the mixtures' per-tensor choices (Q4_K_M's Q6_K `attn_v`/`ffn_down` and `output`),
  and its fallbacks for rows that are not a multiple of 256, are llama.cpp's.
- without llama-cpp-python: the types gguf-py encodes (`GGUF_PY_TYPES`: every matrix in that
  type, 1-D tensors F32, as `convert_hf_to_gguf.py --outtype` does); any other type is refused
  in one line naming the extra to install. No quantization code of toymlx's own.
An export carries no `toy.tensor_sha256` (checkpoints do): other tools copy every key, so
`llama-quantize` run on an F32 export would carry a digest its data no longer has, and toymlx
would refuse the result as damaged. Without it, the F32 export is exactly the file llama.cpp
quantizes here. A crash, a full disk or a signal leaves nothing under the final name;
temporaries carry `atomic.TMP_TAG`, and those of killed writers are removed by the next write
of the same name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from tqdm import tqdm

from toymlx.backend import atomic
from toymlx.backend.lifeline import watch_parent
from toymlx.backend.stop import in_child
from toymlx.gguf.reader import DIGEST_KEY, UINT32, GGUFError, GGUFFile
from toymlx.gguf.writer import GGUF_PY_TYPES, encode_tensor, write_gguf

EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0",
                "q4_k_m", "q4_k_s", "q4_1", "q4_0", "q3_k_l", "q3_k_m", "q3_k_s", "q2_k",
                "iq4_xs", "iq4_nl")
"""File types a model is exported in: llama.cpp's file types (`llama-quantize`'s names,
lower case) that need no importance matrix."""
ExportType = Literal[EXPORT_TYPES]  # type: ignore[valid-type]  (tyro reads it at run time)
INTEROP_EXTRA = 'pip install "toymlx[interop]"'
"""What installs llama.cpp's quantizer (llama-cpp-python)."""
_GUESSED = 1024  # llama_ftype's LLAMA_FTYPE_GUESSED flag
_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")  # llama.cpp's per-tensor "[  12/ 272] name"


def file_type(name: str) -> LlamaFileType:
    """llama_ftype (`general.file_type`) of an export type name."""
    return LlamaFileType.ALL_F32 if name == "f32" else LlamaFileType[f"MOSTLY_{name.upper()}"]


BASE_FILE_TYPE = "toy.base_file_type"
"""Metadata key of a full fine-tune's checkpoints: general.file_type of the file it was trained
from, the type its export defaults to."""


def own_type(g: GGUFFile, key: str = "general.file_type") -> str:
    """The export type name of a GGUF's `general.file_type` (its own type, e.g. q4_k_m), or of
    another llama_ftype key."""
    raw = g.metadata.get(key)
    if raw is None and key == "general.file_type":
        raw = _guessed_file_type(g)
    if not isinstance(raw, int):
        raise GGUFError(f"{g.path}: metadata key {key!r}: expected the file's type (a "
                        f"llama_ftype) to export in, found {raw!r}; pass --dtype")
    try:
        ft = LlamaFileType(raw & ~_GUESSED)
    except ValueError:
        ft = None
    name = ("f32" if ft == LlamaFileType.ALL_F32 else
            ft.name.removeprefix("MOSTLY_").lower() if ft is not None else str(raw))
    if name not in EXPORT_TYPES:
        raise GGUFError(f"{g.path}: metadata key {key!r}: its type {name} is not one toymlx "
                        f"writes (expected one of {', '.join(EXPORT_TYPES)}); pass --dtype")
    return name


_K_MIXTURE = {"Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M",
              "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}


def _guessed_file_type(g: GGUFFile) -> int | None:
    """A llama_ftype for a file without `general.file_type` (older or hand-made files), as
    llama.cpp's loader guesses one: the tensor type most of its matrices have (a K-quant as its
    _M mixture), flagged as guessed; None when that type is no file type."""
    counts: dict[str, int] = {}
    for t in g.tensors.values():
        if len(t.shape) >= 2:
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
    if not counts:
        return None
    most = max(counts, key=lambda k: counts[k])
    name = "ALL_F32" if most == "F32" else _K_MIXTURE.get(most, f"MOSTLY_{most}")
    return int(LlamaFileType[name]) | _GUESSED if name in LlamaFileType.__members__ else None


def export_type(g: GGUFFile) -> str:
    """The type an export of `g` defaults to: the file's own, or for a full fine-tune's
    checkpoint the type of the file it was trained from (`toy.base_file_type`)."""
    return own_type(g, BASE_FILE_TYPE if BASE_FILE_TYPE in g.metadata else "general.file_type")


FLOAT_TENSOR_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                      GGMLQuantizationType.BF16)
BLOCK = 32
"""The fewest values any quantized type's block holds (Q8_0, Q4_0, ...; the k-quants 256)."""


def block_type(dtype: str) -> GGMLQuantizationType:
    """The tensor type whose blocks an export type is named for (q4_k_m: Q4_K, iq4_xs: IQ4_XS)."""
    return GGMLQuantizationType[re.sub(r"(_K)_[SML]$", r"\1", dtype.upper())]


def _named(tensors: list[tuple[str, Any]]) -> str:
    """Tensor names, each block's alike as one `blk.*.NAME (count)`."""
    seen: dict[str, list[str]] = {}
    for name, _ in tensors:
        seen.setdefault(re.sub(r"^blk\.\d+\.", "blk.*.", name), []).append(name)
    return ", ".join(names[0] if len(names) == 1 else f"{key} ({len(names)})"
                     for key, names in seen.items())


def unquantized_note(path: str | os.PathLike, dtype: str) -> str | None:
    """For a file written in a quantized `dtype`, as one line: the matrices it names but does
    not hold in that type, left by llama-quantize's fallbacks (said only in its log): rows not a
    multiple of `BLOCK` stay F16 (gguf-py's writer refuses them), and a k-quant's rows not a
    multiple of its 256 take a 32-value block type (Q5_0, Q8_0, IQ4_NL, ...), named with the
    tensors that got each; None where every matrix is in `dtype`'s blocks or `dtype` is a float
    type."""
    if dtype in ("f32", "f16", "bf16"):
        return None
    mats = [(n, t) for n, t in GGUFFile(path).tensors.items() if len(t.shape) == 2]
    notes = []
    left = [t for _, t in mats if t.type in FLOAT_TENSOR_TYPES and t.shape[-1] % BLOCK]
    if left:
        kinds = sorted({t.type.name for t in left})
        rows = sorted({t.shape[-1] for t in left})
        notes.append(
            f"{len(left)} of its {len(mats)} matrices stay {'/'.join(kinds)}, not {dtype}: their "
            f"rows ({', '.join(map(str, rows))} values) are not a multiple of the {BLOCK} a "
            "quantized block holds; a model whose widths are multiples of 32 (256 for k-quants) "
            "quantizes them all (a new model's: --model.d-model, --model.ffn-dim; a base's are "
            "its own)")
    asked = block_type(dtype)
    per_block = GGML_QUANT_SIZES[asked][0]
    fell = [(n, t) for n, t in mats if t.type not in FLOAT_TENSOR_TYPES
            and GGML_QUANT_SIZES[t.type][0] < per_block and t.shape[-1] % per_block]
    if fell:
        rows = sorted({t.shape[-1] for _, t in fell})
        got = "; ".join(f"{k}: {_named([m for m in fell if m[1].type.name == k])}"
                        for k in sorted({t.type.name for _, t in fell}))
        notes.append(
            f"{len(fell)} of its {len(mats)} matrices are quantized in a {BLOCK}-value block "
            f"type, not {dtype}'s {per_block}-value {asked.name}: their rows "
            f"({', '.join(map(str, rows))} values) are not a multiple of {per_block}, and "
            f"llama.cpp's quantizer fell back ({got}); widths that are multiples of "
            f"{per_block} get {dtype}'s own blocks")
    return "; ".join(notes) or None


def llama_cpp_module() -> Any | None:
    """llama-cpp-python, if installed (it carries llama.cpp's quantizer), else None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def quantizer(dtype: str) -> str:
    """Who writes `dtype`: "toymlx" (f32), "llama.cpp" or "gguf-py"; ValueError naming
    --dtype and the extra to install when nothing here can."""
    if dtype not in EXPORT_TYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(EXPORT_TYPES)}, found {dtype!r}")
    if dtype == "f32":
        return "toymlx"
    if llama_cpp_module() is not None:
        return "llama.cpp"
    if dtype in GGUF_PY_TYPES:
        return "gguf-py"
    raise ValueError(f"--dtype {dtype}: expected llama.cpp's quantizer for this type, found "
                     f"llama-cpp-python not installed ({INTEROP_EXTRA}); without it toymlx "
                     f"writes {', '.join(GGUF_PY_TYPES)}")


GGUF_PY_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def ggml_quantize_chunk() -> Any | None:
    """llama.cpp's `ggml_quantize_chunk` (the routine llama-quantize encodes every tensor
    with), from llama-cpp-python's libggml; None without it."""
    if llama_cpp_module() is None:
        return None
    try:
        from llama_cpp._ggml import libggml
        fn = libggml.ggml_quantize_chunk
    except (ImportError, AttributeError, OSError):
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


CHUNK_VALUES = 1 << 20
"""Values `quantize_tensor` hands llama.cpp's `ggml_quantize_chunk` a call, a run of whole rows
(llama-quantize's own threads split a tensor so, and each row is encoded alone: the same
bytes): Python runs no signal handler inside one call, and one call on a 1B model's 8192 x
2048 tensor held a SIGTERM to `toymlx-export --fuse` ~2.7 s on 2 CPU cores."""


def quantize_tensor(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A float32 (out, in) tensor encoded as `qtype`'s raw bytes (uint8): llama.cpp's own
    encoder where installed (the bytes llama-quantize writes for that tensor, no importance
    matrix), else gguf-py's (the same reference rounding for its types)."""
    w = np.ascontiguousarray(w, np.float32)
    if qtype == GGMLQuantizationType.F32:
        return w.view(np.uint8).reshape(-1)
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16).view(np.uint8).reshape(-1)
    block, size = GGML_QUANT_SIZES[qtype]
    n_in = w.shape[-1]
    if n_in % block:
        raise ValueError(f"tensor type {qtype.name}: expected rows a multiple of {block} "
                         f"values, found {n_in}")
    fn = ggml_quantize_chunk()
    if fn is not None:
        rows = w.size // n_in
        out = np.empty(rows * (n_in // block) * size, np.uint8)
        step = max(1, CHUNK_VALUES // n_in)  # rows a call: a stop's handler runs between two
        n = sum(fn(int(qtype), w.ctypes.data, out.ctypes.data, r * n_in, min(step, rows - r),
                   n_in, None) for r in range(0, rows, step))
        if n != out.nbytes:
            raise OSError(f"llama.cpp's ggml_quantize_chunk ({qtype.name}): expected "
                          f"{out.nbytes} bytes, found {n}")
        return out
    if qtype.name not in GGUF_PY_TENSOR_TYPES:
        raise ValueError(f"tensor type {qtype.name}: expected llama.cpp's quantizer, found "
                         f"llama-cpp-python not installed ({INTEROP_EXTRA})")
    from gguf.quants import quantize

    return np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(-1)


def dequantize_tensor(raw: np.ndarray, qtype: GGMLQuantizationType,
                      shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes of `qtype` decoded to float64 (gguf-py's decoders, exact)."""
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).astype(np.float64)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float64)
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    return dequantize(raw.reshape(-1, shape[-1] // block * size), qtype).reshape(
        shape).astype(np.float64)


def write_model_gguf(out: str | os.PathLike, metadata: dict[str, Any],
                     types: dict[str, tuple[int, int | None]], tensors: dict[str, np.ndarray],
                     dtype: str, progress: bool = False) -> Path:
    """Write llama.cpp-named float32 `tensors` with `metadata` (value types `types`) as a GGUF
    of file type `dtype`, atomically; see the module docstring for who encodes what."""
    who = quantizer(dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale(out)
    drop = ("general.alignment", "general.file_type", DIGEST_KEY)
    meta = {k: v for k, v in metadata.items() if k not in drop}
    types = {k: t for k, t in types.items() if k not in drop}
    types["general.file_type"] = (UINT32, None)
    meta["general.file_type"] = int(file_type("f32" if who == "llama.cpp" else dtype))
    try:
        if who != "llama.cpp":
            encoded = {n: encode_tensor(n, w, dtype) for n, w in
                       tqdm(tensors.items(), desc=f"encoding {dtype}", unit="tensor",
                            disable=not progress or dtype == "f32", file=sys.stderr)}
            return write_gguf(out, meta, encoded, types=types, digest=False,
                              progress=f"writing {out.name}" if progress else None)
        _write_with_llama_cpp(out, meta, types, tensors, dtype, progress)
    except OSError as e:
        raise OSError(f"{out}: could not write the {dtype} model ({atomic.named(e, out)}); "
                      "nothing was written under this name") from e
    return out


def _write_with_llama_cpp(out: Path, meta: dict[str, Any],
                          types: dict[str, tuple[int, int | None]],
                          tensors: dict[str, np.ndarray], dtype: str, progress: bool) -> None:
    # llama.cpp quantizes from a file: the F32 export, beside the target
    f32 = out.with_name(f".{out.name}.f32{atomic.TMP_TAG}{os.getpid()}")
    try:
        try:
            write_gguf(f32, meta, tensors, types=types, digest=False,
                       progress="writing the F32 model for llama.cpp" if progress else None)
        except OSError as e:  # "the file" of room_for's message is not the one asked for
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise OSError(e.errno, f"{e.strerror}; that file is llama.cpp's F32 input, written "
                          f"beside it first, and the {dtype} file then needs room beside it",
                          str(out)) from None
        with atomic.atomic_path(out) as tmp:
            try:
                llama_quantize(f32, tmp, dtype, progress)
            except OSError as e:
                raise _out_of_room(e, out, tmp, f32, dtype) from None
    finally:
        atomic.discard(f32)  # on a read-only disk, removing it fails too


FULL = 1 << 20
"""A disk with less than this free as llama.cpp's quantizer fails is taken as full."""


def _out_of_room(e: OSError, out: Path, tmp: Path, f32: Path, dtype: str) -> OSError:
    """llama.cpp's quantizer stopped by a full disk says only "basic_ios::clear: iostream
    error": where the disk is full as it fails (its part-written file still there), an ENOSPC
    naming `out` with what the export takes there; any other failure as it is."""
    free = atomic.free_bytes(tmp.parent)
    if free is None or free >= FULL or not tmp.is_file():
        return e
    return OSError(errno.ENOSPC, f"No space left on device ({e}; its F32 "
                   f"input beside the file takes {f32.stat().st_size / 2**20:.1f} MiB, and "
                   f"{tmp.stat().st_size / 2**20:.1f} MiB of the {dtype} file were written as "
                   f"the disk filled)", str(out))


def llama_quantize(src: Path, dst: Path, dtype: str, progress: bool = False) -> None:
    """`llama-quantize SRC DST TYPE` (llama.cpp's default parameters) in a child process a stop
    kills (`in_child`): llama.cpp's call holds its process until it returns (seconds per GB of
    model). Its progress bar on this process's stderr; the caller's `atomic_path` removes what
    it wrote. OSError with llama.cpp's own message when it fails (a full disk, an unreadable
    file)."""
    in_child(f"llama.cpp's quantizer ({dtype})", __name__,
             [os.fspath(src), os.fspath(dst), dtype, "progress" if progress else "quiet"],
             show_stderr=True)


def _quantize_here(src: str, dst: str, dtype: str, progress: bool) -> str | None:
    """llama.cpp's quantizer in this process (the child of `llama_quantize`); None, or why it
    failed in llama.cpp's words."""
    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(file_type(dtype))
    lines: list[str] = []
    bar = tqdm(desc=f"quantizing {dtype} (llama.cpp)", unit="tensor", disable=not progress,
               file=sys.stderr)

    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, user_data: Any) -> None:
        s = text.decode("utf-8", "replace")
        lines.append(s)
        del lines[:-20]  # the last lines, for the error message
        m = _PROGRESS.match(s)
        if m:
            bar.total = int(m.group(2))
            bar.update(int(m.group(1)) - bar.n)

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst),
                                            ctypes.byref(params))
    finally:
        bar.close()
        _restore_log(llama_cpp)
    if rc == 0:
        return None
    why = next((s.strip() for s in reversed(lines) if "failed" in s), "".join(lines[-3:]))
    return " ".join(why.split()) or f"llama_model_quantize returned {rc}"


def _restore_log(llama_cpp: Any) -> None:
    """Give llama.cpp's log back to llama-cpp-python's own handler (it honours verbose=), or
    to llama.cpp's default (stderr) where that version has none."""
    try:
        from llama_cpp import _logger
    except ImportError:
        llama_cpp.llama_log_set(None, ctypes.c_void_p(0))
        return
    llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


if __name__ == "__main__":  # llama_quantize's child: SRC DST TYPE progress|quiet
    watch_parent()
    failed = _quantize_here(*sys.argv[1:4], sys.argv[4] == "progress")
    if failed:
        print(failed, flush=True)
    sys.exit(1 if failed else 0)
