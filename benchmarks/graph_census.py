"""Count the primitives in one LoRA training step's graph: toymlx's GPU math against mlx-lm's.

    python benchmarks/graph_census.py                      # lora-q-135m-8x512, bfloat16
    python benchmarks/graph_census.py --only lora-q-360m-8x512 --dtype float32

A speed comparison needs the GPU; which operations each step asks MLX for does not. This
builds the workload's model twice (the lora recipe's Task, computing with toymlx's `Ops` for a
GPU in the given dtype; mlx-lm's llama with its LoRA layers, as the benchmark does), traces one
step without compiling it, and counts the primitives in the lazy graph (`mx.export_to_dot`).
Width does not change the graph, so the model is narrowed to a small vocabulary and a short
batch; the count per transformer block is the difference between a 2-block and a 1-block model.
Two graphs per side: the forward and backward pass alone (loss and gradients), and the whole
step (with the optimizer update).
On a CPU, `mx.fast` kernels that have no CPU form show up as their fallback primitives, the
same ones on both sides.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse
import re
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from mlx_lm_step import MlxLmVariant
from toymlx_step import build_task, gpu_ops, recipe_inputs, weights_np
from workloads import Workload, find, make_batch

from toymlx.training.step import make_step, micro_batch_grads
from toymlx.training.task import make_optimizer


def primitives(arrays: list[mx.array]) -> Counter:
    """How many times each primitive occurs in the graph that computes `arrays`."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(dot), *arrays)
        return Counter(re.findall(r'label ="([^"]+)"', dot.read_text()))


def leaves(*trees: object) -> list[mx.array]:
    return [v for _, v in tree_flatten(list(trees))]


def census(w: Workload, dtype: str) -> dict[str, Counter]:
    """{side/graph: primitive counts} for one model size. toymlx's model and loss are the lora
    recipe's Task (`toymlx_step.build_task`); its step is `make_step`, the one a GPU runs (the
    CPU's stream split would trace two half-batches instead)."""
    batch = make_batch(w)
    micro = {k: mx.array(v[0]) for k, v in batch.items()}
    out: dict[str, Counter] = {}
    mx.disable_compile()  # every graph below is traced lazily instead of compiled
    try:
        with recipe_inputs(w) as inputs:
            task, cfg = build_task(w, gpu_ops(dtype), inputs, compile=False)
        model = task.model
        weights = weights_np(model)
        loss, _, grads = micro_batch_grads(model, task.loss_fn)(micro)
        out["toymlx/grad"] = primitives(leaves(loss, grads))
        optimizer = make_optimizer(cfg)
        optimizer.init(model.trainable_parameters())
        res = make_step(model, task.loss_fn, optimizer, cfg.grad_clip, compile=False)(
            {k: mx.array(v) for k, v in batch.items()})
        out["toymlx/step"] = primitives(leaves(res, model.trainable_parameters(),
                                               optimizer.state))

        peer = MlxLmVariant(w, weights, batch, dtype=dtype)
        tokens, lengths = mx.array(peer.tokens), mx.array(peer.lengths)
        (loss, _), grads = nn.value_and_grad(peer.model, default_loss)(peer.model, tokens,
                                                                       lengths)
        out["mlx-lm/grad"] = primitives(leaves(loss, grads))
        loss, _, _ = peer.step_fn((tokens, lengths), None, True)
        out["mlx-lm/step"] = primitives(leaves(loss, peer.model.trainable_parameters(),
                                               peer.optimizer.state))
    finally:
        mx.enable_compile()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="lora-q-135m-8x512", help="a LoRA workload of the suite")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    w = find(args.only)
    if not w.lora:
        raise SystemExit(f"{args.only}: not a LoRA workload (mlx-lm's side is its LoRA step)")
    small = {n: census(replace(w, batch=1, seq=64, llama=replace(w.llama, n_layers=n,
                                                                  vocab_size=1024)), args.dtype)
             for n in (1, 2)}
    print(f"{args.only} in {args.dtype}: primitives in one step's graph "
          f"(per block: 2 blocks minus 1; total: 1 block)")
    for graph in ("grad", "step"):
        ours = {n: small[n][f"toymlx/{graph}"] for n in (1, 2)}
        theirs = {n: small[n][f"mlx-lm/{graph}"] for n in (1, 2)}
        names = sorted(set(ours[2]) | set(theirs[2]), key=lambda k: -(ours[2][k] + theirs[2][k]))
        print(f"\n{'forward + backward' if graph == 'grad' else 'whole step (+ update)'}")
        print(f"{'primitive':20s} {'toymlx/block':>12s} {'mlx-lm/block':>12s} "
              f"{'toymlx':>7s} {'mlx-lm':>7s}")
        for d in (ours, theirs):
            for n in (1, 2):
                d[n]["all"] = d[n].total()
        for k in names + ["all"]:
            row = (ours[2][k] - ours[1][k], theirs[2][k] - theirs[1][k], ours[1][k], theirs[1][k])
            if k == "all" or row[0] != row[1] or row[2] != row[3]:
                print(f"{k:20s} {row[0]:12d} {row[1]:12d} {row[2]:7d} {row[3]:7d}")
    print("\n(rows where both sides agree are left out)")


if __name__ == "__main__":
    main()
