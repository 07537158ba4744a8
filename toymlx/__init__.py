"""toymlx: train and fine-tune small models with MLX, exchange them with llama.cpp as GGUF."""

import os as _os
import sys as _sys

# MLX orders each evaluation breadth-first up to this width, then depth-first. The CPU training
# step runs slices of the batch on parallel streams (toymlx.trainer.make_step); a narrow
# breadth-first order queues one slice's ops long before the other's, and with at most 10
# tasks in flight the other stream then waits (2 streams: 1.08x slower than 1 at width 20,
# 0.90x at full width). Read once, by MLX's first evaluation. Linux only: on macOS the step
# runs on the GPU or on one stream (Accelerate's threads are not toymlx's to share out).
if _sys.platform.startswith("linux"):
    _os.environ.setdefault("MLX_BFS_MAX_WIDTH", "1000000")

from toymlx import device as _device

_device.preload_blas()  # must precede the first `import mlx.core`
_device.tune_malloc()

__version__ = "0.2.0"
