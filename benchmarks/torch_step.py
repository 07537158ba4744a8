"""The PyTorch yardstick: the same models and training step written in plain PyTorch.

Same shapes and math as toymlx's (RMSNorm, adjacent-pair RoPE, GQA SDPA, SwiGLU, tied head;
LayerNorm, GELU and a cls token for the ViT; LoRA on the chosen projections), with toymlx's
parameter names so the weights copy over by name; AdamW (fused) with the same two decay groups
and gradient clipping. Eager by default; `compile_backend` runs the loss under `torch.compile`;
`dtype="bfloat16"` runs the forward under bf16 autocast (weights and optimizer in float32).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from rounds import Variant
from torch import nn
from workloads import Workload

from toymlx.models.llama import LlamaArgs
from toymlx.models.vit import ViTArgs


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LoRALinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, rank: int, alpha: float):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.lora_a = nn.Parameter(torch.zeros(rank, n_in))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(n_out, rank))  # (out, r)
        self.scale = alpha / rank

    def forward(self, x):
        return self.linear(x) + F.linear(F.linear(x, self.lora_a) * self.scale, self.lora_b)


def linear(n_in: int, n_out: int, w: Workload, target: str) -> nn.Module:
    """A projection, wrapped in LoRA where the workload trains `target` with LoRA."""
    if w.lora and target in w.lora_targets:
        return LoRALinear(n_in, n_out, w.lora_rank, w.lora_alpha)
    return nn.Linear(n_in, n_out, bias=False)


def rope(x, cos, sin):
    """Adjacent pairs (x[2i], x[2i+1]) rotated, as llama.cpp and toymlx rotate them."""
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (B,H,T,hd/2)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, w: Workload):
        super().__init__()
        self.a = a
        self.q_proj = linear(a.d_model, a.n_heads * a.head_dim, w, "q")
        self.k_proj = linear(a.d_model, a.n_kv_heads * a.head_dim, w, "k")
        self.v_proj = linear(a.d_model, a.n_kv_heads * a.head_dim, w, "v")
        self.o_proj = linear(a.n_heads * a.head_dim, a.d_model, w, "o")

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        a = self.a
        q = self.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)  # (B,H,T,hd)
        k = self.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)  # (B,Hkv,T,hd)
        v = self.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))  # (B,T,H*hd)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs, w: Workload):
        super().__init__()
        self.gate_proj = linear(a.d_model, a.ffn_dim, w, "gate")
        self.up_proj = linear(a.d_model, a.ffn_dim, w, "up")
        self.down_proj = linear(a.ffn_dim, a.d_model, w, "down")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs, w: Workload):
        super().__init__()
        self.attn_norm = RMSNorm(a.d_model, a.norm_eps)
        self.attn = Attention(a, w)
        self.ffn_norm = RMSNorm(a.d_model, a.norm_eps)
        self.mlp = MLP(a, w)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.ffn_norm(x))


class TorchLlama(nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        a = self.a = w.llama
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.layers = nn.ModuleList([Block(a, w) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.d_model, a.norm_eps)
        if not a.tie_embeddings:
            self.output = nn.Linear(a.d_model, a.vocab_size, bias=False)
        inv = a.rope_base ** (-torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim)
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
        ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
        mask = batch["mask"].flatten()
        return (ce * mask).sum() / mask.sum().clamp_min(1.0)


class ViTBlock(nn.Module):
    def __init__(self, a: ViTArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.attn_norm = nn.LayerNorm(a.d_model, eps=a.norm_eps)
        self.attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attn, n, nn.Linear(a.d_model, a.d_model))
        self.ffn_norm = nn.LayerNorm(a.d_model, eps=a.norm_eps)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(a.d_model, a.ffn_dim)
        self.mlp.down_proj = nn.Linear(a.ffn_dim, a.d_model)
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


class TorchViT(nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        a = self.a = w.vit
        self.patch_embed = nn.Linear(a.patch_size ** 2 * a.channels, a.d_model)
        self.cls_token = nn.Parameter(torch.zeros(a.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1 + a.n_patches, a.d_model))
        self.layers = nn.ModuleList([ViTBlock(a) for _ in range(a.n_layers)])
        self.norm = nn.LayerNorm(a.d_model, eps=a.norm_eps)
        self.head = nn.Linear(a.d_model, a.num_classes)

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


class TorchStep(Variant):
    """The same model and step in PyTorch, in this process: AdamW (fused where this torch has
    it), the same decay groups, gradient clipping at 1.0."""

    name = "torch"
    uses_mlx = False

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 threads: int | None = None, device: str = "cpu", dtype: str = "float32",
                 compile_backend: str | None = None):
        self.threads, self.device = threads, torch.device(device)
        if threads is not None:
            self.name = f"torch{threads}t"
        if compile_backend is not None:
            self.name = "torch-compile"
        self.autocast = dtype != "float32"
        self.amp_dtype = getattr(torch, dtype)
        model = TorchViT(w) if w.kind == "vit" else TorchLlama(w)
        with torch.no_grad():
            state = model.state_dict()
            missing = set(state) - set(weights)
            if missing:
                raise RuntimeError(f"torch model has parameters toymlx lacks: {sorted(missing)}")
            for k, v in weights.items():
                state[k].copy_(torch.from_numpy(v))
        model.to(self.device)
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
        except (RuntimeError, TypeError):  # no fused AdamW for this device in this torch
            opt = torch.optim.AdamW(groups, lr=w.lr, betas=(0.9, 0.95), eps=1e-8)
        self.model, self.opt, self.params = model, opt, params
        self.loss_fn = (model.loss if compile_backend is None
                        else torch.compile(model.loss, backend=compile_backend))
        self.batch = {k: torch.from_numpy(np.ascontiguousarray(v[0])).to(self.device)
                      for k, v in batch.items()}
        for k in ("inputs", "targets", "labels"):
            if k in self.batch:
                self.batch[k] = self.batch[k].long()
        self.gnorm0: float | None = None
        self.last_norm: float | None = None

    def step(self, s: int) -> float:
        if self.threads is None:
            return self._step()
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._step()
        finally:
            torch.set_num_threads(before)

    def _step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.autocast):
            loss = self.loss_fn(self.batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.last_norm = float(norm)  # waits for the device
        if self.gnorm0 is None:
            self.gnorm0 = self.last_norm
        return float(loss.detach())

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def resident_bytes(self) -> int:
        tensors = list(self.model.parameters()) + [
            t for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)
