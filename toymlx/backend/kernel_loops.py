"""MLX's strided CPU kernels rewritten so that g++ vectorises their inner loop: a `g++` in front
of the real one for MLX's kernel builds (Linux).

Why: `mx.compile` writes each fused elementwise kernel as C++ in two forms. Where every operand
has the output's shape and layout, one flat loop, which g++ vectorises. Where one operand is
broadcast (a LayerNorm's mean and scale per row, its weight per column, softmax's row maximum,
a mask) or read across (a transposed view), nested loops that step each operand's pointer by a
stride read at run time. g++ versions such a loop for strides of 1 only, so a loop where one
operand repeats (stride 0) runs one element at a time: (1600, 192) `(x - mu) * rstd * w + b`
took 685 us against 127 us for `x * 2 + 1` over the same array, and those loops were 8-12% of a
CPU training step (docs/RESULTS.md, session 28).

How: MLX builds a kernel by running `g++ ... <kernel>.cpp -o <kernel>.so` through the shell, so
`install` puts a `g++` of toymlx's first on this process's PATH. It runs `main` here, which
rewrites the innermost loop of an MLX strided kernel before handing the unchanged command to the
real compiler. The rewritten loop takes the row in chunks of `CHUNK` elements: an operand with
stride 1 is read in place; one with stride 0 is copied into a chunk-long buffer once a row (its
one value, repeated); any other stride is gathered into the buffer. The loop over the chunk then
reads every operand contiguously, the body MLX wrote (the same statements, in the same order)
runs on vectors, and the results are written where MLX's loop wrote them. The three variants
differ only in where an operand's value is read from, so each element's arithmetic is MLX's
own, bit for bit (the kernels' target has no fused multiply-add). Two statements change form,
not value, where g++ 12 would not vectorise them: a bool is read as its byte, and a bool cast
to a number is a choice of 1 or 0. Rows shorter than `MIN_WIDTH` keep MLX's loop. Any source
this does not recognise is compiled as MLX wrote it; any other command passes through
unchanged. Of the 252 strided kernels in a training cache, g++ vectorises 199 rewritten loops;
the rest hold float16 or bfloat16, sqrt or rsqrt (which set errno), or bit operations on bytes.

The shim, the real compiler after it and everything that compiler runs ignore SIGINT, SIGTERM,
SIGHUP and SIGPIPE (a signal ignored stays ignored across exec): a terminal's Ctrl-C reaches every
process of its foreground group, MLX's kernel build too, and a build stopped there failed the
step it was building for. The run counts the signal itself and stops after the step
(`toymlx.backend.stop.StopSignals`); a run that leaves at once (a second Ctrl-C) leaves the build
in flight to finish its library, whose output pipe then has no reader.

Kernels built this way live in a kernel folder of their own: `identity()` is part of the
kernel header's tag (`toymlx.backend.kernel_pch.header_tag`). `TOYMLX_KERNEL_LOOPS=off` leaves
MLX's loops as they are.

This file runs as a script (`python -S`) for every kernel build: the standard library only.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import sys
from pathlib import Path

CHUNK = 256
"""Elements of a row taken at a time (each operand's buffer: 1 KB of float32, on the stack)."""

MIN_WIDTH = 16
"""Rows shorter than this keep MLX's element-at-a-time loop (a chunk's set-up costs more there:
rows of 2 took 2.1 ms against 0.9-1.5 ms)."""

_SIGNATURE = re.compile(
    r"void (\w+_strided_(\d+))\(int\* shape, int64_t\*\* strides, void\*\* args\) \{\n")
_ARG = re.compile(r"^  (\w+)\* (\w+) = \(\w+\*\)args\[\d+\];$", re.MULTILINE)
_STRIDES = re.compile(r"^  const int64_t\* (\w+)_strides = strides\[\d+\];$", re.MULTILINE)
_READ = re.compile(r"  (\w+) tmp_(\w+) = \*(\w+);")
_WRITE = re.compile(r"  \*(\w+)\+\+ = tmp_(\w+);")
_STEP = re.compile(r"  (\w+) \+= (\w+)_strides\[(\d+)\];")
_TEMP = re.compile(r"  (\w+) tmp_(\w+) = .*;")
_CAST = re.compile(r"  (\w+) tmp_(\w+) = static_cast<(\w+)>\(tmp_(\w+)\);")


def _choice(line: str, bools: set[str]) -> str:
    """`line`, where it casts a bool temporary to a number type, as a choice of 1 or 0."""
    cast = _CAST.fullmatch(line)
    if cast is None or cast.group(4) not in bools or cast.group(3) == "bool":
        return line
    t, name, to, src = cast.groups()
    return f"  {t} tmp_{name} = tmp_{src} ? static_cast<{to}>(1) : static_cast<{to}>(0);"


def rewrite(source: str) -> str | None:
    """`source` (an MLX strided kernel) with its innermost loop chunked as the module says, or
    None where it is not one in the form MLX 0.32 writes."""
    sig = _SIGNATURE.search(source)
    if sig is None:
        return None
    last = int(sig.group(2)) - 1
    head = f"  for (int i{last} = 0; i{last} < shape[{last}]; ++i{last}) {{\n"
    start = source.find(head, sig.end())
    end = source.find("\n  }\n", start)
    if start < 0 or end < 0:
        return None
    end += len("\n  }\n")
    preamble = source[sig.end():start]
    types = {name: t for t, name in _ARG.findall(preamble)}
    strided = _STRIDES.findall(preamble)
    reads: list[tuple[str, str]] = []  # (the value's type, operand) of each strided operand
    body: list[str] = []  # MLX's other statements before the writes (constants, scalars, ops)
    writes: list[tuple[str, str]] = []  # (output, its value)
    steps: list[str] = []  # the operands whose pointers the loop steps
    for line in source[start + len(head):end - len("  }\n")].splitlines():
        read, write, step = _READ.fullmatch(line), _WRITE.fullmatch(line), _STEP.fullmatch(line)
        if read and read.group(2) == read.group(3) and not (writes or steps):
            reads.append((read.group(1), read.group(3)))
        elif write and not steps:
            writes.append((write.group(1), write.group(2)))
        elif step and step.group(1) == step.group(2) and step.group(3) == str(last):
            steps.append(step.group(1))
        elif line.startswith("  ") and not (writes or steps):
            body.append(line)
        else:
            return None
    operands = [x for _, x in reads]
    if (sorted(steps) != sorted(operands) or sorted(strided) != sorted(operands) or not writes
            or any(x not in types for x in operands) or any(o not in types for o, _ in writes)):
        return None
    # rows shorter than MIN_WIDTH: MLX's loop, kept from vectorising (an empty asm that may touch
    # memory: g++ would otherwise version it for strides of 1 at thrice the build time)
    scalar = source[start:end].rstrip("\n").replace(
        head, head + '  __asm__ volatile("" ::: "memory");\n', 1)
    loop = ["  {", f"  const int n_ = shape[{last}];", f"  if (n_ < {MIN_WIDTH}) {{", scalar,
            "  } else {"]
    for _, x in reads:
        loop += [f"  const int64_t {x}_s_ = {x}_strides[{last}];",
                 f"  alignas(64) {types[x]} {x}_b_[{CHUNK}];"]
    loop += [f"  for (int c_ = 0; c_ < n_; c_ += {CHUNK}) {{",
             f"  const int m_ = n_ - c_ < {CHUNK} ? n_ - c_ : {CHUNK};"]
    for _, x in reads:
        t = types[x]
        loop += [
            f"  const {t}* {x}_p_ = {x} + c_;",
            f"  if ({x}_s_ == 0) {{",
            (f"    if (c_ == 0) {{ const {t} v_ = *{x}; "
             f"for (int k_ = 0; k_ < m_; ++k_) {x}_b_[k_] = v_; }}"),
            f"    {x}_p_ = {x}_b_;",
            f"  }} else if ({x}_s_ != 1) {{",
            f"    for (int k_ = 0; k_ < m_; ++k_) {x}_b_[k_] = {x}[(int64_t)(c_ + k_) * {x}_s_];",
            f"    {x}_p_ = {x}_b_;",
            "  }",
        ]
    loop += [f"  {types[o]}* {o}_p_ = {o} + c_;" for o, _ in writes]
    loop += ["  #pragma GCC ivdep", "  for (int i_ = 0; i_ < m_; ++i_) {"]
    # a bool made a number as a choice between the two: the same values, and g++ 12 vectorises
    # it (it does not vectorise a loop that converts a bool to a float)
    bools = {x for t, x in reads if t == "bool"} | {
        m.group(2) for m in map(_TEMP.fullmatch, body) if m and m.group(1) == "bool"}
    body = [_choice(line, bools) for line in body]
    # a bool is read as its byte: g++ 12 does not vectorise a loop that loads bools as such
    loop += [f"  {t} tmp_{x} = ((const unsigned char*){x}_p_)[i_] != 0;" if t == "bool"
             else f"  {t} tmp_{x} = {x}_p_[i_];" for t, x in reads]
    loop += body
    loop += [f"  {o}_p_[i_] = tmp_{v};" for o, v in writes]
    loop += ["  }", "  }"]
    loop += [f"  {x} += {x}_s_ * n_;" for x in operands]
    loop += [f"  {o} += n_;" for o, _ in writes]
    loop += ["  }", "  }"]
    return source[:start] + "\n".join(loop) + "\n" + source[end:]


def identity() -> str:
    """What decides the rewritten loops (this file's code), or "off": part of the kernel
    header's tag, so kernels built with other loops are never found by this build."""
    if os.environ.get("TOYMLX_KERNEL_LOOPS") == "off":
        return "loops: off"
    return "loops: " + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


_MARK = "# toymlx.backend.kernel_loops: MLX's strided kernels vectorised"


def is_shim(path: str | os.PathLike) -> bool:
    """Whether `path` is a `g++` that `install` wrote."""
    try:
        with open(path, "rb") as f:
            return _MARK.encode() in f.read(256)
    except OSError:
        return False


def install(cache: str | os.PathLike, compiler: str) -> str:
    """Put a `g++` that rewrites MLX's strided kernels and then runs `compiler`, deaf to the stop
    signals, first on this process's PATH (MLX's kernel builds and every process started from
    here find it), in place of any other toymlx's; return what `backend_info` records: the
    shim, or "off (why)". The shim names this Python, this file and `compiler`, and lives in a
    folder of `cache` named after them: installs sharing a kernel cache each keep their own."""
    if os.environ.get("TOYMLX_KERNEL_LOOPS") == "off":
        return "off (TOYMLX_KERNEL_LOOPS=off)"
    # MLX asks `g++ --version` once a process through system(), which ignores SIGINT in the
    # caller while it runs: through Python that took ~80 ms, and a Ctrl-C then was lost (the
    # run trained on to its end); the compiler itself answers in a few ms
    text = (f"#!/bin/sh\n{_MARK}\ntrap '' HUP INT PIPE TERM\n"
            f"[ \"$*\" = --version ] && exec {shlex.quote(compiler)} --version\n"
            f"exec {shlex.quote(sys.executable)} -S -E {shlex.quote(str(Path(__file__)))} "
            f"{shlex.quote(compiler)} \"$@\"\n")
    shim = Path(cache) / f"bin-{hashlib.sha256(text.encode()).hexdigest()[:10]}" / "g++"
    tmp = shim.with_name(f".g++.{os.getpid()}")
    try:
        if not shim.is_file() or shim.read_text() != text:
            shim.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.chmod(0o755)
            os.replace(tmp, shim)  # a build running now sees the whole file or none
    except OSError as e:
        _discard(tmp)
        return f"off ({' '.join(str(e).split())[:200]})"
    uninstall()
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(shim.parent), path]) if path else str(shim.parent)
    return str(shim)


def uninstall() -> None:
    """Take any shim `install` put on PATH off it again: a process that keeps MLX's loops
    (`TOYMLX_KERNEL_LOOPS=off`, no PCH) may have been started by one that put it there."""
    path = os.environ.get("PATH")
    if path is None:
        return
    kept = [d for d in path.split(os.pathsep) if not (d and is_shim(os.path.join(d, "g++")))]
    if len(kept) != len(path.split(os.pathsep)):
        os.environ["PATH"] = os.pathsep.join(kept)


def _rewrite_file(path: Path) -> None:
    """Rewrite the kernel in `path` in place (through a temporary file) where it is an MLX
    strided kernel; leave it as MLX wrote it otherwise, or if anything fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        new = rewrite(path.read_text())
        if new is not None:
            tmp.write_text(new)
            os.replace(tmp, path)
    except (OSError, UnicodeDecodeError, ValueError):
        _discard(tmp)  # MLX's own loop: slower, never wrong


def _discard(tmp: Path) -> None:
    """Remove a failed write's temporary (a full disk is left no fuller); `atomic.discard`,
    which this file, run by the shim as a script without toymlx on its path, cannot import."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def main(argv: list[str]) -> None:
    """The shim: `argv` is the real compiler and its arguments. Each MLX strided kernel among
    the sources is rewritten (unless `TOYMLX_KERNEL_LOOPS=off`: a process started with it from
    one that installed the shim), then the real compiler runs the command as given."""
    compiler, args = argv[0], argv[1:]
    if os.environ.get("TOYMLX_KERNEL_LOOPS") != "off":
        for source in args:
            if source.endswith(".cpp"):
                _rewrite_file(Path(source))
    os.execv(compiler, [compiler, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
