"""A mixture-of-experts feed-forward block (Qwen3-MoE's), in llama.cpp's GGUF conventions.

llama.cpp's `build_moe_ffn` (src/llama-graph.cpp) for qwen3moe, which `MoE` computes: the
router `ffn_gate_inp` (E, D) gives each token E logits; their softmax (float32) are the
probabilities; the `k` largest pick the token's experts (`expert_used_count`); their
probabilities, divided by their sum (qwen3moe always renormalizes: `norm_w` true, clamped at
float16's smallest normal 6.1e-5), weight the experts' SwiGLU outputs
`down_e(silu(gate_e x) * up_e x)`, which are summed. The expert tensors are 3-D, `(E, out, in)`
in numpy order (experts as GGUF's last dimension): `ffn_gate_exps` and `ffn_up_exps`
(E, F, D), `ffn_down_exps` (E, D, F), F the expert width (`expert_feed_forward_length`).

Each token's experts are applied with `mx.gather_mm` (a matrix-level gather, the same on the
CPU, Metal and CUDA; `gather_product`), its (token, expert) pairs sorted by expert where there are `SORT_FROM` or
more (as mlx-lm's SwitchGLU): the gradient of an expert tensor (a LoRA pair's) is then a matmul
per expert's run of pairs, where unsorted MLX forms an (r, in) product per pair and adds them
up (the tiny Q4_K_M qwen3moe, 1024 tokens, LoRA on gate, up and down: a step's peak 108 MB
above LoRA on q alone unsorted, 4 MB sorted; that gradient alone ~7x faster sorted). A
float-held expert tensor is an `ExpertLinear`; a quantized one stays in its GGUF blocks
(`BlockExperts`), decoded where it is used and decoded again in the backward pass rather than
kept, as `toymlx.models.layers.BlockLinear` does for a 2-D matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx import nn

from toymlx.models.layers import PART, BlockCodec, Linear, after
from toymlx.models.ops import EXACT, Ops

WEIGHT_SUM_FLOOR = 6.103515625e-5
"""llama.cpp clamps the selected experts' probability sum at float16's smallest normal."""
SORT_FROM = 64
"""(token, expert) pairs from which `MoE` sorts them by expert (mlx-lm's SwitchGLU's)."""


def gather_product(a: mx.array, b: mx.array, idx: mx.array, by_expert: bool) -> mx.array:
    """`mx.gather_mm(a, b, rhs_indices=idx, sorted_indices=by_expert)`, the one call of it. Where
    MLX computes on the CPU and both operands are half precision, in float32 and the product
    rounded back: MLX 0.32's CPU GatherMM has no half-precision kernel ("[GatherMM::eval]
    Currently only supports float32", so a bfloat16 mixture of experts failed on its first
    product there); Metal's and CUDA's have one, and take the operands as they are."""
    half = a.dtype in (mx.bfloat16, mx.float16) and b.dtype == a.dtype
    if half and mx.default_device() == mx.cpu:
        return mx.gather_mm(a.astype(mx.float32), b.astype(mx.float32), rhs_indices=idx,
                            sorted_indices=by_expert).astype(a.dtype)
    return mx.gather_mm(a, b, rhs_indices=idx, sorted_indices=by_expert)


def expert_product(x: mx.array, w: mx.array, idx: mx.array, by_expert: bool = False
                   ) -> mx.array:
    """x @ w[idx].T per token and chosen expert: x (N, 1 or k, 1, in), w (E, out, in), idx
    (N, k) -> (N, k, 1, out); `by_expert`: x (M, 1, in) pairs sorted by their experts idx
    (M,) -> (M, 1, out)."""
    return gather_product(x, w.swapaxes(-1, -2), idx, by_expert)


class ExpertLinear(nn.Module):
    """E float projections `weight` (E, out, in), applied per token to its chosen experts."""

    def __init__(self, n_experts: int, n_out: int, n_in: int, ops: Ops = EXACT):
        super().__init__()
        self.ops = ops
        self.n_experts, self.n_out, self.n_in = int(n_experts), int(n_out), int(n_in)
        self.weight = mx.zeros((n_experts, n_out, n_in))

    def __call__(self, x: mx.array, idx: mx.array, by_expert: bool = False) -> mx.array:
        x = self.ops.cast(x)
        return expert_product(x, self.ops.cast(self.weight), idx, by_expert)

    def dense(self) -> mx.array:
        return self.weight


def decoded_experts(codec: BlockCodec, names: tuple[str, ...], n_experts: int, n_out: int,
                    n_in: int, by_expert: bool = False) -> Callable:
    """(x, idx, *block arrays) -> `expert_product` (`by_expert`: of pairs sorted by expert)
    with the experts decoded from their blocks (arrays led by E * out rows): only the chosen
    experts' blocks where there are fewer (token, expert) pairs than experts (a generation
    step), else the whole tensor, decoded once; decoded again in the backward pass rather than
    kept."""

    def weights(arrays: tuple[mx.array, ...], idx: mx.array, x: mx.array
                ) -> tuple[mx.array, mx.array]:
        held = after(list(arrays), x)
        parts = {k: v.reshape(n_experts, n_out, *v.shape[1:])
                 for k, v in zip(names, held, strict=True)}
        if idx.size < n_experts:  # (N, k, out, in): each pair's own expert
            w = codec.decode({k: v[idx] for k, v in parts.items()})
            return w.reshape(*idx.shape, n_out, n_in), None
        return codec.decode(parts).reshape(n_experts, n_out, n_in), idx

    def apply(a: mx.array, w: mx.array, idx: mx.array | None, transpose: bool) -> mx.array:
        w = w.astype(a.dtype)
        if idx is None:  # w (N, k, out, in) already gathered
            return a @ (w if transpose else w.swapaxes(-1, -2))
        return gather_product(a, w if transpose else w.swapaxes(-1, -2), idx, by_expert)

    @mx.custom_function
    def product(x: mx.array, idx: mx.array, *arrays: mx.array) -> mx.array:
        w, gidx = weights(arrays, idx, x)
        return apply(x, w, gidx, transpose=False)  # (N, k, 1, out)

    @product.vjp
    def product_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        x, idx, *arrays = primals
        w, gidx = weights(tuple(arrays), idx, cotangent)
        dx = apply(cotangent, w, gidx, transpose=True)  # (N, k, 1, in)
        if x.shape[1] == 1 and dx.shape[1] != 1:  # x was shared by the token's k experts
            dx = dx.sum(axis=1, keepdims=True)
        return (dx, mx.zeros_like(idx), *(mx.zeros_like(v) for v in arrays))

    return product


class BlockExperts(nn.Module):
    """A frozen 3-D expert tensor (E, out, in) held as its GGUF blocks (`blocks`: arrays led by
    E * out rows, `toymlx.gguf.blocks.split_rows`), kept as frozen parameters `block_*`."""

    def __init__(self, codec: BlockCodec, blocks: dict[str, mx.array], n_experts: int,
                 n_out: int, n_in: int, ops: Ops = EXACT):
        super().__init__()
        self.codec, self.ops = codec, ops
        self.n_experts, self.n_out, self.n_in = int(n_experts), int(n_out), int(n_in)
        self.parts = tuple(blocks)
        for k, v in blocks.items():
            self[PART + k] = v
        self._products = tuple(  # [by_expert]: pairs in token order, pairs sorted by expert
            decoded_experts(codec, self.parts, self.n_experts, self.n_out, self.n_in, by_expert)
            for by_expert in (False, True))
        self.freeze()

    def dense(self) -> mx.array:
        """The float32 (E, out, in) tensor."""
        blocks = {k: self[PART + k] for k in self.parts}
        return self.codec.decode(blocks).reshape(self.n_experts, self.n_out, self.n_in)

    def __call__(self, x: mx.array, idx: mx.array, by_expert: bool = False) -> mx.array:
        product = self._products[int(by_expert)]
        return product(self.ops.cast(x), idx, *(self[PART + k] for k in self.parts))


class MoE(nn.Module):
    """Qwen3-MoE's feed-forward block: a router over `n_experts` SwiGLU experts, `n_used` of
    them per token (the module docstring has the math); with `shared` (qwen2moe's shared expert,
    a dense MLP every token takes), its output times sigmoid(`shared_gate` x) is added
(`ffn_gate_inp_shexp`, (1, D) as llama.cpp's converter writes it)."""

    def __init__(self, d_model: int, n_experts: int, n_used: int, ffn_dim: int,
                 norm_topk: bool = True, ops: Ops = EXACT, shared: nn.Module | None = None):
        super().__init__()
        if shared is not None:
            self.shared = shared
            self.shared_gate = Linear(d_model, 1, bias=False, ops=ops)
        self.ops, self.n_used, self.norm_topk = ops, int(n_used), bool(norm_topk)
        self.router = Linear(d_model, n_experts, bias=False, ops=ops)
        self.gate_exps = ExpertLinear(n_experts, ffn_dim, d_model, ops)
        self.up_exps = ExpertLinear(n_experts, ffn_dim, d_model, ops)
        self.down_exps = ExpertLinear(n_experts, d_model, ffn_dim, ops)

    def route(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """h (N, D) -> the chosen experts (N, k) and their float32 weights (N, k)."""
        probs = self.probabilities(h)
        k = self.n_used
        idx = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        return idx, self.weights(probs, idx)

    def probabilities(self, h: mx.array) -> mx.array:
        """h (N, D) -> the router's float32 probabilities (N, E)."""
        return mx.softmax(self.router(h).astype(mx.float32), axis=-1)

    def weights(self, probs: mx.array, idx: mx.array) -> mx.array:
        """The weights (N, k) of the experts idx (N, k) from the probabilities (N, E): theirs,
        renormalized where the model says so (norm_topk)."""
        w = mx.take_along_axis(probs, idx, axis=-1)  # (N, k)
        if self.norm_topk:
            w = w / mx.maximum(w.sum(axis=-1, keepdims=True), WEIGHT_SUM_FLOOR)
        return w

    def __call__(self, x: mx.array) -> mx.array:
        lead, d = x.shape[:-1], x.shape[-1]
        h = x.reshape(-1, d)  # (N, D)
        idx, w = self.route(h)
        n, k = idx.shape
        if idx.size >= SORT_FROM:  # the N * k pairs in the order of their experts
            order = mx.argsort(idx.reshape(-1))  # (N * k,): pair t * k + j is token t's j-th
            experts = idx.reshape(-1)[order]
            xe = h[order // k][:, None, :]  # (N * k, 1, D)
            act = self.ops.silu_mul(self.gate_exps(xe, experts, True),
                                    self.up_exps(xe, experts, True))  # (N * k, 1, F)
            y = self.down_exps(act, experts, True)[:, 0, :]  # (N * k, D), sorted
            y = y[mx.argsort(order)].reshape(n, k, d)  # back in token order
        else:
            xe = h[:, None, None, :]  # (N, 1, 1, D): shared by the token's k experts
            act = self.ops.silu_mul(self.gate_exps(xe, idx), self.up_exps(xe, idx))  # (N,k,1,F)
            y = self.down_exps(act, idx)[:, :, 0, :]  # (N, k, D)
        y = (y * w[..., None].astype(y.dtype)).sum(axis=1)
        if "shared" in self:
            y = y + self.shared(h) * mx.sigmoid(self.shared_gate(h)).astype(y.dtype)
        return y.reshape(*lead, d)
