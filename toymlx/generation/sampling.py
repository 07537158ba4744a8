"""Choosing the next token from the log-probabilities: mlx-lm's samplers, in toymlx.

The same chain as `mlx_lm.sample_utils.make_sampler`, in its order: top-p, then min-p, then
top-k, each setting the tokens it drops to -inf, then a draw at the temperature
(`mx.random.categorical`; temperature 0 is the argmax); and mlx-lm's repetition penalty over
the last 20 tokens. The same tokens come out for the same seed (tests/test_generate.py holds
them to mlx-lm's). They live here rather than being imported because `mlx_lm`'s package
imports transformers, and with it PyTorch where that is installed: 1.2-5 s before the first
token of every `toymlx-generate`.

One thing differs, where `make_sampler(checked_on_host=True)` (a CPU): how top-p finds its cut
(`top_p_cut`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
"""(1, V) log-probabilities -> (1,) the chosen token."""

TOP_P_CANDIDATES = 256
"""How many of the most likely tokens the host-checked top-p looks at before sorting all."""


def make_sampler(temperature: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                 checked_on_host: bool = False) -> Sampler:
    """The sampler chain (module docstring); 0 and 1.0 leave a filter out.

    `checked_on_host`: mlx-lm's top-p sorts the whole vocabulary every token: 4.3 ms of
    SmolLM2's 49,152 on a 2-core AMD EPYC Zen 4, a tenth of a decoded token. The nucleus is
    nearly always among the few hundred most likely tokens: `top_p_cut` takes the
    `TOP_P_CANDIDATES` largest (`mx.topk`, 0.5 ms) and, where their mass reaches top-p (checked
    on the host: one scalar, read once the logits are computed), cuts among them; otherwise it
    sorts everything as mlx-lm does. The check waits for the token's logits, which undoes the
    decoding loop's overlap of building the next step's graph with computing this one: nothing
    on a CPU, where the same cores do both, but idle time for a GPU (Metal, CUDA), whose sort is
    cheap anyway: `generate` passes True only where MLX computes on the CPU."""
    if temperature == 0:
        return greedy
    cuts: list[Callable[[mx.array], mx.array]] = []
    if top_p < 1.0:
        cuts.append(partial(top_p_cut, top_p=top_p) if checked_on_host
                    else partial(_top_p_sorted, top_p=top_p))
    if min_p > 0.0:
        cuts.append(partial(_min_p_cut, log_min_p=math.log(min_p)))
    if top_k > 0:
        cuts.append(partial(_top_k_cut, top_k=top_k))

    def sample(logprobs: mx.array) -> mx.array:
        for cut in cuts:
            logprobs = cut(logprobs)
        return _categorical(logprobs, 1.0 / temperature)

    return sample


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token."""
    return mx.argmax(logprobs, axis=-1)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _categorical(logprobs: mx.array, inverse_temperature: float) -> mx.array:
    return mx.random.categorical(logprobs * inverse_temperature)


@mx.compile
def _top_p_sorted(logprobs: mx.array, top_p: float) -> mx.array:
    """Top-p over the whole vocabulary sorted: keeps every token whose strictly more likely
    tokens hold less than `top_p` of the mass, and every token tied with the least likely of
    those."""
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)  # mass strictly above
    total = above[..., :1] + probs[..., :1]
    dropped = (above >= top_p * total).sum(axis=-1, keepdims=True)
    cut = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < cut, -float("inf"), logprobs)


def top_p_cut(logprobs: mx.array, top_p: float) -> mx.array:
    """`_top_p_sorted`'s result from the `TOP_P_CANDIDATES` most likely tokens where they hold
    the nucleus (see `make_sampler`); the same tokens kept, but where the cut falls within
    float32 rounding of the summed mass (1 cut in 900 on random 49,152-token distributions
    kept one boundary token more or less, both within rounding of the float64 nucleus)."""
    if logprobs.shape[-1] <= TOP_P_CANDIDATES:
        return _top_p_sorted(logprobs, top_p)
    best = mx.sort(mx.topk(logprobs, TOP_P_CANDIDATES, axis=-1), axis=-1)[..., ::-1]
    probs = mx.exp(best.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, inclusive=False)  # mass of the strictly more likely ones
    wanted = top_p * mx.exp(logprobs.astype(mx.float32)).sum(axis=-1, keepdims=True)
    if not bool(mx.all(above[..., -1:] + probs[..., -1:] >= wanted)):
        return _top_p_sorted(logprobs, top_p)  # a flat distribution: sort it all
    kept = (above < wanted).sum(axis=-1, keepdims=True)
    cut = mx.take_along_axis(best, kept - 1, axis=-1)
    return mx.where(logprobs < cut, -float("inf"), logprobs)


@mx.compile
def _min_p_cut(logprobs: mx.array, log_min_p: float) -> mx.array:
    """Drops the tokens less likely than min_p times the most likely one."""
    floor = logprobs.max(axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < floor, -float("inf"), logprobs)


def check_top_k(top_k: int, vocab: int, source: object = None) -> None:
    """ValueError unless `top_k` is 0 (off) or below `vocab`, the model's vocabulary (its
    logits' width; k = vocab would keep every token): `source`, the model file, names it."""
    if not 0 <= top_k < vocab:
        where = f"{source}: " if source is not None else ""
        raise ValueError(f"{where}--top-k: expected 0 (off) or below {vocab} (the model's "
                         f"vocabulary), found {top_k}")


def _top_k_cut(logprobs: mx.array, top_k: int) -> mx.array:
    """Keeps the `top_k` most likely tokens (ties at the boundary as `mx.argpartition` orders
    them, as mlx-lm's)."""
    check_top_k(top_k, logprobs.shape[-1])
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-float("inf"), logprobs.dtype),
                             axis=-1)


PENALTY_CONTEXT = 20
"""How many of the latest tokens the repetition penalty looks at (mlx-lm's default)."""


def repetition_penalty(penalty: float, context: int = PENALTY_CONTEXT
                       ) -> Callable[[mx.array, mx.array], mx.array]:
    """(recent tokens, (1, V) logits) -> logits with each of the last `context` tokens made
    less likely: a positive logit divided by `penalty`, a negative one multiplied (CTRL's
    penalty, as mlx-lm applies it)."""
    def apply(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        recent = tokens[-context:]
        picked = logits[:, recent]
        logits[:, recent] = mx.where(picked < 0, picked * penalty, picked / penalty)
        return logits
    return apply
