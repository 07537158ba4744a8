"""ImageFolder and CIFAR loading: decoding against Pillow, class names, splits, streaming,
and one-line errors naming the bad file."""

from __future__ import annotations

import io
import pickle
import tarfile

import numpy as np
import pytest
from image_files import CLASSES, cifar_batch, make_cifar10, make_image_folder, write_pickle
from PIL import Image

from toymlx.data.cifar import load_cifar
from toymlx.data.image_folder import (
    ImageDataError,
    ImageFiles,
    decode_image,
    probe,
    scan_image_folder,
)
from toymlx.data.images import Augment, Prefetcher, load_images


def test_scan_and_decode_against_pillow(tmp_path):
    root = make_image_folder(tmp_path / "f", per_class=4)
    files, labels, names, _ = scan_image_folder(root)
    assert names == list(CLASSES) and labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert [f.parent.name for f in files] == [CLASSES[k] for k in labels]
    # A 9x20 RGB image at size 8: shorter side 9 -> 8, width int(8 * 20 / 9) = 17 (as
    # torchvision's Resize truncates), centre 8x8 crop from round(4.5) = 4.
    p = tmp_path / "one.png"
    rgb = np.random.default_rng(1).integers(0, 256, (9, 20, 3)).astype(np.uint8)
    Image.fromarray(rgb).save(p)
    want = np.asarray(Image.fromarray(rgb).resize((17, 8), Image.Resampling.BICUBIC)
                      .crop((4, 0, 12, 8)))
    np.testing.assert_array_equal(decode_image(p, 8, 3), want)
    grey = np.asarray(Image.fromarray(rgb).convert("L").resize((17, 8), Image.Resampling.BICUBIC)
                      .crop((4, 0, 12, 8)))
    np.testing.assert_array_equal(decode_image(p, 8, 1)[..., 0], grey)


def test_decode_equals_timm_s_evaluation_transform(tmp_path):
    """timm's evaluation transform (crop_pct 1, as toymlx-export's config.json gives it) is
    torchvision's Resize(size, bicubic) then CenterCrop(size): the longer side truncated, the
    crop's offset rounded. toymlx rounded the one and floored the other, so 18 of 30 photos
    of mixed sizes came out a pixel off timm's (up to 60 levels apart at an edge) and
    toymlx-classify's probabilities differed from timm's on the same file by up to 0.011."""
    T = pytest.importorskip("torchvision.transforms", reason="torchvision: the reference")
    rng = np.random.default_rng(3)
    for w, h, size in [(65, 57, 32), (57, 65, 32), (20, 9, 8), (33, 33, 16), (46, 38, 224),
                       (3, 70, 12)]:
        p = tmp_path / f"{w}x{h}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3)).astype(np.uint8)).save(p)
        ref = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
                         T.CenterCrop(size)])
        np.testing.assert_array_equal(decode_image(p, size, 3),
                                      np.asarray(ref(Image.open(p).convert("RGB"))),
                                      err_msg=f"{w}x{h} at {size}")


def test_a_palette_with_transparency_decodes_without_pillow_s_warning(tmp_path):
    """A palette PNG whose transparency is a table of bytes (a tRNS chunk, as image editors
    write one) made Pillow warn, in two lines naming no file, that it "should be converted to
    RGBA": shown once a process, for whichever file came first. The alpha is dropped either
    way; the pixels are Pillow's own convert's, and nothing is warned."""
    import warnings

    rng = np.random.default_rng(4)
    p = tmp_path / "trns.png"
    im = Image.fromarray(rng.integers(0, 256, (12, 12, 3)).astype(np.uint8)).convert(
        "P", palette=Image.Palette.ADAPTIVE)
    im.save(p, transparency=bytes([0, 128, 255] + [255] * 13))
    assert isinstance(Image.open(p).info["transparency"], bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = {c: np.asarray(Image.open(p).convert(m)).reshape(12, 12, c)
                for c, m in ((3, "RGB"), (1, "L"))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for c in (3, 1):
            np.testing.assert_array_equal(decode_image(p, 12, c), want[c])


def test_folder_load_colour_names_split_and_stream(tmp_path):
    root = make_image_folder(tmp_path / "f")
    d = load_images(str(root), 0.2, image_size=12)
    assert d.class_names == list(CLASSES) and d.num_classes == 3
    assert d.image_shape == (12, 12, 3)  # grey files become RGB: the set has colour
    assert (len(d.train_x), len(d.val_x)) == (24, 6) and d.scale == 255.0 and d.scale_fixed
    grey = load_images(str(root), 0.2, image_size=12, channels=1)
    assert grey.image_shape == (12, 12, 1)
    s = load_images(str(root), 0.2, Augment(crop="shift", pad=2, trivial=True, flip=True),
                    image_size=12, stream=True)
    d.augment = s.augment
    assert s.streamed and isinstance(s.train_x, ImageFiles) and not d.streamed
    np.testing.assert_array_equal(s.train_x[np.arange(24)], d.train_x)
    for step in (0, 3):  # streamed batches equal in-memory ones, augmentation included
        a, b = d.train_batch(step, 5, 8), s.train_batch(step, 5, 8)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    va, vb = list(d.val_batches(4)), list(s.val_batches(4))
    assert len(va) == len(vb) == 2
    np.testing.assert_array_equal(va[1]["images"], vb[1]["images"])


def test_a_class_whose_images_are_all_held_out_is_named(tmp_path):
    """A class folder of one image that the seeded split held out for validation: the line
    said "labels takes 3 values in 0..3 in the training split: 1 of the 4 classes have no
    training image", naming neither the class nor why, of a folder that has no labels."""
    root = make_image_folder(tmp_path / "f", per_class=4)
    (root / "owl").mkdir()
    Image.new("L", (9, 9), 200).save(root / "owl" / "only.png")
    d = load_images(str(root), 0.55, image_size=8)  # 7 of 13 held out, owl/only.png among them
    assert sorted(set(d.train_y.tolist())) == [0, 1, 2] and d.val_y.tolist().count(3) == 1
    assert d.notes == [(f"{root}: 1 of the 4 classes has no training image: 'owl' (1 image, "
                        "held out for validation); the model cannot learn it: add images, or "
                        "lower --data.val-fraction")]
    assert load_images(str(root), 0.1, image_size=8).notes == []


def test_images_in_no_class_folder_are_named_not_dropped_without_a_word(tmp_path):
    """Image files directly in the folder of classes belong to no class: they were left out of
    training, validation and the counts without a word. One line names them, for --data.path
    and --data.val-path alike; hidden names and other files say nothing."""
    root = make_image_folder(tmp_path / "f", per_class=3)
    val = make_image_folder(tmp_path / "v", per_class=1, seed=1)
    for name in ("b.png", "a.JPG", "c.png", "d.gif"):
        Image.new("L", (9, 9)).save(root / name, format="PNG")
    Image.new("L", (9, 9)).save(val / "x.png")
    for name in (".hidden.png", "notes.txt", ".DS_Store"):
        (root / name).write_bytes(b"\x00")
    d = load_images(str(root), val_path=str(val), image_size=8)
    assert (len(d.train_y), len(d.val_y)) == (9, 3)
    assert d.notes == [
        (f"{root}: 4 image files directly in it, in no class folder (a.JPG, b.png, c.png ...): "
         "not read (an image's class is the subfolder it is in); move them into one"),
        (f"{val}: 1 image file directly in it, in no class folder (x.png): not read (an "
         "image's class is the subfolder it is in); move it into one")]
    for name in ("b.png", "a.JPG", "c.png", "d.gif"):
        (root / name).unlink()
    assert load_images(str(root), image_size=8).notes == []



def test_files_in_class_folders_not_named_as_images_are_counted_in_one_line(tmp_path, capsys):
    """An iPhone's .heic photos, a Windows .jfif download, a Thumbs.db or a notes.txt in a
    class folder are not read: they were left out without a word, so a class of .heic photos
    trained on what remained of it (and toymlx-classify of a folder answered for the others
    alone). One line counts them by extension and names the first; hidden names (.DS_Store)
    still say nothing."""
    from toymlx.generation.classify import image_files

    root = make_image_folder(tmp_path / "f", per_class=3)
    for name in ("bird/photo.HEIC", "bird/b.heic", "cat/Thumbs.db", "cat/scan.jfif",
                 "frog/README", "frog/.DS_Store"):
        (root / name).write_bytes(b"\x00")
    d = load_images(str(root), image_size=8)
    assert len(d.train_y) + len(d.val_y) == 9
    assert d.notes == [
        (f"{root}: 5 files not read, not named as images (*.png, *.jpg, *.jpeg, ...): 2 .heic, "
        "1 .db, 1 .jfif, 1 no extension (bird/b.heic, bird/photo.HEIC, cat/Thumbs.db and 2 "
        "more); convert or rename any image among them to a format read")]
    capsys.readouterr()
    assert len(image_files([root / "bird", root / "frog"])) == 6
    assert capsys.readouterr().err == (
        f"toymlx: {root / 'bird'}: 2 files not read, not named as images (*.png, *.jpg, "
        "*.jpeg, ...): 2 .heic (b.heic, photo.HEIC); convert or rename any image among them "
        f"to a format read\ntoymlx: {root / 'frog'}: 1 file not read, not named as images "
        "(*.png, *.jpg, *.jpeg, ...): 1 no extension (README); convert or rename any image "
        "among them to a format read\n")
    for name in ("bird/photo.HEIC", "bird/b.heic", "cat/Thumbs.db", "cat/scan.jfif",
                 "frog/README"):
        (root / name).unlink()
    assert load_images(str(root), image_size=8).notes == []

def test_a_palette_of_greys_is_grey(tmp_path):
    """GIFs (and palette PNGs) of grey digits are mode P with a palette of greys: counted as
    colour by their mode, one of them made a grey set train as RGB, with flips on (the default
    for colour). A palette with a colour in it is colour, as before."""
    root = tmp_path / "f"
    rng = np.random.default_rng(0)
    for k, name in enumerate(("a", "b")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            grey = Image.fromarray(rng.integers(0, 256, (8, 8)).astype(np.uint8))
            grey.save(root / name / f"{i}.gif")  # mode P, a palette of greys
            grey.save(root / name / f"{i}.png")  # mode L
    assert Image.open(root / "a" / "0.gif").mode == "P"
    d = load_images(str(root), 0.0)
    assert d.image_shape == (8, 8, 1)
    np.testing.assert_array_equal(d.train_x[0, ..., 0], np.asarray(Image.open(root / "a" / "0.gif")
                                                                   .convert("L")))
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 200
    Image.fromarray(red).convert("P", palette=Image.Palette.ADAPTIVE).save(root / "b" / "r.png")
    assert load_images(str(root), 0.0).image_shape == (8, 8, 3)


def test_default_size_and_val_path_by_class_name(tmp_path):
    root = tmp_path / "same"
    for name in ("b", "a"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((10, 10), 40 * i, np.uint8)).save(root / name / f"{i}.png")
    d = load_images(str(root), 0.0)
    assert d.image_shape == (10, 10, 1) and d.class_names == ["a", "b"]  # one square size: kept
    assert d.notes == []
    # mixed sizes go to 224 in one line: a run upscaling 10 px images 22x said nothing
    Image.fromarray(np.zeros((12, 30), np.uint8)).save(root / "a" / "wide.png")
    assert load_images(str(root), 0.0).notes == [
        (f"{root}: 7 images of 2 sizes (shorter side 10 to 12 px): each resized and "
         "centre-cropped to 224x224 (the default for images not all of one square size up to "
         "224; --data.image-size to choose)")]
    assert load_images(str(root), 0.0, image_size=10).notes == []  # the size given
    (root / "a" / "wide.png").unlink()
    big = tmp_path / "big"  # one square size above 224: timm's 224 too, said so
    for name in ("a", "b"):
        (big / name).mkdir(parents=True)
        Image.new("L", (240, 240)).save(big / name / "0.png")
    assert load_images(str(big), 0.0).notes == [
        (f"{big}: 2 images, all 240x240: each resized and centre-cropped to 224x224 (the "
         "default for images not all of one square size up to 224; --data.image-size to "
         "choose)")]
    val = tmp_path / "val" / "b"
    val.mkdir(parents=True)
    Image.fromarray(np.zeros((30, 20), np.uint8)).save(val / "x.png")
    d = load_images(str(root), 0.5, val_path=str(tmp_path / "val"))
    assert (len(d.train_x), len(d.val_x)) == (6, 1) and d.val_y.tolist() == [1]  # "b" is 1
    assert d.val_x.shape == (1, 10, 10, 1)
    bad = tmp_path / "val2" / "zebra"
    bad.mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(bad / "z.png")
    with pytest.raises(ImageDataError, match="class 'zebra': expected one of the 2 classes"):
        load_images(str(root), val_path=str(tmp_path / "val2"))


def _one_line(e: pytest.ExceptionInfo, path) -> str:
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_files_give_one_line_errors_naming_them(tmp_path):
    root = make_image_folder(tmp_path / "f", per_class=3)
    png = root / "cat" / "01.png"
    png.write_bytes(png.read_bytes()[:-40])  # truncated
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert "cannot decode the image" in _one_line(e, png)

    # a JPEG cut short in its header was "cannot open (Truncated File Read)", as if the OS
    # could not open it
    root = make_image_folder(tmp_path / "j", per_class=3)
    jpg = root / "cat" / "cut.jpg"
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(out, "JPEG")
    jpg.write_bytes(out.getvalue()[:300])
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert _one_line(e, jpg) == (
        f"{jpg}: cannot decode the image (Truncated File Read): expected a whole image file, "
        "found a JPEG file of 300 bytes whose header Pillow cannot read (cut short?); remove or "
        "replace the file")

    root = make_image_folder(tmp_path / "g", per_class=3)
    fake = root / "frog" / "notes.jpg"
    fake.write_text("this is not a picture\n")
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert "not an image Pillow can read" in _one_line(e, fake)

    root = make_image_folder(tmp_path / "h", per_class=3)
    (root / "empty").mkdir()
    (root / "empty" / "README.txt").write_text("no images here")
    with pytest.raises(ImageDataError) as e:
        load_images(str(root))
    assert "class folder has no images" in _one_line(e, root / "empty")

    one = tmp_path / "one"
    (one / "only").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(one / "only" / "a.png")
    with pytest.raises(ImageDataError) as e:
        load_images(str(one))
    assert "expected at least 2 class subfolders, found 1 ('only')" in _one_line(e, one)


def test_a_fifo_named_as_an_image_is_named_not_skipped(tmp_path):
    """A FIFO `cat/pipe.png` among the images was skipped without a word by training, eval
    and classify (one image fewer); classify given the FIFO itself said "no such file or
    directory". Each now names it and what it is."""
    import os

    from toymlx.generation.classify import image_files

    root = make_image_folder(tmp_path / "f", per_class=3)
    pipe = root / "cat" / "pipe.png"
    os.mkfifo(pipe)
    want = f"{pipe}: expected an image file, found a FIFO (named pipe); remove it or put the " \
           "image there"
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert str(e.value) == want
    assert [str(e) for e in image_files([root])] == [want]  # in the folder's place
    assert [str(e) for e in image_files([pipe])] == [
        (f"{pipe}: expected an image file or a folder, found a FIFO (named pipe); for one "
         "image sent on stdin, name it -")]
    pipe.unlink()
    assert len(image_files([root])) == 9


def test_an_image_pillow_refuses_at_open_is_one_line(tmp_path, monkeypatch):
    """A 20000 x 20000 PNG (388 KB on disk) passes Pillow's decompression-bomb limit: its
    DecompressionBombError, raised when the file is opened, came out as a traceback (exit
    status 1) from training, eval and classify; a PPM header Pillow cannot parse as a bare
    ValueError naming no file. Now each is the line a corrupt image gets."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the limit, lowered: a small file
    root = make_image_folder(tmp_path / "f", per_class=3)
    big = root / "cat" / "big.png"
    Image.fromarray(np.zeros((50, 50), np.uint8)).save(big)  # 2500 pixels > 2 x 1000
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert str(e.value) == (f"{big}: cannot decode the image (Image size (2500 pixels) exceeds "
                            "limit of 2000 pixels, could be decompression bomb DOS attack.); "
                            "remove or replace the file")
    # a PPM header Pillow cannot parse: its ValueError came out bare, naming no file
    big.unlink()
    bad = root / CLASSES[1] / "bad.ppm"
    bad.write_bytes(b"P6\n" + b"7" * 20 + b"\n")
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert str(e.value) == (f"{bad}: cannot decode the image (b'Token too long in file header: "
                            f"{'7' * 11}'); remove or replace the file")


def test_a_large_image_is_one_line_naming_the_file_once(tmp_path):
    """An image between Pillow's pixel limit and twice it decodes, with Pillow's warning: two
    lines naming Pillow's own source, not the file. Now one line names the file and its size,
    once however often the file is read, and the image is decoded as before."""
    import subprocess
    import sys

    big = tmp_path / "big.png"
    Image.fromarray(np.full((30, 40), 9, np.uint8)).save(big)  # 1200 pixels: over, under 2x
    code = ("import sys; from PIL import Image; Image.MAX_IMAGE_PIXELS = 1000\n"
            "from toymlx.data.image_folder import decode_image\n"
            "a = decode_image(sys.argv[1], 8, 1); decode_image(sys.argv[1], 8, 1)\n"
            "print(a.shape, int(a.min()), int(a.max()))\n")
    p = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True,
                       timeout=120, check=True)
    assert p.stdout == "(8, 8, 1) 9 9\n"
    assert p.stderr == (f"toymlx: {big}: a large image, 40 x 30 = 1,200 pixels, over Pillow's "
                        "limit of 1,000 for untrusted files; decoded as it is\n")


def test_reading_images_leaves_the_callers_warnings_as_they_were(tmp_path):
    """toymlx's one line replaces Pillow's warning for the images toymlx reads, and only those:
    importing the reader (as `toymlx.train` does, to summarise a run) silenced Pillow's
    DecompressionBombWarning for the whole process, a notebook's own `Image.open` of a huge
    untrusted file included, with a filter left in `warnings.filters`."""
    import subprocess
    import sys

    big = tmp_path / "big.png"
    Image.fromarray(np.full((30, 40), 9, np.uint8)).save(big)  # 1200 pixels: over, under 2x
    code = ("import sys, warnings, numpy; from PIL import Image\n"
            "Image.MAX_IMAGE_PIXELS = 1000; before = list(warnings.filters)\n"
            "from toymlx.data.image_folder import decode_image\n"
            "decode_image(sys.argv[1], 8, 1)\n"
            "print(warnings.filters == before)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    Image.open(sys.argv[1]).close()\n"
            "print([type(x.message).__name__ for x in w])\n")
    p = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True,
                       timeout=120, check=True)
    assert p.stdout == "True\n['DecompressionBombWarning']\n"
    assert p.stderr == (f"toymlx: {big}: a large image, 40 x 30 = 1,200 pixels, over Pillow's "
                        "limit of 1,000 for untrusted files; decoded as it is\n")


def test_a_class_folder_utf8_cannot_name_is_refused_first(tmp_path):
    """A class folder named in latin-1 (byte 0xe9): its name, the class's, went into the
    run_start event and failed there ("'utf-8' codec can't encode character '\\udce9'"),
    after the images were read; now the scan names it."""
    import os

    root = make_image_folder(tmp_path / "f", per_class=3)
    latin = root / os.fsdecode(b"caf\xe9")
    (root / CLASSES[0]).rename(latin)
    with pytest.raises(ImageDataError) as e:
        scan_image_folder(root)
    assert str(e.value) == (f"{latin}: expected a class folder named in UTF-8 (its name is the "
                            "class's, recorded as text), found the byte 0xe9 at character 3; "
                            "rename it")


def test_cifar10_folder_archive_and_batch_file(tmp_path):
    folder = make_cifar10(tmp_path / "a")
    x, y, n_train, names = load_cifar(folder)
    assert x.shape == (36, 32, 32, 3) and n_train == 30 and names[:3] == ["airplane",
                                                                        "automobile", "bird"]
    first = cifar_batch(6, 1)
    # row r of "data" is channel-planar: pixel (i, j) of channel c is data[r, c*1024 + 32*i + j]
    assert x[0, 5, 7, 2] == first[b"data"][0, 2 * 1024 + 32 * 5 + 7]
    assert y[:6].tolist() == first[b"labels"]
    xa, ya, na, names_a = load_cifar(make_cifar10(tmp_path / "b", archive=True))
    np.testing.assert_array_equal(xa, x)
    assert (na, names_a) == (n_train, names) and np.array_equal(ya, y)
    d = load_images(str(folder.parent / "cifar-10-batches-py"))
    assert (len(d.train_x), len(d.val_x), d.num_classes) == (30, 6, 10)  # official split
    assert d.class_names[9] == "truck" and d.image_shape == (32, 32, 3)
    single = load_images(str(folder / "data_batch_2"), 0.5)  # one batch, names from the meta
    assert (len(single.train_x), len(single.val_x)) == (3, 3) and single.class_names[0] == \
        "airplane"


def test_cifar100_layout(tmp_path):
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    write_pickle(d / "train", cifar_batch(8, 1, classes=100, fine=True))
    write_pickle(d / "test", cifar_batch(4, 2, classes=100, fine=True))
    write_pickle(d / "meta", {b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                              b"coarse_label_names": [b"x"] * 20})
    with tarfile.open(tmp_path / "cifar-100-python.tar.gz", "w:gz") as tar:
        tar.add(d, arcname="cifar-100-python")
    s = load_images(str(tmp_path / "cifar-100-python.tar.gz"))
    assert (len(s.train_x), len(s.val_x), s.num_classes) == (8, 4, 100)
    assert s.class_names[42] == "c42"


def test_cifar_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(ImageDataError) as e:
        load_images(str(p))
    assert "print is not allowed" in _one_line(e, p)
    bad = write_pickle(tmp_path / "test_batch", {b"data": np.zeros((2, 100), np.uint8),
                                                 b"labels": [0, 1]})
    with pytest.raises(ImageDataError) as e:
        load_images(str(bad))
    assert "key 'data': expected (N, 3072) uint8 rows, found (2, 100)" in _one_line(e, bad)


def test_prefetcher_returns_the_same_values_in_any_order():
    calls = []

    def fn(step):
        calls.append(step)
        return np.random.default_rng(step).random(3)

    p = Prefetcher(fn, workers=2, stop=10)
    got = [p(s) for s in (0, 1, 2, 7, 3, 9)]  # a jump, a jump back (resume), the last step
    for s, g in zip((0, 1, 2, 7, 3, 9), got):
        np.testing.assert_array_equal(g, np.random.default_rng(s).random(3))
    p.pool.shutdown(wait=True)
    assert max(calls) <= 9  # never past stop


def test_timm_s_train_and_val_folders_are_splits_not_classes(tmp_path):
    """`root/train/<class>` beside `root/val/<class>`, as timm's --data-dir reads it: trained on
    train/, validated on val/, with a line saying so (before: two classes, "train" and "val")."""
    root = tmp_path / "set"
    make_image_folder(root / "train", per_class=4)
    make_image_folder(root / "val", per_class=2, seed=1)
    d = load_images(str(root), image_size=8)
    assert d.class_names == list(CLASSES)
    assert (len(d.train_y), len(d.val_y)) == (12, 6)
    assert d.val_y.tolist() == [0, 0, 1, 1, 2, 2] and d.source == str(root)
    assert d.notes == [(f"{root}: train/, val/ are splits (timm's layout), not classes: "
                        f"training on {root / 'train'}, validating on {root / 'val'}")]
    # no val/: the fixed split of train/; test/ named, never read unless asked
    (root / "val").rename(root / "test")
    d = load_images(str(root), 0.25, image_size=8)
    assert (len(d.train_y), len(d.val_y)) == (9, 3) and d.test_y is None
    assert d.notes == [(f"{root}: test/, train/ are splits (timm's layout), not classes: "
                        f"training on {root / 'train'}, no val/, valid/, validation/, eval/, "
                        f"evaluation/ folder; {root / 'test'} is scored only by "
                        f"--data.test-path {root / 'test'} --test")]
    assert d.split_note == (f"{root}: no validation set given: a fixed seeded 3 of its 12 images "
                            "(--data.val-fraction 0.25) validate and are not trained on; to "
                            f"give one: a {root}/val/ folder of class subfolders, or "
                            "--data.val-path DIR")
    # classes that happen to be called train and test, holding images: classes
    flat = tmp_path / "flat"
    for name in ("train", "test"):
        (flat / name).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (8, 8), 40 * i).save(flat / name / f"{i}.png")
    assert load_images(str(flat), image_size=8).class_names == ["test", "train"]
    (root / "validation").mkdir()
    (root / "val").mkdir()
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8)
    assert str(e.value) == (f"{root}: expected one val folder (timm's layout), found val/ and "
                            "validation/; merge or rename one")


def test_one_folder_says_how_many_images_its_seeded_split_holds_out(tmp_path):
    """One folder of class subfolders, no split given: the run held out a seeded 10% without a
    word. One line now counts them (round(30 x 0.1) = 3 of 30, the validation split's size) and
    names how to give a split; one that rounds to none says the run validates nothing."""
    root = make_image_folder(tmp_path / "set", per_class=10)
    d = load_images(str(root), image_size=8)
    assert (len(d.train_y), len(d.val_y)) == (27, 3)
    assert d.split_note == (f"{root}: no validation set given: a fixed seeded 3 of its 30 "
                            "images (--data.val-fraction 0.1) validate and are not trained on; "
                            "to give one: --data.val-path DIR, or --data.path a folder of "
                            "train/ and val/ (timm's layout)")
    d = load_images(str(root), 0.04, image_size=8)  # 30 x 0.04 = 1.2: one image
    assert len(d.val_y) == 1 and "a fixed seeded 1 of its 30 images (--data.val-fraction " \
        "0.04) validates and is not trained on" in d.split_note
    d = load_images(str(root), 0.01, image_size=8)  # 0.3 rounds to none
    assert len(d.val_y) == 0 and d.split_note.startswith(
        f"{root}: no validation set given: --data.val-fraction 0.01 of its 30 images holds out "
        "none, so the run validates nothing; ")
    # a split given (--data.val-path), an evaluation (classes given), the digits: no such line
    val = make_image_folder(tmp_path / "val", per_class=2, seed=1)
    assert load_images(str(root), val_path=str(val), image_size=8).split_note is None
    assert load_images(str(root), image_size=8, classes=list(CLASSES)).split_note is None
    assert load_images().split_note is None


def test_linked_subfolders_are_read_and_a_dangling_link_is_named(tmp_path):
    """Images behind a linked subfolder count, as torchvision's ImageFolder follows links (before:
    skipped without a word); a link to nothing, or up to the folder of the classes, is refused
    by name (before: skipped, and read as the class's); a link up to the class folder itself is
    refused as in a folder of text files (before: skipped, as there)."""
    root = make_image_folder(tmp_path / "f", per_class=3)
    elsewhere = make_image_folder(tmp_path / "more", per_class=2, seed=2)
    (root / "cat" / "more").symlink_to(elsewhere / "cat")
    files, labels, _, _ = scan_image_folder(root)
    assert np.bincount(labels).tolist() == [3, 5, 3]
    assert sum(f.parent.name == "more" for f in files) == 2
    (root / "cat" / "loop").symlink_to(root / "cat")
    with pytest.raises(ImageDataError) as e:
        scan_image_folder(root)
    assert str(e.value) == (f"{root / 'cat' / 'loop'}: expected a file or a folder within "
                            f"{root / 'cat'}, found a link back up to {(root / 'cat').resolve()}, "
                            "which holds it: a loop, its names read again through it; remove "
                            "the link")
    (root / "cat" / "loop").unlink()
    # in a hidden folder (never read) a link up is not followed, nor refused
    (root / "cat" / ".ipynb_checkpoints").mkdir()
    (root / "cat" / ".ipynb_checkpoints" / "up").symlink_to(root)
    assert scan_image_folder(root)[0] == files
    # a link up to the folder holding the classes read them all as cat's, without a word
    (root / "frog" / "up").symlink_to("..")
    with pytest.raises(ImageDataError) as e:
        scan_image_folder(root)
    assert str(e.value) == (f"{root / 'frog' / 'up'}: expected a file or a folder within "
                            f"{root / 'frog'}, found a link back up to {root.resolve()}, which "
                            "holds it: the names beside it would be read as this folder's; "
                            "remove the link")
    (root / "frog" / "up").unlink()
    (root / "frog" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(ImageDataError) as e:
        scan_image_folder(root)
    assert str(e.value) == (f"{root / 'frog' / 'gone.png'}: expected an image file, found a link "
                            f"to {tmp_path / 'nowhere.png'}, which does not exist; restore its "
                            "target or remove the link")
    (root / "frog" / "gone.png").unlink()
    # a class folder linked from a disk not mounted: the class dropped out without a word (2
    # classes trained), in timm's layout too (no val/: validated on a split of train/)
    (root / "owl").symlink_to(tmp_path / "unmounted" / "owl")
    want = (f"{root / 'owl'}: expected a folder of images, found a link to "
            f"{tmp_path / 'unmounted' / 'owl'}, which does not exist; restore its target or "
            "remove the link")
    for where in (root, tmp_path / "layout"):
        if where != root:
            (where / "train").mkdir(parents=True)
            (where / "train" / "cat").symlink_to(root / "cat")
            (where / "val").symlink_to(tmp_path / "unmounted" / "val")
            want = want.replace(str(root / "owl"), str(where / "val")).replace(
                str(tmp_path / "unmounted" / "owl"), str(tmp_path / "unmounted" / "val"))
        with pytest.raises(ImageDataError) as e:
            load_images(str(where), image_size=8)
        assert str(e.value) == want


def test_a_test_folder_beside_train_and_val_is_a_test_path_apart_from_training(tmp_path):
    """`--data.path set --data.test-path set/test --test` in timm's layout: the training images are
    set/train, so set/test is apart from them (before: refused as overlapping --data.path)."""
    from toymlx.recipes.vit_tiny import Config, ImageData, validate

    root = tmp_path / "set"
    for split in ("train", "val", "test"):
        make_image_folder(root / split, per_class=2)
    validate(Config(data=ImageData(path=str(root), test_path=str(root / "test")), test=True))
    with pytest.raises(ValueError) as e:
        validate(Config(data=ImageData(path=str(root), test_path=str(root / "train" / "cat")),
                        test=True))
    assert str(e.value).startswith("--data.test-path: expected images apart from --data.path")


def test_every_unreadable_image_is_named_in_one_line(tmp_path):
    """Several images that do not decode were named one at a time (fix one, run again, meet
    the next); one line names the first three, in file order, and counts the rest, at load
    (a set decoded into memory, or a streamed set's headers) and in a streamed batch."""
    root = make_image_folder(tmp_path / "f", per_class=6)
    files, _, _, _ = scan_image_folder(root)
    pngs = [f for f in files if f.suffix == ".png"]
    for f in pngs[:5]:  # the header whole, the pixels cut
        f.write_bytes(f.read_bytes()[:60])
    cut = "cannot decode the image (image file is truncated)"
    want = (f"5 images cannot be read: {pngs[0]}: {cut}; {pngs[1]}: {cut}; {pngs[2]}: {cut}; "
            "and 2 more; remove or replace them")
    with pytest.raises(ImageDataError) as e:
        load_images(str(root), image_size=8, workers=2)
    assert str(e.value) == want
    with pytest.raises(ImageDataError) as e:
        ImageFiles(files, 8, 3)[np.arange(len(files))]
    assert str(e.value) == want
    with pytest.raises(ImageDataError) as e:  # one: its own line, as before
        ImageFiles(pngs[4:], 8, 3)[:]
    assert str(e.value) == f"{pngs[4]}: {cut}; remove or replace the file"
    (tmp_path / "bad.png").write_bytes(b"nothing")
    (tmp_path / "bad2.png").write_bytes(b"")
    with pytest.raises(ImageDataError, match=r"^2 images cannot be read: .*bad\.png: not an image "
                       r"Pillow can read: .*; .*bad2\.png: not an image .* an empty file; remove "
                       r"or replace them$"):
        probe([tmp_path / "bad.png", tmp_path / "bad2.png"], 2)


def test_a_folder_one_level_above_the_classes_names_the_one_below(tmp_path):
    """`--data.path data` with the classes in data/images/ read as one class, images, and was
    refused for having one class, the way out unsaid: the refusal names the folder below whose
    subfolders look like the classes. A class with subfolders of its own among others is not
    second-guessed."""
    make_image_folder(tmp_path / "data" / "images", per_class=1)
    with pytest.raises(ImageDataError) as e:
        load_images(str(tmp_path / "data"), image_size=8)
    assert str(e.value) == (
        f"{tmp_path / 'data'}: expected at least 2 class subfolders, found 1 ('images'); a "
        "classifier needs two or more classes; its subfolders (bird, cat, frog) look like the "
        f"classes: --data.path {tmp_path / 'data' / 'images'}")
    assert len(load_images(str(tmp_path / "data" / "images"), 0.0, image_size=8).train_y) == 3


def test_a_class_with_no_validation_image_is_named(tmp_path):
    """timm's layout with val/ lacking one class's subfolder validated on the other classes
    without a word: the held-out accuracy read as the model's on every class. One line names
    the classes it leaves out."""
    root = tmp_path / "d"
    make_image_folder(root / "train", per_class=4)
    make_image_folder(root / "val", per_class=2, seed=1)
    for f in (root / "val" / "frog").iterdir():
        f.unlink()
    (root / "val" / "frog").rmdir()
    d = load_images(str(root), image_size=8)  # timm's layout
    assert sorted(set(d.val_y.tolist())) == [0, 1]
    assert d.notes[1:] == [
        (f"{root / 'val'}: 1 of the 3 classes has no validation image ('frog'): the held-out "
         "accuracy and loss cover the other 2; add images of it to score it")]
    assert load_images(str(root / "train"), val_path=str(root / "train"), image_size=8
                       ).notes == []


def test_images_in_a_hidden_folder_are_skipped_as_hidden_files_are(tmp_path):
    """A class folder's hidden subfolder (a viewer's .thumbnails/) was read as images of the
    class while a hidden file beside them was skipped; both are skipped now, as a folder of
    text files skips them."""
    from toymlx.data.image_folder import files_below

    cat = tmp_path / "cat"
    (cat / ".thumbnails").mkdir(parents=True)
    for name in ("a.png", ".b.png", ".thumbnails/a.png"):
        Image.new("L", (4, 4)).save(cat / name)
    assert files_below(cat) == ([cat / "a.png"], [])
