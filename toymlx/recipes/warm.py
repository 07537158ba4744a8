"""Warm start: a Llama whose token table comes from a donor GGUF, seen through a learned lens.

The student keeps the donor's table at the donor's width `Dd` and learns a lens `(Dd, D)` into
its own width `D`. Every use of the table goes through the folded matrix `W = table @ lens`
`(V, D)`: the input embedding is a row of `W` and a tied output head is `h @ W^T`. So a
checkpoint is a plain llama GGUF whose `token_embd.weight` is exactly `W` (llama.cpp rejects
extra tensors in a model file), and its logits are the training model's.

To resume exactly, the unfolded table and the lens go in a side file beside each checkpoint,
`step_N.warm.safetensors`, written atomically before the GGUF (like the optimizer state), so
whenever `weights/latest` names a GGUF its side file is complete too.

The donor is read through toymlx's validated GGUF reader (never `mx.load`: it segfaults on
float64 metadata, decodes Q4_K wrongly and copies the whole file to read one tensor); the
reader decodes F32/F16/BF16 exactly and every quantized type with gguf-py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np
from mlx import nn

from toymlx.backend.lifeline import watch_parent
from toymlx.backend.stop import in_child
from toymlx.bundle import checkpoint as ck
from toymlx.gguf.llama import ARCHS, SUPPORTED, check_model_kind, llama_tensors, load_llama_weights
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.llama import Llama, LlamaArgs
from toymlx.models.ops import EXACT, Ops

LensMode = Literal["pca", "random", "identity"]


@dataclass(frozen=True)
class Donor:
    """What warm start takes from a donor GGUF."""

    path: str
    width: int
    """llama.embedding_length, checked against the table."""
    table: np.ndarray
    """token_embd.weight decoded to float32, (vocab, width)."""
    tensor_type: str
    """GGML type the table was stored as (F32, Q8_0, Q4_K, ...)."""
    metadata: dict[str, Any]
    unread: int = 0
    """The donor's other tensors (its blocks, norm and head): not read, said in one line
    (`Donor.note`)."""

    def note(self, given: str | None = None) -> str:
        """What warm start takes from the donor and what it leaves, in one line; `given`: the
        --donor as typed, named beside the file where it is a store name (`ollama:...`)."""
        rows, width = self.table.shape
        shown = self.path if given in (None, self.path) else f"{given} ({self.path})"
        return (f"--donor {shown}: takes token_embd.weight ({rows} x {width}, "
                f"{self.tensor_type}) and its tokenizer; its {self.unread} other tensors (blocks, "
                "norm, head) are not read: the student's blocks start from random init")


def read_donor(path: str | os.PathLike, vocab: int | None = None) -> Donor:
    """The donor's table: its first `vocab` rows (default: one per tokenizer token).

    Raises GGUFError (one line naming file, key or tensor, expected and found) for a missing
    or unreadable file, a non-GGUF, an architecture toymlx does not load, no token_embd.weight, a table
    whose width is not <arch>.embedding_length, or fewer rows than asked for.
    """
    g = GGUFFile(path)  # missing, unreadable, not GGUF, truncated: one-line GGUFError
    check_model_kind(g, "--donor")
    arch = g.metadata.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{g.path}: metadata key 'general.architecture': expected one of "
                        f"{SUPPORTED} (a decoder donor), found {arch!r}")
    width = g.get(f"{arch}.embedding_length", int)
    name = "token_embd.weight"
    if name not in g.tensors:
        raise GGUFError(f"{g.path}: tensor {name!r}: expected present (the donor's token "
                        f"table), found {g.missing()}")
    info = g.tensors[name]
    if len(info.shape) != 2 or info.shape[1] != width:
        raise GGUFError(f"{g.path}: tensor {name!r} shape: expected (n_vocab, {width}) from "
                        f"{arch}.embedding_length={width}, found {info.shape}")
    rows = info.shape[0]
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    want = vocab or n_tokens or rows  # a padded table's extra rows have no token
    if want > rows:
        why = "--warm.vocab" if vocab else "one per token of tokenizer.ggml.tokens"
        most = min(rows, n_tokens or rows)  # a padded table's extra rows have no token
        fix = f"; use --warm.vocab {most} or less (the donor's whole vocabulary)" if vocab else ""
        raise GGUFError(f"{g.path}: tensor {name!r} rows: expected at least {want} ({why}), "
                        f"found {rows}{fix}")
    table = g.load(name)[:want]
    return Donor(g.path, width, np.ascontiguousarray(table), info.type_name, dict(g.metadata),
                 unread=len(g.tensors) - 1)


# ---- lenses ------------------------------------------------------------------------------------
def pca_basis(table: np.ndarray, width: int) -> np.ndarray:
    """(Dd, width): the table's top principal directions (orthonormal columns), best first.

    When the student is wider than the donor, all Dd directions are kept and the extra
    columns are zero (orthonormal rows instead: nothing is lost, nothing is invented).
    """
    t = table.astype(np.float64)
    _, _, vt = np.linalg.svd(t - t.mean(axis=0), full_matrices=False)  # vt: (min(V,Dd), Dd)
    k = min(width, vt.shape[0])
    basis = np.zeros((table.shape[1], width))
    basis[:, :k] = vt[:k].T
    return basis


def random_basis(donor_width: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """(Dd, width) with orthonormal columns (or rows, if wider) in a random orientation."""
    g = rng.standard_normal((max(donor_width, width), min(donor_width, width)))
    q, _ = np.linalg.qr(g)  # (max, min) orthonormal columns
    return q if donor_width >= width else q.T


def rms(x: np.ndarray) -> float:
    """Per-element root mean square."""
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def make_lens(mode: LensMode, table: np.ndarray, width: int,
              rng: np.random.Generator) -> np.ndarray:
    """The initial lens (Dd, width), float32.

    Every mode starts the student's embedding `table @ lens` at the donor table's per-element
    RMS, the scale the donor's blocks were trained to read: identity (exactly I) by
    construction, pca and random as an orthonormal basis times one number. (Scaling the folded
    table down to a from-scratch embedding's N(0, 0.02) trained clearly worse: 3.82 against
    3.53 validation loss after 150 steps for stories260K -> a 32-wide student.)

    pca and random run in a child process (`pca_lens`, `random_lens`), so that a stop acts at
    once, not after their long numpy calls on the table.
    """
    dd = table.shape[1]
    if mode == "identity":
        if dd != width:
            raise ValueError(f"--warm.lens identity: expected the student width (--model.d-model)"
                             f" to equal the donor width {dd}, found {width}; use pca or random")
        return np.eye(dd, dtype=np.float32)
    if mode == "pca":
        return pca_lens(table, width)
    if mode == "random":
        return random_lens(table, random_basis(dd, width, rng))
    raise ValueError(f"--warm.lens: expected pca, random or identity, found {mode!r}")


def scaled_lens(table: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """`basis` (Dd, width) times the one number that keeps `table @ lens` at the table's RMS,
    float32."""
    scale = rms(table) / max(rms(table.astype(np.float64) @ basis), 1e-30)
    return (basis * scale).astype(np.float32)


def pca_lens(table: np.ndarray, width: int) -> np.ndarray:
    """`scaled_lens` of `pca_basis`, computed in a child process (`lens_in_child`): the SVD of
    SmolLM2's table is one numpy call of 6-7 s, in which this process would run no stop
    handler, so a SIGTERM or Ctrl-C waited for it; now it acts within 0.05 s. The same numpy
    code, so the same lens, bit for bit."""
    return lens_in_child("--warm.lens pca", table, width)


def random_lens(table: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """`scaled_lens` of `basis` (`random_basis`, drawn here), computed in a child process
    (`lens_in_child`): its RMS of the table and `table @ basis` in float64 are long numpy calls
    (a SIGTERM waited 12 s for them on a 49152 x 3072 table on 2 CPU cores). The same lens, bit
    for bit."""
    return lens_in_child("--warm.lens random", table, basis.shape[1], basis)


def lens_in_child(what: str, table: np.ndarray, width: int,
                  basis: np.ndarray | None = None) -> np.ndarray:
    """The (Dd, width) float32 lens `_lens_child` computes in a child process (`in_child`, which
    a stop kills at once): `scaled_lens` of `basis`, else of `pca_basis`."""
    table = np.ascontiguousarray(table)
    data = memoryview(table).cast("B")
    if basis is not None:
        data = table.tobytes() + np.ascontiguousarray(basis, np.float64).tobytes()
    out = in_child(what, __name__, [table.dtype.str, *map(str, table.shape), str(width),
                                    "basis" if basis is not None else "pca"], data)
    return np.frombuffer(out, np.float32).reshape(table.shape[1], width).copy()


def _lens_child(dtype: str, rows: str, cols: str, width: str, basis: str) -> None:
    """`lens_in_child`'s child: the table's raw bytes on stdin (then the float64 basis's, for
    "basis"), the lens's on stdout."""
    watch_parent()
    data = sys.stdin.buffer.read()
    shape, k = (int(rows), int(cols)), int(width)
    n = shape[0] * shape[1] * np.dtype(dtype).itemsize
    table = np.frombuffer(data, dtype, count=shape[0] * shape[1]).reshape(shape)
    b = (np.frombuffer(data, np.float64, offset=n).reshape(shape[1], k) if basis == "basis"
         else pca_basis(table, k))
    sys.stdout.buffer.write(scaled_lens(table, b).tobytes())


def head_norm_weight(folded: np.ndarray) -> float:
    """The final RMSNorm's initial weight for a tied head: `1 / (sqrt(D) * rms(folded))`.

    The normed hidden state has RMS 1, so the first logits `h . W[v]` spread by about
    `sqrt(D) * rms(W)` times this weight: 1 here. At weight 1 the donor's table gave the input
    token's own row a logit of `D * rms(W)` (35 for SmolLM2's table into 256 wide): a first
    loss of 27.7 nats against ln 49152 = 10.8. With this weight: 14.6, and 6.48 against 6.63
    validation loss after the README's 50 steps. T5 scales its tied head by `D ** -0.5` for
    the same reason; here the scale is the norm's weight, so a checkpoint stays a plain llama
    GGUF. Smaller weights (a from-scratch model's logit spread, a first loss below ln V) ended
    worse on stories260K students (docs/RESULTS.md, "warm-start's first loss").
    """
    return 1.0 / (folded.shape[1] ** 0.5 * max(rms(folded), 1e-30))


# ---- the model ---------------------------------------------------------------------------------
class LensEmbedding(nn.Module):
    """A (V, Dd) token table seen through a learned (Dd, D) lens; rows are `weight @ lens`."""

    def __init__(self, vocab: int, donor_width: int, width: int):
        super().__init__()
        self.weight = mx.zeros((vocab, donor_width))
        self.lens = mx.zeros((donor_width, width))

    def folded(self) -> mx.array:
        """The student-width table `weight @ lens` (V, D) that the checkpoint stores."""
        return self.weight @ self.lens



class WarmLlama(Llama):
    """A Llama whose embedding is a donor-width table plus a lens (`embed.weight`, `embed.lens`)."""

    def __init__(self, args: LlamaArgs, donor_width: int, ops: Ops = EXACT):
        super().__init__(args, ops)
        self.embed = LensEmbedding(args.vocab_size, donor_width, args.d_model)

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.ops.embed(self.embed.folded(), tokens)

    def unembed(self, h: mx.array) -> mx.array:
        if self.args.tie_embeddings:
            return self.ops.unembed(h, self.embed.folded())
        return self.output(h)

    @property
    def donor_width(self) -> int:
        return self.embed.weight.shape[1]

    @property
    def table(self) -> mx.array:
        return self.embed.weight

    @property
    def lens(self) -> mx.array:
        return self.embed.lens

    def set_embedding(self, table: np.ndarray, lens: np.ndarray) -> None:
        """Install the unfolded table (V, Dd) and lens (Dd, D), checking both shapes."""
        for key, have, new in (("embed.weight", self.embed.weight, table),
                               ("embed.lens", self.embed.lens, lens)):
            if tuple(new.shape) != tuple(have.shape):
                raise ValueError(f"{key}: expected shape {tuple(have.shape)}, "
                                 f"found {tuple(new.shape)}")
        self.load_weights([("embed.weight", mx.array(table, dtype=mx.float32)),
                           ("embed.lens", mx.array(lens, dtype=mx.float32))], strict=False)


def folded_tensors(model: WarmLlama) -> dict[str, np.ndarray]:
    """llama.cpp tensors of the student with the lens folded into token_embd.weight."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    params["embed.weight"] = model.embed.folded()
    return llama_tensors(model, params)


# ---- resume side file --------------------------------------------------------------------------
def warm_path(ckpt: Path) -> Path:
    """`step_N.gguf` -> `step_N.warm.safetensors` (the unfolded table and the lens)."""
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name[: -len(".gguf")] + ".warm.safetensors")


def save_warm_state(ckpt: Path, model: WarmLlama, meta: dict[str, Any]) -> None:
    """Write the side file atomically; call before writing the GGUF itself."""
    ck.save_state(warm_path(ckpt), {"table": model.embed.weight, "lens": model.embed.lens}, meta)


ROUNDING = {"F16": 2.0 ** -11, "BF16": 2.0 ** -8}
"""Relative rounding (half an ulp) of the tensor types --save-dtype writes besides F32: the
most a checkpoint's token_embd.weight differs from the table @ lens it was written from."""


def load_warm_checkpoint(ckpt: Path, model: WarmLlama) -> None:
    """Restore a warm checkpoint exactly: blocks from the GGUF, table and lens from the side file."""
    ckpt = Path(ckpt)
    side = warm_path(ckpt)
    with GGUFFile(ckpt) as g:
        load_llama_weights(g, model, skip=("token_embd.weight",))
        arrays, _ = ck.load_state(side)
        for key in ("table", "lens"):
            if key not in arrays:
                raise GGUFError(f"{side}: tensor {key!r}: expected present, found missing")
        try:
            model.set_embedding(np.array(arrays["table"]), np.array(arrays["lens"]))
        except ValueError as e:
            raise GGUFError(f"{side}: {e}") from None
        stored = g.load("token_embd.weight")
        rtol = ROUNDING.get(g.tensors["token_embd.weight"].type_name, 0.0)
    folded = np.array(model.embed.folded())
    if stored.shape != folded.shape or not np.allclose(stored, folded, rtol=rtol, atol=1e-5):
        raise GGUFError(f"{side}: table @ lens: expected to equal {ckpt.name}'s "
                        "token_embd.weight, found a mismatch (side file of another checkpoint?)")
    mx.eval(model.parameters())


if __name__ == "__main__":  # lens_in_child's child: DTYPE ROWS COLS WIDTH pca|basis, the table
    _lens_child(*sys.argv[1:6])  # (and the basis) on stdin
