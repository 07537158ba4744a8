"""A trained adapter or full fine-tune fused with its base into one GGUF: re-encoded in one
type (`write_reencoded`), or as the file that keeps the fine-tune (`write_fused_kept`,
`write_full_kept`, through `toymlx.gguf.fuse.write_kept`), and how much of the adapter's change
a fused file keeps (`adapter_kept`). A full fine-tune's checkpoint is its model as a file of its
base's kind (`write_like_base`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from mlx.utils import tree_flatten

from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.gguf.fuse import RUN_DATA
from toymlx.gguf.llama import llama_tensor, llama_tensors, load_llama, parameter_names
from toymlx.gguf.quantize import BASE_FILE_TYPE, export_type, quantizer, write_model_gguf
from toymlx.gguf.reader import UINT32, GGUFError, GGUFFile
from toymlx.gguf.writer import FILE_TYPE, Deferred, encode_tensor, encoded_type, write_gguf
from toymlx.models.llama import Llama
from toymlx.models.lora import fuse
from toymlx.training.adapter import apply_adapter, check_arch, load_adapter, shape_text

KEPT_WARNING = 0.5
"""Below this share of the adapter's change kept, a fused export says so (see adapter_kept)."""
RUN_DATA_OPTIONS = ("data.path", "data.pack", "data.mask_prompt", "data.train_turns",
                    "data.drop_tools", "data.val_fraction", "seq_len", "batch_size", "eval_batches",
                    "grad_checkpoint")
"""The run's options recorded under `RUN_DATA`, by their dotted config names: how its examples
became rows and which were held out, and which of those rows its eval events scored in which
batches (`--eval-batches` x `--batch-size`, calls of `held_out_call_rows`). The chat template
is not among them: the run used its base's, which the fused file carries as its own."""
RUN_DATA_FINGERPRINT = ("bytes", "sha256", "sample_sha256", "mtime_ns", "only")
"""The keys of the data's `fingerprint`, as the run's config.json recorded it, recorded under
`RUN_DATA` + "fingerprint.": what tells the run's data from other data at eval time ("only":
the files of a data folder it covers, an mlx-lm folder's split files, so a README.md edited
beside them is not other data)."""


def run_data_metadata(cfg: Any, data_record: dict[str, Any] | None) -> dict[str, Any]:
    """The `RUN_DATA` keys of a file fused from the LoRA run of config `cfg`: its
    `RUN_DATA_OPTIONS` (data.path as the file the run reads, absolute; absent for the
    shipped default data) and `data_record`, its data's `fingerprint` as config.json recorded it (None: none).
    Not the run's id: a run and its copy under another id write the same file byte for byte.
    The writers below take them as `run_data`; `toymlx.runner.bundle.fused_run_data` finds
    them for a run folder or checkpoint."""
    from toymlx.bundle.options import option

    meta = {RUN_DATA + k: v for k in RUN_DATA_OPTIONS if (v := option(cfg, k)) is not None}
    path = meta.get(RUN_DATA + "data.path")
    if path is not None:  # where the run's data is: the folder a resume found it moved to
        # (`cfg` as `runner.bundle.Bundle` resolved it, checked against its record), else
        # where the run read it, never resolved against this folder
        meta[RUN_DATA + "data.path"] = (os.path.realpath(path) if os.path.exists(path) else
                                        (data_record or {}).get("file") or os.path.abspath(path))
    meta.update({f"{RUN_DATA}fingerprint.{k}": data_record[k] for k in RUN_DATA_FINGERPRINT
                 if k in (data_record or {})})
    return meta


def adapter_kept(fused: str | os.PathLike, base: str | os.PathLike,
                 adapter: str | os.PathLike) -> float:
    """The share of the adapter's change a fused file keeps, on the adapted layers' outputs
    (`toymlx.gguf.fuse.kept_from`): over the adapted tensors, with D the adapter's change, F = W + D
    and Q the file's weights, 1 - sqrt(sum ||Q - F||^2 / sum ||D||^2) clipped to [0, 1]: the
    output error on isotropic inputs against the change's own output. Rounding the untouched
    part of W again counts as error, never as change (1: all of it kept; 0: noise as large as
    the change). Weights dequantized by gguf-py, sums in float64."""
    return adapter_retention(fused, base, adapter).kept


class Retention(NamedTuple):
    """How much of an adapter's change a fused file keeps (`adapter_retention`)."""

    kept: float
    """`adapter_kept`: 1 - `noise` clipped to [0, 1]."""
    along: float
    """The share of the change the file's weights still move along: with D, W and Q as in
    `adapter_kept`, sum <Q - W, D> / sum ||D||^2 clipped to [0, 1]."""
    noise: float
    """sqrt(sum ||Q - F||^2 / sum ||D||^2): the file's error on the adapted layers' outputs
    (isotropic inputs) as a multiple of the change's own."""


def adapter_retention(fused: str | os.PathLike, base: str | os.PathLike,
                      adapter: str | os.PathLike) -> Retention:
    """`Retention` of the adapter's change in the fused file. `along` tells rounding
    noise from an erased change: re-rounding onto another grid (a Q4_1 base written as Q4_K_M)
    adds noise that knows nothing of D, so the file still moves by D on average (near 1, however
    large the noise), where rounding W + D onto W's own grid returns W (near 0: the change is
    gone). One pass over the adapted tensors."""
    from toymlx.gguf.fuse import kept_from

    ad = load_adapter(adapter)
    err2 = delta2 = along = 0.0
    with GGUFFile(base) as g, GGUFFile(fused) as f:
        for name in ad.pairs:
            w = g.load(name, np.float32)
            d = ad.delta(name, w).astype(np.float64)
            moved = f.load(name, np.float64) - w
            e = moved - d
            err2, delta2 = err2 + float(np.vdot(e, e)), delta2 + float(np.vdot(d, d))
            along += float(np.vdot(moved, d))
            f.release(name)
            g.release(name)
    if delta2 <= 0.0:
        return Retention(1.0, 1.0, 0.0)
    return Retention(kept_from(err2, delta2), float(min(1.0, max(0.0, along / delta2))),
                     float(np.sqrt(err2 / delta2)))


FINER = ("q8_0", "f16", "f32")
"""Types finer than a small-block quantization, coarse to fine: what `kept_note` offers (after
bf16, whose 8-bit mantissa q8_0 does not refine: f16 or f32)."""


def kept_note(kept: float | Retention, dtype: str, flag: str = "--dtype") -> str:
    """What a user reads about `adapter_kept`: the share, and what to do when it is small:
    `flag` (toymlx-export's --dtype, or --fuse-at-end) left to keep each adapted tensor's
    change, or a type finer than `dtype` (none that is `dtype` itself or coarser). Given a
    `Retention`, a small share whose change the weights still move along (`along`) is rounding
    noise over a change that survives, and is said as such: only a change erased is lost."""
    r = kept if isinstance(kept, Retention) else None
    kept = r.kept if r is not None else kept
    note = f"keeps {kept:.0%} of the adapter's change on the adapted layers' outputs"
    if kept >= KEPT_WARNING:
        return note
    low = dtype.lower()
    finer = (FINER[FINER.index(low) + 1:] if low in FINER else
             FINER[1:] if low == "bf16" else FINER[:2])
    keep = ("export without --dtype" if flag == "--dtype" else f"{flag} base")
    fix = (f"{keep} (each adapted tensor in a type that keeps its change), "
           + (f"or {flag} {' or '.join(finer)}, " if finer else "")
           + "or run the base with the adapter: llama-cli --lora")
    if r is not None and r.along >= KEPT_WARNING:
        return (f"keeps {r.along:.0%} of the adapter's change in its weights, under {dtype}'s "
                f"rounding noise {r.noise:.1f}x the change's size on the adapted layers' outputs "
                f"(so {kept:.0%} kept by that measure: the noise of any file rounded to {dtype}; "
                f"the held-out gain measures what the fine-tune kept; to keep the change "
                f"exact, {fix})")
    return note + f" (warning: the rest is lost to {dtype}'s rounding; to keep the fine-tune, {fix})"


def write_reencoded(out: str | os.PathLike, base: str | os.PathLike,
                    adapter: str | os.PathLike | None = None, dtype: str | None = None,
                    progress: bool = False, run_data: dict[str, Any] | None = None) -> Path:
    """Write `base` (+ `adapter`, LoRA or DoRA, fused into its weights) as a full GGUF with
    every tensor re-encoded in `dtype` (default: the base's own, `export_type`) through
    `write_model_gguf`, byte for byte what llama-quantize writes from the fused F32 model;
    `base` may be a full fine-tune's run folder (its latest checkpoint); `run_data`: the run's
    `run_data_metadata`."""
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
    extra.update(run_data or {})
    try:  # a file re-encoded alone keeps the run its weights came from
        meta, types, weights = like_base(g, model, extra, keep_run=not extra)
    finally:
        g.close()
    del model
    return write_model_gguf(out, meta, types, weights, dtype, progress)



def write_fused_kept(out: str | os.PathLike, base: str | os.PathLike,
                     adapter: str | os.PathLike, progress: bool = False,
                     run_data: dict[str, Any] | None = None):
    """`base` + `adapter` (LoRA or DoRA) fused by `toymlx.gguf.fuse.write_kept` (the file that keeps
    the fine-tune; `run_data`: the run's `run_data_metadata`); returns its `KeptFile`. The
    adapter is checked against the base first (architecture, every adapted weight's name and
    shape), as `apply_adapter` checks it."""
    from toymlx.gguf.fuse import write_kept

    base = checkpoint_file(base, "--base")
    ad_path = checkpoint_file(adapter, "--adapter")
    ad = load_adapter(ad_path)
    with GGUFFile(base) as g:
        check_arch(ad, str(g.metadata.get("general.architecture", "llama")))
        for name, (a, b) in ad.pairs.items():
            info = g.tensors.get(name)
            if info is None or len(info.shape) not in (2, 3) or name == "token_embd.weight":
                raise GGUFError(f"{ad.path}: tensor '{name}.lora_a': expected a projection "
                                f"weight of the base {base}, found no such weight")
            lead = tuple(info.shape[:-2])  # an expert tensor's (E,)
            if (*a.shape[:-2], b.shape[-2], a.shape[-1]) != tuple(info.shape):
                raise GGUFError(f"{ad.path}: tensor '{name}.lora_a'/'.lora_b' shapes: expected "
                                f"{shape_text(*lead, 'r', info.shape[-1])} and "
                                f"{shape_text(*lead, info.shape[-2], 'r')} to fit the "
                                f"base's {name} {info.shape}, found {a.shape} and {b.shape} "
                                "(wrong base?)")

    def fused(name: str, w: np.ndarray) -> np.ndarray:
        return (w.astype(np.float64) + ad.delta(name, w)).astype(np.float32)

    return write_kept(out, base, ad.pairs, fused, {"toy.merged_adapter": ad_path.name,
                                                   **(run_data or {})},
                      progress=progress)



def write_full_kept(out: str | os.PathLike, base: str | os.PathLike,
                    checkpoint: str | os.PathLike, progress: bool = False,
                    run_data: dict[str, Any] | None = None):
    """A full fine-tune's `checkpoint` as the file that keeps the fine-tune
    (`toymlx.gguf.fuse.write_kept` over the file `base` it was trained from): each tensor it changed
    in a type that keeps the change, every other one the base's own bytes; `run_data`: the
    run's `run_data_metadata`."""
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
                          {"toy.fine_tuned": checkpoint.name,
                           **(run_data or {})}, progress=progress)
    finally:
        c.close()


def like_base_metadata(g: GGUFFile, extra: dict[str, Any] | None = None, keep_run: bool = False
                       ) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    """(metadata, their GGUF types) of a file of the base `g`'s kind: every metadata key of the
    base but its alignment and file types, with its original GGUF type, `extra` added. The
    base's `RUN_DATA` (a fused file's run) only with `keep_run`: the same weights re-encoded;
    new weights are another run's, which `extra` records (or nothing does)."""
    skip = {"general.alignment", "general.file_type", BASE_FILE_TYPE} | (
        set() if keep_run else {k for k in g.metadata if k.startswith(RUN_DATA)})
    meta = {k: v for k, v in g.metadata.items() if k not in skip}
    types = {k: t for k, t in g.metadata_types.items() if k not in skip}
    meta.update(extra or {})
    return meta, types


def like_base(g: GGUFFile, model: Llama, extra: dict[str, Any] | None = None,
              keep_run: bool = False
              ) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]], dict[str, np.ndarray]]:
    """(metadata, their GGUF types, float32 tensors) of `model` as a file of the base `g`'s kind:
    every metadata key of the base (tokenizer, chat template, hyperparameters) with its original
    GGUF type, `extra` added (`keep_run`: as `like_base_metadata`), and the base's other tensors
    (RoPE constants: rope_freqs, rope_factors_*); the writer sets general.file_type."""
    meta, types = like_base_metadata(g, extra, keep_run)
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
    meta, types = like_base_metadata(g, extra)
    meta["general.file_type"] = FILE_TYPE[dtype]
    types["general.file_type"] = (UINT32, None)
    base_type = g.metadata.get(BASE_FILE_TYPE, g.metadata.get("general.file_type"))
    if isinstance(base_type, int):
        meta[BASE_FILE_TYPE], types[BASE_FILE_TYPE] = base_type, (UINT32, None)
    return write_gguf(out, meta, deferred_like_base(g, model, dtype), types=types)


def deferred_like_base(g: GGUFFile, model: Llama, dtype: str) -> dict[str, Deferred]:
    """`like_base`'s tensors, each encoded as `dtype`, made as `write_gguf` writes it: a frozen
    block held as the file's blocks is decoded to float32 one matrix at a time, where the
    whole model's float32 values at once were 4.3 GB beside the run's weights and optimizer
    state (Llama-3.2-1B's last 2 blocks trained: the run's peak)."""
    flat = dict(tree_flatten(model.parameters()))

    def made(name: str, values: Callable[[], np.ndarray]) -> Deferred:
        shape = tuple(g.tensors[name].shape)  # a checkpoint's shapes are its base's
        return Deferred(encoded_type(shape, dtype), shape,
                        lambda: encode_tensor(name, values(), dtype))

    tensors = {name: made(name, partial(llama_tensor, model, flat, key))
               for name, key in parameter_names(model.args).items()}
    for name in g.tensors:  # RoPE constants as the base has them
        if name not in tensors:
            tensors[name] = made(name, partial(g.load, name, np.float32))
    return tensors
