"""toymlx-export --base BASE.gguf [--adapter RUN|ADAPTER.gguf --fuse] --out OUT.gguf [--dtype],
toymlx-export --adapter runs/<lora run> --format modelfile [--fuse] --out DIR (an Ollama Modelfile),
or toymlx-export --model runs/<vit run> --format safetensors --out DIR|FILE.safetensors."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toymlx_cli import run_command

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)
from toymlx.gguf.quantize import ExportType
from toymlx.outputs import check_output

PROG = "toymlx-export"


@dataclass
class Args:
    """Write a llama GGUF for llama.cpp, or a ViT for timm.

    --adapter A --fuse: the base with W + (alpha/r) B A in every adapted weight (DoRA: that
                        rescaled to its magnitude m per row), in the base's own type (a Q4_K_M
                        base gives a Q4_K_M file) or --dtype; quantized by llama.cpp's own
                        quantizer (llama-cpp-python), byte for byte what llama-quantize writes
                        from the fused F32 model.
    --adapter A alone:  the adapter GGUF itself, checked against the base.
    no --adapter:       the base re-encoded at --dtype (--dtype f32: an F32 copy of a Q4_1 file).
    --adapter A --format modelfile --out DIR: DIR/Modelfile for Ollama (FROM the base, ADAPTER
                        A, the base's Ollama template and stop tokens); with --fuse, FROM the
                        fused model written beside it (DIR/fused-TYPE.gguf); then
                        `ollama create NAME -f DIR/Modelfile`.
    A GGUF option also takes ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO[/FILE.gguf].
    --model M --format safetensors: a ViT run or checkpoint in timm's vit_tiny_patch16_224
                        layout; --out DIR writes DIR/model.safetensors + DIR/config.json
                        (timm.create_model("local-dir:DIR", pretrained=True) loads it),
                        --out F.safetensors the weights alone (config in its metadata).
    """

    out: str
    """Where to write (atomically): a GGUF, or for safetensors a folder or .safetensors file."""
    base: str | None = None
    """The llama GGUF the adapter was trained on (its tokenizer and metadata are kept); default
    with --adapter: the base the LoRA run recorded (its absolute file, checked by SHA-256)."""
    model: str | None = None
    """A ViT checkpoint GGUF or run directory to export (with --format safetensors)."""
    format: Literal["gguf", "safetensors", "modelfile"] = "gguf"
    """gguf (llama.cpp), safetensors (timm's ViT layout, from --model), or modelfile (an Ollama
    Modelfile in the folder --out, for --adapter)."""
    adapter: str | None = None
    """A LoRA adapter GGUF, or a LoRA run directory (its weights/latest); a DoRA adapter
    (--fine-tune-type dora) only with --fuse."""
    fuse: bool = False
    """Merge the adapter into the base weights (a full model for llama.cpp without --lora)."""
    dtype: ExportType | None = None
    """File type of the written model, as llama-quantize names them (default: the base's own
    general.file_type). Without llama-cpp-python only f32, f16, bf16, q8_0, q4_0, q4_1, q5_0
    and q5_1 (gguf-py's encoders)."""


def export_vit(args: Args) -> int:
    from toymlx.classify import Classifier
    from toymlx.timm_export import TIMM_ARCH, export_timm, timm_model_args

    if args.base or args.adapter or args.fuse or args.dtype:
        raise ValueError("--format safetensors: expected --model and --out only, found "
                         "--base/--adapter/--fuse/--dtype (those are for llama GGUFs)")
    t0 = time.perf_counter()
    clf = Classifier.load(args.model)
    inputs = [("--model", args.model), ("--model", clf.path)]
    check_output(args.out, inputs)
    if not args.out.endswith(".safetensors"):  # a folder: the two files written into it
        for name in ("model.safetensors", "config.json"):
            check_output(Path(args.out) / name, inputs)
    norm = {"toy.pixel_scale": clf.scale, "toy.pixel_mean": clf.mean.tolist(),
            "toy.pixel_std": clf.std.tolist()}
    files = export_timm(args.out, clf.model, norm, clf.names)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in timm_model_args(clf.model.args).items())
    print(f"{PROG}: wrote {', '.join(map(str, files))} from {clf.path} in "
          f"{time.perf_counter() - t0:.1f} s; load with timm.create_model({TIMM_ARCH!r}, "
          f"{kwargs}) and load_state_dict; inputs NCHW, (pixels / 255 - mean) / std with mean "
          f"{[round(float(v), 4) for v in clf.mean]}, std {[round(float(v), 4) for v in clf.std]}",
          file=sys.stderr)
    return 0


def export_modelfile(args: Args) -> int:
    from toymlx.modelfile import write_modelfile

    if not args.adapter or args.model or (args.dtype and not args.fuse):
        raise ValueError("--format modelfile: expected --adapter (a LoRA run or adapter GGUF), "
                         "--out DIR and optionally --base, --fuse and --dtype (with --fuse), "
                         "found " + ("no --adapter" if not args.adapter else
                                     "--model" if args.model else "--dtype without --fuse"))
    t0 = time.perf_counter()
    path, base, adapter, fused = write_modelfile(args.out, args.adapter, args.base,
                                                 fuse=args.fuse, dtype=args.dtype,
                                                 progress=True)
    what = f"FROM {base.path}, ADAPTER {adapter}"
    if fused:
        from toymlx.gguf.quantize import own_type
        from toymlx.gguf.reader import GGUFFile
        from toymlx.lora import adapter_kept, kept_note

        with GGUFFile(fused) as g:
            dtype = own_type(g)
        what = (f"FROM {fused} ({fused.stat().st_size / 2**20:.1f} MiB: {base.path} + {adapter} "
                f"fused; it {kept_note(adapter_kept(fused, base.path, adapter), dtype)})")
    print(f"{PROG}: wrote {path} ({what}) in {time.perf_counter() - t0:.1f} s; create the "
          f"Ollama model with: ollama create NAME -f {path}", file=sys.stderr)
    return 0


def run(args: Args) -> int:
    from toymlx.atomic import atomic_open
    from toymlx.checkpoint import checkpoint_file
    from toymlx.gguf.llama import load_llama
    from toymlx.gguf.quantize import own_type
    from toymlx.gguf.reader import GGUFFile
    from toymlx.lora import adapter_kept, apply_adapter, kept_note, load_adapter, write_merged

    if args.format == "modelfile":
        return export_modelfile(args)
    if args.format == "safetensors" or args.model:
        if args.format != "safetensors":
            raise ValueError("--model: expected with --format safetensors (a ViT for timm), "
                             "found --format gguf; llama GGUFs are exported with --base")
        if not args.model:
            raise ValueError("--format safetensors: expected --model (a ViT run or checkpoint), "
                             "found none")
        return export_vit(args)
    if args.fuse and not args.adapter:
        raise ValueError("--fuse: expected --adapter (the adapter to merge), found none")
    base_spec = args.base or run_base_of(args.adapter)
    base = checkpoint_file(base_spec, "--base")  # a path, a run, or ollama:NAME / lmstudio:NAME
    adapter = checkpoint_file(args.adapter, "--adapter") if args.adapter else None
    out = check_output(args.out, [("--base", base_spec), ("--base", base),
                                  ("--adapter", args.adapter), ("--adapter", adapter)])
    t0 = time.perf_counter()
    if args.adapter and not args.fuse:
        if args.dtype:
            raise ValueError("--dtype: only applies to a written model (with --fuse or "
                             "without --adapter); an adapter is written as F32")
        src = checkpoint_file(args.adapter, "--adapter")
        if load_adapter(src).kind != "lora":
            raise ValueError(f"{src}: --adapter: expected a LoRA adapter to write for llama.cpp, "
                             "found a DoRA adapter (toymlx's own format: llama.cpp has none); "
                             "add --fuse to write the full model llama.cpp runs")
        model, _ = load_llama(base, weights="blocks")  # the adapter checked against the base
        apply_adapter(model, src)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as f, atomic_open(out) as dst:
            shutil.copyfileobj(f, dst)
        what = f"adapter {src}"
    else:
        write_merged(out, base, args.adapter, args.dtype, progress=True)
        what = f"{base_spec}" + (f" + adapter {args.adapter} (fused)" if args.adapter else "")
        if args.adapter:
            with GGUFFile(out) as g:
                dtype = own_type(g)
            what += "; it " + kept_note(adapter_kept(out, base, args.adapter), dtype)
    print(f"{PROG}: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {what} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def run_base_of(adapter: str | None) -> str:
    """The base to export when --base is not given: the one the --adapter's LoRA run (or its
    adapter GGUF's `toy.base`) records; says which file that is."""
    from toymlx.checkpoint import checkpoint_file
    from toymlx.modelfile import lora_run_base
    from toymlx.runs import run_base

    if adapter is None:
        raise ValueError("--base: expected the llama GGUF to export (or --model with --format "
                         "safetensors for a ViT), found none")
    found = run_base(adapter, "--adapter")
    base = found[0] if found is not None else lora_run_base(
        adapter, checkpoint_file(adapter, "--adapter"))
    if base is None:
        raise ValueError(f"--base: expected the GGUF {adapter} was trained on (not recorded by "
                         "its run or adapter), found none; pass --base")
    print(f"{PROG}: base {found[1] if found is not None else base} (no --base given)",
          file=sys.stderr)
    return base


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the write in flight removes its temporaries, as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    old = signal.signal(signal.SIGTERM, _stop)  # a kill stops an export like Ctrl-C does
    try:
        return run_command(PROG, Args, run, argv, (ValueError, OSError, KeyError, TypeError))
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
