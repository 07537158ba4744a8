"""The llama.cpp engine's child process (`python -m toymlx.generation.llamacpp_decode`).

It reads one JSON request line on stdin (the model, adapter, context, seed), loads the model in
llama.cpp (llama-cpp-python) and prints `ready`; then, for each request line that follows (the
prompt ids and the samplers: one turn of a conversation), each new token id on its own line as
it is decoded, flushed, and `END` after the last, until stdin closes. llama.cpp keeps the
tokens it has computed between requests and computes again only where a prompt departs from
them (a conversation's next turn repeats the whole conversation so far). Run apart from toymlx-generate so that a
llama.cpp crash on a given CPU (one llama-cpp-python build segfaulted decoding Q4_1 on an
AVX-512 host) costs a fallback to MLX, not the command (`toymlx.generation.generate.LlamaCppDecoder`).
"""

from __future__ import annotations

import json
import os
import sys

END = "end"
"""The line after a request's last token."""


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


def main() -> None:
    import llama_cpp

    req = json.loads(sys.stdin.readline())
    plain_cpu_buffers(req["model"])
    llm = llama_cpp.Llama(req["model"], n_ctx=req["context"], seed=req["seed"], verbose=False,
                          n_threads=os.cpu_count(), last_n_tokens_size=20,
                          lora_path=req["adapter"])
    print("ready", flush=True)
    for line in sys.stdin:  # a prompt and its samplers, per turn
        req = json.loads(line)
        steps = llm.generate(req["ids"], temp=req["temperature"], top_p=req["top_p"],
                             top_k=req["top_k"], min_p=req["min_p"],
                             repeat_penalty=req["repetition_penalty"])
        for n, tok in enumerate(steps):
            if tok == req["eos"] or n >= req["budget"]:
                break
            print(int(tok), flush=True)
        print(END, flush=True)


if __name__ == "__main__":
    main()
