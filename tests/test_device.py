"""Process set-up (`toymlx.backend.device.setup_process`): the malloc settings that keep MLX's buffers in
the process; and GGUF loading that keeps one copy of the weights resident."""

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, os
import toymlx
import mlx.core as mx
from toymlx.backend.device import backend_info, setup_process

setup_process()

def faults():
    return int(open("/proc/self/stat").read().split()[9])  # minor page faults

x = mx.random.normal((1024, 1024))  # 4 MiB

def step():  # like a training step: 24 MiB .. 96 MiB of buffers alive, then all freed
    ys = [x * float(i) for i in range(24)]
    mx.eval(ys)
    mx.eval(sum(ys))

step()
f0 = faults()
for _ in range(10):
    step()
print(json.dumps({"faults": faults() - f0, "malloc": backend_info()["malloc"]}))
"""


def _probe(mode: str | None) -> dict:
    import os

    env = dict(os.environ)
    env.pop("TOYMLX_MALLOC", None)
    if mode:
        env["TOYMLX_MALLOC"] = mode
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux")
def test_freed_buffers_are_reused_not_faulted_in_again():
    tuned, plain = _probe(None), _probe("default")
    assert tuned["malloc"] == "glibc-retain" and plain["malloc"] == "default"
    # 10 steps of ~100 MiB: glibc's own settings give some of it back to the system every
    # step and fault it in again (25,600 faults here), the retained heap reuses the first
    # step's pages: not one 4 MiB buffer (1,024 pages) is faulted in again (with the aligned
    # buffers' posix_memalign, the heap grew by one every few steps)
    assert plain["faults"] > 10_000, plain
    assert tuned["faults"] < 1024, (tuned, plain)


def test_gguf_load_keeps_one_copy_resident(tmp_path):
    """load_llama copies each tensor into MLX and drops the file mapping's pages of it, so a
    model's weights are resident once (plus one tensor), not twice (mapping + copy)."""
    import mlx.core as mx

    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama, tiny

    mx.random.seed(0)
    model = Llama(tiny(d_model=512, ffn_dim=2048, n_layers=6))  # ~100 MB in 4 MB tensors
    mx.eval(model.parameters())
    path = tmp_path / "big.gguf"
    write_llama(str(path), model, {}, name="t")
    size_mb = path.stat().st_size / 2**20
    probe = f"""
import json
from pathlib import Path
import toymlx
import mlx.core as mx
from toymlx.gguf.llama import load_llama
def st(k):
    return next(int(x.split()[1]) / 1024 for x in Path('/proc/self/status').read_text().splitlines() if x.startswith(k + ':'))
base = st('VmRSS'); Path('/proc/self/clear_refs').write_text('5')
m, g = load_llama({str(path)!r})
print(json.dumps({{"grown_mb": st('VmHWM') - base}}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    grown = json.loads(out.stdout.strip().splitlines()[-1])["grown_mb"]
    assert size_mb > 90
    assert grown < 1.3 * size_mb, (grown, size_mb)  # twice the file before


@pytest.mark.parametrize("environ,mode,glibc,want", [
    ({}, "madvise", (2, 36), "glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36),
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), None),  # the user's
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", (2, 36), None),  # restarted
    ({"TOYMLX_MALLOC": "default"}, "madvise", (2, 36), None),
    ({}, "always", (2, 36), None),  # the heap has them already
    ({}, "never", (2, 36), None),
    ({}, None, (2, 36), None),
    ({}, "madvise", (2, 34), None),  # no such tunable before glibc 2.35
    ({}, "madvise", None, None),  # musl, macOS
])
def test_when_a_command_restarts_for_huge_pages(environ, mode, glibc, want):
    from toymlx.backend.device import huge_pages_tunables

    assert huge_pages_tunables(environ, mode, glibc) == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux")
def test_toymlx_train_restarts_with_a_huge_page_heap_and_the_same_losses(tmp_path):
    """The console script restarts itself with glibc.malloc.hugetlb=1 where the kernel's THP
    mode is madvise (run_start's backend says so), TOYMLX_MALLOC=default does not, and the two
    runs' losses are the same bit for bit: page size changes no value."""
    import os
    from pathlib import Path

    from toymlx.backend.device import glibc_version, thp_mode
    from toymlx.bundle.events import read_events

    exe = Path(sys.executable).parent / "toymlx-train"  # the console script, as installed
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    runs = {}
    for name, malloc in (("huge", None), ("plain", "default")):
        env = {k: v for k, v in os.environ.items() if k not in ("TOYMLX_MALLOC", "GLIBC_TUNABLES")}
        if malloc:
            env["TOYMLX_MALLOC"] = malloc
        subprocess.run([*cmd, "--recipe", "from-scratch", "--steps", "3", "--batch-size", "2",
                        "--seq-len", "64", "--eval-every", "0", "--no-progress",
                        "--runs-root", str(tmp_path), "--run-id", name],
                       env=env, capture_output=True, text=True, timeout=300, check=True)
        runs[name] = read_events(tmp_path / name)
    backend = {k: r[0]["backend"] for k, r in runs.items()}
    if thp_mode() == "madvise" and (glibc_version() or (0, 0)) >= (2, 35):
        assert backend["huge"]["huge_pages"].startswith("on (glibc.malloc.hugetlb=1"), backend
        assert backend["plain"]["huge_pages"].startswith("off"), backend
    else:  # another kernel mode: nothing to restart for, and the record names the mode
        assert backend["huge"]["huge_pages"] == backend["plain"]["huge_pages"], backend
    losses = {k: [e["loss"] for e in r if e["kind"] == "step"] for k, r in runs.items()}
    assert len(losses["huge"]) == 3 and losses["huge"] == losses["plain"], losses


def test_the_cuda_kernel_cache_is_where_mlx_keeps_its_ptx(monkeypatch, tmp_path):
    """On CUDA: MLX_PTX_CACHE_DIR where set, else <temp>/mlx/<MLX's version>/ptx (MLX 0.32's
    `ptx_cache_dir`); on Metal and on the CPU, None."""
    import tempfile
    from pathlib import Path

    import mlx.core as mx

    from toymlx.backend import device

    monkeypatch.setattr(device, "on_gpu", lambda: True)
    monkeypatch.setattr(device.sys, "platform", "linux")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    expected = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"
    assert device.cuda_kernel_cache() == expected
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert device.cuda_kernel_cache() == tmp_path
    monkeypatch.setattr(device.sys, "platform", "darwin")
    assert device.cuda_kernel_cache() is None
    monkeypatch.setattr(device, "on_gpu", lambda: False)
    monkeypatch.setattr(device.sys, "platform", "linux")
    assert device.cuda_kernel_cache() is None


@pytest.mark.parametrize("gpu", [False, True])
def test_the_buffer_cache_is_bounded_to_a_step_only_on_the_cpu(monkeypatch, gpu):
    """`bound_kept_buffers` bounds MLX's buffer cache to a step's transient memory on the CPU;
    on a GPU (a fake one here) it leaves MLX's limit as it is: freed GPU buffers beyond the
    bound would go back to the driver and be allocated again every step."""
    import mlx.core as mx

    from toymlx.backend import device

    monkeypatch.setattr(device, "on_gpu", lambda: gpu)
    monkeypatch.setattr(device, "_PROCESS", device._ProcessState())  # malloc "default": no glibc
    mine = 1 << 30
    original = mx.set_cache_limit(mine)
    try:
        device.bound_kept_buffers(1 << 20)
        after = mx.set_cache_limit(original)
    finally:
        mx.set_cache_limit(original)
    assert after == (mine if gpu else 1 << 20)
    assert device.kept_buffers()["mlx_cache_limit_mb"] == (None if gpu else 1)


@pytest.mark.parametrize("value,ok", [("junk", False), ("0", False), ("", False),
                                      ("5x", False), ("1", True), (" 7", True),
                                      ("1000000", True), ("-1", True)])
def test_an_mlx_bfs_width_that_hangs_mlx_is_refused(value, ok):
    from toymlx.backend.device import check_bfs_width

    if ok:
        check_bfs_width(value)
    else:
        with pytest.raises(ValueError) as e:
            check_bfs_width(value)
        assert str(e.value).startswith(f"MLX_BFS_MAX_WIDTH: expected a whole number other "
                                       f"than 0, found {value!r} (MLX reads it as 0")


@pytest.mark.parametrize("name,value,ok", [
    ("TOYMLX_KERNEL_PCH", "off", True), ("TOYMLX_KERNEL_PCH", "", True),
    ("TOYMLX_KERNEL_LOOPS", "on", True), ("TOYMLX_MALLOC", "default", True),
    ("TOYMLX_KERNEL_PCH", "0", False), ("TOYMLX_GEMV_FORWARD", "OFF", False),
    ("TOYMLX_KERNEL_LOOPS", "false", False), ("TOYMLX_MALLOC", "off", False),
])
def test_a_switch_set_to_what_it_does_not_read_is_refused(name, value, ok):
    """TOYMLX_KERNEL_PCH=0, TOYMLX_GEMV_FORWARD=OFF, TOYMLX_MALLOC=off: each is compared with its
    one value ("off", "default"), so these left toymlx's code on, with no word."""
    from toymlx.backend.device import check_switches

    if ok:
        check_switches({name: value})
        return
    with pytest.raises(ValueError) as e:
        check_switches({name: value})
    off, unset = ("default", "glibc-retain") if name == "TOYMLX_MALLOC" else ("off", "on")
    assert str(e.value) == (f"{name}: expected {off} (or {unset}, as unset), found {value!r}, "
                            f"which toymlx reads as {unset}; set {name}={off} or unset it")


def test_a_switch_set_wrong_is_one_line_from_a_command(stories_path, capsys, monkeypatch):
    from cli_errors import error_line
    from toymlx_cli.generate import main as generate_main

    from toymlx.backend import device

    monkeypatch.setenv("TOYMLX_GEMV_FORWARD", "0")
    monkeypatch.setattr(device._PROCESS, "set_up", False)
    assert generate_main(["--model", str(stories_path), "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate") == (
        "toymlx-generate: error: TOYMLX_GEMV_FORWARD: expected off (or on, as unset), found "
        "'0', which toymlx reads as on; set TOYMLX_GEMV_FORWARD=off or unset it")


@pytest.mark.parametrize("value, has_gpu, want", [
    ("cuda", False, ("TOYMLX_BACKEND=cuda: this MLX has no GPU, so this computes on the CPU; the "
                     "variable chooses the MLX backend scripts/install.sh installs, not where a "
                     "command computes (--device): unset it, or for a GPU, source the installer "
                     "with it where nvidia-smi lists one")),
    ("cuda12", False, "TOYMLX_BACKEND=cuda12: this MLX has no GPU, so this computes on the CPU;"),
    ("cpu", True, ("TOYMLX_BACKEND=cpu: this MLX has a GPU, so this computes on the GPU; the "
                   "variable chooses the MLX backend scripts/install.sh installs, not where a "
                   "command computes (--device): pass --device cpu for the CPU")),
    ("cpu", False, None), ("cuda", True, None), ("", False, None), (None, True, None),
])
def test_a_toymlx_backend_that_names_another_device_is_one_line(value, has_gpu, want):
    """TOYMLX_BACKEND chooses what scripts/install.sh installs; no command reads it, so a
    TOYMLX_BACKEND=cuda taken for PyTorch's device switch ran on the CPU without a word."""
    from toymlx.backend.device import backend_variable_note

    note = backend_variable_note(has_gpu, {} if value is None else {"TOYMLX_BACKEND": value})
    assert (note is None) == (want is None)
    if want is not None:
        assert note.startswith(want) and "\n" not in note


def test_select_device_auto_warns_where_toymlx_backend_says_otherwise(monkeypatch):
    import warnings

    import mlx.core as mx

    from toymlx.backend.device import select_device
    from toymlx.backend.notice import ToymlxWarning

    gpu = mx.is_available(mx.gpu)
    monkeypatch.setenv("TOYMLX_BACKEND", "cpu" if gpu else "cuda")
    old = mx.default_device()
    try:
        with pytest.warns(ToymlxWarning) as caught:
            dev = select_device("auto")
        assert dev == (mx.gpu if gpu else mx.cpu)
        [w] = caught
        assert str(w.message).startswith(
            f"TOYMLX_BACKEND={'cpu' if gpu else 'cuda'}: this MLX has {'a' if gpu else 'no'} GPU")
        with warnings.catch_warnings(record=True) as given:
            warnings.simplefilter("always")
            select_device("cpu")  # a device given: the variable does not choose it
        assert given == []
    finally:
        mx.set_default_device(old)


@pytest.mark.parametrize("value, ok", [
    ("off", True), ("", True), ("/var/cache/kernels", True), ("~/kernels", True),
    ("OFF", False), ("0", False), ("false", False), ("kernels", False), ("./kernels", False),
])
def test_a_kernel_cache_that_is_not_off_or_absolute_is_refused(value, ok):
    """TOYMLX_KERNEL_CACHE=OFF, =0 or =false (meant as off) was a folder of that name in the
    folder the command started in: a cache of its own there, its kernels built from nothing."""
    from toymlx.backend.device import check_kernel_cache

    if ok:
        check_kernel_cache({"TOYMLX_KERNEL_CACHE": value})
        return
    with pytest.raises(ValueError) as e:
        check_kernel_cache({"TOYMLX_KERNEL_CACHE": value})
    assert str(e.value) == (
        f"TOYMLX_KERNEL_CACHE: expected off or an absolute folder path, found {value!r}, which "
        "would be a folder of that name in each folder a command starts in; set "
        "TOYMLX_KERNEL_CACHE=off, or an absolute path, or unset it")


def test_a_relative_kernel_cache_is_one_line_from_a_command(stories_path, capsys, monkeypatch,
                                                            tmp_path):
    from cli_errors import error_line
    from toymlx_cli.generate import main as generate_main

    from toymlx.backend import device

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOYMLX_KERNEL_CACHE", "OFF")
    monkeypatch.setattr(device._PROCESS, "set_up", False)
    assert generate_main(["--model", str(stories_path), "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate").startswith(
        "toymlx-generate: error: TOYMLX_KERNEL_CACHE: expected off or an absolute folder path, "
        "found 'OFF'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module", ["train", "generate"])
def test_a_junk_mlx_bfs_width_is_one_line_not_a_hang(module, tmp_path, stories_path):
    """MLX_BFS_MAX_WIDTH=junk (or 0): MLX reads it as a width of 0 and never finishes its first
    evaluation, so every command hung, silent, until killed; now each refuses it first (the
    subprocess timeout only keeps a regression from hanging the suite)."""
    import os

    args = {"train": ["--recipe", "lora", "--base", str(stories_path), "--runs-root",
                      str(tmp_path), "--run-id", "w", "--steps", "2", "--no-progress"],
            "generate": ["--model", str(stories_path), "--prompt", "hi", "--max-tokens", "2"]}
    p = subprocess.run([sys.executable, "-m", f"toymlx_cli.{module}", *args[module]],
                       env={**os.environ, "MLX_BFS_MAX_WIDTH": "junk"}, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        (f"toymlx-{module}: error: MLX_BFS_MAX_WIDTH: expected a whole number other than 0, "
         "found 'junk' (MLX reads it as 0, and with 0 never finishes an evaluation: the "
         "command would hang); unset it, or set it to 1000000 as toymlx does")]
    assert not (tmp_path / "w").exists()


_RESTART_PROBE = """
import json, os
import toymlx
from toymlx.backend.device import restart_with_huge_pages
restart_with_huge_pages()
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"),
                  "marker": os.environ.get("TOYMLX_RESTARTED")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux")
def test_the_blas_warning_is_printed_once_across_the_huge_page_restart():
    """The import's BLAS warning was printed by a command and again by the process that
    replaced it for a huge-page heap; the restarted one now leaves it out (and takes its marker
    out of the environment, so its own children warn for themselves)."""
    import os

    from toymlx.backend.device import HUGE_PAGES_TUNABLE, restart_tunables

    env = {k: v for k, v in os.environ.items() if k not in ("TOYMLX_MALLOC", "GLIBC_TUNABLES")}
    env["TOYMLX_BLAS"] = "/no/such/libblas.so"
    p = subprocess.run([sys.executable, "-c", _RESTART_PROBE], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.stderr.count("TOYMLX_BLAS: expected 'openblas'") == 1, p.stderr
    assert r["marker"] is None
    if restart_tunables() is None:
        pytest.skip("no huge-page restart here (THP mode or glibc): one process, one warning")
    assert r["tunables"] == HUGE_PAGES_TUNABLE  # it did restart
