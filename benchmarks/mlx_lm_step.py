"""The mlx-lm peer: mlx-lm's llama model, its LoRA layers and its trainer's compiled step.

The step is built as `mlx_lm.tuner.trainer.train` builds it (a closure there):
`value_and_grad(default_loss)` under `mx.compile` with the model, optimizer and random state
as state, grad_accum 1, and mlx-lm lora's default optimizer (Adam). In bfloat16 the model is
cast with `set_dtype` before the LoRA layers are added, as loading a bf16 checkpoint gives
(mlx-lm's adapters stay float32).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from rounds import Variant
from workloads import Workload


def to_mlx_lm(name: str) -> str:
    """mlx-lm's name for a toymlx Llama parameter."""
    k = (name.replace("embed.", "embed_tokens.").replace("attn_norm", "input_layernorm")
         .replace("ffn_norm", "post_attention_layernorm").replace(".attn.", ".self_attn."))
    return "lm_head.weight" if k == "output.weight" else "model." + k


class MlxLmVariant(Variant):
    """mlx-lm's llama + its LoRA layers + its trainer's compiled step."""

    name = "mlx-lm"

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 seed: int = 0, dtype: str = "float32"):
        a = w.llama
        mx.random.seed(seed)
        model = Model(ModelArgs(model_type="llama", hidden_size=a.d_model,
                                num_hidden_layers=a.n_layers, intermediate_size=a.ffn_dim,
                                num_attention_heads=a.n_heads, rms_norm_eps=a.norm_eps,
                                vocab_size=a.vocab_size, head_dim=a.head_dim,
                                num_key_value_heads=a.n_kv_heads, rope_theta=a.rope_base,
                                rope_traditional=True, tie_word_embeddings=a.tie_embeddings))
        model.load_weights([(to_mlx_lm(k.replace(".linear.weight", ".weight")), mx.array(v))
                            for k, v in weights.items() if ".lora_" not in k], strict=True)
        if dtype != "float32":
            model.set_dtype(getattr(mx, dtype))
        model.freeze()
        keys = [f"self_attn.{t}_proj" if t in "qkvo" else f"mlp.{t}_proj"
                for t in w.lora_targets]
        linear_to_lora_layers(model, a.n_layers, {"rank": w.lora_rank, "dropout": 0.0,
                                                  "scale": w.lora_alpha / w.lora_rank,
                                                  "keys": keys})
        # Same adapter values (mlx-lm stores the transposes), so step 0 is the same function.
        model.load_weights([(to_mlx_lm(k), mx.array(v.T)) for k, v in weights.items()
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

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten([self.model.parameters(),
                                                      self.optimizer.state]))
