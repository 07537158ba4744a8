"""mlx-lm's LoRA and DoRA adapters (the folder `mlx_lm.lora` writes: adapters.safetensors and
adapter_config.json) read for a GGUF base, in toymlx's adapter layout.

mlx-lm's LoRALinear computes y = W x + scale (x A) B with A `lora_a` (n_in, r) and B `lora_b`
(r, n_out), keyed by Hugging Face module paths (`model.layers.N.self_attn.q_proj.lora_a`; the
paths are `toymlx.models.lora.MLX_LM_KEYS`', the ones each block has `mlx_lm_modules`'); its
`scale` is adapter_config.json's `lora_parameters.scale`, its blocks the last `num_layers`. Its
DoRALinear adds `m` (n_out,) and computes what toymlx's `DoRALinear` computes. As toymlx's
(and llama.cpp's) adapter that is A^T (r, n_in) and B^T (n_out, r) under the base tensor's
llama.cpp name, with alpha = scale * r (their scale is alpha / r). Its LoRASwitchLinear (a
mixture of experts' `switch_mlp`) holds A (E, r, n_in) and B (E, n_out, r), toymlx's
`ExpertLoRA` layout already. mlx-lm trains on Hugging Face's layout: llama's q and k rows (B's
rows, m) are permuted as llama.cpp's converter permuted the base's
(`toymlx.gguf.llama.hf_rows_to_gguf`), qwen35's value heads reordered as it reordered them
(`hf_v_heads_to_gguf`: B's rows, m, or ssm_out's A columns).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from toymlx.gguf.llama import (
    expected_shapes,
    hf_permuted_heads,
    hf_rows_to_gguf,
    hf_v_heads,
    hf_v_heads_to_gguf,
    toy_to_gguf,
)
from toymlx.models.llama import LlamaArgs
from toymlx.models.lora import MLX_LM_KEYS, block_targets, mlx_lm_modules, target_path

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
_KEY = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.([\w.]+)\.(lora_a|lora_b|m)")


class MlxLmError(ValueError):
    """An mlx-lm adapter toymlx cannot use; the message is one line naming file and key."""


@dataclass(frozen=True)
class MlxLmAdapter:
    """An mlx-lm adapter in toymlx's layout: base tensor name -> (A (r, n_in), B (n_out, r))."""

    path: Path
    """its adapters.safetensors"""
    kind: str
    """lora or dora (adapter_config.json's fine_tune_type)"""
    alpha: float
    """scale * rank: toymlx's scale alpha / rank is mlx-lm's scale"""
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    magnitudes: dict[str, np.ndarray] | None
    """DoRA: base tensor name -> m (n_out,)"""
    flags: str = ""
    """the toymlx options that adapt what it adapts (`--lora.targets q,v --lora.layers 2`),
    where it adapts the same projections of the last blocks; else ''"""


def mlx_lm_files(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """(adapters.safetensors, adapter_config.json beside it) when `path` is mlx-lm's adapter
    folder (either file in it: a folder holding only checkpoints is refused by the reader,
    naming them) or a .safetensors file (mlx-lm's checkpoints are
    `0000100_adapters.safetensors`); None for anything else (an adapter GGUF, a run folder;
    a path with nothing at it, which the caller's resolver names as not found, not as a file
    missing beside it)."""
    p = Path(path)
    if p.is_dir() and ((p / ADAPTER_FILE).is_file() or (p / CONFIG_FILE).is_file()):
        return p / ADAPTER_FILE, p / CONFIG_FILE
    if p.suffix == ".safetensors" and p.is_file():
        return p, p.parent / CONFIG_FILE
    return None


def _no_weights(weights: Path) -> MlxLmError:
    """The error for mlx-lm's folder without its adapters.safetensors: its checkpoints named
    (`mlx_lm.lora` writes NNNNNNN_adapters.safetensors beside it), or Hugging Face's PEFT file."""
    folder = weights.parent
    saved = sorted(x.name for x in folder.glob("*_adapters.safetensors"))
    if saved:
        fix = (f"found only its checkpoints ({', '.join(saved[-3:])}); pass one as the "
               f"adapter: {folder / saved[-1]}")
    elif (folder / "adapter_model.safetensors").is_file():
        fix = ("found adapter_model.safetensors: Hugging Face PEFT's adapter, not mlx-lm's; "
               "convert it with llama.cpp's convert_lora_to_gguf.py")
    else:
        fix = "found none; copy it from the adapter's folder"
    return MlxLmError(f"{folder}: expected mlx-lm's {ADAPTER_FILE} beside {CONFIG_FILE}, {fix}")


def lora_flags(found: set[tuple[int, str]], n_layers: int, have: tuple[str, ...]) -> str:
    """The --lora options that adapt exactly the (block, target) pairs `found`: the same
    targets in each of the last blocks; '' where no options do."""
    blocks = sorted({b for b, _ in found})
    targets = [t for t in have if any(f == t for _, f in found)]
    if blocks != list(range(n_layers - len(blocks), n_layers)) or len(found) != len(
            blocks) * len(targets):
        return ""
    return f"--lora.targets {','.join(targets)} --lora.layers {len(blocks)}"


def _config(path: Path, weights: Path) -> tuple[str, int, float, int, str]:
    """(fine_tune_type, rank, scale, num_layers, model) from adapter_config.json, each
    checked (model: the Hugging Face model it was trained on, as given; '' when absent)."""
    if not path.is_file():
        raise MlxLmError(f"{path}: expected mlx-lm's adapter config beside {weights.name} "
                        "(mlx_lm.lora writes both; it gives lora_parameters.scale and rank), "
                        "found no file; copy it from the adapter's folder")
    try:
        conf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise MlxLmError(f"{path}: expected JSON (mlx-lm's adapter config), found a file that "
                        f"does not parse ({e})") from None
    if not isinstance(conf, dict):
        raise MlxLmError(f"{path}: expected a JSON mapping, found {type(conf).__name__}")
    kind = conf.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise MlxLmError(f"{path}: key 'fine_tune_type': expected 'lora' or 'dora' (an adapter), "
                        f"found {kind!r}" + (" (a full fine-tune's weights, not an adapter)"
                                             if kind == "full" else ""))
    params = conf.get("lora_parameters")
    if not isinstance(params, dict):
        raise MlxLmError(f"{path}: key 'lora_parameters': expected a mapping with rank and scale, "
                        f"found {json.dumps(params)}")
    rank, scale = params.get("rank"), params.get("scale")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise MlxLmError(f"{path}: key 'lora_parameters.rank': expected an integer >= 1, found "
                        f"{json.dumps(rank)}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise MlxLmError(f"{path}: key 'lora_parameters.scale': expected a number > 0 (mlx-lm's "
                        f"scale, toymlx's alpha / rank), found {json.dumps(scale)}")
    layers = conf.get("num_layers", 16)
    if not (isinstance(layers, int) and not isinstance(layers, bool)):
        raise MlxLmError(f"{path}: key 'num_layers': expected an integer, found "
                        f"{json.dumps(layers)}")
    return kind, rank, float(scale), layers, str(conf.get("model") or "")


def read_mlx_lm_adapter(path: str | os.PathLike, a: LlamaArgs) -> MlxLmAdapter:
    """mlx-lm's adapter (its folder or adapters.safetensors, adapter_config.json beside it) in
    toymlx's layout for a base of shape `a`; MlxLmError, one line naming the file and the key,
    for a key toymlx cannot place or a shape that does not fit the base."""
    files = mlx_lm_files(path)
    if files is None:
        raise MlxLmError(f"{path}: expected mlx-lm's adapter folder or its {ADAPTER_FILE}, found "
                        "neither")
    weights, config = files
    if not weights.is_file() and weights.name == ADAPTER_FILE and config.is_file():
        raise _no_weights(weights)
    kind, rank, scale, num_layers, trained_on = _config(config, weights)
    try:
        raw = mx.load(str(weights), format="safetensors")
    except (ValueError, RuntimeError, OSError) as e:
        raise MlxLmError(f"{weights}: expected a safetensors file (mlx-lm's adapters), found one "
                        f"that does not read ({e})") from None
    first = max(a.n_layers - num_layers, 0) if num_layers > 0 else 0  # layers[-num_layers:]
    have, shapes = block_targets(a), expected_shapes(a)
    halves: dict[str, dict[str, np.ndarray]] = {}
    module_of: dict[str, str] = {}  # base tensor name -> the key's module path, for messages
    found: set[tuple[int, str]] = set()  # (block, target) adapted
    early: MlxLmError | None = None  # a block before the last num_layers
    for key in sorted(raw):
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in MLX_LM_KEYS:
            every = dict.fromkeys(x for i in range(a.n_layers)
                                  for x, t in mlx_lm_modules(a, i).items() if t is not None)
            raise MlxLmError(f"{weights}: key {key!r}: expected model.layers.N.<module>.lora_a, "
                            f".lora_b (or DoRA's .m) with <module> a projection of this "
                            f"{a.arch} base's blocks ({', '.join(every)}), found another key")
        block, module, leaf = int(m.group(1)), m.group(2), m.group(3)
        if block >= a.n_layers:
            raise MlxLmError(f"{weights}: key {key!r}: expected a block of the base's "
                             f"{a.n_layers} (0..{a.n_layers - 1}), found block {block} (wrong "
                             "base?)")
        modules = mlx_lm_modules(a, block)
        can = [x for x, t in modules.items() if t is not None]
        if modules.get(module, "") is None:
            raise MlxLmError(f"{weights}: key {key!r}: expected a projection toymlx can adapt "
                             f"(block {block} of this {a.arch} base: {', '.join(can)}), found "
                             f"{module}, the shared expert's, which no --lora.targets adapts")
        if module not in modules:
            raise MlxLmError(f"{weights}: key {key!r}: expected a projection block {block} of "
                             f"this {a.arch} base has ({', '.join(can) or 'none'}), found "
                             f"{module} (wrong base?)")
        target = modules[module]
        name = toy_to_gguf(f"layers.{block}.{target_path(target, a)}.weight")
        *lead, n_out, n_in = shapes[name]  # lead: an expert tensor's (E,)
        lead = tuple(lead)
        want = ({"lora_a": (*lead, rank, n_in), "lora_b": (*lead, n_out, rank), "m": (n_out,)}
                if lead else
                {"lora_a": (n_in, rank), "lora_b": (rank, n_out), "m": (n_out,)})[leaf]
        arr = np.array(raw[key].astype(mx.float32))
        # the model's axes, not rank's (mlx-lm's LoRASwitchLinear: A (E, r, in), B (E, out, r))
        dims = ({"lora_a": (0, 2), "lora_b": (0, 1), "m": (0,)} if lead else
                {"lora_a": (0,), "lora_b": (1,), "m": (0,)})[leaf]
        if arr.ndim == len(want) and any(arr.shape[i] != want[i] for i in dims):
            raise MlxLmError(f"{weights}: key {key!r}: expected shape {want} (the base's {name} "
                            f"({n_out}, {n_in})), found {arr.shape}: an adapter for another "
                            f"model ({config.name}'s model: {trained_on or 'not given'}); give "
                            "--base that model's GGUF")
        if block < first and early is None:  # said after every key's shape is checked
            early = MlxLmError(f"{weights}: key {key!r}: expected blocks {first}.."
                               f"{a.n_layers - 1} (num_layers {num_layers} in {config.name}: the "
                               f"last {num_layers}), found block {block}")
        if leaf == "m" and kind != "dora":
            raise MlxLmError(f"{weights}: key {key!r}: expected lora_a and lora_b only "
                            f"(fine_tune_type {kind!r} in {config.name}), found DoRA's magnitude")
        if arr.shape != want:
            raise MlxLmError(f"{weights}: key {key!r}: expected shape {want} (the base's "
                            f"{name} ({n_out}, {n_in}), lora_parameters.rank {rank} in "
                            f"{config.name}), found {arr.shape}")
        halves.setdefault(name, {})[leaf] = arr
        module_of[name] = key.rpartition(".")[0]
        found.add((block, target))
    if early is not None:
        raise early
    pairs, magnitudes = {}, {}
    need = ("lora_a", "lora_b", "m") if kind == "dora" else ("lora_a", "lora_b")
    for name, h in halves.items():
        lost = next((x for x in need if x not in h), None)
        if lost is not None:
            raise MlxLmError(f"{weights}: key '{module_of[name]}.{lost}': expected "
                            f"present (with {', '.join(sorted(h))}), found missing")
        # (r, n_in) and (n_out, r); LoRASwitchLinear's (E, r, n_in), (E, n_out, r) as they are
        lora_a, b = ((h["lora_a"], h["lora_b"]) if h["lora_a"].ndim == 3
                     else (h["lora_a"].T, h["lora_b"].T))
        heads = hf_permuted_heads(a, name)
        if heads is not None:  # mlx-lm's rows are HF's; the base's were permuted
            b = hf_rows_to_gguf(b, heads)
            if "m" in h:
                h["m"] = hf_rows_to_gguf(h["m"], heads)
        if (v := hf_v_heads(a, name)) is not None:  # qwen35's value heads, grouped -> tiled
            axis, start = v
            order = (a.ssm_k_heads, a.ssm_v_heads)
            if axis == 1:  # ssm_out's input columns: A's
                lora_a = hf_v_heads_to_gguf(lora_a, 1, start, *order)
            else:
                b = hf_v_heads_to_gguf(b, 0, start, *order)
                if "m" in h:
                    h["m"] = hf_v_heads_to_gguf(h["m"], 0, start, *order)
        pairs[name] = (np.ascontiguousarray(lora_a), np.ascontiguousarray(b))
        if kind == "dora":
            magnitudes[name] = h["m"]
    if not pairs:
        raise MlxLmError(f"{weights}: keys: expected lora_a/lora_b pairs, found none")
    return MlxLmAdapter(weights, kind, scale * rank, pairs, magnitudes if kind == "dora" else None,
                        lora_flags(found, a.n_layers, have))

