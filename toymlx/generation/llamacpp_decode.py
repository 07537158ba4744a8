"""The llama.cpp engine's child process (`python -m toymlx.generation.llamacpp_decode`).

It reads one JSON request line on stdin (the model, adapter, context, seed), loads the model in
llama.cpp (llama-cpp-python) and prints `ready`; then, for each request line that follows (the
prompt ids and the samplers: one turn of a conversation, or with `seed` one sample decoded
afresh; with `window`, past it by context shifts, `shifted`), each new token id on its own line
as it is decoded, flushed, and `END` after the last, until stdin closes. llama.cpp keeps the
tokens it has computed between requests and computes again only where a prompt departs from
them (a conversation's next turn repeats the whole conversation so far). Run apart from toymlx-generate so that a
llama.cpp crash on a given CPU (one llama-cpp-python build segfaulted decoding Q4_1 on an
AVX-512 host) costs a fallback to MLX, not the command (`toymlx.generation.generate.LlamaCppDecoder`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

END = "end"
"""The line after a request's last token."""


YARN_FROM_MODEL = {"yarn_beta_fast": -1.0, "yarn_beta_slow": -1.0, "yarn_attn_factor": -1.0}
"""llama-cpp-python's `Llama` arguments for the file's own YaRN parameters, as llama.cpp's CLI
and server take them (their defaults are -1, "from the model"): llama-cpp-python's defaults
(beta_fast 32, beta_slow 1) replace a file's rope.scaling.yarn_beta_fast/slow (Ministral 3's
mistral3 reads them), and its 1.0 a file's yarn_attn_factor."""


def plain_cpu_buffers(model: str) -> None:
    """Load a quantized model without llama.cpp's extra CPU buffer types (AMX tiles, repacked
    weights): llama-cpp-python 0.3.36 segfaults decoding a SmolLM2 Q4_1 file in them on an Intel host with
    AMX (the same file decodes on the plain path: "The capital of France is Paris."). `Llama`
    takes no such option, so its default model parameters are the ones changed."""
    import llama_cpp.llama_cpp as lib

    from toymlx.gguf.reader import GGUFFile

    with GGUFFile(model) as g:  # float files keep them: their F16 path is the closer one
        if all(t.type.name in ("F32", "F16", "BF16") for t in g.tensors.values()):
            return
    default = lib.llama_model_default_params
    if "use_extra_bufts" not in {name for name, _ in default().__class__._fields_}:
        return  # a llama.cpp without the option: nothing to turn off

    def plain():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None where there is no such file
    (macOS)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def idle_cores(window: float = 0.1) -> float:
    """How many of this machine's cores are idle now: the idle share of /proc/stat over `window`
    seconds times the cores, or, without /proc/stat, the cores less the 1-minute load average."""
    cores = os.cpu_count() or 1
    before = _cpu_times()
    if before is not None:
        time.sleep(window)
        after = _cpu_times()
        total = after[1] - before[1]
        if total > 0:
            return cores * (after[0] - before[0]) / total
    return max(0.0, cores - os.getloadavg()[0])


@dataclass(frozen=True)
class CpuMark:
    """/proc/stat's idle and total jiffies, this process's own CPU time in jiffies (all its
    threads), and when they were read (`time.monotonic`)."""

    idle: int
    total: int
    own: int
    at: float


def cpu_mark() -> CpuMark | None:
    """This machine's CPU times now (`CpuMark`), or None where there is no /proc/stat."""
    times = _cpu_times()
    if times is None:
        return None
    t = os.times()
    return CpuMark(*times, round((t.user + t.system) * os.sysconf("SC_CLK_TCK")), time.monotonic())


def idle_cores_between(before: CpuMark, after: CpuMark) -> float:
    """How many cores other programs left idle between two marks: the idle share plus this
    process's own share (its threads are done when the next decoding starts) times the cores;
    0 to the cores."""
    cores = os.cpu_count() or 1
    total = after.total - before.total
    if total <= 0:
        return float(cores)
    free = after.idle - before.idle + after.own - before.own
    return min(float(cores), max(0.0, cores * free / total))


@dataclass
class IdleCores:
    """`idle_cores` for each decoding call, its 0.1 s sleep paid once, not at every turn of a
    chat or prompt of a batch: a call measures over the time since the call before it (that
    call's decoding, own threads counted idle, and the pause after it), as long as that is
    `MIN_WINDOW` to `MAX_WINDOW` seconds; a shorter one takes the last figure (its window
    grows to the next call); a first call, a longer one (the average of a long pause hides a
    program started at its end) and a machine without /proc/stat ask `idle_cores`."""

    MIN_WINDOW = 0.1
    MAX_WINDOW = 60.0
    mark: CpuMark | None = None
    last: float | None = None

    def __call__(self) -> float:
        now = cpu_mark()
        if now is None:
            return idle_cores()  # the load average: no sleep
        if self.mark is None or self.last is None or now.at - self.mark.at > self.MAX_WINDOW:
            self.last, self.mark = idle_cores(), cpu_mark()
        elif now.at - self.mark.at >= self.MIN_WINDOW:
            self.last, self.mark = idle_cores_between(self.mark, now), now
        return self.last


def decode_threads(cores: int, idle: float) -> int:
    """llama.cpp's threads for a turn (and OpenBLAS's for an MLX decoding call on the CPU,
    `toymlx.generation.generate.decoding_blas_threads`): one per idle core, at least 1. Its threads wait for each
    other after every matmul, so one thread on a core other work holds stalls the rest: on 2
    cores with one busy, SmolLM2 decoded 3-28 tok/s on 2 threads, 50 on 1 (124 on 2, quiet)."""
    return max(1, min(cores, int(idle + 0.5)))


def shifted(llm: Any, req: dict[str, Any]) -> Iterator[int]:
    """The tokens llama.cpp decodes after the request's ids, endless: where the request names a
    `window`, the text in view goes on from its newer half each time it fills the window
    (`toymlx.generation.window`), llama.cpp computing those tokens again from position 0 (a
    fresh start: the kept tokens share no start with what it holds)."""
    from toymlx.generation.window import in_window

    ids, window = list(req["ids"]), req.get("window")
    while True:
        # a copy: llama-cpp-python's generate reuses the list it is given for its own tokens
        for tok in llm.generate(list(ids), temp=req["temperature"], top_p=req["top_p"],
                                top_k=req["top_k"], min_p=req["min_p"],
                                repeat_penalty=req["repetition_penalty"]):
            yield tok
            ids.append(tok)
            if window is not None and len(ids) >= window:
                ids = in_window(ids, window)
                break


def main() -> None:
    import llama_cpp

    req = json.loads(sys.stdin.readline())
    plain_cpu_buffers(req["model"])
    llm = llama_cpp.Llama(req["model"], n_ctx=req["context"], seed=req["seed"], verbose=False,
                          n_threads=os.cpu_count(), last_n_tokens_size=20,
                          lora_path=req["adapter"], **YARN_FROM_MODEL)
    print("ready", flush=True)
    idle = IdleCores()
    for line in sys.stdin:  # a prompt and its samplers, per turn
        req = json.loads(line)
        n = decode_threads(os.cpu_count() or 1, idle())
        llama_cpp.llama_set_n_threads(llm.ctx, n, n)
        if "seed" in req:  # a sample of its own: as a child loaded with this seed decodes it
            llm.set_seed(req["seed"])
            llm.reset()  # no prefix reused: the prompt computed in one batch, as at the start
        stop = set(req["stop"])
        for n, tok in enumerate(shifted(llm, req)):
            if tok in stop or n >= req["budget"]:
                break
            print(int(tok), flush=True)
        print(END, flush=True)
    # stdin closed: done. llama-cpp-python 0.3.36 frees a LoRA adapter in Llama.__del__ after
    # llama.cpp freed it with its model, a segfault as the interpreter collects it at exit (seen
    # in tests/llamacpp_runner.py's child, as PYTHONPATH was set or not): nothing is collected
    os._exit(0)


if __name__ == "__main__":
    main()
