"""Batches of several widths (unpacked rows): the first step traces the compiled step for every
width the run will see (`Stepper.trace`), so that no later step stops to trace; the traces take
no step and leave the model, optimizer and random state as they were."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from toymlx.data.chat import PAD_MULTIPLE, SFTData
from toymlx.models.llama import Llama, tiny
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training.task import Task, TrainConfig
from toymlx.training.trainer import Stepper

VOCAB = 64


def _batch(width: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (1, 4, width + 1)).astype(np.int32)
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
            "mask": np.ones((1, 4, width), np.float32)}


def _stepper(cpu_streams: int, traced: list[int]) -> Stepper:
    """A tiny Llama's Stepper whose loss function counts its Python calls (one per trace of a
    micro-batch shape) in `traced`."""
    mx.random.seed(0)
    model = Llama(tiny(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                       ffn_dim=64), training_ops(False))

    def loss_fn(m, batch):
        traced.append(batch["inputs"].shape[-1])
        return lm_loss(m, batch)

    cfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=0, cpu_streams=cpu_streams)
    stepper = Stepper(Task("test", model, loss_fn, lambda s: _batch(32, s), [], None, None, {}),
                      cfg)
    stepper.build()
    return stepper


@pytest.mark.parametrize("cpu_streams", [1, 2])
def test_traced_widths_take_no_step_and_are_not_traced_again(cpu_streams):
    """Four steps of widths 32, 64, 96, 64 : with the three widths traced before the
    first step, the losses, gradient norms, weights and optimizer state equal those of the run
    that traces as it goes, bit for bit, and no step traces (the loss function's Python body
    runs only in `trace`)."""
    widths = [32, 64, 96, 64]
    runs = {}
    for ahead in (False, True):
        traced: list[int] = []
        stepper = _stepper(cpu_streams, traced)
        if ahead:
            stepper.trace([_batch(w, 100 + w) for w in (64, 96)])
            stepper.trace([_batch(32, 0)])
            assert sorted(traced) == sorted([32, 64, 96] * cpu_streams)
            traced.clear()
        outs = [stepper.step(s, _batch(w, s)) for s, w in enumerate(widths)]
        if ahead:
            assert traced == [], "a step traced a width already traced"
        else:
            assert len(traced) == 3 * cpu_streams  # each new width, once per stream
        runs[ahead] = ([(o["loss"].item(), o["grad_norm"].item()) for o in outs],
                       [np.array(v) for v in _leaves(stepper.model.trainable_parameters())],
                       [np.array(v) for v in _leaves(stepper.optimizer.state)])
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1] + runs[True][2], runs[False][1] + runs[False][2]):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    from mlx.utils import tree_flatten
    return [v for _, v in tree_flatten(tree)]


def test_batch_widths_are_the_built_batches_widths():
    """`SFTData.batch_widths` over 60 steps (several epochs, rows of many lengths) equals the
    width of each batch `SFTData.batch` builds, and a packed run's is its one width."""
    rng = np.random.default_rng(1)
    n, width = 37, 256
    mask = np.zeros((n, width), np.float32)
    for r, end in enumerate(rng.integers(1, width + 1, n)):
        mask[r, rng.integers(0, end):end] = 1.0
    mask[5] = 0.0  # a row with no trained target
    rows = {"inputs": np.zeros((n, width), np.int32), "targets": np.zeros((n, width), np.int32),
            "mask": mask}
    data = SFTData(rows, rows, "<test>")
    steps = range(3, 63)
    got = data.batch_widths(steps, seed=7, batch_size=3, accum=2)
    want = [data.batch(s, 7, 3, 2)["mask"].shape[-1] for s in steps]
    assert got.tolist() == want
    assert len(set(want)) > 3 and all(w % PAD_MULTIPLE == 0 for w in want)
    packed = SFTData(rows, rows, "<test>", pack=True)
    assert packed.batch_widths(steps, 7, 3, 2).tolist() == [width] * len(steps)
