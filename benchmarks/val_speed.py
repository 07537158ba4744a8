"""Validation against training, per row, in one process: issue 36's "validation at the speed of
a forward pass", timed as `toymlx-train` runs it.

    python benchmarks/val_speed.py [--steps 4] [--passes 2] [--eval-batches 4] [--base GGUF]

Builds the lora recipe's task on the real SmolLM2-135M-Instruct Q4_1 at the benchmark's LoRA
shape (4 x 256, LoRA on q, the recipe's packed default data; `user_paths.LORA_SHAPE`), steps it
with the trainer's `Stepper`, and after every `--steps` training steps times one validation
pass over the first `--eval-batches` batches two ways, back to back:
- now: the run's `training/evaluate.py:Evaluator` (compiled once, the step's CPU streams, held-out batches
  cut to their longest row with the loss at the trained positions alone), its first pass
  included (tracing, and compiling any kernel not yet in the kernel cache);
- before: what the loop ran before issue 36 (eager, one stream, batches of --batch-size rows
  each padded to --seq-len, `lm_loss` over every position), on the same rows.
Each figure is seconds per row (validation: per real row, the fill rows of a short last batch
not counted; training: a step's time over its 4 rows), wall clock and this process's CPU time
(on a machine shared with other work the CPU time is the steadier measure). The ratio is
validation per row over the median training step per row, the first step (its compile) apart.
Beside the times it prints the arithmetic floor of that ratio: the floating-point operations
of the validation rows (the forward pass, the head's logits only at the trained positions) over
those of the training steps' rows (the forward, the input gradient through every projection,
attention's backward at twice its forward, the head at every position both ways), the matmuls
counted, elementwise work not. The step's count is an upper bound (the first block's input
gradient is not needed), so the floor is a lower bound: a LoRA step on a frozen base does about
two forwards of work, so a validation row cannot cost much under half a training row.
Prints one JSON line after a human-readable table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toymlx.backend.device import setup_process


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _attention_flops(a, width: int, block: int = 64) -> int:
    """Causal attention's score and value products for one row of `width` tokens, computed
    `block` query rows at a time against the keys they see (`toymlx.backend.fastmath.attention`)."""
    hd = a.head_dim
    scores = sum((min(q + block, width) - q) * min(q + block, width)
                 for q in range(0, width, block))
    return 4 * a.n_layers * a.n_heads * hd * scores


def _rebatched(batches: list, batch_size: int, per_call: int) -> list:
    """The rows of the recipe's held-out batches, batched again `per_call` rows a call."""
    import numpy as np

    from toymlx.data.chat import sft_val_batches

    width = max(b["inputs"].shape[-1] for b in batches)
    rows = {k: np.concatenate([np.pad(b[k][0], [(0, 0), (0, width - b[k].shape[-1])])
                               for b in batches]) for k in ("inputs", "targets", "mask")}
    return sft_val_batches(rows, batch_size, len(rows["inputs"]), per_call)


def flop_floor(a, val_batches: list, rows: int, train_batch: dict) -> float:
    """FLOPs of a validation row over a training step's row (module docstring)."""
    from workloads import block_weights

    linear, head = 2 * block_weights(a), 2 * a.d_model * a.vocab_size
    val = 0
    for b in val_batches:
        n, width = b["inputs"].shape[1:]
        val += n * (width * linear + _attention_flops(a, width)
                    + b["positions"].shape[-1] * head)
    *_, B, T = train_batch["inputs"].shape
    step = B * (2 * T * linear + 3 * _attention_flops(a, T) + 2 * T * head)
    return (val / rows) / (step / B)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="training steps before each pass")
    p.add_argument("--passes", type=int, default=2, help="validation passes of each kind")
    p.add_argument("--eval-batches", type=int, default=4, help="batches of 4 rows per pass")
    p.add_argument("--base", help="another llama GGUF (default: the real SmolLM2-135M Q4_1)")
    p.add_argument("--held-out-rows", type=int, default=0,
                   help="training batches' rows a held-out call (default: the recipe's "
                        "toymlx.data.chat.HELD_OUT_ROWS)")
    args = p.parse_args(argv)
    setup_process()
    import numpy as np
    from user_paths import LORA_SHAPE, host_info, host_line, smollm_gguf

    from toymlx.models.losses import lm_loss
    from toymlx.recipes import lora
    from toymlx.runner.run import run_ops
    from toymlx.training.evaluate import Evaluator
    from toymlx.training.task import check_config
    from toymlx.training.trainer import Stepper

    shape = {k: v for k, v in LORA_SHAPE.items() if k != "lora"}
    cfg = lora.Config(base=args.base or str(smollm_gguf()), **shape, eval_batches=args.eval_batches,
                      progress=False, lora=lora.LoRAOptions(**LORA_SHAPE["lora"]))
    check_config(lora, cfg)
    task = lora.build(cfg, run_ops(cfg))
    if args.held_out_rows:
        task = replace(task, val_batches=_rebatched(task.val_batches, cfg.batch_size,
                                                    args.held_out_rows * cfg.batch_size))
    stepper = Stepper(task, cfg)
    stepper.build()
    now = Evaluator(task, cfg.compile, stepper.n_streams, stepper.blas_threads)
    batches = task.val_batches[:args.eval_batches]
    rows = sum(int((b["mask"][0].sum(axis=-1) > 0).sum()) for b in batches)
    # before: every row padded to --seq-len, the loss over every position, eager, one stream
    # (and batches of --batch-size rows: held-out batches now hold HELD_OUT_ROWS times that)
    full = [{k: np.pad(v[:, a:a + cfg.batch_size],
                       [(0, 0), (0, 0), (0, cfg.seq_len - v.shape[-1])])
             for k, v in b.items() if k in ("inputs", "targets", "mask")}
            for b in batches for a in range(0, b["inputs"].shape[1], cfg.batch_size)]
    before = Evaluator(replace(task, metrics_fn=None, loss_fn=lm_loss, val_batches=full),
                       compile=False)
    steps, passes, s = [], {"now": [], "before": []}, 0
    for _ in range(args.passes):
        for _ in range(args.steps):
            _, wall, cpu = _timed(lambda s=s: stepper.step(s, task.train_batch(s)))
            steps.append((wall / cfg.batch_size, cpu / cfg.batch_size))
            s += 1
        for name, ev in (("now", now), ("before", before)):
            m, wall, cpu = _timed(lambda ev=ev: ev(args.eval_batches))
            passes[name].append((wall / rows, cpu / rows, m["val_loss"]))
    train = [statistics.median(x[i] for x in steps[1:]) for i in (0, 1)]
    floor = flop_floor(task.model.args, batches, rows, task.train_batch(0))
    out = {"host": host_info(), "rows": rows, "train_s_per_row": {"wall": train[0],
                                                                   "cpu": train[1]},
           "flop_floor": floor}
    print(host_line(out["host"]))
    print(f"training step, median of {len(steps) - 1} (first apart): {train[0]:.3f} s/row "
          f"wall, {train[1]:.3f} s/row CPU")
    print(f"arithmetic floor: a validation row's FLOPs are {floor:.2f}x a training row's")
    for name, rec in passes.items():
        out[name] = [{"wall": w, "cpu": c, "val_loss": v, "ratio_wall": w / train[0],
                      "ratio_cpu": c / train[1]} for w, c, v in rec]
        for i, r in enumerate(out[name]):
            print(f"validation {name:6s} pass {i + 1} ({rows} rows): {r['wall']:.3f} s/row wall "
                  f"({r['ratio_wall']:.2f}x a step's), {r['cpu']:.3f} s/row CPU "
                  f"({r['ratio_cpu']:.2f}x), val_loss {r['val_loss']:.6f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
