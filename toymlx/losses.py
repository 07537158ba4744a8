"""Losses: pure functions (model, micro-batch) -> (mean loss, count)."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from toymlx.models import llama as _llama

LOG2E = 1.4426950408889634


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    """Per-position cross-entropy over the last axis (no reduction).

    On the CPU, logsumexp is spelt out with 2**(x log2 e) (MLX's Linux CPU exp is ~3x slower
    than powf) and the max held constant, so the backward reuses the forward's
    exponentials instead of recomputing a softmax: one transcendental pass over the vocab
    instead of two. Same values to ~1e-7 relative; the GPU keeps MLX's fused kernel (the
    switch is `toymlx.models.llama.cpu_forms`).
    """
    if not _llama.cpu_forms():
        return nn.losses.cross_entropy(logits, targets, reduction="none")
    m = mx.stop_gradient(logits.max(-1, keepdims=True))  # (..., 1)
    s = mx.power(2.0, (logits - m) * LOG2E).sum(-1)  # (...)
    picked = mx.take_along_axis(logits, targets[..., None], -1)[..., 0]  # (...)
    return mx.log(s) + m[..., 0] - picked


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
