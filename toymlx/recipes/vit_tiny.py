"""Recipe `vit-tiny`: a ViT-Tiny image classifier trained from scratch.

With no arguments it trains on the UCI 8x8 handwritten digits in `toymlx/fixtures/digits/`;
`--data.path` takes a folder of class subfolders of images (ImageFolder), CIFAR-10/100 python
batches, MNIST/Fashion-MNIST IDX files (or their folder) or a `.npz` with x/y. The preset
follows the data's image shape unless `--model.preset` says otherwise, and the augmentation
follows the image and set size (`augment_for`) unless a `--data.*` flag says otherwise.
`--data.test-path` names a held-out test set that `--test` scores once, at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from toymlx.data.image_folder import split_folders
from toymlx.data.images import (
    Augment,
    ImageSet,
    Prefetcher,
    files_read,
    load_images,
    source_files,
)
from toymlx.gguf.vit import RECORDED_CLASS_NAMES, class_names_sha256, load_vit, write_vit
from toymlx.models.checks import ArgsError
from toymlx.models.losses import classify_metrics
from toymlx.models.ops import Ops
from toymlx.models.vit import PRESETS, ViT, ViTArgs
from toymlx.training.task import (
    Task,
    TrainConfig,
    check_batch_fits,
    model_error,
    preset_overrides,
)

AUTO_PATCH_8 = (8, 4)
"""(image side, patch side): preset auto trains 8x8 images with 4x4 patches (measured faster and
more accurate than the vit-tiny-8 preset's 2x2 patches; see ViTOptions.patch_size)."""


@dataclass
class ViTOptions:
    """Shape of the ViT: a preset (ViT-Tiny body 192 wide, 12 blocks, 3 heads) with overrides."""

    preset: Literal["auto", "vit-tiny", "vit-tiny-28", "vit-tiny-8"] = "auto"
    """auto: vit-tiny-8 (with 4x4 patches) for 8x8 images, vit-tiny-28 for 28x28, vit-tiny for
    224x224, and the Tiny body with the patch whose grid is nearest 8x8 for other sizes (32 px:
    4, 64 px: 8)."""
    patch_size: int | None = None
    """Patch side in pixels. Default: 4 for 8x8 images under preset auto (a 2x2 grid, 4 tokens +
    cls: on the digits 96.7-100% held-out over seeds 0-4 in 400 steps at 0.19-0.23 s/step,
    against 96.1-98.3% in 600 steps at 0.59 s/step with the vit-tiny-8 preset's 2x2 patches;
    docs/RESULTS.md), else the preset's."""
    d_model: int | None = None
    """Embedding width (default 192)."""
    n_layers: int | None = None
    """Transformer blocks (default 12)."""
    n_heads: int | None = None
    """Attention heads (default 3)."""
    ffn_dim: int | None = None
    """MLP hidden width (default 768)."""
    gelu: Literal["erf", "tanh", "fast"] | None = None
    """GELU form: erf (timm's, exact) or the tanh / sigmoid approximations."""
    drop_path: float | None = None
    """Stochastic depth: the largest rate at which a block's residual branches are dropped per
    image in training, rising linearly from 0 at the first block (timm's drop_path_rate;
    default 0)."""


@dataclass
class ImageData:
    """Labelled images to train on, and what augments them (auto: chosen by image size and
    set size; see augment_for and docs/RESULTS.md)."""

    path: str | None = None
    """A folder of class subfolders of images (ImageFolder), CIFAR-10/100 python batches (folder,
    .tar.gz or one batch file), IDX images file or folder, or .npz with x/y; default: the UCI
    8x8 digits fixture."""
    val_path: str | None = None
    """A separate validation set in any of those formats (default: a fixed split of path; a
    CIFAR folder or archive, or an MNIST folder with t10k files: its official test set)."""
    test_path: str | None = None
    """A held-out test set in any of those formats, every image of it scored once by --test
    at the end (never trained on, validated on, or used by --keep-best)."""
    val_fraction: float = 0.1
    """Fraction held out for validation when path has no split of its own (a fixed split, the
    same for every seed)."""
    image_size: int | None = None
    """Side the images are resized and centre-cropped to (default: the data's own; a folder of
    mixed sizes: 224)."""
    channels: Literal[1, 3] | None = None
    """1 (grey) or 3 (RGB) (default: 3 when any image has colour)."""
    augment: bool | None = None
    """Train-time augmentation at all (default: on for images of 16 px and more; on the 8x8
    digits 1-pixel shifts slowed learning: 49% vs 89% held-out at step 200; on MNIST shifts of
    2 px cost accuracy in 1,500 steps and paid off in 4,000, docs/RESULTS.md)."""
    crop: Literal["shift", "resized", "none"] | None = None
    """Random crop: shift (of the image padded by max_shift zero pixels), resized (timm's
    RandomResizedCrop, area >= crop_scale) or none (default: shift up to 64 px, else resized)."""
    max_shift: int | None = None
    """Largest shift in pixels per axis for crop shift (default: 2 for grey images, as for
    MNIST; 1/8 of the side for colour ones, CIFAR's 4 at 32 px)."""
    crop_scale: float = 0.35
    """Smallest crop area for crop resized, as a fraction of the image."""
    flip: bool | None = None
    """Random horizontal flips (default: on for colour images, off for grey ones such as
    digits, where orientation matters)."""
    trivial_augment: bool = False
    """TrivialAugment: one random op (shear, translate, rotate, brightness, contrast, ...) of
    random strength per image. Off by default: on MNIST it slowed learning far more than these
    short CPU schedules can repay (69% vs 82% held-out at step 500 of 1500, with shifts in both;
    docs/RESULTS.md); turn it on for long schedules."""
    mixup: float | None = None
    """Mixup: images mixed as lam * x + (1 - lam) * x[perm], the loss mixed the same way, lam ~
    Beta(mixup, mixup) per micro-batch (0: off). Default: 0.4 when there are fewer than 5,000
    training images (the digits: 93.9% -> 96.7% held-out), else off (see docs/RESULTS.md)."""
    cutmix: float = 0.0
    """Cutmix Beta parameter (0: off); with mixup too, one of the two per micro-batch."""
    stream: bool | None = None
    """Decode an image folder from disk for each batch instead of holding it in memory
    (default: when its decoded training images exceed 2 GB)."""
    workers: int = 2
    """Background threads that decode and augment the next steps' batches while the step
    runs (0: in the training thread). Batches are the same either way."""

    @staticmethod
    def reads_only(path: str, test: bool) -> tuple[str, ...] | None:
        """The extensions of the files read in the data folder `path` (`images.files_read`):
        what the run's record of its data (config.json's data_files) covers. `test` (--test)
        adds none: the test images are --data.test-path, recorded as their own."""
        return files_read(path)


@dataclass
class Config(TrainConfig):
    """toymlx-train --recipe vit-tiny: train a ViT-Tiny image classifier from scratch."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-4
    warmup: int = 60
    weight_decay: float = 0.05
    beta2: float = 0.999
    eval_every: int = 100
    eval_batches: int = 1000
    label_smoothing: float = 0.1
    """Training targets (1 - eps) one-hot + eps uniform over the classes (held-out loss is
    plain cross-entropy)."""
    model: ViTOptions = field(default_factory=ViTOptions)
    data: ImageData = field(default_factory=ImageData)
    test: bool = False
    """At the end of a completed run, score --data.test-path: test_loss and test_accuracy over
    every image, an `eval` event with split "test" (later: `toymlx-eval --model RUN --split
    test`). A CIFAR or MNIST folder as --data.path already validates on its official test set
    (test_batch, t10k) at every eval; --test scores a test set of its own."""

def smoothed_loss(eps: float):
    """Label-smoothed cross-entropy, optionally mixed between two label sets (mixup):
    CE with targets (1 - eps) one-hot(y) + eps / K = CE(y) + eps * (z_y - mean_k z_k)."""
    def loss(model, batch):
        logits = model(batch["images"]).astype(mx.float32)  # (B, K)
        z_mean = logits.mean(-1)

        def ce(labels):
            picked = mx.take_along_axis(logits, labels[:, None], -1)[:, 0]
            return model.ops.cross_entropy(logits, labels) + eps * (picked - z_mean)

        out = ce(batch["labels"])
        if "mix_labels" in batch:  # mixup: lam (B,) per image, the same within a batch
            lam = batch["mix_lam"]
            out = lam * out + (1.0 - lam) * ce(batch["mix_labels"])
        return out.mean(), mx.array(batch["labels"].shape[0], dtype=mx.float32)

    return loss


def augment_for(d: ImageData, shape: tuple[int, int, int], n_train: int) -> Augment:
    """The augmentation a run gets: each field as given, else the measured default for this
    image size and set size (docs/RESULTS.md, "vit-tiny on the images people bring")."""
    side, channels = shape[0], shape[2]
    on = d.augment if d.augment is not None else side >= 16
    mixup = d.mixup if d.mixup is not None else (0.4 if n_train < 5000 else 0.0)
    if not on:
        return Augment(mixup=mixup, cutmix=d.cutmix)
    crop = d.crop or ("shift" if side <= 64 else "resized")
    pad = 2 if channels == 1 else max(1, side // 8)  # MNIST's usual +-2; CIFAR's pad 4 at 32
    return Augment(crop=crop, pad=d.max_shift if d.max_shift is not None else pad,
                   scale_min=d.crop_scale,
                   flip=d.flip if d.flip is not None else channels == 3,
                   trivial=bool(d.trivial_augment),
                   mixup=mixup, cutmix=d.cutmix)


def validate(cfg: Config) -> None:
    """Raise ValueError naming the flag for out-of-range options."""
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"--label-smoothing: expected 0 <= eps < 1, found {cfg.label_smoothing}")
    d = cfg.data
    checks = [("--data.mixup", d.mixup is None or d.mixup >= 0, ">= 0 (0: off)", d.mixup),
              ("--data.cutmix", d.cutmix >= 0, ">= 0 (0: off)", d.cutmix),
              ("--data.max-shift", d.max_shift is None or d.max_shift >= 0, ">= 0", d.max_shift),
              ("--data.crop-scale", 0 < d.crop_scale <= 1, "in (0, 1]", d.crop_scale),
              ("--data.image-size", d.image_size is None or d.image_size >= 1, ">= 1",
               d.image_size),
              ("--data.workers", d.workers >= 0, ">= 0", d.workers),
              ("--model.drop-path", cfg.model.drop_path is None
               or 0 <= cfg.model.drop_path < 1, "in [0, 1)", cfg.model.drop_path)]
    for flag, ok, want, found in checks:
        if not ok:
            raise ValueError(f"{flag}: expected {want}, found {found}")
    check_body(cfg.model, d)
    if cfg.test and d.test_path is None:
        raise ValueError("--test: expected --data.test-path naming a held-out test set, found "
                         "none (a CIFAR or MNIST folder as --data.path validates on its official "
                         "test set at every eval already)")
    if d.test_path is not None:
        for flag, other in (("--data.path", _trained(d)), ("--data.val-path", d.val_path)):
            _apart("--data.test-path", d.test_path, flag, other, "a test set is never trained or "
                   "validated on")
        if d.val_path is None and d.path is not None:
            _not_its_own_test_set(d.path, d.test_path)


def _not_its_own_test_set(path: str, test_path: str) -> None:
    """ValueError where --data.test-path names the official test set of the CIFAR or MNIST
    folder --data.path, which validates on it at every eval (without --data.val-path): --test
    would score the validation images again, as a held-out test."""
    own = set(source_files(path)) - set(source_files(path, trained=True))
    if own and _shared_file(source_files(test_path), own) is not None:
        raise ValueError(f"--data.test-path: expected images apart from the validation set (a "
                         f"test set is never validated on), found {test_path}, the official test "
                         f"set {path} validates on at every eval already; leave out "
                         "--data.test-path and --test (the val_loss and accuracy are that test "
                         "set's), or validate on another set with --data.val-path")


def check_applies(cfg: Config, given: Collection[str] = ()) -> None:
    """A new run's options that `validate` cannot refuse in a saved run, which goes on as it
    was started: a --data.val-path overlapping the training images (a run started so before
    toymlx refused it still resumes)."""
    if cfg.data.val_path is not None:
        _apart("--data.val-path", cfg.data.val_path, "--data.path", _trained(cfg.data),
               "a validation set is never trained on")


def _trained(d: ImageData) -> str | None:
    """The folder or file the run trains on: timm's layout's train/, else --data.path."""
    split = split_folders(d.path) if d.path is not None else None
    return str(split["train"]) if split else d.path


def _apart(which: str, held: str, flag: str, other: str | None, never: str) -> None:
    """ValueError where the held-out set `held` (--data.val-path, --data.test-path) and `other`
    (--data.path: the files its training images come from; --data.val-path: all it reads)
    share a file, one folder in or holding the other or a link (or a hard link) in one to the
    other's file: its score would be of images trained on (an MNIST folder's own t10k file is
    not: the folder trains on its train-* files alone). The line names both files."""
    if other is None:
        return
    shared = _shared_file(source_files(held), source_files(other, trained=flag == "--data.path"))
    if shared is not None:
        f, twin = shared
        how = f"both read {f}" if f == twin else f"{f} and {twin} are one file"
        raise ValueError(f"{which}: expected images apart from {flag} ({never}), found "
                         f"{held}, which overlaps {other} ({how})")


def _shared_file(files: Iterable[Path], others: Iterable[Path]) -> tuple[Path, Path] | None:
    """(the first of `files` that is one of `others` by file identity, device and inode: the
    same path, a link or a hard link to it; that one of `others`), or None where none is."""
    read: dict[tuple[int, int], Path] = {}
    for f in others:
        st = f.stat()
        read.setdefault((st.st_dev, st.st_ino), f)
    for f in files:
        st = f.stat()
        if (twin := read.get((st.st_dev, st.st_ino))) is not None:
            return f, twin
    return None


def auto_patch(side: int) -> int:
    """Patch side for preset auto on a size without a preset: the divisor of `side` in 2..16
    whose grid is nearest 8x8 (32 px: 4, 64 px: 8, 96 px: 12)."""
    options = [p for p in range(2, 17) if side % p == 0]
    if not options:
        raise ValueError(f"--data.image-size: expected a side with a divisor in 2..16 for the "
                         f"patches, found {side}; pass --data.image-size or --model.patch-size")
    return min(options, key=lambda p: (abs(side // p - 8), -p))


def model_args(opts: ViTOptions, data: ImageSet, data_opts: ImageData | None = None) -> ViTArgs:
    """The ViTArgs of `opts` for `data` (its image shape and classes), checked; an error names
    the flags, the image side and channels as --data.image-size and --data.channels
    (`data_opts`: the options given, which decide which flag of two a fault is told of)."""
    data_opts = data_opts or ImageData()
    h, w, c = data.image_shape
    if h != w:  # before the patch is chosen from the side: a 13x20 set was told of 13's divisors
        raise ValueError(f"{data.source}: images: expected square images, found {h}x{w} (height "
                         f"x width); --data.image-size {min(h, w)} resizes the shorter side to "
                         "it and centre-crops, as a folder's images are")
    preset = opts.preset
    if preset == "auto":
        preset = {8: "vit-tiny-8", 28: "vit-tiny-28", 224: "vit-tiny"}.get(h, "vit-tiny-28")
    over = preset_overrides(opts)
    if opts.preset == "auto" and "patch_size" not in over:
        if h == AUTO_PATCH_8[0]:
            over["patch_size"] = AUTO_PATCH_8[1]
        elif h not in (28, 224):
            over["patch_size"] = auto_patch(h)
    args = replace(PRESETS[preset](), image_size=h, channels=c, num_classes=data.num_classes,
                   **over)
    return _checked(args, opts, data_opts)


def _checked(args: ViTArgs, opts: ViTOptions, data_opts: ImageData) -> ViTArgs:
    """`args`, validated; an error names the flags (the image side and channels are the
    data's, or --data.image-size's and --data.channels')."""
    try:
        args.validate()
    except ArgsError as e:
        raise model_error(e, opts, {"image_size": ("--data.image-size", data_opts.image_size),
                                    "channels": ("--data.channels", data_opts.channels)}
                          ) from None
    return args


def check_body(opts: ViTOptions, data_opts: ImageData) -> None:
    """The shape's checks that need no image (widths, heads, depth, drop path): before the
    data is read, so that a sweep refuses a bad grid value before its runs start, as the text
    recipes do. The image side, channels and classes are checked with the data
    (`model_args`)."""
    preset = "vit-tiny-28" if opts.preset == "auto" else opts.preset  # the same Tiny body
    body = replace(PRESETS[preset](), **preset_overrides(opts))
    _checked(replace(body, image_size=max(body.patch_size, 1), channels=1, num_classes=2), opts,
             data_opts)


def build(cfg: Config, ops: Ops) -> Task:
    d = cfg.data
    data = load_images(d.path, d.val_fraction, val_path=d.val_path,
                       test_path=d.test_path if cfg.test else None, image_size=d.image_size,
                       channels=d.channels, stream=d.stream, workers=max(d.workers, 1))
    for note in data.notes + [data.split_note] * bool(data.split_note):
        print(f"toymlx: {note}", file=sys.stderr)
    data.augment = augment_for(d, data.image_shape, len(data.train_x))
    check_batch_fits(cfg.batch_size, {"train_images": len(data.train_x),
                                      "data_source": data.source})  # before the model is made
    args = model_args(cfg.model, data, cfg.data)
    mx.random.seed(cfg.seed)
    model = ViT(args, ops)
    norm = {"toy.pixel_scale": float(data.scale), "toy.pixel_mean": data.mean.tolist(),
            "toy.pixel_std": data.std.tolist()}

    def save(path: Path, m: ViT, extra: dict) -> None:
        write_vit(path, m, norm, extra, class_names=data.class_names, dtype=cfg.save_dtype)

    def load(path: Path, m: ViT) -> None:
        loaded, _, _ = load_vit(path)
        m.update(loaded.parameters())

    info = {"arch": "vit", "image_size": args.image_size, "patch_size": args.patch_size,
            "channels": args.channels, "d_model": args.d_model, "n_layers": args.n_layers,
            "n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "num_classes": args.num_classes,
            "gelu": args.gelu, "norm_eps": args.norm_eps,
            # the checkpoint's input normalisation: what its readers compare (`check_own`)
            "pixel_scale": norm["toy.pixel_scale"], "pixel_mean": norm["toy.pixel_mean"],
            "pixel_std": norm["toy.pixel_std"]}
    if args.drop_path:
        info["drop_path"] = args.drop_path

    def batch_at(step: int) -> dict[str, np.ndarray]:
        return data.train_batch(step, cfg.seed, cfg.batch_size, cfg.grad_accum)

    aug = data.augment
    return Task(
        recipe="vit-tiny", model=model, loss_fn=smoothed_loss(cfg.label_smoothing),
        train_batch=Prefetcher(batch_at, d.workers, cfg.steps) if d.workers else batch_at,
        val_batches=data.val_batches(cfg.batch_size, pad_last=True), save=save, load=load,
        model_info=info, config_info={
            "data_source": data.source, "augment": aug.crop != "none" or aug.flip or aug.trivial,
            "crop": aug.crop, "max_shift": aug.pad, "flip": aug.flip, "trivial_augment": aug.trivial,
            "mixup": aug.mixup, "cutmix": aug.cutmix, "label_smoothing": cfg.label_smoothing,
            "class_names": data.class_names[:RECORDED_CLASS_NAMES],
            # the whole list, for readers comparing a checkpoint's `toy.class_names` (`check_own`)
            "class_count": len(data.class_names),
            "class_names_sha256": class_names_sha256(data.class_names), **data.describe()},
        metrics_fn=classify_metrics, unit="images",
        count=lambda b: int(np.prod(b["labels"].shape)),
        test_batches=data.test_batches(cfg.batch_size, pad_last=True))
