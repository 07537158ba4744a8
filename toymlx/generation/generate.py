"""Text generation from a Llama, and loading a model to generate from.

Two engines decode the same GGUF files (`choose_engine`):
- `mlx`: the decoding loop (`decode`) and the samplers (`toymlx.generation.sampling`: temperature, top-p,
  min-p, top-k, repetition penalty) are mlx-lm's, rewritten here so that `toymlx-generate` does
  not import mlx-lm's package (transformers, and PyTorch where installed: 1.2-5 s before the
  first token); they give mlx-lm's tokens for the same seed. toymlx adds the stopping rules
  (an end-of-generation token, as llama.cpp's, `stop_ids`), what happens at the window the model
  reads at once (a stop, or a context shift: `toymlx.generation.window`), seeds MLX's
  generator so a run repeats exactly, and, where MLX computes on the CPU, cuts a decoded token's fixed costs without
  changing what it computes: the one-token steps traced (`CompiledDecode`: the same logits,
  bit for bit), top-p found among the most likely tokens before sorting all
  (`toymlx.generation.sampling.make_sampler`), and OpenBLAS kept off the cores other work
  holds (`decoding_blas_threads`).
- `llama.cpp` (llama-cpp-python, the `interop` extra): the same files, adapters and samplers in
  llama.cpp. Decoding one token reads every weight once; on a CPU MLX multiplies float32
  weights (through OpenBLAS's sgemv, `toymlx.backend.gemv_forward`: ~22 GB/s on 2 cores, 24 of a
  SmolLM2-135M token's 33 ms on an AMD EPYC Zen 4) and its quantized CPU matmul is slower
  still, while llama.cpp reads the file's own 4-bit blocks with SIMD dot products. It also
  computes as llama.cpp does, quantized activations included: on SmolLM2-135M's Q4_1 file
  llama.cpp answers "What is the capital of France?" with French nonsense where its F32 copy
  and toymlx (the Q4_1 weights dequantized) answer "Paris", which is why MLX stays the
  default. `auto` takes llama.cpp where MLX computes on the CPU and llama-cpp-python is
  installed, else MLX (a Mac's GPU, CUDA).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import operator
import os
import subprocess
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from toymlx.backend.device import blas_threads, on_gpu, use_blas_threads
from toymlx.backend.lifeline import module_command
from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.bundle.model_store import is_store_name, resolve, resolve_model
from toymlx.data.tokenizer import Tokenizer
from toymlx.generation.llamacpp_decode import IdleCores, decode_threads
from toymlx.generation.sampling import (
    PENALTY_CONTEXT,
    check_top_k,
    make_sampler,
    repetition_penalty,
)
from toymlx.generation.window import check_window, in_window, shift_keep
from toymlx.gguf.llama import ARCHS, args_from_gguf, float32_bytes, frozen_weights, load_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.gated_delta import DeltaCache, delta_steps
from toymlx.models.kv_cache import KVCache
from toymlx.models.llama import Llama
from toymlx.models.ops import EXACT, Ops
from toymlx.runner.bundle import run_base
from toymlx.training.adapter import apply_adapter

PREFILL_CHUNK = 2048
"""Prompt tokens put through the model at a time before decoding (mlx-lm's prefill step)."""


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float,
                   repetition_penalty: float | None) -> None:
    """ValueError naming the flag of a sampler setting out of its range (nan and inf too)."""
    pen = repetition_penalty
    for flag, ok, want, found in [
            ("--top-p", 0.0 < top_p <= 1.0, "in (0, 1]", top_p),
            ("--temperature", 0 <= temperature < math.inf, "a finite number >= 0", temperature),
            ("--top-k", top_k >= 0, ">= 0 (0: off)", top_k),
            ("--min-p", 0.0 <= min_p < 1.0, "in [0, 1) (0: off)", min_p),
            ("--repetition-penalty", pen is None or 0 < pen < math.inf, "a finite number > 0",
             pen)]:
        if not ok:
            raise ValueError(f"{flag}: expected {want}, found {found}")


def prompt_token_ids(prompt_ids: Sequence[int], vocab: int) -> list[int]:
    """`prompt_ids` as a list of ints (numpy's too), each a row of a `vocab`-token model: a
    TypeError or ValueError naming `prompt_ids` otherwise (an id past the table was read out
    of bounds: a segmentation fault)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids: expected a list of token ids (tokenizer.encode(text)), "
                        f"found a {type(prompt_ids).__name__}")
    ids = []
    for i, given in enumerate(prompt_ids):
        try:
            t = operator.index(given) if not isinstance(given, bool) else None
        except TypeError:
            t = None
        if t is None:
            raise TypeError(f"prompt_ids[{i}]: expected an int token id, found {given!r}")
        if not 0 <= t < vocab:
            raise ValueError(f"prompt_ids[{i}]: expected a token id in 0..{vocab - 1} (the "
                             f"model's vocabulary), found {t}")
        ids.append(t)
    return ids


def generate(model: Llama, tokenizer: Any, prompt_ids: Sequence[int], max_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
             min_p: float = 0.0, repetition_penalty: float | None = None,
             kept: PromptCache | None = None, decoder: Any = None, window: int | None = None,
             shift: bool = False) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt_ids`; stops before an
    end-of-generation token (`stop_ids`). Temperature 0 is greedy; otherwise sampled as mlx-lm
    samples (`toymlx.generation.sampling`). `kept`: a conversation's caches, kept between calls
    (`PromptCache`). `decoder`: `decoder_for(model)`, made once by a caller that generates
    several times from the model (its traces are made at its first call); None: made here.
    `window`: the most tokens of text the model reads at once (a from-scratch run's --seq-len;
    None: the model's context). Where the text reaches it, generation stops, or with `shift`
    goes on from its newer half (`toymlx.generation.window`: a prompt that fills the window
    cut so too), each prediction reading at most `window` tokens at positions 0..window-1.
    Where MLX computes on the CPU, OpenBLAS runs on `decoding_blas_threads` threads from the
    first token asked for until the last one is handed out or the caller stops reading."""
    prompt_ids = prompt_token_ids(prompt_ids, model.args.vocab_size)
    if len(prompt_ids) == 0:
        raise ValueError("prompt: expected at least one token, found an empty prompt")
    if not hasattr(type(max_tokens), "__index__") or isinstance(max_tokens, bool) \
            or operator.index(max_tokens) < 0:  # -1 yielded nothing, "3" failed comparing
        raise ValueError(f"max_tokens: expected an integer >= 0, found {max_tokens!r}")
    check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
    check_top_k(top_k, model.args.vocab_size)  # greedy too: the flag is wrong either way
    window = model.args.context if window is None else window
    if not 0 < window <= model.args.context:  # past the trained context the output is meaningless
        raise ValueError(f"window: expected 1..{model.args.context} tokens (the model's "
                         f"context), found {window}")
    if shift:
        check_window(window)
    budget = max_tokens if shift else min(max_tokens, window - len(prompt_ids))
    if budget <= 0:
        return
    stop = stop_ids(tokenizer)
    mx.random.seed(seed)
    cpu = not on_gpu()
    sampler = make_sampler(temperature, top_p, min_p, top_k, checked_on_host=cpu)
    penalty = _penalty(repetition_penalty)
    decoder = decoder_for(model) if decoder is None else decoder
    with use_blas_threads(decoding_blas_threads() if cpu else None):
        for tok in decode(decoder, prompt_ids, budget, sampler, penalty, kept,
                          window if shift else None):
            if tok in stop:
                return
            yield tok


def decoder_for(model: Llama) -> Any:
    """What `generate` decodes `model` with: its `CompiledDecode` where MLX computes on the CPU
    and the model fits one, else the model itself (a GPU runs the eager graph)."""
    return CompiledDecode(model) if not on_gpu() and CompiledDecode.fits(model) else model


def stop_ids(tokenizer: Any) -> frozenset[int]:
    """The ids generation stops before, as llama.cpp's `llama_vocab_is_eog` (and Ollama, and
    llama-cpp-python's completions) stop: eos and the end-of-turn tokens (`eog_ids`), not eos
    alone: SmolLM2's <|endoftext|>, a file's `tokenizer.ggml.eot_token_id`."""
    eos = getattr(tokenizer, "eos_id", None)
    return frozenset(getattr(tokenizer, "eog_ids", ())) | ({eos} if eos is not None else set())


def decoding_blas_threads() -> int | None:
    """The BLAS threads a decoding call runs on where MLX computes on the CPU: one per idle
    core (`llamacpp_decode.decode_threads`, as the llama.cpp engine picks its threads), at most
    the process's own count; None where toymlx does not control the BLAS.

    Why: a decoded token is ~200 one-row products of ~0.1-1 ms, and OpenBLAS's threads wait
    for each other at the end of every one: with another program holding a core, the thread
    on that core stalls every product. SmolLM2-135M on a 2-core AMD EPYC with other work on
    both cores: 0.3 tok/s on 2 threads, 3.8-7.8 on 1, the same tokens. Idle cores: as many
    threads as before. Sampling the cores' idle time takes 0.1 s: paid at a process's first
    call only, later calls measure over the time since the one before (`IdleCores`)."""
    have = blas_threads()
    if have is None or have <= 1:
        return have
    return decode_threads(have, DECODING_IDLE())


DECODING_IDLE = IdleCores()
"""The idle cores `decoding_blas_threads` sees: one meter for the process, so that each
`generate` call of a chat or a batch measures over the time since the last."""


@dataclass
class PromptCache:
    """A conversation's KV caches kept from one `generate` call to the next, and the token ids
    whose keys and values they hold: the next prompt's tokens that start the same way are not
    computed again (mlx_lm.chat's prompt cache). One per model and conversation."""

    layers: list[KVCache] | None = None
    ids: list[int] = field(default_factory=list)
    reused: int = 0
    """How many of the last prompt's tokens came from the cache."""

    def take(self, model: Any, prompt_ids: Sequence[int]) -> list[KVCache]:
        """The caches, holding the longest start the prompt shares with what they hold (all
        but the prompt's last token at most: that one is computed to give the logits)."""
        if self.layers is None:
            self.layers, self.ids = model.make_cache(), []
        n = 0
        limit = min(len(self.ids), len(prompt_ids) - 1)
        while n < limit and self.ids[n] == prompt_ids[n]:
            n += 1
        if n < len(self.ids) and any(isinstance(c, DeltaCache) for c in self.layers):
            n = 0  # a recurrent state (qwen35's linear blocks) cannot be rewound: start over
        for c in self.layers:
            c.keep(n)
        self.ids, self.reused = list(prompt_ids[:n]), n
        return self.layers


def _penalty(factor: float | None):
    return None if factor is None or factor == 1.0 else repetition_penalty(factor)


def decode(model: Any, prompt_ids: list[int], max_tokens: int,
           sampler: Callable[[mx.array], mx.array],
           penalty: Callable[[mx.array, mx.array], mx.array] | None = None,
           kept: PromptCache | None = None, window: int | None = None) -> Iterator[int]:
    """`max_tokens` token ids after the prompt, as mlx-lm's `generate_step` makes them: the
    prompt but its last token into the KV caches `PREFILL_CHUNK` at a time, then one token at
    a time, each step's graph built (and sent to the device) while the previous token is
    handed out. `penalty(recent tokens, logits)`: mlx-lm's repetition penalty, over the text's
    last tokens (a shift does not change what it looks at). `kept`: caches that outlive the
    call (`PromptCache`), the prompt's shared start taken from them. `window`: the context
    shift (`toymlx.generation.window`): the prompt cut to fit it, and before a token is put
    through the model where the text in view holds `window` tokens, the caches emptied and
    the newer half put through again from position 0; None: the caller's `max_tokens` keeps
    the text within the model's context."""
    recent = mx.array(prompt_ids[-PENALTY_CONTEXT:], dtype=mx.int32) if penalty else None
    if window is not None:
        check_window(window)
        prompt_ids = in_window(prompt_ids, window)
    cache = model.make_cache() if kept is None else kept.take(model, prompt_ids)
    fed = [] if kept is None else kept.ids  # the ids whose keys and values are in `cache`
    _prefill(model, cache, prompt_ids[len(fed):-1])
    fed += prompt_ids[len(fed):]  # the last one's keys and values: computed by the first step

    def step(tokens: mx.array) -> mx.array:
        nonlocal recent
        logits = model(tokens[None], cache)[:, -1, :]  # (1, V)
        if penalty is not None:
            logits = penalty(recent, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = sampler(logprobs)  # (1,)
        if penalty is not None:
            recent = mx.concatenate([recent, token])[-PENALTY_CONTEXT:]
        return token

    def after(token: mx.array) -> mx.array:
        """The token that follows `token` (not yet in `fed`), the context shifted first where
        the text in view, `token` included, fills the window."""
        if window is not None and len(fed) + 1 >= window:
            newer = fed[len(fed) - shift_keep(window) + 1:]  # with `token`: the newer half
            for c in cache:
                c.keep(0)
            fed[:] = newer
            _prefill(model, cache, newer)
        return step(token)

    token = step(mx.array(prompt_ids[-1:], dtype=mx.int32))
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            following = after(token)
            mx.async_eval(following)
        value = int(token.item())
        if n + 1 < max_tokens:
            fed.append(value)  # its keys and values are being computed with `following`
        yield value
        if n % 256 == 255:
            mx.clear_cache()
        if n + 1 < max_tokens:
            token = following


def _prefill(model: Any, cache: list[Any], ids: Sequence[int]) -> None:
    """Put `ids` through the model into the KV caches, `PREFILL_CHUNK` at a time."""
    for at in range(0, len(ids), PREFILL_CHUNK):
        model(mx.array(ids[at:at + PREFILL_CHUNK], dtype=mx.int32)[None], cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()


class CompiledDecode:
    """A Llama for `decode` whose one-token steps run each block's `start` and `finish`
    as traced functions (`mx.compile`); prompts (several tokens) go to the model as they are.

    Why: a decoded token of SmolLM2-135M is 3,317 MLX primitives, and on a CPU each costs about
    4 us to schedule whatever it computes (about 13 ms of a 37 ms token on a 2-core AMD EPYC
    Zen 4), and Python builds the graph anew for every token. Traced, the elementwise chains
    (norms, RoPE, SwiGLU, residuals) are fused and the graph is replayed without Python. What
    stays eager is what changes shape with every token: the KV cache and the attention over it.
    qwen35's Gated DeltaNet blocks trace around their one-token recurrence (`delta_steps`, eager:
    traced, its exp would be toymlx's kernel form, `toymlx.backend.fastmath`, not MLX's op the
    model computes with), their conv inputs and state going in and out of the traced parts.
    The logits are the eager model's, bit for bit (tests/test_archs.py, every architecture).

    The blocks' parameters are inputs of the traced functions (`inputs=block.state`), not
    constants: weights changed or adapters applied after the first step are used. RoPE comes
    from float64 tables handed in per position (`Ops.rope_tables`), so the model's Ops must be
    exact_rope (`fits`); generation's are."""

    def __init__(self, model: Llama):
        if not self.fits(model):
            raise ValueError("CompiledDecode: expected a Llama with exact_rope Ops")
        self.model = model
        # the position reaches `start` only through its tables (an int would be a constant of
        # the trace, traced again at every position); a linear block is traced whole
        self._start = [mx.compile(self._starter(b), inputs=b.state) for b in model.layers]
        self._finish = [mx.compile(self._finisher(b), inputs=b.state) for b in model.layers]

    @staticmethod
    def _starter(block: Any) -> Callable:
        """block.start at the position its tables say; q alone where the block reads an
        earlier block's keys and values (a traced function returns arrays only); q, k, v and
        the output gate where it has one (qwen35's full-attention blocks); a linear block's
        whole step (`_linear_step`)."""
        if block.linear:  # the normed input, the rule's inputs and the conv's last inputs
            return lambda x, conv: (normed := block.pre(x, "attn_norm"),
                                    *block.attn.rule_inputs(normed, conv))
        if block.attn.out_gate:
            def start(x, tables=None, q_tables=None):
                q, k, v = block.attn.project(block.pre(x, "attn_norm"))
                q, gate = block.attn.split_gate(q)
                return (*block.attn.heads(q, k, v, 0, tables, q_tables), gate)

            return start
        if block.attn.own_kv:
            return functools.partial(block.start, offset=0)
        return lambda x, tables=None, q_tables=None: block.start(x, 0, tables, q_tables)[0]

    @staticmethod
    def _finisher(block: Any) -> Callable:
        """block.finish, the attention's output gated first where the block has a gate; a
        linear block's `_linear_finish`."""
        if block.linear:
            return functools.partial(CompiledDecode._linear_finish, block)
        if block.attn.out_gate:
            return lambda x, o, gate, *ple: block.finish(x, block.attn.gated(o, gate), *ple)
        return block.finish

    @staticmethod
    def _linear_finish(block: Any, x: mx.array, normed: mx.array, o: mx.array, *ple: mx.array
                       ) -> mx.array:
        """A Gated DeltaNet block's output from its input x, its normed input and the gated
        delta rule's o."""
        return block.close(x, block.attn.output(normed, o), *ple)

    @staticmethod
    def fits(model: Any) -> bool:
        """A toymlx Llama computing RoPE from tables (the compiled steps take them as inputs)."""
        return isinstance(model, Llama) and model.ops.exact_rope

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        if cache is None or tokens.shape[-1] != 1:
            return self.model(tokens, cache)
        model = self.model
        h = model.embed_tokens(tokens)  # (B,1,D)
        ple = model.per_layer_inputs(tokens, h) if model.args.per_layer_dim else None
        for i, block in enumerate(model.layers):
            more = () if ple is None else (ple[:, :, i, :],)
            if block.linear:  # qwen35's Gated DeltaNet: the recurrence itself eager (its
                c = cache[i]  # exp is MLX's op there, a traced one computes other values)
                conv, ssm = (c.conv, c.ssm) if c.conv is not None else _zero_state(block, h)
                normed, q, k, v, g, beta, c.conv = self._start[i](h, conv)
                o, c.ssm = delta_steps(q, k, v, g, beta, ssm)
                h = self._finish[i](h, normed, o, *more)
                c.offset += 1
                continue
            offset = cache[i].offset
            rope, q_rope = block.attn.rope, block.attn.q_rope  # None: a block without RoPE
            tables = q_tables = None  # (smollm3's every 4th)
            if rope is not None:
                tables = model.ops.rope_tables(rope, block.attn.head_dim, offset, 1)
            if q_rope != rope:  # mistral3's queries: their temperature at this position
                q_tables = model.ops.rope_tables(q_rope, block.attn.head_dim, offset, 1)
            out = self._start[i](h, tables=tables, q_tables=q_tables)  # gemma4's shared-KV
            gate = (out[3],) if block.attn.out_gate else ()  # tail: q alone; qwen35's: a gate
            q, k, v = out[:3] if block.attn.own_kv else (out, None, None)
            o = block.attn.attend(q, k, v, cache[i])
            h = self._finish[i](h, o, *gate, *more)
        return model.unembed(model.head_input(h))


def _zero_state(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    """A linear block's conv inputs (B, K-1, conv_dim) and state (B, Hv, dk, dk) before its
    first token: zeros, float32, as `GatedDeltaNet` starts from without a cache."""
    attn = block.attn
    channels, kernel = attn.conv1d.weight.shape
    return (mx.zeros((x.shape[0], kernel - 1, channels), mx.float32),
            mx.zeros((x.shape[0], attn.hv, attn.dk, attn.dk), mx.float32))


def _lora_run_base(path: str | os.PathLike) -> str | None:
    """The `--base` a LoRA run was trained on (the file its config.json records, checked),
    when `path` is in a run."""
    found = run_base(path)
    return found[0] if found is not None else None


def used_files(path: str | os.PathLike, adapter: str | os.PathLike | None = None,
               check_digest: bool = True) -> str:
    """Which files `--model` (and `--adapter`) are read from, for a reader to say: the model
    GGUF (a LoRA run's base: the file its run recorded, and why that one) and the adapters;
    `check_digest` as `model_files`'."""
    gguf_path, adapters = model_files(path, adapter, check_digest)
    found = run_base(path)  # a full fine-tune's checkpoint is a model itself: no base read
    base = found is not None and resolve_model(found[0], check_digest=check_digest) == gguf_path
    text = f"model {found[1] if base else gguf_path}"
    return text + "".join(f" + adapter {a}" for a in adapters)


ENGINES = ("auto", "mlx", "llama.cpp")
_NO_LLAMACPP = ("--engine llama.cpp: expected llama-cpp-python, found it not installed "
                "(pip install 'toymlx[interop]')")


def choose_engine(name: str, on_gpu: bool) -> str:
    """`mlx` or `llama.cpp` for `--engine name` (see the module's docstring for `auto`)."""
    if name not in ENGINES:
        raise ValueError(f"--engine: expected one of {', '.join(ENGINES)}; found {name!r}")
    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    if name == "llama.cpp" and not has_llamacpp:
        raise ValueError(_NO_LLAMACPP)
    if name == "auto":
        return "llama.cpp" if (has_llamacpp and not on_gpu) else "mlx"
    return name


def model_files(path: str | os.PathLike, adapter: str | os.PathLike | None = None,
                check_digest: bool = True) -> tuple[Path, list[Path]]:
    """The files a `--model` (and `--adapter`) name: the model GGUF, and the LoRA adapter GGUFs
    on top of it in order. A LoRA run or adapter file comes with the base it was trained on, and
    an Ollama model with the adapter of its manifest's ADAPTER layer. `check_digest=False`:
    for headers alone, an Ollama blob's SHA-256 (a read of the whole file) not yet checked
    (`model_store.resolve`); call again with it before the weights are read."""
    if is_store_name(path):
        found = resolve(path, "--model", with_adapter=True, check_digest=check_digest)
        gguf_path, adapters = found.path, [found.adapter] if found.adapter is not None else []
    else:
        gguf_path, adapters = checkpoint_file(path, check_digest=check_digest), []
    if adapter is not None:
        adapters.append(checkpoint_file(adapter, "--adapter", check_digest))
    g = GGUFFile(gguf_path)
    kind, base = g.metadata.get("general.type"), g.metadata.get("toy.base")
    g.close()
    if kind != "adapter":
        return gguf_path, adapters
    base = _lora_run_base(path) or base
    if isinstance(base, str) and (Path(base).is_file() or is_store_name(base)):
        model, under = model_files(base, check_digest=check_digest)
        return model, [*under, gguf_path, *adapters]
    raise GGUFError(f"{gguf_path}: metadata key 'general.type': expected a model, found a "
                    "LoRA adapter (pass its base model as --model and this as --adapter"
                    + (f"; its base {base} is not a file here)" if base else ")"))


def load_tokenizer(gguf_path: Path, given: str | os.PathLike | None = None
                   ) -> tuple[Tokenizer, Any]:
    """The GGUF's own tokenizer and its `LlamaArgs`, after checking its architecture and
    shapes (no weights read); `given`: the --model typed (a run folder), named in the refusal
    of an image classifier, its checkpoint beside it."""
    g = GGUFFile(gguf_path)
    try:
        if g.metadata.get("general.architecture") == "vit":  # a vit-tiny run or checkpoint
            model = gguf_path if given is None else given
            named = gguf_path if Path(model) == gguf_path else f"{model} ({gguf_path})"
            raise GGUFError(f"{named}: metadata key 'general.architecture': expected a "
                            f"language model ({', '.join(ARCHS)}), found 'vit', an image "
                            f"classifier: toymlx-classify --model {model} IMAGE uses it")
        args = args_from_gguf(g)  # architecture, hyperparameters and tensor shapes
        if "tokenizer.ggml.tokens" not in g.metadata:
            raise GGUFError(f"{gguf_path}: metadata key 'tokenizer.ggml.tokens': expected a "
                            "tokenizer in the GGUF, found missing")
        tokenizer = Tokenizer.from_metadata(g.metadata, source=gguf_path)
    finally:
        g.close()
    if tokenizer.vocab_size > args.vocab_size:
        raise GGUFError(f"{gguf_path}: tensor 'token_embd.weight': expected at least "
                        f"{tokenizer.vocab_size} rows (the tokenizer's vocabulary), found "
                        f"{args.vocab_size}")
    return tokenizer, args


def decoding_weights(gguf_path: str | os.PathLike, gpu: bool) -> str:
    """How a model decoded token by token holds its weights (`load_llama`'s weights).

    One token's matmuls read each weight once, so decoding blocks costs as much as the product
    itself on the CPU: float32 there when the float32 model takes at most half the memory
    available, else its blocks (the file's size; slower, said on stderr). A GPU: MLX's
    quantized layers where they hold the type exactly, blocks elsewhere."""
    if gpu:
        return frozen_weights(True)
    with GGUFFile(gguf_path) as g:
        need = float32_bytes(g)
    from toymlx.training.memory import within_half_available

    fits, have = within_half_available(need)
    if fits:
        return "float32"
    print(f"toymlx: {gguf_path}: holding the model as its quantized blocks (float32 would take "
          f"{need / 1e9:.1f} GB of the {have / 1e9:.1f} GB available): on the CPU MLX decodes "
          "each weight at every token, which is slow; --engine llama.cpp reads the blocks "
          "directly", file=sys.stderr)
    return "blocks"


def load_for_generation(path: str | os.PathLike, adapter: str | os.PathLike | None = None,
                        weights: str | None = None, ops: Ops = EXACT) -> tuple[Llama, Any]:
    """(model, tokenizer) in MLX from a llama-family GGUF or a run directory (its
    `weights/latest`), with the LoRA adapter a run trained (and `adapter`) applied; `weights`:
    how it holds them (`load_llama`; None: `decoding_weights`); `ops`: the math it computes
    with (toymlx-eval: `models.ops.scoring_ops`)."""
    gguf_path, adapters = model_files(path, adapter)
    check_one_adapter(path, adapters)
    tokenizer, _ = load_tokenizer(gguf_path, path)
    return load_model(gguf_path, adapters, weights, ops), tokenizer


def check_one_adapter(path: str | os.PathLike, adapters: Sequence[Path]) -> None:
    """ValueError where `model_files(path, ...)` found more than one adapter to apply."""
    if len(adapters) > 1:
        raise ValueError(f"{adapters[-1]}: --adapter: expected one adapter on {path}, found "
                         f"{path} carries one already ({adapters[0]}; give its base as "
                         "--model)")


def load_model(gguf_path: Path, adapters: Sequence[Path], weights: str | None = None,
               ops: Ops = EXACT) -> Llama:
    """The MLX model of `model_files`' answer, its adapters applied (`load_for_generation`
    after its header checks: a command that checked the header itself loads with this). A
    large one is announced first (`memory.loading_note`): it reads, and as float32 decodes, every
    weight before anything else is said."""
    from toymlx.gguf.quant import projection_types
    from toymlx.training.memory import base_bytes, loading_note

    weights = weights or decoding_weights(gguf_path, on_gpu())
    with GGUFFile(gguf_path) as g:
        note = loading_note(gguf_path, "/".join(sorted(set(projection_types(g).values()))),
                            weights, base_bytes(g, weights))
    if note:
        print(f"toymlx: {note}", file=sys.stderr, flush=True)
    model, g = load_llama(gguf_path, ops, weights=weights)
    g.close()
    for a in adapters:
        apply_adapter(model, a)
    return model


class EngineFailed(RuntimeError):
    """The llama.cpp engine stopped before its first token (the caller may decode with MLX)."""


class LlamaCppDecoder:
    """The `llama.cpp` engine: the model file and its adapter loaded in llama.cpp, in a child
    process (`toymlx.generation.llamacpp_decode`), decoding with the samplers `generate` takes (the
    repetition penalty over the last 20 tokens, as mlx-lm's). Seeded: a run repeats exactly on
    the same llama.cpp build. One child serves every `generate` call (each turn of a
    conversation) until `close`. A child that dies before its first token raises `EngineFailed`."""

    def __init__(self, gguf_path: Path, adapters: Sequence[Path], context: int, seed: int = 0):
        """Start the child and load the model (`context`: the most tokens, prompt and new
        ones, it will hold); returns once the model is loaded."""
        if len(adapters) > 1:
            raise ValueError(f"{adapters[-1]}: --adapter: expected one adapter, found "
                             f"{len(adapters)} ({', '.join(map(str, adapters))})")
        for a in adapters:
            g = GGUFFile(a)
            kind = g.metadata.get("adapter.type", "lora")
            g.close()
            if kind != "lora":
                raise EngineFailed(f"{a}: metadata key 'adapter.type': llama.cpp reads only "
                                   f"lora adapters, found {kind!r} (fuse it with toymlx-export "
                                   "--fuse to run it in llama.cpp)")
        self.context = context
        self.decoded = False  # any token yet: a failure after one is not the engine's start
        self.child = subprocess.Popen(
            module_command("toymlx.generation.llamacpp_decode"), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self._send({"model": str(gguf_path), "adapter": str(adapters[0]) if adapters else None,
                    "context": context, "seed": seed})
        if self._line() != "ready":
            raise EngineFailed(self._why(f"loading {gguf_path}"))

    def _send(self, request: dict[str, Any]) -> None:
        assert self.child.stdin is not None
        try:
            self.child.stdin.write(json.dumps(request) + "\n")
            self.child.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone: its exit status says why

    def _line(self) -> str:
        assert self.child.stdout is not None
        return self.child.stdout.readline().strip()

    def _why(self, doing: str) -> str:
        code = self.child.wait()
        err = (self.child.stderr.read() if self.child.stderr else "").strip().splitlines()
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"llama.cpp stopped {doing} ({how}{': ' + err[-1] if err else ''})"

    def generate(self, prompt_ids: Sequence[int], stop: Collection[int], max_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float | None = None,
                 seed: int | None = None, window: int | None = None,
                 shift: bool = False) -> Iterator[int]:
        """The new token ids for `prompt_ids` up to one of `stop` (`stop_ids`), as the child
        decodes them; the child stays for
        the next call. Left before the end (the caller stopped reading), the child is stopped.
        `seed`: decode as a child started with this seed would (the sampler reseeded, no
        computed token reused: one of several samples); None: go on from the last call (a
        conversation's turn, its shared start reused). `window`, `shift`: as `generate`'s
        (None: the context the child was started with); llama.cpp's sampler starts its random
        stream again from the seed at each shift."""
        from toymlx.generation.llamacpp_decode import END

        window = self.context if window is None else window
        if shift:
            check_window(window)
            prompt_ids = in_window(prompt_ids, window)
        budget = max_tokens if shift else min(max_tokens, window - len(prompt_ids))
        if budget <= 0:  # nothing to decode (a prompt longer than the child's context fails)
            return
        request = {"ids": [int(i) for i in prompt_ids], "stop": sorted(int(i) for i in stop),
                   "budget": budget, "temperature": temperature, "top_p": top_p,
                   "top_k": top_k, "min_p": min_p,
                   "repetition_penalty": repetition_penalty or 1.0,
                   "window": window if shift else None}
        self._send(request if seed is None else {**request, "seed": seed})
        done = False
        try:
            while (line := self._line()) != END:
                if not line:  # the child is gone
                    why = self._why("decoding")
                    raise RuntimeError(why) if self.decoded else EngineFailed(why)
                self.decoded = True
                yield int(line)
            done = True
        finally:
            if not done:
                self.close()

    def close(self) -> None:
        """End the child (its stdin closed: it exits; killed if it has not within 10 s)."""
        if self.child.poll() is None:
            try:
                assert self.child.stdin is not None
                self.child.stdin.close()
                self.child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.child.kill()
                self.child.wait()
