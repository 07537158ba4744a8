"""toymlx: train and fine-tune small models with MLX, exchange them with llama.cpp as GGUF."""

from toymlx import device as _device

_device.preload_blas()  # must precede the first `import mlx.core` (see toymlx.device)

__version__ = "0.1.0"
