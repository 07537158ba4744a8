"""The LR schedule: linear warm-up, cosine to a floor; Python and mlx give the same values."""

import itertools
import math

import mlx.core as mx
import pytest

from toymlx.training.schedule import lr_at
from toymlx.training.task import TrainConfig, warmup_note


def test_warmup_peak_and_end():
    lr, warm, total, floor = 1e-3, 10, 110, 0.1
    assert lr_at(0, lr, warm, total, floor) == pytest.approx(1e-4)  # first update: lr/warmup
    assert lr_at(4, lr, warm, total, floor) == pytest.approx(5e-4)
    assert lr_at(9, lr, warm, total, floor) == pytest.approx(1e-3)  # end of warm-up: peak
    assert lr_at(10, lr, warm, total, floor) == pytest.approx(1e-3)  # cosine starts at peak
    mid = 10 + (total - 1 - 10) / 2
    assert lr_at(mid, lr, warm, total, floor) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(total - 1, lr, warm, total, floor) == pytest.approx(1e-4)  # the floor
    assert lr_at(total + 50, lr, warm, total, floor) == pytest.approx(1e-4)  # stays there


def test_monotone_after_warmup_and_no_warmup():
    vals = [lr_at(s, 1.0, 5, 50, 0.0) for s in range(50)]
    assert all(a >= b for a, b in itertools.pairwise(vals[5:]))
    assert lr_at(0, 2.0, 0, 10, 0.5) == pytest.approx(2.0)
    assert lr_at(9, 2.0, 0, 10, 0.5) == pytest.approx(1.0)


def test_mlx_matches_python():
    for s in (0, 3, 9, 10, 37, 109):
        got = lr_at(mx.array(s), 1e-3, 10, 110, 0.1).item()
        assert math.isclose(got, lr_at(s, 1e-3, 10, 110, 0.1), rel_tol=1e-6)


def test_a_warmup_longer_than_the_run_is_said_and_kept():
    cfg = TrainConfig(steps=6, warmup=10, lr=2e-4)
    assert warmup_note(cfg) == (
        "--warmup 10 is longer than --steps 6: the learning rate is still warming up when the "
        "run ends (6/10 of the way) and never reaches --lr 0.0002; lower --warmup to reach it")
    # kept as given (mlx-lm and nanoGPT do not rescale a warm-up): the last update's lr is 6/10
    assert lr_at(cfg.steps - 1, cfg.lr, cfg.warmup, cfg.steps) == pytest.approx(1.2e-4)
    # as long as the run: --lr at the last update only, never decayed; shorter: nothing to say
    assert warmup_note(TrainConfig(steps=10, warmup=10, lr=2e-4)) == (
        "--warmup 10 is as long as --steps 10: the learning rate reaches --lr 0.0002 only at "
        "the last step and never decays; lower --warmup for a decay")
    assert lr_at(9, 2e-4, 10, 10) == pytest.approx(2e-4) and lr_at(8, 2e-4, 10, 10) < 2e-4
    assert warmup_note(TrainConfig(steps=11, warmup=10)) is None


def test_a_recipe_s_default_warmup_longer_than_the_run_is_said_as_the_default():
    """`--recipe lora --steps 4` (its default --warmup 10) trained at a rising lr throughout,
    never reaching --lr, and said nothing: the user gave no --warmup to know of. The line names
    the warm-up as the recipe's default."""
    from toymlx.recipes.lora import Config as LoraConfig
    from toymlx.recipes.vit_tiny import Config as VitConfig

    assert warmup_note(LoraConfig(steps=4)) == (
        "--warmup 10 (the recipe's default) is longer than --steps 4: the learning rate is still "
        "warming up when the run ends (4/10 of the way) and never reaches --lr 0.0002; lower "
        "--warmup to reach it")
    assert warmup_note(TrainConfig(steps=5)).startswith(  # from-scratch's default 20
        "--warmup 20 (the recipe's default) is longer than --steps 5:")
    assert warmup_note(LoraConfig(steps=11)) is None
    assert warmup_note(VitConfig(steps=20, warmup=80)) == (
        "--warmup 80 is longer than --steps 20: the learning rate is still warming up when the "
        "run ends (20/80 of the way) and never reaches --lr 0.0003; lower --warmup to reach it")
