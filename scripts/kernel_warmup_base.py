"""Write the base GGUF the installer's LoRA kernel warm-up trains (scripts/install_env.sh,
`build_kernels`): a two-layer SmolLM2-shaped Llama, random weights, toymlx's byte tokenizer
padded with unused tokens to a 4,096-token vocabulary.

Why this shape: MLX names each CPU kernel it compiles after the fused operations and the
constants in them, not the arrays' sizes, so a LoRA step on this base builds the kernels of a
LoRA step on any Llama-family base but for those few that hold a number of its own (the
schedule's, for instance). The vocabulary is wider than one slice of the frozen head
(`toymlx.models.losses.head_slices`), so the kernels of a head read in slices are built too:
with the byte vocabulary alone (259 tokens, one slice) a SmolLM2-135M run still built 5 more.

    python scripts/kernel_warmup_base.py OUT.gguf
"""

from __future__ import annotations

import sys

import mlx.core as mx

from toymlx.data.vocab import K_SCORES, K_TOKENS, K_TYPES, UNUSED, byte_metadata
from toymlx.gguf.llama import write_llama
from toymlx.models.llama import Llama, smollm2_135m

VOCAB = 4096
"""Four slices of the frozen head at the recipe's default 4 x 256 tokens."""


def main(out: str) -> None:
    meta = byte_metadata()
    pad = VOCAB - len(meta[K_TOKENS])
    meta[K_TOKENS] = meta[K_TOKENS] + [f"<unused{i}>" for i in range(pad)]
    meta[K_SCORES] = meta[K_SCORES] + [0.0] * pad
    meta[K_TYPES] = meta[K_TYPES] + [UNUSED] * pad
    mx.random.seed(0)
    model = Llama(smollm2_135m(n_layers=2, vocab_size=VOCAB))
    mx.eval(model.parameters())
    write_llama(out, model, meta)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/kernel_warmup_base.py OUT.gguf")
    main(sys.argv[1])
