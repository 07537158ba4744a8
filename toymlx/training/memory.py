"""Will a fine-tune fit? The peak of a training step estimated from a GGUF header and the options,
before anything is loaded, against the memory this machine has.

The estimate adds, in bytes:
- base: the weights as the run holds them (`base_bytes`; a full fine-tune's trained ones as
  float32): float-held (`--base-dtype` float32/bfloat16/float16), every value at that width;
  held in the file's blocks, each quantized tensor at about its size in the file, F32/F16/BF16
  tensors at 4 bytes a value (norms).
- trained: what training adds: each adapter value with its gradient and AdamW's two moments,
  float32 (16 bytes); a full fine-tune's trained values, held in base at 4 bytes a value, their
  gradients and two moments (12 bytes), one trained block's values once more
  (`UPDATE_BLOCK_COPIES`) and each further CPU stream's gradient (4 bytes). A full fine-tune trains the whole base; with
  --full.layers N, the last N blocks' tensors, the rest held as frozen.
- activations: what the backward pass keeps per token and per block (`_block_values`,
  `BLOCK_D_VALUES`), times the blocks the gradient runs through: those from the first adapted
  or trained block up (--lora.layers, --full.layers) or all (full). With --grad-checkpoint,
  each block's `CHECKPOINT_D_VALUES`, plus one block recomputed. Blocks of different widths
  (gemma4's head widths, kv heads and MLPs) are averaged; a LoRA on `o`, `gate`/`up` or `down`
  keeps that projection's input.
- logits: a trained head's chunk of `toymlx.models.losses.logits_chunk` tokens x vocabulary,
  `LOGITS_COPIES` float32 copies (the logits, the cross-entropy's temporaries and their
  gradients), and the head's float32 weight gradient of every chunk beyond the trained values'
  gradient that `trained` counts (`head_chunk_gradients`); a frozen head's slice of rows
  (`toymlx.models.losses.head_slices`), its logits and weights; each CPU stream the step runs
  on its own, for its share of the tokens.
- decoded: a block-held base's float weights, decoded where used: the largest block-held
  matrix of a block whole, or `Ops.decode_slice` values of it, `DECODED_COPIES` float32 copies;
  or a mixture of experts' largest 3-D expert tensor whole, `EXPERT_DECODED_COPIES` copies;
  each CPU stream the step runs on decodes its own (`step_streams`).
- runtime: Python, MLX and the data (`RUNTIME_BYTES`), MKL where it is the BLAS
  (`BLAS_BYTES`), the tokenizer (`TOKENIZER_BYTES` a vocabulary token) and the heap kept beyond
  MLX's arrays (`HEAP_BYTES` a unit of width and token a CPU stream runs, `FULL_HEAP_BYTES` a
  fully trained value and CPU stream: `runtime_bytes`).
It is an estimate, written to refuse runs that cannot fit, not to predict a peak to the MB.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from toymlx.gguf.blocks import CODECS, held_bytes
from toymlx.gguf.llama import args_from_gguf, block_tensors, tensor_route
from toymlx.gguf.reader import GGUFFile
from toymlx.models.gated_delta import CHUNK
from toymlx.models.llama import LlamaArgs, attention_values
from toymlx.models.losses import head_slices, logits_chunk
from toymlx.models.ops import Ops

RUNTIME_BYTES = 112 * 2**20
"""What a run's RSS holds beyond MLX's arrays and the tokenizer whatever the model: the
interpreter and libraries, the GGUF's header, what `toymlx-train` holds before the base loads.
Session 63 (Intel Xeon model 207, 2 cores, scipy-openblas32's SkylakeX kernels: the BLAS
`RUNTIME_BYTES` stands for; MKL's own is `BLAS_BYTES`): SmolLM2-135M's LoRA q in blocks peaked
at 586 MiB of RSS at 1 x 256 and 1,487-1,490 at 4 x 256, 0-8 over the count with 96 MiB (the
first session with MLX's arrays 64-byte aligned, `toymlx.backend.aligned_buffers`, 2-8 MiB
of heap more in A/B runs); 112 is 16 more.
Measured (session 58, AMD EPYC, 2 cores shared; /proc/PID/status sampled every 20 ms): the
LoRA command on SmolLM2-135M at 84-92 MiB until its weights load (importing toymlx and MLX:
62). Session 57's 160 MiB (86 outside the heap, 48-83 of the heap in use beyond MLX's arrays)
held the heap's tokenizer, counted again by `TOKENIZER_BYTES`: SmolLM2's LoRA q 1 x 256 step
was estimated 18.7% over its peak RSS (1,109 against 935 MiB), then 11.8%. Until session 57 one
fixed 448 MiB stood for all of the runtime: the Llama-3.1-8B shape's 1 x 512 --grad-checkpoint
step was estimated 9% under its peak RSS."""
TOKENIZER_BYTES = 1024
"""Bytes a run holds per vocabulary token for the tokenizer and the header's token lists
(`Tokenizer.from_metadata`; measured: 33 MiB for SmolLM2's 49,152 tokens, 101 for Qwen2's
151,936, 234 for Gemma 4's 262,144)."""
HEAP_BYTES = 256
"""Bytes of RSS per unit of width and token of one CPU stream's share of the batch
(`d_model * batch_size * seq_len / streams`), whatever the blocks, beyond the other parts'
count: the heap glibc and MLX's cache keep above what is in use (a step's freed buffers stay
with the process, `toymlx.backend.device.tune_malloc`, bounded to a step's transient memory)
and MLX's peak beyond the other parts' count. It does not grow with the blocks (the 28- and
32-block shapes kept fewer bytes a unit of width and token than the 16-block one): a block's
transient arrays (its recomputed or cotangent d- and ffn-wide values, its attention's) are
freed and the same sizes allocated again by the next block, so the heap keeps about one
block's worth, not one per block; 256 bytes are 64 d-wide float32 arrays a token. Measured (peak RSS of `toymlx-train --recipe lora` under
/usr/bin/time -v, LoRA rank 8, less the estimate's other parts, bytes a unit of width and
token; AMD EPYC, 2 cores shared, load 3-8): session 59, SmolLM2-135M (30 x 576), q, at
1 x 256 2 (float32 base) and 235 (in blocks), at 4 x 256 (two streams of 512 tokens) 189 and
252, 8 x 128 144; the Llama-3.2-1B shape (16 x 2048), q,v, at 1 x 512 --grad-checkpoint 165
(float32) and 168 (blocks); session 60, the Llama-3.2-3B shape (28 x 3072) the same way 117
(peak RSS 2,643 MiB, MLX's peak 2,231) and the Llama-3.1-8B shape (32 x 4096) 105 (5,521
MiB, MLX 5,043). Until session 60 it was 13 bytes a block, unit of width and token, fitted
on the 8B shape's step of session 56 (817 MiB, 13 bytes): the 3B's step was estimated 14%
over its peak RSS (3,014 MiB against 2,643), the 8B's 11% (6,140 against 5,521); now 8% and
5%. Which buffers they are is not pinned down."""
FULL_HEAP_BYTES = 1
"""Bytes of RSS per fully trained value and CPU stream beyond `HEAP_BYTES`' count: the freed
buffers of its gradient and update a full fine-tune's step leaves in the heap; on two CPU
streams each computes its own float32 gradient of every trained value
(`cpu_streams.make_stream_step`), and each one's freed buffers stay. Measured (session 59, AMD
EPYC, 2 cores, load 4): SmolLM2-135M's full fine-tune at 1 x 256 (134.5 M values) peaked at
2,845 MiB of RSS, 53 over the rest of its count (2,792), 0.4 bytes a value; the Llama-3.2-1B
shape's --full.layers 2 (121.6 M values) at 1 x 512 --grad-checkpoint 4 under (session 58's
peak RSS of 3,220 MiB; session 59's 3,150 and 3,157 in two runs: estimated 3,340). Session 60
(`/usr/bin/time -v`, load 3.5-6): SmolLM2's full 2 x 256, 4 steps, held 287 MiB of RSS above
MLX's peak on one stream (`--cpu-streams 1`: 3,478 against 3,191) and 441 on two (3,970
against 3,529): the second stream 154 MiB more where the tokens a stream runs (half) count 36
less, 1.5 bytes a trained value. Counted once a run until session 60: the two-stream step
estimated 3,960 MiB against 3,939-3,976 (session 59, 6 runs) and 3,970; now 4,069."""
BLAS_BYTES = {"mkl": 40 * 2**20}
"""Bytes of RSS a CPU BLAS holds beyond `RUNTIME_BYTES`' (measured with OpenBLAS), by the name
the process bound (`backend_info()["blas"]`): MKL's larger libraries and its kept work buffers.
Measured (session 63, Intel Xeon model 207, 2 cores, MKL 2026.2; `/usr/bin/time -v`):
SmolLM2-135M's LoRA q 4 x 256 in blocks peaked at 1,517-1,521 MiB of RSS with MKL and
1,487-1,490 with scipy-openblas32 (`TOYMLX_BLAS=openblas`), the same code: 27-34 MiB more (11-14
at 1 x 256); 40 leaves room for the runs' spread."""
ADAPTER_TRAINED_BYTES = 16
"""Bytes an adapter value takes while it trains: itself, its gradient and AdamW's two moments,
float32 (the base does not hold it)."""
FULL_TRAINED_BYTES = 12
"""Bytes a fully trained value takes beyond its float32 self, which base counts: its gradient
and AdamW's two moments (`toymlx.training.optimizers`: the update is in place). Measured
(session 58, AMD EPYC, 2 cores shared; MLX's peak in the steps, MiB): SmolLM2-135M Q4_1's full
fine-tune at 1 x 256 2,561 (counted now 2,594 with `UPDATE_BLOCK_COPIES`' 14), --full.layers 2
in blocks 227 (259), as float32 621 (648), --full.layers 10 in blocks 668 (765). Counted 16
until session 58, the value twice: the full 1 x 256 step 3,410 MiB against a peak RSS of 2,834
(20% over; now 2,847). The Llama-3.2-1B shape's --full.layers 2 at 1 x 512 --grad-checkpoint:
MLX's peak 2,662 or 2,893 MiB a step (`UPDATE_BLOCK_COPIES`), its estimate 3,520 with the value
twice, 2,992 without, now 3,224 against a peak RSS of 3,220."""
UPDATE_BLOCK_COPIES = 1
"""float32 copies of one fully trained block's values (its largest) that a full fine-tune's
step holds beyond its weights, gradients and moments in some steps and not others (`trained`).
Measured (session 58, AMD EPYC, 2 cores; MLX's peak of each step alone, `mx.reset_peak_memory`
before it): the Llama-3.2-1B shape's --full.layers 2 at 1 x 512 --grad-checkpoint, 5 steps of
the same batch shape on two CPU streams, 2,662, 2,893, 2,662, 2,665, 2,893 MiB: 231.5 MiB
apart, one block's 60,821,504 values (232.0 MiB); on one stream 2,664-2,785 in 5 steps, and on
two with every parameter's update on the first (`cpu_streams`' homes emptied) 2,661-2,789 in 8:
it comes of the two streams' AdamW updates (`cpu_streams.make_stream_step`) running at once.
MLX's count is the run's highest, so one such step is the run's peak. Which buffers they are is
not pinned down: MLX allocates an op's output when it hands the op to a stream's thread and
frees its inputs when the thread has run it, so what is alive at once depends on how far ahead
of the threads the step's dispatch runs."""
HEAD_LOGITS_COPIES = 6
"""float32 copies of a frozen head's slice of logits alive at once in the loss
(`toymlx.models.losses.frozen_head_cross_entropy`: the logits, their exponentials, the
soft-cap's slope, masks)."""
LOGITS_COPIES = 16
"""float32 copies of a chunk's logits alive at the peak of its backward pass (measured: the
vectorised CPU kernels compiled ~16, eager ~22; MLX's own ops ~8)."""
DECODED_COPIES = 3
"""float32 copies of the largest decoded slice of a block-held weight alive at once in a step,
per CPU stream (`toymlx.training.cpu_streams`: each stream runs its slice of the batch through
every block, decoding the weights itself). Measured, MLX's peak held in blocks less held as
float32 (less the bases' difference): the 10-block Gemma 4 E2B shape's largest weight (the
shared-KV tail's 12288 x 1536 MLP, 72 MiB) 3.4 copies at 1 x 256 (one stream), 6.0 at 2 x 256
(two); the Llama-3.2-1B shape at 4 x 256 on two streams 5.3 copies of its 48 MB."""
EXPERT_DECODED_COPIES = 4
"""float32 copies of a block-held 3-D expert tensor alive at once in a step, per CPU stream (as
`DECODED_COPIES`; measured on one): it is decoded
whole where it is used (`toymlx.models.moe.BlockExperts`), with the decoding's temporaries
(measured: Qwen3-30B-A3B's shape with 2 blocks, Q4_K_M, 1 x 256 tokens, LoRA q,k,v,o, peaked
3.8 GB by MLX's count over 1.15 GB of blocks: about 3.1 copies of its 805 MB tensors)."""
BLOCK_D_VALUES = 3
"""d_model-wide arrays per token a block keeps for the backward pass: its input and the MLP
norm's input, which their RMSNorms' backward pass reads (`toymlx.backend.fastmath.rms_norm`'s
vjp: x and its rstd), and the attention norm's output, the q, k and v adapters' input. Measured
(`benchmarks/kept_values.py`: MLX's peak of a compiled value_and_grad, 6 blocks less 2, the
SmolLM2-135M shape, LoRA q, float32, the vectorised kernels; AMD EPYC, 2 cores): 7,290-7,306
float32 values a token and block at 1 x 512 (attention recomputed), counted 3 x 576 + q 576 +
k, v 2 x 192 + gate, up, silu 3 x 1,536 = 7,296; 8,833 at 1 x 256 and 8,170 at 1 x 128
(attention kept: its probabilities, 1,440 and 720 counted). The count before session 56 (6 d-wide arrays, SwiGLU's product, q and k
rotated and attention's output on top of q and k as projected) was 13,344 at 1 x 256: SmolLM2's
4 x 256 LoRA step estimated 43% over its peak RSS."""
CHECKPOINT_D_VALUES = 2
"""d_model-wide arrays per token a block keeps with --grad-checkpoint (`Ops.block`'s
`mx.checkpoint`: its input and output, for the recomputation and its vjp). Measured as
`BLOCK_D_VALUES` (1 x 512, LoRA q, 6 blocks less 2): 1,133 float32 values a token and block,
2 x 576 = 1,152 counted. Counted as 1 until session 56: the Llama-3.2-3B shape's 1 x 512 step
(28 blocks of 3,072) 176 MB fewer (its estimate was 5% under its peak RSS, `RUNTIME_BYTES`)."""
GEMMA4_BLOCK_D_VALUES = 5
"""d_model-wide arrays per token a gemma4 block keeps for the backward pass beyond the other
terms of `_block_values` (`BLOCK_D_VALUES`, its two post-norms' inputs): the per-layer
embedding branch's norm's input (`Block.close`), and what the measurement below found beyond
the rest. A bare compiled value_and_grad of a 4-block E2B-width gemma4 (LoRA q, 256 -> 768
tokens) kept 1.2, 1.9 and 1.9 d-wide values a token and block fewer with each of its
post-norms and the per-layer branch's norm made the identity. Measured through the recipe
(`benchmarks/shapes.py`'s E2B at 10 blocks, 5 in the shared-KV tail; 32,768 rows, Q4_K_M, held
in blocks, LoRA q, one stream: 1 x 256 -> 1 x 1024; AMD EPYC, 2 cores): MLX's peak grew
45,225 float32 values a token and block less the frozen head's, 4,830 (3.1 x 1,536) above
session 51's count (6 d-wide arrays, q, k and v as projected, GeGLU's 3 ffn-wide, the per-layer
branch's 3, attention recomputed). Counted now as 3 + 2 + 5 d-wide arrays: 6,144 above that
one, 1,314 values a token and block above the measured peak. (Session 50's 6 came from 1 x 256
-> 4 x 256, where the second CPU stream's decoded weights, 204 MiB, `DECODED_COPIES`, were
spread over the tokens.)"""
AVAILABLE_ENV = "TOYMLX_MEMORY_AVAILABLE"
"""Bytes to take as this machine's available memory instead of asking it (tests only)."""
_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


@dataclass(frozen=True)
class Estimate:
    """A training step's peak, in bytes, by part."""

    base: int
    trained: int
    activations: int
    logits: int
    decoded: int
    runtime: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def record(self) -> dict[str, Any]:
        """What run_start records: each part and the total, in MB."""
        return {f"{k}_mb": round(v / 2**20) for k, v in
                {**asdict(self), "total": self.total}.items()}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in asdict(self).items())
        return f"{self.total / GB:.1f} GB ({parts})"


def projection_dims(a: LlamaArgs) -> dict[str, tuple[int, int]]:
    """(n_out, n_in) of each projection of a block, by --lora.targets name (qwen35: of either
    kind of block, its q carrying the output gate); a mixture of experts' gate, up and down
    summed over its experts ((E * out, E * in): what a LoRA pair per expert holds); gemma4
    E2B/E4B's per-layer-input ple_gate and ple_proj."""
    q, kv, d, f = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.d_model, a.ffn_dim
    if a.fused_qkv:
        dims = {"qkv": (q + 2 * kv, d)}
    else:
        dims = {"q": (2 * q if a.attn_out_gate else q, d), "k": (kv, d), "v": (kv, d)}
    dims["o"] = (d, q)
    if a.n_experts:  # a mixture of experts: its router, and its experts' 3-D tensors
        e, f = a.n_experts, a.expert_width
        dims.update({"gate": (e * f, e * d), "up": (e * f, e * d), "down": (e * d, e * f),
                     "router": (e, d)})
        return dims
    dims.update({"gate_up": (2 * f, d)} if a.fused_gate_up else {"gate": (f, d), "up": (f, d)})
    dims["down"] = (d, f)
    if a.per_layer_dim:  # gemma4's per-layer-input gate and projection
        dims.update({"ple_gate": (a.per_layer_dim, d), "ple_proj": (d, a.per_layer_dim)})
    if a.linear_layers:  # Gated DeltaNet's (toymlx.models.gated_delta)
        hv, dk = a.ssm_v_heads, a.ssm_head_dim
        dims.update({"qkv": (2 * a.ssm_k_heads * dk + hv * dk, d), "z": (hv * dk, d),
                     "beta": (hv, d), "alpha": (hv, d), "out": (d, hv * dk)})
    return dims


def _block_values(a: LlamaArgs, seq_len: int, ops: Ops, targets: tuple[str, ...] = ()) -> int:
    """Values one block keeps per token for the backward pass, averaged over the blocks: its
    input, the attention norm's output (the q, k and v adapters' input) and the MLP norm's
    input (`BLOCK_D_VALUES`), the post-norms' inputs where the model has them; q, k and v as
    projected (each block at its own head width and kv heads, a block reading an earlier one's
    keys and values projecting none); the MLP's gate, up and activation (SwiGLU's silu, GeGLU's
    tanh, `Ops.gelu_mul`). A frozen projection's backward pass needs no input, so the MLP
    norm's output and down's input are kept only for adapters on them (`_target_inputs`).
    Attention's own activations (q and k rotated, each head's probabilities, its output:
    `attention_values`) are recomputed in the backward pass (`Ops.recomputed`), starting from
    q, k and v as projected (qk_norm's norms too: the SmolLM2 shape of `BLOCK_D_VALUES` kept
    7,290 values with them), unless they are few enough to keep (`Ops.keeps_attention`): then
    the probabilities (q and k rotated take the place of q and k as projected; RoPE's backward
    pass reads neither) and with qk_norm q and k before their norms; or the block is the one
    `--grad-checkpoint` is recomputing, which keeps them all. Kept attention keeps its output
    too: its backward pass sums dO * O over a head's width (`toymlx.backend.fastmath.attention`;
    session 63, SmolLM2-135M's LoRA q 4 x 256: 62-64 MiB of peak RSS more than sums over the
    keys, which read no output; these count 67.5). Gemma4's shared-KV tail
    recomputes its attention too (`Attention.__call__` with an earlier block's keys and
    values); its blocks keep `GEMMA4_BLOCK_D_VALUES` more d-wide arrays."""
    n, d = a.n_layers, a.d_model
    q = sum(a.n_heads * a.layer_head_dim(i) for i in range(n)) // n  # gemma4's differ
    kv = sum(a.kv_heads(i) * a.layer_head_dim(i) for i in range(n) if a.kv_source(i) is None) // n
    f = sum(a.layer_ffn(i) for i in range(n)) // n  # gemma4's differ
    mlp = 3 * f
    if a.n_experts:  # the router's probabilities; each chosen expert's gate, up, product, down
        mlp = (2 * a.n_experts + a.n_experts_used * (3 * a.expert_width + d)
               + 4 * a.shared_expert_ffn_dim)  # qwen2moe's shared expert: a dense MLP
    norms = BLOCK_D_VALUES + (2 if a.post_norms else 0)
    kept = norms * d + q + 2 * kv + mlp + 3 * a.per_layer_dim  # gemma4's PLE: gate, GELU, product
    if a.arch == "gemma4":
        kept += GEMMA4_BLOCK_D_VALUES * d
    if a.linear_layers:  # every block counted as a Gated DeltaNet one, the larger: by chunks
        # of CHUNK tokens its delta rule keeps about 16 (CHUNK, CHUNK) matrices (decays, the
        # inverse's powers and products) and 2 (dk, dv) states per chunk, per value head
        kept += a.ssm_v_heads * (16 * CHUNK + 2 * a.ssm_head_dim ** 2 // CHUNK)
    kept += _target_inputs(a, targets, d, f, q)
    attention = attention_values(a, seq_len)
    normed = q + kv if a.qk_norm or a.qk_norm_whole else 0  # q and k before their norms
    if ops.grad_checkpoint:
        return kept + attention + normed
    if ops.keeps_attention(attention):  # and its output: softmax's backward row sums read it
        return kept + attention_probabilities(a, seq_len) + q + normed
    return kept


def attention_probabilities(a: LlamaArgs, seq_len: int) -> int:
    """Of `attention_values`, the heads' probabilities: what a block that keeps its attention
    keeps beyond q, k and v (their rotated forms take the place of the projected ones) and its
    output (`_block_values` adds that)."""
    return attention_values(a, seq_len) - (2 * a.n_heads * a.head_dim + a.n_kv_heads * a.head_dim)


def _target_inputs(a: LlamaArgs, targets: tuple[str, ...], d: int, f: int, q: int) -> int:
    """Values per token a block keeps for its adapters' gradients beyond what its backward pass
    keeps anyway: `o`'s input (the attention's output), the MLP norm's output (gate's and up's
    input) and `down`'s input (the activation times up); a mixture of experts' are counted in
    its MLP; gemma4's `ple_gate`'s input (the block's residual after its MLP, d wide) and
    `ple_proj`'s (the per-layer branch's GELU product, per_layer_dim wide). Those two measured
    (`benchmarks/kept_values.py --gemma4`, 1 x 256, against LoRA q; AMD EPYC, 2 cores shared):
    ple_gate 1,292 float32 values a token and block (counted 1,536), ple_proj within the
    measurement's noise (-628; counted 256), both 1,172 (counted 1,792). LoRA
    q,k,v,o,gate,up,down kept, above LoRA q (MLX's count, less the adapters' own), 2,453
    float32 values a token and block on the SmolLM2-135M shape (as `BLOCK_D_VALUES`, 1 x 256;
    these count 2,688), 13,760 on the 10-block gemma4 shape of `GEMMA4_BLOCK_D_VALUES` at
    4 x 256 (these count 13,209)."""
    return ((q if "o" in targets else 0)
            + (d if {"gate", "up", "gate_up"} & set(targets) and not a.n_experts else 0)
            + (f if "down" in targets and not a.n_experts else 0)
            + (d if "ple_gate" in targets else 0)
            + (a.per_layer_dim if "ple_proj" in targets else 0))


def base_bytes(g: GGUFFile, held: str, trained: frozenset[str] = frozenset()) -> int:
    """The frozen weights as `load_llama` holds them with `held` (`--base-dtype` resolved): each
    tensor by its route (`tensor_route`): the file's blocks at their split size, MLX's quantized
    layers at their packed codes plus float32 scales and biases, floats at their width; the
    `trained` ones (a full fine-tune's) are not counted."""
    total = 0
    for name, t in g.tensors.items():
        if name in trained:
            continue
        route = tensor_route(g, name, held)
        if route == "blocks":
            total += held_bytes(CODECS[t.type], t.shape)
        elif route == "mlx":
            bits = 8 if t.type_name == "Q8_0" else 4
            total += t.n_elements * bits // 8 + t.n_elements // 32 * 8
        else:
            total += t.n_elements * (4 if len(t.shape) == 1 else _WIDTH.get(held, 4))
    return total


def estimate(g: GGUFFile, *, held: str, full: bool, targets: tuple[str, ...], rank: int,
             layers: int | None, dora: bool, batch_size: int, seq_len: int, ops: Ops,
             streams: int = 1, blas: str | None = None) -> Estimate:
    """The peak of one training step of the model in `g` with these options, computed with
    `ops` (the run's math: its dtype, `--grad-checkpoint`, decode slices and what attention
    keeps) on `streams` CPU streams (`step_streams`) with the CPU BLAS `blas` (its name in
    `backend_info()`; None on a GPU) (module docstring)."""
    a = args_from_gguf(g)
    tokens = batch_size * seq_len
    width = _WIDTH.get(ops.dtype, 4)
    train = (block_tensors(g.tensors, range(a.n_layers - min(layers, a.n_layers), a.n_layers))
             if full and layers else frozenset())
    # a fully trained value is held in base (float32): trained adds its gradient and AdamW's
    # two moments, 12 bytes (16 counted it twice: SmolLM2-135M's full 1 x 256 step 531 MiB
    # over MLX's peak)
    if full and not layers:
        n = sum(t.n_elements for t in g.tensors.values())
        base, trained, blocks = n * 4, n * FULL_TRAINED_BYTES, a.n_layers
    elif full:  # the last `layers` blocks trained (float32), the rest held as frozen
        n = sum(g.tensors[name].n_elements for name in train)
        base, trained = base_bytes(g, held, train) + n * 4, n * FULL_TRAINED_BYTES
        blocks = min(layers, a.n_layers)
    else:
        dims = projection_dims(a)
        blocks = min(layers or a.n_layers, a.n_layers)
        per_block = sum(rank * (dims[t][0] + dims[t][1]) + (dims[t][0] if dora else 0)
                        for t in targets)
        base, trained = base_bytes(g, held), per_block * blocks * ADAPTER_TRAINED_BYTES
        n = 0  # no base value trained
    if full:
        trained += (block_values(g, range(a.n_layers - blocks, a.n_layers)) * 4
                    * UPDATE_BLOCK_COPIES)
    # each CPU stream beyond the first holds its own float32 gradient of the trained values
    # until the update sums them (`cpu_streams.make_stream_step`): SmolLM2-135M's full 2 x 256
    # step on two streams peaked at 3,530 MiB by MLX's count, 410 over the count without it
    trained += n * 4 * (streams - 1)
    # a full fine-tune trains every projection: each keeps its input, as an adapter's does
    per_block = (_block_values(a, seq_len, ops, tuple(projection_dims(a)) if full else targets)
                 * tokens * width)
    if ops.grad_checkpoint:
        acts = blocks * tokens * CHECKPOINT_D_VALUES * a.d_model * width + per_block
    else:
        acts = blocks * per_block
    share = tokens // streams  # each CPU stream runs its share of the batch, and its loss
    if full and not layers:  # a trained head: a chunk of tokens' logits at a time
        chunk = logits_chunk(a.vocab_size, ops.logits_values)
        logits = (min(share, chunk) * a.vocab_size * 4 * LOGITS_COPIES
                  + head_chunk_gradients(a, share, chunk, n)) * streams
    else:  # a frozen head: a slice of its rows at a time (`head_slices`): its logits, their
        # softmax and gradient (HEAD_LOGITS_COPIES), and its weights decoded (and cast)
        (lo, hi), = head_slices(a.vocab_size, share, a.d_model, ops.logits_values)[:1]
        logits = (hi - lo) * (HEAD_LOGITS_COPIES * share + 2 * a.d_model) * 4 * streams
    held_as_blocks = [t.n_elements for name, t in g.tensors.items()
                      if name.startswith("blk.") and len(t.shape) == 2
                      and tensor_route(g, name, held, train) == "blocks"]
    largest = max(held_as_blocks, default=0)
    experts = max((t.n_elements for name, t in g.tensors.items() if len(t.shape) == 3
                   and tensor_route(g, name, held, train) == "blocks"), default=0)
    decoded = max(min(largest, ops.decode_slice or largest) * DECODED_COPIES,
                  experts * EXPERT_DECODED_COPIES) * 4 * streams
    return Estimate(base, trained, acts, logits, decoded, runtime_bytes(a, share, n, streams, blas))


def head_chunk_gradients(a: LlamaArgs, share: int, chunk: int, trained: int) -> int:
    """Bytes a trained head's loss holds beyond the `trained` values' float32 gradient, on one
    CPU stream running `share` tokens: each `chunk` of tokens' logits
    (`toymlx.models.losses.masked_ce`) gives the head its own vocabulary x width float32
    gradient, all of them alive until they are summed, at the start of the backward pass
    before any block's gradient exists. Measured (session 60, AMD EPYC, 2 cores, load 4-6;
    MLX's peak, MiB): SmolLM2-135M's full fine-tune on one stream at 1 x 256 (4 chunks of 64
    tokens, 432 MiB of them under its 513 MiB gradient) 2,561, at 2 x 256 (8 chunks) 3,191,
    at 2 x 256 in 16 chunks of 32 tokens 4,002: 101 MiB a chunk, the head's gradient 108 MiB;
    estimated 2,927 and 2,831 without these."""
    return max(0, -(-share // chunk) * a.vocab_size * a.d_model * 4 - trained * 4)


def block_values(g: GGUFFile, blocks: range) -> int:
    """The values of the largest of `blocks` (its `blk.N.*` tensors): `UPDATE_BLOCK_COPIES`."""
    return max((sum(g.tensors[name].n_elements for name in block_tensors(g.tensors, (i,)))
                for i in blocks), default=0)


def runtime_bytes(a: LlamaArgs, share: int, trained: int = 0, streams: int = 1,
                  blas: str | None = None) -> int:
    """What a run of the model `a` holds beyond MLX's arrays at its peak, its steps running
    `share` tokens on each of `streams` CPU streams and fully training `trained` values, with
    the CPU BLAS named `blas` (None on a GPU): `RUNTIME_BYTES`, the tokenizer's
    `TOKENIZER_BYTES` a vocabulary token, `HEAP_BYTES` a unit of width and token,
    `FULL_HEAP_BYTES` a trained value and stream, and `BLAS_BYTES` for that BLAS."""
    return (RUNTIME_BYTES + TOKENIZER_BYTES * a.vocab_size
            + HEAP_BYTES * a.d_model * share + FULL_HEAP_BYTES * trained * streams
            + BLAS_BYTES.get(blas or "", 0))


def step_streams(requested: int, batch_size: int) -> int:
    """The CPU streams a step of `batch_size` rows runs on (`cpu_streams.stream_count` of
    --cpu-streams; one where the batch does not split evenly over them, as
    `cpu_streams.make_stream_step` runs it): each decodes a block-held base's weights itself."""
    from toymlx.training import cpu_streams

    n = cpu_streams.stream_count(requested)
    return n if batch_size % n == 0 else 1


def available_memory() -> tuple[int | None, str]:
    """(bytes this process may use, where that came from); (None, why) where it is unknown.
    Linux: /proc/meminfo's MemAvailable, or where MLX computes on a CUDA GPU that GPU's free
    memory (`cuda_free_memory`: the step's arrays live there, not in the host's RAM); a Mac's
    GPU: MLX's max recommended working set."""
    env = os.environ.get(AVAILABLE_ENV)
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{AVAILABLE_ENV}: expected a number of bytes (0 or more), found "
                             f"{env!r}")
        return n, AVAILABLE_ENV
    if sys.platform == "darwin":
        import mlx.core as mx

        try:
            ws = mx.device_info().get("max_recommended_working_set_size")
        except Exception:  # noqa: BLE001  (a build without Metal)
            ws = None
        if ws:
            return int(ws), "MLX's max recommended working set"
    gpu = cuda_free_memory()
    if gpu is not None:
        return gpu, "the CUDA GPU's free memory (MLX's device_info)"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return None, "unknown on this platform"


def cuda_free_memory() -> int | None:
    """The free memory of MLX's default device where it is a CUDA GPU (MLX 0.32's
    `device_info()` free_memory, else total_memory), None elsewhere or where MLX does not say."""
    from toymlx.backend import device

    if device.gpu_kind() != "cuda":
        return None
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001  (device_info is backend-specific)
        return None
    n = info.get("free_memory", info.get("total_memory"))  # 0 free is 0, not the total
    return int(n) if isinstance(n, int) else None


LOADING_NOTE_BYTES = 2**30
"""A model held in this much or more is announced before it loads (`loading_note`): reading and
decoding it takes seconds with nothing else on screen (the Llama-3.2-1B shape's Q4_K_M, 4.3 GB
as float32: 13 s on 2 AMD EPYC cores to train from, 16 s to generate from)."""


def loading_note(path: str | os.PathLike, types: str, held: str, nbytes: int) -> str | None:
    """The line said before a large model (`LOADING_NOTE_BYTES` or more as held) loads: the
    file, its size and tensor types, how it is held (`held`) and in how much (`nbytes`, e.g.
    `base_bytes`); None for a small one. The one announcement of a load, for every command."""
    if nbytes < LOADING_NOTE_BYTES:
        return None
    return (f"loading {os.path.basename(path)} ({os.path.getsize(path) / GB:.1f} GB, {types}) "
            f"held as {held}: about {nbytes / GB:.1f} GB")


def within_half_available(need: int) -> tuple[bool, int | None]:
    """(whether `need` bytes take at most half the memory available, True where that is
    unknown; the bytes available or None): the rule by which the CPU holds a frozen base as
    float32 rather than its quantized blocks (`toymlx-generate`, `--base-dtype auto`)."""
    have, _ = available_memory()
    return have is None or need <= have // 2, have


def check_fits(est: Estimate, source: str, force: bool, grad_checkpoint: bool = False,
               blocks_smaller: bool = False, streams: int = 1) -> dict[str, Any]:
    """ValueError in one line when `est` exceeds the available memory (unless `force`), its
    advice what the run does not do already: --grad-checkpoint unless on, --base-dtype blocks
    where `blocks_smaller` (a float-held base its blocks would hold in less), --cpu-streams 1
    where the step fits with one stream's decoded floats: on `streams` CPU streams each decodes
    a block-held base's weights itself (`est.decoded`; a mixture of experts' 3-D tensors whole,
    the Qwen3-30B-A3B shape's 805 MB 4 copies a stream: 6.4 GB on two); with `force`, that line
    on stderr, starting anyway; else what run_start records: the estimate, what was available
    and from where."""
    avail, where = available_memory()
    if avail is not None and est.total > avail:
        over = (f"{source}: a training step needs about {est.describe()} and "
                f"{avail / GB:.1f} GB is available ({where})")
        if force:
            print(f"toymlx: {over}; starting anyway (--force)", file=sys.stderr)
        else:
            tries = ([] if grad_checkpoint else ["--grad-checkpoint"]) + (
                ["--base-dtype blocks"] if blocks_smaller else []) + (
                ["--cpu-streams 1"] if est.total - est.decoded + est.decoded // streams
                <= avail else []) + [
                "a smaller --batch-size or --seq-len", "fewer --lora.layers"]
            raise ValueError(f"{over}; expected at most that: try {', '.join(tries)}, or "
                             "--force to start anyway")
    return {"estimate": est.record(), "available_mb": None if avail is None
            else round(avail / 2**20), "available_from": where, "forced": bool(force)}
