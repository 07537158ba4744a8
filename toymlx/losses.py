"""Losses: pure functions (model, micro-batch) -> (mean loss, count).

Per-position cross-entropy comes from the model's own `Ops` (`model.ops.cross_entropy`), so the
loss runs the same kernels and precision as the forward pass; it is float32 whatever the
activations' dtype.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn


def lm_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Next-token cross-entropy averaged over the positions whose mask is 1."""
    logits = model(batch["inputs"])  # (B, T, V)
    ce = model.ops.cross_entropy(logits, batch["targets"])  # (B, T) float32
    mask = batch["mask"]
    n = mask.sum()
    return (ce * mask).sum() / mx.maximum(n, 1.0), n


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
    (`toymlx.data.chat.sft_val_batches`). The same values as `lm_loss`, rows of logits being
    independent; the unembedding and the cross-entropy skip the prompts and the padding."""
    h = model.hidden(batch["inputs"])  # (B, T, D)
    pos = batch["positions"]
    logits = model.unembed(mx.take_along_axis(h, pos[..., None], axis=1))  # (B, P, V)
    ce = model.ops.cross_entropy(logits, mx.take_along_axis(batch["targets"], pos, axis=1))
    weight = batch["position_mask"]
    return {"loss": (ce * weight).sum(), "n": weight.sum()}
