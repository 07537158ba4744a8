"""The shared loop through the real from-scratch recipe: determinism, compile == eager,
exact resume, checkpoint round trip, and the run bundle's events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from toymlx_cli.train import main

from toymlx.bundle.checkpoint import list_checkpoints, resolve_latest
from toymlx.bundle.events import read_events
from toymlx.gguf.llama import load_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.runner.run import run_ops

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "2", "--no-progress"]


@pytest.fixture(scope="module")
def text_file(shared_file) -> str:
    return str(shared_file("text/tinyshakespeare.txt"))


def _run(tmp: Path, run_id: str, *extra: str, data: str) -> Path:
    args = ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root", str(tmp),
            "--run-id", run_id, *extra]
    assert main(args) == 0
    return tmp / run_id


def _losses(run: Path) -> list[float]:
    return [e["loss"] for e in read_events(run) if e["kind"] == "step"]


def _report_lines(out: str) -> dict[int, str]:
    """step -> its report line, up to the timing figures (steps/s and tokens/s vary)."""
    import re

    lines = {}
    for line in out.splitlines():
        if m := re.fullmatch(r"step (\d+)/\d+: (train loss \S+, lr \S+), \S+ steps/s, \S+ "
                             r"tokens/s, (\d+ tokens trained), .*", line):
            lines[int(m[1])] = f"{m[2]}, {m[3]}"
    return lines


def test_a_run_stopped_between_report_lines_resumes_with_the_same_lines(tmp_path, text_file,
                                                                        capsys):
    """A nanoGPT user stops a run at step 7 (SIGTERM, Ctrl-C) and compares the resumed run's
    lines with the run that never stopped: step 10's mean train loss is over steps 6-10 in both
    (before: over 8-10 alone, the steps this process trained, so the line differed)."""
    common = ["--steps", "10", "--report-every", "5", "--eval-every", "0", "--no-compile"]
    _run(tmp_path, "full", *common, data=text_file)
    full = _report_lines(capsys.readouterr().out)
    part = _run(tmp_path, "part", *common, "--stop-at", "7", data=text_file)
    first = _report_lines(capsys.readouterr().out)
    assert main(["--resume", str(part), "--no-progress"]) == 0
    resumed = _report_lines(capsys.readouterr().out)
    assert list(full) == [5, 10] and list(first) == [5] and list(resumed) == [10]
    assert resumed[10] == full[10]
    steps = {e["step"]: e for e in read_events(part) if e["kind"] == "step"}
    mean = sum(steps[s]["loss"] for s in range(6, 11)) / 5
    assert resumed[10] == (f"train loss {mean:.4f}, lr {steps[10]['lr']:.3e}, "
                           f"{steps[10]['trained_tokens']} tokens trained")
    assert steps[10]["trained_tokens"] == 10 * 4 * 32


@pytest.mark.parametrize("quiet_s", [0.0, 1e9])
def test_slow_steps_print_a_line_between_report_lines_where_no_bar_is_drawn(
        tmp_path, text_file, capsys, monkeypatch, quiet_s):
    """A Qwen3-1.7B user with 70-130 s steps and the output in a log file saw nothing for the
    first 10 steps (--report-every 10): a step that ends QUIET_LINE_S or more after the last
    line prints its own loss and time (here 0 s: every step; 1e9 s: none), and the report
    lines stay as they were."""
    from toymlx.training import trainer

    monkeypatch.setattr(trainer, "QUIET_LINE_S", quiet_s)
    run = _run(tmp_path, "r", "--steps", "7", "--report-every", "5", "--eval-every", "0",
               "--no-compile", data=text_file)
    out = capsys.readouterr().out
    losses = {e["step"]: e["loss"] for e in read_events(run) if e["kind"] == "step"}
    import re

    step_lines = {int(m[1]): (float(m[2]), int(m[3])) for m in re.finditer(
        r"^step (\d+)/7: loss (\S+), \S+ s this step \(the report line of the steps since "
        r"the last comes at step (\d+)\)$", out, re.MULTILINE)}
    if quiet_s:
        assert step_lines == {}
    else:  # steps 5 and 7 have their report lines
        assert sorted(step_lines) == [1, 2, 3, 4, 6]
        for step, (loss, due) in step_lines.items():
            assert loss == pytest.approx(losses[step], abs=5e-5)
            assert due == (5 if step < 5 else 7)
    assert sorted(_report_lines(out)) == [5, 7]


def test_same_seed_same_losses_and_compile_equals_eager(tmp_path, text_file):
    a = _losses(_run(tmp_path, "a", "--steps", "6", data=text_file))
    b = _losses(_run(tmp_path, "b", "--steps", "6", data=text_file))
    eager = _losses(_run(tmp_path, "c", "--steps", "6", "--no-compile", data=text_file))
    assert len(a) == 6
    assert a == b  # bit-identical on the same machine
    np.testing.assert_allclose(eager, a, rtol=1e-5, atol=1e-6)
    assert a[-1] < a[0]


def test_resume_is_exact(tmp_path, text_file):
    common = ["--steps", "8", "--checkpoint-every", "4", "--eval-every", "4"]
    full = _losses(_run(tmp_path, "full", *common, data=text_file))
    part = _run(tmp_path, "part", *common, "--stop-at", "4", data=text_file)
    assert resolve_latest(part).name == "step_4.gguf"
    assert main(["--resume", str(part), "--no-progress"]) == 0
    resumed = _losses(part)
    assert len(resumed) == 8
    np.testing.assert_allclose(resumed, full, rtol=0, atol=1e-6)
    # one run, as toy/v1 reads it: one run_start, each step once, the resume recorded
    kinds = [e["kind"] for e in read_events(part)]
    assert kinds.count("run_start") == 1 and kinds.count("run_end") == 1
    assert [e["step"] for e in read_events(part) if e["kind"] == "step"] == list(range(1, 9))
    (res,) = [e for e in read_events(part) if e["kind"] == "resume"]
    assert res["from_step"] == 4 and res["previous_end"] == "stopped"


def test_bundle_events_and_checkpoints(tmp_path, text_file):
    rid = 'odd "id" \\ ünï'
    run = _run(tmp_path, rid, "--steps", "5", "--checkpoint-every", "2", "--eval-every", "2",
               data=text_file)
    lines = (run / "events.jsonl").read_text(encoding="utf-8").splitlines()
    evs = [json.loads(x) for x in lines]
    kinds = [e["kind"] for e in evs]
    assert kinds[0] == "run_start" and kinds.count("run_start") == 1
    assert kinds[-1] == "run_end" and kinds.count("run_end") == 1
    start, end = evs[0], evs[-1]
    assert start["schema"] == "toy/v1" and start["run_id"] == rid and start["phase"] == "train"
    assert {"name", "os", "arch"} <= start["host"].keys()
    assert start["backend"]["kind"] in ("cpu", "metal", "cuda")
    assert start["model"]["arch"] == "llama" and start["model"]["d_model"] == 32
    assert start["config"]["steps"] == 5 and start["config"]["context"] == 32
    steps = [e for e in evs if e["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all({"loss", "lr", "t", "tokens_per_s"} <= s.keys() for s in steps)
    assert [e["step"] for e in evs if e["kind"] == "eval"] == [2, 4, 5]
    assert [e["step"] for e in evs if e["kind"] == "checkpoint"] == [2, 4, 5]
    assert end["reason"] == "completed" and end["final_step"] == 5 and end["exit_code"] == 0
    assert end["final_loss"] == steps[-1]["loss"]
    assert [s for s, _ in list_checkpoints(run / "weights")] == [2, 4, 5]
    latest = run / "weights" / "latest"
    assert latest.is_symlink() and not Path(latest.readlink()).is_absolute()
    assert resolve_latest(run).name == "step_5.gguf"
    g = GGUFFile(resolve_latest(run))
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["general.step"] == 5 and g.metadata["general.run_id"] == rid
    assert g.metadata["toy.checkpoint_format"] == "toy/gguf-v1"
    assert "output.weight" not in g.tensors  # tied
    assert g.metadata["toy.n_params_written"] == sum(t.n_elements for t in g.tensors.values())
    assert g.metadata["tokenizer.ggml.model"] == "llama"


def test_checkpoint_round_trip_identical_logits(tmp_path, text_file):
    from toymlx.recipes import from_scratch
    from toymlx.training.trainer import train

    for tie in (True, False):
        cfg = from_scratch.Config(steps=3, batch_size=4, seq_len=32, progress=False,
                                  eval_batches=1)
        cfg.model.d_model, cfg.model.n_layers, cfg.model.ffn_dim = 32, 2, 64
        cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.tie_embeddings = 4, 2, tie
        cfg.data.path = text_file
        task = from_scratch.build(cfg, run_ops(cfg))
        run = tmp_path / f"rt{tie}"
        train(task, cfg, run, {})
        loaded, g = load_llama(resolve_latest(run), task.model.ops)  # the same math
        assert ("output.weight" in g.tensors) == (not tie)
        x = mx.array([[1, 5, 9, 200, 17, 3, 88]])
        assert mx.array_equal(loaded(x), task.model(x)).item()


def test_cpu_streams_split_equals_one_stream_and_records_it(tmp_path, text_file):
    """Slices of the batch on 2 CPU streams = gradient accumulation of the slices: the same
    losses as one stream (to float32 summation order); run_start says what ran."""
    one = _run(tmp_path, "one", "--steps", "5", "--cpu-streams", "1", data=text_file)
    two = _run(tmp_path, "two", "--steps", "5", "--cpu-streams", "2", data=text_file)
    np.testing.assert_allclose(_losses(two), _losses(one), rtol=1e-5, atol=1e-6)
    assert _losses(two) != _losses(one)  # really another summation order
    start = read_events(two)[0]
    assert start["step_parallelism"]["cpu_streams"] == 2
    assert read_events(one)[0]["step_parallelism"]["cpu_streams"] == 1
    if start["backend"].get("blas") in ("openblas", "mkl"):  # threads shared out between the streams
        assert start["step_parallelism"]["blas_threads"] == max(
            1, start["backend"]["blas_threads"] // 2)


def test_dropout_draws_a_new_mask_each_step_on_every_stream():
    """The per-stream compiled steps thread MLX's random state: with dropout the compiled
    2-stream step matches the eager one step after step (a baked-in key would repeat step 1's
    mask and drift from the eager losses)."""
    from mlx import nn

    from toymlx.training.cpu_streams import make_stream_step, new_streams
    from toymlx.training.task import TrainConfig, make_optimizer
    from toymlx.training.trainer import step_seed

    def run(compile: bool) -> list[float]:
        mx.random.seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4))
        mx.eval(model.parameters())

        def loss_fn(m, b):
            return nn.losses.cross_entropy(m(b["x"]), b["y"], reduction="mean"), mx.array(
                b["y"].size)

        cfg = TrainConfig(steps=4, batch_size=8, lr=1e-2, warmup=1)
        opt = make_optimizer(cfg)
        opt.init(model.trainable_parameters())
        step = make_stream_step(model, loss_fn, opt, new_streams(2, "keep"), compile=compile)
        rng = np.random.default_rng(1)
        batch = {"x": mx.array(rng.standard_normal((1, 8, 16)).astype(np.float32)),
                 "y": mx.array(rng.integers(0, 4, (1, 8)).astype(np.int32))}
        out = []
        for s in range(4):
            mx.random.seed(step_seed(0, s))
            res = step(batch)
            mx.eval(res, model.state, opt.state)
            out.append(float(res["loss"].item()))
        return out

    compiled, eager = run(True), run(False)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
    assert len(set(compiled)) == 4


def test_evaluate_runs_in_eval_mode_and_restores_training_mode():
    """With dropout 0.5, evaluation is deterministic (any random seed) and equals a float64
    forward without dropout, while training-mode forwards still drop; the mode is restored."""
    from mlx import nn

    from toymlx.training.evaluate import evaluate
    from toymlx.training.task import Task

    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3))
    mx.eval(model.parameters())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 16, 6)).astype(np.float32)  # (accum, B, in)
    y = rng.integers(0, 3, (1, 16)).astype(np.int32)

    def loss_fn(m, b):
        return nn.losses.cross_entropy(m(b["x"]), b["y"], reduction="mean"), mx.array(b["y"].size)

    task = Task(recipe="t", model=model, loss_fn=loss_fn, train_batch=None,
                        val_batches=[{"x": x, "y": y}], save=None, load=None, model_info={})
    got = []
    for seed in (1, 2, 3):
        mx.random.seed(seed)
        got.append(evaluate(task)["val_loss"])
        assert model.training  # back in training mode
    w = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(model.parameters())}
    h = x[0].astype(np.float64) @ w["layers.0.weight"].T + w["layers.0.bias"]
    logits = h @ w["layers.2.weight"].T + w["layers.2.bias"]
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    want = -logp[np.arange(16), y[0]].mean()
    assert got[0] == got[1] == got[2]
    np.testing.assert_allclose(got[0], want, rtol=1e-5)
    train_losses = []
    for seed in (1, 2):
        mx.random.seed(seed)
        train_losses.append(float(loss_fn(model, {"x": mx.array(x[0]), "y": mx.array(y[0])})[0]))
    assert train_losses[0] != train_losses[1]  # training still drops, differently per seed
    assert all(abs(t - want) > 1e-4 for t in train_losses)
    model.eval()
    evaluate(task)
    assert not model.training  # a model evaluated in eval mode stays there


def text_folder(path: Path, shared_file) -> tuple[Path, list[str]]:
    """An mlx-lm data folder of {"text"} records: the lines of the TinyStories sample, the
    last three in test.jsonl and three before them in valid.jsonl; returns the test lines."""
    lines = [x for x in shared_file("text/tinystories_sample.txt").read_text()
             .splitlines() if x.strip()]
    path.mkdir(parents=True)
    for name, part in (("train", lines[:-6]), ("valid", lines[-6:-3]), ("test", lines[-3:])):
        (path / f"{name}.jsonl").write_text("".join(json.dumps({"text": x}) + "\n"
                                                    for x in part))
    return path, lines[-3:]


def test_test_scores_the_data_folders_test_jsonl_as_eval_does(tmp_path, shared_file, capsys):
    from cli_errors import error_line
    from toymlx_cli.eval import main as eval_main

    from toymlx.data.text import val_batches
    from toymlx.data.tokenizer import byte_tokenizer

    data, test_lines = text_folder(tmp_path / "data", shared_file)
    run = _run(tmp_path, "t", "--steps", "2", "--no-compile", "--test", data=str(data))
    events = read_events(run)
    start = events[0]
    ids = byte_tokenizer().encode("\n\n".join(test_lines))  # the records joined as paragraphs
    assert start["config"]["test_source"] == str(data / "test.jsonl")
    assert start["config"]["test_tokens"] == len(ids)
    assert start["config"]["data_source"] == f"{data / 'train.jsonl'} + {data / 'valid.jsonl'}"
    assert [(e["kind"], e.get("split")) for e in events[-3:]] == [
        ("checkpoint", None), ("eval", "test"), ("run_end", None)]
    test = events[-2]
    assert test["test_perplexity"] == pytest.approx(np.exp(test["test_loss"]), rel=1e-12)
    # by hand: the checkpoint's float64 cross-entropy over every 32-token window of test.jsonl
    model, _ = load_llama(resolve_latest(run))
    windows = val_batches(np.array(ids), 4, 32, 10**9)
    nll, n = 0.0, 0.0
    for b in windows:
        logits = np.array(model(mx.array(b["inputs"][0])), dtype=np.float64)  # (B, T, V)
        top = logits.max(-1, keepdims=True)
        logp = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
        picked = np.take_along_axis(logp, b["targets"][0][..., None], -1)[..., 0]  # (B, T)
        nll -= (picked * b["mask"][0]).sum()
        n += b["mask"][0].sum()
    assert n == 32 * ((len(ids) - 1) // 32)  # every whole window, none twice
    assert test["test_loss"] == pytest.approx(nll / n, abs=2e-5)
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--split", "test"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"] == str(data / "test.jsonl")
    assert out["test_loss"] == pytest.approx(test["test_loss"], abs=1e-5)
    # a single text file, or the default corpus, has no test split: nothing is split off
    single = str(shared_file("text/tinystories_sample.txt"))
    give = "give a folder with train.jsonl and test.jsonl, mlx-lm's layout"
    for path, found in ((["--data.path", single], (f"{single}, a single file with no test split "
                                                  f"({give})")),
                        ([], f"no --data.path (the default data has no test split: {give})")):
        assert main(["--recipe", "from-scratch", *TINY, "--runs-root", str(tmp_path),
                     "--run-id", "none", "--test", *path]) == 2
        assert error_line(capsys) == ("toymlx-train: error: --test: expected --data.path to be a "
                                      f"data folder with test.jsonl, found {found}")
    assert not (tmp_path / "none").exists()


def test_the_gradient_norm_is_the_left_to_right_float32_sum_with_no_chain_of_adds(tmp_path):
    """The update's gradient norm on the CPU: sqrt of the per-parameter sums of squares (each one
    product of the gradient with itself) added left to right in float32 (bit for bit, as
    `sum()` over them adds), divided by the count; against float64; and, for any parameter
    count, no chain of adds in its graph: `mx.compile` fused such a chain into kernels named
    after how many adds each held, new CPU kernels for every layer count."""
    import re

    import mlx.optimizers as optim
    from mlx import nn
    from mlx.utils import tree_map

    from toymlx.training.step import make_update, sum_of_squares

    rng = np.random.default_rng(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(13)])  # 26 parameters
    mx.eval(model.parameters())
    grads = tree_map(lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32)
                                        * 10.0 ** rng.uniform(-4, 2)), model.parameters())
    mx.eval(grads)
    count = 4.0  # the parts hold gradients times the count: the norm is the mean's
    out = make_update(model, optim.SGD(learning_rate=0.0), grad_clip=0.0)(
        [(mx.array(3.0), mx.array(count), grads)])
    dot = tmp_path / "norm.dot"
    mx.export_to_dot(str(dot), out["grad_norm"])  # before evaluating it (then it has no graph)
    assert "Add" not in re.findall(r'label ="([^"]+)", shape=rectangle', dot.read_text())
    total = np.float32(0)
    for q in [np.array(sum_of_squares(g)).item() for _, g in tree_flatten(grads)]:
        total = np.float32(total + np.float32(q))  # left to right, as sum() adds
    assert np.array(out["grad_norm"]) == np.sqrt(total) / np.float32(count)
    squares = [(np.array(g, np.float64) ** 2).sum() for _, g in tree_flatten(grads)]
    assert np.isclose(np.array(out["grad_norm"]), np.sqrt(np.sum(squares)) / count, rtol=1e-5)


@pytest.mark.parametrize("cpu", [True, False])
def test_sum_of_squares_is_a_dot_on_the_cpu_and_a_reduction_on_a_gpu(tmp_path, cpu):
    """A gradient's sum of squares in float32 against float64 numpy's, from float32 and
    bfloat16 gradients up to 2^16 values (the GPU's form runs here on the CPU, whose reduction
    adds in order: at 2^16 values 1.2e-5 off, hence its wider margin; a GPU's adds as a tree).
    On the CPU one product (BLAS's dot); for a GPU MLX's reduction and no product (MLX's GPU
    matmul gives a (1, n) x (n, 1) product one warp or threadgroup: a from-scratch 360M step
    took 158 ms on an H200 against 90 ms without it)."""
    import re

    from toymlx.training.step import sum_of_squares

    rng = np.random.default_rng(7)
    for shape in [(3,), (64, 48), (256, 256)]:
        for dtype in (mx.float32, mx.bfloat16):
            g = mx.array(rng.standard_normal(shape).astype(np.float32) * 1e-3).astype(dtype)
            q = sum_of_squares(g, cpu=cpu)
            assert q.shape == (1, 1) and q.dtype == mx.float32
            want = (np.array(g.astype(mx.float32), np.float64) ** 2).sum()
            rtol = 1e-5 if cpu else 1e-4
            assert np.isclose(np.array(q).item(), want, rtol=rtol), (shape, dtype)
    dot = tmp_path / "squares.dot"
    mx.export_to_dot(str(dot), sum_of_squares(mx.ones((256, 8)), cpu=cpu))
    labels = set(re.findall(r'label ="([^"]+)"', dot.read_text()))
    assert ("Matmul" in labels) == cpu and ("Sum" in labels) != cpu


def test_the_update_reads_each_gradient_in_one_product_and_one_fused_update(tmp_path):
    """Each parameter's gradient feeds two nodes of the update's graph: the product that sums
    its squares and AdamW's fused kernel, which applies the mean and the clip as one factor;
    dividing, squaring, summing and clipping were 4 more GPU kernels a parameter (ViT-Tiny
    224: ~800 of a step's ~2,200). The clipped AdamW step agrees with float64 numpy's."""
    import re

    import mlx.optimizers as optim
    from mlx import nn
    from mlx.utils import tree_map

    from toymlx.training.step import make_update

    rng = np.random.default_rng(1)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)])  # 10 parameters
    mx.eval(model.parameters())
    before = [np.array(p, np.float64) for _, p in tree_flatten(model.parameters())]
    grads = tree_map(lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32)),
                     model.parameters())
    mx.eval(grads)
    opt = optim.AdamW(learning_rate=1e-2, weight_decay=0.1)
    opt.init(model.trainable_parameters())
    count, clip = 3.0, 0.5
    update = mx.compile(make_update(model, opt, grad_clip=clip),
                        inputs=[model.state, opt.state], outputs=[model.state, opt.state])
    out = update([(mx.array(1.0), mx.array(count), grads)])
    dot = tmp_path / "update.dot"
    mx.export_to_dot(str(dot), *[p for _, p in tree_flatten(model.parameters())])
    text = dot.read_text()
    labels = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', text))
    edges = re.findall(r'"?(\w+)"? -> "?(\w+)"?', text)
    fused = [n for n, label in labels.items() if label.startswith("Compiled")
             and "Sqrt" in label]
    assert len(fused) == 10  # one AdamW kernel a parameter, the clip inside it
    assert not any(label in ("Divide", "Multiply", "Square", "Sum") for label in labels.values())
    assert sum(1 for a, b in edges if labels.get(b) == "Matmul") == 20  # g (1, n) @ g (n, 1)
    mx.eval(out, model.parameters())
    g64 = [np.array(g, np.float64) / count for _, g in tree_flatten(grads)]
    norm = np.sqrt(sum((g ** 2).sum() for g in g64))
    assert np.isclose(out["grad_norm"].item(), norm, rtol=1e-6)
    factor = min(clip / (norm + 1e-6), 1.0)
    for (_, p), p0, g in zip(tree_flatten(model.parameters()), before, g64):
        g = g * factor
        m, v = 0.1 * g, 0.001 * g * g  # AdamW's first step from zero moments, no bias fix
        want = p0 * (1 - 1e-2 * 0.1) - 1e-2 * m / (np.sqrt(v) + 1e-8)
        np.testing.assert_allclose(np.array(p, np.float64), want, rtol=2e-5, atol=1e-7)


def test_a_micro_batch_is_a_view_of_the_batch_not_a_gather():
    """`micro_batch` takes micro-batch i as a slice (a view), not as MLX's `v[i]`, a gather that
    copied ViT-Tiny 224's 128 images in 4 ms of GPU time on an H200: the same values, and the
    graph holds a Slice and no Gather."""
    import io

    from toymlx.training.step import micro_batch

    images = mx.arange(3 * 2 * 5 * 4, dtype=mx.float32).reshape(3, 2, 5, 4)
    batch = {"images": images, "labels": mx.array([[1, 2], [3, 4], [5, 6]])}
    for i in range(3):
        part = micro_batch(batch, i)
        assert part["images"].shape == (2, 5, 4)
        np.testing.assert_array_equal(np.array(part["images"]), np.array(images)[i])
        np.testing.assert_array_equal(np.array(part["labels"]), [2 * i + 1, 2 * i + 2])
    dot = io.StringIO()
    mx.export_to_dot(dot, micro_batch(batch, 1)["images"] * 2)
    assert "Slice" in dot.getvalue() and "Gather" not in dot.getvalue()
    dot = io.StringIO()
    mx.export_to_dot(dot, images[1] * 2)  # what the step did before
    assert "Gather" in dot.getvalue()


def test_a_cold_cuda_kernel_cache_is_announced_before_the_first_step(tmp_path, text_file,
                                                                    monkeypatch, capsys):
    """Where MLX's CUDA kernel cache holds no PTX (a fresh machine: the first steps took 75-120 s
    on an H200), one line says so before step 1; with the cache filled, nothing. Off CUDA the
    cache is None (this CPU run) and nothing is said."""
    from toymlx.backend import device

    assert device.cuda_kernel_cache() is None  # MLX's CPU here
    cache = tmp_path / "ptx"
    monkeypatch.setattr(device, "cuda_kernel_cache", lambda: cache)
    _run(tmp_path, "cold", "--steps", "2", "--eval-every", "0", data=text_file)
    said = capsys.readouterr().out
    assert f"step 1: MLX builds its CUDA kernels first, up to 2.5 minutes on a fresh machine " \
           f"(kept in {cache} for later runs)" in said
    cache.mkdir()
    (cache / "kernel.ptx").write_text("//")
    _run(tmp_path, "warm", "--steps", "2", "--eval-every", "0", data=text_file)
    assert "CUDA kernels" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_stop_while_a_large_model_s_init_is_evaluated_acts_at_once(tmp_path):
    """`Stepper.build` evaluates the random init an array at a time (`eval_each`): a SIGTERM 2 s
    after the run folder is made, while a 0.3B-parameter model's init is evaluated, ends
    toymlx-train within seconds with its one line, the new run's folder removed (one `mx.eval` of
    it all held it ~36-52 s on 2 CPU cores)."""
    import signal
    import subprocess
    import time

    exe = Path(sys.executable).parent / "toymlx-train"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    p = subprocess.Popen(cmd + ["--recipe", "from-scratch", "--model.d-model", "2048",
                                "--model.n-layers", "5", "--model.n-heads", "16",
                                "--model.ffn-dim", "8192", "--steps", "1", "--batch-size", "1",
                                "--seq-len", "64", "--runs-root", str(tmp_path), "--run-id", "r"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "r" / "config.json").exists() and p.poll() is None:
            assert time.monotonic() < deadline, "no run folder after 120 s"
            time.sleep(0.05)
        time.sleep(2.0)  # the build is quick: the init's evaluation has begun
        assert p.poll() is None
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143
    assert err.strip().splitlines()[-1] == ("toymlx-train: stopped by SIGTERM before the first "
                                            "step; nothing was trained")
    assert not (tmp_path / "r").exists()  # a new run's folder goes, as before the loop's set-up
    assert took < 10, took


@pytest.mark.parametrize("argv, want", [
    (["--recipe", "from-scratch", "--model.d-model", "30"],
     "--model.d-model: expected a multiple of --model.n-heads (8, the preset's), found 30"),
    (["--recipe", "from-scratch", "--model.n-heads", "5"],
     "--model.n-heads: expected a divisor of --model.d-model (256, the preset's), found 5"),
    (["--recipe", "from-scratch", "--model.n-kv-heads", "3"],
     "--model.n-kv-heads: expected a divisor of --model.n-heads (8, the preset's), found 3"),
    (["--recipe", "from-scratch", "--model.n-heads", "2"],
     "--model.n-heads: expected a multiple of --model.n-kv-heads (4, the preset's), found 2"),
    # nanoGPT's shakespeare_char shape: n_head 6 is --model.n-heads 6, but the tiny preset's
    # 8 query heads share 4 key/value heads; the line said "(4)" of a flag never typed
    (["--recipe", "from-scratch", "--model.n-heads", "6", "--model.d-model", "384"],
     "--model.n-heads: expected a multiple of --model.n-kv-heads (4, the preset's), found 6"),
    (["--recipe", "from-scratch", "--model.d-model", "24", "--model.n-heads", "8"],
     ("--model.d-model: expected a multiple of 2 x --model.n-heads (8) (an even width per head "
     "for RoPE), found 24")),
    (["--recipe", "from-scratch", "--model.n-heads", "256"],
     ("--model.n-heads: expected a divisor of --model.d-model (256, the preset's) leaving an "
      "even width per "
     "head for RoPE, found 256")),
    (["--recipe", "from-scratch", "--model.n-layers", "0"],
     "--model.n-layers: expected > 0, found 0"),
    (["--recipe", "warm-start", "--model.ffn-dim", "0"], "--model.ffn-dim: expected > 0, found 0"),
    (["--recipe", "from-scratch", "--model.rope-base", "-1"],
     "--model.rope-base: expected > 0, found -1.0"),
    (["--recipe", "vit-tiny", "--model.n-heads", "5"],
     "--model.n-heads: expected a divisor of --model.d-model (192, the preset's), found 5"),
    (["--recipe", "vit-tiny", "--model.d-model", "100"],
     "--model.d-model: expected a multiple of --model.n-heads (3, the preset's), found 100"),
    (["--recipe", "vit-tiny", "--model.patch-size", "3"],
     "--model.patch-size: expected a divisor of --data.image-size (8), found 3"),
    (["--recipe", "vit-tiny", "--model.preset", "vit-tiny-8", "--data.image-size", "9"],
     "--data.image-size: expected a multiple of --model.patch-size (2, the preset's), found 9"),
    (["--recipe", "vit-tiny", "--model.n-layers", "0"],
     "--model.n-layers: expected > 0, found 0"),
])
def test_a_model_shape_it_cannot_build_names_the_flags_given(tmp_path, capsys, argv, want):
    """`--recipe vit-tiny --model.n-heads 5` was refused as `--model: model.d_model: expected a
    multiple of n_heads=5, found 192`: the field, not the flag, and not the one typed."""
    from cli_errors import error_line

    assert main([*argv, "--steps", "1", "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not (tmp_path / "runs").exists()


def test_a_config_files_model_shape_is_named_by_its_key_spelled_as_the_flag(tmp_path, capsys):
    """A -c file's keys are spelled as the flags, and a later check names the file and its key
    (the flag it checks against as a flag)."""
    from cli_errors import error_line

    (tmp_path / "c.yaml").write_text("recipe: from-scratch\nmodel: {n_kv_heads: 3}\n")
    assert main(["-c", str(tmp_path / "c.yaml"), "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {tmp_path / 'c.yaml'}: key 'model: "
                                  "{n_kv_heads}': expected a divisor of --model.n-heads (8, the "
                                  "preset's), "
                                  "found 3")


def test_eval_batches_minus_one_validates_every_window(tmp_path, text_file, capsys):
    """--eval-batches -1 is every validation batch (toymlx-eval's -1, mlx-lm's --val-batches
    -1, which an mlx-lm config now maps to it rather than to 2147483647); it was refused (">=
    1"). Its val loss is that of a count past the split's windows, not the first batch's;
    config.json records -1; -2 is refused naming both spellings."""
    data = tmp_path / "small.txt"
    data.write_text(Path(text_file).read_text()[:20_000])
    common = ["--steps", "1", "--eval-every", "1", "--no-compile", "--data.path", str(data)]

    def val_loss(run_id: str, batches: str) -> float:
        run = _run(tmp_path, run_id, *common, "--eval-batches", batches, data=str(data))
        return [e["val_loss"] for e in read_events(run) if e["kind"] == "eval"][-1]

    every = val_loss("every", "-1")
    assert every == val_loss("many", "100000")
    assert every != val_loss("first", "1")
    saved = json.loads((tmp_path / "every" / "config.json").read_text())
    assert saved["config"]["eval_batches"] == -1
    capsys.readouterr()
    assert main(["--recipe", "from-scratch", *TINY, *common, "--eval-batches", "-2",
                 "--runs-root", str(tmp_path), "--run-id", "bad"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "toymlx-train: error: --eval-batches: expected >= 1, or -1 (every validation batch), "
        "found -2")
