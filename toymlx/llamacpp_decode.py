"""The llama.cpp engine's child process (`python -m toymlx.llamacpp_decode`).

It reads one JSON request line on stdin (the model, adapter, context, seed, prompt ids and the
samplers), loads the model in llama.cpp (llama-cpp-python), prints `ready`, then prints each new
token id on its own line as it is decoded, flushed. Run apart from toymlx-generate so that a
llama.cpp crash on a given CPU (one llama-cpp-python build segfaulted decoding Q4_1 on an
AVX-512 host) costs a fallback to MLX, not the command (`toymlx.generate.LlamaCppDecoder`).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import llama_cpp

    req = json.loads(sys.stdin.readline())
    llm = llama_cpp.Llama(req["model"], n_ctx=req["context"], seed=req["seed"], verbose=False,
                          n_threads=os.cpu_count(), last_n_tokens_size=20,
                          lora_path=req["adapter"])
    print("ready", flush=True)
    req = json.loads(sys.stdin.readline())  # the prompt and samplers
    steps = llm.generate(req["ids"], temp=req["temperature"], top_p=req["top_p"],
                         top_k=req["top_k"], min_p=req["min_p"],
                         repeat_penalty=req["repetition_penalty"])
    for n, tok in enumerate(steps):
        if tok == req["eos"] or n >= req["budget"]:
            break
        print(int(tok), flush=True)


if __name__ == "__main__":
    main()
