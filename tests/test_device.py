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
    # step's pages
    assert plain["faults"] > 10_000, plain
    assert tuned["faults"] < plain["faults"] / 10, (tuned, plain)


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
