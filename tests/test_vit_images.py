"""vit-tiny on image files people bring: an ImageFolder of PNG/JPEG files and CIFAR batches
train, checkpoint, resume exactly, classify and evaluate; bad files fail cleanly."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from image_files import CLASSES, make_cifar10, make_image_folder
from toymlx_cli.classify import main as classify_main
from toymlx_cli.eval import main as eval_main
from toymlx_cli.train import main as train_main

from toymlx.bundle.checkpoint import resolve_latest
from toymlx.bundle.events import read_events
from toymlx.data.image_folder import decode_image
from toymlx.generation.classify import Classifier
from toymlx.gguf.reader import GGUFFile

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "2",
        "--model.ffn-dim", "64", "--batch-size", "8", "--no-progress", "--warmup", "2",
        "--lr", "1e-3"]


def _train(tmp, rid, data, *extra) -> object:
    assert train_main(["--recipe", "vit-tiny", *TINY, "--data.path", str(data),
                       "--runs-root", str(tmp / "runs"), "--run-id", rid, *extra]) == 0
    return tmp / "runs" / rid


def _losses(run) -> list[float]:
    return [e["loss"] for e in read_events(run) if e["kind"] == "step"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("imgs") / "train", per_class=10)


def test_image_folder_trains_resumes_exactly_classifies_and_evaluates(tmp_path, folder, capsys):
    # augmentation on (8 px: shift, TrivialAugment, flips for colour, cutmix + mixup) so the
    # resumed run must redraw every random choice exactly
    aug = ["--data.image-size", "8", "--data.augment", "True", "--data.trivial-augment",
           "--data.cutmix", "1.0",
           "--data.mixup", "0.4", "--steps", "6", "--checkpoint-every", "3", "--eval-every", "3"]
    full = _train(tmp_path, "full", folder, *aug)
    # one folder, no split given: its seeded hold-out is said at the start (round(30 x 0.1))
    assert (f"toymlx: {folder}: no validation set given: a fixed seeded 3 of its 30 images "
            "(--data.val-fraction 0.1) validate and are not trained on; to give one: "
            "--data.val-path DIR" in capsys.readouterr().err)
    part = _train(tmp_path, "part", folder, *aug, "--stop-at", "3", "--data.workers", "0")
    assert train_main(["--resume", str(part), "--no-progress"]) == 0
    assert _losses(part) == _losses(full) and len(_losses(full)) == 6  # bit-identical
    start = read_events(full)[0]
    c = start["config"]
    assert (c["crop"], c["flip"], c["trivial_augment"], c["cutmix"]) == ("shift", True, True, 1.0)
    assert c["class_names"] == list(CLASSES) and start["model"]["channels"] == 3

    ckpt = resolve_latest(full)
    g = GGUFFile(ckpt)
    assert g.metadata["toy.class_names"] == list(CLASSES)
    clf = Classifier.load(full)
    files = [folder / "cat" / "01.png", folder / "frog" / "00.png"]
    x = np.stack([decode_image(f, 8, 3) for f in files]).astype(np.float32) / 255
    logits = np.asarray(clf.model(mx.array((x - clf.mean) / clf.std)), np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    capsys.readouterr()
    assert classify_main(["--model", str(full), "--top-k", "3", "--json", *map(str, files)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for row, want in zip(rows, p):
        assert [t["class"] for t in row["top"]] == [CLASSES[k] for k in np.argsort(-want)]
        np.testing.assert_allclose([t["probability"] for t in row["top"]], np.sort(want)[::-1],
                                   atol=1e-5)
    assert classify_main(["--model", str(full), str(folder / "bird")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 10  # a folder: every image in it

    plot = tmp_path / "cm.png"
    assert eval_main(["--model", str(full), "--split", "all", "--json", "--plot",
                      str(plot)]) == 0
    rep = json.loads(capsys.readouterr().out)
    m = np.array(rep["confusion"])
    assert m.shape == (3, 3) and m.sum() == rep["images"] == 30 and m.sum(1).tolist() == [10] * 3
    assert abs(rep["accuracy"] - np.trace(m) / 30) < 1e-12
    for k, name in enumerate(CLASSES):
        assert abs(rep["per_class"][name]["accuracy"] - m[k, k] / 10) < 1e-12
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # the same numbers computed here from the classifier itself
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    pred = np.argmax(clf.probabilities(clf.read(every)), axis=1)
    true = np.array([CLASSES.index(f.parent.name) for f in every])
    assert abs(rep["accuracy"] - (pred == true).mean()) < 1e-12
    assert eval_main(["--model", str(full)]) == 0  # text: the run's own held-out split
    text = capsys.readouterr().out
    assert "confusion matrix" in text and text.startswith("accuracy ")
    assert text.rstrip().endswith(f"data {folder} (val)") and "on 3 images" in text
    # data the run did not train on: every image of it by default, and the output says so
    other = make_image_folder(tmp_path / "other", per_class=10, seed=9)
    assert eval_main(["--model", str(full), "--data.path", str(other)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("accuracy ") and "on 30 images" in text
    assert text.rstrip().endswith(f"data {other} (all)")
    assert eval_main(["--model", str(full), "--data.path", str(other), "--split", "val"]) == 0
    assert "on 3 images" in capsys.readouterr().out
    # a copy of the run's own data is that data moved: its held-out split, as training scored it
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert eval_main(["--model", str(full), "--data.path", str(copy)]) == 0
    said = capsys.readouterr()
    assert "on 3 images" in said.out and said.out.rstrip().endswith(f"data {copy} (val)")


def test_cifar_batch_file_trains_and_resumes_exactly(tmp_path):
    batch = make_cifar10(tmp_path / "c", per_batch=12) / "data_batch_1"
    common = ["--steps", "4", "--checkpoint-every", "2", "--eval-every", "2",
              "--data.val-fraction", "0.25", "--model.patch-size", "8"]
    full = _train(tmp_path, "full", batch, *common)
    part = _train(tmp_path, "part", batch, *common, "--stop-at", "2")
    assert train_main(["--resume", str(part), "--no-progress"]) == 0
    assert _losses(part) == _losses(full)
    start = read_events(full)[0]
    assert start["config"]["class_names"][:2] == ["airplane", "automobile"]
    assert (start["config"]["crop"], start["config"]["flip"]) == ("shift", True)  # colour 32 px
    assert start["model"]["image_size"] == 32 and start["model"]["num_classes"] == 10


def test_test_path_scored_at_the_end_as_eval_and_the_classifier_score_it(tmp_path, folder,
                                                                          capsys):
    from cli_errors import error_line

    from toymlx.runner.report import summarize_run

    test = make_image_folder(tmp_path / "test", per_class=4, seed=5)  # other images, same classes
    run = _train(tmp_path, "t", folder, "--data.image-size", "8", "--steps", "4",
                 "--eval-every", "2", "--data.test-path", str(test), "--test")
    events = read_events(run)
    assert events[0]["config"]["test_source"] == str(test)
    assert events[0]["config"]["test_images"] == 12
    assert [(e["kind"], e.get("split")) for e in events[-3:]] == [
        ("checkpoint", None), ("eval", "test"), ("run_end", None)]
    scored = events[-2]
    assert set(scored) == {"kind", "t", "step", "split", "test_loss", "test_accuracy", "seconds"}
    # by hand: the checkpoint's float64 cross-entropy and accuracy over every test image
    clf = Classifier.load(run)
    files = sorted(p for p in test.rglob("*") if p.is_file())
    true = np.array([CLASSES.index(f.parent.name) for f in files])
    logits = np.asarray(clf.model(mx.array(clf.read(files))), np.float64)  # (12, 3)
    top = logits.max(1, keepdims=True)
    logp = logits - (top + np.log(np.exp(logits - top).sum(1, keepdims=True)))
    assert scored["test_accuracy"] == pytest.approx((logits.argmax(1) == true).mean(), abs=1e-12)
    assert scored["test_loss"] == pytest.approx(-logp[np.arange(12), true].mean(), abs=1e-5)
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--split", "test", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["data"], rep["split"], rep["images"]) == (str(test), "test", 12)
    assert rep["accuracy"] == pytest.approx(scored["test_accuracy"], abs=1e-12)
    assert rep["test_loss"] == pytest.approx(scored["test_loss"], abs=1e-5)
    row = summarize_run(run)
    assert (row["test_loss"], row["test_accuracy"]) == (scored["test_loss"],
                                                        scored["test_accuracy"])
    # no test set: refused, and never one that overlaps the training images
    for extra, want in (
            ([], ("--test: expected --data.test-path naming a held-out test set, found none (a "
                 "CIFAR or MNIST folder as --data.path validates on its official test set at "
                 "every eval already)")),
            (["--data.test-path", str(folder / "cat")], ("--data.test-path: expected images "
             f"apart from --data.path (a test set is never trained or validated on), found "
             f"{folder / 'cat'}, which overlaps {folder} (both read "
             f"{min((folder / 'cat').iterdir())})"))):
        assert train_main(["--recipe", "vit-tiny", *TINY, "--data.path", str(folder), "--test",
                           "--runs-root", str(tmp_path / "runs"), "--run-id", "no", *extra]) == 2
        assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not (tmp_path / "runs" / "no").exists()


def test_a_val_path_overlapping_the_training_images_is_refused_for_a_new_run(tmp_path, capsys):
    """--data.val-path naming the training folder (or a class folder in it, or timm's train/)
    trained on those images and scored them as held out, said nowhere; a saved run is not
    refused (it goes on as it was started), as its config is checked again on --resume."""
    from cli_errors import error_line

    from toymlx.recipes import get_recipe
    from toymlx.recipes.vit_tiny import Config, ImageData
    from toymlx.training.task import check_config

    root = make_image_folder(tmp_path / "d", per_class=3)
    timm = tmp_path / "t"
    make_image_folder(timm / "train", per_class=3)
    make_image_folder(timm / "val", per_class=1, seed=3)
    for data, val, over in ((root, root, root), (root, root / "cat", root),
                            (timm, timm / "train", timm / "train")):
        assert train_main(["--recipe", "vit-tiny", *TINY, "--data.path", str(data),
                           "--data.val-path", str(val), "--runs-root", str(tmp_path / "runs"),
                           "--run-id", "r"]) == 2
        assert error_line(capsys) == (
            "toymlx-train: error: --data.val-path: expected images apart from --data.path (a "
            f"validation set is never trained on), found {val}, which overlaps {over} (both "
            f"read {min((val / 'bird' if (val / 'bird').is_dir() else val).iterdir())})")
    assert not (tmp_path / "runs").exists()
    saved = Config(data=ImageData(path=str(root), val_path=str(root)))
    check_config(get_recipe("vit-tiny"), saved)  # a saved run's: taken
    with pytest.raises(ValueError, match="^--data.val-path: expected images apart"):
        check_config(get_recipe("vit-tiny"), saved, new_run=True)
    # timm's val/ named again, apart from train/: trained
    _train(tmp_path, "ok", timm, "--data.val-path", str(timm / "val"), "--steps", "1")


def test_a_held_out_folder_linking_to_training_images_is_refused(tmp_path, capsys):
    """A --data.val-path (or --data.test-path) folder outside --data.path whose files are links
    (or hard links) to training images scored images trained on as held out: the overlap check
    compared folders, one inside the other. It now compares the files each side reads, and the
    line names both."""
    from toymlx.recipes import get_recipe
    from toymlx.recipes.vit_tiny import Config, ImageData
    from toymlx.training.task import check_config

    root = make_image_folder(tmp_path / "d", per_class=3)
    held = make_image_folder(tmp_path / "held", per_class=2, seed=3)
    other = make_image_folder(tmp_path / "other", per_class=2, seed=4)
    trained = min((root / "frog").iterdir())
    recipe = get_recipe("vit-tiny")
    check_config(recipe, Config(data=ImageData(path=str(root), val_path=str(held))), new_run=True)
    for make in (Path.symlink_to, Path.hardlink_to):
        (held / "frog" / "zz.png").unlink(missing_ok=True)
        make(held / "frog" / "zz.png", trained)
        with pytest.raises(ValueError) as e:
            check_config(recipe, Config(data=ImageData(path=str(root), val_path=str(held))),
                         new_run=True)
        assert str(e.value) == (
            "--data.val-path: expected images apart from --data.path (a validation set is never "
            f"trained on), found {held}, which overlaps {root} ({held / 'frog' / 'zz.png'} and "
            f"{trained} are one file)")
        with pytest.raises(ValueError) as e:
            check_config(recipe, Config(data=ImageData(path=str(root), val_path=str(other),
                                                       test_path=str(held))), new_run=True)
        assert str(e.value).startswith(
            "--data.test-path: expected images apart from --data.path (a test set is never "
            f"trained or validated on), found {held}, which overlaps {root} (")
    # a linked class folder: the same
    (held / "frog" / "zz.png").unlink()
    shutil.rmtree(held / "cat")
    (held / "cat").symlink_to(root / "cat")
    with pytest.raises(ValueError, match=r"which overlaps .* are one file\)$"):
        check_config(recipe, Config(data=ImageData(path=str(root), val_path=str(held))),
                     new_run=True)


def test_held_out_files_inside_the_training_folder_but_not_trained_on_are_taken(tmp_path):
    """The overlap checks compared paths: an MNIST folder's own t10k file (or a CIFAR folder's
    test_batch) as --data.test-path or --data.val-path was refused as inside --data.path,
    though the folder trains on its train-* files (data_batch_*) alone. They now compare the
    files read: those are taken, a training file named is still refused."""
    from image_files import fake_pair

    from toymlx.recipes import get_recipe
    from toymlx.recipes.vit_tiny import Config, ImageData
    from toymlx.training.task import check_config

    mnist = tmp_path / "mnist"
    mnist.mkdir()
    fake_pair(mnist, "train", 20, seed=1)
    t10k = fake_pair(mnist, "t10k", 10, seed=2)
    cifar = make_cifar10(tmp_path / "cifar")
    recipe = get_recipe("vit-tiny")
    other = make_image_folder(tmp_path / "other", per_class=2)
    for folder, held in ((mnist, t10k), (cifar, cifar / "test_batch")):
        check_config(recipe, Config(data=ImageData(path=str(folder), test_path=str(held),
                                                   val_path=str(other))), new_run=True)
        check_config(recipe, Config(data=ImageData(path=str(folder), val_path=str(held))),
                     new_run=True)
        # without --data.val-path the folder validates on that same test set at every eval:
        # --test would score the validation images again (taken, said nowhere, before)
        with pytest.raises(ValueError) as e:
            check_config(recipe, Config(data=ImageData(path=str(folder), test_path=str(held))),
                         new_run=True)
        assert str(e.value) == (
            "--data.test-path: expected images apart from the validation set (a test set is "
            f"never validated on), found {held}, the official test set {folder} validates on at "
            "every eval already; leave out --data.test-path and --test (the val_loss and accuracy "
            "are that test set's), or validate on another set with --data.val-path")
    for folder, held in ((mnist, t10k), (cifar, cifar / "test_batch")):
        # a hard link to the official test set (not caught: resolved paths were compared)
        linked = tmp_path / "linked" / folder.name / held.name
        linked.parent.mkdir(parents=True)
        os.link(held, linked)
        with pytest.raises(ValueError) as e:
            check_config(recipe, Config(data=ImageData(path=str(folder),
                                                       test_path=str(linked))), new_run=True)
        assert str(e.value).startswith(
            f"--data.test-path: expected images apart from the validation set (a test set is "
            f"never validated on), found {linked}, the official test set {folder} validates on")
    for folder, trained in ((mnist, mnist / "train-images-idx3-ubyte"),
                            (cifar, cifar / "data_batch_2")):
        with pytest.raises(ValueError) as e:
            check_config(recipe, Config(data=ImageData(path=str(folder), test_path=str(trained))),
                         new_run=True)
        assert str(e.value) == (
            "--data.test-path: expected images apart from --data.path (a test set is never "
            f"trained or validated on), found {trained}, which overlaps {folder} (both read "
            f"{trained})")


def test_a_folder_of_images_without_class_folders_says_so(tmp_path, capsys):
    """One class's folder given as --data.path said "no images found" of a folder of images."""
    from cli_errors import error_line

    root = make_image_folder(tmp_path / "d", per_class=3)
    assert train_main(["--recipe", "vit-tiny", *TINY, "--data.path", str(root / "cat"),
                       "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {root / 'cat'}: 3 images and no class subfolders: expected "
        "class subfolders of image files (ImageFolder: an image's class is its folder's name); "
        f"give the folder that holds the class folders (as {root} holds cat/), or put each "
        "class's images in a subfolder named for it")
    assert not (tmp_path / "runs").exists()


def test_a_val_fraction_out_of_range_names_the_flag(tmp_path, capsys):
    """vit-tiny --data.val-fraction 1 said "val_fraction: expected a value in [0, 1)", the
    loader's argument, not the flag (lora's says --data.val-fraction)."""
    from cli_errors import error_line

    assert train_main(["--recipe", "vit-tiny", *TINY, "--data.val-fraction", "1", "--runs-root",
                       str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == ("toymlx-train: error: --data.val-fraction: expected in [0, 1), "
                                  "found 1.0")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["truncated", "text-as-jpg", "empty-class", "one-class"])
def test_bad_image_data_one_line_error_and_nothing_left(tmp_path, capsys, case):
    root = make_image_folder(tmp_path / "d", per_class=3)
    bad = {"truncated": root / "cat" / "01.png", "text-as-jpg": root / "frog" / "x.jpg",
           "empty-class": root / "zebra", "one-class": tmp_path / "one"}[case]
    if case == "truncated":
        bad.write_bytes(bad.read_bytes()[:-40])
    elif case == "text-as-jpg":
        bad.write_text("not an image")
    elif case == "empty-class":
        bad.mkdir()
    else:
        (bad / "only").mkdir(parents=True)
        (root / "cat" / "01.png").rename(bad / "only" / "a.png")
    data = tmp_path / "one" if case == "one-class" else root
    capsys.readouterr()
    code = train_main(["--recipe", "vit-tiny", *TINY, "--data.path", str(data), "--data.image-size",
                       "8", "--runs-root", str(tmp_path / "runs"), "--run-id", "r", "--steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(bad) in err[0], err
    assert not (tmp_path / "runs" / "r").exists()  # nothing half-written


def test_stochastic_depth_rates_scaling_and_eval_mode():
    from toymlx.models.vit import ViT, ViTArgs

    a = ViTArgs(image_size=8, patch_size=4, channels=1, d_model=8, n_layers=3, n_heads=2,
                ffn_dim=16, num_classes=3, drop_path=0.4)
    model = ViT(a)
    assert [blk.drop_path.p for blk in model.layers] == [0.0, 0.2, 0.4]  # timm's linear rule
    blk = model.layers[2]
    y = mx.ones((20000, 1, 1))
    mx.random.seed(0)
    out = np.asarray(blk.drop_path(y)).ravel()
    assert np.allclose(out[out != 0], 1 / 0.6)  # dropped, or kept and scaled by 1 / (1 - p)
    assert abs((out == 0).mean() - 0.4) < 0.015 and abs(out.mean() - 1.0) < 0.03
    x = mx.array(np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32))
    model.eval()
    plain = ViT(ViTArgs(**{**a.__dict__, "drop_path": 0.0}))
    plain.update(model.parameters())
    assert mx.array_equal(model(x), plain(x)).item()  # no dropping outside training


def test_a_dark_8_bit_set_is_classified_as_trained_from_its_images_as_files(tmp_path):
    """A uint8 .npz whose brightest pixel is 100 was trained in units of x / 100, and
    toymlx-classify, toymlx-eval on a folder and the timm export read the same images as
    x / 255: a run at accuracy 1.0 called every image of its bright class the dark class."""
    from PIL import Image

    from toymlx.data.images import load_images

    rng = np.random.default_rng(0)
    x = np.where(np.arange(40)[:, None, None, None] % 2, rng.integers(60, 101, (40, 8, 8, 1)),
                 rng.integers(0, 40, (40, 8, 8, 1))).astype(np.uint8)
    np.savez(tmp_path / "dark.npz", x=x, y=np.arange(40) % 2)
    run = _train(tmp_path, "dark", tmp_path / "dark.npz", "--steps", "2")
    clf = Classifier.load(run)
    assert clf.scale == 255.0
    files = []
    for i in range(4):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(x[i, :, :, 0], mode="L").save(files[-1])
    data = load_images(str(tmp_path / "dark.npz"), val_fraction=0.0)
    as_trained = ((x[:4].astype(np.float32) / data.scale - clf.mean) / clf.std)
    assert np.allclose(clf.read(files), as_trained, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, folder):
    """A 2-step vit-tiny run on `folder` (what eval and classify read)."""
    tmp = tmp_path_factory.mktemp("tiny")
    return _train(tmp, "tiny", folder, "--data.image-size", "8", "--steps", "2")


def test_one_file_given_to_the_classifier_for_a_list_is_one_clear_error(tiny_run, tmp_path):
    """`Classifier.top_k("cat.png")` read the str a character at a time and failed on "/" as
    a directory ("/: cannot open (Is a directory)"); a Path failed in len()."""
    clf = Classifier.load(tiny_run)
    image = tmp_path / "cat.png"
    for one in (str(image), image):
        for call in (clf.top_k, clf.read, lambda f: list(clf.each_top_k(f))):
            with pytest.raises(TypeError) as e:
                call(one)
            assert str(e.value) == (f"files: expected a list of image files, found one "
                                    f"{type(one).__name__} ({one!r}); pass [{one!r}]")


def test_the_classifier_takes_a_generator_of_files_and_names_what_is_no_collection(tiny_run,
                                                                                 folder):
    """`clf.top_k(Path(d).glob("*.png"))` failed in len() ("object of type 'generator' has no
    len()"), and `top_k(5)` too: the glob's files are ranked as their list is, and a value
    that holds no files is one TypeError naming `files`."""
    clf = Classifier.load(tiny_run)
    files = sorted(Path(folder).rglob("*.png"))[:3]
    assert len(files) == 3
    assert clf.top_k(f for f in files) == clf.top_k(files)
    assert [f for f, _ in clf.each_top_k(iter(files))] == files
    for call in (clf.top_k, clf.read, lambda f: list(clf.each_top_k(f))):
        with pytest.raises(TypeError) as e:
            call(5)
        assert str(e.value) == "files: expected a list of image files, found int (5)"


def test_eval_split_val_of_a_set_too_small_to_hold_one_out_is_one_line(tmp_path, tiny_run,
                                                                       capsys):
    """`toymlx-eval --data.path SMALL --split val` on 3 images (10% of 3 holds none out) ended
    in numpy's "error: need at least one array to concatenate". Now one line names the data,
    the fraction and the count, and the flag that scores them."""
    from cli_errors import error_line

    small = make_image_folder(tmp_path / "small", per_class=1)
    capsys.readouterr()
    assert eval_main(["--model", str(tiny_run), "--data.path", str(small), "--split",
                      "val"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {small}: --split val: expected validation images to score, found "
        "none: --data.val-fraction 0.1 of 3 images holds none out; score them all with "
        "--split all")
    assert eval_main(["--model", str(tiny_run), "--data.path", str(small)]) == 0  # all
    assert "on 3 images" in capsys.readouterr().out


def test_eval_plot_names_a_name_it_cannot_write_and_a_file_it_cannot_draw(tmp_path, tiny_run,
                                                                          capsys, monkeypatch):
    """`toymlx-eval --plot cm.pdf` wrote a PNG into cm.pdf (notes.txt too); a --plot it could
    not write (a full disk; /proc/x/c.png) was a bare "[Errno ...]" line, no flag."""
    import contextlib
    import errno

    from cli_errors import error_line

    from toymlx.generation import classify

    capsys.readouterr()
    assert eval_main(["--model", str(tiny_run), "--plot", str(tmp_path / "cm.pdf")]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --plot: expected a .png file name (the confusion matrix is drawn as "
        "a PNG), found 'cm.pdf'")

    @contextlib.contextmanager
    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(classify, "atomic_open", full)
    plot = tmp_path / "cm.png"
    assert eval_main(["--model", str(tiny_run), "--plot", str(plot)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {plot}: --plot: could not write the confusion matrix ([Errno 28] "
        f"No space left on device: '{plot}'); nothing was written under this name")
    assert list(tmp_path.iterdir()) == []


def test_eval_seq_len_of_a_vit_is_refused_not_ignored(tiny_run, capsys):
    """--seq-len (a language model's window) given for a ViT was taken and ignored, exit 0."""
    from cli_errors import error_line

    capsys.readouterr()
    assert eval_main(["--model", str(tiny_run), "--seq-len", "32"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --seq-len 32: expected a language model (it sets the tokens of a "
        f"window), found a ViT ({tiny_run}): an image is one window; drop --seq-len")


def test_classify_answers_every_readable_image_when_one_is_not(tmp_path, tiny_run, capsys):
    """A folder of images with one corrupt file (a PNG cut short, named as one: it was "found
    bytes b'\\x89PNG...'", as for a file of no image kind): toymlx-classify printed one
    error line and nothing else, every other image's answer lost (all were computed before any
    was printed). Now each readable image gets its answer, the same as alone, the unreadable one
    its error line, then a count; exit status 2."""
    src = make_image_folder(tmp_path / "f", per_class=2)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    bad = files[2]
    bad.write_bytes(bad.read_bytes()[:40])  # a PNG cut short
    good = [f for f in files if f != bad]
    capsys.readouterr()
    assert classify_main(["--model", str(tiny_run), "--top-k", "2", "--batch-size", "4",
                          str(src)]) == 2
    out, err = capsys.readouterr()
    assert [ln.split(":")[0] for ln in out.splitlines()] == [str(f) for f in good]
    assert classify_main(["--model", str(tiny_run), "--top-k", "2", *map(str, good)]) == 0
    assert capsys.readouterr().out == out  # the same answers as without the corrupt file
    assert err.splitlines() == [
        (f"toymlx-classify: error: {bad}: not an image Pillow can read: expected one of png, "
         "jpg, jpeg, bmp, gif, webp, tif, tiff, ppm, pgm, pbm, found a PNG file of 40 bytes "
         "whose header Pillow cannot read (cut short?); remove or replace the file"),
        ("toymlx-classify: error: 1 of 6 inputs could not be read (named above); the other 5 "
         "are classified")]
    assert classify_main(["--model", str(tiny_run), str(bad)]) == 2  # alone: its line only
    assert capsys.readouterr().err.splitlines() == err.splitlines()[:1]


class _Pipe(io.BytesIO):
    """What sys.stdin.buffer is for `cat FILE | toymlx-classify ...` (or a terminal: `tty`)."""

    def __init__(self, data: bytes, tty: bool = False) -> None:
        super().__init__(data)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _stdin(monkeypatch, data: bytes, tty: bool = False) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(_Pipe(data, tty)))


def test_classify_dash_reads_one_image_from_stdin_as_its_file_reads(tmp_path, folder, tiny_run,
                                                                    capsys, monkeypatch):
    """`cat x.png | toymlx-classify --model RUN -` said "-: no such file or directory". Now `-`
    is one image's bytes read from stdin, decoded by the files' decoder from memory, named `-`
    in the answer: the same probabilities as the file's, to the bit (a JPEG too, which Pillow
    decodes at a reduced scale from a file)."""
    from toymlx.data.image_folder import ImageBytes

    for img in (folder / "cat" / "01.png", folder / "frog" / "02.jpg"):
        np.testing.assert_array_equal(decode_image(ImageBytes("-", img.read_bytes()), 8, 3),
                                      decode_image(img, 8, 3))
        capsys.readouterr()
        other = folder / "bird" / "00.png"  # the same batch: its size moves the last bit
        assert classify_main(["--model", str(tiny_run), "--json", "--top-k", "3", str(img),
                              str(other)]) == 0
        want = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
        _stdin(monkeypatch, img.read_bytes())
        assert classify_main(["--model", str(tiny_run), "--json", "--top-k", "3", "-",
                              str(other)]) == 0
        rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
        assert rows == [{"file": "-", "top": want[0]["top"]}, want[1]]  # equal, to the bit
        assert classify_main(["--model", str(tiny_run), str(img)]) == 0
        line = capsys.readouterr().out
        _stdin(monkeypatch, img.read_bytes())
        assert classify_main(["--model", str(tiny_run), "-"]) == 0
        assert capsys.readouterr().out == "-" + line.removeprefix(str(img))


def test_classify_names_a_file_called_dash_apart_from_stdin(tmp_path, folder, tiny_run, capsys,
                                                           monkeypatch):
    """docs/IMAGES.md: a file named `-` is `./-`. Its answer was printed as `-: ...`, the name
    of stdin's image (Path("./-") prints "-"), and a missing `./-` as "-: no such file". Now
    such a file keeps its `./`, in the answer, in --json and in the error line."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert classify_main(["--model", str(tiny_run), "./-"]) == 2
    assert capsys.readouterr().err == ("toymlx-classify: error: ./-: expected an image file or "
                                       "a folder, found nothing at that path\n")
    (tmp_path / "-").write_bytes((folder / "cat" / "01.png").read_bytes())
    assert classify_main(["--model", str(tiny_run), "./-"]) == 0
    assert capsys.readouterr().out.startswith("./-: ")
    assert classify_main(["--model", str(tiny_run), "--json", "./-"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == "./-"


PNG_NAMES = "png, jpg, jpeg, bmp, gif, webp, tif, tiff, ppm, pgm, pbm"


@pytest.mark.parametrize("case", ["empty", "not an image", "endless", "terminal", "twice"])
def test_classify_dash_on_a_bad_stdin_is_one_line(tiny_run, capsys, monkeypatch, case):
    """`-` with stdin empty, holding text, an endless stream (read until memory ran out, as
    `--prompt -` once was), a terminal (it would wait for Ctrl-D), or `-` named twice (stdin
    holds one image): one line each, exit status 2."""
    monkeypatch.setattr("toymlx.generation.classify.STDIN_IMAGE_LIMIT", 64)
    data, tty, argv = {"empty": (b"", False, ["-"]), "not an image": (b"junk\n", False, ["-"]),
                       "endless": (b"y\n" * 40, False, ["-"]), "terminal": (b"", True, ["-"]),
                       "twice": (b"junk", False, ["-", "-"])}[case]
    _stdin(monkeypatch, data, tty)
    capsys.readouterr()
    assert classify_main(["--model", str(tiny_run), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["toymlx-classify: error: " + {
        "empty": "-: expected one image's bytes on stdin, found none (stdin was empty)",
        "not an image": f"-: not an image Pillow can read: expected one of {PNG_NAMES}, found "
                        "bytes b'junk\\n'; send one image file's bytes on stdin",
        "endless": "-: expected one image's bytes on stdin, at most 64 bytes (an uncompressed "
                   "RGB image at Pillow's pixel limit), found more; is stdin an endless stream? "
                   "A larger image: give its file's name",
        "terminal": "-: expected one image's bytes piped or redirected to stdin (cat x.png | "
                    "toymlx-classify --model RUN -), found a terminal",
        "twice": "IMAGE_OR_DIR: expected '-' (one image read from stdin) at most once, found it "
                 "2 times; name the other images by their files"}[case]]


def test_classify_goes_on_past_a_name_that_gives_no_image(tmp_path, folder, tiny_run, capsys):
    """`toymlx-classify --model RUN a.png missing.png b.png` (a glob, `xargs`) stopped at the
    missing name with no answer at all, although an unreadable image let the others be
    classified. Now a missing name, an empty folder and a FIFO each get their line on stderr
    in their place, every image is classified as alone, then a count; exit status 2 (as
    `identify`: non-zero when any was not read)."""
    good = [folder / "cat" / "01.png", folder / "frog" / "02.jpg"]
    (empty := tmp_path / "empty").mkdir()
    os.mkfifo(fifo := tmp_path / "pipe.png")
    missing = tmp_path / "missing.png"
    capsys.readouterr()
    assert classify_main(["--model", str(tiny_run), *map(str, good)]) == 0
    alone = capsys.readouterr().out
    assert classify_main(["--model", str(tiny_run), str(missing), str(good[0]), str(empty),
                          str(fifo), str(good[1])]) == 2
    out, err = capsys.readouterr()
    assert out == alone
    assert err.splitlines() == [
        (f"toymlx-classify: error: {missing}: expected an image file or a folder, found nothing "
         "at that path"),
        (f"toymlx-classify: error: {empty}: expected image files (.png, .jpg, .jpeg, .bmp, "
         ".gif, .webp, .tif, .tiff, .ppm, .pgm, .pbm) in the folder, found none"),
        (f"toymlx-classify: error: {fifo}: expected an image file or a folder, found a FIFO "
         "(named pipe); for one image sent on stdin, name it -"),
        ("toymlx-classify: error: 3 of 5 inputs could not be read (named above); the other 2 "
         "are classified")]
    assert classify_main(["--model", str(tiny_run), str(missing)]) == 2  # alone: its line only
    assert capsys.readouterr().err.splitlines() == err.splitlines()[:1]


def test_classify_dash_through_a_real_pipe(folder, tiny_run):
    """The console script's own stdin, a pipe (`cat x.jpg | toymlx-classify ... - FILE`): the
    answer for `-` equals the file's; /dev/stdin on a pipe is a FIFO, refused with `-` named."""
    img = folder / "frog" / "02.jpg"
    cmd = [sys.executable, "-m", "toymlx_cli.classify", "--model", str(tiny_run)]
    with img.open("rb") as f:
        cat = subprocess.Popen(["cat"], stdin=f, stdout=subprocess.PIPE)
        r = subprocess.run([*cmd, "-", str(img)], stdin=cat.stdout, capture_output=True,
                           text=True, check=False)
        cat.wait()
    assert (r.returncode, r.stderr) == (0, "")
    dash, named = r.stdout.splitlines()
    assert dash == "-" + named.removeprefix(str(img))
    r = subprocess.run([*cmd, "/dev/stdin"], input=img.read_bytes(), capture_output=True,
                       check=False)
    assert r.returncode == 2
    assert r.stderr.decode().splitlines()[-1] == (
        "toymlx-classify: error: /dev/stdin: expected an image file or a folder, found a FIFO "
        "(named pipe); for one image sent on stdin, name it -")


def test_a_run_holding_out_no_images_says_so_in_its_last_line(tmp_path, folder, capsys):
    """--data.val-fraction 0 holds out no image: the last line said "not measured (no
    validation pass ran)", as if a pass had been skipped, where the text recipes' and lora's
    runs say the data holds out nothing (`_no_figures` read val_rows and val_tokens alone)."""
    run = _train(tmp_path, "all", folder, "--data.image-size", "8", "--steps", "2",
                 "--data.val-fraction", "0")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "toymlx: completed at step 2. held-out: none (the data holds out nothing to validate "
        f"on). bundle: {run}")


def test_a_batch_larger_than_the_training_images_names_the_size_that_fits(tmp_path, folder,
                                                                          capsys):
    """The folder's 30 images leave 27 to train on (--data.val-fraction 0.1): --batch-size 64
    said "expected at most the 27 training images of DIR, found 64" without a fix, in words of
    its own where the text recipes' check (`check_batch_fits`) says the same thing; now it is
    that one check, before the model is made, and nothing is left behind."""
    from cli_errors import error_line

    capsys.readouterr()
    assert train_main(["--recipe", "vit-tiny", *TINY, "--batch-size", "64", "--data.path",
                       str(folder), "--data.image-size", "8", "--runs-root",
                       str(tmp_path / "runs"), "--run-id", "big", "--steps", "2"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: --batch-size: expected at most 27 (the training split of {folder} "
        "holds 27 images), found 64; use --batch-size 27 or less, or more data")
    assert not (tmp_path / "runs" / "big").exists()
