"""`toymlx-export --fuse`'s choices for a run: `write_merged` (the file that keeps the fine-tune
by default, a full fine-tune's base found from its run, or every tensor re-encoded in one type)
and `write_fused_exact` (`--exact-size`: the base's own types, each adapted tensor rounded on the
inputs its layer sees over the run's own training rows)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn

from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.gguf.llama import load_llama, toy_to_gguf
from toymlx.gguf.reader import GGUFFile
from toymlx.models.layers import replace_submodule
from toymlx.models.llama import Llama
from toymlx.models.lora import lora_layers
from toymlx.training.adapter import apply_adapter, load_adapter
from toymlx.training.fused import write_full_kept, write_fused_kept, write_reencoded


def write_merged(out: str | os.PathLike, base: str | os.PathLike,
                 adapter: str | os.PathLike | None = None, dtype: str | None = None,
                 progress: bool = False) -> Path:
    """Write `base` (+ `adapter`, LoRA or DoRA, fused into its weights) as a full GGUF; `base`
    may be a full fine-tune's run folder (its latest checkpoint).

    No `dtype`, with an adapter or for a full fine-tune: the file that keeps the fine-tune
    (`toymlx.gguf.fuse.write_kept`): the base's tensors byte for byte, each adapted (changed) one in
    the smallest type that keeps its change, general.file_type the base's. Otherwise every
    tensor re-encoded in `dtype` (default: the base's own, `export_type`) through
    `write_model_gguf`, byte for byte what llama-quantize writes from the fused F32 model.
    The file records the settings of the run `adapter` (else `base`) comes from
    (`toymlx.runner.bundle.fused_run_data`), so that toymlx-eval scores it on the run's rows."""
    from toymlx.runner.bundle import fused_run_data

    run_data = fused_run_data(*(adapter, "--adapter") if adapter is not None else (base, "--base"))
    if dtype is None:
        if adapter is not None:
            return write_fused_kept(out, base, adapter, progress, run_data).path
        trained_from = fine_tune_base(base)
        if trained_from is not None:
            return write_full_kept(out, trained_from, base, progress, run_data).path
    return write_reencoded(out, base, adapter, dtype, progress, run_data)


class _Moments:
    """X^T X of the inputs each recorded layer sees: a batch's products in float32 (MLX, in the
    forward's own graph), summed over batches in float64. Layers that read the same input (q, k
    and v; gate and up) share one product."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self._batch: dict[str, mx.array] = {}
        self._by_input: dict[int, tuple[mx.array, mx.array]] = {}

    def record(self, path: str, x: mx.array) -> None:
        if id(x) not in self._by_input:  # x stays referenced, so its id is not reused
            a = x.astype(mx.float32).reshape(-1, x.shape[-1])
            self._by_input[id(x)] = (x, a.T @ a)
        self._batch[path] = self._by_input[id(x)][1]

    def end_batch(self, *outputs: mx.array) -> None:
        mx.eval(*outputs, *self._batch.values())
        for path, xtx in self._batch.items():
            h = np.asarray(xtx, np.float64)
            self.sums[path] = self.sums[path] + h if path in self.sums else h
        self._batch.clear()
        self._by_input.clear()


class _Recorded(nn.Module):
    """A layer whose inputs `moments` records as it computes."""

    def __init__(self, inner: nn.Module, path: str, moments: _Moments):
        super().__init__()
        self.inner = inner
        self.path = path
        self.moments = moments

    def __call__(self, x: mx.array) -> mx.array:
        self.moments.record(self.path, x)
        return self.inner(x)


MOMENT_ROWS = 256
"""Training rows (at most) whose activations a data-aware rounding (`write_fused_exact`) uses."""


def input_moments(model: Llama, rows: np.ndarray, batch: int = 16) -> dict[str, np.ndarray]:
    """GGUF tensor name -> X^T X of the inputs its (LoRA or DoRA) layer sees over `rows`
    (token ids, (n, seq)); the model computes as it trains (base + adapter), up to its final
    hidden states (the head reads no recorded layer's output)."""
    layers = lora_layers(model)
    moments = _Moments()
    for p, m in layers.items():
        replace_submodule(model, p, _Recorded(m, p, moments))
    try:
        for i in range(0, len(rows), batch):
            moments.end_batch(model.hidden(mx.array(rows[i:i + batch])))
    finally:
        for p, m in layers.items():
            replace_submodule(model, p, m)
    return {toy_to_gguf(p + ".weight"): moments.sums[p] for p in layers}


def write_fused_exact(out: str | os.PathLike, base: str | os.PathLike,
                      adapter: str | os.PathLike, progress: bool = False) -> tuple[Path, float]:
    """`base` + `adapter` (a LoRA or DoRA run) fused in the base's own tensor types, byte for
    byte its size: every other tensor the base's bytes, each adapted one rounded by
    `toymlx.gguf.gptq` to keep its outputs on the inputs the layer sees over the run's own
    training rows (at most `MOMENT_ROWS`). Returns (the file, the share of the change kept on
    those inputs, `toymlx.gguf.fuse.kept_from` over the adapted layers)."""
    from toymlx.data.chat import SFTData, row_keys
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.fuse import kept_from, write_with_tensors
    from toymlx.gguf.gptq import GPTQ_TYPES, gptq_quantize
    from toymlx.gguf.quantize import dequantize_tensor
    from toymlx.recipes.lora import DEFAULT_DATA
    from toymlx.runner.bundle import Bundle

    bundle = Bundle.of(adapter, "--adapter")
    if bundle is None or bundle.recipe != "lora":
        raise ValueError(f"{adapter}: --exact-size: expected a LoRA run folder (its training "
                         "rows give each layer's inputs), found an adapter outside a run")
    base = checkpoint_file(base, "--base")
    ad_path = checkpoint_file(adapter, "--adapter")
    ad = load_adapter(ad_path)
    with GGUFFile(base) as g:
        bad = sorted({g.tensors[n].type.name for n in ad.pairs} - {t.name for t in GPTQ_TYPES})
        if bad:
            raise ValueError(f"{base}: --exact-size: expected adapted tensors of type "
                             f"{', '.join(t.name for t in GPTQ_TYPES)}, found {', '.join(bad)}")
        tok = Tokenizer.from_metadata(g.metadata, source=str(base))
    cfg = bundle.config
    data = SFTData.from_file(cfg.data.path or DEFAULT_DATA, tok, cfg.seq_len,
                             cfg.data.mask_prompt, cfg.data.pack, cfg.data.val_fraction,
                             turns=cfg.data.train_turns,
                             keys=row_keys(getattr(cfg.data, "keys", ())),
                             drop_tools=cfg.data.drop_tools, test=False)
    model, g = load_llama(base)
    g.close()
    apply_adapter(model, ad_path)
    moments = input_moments(model, data.train["inputs"][:MOMENT_ROWS])
    del model
    err2 = delta2 = 0.0
    tensors = {}
    with GGUFFile(base) as g:
        for i, (name, h) in enumerate(moments.items()):
            info = g.tensors[name]
            w = g.load(name, np.float32)
            d = ad.delta(name, w)
            f = w + d
            raw = gptq_quantize(f, h, info.type)
            e = dequantize_tensor(raw, info.type, info.shape) - f
            err2 += float(np.sum((e @ h) * e))
            delta2 += float(np.sum((d @ h) * d))
            tensors[name] = raw
            if progress:
                print(f"\rrounding on the run's activations: {i + 1}/{len(moments)}", end="",
                      file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        out = write_with_tensors(out, g, tensors, {"toy.merged_adapter": ad_path.name,
                                                   **bundle.run_data()}, progress)
    return out, kept_from(err2, delta2)


def fine_tune_base(run_or_checkpoint: str | os.PathLike) -> Path | None:
    """The file a full fine-tune was trained from (its run_start's absolute `base_file`), for
    a full fine-tune's run folder or checkpoint; None for anything else. FileNotFoundError,
    naming it, when that file is gone."""
    from toymlx.runner.bundle import Bundle

    bundle = Bundle.of(run_or_checkpoint, "--base")
    if bundle is None or getattr(bundle.config, "fine_tune_type", None) != "full":
        return None
    start = bundle.start_event or {}
    recorded = start.get("config", {}).get("base_file")
    if not recorded or not Path(recorded).is_file():
        raise FileNotFoundError(f"{bundle.path}: run_start 'base_file': expected the file the "
                                f"full fine-tune was trained from, found "
                                f"{'nothing recorded' if not recorded else 'no file ' + recorded}"
                                "; pass --dtype to re-encode the checkpoint alone")
    return Path(recorded)

