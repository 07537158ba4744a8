"""Losses: pure functions (model, micro-batch) -> (mean loss, count)."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from toymlx import fastmath


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-position cross-entropy over the last axis (no reduction).

    Where `toymlx.fastmath` is on (the CPU) it is logsumexp - picked logit with the vectorised
    exp, whose backward reuses nothing but the logits and the result; elsewhere MLX's kernel.
    """
    if fastmath.enabled():
        return fastmath.cross_entropy(logits, targets)
    return nn.losses.cross_entropy(logits, targets, reduction="none")


def lm_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Next-token cross-entropy averaged over the positions whose mask is 1."""
    logits = model(batch["inputs"])  # (B, T, V)
    ce = cross_entropy(logits, batch["targets"])  # (B, T)
    mask = batch["mask"]
    n = mask.sum()
    return (ce * mask).sum() / mx.maximum(n, 1.0), n


def classify_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Cross-entropy of class logits, averaged over the batch."""
    logits = model(batch["images"])  # (B, classes)
    ce = cross_entropy(logits, batch["labels"]).mean()
    return ce, mx.array(batch["labels"].shape[0], dtype=mx.float32)


def classify_metrics(model: nn.Module, batch: dict[str, mx.array]) -> dict[str, mx.array]:
    """Summed loss and correct predictions for validation (labels < 0 are padding)."""
    logits = model(batch["images"])
    labels = batch["labels"]
    valid = (labels >= 0).astype(mx.float32)
    safe = mx.maximum(labels, 0)
    ce = cross_entropy(logits, safe)
    correct = (mx.argmax(logits, axis=-1) == safe).astype(mx.float32)
    return {"loss": (ce * valid).sum(), "accuracy": (correct * valid).sum(), "n": valid.sum()}
