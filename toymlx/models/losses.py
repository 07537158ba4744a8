"""Losses: pure functions (model, micro-batch) -> (mean loss, count).

Per-position cross-entropy comes from the model's own `Ops` (`model.ops.cross_entropy`), so the
loss runs the same kernels and precision as the forward pass; it is float32 whatever the
activations' dtype.

A language model's [tokens x vocabulary] logits never live whole. Gemma 3's 262,144-token
vocabulary makes 4 x 256 tokens of float32 logits 1.07 GB a copy.
- A frozen output head (a LoRA base's: `Llama.frozen_head`) is read a slice of vocabulary rows
  at a time (`frozen_head_cross_entropy`): each slice's logits join a running logsumexp, and in
  a training step the input gradient accumulates beside it, so the head is read once a step
  and neither [tokens x vocabulary] nor the head's float weight is ever whole (a head held as
  blocks decodes one slice of rows at a time).
- A trained head: `lm_loss` unembeds the final hidden states `chunk` tokens at a time
  (`logits_chunk`), each chunk's logits reduced at once to its per-token losses; with more than
  one chunk, the backward pass recomputes each chunk's logits instead of keeping them, one chunk
  after another (`masked_ce_sum`); a chunk is at most `LOGITS_CHUNK_VALUES` values (16 MB), or
  32 tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

from toymlx.models.layers import row_reader
from toymlx.models.ops import recompute_in_backward

LOGITS_CHUNK_VALUES = 1 << 22
"""Most logits (tokens x vocabulary) computed at once in a loss, 16 MB of float32 a copy: the
backward pass of a chunk holds ~16 copies at its peak (the vectorised CPU kernels, compiled;
~8 with MLX's own), and every chunk reads the whole output matrix again."""


def logits_chunk(vocab: int, values: int | None = None) -> int:
    """Tokens per logits chunk for a vocabulary: `values` (the run's `Ops.logits_values`; None:
    LOGITS_CHUNK_VALUES) // vocab, rounded down to a multiple of 32 (so compiled shapes stay
    few), at least 32."""
    return max(32, (values or LOGITS_CHUNK_VALUES) // vocab // 32 * 32)


def lm_loss(model: nn.Module, batch: dict[str, mx.array], chunk: int | None = None
            ) -> tuple[mx.array, mx.array]:
    """Next-token cross-entropy averaged over the positions whose mask is 1, the logits computed
    `chunk` tokens at a time (None: `logits_chunk` of the model's vocabulary and Ops)."""
    h = model.hidden(batch["inputs"])  # (B, T, D)
    mask = batch["mask"]
    chunk = chunk or logits_chunk(model.args.vocab_size, model.ops.logits_values)
    total = masked_ce_sum(model, h, batch["targets"], mask, chunk)
    n = mask.sum()
    return total / mx.maximum(n, 1.0), n


def masked_ce_sum(model: nn.Module, h: mx.array, targets: mx.array, mask: mx.array,
                  chunk: int, grad: bool = True) -> mx.array:
    """sum(cross_entropy(model.unembed(h), targets) * mask) over (B, T): `masked_ce`'s sum."""
    return masked_ce(model, h, targets, mask, chunk, grad).sum()


def masked_ce(model: nn.Module, h: mx.array, targets: mx.array, mask: mx.array,
              chunk: int, grad: bool = True) -> mx.array:
    """cross_entropy(model.unembed(h), targets) * mask, (B, T), `chunk` tokens of
    logits at a time, each chunk recomputed in the backward pass. The per-token losses are
    joined before the masked sum, so it adds in the order the whole-logits loss does. A frozen
    head: `frozen_head_cross_entropy` (`grad`: the sum will be differentiated).

    Each chunk goes through `ops.recompute_in_backward`: its vjp recomputes its logits (none are
    kept from the forward pass) once that chunk's cotangent exists (`mx.depends`); each
    chunk's input adds 0 times the previous chunk's first loss, so the chunks depend on one
    another forward and backward. Values and gradients are unchanged, and MLX evaluates the
    chunks one after another, where its breadth-first order (the CPU step's
    `MLX_BFS_MAX_WIDTH`) computed independent ones all at once. A 1-block model with Gemma 3's
    vocabulary, 4 x 256 tokens, 64-token chunks, vectorised kernels, eager: 1.35 GB above the
    weights, against 5.1 GB with independent `mx.checkpoint` chunks and 16.4 GB unchunked;
    compiled: 1.09 against 8.2 GB unchunked."""
    B, T, D = h.shape
    N = B * T
    head = model.frozen_head()
    if head is not None:
        ce = frozen_head_cross_entropy(h.reshape(N, D), targets.reshape(N), head, model.ops,
                                       model.args.final_softcap, grad)
        return ce.reshape(B, T) * mask
    if N <= chunk:
        return _ce(model, h, targets) * mask
    h = h.reshape(1, N, D)  # (1, B*T, D): chunks may cross rows
    targets = targets.reshape(1, N)
    key = model.head_key()
    trainable = model.trainable_parameters()
    params = {key: trainable[key]} if key in trainable else {}

    def forward(p: dict, hc: mx.array, tc: mx.array) -> mx.array:
        model.update(p)  # the head's trainable weights as inputs, so their gradients flow
        return _ce(model, hc, tc)

    ce: list[mx.array] = []
    for a in range(0, N, chunk):
        hc = h[:, a:a + chunk]  # (1, chunk, D)
        if ce:  # + 0 x the previous chunk's first loss: one chunk after another (see above)
            hc = hc + (0.0 * ce[-1][:, :1, None]).astype(hc.dtype)
        tc = targets[:, a:a + chunk]
        ce.append(recompute_in_backward(lambda p, x, tc=tc: forward(p, x, tc), params, hc))
    model.update(params)  # the custom function leaves its inner arrays in the model
    return mx.concatenate(ce, axis=1).reshape(B, T) * mask


HEAD_SLICE_VALUES = 1 << 20
"""Most logits (tokens x vocabulary rows) or weights of one slice of a frozen head: 4 MB of
float32. MLX's CPU evaluation allocates the outputs of up to 10 operations ahead of those that
have run, so a slice costs ~10-16 copies of its logits at its backward pass's peak, whatever
orders the slices: the Gemma-3-270M shape's 4 x 256 step peaked 140 MB (MLX's count) higher
with 16 MB slices than with 8, and 64 MB more again with 8 than with 4, at the same step time."""
HEAD_SLICE_MIN_ROWS = 1024
"""Fewest vocabulary rows a slice reads (unless the vocabulary is smaller): each slice adds its
operations to the compiled step's graph, ~1.7 KB of memory a node, and a product of few rows
runs below the BLAS's speed. Llama 3's 128,256-token vocabulary is 126 slices at most."""


def head_slices(vocab: int, tokens: int, width: int, values: int | None = None
                ) -> list[tuple[int, int]]:
    """Row ranges of a frozen head read at once: at most `values` (the run's
    `Ops.logits_values`; None: HEAD_SLICE_VALUES) logits and as many weights, in rows a
    multiple of 256, at least HEAD_SLICE_MIN_ROWS."""
    n = max(HEAD_SLICE_MIN_ROWS,
            (values or HEAD_SLICE_VALUES) // max(tokens, width, 1) // 256 * 256)
    return [(a, min(a + n, vocab)) for a in range(0, vocab, n)]


def _head_slice_logits(x: mx.array, arrs: list[mx.array], rows: Any, a: int, b: int,
                       after: list[mx.array], softcap: float | None
                       ) -> tuple[mx.array, mx.array, mx.array | None]:
    """Rows a..b of a frozen head read once `after` is computed, and their logits: (z (N, b - a),
    soft-capped where softcap is set; the rows W_slice (b - a, D); tanh(z / softcap) or None).
    z is the product in x's dtype, float32 where soft-capped: a half-precision product widens
    exactly wherever it meets float32, so z is not kept as a float32 copy (the largest
    array of a GPU's slice)."""
    w = rows(list(mx.depends(arrs, after)), a, b).astype(x.dtype)  # (b - a, D)
    z = x @ w.T  # (N, b - a)
    if not softcap:
        return z, w, None
    th = mx.tanh(z.astype(mx.float32) / softcap)
    return softcap * th, w, th


def _targets_in_slices(t: mx.array, slices: list[tuple[int, int]]
                       ) -> list[tuple[mx.array, mx.array]]:
    """For each slice a..b of `head_slices`: each token's target as a column of the slice
    (N, 1), one inside it for a target elsewhere, and whether it lies there (N, 1). No number
    that differs from slice to slice enters the computation as a constant: MLX's CPU compiler writes constants
    into its kernels, so `t - a` once built a kernel of its own for every slice (69 of the 131
    kernels of a cold SmolLM2 LoRA step). The quotients and remainders come from `mx.divmod`,
    which `mx.compile` does not fuse, so no kernel is built for them either: with the slice width
    and the last slice's rows as constants, a remainder, a floor division and a minimum each
    built one per vocabulary and batch (5 of the 12 a SmolLM2 LoRA run built as installed)."""
    n = slices[0][1] - slices[0][0]  # every slice but the last holds n rows
    slice_of, col = mx.divmod(t, n)
    which = slice_of[:, None] == mx.arange(len(slices))[None]  # (N, slices)
    a, b = slices[-1]
    # the last slice's column of a target outside it is any column of it (`which` drops it)
    last = col if b - a == n else mx.divmod(col, b - a)[1]
    col, last = col[:, None], last[:, None]  # (N, 1)
    return [(last if i == len(slices) - 1 else col, which[:, i:i + 1])
            for i in range(len(slices))]


def frozen_head_cross_entropy(h: mx.array, targets: mx.array, head: nn.Module, ops: Any,
                              softcap: float | None = None, grad: bool = True) -> mx.array:
    """Per-token cross-entropy (N,) float32 of the logits h @ W.T (soft-capped to +-softcap),
    W the frozen `head`'s weight (V, D), read a slice of rows at a time (`head_slices`):
    logsumexp accumulated over the slices, the target's logit picked in its slice. Each slice's
    rows are read after the previous slice is done, all its sums and its picked logit
    (`mx.depends`), so one slice's weights and logits live at a time: depending on the
    logsumexp alone, every slice's logits lived until the picked logits were summed.

    The input gradient is (softmax - one-hot) @ W, each logit's term times its soft cap's slope.
    grad True (a loss the step differentiates): the forward pass accumulates it as it goes, as
    the logsumexp is, each slice's exp(z - running max) @ W_slice rescaled when the max grows,
    and the target's row picked, so the head is read once a step: one decode of a block-held
    slice and two products, against two and three. False (a forward alone: held-out scoring):
    the loss alone, and a backward pass, if one comes, recomputes each slice's logits."""
    if grad:
        return _frozen_head_ce_with_grad(h, targets, head, ops, softcap)
    arrays, rows = row_reader(head)
    N = h.shape[0]
    slices = head_slices(arrays[0].shape[0], N, h.shape[1], ops.logits_values)

    @mx.custom_function
    def ce(x: mx.array, t: mx.array, *arrs: mx.array) -> tuple[mx.array, mx.array]:
        m = mx.full((N, 1), -mx.inf, mx.float32)
        s = mx.zeros((N, 1), mx.float32)
        picked = mx.zeros((N, 1), mx.float32)
        for (a, b), (at, inside) in zip(slices, _targets_in_slices(t, slices)):
            # after both of the previous slice's reductions: its logits are then let go
            z, _, _ = _head_slice_logits(x, list(arrs), rows, a, b, [s, picked], softcap)
            top = mx.maximum(m, z.max(-1, keepdims=True))
            s = s * ops.exp_values(m - top) + ops.row_sum(ops.exp_values(z - top))
            m = top
            picked = picked + mx.where(inside, mx.take_along_axis(z, at, -1), 0.0)
        lse = m + mx.log(s)
        return (lse - picked)[:, 0], lse[:, 0]

    @ce.vjp
    def ce_vjp(primals: tuple, cotangents: Any, outputs: Any) -> tuple:
        x, t, *arrs = primals
        g_ce, g_lse = cotangents
        lse = outputs[1][:, None]
        g_all = (g_ce + g_lse)[:, None]  # d lse / dz = softmax; d picked / dz = one-hot
        dx = mx.zeros(x.shape, mx.float32)
        for a, b in slices:
            z, w, th = _head_slice_logits(x, arrs, rows, a, b, [dx], softcap)
            hot = mx.arange(a, b)[None, :] == t[:, None]  # (N, b - a)
            dz = g_all * ops.exp_values(z - lse) - mx.where(hot, g_ce[:, None], 0.0)
            if th is not None:
                dz = dz * (1.0 - th * th)
            dx = dx + (dz.astype(x.dtype) @ w).astype(mx.float32)
        return (dx.astype(x.dtype), mx.zeros_like(t), *(mx.zeros_like(v) for v in arrs))

    return ce(h, targets, *arrays)[0]


def _frozen_head_ce_with_grad(h: mx.array, targets: mx.array, head: nn.Module, ops: Any,
                              softcap: float | None) -> mx.array:
    """`frozen_head_cross_entropy` with grad: its input gradient's two terms (the softmax-weighted
    rows of W and the target's row, each times its logit's soft-cap slope) computed in the
    forward pass and read by the backward pass."""
    arrays, rows = row_reader(head)
    N, D = h.shape
    slices = head_slices(arrays[0].shape[0], N, D, ops.logits_values)

    @mx.custom_function
    def ce(x: mx.array, t: mx.array, *arrs: mx.array) -> tuple[mx.array, ...]:
        m = mx.full((N, 1), -mx.inf, mx.float32)
        s = mx.zeros((N, 1), mx.float32)
        picked = mx.zeros((N, 1), mx.float32)
        soft = mx.zeros((N, D), mx.float32)  # sum of exp(z - m) x slope x W's rows
        target = mx.zeros((N, D), mx.float32)  # the target's row of W x its slope
        for (a, b), (at, inside) in zip(slices, _targets_in_slices(t, slices)):
            z, w, th = _head_slice_logits(x, list(arrs), rows, a, b,
                                          [s, picked, soft, target], softcap)
            slope = None if th is None else 1.0 - th * th
            top = mx.maximum(m, z.max(-1, keepdims=True))
            rescale = ops.exp_values(m - top)  # 0 for the first slice (m = -inf)
            e = ops.exp_values(z - top)
            s = s * rescale + ops.row_sum(e)
            weighted = e if slope is None else e * slope
            soft = soft * rescale + (weighted.astype(x.dtype) @ w).astype(mx.float32)
            m = top
            picked = picked + mx.where(inside, mx.take_along_axis(z, at, -1), 0.0)
            row = mx.take(w, at[:, 0], axis=0).astype(mx.float32)  # (N, D)
            if slope is not None:
                row = row * mx.take_along_axis(slope, at, -1)
            target = target + mx.where(inside, row, 0.0)
        lse = m + mx.log(s)
        return (lse - picked)[:, 0], lse[:, 0], soft / s, target

    @ce.vjp
    def ce_vjp(primals: tuple, cotangents: Any, outputs: Any) -> tuple:
        x, t, *arrs = primals
        g_ce, g_lse = cotangents[0][:, None], cotangents[1][:, None]
        _, _, soft, target = outputs  # d lse / dz = softmax; d picked / dz = one-hot
        dx = (g_ce + g_lse) * soft - g_ce * target
        return (dx.astype(x.dtype), mx.zeros_like(t), *(mx.zeros_like(v) for v in arrs))

    return ce(h, targets, *arrays)[0]


def _ce(model: nn.Module, h: mx.array, targets: mx.array) -> mx.array:
    """Per-token cross-entropy (B, T) float32 of the logits `model.unembed(h)` (B, T, V)."""
    return model.ops.cross_entropy(model.unembed(h), targets)


def classify_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Cross-entropy of class logits, averaged over the batch."""
    logits = model(batch["images"]).astype(mx.float32)  # (B, classes)
    ce = model.ops.cross_entropy(logits, batch["labels"]).mean()
    return ce, mx.array(batch["labels"].shape[0], dtype=mx.float32)


def classify_metrics(model: nn.Module, batch: dict[str, mx.array]) -> dict[str, mx.array]:
    """Summed loss and correct predictions for validation (labels < 0 are padding)."""
    logits = model(batch["images"]).astype(mx.float32)
    labels = batch["labels"]
    valid = (labels >= 0).astype(mx.float32)
    safe = mx.maximum(labels, 0)
    ce = model.ops.cross_entropy(logits, safe)
    correct = (mx.argmax(logits, axis=-1) == safe).astype(mx.float32)
    return {"loss": (ce * valid).sum(), "accuracy": (correct * valid).sum(), "n": valid.sum()}


def lm_held_out_sums(model: nn.Module, batch: dict[str, mx.array]) -> dict[str, mx.array]:
    """Summed next-token cross-entropy of a held-out batch and its count (`lm_loss` times its
    count), with the logits computed only where a target is trained: `positions` (B, P) holds
    each row's trained target positions, padded where `position_mask` (B, P) is 0
    (`toymlx.data.chat.sft_val_batches`). The same values as `lm_loss` (`masked_ce_sum` over
    the hidden states there), rows of logits being independent: the unembedding and the
    cross-entropy skip the prompts and the padding."""
    ce, weight = _held_out_ce(model, batch)
    return {"loss": ce.sum(), "n": weight.sum()}


def lm_held_out_rows(model: nn.Module, batch: dict[str, mx.array]) -> dict[str, mx.array]:
    """`lm_held_out_sums` (the same sums, added in the same order) and each row's own:
    `row_loss` (B,) its summed cross-entropy, `row_n` (B,) its trained targets; the paired
    differences of two models' rows give a standard error of their losses' difference
    (`toymlx_cli.export.gain_note`)."""
    ce, weight = _held_out_ce(model, batch)
    return {"loss": ce.sum(), "n": weight.sum(), "row_loss": ce.sum(axis=-1),
            "row_n": weight.sum(axis=-1)}


def _held_out_ce(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """The masked cross-entropy (B, P) at each row's trained positions, and their weights."""
    h = model.hidden(batch["inputs"])  # (B, T, D)
    pos, weight = batch["positions"], batch["position_mask"]
    ce = masked_ce(model, mx.take_along_axis(h, pos[..., None], axis=1),
                   mx.take_along_axis(batch["targets"], pos, axis=1), weight,
                   logits_chunk(model.args.vocab_size, model.ops.logits_values), grad=False)
    return ce, weight
