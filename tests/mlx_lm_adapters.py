"""mlx-lm's own model and adapters, for the tests of toymlx's mlx-lm adapter import.

`hf_model(gguf)` is mlx-lm's Llama (`mlx_lm.models.llama`, Hugging Face's layout: RoPE on each
head's halves) holding a llama GGUF's weights, q/k rows put back in Hugging Face's order with
mlx-lm's own copy of llama.cpp's converter permutation (`mlx_lm.gguf.permute_weights`: the GGUF
row r is the HF row `permute_weights(arange)[r]`), so nothing of toymlx's is used to build it.
For a qwen35 GGUF it is mlx-lm's qwen3_5 (`qwen35_model`: the converter's value-head reorder,
A_log and conv1d undone here, by index), for a qwen3moe one its qwen3_moe (`qwen3moe_model`);
`qwen3moe_gguf` writes a tiny random qwen3moe file.
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
from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from mlx_lm.utils import save_config, save_model

from toymlx.gguf.llama import args_from_gguf
from toymlx.gguf.reader import GGUFFile
from toymlx.models.llama import LlamaArgs

_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
"""A GGUF's tensors outside the blocks -> mlx-lm's names (qwen3_5's under `language_model.`)."""


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


def hf_model(gguf: str | Path) -> nn.Module:
    """mlx-lm's Model (HF layout) with the GGUF's float32 weights: its llama, or its qwen3_5 or
    qwen3_moe for those files."""
    with GGUFFile(gguf) as g:
        a = args_from_gguf(g)
        if a.arch == "qwen35":
            return qwen35_model(g, a)
        if a.arch == "qwen3moe":
            return qwen3moe_model(g, a)
        if a.arch == "gemma4":
            return gemma4_model(g, a)

        def block(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
            _, i, leaf, kind = name.split(".")
            if leaf == "attn_q":
                w = hf_order(w, a.n_heads)
            elif leaf == "attn_k":
                w = hf_order(w, a.n_heads, a.n_kv_heads)
            return f"model.layers.{i}.{_NAMES[leaf]}.{kind}", w

        return _filled(Model(ModelArgs.from_dict(hf_config(a))), g, block)


def _filled(model: nn.Module, g: GGUFFile, block, prefix: str = "") -> nn.Module:
    """`model` holding the GGUF's float32 tensors: those outside the blocks under `_GLOBALS`'
    names, each block tensor as `block(name, w)` names and lays it out; `prefix` before each."""
    weights = {}
    for name in g.tensors:
        w = g.load(name, np.float32)
        key, w = (_GLOBALS[name], w) if name in _GLOBALS else block(name, w)
        weights[prefix + key] = mx.array(w)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def _tiled_to_grouped(n_k: int, n_v: int, width: int) -> np.ndarray:
    """Index `idx` with hf[i] = gguf[idx[i]] over n_v value heads of `width`: llama.cpp's
    converter put HF's value head g * r + j (grouped: k head g's j-th) at GGUF head j * n_k + g
    (tiled), r = n_v / n_k (`_LinearAttentionVReorderBase`)."""
    r = n_v // n_k
    idx = np.empty(n_v * width, dtype=np.int64)
    for g in range(n_k):
        for j in range(r):
            hf, gg = g * r + j, j * n_k + g
            idx[hf * width:(hf + 1) * width] = np.arange(gg * width, (gg + 1) * width)
    return idx


def qwen35_model(g: GGUFFile, a: LlamaArgs) -> nn.Module:
    """mlx-lm's qwen3_5 Model with a qwen35 GGUF's float32 weights, as mlx-lm's sanitize leaves
    a Hugging Face checkpoint's (norms with their 1 already added, as the converter adds it):
    value heads put back in HF's grouped order, A_log = log(-ssm_a), conv1d (C, K, 1)."""
    from mlx_lm.models import qwen3_5

    hd = a.head_dim
    config = {"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": a.d_model, "num_hidden_layers": a.n_layers,
        "intermediate_size": a.ffn_dim, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": hd, "rms_norm_eps": a.norm_eps,
        "vocab_size": a.vocab_size, "linear_num_value_heads": a.ssm_v_heads,
        "linear_num_key_heads": a.ssm_k_heads, "linear_key_head_dim": a.ssm_head_dim,
        "linear_value_head_dim": a.ssm_head_dim, "linear_conv_kernel_dim": a.ssm_conv_kernel,
        "full_attention_interval": 4, "tie_word_embeddings": a.tie_embeddings,
        "max_position_embeddings": a.context,
        "rope_parameters": {"type": "default", "rope_theta": a.rope_base,
                            "partial_rotary_factor": (a.rope_dims or hd) / hd}}}
    assert list(a.linear_layers) == [(i + 1) % 4 != 0 for i in range(a.n_layers)]
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    nk, nv, dk = a.ssm_k_heads, a.ssm_v_heads, a.ssm_head_dim
    v_rows = _tiled_to_grouped(nk, nv, dk)
    one = _tiled_to_grouped(nk, nv, 1)
    qkv = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + v_rows])
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
             "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
             "ssm_out": "linear_attn.out_proj", "ssm_norm": "linear_attn.norm",
             "ssm_conv1d": "linear_attn.conv1d", "ssm_dt": "linear_attn.dt_bias",
             "ssm_a": "linear_attn.A_log"}

    def block(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        parts = name.split(".")
        i, leaf = parts[1], parts[2]
        key = f"model.layers.{i}.{names[leaf]}"
        key += "" if leaf in ("ssm_a", "ssm_dt") else f".{parts[-1]}"
        if leaf == "attn_qkv":
            w = w[qkv]
        elif leaf == "attn_gate":
            w = w[v_rows]
        elif leaf in ("ssm_beta", "ssm_alpha", "ssm_dt"):
            w = w[one]
        elif leaf == "ssm_a":
            w = np.log(-w[one])
        elif leaf == "ssm_out":
            w = w[:, v_rows]
        elif leaf == "ssm_conv1d":
            w = w[qkv][:, :, None]  # (C, K) -> mlx-lm's Conv1d (C, K, 1)
        return key, w

    return _filled(model, g, block, "language_model.")


def qwen3moe_model(g: GGUFFile, a: LlamaArgs) -> nn.Module:
    """mlx-lm's qwen3_moe Model with a qwen3moe GGUF's float32 weights (NEOX RoPE: q and k rows
    as HF's; the experts' 3-D tensors as mlx-lm's SwitchGLU holds them, (E, out, in))."""
    from mlx_lm.models import qwen3_moe

    config = {"model_type": "qwen3_moe", "hidden_size": a.d_model, "num_hidden_layers": a.n_layers,
              "intermediate_size": a.ffn_dim, "num_attention_heads": a.n_heads,
              "num_experts": a.n_experts, "num_experts_per_tok": a.n_experts_used,
              "decoder_sparse_step": 1, "mlp_only_layers": [],
              "moe_intermediate_size": a.expert_width, "rms_norm_eps": a.norm_eps,
              "vocab_size": a.vocab_size, "num_key_value_heads": a.n_kv_heads,
              "head_dim": a.head_dim, "rope_theta": a.rope_base,
              "tie_word_embeddings": a.tie_embeddings, "max_position_embeddings": a.context,
              "norm_topk_prob": True}
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    names = {**_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
             "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj"}

    def block(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        _, i, leaf, kind = name.split(".")
        return f"model.layers.{i}.{names[leaf]}.{kind}", w

    return _filled(model, g, block)


def gemma4_model(g: GGUFFile, a: LlamaArgs) -> nn.Module:
    """mlx-lm's gemma4 Model (its text model under `language_model.`, as mlx-lm loads a Gemma 4
    checkpoint) with a gemma4 GGUF's float32 weights: sliding blocks every other one from the
    first as `arch_files.gemma4_args` has them, proportional RoPE on a quarter of the full
    blocks' heads (the file's rope_freqs), per-layer embeddings, the shared-KV tail."""
    from mlx_lm.models import gemma4

    text = {"hidden_size": a.d_model, "num_hidden_layers": a.n_layers,
            "intermediate_size": a.ffn_dim, "num_attention_heads": a.n_heads,
            "head_dim": a.key_length_sliding, "global_head_dim": a.head_dim,
            "num_key_value_heads": a.n_kv_heads, "rms_norm_eps": a.norm_eps,
            "vocab_size_per_layer_input": a.vocab_size,
            "num_kv_shared_layers": a.shared_kv_layers,
            "hidden_size_per_layer_input": a.per_layer_dim, "sliding_window": a.sliding_window,
            "final_logit_softcapping": a.final_softcap, "use_double_wide_mlp": True,
            "layer_types": ["sliding_attention" if a.is_sliding(i) else "full_attention"
                            for i in range(a.n_layers)],
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": a.rope_base,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0,
                                      "rope_theta": a.rope_base_sliding,
                                      "rope_type": "default"}}}
    model = gemma4.Model(gemma4.ModelArgs(model_type="gemma4", vocab_size=a.vocab_size,
                                          text_config=text))
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
             "post_norm": "post_per_layer_input_norm", "layer_output_scale": "layer_scalar"}
    glob = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
            "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
            "per_layer_model_proj.weight": "per_layer_model_projection.weight",
            "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}
    weights = {}
    for name in g.tensors:
        if name == "rope_freqs.weight":
            continue
        w = g.load(name, np.float32)
        if name in glob:
            key = glob[name]
        else:
            _, i, leaf, kind = name.split(".")
            key = f"layers.{i}.{names[leaf]}" + ("" if leaf == "layer_output_scale"
                                                 else f".{kind}")
        weights["language_model.model." + key] = mx.array(w)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def qwen3moe_gguf(path: str | Path, seed: int = 0) -> Path:
    """A random-weight qwen3moe GGUF (2 blocks of 4 experts, 2 per token, 32 wide; q/k norms)
    over the byte vocabulary, written by toymlx; its routers drawn wide (std 1), so that no token
    sits near a tie between its 2nd and 3rd experts."""
    from dataclasses import replace

    from mlx.utils import tree_unflatten

    from toymlx.data.vocab import byte_metadata
    from toymlx.gguf.llama import ARCHS, write_llama
    from toymlx.models.llama import Llama

    args = replace(LlamaArgs(), arch="qwen3moe", **ARCHS["qwen3moe"].switches, vocab_size=300,
                   d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, context=256,
                   n_experts=4, n_experts_used=2, expert_ffn_dim=32)
    mx.random.seed(seed)
    model = Llama(args)
    rng = np.random.default_rng(seed)

    def drawn(name: str, w: mx.array) -> mx.array:
        std = 1.0 if name.endswith("router.weight") else 0.08
        if name.endswith("norm.weight"):
            return w + mx.array(0.2 * rng.standard_normal(w.shape).astype(np.float32))
        return mx.array(std * rng.standard_normal(w.shape).astype(np.float32))

    model.update(tree_unflatten([(k, drawn(k, v)) for k, v in tree_flatten(model.parameters())]))
    write_llama(path, model, byte_metadata())
    return Path(path)


def mlx_lm_folder(hf_dir: str | Path, out: Path) -> nn.Module:
    """mlx-lm's own model loaded from a copy of transformers' checkpoint folder (tests/hf_tiny.py),
    its config.json in the names mlx-lm 0.32 reads: a Qwen3_5ForCausalLM's `qwen3_5_text` as
    `qwen3_5` (the model type of Qwen3.5's own checkpoints), and newer transformers'
    `num_local_experts` and `rope_parameters.rope_theta` as qwen3_moe's `num_experts` and
    `rope_theta`. Nothing of toymlx's converts its weights: mlx-lm's `sanitize` does."""
    import json
    import shutil

    from mlx_lm.utils import load_model

    shutil.copytree(hf_dir, out)
    config = json.loads((out / "config.json").read_text())
    if config["model_type"] == "qwen3_5_text":
        config["model_type"] = "qwen3_5"
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    if "rope_theta" not in config and "rope_parameters" in config:
        config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(config))
    model, _ = load_model(out)
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
    (each expert's too, and DoRA's m moved off the base's row norms)."""
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"],
                          use_dora=config["fine_tune_type"] == "dora")
    rng = np.random.default_rng(seed)
    for _, m in sorted(model.named_modules(), key=lambda pm: pm[0]):
        if isinstance(m, LoRASwitchLinear):  # a mixture of experts': A (E, r, in), B (E, out, r)
            e, r, n_in = m.lora_a.shape
            m.lora_a = mx.array(rng.uniform(-1, 1, (e, r, n_in)).astype(np.float32) / n_in ** 0.5)
            m.lora_b = mx.array(rng.normal(0, 0.2, m.lora_b.shape).astype(np.float32))
        elif isinstance(m, (LoRALinear, DoRALinear)):
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
