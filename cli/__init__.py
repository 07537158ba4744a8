"""Thin command-line entry points (installed as `toymlx_cli`)."""
