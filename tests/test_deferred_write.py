"""write_gguf's Deferred tensors: the same file as tensors given whole, one made at a time."""

from __future__ import annotations

import filecmp

import numpy as np

from toymlx.gguf.reader import DIGEST_KEY, GGUFFile, data_digest
from toymlx.gguf.writer import Deferred, encode_tensor, encoded_type, write_gguf


def test_deferred_tensors_write_the_same_bytes_and_digest(tmp_path):
    rng = np.random.default_rng(0)
    ws = {"a.weight": rng.normal(size=(64, 32)).astype(np.float32),
          "b.weight": rng.normal(size=(7,)).astype(np.float32),
          "c.weight": rng.normal(size=(32, 64)).astype(np.float32)}
    meta = {"general.architecture": "llama", "general.name": "t"}
    for dtype in ("f32", "f16", "bf16", "q8_0"):
        made = []

        def make(n, dtype=dtype, made=made):
            made.append(n)
            return encode_tensor(n, ws[n], dtype)

        whole = write_gguf(tmp_path / f"whole-{dtype}.gguf", meta,
                           {n: encode_tensor(n, w, dtype) for n, w in ws.items()})
        lazy = write_gguf(tmp_path / f"lazy-{dtype}.gguf", meta,
                          {n: Deferred(encoded_type(w.shape, dtype), w.shape,
                                       lambda n=n: make(n)) for n, w in ws.items()})
        assert made == list(ws)
        assert filecmp.cmp(whole, lazy, shallow=False), dtype
        g = GGUFFile(lazy)
        assert g.metadata[DIGEST_KEY] == data_digest(lazy, g.data_start)
        g.close()
