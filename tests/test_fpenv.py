"""toymlx.backend.fpenv: subnormal floats flushed to zero on exactly the threads that compute a
training step (MLX's stream threads made by `new_streams`, OpenBLAS's workers, the evaluating
thread while it evaluates), kept as IEEE arithmetic has them elsewhere, and a step's losses the
same either way."""

from __future__ import annotations

import platform
import sys

import mlx.core as mx
import numpy as np
import pytest

from toymlx.backend import device, fpenv
from toymlx.training.cpu_streams import new_streams

pytestmark = [pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
    reason="toymlx sets the flush-to-zero mode on Linux x86-64 and arm64 only"),
    pytest.mark.usefixtures("on_cpu")]

TINY = np.float32(1e-38)  # float32's smallest normal is 1.18e-38
SUBNORMAL = float(TINY) * 0.01  # 1e-40 as float32 rounds it


def _subnormals(values: np.ndarray) -> int:
    a = np.abs(np.asarray(values, np.float32))
    return int(((a > 0) & (a < np.finfo(np.float32).tiny)).sum())


def test_the_mode_holds_within_and_is_restored_after():
    assert fpenv.flushing() is False
    assert np.float32(TINY) * np.float32(0.01) != 0  # numpy on this thread: IEEE
    with fpenv.subnormals("flush"):
        assert fpenv.flushing() is True
        assert np.float32(TINY) * np.float32(0.01) == 0
        with fpenv.subnormals("keep"):
            assert fpenv.flushing() is False
        assert fpenv.flushing() is True
    assert fpenv.flushing() is False
    assert np.float32(TINY) * np.float32(0.01) != 0
    with pytest.raises(ValueError, match="subnormals: expected flush or keep, found 'fast'"), \
            fpenv.subnormals("fast"):
        pass


def _chain(stream) -> mx.array:
    """21 elementwise ops on `stream` (enough for MLX to run them on the stream's thread) whose
    exact results are subnormal."""
    with mx.stream(stream):
        y = mx.full((4096,), TINY) * mx.full((4096,), np.float32(0.01))
        for _ in range(20):
            y = y * 1.0 + 0.0
    return y


@pytest.mark.parametrize("mode,want", [("flush", 0.0), ("keep", SUBNORMAL)])
def test_a_streams_thread_computes_in_the_mode_it_was_made_in(mode, want):
    [stream] = new_streams(1, mode)
    y = _chain(stream)
    mx.eval(y)  # evaluated from a thread in the other mode: the stream's thread decides
    got = np.array(y)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=0)


def test_a_matmul_on_blas_worker_threads_flushes_within_a_flushing_step():
    """A 1024 x 1024 product splits over OpenBLAS's threads; with a subnormal operand every row
    is 0 where the step flushes, and the exact 1024 x 1e-39 where it keeps them (its matmuls
    then run on the stream's own thread: OpenBLAS's workers always flush)."""
    a = mx.full((1024, 1024), np.float32(1e-39))
    b = mx.ones((1024, 1024))
    mx.eval(a, b)
    for mode, want in [("flush", 0.0), ("keep", 1024 * float(np.float32(1e-39)))]:
        [stream] = new_streams(1, mode)
        with device.evaluating(device.blas_threads(), mode):
            with mx.stream(stream):
                c = a @ b
            mx.eval(c)
        np.testing.assert_allclose(np.array(c), want, rtol=1e-4, atol=0)


def _stepper(model, loss_fn, batch, mode):
    from toymlx.training.task import Task, TrainConfig
    from toymlx.training.trainer import Stepper

    cfg = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup=0, subnormals=mode, cpu_streams=2)
    stepper = Stepper(Task("test", model, loss_fn, lambda s: batch, [], None, None, {}), cfg)
    stepper.build()
    return stepper


@pytest.mark.parametrize("mode", ["flush", "keep"])
def test_a_training_step_computes_in_its_mode(mode):
    """A step whose products are all subnormal (1e-20 weights times 1e-20 inputs, over 2 CPU
    streams): 0 where the step flushes them, the float64 value where it keeps them."""
    from mlx import nn

    from toymlx.models.ops import Ops

    model = nn.Linear(64, 64, bias=False)
    model.ops = Ops(kernels="vectorised", subnormals=mode)
    model.weight = mx.full((64, 64), np.float32(1e-20))
    x = np.full((1, 4, 8, 64), np.float32(1e-20))

    def loss_fn(m, batch):
        return (m(batch["x"]) * 1e30).sum(), mx.array(1.0)

    loss = _stepper(model, loss_fn, {"x": x}, mode).step(0, {"x": x})["loss"].item()
    # the step's loss: the mean of its two streams' halves of the batch, 2 rows each
    want = 0.0 if mode == "flush" else 2 * 8 * 64 * 64 * float(np.float32(1e-20)) ** 2 * 1e30
    assert loss == pytest.approx(want, rel=1e-3, abs=0)


def test_a_llama_trains_to_the_same_losses_either_way():
    """Three steps of a tiny causal Llama (masked scores at -inf): the same losses with
    subnormals flushed and kept."""
    from toymlx.models.llama import Llama, tiny
    from toymlx.models.losses import lm_loss
    from toymlx.models.ops import training_ops

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (1, 4, 33)).astype(np.int32)
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
             "mask": np.ones((1, 4, 32), np.float32)}
    losses = {}
    for mode in ("flush", "keep"):
        mx.random.seed(0)
        model = Llama(tiny(vocab_size=64, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                           ffn_dim=64), training_ops(False, subnormals=mode))
        stepper = _stepper(model, lm_loss, batch, mode)
        losses[mode] = [stepper.step(s, batch)["loss"].item() for s in range(3)]
    np.testing.assert_allclose(losses["flush"], losses["keep"], rtol=1e-6)


_AFTER_FORK = """
import os
import mlx.core as mx, numpy as np
import toymlx
from toymlx.backend import device
from toymlx.training.cpu_streams import new_streams
a = mx.full((1024, 1024), np.float32(1e-39)); b = mx.ones((1024, 1024)); mx.eval(a, b)
pid = os.fork()  # OpenBLAS ends its workers before a fork, and starts them again later
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
c = mx.random.normal((512, 512)); mx.eval(c @ c)  # this thread, not flushing, calls first
[s] = new_streams(1, "flush")
with device.evaluating(device.blas_threads(), "flush"):
    with mx.stream(s):
        c = a @ b
    mx.eval(c)
print(int((np.array(c) != 0).sum()))
"""


def test_blas_workers_flush_again_after_a_fork():
    """A fork (a subprocess with preexec_fn, multiprocessing) ends OpenBLAS's workers, and the
    next caller that wants them starts them in its own mode: toymlx starts them again, flushing,
    right after the fork (half the product was once computed with subnormals)."""
    import subprocess

    p = subprocess.run([sys.executable, "-c", _AFTER_FORK], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == "0"
