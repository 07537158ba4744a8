"""Learning-rate schedule: linear warm-up, then cosine decay to a floor. Pure in the step."""

from __future__ import annotations

import math


def lr_at(step, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1):
    """LR for optimizer step `step` (0-indexed: the update that makes step `step+1`).

    Warm-up rises linearly from base_lr/warmup at step 0 to base_lr at step warmup-1; then the
    cosine falls from base_lr at step `warmup` to base_lr*min_ratio at step total-1. Works on
    Python numbers and on mlx arrays (inside a compiled step).
    """
    if isinstance(step, (int, float)):
        if step < warmup:
            return base_lr * (step + 1) / warmup
        span = max(total - 1 - warmup, 1)
        p = min(max((step - warmup) / span, 0.0), 1.0)
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
    import mlx.core as mx

    step = step.astype(mx.float32)
    warm = base_lr * (step + 1) / max(warmup, 1)
    span = max(total - 1 - warmup, 1)
    p = mx.clip((step - warmup) / span, 0.0, 1.0)
    cos = base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + mx.cos(math.pi * p)))
    return mx.where(step < warmup, warm, cos)
