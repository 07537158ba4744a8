"""llama.cpp (through llama-cpp-python) in a child process, for the interop tests.

llama-cpp-python can segfault on a malformed file instead of raising, so every call here runs
this file as a script with `sys.executable` and exchanges data through files: a crash then
fails the one test that caused it, with llama.cpp's stderr in the message.

Script use:
    python llamacpp_runner.py logits MODEL TOKENS.json OUT.npy
    python llamacpp_runner.py tokenize MODEL TEXTS.json OUT.json [--no-bos] [--special]
    python llamacpp_runner.py greedy MODEL PROMPT.json OUT.json [--lora ADAPTER] [--max-tokens N]
    python llamacpp_runner.py quantize SRC.gguf DST.gguf TYPE    (TYPE: Q4_K_M, Q8_0, ...)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve()


class LlamaCppError(RuntimeError):
    """llama.cpp failed or crashed in the child process."""


def _run(args: list[str], timeout: float) -> dict:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        raise LlamaCppError(f"llama.cpp child process failed ({how}): "
                            f"{(r.stderr or r.stdout).strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llamacpp_logits(model: str | Path, tokens: list[int], timeout: float = 600,
                    lora: str | Path | None = None) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits (T, V) float32 for `tokens` with an f32 KV cache, flash attn off;
    with `lora`, that adapter GGUF applied at scale 1 (llama-cli's --lora)."""
    with tempfile.TemporaryDirectory(prefix="toymlx-llamacpp-") as d:
        tok, out = Path(d) / "tokens.json", Path(d) / "logits.npy"
        tok.write_text(json.dumps([int(t) for t in tokens]))
        extra = ["--lora", str(lora)] if lora else []
        info = _run(["logits", str(model), str(tok), str(out), *extra], timeout)
        return np.load(out), info


def llamacpp_logits_lora(model: str | Path, lora: str | Path | None, tokens: list[int],
                         timeout: float = 600) -> tuple[np.ndarray, dict]:
    """`llamacpp_logits` with an adapter (None: the model alone)."""
    return llamacpp_logits(model, tokens, timeout, lora=lora)


def llamacpp_greedy(model: str | Path, prompt: list[int], max_tokens: int = 24,
                    lora: str | Path | None = None, timeout: float = 600) -> list[int]:
    """llama.cpp's greedy reply (token ids, eos not included) to the `prompt` ids, with `lora`
    applied at scale 1 if given."""
    with tempfile.TemporaryDirectory(prefix="toymlx-llamacpp-") as d:
        src, out = Path(d) / "prompt.json", Path(d) / "reply.json"
        src.write_text(json.dumps([int(t) for t in prompt]))
        extra = ["--lora", str(lora)] if lora else []
        _run(["greedy", str(model), str(src), str(out), "--max-tokens", str(max_tokens), *extra],
             timeout)
        return json.loads(out.read_text())


def llamacpp_tokenize(model: str | Path, texts: list[str], add_bos: bool = True,
                      special: bool = False, timeout: float = 300) -> list[list[int]]:
    """llama.cpp's token ids for each text (`Llama.tokenize(text.encode(), add_bos, special)`)."""
    with tempfile.TemporaryDirectory(prefix="toymlx-llamacpp-") as d:
        src, out = Path(d) / "texts.json", Path(d) / "ids.json"
        src.write_text(json.dumps(texts))
        flags = ([] if add_bos else ["--no-bos"]) + (["--special"] if special else [])
        _run(["tokenize", str(model), str(src), str(out), *flags], timeout)
        return json.loads(out.read_text())


def quantize(src: str | Path, dst: str | Path, qtype: str, timeout: float = 600) -> dict:
    """`llama-quantize SRC DST QTYPE`: llama.cpp's `llama_model_quantize` with its default
    parameters and ftype LLAMA_FTYPE_MOSTLY_<QTYPE> (Q4_0, Q4_K_M, Q8_0, F16, ...)."""
    return _run(["quantize", str(src), str(dst), qtype], timeout)


# ---- child side -------------------------------------------------------------------------
def _child_logits(model: str, tokens_path: str, out_path: str, lora: str | None = None) -> dict:
    from llama_cpp import Llama

    from toymlx.generation.llamacpp_decode import YARN_FROM_MODEL, plain_cpu_buffers

    plain_cpu_buffers(model)  # the same llama.cpp set-up as toymlx-generate --engine llama.cpp

    tokens = json.loads(Path(tokens_path).read_text())
    n = len(tokens)
    t0 = time.perf_counter()
    llm = Llama(model_path=model, logits_all=True, n_ctx=max(n, 64), n_batch=max(n, 64),
                n_ubatch=max(n, 64), type_k=0, type_v=0, flash_attn=False, n_threads=2,
                n_threads_batch=2, verbose=False, **YARN_FROM_MODEL,
                **({"lora_path": lora} if lora else {}))
    t1 = time.perf_counter()
    llm.eval(tokens)
    t2 = time.perf_counter()
    logits = np.array(llm.scores[:n], dtype=np.float32)  # (T, V)
    np.save(out_path, logits)
    return {"load_s": t1 - t0, "eval_s": t2 - t1, "n_tokens": n, "n_vocab": llm.n_vocab()}


def _child_greedy(model: str, prompt_path: str, out_path: str, max_tokens: int,
                  lora: str | None = None) -> dict:
    from llama_cpp import Llama

    from toymlx.generation.llamacpp_decode import YARN_FROM_MODEL, plain_cpu_buffers

    plain_cpu_buffers(model)
    prompt = json.loads(Path(prompt_path).read_text())
    n = len(prompt) + max_tokens
    # logits_all: `scores` holds every position's row (else only the first)
    llm = Llama(model_path=model, logits_all=True, n_ctx=max(n, 64), n_batch=max(n, 64),
                n_ubatch=max(n, 64), type_k=0, type_v=0, flash_attn=False, n_threads=2,
                n_threads_batch=2, verbose=False, **YARN_FROM_MODEL,
                **({"lora_path": lora} if lora else {}))
    llm.eval(prompt)
    new: list[int] = []
    for _ in range(max_tokens):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == llm.token_eos():
            break
        new.append(tok)
        llm.eval([tok])
    Path(out_path).write_text(json.dumps(new))
    return {"n_new": len(new)}


def _child_tokenize(model: str, texts_path: str, out_path: str, add_bos: bool,
                    special: bool) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    texts = json.loads(Path(texts_path).read_text())
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=special) for t in texts]
    Path(out_path).write_text(json.dumps(ids))
    return {"n_texts": len(texts)}


def _child_quantize(src: str, dst: str, qtype: str) -> dict:
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise SystemExit(f"unknown quantization type {qtype!r}: llama_cpp has no "
                         f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    t0 = time.perf_counter()
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # llama.cpp's own prints go to stderr: stdout's last line stays the JSON
    try:
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    finally:
        ctypes.CDLL(None).fflush(None)  # C's buffered stdout out to stderr before the switch back
        os.dup2(saved, 1)
        os.close(saved)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src!r}, {dst!r}, {qtype}) returned {rc}")
    return {"quantize_s": time.perf_counter() - t0, "ftype": int(ftype)}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits")
    tk = sub.add_parser("tokenize")
    gr = sub.add_parser("greedy")
    for s in (lg, tk, gr):
        s.add_argument("model")
        s.add_argument("src")
        s.add_argument("out")
    gr.add_argument("--lora")
    gr.add_argument("--max-tokens", type=int, default=24)
    qz = sub.add_parser("quantize")
    qz.add_argument("src")
    qz.add_argument("dst")
    qz.add_argument("qtype")
    lg.add_argument("--lora")
    tk.add_argument("--no-bos", action="store_true")
    tk.add_argument("--special", action="store_true")
    a = p.parse_args()
    if a.cmd == "logits":
        info = _child_logits(a.model, a.src, a.out, a.lora)
    elif a.cmd == "greedy":
        info = _child_greedy(a.model, a.src, a.out, a.max_tokens, a.lora)
    elif a.cmd == "quantize":
        info = _child_quantize(a.src, a.dst, a.qtype)
    else:
        info = _child_tokenize(a.model, a.src, a.out, not a.no_bos, a.special)
    print(json.dumps(info), flush=True)
    # llama-cpp-python 0.3.36 frees a LoRA adapter in Llama.__del__ after llama.cpp freed it
    # with its model: a segfault (signal 11) as the interpreter collects it at exit, whether it
    # does depending on what else the process holds (seen with PYTHONPATH unset, not set).
    # Everything asked for is written: the process ends here, nothing collected.
    os._exit(0)


if __name__ == "__main__":
    gc.disable()  # no collection of a Llama before the end either (above)
    main()
