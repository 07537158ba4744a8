"""Losses: pure functions (model, micro-batch) -> (mean loss, count).

Per-position cross-entropy comes from the model's own `Ops` (`model.ops.cross_entropy`), so the
loss runs the same kernels and precision as the forward pass; it is float32 whatever the
activations' dtype.

A language model's [tokens x vocabulary] logits never live whole: `lm_loss` unembeds the final
hidden states `chunk` tokens at a time (`logits_chunk`), each chunk's logits reduced at once to
its per-token losses, and with more than one chunk each chunk is an `mx.checkpoint`, so the
backward pass recomputes that chunk's logits instead of keeping them. Gemma 3's 262,144-token
vocabulary makes 4 x 256 tokens of float32 logits 1.07 GB a copy; a chunk is at most
`LOGITS_CHUNK_VALUES` values (64 MB).
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

LOGITS_CHUNK_VALUES = 1 << 24
"""Most logits (tokens x vocabulary) computed at once in a loss: 64 MB of float32."""


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
    joined before the masked sum, so it adds in the order the whole-logits loss does."""
    B, T, D = h.shape
    N = B * T
    if N <= chunk:
        return (_ce(model, h, targets) * mask).sum()
    h = h.reshape(1, N, D)  # (1, B*T, D): chunks may cross rows
    targets = targets.reshape(1, N)
    key = model.head_key()
    trainable = model.trainable_parameters()
    params = {key: trainable[key]} if key in trainable else {}
    # a head held as blocks: decoded once here, not once per chunk and again in its backward
    head = model.decoded_head()

    def piece(p: dict, hc: mx.array, tc: mx.array, *w: mx.array) -> mx.array:
        model.update(p)  # the head's trainable weights as inputs, so their gradients flow
        # the checkpoint differentiates every input: the targets and a decoded frozen head are
        # data, not weights
        w = tuple(mx.stop_gradient(x) for x in w)
        return _ce(model, hc, mx.stop_gradient(tc), *w)

    piece = mx.checkpoint(piece)
    w = () if head is None else (head,)
    ce = [piece(params, h[:, a:a + chunk], targets[:, a:a + chunk], *w)
          for a in range(0, N, chunk)]
    model.update(params)  # the checkpoint leaves its inner arrays in the model
    return (mx.concatenate(ce, axis=1).reshape(B, T) * mask).sum()


def _ce(model: nn.Module, h: mx.array, targets: mx.array, head: mx.array | None = None
        ) -> mx.array:
    """Per-token cross-entropy (B, T) float32 of the logits `model.unembed(h, head)` (B, T, V)."""
    return model.ops.cross_entropy(model.unembed(h, head), targets)


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
