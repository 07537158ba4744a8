"""toymlx-export --base BASE.gguf [--adapter RUN|ADAPTER.gguf --fuse] --out OUT.gguf [--dtype],
toymlx-export --adapter runs/<lora run> --format modelfile [--fuse] --out DIR (an Ollama Modelfile),
or toymlx-export --model runs/<vit run> --format safetensors --out DIR|FILE.safetensors."""

from __future__ import annotations

import math
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from toymlx_cli import console_command, run_command

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)
from toymlx.backend.progress import draws_bars
from toymlx.backend.stop import SIGNALS, stops_raise
from toymlx.bundle.outputs import check_output
from toymlx.gguf.quantize import ExportType, unquantized_note

if TYPE_CHECKING:
    from toymlx_cli.eval import HeldOut

    from toymlx.runner.bundle import Bundle

PROG = "toymlx-export"


@dataclass
class Args:
    """Write a llama GGUF for llama.cpp, or a ViT for timm.

    --adapter A --fuse: the base with W + (alpha/r) B A in every adapted weight (DoRA: that
                        rescaled to its magnitude m per row). Default: the file that keeps the
                        fine-tune: every other tensor the base's own bytes, each adapted one
                        in the smallest type keeping 90% of its change (its output error),
                        within 1.10x the base's size, general.file_type the base's. --dtype T:
                        every tensor re-quantized to T by llama.cpp's own quantizer
                        (llama-cpp-python), byte for byte what llama-quantize writes from the
                        fused F32 model (rounding may erase a small fine-tune: the export says
                        how much of it the file keeps). From a run, the held-out loss of the
                        fused file is printed beside the base's and base + adapter's, with the
                        share of the fine-tune's gain it keeps (--no-held-out skips it).
    --adapter A alone:  the adapter GGUF itself, checked against the base; mlx-lm's adapter
                        folder converted to one (llama's q/k rows in the GGUF's order).
    no --adapter:       the base re-encoded at --dtype (--dtype f32: an F32 copy of a Q4_1 file).
    --adapter A --format modelfile --out DIR: DIR/Modelfile for Ollama (FROM the base, ADAPTER
                        A, the base's Ollama template and stop tokens); with --fuse, FROM the
                        fused model written beside it (DIR/fused-TYPE.gguf); then
                        `ollama create NAME -f DIR/Modelfile`.
    A GGUF option also takes ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE.gguf] or
                        hf:USER/REPO[:QUANT].
    --model M --format safetensors: a ViT run or checkpoint in timm's vit_tiny_patch16_224
                        layout; --out DIR writes DIR/model.safetensors + DIR/config.json
                        (timm.create_model("local-dir:DIR", pretrained=True) loads it),
                        --out F.safetensors the weights alone (config in its metadata).
    """

    out: str
    """Where to write (atomically): a GGUF; for safetensors a folder or .safetensors file; for
    modelfile a folder (its Modelfile, and with --fuse the fused GGUF beside it)."""
    base: str | None = None
    """The llama GGUF the adapter was trained on (its tokenizer and metadata are kept); default
    with --adapter: the base the LoRA run recorded (its absolute file, checked by SHA-256)."""
    model: str | None = None
    """A ViT checkpoint GGUF or run directory to export (with --format safetensors)."""
    format: Literal["gguf", "safetensors", "modelfile"] = "gguf"
    """gguf (llama.cpp), safetensors (timm's ViT layout, from --model), or modelfile (an Ollama
    Modelfile in the folder --out, for --adapter)."""
    adapter: str | None = None
    """A LoRA adapter GGUF, or a LoRA run directory (its weights/latest), or mlx-lm's adapter
    folder (adapters.safetensors + adapter_config.json; with --base); a DoRA adapter
    (--fine-tune-type dora) only with --fuse."""
    fuse: bool = False
    """Merge the adapter into the base weights (a full model for llama.cpp without --lora)."""
    exact_size: bool = False
    """With --fuse and a LoRA or DoRA run: the base's own type for every tensor (its size, byte
    for byte), each adapted tensor rounded to keep its outputs on the inputs its layer sees
    over the run's training rows (GPTQ-style; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 tensors)."""
    overwrite: bool = False
    """Replace an existing --out file (a --out folder: the files written into it); without
    it, an existing one is refused."""
    held_out: bool = True
    """With --adapter RUN --fuse: score the fused file's held-out loss on the run's validation
    rows (and the base's and base + adapter's where the run did not record them: up to three
    passes, minutes each on a 1B model on a CPU) to say how much of the fine-tune it keeps;
    --no-held-out writes the file without them, as mlx_lm.fuse does."""
    dtype: ExportType | None = None
    """File type of the written model, as llama-quantize names them, in either case (Q4_K_M or
    q4_k_m; default: the base's own general.file_type; with --fuse, the base's tensors kept and
    each adapted one in a type that keeps its change). Without llama-cpp-python only f32, f16,
    bf16, q8_0, q4_0, q4_1, q5_0 and q5_1 (gguf-py's encoders)."""


def export_vit(args: Args) -> int:
    from toymlx.generation.classify import Classifier
    from toymlx.interop.timm_export import CLASS_MAP, TIMM_ARCH, export_timm, timm_model_args

    if args.base or args.adapter or args.fuse or args.dtype:
        raise ValueError("--format safetensors: expected --model and --out only, found "
                         "--base/--adapter/--fuse/--dtype (those are for llama GGUFs)")
    t0 = time.perf_counter()
    clf = Classifier.load(args.model)
    inputs = [("--model", args.model), ("--model", clf.path)]
    check_output(args.out, inputs, folder=not args.out.endswith(".safetensors"),
                 overwrite=args.overwrite)
    if not args.out.endswith(".safetensors"):  # a folder: the two files written into it
        for name in ("model.safetensors", "config.json", CLASS_MAP):
            check_output(Path(args.out) / name, inputs, overwrite=args.overwrite)
    norm = {"toy.pixel_scale": clf.scale, "toy.pixel_mean": clf.mean.tolist(),
            "toy.pixel_std": clf.std.tolist()}
    files = export_timm(args.out, clf.model, norm, clf.names)
    if args.out.endswith(".safetensors"):  # the weights alone: timm needs the model's shape
        kwargs = ", ".join(f"{k}={v!r}" for k, v in timm_model_args(clf.model.args).items())
        load = f"timm.create_model({TIMM_ARCH!r}, {kwargs}) and load_state_dict"
    else:  # a folder with config.json: timm reads the shape and the weights from it
        load = (f"timm.create_model('local-dir:{args.out.rstrip('/')}', pretrained=True) "
                f"(and its classes' order: create_dataset(..., class_map="
                f"'{Path(args.out) / CLASS_MAP}'))")
    print(f"{PROG}: wrote {', '.join(map(str, files))} from {clf.path} in "
          f"{time.perf_counter() - t0:.1f} s; load with {load}; "
          f"inputs NCHW, (pixels / 255 - mean) / std with mean "
          f"{[round(float(v), 4) for v in clf.mean]}, std {[round(float(v), 4) for v in clf.std]}",
          file=sys.stderr)
    return 0


def export_modelfile(args: Args) -> int:
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.interop.modelfile import write_modelfile

    if not args.adapter and args.base and not args.model:  # a from-scratch or warm-start model
        from toymlx.gguf.reader import read_metadata, refuse_adapter

        gguf = checkpoint_file(args.base, "--base", check_digest=False).absolute()
        refuse_adapter(gguf, read_metadata(gguf))  # a LoRA run given as --base: its own line
        raise ValueError(f"--format modelfile: expected --adapter (a LoRA run or adapter GGUF), "
                         f"found --base {args.base} alone: a model with no adapter takes a "
                         f"Modelfile of one line, FROM {gguf} (then ollama create NAME -f "
                         "Modelfile)")
    if not args.adapter or args.model or (args.dtype and not args.fuse):
        raise ValueError("--format modelfile: expected --adapter (a LoRA run or adapter GGUF), "
                         "--out DIR and optionally --base, --fuse and --dtype (with --fuse), "
                         "found " + ("no --adapter" if not args.adapter else
                                     "--model" if args.model else "--dtype without --fuse"))
    t0 = time.perf_counter()
    path, base, adapter, fused = write_modelfile(args.out, args.adapter, args.base,
                                                 fuse=args.fuse, dtype=args.dtype,
                                                 progress=draws_bars(),
                                                 overwrite=args.overwrite)
    what = f"FROM {base.path}, ADAPTER {adapter}"
    if fused:
        from toymlx.training.fused import adapter_retention, kept_note

        kind = args.dtype or "each adapted tensor in a type that keeps its change"
        what = (f"FROM {fused} ({fused.stat().st_size / 2**20:.1f} MiB: {base.path} + {adapter} "
                f"fused, {kind}; it "
                f"{kept_note(adapter_retention(fused, base.path, adapter), args.dtype or 'its')})")
    print(f"{PROG}: wrote {path} ({what}) in {time.perf_counter() - t0:.1f} s; create the "
          f"Ollama model with: ollama create NAME -f {shlex.quote(str(path))}", file=sys.stderr)
    if fused:
        print(f"{PROG}: {heldout_note(base.path, args.adapter, fused, args.dtype, args.held_out)}",
              file=sys.stderr)
    return 0


def export_mlx_lm(args: Args) -> int:
    """--adapter as mlx-lm's adapter folder (or its adapters.safetensors): converted for --base
    to an adapter GGUF (`write_adapter_for`: llama's q/k rows in the GGUF's order), written as
    --out (llama.cpp's LoRA format) or, with --fuse, fused into the base."""
    import tempfile

    from toymlx.backend.atomic import atomic_open, output_folder
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.interop.merge import write_merged
    from toymlx.training.adapter import write_adapter_for
    from toymlx.training.fused import adapter_retention, kept_note, write_fused_kept

    if not args.base:
        raise ValueError(f"{args.adapter}: --base: expected the GGUF the mlx-lm adapter goes on "
                         "(its adapter_config.json names a Hugging Face model, not a GGUF), "
                         "found none; pass --base")
    if args.exact_size:
        raise ValueError(f"{args.adapter}: --exact-size: expected a LoRA run folder (its training "
                         "rows give each layer's inputs), found mlx-lm's adapters")
    if args.dtype and not args.fuse:
        raise ValueError("--dtype: only applies to a written model (with --fuse or without "
                         "--adapter); an adapter is written as F32")
    base = checkpoint_file(args.base, "--base", check_digest=False)
    out = check_output(args.out, [("--base", args.base), ("--base", base),
                                  ("--adapter", args.adapter)], overwrite=args.overwrite)
    gguf_name(out)
    base = checkpoint_file(args.base, "--base")  # an Ollama blob's SHA-256: the whole base read
    t0 = time.perf_counter()
    with (output_folder(out.parent),  # the folders --out needs, removed again if it fails
          tempfile.TemporaryDirectory(prefix="toymlx-export-") as tmp):
        gguf, kind = write_adapter_for(Path(tmp) / f"{Path(args.adapter).stem}.gguf",
                                       args.adapter, base)
        if not args.fuse:
            if kind != "lora":
                raise ValueError(f"{args.adapter}: --adapter: expected a LoRA adapter to write "
                                 "for llama.cpp, found a DoRA adapter (llama.cpp has no DoRA "
                                 "format); add --fuse to write the full model llama.cpp runs")
            with open(gguf, "rb") as f, atomic_open(out) as dst:
                shutil.copyfileobj(f, dst)
            what = f"mlx-lm adapter {args.adapter}, as llama.cpp's LoRA adapter for {args.base}"
        elif args.dtype:
            write_merged(out, base, gguf, args.dtype, progress=draws_bars())
            what = (f"{args.base} + mlx-lm adapter {args.adapter} (fused) in {args.dtype}; it "
                    + kept_note(adapter_retention(out, base, gguf), args.dtype))
        else:
            kept = write_fused_kept(out, base, gguf, progress=draws_bars())
            what = f"{args.base} + mlx-lm adapter {args.adapter} (fused): {kept.summary()}"
    print(f"{PROG}: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {what} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.fuse and args.dtype and (left := unquantized_note(out, args.dtype)):
        print(f"{PROG}: warning: {out}: {left}", file=sys.stderr)
    return 0


def run(args: Args) -> int:
    from toymlx.backend.atomic import atomic_open, output_folder
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.gguf.llama import load_llama
    from toymlx.gguf.reader import GGUFFile, refuse_adapter
    from toymlx.interop.merge import fine_tune_base, write_fused_exact, write_merged
    from toymlx.runner.bundle import fused_run_data
    from toymlx.training.adapter import apply_adapter, load_adapter
    from toymlx.training.fused import (
        KEPT_WARNING,
        adapter_kept,
        adapter_retention,
        kept_note,
        write_full_kept,
        write_fused_kept,
    )
    from toymlx.training.mlx_lm_adapter import mlx_lm_files

    if not args.held_out and not (args.adapter and args.fuse):
        raise ValueError("--no-held-out: expected with --adapter and --fuse (it skips the fused "
                         "file's held-out loss), found "
                         + ("no --adapter" if not args.adapter else "no --fuse"))
    if args.format == "modelfile":
        return export_modelfile(args)
    if args.format == "safetensors" or args.model:
        if args.format != "safetensors":
            raise ValueError(f"--model: expected with --format safetensors (a ViT for timm), "
                             f"found --format gguf; a language model's run or GGUF is exported "
                             f"with --base (toymlx-export --base {args.model} --out {args.out}"
                             f"{' --dtype ' + args.dtype if args.dtype else ''}), and a run's "
                             "checkpoints are GGUFs llama.cpp loads as they are")
        if not args.model:
            raise ValueError("--format safetensors: expected --model (a ViT run or checkpoint), "
                             "found none")
        return export_vit(args)
    if args.fuse and not args.adapter:
        raise ValueError("--fuse: expected --adapter (the adapter to merge), found none")
    if args.adapter and mlx_lm_files(args.adapter) is not None:
        return export_mlx_lm(args)
    base_spec = args.base or run_base_of(args.adapter)
    if args.base and args.adapter and (note := base_note(args.base, args.adapter)):
        print(f"{PROG}: {note}", file=sys.stderr)
    # a path, a run, or ollama:NAME / lmstudio:NAME / hf:...; an Ollama blob's SHA-256 (a read
    # of the whole base) after the cheap refusals: the output, the flags
    base = checkpoint_file(base_spec, "--base", check_digest=False)
    adapter = checkpoint_file(args.adapter, "--adapter") if args.adapter else None
    out = check_output(args.out, [("--base", base_spec), ("--base", base),
                                  ("--adapter", args.adapter), ("--adapter", adapter)],
                       overwrite=args.overwrite)
    gguf_name(out)
    if args.exact_size and (not args.fuse or args.dtype):
        raise ValueError("--exact-size: expected with --fuse and without --dtype (it writes the "
                         f"base's own types), found {'--dtype' if args.dtype else 'no --fuse'}")
    base = checkpoint_file(base_spec, "--base")
    meta = GGUFFile(base).metadata
    # an adapter as --base beside --adapter said "expected a projection weight of the base
    # ADAPTER": the option and the base to give instead (the adapter's `toy.base`)
    refuse_adapter(base, meta, "--base" if args.adapter else None)
    if meta.get("general.architecture") == "vit":  # was "expected one of
        # llama, ..., found 'vit'", nothing of the export a ViT has
        raise ValueError(f"{base}: --base: expected a language model, found 'vit', an image "
                         "classifier (its checkpoint is a GGUF already); for timm: "
                         f"{PROG} --model {base_spec} --format safetensors --out DIR")
    t0 = time.perf_counter()
    # the folders --out needs, made here and removed again (where empty) if the write fails
    with output_folder(out.parent):
        if args.adapter and not args.fuse:
            if args.dtype:
                raise ValueError("--dtype: only applies to a written model (with --fuse or "
                                 "without --adapter); an adapter is written as F32")
            src = checkpoint_file(args.adapter, "--adapter")
            if load_adapter(src).kind != "lora":
                raise ValueError(f"{src}: --adapter: expected a LoRA adapter to write for "
                                 "llama.cpp, found a DoRA adapter (toymlx's own format: "
                                 "llama.cpp has none); add --fuse to write the full model "
                                 "llama.cpp runs")
            model, _ = load_llama(base, weights="blocks")  # the adapter checked against the base
            apply_adapter(model, src)
            with open(src, "rb") as f, atomic_open(out) as dst:
                shutil.copyfileobj(f, dst)
            what = f"adapter {src}"
        elif args.exact_size:
            _, share = write_fused_exact(out, base, args.adapter, progress=draws_bars())
            what = (f"{base_spec} + adapter {args.adapter} (fused in the base's own types, "
                    f"rounded on the run's activations); it keeps {share:.0%} of the adapter's "
                    f"change on those activations, {adapter_kept(out, base, args.adapter):.0%} "
                    "on isotropic inputs" + (
                        " (warning: the rest is below the base's rounding step; export without "
                        "--exact-size, or run the base with the adapter)"
                        if share < KEPT_WARNING else ""))
        elif args.adapter and not args.dtype:
            # the file records the run's data settings: toymlx-eval rebuilds its rows
            kept = write_fused_kept(out, base, args.adapter, progress=draws_bars(),
                                    run_data=fused_run_data(args.adapter))
            what = f"{base_spec} + adapter {args.adapter} (fused): {kept.summary()}"
        elif not args.dtype and (trained_from := fine_tune_base(base_spec)) is not None:
            kept = write_full_kept(out, trained_from, base, progress=draws_bars(),
                                   run_data=fused_run_data(base, "--base"))
            what = f"{base_spec} (a full fine-tune of {trained_from}): {kept.summary()}"
        else:
            write_merged(out, base, args.adapter, args.dtype, progress=draws_bars())
            # a run folder: the checkpoint read, as toymlx-generate names it (latest moves on)
            what = (f"{base if Path(base_spec).is_dir() else base_spec}"
                    + (f" + adapter {args.adapter} (fused)" if args.adapter else ""))
            if args.adapter:
                what += (f" in {args.dtype}; it "
                         + kept_note(adapter_retention(out, base, args.adapter), args.dtype))
    print(f"{PROG}: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {what} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.dtype and (left := unquantized_note(out, args.dtype)):
        print(f"{PROG}: warning: {out}: {left}", file=sys.stderr)
    if args.adapter and args.fuse:
        print(f"{PROG}: {heldout_note(base, args.adapter, out, args.dtype, args.held_out)}",
              file=sys.stderr)
    return 0


def gguf_name(out: Path) -> None:
    """ValueError unless the GGUF `out` is to be is named *.gguf: LM Studio lists only such
    files, and a `lm.txt` or `model` written as a GGUF would be mistaken for what it is not."""
    if out.suffix.lower() != ".gguf":
        raise ValueError(f"{out}: --out: expected a .gguf file name (the GGUF it writes; LM "
                         f"Studio and llama.cpp's tools name them so), found "
                         f"{repr(out.suffix) if out.suffix else 'no suffix'}; use --out "
                         f"{out.with_name(out.stem + '.gguf') if out.suffix else str(out) + '.gguf'}")


def base_note(base: str, adapter: str) -> str | None:
    """What to say where --base is not the base file the --adapter's run recorded: where it
    reads that base from, where --base holds it from another place ("reads --base from X
    (moved; same contents as the run's Y)", `adopt_input`); a note where --base is a file of
    other contents (another quantization of it, a sibling model of the same shape, or a slip),
    exported as given, as llama.cpp applies an adapter to any base it fits, but not without a
    word. None where it is that file, or nothing is recorded. --base is hashed once."""
    import os

    from toymlx.bundle.inputs import MODEL_FILES_KEY, OtherContents, adopt_input
    from toymlx.bundle.options import RunError
    from toymlx.runner.bundle import Bundle

    try:
        bundle = Bundle.of(adapter, "--adapter")
        rec = bundle.saved.get(MODEL_FILES_KEY, {}).get("base") if bundle is not None else None
        if not isinstance(rec, dict) or not isinstance(rec.get("file"), str):
            return None
        adopted = adopt_input("base", rec, base, bundle.config)
    except OtherContents as e:
        return (f"note: --base {base} ({e.found}) is not the base the run {bundle.path} trained "
                f"on ({rec['file']}, {e.recorded}): the adapter is applied to it as given"
                ) if os.path.isfile(base) else None
    except (RunError, OSError):  # no run read, or --base missing: export refuses it later
        return None
    return f"reads --base from {adopted[1]}" if adopted is not None else None


def run_base_of(adapter: str | None) -> str:
    """The base to export when --base is not given: the one the --adapter's LoRA run (or its
    adapter GGUF's `toy.base`) records; says which file that is."""
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.gguf.reader import read_metadata
    from toymlx.interop.modelfile import lora_run_base
    from toymlx.runner.bundle import run_base

    if adapter is None:
        raise ValueError("--base: expected the llama GGUF to export (or --model with --format "
                         "safetensors for a ViT), found none")
    found = run_base(adapter, "--adapter")
    ckpt = checkpoint_file(adapter, "--adapter")
    base = found[0] if found is not None else lora_run_base(adapter, ckpt)
    if base is None and ckpt.is_file() and read_metadata(ckpt).get("general.type") != "adapter":
        # a from-scratch or warm-start run, or a model: there is no base, it is one
        raise ValueError(f"{adapter}: --adapter: expected a LoRA adapter or a LoRA run, found "
                         f"a model ({ckpt}); export a model as --base {ckpt}")
    if base is None:
        raise ValueError(f"--base: expected the GGUF {adapter} was trained on (not recorded by "
                         "its run or adapter), found none; pass --base")
    print(f"{PROG}: no --base given: base {found[1] if found is not None else base}",
          file=sys.stderr)
    return base


def heldout_note(base: Path, adapter: str, fused: Path, dtype: str | None = None,
                 score: bool = True) -> str:
    """The held-out loss of the fused file beside the base's and base + adapter's, on the
    validation rows the adapter's run scores at each evaluation (`run_rows`: the first
    --eval-batches x --batch-size, as toymlx-eval scores by default), and the share of the
    fine-tune's gain the file keeps (`gain_note`, with the gain's standard error from the rows'
    paired losses, `gain_error`; `dtype`: the --dtype every tensor was rounded to, if any).
    Base + adapter's is the run's own figure where it validated the adapter's step in float32
    (`run_val_loss`), the base's the run's step-0 validation (--eval-at-start; a run from a
    zero adapter, on this base), else each is scored here, on the same rows, as toymlx-eval
    scores; its rows' own losses for the standard error are the run's too where its event
    recorded them (`run_val_rows`), else that model is scored here row by row all the same
    (a run from before the events held them): one pass, the fused file's, where the run has
    both. Or why it was not measured: an adapter outside a run, the run's data gone, no row
    held out, or `score` False (--no-held-out). A progress bar on a terminal names each
    pass."""
    import numpy as np
    from toymlx_cli.eval import chat_loss, gone_run_data, run_rows

    from toymlx.backend.device import on_gpu
    from toymlx.backend.files import counted
    from toymlx.bundle.checkpoint import checkpoint_file, checkpoint_step
    from toymlx.generation.generate import load_for_generation
    from toymlx.gguf.llama import frozen_weights
    from toymlx.models.ops import scoring_ops
    from toymlx.runner.bundle import Bundle

    bundle = Bundle.of(adapter, "--adapter")
    if bundle is None or bundle.recipe != "lora":
        return ("held-out loss not measured: the adapter is a file outside a run, so its "
                "validation data is not known (toymlx-eval --model FUSED --data.path DATA "
                "measures it)")
    if not score:
        return (f"held-out loss not measured (--no-held-out): toymlx-eval --model {fused} "
                "scores it on the run's validation rows")
    if gone := gone_run_data(bundle):
        return (f"held-out loss not measured: {gone} (toymlx-eval --model {fused} --data.path "
                "DATA measures it)")
    cfg = bundle.config
    pick = run_rows(cfg)
    step = checkpoint_step(checkpoint_file(adapter, "--adapter"))
    own = trained_on(bundle, base)  # the run's figures are of this base
    ref = run_val_loss(bundle.events, step) if own else None
    # step 0 is the base alone where the adapter started at zero (lora_b = 0; DoRA's m = |W|)
    start = run_val_loss(bundle.events, 0) if own and not cfg.lora.init_adapter else None
    start_rows = run_val_rows(bundle.events, 0) if start is not None else None
    tuned_rows = run_val_rows(bundle.events, step) if ref is not None else None

    start_from = "the run's step-0 validation" if start is not None else "scored here"
    ref_from = f"the run's step-{step} validation" if ref is not None else "scored here"

    def loss(what: str, *paths: Path | str) -> HeldOut:
        # loaded and scored as toymlx-eval scores (on a CPU the run's float32 kernels)
        gpu = on_gpu()
        model = load_for_generation(*paths, weights=frozen_weights(gpu), ops=scoring_ops(gpu))
        return chat_loss(*model, cfg, pick=pick, per_row=True,
                         progress=f"{PROG}: held-out loss, {what}")

    recorded = next((len(r.n) for r in (tuned_rows, start_rows) if r is not None), None)
    passes = ["the fused file", *(["the base"] if start_rows is None else []),
              *(["base + adapter"] if tuned_rows is None else [])]
    names = " and ".join([", ".join(passes[:-1]), passes[-1]] if len(passes) > 1 else passes)
    print(f"{PROG}: scoring the held-out loss of {names} on the run's "
          + (f"{counted(recorded, 'validation row')}" if recorded is not None else
             f"validation rows ({eval_rows(cfg)})")
          + ", to say how much of the fine-tune the file keeps (--no-held-out skips it)",
          file=sys.stderr, flush=True)
    try:
        held = loss("fused file", fused)
        # the run's rows are these rows where each holds the trained tokens the fused pass's
        # does (the data unchanged since), else that model is scored here
        start_rows, tuned_rows = (r if r is not None and np.array_equal(r.n, held.row_n)
                                  else None for r in (start_rows, tuned_rows))
        if start_rows is None:
            at_start = loss("base", base)
            start = at_start.loss if start is None else start
            start_rows = RowLosses(at_start.row_loss, at_start.row_n)
        if tuned_rows is None:
            tuned = loss("base + adapter", base, adapter)
            ref = tuned.loss if ref is None else ref
            tuned_rows = RowLosses(tuned.row_loss, tuned.row_n)
    except ValueError as e:  # DataError: the run's data moved or gone; or it held out no row
        # (a ValueError naming --data.val-fraction): the file is written all the same
        return (f"held-out loss not measured: {e} (toymlx-eval --model {fused} --data.path "
                "DATA measures it)")
    got, n = held.loss, held.rows
    change = (f"{(got - ref) / ref:+.2%}" if math.isfinite(ref) and math.isfinite(got) and ref
              else "no change to give: a loss is not finite")
    rows = "the validation row" if n == 1 else f"the {n} validation rows"
    error = gain_error(start_rows.loss, tuned_rows.loss, tuned_rows.n)
    return (f"held-out loss on {rows} the run scores ({held.source}; {eval_rows(cfg)}): "
            f"base {start:.4f} ({start_from}), base + adapter {ref:.4f} ({ref_from}), fused "
            f"file {got:.4f} ({change}); "
            f"{gain_note(start, ref, got, regrid(base, dtype), error, n)}")


def eval_rows(cfg: Any) -> str:
    """Which validation rows the run of config `cfg` scores, as its flags say it."""
    return ("all of them, --eval-batches -1" if cfg.eval_batches == -1 else
            f"the first --eval-batches {cfg.eval_batches} x --batch-size {cfg.batch_size}")


def gain_error(base_rows: Any, tuned_rows: Any, counts: Any) -> float:
    """The standard error of a held-out gain, base - tuned, each loss the mean over the trained
    tokens of the same rows: `base_rows` and `tuned_rows` each row's summed loss, `counts` its
    trained tokens. The rows are the units (tokens of a row are not independent): with the
    paired differences d_i = base_i - tuned_i, N = sum n_i and the gain G = sum d_i / N, the
    ratio estimator's sqrt(R / (R - 1) * sum (d_i - G n_i)^2) / N over the R rows that hold a
    trained token; NaN for fewer than 2 such rows (no spread to measure)."""
    import numpy as np

    d = np.asarray(base_rows, np.float64) - np.asarray(tuned_rows, np.float64)
    n = np.asarray(counts, np.float64)
    d, n = d[n > 0], n[n > 0]
    if len(n) < 2:
        return math.nan
    gain = d.sum() / n.sum()
    return float(math.sqrt(len(n) / (len(n) - 1) * ((d - gain * n) ** 2).sum()) / n.sum())


def gain_note(base: float, tuned: float, fused: float, dtype: str | None = None,
              error: float | None = None, rows: int | None = None) -> str:
    """What the fused file keeps of the fine-tune's held-out gain, from the three losses: the
    share (base - fused) / (base - tuned) in words, or plainly why there is no share (no gain,
    a loss worse than the base's, a loss not finite). With the gain's standard error `error`
    over `rows` validation rows (`gain_error`): a gain within `NOISE_ERRORS` of them of zero,
    or from fewer than `MIN_GAIN_ROWS` rows, is said to be within noise instead of a share
    (on one or two rows a share read 117% or 5%), and a share says the gain's error. Below
    `KEPT_WARNING` where --dtype `dtype` rounded the base's own tensors onto another grid
    (`regrid`), it says so: a cost of its own, not the fine-tune's."""
    from toymlx.backend.files import counted
    from toymlx.training.fused import KEPT_WARNING

    if not all(map(math.isfinite, (base, tuned, fused))):
        return "no share of the fine-tune's gain to give: a loss is not finite"
    gain = base - tuned
    if gain < GAIN_STEP:  # none, or below the figures' printed precision
        return ("the fine-tune made no held-out gain to keep: base + adapter's loss is "
                + (f"{-gain:.4f} above the base's" if gain <= -GAIN_STEP else
                   "the base's to 4 decimals"))
    measured = ""
    if rows is not None:
        on = f"the fine-tune's held-out gain on {counted(rows, 'validation row')}"
        more = "more validation rows (--data.val-fraction, or a larger valid.jsonl) measure it"
        if rows < MIN_GAIN_ROWS or error is None or not math.isfinite(error):
            spread = f" +- {error:.4f}" if error is not None and math.isfinite(error) else ""
            # a spread from so few rows is no measure of the noise, however small it reads
            return (f"{on} cannot be told from noise on so few rows ({gain:.4f}{spread} nats; "
                    f"fewer than {MIN_GAIN_ROWS} rows measure no noise, nor give a share of it)"
                    f": {more}")
        if gain < NOISE_ERRORS * error:
            return (f"{on} is within noise ({gain:.4f} +- {error:.4f} nats, under "
                    f"{NOISE_ERRORS:g} standard errors): {more}")
        measured = f"; {on}: {gain:.4f} +- {error:.4f} nats"
    share = (base - fused) / gain
    if share > 1:
        note = (f"the fused file keeps all of the fine-tune's held-out gain ({share:.0%}: its "
                f"loss is {tuned - fused:.4f} below base + adapter's)")
    elif share < 0:
        note = (f"the fused file keeps none of the fine-tune's held-out gain (its loss is "
                f"{fused - base:.4f} above the base's)")
    else:
        note = f"the fused file keeps {share:.0%} of the fine-tune's held-out gain"
    if dtype and share < KEPT_WARNING:
        note += (f"; --dtype {dtype} rounded the base's own tensors onto its grid too, which "
                 "costs held-out loss of its own")
    return note + measured


GAIN_STEP = 5e-5
"""The smallest held-out gain `gain_note` gives a share of: half the last printed decimal, where
two losses printed to 4 decimals would read the same."""

NOISE_ERRORS = 2.0
"""A held-out gain under this many standard errors (`gain_error`) is within noise: about the
95% two-sided bound, where a share of it would be a ratio of noise."""

MIN_GAIN_ROWS = 5
"""Fewer validation rows than this give no share: their standard error rests on too few
differences to bound the gain (with 2 rows, one degree of freedom)."""


def regrid(base: Path, dtype: str | None) -> str | None:
    """`dtype` where an export --dtype `dtype` rounds the base's own tensors onto another grid
    (it is not the base's type, `export_type`); None where they keep their values."""
    from toymlx.gguf.quantize import export_type
    from toymlx.gguf.reader import GGUFFile

    if not dtype:
        return None
    with GGUFFile(base) as g:
        return dtype if dtype.lower() != export_type(g) else None


def trained_on(bundle: Bundle, base: Path) -> bool:
    """Whether `base` holds the base the LoRA run `bundle` trained on (its file, or the same
    contents elsewhere: `Bundle.given_input`): the run's own validation figures are then of
    this base, where another base (a --base given to the export) needs its own."""
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.bundle.options import RunError

    try:
        recorded = checkpoint_file(bundle.config.base, "--base", check_digest=False)
    except (RunError, OSError, ValueError):
        return False
    return (recorded.resolve() == Path(base).resolve()
            or bundle.given_input("base", str(base)) is not None)


class RowLosses(NamedTuple):
    """Each validation row's summed loss and trained tokens, in the order the run batches them
    (`toymlx_cli.eval.run_rows`)."""

    loss: Any
    """(rows,) float64"""
    n: Any
    """(rows,) the row's trained tokens"""


ROWS_RTOL = 1e-5
"""How far the mean of a run's recorded rows (`run_val_rows`) may be from its val_loss,
relative: the run adds each micro-batch's float32 sum where the rows are float32 sums of one
row each, so the two agree to float32 rounding (about 1e-7 on the runs measured), not
bit for bit; rows of other data or another model are off by far more."""


def run_val_rows(events: list[dict], step: int) -> RowLosses | None:
    """The rows' own losses of the run's validation at `step` (the event `run_val_loss` takes
    its figure from: `val_row_loss`, `val_row_n`, recorded by runs since session 48), None
    where it recorded none or they do not add up to its val_loss (`ROWS_RTOL`), so that the
    export scores that model again."""
    import numpy as np

    ev = run_val_event(events, step)
    loss, n = (ev or {}).get("val_row_loss"), (ev or {}).get("val_row_n")
    if not (isinstance(loss, list) and isinstance(n, list) and len(loss) == len(n) > 0
            and all(isinstance(x, float) for x in loss)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in n)):
        return None
    rows = RowLosses(np.asarray(loss, np.float64), np.asarray(n, np.float64))
    total = rows.n.sum()
    if not total or abs(rows.loss.sum() / total - ev["val_loss"]) > ROWS_RTOL * abs(
            ev["val_loss"]):
        return None
    return rows


def run_val_event(events: list[dict], step: int | None) -> dict | None:
    """The `eval` event `run_val_loss` takes its figure from, None where there is none."""
    from toymlx.bundle.events import run_start

    if step is None:
        return None
    start = run_start(events) or {}
    math_ = start.get("math") or {}
    base_dtype = (start.get("config") or {}).get("base_dtype_resolved", "float32")
    if math_.get("dtype") != "float32" or base_dtype in ("bfloat16", "float16"):
        return None
    found = [e for e in events if e.get("kind") == "eval" and e.get("step") == step
             and e.get("split", "val") == "val" and isinstance(e.get("val_loss"), float)]
    return found[-1] if found else None


def run_val_loss(events: list[dict], step: int | None) -> float | None:
    """The run's own validation loss of the model at `step` (the last `eval` event of the
    validation split there), where the run computed in float32 (its `run_start`'s math): the
    figure the export would score again for base + adapter (at step 0, --eval-at-start's: the
    base), on the same rows. None where there is none (a run stopped before its final
    validation) or the run's math rounded to a narrower type (bfloat16, float16), which the
    export's float32 scoring would not match (`run_val_event`)."""
    ev = run_val_event(events, step)
    return None if ev is None else ev["val_loss"]


@console_command("toymlx-export")
def main(argv: list[str] | None = None) -> int:
    # Ctrl-C, a kill or a closed terminal stops an export at once, as toymlx-train before its
    # loop: the write in flight removes its temporaries (SIGINT too where a script started the
    # export in the background, which Python would otherwise go on ignoring)
    with stops_raise(SIGNALS):
        return run_command(PROG, Args, run, argv, (ValueError, OSError, KeyError, TypeError),
                           outputs=("out",))


if __name__ == "__main__":
    sys.exit(main())
