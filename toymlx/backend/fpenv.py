"""Subnormal floats treated as zero while a step is evaluated (flush-to-zero), on the CPU.

Why: an x86 core that meets a subnormal float (below 1.18e-38 in float32) in a multiply or an
add takes a microcode assist, ~100 times the cost of the instruction; Intel cores do, AMD's
mostly do not. A training step makes them in its tails: softmax probabilities of masked or
far-off scores, their products with values and gradients. On an Intel Xeon, a LoRA step of
SmolLM2-135M at 4 x 256 took 15-25 s with them against 3.6 s without, with the same losses to
the fourth decimal (`sgemm` spent 90% of the slow steps on such operands). PyTorch offers the
same switch as `torch.set_flush_denormal`; a GPU flushes them in its own kernels.

How: the CPU's floating-point control register of the *calling thread*: MXCSR's FTZ (results)
and DAZ (operands) bits on x86-64, FPCR's FZ bit on arm64, read and written through the C
library's `fegetenv`/`fesetenv`. A thread starts in the mode of the thread that made it, so the
threads that compute a step are made in its mode: MLX's CPU stream threads (made at a stream's
first evaluation, `toymlx.training.cpu_streams.new_streams`) and OpenBLAS's workers (made as it
loads, `toymlx.backend.blas.load`, always flushing). Small graphs MLX evaluates on the calling
thread, so the step's evaluation sets the mode there too, and restores it after
(`toymlx.backend.device.evaluating`): the user's own threads never change mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import sys
from collections.abc import Iterator
from typing import Literal

Subnormals = Literal["flush", "keep"]

_X86_FTZ_DAZ = 0x8040  # MXCSR bit 15 (flush to zero) | bit 6 (denormals are zero)
_ARM64_FZ = 1 << 24  # FPCR.FZ


class _X86Env(ctypes.Structure):  # glibc's fenv_t on x86-64: the x87 environment, then MXCSR
    _fields_ = [("x87", ctypes.c_uint16 * 14), ("mxcsr", ctypes.c_uint32)]


class _Arm64Env(ctypes.Structure):  # glibc's fenv_t on aarch64
    _fields_ = [("fpcr", ctypes.c_uint32), ("fpsr", ctypes.c_uint32)]


def _control() -> tuple[type[ctypes.Structure], str, int] | None:
    """(glibc's fenv_t, its control field, the flush bits) on this platform; None where
    toymlx does not set the mode (macOS, Windows, other CPUs)."""
    if not sys.platform.startswith("linux"):
        return None
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return _X86Env, "mxcsr", _X86_FTZ_DAZ
    if machine in ("aarch64", "arm64"):
        return _Arm64Env, "fpcr", _ARM64_FZ
    return None


_libm: ctypes.CDLL | None = None


def _env(struct: type[ctypes.Structure]) -> ctypes.Structure:
    global _libm
    if _libm is None:
        _libm = ctypes.CDLL("libm.so.6")
    env = struct()
    if _libm.fegetenv(ctypes.byref(env)) != 0:
        raise OSError("fegetenv failed")
    return env


def _set(env: ctypes.Structure) -> None:
    if _libm is None or _libm.fesetenv(ctypes.byref(env)) != 0:
        raise OSError("fesetenv failed")


def flushing() -> bool | None:
    """Whether this thread treats subnormals as zero now (None: toymlx cannot tell here)."""
    control = _control()
    if control is None:
        return None
    struct, field, bits = control
    return getattr(_env(struct), field) & bits == bits


def describe(mode: Subnormals) -> str:
    """What run_start's `math.subnormals` records: the mode and whether it takes effect here."""
    if mode == "keep":
        return "keep"
    return "flush" if _control() is not None else f"keep (flush not supported on " \
        f"{sys.platform} {platform.machine()})"


@contextlib.contextmanager
def subnormals(mode: Subnormals) -> Iterator[None]:
    """Within: this thread (and the BLAS threads it calls) computes with subnormals flushed to
    zero (`flush`) or as IEEE arithmetic has them (`keep`); the previous mode after."""
    if mode not in ("flush", "keep"):
        raise ValueError(f"subnormals: expected flush or keep, found {mode!r}")
    control = _control()
    if control is None:
        yield
        return
    struct, field, bits = control
    env = _env(struct)
    before = getattr(env, field)
    want = before | bits if mode == "flush" else before & ~bits
    if want == before:
        yield
        return
    setattr(env, field, want)
    _set(env)
    try:
        yield
    finally:
        env = _env(struct)
        setattr(env, field, before)
        _set(env)
