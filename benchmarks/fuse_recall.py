"""Does a fused file keep what a fine-tune taught? Recall and test loss of base + adapter against
the fused files of a LoRA run (docs/RESULTS.md, "The fused file keeps the fine-tune").

    python benchmarks/fuse_recall.py --run runs/fact --questions questions.json \\
        --word Quorvath --fused kept=fused-kept.gguf naive=fused-naive.gguf

For base + adapter (the run's base and its latest adapter) and each fused file: the answer to
each held-out question (greedy, 40 tokens, the GGUF's chat template) in llama.cpp
(llama-cpp-python; base + adapter through its --lora) and in toymlx, whether it contains
`--word`, the test loss (`toymlx-eval --split test`'s rows: the run's data folder's
test.jsonl) and the file's size. Prints one JSON object.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split

import argparse
import json
import sys
from pathlib import Path


def llama_cpp_answers(model: Path, questions: list[str], lora: Path | None) -> list[str]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=512, n_threads=2, verbose=False, seed=0,
                **({"lora_path": str(lora)} if lora else {}))
    out = []
    for q in questions:
        r = llm.create_chat_completion([{"role": "user", "content": q}], temperature=0.0,
                                       max_tokens=40)
        out.append(r["choices"][0]["message"]["content"])
    return out


def toymlx_answers(model, tok, questions: list[str]) -> list[str]:
    from toymlx.generate import generate

    out = []
    for q in questions:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                         add_bos=False)
        reply = []
        for t in generate(model, tok, ids, 40):
            if t in tok.eog_ids:
                break
            reply.append(t)
        out.append(tok.decode(reply))
    return out


def main() -> int:
    from toymlx_cli.eval import chat_loss

    from toymlx.checkpoint import checkpoint_file
    from toymlx.generate import load_for_generation
    from toymlx.runs import Bundle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="the LoRA run folder")
    p.add_argument("--questions", required=True, help="JSON list of held-out questions")
    p.add_argument("--word", required=True, help="what a recalled answer contains")
    p.add_argument("--fused", nargs="*", default=[], help="NAME=FILE.gguf fused files")
    a = p.parse_args()
    questions = json.loads(Path(a.questions).read_text())
    bundle = Bundle.of(a.run)
    base = Path(next(e for e in bundle.events if e["kind"] == "run_start")["config"]["base_file"])
    adapter = checkpoint_file(a.run, "--run")
    models = {"base + adapter": (base, adapter)}
    models.update({n: (Path(f), None) for n, f in (s.split("=", 1) for s in a.fused)})
    models["base alone"] = (base, None)
    report = {}
    for name, (path, lora) in models.items():
        model, tok = (load_for_generation(path, lora) if lora else load_for_generation(path))
        loss, rows, _ = chat_loss(model, tok, bundle.config, "test")
        mine = toymlx_answers(model, tok, questions)
        cpp = llama_cpp_answers(path, questions, lora)
        report[name] = {
            "file": str(path), "bytes": path.stat().st_size, "test_loss": round(loss, 4),
            "test_rows": rows, "recall_toymlx": sum(a.word in s for s in mine),
            "recall_llama_cpp": sum(a.word in s for s in cpp),
            "answers_toymlx": mine, "answers_llama_cpp": cpp}
        print(f"{name}: test loss {loss:.4f}, recall toymlx {report[name]['recall_toymlx']}/"
              f"{len(questions)}, llama.cpp {report[name]['recall_llama_cpp']}/{len(questions)}, "
              f"{path.stat().st_size / 2**20:.2f} MiB", file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
