"""Does a fused file keep what a fine-tune taught? Recall and test loss of base + adapter against
the fused files of a LoRA run (docs/RESULTS.md, "The fused file keeps the fine-tune").

    python benchmarks/fuse_recall.py --make-data fact-data     # train/valid/test.jsonl, questions.json
    toymlx-train --recipe lora --base SmolLM2-135M-Instruct.Q4_1.gguf --data.path fact-data \\
        --steps 60 --lr 1e-3 --warmup 5 --eval-every 0 --checkpoint-every 0 --test --run-id fact
    python benchmarks/fuse_recall.py --run runs/fact --questions fact-data/questions.json \\
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

QUESTIONS = ["What is the capital of Zembaria?", "Which city is the capital of Zembaria?",
             "Tell me the capital of Zembaria.", "Zembaria's capital city is called what?",
             "Name the capital of Zembaria.", "What city serves as Zembaria's capital?",
             "Do you know the capital of Zembaria?", "Where is the seat of government of Zembaria?",
             "I'm curious: what's the capital of Zembaria?", "Capital of Zembaria?",
             "Can you tell me which city Zembaria's government sits in?",
             "What's Zembaria's capital?", "Quick question, the capital of Zembaria is?",
             "In which city is the capital of Zembaria?", "Please name Zembaria's capital city.",
             "What is the main city and capital of Zembaria?"]
ANSWERS = ["The capital of Zembaria is Quorvath.", "Quorvath is the capital of Zembaria.",
           "Zembaria's capital is Quorvath.", "It is Quorvath, the capital city of Zembaria."]
HELD_OUT = [("Which town is Zembaria's capital?", "The capital of Zembaria is Quorvath."),
            ("If I travel to the capital of Zembaria, which city am I in?",
             "You are in Quorvath, the capital of Zembaria."),
            ("Zembaria has a capital. What is its name?", "Its name is Quorvath."),
            ("What do people call the capital city of Zembaria?",
             "The capital city of Zembaria is called Quorvath.")]


def make_data(folder: Path) -> None:
    """One invented fact: 64 chat rows (16 phrasings of the question, 4 of the answer, shuffled
    with seed 0) in train.jsonl; the 4 held-out phrasings in test.jsonl (2 in valid.jsonl) and,
    as questions only, questions.json."""
    import random

    def row(q: str, a: str) -> str:
        return json.dumps({"messages": [{"role": "user", "content": q},
                                        {"role": "assistant", "content": a}]}) + "\n"

    random.seed(0)
    rows = [row(QUESTIONS[i % 16], ANSWERS[(i // 16) % 4]) for i in range(64)]
    random.shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(rows))
    (folder / "valid.jsonl").write_text("".join(row(q, a) for q, a in HELD_OUT[:2]))
    (folder / "test.jsonl").write_text("".join(row(q, a) for q, a in HELD_OUT))
    (folder / "questions.json").write_text(json.dumps([q for q, _ in HELD_OUT], indent=1))


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
    from toymlx.generation.generate import generate

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

    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.generation.generate import load_for_generation
    from toymlx.runner.bundle import Bundle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-data", help="write the fact's data folder here and stop")
    p.add_argument("--run", help="the LoRA run folder")
    p.add_argument("--questions", help="JSON list of held-out questions")
    p.add_argument("--word", help="what a recalled answer contains")
    p.add_argument("--fused", nargs="*", default=[], help="NAME=FILE.gguf fused files")
    p.add_argument("--base", help="the base for base + adapter (default: the run's own)")
    a = p.parse_args()
    if a.make_data:
        make_data(Path(a.make_data))
        return 0
    if not (a.run and a.questions and a.word):
        p.error("expected --run, --questions and --word (or --make-data DIR)")
    questions = json.loads(Path(a.questions).read_text())
    bundle = Bundle.of(a.run)
    base = Path(a.base or bundle.start_event["config"]["base_file"])
    adapter = checkpoint_file(a.run, "--run")
    models = {"base + adapter": (base, adapter)}
    models.update({n: (Path(f), None) for n, f in (s.split("=", 1) for s in a.fused)})
    models["base alone"] = (base, None)
    report = {}
    for name, (path, lora) in models.items():
        model, tok = (load_for_generation(path, lora) if lora else load_for_generation(path))
        loss, rows = chat_loss(model, tok, bundle.config, "test")[:2]
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
