"""The vit-tiny recipe end to end on a small body: events, checkpoint round trip, eager==compiled."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from toymlx_cli.train import main

from toymlx.checkpoint import resolve_latest
from toymlx.events import read_events
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.vit import load_vit

SMALL = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "2",
         "--model.mlp-dim", "64", "--batch-size", "16", "--no-progress", "--warmup", "2"]


def _run(tmp, rid, *extra):
    assert main(["--recipe", "vit-tiny", *SMALL, "--runs-root", str(tmp), "--run-id", rid,
                 *extra]) == 0
    return tmp / rid


def test_vit_run_events_and_checkpoint(tmp_path):
    run = _run(tmp_path, "v", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3")
    evs = read_events(run)
    start = evs[0]
    assert start["event"] == "run_start" and evs[-1]["event"] == "run_end"
    m = start["model"]
    assert m["arch"] == "vit" and m["image_size"] == 8 and m["patch_size"] == 2
    assert (m["channels"], m["d_model"], m["n_layers"], m["n_heads"], m["num_classes"]) == (
        1, 32, 2, 2, 10)
    c = start["config"]
    assert c["steps"] == 6 and c["batch_size"] == 16 and "lr" in c and "seed" in c
    assert "context" not in c
    ev = [e for e in evs if e["event"] == "eval"]
    assert [e["step"] for e in ev] == [3, 6]
    assert all(0.0 <= e["accuracy"] <= 1.0 and e["val_loss"] > 0 for e in ev)
    assert all("images_per_s" in e for e in evs if e["event"] == "step")

    g = GGUFFile(resolve_latest(run))
    assert g.metadata["general.architecture"] == "vit"
    for k, v in {"vit.image_size": 8, "vit.patch_size": 2, "vit.channels": 1,
                 "vit.embedding_length": 32, "vit.block_count": 2,
                 "vit.attention.head_count": 2, "vit.feed_forward_length": 64,
                 "vit.class_count": 10}.items():
        assert g.metadata[k] == v, k
    assert abs(g.metadata["vit.attention.layer_norm_epsilon"] - 1e-6) < 1e-12


def test_vit_round_trip_and_eager_equals_compiled(tmp_path):
    from toymlx.recipes import vit_tiny
    from toymlx.trainer import train

    def cfg(compile_):
        c = vit_tiny.Config(steps=4, batch_size=16, warmup=2, progress=False, eval_every=0,
                            compile=compile_)
        c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.mlp_dim = 32, 2, 2, 64
        return c

    task = vit_tiny.build(cfg(True))
    train(task, cfg(True), tmp_path / "a", {})
    loaded, norm, _ = load_vit(resolve_latest(tmp_path / "a"))
    x = mx.array(np.random.default_rng(0).normal(size=(5, 8, 8, 1)).astype(np.float32))
    assert mx.array_equal(loaded(x), task.model(x)).item()
    assert len(norm["toy.pixel_mean"]) == 1 and norm["toy.pixel_scale"] == 16.0

    eager_task = vit_tiny.build(cfg(False))
    train(eager_task, cfg(False), tmp_path / "b", {})
    la = [e["loss"] for e in read_events(tmp_path / "a") if e["event"] == "step"]
    lb = [e["loss"] for e in read_events(tmp_path / "b") if e["event"] == "step"]
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)
