"""Values a training step keeps per token and block, measured: the numbers behind
`toymlx.training.memory.BLOCK_D_VALUES`, `CHECKPOINT_D_VALUES` and `_target_inputs`.

    python benchmarks/kept_values.py                          # SmolLM2-135M shape, LoRA q, 1 x 256
    python benchmarks/kept_values.py --targets q,k,v,o,gate,up,down --seq-len 512
    python benchmarks/kept_values.py --qk-norm --grad-checkpoint

Builds the SmolLM2-135M shape (random weights, float32, the CPU's training `Ops`) with 2 and
with 6 blocks, LoRA on the given targets, and runs one compiled value_and_grad of the LM loss
on each; MLX's peak over the model's own memory grows by what 4 more blocks keep, divided here
by 4 blocks and the batch's tokens: float32 values a token and block. The same step's count,
`memory._block_values` (with --grad-checkpoint: `CHECKPOINT_D_VALUES` d-wide arrays, the
recomputed block being in both models), is printed beside it.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse

import mlx.core as mx
from mlx import nn

from toymlx.backend import device
from toymlx.models.llama import Llama, smollm2_135m
from toymlx.models.lora import apply_lora, parse_targets
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training import memory


def step_peak(n_layers: int, targets: tuple[str, ...], batch: int, seq_len: int, qk_norm: bool,
              grad_checkpoint: bool) -> int:
    """MLX's peak bytes over the model's own of a compiled value_and_grad (its second call)."""
    mx.random.seed(0)
    ops = training_ops(False, "float32", grad_checkpoint=grad_checkpoint)
    model = apply_lora(Llama(smollm2_135m(n_layers=n_layers, qk_norm=qk_norm), ops), targets)
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
    args = p.parse_args(argv)
    device.setup_process(wide_evaluation=not args.grad_checkpoint)
    targets = parse_targets(args.targets)
    peaks = {n: step_peak(n, targets, args.batch_size, args.seq_len, args.qk_norm,
                          args.grad_checkpoint) for n in (2, 6)}
    kept = (peaks[6] - peaks[2]) / 4 / (args.batch_size * args.seq_len) / 4
    a = smollm2_135m(qk_norm=args.qk_norm)
    ops = training_ops(False, "float32", grad_checkpoint=args.grad_checkpoint)
    counted = (memory.CHECKPOINT_D_VALUES * a.d_model if args.grad_checkpoint
               else memory._block_values(a, args.seq_len, ops, targets))
    print(f"SmolLM2-135M shape, LoRA {','.join(targets)}, {args.batch_size} x {args.seq_len}"
          f"{', qk_norm' if args.qk_norm else ''}"
          f"{', --grad-checkpoint' if args.grad_checkpoint else ''}: MLX's peak 2 blocks "
          f"{peaks[2] / 2**20:.1f} MiB, 6 blocks {peaks[6] / 2**20:.1f} MiB; kept {kept:,.0f} "
          f"float32 values a token and block, counted {counted:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
