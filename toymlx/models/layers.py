"""Linear, RMSNorm and LayerNorm that compute through the `Ops` they are built with.

Each keeps `mlx.nn`'s parameters, names and initialisation (checkpoints, LoRA wrapping and
`nn.quantize` see an `nn.Linear`), and hands its math to `ops` (`toymlx.models.ops`), so a
model built with `Ops(kernels="vectorised")` trains through toymlx.fastmath's forms and one
built with `Ops()` runs MLX's own kernels, with nothing else deciding which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx
from mlx import nn

from toymlx.models.ops import EXACT, Ops, next_key


class Linear(nn.Linear):
    """`nn.Linear` (weight (out, in), optional bias) computing `ops.linear`."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, ops: Ops = EXACT):
        super().__init__(input_dims, output_dims, bias=bias)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.linear(x, self.weight, self.get("bias"))


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` (a frozen, quantized base projection) whose output is in the
    compute dtype: its scales stay float32, so the file's blocks are held exactly."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, group_size: int,
                 bits: int, ops: Ops = EXACT):
        super().__init__(input_dims, output_dims, bias=bias, group_size=group_size, bits=bits)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.cast(super().__call__(x))


class Embedding(nn.Embedding):
    """`nn.Embedding` (weight (vocab, dims)) whose rows and tied logits come through `ops`."""

    def __init__(self, num_embeddings: int, dims: int, ops: Ops = EXACT):
        super().__init__(num_embeddings, dims)
        self.ops = ops

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.ops.embed(self.weight, tokens)

    def as_linear(self, h: mx.array) -> mx.array:
        """h @ weight.T: the logits of a tied output head."""
        return self.ops.unembed(h, self.weight)


class BlockCodec(Protocol):
    """What a block layer needs of a quantized type (`toymlx.gguf.blocks.Codec`)."""

    block_values: int

    def decode(self, parts: dict[str, mx.array]) -> mx.array: ...


def after(arrays: list[mx.array], x: mx.array) -> list[mx.array]:
    """The same arrays, made to wait for `x`: a weight is decoded where it is used. The decoding
    depends only on the frozen blocks, so MLX's scheduler (breadth-first up to
    MLX_BFS_MAX_WIDTH nodes) would otherwise decode every layer's weights at the start of the
    step and hold them all until their layers run."""
    return list(mx.depends(arrays, [x]))


def slices(n: int, step: int) -> list[tuple[int, int]]:
    """[(0, step), (step, 2 step), ..., (.., n)]."""
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def decoded_product(codec: BlockCodec, names: tuple[str, ...], n_out: int, n_in: int,
                    slice_values: int | None) -> Callable:
    """(x, *block arrays) -> x @ W.T, W (n_out, n_in) decoded from the arrays a slice at a time
    (at most `slice_values` values, None: whole; rows for the product, block columns for the
    backward pass's x gradient, each slice after the previous one's product), and decoded again
    in the backward pass instead of kept: a frozen base never holds more than a slice of float
    weights. Row and column slices leave every sum whole, so the values are the whole weight's."""
    most = slice_values or n_out * n_in
    rows = slices(n_out, max(1, most // n_in))
    per = codec.block_values
    cols = slices(n_in // per, max(1, most // n_out // per))  # in blocks

    def joined(parts: list[mx.array]) -> mx.array:
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    @mx.custom_function
    def product(x: mx.array, *arrays: mx.array) -> mx.array:
        out, prev = [], x
        for a, b in rows:
            held = after(list(arrays), prev)
            w = codec.decode({k: v[a:b] for k, v in zip(names, held, strict=True)}
                             ).reshape(b - a, n_in)
            prev = x @ w.astype(x.dtype).T  # (..., b - a)
            out.append(prev)
        return joined(out)

    @product.vjp
    def product_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        _, *arrays = primals
        out, prev = [], cotangent
        for c, d in cols:
            held = after(arrays, prev)
            w = codec.decode({k: v[:, c:d] for k, v in zip(names, held, strict=True)}
                             ).reshape(n_out, (d - c) * per)
            prev = cotangent @ w.astype(cotangent.dtype)  # (..., (d - c) * per)
            out.append(prev)
        return (joined(out), *(mx.zeros_like(v) for v in arrays))  # the blocks are frozen

    return product


PART = "block_"
"""Parameter-name prefix of a block layer's arrays (`block_qs`, `block_d`, ...)."""


class BlockMatrix(nn.Module):
    """A frozen (n_out, n_in) matrix held as its GGUF tensor's own quantized blocks (`blocks`: the
    arrays `toymlx.gguf.blocks` splits a tensor into, kept as flat frozen parameters
    `block_qs`, `block_d`, ...: MLX's freezing does not reach into a dict of arrays), decoded
    to float where it is used. Its float32 weight equals the file's exact dequantization; its
    product decodes again in the backward pass (`decoded_product`)."""

    def __init__(self, codec: BlockCodec, blocks: dict[str, mx.array], n_out: int, n_in: int,
                 ops: Ops = EXACT):
        super().__init__()
        self.codec, self.n_out, self.n_in, self.ops = codec, int(n_out), int(n_in), ops
        self.parts = tuple(blocks)
        for k, v in blocks.items():
            self[PART + k] = v
        self._product = decoded_product(codec, self.parts, self.n_out, self.n_in,
                                        ops.decode_slice)

    @property
    def blocks(self) -> dict[str, mx.array]:
        return {k: self[PART + k] for k in self.parts}

    def dense(self) -> mx.array:
        """The float32 (n_out, n_in) weight."""
        return self.codec.decode(self.blocks).reshape(self.n_out, self.n_in)

    def product(self, x: mx.array) -> mx.array:
        """x @ W.T in the compute dtype."""
        return self._product(self.ops.cast(x), *self.blocks.values())


class BlockLinear(BlockMatrix):
    """A frozen projection held as its tensor's blocks (`BlockMatrix`), with an optional float32
    bias: it computes what a float32-held base computes."""

    def __init__(self, codec: BlockCodec, blocks: dict[str, mx.array], n_out: int, n_in: int,
                 bias: mx.array | None = None, ops: Ops = EXACT):
        super().__init__(codec, blocks, n_out, n_in, ops)
        if bias is not None:
            self.bias = bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.product(x)
        return y if "bias" not in self else y + self.ops.cast(self.bias)


class BlockEmbedding(BlockMatrix):
    """A frozen token table (vocab, dims) held as its tensor's blocks: a token's row is decoded
    from that row's blocks alone; a tied output head is the product with the whole table."""

    def __init__(self, codec: BlockCodec, blocks: dict[str, mx.array], vocab: int, dims: int,
                 ops: Ops = EXACT):
        super().__init__(codec, blocks, vocab, dims, ops)
        self.freeze()

    def __call__(self, tokens: mx.array) -> mx.array:
        rows = {k: v[tokens] for k, v in self.blocks.items()}  # (*tokens.shape, n_blocks, ...)
        return self.ops.cast(self.codec.decode(rows).reshape(*tokens.shape, self.n_in))

    def as_linear(self, h: mx.array) -> mx.array:
        return self.product(h)


def row_reader(layer: Any) -> tuple[list[mx.array], Callable[[list[mx.array], int, int],
                                                              mx.array]]:
    """A frozen matrix layer's arrays, and `rows(arrays, a, b)`: rows a..b of its weight (b - a,
    n_in), float (block layers decode just those rows' blocks)."""
    if isinstance(layer, BlockMatrix):
        names, codec = layer.parts, layer.codec

        def rows(arrays: list[mx.array], a: int, b: int) -> mx.array:
            return codec.decode({k: v[a:b] for k, v in zip(names, arrays, strict=True)}
                                ).reshape(b - a, -1)

        return [layer[PART + k] for k in names], rows
    if isinstance(layer, nn.QuantizedLinear):
        gs, bits = layer.group_size, layer.bits

        def rows(arrays: list[mx.array], a: int, b: int) -> mx.array:
            w, sc, bi = (x[a:b] for x in arrays)
            return mx.dequantize(w, sc, bi, group_size=gs, bits=bits)

        return [layer.weight, layer.scales, layer.biases], rows
    return [layer.weight], lambda arrays, a, b: arrays[0][a:b]


def dense_weight(layer: Any) -> mx.array:
    """The (n_out, n_in) float weight of any frozen or float linear layer: a block layer's
    decoded, an MLX-quantized one's dequantized, a float one's as it is."""
    if isinstance(layer, BlockMatrix):
        return layer.dense()
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(layer.weight, layer.scales, layer.biases,
                             group_size=layer.group_size, bits=layer.bits)
    return layer.weight


def model_bytes(model: nn.Module) -> int:
    """Bytes of every array a model holds (its parameters: a frozen base's blocks or floats,
    trainable weights)."""
    from mlx.utils import tree_flatten

    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computing `ops.rms_norm`."""

    def __init__(self, dims: int, eps: float = 1e-5, ops: Ops = EXACT):
        super().__init__(dims, eps=eps)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (affine) computing `ops.layer_norm`."""

    def __init__(self, dims: int, eps: float = 1e-5, ops: Ops = EXACT):
        super().__init__(dims, eps=eps)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


class DropPath(nn.Module):
    """Stochastic depth on a residual branch: in training each example keeps the branch with
    probability 1 - p, scaled by 1 / (1 - p); evaluation and p = 0 pass it through."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = float(p)

    def __call__(self, y: mx.array) -> mx.array:
        if not (self.training and self.p > 0):
            return y
        keep = mx.random.bernoulli(1.0 - self.p, (y.shape[0],) + (1,) * (y.ndim - 1),
                                   key=next_key())  # (B, 1, ..., 1) per example
        return y * keep.astype(y.dtype) / (1.0 - self.p)


class Dropout(nn.Dropout):
    """`nn.Dropout` drawing its mask with `next_key`: the same mask again where a checkpointed
    block is recomputed (`Ops.block`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if self._p_1 == 1 or not self.training:
            return x
        mask = mx.random.bernoulli(self._p_1, x.shape, key=next_key())
        return (mask * x) * (1 / self._p_1)


def submodule(model: nn.Module, path: str) -> nn.Module:
    """The module at a dotted path such as `layers.3.attn.q_proj`."""
    obj: nn.Module = model
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    return obj


def replace_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at a dotted path such as `layers.3.attn.q_proj`."""
    parent, _, leaf = path.rpartition(".")
    setattr(submodule(model, parent) if parent else model, leaf, module)
