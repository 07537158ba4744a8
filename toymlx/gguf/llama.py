"""The llama <-> GGUF name map and layout conventions, in one place.

toymlx parameter paths (`layers.3.attn.q_proj.weight`) map one-to-one onto llama.cpp's tensor
names (`blk.3.attn_q.weight`); both are stored `(out, in)`, and q/k keep GGUF's adjacent-pair
RoPE layout, so no model tensor is ever permuted or split into heads. What comes from Hugging
Face's layout (mlx-lm's adapters, their targets named by `toymlx.models.lora.MLX_LM_KEYS`) is
put into the GGUF's here, in one place: `hf_rows_to_gguf` permutes llama's q/k rows as
llama.cpp's converter permuted the base's, `hf_v_heads_to_gguf` qwen35's value heads.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from toymlx.gguf import gemma4
from toymlx.gguf.blocks import CODECS, split_rows
from toymlx.gguf.quant import EXACT_QUANTS, GROUP_SIZE, gguf_to_mlx_quant
from toymlx.gguf.reader import (
    UINT32,
    VOCAB_ONLY,
    GGUFError,
    GGUFFile,
    check_finite,
    refuse_adapter,
)
from toymlx.gguf.writer import FILE_TYPE, encode_tensor, write_gguf
from toymlx.models.layers import (
    BlockEmbedding,
    BlockLinear,
    QuantizedLinear,
    dense_weight,
    replace_submodule,
    submodule,
)
from toymlx.models.llama import Llama, LlamaArgs
from toymlx.models.lora import FUSED, TARGET_OF
from toymlx.models.moe import BlockExperts
from toymlx.models.ops import DTYPES, EXACT, Ops

CHECKPOINT_FORMAT = "toy/gguf-v1"
TRAINED_WINDOW = "toy.seq_len"
"""The --seq-len a from-scratch or warm-start checkpoint trained on: toymlx-generate keeps a
lone copy of it (moved out of its run, exported) within that window, as it keeps its run's."""


@dataclass(frozen=True)
class Arch:
    """What one llama.cpp architecture is, in `LlamaArgs` switches, and which of its
    `<arch>.*` metadata keys the loader reads (any other is refused, never ignored)."""

    name: str
    switches: dict[str, Any]
    """LlamaArgs fields every file of this architecture has."""
    keys: frozenset[str]
    """The `<arch>.` keys understood beside COMMON_KEYS."""
    rope_scaling: tuple[str, ...] = ("none", "linear")
    """rope.scaling.type values computed as llama.cpp computes them."""


COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "vocab_size", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "expert_count",
    "expert_used_count"})
YARN_UNREAD = ("rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
               "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor")
"""YaRN keys llama.cpp's converter writes from a Hugging Face config where it has them, and
which llama.cpp's loader does not read for some architectures (`YARN_READ` says which it
reads): accepted there only where they say what llama.cpp computes with (`_yarn_switches`)."""
QWEN35_KEYS = ("rope.dimension_sections", "ssm.conv_kernel", "ssm.inner_size",
               "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
               "full_attention_interval", "attention.recurrent_layers", "nextn_predict_layers")
"""qwen35's `<arch>.` keys beside COMMON_KEYS (`qwen35_switches` reads them)."""
GRANITE_SCALARS = {"embedding_scale": "embedding_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
"""granite's `<arch>.` scalar keys -> the LlamaArgs fields they set (beside attention.scale,
which is `attn_scale`)."""
YARN = ("none", "linear", "yarn")
"""rope.scaling.type values of the architectures whose llama.cpp graph hands its context's YaRN
parameters to ggml_rope_ext unchanged (`LlamaArgs.yarn_rope`)."""
YARN_READ = frozenset({"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                       "rope.scaling.yarn_log_multiplier"})
"""The YaRN keys llama.cpp's mistral3 loader reads (its other YARN architectures read none)."""
BIASED = ("llama", "mistral3")
"""The architectures whose files may carry attention biases and a rope_freqs tensor."""
ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("llama", {}, frozenset(), rope_scaling=YARN),
    Arch("qwen2", {"rope_neox": True, "attn_bias": True}, frozenset(), rope_scaling=YARN),
    Arch("qwen3", {"rope_neox": True, "qk_norm": True}, frozenset(), rope_scaling=YARN),
    # Ministral 3: llama's layout, YaRN, and Llama 4's attention temperature on the queries
    Arch("mistral3", {}, YARN_READ | {"attention.temperature_scale"}, rope_scaling=YARN),
    Arch("qwen3moe", {"rope_neox": True, "qk_norm": True},
         frozenset({"expert_feed_forward_length"})),
    Arch("qwen2moe", {"rope_neox": True, "attn_bias": True, "moe_norm_topk": False},
         frozenset({"expert_feed_forward_length", "expert_shared_feed_forward_length"})),
    Arch("gemma2", {"rope_neox": True, "post_norms": True, "embed_scale": True,
                    "activation": "gelu_tanh"},
         frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                    "rope.freq_base_swa", "attn_logit_softcapping", "final_logit_softcapping"}),
         rope_scaling=("none",)),  # llama.cpp would scale its sliding blocks too
    Arch("gemma3", {"rope_neox": True, "qk_norm": True, "post_norms": True, "embed_scale": True,
                    "activation": "gelu_tanh"},
         frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                    "rope.freq_base_swa", "final_logit_softcapping"})),
    Arch("phi3", {"rope_neox": True, "fused_qkv": True, "fused_gate_up": True},
         # llama.cpp reads phi3's sliding_window and turns it off (so does toymlx)
         frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
         rope_scaling=("none", "linear", "longrope")),
    # llama.cpp fixes smollm3's no-RoPE blocks (every 4th); no key says them
    Arch("smollm3", {"no_rope_interval": 4}, frozenset(), rope_scaling=YARN),
    Arch("granite", {}, frozenset(GRANITE_SCALARS) | {"attention.scale"}, rope_scaling=YARN),
    Arch("olmo2", {"rope_neox": True, "qk_norm_whole": True, "pre_norms": False,
                   "post_norms": True}, frozenset(), rope_scaling=YARN),
    Arch("gemma4", gemma4.SWITCHES, gemma4.KEYS, rope_scaling=("none",)),
    # Qwen3.5 dense: Gated DeltaNet blocks (toymlx.models.gated_delta) and gated full attention
    Arch("qwen35", {"rope_neox": True, "qk_norm": True, "attn_out_gate": True},
         frozenset(QWEN35_KEYS), rope_scaling=("none",)),
)}
"""The architectures toymlx loads, by general.architecture."""
MOE_ARCHS = ("qwen3moe", "qwen2moe", "llama")
"""The architectures whose blocks' MLPs may be mixtures of experts (`toymlx.models.moe.MoE`):
qwen3moe's and qwen2moe's always are (qwen2moe's with a shared expert); llama's are where
`expert_count` > 0 (Mixtral)."""
DENSE_ALLOWED = ("llama",)
"""The mixture-of-experts architectures whose files may be dense (expert_count 0)."""


@dataclass(frozen=True)
class Gemma:
    """What llama.cpp assumes of a Gemma architecture's file where a key is absent."""

    pattern: int
    """Every n-th block attends globally, the others slide (attention.sliding_window_pattern)."""
    window: int
    """attention.sliding_window; 0: no block slides."""
    final_softcap: float
    """final_logit_softcapping; 0: the logits are not capped."""
    attn_softcap: float | None
    """attn_logit_softcapping; None: the architecture never caps its attention scores."""
    slides: str
    """Which blocks slide, in words."""
    swa_base_is_rope_base: bool
    """rope.freq_base_swa is the file's rope.freq_base (else 10000)."""
    wide_query_blocks: int
    """Block count of the 27B shape, whose queries are scaled by 1/sqrt(d/heads)."""


GEMMA = {"gemma2": Gemma(pattern=2, window=4096, final_softcap=30.0, attn_softcap=50.0,
                         slides="every other block from the first",
                         swa_base_is_rope_base=True, wide_query_blocks=46),
         "gemma3": Gemma(pattern=6, window=0, final_softcap=0.0, attn_softcap=None,
                         slides="every block but each sixth",
                         swa_base_is_rope_base=False, wide_query_blocks=62)}
"""The Gemma architectures' defaults, from llama.cpp's hparams loading (src/models/gemma*.cpp)."""
SUPPORTED = ", ".join(ARCHS)
INFORMATIONAL = ("general.", "tokenizer.", "quantize.", "toy.")
"""Metadata prefixes that describe a file without changing what its model computes."""

_GLOBAL = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
           "output.weight": "output.weight", "per_layer_token_embd.weight": "ple_embed.weight",
           "per_layer_model_proj.weight": "ple_proj.weight",
           "per_layer_proj_norm.weight": "ple_norm.weight"}
_BLOCK = {"attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj",
          "attn_v": "attn.v_proj", "attn_qkv": "attn.qkv_proj", "attn_output": "attn.o_proj",
          "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm",
          "post_attention_norm": "attn_post_norm", "ffn_norm": "ffn_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "post_ffw_norm": "ffn_post_norm", "inp_gate": "ple_gate", "proj": "ple_proj",
          "post_norm": "ple_norm", "layer_output_scale": "out_scale",
          "ffn_gate_inp": "mlp.router",
          "ffn_gate_exps": "mlp.gate_exps", "ffn_up_exps": "mlp.up_exps",
          "ffn_down_exps": "mlp.down_exps", "ffn_gate_inp_shexp": "mlp.shared_gate",
          "ffn_gate_shexp": "mlp.shared.gate_proj", "ffn_up_shexp": "mlp.shared.up_proj",
          "ffn_down_shexp": "mlp.shared.down_proj",
          # qwen35's linear-attention blocks (toymlx.models.gated_delta)
          "attn_gate": "attn.z_proj", "ssm_beta": "attn.beta_proj",
          "ssm_alpha": "attn.alpha_proj", "ssm_out": "attn.out_proj", "ssm_norm": "attn.norm",
          "ssm_conv1d": "attn.conv1d"}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()} | {"mlp.gate_up_proj": "ffn_up"}
_BLOCK_ODD = {"ssm_a": "attn.ssm_a", "ssm_dt.bias": "attn.dt_bias"}
"""qwen35's block tensors whose names are not `<tensor>.weight` or `.bias` of a module."""
_BLOCK_ODD_INV = {v: k for k, v in _BLOCK_ODD.items()}
_ODD_RE = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)")
_TOY_ODD_RE = re.compile(r"layers\.(\d+)\.(attn\.ssm_a|attn\.dt_bias)")
_GGUF_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOY_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
"""Constants of RoPE that llama.cpp files carry as tensors (not trained)."""


def gguf_to_toy(name: str, fused_gate_up: bool = False, arch: str = "") -> str | None:
    """toymlx parameter path for a llama.cpp tensor name (None if not a decoder parameter);
    phi3's `ffn_up` is the fused gate-and-up projection, qwen35's `post_attention_norm` the
    norm before its MLP (`ffn_norm`: it norms the residual, not the attention's output)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    if m := _ODD_RE.fullmatch(name):
        return f"layers.{m.group(1)}.{_BLOCK_ODD[m.group(2)]}"
    m = _GGUF_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        path = _BLOCK[m.group(2)]
        if fused_gate_up and path == "mlp.up_proj":
            path = "mlp.gate_up_proj"
        if arch == "qwen35" and path == "attn_post_norm":
            path = "ffn_norm"
        return f"layers.{m.group(1)}.{path}.{m.group(3)}"
    return None


def gguf_targets(arch: str | None = None) -> dict[str, str]:
    """A block tensor's name in a GGUF of `arch` (`attn_q`, `ffn_down_exps`), as llama.cpp's
    adapters name what they adapt, -> its --lora.targets name (`parse_targets` says a list of
    them in toymlx's): phi3's `ffn_up` is its fused gate_up (`gguf_to_toy`), not the up that
    phi3 lacks, and the `attn_q`, `attn_k`, `attn_v` and `ffn_gate` of other architectures'
    files its fused qkv and gate_up, which hold them (`FUSED`); None: an architecture not known
    (another's `ffn_up` is up)."""
    switches = ARCHS[arch].switches if arch in ARCHS else {}
    # a fused projection's switch is `fused_<its target>` (LlamaArgs.fused_qkv, fused_gate_up)
    whole = {part: fused for fused, parts in FUSED.items()
             if switches.get(f"fused_{fused}", False) for part in parts}
    out = {}
    for name in _BLOCK:
        path = gguf_to_toy(f"blk.0.{name}.weight", switches.get("fused_gate_up", False),
                           arch or "")
        path = path.removeprefix("layers.0.").removesuffix(".weight")
        if path in TARGET_OF:
            out[name] = whole.get(TARGET_OF[path], TARGET_OF[path])
    return out


def toy_to_gguf(path: str) -> str:
    """llama.cpp tensor name for a toymlx parameter path (LoRA wrappers' `.linear` dropped)."""
    path = path.replace(".linear.weight", ".weight").replace(".linear.bias", ".bias")
    for g, t in _GLOBAL.items():
        if path == t:
            return g
    if m := _TOY_ODD_RE.fullmatch(path):
        return f"blk.{m.group(1)}.{_BLOCK_ODD_INV[m.group(2)]}"
    m = _TOY_RE.fullmatch(path)
    if m and m.group(2) in _BLOCK_INV:
        return f"blk.{m.group(1)}.{_BLOCK_INV[m.group(2)]}.{m.group(3)}"
    raise KeyError(f"no GGUF name for parameter {path!r}")


def hf_permuted_heads(a: LlamaArgs, name: str) -> int | None:
    """The heads by which llama.cpp's converter permuted tensor `name`'s rows from Hugging
    Face's layout: llama's q (n_heads) and k (n_kv_heads), whose RoPE turns adjacent pairs in
    the GGUF and each head's halves in HF (smollm3's, granite's and mistral3's too: their
    converter is llama's); None for every other tensor, and for the NEOX architectures (qwen2,
    qwen3, gemma2, gemma3, phi3, olmo2), whose files keep HF's rows."""
    if a.rope_neox or a.fused_qkv:
        return None
    leaf = name.split(".")[-2] if name.startswith("blk.") else ""
    return {"attn_q": a.n_heads, "attn_k": a.n_kv_heads}.get(leaf)


def hf_rows_to_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows (axis 0) of a Hugging Face q or k projection in llama.cpp's order: its converter's
    `permute`, each head's two rotary halves interleaved into adjacent pairs."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_v_heads(a: LlamaArgs, name: str) -> tuple[int, int] | None:
    """(axis, first index of its value heads) of tensor `name` where llama.cpp's converter
    reordered a qwen35 linear-attention tensor's value heads from Hugging Face's grouped order
    (v heads 0..r-1 read k head 0) to tiled (v head j reads k head j % Hk;
    `_LinearAttentionVReorderBase`): attn_qkv's v rows, attn_gate's, ssm_beta's and ssm_alpha's
    rows (one per head), ssm_out's columns. None for every other tensor, and where Hk == Hv."""
    if not a.linear_layers or a.ssm_k_heads == a.ssm_v_heads:
        return None
    leaf = name.split(".")[-2] if name.startswith("blk.") else ""
    return {"attn_qkv": (0, 2 * a.ssm_k_heads * a.ssm_head_dim), "attn_gate": (0, 0),
            "ssm_beta": (0, 0), "ssm_alpha": (0, 0), "ssm_out": (1, 0)}.get(leaf)


def hf_v_heads_to_gguf(w: np.ndarray, axis: int, start: int, k_heads: int, v_heads: int
                       ) -> np.ndarray:
    """`w` with the value heads along `axis` from index `start` on (v_heads of equal width)
    put from Hugging Face's grouped order in llama.cpp's tiled one: the converter's
    `_reorder_v_heads`, (Hk, r, width) -> (r, Hk, width)."""
    w = np.moveaxis(w, axis, 0)
    v = w[start:]
    r = v_heads // k_heads
    v = v.reshape(k_heads, r, -1, *v.shape[1:]).swapaxes(0, 1).reshape(v.shape)
    return np.moveaxis(np.concatenate([w[:start], v]), 0, axis)


def gguf_rows_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `hf_rows_to_gguf`: a GGUF's q or k rows in Hugging Face's order."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _arch_of(g: GGUFFile) -> Arch:
    arch = g.metadata.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{g.path}: metadata key 'general.architecture': expected one of "
                        f"{SUPPORTED}, found {arch!r}")
    return ARCHS[arch]


def check_keys(g: GGUFFile, arch: Arch) -> None:
    """Refuse any metadata key that would change the model and that toymlx does not read."""
    prefix = arch.name + "."
    for key in g.metadata:
        if key.startswith(INFORMATIONAL):
            continue
        if key.startswith(prefix) and key[len(prefix):] in COMMON_KEYS | arch.keys:
            continue
        if key.startswith(prefix) and key[len(prefix):] in YARN_UNREAD and "yarn" in \
                arch.rope_scaling:  # read, or checked against what llama.cpp computes with
            continue
        raise GGUFError(f"{g.path}: metadata key {key!r}: expected only keys toymlx computes "
                        f"with ({prefix}* for {arch.name}: "
                        f"{', '.join(sorted(COMMON_KEYS | arch.keys))}; and general.*, "
                        f"tokenizer.*, quantize.*), found this one; not loaded, so that "
                        "nothing is ignored")


def _positive(g: GGUFFile, key: str, v: float) -> float:
    if not (math.isfinite(v) and v > 0):
        raise GGUFError(f"{g.path}: metadata key {key!r}: expected a finite value > 0, "
                        f"found {v!r}")
    return v


def _rope_factors(g: GGUFFile, name: str, n: int) -> tuple[float, ...]:
    info = g.tensors[name]
    if tuple(info.shape) != (n,):
        raise GGUFError(f"{g.path}: tensor {name!r} shape: expected ({n},) (rope dims / 2), "
                        f"found {tuple(info.shape)}")
    f = g.load(name, np.float32)
    if not (np.isfinite(f).all() and (f > 0).all()):
        raise GGUFError(f"{g.path}: tensor {name!r}: expected finite factors > 0, found "
                        f"min {f.min()!r}")
    return tuple(float(x) for x in f)


NOT_A_MODEL = {
    "mmproj": ("a multimodal projector (mmproj), which llama.cpp loads beside its language "
               "model (--mmproj); toymlx trains and runs the language model: pass that GGUF"),
    "imatrix": ("an importance matrix (llama-imatrix's output, for llama-quantize --imatrix); "
                "pass the model GGUF"),
}
"""What a GGUF of each `general.type` other than a model is, and what to pass instead."""


def check_model_kind(g: GGUFFile, flag: str | None = None) -> None:
    """GGUFError, before any other key is read, where the file is not a model: a LoRA adapter
    (`refuse_adapter`; `flag` the option that gave it), a projector (mmproj; older ones say so
    by `general.architecture` 'clip' alone), an importance matrix or another `general.type`,
    saying what to pass instead; a file of no tensors (a vocabulary) says so."""
    refuse_adapter(g.path, g.metadata, flag)
    kind = g.metadata.get("general.type", "model")
    key = "general.type"
    if kind == "model" and g.metadata.get("general.architecture") == "clip":
        kind, key = "mmproj", "general.architecture"
    if kind != "model":  # e.g. a vocabulary-only file
        what = NOT_A_MODEL.get(kind, f"{kind!r}")
        raise GGUFError(f"{g.path}: metadata key {key!r}: expected a model (general.type "
                        f"'model' or absent), found {what}")
    if not g.tensors:  # llama.cpp's ggml-vocab-*.gguf: its architecture ('gpt2') names no model
        raise GGUFError(f"{g.path}: expected a model, found a "
                        f"{g.metadata.get('general.architecture')!r} vocabulary only: "
                        f"{VOCAB_ONLY}")


def args_from_gguf(g: GGUFFile) -> LlamaArgs:
    """LlamaArgs from a GGUF's `<arch>.*` keys and RoPE tensors, checked against its tensors:
    an unknown architecture, metadata key or tensor is one GGUFError naming it."""
    check_model_kind(g)
    arch = _arch_of(g)
    check_keys(g, arch)
    k = arch.name + "."
    d = g.get(k + "embedding_length", int)
    table = g.tensors.get("token_embd.weight")
    if table is not None and len(table.shape) == 2 and table.shape[1] != d:
        # before the head sizes that derive from it are checked, and blamed
        raise GGUFError(f"{g.path}: metadata key '{k}embedding_length': expected "
                        f"{table.shape[1]} (the width of tensor 'token_embd.weight'), found {d}")
    n_heads = g.get(k + "attention.head_count", int)
    n_kv, kv_per_block = (gemma4.per_block(g, k + "attention.head_count_kv", n_heads)
                          if arch.name == "gemma4" else
                          (g.get(k + "attention.head_count_kv", int, n_heads), None))
    ffn, ffn_per_block = (gemma4.per_block(g, k + "feed_forward_length")
                          if arch.name == "gemma4" else
                          (g.get(k + "feed_forward_length", int), None))
    if n_heads <= 0 or d <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise GGUFError(f"{g.path}: metadata key '{k}attention.head_count_kv': expected a "
                        f"positive divisor of head_count={n_heads}, found {n_kv}")
    head_dim = g.get(k + "attention.key_length", int, d // n_heads)
    value_dim = g.get(k + "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{g.path}: metadata key '{k}attention.value_length': expected "
                        f"{head_dim} (= key_length), found {value_dim}")
    rope_dims = g.get(k + "rope.dimension_count", int, head_dim)
    if not (0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise GGUFError(f"{g.path}: metadata key '{k}rope.dimension_count': expected an even "
                        f"number in 2..{head_dim} (the head width), found {rope_dims}")
    if not arch.switches.get("rope_neox") and rope_dims != head_dim:
        raise GGUFError(f"{g.path}: metadata key '{k}rope.dimension_count': expected "
                        f"{head_dim} (full-head RoPE for {arch.name}), found {rope_dims}")
    moe = _moe_switches(g, arch)
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight': expected present, found "
                        f"{g.missing()}")
    vocab = g.tensors["token_embd.weight"].shape[0]
    said = g.get(k + "vocab_size", int, vocab)  # llama.cpp sizes the table by it
    if said != vocab:
        raise GGUFError(f"{g.path}: metadata key '{k}vocab_size': expected {vocab} (the rows of "
                        f"tensor 'token_embd.weight'), found {said}")
    # Bound every size before it is used: a block count of 2**40 would otherwise spin in
    # expected_shapes, and MLX's RMSNorm rejects eps <= 0 with a message naming no file.
    n_layers = g.get(k + "block_count", int)
    most = len(g.tensors) // 5
    if not 1 <= n_layers <= most:
        raise GGUFError(f"{g.path}: metadata key '{k}block_count': expected 1..{most} "
                        f"(at least 5 tensors per block, {len(g.tensors)} in the file), "
                        f"found {n_layers}")
    # qwen35's MTP (nextn) blocks come after the decoder's; llama.cpp's plain decoding does not
    # run them (its graph stops at n_layer - nextn), and neither does toymlx
    nextn = g.get(k + "nextn_predict_layers", int, 0) if arch.name == "qwen35" else 0
    if not 0 <= nextn < n_layers:
        raise GGUFError(f"{g.path}: metadata key '{k}nextn_predict_layers': expected 0.."
                        f"{n_layers - 1} (fewer than block_count), found {nextn}")
    n_layers -= nextn
    context = int(_positive(g, k + "context_length", g.get(k + "context_length", int)))
    rope_base = _positive(g, k + "rope.freq_base",
                          float(g.get(k + "rope.freq_base", (int, float), 10000.0)))
    norm_eps = _positive(g, k + "attention.layer_norm_rms_epsilon",
                         float(g.get(k + "attention.layer_norm_rms_epsilon", (int, float))))
    sw: dict[str, Any] = dict(arch.switches)
    # RoPE scaling, as llama.cpp reads it: a linear position scale, Llama 3's per-frequency
    # factors (the rope_freqs tensor), Phi-3's longrope (short factors at toymlx's contexts)
    scaling = g.get(k + "rope.scaling.type", str, "none" if k + "rope.scaling.factor"
                    not in g.metadata else "linear")
    if scaling not in arch.rope_scaling:
        raise GGUFError(f"{g.path}: metadata key '{k}rope.scaling.type': expected one of "
                        f"{', '.join(arch.rope_scaling)} for {arch.name}, found {scaling!r}")
    factor = float(g.get(k + "rope.scaling.factor", (int, float), 0.0))
    if scaling in ("linear", "yarn") and factor not in (0.0, 1.0):
        sw["rope_scale"] = 1.0 / _positive(g, k + "rope.scaling.factor", factor)
    # phi3 files carry longrope's factors with or without rope.scaling.type = longrope
    longrope = scaling == "longrope" or (arch.name == "phi3" and
                                         "rope_factors_short.weight" in g.tensors)
    if "rope_freqs.weight" in g.tensors:
        if longrope:
            raise GGUFError(f"{g.path}: tensor 'rope_freqs.weight': expected absent in a "
                            "longrope file (it has rope_factors_short/long), found present")
        sw["rope_factors"] = _rope_factors(g, "rope_freqs.weight", rope_dims // 2)
    if longrope:
        sw["rope_factors"] = _rope_factors(g, "rope_factors_short.weight", rope_dims // 2)
        _rope_factors(g, "rope_factors_long.weight", rope_dims // 2)
    # llama.cpp multiplies cos and sin by rope.scaling.attn_factor whatever the scaling type
    sw["rope_mscale"] = _positive(g, k + "rope.scaling.attn_factor", float(
        g.get(k + "rope.scaling.attn_factor", (int, float), 1.0)))
    if k + "rope.scaling.original_context_length" in g.metadata:
        sw["rope_orig_context"] = int(_positive(g, k + "rope.scaling.original_context_length",
                                                g.get(k + "rope.scaling.original_context_length",
                                                      int)))
    sw.update(_yarn_switches(g, arch, scaling, sw))
    if arch.name in GEMMA:
        sw.update(_gemma_switches(g, GEMMA[arch.name], n_layers, rope_base))
        sw["attn_scale"] = _gemma_query_scale(arch.name, d, n_heads, n_layers, head_dim)
        sw["rope_dims_sliding"] = None if rope_dims == head_dim else rope_dims
    if arch.name == "gemma4":
        sw.update(gemma4.switches(g, n_layers, head_dim), kv_heads_per_block=kv_per_block,
                  ffn_dims_per_block=ffn_per_block)
    if arch.name == "granite":
        sw.update(granite_scalars(g, k))
    if arch.name == "qwen35":
        sw.update(qwen35_switches(g, k, n_layers, rope_dims))
    if arch.name == "olmo2" and "output.weight" not in g.tensors:  # llama.cpp requires it
        raise GGUFError(f"{g.path}: tensor 'output.weight': expected present (olmo2 files "
                        "carry their own output head), found missing")
    if arch.name in BIASED:  # their files may carry attention biases
        sw["attn_bias"] = "blk.0.attn_q.bias" in g.tensors
        sw["out_bias"] = "blk.0.attn_output.bias" in g.tensors
    args = LlamaArgs(
        vocab_size=vocab, d_model=d, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=ffn,
        context=context, rope_base=rope_base, norm_eps=norm_eps,
        tie_embeddings="output.weight" not in g.tensors,
        key_length=None if head_dim == d // n_heads else head_dim,
        arch=arch.name, rope_dims=None if rope_dims == head_dim else rope_dims, **sw, **moe)
    try:
        args.validate()
    except ValueError as e:
        raise GGUFError(f"{g.path}: {e}") from None
    check_shapes(g, args, rope_tensors(longrope, "rope_freqs.weight" in g.tensors))
    return args


def _moe_switches(g: GGUFFile, arch: Arch) -> dict[str, Any]:
    """A mixture-of-experts file's expert_count, expert_used_count and
    expert_feed_forward_length as LlamaArgs fields; in a dense architecture's file both counts
    must be 0 (llama.cpp's dense models)."""
    k = arch.name + "."
    if arch.name not in MOE_ARCHS:
        for key in ("expert_count", "expert_used_count"):
            if n := g.get(k + key, int, 0):
                raise GGUFError(f"{g.path}: metadata key '{k}{key}': expected 0 ({arch.name} "
                                f"is dense; mixtures of experts load as "
                                f"{', '.join(MOE_ARCHS)}), found {n}")
        return {}
    n = g.get(k + "expert_count", int, 0 if arch.name in DENSE_ALLOWED else ...)
    if n == 0 and arch.name in DENSE_ALLOWED:  # llama.cpp: a dense model uses no experts
        if used := g.get(k + "expert_used_count", int, 0):
            raise GGUFError(f"{g.path}: metadata key '{k}expert_used_count': expected 0 "
                            f"(expert_count is 0: a dense {arch.name} model), found {used}")
        return {}
    if n <= 0:
        raise GGUFError(f"{g.path}: metadata key '{k}expert_count': expected > 0 "
                        f"({arch.name} is a mixture of experts), found {n}")
    used = g.get(k + "expert_used_count", int)
    if not 1 <= used <= n:
        raise GGUFError(f"{g.path}: metadata key '{k}expert_used_count': expected 1..{n} "
                        f"(expert_count), found {used}")
    if arch.name == "llama":  # Mixtral: each expert is feed_forward_length wide
        return {"n_experts": n, "n_experts_used": used,
                "expert_ffn_dim": g.get(k + "feed_forward_length", int)}
    width = g.get(k + "expert_feed_forward_length", int, 0)
    if width < 0:
        raise GGUFError(f"{g.path}: metadata key '{k}expert_feed_forward_length': expected "
                        f"> 0 (or absent: feed_forward_length / expert_used_count), found "
                        f"{width}")
    out = {"n_experts": n, "n_experts_used": used, "expert_ffn_dim": width or None}
    if arch.name == "qwen2moe":  # llama.cpp: feed_forward_length where the key is absent
        shared = g.get(k + "expert_shared_feed_forward_length", int, 0)
        out["shared_expert_ffn_dim"] = shared or g.get(k + "feed_forward_length", int)
    return out


def _yarn_switches(g: GGUFFile, arch: Arch, scaling: str, sw: dict[str, Any]
                   ) -> dict[str, Any]:
    """The LlamaArgs fields of a file's YaRN keys and mistral3's attention temperature, as
    llama.cpp reads them for `arch` (`sw`: the RoPE fields read so far). A YaRN key llama.cpp
    does not read for `arch` (`YARN_UNREAD`) is accepted where it says what llama.cpp computes
    with anyway, and refused where it says otherwise: transformers would compute with it."""
    k = arch.name + "."
    out: dict[str, Any] = {"rope_yarn": scaling == "yarn"}
    beta = [32.0, 1.0]  # llama.cpp's yarn_beta_fast, yarn_beta_slow
    for i, key in enumerate(("rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")):
        if key in arch.keys and k + key in g.metadata:
            beta[i] = _positive(g, k + key, float(g.get(k + key, (int, float))))
    out["rope_yarn_beta"] = tuple(beta)
    if "rope.scaling.yarn_log_multiplier" in arch.keys:
        mul = float(g.get(k + "rope.scaling.yarn_log_multiplier", (int, float), 0.0))
        if not math.isfinite(mul):
            raise GGUFError(f"{g.path}: metadata key '{k}rope.scaling.yarn_log_multiplier': "
                            f"expected a finite number, found {mul!r}")
        out["rope_yarn_log_mul"] = mul
    if "attention.temperature_scale" in arch.keys:
        t = float(g.get(k + "attention.temperature_scale", (int, float), 0.0))
        out["attn_temperature"] = t if t == 0.0 else _positive(
            g, k + "attention.temperature_scale", t)
    args = LlamaArgs(**{f: v for f, v in {**sw, **out}.items()
                        if f in ("rope_scale", "rope_mscale", "rope_yarn", "rope_yarn_beta",
                                 "rope_yarn_log_mul")})
    computed = {"rope.scaling.yarn_beta_fast": beta[0], "rope.scaling.yarn_beta_slow": beta[1],
                "rope.scaling.yarn_ext_factor": 1.0 if out["rope_yarn"] else 0.0,
                "rope.scaling.yarn_attn_factor": args.yarn_rope()[1]}
    for key in YARN_UNREAD:
        if key in arch.keys or k + key not in g.metadata:
            continue
        said, want = float(g.get(k + key, (int, float))), computed[key]
        if not math.isclose(said, want, rel_tol=1e-6):
            raise GGUFError(f"{g.path}: metadata key '{k}{key}': expected {want:.7g} (llama.cpp "
                            f"does not read this key for {arch.name} and computes with "
                            f"{want:.7g}; Hugging Face's model would use the file's), found "
                            f"{said:.7g}")
    return out


def _gemma_switches(g: GGUFFile, gemma: Gemma, n_layers: int, rope_base: float
                    ) -> dict[str, Any]:
    """A Gemma file's sliding window, its blocks and RoPE base, and its soft caps, each from its
    key or llama.cpp's default where the file has none."""
    k = g.metadata["general.architecture"] + "."
    sw: dict[str, Any] = {}
    window = g.get(k + "attention.sliding_window", int, gemma.window)
    if window > 0:
        pattern = g.metadata.get(k + "attention.sliding_window_pattern", gemma.pattern)
        if isinstance(pattern, (list, tuple)):
            sliding = tuple(bool(x) for x in pattern)
        elif isinstance(pattern, int) and pattern >= 0:
            sliding = _sliding_blocks(n_layers, pattern)
        else:
            raise GGUFError(f"{g.path}: metadata key '{k}attention.sliding_window_pattern'"
                            f": expected an int or a bool per block, found {pattern!r}")
        base = rope_base if gemma.swa_base_is_rope_base else 10000.0
        sw.update(sliding_window=window, sliding_layers=sliding,
                  rope_base_sliding=_positive(g, k + "rope.freq_base_swa", float(
                      g.get(k + "rope.freq_base_swa", (int, float), base))))
    elif gemma.window:  # llama.cpp slides these blocks whatever the file says
        raise GGUFError(f"{g.path}: metadata key '{k}attention.sliding_window': expected a "
                        f"window > 0 (llama.cpp's default {gemma.window}), found {window}")
    sw["final_softcap"] = _softcap(g, k + "final_logit_softcapping", gemma.final_softcap)
    if gemma.attn_softcap is not None:
        sw["attn_softcap"] = _softcap(g, k + "attn_logit_softcapping", gemma.attn_softcap)
    return sw


def _softcap(g: GGUFFile, key: str, default: float) -> float | None:
    """A soft cap from `key` (its default where absent); None where the default is 0 (no cap).
    A file's 0 is refused where llama.cpp caps by default: it would divide by it."""
    cap = float(g.get(key, (int, float), default))
    if cap == 0.0 and not default:
        return None
    return _positive(g, key, cap)


def granite_scalars(g: GGUFFile, k: str) -> dict[str, float]:
    """The LlamaArgs fields a granite file's scalars set, each where llama.cpp applies it:
    embedding_scale (the token embeddings times it), residual_scale (each block's attention
    and MLP outputs times it), attention.scale (q k^T times it, for 1/sqrt(head_dim)),
    logit_scale (the logits divided by it). llama.cpp reads an absent or 0 scale as none
    (logit_scale it requires); `rope.scaling.finetuned` false turns its RoPE off, which no
    dense Granite does and toymlx refuses."""
    if not g.get(k + "rope.scaling.finetuned", bool, True):
        raise GGUFError(f"{g.path}: metadata key '{k}rope.scaling.finetuned': expected true "
                        "(granite files whose blocks all skip RoPE are not supported), found "
                        "false")
    out: dict[str, float] = {}
    for key, field in GRANITE_SCALARS.items():
        v = float(g.get(k + key, (int, float), 0.0))
        if v:
            out[field] = _positive(g, k + key, v)
    scale = float(g.get(k + "attention.scale", (int, float), 0.0))
    if scale:
        out["attn_scale"] = _positive(g, k + "attention.scale", scale)
    return out


def qwen35_switches(g: GGUFFile, k: str, n_layers: int, rope_dims: int) -> dict[str, Any]:
    """A qwen35 file's linear-attention shape and blocks, each key as llama.cpp reads it
    (`llama_model_qwen35::load_arch_hparams`), and its M-RoPE sections checked to rotate text
    as toymlx does (`check_text_mrope`)."""
    sw: dict[str, Any] = {}
    for key, field in (("ssm.conv_kernel", "ssm_conv_kernel"), ("ssm.state_size", "ssm_head_dim"),
                       ("ssm.group_count", "ssm_k_heads"), ("ssm.time_step_rank", "ssm_v_heads")):
        sw[field] = g.get(k + key, int)
        if sw[field] <= 0:
            raise GGUFError(f"{g.path}: metadata key '{k}{key}': expected > 0, found {sw[field]}")
    inner = g.get(k + "ssm.inner_size", int)
    if inner != sw["ssm_v_heads"] * sw["ssm_head_dim"]:  # llama.cpp: head_v_dim = head_k_dim
        raise GGUFError(f"{g.path}: metadata key '{k}ssm.inner_size': expected "
                        f"{sw['ssm_v_heads'] * sw['ssm_head_dim']} (time_step_rank x "
                        f"state_size: value heads as wide as key heads), found {inner}")
    if sw["ssm_v_heads"] % sw["ssm_k_heads"]:
        raise GGUFError(f"{g.path}: metadata key '{k}ssm.time_step_rank': expected a multiple "
                        f"of ssm.group_count={sw['ssm_k_heads']}, found {sw['ssm_v_heads']}")
    said = g.metadata.get(k + "attention.recurrent_layers")
    if said is not None:  # one bool per block, MTP blocks (not recurrent) included
        if not (isinstance(said, list) and len(said) >= n_layers
                and all(isinstance(x, bool) for x in said)):
            raise GGUFError(f"{g.path}: metadata key '{k}attention.recurrent_layers': expected "
                            f"a bool per block ({n_layers} or more), found {said!r:.80}")
        sw["linear_layers"] = tuple(said[:n_layers])
    else:
        every = g.get(k + "full_attention_interval", int, 4)
        if every <= 0:
            raise GGUFError(f"{g.path}: metadata key '{k}full_attention_interval': expected "
                            f"> 0, found {every}")
        sw["linear_layers"] = tuple((i + 1) % every != 0 for i in range(n_layers))
    check_text_mrope(g, k, rope_dims)
    return sw


def check_text_mrope(g: GGUFFile, k: str, rope_dims: int) -> None:
    """qwen35 rotates q and k by interleaved M-RoPE (ggml's IMROPE, `ggml_mrope_cache_init`):
    rotated pair i, at sector s = i mod (the sections' sum), turns by the time, height or
    width position as s % 3 is 0, 1 or 2, while s < 3 x that axis's section, and by a fourth
    position otherwise. llama.cpp gives a text token its position as time, height and width
    and 0 as the fourth (llama-graph.cpp), so where every pair falls in one of the three the
    rotation is plain NEOX RoPE over `rope_dims` (transformers' `Qwen3_5TextRotaryEmbedding`
    computes the same); a file leaving a pair to the fourth (unrotated) is refused."""
    sections = g.get(k + "rope.dimension_sections", list)
    if (len(sections) != 4 or not all(isinstance(x, int) and x >= 0 for x in sections)
            or not sum(sections)):
        raise GGUFError(f"{g.path}: metadata key '{k}rope.dimension_sections': expected 4 "
                        f"counts >= 0, not all 0, found {sections!r}")
    for i in range(rope_dims // 2):
        s = i % sum(sections)
        if not s < 3 * sections[s % 3]:
            raise GGUFError(f"{g.path}: metadata key '{k}rope.dimension_sections': expected "
                            f"sections whose interleaving covers all {rope_dims // 2} rotated "
                            f"pairs with text positions, found {sections} (pair {i} turns by "
                            "the fourth position)")


def rope_tensors(longrope: bool, has_freqs: bool) -> set[str]:
    """The RoPE constant tensors a file with (or without) longrope carries."""
    if longrope:
        return {"rope_factors_short.weight", "rope_factors_long.weight"}
    return {"rope_freqs.weight"} if has_freqs else set()


def expected_shapes(a: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every llama.cpp tensor name this model has, with its numpy (out, in) shape: the
    parameters, then the RoPE constants its file carries."""
    shapes = {"token_embd.weight": (a.vocab_size, a.d_model), "output_norm.weight": (a.d_model,)}
    if not a.tie_embeddings:
        shapes["output.weight"] = (a.vocab_size, a.d_model)
    shapes.update(gemma4.global_shapes(a))
    for i in range(a.n_layers):
        for n, s in block_shapes(a, i).items():
            shapes[f"blk.{i}.{n}"] = s
    return shapes


def block_shapes(a: LlamaArgs, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensors (names after `blk.i.`) and shapes: the same in every block but
    gemma4's, whose sliding and full blocks differ in width and whose shared-KV tail has no
    keys or values."""
    hd = a.layer_head_dim(i)
    q, kv = a.n_heads * hd, a.kv_heads(i) * hd
    own_kv = a.kv_source(i) is None
    per: dict[str, tuple[int, ...]] = {"attn_norm.weight": (a.d_model,)} if a.pre_norms else {}
    if a.fused_qkv:
        per["attn_qkv.weight"] = (q + 2 * kv, a.d_model)
    else:
        per["attn_q.weight"] = (2 * q if a.attn_out_gate else q, a.d_model)
        if own_kv:
            per["attn_k.weight"] = (kv, a.d_model)
        if own_kv and not (a.k_eq_v and not a.is_sliding(i)):
            per["attn_v.weight"] = (kv, a.d_model)
    if a.attn_bias:
        per.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    per["attn_output.weight"] = (a.d_model, q)
    if a.out_bias:
        per["attn_output.bias"] = (a.d_model,)
    if a.qk_norm:
        per["attn_q_norm.weight"] = (hd,)
        if own_kv:
            per["attn_k_norm.weight"] = (hd,)
    if a.qk_norm_whole:
        per.update({"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)})
    if a.post_norms:
        per["post_attention_norm.weight"] = (a.d_model,)
    if a.pre_norms:  # qwen35's is named post_attention_norm (`gguf_to_toy`)
        per["post_attention_norm.weight" if a.arch == "qwen35" else "ffn_norm.weight"] = (
            a.d_model,)
    if a.n_experts:  # numpy (out, in) with the experts first
        e, f = a.n_experts, a.expert_width
        per.update({"ffn_gate_inp.weight": (e, a.d_model),
                    "ffn_gate_exps.weight": (e, f, a.d_model),
                    "ffn_up_exps.weight": (e, f, a.d_model),
                    "ffn_down_exps.weight": (e, a.d_model, f)})
        if s := a.shared_expert_ffn_dim:
            per.update({"ffn_gate_inp_shexp.weight": (1, a.d_model),
                        "ffn_gate_shexp.weight": (s, a.d_model),
                        "ffn_up_shexp.weight": (s, a.d_model),
                        "ffn_down_shexp.weight": (a.d_model, s)})
    else:
        f = a.layer_ffn(i)
        if a.fused_gate_up:
            per["ffn_up.weight"] = (2 * f, a.d_model)
        else:
            per.update({"ffn_gate.weight": (f, a.d_model), "ffn_up.weight": (f, a.d_model)})
        per["ffn_down.weight"] = (a.d_model, f)
    if a.post_norms:
        per["post_ffw_norm.weight"] = (a.d_model,)
    per.update(gemma4.per_block_shapes(a, i))
    return linear_shapes(a, per) if a.is_linear(i) else per


def linear_shapes(a: LlamaArgs, per: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A qwen35 linear-attention block's tensors (`toymlx.models.gated_delta`): the norms and
    MLP of `per` (a full-attention block's), Gated DeltaNet's in place of the attention's."""
    d, hv, dk = a.d_model, a.ssm_v_heads, a.ssm_head_dim
    conv = 2 * a.ssm_k_heads * dk + hv * dk
    out = {n: s for n, s in per.items() if not n.startswith("attn_") or n == "attn_norm.weight"}
    out.update({"attn_qkv.weight": (conv, d), "attn_gate.weight": (hv * dk, d),
                "ssm_conv1d.weight": (conv, a.ssm_conv_kernel), "ssm_dt.bias": (hv,),
                "ssm_a": (hv,), "ssm_beta.weight": (hv, d), "ssm_alpha.weight": (hv, d),
                "ssm_norm.weight": (dk,), "ssm_out.weight": (d, hv * dk)})
    return out


def parameter_names(a: LlamaArgs) -> dict[str, str]:
    """llama.cpp tensor name -> toymlx parameter path, for every parameter of the model."""
    return {n: gguf_to_toy(n, a.fused_gate_up, a.arch) for n in expected_shapes(a)}


def check_shapes(g: GGUFFile, a: LlamaArgs, rope: set[str] | None = None) -> None:
    """Every tensor the model needs is there with its shape, and nothing else is but the
    RoPE constants in `rope` (None: whichever the file has, already read into `a`)."""
    want = expected_shapes(a)
    for name, shape in want.items():
        if name not in g.tensors:
            raise GGUFError(f"{g.path}: tensor {name!r}: expected present with shape {shape}, "
                            "found missing")
        found = g.tensors[name].shape
        if tuple(found) != shape:
            raise GGUFError(f"{g.path}: tensor {name!r} shape: expected {shape} from the "
                            f"{a.arch}.* hyperparameters, found {tuple(found)}")
    rope = set(ROPE_TENSORS) if rope is None else rope
    for name in g.tensors:
        if name not in want and name not in rope and not mtp_block(g, name, a):
            raise GGUFError(f"{g.path}: tensor {name!r}: expected only the tensors a "
                            f"{a.arch} model of this shape computes with, found this one too; "
                            "not loaded, so that nothing is ignored (supported architectures: "
                            f"{SUPPORTED})")


def mtp_block(g: GGUFFile, name: str, a: LlamaArgs) -> bool:
    """Tensor `name` belongs to one of a qwen35 file's MTP blocks (`nextn_predict_layers`
    after the decoder's): the draft head of llama.cpp's speculative decoding, which its plain
    decoding never runs (`llama_model_qwen35::graph`), nor toymlx."""
    m = re.match(r"blk\.(\d+)\.", name)
    nextn = g.metadata.get("qwen35.nextn_predict_layers", 0) if a.arch == "qwen35" else 0
    return m is not None and a.n_layers <= int(m.group(1)) < a.n_layers + nextn


WEIGHTS = ("float32", "bfloat16", "float16", "blocks", "quantized")
"""How a loaded model holds its weights: a float dtype (exact dequantisation, then rounded to
it); "blocks" (every quantized matrix kept as the file's own blocks, `toymlx.gguf.blocks`,
decoded to float32 where it is used: the file's size in memory and the float32-held model's
values); or "quantized" (the projections of the types MLX's affine quantization holds exactly,
Q4_0/Q4_1/Q8_0 (`toymlx.gguf.quant`), as MLX's quantized layers, its fast path on a GPU; every
other quantized matrix as blocks)."""


def frozen_weights(gpu: bool) -> str:
    """How a base that no step trains holds its weights (LoRA's base, evaluation): on the CPU,
    where MLX's quantized matmul is a loop over groups (~40x slower than dequantize + float32),
    its blocks, decoded inside the step; on a GPU, MLX's quantized layers where they hold the
    type exactly (its fast path), blocks elsewhere."""
    return "quantized" if gpu else "blocks"


def float32_bytes(g: GGUFFile) -> int:
    """Bytes of the file's tensors held as float32."""
    return 4 * sum(t.n_elements for t in g.tensors.values())


def load_llama(path: str | os.PathLike, ops: Ops = EXACT, weights: str = "float32",
               trained: frozenset[str] = frozenset()) -> tuple[Llama, GGUFFile]:
    """A Llama that computes with `ops`, holding a llama GGUF's weights as `weights` (any
    tensor type gguf-py decodes), the tensors named in `trained` as float32 whatever `weights`
    says (a full fine-tune of some blocks: `block_tensors`). The one GGUF-to-Llama loader:
    every recipe, generation, evaluation and export go through it (or through
    `load_llama_weights`)."""
    g = GGUFFile(path)
    g.verify_digest()  # a damaged toymlx checkpoint is named here, not found in the logits
    model = Llama(args_from_gguf(g), ops)  # its random init is lazy, and replaced unevaluated
    load_llama_weights(g, model, weights, trained=trained)
    return model, g


def block_tensors(names: Iterable[str], blocks: Iterable[int]) -> frozenset[str]:
    """The tensors (llama.cpp names) of the blocks numbered `blocks`: `blk.N.*`."""
    prefixes = tuple(f"blk.{i}." for i in blocks)
    return frozenset(n for n in names if n.startswith(prefixes))


def tensor_route(g: GGUFFile, name: str, weights: str,
                 trained: frozenset[str] = frozenset()) -> str:
    """How `load_llama_weights` holds tensor `name`: "float" (dequantized to the model's
    dtype, or float32 for 1-D tensors and those in `trained`), "blocks"
    (`BlockLinear`/`BlockEmbedding`) or "mlx" (MLX's quantized layer)."""
    info = g.tensors[name]
    matrix = (len(info.shape) in (2, 3) and name.endswith(".weight")  # 3-D: experts
              and not name.endswith("ssm_conv1d.weight"))  # a convolution's, not a Linear's
    if (weights not in ("blocks", "quantized") or not matrix or info.type not in CODECS
            or name in trained):
        return "float"
    if (weights == "quantized" and name.startswith("blk.") and info.type in EXACT_QUANTS
            and len(info.shape) == 2):
        return "mlx"
    return "blocks"


def load_llama_weights(g: GGUFFile, model: Llama, weights: str = "float32",
                       skip: tuple[str, ...] = (), trained: frozenset[str] = frozenset()
                       ) -> None:
    """Copy the file's tensors (all but `skip`) into `model`, shapes checked against its args.

    Each tensor's pages of the file mapping are dropped once MLX holds its copy, so the peak
    is the model plus one tensor, not the model twice (mapping + copy). Norms and the tensors
    in `trained` are float32; with "blocks" or "quantized" the other float weights take the
    model's compute dtype."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {', '.join(WEIGHTS)}, found {weights!r}")
    check_shapes(g, model.args)
    kept = weights in ("blocks", "quantized")
    dtype = DTYPES[model.ops.dtype if kept else weights]
    names = parameter_names(model.args)
    biased = {n.replace(".weight", ".bias") for n in names
              if tensor_route(g, n, weights, trained) != "float"} & set(names)
    loaded = []
    for name, key in names.items():
        if name in skip or name in biased:
            continue  # a bias held by its quantized projection
        route = tensor_route(g, name, weights, trained)
        bias = name.replace(".weight", ".bias")
        bias = bias if route != "float" and bias in names else None
        if route == "mlx":
            replace_submodule(model, key[: -len(".weight")],
                              _quantized_linear(g, name, model.ops, bias))
        elif route == "blocks":
            replace_submodule(model, key[: -len(".weight")], _block_layer(g, name, model.ops,
                                                                           bias))
        else:  # norms and biases (1-D) stay float32
            want = mx.float32 if len(g.tensors[name].shape) == 1 or name in trained else dtype
            loaded.append((key, float_weight(g, name, want)))
        g.release(name)
    model.load_weights(loaded, strict=False)  # every shape was checked by check_shapes
    mx.eval(model.parameters())


SLICE_VALUES = 2**22
"""Values of a tensor `loaded_rows` reads at a time (16 MiB as float32)."""


def loaded_rows(g: GGUFFile, name: str,
                read: Callable[[tuple[int, int] | None], dict[str, mx.array]]
                ) -> dict[str, mx.array]:
    """Tensor `name` of `g` as the MLX arrays `read` makes of its rows ((start, stop) of its
    leading dimensions flattened, or None for all of them), evaluated, its pages of the file
    mapping dropped. A tensor of more than `SLICE_VALUES` values is read a slice of rows at a
    time into arrays allocated whole (each slice written in place: an array's buffer is donated
    to the update; the slice's pages dropped once read), so its load holds those arrays and one
    slice. Read whole, the decoded or split numpy copy, the decoder's temporaries, the mapped
    tensor and MLX's copy were alive at once: the Llama-3.2-1B shape's Q6_K token table peaked
    464 MiB over its 384 MiB float32 array, sliced 71 (session 61); Gemma 4 E2B's 1.8 GiB
    per-layer table held in blocks made the load its run's peak (6,056 MiB of RSS against its
    step's 5,040 by MLX) until its split copy's pages were dropped before MLX copied it
    (session 60)."""
    info = g.tensors[name]
    n_rows = info.n_elements // info.shape[-1]
    step = max(1, SLICE_VALUES // info.shape[-1])
    if n_rows <= step:
        whole = read(None)
        mx.eval(whole)
        g.release(name)
        return whole
    held: dict[str, mx.array] = {}
    for start in range(0, n_rows, step):
        rows = (start, min(start + step, n_rows))
        for k, part in read(rows).items():
            if k not in held:
                held[k] = mx.zeros((n_rows, *part.shape[1:]), dtype=part.dtype)
            held[k][start:rows[1]] = part
        mx.eval(held)
        g.release(name, rows)
    return held


def float_weight(g: GGUFFile, name: str, want: mx.Dtype) -> mx.array:
    """Tensor `name` of `g` decoded to an MLX array of dtype `want` (`loaded_rows`)."""
    decoded = np.float16 if want == mx.float16 else np.float32

    def read(rows: tuple[int, int] | None) -> dict[str, mx.array]:
        w = mx.array(g.load(name, decoded, rows=rows))
        return {"w": w if w.dtype == want else w.astype(want)}

    return loaded_rows(g, name, read)["w"].reshape(g.tensors[name].shape)


EMBEDDINGS = ("token_embd.weight", "per_layer_token_embd.weight")
"""The tables a model gathers rows of (gemma4's per-layer one is its biggest tensor)."""


def _block_layer(g: GGUFFile, name: str, ops: Ops, bias: str | None = None
                 ) -> BlockLinear | BlockEmbedding | BlockExperts:
    """Tensor `name` as its own blocks: the token table as a `BlockEmbedding`, a 3-D expert
    tensor as `BlockExperts`, any other matrix as a `BlockLinear` (with the float32 tensor
    `bias`, if given)."""
    info = g.tensors[name]
    codec = CODECS[info.type]

    def read(rows: tuple[int, int] | None) -> dict[str, mx.array]:
        n = info.n_elements // info.shape[-1] if rows is None else rows[1] - rows[0]
        parts = split_rows(codec, g.raw(name, rows), (n, info.shape[-1]))
        g.release(name, rows)  # the split arrays are copies: the mapped rows' pages can go
        for k, v in parts.items():  # the scales (float16 fields); the codes are integers
            check_finite(g.path, name, v, f"block scales ({k!r})", rows=info.shape[:-1],
                         start=None if rows is None else rows[0])
        return {k: mx.array(v) for k, v in parts.items()}

    blocks = loaded_rows(g, name, read)
    if len(info.shape) == 3:
        return BlockExperts(codec, blocks, *info.shape, ops)
    n_out, n_in = info.shape
    if name in EMBEDDINGS:  # tables read a row at a time
        return BlockEmbedding(codec, blocks, n_out, n_in, ops)
    b = None
    if bias is not None:
        b = mx.array(g.load(bias, np.float32))
        mx.eval(b)
        g.release(bias)
    return BlockLinear(codec, blocks, n_out, n_in, b, ops)


def load_llama_into(path: str | os.PathLike, model: Llama) -> None:
    """Resume: a llama GGUF's weights into an existing model of the same shape (float32); the
    matrices the model holds as blocks or MLX-quantized are frozen, the base's, and kept."""
    held = dict(tree_flatten(model.parameters()))
    with GGUFFile(path) as g:
        kept = tuple(n for n, key in parameter_names(model.args).items() if key not in held)
        load_llama_weights(g, model, skip=kept)


def _quantized_linear(g: GGUFFile, name: str, ops: Ops, bias: str | None = None
                      ) -> QuantizedLinear:
    """A frozen quantized projection holding tensor `name`'s own Q4_0/Q4_1/Q8_0 blocks (and
    the float32 tensor `bias`, if given)."""
    w, scales, biases, bits = gguf_to_mlx_quant(g, name)
    n_out, n_in = g.tensors[name].shape
    q = QuantizedLinear(n_in, n_out, bias=bias is not None, group_size=GROUP_SIZE, bits=bits,
                        ops=ops)
    q.weight, q.scales, q.biases = mx.array(w), mx.array(scales), mx.array(biases)
    if bias is not None:
        q.bias = mx.array(g.load(bias, np.float32))
        g.release(bias)
    mx.eval(q.parameters())
    return q


_SWITCHES = ("rope_neox", "attn_bias", "qk_norm", "qk_norm_whole", "pre_norms", "post_norms",
             "embed_scale", "activation", "fused_qkv", "fused_gate_up", "no_rope_interval",
             "attn_out_gate", "v_norm")
"""LlamaArgs fields that an architecture fixes (`Arch.switches`; LlamaArgs' default where it
does not name them)."""


def _sliding_blocks(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """llama.cpp's Gemma blocks for `sliding_window_pattern` n: sliding, but every n-th block
    dense (0: every block slides); n = 2 for gemma2, 6 for gemma3 (`GEMMA`)."""
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers))


def _gemma_query_scale(arch: str, d_model: int, n_heads: int, n_layers: int,
                       head_dim: int) -> float:
    """llama.cpp's Gemma query scale: 1/sqrt(head width), but 1/sqrt(d/heads) for the 27B
    shape (46 blocks of gemma2, 62 of gemma3)."""
    wide = n_layers == GEMMA[arch].wide_query_blocks
    return (d_model // n_heads if wide else head_dim) ** -0.5


def _loaded_attn_scale(a: LlamaArgs) -> float:
    """The query scale `args_from_gguf` gives a file of this shape."""
    if a.arch in GEMMA:
        return _gemma_query_scale(a.arch, a.d_model, a.n_heads, a.n_layers, a.head_dim)
    if a.arch == "granite":  # granite.attention.scale says any
        return a.attn_scale or a.head_dim ** -0.5
    if a.arch == "gemma4":
        return 1.0
    return a.head_dim ** -0.5


def unwritable(a: LlamaArgs) -> list[str]:
    """The fields of `a` that no GGUF of its architecture says, so that `args_from_gguf` (and
    llama.cpp) would read another model: each as "field=value (why)"; empty: `a` is writable."""
    if a.arch not in ARCHS:
        return [f"arch={a.arch!r} (expected one of {SUPPORTED})"]
    arch, plain, out = ARCHS[a.arch], LlamaArgs(), []
    for k in _SWITCHES:
        want = arch.switches.get(k, getattr(plain, k))
        if getattr(a, k) != want and not (k == "attn_bias" and a.arch in BIASED):
            out.append(f"{k}={getattr(a, k)!r} ({a.arch} files compute with {want!r})")
    if a.n_experts and a.arch not in MOE_ARCHS or not a.n_experts and a.arch in MOE_ARCHS \
            and a.arch not in DENSE_ALLOWED:
        out.append(f"n_experts={a.n_experts} ({a.arch} files are "
                   f"{'mixtures of experts' if a.arch in MOE_ARCHS else 'dense'})")
    if a.n_experts and a.arch == "llama" and a.expert_width != a.ffn_dim:
        out.append(f"expert_ffn_dim={a.expert_ffn_dim} (llama's experts are "
                   f"feed_forward_length={a.ffn_dim} wide)")
    norm = arch.switches.get("moe_norm_topk", True)
    if a.n_experts and a.moe_norm_topk != norm:
        out.append(f"moe_norm_topk={a.moe_norm_topk} (llama.cpp's {a.arch} "
                   f"{'always' if norm else 'never'} renormalizes the chosen experts' weights)")
    if bool(a.shared_expert_ffn_dim) != (a.n_experts > 0 and a.arch == "qwen2moe"):
        out.append(f"shared_expert_ffn_dim={a.shared_expert_ffn_dim} (only qwen2moe files, "
                   "always, have a shared expert)")
    if a.tie_embeddings and a.arch == "olmo2":
        out.append("tie_embeddings=True (llama.cpp's olmo2 reads an output.weight)")
    if a.arch == "qwen35" and not a.linear_layers:
        out.append("linear_layers=None (qwen35 files say which blocks are linear attention)")
    elif a.arch != "qwen35" and a.linear_layers:
        out.append("linear_layers (only qwen35 files have linear-attention blocks)")
    if a.out_bias and a.arch not in BIASED:
        out.append("out_bias=True (only llama and mistral3 files carry an attention output "
                   "bias)")
    if a.rope_dims is not None and a.rope_dims != a.head_dim and not a.rope_neox:
        out.append(f"rope_dims={a.rope_dims} ({a.arch} rotates the whole head)")
    if a.rope_factors is not None and a.arch not in (*BIASED, "gemma4"):
        out.append("rope_factors (phi3 files carry longrope's short and long factors, and a "
                   "model holds only the short ones)" if a.arch == "phi3" else
                   "rope_factors (only llama, mistral3 and gemma4 files carry a rope_freqs "
                   "tensor)")
    if a.rope_mscale != 1.0 and "rope.scaling.attn_factor" not in arch.keys:
        out.append(f"rope_mscale={a.rope_mscale} ({a.arch} files have no rope.scaling."
                   "attn_factor)")
    if (a.attn_scale or a.head_dim ** -0.5) != _loaded_attn_scale(a):
        out.append(f"attn_scale={a.attn_scale} ({a.arch} files of this shape scale queries by "
                   f"{_loaded_attn_scale(a)})")
    out += _yarn_unwritable(a, arch)
    if a.arch == "gemma4":
        return out + gemma4.unwritable(a)
    return out + _gemma4_fields(a) + _gemma_unwritable(a)


def _yarn_unwritable(a: LlamaArgs, arch: Arch) -> list[str]:
    """`unwritable`'s findings in the YaRN fields and mistral3's attention temperature."""
    out, plain = [], LlamaArgs()
    if a.rope_yarn and "yarn" not in arch.rope_scaling:
        out.append(f"rope_yarn=True ({a.arch} files say rope.scaling.type "
                   f"{', '.join(arch.rope_scaling)})")
    if a.rope_yarn_beta != plain.rope_yarn_beta and "rope.scaling.yarn_beta_fast" not in \
            arch.keys:
        out.append(f"rope_yarn_beta={a.rope_yarn_beta} (llama.cpp's {a.arch} computes with "
                   f"{plain.rope_yarn_beta})")
    if a.rope_yarn_log_mul and "rope.scaling.yarn_log_multiplier" not in arch.keys:
        out.append(f"rope_yarn_log_mul={a.rope_yarn_log_mul} (llama.cpp's {a.arch} reads no "
                   "rope.scaling.yarn_log_multiplier)")
    if a.attn_temperature and "attention.temperature_scale" not in arch.keys:
        out.append(f"attn_temperature={a.attn_temperature} (only mistral3 files say it)")
    return out


def _gemma4_fields(a: LlamaArgs) -> list[str]:
    """The gemma4-only fields of `a` (another architecture) that are not their defaults."""
    plain = LlamaArgs()
    out = [f"{f}={getattr(a, f)!r} (only gemma4 files say it)" for f in (
        "key_length_sliding", "kv_heads_per_block", "ffn_dims_per_block", "k_eq_v",
        "shared_kv_layers",
        "per_layer_dim", "layer_scales") if getattr(a, f) != getattr(plain, f)]
    said = a.rope_dims if a.arch in GEMMA else None  # gemma2, gemma3: their rope_dims
    if a.rope_dims_sliding != said:
        out.append(f"rope_dims_sliding={a.rope_dims_sliding} ({a.arch} files say "
                   f"{said} (None: the whole head))")
    return out


def _gemma_unwritable(a: LlamaArgs) -> list[str]:
    """`unwritable`'s findings in the fields only Gemma files say: the sliding window, its
    blocks and RoPE base, and the soft caps."""
    gemma, out = GEMMA.get(a.arch), []
    if gemma is not None and a.sliding_window:
        if a.sliding_layers != _sliding_blocks(a.n_layers, gemma.pattern):
            out.append(f"sliding_layers={a.sliding_layers!r} (llama.cpp's {a.arch} slides "
                       f"{gemma.slides})")
    else:
        if gemma is not None and gemma.window:
            out.append(f"sliding_window={a.sliding_window} (llama.cpp's {a.arch} slides a "
                       f"{gemma.window}-key window over {gemma.slides} where a file says none)")
        elif a.sliding_window is not None and gemma is None:
            out.append(f"sliding_window={a.sliding_window} (only {' and '.join(GEMMA)} files "
                       "say it)")
        if a.sliding_layers is not None:
            out.append(f"sliding_layers={a.sliding_layers!r} (only {' and '.join(GEMMA)} files "
                       "with a sliding window say it)")
    if a.rope_base_sliding != 10000.0 and not (gemma and gemma.swa_base_is_rope_base):
        out.append(f"rope_base_sliding={a.rope_base_sliding} (llama.cpp's gemma3 fixes 10000)")
    for field, what in (("final_softcap", "logits"), ("attn_softcap", "attention scores")):
        cap, default = getattr(a, field), getattr(gemma, field, None)
        if cap is not None and default is None:
            says = " and ".join(n for n, gm in GEMMA.items() if getattr(gm, field) is not None)
            out.append(f"{field}={cap} (only {says} files say it)")
        elif cap is None and default:
            out.append(f"{field}=None (llama.cpp caps {a.arch}'s {what} at {default:g} where "
                       "a file says no cap)")
    for key, field in GRANITE_SCALARS.items():
        if getattr(a, field) != 1.0 and a.arch != "granite":
            out.append(f"{field}={getattr(a, field)} (only granite files say it: {key})")
    return out


def llama_metadata(a: LlamaArgs, name: str = "toymlx") -> dict[str, Any]:
    """The general.* and `<arch>.*` keys llama.cpp needs for this shape, which `args_from_gguf`
    reads back as `a`; ValueError naming the fields no file of the architecture says."""
    bad = unwritable(a)
    if bad:
        raise ValueError(f"model args: expected a shape a {a.arch} GGUF can say, found "
                         f"{'; '.join(bad)}")
    k = a.arch + "."
    meta: dict[str, Any] = {
        "general.architecture": a.arch,
        "general.name": name,
        "general.file_type": 0,  # all F32
        k + "vocab_size": a.vocab_size,
        k + "context_length": a.context,
        k + "embedding_length": a.d_model,
        k + "block_count": a.n_layers,
        k + "feed_forward_length": a.ffn_dim,
        k + "attention.head_count": a.n_heads,
        k + "attention.head_count_kv": a.n_kv_heads,
        k + "attention.key_length": a.head_dim,
        k + "attention.value_length": a.head_dim,
        k + "rope.dimension_count": a.rope_dims or a.head_dim,
        k + "rope.freq_base": float(a.rope_base),
        k + "attention.layer_norm_rms_epsilon": float(a.norm_eps),
    }
    if a.n_experts:
        meta.update({k + "expert_count": a.n_experts, k + "expert_used_count": a.n_experts_used})
        if a.arch != "llama":  # llama's experts are feed_forward_length wide
            meta[k + "expert_feed_forward_length"] = a.expert_width
        if a.shared_expert_ffn_dim:
            meta[k + "expert_shared_feed_forward_length"] = a.shared_expert_ffn_dim
    if a.rope_scale != 1.0 or a.rope_yarn:
        meta[k + "rope.scaling.type"] = "yarn" if a.rope_yarn else "linear"
        meta[k + "rope.scaling.factor"] = 1.0 / a.rope_scale
    if a.rope_orig_context is not None:
        meta[k + "rope.scaling.original_context_length"] = a.rope_orig_context
    if a.rope_yarn_beta != LlamaArgs().rope_yarn_beta:
        meta[k + "rope.scaling.yarn_beta_fast"] = float(a.rope_yarn_beta[0])
        meta[k + "rope.scaling.yarn_beta_slow"] = float(a.rope_yarn_beta[1])
    if a.rope_yarn_log_mul:
        meta[k + "rope.scaling.yarn_log_multiplier"] = float(a.rope_yarn_log_mul)
    if a.attn_temperature:
        meta[k + "attention.temperature_scale"] = float(a.attn_temperature)
    if a.rope_mscale != 1.0:
        meta[k + "rope.scaling.attn_factor"] = float(a.rope_mscale)
    if a.arch == "gemma4":
        meta.update(gemma4.metadata(a))
    elif a.sliding_window:  # the blocks that slide are llama.cpp's own
        meta[k + "attention.sliding_window"] = a.sliding_window
        if a.rope_base_sliding != a.rope_base and GEMMA[a.arch].swa_base_is_rope_base:
            meta[k + "rope.freq_base_swa"] = float(a.rope_base_sliding)
    if a.final_softcap is not None and a.arch != "gemma4":
        meta[k + "final_logit_softcapping"] = float(a.final_softcap)
    if a.attn_softcap is not None:
        meta[k + "attn_logit_softcapping"] = float(a.attn_softcap)
    if a.arch == "qwen35":
        meta.update(qwen35_metadata(a))
    if a.arch == "granite":  # llama.cpp requires logit_scale; the others, where not 1
        meta.update({k + key: float(getattr(a, field)) for key, field in GRANITE_SCALARS.items()
                     if key == "logit_scale" or getattr(a, field) != 1.0})
        if a.attn_scale is not None:
            meta[k + "attention.scale"] = float(a.attn_scale)
    return meta


def qwen35_metadata(a: LlamaArgs) -> dict[str, Any]:
    """A qwen35 file's keys beside the common ones (those `qwen35_switches` reads), its M-RoPE
    sections the interleaving that turns every rotated pair by the text position (a third of
    the pairs each, time first: the converter's [11, 11, 10, 0] for 32 pairs)."""
    k, n = "qwen35.", (a.rope_dims or a.head_dim) // 2
    return {k + "ssm.conv_kernel": a.ssm_conv_kernel, k + "ssm.state_size": a.ssm_head_dim,
            k + "ssm.group_count": a.ssm_k_heads, k + "ssm.time_step_rank": a.ssm_v_heads,
            k + "ssm.inner_size": a.ssm_v_heads * a.ssm_head_dim,
            k + "attention.recurrent_layers": list(a.linear_layers or ()),
            k + "rope.dimension_sections": [-(-n // 3), -(-(n - 1) // 3), -(-(n - 2) // 3), 0]}


LLAMA_TYPES = {"general.file_type": (UINT32, None)}


def llama_tensors(model: Llama, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 numpy tensors of a Llama (base weights only, no LoRA)."""
    flat = params if params is not None else dict(tree_flatten(model.parameters()))
    return {name: llama_tensor(model, flat, key)
            for name, key in parameter_names(model.args).items()}


def llama_tensor(model: Llama, flat: dict[str, Any], key: str) -> np.ndarray:
    """The float32 numpy values of the parameter at `key` (`flat`: the model's parameters
    flattened), a frozen matrix held as blocks or MLX-quantized decoded exactly."""
    w = flat.get(key)
    base, _, leaf = key.rpartition(".")
    if w is None and f"{base}.linear.{leaf}" in flat:  # a LoRA-wrapped projection keeps
        w = flat[f"{base}.linear.{leaf}"]  # its base weight under `.linear`
    elif w is None:  # a frozen matrix held as blocks or MLX-quantized: its exact decoding
        m = submodule(model, base)
        w = m.dense() if isinstance(m, BlockExperts) else dense_weight(m)
    return np.asarray(w.astype(mx.float32))


def write_llama(path: str | os.PathLike, model: Llama, tokenizer_meta: dict[str, Any],
                extra: dict[str, Any] | None = None, name: str = "toymlx",
                tensors: dict[str, np.ndarray] | None = None, dtype: str = "f32") -> None:
    """Write a llama.cpp-loadable GGUF of `model` in its architecture (`llama_metadata`), its
    matrices as `dtype` (f32, f16, bf16; norms stay F32); tied models get no output.weight, a
    model with RoPE factors gets them as `rope_freqs.weight` (Llama 3's)."""
    tensors = tensors if tensors is not None else llama_tensors(model)
    meta = llama_metadata(model.args, name)
    meta.update(tokenizer_meta)
    meta["general.file_type"] = FILE_TYPE[dtype]
    meta["toy.checkpoint_format"] = CHECKPOINT_FORMAT
    meta["toy.n_params_written"] = int(sum(t.size for t in tensors.values()))
    meta.update(extra or {})
    if model.args.rope_factors is not None:  # a constant, not a parameter
        tensors = {**tensors, "rope_freqs.weight": np.array(model.args.rope_factors, np.float32)}
    write_gguf(path, meta, {n: encode_tensor(n, t, dtype) for n, t in tensors.items()},
               types=LLAMA_TYPES)
