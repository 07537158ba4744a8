"""The keys and values a block has seen, kept for generation (`Llama.make_cache`).

mlx-lm's `KVCache` design, in toymlx (importing mlx-lm's package costs every `toymlx-generate`
1.2-5 s, see toymlx/generation/sampling.py): a buffer per block grown 256 positions at a time, written in
place (`slice_update`) and read up to the current position. The interface is the one mlx-lm's
decoding code and toymlx's `Attention.attend` use: `offset`, `update_and_fetch`, `state`.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys (B, Hkv, S, hd_k) and values (B, Hkv, S, hd_v) of positions 0..offset-1."""

    step = 256
    """Positions added to the buffers at a time."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values (B, Hkv, T, hd) at positions offset..offset+T-1; return every
        position's so far."""
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or self.values is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        if end == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, keys: mx.array, values: mx.array, end: int) -> None:
        B, H, T, _ = keys.shape
        more = -(-T // self.step) * self.step  # T rounded up to whole steps
        new_k = mx.zeros((B, H, more, keys.shape[3]), keys.dtype)
        new_v = mx.zeros((B, H, more, values.shape[3]), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
            return
        kept_k, kept_v = self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        self.keys = mx.concatenate([kept_k, new_k], axis=2)
        self.values = mx.concatenate([kept_v, new_v], axis=2)

    def keep(self, n: int) -> None:
        """Forget positions n and after (the buffers stay; the next update overwrites them)."""
        self.offset = kept(self, n)

    @property
    def state(self) -> list[mx.array]:
        """The buffers, to evaluate (empty before the first update)."""
        return [a for a in (self.keys, self.values) if a is not None]


class SharedKV:
    """A block's view of an earlier block's `KVCache` (gemma4's shared-KV tail: it projects no
    keys or values and attends over its source's, which has already taken this step's)."""

    def __init__(self, source: KVCache | SharedKV) -> None:
        self.source = source if isinstance(source, KVCache) else source.source
        self.offset = 0

    def fetch(self, n: int) -> tuple[mx.array, mx.array]:
        """The source's keys and values of positions 0..offset+n-1, this block's queries being
        the last n of them."""
        self.offset += n
        src = self.source
        if src.keys is None or src.values is None or src.offset != self.offset:
            raise ValueError(f"SharedKV: expected the source block's cache at position "
                             f"{self.offset}, found it at {src.offset}")
        return src.keys[..., :self.offset, :], src.values[..., :self.offset, :]

    def keep(self, n: int) -> None:
        """Forget positions n and after (the source keeps its own count)."""
        self.offset = kept(self, n)

    @property
    def state(self) -> list[mx.array]:
        """Nothing of its own to evaluate."""
        return []


def kept(cache: KVCache | SharedKV, n: int) -> int:
    """n, the positions a cache's `keep` keeps; ValueError where it holds fewer."""
    if not 0 <= n <= cache.offset:
        raise ValueError(f"{type(cache).__name__}.keep: expected 0..{cache.offset} positions, "
                         f"found {n}")
    return n
