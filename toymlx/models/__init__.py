"""Model architectures, written in mlx.nn. Nothing here imports the rest of toymlx."""
