"""Augmentation ops against Pillow's and hand-computed references; mixup/cutmix bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from toymlx.data import augment as A


def _imgs(n=3, h=12, w=12, c=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, c)).astype(np.uint8)


@pytest.mark.parametrize("name,pil", [
    ("brightness", lambda im, f: ImageEnhance.Brightness(im).enhance(f)),
    ("contrast", lambda im, f: ImageEnhance.Contrast(im).enhance(f)),
    ("color", lambda im, f: ImageEnhance.Color(im).enhance(f)),
    ("sharpness", lambda im, f: ImageEnhance.Sharpness(im).enhance(f)),
])
def test_enhance_ops_match_pillow(name, pil):
    x = _imgs()
    m = np.array([-0.7, 0.3, 0.9], np.float32)
    got = A.apply_op(x.astype(np.float32) / 255, name, m)
    for i in range(len(x)):
        want = np.asarray(pil(Image.fromarray(x[i]), 1 + 0.9 * m[i])).astype(np.float32) / 255
        # Pillow rounds to 8 bits (and its contrast mean is an integer): within 2/255
        np.testing.assert_allclose(got[i], want, atol=2.5 / 255)


def test_posterize_solarize_autocontrast_match_pillow():
    x = _imgs(c=1)[..., 0]
    xf = x[..., None].astype(np.float32) / 255
    m = np.array([0.3, 0.6, 1.0], np.float32)  # posterize keeps 7, 6, 4 bits
    post = A.apply_op(xf, "posterize", m)
    sol = A.apply_op(xf, "solarize", m)
    auto = A.apply_op(xf, "autocontrast", m)
    for i in range(3):
        im = Image.fromarray(x[i])
        bits = 8 - int(np.floor(4 * m[i]))
        np.testing.assert_array_equal(np.round(post[i, ..., 0] * 255),
                                      np.asarray(ImageOps.posterize(im, bits)))
        # Pillow's solarize inverts values >= its threshold; ours is threshold / 255
        want = np.asarray(ImageOps.solarize(im, round(255 * (1 - float(m[i])))))
        np.testing.assert_allclose(sol[i, ..., 0] * 255, want, atol=1e-3)
        np.testing.assert_allclose(auto[i, ..., 0] * 255, np.asarray(ImageOps.autocontrast(im)),
                                   atol=1.0)


def test_affine_identity_translation_and_rotation():
    x = np.random.default_rng(0).random((2, 9, 9, 1)).astype(np.float32)
    eye = np.tile(np.array([[1, 0, 0], [0, 1, 0]], np.float32), (2, 1, 1))
    np.testing.assert_allclose(A.affine(x, eye), x, atol=1e-6)
    shift = eye.copy()
    shift[:, 0, 2] = 2.0  # output column j reads input column j + 2
    out = A.affine(x, shift)
    np.testing.assert_allclose(out[:, :, :7], x[:, :, 2:], atol=1e-6)
    assert (out[:, :, 7:] == 0).all()
    rot = A.apply_op(x, "rotate", np.array([1.0, -1.0]))  # +-30 degrees about the centre
    assert rot.shape == x.shape and abs(rot[0, 4, 4, 0] - x[0, 4, 4, 0]) < 1e-6
    # a quarter turn is exact on pixel centres: compare with numpy's rot90
    a = np.deg2rad(90.0)
    quarter = np.array([[[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0]]], np.float32)
    np.testing.assert_allclose(A.affine(x[:1], quarter)[0], np.rot90(x[0], k=1), atol=1e-5)


def test_resized_crop_full_box_is_identity_and_pad_crop_shifts():
    x = np.random.default_rng(1).random((4, 10, 10, 3)).astype(np.float32)
    rng = np.random.default_rng(0)
    np.testing.assert_allclose(A.resized_crop(x, (1.0, 1.0), rng, ratio=(1.0, 1.0)), x,
                               atol=1e-5)
    small = A.resized_crop(x, (0.25, 0.25), np.random.default_rng(3), ratio=(1.0, 1.0))
    assert small.shape == x.shape and not np.allclose(small, x)
    flipped = A.hflip(x, np.random.default_rng(2))
    for i in range(4):
        assert np.array_equal(flipped[i], x[i]) or np.array_equal(flipped[i], x[i, :, ::-1])


def test_trivial_augment_is_deterministic_and_in_range():
    x = _imgs(n=64).astype(np.float32) / 255
    a = A.trivial_augment(x, np.random.default_rng([1, 2, 1]))
    b = A.trivial_augment(x, np.random.default_rng([1, 2, 1]))
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32 and a.min() >= 0 and a.max() <= 1 + 1e-6
    changed = [not np.allclose(a[i], x[i]) for i in range(64)]
    assert 40 < sum(changed) < 64  # identity (1 op in 13) and weak draws leave a few alone


def test_cutmix_lambda_is_the_kept_area_and_mixup_blends():
    rng = np.random.default_rng(0)
    x = rng.random((2, 6, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 5, (2, 6)).astype(np.int32)
    out = A.mix_batch({"images": x, "labels": y}, 0.0, 1.0, np.random.default_rng(5))
    boxes = 0
    for a in range(2):
        lam = out["mix_lam"][a, 0]
        for i in range(6):
            changed = ~np.isclose(out["images"][a, i, ..., 0], x[a, i, ..., 0])  # (H, W)
            if not changed.any():
                continue  # paired with itself
            rows, cols = np.nonzero(changed.any(1))[0], np.nonzero(changed.any(0))[0]
            box = np.zeros_like(changed)
            box[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = True
            assert (changed == box).all()  # one rectangle
            assert abs(changed.mean() - (1 - lam)) < 1e-6  # lam is the area kept
            boxes += 1
    assert boxes >= 6
    mixed = A.mix_batch({"images": x, "labels": y}, 0.4, 0.0, np.random.default_rng(5))
    lam = mixed["mix_lam"][0, 0]
    assert 0 <= lam <= 1 and (mixed["mix_lam"][0] == lam).all()
    for i in range(6):  # each image is lam * itself + (1 - lam) * an image of its partner label
        cands = [j for j in range(6) if np.allclose(
            mixed["images"][0, i], lam * x[0, i] + (1 - lam) * x[0, j], atol=1e-6)]
        assert cands and mixed["mix_labels"][0, i] in y[0, cands]
