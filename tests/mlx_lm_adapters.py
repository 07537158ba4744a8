"""mlx-lm's own model and adapters, for the tests of toymlx's mlx-lm adapter import.

`hf_model(gguf)` is mlx-lm's Llama (`mlx_lm.models.llama`, Hugging Face's layout: RoPE on each
head's halves) holding a llama GGUF's weights, q/k rows put back in Hugging Face's order with
mlx-lm's own copy of llama.cpp's converter permutation (`mlx_lm.gguf.permute_weights`: the GGUF
row r is the HF row `permute_weights(arange)[r]`), so nothing of toymlx's is used to build it.
`add_adapter` wraps it with mlx-lm's LoRA or DoRA layers (`linear_to_lora_layers`) holding
random matrices; `save_adapter` writes them as `mlx_lm.lora` does (adapters.safetensors from
`trainable_parameters`, adapter_config.json through `save_config`); `load_with_adapter` is
mlx-lm's own `load_adapters` on a fresh model: the reference toymlx is compared against.
`model_folder` saves `hf_model` with the GGUF's tokenizer as the folder `mlx_lm lora --model`
reads, and `run_mlx_lm_lora` runs mlx-lm's own command to train an adapter on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm import lora as mlx_lm_lora
from mlx_lm.gguf import permute_weights
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from mlx_lm.utils import save_config, save_model

from toymlx.gguf.llama import args_from_gguf
from toymlx.gguf.reader import GGUFFile
from toymlx.models.llama import LlamaArgs

_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_order(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """A GGUF's q (or k: n_head_kv) rows in Hugging Face's order, by mlx-lm's permutation."""
    idx = np.asarray(permute_weights(np.arange(w.shape[0]), n_head, n_head_kv))
    out = np.empty_like(w)
    out[idx] = w
    return out


def hf_config(a: LlamaArgs) -> dict[str, Any]:
    """The config.json of mlx-lm's llama for a llama GGUF's shape, in Hugging Face's layout
    (RoPE on each head's halves: `rope_traditional` false), as `mlx_lm convert` saves it."""
    return {"model_type": "llama", "hidden_size": a.d_model, "num_hidden_layers": a.n_layers,
            "intermediate_size": a.ffn_dim, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads, "rms_norm_eps": a.norm_eps,
            "vocab_size": a.vocab_size, "rope_theta": a.rope_base, "rope_traditional": False,
            "tie_word_embeddings": a.tie_embeddings, "max_position_embeddings": a.context}


def hf_model(gguf: str | Path) -> Model:
    """mlx-lm's llama Model (HF layout) with the GGUF's float32 weights."""
    with GGUFFile(gguf) as g:
        a = args_from_gguf(g)
        model = Model(ModelArgs.from_dict(hf_config(a)))
        weights = {}
        for name in g.tensors:
            w = g.load(name, np.float32)
            if name == "token_embd.weight":
                key = "model.embed_tokens.weight"
            elif name == "output_norm.weight":
                key = "model.norm.weight"
            elif name == "output.weight":
                key = "lm_head.weight"
            else:
                _, i, leaf, kind = name.split(".")
                key = f"model.layers.{i}.{_NAMES[leaf]}.{kind}"
                if leaf == "attn_q":
                    w = hf_order(w, a.n_heads)
                elif leaf == "attn_k":
                    w = hf_order(w, a.n_heads, a.n_kv_heads)
            weights[key] = mx.array(w)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def lora_config(num_layers: int, rank: int, scale: float, keys: list[str] | None = None,
                kind: str = "lora") -> dict[str, Any]:
    """adapter_config.json as `mlx_lm.lora` writes it (its CONFIG_DEFAULTS, these set)."""
    params: dict[str, Any] = {"rank": rank, "dropout": 0.0, "scale": scale}
    if keys is not None:
        params["keys"] = keys
    return {**mlx_lm_lora.CONFIG_DEFAULTS, "fine_tune_type": kind, "num_layers": num_layers,
            "lora_parameters": params, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def add_adapter(model: Model, config: dict[str, Any], seed: int = 0) -> Model:
    """mlx-lm's LoRA (or DoRA) layers on `model` as `mlx_lm.lora` makes them, with random A, B
    (and DoRA's m moved off the base's row norms)."""
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"],
                          use_dora=config["fine_tune_type"] == "dora")
    rng = np.random.default_rng(seed)
    for _, m in sorted(model.named_modules(), key=lambda pm: pm[0]):
        if isinstance(m, (LoRALinear, DoRALinear)):
            n_in, r = m.lora_a.shape
            m.lora_a = mx.array(rng.uniform(-1, 1, (n_in, r)).astype(np.float32) / n_in ** 0.5)
            m.lora_b = mx.array(rng.normal(0, 0.2, m.lora_b.shape).astype(np.float32))
            if isinstance(m, DoRALinear):
                m.m = m.m * mx.array(1 + 0.2 * rng.normal(size=m.m.shape).astype(np.float32))
    mx.eval(model.parameters())
    return model


def save_adapter(model: nn.Module, folder: Path, config: dict[str, Any]) -> Path:
    """The folder `mlx_lm.lora` writes: adapters.safetensors and adapter_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))
    save_config(dict(config), folder / "adapter_config.json")
    return folder


def make_adapter(gguf: str | Path, folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """An mlx-lm adapter folder for `gguf`'s model (random matrices)."""
    return save_adapter(add_adapter(hf_model(gguf), config, seed), folder, config)


def load_with_adapter(gguf: str | Path, folder: Path) -> Model:
    """mlx-lm's model with the adapter folder loaded by mlx-lm's own `load_adapters`."""
    model = hf_model(gguf)
    model.freeze()
    return load_adapters(model, str(folder))


def logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    """(T, V) float32 logits of either model."""
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def model_folder(gguf: str | Path, out: Path) -> Path:
    """The folder `mlx_lm lora --model` reads, for a llama GGUF: `hf_model`'s float32 weights
    and config saved as `mlx_lm convert` saves them (`save_model`, `save_config`), and the
    GGUF's own tokenizer and chat template as transformers reads them from the GGUF
    (`AutoTokenizer.from_pretrained(..., gguf_file=...)`, then `save_pretrained`)."""
    from transformers import AutoTokenizer

    gguf = Path(gguf)
    with GGUFFile(gguf) as g:
        config = hf_config(args_from_gguf(g))
    save_model(out, hf_model(gguf))
    save_config(config, out / "config.json")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


MLX_LM_LORA = ("import sys, toymlx; from mlx_lm.lora import main; "
               "sys.argv = ['mlx_lm.lora', *sys.argv[1:]]; main()")
"""`mlx_lm lora` (its own `main`) in a child process, OpenBLAS loaded under MLX first by importing
toymlx: on Linux `python -m mlx_lm lora` alone runs MLX's reference BLAS (SmolLM2's run had not
reached its first report after 10 minutes; with OpenBLAS its 20 iterations took under 5)."""


def run_mlx_lm_lora(*argv: str, cwd: Path) -> str:
    """Run `mlx_lm lora ARGV` (as `MLX_LM_LORA`) in `cwd`; its output, colours off; RuntimeError
    with the output's tail when it fails."""
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb"}
    p = subprocess.run([sys.executable, "-c", MLX_LM_LORA, *argv], cwd=cwd, env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"mlx_lm lora {' '.join(argv)} failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout)[-2000:]}")
    return p.stdout
