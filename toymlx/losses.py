"""Losses: pure functions (model, micro-batch) -> (mean loss, count)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def lm_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Next-token cross-entropy averaged over the positions whose mask is 1."""
    logits = model(batch["inputs"])  # (B, T, V)
    ce = nn.losses.cross_entropy(logits, batch["targets"], reduction="none")  # (B, T)
    mask = batch["mask"]
    n = mask.sum()
    return (ce * mask).sum() / mx.maximum(n, 1.0), n


def classify_loss(model: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
    """Cross-entropy of class logits, averaged over the batch."""
    logits = model(batch["images"])  # (B, classes)
    ce = nn.losses.cross_entropy(logits, batch["labels"], reduction="mean")
    return ce, mx.array(batch["labels"].shape[0], dtype=mx.float32)


def classify_metrics(model: nn.Module, batch: dict[str, mx.array]) -> dict[str, mx.array]:
    """Summed loss and correct predictions for validation (labels < 0 are padding)."""
    logits = model(batch["images"])
    labels = batch["labels"]
    valid = (labels >= 0).astype(mx.float32)
    safe = mx.maximum(labels, 0)
    ce = nn.losses.cross_entropy(logits, safe, reduction="none")
    correct = (mx.argmax(logits, axis=-1) == safe).astype(mx.float32)
    return {"loss": (ce * valid).sum(), "accuracy": (correct * valid).sum(), "n": valid.sum()}
