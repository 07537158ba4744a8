"""Gemma 4's dense GGUFs (`general.architecture = gemma4`: E2B, E4B, 31B): what each piece
is, where llama.cpp and transformers put it, and the `LlamaArgs` switches it sets.

Read from llama.cpp's src/models/gemma4.cpp (load_arch_hparams, load_arch_tensors, the
graph), its KV cache's `reuse` rule (src/llama-model.cpp, gemma3n and gemma4), its converter
(conversion/gemma.py, Gemma4Model) and transformers 5.24's models/gemma4 (Gemma4TextConfig,
Gemma4TextAttention, Gemma4TextDecoderLayer, Gemma4TextModel). A block is gemma3's (pre and
post norms around attention and the MLP, GeGLU with GELU's tanh form, q/k RMS norms per head,
NEOX RoPE, embeddings times sqrt(d_model)) with these differences:

- Two kinds of block. `attention.sliding_window_pattern` is an array, one bool per block (a
  sliding block: True); transformers' `layer_types`. Sliding blocks attend over the last
  `attention.sliding_window` keys (themselves included: llama.cpp's LLAMA_SWA_TYPE_STANDARD,
  transformers' sliding mask, as gemma3). Their heads are `attention.key_length_swa` wide
  (transformers' head_dim), the full-attention blocks' `attention.key_length` (its
  global_head_dim); `head_count_kv` may be an array, one count per block (the 31B's
  num_global_key_value_heads for its full blocks): `LlamaArgs.key_length_sliding`,
  `kv_heads_per_block`.
- RoPE. Sliding blocks: base `rope.freq_base_swa` (default 10000), `rope.dimension_count_swa`
  dims (the whole head). Full blocks: base `rope.freq_base`, "proportional" RoPE: transformers
  rotates the first partial_rotary_factor (0.25) of each head's frequency pairs with
  exponents over the whole head width and leaves the others; llama.cpp's NEOX RoPE rotates
  the whole head (`rope.dimension_count` = key_length) with the `rope_freqs` tensor dividing
  each pair's frequency: 1 for the rotated pairs, 1e30 for the others (an angle of ~0: cos 1,
  sin ~1e-30). The same numbers; toymlx reads rope_freqs as its full blocks' `rope_factors`
  (llama.cpp applies it to full blocks only, `n_rot(il)`).
- Attention: q k^T is not scaled (llama.cpp's f_attention_scale 1.0, transformers'
  scaling 1.0): `attn_scale` 1.0. Values are RMS-normed per head without a weight
  (`v_norm`; transformers' v_norm with_scale=False, llama.cpp's ggml_rms_norm). A block
  without `attn_v` (the 31B's full blocks, attention_k_eq_v) uses its k projection as v,
  before k's norm and RoPE (both sides agree): `k_eq_v`.
- Shared KV: the last `attention.shared_kv_layers` blocks have no attn_k/attn_v/attn_k_norm
  and attend over an earlier block's keys and values with their own queries. Which one:
  llama.cpp (the KV cache's reuse callback) takes block n_kv - 2 for a sliding block and
  n_kv - 1 for a full one (n_kv = block_count - shared_kv_layers); transformers the last block
  before the tail of the same layer type. They differ where block n_kv - 1 is not full or
  n_kv - 2 not sliding; no Gemma 4 is so (E2B: 15 - 1 = 14 full, 13 sliding), and toymlx
  refuses such a file (`LlamaArgs.kv_source`, checked in `validate`).
- Per-layer embeddings (PLE, E2B/E4B; `embedding_length_per_layer_input` P > 0, 0: none).
  Before the blocks: per_layer_token_embd (vocab rows of n_layer * P) gathered at the ids,
  times sqrt(P); per_layer_model_proj (n_layer * P, d_model) of the scaled token embeddings,
  times 1/sqrt(d_model), RMS-normed per block's P values by per_layer_proj_norm; the two
  added and times 1/sqrt(2): block i's input is its slice (llama.cpp's build_inp_per_layer
  and project_per_layer_inputs, transformers' get_per_layer_inputs and
  project_per_layer_inputs: the same). In block i, after the MLP's residual add:
  h + post_norm(proj(gelu_tanh(inp_gate(h)) * input_i)) (blk.i.inp_gate, blk.i.proj,
  blk.i.post_norm; transformers' per_layer_input_gate, per_layer_projection,
  post_per_layer_input_norm). The table is the biggest tensor of an E2B (35 * 256 x 262144):
  toymlx keeps it in its quantized blocks and decodes the gathered rows only, as it keeps
  token_embd (`BlockEmbedding`).
- Each block's output times `blk.i.layer_output_scale` (a 1-element tensor; transformers'
  layer_scalar buffer): `layer_scales`.
- The logits soft-capped by `final_logit_softcapping`; llama.cpp caps at 30 where the key is
  absent and not at all where it is 0 (the converter writes none where transformers' config
  says None: the two then differ; toymlx reads as llama.cpp).
- Norm weights are stored as applied (transformers' Gemma4RMSNorm multiplies by w, not
  1 + w: the converter's norm_shift is 0).
- Mixture-of-experts files (26B-A4B: expert_count > 0, ffn_gate_inp tensors) are refused.
"""

from __future__ import annotations

import math
from typing import Any

from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.llama import LlamaArgs

KEYS = frozenset({
    "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
    "final_logit_softcapping", "attention.key_length_swa", "attention.value_length_swa",
    "rope.dimension_count_swa", "attention.shared_kv_layers",
    "embedding_length_per_layer_input", "expert_feed_forward_length"})
"""gemma4's `<arch>.` keys beside the common ones (expert_feed_forward_length only so that a
mixture-of-experts file is refused by its expert_count, in one line)."""
SWITCHES = {"rope_neox": True, "qk_norm": True, "post_norms": True, "embed_scale": True,
            "activation": "gelu_tanh", "v_norm": True, "attn_scale": 1.0}
"""What every gemma4 file computes with."""
FINAL_SOFTCAP = 30.0
"""llama.cpp's final_logit_softcapping where a file has none (llama-hparams.h)."""
SWA_BASE = 10000.0
"""llama.cpp's rope.freq_base_swa where a file has none."""


def per_block(g: GGUFFile, key: str, default: int | None = None
              ) -> tuple[int, tuple[int, ...] | None]:
    """A count said once or once per block (head_count_kv, feed_forward_length): (the count,
    None) or (the first block's, the tuple where they differ)."""
    v = g.metadata.get(key, default) if default is not None else g.get(key, (int, list))
    if isinstance(v, (list, tuple)):
        counts = tuple(int(x) for x in v)
        if not counts or isinstance(v[0], bool):
            raise GGUFError(f"{g.path}: metadata key {key!r}: expected a count or one per "
                            f"block, found {v!r:.60}")
        return counts[0], counts if len(set(counts)) > 1 else None
    return int(v), None


def switches(g: GGUFFile, n_layers: int, head_dim: int) -> dict[str, Any]:
    """The LlamaArgs fields a gemma4 file's keys and tensors set beyond the common ones; one
    GGUFError naming the key or tensor where it is not what llama.cpp reads."""
    k = "gemma4."
    sw: dict[str, Any] = dict(SWITCHES)
    pattern = g.metadata.get(k + "attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != n_layers:
        raise GGUFError(f"{g.path}: metadata key '{k}attention.sliding_window_pattern': "
                        f"expected a bool per block ({n_layers}), found {pattern!r}")
    window = g.get(k + "attention.sliding_window", int)
    if window <= 0:
        raise GGUFError(f"{g.path}: metadata key '{k}attention.sliding_window': expected a "
                        f"window > 0, found {window}")
    swa_dim = g.get(k + "attention.key_length_swa", int, head_dim)
    if g.get(k + "attention.value_length_swa", int, swa_dim) != swa_dim:
        raise GGUFError(f"{g.path}: metadata key '{k}attention.value_length_swa': expected "
                        f"{swa_dim} (= key_length_swa), found "
                        f"{g.metadata[k + 'attention.value_length_swa']}")
    swa_rot = g.get(k + "rope.dimension_count_swa", int, swa_dim)
    if not (0 < swa_rot <= swa_dim and swa_rot % 2 == 0):
        raise GGUFError(f"{g.path}: metadata key '{k}rope.dimension_count_swa': expected an "
                        f"even number in 2..{swa_dim}, found {swa_rot}")
    base = float(g.get(k + "rope.freq_base_swa", (int, float), SWA_BASE))
    if not (math.isfinite(base) and base > 0):  # inf: the sliding blocks would not turn
        raise GGUFError(f"{g.path}: metadata key '{k}rope.freq_base_swa': expected a finite "
                        f"value > 0, found {base}")
    cap = float(g.get(k + "final_logit_softcapping", (int, float), FINAL_SOFTCAP))
    if not (math.isfinite(cap) and cap >= 0):  # inf: every logit 0 * inf = NaN
        raise GGUFError(f"{g.path}: metadata key '{k}final_logit_softcapping': expected a "
                        f"finite value >= 0 (0: no cap), found {cap}")
    shared = g.get(k + "attention.shared_kv_layers", int, 0)
    ple = g.get(k + "embedding_length_per_layer_input", int, 0)
    if shared < 0 or ple < 0:
        raise GGUFError(f"{g.path}: metadata keys '{k}attention.shared_kv_layers' and "
                        f"'{k}embedding_length_per_layer_input': expected >= 0, found "
                        f"{shared} and {ple}")
    for name in g.tensors:
        if ".ffn_gate_inp." in name or "_exps." in name:
            raise GGUFError(f"{g.path}: tensor {name!r}: expected a dense gemma4 "
                            "(mixture-of-experts files are not supported), found an expert "
                            "tensor")
    sw.update(sliding_window=window, sliding_layers=tuple(bool(x) for x in pattern),
              rope_base_sliding=base, final_softcap=cap or None,
              key_length_sliding=None if swa_dim == head_dim else swa_dim,
              rope_dims_sliding=None if swa_rot == swa_dim else swa_rot,
              shared_kv_layers=shared, per_layer_dim=ple,
              layer_scales="blk.0.layer_output_scale.weight" in g.tensors,
              k_eq_v=_k_eq_v(g, pattern, shared))
    return sw


def _k_eq_v(g: GGUFFile, pattern: list, shared: int) -> bool:
    """Whether the full-attention blocks (with their own keys) have no attn_v: all or none."""
    full = [i for i, s in enumerate(pattern) if not s and i < len(pattern) - shared]
    has_v = {f"blk.{i}.attn_v.weight" in g.tensors for i in full}
    if len(has_v) > 1:
        raise GGUFError(f"{g.path}: tensor 'blk.{full[0]}.attn_v.weight': expected present in "
                        "every full-attention block or in none, found it in some")
    return has_v == {False}


def per_block_shapes(a: LlamaArgs, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's gemma4-only tensors (the per-layer embedding's, the output scale)."""
    out: dict[str, tuple[int, ...]] = {}
    if a.per_layer_dim:
        out.update({"inp_gate.weight": (a.per_layer_dim, a.d_model),
                    "proj.weight": (a.d_model, a.per_layer_dim),
                    "post_norm.weight": (a.d_model,)})
    if a.layer_scales:
        out["layer_output_scale.weight"] = (1,)
    return out


def global_shapes(a: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """The per-layer embedding's global tensors."""
    if not a.per_layer_dim:
        return {}
    width = a.per_layer_dim * a.n_layers
    return {"per_layer_token_embd.weight": (a.vocab_size, width),
            "per_layer_model_proj.weight": (width, a.d_model),
            "per_layer_proj_norm.weight": (a.per_layer_dim,)}


def metadata(a: LlamaArgs) -> dict[str, Any]:
    """The gemma4 keys `switches` reads back as `a` (beside llama_metadata's common ones)."""
    k = "gemma4."
    swa_dim = a.key_length_sliding or a.head_dim
    meta: dict[str, Any] = {
        k + "attention.sliding_window": a.sliding_window,
        k + "attention.sliding_window_pattern": [bool(x) for x in a.sliding_layers or ()],
        k + "attention.key_length_swa": swa_dim, k + "attention.value_length_swa": swa_dim,
        k + "rope.dimension_count_swa": a.rope_dims_sliding or swa_dim,
        k + "rope.freq_base_swa": float(a.rope_base_sliding),
        k + "final_logit_softcapping": float(a.final_softcap or 0.0),
        k + "attention.shared_kv_layers": a.shared_kv_layers,
        k + "embedding_length_per_layer_input": a.per_layer_dim}
    if a.kv_heads_per_block:
        meta[k + "attention.head_count_kv"] = list(a.kv_heads_per_block)
    if a.ffn_dims_per_block:
        meta[k + "feed_forward_length"] = list(a.ffn_dims_per_block)
    return meta


def unwritable(a: LlamaArgs) -> list[str]:
    """The fields of a gemma4 `a` no gemma4 file says (see `toymlx.gguf.llama.unwritable`)."""
    out = []
    if not a.sliding_window or a.sliding_layers is None:
        out.append(f"sliding_window={a.sliding_window} (gemma4 files say a window and a "
                   "pattern)")
    if a.attn_scale != 1.0:
        out.append(f"attn_scale={a.attn_scale} (llama.cpp's gemma4 does not scale q k^T)")
    if a.attn_softcap is not None:
        out.append(f"attn_softcap={a.attn_softcap} (gemma4 files do not cap attention)")
    for f in ("ffn_dims_per_block", "kv_heads_per_block"):
        v = getattr(a, f)
        if v is not None and len(set(v)) == 1:
            out.append(f"{f}={v!r} (a file says one count where every block has it)")
    return out
