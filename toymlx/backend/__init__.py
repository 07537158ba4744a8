"""The machine under toymlx: BLAS and MLX set-up, CPU kernels, atomic files, locks, child processes. Imports nothing else of toymlx."""
