"""Count the primitives in one LoRA training step's graph: toymlx's GPU math against mlx-lm's.

    python benchmarks/graph_census.py                      # lora-q-135m-8x512, bfloat16
    python benchmarks/graph_census.py --only lora-q-360m-8x512 --dtype float32

A speed comparison needs the GPU; which operations each step asks MLX for does not. This
builds the workload's model twice (the lora recipe's Task, computing with toymlx's `Ops` for a
GPU in the given dtype, its base held as a GPU run holds it (`frozen_weights`); mlx-lm's llama
with its LoRA layers, as the benchmark does), traces one step without compiling it, and counts
the primitives in the lazy graph (`mx.export_to_dot`). Width does not change the graph, so the
model is narrowed to a small vocabulary and a short batch; the count per transformer block is
the difference between a 2-block and a 1-block model. Three graphs per side: the forward and
backward pass alone (loss and gradients), the whole step (with the optimizer update), and the
whole step compiled as training compiles it, counted as kernels: each fused `Compiled` node one
kernel, every other node that is not a view (reshape, broadcast, transpose, slice...) one.
On a CPU, `mx.fast` kernels that have no CPU form show up as their fallback primitives, the
same ones on both sides, and toymlx's update sums each gradient's squares as the CPU does, one
Matmul (a Sum on a GPU: `toymlx.training.step.sum_of_squares`).
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse
import re
from collections import Counter
from dataclasses import replace

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from mlx_lm_step import MlxLmVariant
from scratch import scratch_folder
from toymlx_step import build_task, gpu_ops, recipe_inputs, weights_np
from workloads import Workload, find, make_batch

from toymlx.gguf.llama import frozen_weights
from toymlx.training.step import make_step, micro_batch_grads
from toymlx.training.task import make_optimizer

VIEWS = frozenset({"Reshape", "Broadcast", "Transpose", "Slice", "Squeeze", "ExpandDims",
                   "Flatten", "Unflatten", "AsStrided", "StopGradient", "Depends"})
"""Primitives that launch no kernel: views of their input (and graph-only markers)."""


def primitives(arrays: list[mx.array]) -> Counter:
    """How many times each primitive occurs in the graph that computes `arrays`."""
    with scratch_folder("toymlx-census-") as tmp:
        dot = tmp / "graph.dot"
        mx.export_to_dot(str(dot), *arrays)
        return Counter(re.findall(r'label ="([^"]+)"', dot.read_text()))


def kernels(arrays: list[mx.array]) -> Counter:
    """The kernels a compiled graph that computes `arrays` launches, by primitive: its nodes
    that are not views, every fused node (`Compiled...`) counted under "Compiled"."""
    counts = primitives(arrays)
    out: Counter = Counter()
    for name, n in counts.items():
        if name not in VIEWS:
            out["Compiled" if name.startswith("Compiled") else name] += n
    return out


def leaves(*trees: object) -> list[mx.array]:
    return [v for _, v in tree_flatten(list(trees))]


def census(w: Workload, dtype: str) -> dict[str, Counter]:
    """{side/graph: primitive counts} for one model size. toymlx's model and loss are the lora
    recipe's Task (`toymlx_step.build_task`); its step is `make_step`, the one a GPU runs (the
    CPU's stream split would trace two half-batches instead)."""
    batch = make_batch(w)
    micro = {k: mx.array(v[0]) for k, v in batch.items()}
    out: dict[str, Counter] = {}
    held = frozen_weights(gpu=True)
    mx.disable_compile()  # every graph below is traced lazily instead of compiled
    try:
        with recipe_inputs(w) as inputs:
            task, cfg = build_task(w, gpu_ops(dtype), inputs, compile=False, base_dtype=held)
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
    # the compiled steps, as training runs them: the state evaluated first, so that each graph
    # holds the step alone (not the lazy initialisation of the adapters and the moments)
    with recipe_inputs(w) as inputs:
        task, cfg = build_task(w, gpu_ops(dtype), inputs, compile=True, base_dtype=held)
    model, optimizer = task.model, make_optimizer(cfg)
    optimizer.init(model.trainable_parameters())
    mx.eval(model.parameters(), optimizer.state)
    res = make_step(model, task.loss_fn, optimizer, cfg.grad_clip, compile=True)(
        {k: mx.array(v) for k, v in batch.items()})
    out["toymlx/kernels"] = kernels(leaves(res, model.trainable_parameters(), optimizer.state))
    peer = MlxLmVariant(w, weights_np(model), batch, dtype=dtype)
    mx.eval(peer.model.parameters(), peer.optimizer.state)
    loss, _, _ = peer.step_fn((mx.array(peer.tokens), mx.array(peer.lengths)), None, True)
    out["mlx-lm/kernels"] = kernels(leaves(loss, peer.model.trainable_parameters(),
                                           peer.optimizer.state))
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
    titles = {"grad": "forward + backward", "step": "whole step (+ update)",
              "kernels": "kernels of the compiled step (fused nodes and non-views)"}
    for graph, title in titles.items():
        ours = {n: small[n][f"toymlx/{graph}"] for n in (1, 2)}
        theirs = {n: small[n][f"mlx-lm/{graph}"] for n in (1, 2)}
        names = sorted(set(ours[2]) | set(theirs[2]), key=lambda k: -(ours[2][k] + theirs[2][k]))
        print(f"\n{title}")
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
