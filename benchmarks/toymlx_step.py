"""toymlx's side: the model and the training step exactly as `toymlx-train` builds and runs them.

Everything here goes through toymlx's public API: a model built with an explicit `Ops` (whose
kernels, which dtype: `toymlx.models.ops`), `lora.apply_lora`, `trainer.make_optimizer` and
`trainer.training_step` (the plain compiled step, or on a multi-core CPU the same step spread
over CPU streams). Each step is taken as `trainer.train` takes it: batch to `mx.array`, the
step's seed, one call, `mx.eval` of the model and optimizer state with the BLAS threads the
step asks for.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from rounds import Variant
from workloads import Workload

from toymlx.cpu_streams import step_blas_threads
from toymlx.device import use_blas_threads
from toymlx.lora import apply_lora
from toymlx.losses import classify_loss, lm_loss
from toymlx.models.llama import Llama
from toymlx.models.ops import DTYPES, Ops, training_ops
from toymlx.models.vit import ViT
from toymlx.trainer import TrainConfig, make_optimizer, step_seed, training_step

CPU_OPS = training_ops(on_gpu=False)
"""What toymlx trains with where MLX computes on the CPU: toymlx.fastmath's vectorised kernels."""


def gpu_ops(dtype: str) -> Ops:
    """What toymlx trains with on a GPU in `dtype` (MLX's fused kernels, float32 masters)."""
    return training_ops(on_gpu=True, dtype=dtype)


def build_model(w: Workload, ops: Ops, seed: int = 0) -> nn.Module:
    """The workload's model as toymlx initialises it, computing with `ops`, LoRA applied. Its
    initial weights depend on the seed only, not on `ops`: every implementation starts there."""
    mx.random.seed(seed)
    model = ViT(w.vit, ops) if w.kind == "vit" else Llama(w.llama, ops)
    if w.lora:
        apply_lora(model, w.lora_targets, None, w.lora_rank, w.lora_alpha)
        frozen_in_compute_dtype(model)
    mx.eval(model.parameters())
    return model


def frozen_in_compute_dtype(model: nn.Module) -> None:
    """A frozen (LoRA) base stored in the model's compute dtype, norms float32, adapters
    float32: how `toymlx.gguf.llama.load_llama_weights` holds the base the lora recipe loads."""
    dtype = DTYPES[model.ops.dtype]
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    model.update(tree_unflatten([
        (k, v if k in trainable or k.endswith("norm.weight") else v.astype(dtype))
        for k, v in tree_flatten(model.parameters())]))


def weights_np(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter by its toymlx name, as float32 numpy (what the other sides load)."""
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def shard(batch: dict[str, np.ndarray], world: Any) -> dict[str, np.ndarray]:
    """This rank's slice of a global batch (axis 1), as the trainer takes it."""
    if world is None or world.size() == 1:
        return batch
    n, r = world.size(), world.rank()
    return {k: v[:, r * v.shape[1] // n:(r + 1) * v.shape[1] // n] for k, v in batch.items()}


class ToymlxVariant(Variant):
    """toymlx's own training path for a model from `build_model`: make_optimizer and
    training_step on it, stepped as train() steps."""

    def __init__(self, w: Workload, model: nn.Module, batch: dict[str, np.ndarray],
                 compile: bool = True, world: Any = None, name: str = "toymlx"):
        self.name, self.model = name, model
        batch = shard(batch, world)
        self.batch = lambda s: batch
        self.loss_fn = classify_loss if w.kind == "vit" else lm_loss
        self.cfg = TrainConfig(steps=100_000, batch_size=w.batch, lr=w.lr, warmup=10,
                               weight_decay=w.weight_decay, compile=compile, progress=False)
        self.optimizer = make_optimizer(self.cfg)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(model.parameters(), self.optimizer.state)
        self.step_fn, n_streams = training_step(model, self.loss_fn, self.optimizer, self.cfg,
                                                world)
        self.step_threads = step_blas_threads(n_streams)
        self.gnorm0: float | None = None

    def step(self, s: int) -> float:
        batch = {k: mx.array(v) for k, v in self.batch(s).items()}
        mx.random.seed(step_seed(self.cfg.seed, s))
        out = self.step_fn(batch)
        with use_blas_threads(self.step_threads):  # as train() evaluates the step
            mx.eval(out, self.model.state, self.optimizer.state)
        if self.gnorm0 is None:
            self.gnorm0 = float(out["grad_norm"].item())
        return float(out["loss"].item())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten([self.model.parameters(),
                                                      self.optimizer.state]))
