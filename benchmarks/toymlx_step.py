"""toymlx's side: each workload's Task built by the recipe that trains it, stepped as `train` does.

A workload's model comes from the recipe a user trains it with, through that recipe's own
`build(cfg, ops)` (`build_task`): from-scratch for a Llama trained from random init, vit-tiny for
the ViT, lora for a LoRA workload. The recipe's Config holds the workload's shape and optimizer
(`recipe_config`), and the built model's shape is checked against the workload's. What a recipe
reads besides its Config (lora: a base GGUF of the workload's shape and architecture, random
init, in float32; vit-tiny: images of the workload's size, channels and classes) is written once
per workload by `recipe_inputs` into a temporary folder; from-scratch reads its default corpus.

`ToymlxVariant` then replaces the Task's `train_batch` by the workload's fixed batch, so every
implementation trains on the same numbers, and steps it with `toymlx.training.trainer.Stepper`, the piece
`toymlx.training.trainer.train` takes each optimizer step with (optimizer, compiled step, seed, shard,
evaluation under the step's BLAS threads). The peers start from `weights_np(task.model)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from rounds import Variant
from scratch import scratch_folder
from workloads import Workload

from toymlx.data.vocab import byte_metadata
from toymlx.gguf.llama import write_llama
from toymlx.models.llama import PRESETS, Llama, LlamaArgs
from toymlx.models.ops import Ops, training_ops
from toymlx.models.vit import ViTArgs
from toymlx.recipes import from_scratch, get_recipe, lora, vit_tiny
from toymlx.recipes.common import LlamaOptions
from toymlx.training.task import Task, TrainConfig, check_config
from toymlx.training.trainer import Stepper


def cpu_ops() -> Ops:
    """What toymlx trains with where MLX computes on the CPU: toymlx.backend.fastmath's vectorised
    kernels, with exp and erf in MLX's kernels where this process's were checked to compute them
    (so: after `setup_process`)."""
    return training_ops(on_gpu=False)


def reference_ops() -> Ops:
    """`cpu_ops` with MLX's own kernels (the benchmark's toymlx-ref side)."""
    return replace(cpu_ops(), kernels="mlx", kernel_forms=False)

BASE_GGUF = "base.gguf"
IMAGES_NPZ = "images.npz"


def gpu_ops(dtype: str) -> Ops:
    """What toymlx trains with on a GPU in `dtype` (MLX's fused kernels, float32 masters)."""
    return training_ops(on_gpu=True, dtype=dtype)


def recipe_of(w: Workload) -> str:
    """The recipe a user trains `w` with."""
    return "vit-tiny" if w.kind == "vit" else "lora" if w.lora else "from-scratch"


@contextmanager
def recipe_inputs(w: Workload, seed: int = 0) -> Iterator[Path]:
    """A temporary folder holding what `w`'s recipe reads besides its Config (written once; the
    folder is removed afterwards): the lora recipe's base GGUF (random init at the workload's
    shape, seeded, float32, toymlx's byte tokenizer), the vit-tiny recipe's images (an .npz of
    2 x batch random images at the workload's size and channels, labels spanning its classes)."""
    with scratch_folder("toymlx-bench-inputs-") as folder:
        if recipe_of(w) == "lora":
            mx.random.seed(seed)
            write_llama(folder / BASE_GGUF, Llama(w.llama), byte_metadata(),
                        name=f"toymlx bench {w.name}")
        elif recipe_of(w) == "vit-tiny":
            a, n = w.vit, 2 * w.batch
            rng = np.random.default_rng(seed)
            y = rng.integers(0, a.num_classes, n)
            y[-1] = a.num_classes - 1  # the recipe counts max(label) + 1 classes
            x = rng.integers(0, 256, (n, a.image_size, a.image_size, a.channels), np.uint8)
            np.savez(folder / IMAGES_NPZ, x=x, y=y)
        yield folder


def training_options(w: Workload, ops: Ops, compile: bool = True) -> dict[str, Any]:
    """The TrainConfig fields every recipe gets from the workload: its batch and optimizer (lr,
    weight decay, AdamW's betas and clipping as the PyTorch peer's; 10 warm-up steps of a
    100,000-step schedule, where the peers keep lr constant), the dtype and kernels `ops`
    computes with, no progress bar."""
    return {"steps": 100_000, "batch_size": w.batch, "grad_accum": 1, "lr": w.lr, "warmup": 10,
            "weight_decay": w.weight_decay, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
            "seed": 0, "eval_batches": 1, "dtype": ops.dtype, "kernels": ops.kernels,
            "compile": compile, "progress": False}


def llama_options(a: LlamaArgs) -> LlamaOptions:
    """The from-scratch recipe's --model options that build `a` (over the byte vocabulary);
    ValueError when no preset with overrides does."""
    over = {f.name: getattr(a, f.name) for f in fields(LlamaOptions) if f.name != "preset"}
    for preset in PRESETS:
        opts = LlamaOptions(preset=preset, **over)
        if opts.build_args(a.vocab_size) == a:
            return opts
    raise ValueError(f"the from-scratch recipe's --model options cannot build {a}")


def recipe_config(w: Workload, ops: Ops, folder: Path, compile: bool = True,
                  base_dtype: str = "auto") -> TrainConfig:
    """The Config of `w`'s recipe (`recipe_of`) that trains the workload's shape with its
    optimizer, reading the inputs `recipe_inputs` wrote into `folder`; a LoRA base held as
    `base_dtype` (--base-dtype; auto: as the lora recipe holds it on this device)."""
    train = training_options(w, ops, compile)
    recipe = recipe_of(w)
    if recipe == "vit-tiny":
        a = w.vit
        model = vit_tiny.ViTOptions(patch_size=a.patch_size, d_model=a.d_model,
                                    n_layers=a.n_layers, n_heads=a.n_heads, ffn_dim=a.ffn_dim,
                                    gelu=a.gelu, drop_path=a.drop_path)
        # the workload's loss is plain cross-entropy, as the peers compute it; the batch is the
        # workload's (no augmentation, mixup or background decoding is ever asked for)
        data = vit_tiny.ImageData(path=str(folder / IMAGES_NPZ), augment=False, mixup=0.0,
                                  workers=0)
        return vit_tiny.Config(**train, label_smoothing=0.0, model=model, data=data)
    if recipe == "lora":
        # base_dtype auto: the compute dtype for a float base, as the lora recipe holds it
        opts = lora.LoRAOptions(rank=w.lora_rank, alpha=w.lora_alpha, dropout=0.0,
                                targets=",".join(w.lora_targets))
        return lora.Config(**train, base=str(folder / BASE_GGUF), seq_len=w.seq, lora=opts,
                           base_dtype=base_dtype)
    return from_scratch.Config(**train, seq_len=w.seq, model=llama_options(w.llama))


def _stored(a: LlamaArgs | ViTArgs) -> LlamaArgs | ViTArgs:
    """`a` with its float fields as a GGUF stores them (float32)."""
    return replace(a, **{f.name: float(np.float32(v)) for f in fields(a)
                         if isinstance(v := getattr(a, f.name), float)})


def build_task(w: Workload, ops: Ops, folder: Path, compile: bool = True,
               base_dtype: str = "auto") -> tuple[Task, TrainConfig]:
    """`w`'s Task as `toymlx-train` builds it (the Config checked, then the recipe's `build`),
    computing with `ops`, and its Config; ValueError when the built model's shape is not the
    workload's."""
    cfg = recipe_config(w, ops, folder, compile, base_dtype)
    module = get_recipe(recipe_of(w))
    check_config(module, cfg)
    task = module.build(cfg, ops)
    built, want = _stored(task.model.args), _stored(w.vit if w.kind == "vit" else w.llama)
    if built != want:
        diff = {f.name: (getattr(built, f.name), getattr(want, f.name))
                for f in fields(want) if getattr(built, f.name) != getattr(want, f.name)}
        raise ValueError(f"{w.name}: the {task.recipe} recipe built another shape than the "
                         f"workload's: (built, workload) {diff}")
    return task, cfg


def weights_np(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter by its toymlx name, as float32 numpy (what the other sides load)."""
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


class ToymlxVariant(Variant):
    """A recipe-built Task (`build_task`) on the workload's fixed batch, stepped by the trainer's
    `Stepper` (this rank's shard of the batch under data parallelism)."""

    def __init__(self, task: Task, cfg: TrainConfig, batch: dict[str, np.ndarray],
                 world: Any = None, name: str = "toymlx"):
        self.name = name
        self.task = replace(task, train_batch=lambda s: batch)
        self.stepper = Stepper(self.task, cfg, world)
        self.stepper.build()
        self.gnorm0: float | None = None

    def step(self, s: int) -> float:
        out = self.stepper.step(s, self.task.train_batch(s))
        if self.gnorm0 is None:
            self.gnorm0 = float(out["grad_norm"].item())
        return float(out["loss"].item())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten([self.task.model.parameters(),
                                                      self.stepper.optimizer.state]))
