"""Losses: pure functions (model, micro-batch) -> (mean loss, count).

Per-position cross-entropy comes from the model's own `Ops` (`model.ops.cross_entropy`), so the
loss runs the same kernels and precision as the forward pass; it is float32 whatever the
activations' dtype.

A language model's [tokens x vocabulary] logits never live whole: `lm_loss` unembeds the final
hidden states `chunk` tokens at a time (`logits_chunk`), each chunk's logits reduced at once to
its per-token losses; with more than one chunk, the backward pass recomputes each chunk's
logits instead of keeping them, one chunk after another (`masked_ce_sum`). Gemma 3's 262,144-token
vocabulary makes 4 x 256 tokens of float32 logits 1.07 GB a copy; a chunk is at most
`LOGITS_CHUNK_VALUES` values (16 MB), or 32 tokens.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

LOGITS_CHUNK_VALUES = 1 << 22
"""Most logits (tokens x vocabulary) computed at once in a loss, 16 MB of float32 a copy: the
backward pass of a chunk holds ~16 copies at its peak (the vectorised CPU kernels, compiled;
~8 with MLX's own), and every chunk reads the whole output matrix again."""


def logits_chunk(vocab: int) -> int:
    """Tokens per logits chunk for a vocabulary: LOGITS_CHUNK_VALUES // vocab, rounded down to a
    multiple of 32 (so compiled shapes stay few), at least 32."""
    return max(32, LOGITS_CHUNK_VALUES // vocab // 32 * 32)


def lm_loss(model: nn.Module, batch: dict[str, mx.array], chunk: int | None = None
            ) -> tuple[mx.array, mx.array]:
    """Next-token cross-entropy averaged over the positions whose mask is 1, the logits computed
    `chunk` tokens at a time (None: `logits_chunk` of the model's vocabulary)."""
    h = model.hidden(batch["inputs"])  # (B, T, D)
    mask = batch["mask"]
    chunk = chunk or logits_chunk(model.args.vocab_size)
    total = masked_ce_sum(model, h, batch["targets"], mask, chunk)
    n = mask.sum()
    return total / mx.maximum(n, 1.0), n


def masked_ce_sum(model: nn.Module, h: mx.array, targets: mx.array, mask: mx.array,
                  chunk: int) -> mx.array:
    """sum(cross_entropy(model.unembed(h), targets) * mask) over (B, T), `chunk` tokens of
    logits at a time, each chunk recomputed in the backward pass. The per-token losses are
    joined before the masked sum, so it adds in the order the whole-logits loss does.

    Each chunk is an `mx.custom_function` whose vjp recomputes its logits (none are kept from
    the forward pass) and starts only once that chunk's cotangent exists (`mx.depends`); each
    chunk's input adds 0 times the previous chunk's first loss, so the chunks depend on one
    another forward and backward. Values and gradients are unchanged, and MLX evaluates the
    chunks one after another, where its breadth-first order (the CPU step's
    `MLX_BFS_MAX_WIDTH`) computed independent ones all at once. A 1-block model with Gemma 3's
    vocabulary, 4 x 256 tokens, 64-token chunks, vectorised kernels, eager: 1.35 GB above the
    weights, against 5.1 GB with independent `mx.checkpoint` chunks and 16.4 GB unchunked;
    compiled: 1.09 against 8.2 GB unchunked."""
    B, T, D = h.shape
    N = B * T
    if N <= chunk:
        return (_ce(model, h, targets) * mask).sum()
    h = h.reshape(1, N, D)  # (1, B*T, D): chunks may cross rows
    targets = targets.reshape(1, N)
    key = model.head_key()
    trainable = model.trainable_parameters()
    params = {key: trainable[key]} if key in trainable else {}

    def forward(p: dict, hc: mx.array, tc: mx.array) -> mx.array:
        model.update(p)  # the head's trainable weights as inputs, so their gradients flow
        return _ce(model, hc, tc)

    @mx.custom_function
    def piece(p: dict, hc: mx.array, tc: mx.array) -> mx.array:
        return forward(p, hc, tc)

    @piece.vjp
    def piece_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        p, hc, tc = primals
        # recompute this chunk's logits only once its cotangent exists (mx.checkpoint's
        # recomputation waits for nothing, and breadth-first, every chunk's would live at once)
        hc = mx.depends(hc, cotangent)
        flat = tree_flatten(p)
        keys, values = [k for k, _ in flat], [v for _, v in flat]

        def of_arrays(*arrays: mx.array) -> mx.array:
            return forward(tree_unflatten(list(zip(keys, arrays[:-1]))), arrays[-1], tc)

        _, grads = mx.vjp(of_arrays, [*values, hc], [cotangent])
        gp = tree_unflatten(list(zip(keys, grads[:-1]))) if keys else p
        return gp, grads[-1], mx.zeros_like(tc)

    ce: list[mx.array] = []
    for a in range(0, N, chunk):
        hc = h[:, a:a + chunk]  # (1, chunk, D)
        if ce:  # + 0 x the previous chunk's first loss: one chunk after another (see above)
            hc = hc + (0.0 * ce[-1][:, :1, None]).astype(hc.dtype)
        ce.append(piece(params, hc, targets[:, a:a + chunk]))
    model.update(params)  # the custom function leaves its inner arrays in the model
    return (mx.concatenate(ce, axis=1).reshape(B, T) * mask).sum()


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
