"""toymlx: train and fine-tune small models with MLX, exchange them with llama.cpp as GGUF."""

from toymlx.device import preload_blas as _preload_blas

_preload_blas()  # must precede the first `import mlx.core`

__version__ = "0.1.0"
