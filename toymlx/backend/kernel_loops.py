"""MLX's strided CPU kernels built with an inner loop g++ vectorises (Linux).

Why: `mx.compile` fuses elementwise ops into C++ kernels (`toymlx.backend.kernel_pch`). Where an
input is broadcast or transposed, MLX writes the "strided" form of the kernel: nested loops that
step each input's pointer by a stride read at run time. g++ vectorises such a loop only where it
can prove every stride is 1, so a kernel with a row statistic broadcast along a row (a norm's
mean and scale, a softmax's max and sum, a causal mask) or a transposed operand runs one float
at a time: 13% of a llama-4x256 training step's CPU time and 7-9% of vit-tiny-28's on an Intel
Xeon, where the same ops in contiguous kernels run 8 floats at a time.

How: `vectorise` rewrites the innermost loop of MLX's generated source. For each block of up to
`BLOCK` elements it gives every strided input a contiguous view: the input itself where its
stride is 1, else a stack buffer filled with its one value (stride 0) or gathered from its
strides. The loop body, MLX's own statements, then reads `view[i]` and writes `out[i]`: plain
contiguous loops that g++ vectorises. Every element is computed by the same statements in the
same order, so the kernel's values are bit for bit MLX's. An output MLX lets overwrite an input
(a donated buffer) is the same elements of the same buffer, so reading and writing a vector of
them at once is as safe as one at a time (`#pragma GCC ivdep`).

Where: MLX builds each kernel by running `g++ ... "<kernel>.cpp" -o "lib<kernel>.so"` through
`popen`. `install` points libmlx.so's `popen` slot (`toymlx.backend.blas_rebind`) at a function
that writes the vectorised source beside MLX's (`<kernel>.vec.cpp`) and runs the build on it,
falling back to MLX's own source in the same shell command if that build fails: a kernel is
always built. Sources it does not recognise (other MLX versions' forms, contiguous kernels,
types outside `TYPES`) build as MLX wrote them. Kernels built before this change keep their
scalar loops, so the kernel folder's name carries `VERSION` (`kernel_pch.header_tag`).
`TOYMLX_KERNEL_LOOPS=off` leaves MLX's builds alone.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import warnings

VERSION = "kernel_loops 2: rows of 16+ in blocks of 256, stride 1 in place, else a stack buffer"
"""What the kernel folder's name records (`kernel_pch.header_tag`): a new rewrite, a new folder."""

BLOCK = 256
"""Elements per block: each strided input's buffer is BLOCK values on the stack."""

SHORT = 16
"""Rows (innermost loops) shorter than this run MLX's own loop."""

TYPES = frozenset({"float", "double", "bool", "int8_t", "int16_t", "int32_t", "int64_t",
                   "uint8_t", "uint16_t", "uint32_t", "uint64_t"})
"""Element types a stack buffer is made of (builtin, trivially constructed); a kernel with
another strided input type (float16_t, bfloat16_t, complex) is built as MLX wrote it."""

MARK = "toymlx_kernel_loops"
"""The symbol a kernel built from `vectorise`'s source exports (its value: `VERSION`)."""

_LOOP = re.compile(r"  for \(int i(\d+) = 0; i\1 < shape\[\1\]; \+\+i\1\) \{")
_READ = re.compile(r"  (\w+) tmp_(\w+) = \*(\w+);")
_STATEMENT = re.compile(r"  \w+ tmp_\w+ = [^*].*;")
_WRITE = re.compile(r"  \*(\w+)\+\+ = tmp_(\w+);")
_BUILD = re.compile(r'"([^"]+)\.cpp" -o "([^"]+\.so)"')


def vectorise(source: str) -> str | None:
    """MLX's generated kernel `source` with its innermost strided loop in blocks of contiguous
    views (see the module's doc); None where the source is not a strided kernel in the form
    MLX 0.32 writes, or an input's type is not in `TYPES`."""
    lines = source.split("\n")
    heads = [i for i, line in enumerate(lines) if _LOOP.fullmatch(line)]
    if not heads:
        return None  # a contiguous kernel: g++ vectorises it already
    head = heads[-1]
    d = _LOOP.fullmatch(lines[head]).group(1)
    if int(d) != len(heads) - 1:
        return None
    try:
        end = lines.index("  }", head + 1)
    except ValueError:
        return None
    reads: dict[str, str] = {}  # input -> type, in the order the body reads them
    writes: list[str] = []
    bumped: list[str] = []
    body: list[str] = []
    bump = re.compile(r"  (\w+) \+= \1_strides\[" + d + r"\];")
    for line in lines[head + 1:end]:
        if (m := _READ.fullmatch(line)) and m.group(2) == m.group(3):
            reads[m.group(3)] = m.group(1)
            body.append(f"  {m.group(1)} tmp_{m.group(3)} = v_{m.group(3)}[i{d}];")
        elif m := _WRITE.fullmatch(line):
            writes.append(m.group(1))
            body.append(f"  {m.group(1)}[i{d}] = tmp_{m.group(2)};")
        elif m := bump.fullmatch(line):
            bumped.append(m.group(1))
        elif _STATEMENT.fullmatch(line) and not any(t in line for t in ("++", "_strides")):
            body.append(line)  # a constant, a scalar input's X[0], an op or a cast
        else:
            return None
    if sorted(bumped) != sorted(reads) or not writes or not reads:
        return None
    if any(t not in TYPES for t in reads.values()):
        return None
    # rows shorter than SHORT keep MLX's loop: a block's set-up would cost more than it saves
    out = [f"  if (shape[{d}] < {SHORT}) {{", *lines[head:end + 1], "  } else {",
           f"  const int n_ = shape[{d}];"]
    out += [f"  const int64_t s_{x} = {x}_strides[{d}];" for x in reads]
    out += [f"  for (int b_ = 0; b_ < n_; b_ += {BLOCK}) {{",
            f"  const int m_ = n_ - b_ < {BLOCK} ? n_ - b_ : {BLOCK};"]
    for x, t in reads.items():
        out += [f"  alignas(64) {t} buf_{x}[{BLOCK}];",
                f"  const {t}* v_{x} = buf_{x};",
                f"  if (s_{x} == 1) v_{x} = {x};",
                (f"  else if (s_{x} == 0) {{ const {t} one_ = *{x}; "
                 f"for (int j_ = 0; j_ < m_; ++j_) buf_{x}[j_] = one_; }}"),
                f"  else for (int j_ = 0; j_ < m_; ++j_) buf_{x}[j_] = {x}[j_ * s_{x}];"]
    out += ["#pragma GCC ivdep", f"  for (int i{d} = 0; i{d} < m_; ++i{d}) {{", *body, "  }"]
    out += [f"  {x} += s_{x} * m_;" for x in reads]
    out += [f"  {y} += m_;" for y in writes]
    out += ["  }", "  }"]
    # a mark in the built library (`built_with_loops`), external so the linker keeps it
    mark = f'extern "C" const char {MARK}[] = "{VERSION}";'
    return "\n".join(lines[:head] + out + lines[end + 1:] + [mark, ""])


def build_command(command: str) -> str:
    """The shell command to run for MLX's kernel `command`: where it builds a `.cpp` whose
    vectorised form (`vectorise`) differs, the build of `<kernel>.vec.cpp` (written beside it),
    or else MLX's own build; otherwise `command` unchanged."""
    m = _BUILD.search(command)
    if m is None:
        return command
    source = m.group(1) + ".cpp"
    try:
        with open(source) as f:
            text = vectorise(f.read())
        if text is None:
            return command
        vec = m.group(1) + ".vec.cpp"
        tmp = f"{vec}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, vec)
    except (OSError, UnicodeDecodeError):
        return command
    # the vectorised build, its source removed after; MLX's own where that build fails
    ours = command.replace(m.group(0), m.group(0).replace(source, vec), 1)
    return f'{ours} && rm -f "{vec}" || {{ rm -f "{vec}"; {command}; }}'


def built_with_loops(library: str | os.PathLike) -> bool:
    """Whether the kernel library at `library` was built from `vectorise`'s source."""
    try:
        return hasattr(ctypes.CDLL(os.fspath(library)), MARK)
    except OSError:
        return False


_POPEN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
_hook: object | None = None  # the installed callback, kept alive for libmlx.so's calls


def identity() -> str:
    """What the kernel folder's name records of this rewrite (`kernel_pch.header_tag`):
    `VERSION`, or that it is off."""
    return "kernel_loops off" if os.environ.get("TOYMLX_KERNEL_LOOPS") == "off" else VERSION


def install() -> str:
    """Route libmlx.so's kernel builds through `build_command`; return "on" or "off (why)".
    Linux only; after `toymlx.backend.kernel_pch.install`, whose folder name carries
    `VERSION`."""
    global _hook
    if os.environ.get("TOYMLX_KERNEL_LOOPS") == "off":
        return "off (TOYMLX_KERNEL_LOOPS=off)"
    if not sys.platform.startswith("linux"):
        return "off (not Linux)"
    if _hook is not None:
        return "on"
    from toymlx.backend import blas_rebind

    libc = ctypes.CDLL(None)
    real = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)(
        ctypes.cast(libc.popen, ctypes.c_void_p).value)

    def popen(command: bytes, mode: bytes) -> int | None:
        try:
            command = build_command(command.decode()).encode()
        except Exception as e:  # noqa: BLE001 -- never stop MLX's build: it runs as MLX wrote it
            warnings.warn(f"toymlx: building an MLX kernel as MLX wrote it ({e!r})", stacklevel=1)
        return real(command, mode)

    hook = _POPEN(popen)
    address = ctypes.cast(hook, ctypes.c_void_p).value
    try:
        names = blas_rebind.rebind("libmlx.so", lambda name: address if name == "popen" else None)
    except OSError as e:
        return f"off ({e})"
    if names != ["popen"]:
        return "off (libmlx.so does not call popen to build its kernels)"
    _hook = hook
    return "on"
