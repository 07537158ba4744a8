"""LoRA: low-rank adapters on a frozen Llama, and llama.cpp's LoRA adapter GGUF format.

`LoRALinear` adds `scale * B (A x)` to a frozen projection (a float `nn.Linear` or an
`nn.QuantizedLinear`). `lora_a` is `(r, n_in)` and `lora_b` `(n_out, r)`: the orientation
PEFT and llama.cpp store, so an adapter file needs no transpose. `lora_b` starts at zero, so
step 0 computes exactly the base model; `scale = alpha / rank` is computed in
`LoRALinear.scale_of` and nowhere else (llama.cpp applies the same `alpha / r`).

Adapter GGUF (what llama.cpp's `llama_adapter_lora_init` checks): `general.type = "adapter"`,
`general.architecture` = the base's, `adapter.type = "lora"`, `adapter.lora.alpha` (float32;
0 means scale 1), and per adapted weight `<base tensor>.lora_a` (r, n_in) and `.lora_b`
(n_out, r), F32.

DoRA (`DoRALinear`, Liu et al. 2024, as mlx-lm's `--fine-tune-type dora`): the same A and B plus
a trained magnitude per output row, `m * (W + scale B A) / ||W + scale B A||_row`. llama.cpp has
no DoRA adapter format, so a DoRA adapter is a toymlx adapter GGUF: the same layout with
`adapter.type = "dora"` (which llama.cpp refuses rather than misreads) and `<base>.dora_m`
(n_out,) per pair; toymlx reads it (`load_adapter`, `apply_adapter`) and `write_merged` fuses it
into a plain GGUF that llama.cpp runs.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.gguf.llama import gguf_to_toy, llama_tensors, load_llama, toy_to_gguf
from toymlx.gguf.quantize import BASE_FILE_TYPE, export_type, quantizer, write_model_gguf
from toymlx.gguf.reader import UINT32, GGUFError, GGUFFile
from toymlx.gguf.writer import FILE_TYPE, encode_tensor, write_gguf
from toymlx.models.layers import BlockLinear, Linear, dense_weight, replace_submodule, submodule
from toymlx.models.llama import Llama
from toymlx.models.ops import EXACT

TARGETS: dict[str, str] = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj",
                           "qkv": "attn.qkv_proj", "o": "attn.o_proj", "gate": "mlp.gate_proj",
                           "up": "mlp.up_proj", "gate_up": "mlp.gate_up_proj",
                           "down": "mlp.down_proj"}
"""--lora.targets short names -> projection paths inside a decoder block (qkv and gate_up:
phi3's fused projections, which it has instead of q, k, v and gate, up)."""

def base_dims(linear: nn.Module) -> tuple[int, int]:
    """(n_out, n_in) of a float, block-held or MLX-quantized linear layer."""
    if isinstance(linear, BlockLinear):
        return linear.n_out, linear.n_in
    if isinstance(linear, nn.QuantizedLinear):
        n_out, packed = linear.weight.shape
        return n_out, packed * 32 // linear.bits
    if isinstance(linear, nn.Linear):
        return tuple(linear.weight.shape)
    raise TypeError(f"LoRA: expected a linear layer (float, block-held or MLX-quantized), "
                    f"found {type(linear).__name__}")


def base_weight(linear: nn.Module) -> mx.array:
    """The (n_out, n_in) weight of a linear layer, decoded or dequantized if need be."""
    return dense_weight(linear)


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update: y = W x + (alpha/r) B (A dropout(x))."""

    @classmethod
    def from_base(cls, linear: nn.Module, rank: int = 8, alpha: float = 16.0,
                  dropout: float = 0.0) -> LoRALinear:
        """Wrap an existing (float or quantized) linear layer."""
        return cls(linear, rank, alpha, dropout)

    def __init__(self, linear: nn.Module, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"--lora.rank: expected >= 1, found {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"--lora.dropout: expected in [0, 1), found {dropout}")
        n_out, n_in = base_dims(linear)
        self.linear = linear
        self.dropout = nn.Dropout(dropout)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.scale_of(self.rank, self.alpha)
        # PEFT's init: A ~ U(-1/sqrt(n_in), 1/sqrt(n_in)), B = 0, so the update starts at zero.
        bound = 1.0 / math.sqrt(n_in)
        self.lora_a = mx.random.uniform(-bound, bound, (rank, n_in))  # (r, in)
        self.lora_b = mx.zeros((n_out, rank))  # (out, r)

    @staticmethod
    def scale_of(rank: int, alpha: float) -> float:
        """alpha / rank: the one place LoRA's scale is computed."""
        return alpha / rank

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a.T) * self.scale  # (..., r)
        return y + (z @ self.lora_b.T).astype(y.dtype)  # (..., out)

    def delta(self) -> mx.array:
        """The dense update scale * B A, (n_out, n_in)."""
        return self.scale * (self.lora_b @ self.lora_a)

    def fuse(self) -> nn.Linear:
        """A plain linear (toymlx's `nn.Linear`) computing W + scale * B A (float32 when the base
        is block-held or quantized)."""
        w = base_weight(self.linear)
        dtype = w.dtype if isinstance(self.linear, nn.Linear) else mx.float32
        n_out, n_in = base_dims(self.linear)
        has_bias = "bias" in self.linear
        fused = Linear(n_in, n_out, bias=has_bias, ops=getattr(self.linear, "ops", EXACT))
        fused.weight = (w.astype(mx.float32) + self.delta()).astype(dtype)
        if has_bias:
            fused.bias = self.linear.bias
        return fused


class DoRALinear(LoRALinear):
    """LoRA with a learned magnitude per output row:
    y = m / ||W + scale B A||_row * (W x + scale B (A dropout(x))) + bias.

    `m` starts at ||W||_row, so step 0 computes the base exactly. The row norm is held constant
    in the backward pass (`stop_gradient`, the DoRA paper's and mlx-lm's choice): it saves the
    norm's gradient through the full (n_out, n_in) weight; m, A and B are all trained.
    """

    def __init__(self, linear: nn.Module, rank: int = 8, alpha: float = 16.0,
                 dropout: float = 0.0):
        super().__init__(linear, rank, alpha, dropout)
        self.m = mx.linalg.norm(base_weight(linear).astype(mx.float32), axis=1)  # (out,)

    def _adapted(self) -> mx.array:
        """W + scale B A in float32, (n_out, n_in)."""
        return base_weight(self.linear).astype(mx.float32) + self.delta()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        bias = self.linear.bias if "bias" in self.linear else None
        if bias is not None:
            y = y - bias  # the magnitude rescales W x + scale B A x, not the bias
        z = (self.dropout(x) @ self.lora_a.T) * self.scale  # (..., r)
        y = y + (z @ self.lora_b.T).astype(y.dtype)  # (..., out)
        norm = mx.stop_gradient(mx.linalg.norm(self._adapted(), axis=1))  # (out,)
        y = (self.m / norm).astype(y.dtype) * y
        return y if bias is None else y + bias

    def fuse(self) -> nn.Linear:
        """A plain linear computing the same: (m / ||W + scale B A||_row) (W + scale B A)."""
        fused = super().fuse()
        w = self._adapted()
        fused.weight = ((self.m / mx.linalg.norm(w, axis=1))[:, None] * w).astype(
            fused.weight.dtype)
        return fused


ADAPTER_KINDS: dict[str, type[LoRALinear]] = {"lora": LoRALinear, "dora": DoRALinear}
"""An adapter file's `adapter.type` -> the layer that computes it."""


# ---- applying, listing and fusing -------------------------------------------------------
def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """Short target names from "q,k,v" or a sequence; ValueError names --lora.targets."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [t.strip() for t in items if t.strip()]
    allowed = ", ".join(TARGETS)
    if not names:
        raise ValueError(f"--lora.targets: expected a comma list of {allowed}; found "
                         f"{targets!r}")
    bad = [t for t in names if t not in TARGETS]
    if bad:
        raise ValueError(f"--lora.targets: expected a comma list of {allowed}; found "
                         f"unknown target {bad[0]!r}")
    return tuple(dict.fromkeys(names))


def target_blocks(n_layers: int, layers: int | None) -> range:
    """Indices of the last `layers` blocks (all when None); ValueError names --lora.layers."""
    if layers is None:
        return range(n_layers)
    if not 1 <= layers <= n_layers:
        raise ValueError(f"--lora.layers: expected 1..{n_layers} (the base's block count) or "
                         f"unset for all, found {layers}")
    return range(n_layers - layers, n_layers)


def apply_lora(model: Llama, targets: str | Sequence[str] = ("q",), layers: int | None = None,
               rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               kind: str = "lora") -> Llama:
    """Freeze `model` and wrap the chosen projections of the last `layers` blocks in LoRA
    (`kind="dora"`: DoRA)."""
    layer = ADAPTER_KINDS[kind]
    names = parse_targets(targets)
    blocks = target_blocks(len(model.layers), layers)
    for t in names:
        part, _, leaf = TARGETS[t].partition(".")
        if leaf not in model.layers[0][part]:
            have = [n for n, p in TARGETS.items()
                    if p.partition(".")[2] in model.layers[0][p.partition(".")[0]]]
            raise ValueError(f"--lora.targets: {t!r} is not a projection of this "
                             f"{model.args.arch} model; expected a comma list of "
                             f"{', '.join(have)}")
    model.freeze()
    for i in blocks:
        for t in names:
            path = f"layers.{i}.{TARGETS[t]}"
            base = submodule(model, path)
            if isinstance(base, LoRALinear):
                raise TypeError(f"{path}: expected a plain projection, found one already "
                                "wrapped in LoRA")
            replace_submodule(model, path, layer.from_base(base, rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear in `model` by its module path (`layers.3.attn.q_proj`), in order."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    return dict(sorted(found, key=lambda pm: _order(pm[0])))


def _order(path: str) -> tuple:
    parts = path.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        rest = ".".join(parts[2:])
        kinds = list(TARGETS.values())
        return (0, int(parts[1]), kinds.index(rest) if rest in kinds else len(kinds), rest)
    return (1, 0, 0, path)


def fuse(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear in `model` by the plain Linear W + scale B A; return `model`."""
    for path, m in lora_layers(model).items():
        replace_submodule(model, path, m.fuse())
    return model


# ---- quantized or float base models -----------------------------------------------------
# ---- the llama.cpp adapter GGUF -----------------------------------------------------------
def write_adapter(path: str | os.PathLike, model: nn.Module, base_meta: dict[str, Any],
                  extra: dict[str, Any] | None = None, dtype: str = "f32") -> Path:
    """Write the model's LoRA layers as a llama.cpp LoRA adapter GGUF (matrices as `dtype`:
    f32, f16 or bf16), atomically; DoRA layers as toymlx's DoRA adapter GGUF."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("write_adapter: expected a model with LoRA layers (apply_lora), "
                         "found none")
    kinds_used = {k for k, c in ADAPTER_KINDS.items() for m in layers.values() if type(m) is c}
    if len(kinds_used) != 1:
        raise ValueError(f"write_adapter: expected one kind of adapter layer, found "
                         f"{sorted(kinds_used)}")
    kind = kinds_used.pop()
    alphas = {m.alpha for m in layers.values()}
    if len(alphas) != 1:
        raise ValueError(f"write_adapter: expected one lora alpha for every layer (the file "
                         f"holds one adapter.lora.alpha), found {sorted(alphas)}")
    tensors: dict[str, np.ndarray] = {}
    short = {v: k for k, v in TARGETS.items()}
    kinds, blocks = [], []
    for p, m in layers.items():
        name = toy_to_gguf(p + ".weight")
        tensors[name + ".lora_a"] = np.asarray(m.lora_a.astype(mx.float32))  # (r, in)
        tensors[name + ".lora_b"] = np.asarray(m.lora_b.astype(mx.float32))  # (out, r)
        if kind == "dora":
            tensors[name + ".dora_m"] = np.asarray(m.m.astype(mx.float32))  # (out,)
        _, i, rest = p.split(".", 2)
        kinds.append(short.get(rest, rest))
        blocks.append(int(i))
    arch = base_meta.get("general.architecture", "llama")
    meta = {
        "general.type": "adapter",
        "general.architecture": arch,
        "general.name": f"{base_meta.get('general.name', arch)} LoRA",
        "adapter.type": kind,
        "adapter.lora.alpha": float(alphas.pop()),
        "toy.lora.rank": int(max(m.rank for m in layers.values())),
        "toy.lora.targets": ",".join(dict.fromkeys(kinds)),
        "toy.lora.blocks": f"{min(blocks)}-{max(blocks)}",
    }
    meta.update(extra or {})
    return write_gguf(path, meta, {n: encode_tensor(n, t, dtype) for n, t in tensors.items()})


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter read from GGUF: base tensor name -> (A (r, n_in), B (n_out, r))."""

    path: str
    arch: str
    alpha: float
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    metadata: dict[str, Any]
    kind: str = "lora"
    """`adapter.type`: lora (llama.cpp's), or dora (toymlx's: with `magnitudes`)"""
    magnitudes: dict[str, np.ndarray] | None = None
    """DoRA: base tensor name -> m (n_out,)"""

    def delta(self, name: str, w: np.ndarray) -> np.ndarray:
        """What the adapter adds to base tensor `name` (weights `w`), (n_out, n_in) float64:
        scale * B A (alpha 0 means scale 1, as llama.cpp reads it); DoRA rescales W + that to
        its magnitude m per row, as `DoRALinear.fuse` does."""
        a, b = self.pairs[name]
        r = a.shape[0]
        d = LoRALinear.scale_of(r, self.alpha or r) * (b.astype(np.float64) @ a)
        if self.kind != "dora":
            return d
        v = w.astype(np.float64) + d
        return self.magnitudes[name][:, None] / np.linalg.norm(v, axis=1)[:, None] * v - w


def load_adapter(path: str | os.PathLike) -> Adapter:
    """Read and check a llama.cpp LoRA adapter GGUF (one-line GGUFError when it is not one)."""
    path = checkpoint_file(path, "--adapter")
    g = GGUFFile(path)
    meta = g.metadata
    kind = meta.get("general.type")
    if kind != "adapter":
        hint = (" (a model; pass it as the base and the adapter separately)" if kind == "model"
                or "tokenizer.ggml.tokens" in meta else "")
        raise GGUFError(f"{path}: metadata key 'general.type': expected 'adapter' (a LoRA "
                        f"adapter GGUF), found {kind!r}{hint}")
    kind = meta.get("adapter.type")
    if kind not in ADAPTER_KINDS:
        raise GGUFError(f"{path}: metadata key 'adapter.type': expected 'lora' (or toymlx's "
                        f"'dora'), found {kind!r}")
    alpha = g.get("adapter.lora.alpha", (int, float), 0.0)
    halves: dict[str, dict[str, np.ndarray]] = {}
    suffixes = ("lora_a", "lora_b", "dora_m") if kind == "dora" else ("lora_a", "lora_b")
    for name in g.tensors:
        base, _, half = name.rpartition(".")
        if half not in suffixes:
            if name.endswith("_norm.weight"):  # llama.cpp ignores these too
                continue
            raise GGUFError(f"{path}: tensor {name!r}: expected a name ending in "
                            f"{' or '.join('.' + x for x in suffixes)}, found another suffix")
        arr = g.load(name, np.float32)
        if half == "dora_m":
            halves.setdefault(base, {})[half] = arr.copy()
            continue
        if arr.ndim != 2:
            raise GGUFError(f"{path}: tensor {name!r}: expected 2 dimensions, found shape "
                            f"{arr.shape}")
        halves.setdefault(base, {})[half] = arr.copy()
    pairs, magnitudes = {}, {}
    for base, h in halves.items():
        if kind == "dora":
            m = h.pop("dora_m", None)
            if m is None or (len(h) == 2 and m.shape != (h["lora_b"].shape[0],)):
                raise GGUFError(f"{path}: tensor '{base}.dora_m': expected shape "
                                f"({h['lora_b'].shape[0] if 'lora_b' in h else 'n_out'},) "
                                f"(a DoRA magnitude per output row), found "
                                f"{'missing' if m is None else m.shape}")
            magnitudes[base] = m
        if len(h) != 2:
            missing = "lora_b" if "lora_a" in h else "lora_a"
            raise GGUFError(f"{path}: tensor '{base}.{missing}': expected present (pair of "
                            f"'{base}.{'lora_a' if missing == 'lora_b' else 'lora_b'}'), "
                            "found missing")
        a, b = h["lora_a"], h["lora_b"]
        if a.shape[0] != b.shape[1]:
            raise GGUFError(f"{path}: tensor '{base}.lora_b' shape: expected (n_out, "
                            f"{a.shape[0]}) to match lora_a's rank, found {b.shape}")
        pairs[base] = (a, b)
    if not pairs:
        raise GGUFError(f"{path}: tensors: expected lora_a/lora_b pairs, found none")
    arch = meta.get("general.architecture")
    g.close()
    return Adapter(str(path), str(arch), float(alpha), pairs, dict(meta), kind,
                   magnitudes if kind == "dora" else None)


def _adapter_targets(model: nn.Module, ad: Adapter) -> dict[str, tuple[str, np.ndarray,
                                                                       np.ndarray]]:
    """Adapter tensor name -> (module path, A, B), every shape checked against the base."""
    out = {}
    for name, (a, b) in ad.pairs.items():
        key = gguf_to_toy(name, model.args.fused_gate_up)
        try:
            module = submodule(model, key[: -len(".weight")]) if key else None
        except (AttributeError, IndexError, KeyError):
            module = None
        if isinstance(module, LoRALinear):
            module = module.linear
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear, BlockLinear)) or \
                key == "embed.weight":
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected a projection weight "
                            f"of the base (blk.N.attn_q/k/v/qkv/output, ffn_gate/up/down), found "
                            f"no such weight in a {len(model.layers)}-block base")
        n_out, n_in = base_dims(module)
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a'/'.lora_b' shapes: expected "
                            f"(r, {n_in}) and ({n_out}, r) to fit the base's {name} "
                            f"({n_out}, {n_in}), found {a.shape} and {b.shape} (wrong base?)")
        out[name] = (key[: -len(".weight")], a, b)
    return out


def _check_arch(ad: Adapter, arch: str) -> None:
    if ad.arch != arch:
        raise GGUFError(f"{ad.path}: metadata key 'general.architecture': expected {arch!r} "
                        f"(the base model's), found {ad.arch!r}")


def apply_adapter(model: Llama, path_or_run_dir: str | os.PathLike) -> Llama:
    """Wrap `model`'s projections with the adapter's LoRA layers (a file or a run directory);
    the adapter's architecture must be the model's."""
    ad = load_adapter(path_or_run_dir)
    _check_arch(ad, model.args.arch)
    for name, (path, a, b) in _adapter_targets(model, ad).items():
        base = submodule(model, path)
        if isinstance(base, LoRALinear):
            raise TypeError(f"{path}: expected a plain projection, found one already "
                            "wrapped in LoRA (apply one adapter per model)")
        rank = a.shape[0]
        # llama.cpp: alpha 0 (or absent) means scale 1, i.e. alpha = r.
        m = ADAPTER_KINDS[ad.kind].from_base(base, rank, ad.alpha or float(rank))
        m.lora_a, m.lora_b = mx.array(a), mx.array(b)
        if ad.magnitudes is not None:
            m.m = mx.array(ad.magnitudes[name])
        replace_submodule(model, path, m)
    mx.eval(model.parameters())
    return model


def load_adapter_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy an adapter file's A and B (and DoRA's m) into the model's existing LoRA layers:
    resume, or a new run started from an adapter (`--lora.init-adapter`).

    The file must hold exactly the model's LoRA layers, of the same kind, ranks and alpha.
    """
    ad = load_adapter(path)
    _check_arch(ad, model.args.arch)
    have = {toy_to_gguf(p + ".weight"): m for p, m in lora_layers(model).items()}
    kind = next((k for k, c in ADAPTER_KINDS.items()
                 if any(type(m) is c for m in have.values())), "lora")
    if ad.kind != kind:
        raise GGUFError(f"{ad.path}: metadata key 'adapter.type': expected {kind!r} (this "
                        f"run's --fine-tune-type), found {ad.kind!r}")
    if set(have) != set(ad.pairs):
        extra = sorted(set(ad.pairs) - set(have))
        missing = sorted(set(have) - set(ad.pairs))
        raise GGUFError(f"{ad.path}: tensors: expected LoRA pairs for exactly the model's "
                        f"{len(have)} adapted weights, found {len(ad.pairs)} (missing "
                        f"{missing[:2]}, unexpected {extra[:2]})")
    targets = _adapter_targets(model, ad)
    for name, (_, a, b) in targets.items():
        m = have[name]
        if a.shape[0] != m.rank or (ad.alpha or a.shape[0]) != m.alpha:
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected rank {m.rank} and "
                            f"alpha {m.alpha} (this run's), found rank {a.shape[0]} and alpha "
                            f"{ad.alpha}")
        m.lora_a, m.lora_b = mx.array(a), mx.array(b)
        if ad.magnitudes is not None:
            if ad.magnitudes[name].shape != m.m.shape:
                raise GGUFError(f"{ad.path}: tensor '{name}.dora_m': expected shape "
                                f"{m.m.shape}, found {ad.magnitudes[name].shape}")
            m.m = mx.array(ad.magnitudes[name])
    mx.eval(model.parameters())


# ---- merged model export ------------------------------------------------------------------
KEPT_WARNING = 0.5
"""Below this share of the adapter's change kept, a fused export says so (see adapter_kept)."""


def adapter_kept(fused: str | os.PathLike, base: str | os.PathLike,
                 adapter: str | os.PathLike) -> float:
    """The share of the adapter's change a fused file keeps, on the adapted layers' outputs
    (`toymlx.gguf.fuse.kept_from`): over the adapted tensors, with D the adapter's change, F = W + D
    and Q the file's weights, 1 - sqrt(sum ||Q - F||^2 / sum ||D||^2) clipped to [0, 1]: the
    output error on isotropic inputs against the change's own output. Rounding the untouched
    part of W again counts as error, never as change (1: all of it kept; 0: noise as large as
    the change). Weights dequantized by gguf-py, sums in float64."""
    from toymlx.gguf.fuse import kept_from

    ad = load_adapter(adapter)
    err2 = delta2 = 0.0
    with GGUFFile(base) as g, GGUFFile(fused) as f:
        for name in ad.pairs:
            w = g.load(name, np.float32)
            d = ad.delta(name, w)
            e = f.load(name, np.float64) - (w + d)
            err2, delta2 = err2 + float(np.vdot(e, e)), delta2 + float(np.vdot(d, d))
            f.release(name)
            g.release(name)
    return kept_from(err2, delta2)


def kept_note(kept: float, dtype: str) -> str:
    """What a user reads about `adapter_kept`: the share, and what to do when it is small."""
    note = f"keeps {kept:.0%} of the adapter's change on the adapted layers' outputs"
    if kept < KEPT_WARNING:
        note += (f" (warning: the rest is lost to {dtype}'s rounding; to keep the fine-tune, "
                 "export without --dtype (each adapted tensor in a type that keeps its change), "
                 "or --dtype q8_0 or f16, or run the base with the adapter: llama-cli --lora)")
    return note

def write_merged(out: str | os.PathLike, base: str | os.PathLike,
                 adapter: str | os.PathLike | None = None, dtype: str | None = None,
                 progress: bool = False) -> Path:
    """Write `base` (+ `adapter`, LoRA or DoRA, fused into its weights) as a full GGUF; `base`
    may be a full fine-tune's run folder (its latest checkpoint).

    No `dtype`, with an adapter or for a full fine-tune: the file that keeps the fine-tune
    (`toymlx.gguf.fuse.write_kept`): the base's tensors byte for byte, each adapted (changed) one in
    the smallest type that keeps its change, general.file_type the base's. Otherwise every
    tensor re-encoded in `dtype` (default: the base's own, `export_type`) through
    `write_model_gguf`, byte for byte what llama-quantize writes from the fused F32 model."""
    if dtype is None:
        if adapter is not None:
            return write_fused_kept(out, base, adapter, progress).path
        trained_from = fine_tune_base(base)
        if trained_from is not None:
            return write_full_kept(out, trained_from, base, progress).path
    base = checkpoint_file(base, "--base")
    with GGUFFile(base) as g:
        dtype = dtype or export_type(g)
    quantizer(dtype)  # refused before the work, if nothing here writes this type
    model, g = load_llama(base)
    extra = {}
    if adapter is not None:
        ad_path = checkpoint_file(adapter, "--adapter")
        apply_adapter(model, ad_path)
        fuse(model)
        extra["toy.merged_adapter"] = ad_path.name
    try:
        meta, types, weights = like_base(g, model, extra)
    finally:
        g.close()
    del model
    return write_model_gguf(out, meta, types, weights, dtype, progress)


def write_fused_kept(out: str | os.PathLike, base: str | os.PathLike,
                     adapter: str | os.PathLike, progress: bool = False):
    """`base` + `adapter` (LoRA or DoRA) fused by `toymlx.gguf.fuse.write_kept` (the file that keeps
    the fine-tune); returns its `KeptFile`. The adapter is checked against the base first
    (architecture, every adapted weight's name and shape), as `apply_adapter` checks it."""
    from toymlx.gguf.fuse import write_kept

    base = checkpoint_file(base, "--base")
    ad_path = checkpoint_file(adapter, "--adapter")
    ad = load_adapter(ad_path)
    with GGUFFile(base) as g:
        _check_arch(ad, str(g.metadata.get("general.architecture", "llama")))
        for name, (a, b) in ad.pairs.items():
            info = g.tensors.get(name)
            if info is None or len(info.shape) != 2 or name == "token_embd.weight":
                raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected a projection "
                                f"weight of the base {base}, found no such weight")
            if (b.shape[0], a.shape[1]) != info.shape:
                raise GGUFError(f"{ad.path}: tensor '{name}.lora_a'/'.lora_b' shapes: expected "
                                f"(r, {info.shape[1]}) and ({info.shape[0]}, r) to fit the "
                                f"base's {name} {info.shape}, found {a.shape} and {b.shape} "
                                "(wrong base?)")

    def fused(name: str, w: np.ndarray) -> np.ndarray:
        return (w.astype(np.float64) + ad.delta(name, w)).astype(np.float32)

    return write_kept(out, base, ad.pairs, fused, {"toy.merged_adapter": ad_path.name},
                      progress=progress)


class _Moments:
    """Running X^T X of the inputs one layer sees (float64)."""

    def __init__(self) -> None:
        self.h: np.ndarray | None = None
        self.rows = 0

    def add(self, x: mx.array) -> None:
        a = np.asarray(x.astype(mx.float32), np.float64).reshape(-1, x.shape[-1])
        self.h = a.T @ a if self.h is None else self.h + a.T @ a
        self.rows += len(a)


class _Recorded(nn.Module):
    """A layer whose inputs are added to `moments` as it computes."""

    def __init__(self, inner: nn.Module, moments: _Moments):
        super().__init__()
        self.inner = inner
        self.moments = moments

    def __call__(self, x: mx.array) -> mx.array:
        self.moments.add(x)
        return self.inner(x)


MOMENT_ROWS = 256
"""Training rows (at most) whose activations a data-aware rounding (`write_fused_exact`) uses."""


def input_moments(model: Llama, rows: np.ndarray, batch: int = 4) -> dict[str, np.ndarray]:
    """GGUF tensor name -> X^T X of the inputs its (LoRA or DoRA) layer sees over `rows`
    (token ids, (n, seq)); the model computes as it trains (base + adapter)."""
    layers = lora_layers(model)
    moments = {p: _Moments() for p in layers}
    for p, m in layers.items():
        replace_submodule(model, p, _Recorded(m, moments[p]))
    try:
        for i in range(0, len(rows), batch):
            mx.eval(model(mx.array(rows[i:i + batch])))
    finally:
        for p, m in layers.items():
            replace_submodule(model, p, m)
    return {toy_to_gguf(p + ".weight"): moments[p].h for p in layers}


def write_fused_exact(out: str | os.PathLike, base: str | os.PathLike,
                      adapter: str | os.PathLike, progress: bool = False) -> tuple[Path, float]:
    """`base` + `adapter` (a LoRA or DoRA run) fused in the base's own tensor types, byte for
    byte its size: every other tensor the base's bytes, each adapted one rounded by
    `toymlx.gguf.gptq` to keep its outputs on the inputs the layer sees over the run's own
    training rows (at most `MOMENT_ROWS`). Returns (the file, the share of the change kept on
    those inputs, `toymlx.gguf.fuse.kept_from` over the adapted layers)."""
    from toymlx.bundle.runs import Bundle
    from toymlx.data.chat import SFTData
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.fuse import kept_from, write_with_tensors
    from toymlx.gguf.gptq import GPTQ_TYPES, gptq_quantize
    from toymlx.gguf.quantize import dequantize_tensor
    from toymlx.recipes.lora import DEFAULT_DATA

    bundle = Bundle.of(adapter, "--adapter")
    if bundle is None or bundle.recipe != "lora":
        raise ValueError(f"{adapter}: --exact-size: expected a LoRA run folder (its training "
                         "rows give each layer's inputs), found an adapter outside a run")
    base = checkpoint_file(base, "--base")
    ad_path = checkpoint_file(adapter, "--adapter")
    ad = load_adapter(ad_path)
    with GGUFFile(base) as g:
        bad = sorted({g.tensors[n].type.name for n in ad.pairs} - {t.name for t in GPTQ_TYPES})
        if bad:
            raise ValueError(f"{base}: --exact-size: expected adapted tensors of type "
                             f"{', '.join(t.name for t in GPTQ_TYPES)}, found {', '.join(bad)}")
        tok = Tokenizer.from_metadata(g.metadata, source=str(base))
    cfg = bundle.config
    data = SFTData.from_file(cfg.data.path or DEFAULT_DATA, tok, cfg.seq_len,
                             cfg.data.mask_prompt, cfg.data.pack, cfg.data.val_fraction)
    model, g = load_llama(base)
    g.close()
    apply_adapter(model, ad_path)
    moments = input_moments(model, data.train["inputs"][:MOMENT_ROWS])
    del model
    err2 = delta2 = 0.0
    tensors = {}
    with GGUFFile(base) as g:
        for i, (name, h) in enumerate(moments.items()):
            info = g.tensors[name]
            w = g.load(name, np.float32)
            d = ad.delta(name, w)
            f = w + d
            raw = gptq_quantize(f, h, info.type)
            e = dequantize_tensor(raw, info.type, info.shape) - f
            err2 += float(np.sum((e @ h) * e))
            delta2 += float(np.sum((d @ h) * d))
            tensors[name] = raw
            if progress:
                print(f"\rrounding on the run's activations: {i + 1}/{len(moments)}", end="",
                      file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        out = write_with_tensors(out, g, tensors, {"toy.merged_adapter": ad_path.name},
                                 progress)
    return out, kept_from(err2, delta2)


def fine_tune_base(run_or_checkpoint: str | os.PathLike) -> Path | None:
    """The file a full fine-tune was trained from (its run_start's absolute `base_file`), for
    a full fine-tune's run folder or checkpoint; None for anything else. FileNotFoundError,
    naming it, when that file is gone."""
    from toymlx.bundle.runs import Bundle

    bundle = Bundle.of(run_or_checkpoint, "--base")
    if bundle is None or getattr(bundle.config, "fine_tune_type", None) != "full":
        return None
    start = next((e for e in bundle.events if e["kind"] == "run_start"), {})
    recorded = start.get("config", {}).get("base_file")
    if not recorded or not Path(recorded).is_file():
        raise FileNotFoundError(f"{bundle.path}: run_start 'base_file': expected the file the "
                                f"full fine-tune was trained from, found "
                                f"{'nothing recorded' if not recorded else 'no file ' + recorded}"
                                "; pass --dtype to re-encode the checkpoint alone")
    return Path(recorded)


def write_full_kept(out: str | os.PathLike, base: str | os.PathLike,
                    checkpoint: str | os.PathLike, progress: bool = False):
    """A full fine-tune's `checkpoint` as the file that keeps the fine-tune
    (`toymlx.gguf.fuse.write_kept` over the file `base` it was trained from): each tensor it changed
    in a type that keeps the change, every other one the base's own bytes."""
    from toymlx.gguf.fuse import write_kept

    checkpoint = checkpoint_file(checkpoint, "--base")
    with GGUFFile(base) as g, GGUFFile(checkpoint) as c:
        if {n: i.shape for n, i in g.tensors.items()} != {n: i.shape for n, i in
                                                          c.tensors.items()}:
            raise GGUFError(f"{checkpoint}: tensors: expected the names and shapes of the base "
                            f"it was trained from ({base}), found others")
        changed = [n for n in g.tensors
                   if not np.array_equal(g.load(n, np.float32), c.load(n, np.float32))]
    c = GGUFFile(checkpoint)
    try:
        return write_kept(out, base, changed, lambda name, w: c.load(name, np.float32),
                          {"toy.fine_tuned": checkpoint.name}, progress=progress)
    finally:
        c.close()


def like_base(g: GGUFFile, model: Llama, extra: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]], dict[str, np.ndarray]]:
    """(metadata, their GGUF types, float32 tensors) of `model` as a file of the base `g`'s kind:
    every metadata key of the base (tokenizer, chat template, hyperparameters) with its original
    GGUF type, `extra` added, and the base's other tensors (RoPE constants: rope_freqs,
    rope_factors_*); the writer sets general.file_type."""
    skip = ("general.alignment", "general.file_type", BASE_FILE_TYPE)
    meta = {k: v for k, v in g.metadata.items() if k not in skip}
    types = {k: t for k, t in g.metadata_types.items() if k not in skip}
    meta.update(extra or {})
    weights = llama_tensors(model)
    for name in g.tensors:  # RoPE constants as the base has them
        if name not in weights:
            weights[name] = g.load(name, np.float32)
    return meta, types, weights


def write_like_base(out: str | os.PathLike, g: GGUFFile, model: Llama, dtype: str,
                    extra: dict[str, Any] | None = None) -> Path:
    """A full fine-tune's checkpoint: `model` as a GGUF of the base `g`'s kind (`like_base`),
    matrices in `dtype` (f32/f16/bf16), with the tensor digest a resume verifies, and the base's
    general.file_type as `toy.base_file_type` (its export defaults to that type)."""
    meta, types, weights = like_base(g, model, extra)
    meta["general.file_type"] = FILE_TYPE[dtype]
    types["general.file_type"] = (UINT32, None)
    base_type = g.metadata.get(BASE_FILE_TYPE, g.metadata.get("general.file_type"))
    if isinstance(base_type, int):
        meta[BASE_FILE_TYPE], types[BASE_FILE_TYPE] = base_type, (UINT32, None)
    tensors = {n: encode_tensor(n, w, dtype) for n, w in weights.items()}
    return write_gguf(out, meta, tensors, types=types)
