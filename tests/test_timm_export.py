"""`toymlx-export --format safetensors`: timm's vit_tiny_patch16_224 layout.

Default tier: the written file, read back, runs through an independent float64 numpy forward
written from timm's VisionTransformer (NCHW conv patch embedding, fused qkv, class-token
pooling) and matches toymlx's logits. `-m bench` (the bench extra: torch, torchvision, timm): timm's own
PyTorch forward, built both from `timm.create_model(...)` + `load_state_dict` and from the
exported folder (`local-dir:`), matches toymlx's to 1e-4.
"""

from __future__ import annotations

import json
import math
import re
import struct

import mlx.core as mx
import numpy as np
import pytest
from toymlx_cli.export import main as export_main

from toymlx.gguf.vit import write_vit
from toymlx.interop.timm_export import TIMM_ARCH, timm_model_args
from toymlx.models.vit import ViT, ViTArgs

ARGS = ViTArgs(image_size=12, patch_size=4, channels=3, d_model=24, n_layers=2, n_heads=3,
               ffn_dim=40, num_classes=4)
NAMES = ["ant", "bee", "cow", "dog"]
NORM = {"toy.pixel_scale": 255.0, "toy.pixel_mean": [0.5, 0.4, 0.3],
        "toy.pixel_std": [0.25, 0.2, 0.3]}


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A safetensors file read by hand (F32 only), checking the header's offsets."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out, end = {}, 0
    for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = v["data_offsets"]
        assert v["dtype"] == "F32" and a == end
        out[k] = np.frombuffer(data[8 + n + a:8 + n + b], "<f4").reshape(v["shape"])
        end = b
    assert 8 + n + end == len(data)
    return out, meta


def timm_forward(sd: dict[str, np.ndarray], x: np.ndarray, heads: int) -> np.ndarray:
    """timm's VisionTransformer forward in float64 numpy; x is NCHW."""
    sd = {k: v.astype(np.float64) for k, v in sd.items()}
    erf = np.vectorize(math.erf)

    def ln(h, name):
        mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        return (h - mu) / np.sqrt(var + 1e-6) * sd[name + ".weight"] + sd[name + ".bias"]

    def lin(h, name):
        return h @ sd[name + ".weight"].T + sd[name + ".bias"]

    w = sd["patch_embed.proj.weight"]  # (D, C, p, p): a stride-p conv is a patch matmul
    d, c, p, _ = w.shape
    b, _, hh, ww = x.shape
    patches = x.reshape(b, c, hh // p, p, ww // p, p).transpose(0, 2, 4, 1, 3, 5)
    h = patches.reshape(b, -1, c * p * p) @ w.reshape(d, -1).T + sd["patch_embed.proj.bias"]
    h = np.concatenate([np.broadcast_to(sd["cls_token"], (b, 1, d)), h], 1) + sd["pos_embed"]
    hd = d // heads
    i = 0
    while f"blocks.{i}.norm1.weight" in sd:
        t = f"blocks.{i}."
        qkv = lin(ln(h, t + "norm1"), t + "attn.qkv").reshape(b, -1, 3, heads, hd)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # each (B, heads, T, hd)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        h = h + lin(o.transpose(0, 2, 1, 3).reshape(b, -1, d), t + "attn.proj")
        u = lin(ln(h, t + "norm2"), t + "mlp.fc1")
        h = h + lin(0.5 * u * (1 + erf(u / math.sqrt(2))), t + "mlp.fc2")
        i += 1
    return lin(ln(h, "norm")[:, 0], "head")


@pytest.fixture
def exported(tmp_path):
    mx.random.seed(3)
    model = ViT(ARGS)
    ckpt = tmp_path / "m.gguf"
    write_vit(ckpt, model, NORM, class_names=NAMES)
    assert export_main(["--model", str(ckpt), "--format", "safetensors",
                        "--out", str(tmp_path / "timm")]) == 0
    return model, tmp_path / "timm"


def test_export_says_how_timm_loads_what_it_wrote(tmp_path, capsys):
    """A folder (config.json beside the weights) loads by `local-dir:`, as docs/IMAGES.md says;
    a .safetensors file alone needs the model's arguments and load_state_dict."""
    ckpt = tmp_path / "m.gguf"
    write_vit(ckpt, ViT(ARGS), NORM, class_names=NAMES)
    assert export_main(["--model", str(ckpt), "--format", "safetensors",
                        "--out", str(tmp_path / "vit") + "/"]) == 0
    err = capsys.readouterr().err
    assert f"; load with timm.create_model('local-dir:{tmp_path / 'vit'}', pretrained=True) " \
        f"(and its classes' order: create_dataset(..., class_map='{tmp_path / 'vit'}/" \
        "class_map.txt')); inputs NCHW" in err, err
    assert export_main(["--model", str(ckpt), "--format", "safetensors",
                        "--out", str(tmp_path / "w.safetensors")]) == 0
    err = capsys.readouterr().err
    assert f"; load with timm.create_model({TIMM_ARCH!r}, num_classes=4, img_size=12, " \
        "patch_size=4, in_chans=3, embed_dim=24, depth=2, " in err, err
    assert ") and load_state_dict; inputs NCHW" in err, err


def test_the_class_map_numbers_timm_s_folders_as_the_model_does(tmp_path):
    """Class folders class2, class10, Bee: toymlx numbers them as torchvision does (Bee,
    class10, class2), timm's folder reader in natural order (Bee, class2, class10), so timm
    scored the exported model against other classes' labels. The export writes class_map.txt
    (the names one a line, in the model's order), which timm's create_dataset(class_map=...)
    and train.py's --class-map read."""
    from image_files import make_image_folder

    from toymlx.data.image_folder import scan_image_folder

    data = tmp_path / "data"
    make_image_folder(data, per_class=1)
    for old, new in zip(sorted(p for p in data.iterdir()), ["class2", "class10", "Bee"]):
        old.rename(data / new)
    names = scan_image_folder(data)[2]
    assert names == ["Bee", "class10", "class2"]
    args = ViTArgs(**{**ARGS.__dict__, "num_classes": 3})
    ckpt = tmp_path / "m.gguf"
    write_vit(ckpt, ViT(args), NORM, class_names=names)
    assert export_main(["--model", str(ckpt), "--format", "safetensors",
                        "--out", str(tmp_path / "vit")]) == 0
    assert (tmp_path / "vit" / "class_map.txt").read_text() == "Bee\nclass10\nclass2\n"
    reader = pytest.importorskip("timm.data.readers.reader_image_folder",
                                 reason="timm: the reader the map is for")
    assert reader.ReaderImageFolder(str(data)).class_to_idx == {
        "Bee": 0, "class2": 1, "class10": 2}  # natural order: not the model's
    assert reader.ReaderImageFolder(str(data), class_map=str(tmp_path / "vit" / "class_map.txt")
                                    ).class_to_idx == {n: i for i, n in enumerate(names)}


def test_a_class_name_timm_s_class_map_reader_changes_is_refused_before_training(tmp_path):
    """Class folders " cat" and "frog " trained as those names, but timm reads the exported
    class_map.txt with each line stripped: its classes were "cat" and "frog", its folder reader
    matched the " cat" folder's images to no class. Such a name is now refused at training
    start (one line: the class, what timm reads, the rename); a name timm's reader gives back
    as it is (inner spaces, a non-breaking space inside) still trains and exports."""
    from image_files import make_image_folder

    from toymlx.data.image_folder import ImageDataError
    from toymlx.data.images import load_images

    class_map = pytest.importorskip("timm.data.readers.class_map",
                                    reason="timm: the reader the map is for")
    reader = pytest.importorskip("timm.data.readers.reader_image_folder")
    data = make_image_folder(tmp_path / "data", per_class=1)
    (data / "cat").rename(data / " cat")
    (data / "frog").rename(data / "frog ")
    # the premise, from timm's own reader: the names a class_map.txt of them gives back differ
    lines = tmp_path / "as_written.txt"
    lines.write_text("bird\n cat\nfrog \n")  # the export's format: one name a line
    assert class_map.load_class_map(str(lines)) == {"bird": 0, "cat": 1, "frog": 2}
    assert reader.ReaderImageFolder(str(data), class_map=str(lines)).samples == [
        (str(data / "bird" / "00.png"), 0)]  # the " cat" and "frog " images: in no class
    with pytest.raises(ImageDataError) as e:
        load_images(str(data), image_size=8)
    assert str(e.value) == (f"{data}: class ' cat': expected a class name that reads back as "
                            "itself from the class_map.txt toymlx-export writes for timm, found "
                            "whitespace at its ends, which timm's reader strips ('cat'); "
                            "rename the folder to 'cat'")
    (data / " cat").rename(data / "cat")
    (data / "frog ").rename(data / "tree\nfrog")
    with pytest.raises(ImageDataError, match=r"class 'tree\\nfrog': .* found a line break in "
                       r"it, which splits its line; rename the folder to 'tree frog'$"):
        load_images(str(data), image_size=8)
    (data / "tree\nfrog").rename(data / "big\xa0cat")
    (data / "bird").rename(data / "tree  frog")
    d = load_images(str(data), image_size=8)
    assert d.class_names == ["big\xa0cat", "cat", "tree  frog"]
    args = ViTArgs(**{**ARGS.__dict__, "num_classes": 3})
    write_vit(tmp_path / "m.gguf", ViT(args), NORM, class_names=d.class_names)
    assert export_main(["--model", str(tmp_path / "m.gguf"), "--format", "safetensors",
                        "--out", str(tmp_path / "vit")]) == 0
    assert class_map.load_class_map(str(tmp_path / "vit" / "class_map.txt")) == {
        n: i for i, n in enumerate(d.class_names)}


def test_a_failed_export_leaves_nothing_it_wrote(tmp_path, capsys, monkeypatch):
    """A config.json that cannot be written (a full disk) takes model.safetensors along and the
    folders the export made (an existing folder keeps only what it held); a .safetensors file
    under new folders that fails leaves none of them. The error names the file."""
    import errno
    import os
    from pathlib import Path

    from toymlx.backend import atomic

    ckpt = tmp_path / "m.gguf"
    write_vit(ckpt, ViT(ARGS), NORM, class_names=NAMES)
    replace = os.replace

    def full_disk(src, dst):
        if Path(dst).name in ("config.json", "w.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", full_disk)
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "keep.txt").write_text("x")
    for out, failed in [(tmp_path / "new" / "vit", "config.json"),
                        (tmp_path / "there", "config.json"),
                        (tmp_path / "a" / "b" / "w.safetensors", "")]:
        capsys.readouterr()
        assert export_main(["--model", str(ckpt), "--format", "safetensors",
                            "--out", str(out)]) == 2
        # a file's own size against the room there (`bc95d86`), said for the .safetensors file
        room = r" \(the file takes [\d.]+ MiB; [\d.]+ MiB are free there\)" if not failed else ""
        assert re.fullmatch(rf"toymlx-export: error: \[Errno 28\] No space left on device{room}: "
                            rf"'{re.escape(str(out / failed if failed else out))}'\n",
                            capsys.readouterr().err)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "m.gguf", "there", "there/keep.txt"]


def test_export_layout_config_and_numpy_timm_forward(exported):
    model, out = exported
    sd, meta = read_safetensors(out / "model.safetensors")
    assert sd["patch_embed.proj.weight"].shape == (24, 3, 4, 4)
    assert sd["cls_token"].shape == (1, 1, 24) and sd["pos_embed"].shape == (1, 10, 24)
    assert sd["blocks.1.attn.qkv.weight"].shape == (72, 24) and sd["head.weight"].shape == (4, 24)
    assert len(sd) == 4 + 12 * 2 + 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == TIMM_ARCH and cfg["label_names"] == NAMES
    assert cfg["model_args"] == {"num_classes": 4, "img_size": 12, "patch_size": 4, "in_chans": 3,
                                 "embed_dim": 24, "depth": 2,
                                 "mlp_ratio": 40 / 24} == timm_model_args(ARGS)
    np.testing.assert_allclose(cfg["pretrained_cfg"]["mean"], NORM["toy.pixel_mean"], rtol=1e-7)
    np.testing.assert_allclose(cfg["pretrained_cfg"]["std"], NORM["toy.pixel_std"], rtol=1e-7)
    assert json.loads(meta["label_names"]) == NAMES
    x = np.random.default_rng(0).normal(size=(5, 12, 12, 3)).astype(np.float32)  # NHWC
    want = timm_forward(sd, x.transpose(0, 3, 1, 2).astype(np.float64), heads=3)
    got = np.asarray(model(mx.array(x)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_export_errors_are_one_line(tmp_path, capsys):
    assert export_main(["--format", "safetensors", "--out", str(tmp_path / "x")]) == 2
    assert "--format safetensors: expected --model" in capsys.readouterr().err
    assert export_main(["--model", str(tmp_path / "nope"), "--format", "safetensors",
                        "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and not (tmp_path / "x").exists()


def test_a_vit_given_as_the_gguf_base_names_the_timm_export(tmp_path, capsys):
    """`toymlx-export --base runs/<vit run> --out v.gguf` was "metadata key
    'general.architecture': expected one of llama, qwen2, ..., found 'vit'"."""
    from cli_errors import error_line

    ckpt = tmp_path / "m.gguf"
    write_vit(ckpt, ViT(ARGS), NORM, class_names=NAMES)
    assert export_main(["--base", str(ckpt), "--out", str(tmp_path / "v.gguf")]) == 2
    assert error_line(capsys, "toymlx-export") == (
        f"toymlx-export: error: {ckpt}: --base: expected a language model, found 'vit', an "
        "image classifier (its checkpoint is a GGUF already); for timm: toymlx-export --model "
        f"{ckpt} --format safetensors --out DIR")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_language_model_given_to_model_names_the_base_command(tmp_path, capsys):
    """`toymlx-export --model runs/lm --out lm.gguf` (a from-scratch run, as toymlx-generate and
    toymlx-eval take it) said only "llama GGUFs are exported with --base": now the command."""
    from cli_errors import error_line

    run = tmp_path / "lm"
    assert export_main(["--model", str(run), "--out", "lm.gguf", "--dtype", "q8_0"]) == 2
    assert error_line(capsys, "toymlx-export") == (
        "toymlx-export: error: --model: expected with --format safetensors (a ViT for timm), "
        "found --format gguf; a language model's run or GGUF is exported with --base "
        f"(toymlx-export --base {run} --out lm.gguf --dtype q8_0), and a run's checkpoints are "
        "GGUFs llama.cpp loads as they are")


@pytest.mark.bench
def test_timm_forward_equals_toymlx(exported):
    import timm  # the bench extra: torch, torchvision and timm
    import torch
    from safetensors.torch import load_file

    model, out = exported
    x = np.random.default_rng(1).normal(size=(6, 12, 12, 3)).astype(np.float32)
    want = np.asarray(model(mx.array(x)))
    xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    explicit = timm.create_model(TIMM_ARCH, **timm_model_args(ARGS)).eval()
    explicit.load_state_dict(load_file(out / "model.safetensors"))  # strict
    hub = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    with torch.no_grad():
        for m in (explicit, hub):
            got = m(xt).numpy()
            print(f"max |timm - toymlx| logit: {np.abs(got - want).max():.2e}")
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert hub.pretrained_cfg["label_names"] == NAMES
    np.testing.assert_allclose(hub.pretrained_cfg["mean"], NORM["toy.pixel_mean"], rtol=1e-7)


def test_the_timm_export_given_back_as_a_model_is_named_as_timm_s(exported, tmp_path, capsys):
    """toymlx-classify and toymlx-eval given the folder or the .safetensors that toymlx-export
    wrote for timm called it "a Hugging Face model folder (..., as mlx-lm's --model takes)" and
    the file "Hugging Face safetensors weights; llama.cpp's convert_hf_to_gguf.py makes a GGUF",
    which takes no ViT: it is named as timm's, with what toymlx reads instead."""
    from toymlx_cli.classify import main as classify_main
    from toymlx_cli.eval import main as eval_main

    _, out = exported
    folder = ("a timm model folder (config.json and model.safetensors, as toymlx-export "
              "--format safetensors writes from a run; toymlx reads the run, or a GGUF of its "
              "weights/)")
    weights = (": timm safetensors weights, as toymlx-export --format safetensors writes from "
               "a run; toymlx reads the run, or a GGUF of its weights/)")
    image = tmp_path / "a.png"
    image.write_bytes(b"")
    capsys.readouterr()
    assert classify_main(["--model", str(out), str(image)]) == 2
    assert capsys.readouterr().err == (f"toymlx-classify: error: {out}: expected a run bundle "
                                       f"with weights/latest, found {folder}\n")
    assert eval_main(["--model", str(out)]) == 2
    assert capsys.readouterr().err == (f"toymlx-eval: error: {out}: --model: expected a run "
                                       f"bundle folder, found {folder}\n")
    st = out / "model.safetensors"
    for main, prog, extra in ((classify_main, "toymlx-classify", [str(image)]),
                              (eval_main, "toymlx-eval", [])):
        assert main(["--model", str(st), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{prog}: error: {st}: magic: expected b'GGUF', found ") \
            and err.endswith(f"(not a GGUF file{weights}\n"), err
    # a transformers model folder is still Hugging Face's
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    assert eval_main(["--model", str(hf)]) == 2
    assert "found a Hugging Face model folder (config.json and model.safetensors, as mlx-lm's " \
        "--model takes" in capsys.readouterr().err
