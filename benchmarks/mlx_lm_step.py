"""The mlx-lm peer: mlx-lm's model of the workload's architecture (llama, qwen2, qwen3,
gemma3_text, phi3) holding toymlx's weights, its LoRA layers and its trainer's compiled step.

`PEERS` is the one toymlx -> mlx-lm map per architecture and `model_config` the one
LlamaArgs -> mlx-lm config; a switch mlx-lm computes otherwise is refused there by name.

The step is built as `mlx_lm.tuner.trainer.train` builds it (a closure there):
`value_and_grad(default_loss)` under `mx.compile` with the model, optimizer and random state
as state, grad_accum 1, and mlx-lm lora's default optimizer (Adam). In bfloat16 the model is
cast with `set_dtype` before the LoRA layers are added, as loading a bf16 checkpoint gives
(mlx-lm's adapters stay float32).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from rounds import Variant
from workloads import Workload

from toymlx.gguf.llama import ARCHS
from toymlx.models.llama import LlamaArgs
from toymlx.models.lora import TARGETS


@dataclass(frozen=True)
class Peer:
    """How mlx-lm holds one of toymlx's architectures: its model module, what its block norms
    are called, and its norm convention."""

    module: str
    """mlx_lm.models.<module>."""
    norms: dict[str, str]
    """toymlx's block norm -> mlx-lm's."""
    norm_offset: float = 0.0
    """Subtracted from every RMSNorm weight: gemma's RMSNorm computes with 1 + w, where
    toymlx (and llama.cpp's files) hold 1 + w already."""


_PLAIN = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
PEERS: dict[str, Peer] = {
    "llama": Peer("llama", _PLAIN),
    "qwen2": Peer("qwen2", _PLAIN),
    "qwen3": Peer("qwen3", _PLAIN),
    "phi3": Peer("phi3", _PLAIN),
    "gemma3": Peer("gemma3_text", {"attn_norm": "input_layernorm",
                                   "attn_post_norm": "post_attention_layernorm",
                                   "ffn_norm": "pre_feedforward_layernorm",
                                   "ffn_post_norm": "post_feedforward_layernorm"}, 1.0),
}
"""The one toymlx -> mlx-lm map per architecture (LlamaArgs.arch). Tensor layouts are the
same on both sides ((out, in); phi3's qkv_proj q-k-v and gate_up_proj gate-up, split alike;
q/k in the file's RoPE layout), so a name and the norm offset are all that change."""


def to_mlx_lm(name: str, peer: Peer) -> str:
    """mlx-lm's name for a toymlx parameter path (LoRA wrappers' `.linear` dropped)."""
    if name == "output.weight":
        return "lm_head.weight"
    k = name.replace(".linear.", ".").replace("embed.", "embed_tokens.").replace(
        ".attn.", ".self_attn.")
    parts = k.split(".")
    if len(parts) > 2 and parts[2] in peer.norms:  # layers.<i>.<norm>.weight
        parts[2] = peer.norms[parts[2]]
    return "model." + ".".join(parts)


def peer_value(name: str, v: np.ndarray, peer: Peer) -> np.ndarray:
    """A base weight as mlx-lm's module holds it (norm offset applied)."""
    return v - peer.norm_offset if name.endswith("norm.weight") and peer.norm_offset else v


def model_config(a: LlamaArgs) -> dict[str, Any]:
    """The Hugging Face-style config mlx-lm builds the same model from; ValueError names a
    switch mlx-lm's module for `a.arch` cannot compute."""
    hd = a.head_dim
    rope_dims = a.rope_dims or hd
    cannot = {k: getattr(a, k) != v for k, v in ARCHS[a.arch].switches.items()}
    cannot |= {"rope_factors": a.rope_factors is not None, "rope_mscale": a.rope_mscale != 1.0,
              "out_bias": a.out_bias,
              # YaRN and mistral3's temperature: a benchmark of the plain RoPE compares alike
              "rope_yarn": a.rope_yarn, "attn_temperature": a.attn_temperature != 0.0,
              # mlx-lm's qwen2 and phi3 derive the head width from hidden_size / heads
              "key_length": a.arch in ("qwen2", "phi3") and hd != a.d_model // a.n_heads,
              "rope_dims": a.arch != "phi3" and rope_dims != hd,
              # mlx-lm's gemma3_text has no logit soft-cap (Gemma 3's configs have none)
              "final_softcap": a.final_softcap is not None,
              "attn_scale": a.arch != "gemma3" and a.attn_scale not in (None, hd ** -0.5),
              # gemma3_text has sliding layers (local RoPE base, no scaling) by construction
              "sliding_window": (a.sliding_window is None) == (a.arch == "gemma3")}
    cfg: dict[str, Any] = {
        "model_type": PEERS[a.arch].module, "hidden_size": a.d_model,
        "num_hidden_layers": a.n_layers, "intermediate_size": a.ffn_dim,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": hd,
        "rms_norm_eps": a.norm_eps, "vocab_size": a.vocab_size, "rope_theta": a.rope_base,
        "rope_traditional": not a.rope_neox, "tie_word_embeddings": a.tie_embeddings,
        "max_position_embeddings": a.context, "attention_bias": a.attn_bias,
        "partial_rotary_factor": rope_dims / hd}
    if a.rope_scale != 1.0:
        cfg["rope_scaling"] = {"type": "linear", "factor": 1.0 / a.rope_scale}
    if a.arch == "gemma3":
        pattern = 6  # mlx-lm's gemma3_text: every sixth block global, as Gemma 3's configs
        sliding = tuple(i % pattern < pattern - 1 for i in range(a.n_layers))
        cannot["sliding_layers"] = bool(a.sliding_window) and a.sliding_layers != sliding
        # mlx-lm multiplies the embeddings by sqrt(d) rounded to bfloat16; llama.cpp and
        # toymlx by sqrt(d) in float32: the same function only where the two are equal
        root = np.float32(a.d_model ** 0.5)
        cannot["d_model"] = float(mx.array(root, mx.bfloat16).astype(mx.float32)) != root
        cfg.update(query_pre_attn_scalar=(a.attn_scale or hd ** -0.5) ** -2,
                   sliding_window=a.sliding_window or a.context,
                   sliding_window_pattern=pattern, rope_local_base_freq=a.rope_base_sliding)
    bad = [k for k, v in cannot.items() if v]
    if bad:
        raise ValueError(f"mlx-lm's {PEERS[a.arch].module} computes these LlamaArgs switches "
                         f"otherwise than toymlx: {', '.join(bad)} (found "
                         f"{', '.join(f'{k}={getattr(a, k)!r}' for k in bad)})")
    return cfg


def lora_keys(targets: tuple[str, ...]) -> list[str]:
    """mlx-lm's module paths inside a block for toymlx's --lora.targets names."""
    return [TARGETS[t].replace("attn.", "self_attn.") for t in targets]


def build_peer(a: LlamaArgs, weights: dict[str, np.ndarray]) -> nn.Module:
    """mlx-lm's model class for `a.arch`, holding toymlx's base weights (LoRA not applied)."""
    peer = PEERS[a.arch]
    lib = importlib.import_module(f"mlx_lm.models.{peer.module}")
    model = lib.Model(lib.ModelArgs.from_dict(model_config(a)))
    base = {to_mlx_lm(k, peer): mx.array(peer_value(k, v, peer))
            for k, v in weights.items() if ".lora_" not in k}
    if hasattr(model, "sanitize"):  # as mlx_lm.utils.load_model: drops a tied lm_head
        base = model.sanitize(base)
    model.load_weights(list(base.items()), strict=True)
    return model


class MlxLmVariant(Variant):
    """mlx-lm's model for the workload's architecture + its LoRA layers + its trainer's
    compiled step."""

    name = "mlx-lm"

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 seed: int = 0, dtype: str = "float32"):
        a = w.llama
        mx.random.seed(seed)
        model = build_peer(a, weights)
        if dtype != "float32":
            model.set_dtype(getattr(mx, dtype))
        model.freeze()
        linear_to_lora_layers(model, a.n_layers, {"rank": w.lora_rank, "dropout": 0.0,
                                                  "scale": w.lora_alpha / w.lora_rank,
                                                  "keys": lora_keys(w.lora_targets)})
        # Same adapter values (mlx-lm stores the transposes), so step 0 is the same function.
        peer = PEERS[a.arch]
        model.load_weights([(to_mlx_lm(k, peer), mx.array(v.T)) for k, v in weights.items()
                            if ".lora_" in k], strict=False)
        model.train()
        optimizer = optim.Adam(learning_rate=w.lr)  # mlx-lm lora's default optimizer
        mx.eval(model.parameters())
        loss_value_and_grad = nn.value_and_grad(model, default_loss)
        state = [model.state, optimizer.state, mx.random.state]

        # mlx_lm.tuner.trainer.train's step, as it builds it (a closure there).
        @partial(mx.compile, inputs=state, outputs=state)
        def step(batch, prev_grad, do_update):
            (lvalue, toks), grad = loss_value_and_grad(model, *batch)
            if prev_grad is not None:
                grad = tree_map(lambda x, y: x + y, grad, prev_grad)
            if do_update:
                grad = average_gradients(grad)
                optimizer.update(model, grad)
                grad = None
            return lvalue, toks, grad

        self.model, self.optimizer, self.state, self.step_fn = model, optimizer, state, step
        self.tokens = np.concatenate([batch["inputs"][0], batch["targets"][0][:, -1:]],
                                     axis=1)  # (B, T+1)
        self.lengths = np.tile(np.array([[0, w.seq]], np.int32), (w.batch, 1))

    def step(self, s: int) -> float:
        batch = (mx.array(self.tokens), mx.array(self.lengths))
        loss, toks, grad = self.step_fn(batch, None, True)
        mx.eval(self.state, loss, toks, grad)
        return float(loss.item())

    def grad_norm(self) -> float:
        """The norm of the adapters' gradient of default_loss on the batch, at the current
        weights (outside the compiled step, which does not return it)."""
        (_, _), grad = nn.value_and_grad(self.model, default_loss)(
            self.model, mx.array(self.tokens), mx.array(self.lengths))
        return float(mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grad))).item())

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten([self.model.parameters(),
                                                      self.optimizer.state]))
