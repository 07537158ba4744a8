"""The vit-tiny recipe end to end on a small body: events, checkpoint round trip, eager==compiled."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from toymlx_cli.train import main

from toymlx.bundle.checkpoint import resolve_latest
from toymlx.bundle.events import read_events
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.vit import load_vit
from toymlx.models.ops import Ops
from toymlx.recipes import vit_tiny
from toymlx.runner.run import run_ops

SMALL = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "2",
         "--model.ffn-dim", "64", "--batch-size", "16", "--no-progress", "--warmup", "2"]


def _run(tmp, rid, *extra):
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp), "--run-id", rid,
                 *extra]) == 0
    return tmp / rid


def _two_classes(data, n: int):
    """`data` holding classes a and b of `n` 8x8 grey PNGs each, a's pixels below 120 and b's
    from 120 (seeded: the same files every call)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for k, name in enumerate(("a", "b")):
        (data / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 120, (8, 8), np.uint8) + 120 * k).save(
                data / name / f"{i:02d}.png")
    return data


def test_vit_run_events_and_checkpoint(tmp_path):
    run = _run(tmp_path, "v", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3")
    evs = read_events(run)
    start = evs[0]
    assert start["kind"] == "run_start" and evs[-1]["kind"] == "run_end"
    m = start["model"]
    assert m["arch"] == "vit" and m["image_size"] == 8 and m["patch_size"] == 4  # auto on 8x8
    assert (m["channels"], m["d_model"], m["n_layers"], m["n_heads"], m["num_classes"]) == (
        1, 32, 2, 2, 10)
    c = start["config"]
    assert c["steps"] == 6 and c["batch_size"] == 16 and "lr" in c and "seed" in c
    assert "context" not in c
    assert c["mixup"] == 0.4 and c["label_smoothing"] == 0.1  # the digits: < 5,000 images
    ev = [e for e in evs if e["kind"] == "eval"]
    assert [e["step"] for e in ev] == [3, 6]
    assert all(0.0 <= e["accuracy"] <= 1.0 and e["val_loss"] > 0 for e in ev)
    assert all("images_per_s" in e for e in evs if e["kind"] == "step")

    g = GGUFFile(resolve_latest(run))
    assert g.metadata["general.architecture"] == "vit"
    for k, v in {"vit.image_size": 8, "vit.patch_size": 4, "vit.channels": 1,
                 "vit.embedding_length": 32, "vit.block_count": 2,
                 "vit.attention.head_count": 2, "vit.feed_forward_length": 64,
                 "vit.class_count": 10}.items():
        assert g.metadata[k] == v, k
    assert abs(g.metadata["vit.attention.layer_norm_epsilon"] - 1e-6) < 1e-12


def test_a_resume_may_change_data_workers_and_trains_the_same(tmp_path, capsys):
    """--data.workers (threads that make the batches, the same batches with any number) was
    refused on --resume as a change of configuration ("expected the run's saved data.workers =
    2, found 0"); it is run-local, as --cpu-streams is, and the resumed losses are the
    uninterrupted run's. A setting that changes what is trained is still refused."""
    whole = _run(tmp_path, "whole", "--steps", "6", "--eval-every", "3")
    part = _run(tmp_path, "part", "--steps", "6", "--eval-every", "3", "--stop-at", "3")
    assert main(["--resume", str(part), "--data.workers", "0", "--no-progress"]) == 0

    def losses(run):
        return [(e["kind"], e["step"], e.get("loss", e.get("val_loss")))
                for e in read_events(run) if e["kind"] in ("step", "eval")]

    assert losses(part) == losses(whole)
    capsys.readouterr()
    assert main(["--resume", str(part), "--steps", "9", "--data.mixup", "0"]) == 2
    assert capsys.readouterr().err.startswith(
        f"toymlx-train: error: {part}: --resume: --data.mixup: expected the run's saved "
        "data.mixup = None, found 0.0;")


def test_vit_round_trip_and_eager_equals_compiled(tmp_path):
    from toymlx.recipes import vit_tiny
    from toymlx.training.trainer import train

    def cfg(compile_):
        c = vit_tiny.Config(steps=4, batch_size=16, warmup=2, progress=False, eval_every=0,
                            compile=compile_)
        c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.ffn_dim = 32, 2, 2, 64
        return c

    task = vit_tiny.build(cfg(True), run_ops(cfg(True)))
    train(task, cfg(True), tmp_path / "a", {})
    loaded, norm, _ = load_vit(resolve_latest(tmp_path / "a"), task.model.ops)  # same math
    x = mx.array(np.random.default_rng(0).normal(size=(5, 8, 8, 1)).astype(np.float32))
    assert mx.array_equal(loaded(x), task.model(x)).item()
    assert len(norm["toy.pixel_mean"]) == 1 and norm["toy.pixel_scale"] == 16.0

    eager_task = vit_tiny.build(cfg(False), run_ops(cfg(False)))
    train(eager_task, cfg(False), tmp_path / "b", {})
    la = [e["loss"] for e in read_events(tmp_path / "a") if e["kind"] == "step"]
    lb = [e["loss"] for e in read_events(tmp_path / "b") if e["kind"] == "step"]
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)


def _np_ce(logits: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Cross-entropy of float64 logits against target distributions (rows)."""
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -(target * logp).sum(-1)


class _Fixed:
    """A 'model' that returns fixed logits whatever the images."""

    ops = Ops()

    def __init__(self, logits):
        self.logits = mx.array(logits)

    def __call__(self, images):
        return self.logits


def test_label_smoothing_and_mixup_loss_against_numpy():
    from toymlx.recipes.vit_tiny import smoothed_loss

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 10)) * 3).astype(np.float32)
    y, y2 = rng.integers(0, 10, 6), rng.integers(0, 10, 6)
    lam = np.full(6, 0.3, np.float32)
    eye = np.eye(10)
    eps = 0.1
    smooth = lambda t: (1 - eps) * eye[t] + eps / 10
    model = _Fixed(logits)
    batch = {"images": mx.zeros((6, 8, 8, 1)), "labels": mx.array(y.astype(np.int32))}
    got, n = smoothed_loss(eps)(model, batch)
    want = _np_ce(logits.astype(np.float64), smooth(y)).mean()
    assert abs(got.item() - want) < 1e-5 and n.item() == 6
    batch.update(mix_labels=mx.array(y2.astype(np.int32)), mix_lam=mx.array(lam))
    got, _ = smoothed_loss(eps)(model, batch)
    want = _np_ce(logits.astype(np.float64), 0.3 * smooth(y) + 0.7 * smooth(y2)).mean()
    assert abs(got.item() - want) < 1e-5
    got0, _ = smoothed_loss(0.0)(model, {"images": batch["images"], "labels": batch["labels"]})
    assert abs(got0.item() - _np_ce(logits.astype(np.float64), eye[y]).mean()) < 1e-5


def test_mixup_batch_is_deterministic_and_keeps_labels():
    from toymlx.data.augment import mix_batch

    def mixup_batch(b, alpha, seed, step):  # as ImageSet.train_batch draws it
        return mix_batch(b, alpha, 0.0, np.random.default_rng([seed, step, 2]))

    rng = np.random.default_rng(1)
    b = {"images": rng.random((2, 5, 8, 8, 1)).astype(np.float32),
         "labels": rng.integers(0, 10, (2, 5)).astype(np.int32)}
    m1, m2 = mixup_batch(b, 0.4, 7, 3), mixup_batch(b, 0.4, 7, 3)
    for k in m1:
        np.testing.assert_array_equal(m1[k], m2[k])
    assert not np.array_equal(mixup_batch(b, 0.4, 7, 4)["mix_lam"], m1["mix_lam"])
    np.testing.assert_array_equal(m1["labels"], b["labels"])
    for a in range(2):
        lam = m1["mix_lam"][a, 0]
        assert (m1["mix_lam"][a] == lam).all() and 0 <= lam <= 1
        assert sorted(m1["mix_labels"][a]) == sorted(b["labels"][a])  # a permutation
        # each mixed image is lam * its own + (1 - lam) * the partner whose label it carries
        for i in range(5):
            j = [k for k in range(5) if np.allclose(
                m1["images"][a, i], lam * b["images"][a, i] + (1 - lam) * b["images"][a, k],
                atol=1e-6)]
            assert j and m1["mix_labels"][a, i] in b["labels"][a, j]


def test_mixup_is_off_by_default_on_larger_sets(tmp_path, shared_file):
    """9,000 MNIST training images: mixup slowed convergence there, so the default is off;
    an explicit --data.mixup wins either way."""
    mnist = shared_file("images/t10k-images-idx3-ubyte.gz")
    shared_file("images/t10k-labels-idx1-ubyte.gz")  # its labels, read beside it
    common = ["--data.path", str(mnist), "--model.patch-size", "7", "--steps", "1",
              "--eval-batches", "1"]
    run = _run(tmp_path, "m", *common)
    assert read_events(run)[0]["config"]["mixup"] == 0.0
    run = _run(tmp_path, "m2", *common, "--data.mixup", "0.2")
    assert read_events(run)[0]["config"]["mixup"] == 0.2


def test_auto_patch_size_on_8x8_and_explicit_choices_win():
    """Preset auto trains 8x8 images with 4x4 patches (2x2 grid + cls); an explicit
    --model.patch-size or --model.preset keeps its own patch size; other sizes keep the
    preset's."""
    from types import SimpleNamespace

    from toymlx.data.images import load_images
    from toymlx.recipes.vit_tiny import Config, ViTOptions, model_args

    digits = load_images(None)
    a = model_args(ViTOptions(), digits)
    assert (a.image_size, a.patch_size, a.n_patches) == (8, 4, 4)
    assert (a.d_model, a.n_layers, a.n_heads, a.ffn_dim) == (192, 12, 3, 768)  # Tiny body
    assert model_args(ViTOptions(patch_size=2), digits).patch_size == 2
    assert model_args(ViTOptions(preset="vit-tiny-8"), digits).patch_size == 2
    rgb224 = SimpleNamespace(image_shape=(224, 224, 3), num_classes=10, source="x")
    assert model_args(ViTOptions(), rgb224).patch_size == 16
    c = Config()
    assert (c.steps, c.batch_size, c.label_smoothing) == (400, 64, 0.1)


def test_images_not_square_name_the_flag_that_squares_them():
    """A .npz of 13x20 images: refused for 13 having no patch divisor, the flag that would
    square them not named; a 12x20 one: "expected square images" and no way out. Both say
    --data.image-size with the shorter side."""
    from types import SimpleNamespace

    from toymlx.recipes.vit_tiny import ViTOptions, model_args

    for h, w in ((13, 20), (12, 20), (20, 13)):
        data = SimpleNamespace(image_shape=(h, w, 1), num_classes=2, source="set.npz")
        with pytest.raises(ValueError) as e:
            model_args(ViTOptions(), data)
        side = min(h, w)
        assert str(e.value) == (f"set.npz: images: expected square images, found {h}x{w} "
                                f"(height x width); --data.image-size {side} resizes the "
                                "shorter side to it and centre-crops, as a folder's images are")


def test_the_vit_body_is_checked_before_any_image_is_read(tmp_path):
    """--model.n-heads 5 (192 wide) was refused only once the images were read, so a sweep
    with `--grid model.n_heads=3,5` started its runs before refusing them; now `validate`
    refuses it with no data there at all, naming the flags, as the text recipes do."""
    def refused(**model) -> str:
        cfg = vit_tiny.Config(model=vit_tiny.ViTOptions(**model),
                              data=vit_tiny.ImageData(path=str(tmp_path / "not-there")))
        with pytest.raises(ValueError) as e:
            vit_tiny.validate(cfg)
        return str(e.value)

    assert refused(n_heads=5) == ("--model.n-heads: expected a divisor of --model.d-model "
                                  "(192, the preset's), found 5")
    assert refused(d_model=100, n_heads=3) == ("--model.d-model: expected a multiple of "
                                               "--model.n-heads (3), found 100")
    assert refused(n_layers=0) == "--model.n-layers: expected > 0, found 0"
    vit_tiny.validate(vit_tiny.Config(model=vit_tiny.ViTOptions(n_heads=4, patch_size=5)))  # no image yet


def test_an_image_that_fails_mid_run_keeps_the_steps_and_resume_goes_on_once_fixed(
        tmp_path, capsys, monkeypatch):
    """A streamed image corrupt past its header (its decode fails only when a batch holds it)
    ended the run with exit 1, nothing checkpointed, and once the file was replaced --resume
    refused the data's changed fingerprint. Now the steps before it are checkpointed, the last
    line names the file, and the resume of the fixed data trains the uninterrupted run's losses
    to the bit; a later resume checks the data against the fixed data, and another change is
    still refused."""

    from toymlx.data import images

    # a streamed set over 2,000 images decodes a sample for its statistics; a fixed
    # mean and std stands for it, so that no image is decoded before the steps read it
    monkeypatch.setattr(images, "_channel_stats",
                        lambda x, scale: (np.full(x.shape[-1], 0.5, np.float32),
                                          np.full(x.shape[-1], 0.25, np.float32)))
    data = _two_classes(tmp_path / "data", 40)
    bad = data / "b" / "20.png"
    good = bad.read_bytes()
    bad.write_bytes(good[:60])  # the header whole, the pixels cut
    opts = ["--data.path", str(data), "--data.stream", "True", "--steps", "12",
            "--checkpoint-every", "100", "--eval-every", "100"]
    whole = tmp_path / "whole"
    part = tmp_path / "part"
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp_path), "--run-id",
                 "part", *opts]) == 1
    end = read_events(part)[-1]
    s = end["final_step"]
    assert 0 < s < 12 and (part / "weights" / f"step_{s}.gguf").is_file()
    assert end["data_error"] == (f"{bad}: cannot decode the image (image file is truncated); "
                                 "remove or replace the file")
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx: error at step {s}: step {s + 1}'s batch cannot be read: {end['data_error']}; "
        f"the steps before it are kept (step {s}): fix the data, then resume with --resume "
        f"{part} (from step {s}). held-out: not measured yet (no validation before the stop). "
        f"bundle: {part}")

    bad.write_bytes(good)
    assert main(["--resume", str(part), "--no-progress"]) == 0
    resumed = [e for e in read_events(part) if e["kind"] == "resume"][-1]
    assert "taken as the fix of the data error the run ended on" in resumed["note"]
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp_path), "--run-id",
                 "whole", *opts]) == 0

    def losses(run):
        return [(e["step"], e["loss"]) for e in read_events(run) if e["kind"] == "step"]

    assert losses(part) == losses(whole)
    assert main(["--resume", str(part), "--steps", "13", "--no-progress"]) == 0
    (data / "a" / "00.png").write_bytes(good)
    capsys.readouterr()
    assert main(["--resume", str(part), "--steps", "14", "--no-progress"]) == 2
    assert "found its contents changed" in capsys.readouterr().err


def test_a_stop_while_the_first_batch_is_read_stops_before_step_1(tmp_path, capsys,
                                                                   monkeypatch):
    """A Ctrl-C while step 1's batch was read (a streamed set's first batches take seconds)
    printed nothing, then trained step 1 and checkpointed it; the step is not begun then, so
    the run stops at once, as before the first step, with its line and nothing trained, and
    its new folder removed (it was kept, its run_end saying "nothing trained", while
    docs/RUNS.md said a stop before the first step leaves none)."""
    import os
    import signal

    from toymlx.data import images

    read = images.ImageSet.train_batch

    def interrupted(self, step, *a, **k):
        if step == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return read(self, step, *a, **k)

    monkeypatch.setattr(images.ImageSet, "train_batch", interrupted)
    run = tmp_path / "s"
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp_path), "--run-id", "s",
                 "--steps", "4", "--data.workers", "0"]) == 130
    assert not run.exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "toymlx-train: interrupted before the first step; nothing was trained")
    monkeypatch.setattr(images.ImageSet, "train_batch", read)  # the same command starts it
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp_path), "--run-id", "s",
                 "--steps", "1", "--data.workers", "0"]) == 0


def test_a_file_the_run_never_reads_does_not_block_its_resume(tmp_path, capsys):
    """An edited notes.txt in a class folder (a file the loader never reads) made --resume
    refuse the data ("its size changed"); the record of an ImageFolder covers its images
    alone, and a changed image is still refused."""

    data = _two_classes(tmp_path / "data", 20)
    (data / "a" / "notes.txt").write_text("where these came from\n")
    run = _run(tmp_path, "n", "--data.path", str(data), "--steps", "4", "--stop-at", "2")
    (data / "a" / "notes.txt").write_text("where these came from, and more\n")
    assert main(["--resume", str(run), "--no-progress"]) == 0
    assert read_events(run)[-1]["final_step"] == 4
    (data / "a" / "00.png").write_bytes((data / "a" / "01.png").read_bytes())
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "5", "--no-progress"]) == 2
    assert "--data.path: expected the data the run started on" in capsys.readouterr().err


@pytest.mark.parametrize("per_class", [6, 10])
def test_a_resume_refused_for_changed_data_names_the_file_that_changed(tmp_path, capsys,
                                                                       monkeypatch, per_class):
    """--resume refused changed data by the folder's sizes and digests alone; a folder small
    enough to record each file in config.json (16 or fewer) named the file that changed, was
    added or went, a larger one only itself. Every folder now names it (the first by name):
    12 images from config.json's "files", 20 from data_index.json beside it, which config.json
    does not grow by; each image read once when the run starts (each file's SHA-256 taken in
    the read that takes the folder's), a same-size edit found by its bytes; toymlx-eval's
    refusal of the run's validation split names it as well."""
    import hashlib
    import json

    from PIL import Image

    from toymlx.bundle import inputs

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for k, name in enumerate(("a", "b")):
        (data / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 120, (8, 8), np.uint8) + 120 * k).save(
                data / name / f"{i:02d}.png")
    opened: list[str] = []

    def counted_open(file, *args, **kwargs):
        opened.append(str(file))
        return open(file, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(inputs, "open", counted_open, raising=False)
        run = _run(tmp_path, "n", "--data.path", str(data), "--steps", "4", "--stop-at", "2",
                   "--batch-size", "4")
    images = sorted(str(p) for p in data.rglob("*.png"))
    assert len(images) == 2 * per_class and sorted(opened) == images  # each read once
    rec = json.loads((run / "config.json").read_text())["data_files"]["data.path"]
    index = run / "data_index.json"
    if per_class == 6:
        assert not index.exists()
        parts = rec["files"]
    else:
        assert "files" not in rec
        kept = json.loads(index.read_text())["data.path"]
        assert kept["sha256"] == rec["sha256"]
        parts = {k: {"bytes": n, "sha256": h} for k, (n, h) in kept["files"].items()}
    one = (data / "b" / "03.png").read_bytes()  # as `fingerprint` names a file of its own
    assert parts["b/03.png"] == {
        "bytes": len(one), "sha256": hashlib.sha256(b"|%d\n" % len(one) + one).hexdigest()}
    assert len(parts) == 2 * per_class

    def refused() -> str:
        capsys.readouterr()
        assert main(["--resume", str(run), "--no-progress"]) == 2
        return capsys.readouterr().err

    was = len(one)
    Image.fromarray(np.full((8, 8), 7, np.uint8)).save(data / "b" / "03.png")
    now = (data / "b" / "03.png").stat().st_size
    assert now != was
    assert f": b/03.png changed ({was} -> {now} bytes)); a resumed run trains on its own" in \
        refused()
    (data / "b" / "03.png").write_bytes(one)  # back; then one byte of a later image, same size
    edited = bytearray((data / "b" / "05.png").read_bytes())
    edited[len(edited) // 2] ^= 0xFF
    (data / "b" / "05.png").write_bytes(bytes(edited))
    size = len(edited)
    assert f": b/05.png changed ({size} -> {size} bytes)); a resumed run" in refused()
    (data / "b" / "05.png").unlink()
    assert ": b/05.png gone); a resumed run" in refused()
    (data / "b" / "05.png").write_bytes(bytes(edited))
    (data / "a" / "new.png").write_bytes(one)
    # a/new.png comes first by name: the addition is named before b/05.png's edit
    assert ": a/new.png added); a resumed run" in refused()
    from toymlx_cli.eval import main as eval_main  # its refusal of the run's split names it too

    assert eval_main(["--model", str(run), "--no-progress"]) == 2
    assert " (a/new.png added); restore it, or score the data as it is now with --data.path " \
        in capsys.readouterr().err


def test_a_held_out_image_that_fails_keeps_the_trained_steps(tmp_path, capsys, monkeypatch):
    """A streamed validation image that does not decode ended the run at its pass with no
    checkpoint of the steps before it; they are now checkpointed and the line names the file."""
    from PIL import Image

    from toymlx.data import images

    monkeypatch.setattr(images, "_channel_stats",
                        lambda x, scale: (np.full(x.shape[-1], 0.5, np.float32),
                                          np.full(x.shape[-1], 0.25, np.float32)))
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for k, name in enumerate(("a", "b")):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(20):
                Image.fromarray(rng.integers(0, 120, (8, 8), np.uint8) + 120 * k).save(
                    tmp_path / "data" / split / name / f"{i:02d}.png")
    bad = tmp_path / "data" / "val" / "b" / "05.png"
    bad.write_bytes(bad.read_bytes()[:60])
    run = tmp_path / "v"
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp_path), "--run-id", "v",
                 "--data.path", str(tmp_path / "data"), "--data.stream", "True",
                 "--steps", "4", "--eval-every", "3"]) == 1
    end = read_events(run)[-1]
    assert (end["reason"], end["final_step"]) == ("error", 3)
    assert (run / "weights" / "step_3.gguf").is_file()
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"toymlx: error at step 3: the validation pass after step 3 cannot read its data: {bad}: "
        "cannot decode the image (image file is truncated); remove or replace the file; the "
        f"steps before it are kept (step 3): fix the data, then resume with --resume {run}")
