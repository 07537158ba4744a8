"""What the benchmark trains: workload shapes, the batch every implementation sees, FLOPs.

A workload is a model shape, a batch shape and an optimizer setting. Its batch and its FLOP
count are pure functions of the workload, so every implementation trains on the same numbers
and is credited with the same work. toymlx's model of it is the one its recipe builds
(`toymlx_step.build_task` checks the shape), so a Llama trained from random init has the
from-scratch recipe's byte vocabulary (`BYTES`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import ARCHS
from toymlx.models.llama import LlamaArgs, smollm2_135m, smollm2_360m, tiny
from toymlx.models.vit import ViTArgs, vit_tiny, vit_tiny_28


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    """"llama" or "vit"."""
    batch: int
    seq: int = 0
    llama: LlamaArgs | None = None
    vit: ViTArgs | None = None
    lora_rank: int = 0
    """0: train everything; r > 0: LoRA rank r on `lora_targets`, base frozen."""
    lora_targets: tuple[str, ...] = ("q",)
    lora_alpha: float = 16.0
    lr: float = 3e-3
    weight_decay: float = 0.1
    quick: bool = True
    """Part of the CPU suite's --quick set."""

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def tokens(self) -> int:
        """Items whose loss one step trains on (tokens, or images for the ViT)."""
        return self.batch * self.seq if self.kind == "llama" else self.batch

    @property
    def unit(self) -> str:
        return "images" if self.kind == "vit" else "tokens"

    def describe(self) -> dict:
        """The shape as plain values, for the JSON record."""
        model = self.vit if self.kind == "vit" else self.llama
        return {"kind": self.kind, "batch": self.batch, "seq": self.seq,
                "lora_rank": self.lora_rank, "lora_targets": list(self.lora_targets),
                "model": asdict(model)}


_LORA = {"lora_rank": 8, "lr": 2e-4, "weight_decay": 0.0}
BYTES = byte_tokenizer().vocab_size
"""The from-scratch recipe's vocabulary (bytes): a model trained from random init has it."""


def arch_shape(arch: str, base: LlamaArgs, window: int) -> LlamaArgs:
    """`base`'s shape computed as llama.cpp's `arch` (qwen2, qwen3, gemma3, phi3): the switches
    every file of it has (toymlx.gguf.llama.ARCHS), and those a real checkpoint sets: Gemma 3's
    sliding window (`window` keys) on five blocks of six, own RoPE base there, linear scaling 8
    on the global blocks, queries scaled by head_dim ** -0.5 (as its files load); Phi-4-mini's
    partial RoPE (3/4 of each head)."""
    a = replace(base, arch=arch, **ARCHS[arch].switches)
    if arch == "gemma3":
        a = replace(a, sliding_window=window, rope_base=1e6, rope_base_sliding=1e4,
                    rope_scale=1 / 8, sliding_layers=tuple(i % 6 < 5 for i in range(a.n_layers)),
                    attn_scale=a.head_dim ** -0.5)
    if arch == "phi3":
        a = replace(a, rope_dims=a.head_dim * 3 // 4)
    return a


def arch_workloads(base: LlamaArgs, batch: int, seq: int, prefix: str, quick: bool = False
                   ) -> list[Workload]:
    """LoRA r8 on the query projection of each architecture beyond llama at `base`'s shape
    (phi3 has only the fused `qkv`); gemma3's window is half the sequence, so it masks."""
    return [Workload(f"{prefix}-{arch}", "llama", batch=batch, seq=seq,
                     llama=arch_shape(arch, base, seq // 2), quick=quick,
                     lora_targets=("qkv",) if arch == "phi3" else ("q",), **_LORA)
            for arch in ("qwen2", "qwen3", "gemma3", "phi3")]


def cpu_workloads() -> list[Workload]:
    """The CPU suite (the 360M ones and the other architectures are outside --quick)."""
    return [
        Workload("llama-4x256", "llama", batch=8, seq=256, llama=tiny()),
        Workload("vit-tiny-28", "vit", batch=64, vit=vit_tiny_28()),
        Workload("lora-q-135m", "llama", batch=4, seq=256, llama=smollm2_135m(), **_LORA),
        Workload("scratch-360m", "llama", batch=4, seq=256, llama=smollm2_360m(vocab_size=BYTES),
                 quick=False),
        Workload("lora-q-360m", "llama", batch=4, seq=256, llama=smollm2_360m(), quick=False,
                 **_LORA),
        *arch_workloads(smollm2_135m(), batch=4, seq=256, prefix="lora-135m"),
    ]


def gpu_workloads(shapes: str = "full") -> list[Workload]:
    """The GPU suite; `shapes="tiny"` gives the same four roles at shapes any CPU runs in
    seconds (to check every code path of the GPU mode without a GPU)."""
    if shapes == "tiny":
        small = tiny(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_dim=128, context=128)
        return [
            Workload("tiny-vit", "vit", batch=4,
                     vit=ViTArgs(image_size=32, patch_size=8, channels=3, d_model=64,
                                 n_layers=2, n_heads=2, ffn_dim=128, num_classes=10)),
            Workload("tiny-lora-q", "llama", batch=2, seq=32, llama=small, **_LORA),
            Workload("tiny-lora-q-gqa3", "llama", batch=2, seq=32,
                     llama=tiny(vocab_size=512, d_model=48, n_layers=2, n_heads=3,
                                n_kv_heads=1, ffn_dim=96, context=128), **_LORA),
            Workload("tiny-scratch", "llama", batch=2, seq=64,
                     llama=replace(small, vocab_size=BYTES)),
        ]
    return [
        Workload("vit-tiny-224", "vit", batch=128, vit=vit_tiny()),
        Workload("lora-q-135m-8x512", "llama", batch=8, seq=512, llama=smollm2_135m(), **_LORA),
        Workload("lora-q-360m-8x512", "llama", batch=8, seq=512, llama=smollm2_360m(), **_LORA),
        Workload("scratch-360m-8x1024", "llama", batch=8, seq=1024,
                 llama=smollm2_360m(vocab_size=BYTES)),
    ]


def find(name: str) -> Workload:
    """The workload called `name` in either suite."""
    for w in cpu_workloads() + gpu_workloads("full") + gpu_workloads("tiny"):
        if w.name == name:
            return w
    raise KeyError(name)


def block_weights(a) -> int:
    """Weights of a llama model's blocks' projections (q, k, v, o, gate, up, down), all layers:
    a token's forward pass does 2 FLOPs for each."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return a.n_layers * (a.d_model * (2 * q + 2 * kv) + 3 * a.d_model * a.ffn_dim)


def train_flops(w: Workload) -> float:
    """Matmul FLOPs of one training step (same count for every implementation): 6 N per item
    (forward 2 N, backward 4 N), 4 N for a frozen LoRA base (no weight gradients), plus the
    attention's score and value products computed dense."""
    if w.kind == "vit":
        a = w.vit
        T = 1 + a.n_patches
        per_layer = 4 * a.d_model * a.d_model + 2 * a.d_model * a.ffn_dim
        n = a.n_layers * per_layer + a.patch_size ** 2 * a.channels * a.d_model
        tokens = w.batch * T
        attn_fwd = 4 * w.batch * a.n_heads * T * T * a.head_dim * a.n_layers
        return 6 * n * tokens + 3 * attn_fwd + 6 * a.d_model * a.num_classes * w.batch
    a = w.llama
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    n = block_weights(a) + a.vocab_size * a.d_model  # blocks + output head
    tokens = w.batch * w.seq
    attn_fwd = 4 * w.batch * a.n_heads * w.seq * w.seq * a.head_dim * a.n_layers
    if not w.lora:
        return 6 * n * tokens + 3 * attn_fwd
    # Frozen base: forward + input gradients only (4 N); the adapters train fully (6 N_lora).
    dims = {"q": (a.d_model, q), "k": (a.d_model, kv), "v": (a.d_model, kv),
            "qkv": (a.d_model, q + 2 * kv), "o": (q, a.d_model), "gate": (a.d_model, a.ffn_dim),
            "up": (a.d_model, a.ffn_dim), "gate_up": (a.d_model, 2 * a.ffn_dim),
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
