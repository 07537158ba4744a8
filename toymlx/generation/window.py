"""The context shift: generation that goes on past the window a model reads at once.

A model reads at most a window of W tokens (a from-scratch run's --seq-len, else its context).
When the text in view reaches W tokens and another token is wanted, the older half is dropped
and the newer half (the last W // 2 tokens, the newest included) is computed again at positions
0.. (a fresh KV cache), so that every prediction reads at most W tokens at positions the model
trained on: nanoGPT's sample.py crops its input to the last block_size tokens at every step,
llama.cpp's context shift (--context-shift) drops the older half of a full context. A prompt
that fills the window is cut the same way. Both engines of toymlx-generate follow this rule
(`toymlx.generation.generate.decode`, `toymlx.generation.llamacpp_decode`); stdlib only, so
that the llama.cpp child imports no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_window(window: int) -> None:
    """ValueError for a window too small to shift: half of it must keep a token."""
    if window < 2:
        raise ValueError(f"context shift: expected a window of at least 2 tokens (its newer "
                         f"half is kept), found {window}")


def shift_keep(window: int) -> int:
    """How many of the newest tokens a shift of a full `window` keeps: its newer half."""
    return window // 2


def in_view(n: int, window: int) -> int:
    """How many of the last `n` tokens of a text the model reads before its next prediction:
    all while they leave room for it (fewer than `window`), else the newer half (a shift)."""
    return n if n < window else shift_keep(window)


def in_window(ids: Sequence[int], window: int) -> list[int]:
    """The last `in_view` of `ids`: what the model reads before its next prediction."""
    return list(ids[len(ids) - in_view(len(ids), window):])


def shifts(n_prompt: int, n_new: int, window: int) -> int:
    """How many shifts making `n_new` tokens after an `n_prompt`-token prompt took (the prompt's
    own cut, `in_window`, not counted): the first where the text in view reaches `window`, then
    one each `window - shift_keep(window)` tokens."""
    room = window - in_view(n_prompt, window)
    if n_new <= room:
        return 0
    return 1 + (n_new - room - 1) // (window - shift_keep(window))
