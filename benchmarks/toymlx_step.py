"""toymlx's side: the model and the training step exactly as `toymlx-train` builds and runs them.

Everything here goes through toymlx's public API (models, `lora.apply_lora`, the trainer's
`Task`, `make_optimizer`, `make_step`), and each step is taken as `trainer.train` takes it:
batch to `mx.array`, the step's seed, one call, `mx.eval` of the model and optimizer state
with the BLAS threads the step asks for.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from rounds import Variant
from workloads import Workload

from toymlx.device import use_blas_threads
from toymlx.lora import apply_lora
from toymlx.losses import classify_loss, lm_loss
from toymlx.models.llama import Llama
from toymlx.models.vit import ViT
from toymlx.step import step_blas_threads, step_streams
from toymlx.trainer import Task, TrainConfig, make_optimizer, make_step, step_seed


def build_model(w: Workload, seed: int = 0) -> nn.Module:
    """The workload's model as toymlx initialises it (LoRA applied): the weights every
    implementation starts from."""
    mx.random.seed(seed)
    model = ViT(w.vit) if w.kind == "vit" else Llama(w.llama)
    if w.lora:
        apply_lora(model, w.lora_targets, None, w.lora_rank, w.lora_alpha)
    mx.eval(model.parameters())
    return model


def weights_np(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter by its toymlx name, as float32 numpy (what the other sides load)."""
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def cast_base(model: nn.Module, dtype: str) -> None:
    """The weights in `dtype`, LoRA adapters kept float32: what casting the base and then
    wrapping its projections gives (mlx-lm's adapters on a bf16 model are float32 too)."""
    if dtype == "float32":
        return
    flat = tree_flatten(model.parameters())
    model.update(tree_unflatten([(k, v if ".lora_" in k else v.astype(getattr(mx, dtype)))
                                 for k, v in flat]))


@contextlib.contextmanager
def mlx_kernels():
    """Within: the models trace with MLX's own elementwise ops (`TOYMLX_FAST_MATH=0`)
    instead of toymlx.fastmath's vectorised CPU forms, for a same-run comparison."""
    before = os.environ.get("TOYMLX_FAST_MATH")
    os.environ["TOYMLX_FAST_MATH"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOYMLX_FAST_MATH")
        else:
            os.environ["TOYMLX_FAST_MATH"] = before


def shard(batch: dict[str, np.ndarray], world: Any) -> dict[str, np.ndarray]:
    """This rank's slice of a global batch (axis 1), as the trainer takes it."""
    if world is None or world.size() == 1:
        return batch
    n, r = world.size(), world.rank()
    return {k: v[:, r * v.shape[1] // n:(r + 1) * v.shape[1] // n] for k, v in batch.items()}


class ToymlxVariant(Variant):
    """toymlx's own training path: Task -> make_optimizer -> make_step, as train() runs it.

    `kernels="auto"` is toymlx's own choice (toymlx.fastmath's vectorised forms in the CPU
    step, MLX's kernels on a GPU); "mlx" traces the same step with MLX's own exp / silu /
    GELU / softmax / cross-entropy everywhere. `dtype` casts the weights (LoRA adapters stay
    float32) and the images."""

    def __init__(self, w: Workload, model: nn.Module, batch: dict[str, np.ndarray],
                 compile: bool = True, world: Any = None, kernels: str = "auto",
                 dtype: str = "float32", name: str = "toymlx"):
        self.name, self.kernels = name, kernels
        cast_base(model, dtype)
        self.dtype = getattr(mx, dtype)
        batch = shard(batch, world)
        self.model = model
        self.cfg = TrainConfig(steps=100_000, batch_size=w.batch, lr=w.lr, warmup=10,
                               weight_decay=w.weight_decay, compile=compile, progress=False)

        def nothing(*_a, **_k):
            return None

        self.task = Task(recipe=f"bench-{w.name}", model=model,
                         loss_fn=classify_loss if w.kind == "vit" else lm_loss,
                         train_batch=lambda s: batch, val_batches=[], save=nothing,
                         load=nothing, model_info={}, unit=w.unit)
        self.optimizer = (self.task.optimizer or make_optimizer)(self.cfg)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(model.parameters(), self.optimizer.state)
        self.step_fn = make_step(self.task, self.optimizer, self.cfg, world)
        self.step_threads = step_blas_threads(step_streams(self.cfg, world))
        self.gnorm0: float | None = None

    def step(self, s: int) -> float:
        with mlx_kernels() if self.kernels == "mlx" else contextlib.nullcontext():
            batch = {k: mx.array(v) for k, v in self.task.train_batch(s).items()}
            if "images" in batch:
                batch["images"] = batch["images"].astype(self.dtype)
            mx.random.seed(step_seed(self.cfg.seed, s))
            loss, gnorm = self.step_fn(batch)
            with use_blas_threads(self.step_threads):  # as train() evaluates the step
                mx.eval(loss, gnorm, self.model.state, self.optimizer.state)
        if self.gnorm0 is None:
            self.gnorm0 = float(gnorm.item())
        return float(loss.item())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten([self.model.parameters(),
                                                      self.optimizer.state]))
