"""The benchmark (`benchmarks/bench.py`): its GPU mode's every code path on the CPU at tiny
shapes, the figures' arithmetic, and the flags it refuses.

The GPU suite runs here in a subprocess as a user runs it (`--device cpu --shapes tiny`), on
two of its four roles (a ViT and a LoRA Llama, each in float32 and bfloat16, with mlx-lm and
PyTorch eager and compiled beside toymlx). `torch.compile` runs with its "eager" backend:
Dynamo traces the same function inductor would compile, in seconds instead of minutes.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from toymlx.backend.device import backend_info

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def tiny_gpu_suite(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--shapes", "tiny",
           "--only", "tiny-vit", "tiny-lora-q", "--rounds", "3", "--warmup", "0",
           "--compile-backend", "eager", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(out.read_text())
    info["stdout"] = p.stdout
    return info


def hand_flops(shape: dict) -> float:
    """Training FLOPs counted matmul by matmul: forward 2*in*out per item for every linear
    (the patch embedding on every token, the 6N rule's convention), attention's scores and
    values dense; a step is forward + input gradients + weight gradients = 3 forwards, or 2
    for a frozen LoRA base whose adapters take all 3."""
    m, B = shape["model"], shape["batch"]
    if shape["kind"] == "vit":
        d, T = m["d_model"], 1 + (m["image_size"] // m["patch_size"]) ** 2
        hd = d // m["n_heads"]
        linears = [(m["patch_size"] ** 2 * m["channels"], d)] + m["n_layers"] * (
            4 * [(d, d)] + [(d, m["ffn_dim"]), (m["ffn_dim"], d)])
        fwd = sum(2 * i * o for i, o in linears) * B * T
        fwd += m["n_layers"] * m["n_heads"] * 2 * (2 * T * T * hd) * B
        fwd += 2 * d * m["num_classes"] * B  # the head, on the cls token only
        return 3 * fwd
    d, T, L, f = m["d_model"], shape["seq"], m["n_layers"], m["ffn_dim"]
    hd = m["key_length"] or d // m["n_heads"]
    q, kv = m["n_heads"] * hd, m["n_kv_heads"] * hd
    base = L * [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)] + [(d, m["vocab_size"])]
    base_fwd = sum(2 * i * o for i, o in base) * B * T
    attn_fwd = L * m["n_heads"] * 2 * (2 * T * T * hd) * B
    assert shape["lora_targets"] == ["q"]
    r = shape["lora_rank"]
    lora_fwd = L * (2 * d * r + 2 * r * q) * B * T
    return 2 * base_fwd + 3 * attn_fwd + 3 * lora_fwd if r else 3 * (base_fwd + attn_fwd)


@pytest.mark.bench
def test_tiny_gpu_suite_rows_and_step0_agreement(tiny_gpu_suite):
    info = tiny_gpu_suite
    assert info["suite"] == "gpu" and info["backend"]["kind"] == "cpu"
    groups = {(g["workload"], g["dtype"]): g for g in info["workloads"]}
    assert set(groups) == {(w, d) for w in ("tiny-vit", "tiny-lora-q")
                           for d in ("float32", "bfloat16")}
    for (w, dtype), g in groups.items():
        want = ["toymlx"] + (["mlx-lm"] if "lora" in w else []) + ["torch", "torch-compile"]
        assert list(g["rows"]) == want, (w, dtype)
        losses = [r["loss0"] for r in g["rows"].values()]
        assert g["loss0_spread"] == pytest.approx(max(losses) - min(losses))
        f32 = groups[(w, "float32")]["rows"]["torch"]["loss0"]
        if dtype == "float32":  # the same function of the same weights, in every implementation
            assert g["loss0_spread"] < 2e-5 * f32, (w, losses)
            norms = [r["grad_norm0"] for r in g["rows"].values() if r["grad_norm0"] is not None]
            assert max(norms) - min(norms) < 1e-3 * max(norms), (w, norms)
        else:  # bf16 rounding moves each implementation, none by a bf16 step (2**-8) or more
            assert all(abs(x - f32) < 2 ** -8 * f32 for x in losses), (w, losses, f32)
        assert all(name in info["stdout"] for name in g["rows"])


@pytest.mark.bench
def test_tiny_gpu_suite_figures_arithmetic(tiny_gpu_suite):
    info = tiny_gpu_suite
    assert set(info["matmul"]) == {"float32", "bfloat16"}
    for m in info["matmul"].values():
        assert m["n"] == 256 and set(m) >= {"mlx", "torch"}
        for k in ("mlx", "torch"):
            assert m[k]["tflops"] == pytest.approx(2 * 256 ** 3 / m[k]["seconds"] / 1e12)
        assert m["peak_tflops"] == max(m["mlx"]["tflops"], m["torch"]["tflops"])
    for g in info["workloads"]:
        assert g["flops_per_step"] == hand_flops(g["shape"]), g["workload"]
        peak = info["matmul"][g["dtype"]]["peak_tflops"]
        assert g["peak_tflops"] == peak
        for name, r in g["rows"].items():
            assert len(r["times_s"]) == g["rounds"] == 3
            assert r["median_s"] == statistics.median(r["times_s"])
            tflops = g["flops_per_step"] / r["median_s"] / 1e12
            assert r["tflops"] == pytest.approx(tflops, rel=1e-12)
            assert r["mfu"] == pytest.approx(tflops / peak, rel=1e-12)
            assert r["items_per_s"] == pytest.approx(g["items_per_step"] / r["median_s"])
            if name.startswith("torch"):  # PyTorch's CPU allocations are not counted
                assert r["peak_mb"] is None
            else:  # its weights and optimizer state, plus the step's own allocations
                assert r["peak_mb"] > r["resident_mb"] > 0, (g["workload"], name)
        # each round steps every row once, so times_s[i] of two rows share round i
        toymlx = g["rows"]["toymlx"]["times_s"]
        for other, ratio in g["ratio_toymlx_over"].items():
            theirs = g["rows"][other]["times_s"]
            assert ratio == pytest.approx(statistics.median(
                [a / b for a, b in zip(toymlx, theirs)]))


@pytest.mark.bench
def test_a_failing_workload_is_reported_and_the_rest_still_run(tmp_path):
    """A row that cannot be built (here an unknown torch.compile backend) fails its workload
    only: the table says so, the exit code is 1, and the JSON keeps the others' figures."""
    out = tmp_path / "fail.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--shapes", "tiny", "--dtype",
           "float32", "--only", "tiny-vit", "tiny-lora-q", "--rounds", "1", "--warmup", "0",
           "--impl", "toymlx", "torch-compile", "--compile-backend", "no-such-backend",
           "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600, cwd=REPO)
    assert p.returncode == 1, p.stderr[-3000:]
    groups = json.loads(out.read_text())["workloads"]
    assert [g["workload"] for g in groups] == ["tiny-vit", "tiny-lora-q"]
    assert all("no-such-backend" in g["error"] for g in groups), groups
    assert p.stdout.count("FAILED:") == 2


def _benchmark_module(monkeypatch, name: str):
    """benchmarks/<name>.py as a module (its siblings import by their plain names)."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    return importlib.import_module(name)


@pytest.fixture
def bench(monkeypatch):
    return _benchmark_module(monkeypatch, "bench")


@pytest.mark.parametrize("flags,message", [
    (["--dtype", "bfloat16"], "--dtype: the CPU suite trains in float32"),
    (["--shapes", "tiny", "--dp", "2"], "--dp: only the CPU suite has these"),
    (["--shapes", "tiny", "--impl", "torch1t"], "--impl: expected some of toymlx, mlx-lm"),
    (["--only", "nope"], "--only: expected some of llama-4x256"),
])
def test_flags_that_do_not_fit_fail_in_one_line(bench, capsys, flags, message):
    assert bench.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bench: {message}") and err.count("\n") == 1, err


def _option_help(monkeypatch, capsys, name: str) -> dict[str, str]:
    """The help text of each option benchmarks/<name>.py --help lists, by its flags."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line an option, unless its flags are long
    with pytest.raises(SystemExit):
        _benchmark_module(monkeypatch, name).main(["--help"])
    helps: dict[str, str] = {}
    flags = ""
    for line in capsys.readouterr().out.split("options:\n")[1].splitlines():
        if line.startswith("  -"):  # an option: its flags, then its help where they leave room
            flags, _, text = line.strip().partition("  ")
            helps[flags] = text.strip()
        elif flags:  # its help, under long flags
            helps[flags] = (helps[flags] + " " + line.strip()).strip()
    return helps


def test_bench_help_says_the_user_paths_run_unless_turned_off(monkeypatch, capsys):
    """--user-paths, on by default and minutes long, did not say it was on."""
    text = _option_help(monkeypatch, capsys, "bench")["--user-paths, --no-user-paths"]
    assert "default: on, --no-user-paths skips them" in text, text


def test_decode_peers_help_describes_every_option(monkeypatch, capsys):
    """--tokens and --rounds were listed without a word."""
    helps = _option_help(monkeypatch, capsys, "decode_peers")
    assert helps["--tokens N"] == "the most tokens each row decodes after the prompt (default: 128)"
    assert helps["--rounds N"] == ("timed rounds, the rows' order reversed every other round "
                                   "(default: 3)")
    assert all(helps.values()), helps


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                           (signal.SIGINT, -signal.SIGINT)])
def test_a_scratch_folder_is_removed_when_a_signal_ends_the_process(tmp_path, signum, code):
    """SIGTERM's default killed a benchmark without unwinding it: its temporary folders stayed.
    Now the process exits 128 + the signal's number, its folders removed; Ctrl-C (Python's
    KeyboardInterrupt) removes them too, and ends the process as Ctrl-C does."""
    # as from a terminal: a child of a background job (CI started with `&`) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt for it
    script = ("import os, signal, sys, time\nfrom scratch import scratch_folder\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "with scratch_folder('toymlx-test-') as tmp, scratch_folder('toymlx-inner-') as inner:\n"
              "    (inner / 'big').write_bytes(bytes(1 << 20))\n"
              f"    os.kill(os.getpid(), {int(signum)})\n"
              "    time.sleep(60)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       check=False, timeout=60)
    assert p.returncode == code, p.stderr
    assert (p.stderr == "") == (signum != signal.SIGINT), p.stderr  # Ctrl-C's traceback
    assert list(tmp_path.iterdir()) == []


def test_a_scratch_folder_puts_the_signal_handlers_back(monkeypatch):
    scratch = _benchmark_module(monkeypatch, "scratch")
    before = [signal.getsignal(s) for s in scratch.ENDING]
    with scratch.scratch_folder("toymlx-test-") as tmp:
        assert tmp.is_dir() and signal.getsignal(signal.SIGTERM) is scratch._exit
    assert not tmp.exists() and [signal.getsignal(s) for s in scratch.ENDING] == before


def test_the_cpu_suite_stopped_by_sigterm_leaves_no_folder(tmp_path):
    """bench.py stopped by SIGTERM left its toymlx-bench-* folder in $TMPDIR (52 MB after a
    quick run; a finished one left it too)."""
    cmd = [sys.executable, str(BENCH), "--quick", "--only", "llama-4x256", "--impl", "toymlx",
           "--rounds", "1", "--no-user-paths"]
    p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while p.poll() is None and not list(tmp_path.glob("toymlx-bench-*")):
            time.sleep(0.05)  # until the suite has made its folder
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    finally:
        p.kill()
    assert p.returncode == 143, err[-2000:]
    assert list(tmp_path.glob("toymlx-bench-*")) == []


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="the message of a machine without a GPU")
def test_device_gpu_without_one_says_so(bench, capsys):
    assert bench.main(["--device", "gpu"]) == 2
    assert capsys.readouterr().err == ("bench: --device gpu: MLX has no GPU backend on this "
                                       "machine; use --device cpu\n")


@pytest.mark.bench
def test_cpu_suite_steps_each_side_alone_in_its_own_process(bench):
    """The CPU suite's rows each step in a process of their own, started as that side runs for
    its users: toymlx's with the heap toymlx's commands restart with, the peers' on the plain
    heap, PyTorch's without OpenBLAS. All start from the same weights (step 0's loss and |g|
    equal), and each reply carries the child's CPU time and MLX's peak for MLX's sides."""
    from cpu_suite import build_variants
    from toymlx_step import recipe_inputs
    from workloads import arch_workloads

    from toymlx.backend.device import glibc_version, huge_pages_tunables, thp_mode
    from toymlx.models.llama import tiny

    base = tiny(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                context=64)
    w = replace(arch_workloads(base, batch=2, seq=32, prefix="tiny")[0], name="tiny-llama",
                llama=base)
    with recipe_inputs(w) as inputs:
        variants, builds = build_variants(w, ("toymlx", "torch", "mlx-lm"), inputs)
    try:
        assert [v.name for v in variants] == list(builds) == ["toymlx", "torch", "mlx-lm"]
        pids = {v.proc.pid for v in variants}
        assert len(pids) == 3 and os.getpid() not in pids
        losses = {v.name: v.step(0) for v in variants}
        norms = {v.name: v.first_grad_norm() for v in variants}
        print(losses, norms, {v.name: v.info for v in variants})
        assert max(losses.values()) - min(losses.values()) < 1e-5 * losses["toymlx"]
        assert norms["toymlx"] == pytest.approx(norms["torch"], rel=1e-4)
        toy, torch_, peer = variants
        mode = thp_mode()
        if mode == "madvise":
            on = huge_pages_tunables(dict(os.environ), mode, glibc_version()) is not None
            assert toy.info["huge_pages"].startswith("on (") == on, toy.info
            assert torch_.info["huge_pages"].startswith("off (") and \
                peer.info["huge_pages"].startswith("off ("), (torch_.info, peer.info)
        for v in variants:
            v.step(1)
            assert v.last_cpu > 0
            assert (v.last_mlx_peak_mb is None) == (v.name == "torch")
        assert toy.last_mlx_peak_mb > 0 and peer.last_mlx_peak_mb > 0
        maps = {v.name: Path(f"/proc/{v.proc.pid}/maps").read_text().lower() for v in variants}
        # the BLAS toymlx binds (pip's OpenBLAS: numpy's own is libscipy_openblas64_-*.so; or
        # MKL on an Intel CPU), in MLX's children and not in PyTorch's
        lib = "/" + os.path.basename(backend_info()["blas_path"]).lower()
        assert lib in maps["toymlx"] and lib in maps["mlx-lm"] and lib not in maps["torch"]
    finally:
        for v in variants:
            v.close()
    assert all(not v.proc.is_alive() for v in variants)


@pytest.mark.bench
def test_a_step_process_that_fails_or_hangs_is_reported_not_waited_for(bench):
    """A child that fails says why in the parent's error; one that says nothing within its
    time is killed, and the parent goes on with an error instead of hanging."""
    from procs import ChildVariant, write_step_inputs
    from toymlx_step import recipe_inputs
    from workloads import find

    w = find("llama-4x256")
    with recipe_inputs(w) as inputs:
        write_step_inputs(w, inputs, weights=False)
        with pytest.raises(RuntimeError, match="expected toymlx, toymlx-ref, mlx-lm, torch or "
                                               "torch1t, found 'nope'"):
            ChildVariant("nope", w, inputs)
        with pytest.raises(RuntimeError, match=r"the toymlx step's process said nothing in 0 s"):
            ChildVariant("toymlx", w, inputs, timeout_s=0.01)


@pytest.mark.slow
@pytest.mark.bench
def test_cpu_suite_quick_round(tmp_path):
    """One round of the CPU suite's small workloads: PyTorch's step in its child process and
    toymlx's with both kernel sets start from the same loss, and the table keeps its columns."""
    out = tmp_path / "quick.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--rounds", "1", "--warm-jit", "--only",
           "llama-4x256", "vit-tiny-28", "--impl", "toymlx", "toymlx-ref", "torch",
           "--no-user-paths", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(out.read_text())
    assert info["suite"] == "cpu" and [w["workload"] for w in info["workloads"]] == [
        "llama-4x256", "vit-tiny-28"]
    for w in info["workloads"]:
        v = w["variants"]
        assert list(v) == ["toymlx", "toymlx-ref", "torch"]
        losses = [x["loss0"] for x in v.values()]
        assert max(losses) - min(losses) < 1e-5 * losses[0], (w["workload"], losses)
        assert set(w["ratio_toymlx_over"]) == {"toymlx-ref", "torch"}
        gflops = w["flops_per_step"] / v["toymlx"]["median_s"] / 1e9
        assert v["toymlx"]["gflops"] == pytest.approx(gflops)
        assert v["toymlx"]["mfu_vs_mlx_sgemm"] == pytest.approx(gflops / w["sgemm_gflops"]["mlx"])
    assert p.stdout.startswith("host: ") and info["host"]["cores"] == os.cpu_count()
    header = p.stdout.splitlines()[2].split()
    assert header == ["workload", "impl", "median", "ms", "min", "ms", "cpu", "ms", "items/s",
                      "GFLOPS", "MFU", "1st", "step", "s", "mlx", "MB", "RSS", "MB", "loss0",
                      "|g|0"]


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.smollm
def test_cpu_suite_times_what_users_run(tmp_path):
    """The rows users run: toymlx-train on the real SmolLM2 at the LoRA shape, toymlx.train in
    a process that imported and used mlx and mlx_lm first (the 10-40x reference-BLAS cliff
    fails this), toymlx-generate beside llama.cpp, and the host they ran on."""
    out = tmp_path / "users.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--rounds", "1", "--warm-jit", "--only",
           "lora-q-135m", "--impl", "toymlx", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3000, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(out.read_text())
    u, host = info["user_paths"], info["host"]
    assert host["cpu"] and host["blas"] == info["backend"]["blas"]
    assert host["versions"]["mlx"] and host["versions"]["llama-cpp-python"]
    assert u["train_command"]["blas"] == u["train_entry_after_mlx"]["blas"] == host["blas"]
    assert u["entry_over_command"] == pytest.approx(
        u["train_entry_after_mlx"]["median_step_s"] / u["train_command"]["median_step_s"])
    bench_s = info["workloads"][0]["variants"]["toymlx"]["median_s"]
    assert u["command_over_bench_step"] == pytest.approx(
        u["train_command"]["median_step_s"] / bench_s)
    for mode in ("greedy", "sampled"):
        row = u["generation"][mode]
        assert row["toymlx-generate"]["engine"] == "mlx" and row["toymlx-generate"]["tok_per_s"] > 0
        if "error" in row["llama.cpp"]:  # a llama.cpp that crashes on this host: its row's
            continue  # error, never the benchmark's end
        cpp = row["llama.cpp"]["tok_per_s"]
        assert row["toymlx-generate --engine llama.cpp"]["engine"] == "llama.cpp"
        for k in ("toymlx-generate", "toymlx-generate --engine llama.cpp"):
            assert row[k]["over_llamacpp"] == pytest.approx(row[k]["tok_per_s"] / cpp)
    assert "toymlx.train after mlx" in p.stdout and "generate greedy" in p.stdout


def _reference_loss(a, weights: dict, tokens: np.ndarray, scale: float) -> float:
    """Mean next-token cross-entropy of tests/reference.py's float64 forward of llama.cpp's
    graph, on the same weights with the adapters folded in (W + scale B A)."""
    from reference import forward

    from toymlx.gguf.llama import toy_to_gguf

    w = {toy_to_gguf(k): v.astype(np.float64) for k, v in weights.items() if ".lora_" not in k}
    for k in [k for k in weights if k.endswith(".lora_a")]:
        base = toy_to_gguf(k.replace(".lora_a", ".linear.weight"))
        w[base] = w[base] + scale * (weights[k.replace("lora_a", "lora_b")].astype(np.float64)
                                     @ weights[k].astype(np.float64))
    hp = {"arch": a.arch, "d": a.d_model, "n_layers": a.n_layers, "n_heads": a.n_heads,
          "n_kv": a.n_kv_heads, "hd": a.head_dim, "n_rot": a.rope_dims or a.head_dim,
          "eps": a.norm_eps, "base": a.rope_base, "base_swa": a.rope_base_sliding,
          "window": a.sliding_window or 0, "pattern": 6, "softcap": a.final_softcap or 0.0,
          "scaling": "linear", "factor": 1 / a.rope_scale if a.rope_scale != 1 else 0.0,
          "attn_factor": 1.0, "attn_softcap": a.attn_softcap or 0.0,
          "embedding_scale": a.embedding_multiplier, "residual_scale": a.residual_multiplier,
          "attention_scale": a.attn_scale if a.arch == "granite" else 0.0,
          "logit_scale": a.logits_scaling, "temperature": a.attn_temperature,
          "n_orig": a.rope_orig_context or a.context}
    losses = []
    for row in tokens:  # (T+1,)
        z = forward(hp, w, list(row[:-1]))  # (T, V)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        losses.append(-logp[np.arange(len(row) - 1), row[1:]])
    return float(np.mean(losses))


@pytest.mark.bench
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_mlx_lm_peer_computes_the_same_model(bench, arch):
    """The CPU suite's mlx-lm rows train the same function as toymlx's: each architecture's
    workload switches at a tiny shape, one set of weights (norms and adapters random, so the
    gemma norm offset and the adapters' orientation count) in toymlx's decoder and in mlx-lm's
    model class: step-0 loss and gradient norm equal, and the loss equal to the float64
    forward of llama.cpp's graph (tests/reference.py)."""
    from mlx_lm_step import MlxLmVariant
    from toymlx_step import ToymlxVariant, build_task, cpu_ops, recipe_inputs, weights_np
    from workloads import arch_workloads, make_batch

    from toymlx.models.llama import tiny

    base = tiny(vocab_size=512, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=128,
                context=128)
    ws = arch_workloads(base, batch=2, seq=32, prefix="tiny")
    ws.append(replace(ws[0], name="tiny-llama", llama=base))  # LoRA on q, as the others
    w = next(x for x in ws if x.llama.arch == arch)
    rng = np.random.default_rng(1)
    with recipe_inputs(w) as inputs:
        task, cfg = build_task(w, cpu_ops(), inputs)
    weights = {k: (1 + 0.2 * rng.standard_normal(v.shape) if k.endswith("norm.weight") else
                   0.05 * rng.standard_normal(v.shape) if k.endswith("lora_b") else v
                   ).astype(np.float32) for k, v in weights_np(task.model).items()}
    task.model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    batch = make_batch(w)
    toy, peer = ToymlxVariant(task, cfg, batch), MlxLmVariant(w, weights, batch)
    peer_gnorm = peer.grad_norm()
    toy_loss, peer_loss = toy.step(0), peer.step(0)
    ref = _reference_loss(w.llama, weights, peer.tokens, w.lora_alpha / w.lora_rank)
    rel = lambda x, y: abs(x - y) / abs(y)
    print(f"{arch}: loss toymlx {toy_loss:.7f} mlx-lm {peer_loss:.7f} fp64 {ref:.7f} (relative: "
          f"toymlx/mlx-lm {rel(toy_loss, peer_loss):.1e}, toymlx/fp64 {rel(toy_loss, ref):.1e}, "
          f"mlx-lm/fp64 {rel(peer_loss, ref):.1e}); |g| toymlx {toy.first_grad_norm():.7f} "
          f"mlx-lm {peer_gnorm:.7f} (relative {rel(toy.first_grad_norm(), peer_gnorm):.1e})")
    assert toy_loss == pytest.approx(peer_loss, rel=1e-5)
    assert toy_loss == pytest.approx(ref, rel=1e-5) and peer_loss == pytest.approx(ref, rel=1e-5)
    assert toy.first_grad_norm() == pytest.approx(peer_gnorm, rel=1e-5)


@pytest.mark.bench
@pytest.mark.parametrize("arch,change,named", [
    # Gemma 3 1B's width: mlx-lm scales the embeddings by sqrt(1152) rounded to bfloat16 (34.0),
    # llama.cpp and toymlx by 33.941 (float32)
    ("gemma3", {"d_model": 1152}, "d_model=1152"),
    ("gemma3", {"final_softcap": 30.0}, "final_softcap=30.0"),
    # Phi-3's longrope: llama.cpp uses the short factors within the original context, mlx-lm's
    # SuScaledRoPE always the long ones
    ("phi3", {"rope_factors": (1.0,) * 24, "rope_mscale": 1.19}, "rope_factors=(1.0"),
    ("qwen2", {"key_length": 128}, "key_length=128"),
])
def test_mlx_lm_peer_refuses_what_it_computes_otherwise(bench, arch, change, named):
    from mlx_lm_step import model_config
    from workloads import arch_shape

    from toymlx.models.llama import smollm2_135m

    with pytest.raises(ValueError, match=r"mlx-lm's \w+ computes these LlamaArgs switches") as e:
        model_config(replace(arch_shape(arch, smollm2_135m(), 128), **change))
    assert named in str(e.value)


@pytest.mark.parametrize("name", ["tiny-scratch", "tiny-vit", "tiny-lora-q"])
def test_toymlx_row_is_the_first_step_of_toymlx_train(bench, tmp_path, name):
    """The benchmark's toymlx row cannot drift from what users run: the workload's recipe
    Config (`toymlx_step.build_task`), run by toymlx-train for one step (`-c` its config.json),
    gives the loss, gradient norm and updated weights that the benchmark's variant (the same
    Task, stepped by `ToymlxVariant`) gives on the same batch (the recipe's step-0 batch, which
    the benchmark swaps for the workload's), to the last bit; one workload per recipe."""
    from mlx.utils import tree_flatten
    from toymlx_cli.train import main
    from toymlx_step import ToymlxVariant, build_task, cpu_ops, recipe_inputs
    from workloads import find

    from toymlx.bundle import folder as runs
    from toymlx.bundle.events import read_events

    w = find(name)
    with recipe_inputs(w) as inputs:
        task, cfg = build_task(w, cpu_ops(), inputs)
        runs.save_config(inputs, task.recipe, cfg)
        assert main(["-c", str(inputs / runs.CONFIG_FILE), "--runs-root", str(tmp_path),
                     "--run-id", "r", "--stop-at", "1"]) == 0
        row = ToymlxVariant(task, cfg, task.train_batch(0))
        loss = row.step(0)
        events = read_events(tmp_path / "r" / "events.jsonl")
        step = next(e for e in events if e["kind"] == "step")
        saved = next(e for e in events if e["kind"] == "checkpoint")
        trained, _ = build_task(w, cpu_ops(), inputs)
        trained.load(tmp_path / "r" / saved["path"], trained.model)
    ours = dict(tree_flatten(task.model.trainable_parameters()))
    theirs = dict(tree_flatten(trained.model.trainable_parameters()))
    diff = max(float(mx.abs(ours[k] - theirs[k]).max()) for k in ours)
    print(f"{name} ({task.recipe}): loss toymlx-train {step['loss']!r} bench {loss!r}; |g| "
          f"toymlx-train {step['grad_norm']!r} bench {row.first_grad_norm()!r}; "
          f"{len(ours)} trained tensors, max |diff| {diff}")
    assert set(ours) == set(theirs) and ours
    assert (loss, row.first_grad_norm()) == (step["loss"], step["grad_norm"])
    assert diff == 0.0


@pytest.mark.bench
@pytest.mark.parametrize("variant", ["keep-attention", "composed-attention", "padded-attention"])
@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_ops_ab_variants_compute_the_same_gradients(monkeypatch, variant, kind):
    """benchmarks/ops_ab.py's variants change how attention is computed, not what: the same
    loss and gradients as the default Ops on the same weights (bfloat16 GPU math, here on the
    CPU; the ViT's 17 tokens padded to 128 where the variant pads)."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    ops_ab = importlib.import_module("ops_ab")
    from mlx.utils import tree_flatten

    from toymlx.models.llama import Llama, tiny
    from toymlx.models.ops import training_ops
    from toymlx.models.vit import ViT, vit_tiny_8

    base = training_ops(on_gpu=True, dtype="float32")
    rng = np.random.default_rng(0)
    if kind == "vit":
        make = lambda ops: ViT(vit_tiny_8(n_layers=2, d_model=64, n_heads=2, ffn_dim=128), ops)
        x = mx.array(rng.random((3, 8, 8, 1), np.float32))
    else:
        make = lambda ops: Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      ffn_dim=128), ops)
        x = mx.array(rng.integers(0, 259, (2, 24)).astype(np.int32))
    mx.random.seed(0)
    ref = make(base)
    other = make(ops_ab.VARIANTS[variant](base))
    other.update(ref.parameters())

    def loss_and_grads(model):
        def loss(params):
            model.update(params)
            return (model(x).astype(mx.float32) ** 2).mean()
        value, grads = mx.value_and_grad(loss)(model.trainable_parameters())
        return float(value), dict(tree_flatten(grads))

    want_loss, want = loss_and_grads(ref)
    got_loss, got = loss_and_grads(other)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_allclose(np.array(got[k]), np.array(want[k]), rtol=2e-4, atol=1e-6,
                                   err_msg=k)


@pytest.mark.bench
def test_ops_ab_puts_the_peers_in_the_same_rounds_and_profiles_each_row(monkeypatch, tmp_path,
                                                                       capsys):
    """`ops_ab.py --peers mlx-lm torch --profile` at a tiny LoRA shape on the CPU: toymlx's
    variants and both peers in one table from the same weights (step-0 losses within 1e-4; the
    variants' equal, their logits sizes changing no number), and each row's profile saying why
    it has none here (no CUDA), written to the JSON."""
    ops_ab = _benchmark_module(monkeypatch, "ops_ab")
    out = tmp_path / "ab.json"
    assert ops_ab.main(["--device", "cpu", "--dtype", "float32", "--only", "tiny-lora-q",
                        "--variants", "default", "cpu-logits", "logits-2^22", "--peers",
                        "mlx-lm", "torch", "--profile", "--rounds", "2", "--warmup", "0",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())[0]["rows"]
    assert list(rows) == ["default", "cpu-logits", "logits-2^22", "mlx-lm", "torch"]
    losses = [r["loss0"] for r in rows.values()]
    assert losses[0] == losses[1] == losses[2]
    assert max(losses) - min(losses) < 1e-4, losses
    assert all(r["profile"] == {"error": "torch.cuda.is_available() is false"}
               for r in rows.values())
    assert rows["default"]["over_default"] == 1.0 and rows["torch"]["peak_mb"] is None
    assert "tiny-lora-q" in capsys.readouterr().out


@pytest.mark.bench
def test_gpu_decode_rows_decode_the_same_tokens(monkeypatch, tmp_path, capsys):
    """`benchmarks/gpu_decode.py` on the CPU at a tiny LoRA base: toymlx's eager decoding, its
    CompiledDecode (the same logits, bit for bit) and mlx-lm's `generate_step` on the same float32
    weights give the same 16 greedy tokens, each row timed, written to the JSON."""
    gpu_decode = _benchmark_module(monkeypatch, "gpu_decode")
    out = tmp_path / "decode.json"
    assert gpu_decode.main(["--device", "cpu", "--only", "tiny-lora-q", "--tokens", "16",
                            "--rounds", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["workloads"][0]
    assert res["generate_uses"] == "toymlx CompiledDecode"  # on the CPU; eager on a GPU
    rows = res["rows"]
    assert list(rows) == ["toymlx eager", "toymlx CompiledDecode", "mlx-lm"]
    assert all(r["tokens"] == 16 and r["agree_with_eager"] == 16 and r["tokens_per_s"] > 0
               for r in rows.values()), rows
    assert "x1.00 of toymlx eager" in capsys.readouterr().out


@pytest.fixture
def env_ab(monkeypatch):
    return _benchmark_module(monkeypatch, "env_ab")


@pytest.mark.parametrize("flags,message", [
    (["--b", "GOMP_SPINCOUNT"], "--b: expected VAR=VALUE, found 'GOMP_SPINCOUNT'"),
    (["--a", "=1"], "--a: expected VAR=VALUE, found '=1'"),
    (["--rounds", "0"], "--rounds: expected >= 1, found 0"),
])
def test_env_ab_refuses_what_it_cannot_run_in_one_line(env_ab, capsys, flags, message):
    assert env_ab.main(flags) == 2
    assert capsys.readouterr().err == f"env_ab: {message}\n"


@pytest.mark.bench
def test_env_ab_steps_each_side_in_the_environment_it_names(env_ab):
    """Each side's child starts with its variables (its backend reports the evaluation width it
    was given) and takes the same steps: the same losses bit for bit, a ratio every round."""
    w = next(w for w in env_ab.cpu_workloads() if w.name == "llama-4x256")
    out = env_ab.run(w, {}, {"MLX_BFS_MAX_WIDTH": "100"}, rounds=2, warmup=0, log=lambda s: None)
    assert out["backend_differs"] == {"bfs_max_width": ["1000000", "100"]}
    assert out["losses_equal"] is True and out["rounds"] == 2
    for k in ("ratio_wall", "ratio_cpu"):
        r = out[k]
        assert 0 < r["q1"] <= r["median"] <= r["q3"] < 10, r
    report = env_ab.format_report(out)
    assert "b: MLX_BFS_MAX_WIDTH=100" in report and "losses bit for bit: yes" in report


def test_gpu_machine_carries_the_kernel_caches_to_the_next_machine(tmp_path):
    """`gpu_machine.sh kernel-cache` packs MLX's PTX cache ($TMPDIR/mlx) and the driver's
    ($CUDA_CACHE_PATH) into pieces of at most 15 MB; `install`, given a part holding them (here
    with the wheels marked installed: they are Python 3.12 wheels for the lent machine), unpacks
    each where MLX and the driver read it, byte for byte."""
    script = REPO / "benchmarks" / "gpu_machine.sh"
    rng = np.random.default_rng(0)
    old = {"tmp/mlx/0.32.4/ptx/k.ptx": rng.bytes(2_000_000),
           "cuda/ComputeCache/index": rng.bytes(100),
           "cuda/ComputeCache/a/b": rng.bytes(17_000_000)}
    for rel, data in old.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"),
           "CUDA_CACHE_PATH": str(tmp_path / "cuda" / "ComputeCache")}
    subprocess.run(["bash", str(script), "kernel-cache", str(out / "gpu_kernels.tgz")],
                   env=env, check=True, capture_output=True)
    pieces = sorted(out.iterdir())
    assert [p.name for p in pieces] == ["gpu_kernels.tgz.0", "gpu_kernels.tgz.1"]
    assert all(p.stat().st_size <= 15_000_000 for p in pieces)
    part, home = tmp_path / "part", tmp_path / "home"
    part.mkdir()
    home.mkdir()
    (part / "kernels.tgz.00").write_bytes(b"".join(p.read_bytes() for p in pieces))
    (part / "MANIFEST").write_text("wheel w.whl\nsha256 0\npieces 1\nkernel_pieces 1\n")
    (home / "installed").write_text("w.whl\n")
    new = {**env, "TOYMLX_GPU_HOME": str(home), "TMPDIR": str(tmp_path / "there"),
           "CUDA_CACHE_PATH": str(tmp_path / "there-cuda")}
    done = subprocess.run(["bash", str(script), "install", str(part)], env=new, check=True,
                          capture_output=True, text=True)
    assert "mlx unpacked" in done.stdout and "ComputeCache unpacked" in done.stdout
    assert (tmp_path / "there/mlx/0.32.4/ptx/k.ptx").read_bytes() == old["tmp/mlx/0.32.4/ptx/k.ptx"]
    assert (tmp_path / "there-cuda/a/b").read_bytes() == old["cuda/ComputeCache/a/b"]


@pytest.fixture
def unpacked_run(monkeypatch):
    return _benchmark_module(monkeypatch, "unpacked_run")


def test_unpacked_run_reads_each_step_against_its_own_width(unpacked_run):
    times = [6.0, 2.8, 1.6, 1.7, 1.2, 2.6, 1.65, 2.0]
    widths = [224, 224, 128, 128, 96, 160, 128, 128]
    r = unpacked_run.analyse([{"step": i + 1, "step_time_s": t, "batch_width": w}
                              for i, (t, w) in enumerate(zip(times, widths))])
    assert r["first_step_s"] == 6.0 and r["first_width"] == 224 and r["steps"] == 8
    assert r["median_step_s"] == 1.7  # of steps 2-8: 1.2 1.6 1.65 1.7 2.0 2.6 2.8
    assert r["widths"][128] == {"steps": 4, "median_step_s": 1.675,
                                "s_per_width_unit_ms": 13.09}
    assert r["worst_vs_width"] == {"step": 8, "width": 128, "ratio": round(2.0 / 1.675, 3)}
    # steps 2 and 6 are over 1.5 x 1.7 = 2.55 s: each the median of its own width
    assert r["over_1.5x_run_median"] == [
        {"step": 2, "width": 224, "ratio": round(2.8 / 1.7, 3), "vs_width": 1.0},
        {"step": 6, "width": 160, "ratio": round(2.6 / 1.7, 3), "vs_width": 1.0}]


def test_unpacked_run_names_the_step_each_kernel_was_built_in(unpacked_run, tmp_path):
    events, kernels = tmp_path / "events.jsonl", tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "old.so").touch()  # built before the run: not counted
    watch = unpacked_run.Watch(events)

    def write(*lines: dict, partial: str = "") -> None:
        with events.open("a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in lines) + partial)

    watch.poll()  # no events yet
    write({"kind": "run_start", "backend": {"kernel_cache": str(kernels)}})
    watch.poll()
    (kernels / "a.so").touch()  # during step 1
    watch.poll()
    write({"kind": "step", "step": 1}, partial='{"kind": "st')  # half a line: waits
    watch.poll()
    (kernels / "b.so").touch()  # during step 2
    (kernels / "c.so").touch()
    with events.open("a") as f:
        f.write('ep", "step": 2}\n')
    watch.poll()
    (kernels / "d.so").touch()  # after step 2's event: in step 3
    watch.poll()
    assert watch.step == 2
    assert watch.built == [{"kernel": "a.so", "during_step": 1},
                           {"kernel": "b.so", "during_step": 2},
                           {"kernel": "c.so", "during_step": 2},
                           {"kernel": "d.so", "during_step": 3}]


def _session_steps() -> list[list[str]]:
    """The commands `benchmarks/gpu_session.sh` runs on a lent GPU (its `step CAP ...` calls,
    continuations joined, comments dropped), each as the words after the cap."""
    text = (REPO / "benchmarks" / "gpu_session.sh").read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        for call in line.split("#")[0].split("&&"):
            words = call.split()
            if words[:1] == ["step"] and words[1].isdigit():
                steps.append([w.strip('"').replace("$out", "/tmp/out") for w in words[2:]])
    return steps


def test_gpu_session_steps_name_scripts_and_flags_that_exist(monkeypatch):
    """Every step of the GPU session (the 15 device minutes: no time for a wrong flag) names a
    file of this checkout, and its flags are ones that script's parser takes: bench.py's fit
    together for the GPU suite (`bench.check`), gpu_decode.py's workloads exist."""
    steps = _session_steps()
    assert len(steps) >= 7, steps
    bench = _benchmark_module(monkeypatch, "bench")
    gpu_decode = _benchmark_module(monkeypatch, "gpu_decode")
    for words in steps:
        assert words[0] == "python3", words
        if words[1] == "-m":
            assert words[2] == "pytest" and (REPO / words[words.index("-m", 3) + 2]).is_file()
            continue
        script = REPO / words[1]
        assert script.is_file(), words
        args = words[2:]
        if script.name == "bench.py":
            a = bench.parse(args)
            assert a.device == "gpu" and bench.check(a, gpu=True) is None, words
        elif script.name == "gpu_decode.py":
            chosen: dict[str, str] = {}

            def stop_at_device(name: str, chosen: dict[str, str] = chosen) -> None:
                chosen["device"] = name
                raise SystemExit(0)

            monkeypatch.setattr(gpu_decode, "select_device", stop_at_device)
            with pytest.raises(SystemExit):
                gpu_decode.main(args)
            assert chosen == {"device": "gpu"}, words
            only = args[args.index("--only") + 1:args.index("--tokens")]
            assert all(gpu_decode.find(name).lora for name in only), only
        elif script.name == "shapes.py":
            shapes = _benchmark_module(monkeypatch, "shapes")
            assert args and all(name in shapes.SHAPES for name in args), words
        elif script.name == "memory.py":
            memory = _benchmark_module(monkeypatch, "memory")
            assert args[0] == "--only" and args[2] == "--json", words
            assert memory.ROWS[args[1]].runner == "toymlx", words
        else:
            pytest.fail(f"a step this test does not check yet: {words}")


def test_gpu_machine_runs_the_trees_cli_not_the_wheels(tmp_path):
    """`gpu_machine.sh run` imports toymlx and toymlx_cli from the working tree, not the copies
    in the wheel that `prepare` built (older than the tree by the time a GPU is lent)."""
    site = tmp_path / "site"
    for pkg in ("toymlx", "toymlx_cli"):
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("raise ImportError('the wheel copy')\n")
    env = {**os.environ, "TOYMLX_GPU_HOME": str(tmp_path)}
    probe = ("import importlib.util as u; "
             "print(u.find_spec('toymlx').origin); print(u.find_spec('toymlx_cli').origin)")
    out = subprocess.run(["bash", "benchmarks/gpu_machine.sh", "run", sys.executable, "-c", probe],
                         env=env, cwd=REPO, check=True, capture_output=True, text=True).stdout
    found = [Path(p).resolve() for p in out.split()]
    assert found == [(REPO / "toymlx" / "__init__.py").resolve(),
                     (REPO / "cli" / "__init__.py").resolve()], found
