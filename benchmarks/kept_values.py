"""Values a training step keeps per token and block, measured: the numbers behind
`toymlx.training.memory.BLOCK_D_VALUES`, `CHECKPOINT_D_VALUES` and `_target_inputs`.

    python benchmarks/kept_values.py                          # SmolLM2-135M shape, LoRA q, 1 x 256
    python benchmarks/kept_values.py --targets q,k,v,o,gate,up,down --seq-len 512
    python benchmarks/kept_values.py --qk-norm --grad-checkpoint
    python benchmarks/kept_values.py --gemma4 --targets q,ple_gate,ple_proj   # against --targets q

Builds the SmolLM2-135M shape (or, `--gemma4`, a gemma4 of E2B's widths: d 1536, MLP 6144,
8 sliding heads of 256, per-layer inputs of 256, a 4,096-token vocabulary) (random weights,
float32, the CPU's training `Ops`) with 2 and with 6 blocks, LoRA on the given targets, and runs one compiled value_and_grad of the LM loss
on each; MLX's peak over the model's own memory grows by what 4 more blocks keep, divided here
by 4 blocks and the batch's tokens: float32 values a token and block. The same step's count,
`memory._block_values` (with --grad-checkpoint: `CHECKPOINT_D_VALUES` d-wide arrays, the
recomputed block being in both models), is printed beside it.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse
from dataclasses import replace

import mlx.core as mx
from mlx import nn

from toymlx.backend import device
from toymlx.gguf.llama import ARCHS
from toymlx.models.llama import Llama, LlamaArgs, smollm2_135m
from toymlx.models.lora import apply_lora, parse_targets
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training import memory


def gemma4_e2b_width(n_layers: int) -> LlamaArgs:
    """A gemma4 of E2B's widths, every block sliding and projecting its own keys and values."""
    return replace(LlamaArgs(), arch="gemma4", **ARCHS["gemma4"].switches, vocab_size=4096,
                   d_model=1536, n_layers=n_layers, n_heads=8, n_kv_heads=1, key_length=256,
                   key_length_sliding=256, ffn_dim=6144, context=4096, rope_base=1e6,
                   norm_eps=1e-6, tie_embeddings=True, sliding_window=512,
                   sliding_layers=(True,) * n_layers, per_layer_dim=256, layer_scales=True,
                   final_softcap=30.0)


def shape(n_layers: int, qk_norm: bool, gemma4: bool) -> LlamaArgs:
    """The measured model at `n_layers` blocks: SmolLM2-135M's shape, or `gemma4_e2b_width`."""
    return gemma4_e2b_width(n_layers) if gemma4 else smollm2_135m(n_layers=n_layers,
                                                                  qk_norm=qk_norm)


def step_peak(n_layers: int, targets: tuple[str, ...], batch: int, seq_len: int, qk_norm: bool,
              grad_checkpoint: bool, gemma4: bool = False) -> int:
    """MLX's peak bytes over the model's own of a compiled value_and_grad (its second call)."""
    mx.random.seed(0)
    ops = training_ops(False, "float32", grad_checkpoint=grad_checkpoint)
    model = apply_lora(Llama(shape(n_layers, qk_norm, gemma4), ops), targets)
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, model.args.vocab_size, (batch, seq_len + 1))
    b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((batch, seq_len))}
    step = mx.compile(nn.value_and_grad(model, lambda x: lm_loss(model, x)[0]))
    peak = 0
    for _ in range(2):  # the first call compiles
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(step(b))
        peak = mx.get_peak_memory() - base
    return peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="q")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--qk-norm", action="store_true", help="qwen3's per-head q and k norms")
    p.add_argument("--grad-checkpoint", action="store_true")
    p.add_argument("--gemma4", action="store_true",
                   help="gemma4 at E2B's widths (`gemma4_e2b_width`)")
    args = p.parse_args(argv)
    device.setup_process(wide_evaluation=not args.grad_checkpoint)
    targets = parse_targets(args.targets)
    peaks = {n: step_peak(n, targets, args.batch_size, args.seq_len, args.qk_norm,
                          args.grad_checkpoint, args.gemma4) for n in (2, 6)}
    kept = (peaks[6] - peaks[2]) / 4 / (args.batch_size * args.seq_len) / 4
    a = shape(30, args.qk_norm, args.gemma4)
    ops = training_ops(False, "float32", grad_checkpoint=args.grad_checkpoint)
    counted = (memory.CHECKPOINT_D_VALUES * a.d_model if args.grad_checkpoint
               else memory._block_values(a, args.seq_len, ops, targets))
    name = "gemma4 E2B-width" if args.gemma4 else "SmolLM2-135M"
    print(f"{name} shape, LoRA {','.join(targets)}, {args.batch_size} x {args.seq_len}"
          f"{', qk_norm' if args.qk_norm else ''}"
          f"{', --grad-checkpoint' if args.grad_checkpoint else ''}: MLX's peak 2 blocks "
          f"{peaks[2] / 2**20:.1f} MiB, 6 blocks {peaks[6] / 2**20:.1f} MiB; kept {kept:,.0f} "
          f"float32 values a token and block, counted {counted:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
