"""Every way toymlx reads a GGUF file, and the judgement of what each did with a case.

A reader path either loads the file (and uses what it loaded: a forward pass, an encode) or
raises a clean error: a ValueError (GGUFError, TokenizerError, ...) whose message is one line
naming the file. Anything else is a defect.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from toymlx.bundle.checkpoint import load_checked
from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import args_from_gguf, load_llama, load_llama_into
from toymlx.gguf.reader import GGUFFile, read_metadata
from toymlx.models.llama import Llama
from toymlx.models.lora import apply_lora
from toymlx.recipes import warm
from toymlx.training import adapter

Reader = Callable[[str, str], object]
"""(file, name of the seed it was mutated from) -> anything; "n/a" when it does not apply."""

TOKENS = mx.array([[1, 2, 3]])


def reader_paths(seed_files: dict[str, str]) -> dict[str, Reader]:
    """{name: reader} for every GGUF reader path of toymlx; `seed_files` are the unmutated
    seeds (resume builds the model a seed describes, then loads the case into it)."""
    base_args: dict = {}

    def gguf_all_tensors(p: str, seed: str) -> None:
        g = GGUFFile(p)
        for n in g.tensors:
            np.isfinite(g.load(n)).all()  # touch the data
        g.close()

    def llama(p: str, seed: str) -> None:
        model, _ = load_llama(p)
        mx.eval(model(TOKENS % model.args.vocab_size))

    def resume(p: str, seed: str) -> str | None:
        if seed not in base_args:  # the unmutated seed's shape: what resume builds
            try:
                base_args[seed] = args_from_gguf(GGUFFile(seed_files[seed]))
            except ValueError:
                base_args[seed] = None
        if base_args[seed] is None:
            return "n/a"
        model = Llama(base_args[seed])
        # what trainer.train does on --resume: the recipe's load, shapes checked after
        load_checked(load_llama_into, Path(p), model)
        mx.eval(model(TOKENS))
        return None

    def tokenizer(p: str, seed: str) -> None:
        t = Tokenizer.from_gguf(p)
        t.decode(t.encode("Hello world, ŝnøw ☃ 123"))

    def apply_adapter(p: str, seed: str) -> None:
        adapter.load_adapter(p)  # apply_adapter's first step: fail before building a base
        model, _ = load_llama(seed_files["toy-checkpoint"])
        adapter.apply_adapter(model, p)
        mx.eval(model(TOKENS))

    def adapter_resume(p: str, seed: str) -> None:
        adapter.load_adapter(p)  # load_adapter_weights' first step, before building a base
        model, _ = load_llama(seed_files["toy-checkpoint"])
        apply_lora(model, targets="q,v,down", rank=4, alpha=8.0)  # the seed's layout
        load_checked(lambda path, m: adapter.load_adapter_weights(m, path), Path(p), model)

    return {
        "GGUFFile+load(all tensors)": gguf_all_tensors,
        "read_metadata": lambda p, seed: read_metadata(p),
        "load_llama(+forward)": llama,
        "resume: load_checked(load_llama_into)": resume,
        "Tokenizer.from_gguf(+encode/decode)": tokenizer,
        "load_llama(bfloat16)": lambda p, seed: load_llama(p, weights="bfloat16"),
        "load_llama(quantized)": lambda p, seed: load_llama(p, weights="quantized"),
        "lora.load_adapter": lambda p, seed: adapter.load_adapter(p),
        "lora.apply_adapter(toy base)": apply_adapter,
        "resume: load_checked(lora.load_adapter_weights)": adapter_resume,
        "warm.read_donor": lambda p, seed: warm.read_donor(p),
    }


def classify(exc: BaseException, path: str) -> str | None:
    """None when `exc` is an acceptable clean error for input `path`, else why not."""
    msg = str(exc)
    if not isinstance(exc, ValueError):
        return f"{type(exc).__name__} is not a ValueError/GGUFError"
    if "\n" in msg.strip():
        return "message spans several lines"
    if path not in msg:
        return "message does not name the file"
    return None


def run_case(paths: dict[str, Reader], file: str, seed: str) -> dict[str, dict]:
    """Every reader on `file`: {reader: {"outcome": ok | n/a | clean_error | defect, ...}}."""
    out = {}
    for name, fn in paths.items():
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy overflow warnings on garbage floats
                res = fn(file, seed)
            out[name] = {"outcome": "n/a" if res == "n/a" else "ok"}
        except Exception as e:  # noqa: BLE001 -- judging every exception (MemoryError too)
            bad = classify(e, file)
            rec = {"outcome": "clean_error" if bad is None else "defect",
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if bad:
                rec["why"] = bad
                rec["trace"] = traceback.format_exc()[-2500:]
            out[name] = rec
        out[name]["s"] = round(time.perf_counter() - t0, 4)
    return out
