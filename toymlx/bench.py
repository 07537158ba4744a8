"""Training-step benchmarks: toymlx's real compiled step against PyTorch CPU and mlx-lm.

Each workload is timed three ways in one process, interleaved round by round (A B C A B C...)
so a busy machine slows every variant alike:

* `toymlx`: a `Task` run through `toymlx.trainer.make_optimizer` + `make_step`, step by step
  as `train()` runs it (batch to `mx.array`, per-step seed, one call, `mx.eval` of the state).
* `torch`: a plain PyTorch module of the same shapes and math (RMSNorm, adjacent-pair RoPE,
  GQA SDPA, SwiGLU, tied head / LayerNorm, GELU for the ViT; LoRA on q), AdamW with the same
  two decay groups and gradient clipping, in eager mode.
* `mlx-lm` (LoRA workloads): mlx-lm's llama model, its `LoRALinear` layers and its trainer's
  step construction (`value_and_grad(default_loss)` under `mx.compile` with the model,
  optimizer and random state as state), with mlx-lm's default Adam.

Every variant starts from the same weights, so their step-0 losses must agree; the table
prints them. FLOPs count the matmuls that training needs (6 N tokens, 4 N for frozen LoRA
bases, plus attention's score and value products computed dense) and are the same number for
every variant. MFU divides achieved GFLOPS by an fp32 sgemm (2048^3) timed in the same round.
PyTorch and mlx-lm are benchmark-only extras (`pip install toymlx[bench]`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# PyTorch's OpenMP threads spin while they wait (libgomp's default): on a 2-core machine that
# other work shares, the spinning thread holds the core its partner needs and PyTorch steps
# take 3-5x longer than with one thread. PASSIVE waits sleep. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.device import use_blas_threads
from toymlx.losses import classify_loss, lm_loss
from toymlx.models.llama import Llama, LlamaArgs, smollm2_135m, smollm2_360m, tiny
from toymlx.trainer import (
    Task,
    TrainConfig,
    make_optimizer,
    make_step,
    step_blas_threads,
    step_seed,
    step_streams,
)

MB = 2**20


# ---- workloads ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    """"llama" or "vit"."""
    batch: int
    seq: int = 0
    llama: LlamaArgs | None = None
    vit: Any = None
    lora_rank: int = 0
    """0: train everything; r > 0: LoRA rank r on `lora_targets`, base frozen."""
    lora_targets: tuple[str, ...] = ("q",)
    lora_alpha: float = 16.0
    lr: float = 3e-3
    weight_decay: float = 0.1
    quick: bool = True
    """Part of the --quick set."""

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def tokens(self) -> int:
        """Items whose loss one step trains on (tokens, or images for the ViT)."""
        return self.batch * self.seq if self.kind == "llama" else self.batch


def workloads() -> list[Workload]:
    """The standard set (the 360M ones are outside --quick)."""
    from toymlx.models.vit import vit_tiny_28

    lora = {"lora_rank": 8, "lr": 2e-4, "weight_decay": 0.0}
    return [
        Workload("llama-4x256", "llama", batch=8, seq=256, llama=tiny()),
        Workload("vit-tiny-28", "vit", batch=64, vit=vit_tiny_28()),
        Workload("lora-q-135m", "llama", batch=4, seq=256, llama=smollm2_135m(), **lora),
        Workload("scratch-360m", "llama", batch=4, seq=256, llama=smollm2_360m(), quick=False),
        Workload("lora-q-360m", "llama", batch=4, seq=256, llama=smollm2_360m(), quick=False,
                 **lora),
    ]


def train_flops(w: Workload) -> float:
    """Matmul FLOPs of one training step (same count for every implementation)."""
    if w.kind == "vit":
        a = w.vit
        T = 1 + a.n_patches
        per_layer = 4 * a.d_model * a.d_model + 2 * a.d_model * a.mlp_dim
        n = a.n_layers * per_layer + a.patch_size ** 2 * a.channels * a.d_model
        tokens = w.batch * T
        attn_fwd = 4 * w.batch * a.n_heads * T * T * a.head_dim * a.n_layers
        return 6 * n * tokens + 3 * attn_fwd + 6 * a.d_model * a.num_classes * w.batch
    a = w.llama
    q, kv = a.n_heads * a.hd, a.n_kv_heads * a.hd
    per_layer = a.d_model * (2 * q + 2 * kv) + 3 * a.d_model * a.ffn_dim
    n = a.n_layers * per_layer + a.vocab_size * a.d_model  # blocks + output head
    tokens = w.batch * w.seq
    attn_fwd = 4 * w.batch * a.n_heads * w.seq * w.seq * a.hd * a.n_layers
    if not w.lora:
        return 6 * n * tokens + 3 * attn_fwd
    # Frozen base: forward + input gradients only (4 N); the adapters train fully (6 N_lora).
    dims = {"q": (a.d_model, q), "k": (a.d_model, kv), "v": (a.d_model, kv),
            "o": (q, a.d_model), "gate": (a.d_model, a.ffn_dim), "up": (a.d_model, a.ffn_dim),
            "down": (a.ffn_dim, a.d_model)}
    n_lora = a.n_layers * sum(w.lora_rank * (i + o) for i, o in (dims[t] for t in w.lora_targets))
    return 4 * n * tokens + 6 * n_lora * tokens + 3 * attn_fwd


def make_batch(w: Workload, seed: int = 0) -> dict[str, np.ndarray]:
    """One global batch with the leading micro-batch axis (1, B, ...)."""
    rng = np.random.default_rng(seed)
    if w.kind == "vit":
        a = w.vit
        return {"images": rng.standard_normal((1, w.batch, a.image_size, a.image_size,
                                              a.channels)).astype(np.float32),
                "labels": rng.integers(0, a.num_classes, (1, w.batch)).astype(np.int32)}
    toks = rng.integers(0, w.llama.vocab_size, (1, w.batch, w.seq + 1)).astype(np.int32)
    return {"inputs": toks[..., :-1], "targets": toks[..., 1:],
            "mask": np.ones((1, w.batch, w.seq), np.float32)}


# ---- variants -------------------------------------------------------------------------------
class Variant:
    """One implementation of a workload's training step."""

    name = ""
    uses_mlx = True

    def step(self, s: int) -> float:
        raise NotImplementedError

    def first_grad_norm(self) -> float | None:
        return None


def build_toymlx_model(w: Workload, seed: int = 0) -> nn.Module:
    mx.random.seed(seed)
    if w.kind == "vit":
        from toymlx.models.vit import ViT

        model = ViT(w.vit)
    else:
        model = Llama(w.llama)
    if w.lora:
        from toymlx.lora import apply_lora

        apply_lora(model, w.lora_targets, None, w.lora_rank, w.lora_alpha)
    mx.eval(model.parameters())
    return model


class _ReferenceForms:
    """While active, the model and loss trace with MLX's own ops (`toymlx.fastmath` off)."""

    def __enter__(self):
        from toymlx import fastmath

        self.saved, fastmath.enabled = fastmath.enabled, lambda: False

    def __exit__(self, *exc):
        from toymlx import fastmath

        fastmath.enabled = self.saved


class ToymlxVariant(Variant):
    """toymlx's own training path: Task -> make_optimizer -> make_step, as train() runs it.

    `reference=True` traces the same step with MLX's own exp / silu / GELU / softmax /
    cross-entropy (`toymlx.fastmath` off) for a same-run before/after comparison."""

    name = "toymlx"

    def __init__(self, w: Workload, model: nn.Module, batch: dict[str, np.ndarray],
                 compile: bool = True, world: Any = None, reference: bool = False):
        from toymlx.trainer import _shard  # this rank's slice, as train() takes it

        self.reference = reference
        if reference:
            self.name = "toymlx-ref"
        batch = _shard(batch, world)
        self.model = model
        self.cfg = TrainConfig(steps=100_000, batch_size=w.batch, lr=w.lr, warmup=10,
                               weight_decay=w.weight_decay, compile=compile, progress=False)

        def nothing(*_a, **_k):
            return None

        self.task = Task(recipe=f"bench-{w.name}", model=model,
                         loss_fn=classify_loss if w.kind == "vit" else lm_loss,
                         train_batch=lambda s: batch, val_batches=[], save=nothing,
                         load=nothing, model_info={}, unit="images" if w.kind == "vit"
                         else "tokens")
        self.optimizer = (self.task.optimizer or make_optimizer)(self.cfg)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(model.parameters(), self.optimizer.state)
        self.step_fn = make_step(self.task, self.optimizer, self.cfg, world)
        self.step_threads = step_blas_threads(step_streams(self.cfg, world))
        self.gnorm0: float | None = None

    def step(self, s: int) -> float:
        if self.reference:
            with _ReferenceForms():
                return self._step(s)
        return self._step(s)

    def _step(self, s: int) -> float:
        batch = {k: mx.array(v) for k, v in self.task.train_batch(s).items()}
        mx.random.seed(step_seed(self.cfg.seed, s))
        loss, gnorm = self.step_fn(batch)
        with use_blas_threads(self.step_threads):  # as train() evaluates the step
            mx.eval(loss, gnorm, self.model.state, self.optimizer.state)
        if self.gnorm0 is None:
            self.gnorm0 = float(gnorm.item())
        return float(loss.item())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0


def mlx_params_np(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


class MlxLmVariant(Variant):
    """mlx-lm's llama + its LoRA layers + its trainer's compiled step (grad_accum 1)."""

    name = "mlx-lm"

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 seed: int = 0):
        from functools import partial

        import mlx.optimizers as optim
        from mlx.nn.utils import average_gradients
        from mlx.utils import tree_map
        from mlx_lm.models.llama import Model, ModelArgs
        from mlx_lm.tuner.trainer import default_loss
        from mlx_lm.tuner.utils import linear_to_lora_layers

        a = w.llama
        mx.random.seed(seed)
        model = Model(ModelArgs(model_type="llama", hidden_size=a.d_model,
                                num_hidden_layers=a.n_layers, intermediate_size=a.ffn_dim,
                                num_attention_heads=a.n_heads, rms_norm_eps=a.norm_eps,
                                vocab_size=a.vocab_size, head_dim=a.hd,
                                num_key_value_heads=a.n_kv_heads, rope_theta=a.rope_base,
                                rope_traditional=True, tie_word_embeddings=a.tie_embeddings))
        model.load_weights([(_to_mlx_lm(k.replace(".linear.weight", ".weight")), mx.array(v))
                            for k, v in weights.items() if ".lora_" not in k], strict=True)
        model.freeze()
        keys = [f"self_attn.{t}_proj" if t in "qkvo" else f"mlp.{t}_proj"
                for t in w.lora_targets]
        linear_to_lora_layers(model, a.n_layers, {"rank": w.lora_rank, "dropout": 0.0,
                                                  "scale": w.lora_alpha / w.lora_rank,
                                                  "keys": keys})
        # Same adapter values (mlx-lm stores the transposes), so step 0 is the same function.
        model.load_weights([(_to_mlx_lm(k), mx.array(v.T)) for k, v in weights.items()
                            if ".lora_" in k], strict=False)
        model.train()
        optimizer = optim.Adam(learning_rate=w.lr)  # mlx-lm lora's default optimizer
        mx.eval(model.parameters())
        loss_value_and_grad = nn.value_and_grad(model, default_loss)
        state = [model.state, optimizer.state, mx.random.state]

        # mlx_lm.tuner.trainer.train's step, as it builds it (a closure there).
        @partial(mx.compile, inputs=state, outputs=state)
        def step(batch, prev_grad, do_update):
            (lvalue, toks), grad = loss_value_and_grad(model, *batch)
            if prev_grad is not None:
                grad = tree_map(lambda x, y: x + y, grad, prev_grad)
            if do_update:
                grad = average_gradients(grad)
                optimizer.update(model, grad)
                grad = None
            return lvalue, toks, grad

        self.model, self.optimizer, self.state, self.step_fn = model, optimizer, state, step
        toks = np.concatenate([batch["inputs"][0], batch["targets"][0][:, -1:]], axis=1)
        self.tokens = toks  # (B, T+1)
        self.lengths = np.tile(np.array([[0, w.seq]], np.int32), (w.batch, 1))

    def step(self, s: int) -> float:
        batch = (mx.array(self.tokens), mx.array(self.lengths))
        loss, toks, grad = self.step_fn(batch, None, True)
        mx.eval(self.state, loss, toks, grad)
        return float(loss.item())


def _to_mlx_lm(k: str) -> str:
    k = (k.replace("embed.", "embed_tokens.").replace("attn_norm", "input_layernorm")
         .replace("ffn_norm", "post_attention_layernorm").replace(".attn.", ".self_attn."))
    return "lm_head.weight" if k == "output.weight" else "model." + k


# ---- the PyTorch yardstick ------------------------------------------------------------------
def _torch_modules():
    """PyTorch modules with toymlx's parameter names, so weights copy over by name."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    class RMSNorm(tnn.Module):
        def __init__(self, d: int, eps: float):
            super().__init__()
            self.weight, self.eps = tnn.Parameter(torch.ones(d)), eps

        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    class LoRALinear(tnn.Module):
        def __init__(self, n_in: int, n_out: int, rank: int, alpha: float):
            super().__init__()
            self.linear = tnn.Linear(n_in, n_out, bias=False)
            self.lora_a = tnn.Parameter(torch.zeros(rank, n_in))  # (r, in)
            self.lora_b = tnn.Parameter(torch.zeros(n_out, rank))  # (out, r)
            self.scale = alpha / rank

        def forward(self, x):
            return self.linear(x) + F.linear(F.linear(x, self.lora_a) * self.scale, self.lora_b)

    def linear(n_in, n_out, w: Workload, target: str, bias: bool = False):
        if w.lora and target in w.lora_targets:
            return LoRALinear(n_in, n_out, w.lora_rank, w.lora_alpha)
        return tnn.Linear(n_in, n_out, bias=bias)

    class Attention(tnn.Module):
        def __init__(self, a: LlamaArgs, w: Workload):
            super().__init__()
            self.a = a
            self.q_proj = linear(a.d_model, a.n_heads * a.hd, w, "q")
            self.k_proj = linear(a.d_model, a.n_kv_heads * a.hd, w, "k")
            self.v_proj = linear(a.d_model, a.n_kv_heads * a.hd, w, "v")
            self.o_proj = linear(a.n_heads * a.hd, a.d_model, w, "o")

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            a = self.a
            q = self.q_proj(x).view(B, T, a.n_heads, a.hd).transpose(1, 2)  # (B,H,T,hd)
            k = self.k_proj(x).view(B, T, a.n_kv_heads, a.hd).transpose(1, 2)  # (B,Hkv,T,hd)
            v = self.v_proj(x).view(B, T, a.n_kv_heads, a.hd).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))  # (B,T,H*hd)

    def rope(x, cos, sin):
        # Adjacent pairs (x[2i], x[2i+1]) as llama.cpp and toymlx rotate them.
        x0, x1 = x[..., 0::2], x[..., 1::2]  # (B,H,T,hd/2)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    class MLP(tnn.Module):
        def __init__(self, a: LlamaArgs, w: Workload):
            super().__init__()
            self.gate_proj = linear(a.d_model, a.ffn_dim, w, "gate")
            self.up_proj = linear(a.d_model, a.ffn_dim, w, "up")
            self.down_proj = linear(a.ffn_dim, a.d_model, w, "down")

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(tnn.Module):
        def __init__(self, a: LlamaArgs, w: Workload):
            super().__init__()
            self.attn_norm = RMSNorm(a.d_model, a.norm_eps)
            self.attn = Attention(a, w)
            self.ffn_norm = RMSNorm(a.d_model, a.norm_eps)
            self.mlp = MLP(a, w)

        def forward(self, x, cos, sin):
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.mlp(self.ffn_norm(x))

    class TorchLlama(tnn.Module):
        def __init__(self, w: Workload):
            super().__init__()
            a = self.a = w.llama
            self.embed = tnn.Embedding(a.vocab_size, a.d_model)
            self.layers = tnn.ModuleList([Block(a, w) for _ in range(a.n_layers)])
            self.norm = RMSNorm(a.d_model, a.norm_eps)
            if not a.tie_embeddings:
                self.output = tnn.Linear(a.d_model, a.vocab_size, bias=False)
            inv = a.rope_base ** (-torch.arange(0, a.hd, 2, dtype=torch.float32) / a.hd)
            ang = torch.arange(w.seq, dtype=torch.float32)[:, None] * inv  # (T, hd/2)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, tokens):
            h = self.embed(tokens)  # (B,T,D)
            for layer in self.layers:
                h = layer(h, self.cos, self.sin)
            h = self.norm(h)
            return F.linear(h, self.embed.weight if self.a.tie_embeddings else
                            self.output.weight)  # (B,T,V)

        def loss(self, batch):
            logits = self(batch["inputs"])
            ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                 reduction="none")
            mask = batch["mask"].flatten()
            return (ce * mask).sum() / mask.sum().clamp_min(1.0)

    class ViTBlock(tnn.Module):
        def __init__(self, a):
            super().__init__()
            self.n_heads = a.n_heads
            self.attn_norm = tnn.LayerNorm(a.d_model, eps=a.norm_eps)
            self.attn = tnn.Module()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self.attn, n, tnn.Linear(a.d_model, a.d_model))
            self.ffn_norm = tnn.LayerNorm(a.d_model, eps=a.norm_eps)
            self.mlp = tnn.Module()
            self.mlp.up_proj = tnn.Linear(a.d_model, a.mlp_dim)
            self.mlp.down_proj = tnn.Linear(a.mlp_dim, a.d_model)
            self.approx = {"erf": "none", "tanh": "tanh"}[a.gelu]

        def forward(self, x):
            B, T, D = x.shape
            h = self.attn_norm(x)
            q, k, v = (getattr(self.attn, n)(h).view(B, T, self.n_heads, -1).transpose(1, 2)
                       for n in ("q_proj", "k_proj", "v_proj"))  # (B,H,T,hd)
            o = F.scaled_dot_product_attention(q, k, v)
            x = x + self.attn.o_proj(o.transpose(1, 2).reshape(B, T, D))
            h = F.gelu(self.mlp.up_proj(self.ffn_norm(x)), approximate=self.approx)
            return x + self.mlp.down_proj(h)

    class TorchViT(tnn.Module):
        def __init__(self, w: Workload):
            super().__init__()
            a = self.a = w.vit
            self.patch_embed = tnn.Linear(a.patch_size ** 2 * a.channels, a.d_model)
            self.cls_token = tnn.Parameter(torch.zeros(a.d_model))
            self.pos_embed = tnn.Parameter(torch.zeros(1 + a.n_patches, a.d_model))
            self.layers = tnn.ModuleList([ViTBlock(a) for _ in range(a.n_layers)])
            self.norm = tnn.LayerNorm(a.d_model, eps=a.norm_eps)
            self.head = tnn.Linear(a.d_model, a.num_classes)

        def forward(self, images):
            a = self.a
            B, p, g = images.shape[0], a.patch_size, a.image_size // a.patch_size
            x = images.view(B, g, p, g, p, a.channels).permute(0, 1, 3, 2, 4, 5)
            x = self.patch_embed(x.reshape(B, g * g, p * p * a.channels))  # (B,N,D)
            cls = self.cls_token.expand(B, 1, -1)
            x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B,1+N,D)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x[:, 0]))

        def loss(self, batch):
            return F.cross_entropy(self(batch["images"]), batch["labels"])

    return TorchLlama, TorchViT


class TorchVariant(Variant):
    """The PyTorch step (`TorchStep`) in its own process, driven step by step from this one.

    Not in this process: toymlx loads OpenBLAS with global symbols before MLX, and PyTorch's
    CPU attention kernels then call OpenBLAS's threaded sgemm from inside their OpenMP threads
    (fwd+bwd of a SmolLM2-135M attention: 465 ms against 20 ms in a clean process). The child
    runs with TOYMLX_BLAS=reference so it never loads OpenBLAS, and with TOYMLX_MALLOC=default
    so that it keeps glibc's malloc settings, as a plain PyTorch process has them.
    """

    name = "torch"
    uses_mlx = False

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 threads: int | None = None):
        import multiprocessing as mp

        if threads is not None:
            self.name = f"torch{threads}t"
        self.folder = Path(tempfile.mkdtemp(prefix="toymlx-torch-"))
        np.savez(self.folder / "weights.npz", **weights)
        np.savez(self.folder / "batch.npz", **batch)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # the child inherits these at spawn: no OpenBLAS, and glibc's own malloc settings
        child_env = {"TOYMLX_BLAS": "reference", "TOYMLX_MALLOC": "default"}
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)
        try:
            self.proc = ctx.Process(target=_torch_worker, args=(child, w, str(self.folder),
                                                                threads), daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._reply()
        self.gnorm0: float | None = None
        self.last_cpu: float | None = None

    def step(self, s: int) -> float:
        self.conn.send(s)
        loss, gnorm, self.last_cpu = self._reply()
        if self.gnorm0 is None:
            self.gnorm0 = gnorm
        return loss

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def _reply(self) -> Any:
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"PyTorch worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)
        for f in self.folder.iterdir():
            f.unlink()
        self.folder.rmdir()


def _torch_worker(conn, w: Workload, folder: str, threads: int | None) -> None:
    """Child side of TorchVariant: build, then one step per request; reply (loss, |g|, cpu s)."""
    import traceback

    try:
        weights = dict(np.load(Path(folder) / "weights.npz"))
        batch = dict(np.load(Path(folder) / "batch.npz"))
        step = TorchStep(w, weights, batch, threads)
        del weights
        conn.send(("ok", None))
        while (s := conn.recv()) is not None:
            c = time.process_time()
            loss = step.step(s)
            conn.send(("ok", (loss, step.last_norm, time.process_time() - c)))
    except Exception:  # noqa: BLE001  (whatever failed, the parent must hear of it)
        conn.send(("error", traceback.format_exc()))


class TorchStep(Variant):
    """The same model and step in eager PyTorch on the CPU: AdamW (fused), same decay groups,
    gradient clipping."""

    name = "torch"
    uses_mlx = False

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 threads: int | None = None):
        import torch

        self.threads = threads
        if threads is not None:
            self.name = f"torch{threads}t"

        TorchLlama, TorchViT = _torch_modules()
        model = TorchViT(w) if w.kind == "vit" else TorchLlama(w)
        with torch.no_grad():
            state = model.state_dict()
            missing = set(state) - set(weights)
            if missing:
                raise RuntimeError(f"torch model has parameters toymlx lacks: {sorted(missing)}")
            for k, v in weights.items():
                state[k].copy_(torch.from_numpy(v))
        if w.lora:  # the base is frozen, as apply_lora freezes it
            for n, p in model.named_parameters():
                p.requires_grad_(".lora_" in n)
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": w.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        try:
            opt = torch.optim.AdamW(groups, lr=w.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        except (RuntimeError, TypeError):  # no fused CPU AdamW in this torch
            opt = torch.optim.AdamW(groups, lr=w.lr, betas=(0.9, 0.95), eps=1e-8)
        self.model, self.opt, self.params = model, opt, params
        self.batch = {k: torch.from_numpy(np.ascontiguousarray(v[0])) for k, v in batch.items()}
        for k in ("inputs", "targets", "labels"):
            if k in self.batch:
                self.batch[k] = self.batch[k].long()
        self.gnorm0: float | None = None

    def step(self, s: int) -> float:
        import torch

        if self.threads is not None:
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                return self._step()
            finally:
                torch.set_num_threads(before)
        return self._step()

    def _step(self) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        loss = self.model.loss(self.batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.last_norm = float(norm)
        if self.gnorm0 is None:
            self.gnorm0 = self.last_norm
        return float(loss.detach())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0


def _mlx_sgemm(n: int = 2048) -> float:
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    t = time.perf_counter()
    mx.eval(a @ b)
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


def _numpy_sgemm(n: int = 2048) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = time.perf_counter()
    a @ b
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


# ---- timing ---------------------------------------------------------------------------------
@dataclass
class VariantResult:
    name: str
    first_step_s: float
    build_s: float
    loss0: float
    grad_norm0: float | None
    times_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    """Process CPU time of each timed step (all threads): robust to a busy machine's waits,
    but it counts spinning BLAS/OpenMP threads as work."""
    mlx_peak_mb: float | None = None
    rss_peak_mb: float | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def build_variants(w: Workload, which: tuple[str, ...]) -> tuple[list[Variant], dict]:
    """Variants for `w` in the order they will be timed, each built from the same weights."""
    batch = make_batch(w)
    out: list[Variant] = []
    builds: dict[str, float] = {}
    t = time.perf_counter()
    model = build_toymlx_model(w)
    weights = mlx_params_np(model)
    if "toymlx" in which:
        v = ToymlxVariant(w, model, batch)
        builds[v.name] = time.perf_counter() - t
        out.append(v)
    else:
        del model
        mx.clear_cache()
    if "toymlx-ref" in which:
        t = time.perf_counter()
        rv = ToymlxVariant(w, build_toymlx_model(w), batch, reference=True)
        builds[rv.name] = time.perf_counter() - t
        out.append(rv)
    if "torch" in which:
        t = time.perf_counter()
        tv = TorchVariant(w, weights, batch)
        builds[tv.name] = time.perf_counter() - t
        out.append(tv)
    if "torch1t" in which:  # one thread: what PyTorch does on a machine others keep busy
        t = time.perf_counter()
        tv = TorchVariant(w, weights, batch, threads=1)
        builds[tv.name] = time.perf_counter() - t
        out.append(tv)
    if "mlx-lm" in which and w.lora and w.kind == "llama":
        t = time.perf_counter()
        lv = MlxLmVariant(w, weights, batch)
        builds[lv.name] = time.perf_counter() - t
        out.append(lv)
    return out, builds


def run_workload(w: Workload, rounds: int, warmup: int, which: tuple[str, ...],
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build, take the first step of each variant, warm up, then time interleaved rounds."""
    variants, builds = build_variants(w, which)
    results: dict[str, VariantResult] = {}
    for v in variants:  # first steps, one after another (includes mx.compile's build)
        if v.uses_mlx:
            mx.reset_peak_memory()
        t = time.perf_counter()
        loss0 = v.step(0)
        results[v.name] = VariantResult(v.name, time.perf_counter() - t, builds[v.name],
                                        loss0, v.first_grad_norm())
        log(f"  {w.name} {v.name}: first step {results[v.name].first_step_s:.2f} s, "
            f"loss {loss0:.5f}")
    for i in range(warmup):
        for v in variants:
            v.step(1 + i)
    sgemm = {"mlx": [], "numpy": []}
    ratios: dict[str, list[float]] = {}
    cpu_ratios: dict[str, list[float]] = {}
    s = 1 + warmup
    for r in range(rounds):
        sgemm["mlx"].append(_mlx_sgemm())
        sgemm["numpy"].append(_numpy_sgemm())
        this, cpu = {}, {}
        order = variants if r % 2 == 0 else variants[::-1]  # no variant always goes first
        for v in order:
            if v.uses_mlx:
                mx.reset_peak_memory()
            t, c = time.perf_counter(), time.process_time()
            v.step(s)
            this[v.name] = time.perf_counter() - t
            cpu[v.name] = getattr(v, "last_cpu", None) or time.process_time() - c
            results[v.name].times_s.append(this[v.name])
            results[v.name].cpu_s.append(cpu[v.name])
            if v.uses_mlx:
                peak = mx.get_peak_memory() / MB
                old = results[v.name].mlx_peak_mb or 0.0
                results[v.name].mlx_peak_mb = max(old, peak)
        s += 1
        for name, dt in this.items():
            if name != "toymlx" and "toymlx" in this:
                ratios.setdefault(name, []).append(this["toymlx"] / dt)
                cpu_ratios.setdefault(name, []).append(cpu["toymlx"] / cpu[name])
        log(f"  {w.name} round {r + 1}/{rounds}: " +
            "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in this.items()) +
            f"  (sgemm mlx {sgemm['mlx'][-1]:.0f} GFLOPS)")
    for v in variants:
        if hasattr(v, "close"):
            v.close()
    flops = train_flops(w)
    load = os.getloadavg()[0]
    sg_mlx = statistics.median(sgemm["mlx"])
    sg_np = statistics.median(sgemm["numpy"])
    out = {"workload": w.name, "flops_per_step": flops, "items_per_step": w.tokens,
           "unit": "images" if w.kind == "vit" else "tokens", "rounds": rounds,
           "loadavg_1min_at_end": load,
           "sgemm_gflops": {"mlx": sg_mlx, "numpy": sg_np}, "variants": {},
           "ratio_toymlx_over": {k: statistics.median(v) for k, v in ratios.items()},
           "cpu_ratio_toymlx_over": {k: statistics.median(v) for k, v in cpu_ratios.items()}}
    for name, res in results.items():
        med = res.median_s
        gflops = flops / med / 1e9
        out["variants"][name] = {
            **{k: v for k, v in asdict(res).items() if k != "name"},
            "median_s": med, "min_s": min(res.times_s), "max_s": max(res.times_s),
            "median_cpu_s": statistics.median(res.cpu_s),
            "items_per_s": w.tokens / med, "gflops": gflops,
            "mfu_vs_mlx_sgemm": gflops / sg_mlx, "mfu_vs_numpy_sgemm": gflops / sg_np,
        }
    return out


# ---- peak RSS in a clean process ------------------------------------------------------------
def probe_memory(workload: str, variant: str, steps: int = 3) -> dict[str, float]:
    """Peak RSS while one variant runs `steps` steps, in a process holding only that variant
    (run it in a child): Linux's VmHWM, reset after the build (/proc/self/clear_refs 5)."""
    import gc

    w = next(x for x in workloads() if x.name == workload)
    if variant.startswith("torch"):  # in this (probe) process, not in a grandchild
        weights = mlx_params_np(build_toymlx_model(w))
        mx.clear_cache()
        v: Variant = TorchStep(w, weights, make_batch(w), 1 if variant == "torch1t" else None)
        del weights
    else:
        v = build_variants(w, (variant,))[0][0]
    v.step(0)
    gc.collect()
    mx.clear_cache()
    before = _proc_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    mx.reset_peak_memory()
    for s in range(1, steps + 1):
        v.step(s)
    return {"rss_peak_mb": _proc_status("VmHWM"), "rss_before_steps_mb": before,
            "mlx_peak_mb": mx.get_peak_memory() / MB}


def _proc_status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def run_child(code: str, env: dict[str, str] | None = None, timeout: float = 1800) -> dict:
    """Run python `code` in a fresh process; its last stdout line is a JSON object."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False, timeout=timeout, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- GGUF I/O at the SmolLM2-360M size ------------------------------------------------------
def gguf_io(folder: Path) -> dict[str, Any]:
    """Seconds and peak RSS to write a random 360M F32 llama GGUF and to load it back
    (each in a fresh process; RSS is the process's whole VmHWM, and its VmRSS just before)."""
    path = folder / "bench-360m.gguf"
    rss = ("from pathlib import Path\n"
           "def st(k):\n"
           "    return next(int(x.split()[1]) / 1024 for x in "
           "Path('/proc/self/status').read_text().splitlines() if x.startswith(k + ':'))\n")
    write = run_child(
        "import json, time\n" + rss +
        "import toymlx, mlx.core as mx\n"
        "from toymlx.models.llama import Llama, smollm2_360m\n"
        "from toymlx.gguf.llama import write_llama\n"
        "mx.random.seed(0); m = Llama(smollm2_360m()); mx.eval(m.parameters())\n"
        "base = st('VmRSS'); Path('/proc/self/clear_refs').write_text('5')\n"
        "t = time.perf_counter()\n"
        f"write_llama({str(path)!r}, m, {{}}, name='bench')\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'rss_peak_mb': st('VmHWM'), 'rss_before_mb': base}))\n")
    load = run_child(
        "import json, time\n" + rss +
        "import toymlx, mlx.core as mx\n"
        "from toymlx.gguf.llama import load_llama\n"
        "base = st('VmRSS'); Path('/proc/self/clear_refs').write_text('5')\n"
        "t = time.perf_counter()\n"
        f"m, g = load_llama({str(path)!r})\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'rss_peak_mb': st('VmHWM'), 'rss_before_mb': base}))\n")
    size = path.stat().st_size / MB
    path.unlink()
    return {"file_mb": size, "write": write, "load": load}


# ---- one data-parallel rank per core against one process ------------------------------------
def dp_worker(workload: str, steps: int, out: str) -> None:
    """Time `steps` warm steps of toymlx's step on this rank's share of the batch (a child)."""
    world = mx.distributed.init()
    world = world if world.size() > 1 else None
    w = next(x for x in workloads() if x.name == workload)
    v = ToymlxVariant(w, build_toymlx_model(w), make_batch(w), world=world)
    loss0 = v.step(0)
    v.step(1)
    wall, cpu = [], []
    for s in range(2, 2 + steps):
        t, c = time.perf_counter(), time.process_time()
        v.step(s)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    rank = 0 if world is None else world.rank()
    Path(f"{out}.rank{rank}").write_text(json.dumps({"loss0": loss0, "grad_norm0": v.gnorm0,
                                                      "wall": wall, "cpu": cpu}))


def run_dp(workload: str, ranks: int = 2, rounds: int = 3, steps: int = 3,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """One process (OpenBLAS on every core) against `ranks` ring ranks over loopback with one
    BLAS thread each, alternating launches; per-step medians and the ratio dp / single."""
    from toymlx.launch import launch

    folder = Path(tempfile.mkdtemp(prefix="toymlx-dp-"))
    script = folder / "worker.py"  # a file: mlx.launch does not carry `-c` code intact
    script.write_text("import sys\nfrom toymlx.bench import dp_worker\n"
                      "from toymlx.launch import rank_status\n\nwith rank_status() as status:\n"
                      "    dp_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])\n"
                      "    status.code = 0\n")
    res: dict[str, Any] = {"workload": workload, "ranks": ranks, "single": [], "dp": []}
    for r in range(rounds):
        for kind in (("single", "dp") if r % 2 == 0 else ("dp", "single")):
            out = folder / f"{kind}{r}"
            cmd = [sys.executable, str(script), workload, str(steps), str(out)]
            if kind == "single":
                subprocess.run(cmd, check=True)
                reports = [json.loads(Path(f"{out}.rank0").read_text())]
            else:
                if launch(ranks, cmd, env=["OPENBLAS_NUM_THREADS=1"]) != 0:
                    raise RuntimeError(f"data-parallel launch of {workload} failed")
                reports = [json.loads(Path(f"{out}.rank{i}").read_text()) for i in range(ranks)]
            walls = [max(x) for x in zip(*(p["wall"] for p in reports))]  # slowest rank
            cpus = [sum(x) for x in zip(*(p["cpu"] for p in reports))]  # all ranks
            res[kind].append({"loss0": reports[0]["loss0"], "grad_norm0": reports[0]["grad_norm0"],
                              "wall": walls, "cpu": cpus})
            log(f"  dp {workload} {kind}: step {statistics.median(walls) * 1e3:.0f} ms wall, "
                f"{statistics.median(cpus) * 1e3:.0f} ms cpu, loss0 {reports[0]['loss0']:.6f}")
    for kind in ("single", "dp"):
        res[kind + "_median_s"] = statistics.median(x for r in res[kind] for x in r["wall"])
        res[kind + "_median_cpu_s"] = statistics.median(x for r in res[kind] for x in r["cpu"])
    pairs = [statistics.median(d["wall"]) / statistics.median(s["wall"])
             for s, d in zip(res["single"], res["dp"])]
    res["ratio_dp_over_single"] = statistics.median(pairs)
    res["loss0_abs_diff"] = abs(res["single"][0]["loss0"] - res["dp"][0]["loss0"])
    return res


# ---- the whole run and its table ------------------------------------------------------------
def run_all(quick: bool = False, only: list[str] | None = None, rounds: int | None = None,
            warmup: int = 1, which: tuple[str, ...] = ("toymlx", "torch", "mlx-lm"),
            memory: bool | None = None, gguf: bool | None = None, cold_jit: bool = True,
            partial_json: str | None = None, dp: int = 0,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every selected workload, then (optionally) child-process peak RSS and GGUF I/O."""
    from toymlx.device import backend_info

    tmp = Path(tempfile.mkdtemp(prefix="toymlx-bench-"))
    if cold_jit:
        # mx.compile caches its g++-built kernels under $TMPDIR/mlx; a fresh TMPDIR makes the
        # first step pay for the build, as a first run on a new machine does.
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = None
    chosen = [w for w in workloads() if (w.quick or not quick) and (not only or w.name in only)]
    info: dict[str, Any] = {"backend": backend_info(), "quick": quick, "cold_jit": cold_jit,
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                            "numpy": np.__version__, "workloads": []}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        which = tuple(x for x in which if not x.startswith("torch"))
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        which = tuple(x for x in which if x != "mlx-lm")
    t_all = time.perf_counter()
    for w in chosen:
        n = rounds or (3 if quick or (w.llama is not None and w.llama.d_model >= 960) else 5)
        log(f"{w.name}: {', '.join(which)} x {n} rounds")
        res = run_workload(w, n, warmup, which, log)
        mx.clear_cache()
        info["workloads"].append(res)
        if partial_json:
            Path(partial_json).write_text(json.dumps(info, indent=1, default=float))
    if memory if memory is not None else not quick:
        for res in info["workloads"]:
            for name in res["variants"]:
                log(f"  peak RSS: {res['workload']} {name}")
                probe = run_child(f"import json; from toymlx.bench import probe_memory; "
                                  f"print(json.dumps(probe_memory({res['workload']!r}, "
                                  f"{name!r})))")
                res["variants"][name].update(
                    rss_peak_mb=probe["rss_peak_mb"], rss_before_steps_mb=probe["rss_before_steps_mb"])
    for w in chosen if dp > 1 else []:
        log(f"{w.name}: {dp} data-parallel ranks against one process")
        info.setdefault("data_parallel", []).append(run_dp(w.name, dp, log=log))
    if gguf if gguf is not None else not quick:
        log("GGUF write + load at the SmolLM2-360M size")
        info["gguf_360m"] = gguf_io(tmp)
    info["total_s"] = time.perf_counter() - t_all
    return info


def format_table(info: dict[str, Any]) -> str:
    """A plain-text table of the results."""
    b = info["backend"]
    lines = [(f"backend: {b.get('kind')} blas={b.get('blas')} mlx={b.get('mlx')} "
              f"torch={info.get('torch')} ({info.get('torch_threads')} threads) "
              f"mlx-lm={info.get('mlx_lm')} cores={b.get('cores')} "
              f"cold_jit={info['cold_jit']} OMP_WAIT_POLICY={info.get('omp_wait_policy')}")]
    hdr = (f"{'workload':<13} {'impl':<7} {'median ms':>9} {'min ms':>8} {'cpu ms':>8} "
           f"{'items/s':>9} "
           f"{'GFLOPS':>7} {'MFU':>5} {'1st step s':>10} {'mlx MB':>8} {'RSS MB':>8} "
           f"{'loss0':>9} {'|g|0':>8}")
    lines += [hdr, "-" * len(hdr)]
    for res in info["workloads"]:
        unit = "img/s" if res["unit"] == "images" else "tok/s"
        for name, v in res["variants"].items():
            rss = v.get("rss_peak_mb")
            lines.append(
                f"{res['workload']:<13} {name:<7} {v['median_s'] * 1e3:>9.0f} "
                f"{v['min_s'] * 1e3:>8.0f} {v['median_cpu_s'] * 1e3:>8.0f} "
                f"{v['items_per_s']:>9.0f} {v['gflops']:>7.1f} "
                f"{v['mfu_vs_mlx_sgemm']:>5.2f} {v['first_step_s']:>10.2f} "
                f"{_num(v.get('mlx_peak_mb')):>8} {_num(rss):>8} {v['loss0']:>9.5f} "
                f"{_num(v.get('grad_norm0'), '.4f'):>8}")
        ratios = ", ".join(f"toymlx/{k} {r:.2f}x (cpu {res['cpu_ratio_toymlx_over'][k]:.2f}x)"
                           for k, r in res["ratio_toymlx_over"].items())
        sg = res["sgemm_gflops"]
        lines.append(f"{'':<13} time ratio (median of per-round ratios): {ratios}; "
                     f"{res['flops_per_step'] / 1e9:.1f} GFLOP/step, {unit}; sgemm 2048: "
                     f"mlx {sg['mlx']:.0f}, numpy {sg['numpy']:.0f} GFLOPS; "
                     f"load avg {res['loadavg_1min_at_end']:.1f}")
    g = info.get("gguf_360m")
    if g:
        lines.append(f"GGUF 360M F32 ({g['file_mb']:.0f} MB): write {g['write']['seconds']:.1f} s "
                     f"(peak RSS {g['write']['rss_peak_mb']:.0f} MB, "
                     f"{g['write']['rss_before_mb']:.0f} before), "
                     f"load {g['load']['seconds']:.1f} s (peak RSS {g['load']['rss_peak_mb']:.0f} "
                     f"MB, {g['load']['rss_before_mb']:.0f} before)")
    for d in info.get("data_parallel", []):
        lines.append(f"data parallel {d['workload']}: {d['ranks']} ranks x 1 BLAS thread "
                     f"{d['dp_median_s'] * 1e3:.0f} ms/step (cpu {d['dp_median_cpu_s'] * 1e3:.0f}) "
                     f"vs one process {d['single_median_s'] * 1e3:.0f} ms/step (cpu "
                     f"{d['single_median_cpu_s'] * 1e3:.0f}): dp/single {d['ratio_dp_over_single']:.2f}x,"
                     f" |loss0 diff| {d['loss0_abs_diff']:.1e}")
    lines.append(f"MFU: achieved GFLOPS / MLX fp32 sgemm 2048^3 in the same rounds. "
                 f"total {info['total_s']:.0f} s")
    return "\n".join(lines)


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the three small workloads, 3 rounds")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--only", nargs="*", help="workload names")
    p.add_argument("--rounds", type=int)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--impl", nargs="*", default=["toymlx", "torch", "mlx-lm"],
                   help="toymlx, toymlx-ref (MLX's own elementwise ops: toymlx.fastmath off), torch, "
                        "torch1t (PyTorch on one thread), mlx-lm")
    p.add_argument("--dp", type=int, default=0, metavar="N",
                   help="also time N data-parallel ranks (one BLAS thread each) against one "
                        "process, for each selected workload")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="peak RSS of each variant in a child process (default: not --quick)")
    p.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=None,
                   help="GGUF write/load at 360M (default: not --quick)")
    p.add_argument("--warm-jit", action="store_true",
                   help="keep mx.compile's kernel cache (first step without the g++ build)")
    a = p.parse_args(argv)
    info = run_all(a.quick, a.only, a.rounds, a.warmup, tuple(a.impl), a.memory, a.gguf,
                   cold_jit=not a.warm_jit, partial_json=a.json, dp=a.dp, log=lambda s: print(s, file=sys.stderr, flush=True))
    info["argv"] = sys.argv[1:] if argv is None else argv
    table = format_table(info)
    print(table)
    info["table"] = table
    if a.json:
        Path(a.json).write_text(json.dumps(info, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
