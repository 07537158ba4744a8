"""A llama_cpp package for tests whose quantizer runs two minutes, put first on a child's path:
a command stopped while llama.cpp quantizes (one long call into C) has to act before it
returns."""

from __future__ import annotations

import os
from pathlib import Path

SLOW_LLAMA_CPP = """\
# llama_cpp as a test stands it in: a quantizer that marks its output with its process id and
# then runs for two minutes (llama.cpp's own on an 8B model: minutes, in one call into C)
import ctypes, os, time
class _Params(ctypes.Structure):
    _fields_ = [("ftype", ctypes.c_int)]
def llama_model_quantize_default_params():
    return _Params()
def llama_log_callback(f):
    return f
def llama_log_set(callback, user_data):
    pass
def llama_model_quantize(src, dst, params):
    with open(dst, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    return 0
"""


def slow_llama_cpp(tmp_path: Path) -> dict:
    """An environment whose llama_cpp quantizes for two minutes (`SLOW_LLAMA_CPP`)."""
    shim = tmp_path / "slow" / "llama_cpp"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SLOW_LLAMA_CPP)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
