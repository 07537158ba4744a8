"""GGUF reading and writing: one validated parser, one atomic writer, and the name maps."""

from toymlx.gguf.reader import GGUFError, GGUFFile, read_metadata
from toymlx.gguf.writer import write_gguf

__all__ = ["GGUFError", "GGUFFile", "read_metadata", "write_gguf"]
