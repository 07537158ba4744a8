"""LoRA and DoRA: low-rank adapters wrapped around a frozen model's projections.

`LoRALinear` adds `scale * B (A x)` to a frozen projection (a float `nn.Linear` or an
`nn.QuantizedLinear`). `lora_a` is `(r, n_in)` and `lora_b` `(n_out, r)`: the orientation
PEFT and llama.cpp store, so an adapter file needs no transpose. `lora_b` starts at zero, so
step 0 computes exactly the base model; `scale = alpha / rank` is computed in
`LoRALinear.scale_of` and nowhere else (llama.cpp applies the same `alpha / r`).

DoRA (`DoRALinear`, Liu et al. 2024, as mlx-lm's `--fine-tune-type dora`): the same A and B plus
a trained magnitude per output row, `m * (W + scale B A) / ||W + scale B A||_row`. Their file
format is `toymlx.training.adapter`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import mlx.core as mx
from mlx import nn

from toymlx.models.layers import (
    BlockLinear,
    Dropout,
    Linear,
    dense_weight,
    replace_submodule,
    submodule,
)
from toymlx.models.llama import Llama, LlamaArgs
from toymlx.models.moe import BlockExperts, ExpertLinear, expert_product
from toymlx.models.ops import EXACT

TARGETS: dict[str, str] = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj",
                           "qkv": "attn.qkv_proj", "o": "attn.o_proj", "gate": "mlp.gate_proj",
                           "up": "mlp.up_proj", "gate_up": "mlp.gate_up_proj",
                           "down": "mlp.down_proj", "z": "attn.z_proj", "beta": "attn.beta_proj",
                           "alpha": "attn.alpha_proj", "out": "attn.out_proj",
                           "router": "mlp.router", "ple_gate": "ple_gate", "ple_proj": "ple_proj"}
"""--lora.targets short names -> projection paths inside a decoder block (qkv and gate_up:
phi3's fused projections, which it has instead of q, k, v and gate, up; qkv, z, beta, alpha
and out: the projections of qwen35's linear-attention blocks, attn_qkv, attn_gate, ssm_beta,
ssm_alpha and ssm_out, each of which llama.cpp's adapters adapt; router: a mixture of
experts' `ffn_gate_inp`, which it has instead of gate, up and down; ple_gate and ple_proj:
gemma4's per-layer-input gate and projection, blk.N.inp_gate and blk.N.proj, which llama.cpp's
adapters adapt too, in the E2B/E4B files that have per-layer embeddings)."""
ALL_LINEAR = "all-linear"
"""--lora.targets all-linear: Unsloth's target_modules="all-linear": every linear projection of
the base's blocks but a mixture of experts' router, as `all_linear` lists them for that base."""
MLX_LM_DEFAULT = "mlx-lm-default"
"""--lora.targets mlx-lm-default: what mlx-lm adapts when its config gives no
lora_parameters.keys, every linear layer of each block, a mixture of experts' router too
(`mlx_lm_default`); what toymlx-train sets for an mlx-lm config file without keys."""
LINEAR_TARGETS = ("qkv", "z", "beta", "alpha", "out", "gate", "up", "down")
"""The targets a qwen35 linear-attention block has (its full-attention blocks have q, k, v, o
and the MLP's)."""
LINEAR_ONLY = ("z", "beta", "alpha", "out")
"""The targets no block but a qwen35 linear-attention one has."""
PLE_TARGETS = ("ple_gate", "ple_proj")
"""The targets no block but one of a base with per-layer embeddings (gemma4 E2B/E4B) has."""
EXPERT_TARGETS = {"gate": "mlp.gate_exps", "up": "mlp.up_exps", "down": "mlp.down_exps"}
"""The MLP targets' paths in a mixture-of-experts block: its 3-D expert tensors (ffn_gate_exps,
ffn_up_exps, ffn_down_exps), one A and B per expert (`ExpertLoRA`)."""
TARGET_OF: dict[str, str] = {**{path: t for t, path in TARGETS.items()},
                             **{path: t for t, path in EXPERT_TARGETS.items()}}
"""A projection path inside a block, dense or expert (`mlp.gate_proj`, `mlp.gate_exps`) -> its
--lora.targets name: each mapping inverted on its own, since both name gate, up and down."""


def target_path(t: str, a: LlamaArgs) -> str:
    """The path of target `t` inside a block of a model with args `a`."""
    return EXPERT_TARGETS[t] if a.n_experts and t in EXPERT_TARGETS else TARGETS[t]

def base_dims(linear: nn.Module) -> tuple[int, int]:
    """(n_out, n_in) of a float, block-held or MLX-quantized linear layer (of each expert, for
    an expert tensor)."""
    if isinstance(linear, (BlockLinear, ExpertLinear, BlockExperts)):
        return linear.n_out, linear.n_in
    if isinstance(linear, nn.QuantizedLinear):
        n_out, packed = linear.weight.shape
        return n_out, packed * 32 // linear.bits
    if isinstance(linear, nn.Linear):
        return tuple(linear.weight.shape)
    raise TypeError(f"LoRA: expected a linear layer (float, block-held or MLX-quantized), "
                    f"found {type(linear).__name__}")


def base_weight(linear: nn.Module) -> mx.array:
    """The (n_out, n_in) weight of a linear layer, decoded or dequantized if need be ((E, n_out,
    n_in) for an expert tensor)."""
    if isinstance(linear, (ExpertLinear, BlockExperts)):
        return linear.dense()
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
        self.linear = linear
        self.dropout = Dropout(dropout)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.scale_of(self.rank, self.alpha)
        a_shape, b_shape = self.pair_shapes()
        # PEFT's init: A ~ U(-1/sqrt(n_in), 1/sqrt(n_in)), B = 0, so the update starts at zero.
        bound = 1.0 / math.sqrt(a_shape[-1])
        self.lora_a = mx.random.uniform(-bound, bound, a_shape)  # (r, in); experts' (E, r, in)
        self.lora_b = mx.zeros(b_shape)  # (out, r); experts' (E, out, r)

    def pair_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of A and B: (r, n_in) and (n_out, r)."""
        n_out, n_in = base_dims(self.linear)
        return (self.rank, n_in), (n_out, self.rank)

    def fused_dtype(self, w: mx.array) -> mx.Dtype:
        """The dtype `fuse` writes W + scale B A in: the base's, `w`'s, where it holds a float
        weight; float32 where it is block-held or quantized."""
        return w.dtype if isinstance(self.linear, (nn.Linear, ExpertLinear)) else mx.float32

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
        n_out, n_in = base_dims(self.linear)
        has_bias = "bias" in self.linear
        fused = Linear(n_in, n_out, bias=has_bias, ops=getattr(self.linear, "ops", EXACT))
        fused.weight = (w.astype(mx.float32) + self.delta()).astype(self.fused_dtype(w))
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


class ExpertLoRA(LoRALinear):
    """LoRA on a frozen 3-D expert tensor (E, out, in): an A (r, in) and B (out, r) per expert,
    `lora_a` (E, r, in) and `lora_b` (E, out, r), each token's chosen experts' applied to it,
    as llama.cpp's `build_lora_mm_id` applies an adapter's `*_exps` pair (GGUF ne {in, r, E}
    and {r, out, E})."""

    def pair_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of A and B, one pair per expert: (E, r, n_in) and (E, n_out, r)."""
        n_out, n_in = base_dims(self.linear)
        e = self.linear.n_experts
        return (e, self.rank, n_in), (e, n_out, self.rank)

    def __call__(self, x: mx.array, idx: mx.array, by_expert: bool = False) -> mx.array:
        """`toymlx.models.moe.expert_product`'s shapes (`by_expert`: pairs sorted by expert)."""
        y = self.linear(x, idx, by_expert)  # (N, k, 1, out)
        z = expert_product(self.dropout(x), self.lora_a, idx, by_expert) * self.scale
        return y + expert_product(z, self.lora_b, idx, by_expert).astype(y.dtype)

    def fuse(self) -> ExpertLinear:
        """A float expert tensor computing W + scale * B A per expert (float32 when the base is
        block-held)."""
        w = base_weight(self.linear)
        fused = ExpertLinear(self.linear.n_experts, self.linear.n_out, self.linear.n_in,
                             getattr(self.linear, "ops", EXACT))
        fused.weight = (w.astype(mx.float32) + self.delta()).astype(self.fused_dtype(w))
        return fused


ADAPTER_KINDS: dict[str, type[LoRALinear]] = {"lora": LoRALinear, "dora": DoRALinear}
"""An adapter file's `adapter.type` -> the layer that computes it."""


# ---- applying, listing and fusing -------------------------------------------------------
def parse_targets(targets: str | Sequence[str],
                  gguf_names: Callable[[], Mapping[str, str]] | None = None
                  ) -> tuple[str, ...]:
    """Short target names from "q,k,v" or a sequence, `ALL_LINEAR` and `MLX_LM_DEFAULT` kept as
    given (`resolve_targets` expands them against a base); ValueError names --lora.targets, and
    the same list in toymlx's names where it is Hugging Face's or, given `gguf_names` (the
    base's GGUF block tensor names -> their targets, `toymlx.gguf.llama.gguf_targets`: called
    only for a name toymlx does not know, as it reads the base's header), llama.cpp's."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [t.strip() for t in items if t.strip()]
    allowed = ", ".join(TARGETS) + f", {ALL_LINEAR} or {MLX_LM_DEFAULT}"
    if not names:
        raise ValueError(f"--lora.targets: expected a comma list of {allowed}; found "
                         f"{targets!r}")
    bad = [t for t in names if t not in TARGETS and t not in (ALL_LINEAR, MLX_LM_DEFAULT)]
    if bad:
        whose, said = "Hugging Face's names", hf_targets(names)
        if said is None and gguf_names is not None:
            whose, said = "llama.cpp's tensor names", toymlx_targets(names, gguf_names())
        if said is None:
            whose, said = other_spelling(names)
        raise ValueError(f"--lora.targets: expected a comma list of {allowed}; found "
                         f"unknown target {bad[0]!r}"
                         + (f" ({whose}; toymlx's are --lora.targets {said})" if said else ""))
    return tuple(dict.fromkeys(names))


def other_spelling(names: Sequence[str]) -> tuple[str, str | None]:
    """(whose spelling, the list in toymlx's) of target names toymlx knows spelt otherwise:
    upper case (`Q,V`), or LLaMA-Factory's `all` for every linear layer; (.., None) else."""
    said = [ALL_LINEAR if t.lower() == "all" else t.lower() for t in names]
    if said == list(names) or any(t not in TARGETS and t not in (ALL_LINEAR, MLX_LM_DEFAULT)
                                  for t in said):
        return "", None
    return ("LLaMA-Factory's all" if ALL_LINEAR in said and "all" in [t.lower() for t in names]
            else "upper case"), ",".join(said)


def all_linear(a: LlamaArgs) -> tuple[str, ...]:
    """What --lora.targets all-linear adapts on a base with args `a`: every linear projection
    its blocks have (`block_targets`), as PEFT's all-linear wraps every nn.Linear of every block
    and mlx-lm's default without keys every linear layer of them. A dense base: q,k,v,o,gate,
    up,down (phi3: its fused qkv,o,gate_up,down). qwen35: those of its full-attention blocks and
    its linear-attention blocks' qkv,z,beta,alpha,out too (each block adapts those it has). A
    mixture of experts: q,k,v,o and gate,up,down as its experts' tensors (a pair per expert),
    not the router (ffn_gate_inp), which PEFT's all-linear and mlx-lm's default would also wrap
    (an nn.Linear there; `mlx_lm_default` adds it): Unsloth leaves a MoE's router untrained by
    default, since adapting it moves which experts each token picks; --lora.targets
    all-linear,router adds it. gemma4 E2B/E4B: ple_gate and ple_proj too (nn.Linear in each
    block, as PEFT's all-linear and mlx-lm's default wrap them)."""
    return tuple(t for t in block_targets(a) if t != "router")


def resolve_targets(targets: str | Sequence[str], a: LlamaArgs) -> tuple[str, ...]:
    """--lora.targets as the target names it adapts on a base with args `a` (`parse_targets`'s,
    `ALL_LINEAR` expanded to `all_linear(a)` and `MLX_LM_DEFAULT` to `mlx_lm_default(a)` in
    their place): the one place those names meet the base, so the run records (run_start's
    lora_targets_resolved) what it adapted."""
    out: list[str] = []
    for t in parse_targets(targets):
        out += (all_linear(a) if t == ALL_LINEAR else mlx_lm_default(a) if t == MLX_LM_DEFAULT
                else [t])
    return tuple(dict.fromkeys(out))


# ---- mlx-lm's module paths (lora_parameters.keys, its adapters' keys) ---------------------
MLX_LM_KEYS: dict[str, str | None] = {
    # llama, qwen2/3, gemma, ... and qwen3_5's full-attention blocks; phi3's fused qkv_proj
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o",
    # qwen3_5's linear-attention blocks (mlx_lm/models/qwen3_5.py's GatedDeltaNet)
    "linear_attn.in_proj_qkv": "qkv", "linear_attn.in_proj_z": "z",
    "linear_attn.in_proj_b": "beta", "linear_attn.in_proj_a": "alpha",
    "linear_attn.out_proj": "out",
    # a dense MLP (phi3's fused gate_up_proj)
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.gate_up_proj": "gate_up",
    "mlp.down_proj": "down",
    # qwen3_moe's and qwen2_moe's mixture of experts: the router and the experts' SwitchGLU
    "mlp.gate": "router", "mlp.switch_mlp.gate_proj": "gate", "mlp.switch_mlp.up_proj": "up",
    "mlp.switch_mlp.down_proj": "down",
    # mixtral's
    "block_sparse_moe.gate": "router", "block_sparse_moe.switch_mlp.gate_proj": "gate",
    "block_sparse_moe.switch_mlp.up_proj": "up", "block_sparse_moe.switch_mlp.down_proj": "down",
    # gemma4's per-layer-input gate and projection (mlx_lm/models/gemma4_text.py's E2B/E4B)
    "per_layer_input_gate": "ple_gate", "per_layer_projection": "ple_proj",
    # qwen2_moe's shared expert, which no --lora.targets name adapts
    "mlp.shared_expert.gate_proj": None, "mlp.shared_expert.up_proj": None,
    "mlp.shared_expert.down_proj": None, "mlp.shared_expert_gate": None}
"""mlx-lm's module paths inside a block (as `mlx_lm.models.<arch>` names them: its config's
lora_parameters.keys, its adapters' `model.layers.N.<path>.lora_a`) -> the --lora.targets name
adapting the same projection; None: one toymlx cannot adapt. Which of them a block has is
`mlx_lm_modules`'."""


def mlx_lm_modules(a: LlamaArgs, block: int) -> dict[str, str | None]:
    """The mlx-lm module paths block `block` of a base with args `a` has (`MLX_LM_KEYS`' names)
    -> their --lora.targets name (None: qwen2moe's shared expert, which toymlx cannot adapt),
    what mlx-lm's `linear_to_lora_layers` wraps in that block when its config gives no keys
    (every nn.Linear and SwitchLinear of it): qwen3_5's linear-attention blocks have
    `linear_attn`, its others `self_attn`; a mixture of experts' MLP is its router and its
    experts (mixtral's under `block_sparse_moe`), a dense MLP's `mlp.gate_proj` it has not;
    gemma4's blocks with per-layer embeddings their `per_layer_input_gate` and
    `per_layer_projection` too. The one place mlx-lm's names meet a base: an mlx-lm config's
    keys and adapters are read by it. Checked against mlx-lm's own llama, phi3, qwen3_5,
    qwen3_moe, mixtral, qwen2_moe and gemma4 (tests/test_mlx_lm_config.py)."""
    have = block_targets(a, block)
    attn = "linear_attn." if a.is_linear(block) else "self_attn."
    if a.n_experts:
        moe = "block_sparse_moe." if a.arch == "llama" else "mlp."
        mlp = (moe + "gate", moe + "switch_mlp.gate_proj", moe + "switch_mlp.up_proj",
               moe + "switch_mlp.down_proj")
        if a.shared_expert_ffn_dim:
            mlp += ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                    "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")
    else:
        mlp = tuple(m for m, t in MLX_LM_KEYS.items()
                    if m.startswith("mlp.") and m.count(".") == 1 and t in have and t != "router")
    ple = tuple(m for m, t in MLX_LM_KEYS.items() if t in PLE_TARGETS and t in have)
    return {m: t for m, t in MLX_LM_KEYS.items()
            if (m.startswith(attn) and t in have) or m in mlp or m in ple}


def mlx_lm_default(a: LlamaArgs) -> tuple[str, ...]:
    """What mlx-lm adapts on a base with args `a` when its config gives no lora_parameters.keys,
    as --lora.targets names: every module of every block `mlx_lm_modules` lists, which on a
    mixture of experts is `all_linear`'s and its router (an nn.Linear mlx-lm wraps too;
    tests/test_mlx_lm_config.py checks this against mlx-lm's own `linear_to_lora_layers`).
    ValueError naming --lora.targets where that includes a projection toymlx cannot adapt
    (qwen2moe's shared expert)."""
    out: list[str | None] = []
    for i in range(a.n_layers):
        mods = mlx_lm_modules(a, i)
        lost = [m for m, t in mods.items() if t is None]
        if lost:
            raise ValueError(
                f"--lora.targets: {MLX_LM_DEFAULT} (mlx-lm's default without lora_parameters."
                f"keys) adapts every linear layer of this {a.arch} base's blocks, its shared "
                f"expert's too ({', '.join(lost)}), which toymlx cannot adapt; name the others "
                f"instead: --lora.targets all-linear,router (lora_parameters.keys "
                f"{', '.join(m for m, t in mods.items() if t is not None)})")
        out += mods.values()
    return tuple(t for t in TARGETS if t in out)


HF_TARGETS: dict[str, str] = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o", "mlp.gate_proj": "gate",
    "mlp.up_proj": "up", "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down",
    "per_layer_input_gate": "ple_gate", "per_layer_projection": "ple_proj"}
"""Hugging Face's projection paths inside a dense decoder block (PEFT's target_modules; gemma4's
per-layer-input gate and projection too) ->
toymlx's --lora.targets names (`TARGETS` gives their paths; mlx-lm's paths, MoE and qwen3_5's
too, are `MLX_LM_KEYS`)."""


def hf_targets(names: Sequence[str]) -> str | None:
    """PEFT's (Unsloth's, mlx-lm's) target_modules as --lora.targets names: `q_proj` or
    `self_attn.q_proj` ("q"; all-linear is toymlx's too); None where a name is neither toymlx's
    nor Hugging Face's."""
    return toymlx_targets(names, {**HF_TARGETS, **{path.rpartition(".")[2]: t
                                                   for path, t in HF_TARGETS.items()}})


def toymlx_targets(names: Sequence[str], other: Mapping[str, str]) -> str | None:
    """`names` in another tool's words (`other`: its name -> toymlx's) as --lora.targets names,
    toymlx's own kept; None where a name is neither."""
    out: list[str] = []
    for n in names:
        if n in TARGETS or n == ALL_LINEAR or n in other:
            out.append(other.get(n, n))
        else:
            return None
    return ",".join(dict.fromkeys(out))


FUSED: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
"""The fused projections -> the targets each holds (phi3 is the architecture that has them)."""


def block_targets(a: LlamaArgs, layer: int | None = None) -> tuple[str, ...]:
    """The --lora.targets names block `layer` of this architecture has (None: any of its
    blocks), in TARGETS' order: qwen35's linear-attention blocks have their own; a gemma4 block
    reading an earlier block's keys and values has no k or v, and one whose values are its keys'
    projection no v; only a base with per-layer embeddings (gemma4 E2B/E4B) has ple_gate and
    ple_proj, in every block."""
    absent = set(FUSED["qkv"]) if a.fused_qkv else {"qkv"}
    absent |= set() if a.per_layer_dim else set(PLE_TARGETS)
    absent |= set(FUSED["gate_up"]) if a.fused_gate_up else {"gate_up"}
    absent |= set(LINEAR_ONLY)
    absent |= {"gate_up"} if a.n_experts else {"router"}
    if a.linear_layers and (layer is None or a.is_linear(layer)):
        linear = set(LINEAR_TARGETS)
        if layer is not None:
            return tuple(t for t in TARGETS if t in linear)
        absent -= linear
    if layer is not None and a.kv_source(layer) is not None:
        absent |= {"k", "v"}
    elif layer is not None and a.k_eq_v and not a.is_sliding(layer):
        absent.add("v")
    return tuple(t for t in TARGETS if t not in absent)


def target_reach(a: LlamaArgs, names: Sequence[str], blocks: Sequence[int]
                 ) -> tuple[int, str | None]:
    """How many of `blocks` (those --lora.layers picks) the targets `names` reach, and, where
    that is fewer than all, one line saying so and which targets reach the others: on qwen35
    the default q reaches its full-attention blocks alone (6 of a 0.8B's 24), not its
    linear-attention ones; on gemma4 k and v miss its shared-KV tail. None where all."""
    reached = [i for i in blocks if set(names) & set(block_targets(a, i))]
    if len(reached) == len(blocks):
        return len(reached), None
    missed: dict[tuple[str, ...], list[int]] = {}
    for i in blocks:
        if i not in reached:
            missed.setdefault(block_targets(a, i), []).append(i)
    others = []
    for have, where in missed.items():
        kind = "linear-attention " if a.is_linear(where[0]) else ""
        have = sorted(have, key=lambda t: not TARGETS[t].startswith("attn."))  # attention's first
        others.append(f"{len(where)} {kind}block{'s' if len(where) > 1 else ''} "
                      f"{_spans(where)}, which {', '.join(have)} reach")
    return len(reached), (
        f"--lora.targets {','.join(names)} reaches {len(reached)} of the {len(blocks)} "
        f"{a.arch} blocks it adapts; not the other {'; '.join(others)}")


def _spans(blocks: Sequence[int]) -> str:
    """Block indices as ranges: (0-2, 4-6, 8)."""
    spans: list[list[int]] = []
    for i in blocks:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return "(" + ", ".join(f"{s}" if s == e else f"{s}-{e}" for s, e in spans) + ")"


def check_targets(names: Sequence[str], a: LlamaArgs, layers: int | None = None) -> None:
    """ValueError naming --lora.targets for a target this architecture lacks: phi3's fused qkv
    or gate_up on another base, or q, k, v, gate or up on phi3's; and, with `layers`
    (--lora.layers), for targets of which the last `layers` blocks have none (k,v on
    gemma4's shared-KV tail), which would train nothing (a block lacking some of them is
    skipped for those, as `apply_lora` does on every base: mlx-lm's every-projection default).
    Checked from the args, before anything (the memory estimate too) sizes the targets'
    projections."""
    have = block_targets(a)
    for t in names:
        if t in have:
            continue
        if t == "router":
            raise ValueError(f"--lora.targets: router is a mixture of experts' ffn_gate_inp; "
                             f"this {a.arch} base is dense and has {','.join(have)}")
        if t in PLE_TARGETS:
            raise ValueError(f"--lora.targets: {t} is the per-layer-input "
                             f"{'gate' if t == 'ple_gate' else 'projection'} of a gemma4 base "
                             f"with per-layer embeddings (E2B/E4B, blk.N."
                             f"{'inp_gate' if t == 'ple_gate' else 'proj'}); this {a.arch} base "
                             f"has {','.join(have)}")
        fused = next((f for f, parts in FUSED.items() if t in parts), None)
        what = (f"{t} is part of phi3's fused {fused}" if fused is not None
                else f"{t} is phi3's fused projection" if t in FUSED
                else f"{t} is a projection of qwen35's linear-attention blocks")
        raise ValueError(f"--lora.targets: {what}; this {a.arch} base has {','.join(have)}")
    if layers is None:
        return
    blocks = target_blocks(a.n_layers, layers)
    if target_reach(a, names, blocks)[0] == 0:  # else a block's absent ones are skipped, as all
        there = [t for t in TARGETS if any(t in block_targets(a, i) for i in blocks)]
        which = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
        raise ValueError(f"--lora.targets: expected a projection that {which} (the last "
                         f"{layers} of this {a.arch} base, --lora.layers) have: "
                         f"{','.join(there)}; found {','.join(names)}, none of which they "
                         "have, so nothing would train: add one of theirs or raise "
                         "--lora.layers")


def target_blocks(n_layers: int, layers: int | None, flag: str = "--lora.layers") -> range:
    """Indices of the last `layers` blocks (all when None); ValueError names `flag`."""
    if layers is None:
        return range(n_layers)
    if not 1 <= layers <= n_layers:
        raise ValueError(f"{flag}: expected 1..{n_layers} (the base's block count) or "
                         f"unset for all, found {layers}")
    return range(n_layers - layers, n_layers)


def apply_lora(model: Llama, targets: str | Sequence[str] = ("q",), layers: int | None = None,
               rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               kind: str = "lora") -> Llama:
    """Freeze `model` and wrap the chosen projections of the last `layers` blocks in LoRA
    (`kind="dora"`: DoRA; `targets` all-linear: `all_linear(model.args)`)."""
    layer = ADAPTER_KINDS[kind]
    names = resolve_targets(targets, model.args)
    blocks = target_blocks(len(model.layers), layers)
    check_targets(names, model.args, layers)
    experts = [t for t in names if model.args.n_experts and t in EXPERT_TARGETS]
    if experts and kind != "lora":
        raise ValueError(f"--lora.targets: {experts[0]} is the experts' 3-D tensor in this "
                         f"{model.args.arch} base, which only --fine-tune-type lora adapts "
                         f"(llama.cpp applies a LoRA pair per expert), found {kind}")
    model.freeze()
    for i in blocks:
        have = block_targets(model.args, i)
        for t in names:
            if t not in have:  # qwen35's blocks of each kind; gemma4's shared-KV tail
                continue
            path = f"layers.{i}.{target_path(t, model.args)}"
            base = submodule(model, path)
            if isinstance(base, LoRALinear):
                raise TypeError(f"{path}: expected a plain projection, found one already "
                                "wrapped in LoRA")
            wrap = ExpertLoRA if t in experts else layer
            replace_submodule(model, path, wrap.from_base(base, rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRALinear in `model` by its module path (`layers.3.attn.q_proj`), in order."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    return dict(sorted(found, key=lambda pm: _order(pm[0])))


def _order(path: str) -> tuple:
    parts = path.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        rest = ".".join(parts[2:])
        kinds = list(TARGETS)  # an expert tensor in its target's place (gate_exps as gate)
        return (0, int(parts[1]), kinds.index(TARGET_OF[rest]) if rest in TARGET_OF
                else len(kinds), rest)
    return (1, 0, 0, path)


def fuse(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear in `model` by the plain Linear W + scale B A; return `model`."""
    for path, m in lora_layers(model).items():
        replace_submodule(model, path, m.fuse())
    return model

