"""toymlx: train and fine-tune small models with MLX, exchange them with llama.cpp as GGUF."""

from toymlx.backend import aligned_buffers as _aligned_buffers

_aligned_buffers.install()  # before mlx.core loads: see toymlx.backend.aligned_buffers

try:
    import mlx.core as _mx  # noqa: F401
except ImportError as _e:  # no backend library (Linux: mlx without its [cpu]/[cuda] extra)
    raise ImportError(
        f"toymlx: MLX cannot load ({_e}). On Linux MLX needs a backend: "
        "pip install 'toymlx[cpu]', or 'toymlx[cuda]' for an NVIDIA GPU with CUDA 13 drivers "
        "('toymlx[cuda12]' for CUDA 12); install only one of them") from None

from toymlx.backend import device as _device

_device.bind_blas()  # MLX's CPU matmuls to an optimised BLAS (see toymlx.backend.device)

__version__ = "0.2.0"

from toymlx import _moved

_moved.install()  # toymlx 0.2's flat module paths, for one more release (toymlx._moved)

from toymlx.runner.api import (  # the Python entry point (toymlx.runner.api)
    OptionError,
    TrainError,
    train,
)

__all__ = ["OptionError", "TrainError", "__version__", "train"]
