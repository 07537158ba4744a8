"""toymlx's Adam and AdamW (`toymlx.training.optimizers`): MLX's values, updated in place."""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from toymlx.models.llama import Llama, tiny
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training import optimizers
from toymlx.training.step import make_step
from toymlx.training.task import TrainConfig, make_optimizer


def _batch(rng: np.random.Generator) -> dict[str, mx.array]:
    return {"inputs": mx.array(rng.integers(0, 259, (1, 1, 16))),
            "targets": mx.array(rng.integers(0, 259, (1, 1, 16))),
            "mask": mx.ones((1, 1, 16))}


def _trained_last(n_blocks: int, d: int = 128, ffn: int = 256) -> Llama:
    """A tiny Llama whose last `n_blocks` alone train, as --full.layers does (lora.build)."""
    mx.random.seed(0)
    model = Llama(tiny(d_model=d, ffn_dim=ffn, n_heads=4, n_kv_heads=2), training_ops(False))
    model.freeze()
    for layer in model.layers[-n_blocks:]:
        layer.unfreeze()
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("ours, mlx", [
    (lambda: optimizers.AdamW(1e-2, weight_decay=0.1), lambda: optim.AdamW(1e-2, weight_decay=0.1)),
    (lambda: optimizers.Adam(1e-2), lambda: optim.Adam(1e-2)),
    (lambda: optimizers.Adam(1e-2, bias_correction=True),
     lambda: optim.Adam(1e-2, bias_correction=True)),
])
def test_the_updates_are_mlx_s_bit_for_bit(ours, mlx):
    """Three compiled steps of a partly frozen model: the same losses, weights and moments."""
    out = []
    for make in (ours, mlx):
        model, opt = _trained_last(2), make()
        step = make_step(model, lm_loss, opt)
        rng = np.random.default_rng(3)
        losses = [float(step(_batch(rng))["loss"]) for _ in range(3)]
        out.append((losses, tree_flatten(model.trainable_parameters()),
                    tree_flatten(opt.state)))
    assert out[0][0] == out[1][0]
    for got, want in zip(out[0][1] + out[0][2], out[1][1] + out[1][2]):
        assert got[0] == want[0]
        np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]), err_msg=got[0])


def test_a_full_fine_tune_step_updates_in_place():
    """A compiled step of the last 2 blocks of a 512-wide model, 16 tokens: its peak above the
    weights and moments held is the gradients and their clipped copies (1.65-1.8x the trained
    bytes on a CPU); MLX's AdamW allocated every new weight, m and v beside the old ones (4.0x)."""
    model = _trained_last(2, d=512, ffn=2048)
    opt = make_optimizer(TrainConfig(lr=1e-3, warmup=0, steps=3))
    opt.init(model.trainable_parameters())
    step = make_step(model, lm_loss, opt)
    trained = sum(p.nbytes for _, p in tree_flatten(model.trainable_parameters()))
    rng = np.random.default_rng(3)
    mx.eval(step(_batch(rng)), model.state, opt.state)  # the moments exist from here
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    mx.eval(step(_batch(rng)), model.state, opt.state)
    above = mx.get_peak_memory() - held
    assert above < 2.5 * trained, (above / trained, trained)
