"""CPU set-up done at import: the malloc settings that keep MLX's buffers in the process."""

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, os
import toymlx
import mlx.core as mx
from toymlx.device import backend_info

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
