"""Transcendental functions that MLX's CPU backend runs fast, with the same values.

Why: the Linux `mlx[cpu]` wheel computes exp, erf, sigmoid and tanh one element at a time
through software fma calls (12-35 ns per element against ~0.5 ns in PyTorch), and those ops
took over half of every training step. Adds, multiplies, compares, casts and bit shifts, on
the other hand, are fused by `mx.compile` into C++ loops that g++ vectorises. So each function
here is written with only those ops:

- `exp`: Cody-Waite reduction x = n ln2 + r with |r| <= ln2/2, e^r from Cephes' degree-5
  minimax polynomial (`expf`), and 2**n assembled in the float's exponent bits. Max relative
  error 1.2e-7 over float32's normal range (MLX's own exp: 1.5e-6; numpy's float32: 2.0e-7).
  Exactly 0 below x = -87 (e**-87 = 1.6e-38, next to float32's smallest normal), so no result
  is subnormal (an Intel core computes on those through slow microcode assists) and exp(-inf)
  is 0; inf above 88.72 (float32's largest finite is e**88.7228); NaN in, NaN out.
- `erf`: the odd/even rational minimax approximation on [-4, 4] used by XLA and Eigen for
  float32 (beyond 4, erf is +-1 in float32); max absolute error ~1e-7, no exp at all.
- `sigmoid`, `silu`, `gelu` (exact erf form), `softmax`, `logsumexp` on top of those, each
  with a hand-written backward (`mx.custom_function`) that reuses the forward's output
  instead of differentiating the polynomials.

Who uses them: a model built with `Ops(kernels="vectorised")` (`toymlx.models.ops`), which the
trainer picks for float32 training on MLX's CPU. Forward-only code keeps MLX's own ops: on
SmolLM2-135M their logits sit 6.6e-5 from llama.cpp's against 1.04e-4 with these forms, although
each form here is the more accurate one per element (float32 rounding that happens to cancel
better with MLX's sigmoid), and the interop contract is 1e-4. Metal and CUDA have fast fused
kernels of their own.
The chains are kept shallow (Estrin's scheme) because `mx.compile` fuses at most 11 levels of
ops into one kernel.

Fewer loops: `kernel_source` is C++ that makes MLX's compiled CPU kernels compute float32 exp
and erf with these same polynomials (toymlx's precompiled header carries it). Where set-up
checked that (`toymlx.backend.device.kernel_forms`), a compiled training step asks for MLX's own
exp and erf ops instead (`in_kernel=True`, `Ops.kernel_forms`): the same values, bit for bit, in
one fused loop each instead of 2-6.
"""

from __future__ import annotations

import functools
import math
import types

import mlx.core as mx
import numpy as np

LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 = HI + LO, HI exact in few bits
_ROUND = 12582912.0  # 1.5 * 2**23: (y + _ROUND) - _ROUND rounds a float32 |y| < 2**22
_EXP_LO, _EXP_HI = -87.0, 89.0  # exp is clamped to these: -87 rounds to n = -126, whose
# scale 2**(n-1) = 2**-127 is assembled as exponent bits 0, i.e. +0.0 (so exp is exactly 0 for
# x <= -87 and a normal float above: e**-86.9 = 1.8e-38 against float32's smallest normal of
# 1.2e-38); n = 128 at 89, where e**x overflows to inf as in IEEE arithmetic (above 88.7228)
_EXP_P = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3,
          1.3981999507e-3, 1.9875691500e-4)  # Cephes expf: e^r = 1 + r + r^2 P(r)
_EXP_2P = tuple(2.0 * c for c in _EXP_P)  # exact doubling, in float32 too
_ERF_A = (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04,
          -5.69250639462346e-05, -2.10102402082508e-06, 2.77068142495902e-08,
          -2.72614225801306e-10)  # numerator, odd powers x^1 .. x^13
_ERF_B = (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03,
          -2.13374055278905e-04, -1.45660718464996e-05)  # denominator, even powers x^0 .. x^8
_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _only(primals):
    """The single primal of a one-argument custom_function (MLX passes it bare or in a tuple)."""
    return primals[0] if isinstance(primals, (tuple, list)) else primals


def _bits(value: float) -> int:
    """The int32 that has the same bits as float32 `value`."""
    return int(np.array(value, np.float32).view(np.int32))


_SIGN, _MAGNITUDE = -(2**31), 2**31 - 1
_INF_BITS = 0x7F800000  # a float32 magnitude's bits above this are NaN


def _clamp(x: mx.array, lo: float, hi: float, negate: bool = False) -> mx.array:
    """x (or -x with `negate`) clamped to [lo, hi] (lo < 0 < hi) on its bits: a float's
    magnitude orders like its bits read as an integer, and integer min has no NaN test (MLX's
    float min/max/where do, and that keeps g++ from vectorising a fused loop). The two views
    also end the fused kernel here. NaN passes through unchanged (its magnitude, above
    infinity's, is kept where the bound would be)."""
    b = mx.view(x, mx.int32)
    if negate:
        b = mx.bitwise_xor(b, _SIGN)
    sign = mx.bitwise_and(b, _SIGN)
    magnitude = mx.bitwise_and(b, _MAGNITUDE)
    bound = _bits(hi) + mx.bitwise_and(mx.right_shift(b, 31), _bits(-lo) - _bits(hi))
    nan = mx.right_shift(_INF_BITS - magnitude, 31)  # all ones where x is NaN, else 0
    kept = mx.bitwise_or(mx.minimum(magnitude, bound), mx.bitwise_and(nan, magnitude))
    return mx.view(mx.bitwise_or(sign, kept), mx.float32)


def _kernel_end(x: mx.array, in_kernel: bool = False) -> mx.array:
    """x, ending `mx.compile`'s fused kernel here (two free views); x itself with `in_kernel`.

    Why it matters: `mx.compile` fuses at most 11 levels of ops into one kernel; an operand
    met deeper than that (typically the broadcast of a constant) becomes an input of the
    kernel, and one broadcast input switches the whole kernel to its strided loop, which g++
    does not vectorise (3-10x slower). Every kernel here is kept within 10 levels, and a caller
    may stack at most `_EXP_SLACK` levels on top of `_exp`'s result. With `in_kernel`, exp and
    erf are one op each, and no chain comes near the limit."""
    return x if in_kernel else mx.view(mx.view(x, mx.int32), mx.float32)


_EXP_SLACK = 2
"""Levels of ops a caller may put above `_exp(...)` in the same fused kernel."""


def _exp(x: mx.array, negate: bool = False, clamp: bool = True,
         in_kernel: bool = False) -> mx.array:
    """e**x (e**-x with `negate`) in float32 from adds, multiplies and bit operations (no
    autodiff of its own): exactly 0 for x <= _EXP_LO (-inf included), inf past 88.7228, NaN
    for NaN. `clamp=False` is for callers that already keep x inside
    [_EXP_LO, _EXP_HI] (one memory pass less). `in_kernel`: MLX's exp op, which the kernel
    header computes as this (`kernel_source`), bit for bit.

    Four fused loops: the clamp, the reduced argument r, the scale 2**(n-1) assembled in the
    exponent bits, and the polynomial (which the caller's next `_EXP_SLACK` levels join)."""
    if in_kernel:
        return mx.exp(-x if negate else x)
    if clamp:
        x = _clamp(x, _EXP_LO, _EXP_HI, negate)
    elif negate:
        x = -x
    n = (x * LOG2E + _ROUND) - _ROUND  # nearest integer to x / ln2, in [-126, 128]
    r = _kernel_end((x - n * _LN2_HI) - n * _LN2_LO)  # |r| <= ln2 / 2, exact to a few ulp
    # The same n again, formed differently so that mx.compile does not share (and so
    # materialise) it between the two loops; (y - R) + R rounds exactly like (y + R) - R.
    n_int = (((x * (2 * LOG2E)) * 0.5 - _ROUND) + _ROUND).astype(mx.int32)
    # 2**(n-1) from its exponent bits: n reaches 128 at the top of the range
    half_two_n = mx.view(mx.left_shift(n_int + 126, 23), mx.float32)
    r2 = r * r
    q = _EXP_2P  # 2 * Cephes' coefficients: 2 e^r = (2 + 2r) + r^2 (2 P(r)), bit for bit
    p = ((q[0] + q[1] * r) + r2 * (q[2] + q[3] * r)) + (r2 * r2) * (q[4] + q[5] * r)
    return ((2.0 + 2.0 * r) + r2 * p) * half_two_n  # depth 8 down to its deepest constant


def _erf(x: mx.array, in_kernel: bool = False) -> mx.array:
    """erf(x) in float32 as x P(x^2) / Q(x^2) on [-4, 4] (+-1 beyond, to float32 precision:
    the rational is exactly +-1 at +-4). `in_kernel`: MLX's erf op, computed as this by the
    kernel header (`kernel_source`), bit for bit."""
    if in_kernel:
        return mx.erf(x)
    x = _clamp(x, -4.0, 4.0)
    z = x * x
    z2 = z * z
    z4 = z2 * z2
    a = _ERF_A
    p = ((a[0] + a[1] * z) + z2 * (a[2] + a[3] * z)) + z4 * ((a[4] + a[5] * z) + z2 * a[6])
    b = _ERF_B
    q = ((b[0] + b[1] * z) + z2 * (b[2] + b[3] * z)) + z4 * b[4]
    return x * p / q  # depth 8 down to its deepest constant


def _float(c: float) -> str:
    """`c` rounded to float32, as an exact C++ float literal (hexadecimal)."""
    return float.hex(float(np.float32(c))) + "f"


def kernel_source() -> str:
    """C++ that makes MLX's CPU kernels compute float32 exp and erf as `_exp` and `_erf` do.

    Why: `in_kernel` forms. The composed forms above cost 2-6 fused loops each, every loop a
    pass over memory (a GELU's backward takes 7), because `mx.compile` ends a kernel at each
    view and fuses at most 11 levels. MLX's own Exp and Erf ops fuse into their neighbours as
    one level each, but the Linux wheel computes them through scalar calls. These explicit
    specialisations of MLX's `detail::Exp` and `detail::Erf` for float, placed after MLX's
    kernel preamble in the precompiled header that every kernel build reads
    (`toymlx.backend.kernel_pch`), make them the same branch-free arithmetic in the same order
    (no fused multiply-add: the header's vector target has none), which g++ vectorises inside
    the fused loop: a (1600, 768) GELU forward and backward 1.8 ms against 3.9 ms, every value
    bit for bit (`check_kernel_forms`). MLX's library kernels (ops run outside `mx.compile`)
    keep MLX's own code; so do other dtypes."""
    q, a, b, f = _EXP_2P, _ERF_A, _ERF_B, _float
    return f"""
namespace mlx::core::detail {{
namespace toymlx_fastmath {{
inline int32_t bits(float x) {{ int32_t b; __builtin_memcpy(&b, &x, 4); return b; }}
inline float from_bits(int32_t b) {{ float x; __builtin_memcpy(&x, &b, 4); return x; }}
// x clamped to [-lo, hi] on its bits (NaN kept), as fastmath._clamp
inline float clamp(float x, int32_t lo_bits, int32_t hi_bits) {{
  int32_t b = bits(x);
  int32_t magnitude = b & INT32_MAX;
  int32_t bound = hi_bits + ((b >> 31) & (lo_bits - hi_bits));
  int32_t nan = (0x7F800000 - magnitude) >> 31;
  int32_t kept = (magnitude < bound ? magnitude : bound) | (nan & magnitude);
  return from_bits((b & INT32_MIN) | kept);
}}
}}  // namespace toymlx_fastmath
template <> inline float Exp::operator()(float x) {{
  x = toymlx_fastmath::clamp(x, {_bits(-_EXP_LO)}, {_bits(_EXP_HI)});
  float n = (x * {f(LOG2E)} + {f(_ROUND)}) - {f(_ROUND)};
  float r = (x - n * {f(_LN2_HI)}) - n * {f(_LN2_LO)};
  float half_two_n = toymlx_fastmath::from_bits(
      (int32_t)((uint32_t)((int32_t)n + 126) << 23));
  float r2 = r * r;
  float p = (({f(q[0])} + {f(q[1])} * r) + r2 * ({f(q[2])} + {f(q[3])} * r))
      + (r2 * r2) * ({f(q[4])} + {f(q[5])} * r);
  return ((2.0f + 2.0f * r) + r2 * p) * half_two_n;
}}
template <> inline float Erf::operator()(float x) {{
  x = toymlx_fastmath::clamp(x, {_bits(4.0)}, {_bits(4.0)});
  float z = x * x;
  float z2 = z * z;
  float z4 = z2 * z2;
  float p = (({f(a[0])} + {f(a[1])} * z) + z2 * ({f(a[2])} + {f(a[3])} * z))
      + z4 * (({f(a[4])} + {f(a[5])} * z) + z2 * {f(a[6])});
  float q = (({f(b[0])} + {f(b[1])} * z) + z2 * ({f(b[2])} + {f(b[3])} * z)) + z4 * {f(b[4])};
  return x * p / q;
}}
}}  // namespace mlx::core::detail
"""


CHECK_VALUES = np.concatenate([
    np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, 1e-30, -88.0, -87.5, -87.0,
              -86.9, 88.72, 88.73, 89.0, 100.0, 4.0, -4.0, 3.999, 5.657, -5.657], np.float32),
    np.linspace(-100.0, 100.0, 40_001, dtype=np.float32),
    np.random.default_rng(0).standard_normal(20_000).astype(np.float32) * 3.0])
"""Where `check_kernel_forms` compares: the edges of both ranges, IEEE specials, a sweep."""


def check_kernel_forms() -> str | None:
    """Whether MLX's compiled CPU kernels compute exp and erf exactly as the composed forms:
    None where every value of `CHECK_VALUES` has the same bits (NaN for NaN), else why not.
    Two small kernels, built once into the kernel folder."""
    x = mx.array(CHECK_VALUES)
    with mx.stream(mx.cpu):
        # each op fused with a multiply: an op left alone in a compiled graph is not fused, and
        # runs MLX's library code (one graph for both would share v * 1.0 between them)
        kernels = [mx.compile(lambda v: mx.exp(v * 1.0))(x), mx.compile(lambda v: mx.erf(v * 1.0))(x)]
        composed = [_exp(x * 1.0), _erf(x * 1.0)]
        mx.eval(kernels, composed)
    for name, got, want in zip(("exp", "erf"), kernels, composed):
        got, want = np.array(got), np.array(want)
        same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
        if not same.all():
            i = int(np.argmin(same))
            return (f"MLX's kernels compute {name}({CHECK_VALUES[i]!r}) = {got[i]!r}, the "
                    f"composed form {want[i]!r}")
    return None


@functools.cache
def _functions(in_kernel: bool):
    """The differentiable functions, built once for each way of computing exp and erf (each
    `mx.custom_function` holds its own backward)."""

    # exp and erf alone: with in_kernel, multiplied by 1 (exactly x) so that MLX's op shares a
    # fused kernel (a custom function's body is fused apart from its callers, and an op left
    # alone runs MLX's library code)
    @mx.custom_function
    def exp(x):
        return _exp(x * 1.0 if in_kernel else x, in_kernel=in_kernel)

    @exp.vjp
    def _exp_vjp(primals, cotangent, output):
        return (cotangent * output,)

    @mx.custom_function
    def erf(x):
        return _erf(x * 1.0 if in_kernel else x, in_kernel)

    @erf.vjp
    def _erf_vjp(primals, cotangent, output):
        x = _only(primals)
        return ((cotangent * (2.0 / math.sqrt(math.pi))) * _exp(-(x * x), in_kernel=in_kernel),)

    @mx.custom_function
    def sigmoid(x):
        return 1.0 / (1.0 + _exp(x, negate=True, in_kernel=in_kernel))

    @sigmoid.vjp
    def _sigmoid_vjp(primals, cotangent, output):
        return (cotangent * output * (1.0 - output),)

    @mx.custom_function
    def silu(x):
        return x / (1.0 + _exp(x, negate=True, in_kernel=in_kernel))

    @silu.vjp
    def _silu_vjp(primals, cotangent, output):
        x = _only(primals)
        if in_kernel:  # e**-x as x * -1, not -x: see the GELU's backward
            s = 1.0 / (1.0 + mx.exp(x * -1.0))
        else:
            s = _kernel_end(1.0 / (1.0 + _exp(x, negate=True)))
        return (cotangent * (s + output * (1.0 - s)),)

    @mx.custom_function
    def gelu(x):
        return (0.5 * x) * (1.0 + _erf(x * _SQRT1_2, in_kernel))

    @gelu.vjp
    def _gelu_vjp(primals, cotangent, output):
        x = _only(primals)
        if in_kernel:
            # Phi(x) from erf(-x / sqrt 2), the same bits (erf here is exactly odd): written as
            # the forward pass writes it, mx.compile would share the erf between the two passes
            # and keep it in memory, a loop and two passes over the activation more
            cdf = 0.5 - 0.5 * mx.erf(x * -_SQRT1_2)
        else:
            cdf = _kernel_end(0.5 + 0.5 * _erf(x * _SQRT1_2))
        pdf = _exp((x * x) * -0.5, in_kernel=in_kernel)  # Phi'(x) sqrt(2 pi)
        return (cotangent * cdf + ((cotangent * x) * _INV_SQRT_2PI) * pdf,)

    @mx.custom_function
    def softmax(x):
        e = _exp(x - mx.stop_gradient(x.max(-1, keepdims=True)), in_kernel=in_kernel)
        return e * (1.0 / _row_sum(e))

    @softmax.vjp
    def _softmax_vjp(primals, cotangent, output):
        return (output * (cotangent - _row_sum(cotangent * output)),)

    @mx.custom_function
    def attend(s, v):
        p = softmax(s)
        return p @ v, p

    @attend.vjp
    def _attend_vjp(primals, cotangents, outputs):
        # softmax's backward row sums sum(dP * P) over the S keys; they equal sum(dO * O) over
        # the hd values (O = P v, dP = dO v^T), a row as wide as a head (FlashAttention's D);
        # the price: the output is kept for the backward pass (`toymlx.training.memory` counts it)
        v = primals[1]
        d_out = cotangents[0]
        out, p = outputs
        ds = p * (d_out @ v.swapaxes(-1, -2) - _row_sum(d_out * out))
        return ds, p.swapaxes(-1, -2) @ d_out

    @mx.custom_function
    def logsumexp(x):
        m = x.max(-1, keepdims=True)
        m = mx.where(mx.isinf(m), 0.0, m)  # all -inf rows: log(0) = -inf, not NaN (-inf - -inf)
        return mx.log(_row_sum(_exp(x - m, in_kernel=in_kernel))) + m

    @logsumexp.vjp
    def _logsumexp_vjp(primals, cotangent, output):
        x = _only(primals)
        return (cotangent * _exp(x - output, in_kernel=in_kernel),)

    return types.SimpleNamespace(exp=exp, erf=erf, sigmoid=sigmoid, silu=silu, gelu=gelu,
                                 softmax=softmax, attend=attend, logsumexp=logsumexp)


# Each function below takes `in_kernel`: False (the default) computes exp and erf from the
# composed forms, fused loops that any MLX evaluates the same; True uses MLX's own exp and erf
# ops, which compute the same values in one loop where the kernel header carries
# `kernel_source` (`toymlx.backend.device.kernel_forms`), the function runs under
# `mx.compile`, and the op is fused with another elementwise op (each form here makes sure of
# it): an op run alone, or outside `mx.compile`, runs MLX's library code (other values, scalar
# speed).


def exp(x: mx.array, in_kernel: bool = False) -> mx.array:
    """e**x, elementwise (float32)."""
    return _functions(in_kernel).exp(x)


def erf(x: mx.array, in_kernel: bool = False) -> mx.array:
    """The error function, elementwise (float32)."""
    return _functions(in_kernel).erf(x)


def sigmoid(x: mx.array, in_kernel: bool = False) -> mx.array:
    """1 / (1 + e**-x), elementwise."""
    return _functions(in_kernel).sigmoid(x)


def silu(x: mx.array, in_kernel: bool = False) -> mx.array:
    """x * sigmoid(x) (SwiGLU's gate), elementwise."""
    return _functions(in_kernel).silu(x)


def gelu(x: mx.array, in_kernel: bool = False) -> mx.array:
    """x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2)): the exact GELU (timm's, `nn.gelu`)."""
    return _functions(in_kernel).gelu(x)


def softmax(x: mx.array, in_kernel: bool = False) -> mx.array:
    """Softmax over the last axis (-inf entries give exactly 0; a row of all -inf gives NaN,
    as the exact softmax does)."""
    return _functions(in_kernel).softmax(x)


def logsumexp(x: mx.array, in_kernel: bool = False) -> mx.array:
    """log(sum(e**x)) over the last axis (kept as a size-1 axis)."""
    return _functions(in_kernel).logsumexp(x)


def cross_entropy(logits: mx.array, targets: mx.array, in_kernel: bool = False) -> mx.array:
    """Per-row cross-entropy over the last axis (no reduction): logsumexp - picked logit."""
    picked = mx.take_along_axis(logits, targets[..., None], -1)  # (..., 1)
    return (logsumexp(logits, in_kernel) - picked)[..., 0]


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              causal: bool = False, block: int = 64, window: int | None = None,
              in_kernel: bool = False, softcap: float | None = None) -> mx.array:
    """softmax(q k^T scale [+ causal mask]) v for q (B,H,T,hd) and k, v (B,Hkv,S,hd), where q's
    T rows are the last T of the S positions; with GQA, query head h reads kv head
    h // (H // Hkv). Each kv head's query heads share one (rep*T, hd) x (hd, S) matmul.

    Causal attention goes `block` query rows at a time, each block against only the keys it
    can see: at T = S = 256 that computes 5/8 of the score matrix, in pieces that stay in
    cache (fwd+bwd of a (8, 8, 256, 32) GQA layer: 54 ms against 136 ms in one piece and
    119 ms for MLX's fused kernel on this CPU).

    `window` (causal only): a query sees only the keys fewer than `window` positions back
    (sliding-window attention, llama.cpp's standard SWA).

    `softcap`: the scores soft-capped to +-softcap, softcap * tanh(scores / softcap), before the
    mask (Gemma 2's attention logit soft-capping; MLX's own tanh, one scalar loop).
    """
    B, H, T, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    rep = H // n_kv
    if scale != 1.0:
        q = q * scale
    if not causal or (T == 1 and (window is None or S <= window)):
        s = q.reshape(B, n_kv, rep * T, hd) @ k.swapaxes(-1, -2)  # (B,Hkv,rep*T,S)
        s = _capped(s, softcap)
        return _attend(s, v, in_kernel).reshape(B, H, T, hd)  # (B,H,T,hd)
    outs = []
    # the query blocks as one split: its backward pass concatenates their gradients, where a
    # slice's writes each into a zero-filled copy of the whole q and the copies are summed (a
    # fused add of as many terms as blocks: a kernel of its own for each block count)
    q_blocks = mx.split(q, list(range(block, T, block)), axis=2)
    for a, qa in zip(range(0, T, block), q_blocks):
        b = min(a + block, T)
        end = S - T + b  # keys 0 .. end-1 are visible to some row of this block
        qb = qa.reshape(B, n_kv, rep * (b - a), hd)  # head h = kv * rep + r
        s = _capped(qb @ k[:, :, :end].swapaxes(-1, -2), softcap)  # (B,Hkv,rep*(b-a),end)
        dist = mx.arange(S - T + a, S - T + b)[:, None] - mx.arange(end)[None]  # (b-a,end)
        keep = dist >= 0 if window is None else (dist >= 0) & (dist < window)
        s = mx.where(mx.tile(keep, (rep, 1)), s, -mx.inf)
        outs.append(_attend(s, v[:, :, :end], in_kernel).reshape(B, H, b - a, hd))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)  # (B,H,T,hd)


def _attend(s: mx.array, v: mx.array, in_kernel: bool) -> mx.array:
    """softmax(s) v over the last axis of the scores s."""
    return _functions(in_kernel).attend(s, v)[0]


def _capped(s: mx.array, softcap: float | None) -> mx.array:
    """Attention scores soft-capped to +-softcap (unchanged where softcap is None)."""
    return s if not softcap else softcap * mx.tanh(s / softcap)


def _row_sum(x: mx.array) -> mx.array:
    """Sum over the last axis, kept as a size-1 axis, as one BLAS matrix-vector product (MLX's
    CPU row reduction runs ~6x slower, on one core)."""
    n = x.shape[-1]
    return (x.reshape(-1, n) @ mx.ones((n, 1), x.dtype)).reshape(*x.shape[:-1], 1)


def exp_values(x: mx.array, in_kernel: bool = False) -> mx.array:
    """e**x (float32) with no autodiff of its own: for hand-written backward passes."""
    return _exp(x, in_kernel=in_kernel)


def row_sum(x: mx.array) -> mx.array:
    """Sum over the last axis, kept as a size-1 axis (one BLAS matrix-vector product)."""
    return _row_sum(x)


def _lead_sum(x: mx.array) -> mx.array:
    """Sum over every axis but the last (a weight's or bias's gradient)."""
    rows = x.reshape(-1, x.shape[-1])
    # one BLAS vector-matrix product: MLX's CPU column reduction runs on one core
    return (mx.ones((1, rows.shape[0]), x.dtype) @ rows).reshape(x.shape[-1])


@functools.cache
def _layer_norm_fn(eps: float, affine: bool):
    @mx.custom_function
    def f(x, w, b):
        inv_n = 1.0 / x.shape[-1]
        mu = _row_sum(x) * inv_n
        var = _row_sum((mu - x) * (mu - x)) * inv_n  # two-pass variance (no cancellation)
        rstd = mx.rsqrt(var + eps)
        y = (x - mu) * rstd
        return (y * w + b if affine else y), mu, rstd

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        x, w, _ = primals
        g = cotangents[0]
        _, mu, rstd = outputs
        inv_n = 1.0 / x.shape[-1]
        xhat = (x - mu) * rstd
        gw = g * w if affine else g
        m1 = _row_sum(gw) * inv_n
        m2 = _row_sum(gw * xhat) * inv_n
        dx = (gw - m1 - xhat * m2) * rstd
        if not affine:
            return dx, mx.zeros_like(w), mx.zeros_like(w)
        return dx, _lead_sum(g * xhat), _lead_sum(g)

    return f


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None,
               eps: float) -> mx.array:
    """LayerNorm over the last axis (as `mx.fast.layer_norm`), with its row sums as BLAS
    matrix-vector products and a hand-written backward."""
    if weight is None:
        one = mx.ones((x.shape[-1],), x.dtype)
        return _layer_norm_fn(float(eps), False)(x, one, one)[0]
    b = bias if bias is not None else mx.zeros_like(weight)
    return _layer_norm_fn(float(eps), True)(x, weight, b)[0]


@functools.cache
def _rms_norm_fn(eps: float):
    @mx.custom_function
    def f(x, w):
        rstd = mx.rsqrt(_row_sum(x * x) * (1.0 / x.shape[-1]) + eps)
        return (x * rstd) * w, rstd

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        x, w = primals
        g = cotangents[0]
        rstd = outputs[1]
        gw = g * w
        m = _row_sum(gw * x) * (1.0 / x.shape[-1])
        dx = (gw - x * (m * (rstd * rstd))) * rstd
        return dx, _lead_sum(g * (x * rstd))

    return f


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """RMSNorm over the last axis (as `mx.fast.rms_norm`), with its row sum as a BLAS
    matrix-vector product and a hand-written backward."""
    return _rms_norm_fn(float(eps))(x, weight)[0]


@mx.custom_function
def _linear(x: mx.array, w: mx.array) -> mx.array:
    return x @ w.T


@_linear.vjp
def _linear_vjp(primals, cotangent, output):
    x, w = primals
    g2 = cotangent.reshape(-1, w.shape[0])
    return cotangent @ w, g2.T @ x.reshape(-1, w.shape[1])


@mx.custom_function
def _linear_bias(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    # not mx.addmm: MLX's CPU addmm first copies the broadcast bias into the output, element by
    # element, and BLAS then reads it back; a fused add is one vectorised loop
    # (toymlx.backend.kernel_loops)
    return x @ w.T + b


@_linear_bias.vjp
def _linear_bias_vjp(primals, cotangent, output):
    x, w, _ = primals
    g2 = cotangent.reshape(-1, w.shape[0])
    return cotangent @ w, g2.T @ x.reshape(-1, w.shape[1]), _lead_sum(g2)


def _permuted(x: mx.array, axes: tuple[int, ...], scale: float = 1.0) -> mx.array:
    """x.transpose(axes) * scale, written row-major in the new order, in one fused loop.

    MLX's CPU ops keep a dense operand's memory order: `x.transpose(axes) * scale` alone would
    come out laid as x is, and the reshape that reads it next would copy it again (MLX's
    general copy, one element at a time). A second operand of shape (1,) makes MLX write the
    loop's result row-major, and toymlx's kernel loops (`toymlx.backend.kernel_loops`) run it
    on vectors: (32, 3, 50, 64) to token-major in 208 us against `mx.contiguous`'s 306 us."""
    return x.transpose(axes) * mx.array([scale], x.dtype)


@functools.cache
def _heads_fn(n_heads: int, scale: float):
    @mx.custom_function
    def f(y, b):
        B, T, D = y.shape
        h = y.reshape(B, T, n_heads, D // n_heads).transpose(0, 2, 1, 3) + b.reshape(n_heads, 1, -1)
        return h if scale == 1.0 else h * scale

    @f.vjp
    def f_vjp(primals, cotangent, output):
        y, _ = primals
        g = _permuted(cotangent, (0, 2, 1, 3), scale).reshape(y.shape)  # token-major
        return g, _lead_sum(g)

    return f


def heads(y: mx.array, bias: mx.array, n_heads: int, scale: float = 1.0) -> mx.array:
    """(y + bias) * scale for a projection y (B,T,D) without its bias, split into heads
    (B,H,T,hd) and stored head-major, in one loop (the bias add and the transpose that the
    attention's products need, which `mx.addmm`'s bias fill and the matmuls' own copies of
    a strided operand did in three); the backward pass likewise, the bias's gradient as one
    matrix-vector product."""
    return _heads_fn(int(n_heads), float(scale))(y, bias)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias), as `nn.Linear`, whose weight gradient comes out of its matmul
    row-major like the weight (autodiff of `weight.T` gives the transposed, column-major
    view, and the optimizer's fused update then runs MLX's strided, unvectorised loop)."""
    return _linear(x, weight) if bias is None else _linear_bias(x, weight, bias)
