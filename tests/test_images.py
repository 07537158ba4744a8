"""Image data: digits fixture, IDX and npz loading, split, normalisation, batches, errors."""

from __future__ import annotations

import gzip
import hashlib
import re
from collections import Counter

import numpy as np
import pytest
from image_files import fake_pair, write_idx

from toymlx.data.images import (
    DIGITS_NPZ,
    Augment,
    ImageDataError,
    load_idx,
    load_images,
    load_npz,
    read_idx,
)


def rows(x: np.ndarray, y: np.ndarray) -> Counter:
    return Counter((xi.tobytes(), int(yi)) for xi, yi in zip(x, y))


# --- the digits fixture --------------------------------------------------------------------

def test_digits_fixture_contents_and_hash():
    x, y = load_npz(DIGITS_NPZ)
    assert x.shape == (1797, 8, 8, 1) and x.dtype == np.uint8
    assert (x.min(), x.max()) == (0, 16)
    assert y.shape == (1797,) and sorted(set(y.tolist())) == list(range(10))
    assert np.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    readme = (DIGITS_NPZ.parent / "README.md").read_text()
    recorded = re.search(r"sha256 of `digits.npz`: `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256(DIGITS_NPZ.read_bytes()).hexdigest() == recorded


def test_default_split_sizes_and_disjointness():
    d = load_images(None)
    assert (len(d.train_x), len(d.val_x)) == (1617, 180)
    assert d.image_shape == (8, 8, 1) and d.num_classes == 10 and d.scale == 16.0
    x, y = load_npz(DIGITS_NPZ)
    assert rows(d.train_x, d.train_y) + rows(d.val_x, d.val_y) == rows(x, y)
    # Standardised with training statistics: training pixels have mean 0, std 1.
    z = d.normalise(d.train_x)
    assert abs(z.mean()) < 1e-5 and abs(z.std() - 1) < 1e-4


def test_validation_is_fixed_and_unaugmented():
    a, b = load_images(None), load_images(None, augment=Augment(crop="shift", pad=2))
    va, vb = a.val_batches(64), b.val_batches(64)
    assert [v["images"].shape for v in va] == [(1, 64, 8, 8, 1), (1, 64, 8, 8, 1), (1, 52, 8, 8, 1)]
    assert all(v["labels"].dtype == np.int32 and v["images"].dtype == np.float32 for v in va)
    for p, q in zip(va, vb):
        np.testing.assert_array_equal(p["images"], q["images"])
    np.testing.assert_array_equal(np.concatenate([v["labels"][0] for v in va]), a.val_y)
    np.testing.assert_allclose(va[0]["images"][0], a.normalise(a.val_x[:64]))
    padded = a.val_batches(64, pad_last=True)
    assert padded[-1]["images"].shape == (1, 64, 8, 8, 1)
    assert (padded[-1]["labels"][0, 52:] == -1).all() and (padded[-1]["labels"][0, :52] >= 0).all()


# --- training batches ----------------------------------------------------------------------

def test_train_batch_is_a_pure_function_of_seed_and_step():
    b1 = load_images(None).train_batch(step=5, seed=7, batch_size=32, accum=2)
    d = load_images(None)
    d.train_batch(step=0, seed=1, batch_size=32)  # other calls in between change nothing
    b2 = d.train_batch(step=5, seed=7, batch_size=32, accum=2)
    assert b1["images"].shape == (2, 32, 8, 8, 1) and b1["images"].dtype == np.float32
    assert b1["labels"].shape == (2, 32) and b1["labels"].dtype == np.int32
    for k in b1:
        np.testing.assert_array_equal(b1[k], b2[k])
    other_step = d.train_batch(step=6, seed=7, batch_size=32, accum=2)
    other_seed = d.train_batch(step=5, seed=8, batch_size=32, accum=2)
    assert not np.array_equal(b1["images"], other_step["images"])
    assert not np.array_equal(b1["labels"], other_seed["labels"])


def test_an_epoch_visits_every_training_image_once():
    d = load_images(None)
    n = len(d.train_x)  # 1617 = 21 * 77
    steps = [d.train_batch(s, seed=3, batch_size=77) for s in range(n // 77)]
    images = np.concatenate([b["images"].reshape(-1, 8, 8, 1) for b in steps])
    labels = np.concatenate([b["labels"].ravel() for b in steps])
    seen = rows(images, labels)
    assert seen == rows(d.normalise(d.train_x), d.train_y)
    # The next epoch is shuffled differently.
    nxt = d.train_batch(n // 77, seed=3, batch_size=77)["labels"].ravel()
    assert not np.array_equal(nxt, steps[0]["labels"].ravel())


def test_augmentation_shifts_with_zero_padding():
    plain = load_images(None)
    aug = load_images(None, augment=Augment(crop="shift", pad=1))
    a = plain.train_batch(2, seed=0, batch_size=64)
    b = aug.train_batch(2, seed=0, batch_size=64)
    np.testing.assert_array_equal(a["labels"], b["labels"])  # same images, shifted
    raw = a["images"][0] * plain.std + plain.mean  # back to [0, 1]
    got = b["images"][0] * plain.std + plain.mean
    moved = 0
    for r, g in zip(raw, got):
        ok = []
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                s = np.zeros_like(r)
                s[max(dy, 0):8 + min(dy, 0), max(dx, 0):8 + min(dx, 0)] = \
                    r[max(-dy, 0):8 + min(-dy, 0), max(-dx, 0):8 + min(-dx, 0)]
                ok.append(np.allclose(s, g, atol=1e-5))
        assert any(ok)
        moved += not ok[4]
    assert moved > 32  # 8 of 9 offsets move the image


# --- IDX -----------------------------------------------------------------------------------

def test_idx_mnist_t10k(shared_file):
    t10k = shared_file("images/t10k-images-idx3-ubyte.gz")
    shared_file("images/t10k-labels-idx1-ubyte.gz")  # its labels, read beside it
    x, y = load_idx(t10k)
    assert x.shape == (10000, 28, 28, 1) and x.dtype == np.uint8
    assert y.shape == (10000,) and sorted(set(y.tolist())) == list(range(10))
    d = load_images(str(t10k.parent))  # a folder with one (t10k) pair: split 9000/1000
    assert (len(d.train_x), len(d.val_x), d.image_shape, d.scale) == (9000, 1000, (28, 28, 1), 255)
    b = d.train_batch(0, seed=0, batch_size=8)
    assert b["images"].shape == (1, 8, 28, 28, 1)


def test_idx_folder_with_train_and_t10k_uses_official_split(tmp_path):
    fake_pair(tmp_path, "train", 50, seed=1)
    fake_pair(tmp_path, "t10k", 20, seed=2)
    d = load_images(str(tmp_path))
    assert (len(d.train_x), len(d.val_x)) == (50, 20)
    xt, yt = load_idx(tmp_path / "t10k-images-idx3-ubyte")
    np.testing.assert_array_equal(d.val_x, xt)
    np.testing.assert_array_equal(d.val_y, yt)


def test_idx_bad_magic(tmp_path):
    p = write_idx(tmp_path / "x-images-idx3-ubyte", np.zeros((2, 4, 4)), magic=0x00000801)
    with pytest.raises(ImageDataError) as e:
        read_idx(p, 0x00000803)
    assert str(e.value) == (f"{p}: bad IDX magic number: expected 0x00000803 (ubyte images, 3-D), "
                            "found 0x00000801")


@pytest.mark.parametrize("name", ["x-images-idx3-ubyte", "x-images-idx3-ubyte.gz"])
def test_idx_truncated(tmp_path, name):
    full = tmp_path / "full"
    write_idx(full, np.zeros((3, 4, 4)))
    p = tmp_path / name
    data = full.read_bytes()[:-5]
    p.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(ImageDataError) as e:
        read_idx(p, 0x00000803)
    assert str(e.value) == f"{p}: truncated: expected 64 bytes (header 16 + 3x4x4), found 59"


def test_idx_truncated_gzip_stream(tmp_path):
    p = write_idx(tmp_path / "x-images-idx3-ubyte.gz", np.zeros((30, 8, 8)))
    p.write_bytes(p.read_bytes()[:-12])
    with pytest.raises(ImageDataError, match=re.escape(f"{p}: truncated gzip stream")):
        read_idx(p, 0x00000803)


def test_idx_label_count_mismatch(tmp_path):
    images = write_idx(tmp_path / "a-images-idx3-ubyte", np.zeros((5, 4, 4)))
    labels = write_idx(tmp_path / "a-labels-idx1-ubyte", np.zeros(4))
    with pytest.raises(ImageDataError) as e:
        load_images(str(images))
    assert str(e.value) == (f"{labels}: label count mismatch: expected 5 (images in "
                            "a-images-idx3-ubyte), found 4")


def test_idx_missing_labels(tmp_path):
    images = write_idx(tmp_path / "a-images-idx3-ubyte.gz", np.zeros((5, 4, 4)))
    with pytest.raises(ImageDataError, match="labels file not found: expected .*a-labels-idx1"):
        load_images(str(images))


# --- npz -----------------------------------------------------------------------------------

def test_npz_of_8_bit_pixels_is_scaled_by_255_whatever_its_brightest_pixel(tmp_path):
    """A dark uint8 set (nothing above 100) was divided by its own maximum, so its units were
    not those of the same images as files (toymlx-classify and an ImageFolder divide by 255):
    a model that scored 100% on the set called every bright-class PNG of it the dark class."""
    rng = np.random.default_rng(0)
    p = tmp_path / "dark.npz"
    np.savez(p, x=rng.integers(0, 101, (20, 4, 4, 1)).astype(np.uint8), y=np.arange(20) % 2)
    d = load_images(str(p), val_fraction=0.25)
    assert (d.scale, d.scale_fixed) == (255.0, True)
    x = np.asarray(d.train_x, np.float64) / 255.0
    assert np.allclose(d.mean, x.mean(axis=(0, 1, 2)), atol=1e-6)
    assert load_images(None).scale == 16.0  # the UCI digits: counts of 0..16


def test_npz_adds_channel_axis_and_scales_by_max(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "set.npz"
    np.savez(p, x=rng.uniform(0, 4, (40, 5, 5)).astype(np.float64), y=rng.integers(0, 3, 40))
    d = load_images(str(p), val_fraction=0.25)
    assert (len(d.train_x), len(d.val_x), d.image_shape) == (30, 10, (5, 5, 1))
    assert d.train_x.dtype == np.float32 and d.num_classes <= 3
    assert d.train_batch(0, 0, 4, 3)["images"].shape == (3, 4, 5, 5, 1)


def test_npz_errors(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, images=np.zeros((2, 3, 3)))
    with pytest.raises(ImageDataError, match=r"missing array\(s\) x, y: expected .* found images"):
        load_images(str(p))
    np.savez(p, x=np.zeros((4, 3, 3)), y=np.zeros(3, np.int64))
    with pytest.raises(ImageDataError, match=r"y: expected \(4,\) integer labels, found \(3,\)"):
        load_images(str(p))
    with pytest.raises(ImageDataError, match="expected a folder of images or a data set file, "
                       "found nothing at that path"):
        load_images(str(tmp_path / "missing.npz"))


def test_a_held_out_set_of_its_own_is_scaled_by_its_own_format(tmp_path):
    """--data.val-path and --data.test-path sets were divided by the training images' scale: a
    float [0, 1] .npz validating a uint8 run scored pixels near 0 (a 0.30 model scored 0.14 on
    the same images as floats), and PNGs validating a float [0, 1] run pixels up to 255. Each
    set reaches [0, 1] by its own format, so the same images give the same batches."""
    rng = np.random.default_rng(0)
    x8 = rng.integers(0, 256, (20, 4, 4), dtype=np.uint8)
    y = np.arange(20) % 2
    u8, f1 = tmp_path / "u8.npz", tmp_path / "f1.npz"
    np.savez(u8, x=x8, y=y)
    np.savez(f1, x=x8.astype(np.float32) / x8.max(), y=y)  # the same images, over their maximum

    def held_out(d):
        return (np.concatenate([b["images"][0] for b in d.val_batches(8)]),
                np.concatenate([b["images"][0] for b in d.test_batches(8)]))

    for train in (u8, f1):
        want = held_out(load_images(str(train), val_path=str(train), test_path=str(train)))
        other = f1 if train == u8 else u8
        d = load_images(str(train), val_path=str(other), test_path=str(other))
        assert (d.val_scale, d.test_scale) == ((1.0, 1.0) if train == u8 else (255.0, 255.0))
        got = held_out(d)
        assert np.allclose(got[0], want[0], atol=1e-5) and np.allclose(got[1], want[1], atol=1e-5)
    split = load_images(str(u8), val_fraction=0.25)  # a split of the set: its own scale
    assert split.val_scale is None and split.test_batches(8) == []
    assert np.allclose(split.val_batches(8)[0]["images"][0],
                       split.normalise(split.val_x, 255.0))


CHANNELS = "x: expected 1 (grey) or 3 (RGB) channels last, found"


@pytest.mark.parametrize("x, want", [
    # a model of 4 channels trained, then no tool could feed it an image
    (np.zeros((4, 8, 8, 4), np.uint8), f"{CHANNELS} 4: drop alpha with x[..., :3]"),
    (np.zeros((4, 8, 8, 2), np.uint8), f"{CHANNELS} 2"),
    # PyTorch's layout was told "expected square images, found 3x8"
    (np.zeros((4, 3, 8, 8), np.uint8), ("x: expected (N,H,W,C) with channels last, found "
                                        "(4, 3, 8, 8): channels first, as PyTorch stores them; "
                                        "save x.transpose(0, 2, 3, 1)")),
    # NaN pixels trained until the loss became nan at step 0
    (np.where(np.arange(4 * 9).reshape(4, 3, 3) == 30, np.nan, 0.5),
     "x: expected finite pixel values, found NaN or infinity in 1 image (the first: x[3])"),
])
def test_npz_pixels_no_tool_could_feed_are_one_line(tmp_path, x, want):
    p = tmp_path / "set.npz"
    np.savez(p, x=x, y=np.arange(4) % 2)
    with pytest.raises(ImageDataError) as e:
        load_images(str(p))
    assert str(e.value) == f"{p}: {want}"


@pytest.mark.parametrize("content, why", [
    (b"PK\x03\x04garbage", "not a zip archive"),  # was zipfile.BadZipFile
    (bytes(range(1, 200)), "not a zip archive"),  # was numpy's "allow_pickle" advice
])
def test_npz_that_is_no_archive_is_one_line(tmp_path, content, why):
    p = tmp_path / "garbage.npz"
    p.write_bytes(content)
    with pytest.raises(ImageDataError) as e:
        load_images(str(p))
    assert str(e.value) == f"{p}: cannot read as a numpy .npz archive ({why})"


def test_npz_with_a_damaged_member_is_one_line(tmp_path):
    p = tmp_path / "set.npz"
    np.savez(p, x=np.zeros((4, 3, 3), np.uint8), y=np.arange(4) % 2)
    raw = bytearray(p.read_bytes())
    at = raw.index(b"x.npy") + 60  # inside the stored x.npy's header: numpy cannot parse it
    raw[at:at + 20] = b"\xff" * 20
    p.write_bytes(bytes(raw))
    with pytest.raises(ImageDataError, match=r"set\.npz: cannot read as a numpy \.npz archive \("):
        load_images(str(p))


def test_npz_classes(tmp_path, capsys):
    """One class is refused, as a one-class ImageFolder is; labels with gaps train (as
    torchvision and timm take labels as indices) and say which classes have no image."""
    x = np.random.default_rng(0).integers(0, 255, (30, 8, 8), dtype=np.uint8)
    p = tmp_path / "onecls.npz"
    np.savez(p, x=x, y=np.zeros(30, np.int64))
    with pytest.raises(ImageDataError) as e:
        load_images(str(p))
    assert str(e.value) == (f"{p}: y: expected at least 2 classes, found 1 ('0' for all 30 "
                            "images); a classifier needs two or more classes")
    np.savez(p, x=x, y=np.repeat([0, 100, 200], 10))
    d = load_images(str(p), val_fraction=0.0)
    assert d.num_classes == 201 and d.notes == [
        (f"{p}: y takes 3 values in 0..200 in the training split: 198 of the 201 classes "
         "have no training image")]
    np.savez(p, x=x, y=np.arange(30) % 3)
    assert load_images(str(p)).notes == []
    # an evaluation maps labels into a checkpoint's classes: one class is a fine test set
    np.savez(p, x=x, y=np.zeros(30, np.int64))
    assert load_images(str(p), 0.0, classes=["0", "1"]).num_classes == 2
