"""llama.cpp's LoRA adapter GGUF, and toymlx's DoRA variant of it: written from a model's
adapter layers (`write_adapter`), read and checked (`load_adapter`), applied to a base
(`apply_adapter`) or loaded into a model's adapter layers (`load_adapter_weights`).

Adapter GGUF (what llama.cpp's `llama_adapter_lora_init` checks): `general.type = "adapter"`,
`general.architecture` = the base's, `adapter.type = "lora"`, `adapter.lora.alpha` (float32;
0 means scale 1), and per adapted weight `<base tensor>.lora_a` (r, n_in) and `.lora_b`
(n_out, r), F32.

llama.cpp has no DoRA adapter format, so a DoRA adapter is a toymlx adapter GGUF: the same
layout with `adapter.type = "dora"` (which llama.cpp refuses rather than misreads) and
`<base>.dora_m` (n_out,) per pair; toymlx reads it (`load_adapter`, `apply_adapter`) and
`toymlx.interop.merge.write_merged` fuses it into a plain GGUF that llama.cpp runs.

mlx-lm's adapters (its folder, or its adapters.safetensors with adapter_config.json beside it)
are read too, for a given base (`load_adapter(path, base)`: `toymlx.training.mlx_lm_adapter`),
and written as an adapter GGUF for llama.cpp (`write_adapter_for`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from toymlx.backend.files import counted
from toymlx.bundle.checkpoint import as_stored, checkpoint_file
from toymlx.bundle.folder import saved_config
from toymlx.gguf.llama import gguf_to_toy, load_llama, toy_to_gguf
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import encode_tensor, write_gguf
from toymlx.models.layers import BlockLinear, replace_submodule, submodule
from toymlx.models.llama import Llama, LlamaArgs
from toymlx.models.lora import (
    ADAPTER_KINDS,
    TARGET_OF,
    ExpertLoRA,
    LoRALinear,
    base_dims,
    block_targets,
    lora_layers,
)
from toymlx.models.moe import BlockExperts, ExpertLinear
from toymlx.training.mlx_lm_adapter import lora_flags, mlx_lm_files, read_mlx_lm_adapter


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
    kinds, blocks = [], []
    for p, m in layers.items():
        name = toy_to_gguf(p + ".weight")
        # (r, in) and (out, r); an expert tensor's (E, r, in) and (E, out, r)
        tensors[name + ".lora_a"] = np.asarray(m.lora_a.astype(mx.float32))
        tensors[name + ".lora_b"] = np.asarray(m.lora_b.astype(mx.float32))
        if kind == "dora":
            tensors[name + ".dora_m"] = np.asarray(m.m.astype(mx.float32))  # (out,)
        _, i, rest = p.split(".", 2)
        kinds.append(TARGET_OF.get(rest, rest))
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


def shape_text(*dims: Any) -> str:
    """A shape as an error message writes it, its names unquoted: (r, 64), (8, 64, r)."""
    return "(" + ", ".join(str(d) for d in dims) + ")"


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
        r = a.shape[-2]  # an expert tensor's pairs are (E, r, in) and (E, out, r)
        d = LoRALinear.scale_of(r, self.alpha or r) * (b.astype(np.float64) @ a)
        if self.kind != "dora":
            return d
        v = w.astype(np.float64) + d
        return self.magnitudes[name][:, None] / np.linalg.norm(v, axis=1)[:, None] * v - w


INIT_ADAPTER = "--lora.init-adapter"
"""The one flag whose error for a model GGUF where an adapter belongs is `_a_model`'s (export's
and generate's --adapter keep their own hint)."""


def _a_model(given: str | os.PathLike, path: Path, meta: dict[str, Any], flag: str) -> str:
    """The error for a model GGUF at `path` (no lora tensors) given as `flag`'s adapter
    (`given`: the file, or the run folder whose checkpoint it is): what it is, what to pass."""
    takes = ("an adapter GGUF (a lora run's adapter_step_N.gguf, or llama.cpp's) or a lora "
             "run's folder")
    arch = meta.get("general.architecture")
    kind = meta.get("general.type")
    what = (f"a{'n' if str(arch)[:1] in 'aeiou' else ''} {arch} model, not an adapter "
            f"(general.type {'unset' if kind is None else repr(kind)}, no lora_a/lora_b tensors)")
    model = "it"
    if Path(given).is_dir():
        recipe = (saved_config(given) or {}).get("recipe")
        what = (f"{'a ' + recipe if isinstance(recipe, str) else 'a'} run whose checkpoint "
                f"{path.relative_to(given) if path.is_relative_to(given) else path} is {what}")
        model = str(path)
    if flag != INIT_ADAPTER:  # toymlx-export's or toymlx-generate's adapter to merge or apply
        instead = (f"a whole model has nothing to merge: give {given} as one (toymlx-export "
                   f"--base {given} --out FILE.gguf, toymlx-generate --model {given})")
    elif arch == "vit":
        instead = "an image classifier cannot be adapted by the lora recipe"
    else:
        instead = f"pass {model} as --base to fine-tune it"
    return f"{given}: {flag}: expected {takes}, found {what}; {instead}"


def load_adapter(path: str | os.PathLike, base: LlamaArgs | None = None,
                 flag: str = "--adapter") -> Adapter:
    """Read and check a llama.cpp LoRA adapter GGUF (a file or a run folder: its latest; a
    one-line GGUFError naming `flag` when it is not one), or mlx-lm's adapter folder for a
    base of shape `base` (which says how llama's q/k rows are ordered in the GGUF)."""
    if mlx_lm_files(path) is not None:
        if base is None:
            raise ValueError(f"{path}: {flag}: expected an adapter GGUF here, found mlx-lm's "
                             f"adapters; convert them for their base: toymlx-export --adapter "
                             f"{path} --base BASE.gguf --out adapter.gguf")
        m = read_mlx_lm_adapter(path, base)
        meta = {"general.type": "adapter", "general.architecture": base.arch,
                "adapter.type": m.kind, "adapter.lora.alpha": m.alpha,
                "toy.mlx_lm_adapter": str(m.path), "toy.mlx_lm_flags": m.flags}
        return Adapter(str(m.path), base.arch, m.alpha, m.pairs, meta, m.kind, m.magnitudes)
    given, path = path, checkpoint_file(path, flag)
    g = GGUFFile(path)
    meta = g.metadata
    kind = meta.get("general.type")
    if kind in (None, "model") and isinstance(
            meta.get("general.architecture"), str) and g.tensors and not any(
            n.endswith((".lora_a", ".lora_b")) for n in g.tensors):  # a model: what to pass
        raise GGUFError(_a_model(given, path, meta, flag))
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
        if kind == "dora" and arr.ndim != 2:  # DoRA's magnitudes are per row of a 2-D weight
            raise GGUFError(f"{path}: tensor {name!r}: expected 2 dimensions (a DoRA adapter "
                            f"adapts no expert tensor; --fine-tune-type lora does), found shape "
                            f"{arr.shape}")
        if arr.ndim not in (2, 3):
            raise GGUFError(f"{path}: tensor {name!r}: expected 2 dimensions (3 for an "
                            f"expert tensor's), found shape {arr.shape}")
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
        if a.shape[-2] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
            raise GGUFError(f"{path}: tensor '{base}.lora_b' shape: expected "
                            f"{shape_text(*a.shape[:-2], 'n_out', a.shape[-2])} to match "
                            f"lora_a's rank, found {b.shape}")
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
        experts = isinstance(module, (ExpertLinear, BlockExperts))
        linear = isinstance(module, (nn.Linear, nn.QuantizedLinear, BlockLinear))
        if not (linear or experts) or key == "embed.weight":
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected a projection weight "
                            f"of the base (blk.N.attn_q/k/v/qkv/output, ffn_gate/up/down, "
                            f"ffn_gate_inp, ffn_*_exps, inp_gate, proj), found no such weight in "
                            f"a {len(model.layers)}-block base")
        n_out, n_in = base_dims(module)
        lead = (module.n_experts,) if experts else ()
        if a.shape[:-2] != lead or a.shape[-1] != n_in or b.shape[-2] != n_out:
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a'/'.lora_b' shapes: expected "
                            f"{shape_text(*lead, 'r', n_in)} and "
                            f"{shape_text(*lead, n_out, 'r')} to fit the base's {name} "
                            f"{shape_text(*lead, n_out, n_in)}, found {a.shape} and {b.shape} "
                            "(wrong base?)")
        out[name] = (key[: -len(".weight")], a, b)
    return out


def check_arch(ad: Adapter, arch: str) -> None:
    """GGUFError unless the adapter was trained for a base of architecture `arch`."""
    if ad.arch != arch:
        raise GGUFError(f"{ad.path}: metadata key 'general.architecture': expected {arch!r} "
                        f"(the base model's), found {ad.arch!r}")


def apply_adapter(model: Llama, path_or_run_dir: str | os.PathLike) -> Llama:
    """Wrap `model`'s projections with the adapter's LoRA layers (a file or a run directory);
    the adapter's architecture must be the model's; mlx-lm's adapter folder too."""
    ad = load_adapter(path_or_run_dir, model.args)
    check_arch(ad, model.args.arch)
    for name, (path, a, b) in _adapter_targets(model, ad).items():
        base = submodule(model, path)
        if isinstance(base, LoRALinear):
            raise TypeError(f"{path}: expected a plain projection, found one already "
                            "wrapped in LoRA (apply one adapter per model)")
        rank = a.shape[-2]
        # llama.cpp: alpha 0 (or absent) means scale 1, i.e. alpha = r.
        layer = ExpertLoRA if a.ndim == 3 else ADAPTER_KINDS[ad.kind]
        m = layer.from_base(base, rank, ad.alpha or float(rank))
        m.lora_a, m.lora_b = mx.array(a), mx.array(b)
        if ad.magnitudes is not None:
            m.m = mx.array(ad.magnitudes[name])
        replace_submodule(model, path, m)
    mx.eval(model.parameters())
    return model


def _adapted_flags(names, a: LlamaArgs) -> str:
    """The --lora options that adapt exactly the GGUF tensors `names` of a model with args `a`
    (`lora_flags`); '' where no options do."""
    found = set()
    for name in names:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", gguf_to_toy(name, a.fused_gate_up) or "")
        if m is None or m.group(2) not in TARGET_OF:
            return ""
        found.add((int(m.group(1)), TARGET_OF[m.group(2)]))
    return lora_flags(found, a.n_layers, block_targets(a))


def _size_options(ad: Adapter, m: nn.Module | None, mlx_lm: bool) -> tuple[list[str], str]:
    """(the --lora.rank and --lora.alpha options that differ from the run's LoRA layer `m` and
    match the adapter, where one rank is all of its tensors'; for mlx-lm's adapters, how its
    scale gives that alpha), so one line names every option a start from it needs."""
    ranks = {a.shape[-2] for a, _ in ad.pairs.values()}
    if m is None or len(ranks) != 1:
        return [], ""
    r = ranks.pop()
    alpha = ad.alpha or float(r)  # llama.cpp: alpha 0 (or absent) means scale 1
    size = ([f"--lora.rank {r}"] if r != m.rank else []) + (
        [f"--lora.alpha {alpha:g}"] if as_stored(alpha) != as_stored(m.alpha) else [])
    fix = (f" (mlx-lm's lora_parameters rank {r} and scale {alpha / r:g}: --lora.alpha is "
           "scale x rank)" if mlx_lm and size else "")
    return size, fix


def load_adapter_weights(model: nn.Module, path: str | os.PathLike,
                         flag: str = "--adapter") -> None:
    """Copy an adapter file's A and B (and DoRA's m) into the model's existing LoRA layers:
    resume, or a new run started from an adapter (`--lora.init-adapter`).

    The file (or mlx-lm's adapter folder) must hold exactly the model's LoRA layers, of the
    same kind, ranks and alpha.
    """
    ad = load_adapter(path, model.args, flag)
    check_arch(ad, model.args.arch)
    have = {toy_to_gguf(p + ".weight"): m for p, m in lora_layers(model).items()}
    kind = next((k for k, c in ADAPTER_KINDS.items()
                 if any(type(m) is c for m in have.values())), "lora")
    mlx_lm = "toy.mlx_lm_adapter" in ad.metadata
    if ad.kind != kind:
        where = (f"{Path(ad.path).parent / 'adapter_config.json'}: key 'fine_tune_type'"
                 if mlx_lm else f"{ad.path}: metadata key 'adapter.type'")
        raise GGUFError(f"{where}: expected {kind!r} (this run's --fine-tune-type), found "
                        f"{ad.kind!r}; pass --fine-tune-type {ad.kind} to start from it")
    size, fix = _size_options(ad, next(iter(have.values()), None), mlx_lm)
    if set(have) != set(ad.pairs):
        extra = sorted(set(ad.pairs) - set(have))
        missing = sorted(set(have) - set(ad.pairs))
        flags = (ad.metadata.get("toy.mlx_lm_flags") if mlx_lm
                 else _adapted_flags(ad.pairs, model.args))
        whose = "mlx-lm's adapter" if mlx_lm else "the adapter"
        raise GGUFError(f"{ad.path}: tensors: expected LoRA pairs for exactly the model's "
                        f"{counted(len(have), 'adapted weight')}, found {len(ad.pairs)} (missing "
                        f"{missing[:2]}, unexpected {extra[:2]})"
                        + (f"; {whose} is this run's with {' '.join([flags, *size])}{fix}"
                           if flags else ""))
    targets = _adapter_targets(model, ad)
    for name, (_, a, b) in targets.items():
        m = have[name]
        r = a.shape[-2]
        if r != m.rank or as_stored(ad.alpha or r) != as_stored(m.alpha):
            hint = (f"; pass {' '.join(size)} to start from it{fix}" if size else
                    " (the adapter's ranks differ between its tensors: no --lora.rank matches)")
            raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected rank {m.rank} and "
                            f"alpha {m.alpha} (this run's), found rank {r} and alpha "
                            f"{ad.alpha or float(r)}{hint}")
        m.lora_a, m.lora_b = mx.array(a), mx.array(b)
        if ad.magnitudes is not None:
            if ad.magnitudes[name].shape != m.m.shape:
                raise GGUFError(f"{ad.path}: tensor '{name}.dora_m': expected shape "
                                f"{m.m.shape}, found {ad.magnitudes[name].shape}")
            m.m = mx.array(ad.magnitudes[name])
    mx.eval(model.parameters())


def write_adapter_for(out: str | os.PathLike, adapter: str | os.PathLike,
                      base: str | os.PathLike) -> tuple[Path, str]:
    """Write `adapter` (mlx-lm's folder, or any adapter `load_adapter` reads) as an adapter GGUF
    for the base GGUF `base`, checked against it: llama.cpp's LoRA format (toymlx's for DoRA).
    Returns (the file, its adapter.type)."""
    model, g = load_llama(base, weights="blocks")
    try:
        meta = dict(g.metadata)
    finally:
        g.close()
    apply_adapter(model, adapter)
    m = next(iter(lora_layers(model).values()))
    kind = next(k for k, c in ADAPTER_KINDS.items() if type(m) is c)
    extra = {"toy.base": str(base), "toy.adapter_source": str(adapter)}
    return write_adapter(out, model, meta, extra), kind
