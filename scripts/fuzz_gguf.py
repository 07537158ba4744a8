"""Fuzz every GGUF reader path of toymlx with mutated real files.

    python scripts/fuzz_gguf.py --cases 5000              # long run, summary on stdout
    python scripts/fuzz_gguf.py --cases 400 --json out.json
    python scripts/fuzz_gguf.py --replay saved.gguf       # rerun one saved input in-process
    python scripts/fuzz_gguf.py --seed 0 --show-case 17   # rebuild case 17's bytes

Seeds are real files: a checkpoint written by a 2-step `toymlx-train --recipe from-scratch`
run, the same model with mixed quantized tensor types, a LoRA adapter for it,
`stories260K.gguf`, and the llama.cpp tokenizer GGUFs from ../shared/data. Each case applies
one to three mutations, structure-aware (header counts, key/value types and payloads, float64
metadata, tensor dims/types/offsets/names, alignment, llama and tokenizer hyperparameters)
and byte-level (bit flips, interesting integers, truncation, insertions, splices), then feeds
the result to every reader path. A case passes when each path either loads or raises one
ValueError (GGUFError is one) whose message is a single line naming the file. Anything else
-- another exception type, a multi-line or anonymous message, MemoryError, a hang, or a crash
of the process -- is a defect, and its input is saved under --out.

Cases are a pure function of (--seed, case index), so a defect is reproducible from its
number. Cases run in a worker subprocess under a 4 GiB address-space limit; the supervisor
restarts it after a crash or a hang and records the case that was running. The modules are
in `scripts/gguf_fuzzer/`.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse
import json
import sys
from pathlib import Path

from gguf_fuzzer.supervisor import replay, report, show_case, supervise, worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="number of fuzz cases")
    ap.add_argument("--seed", type=int, default=0, help="fuzz seed (cases are a pure function)")
    ap.add_argument("--out", default="fuzz-out", help="folder for offending inputs")
    ap.add_argument("--json", help="write the summary JSON here")
    ap.add_argument("--case-timeout", type=float, default=30.0, help="seconds before a hang")
    ap.add_argument("--time-budget", type=float, default=0, help="stop after this many s")
    ap.add_argument("--mem-gb", type=int, default=4, help="worker address-space limit (GiB)")
    ap.add_argument("--profile", choices=["quick", "full"], default="full",
                    help="quick: small seeds only (vocabularies cut to 1500 tokens); full: "
                    "also the 50k-token vocabularies as they are")
    ap.add_argument("--replay", help="run every reader on one saved file and print outcomes")
    ap.add_argument("--show-case", type=int, help="write case N's bytes to --out and exit")
    ap.add_argument("--selftest", action="store_true",
                    help="add a reader that segfaults on case 1 and hangs on case 2, to check "
                    "that both are caught and saved")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--end", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.replay:
        return replay(args.replay)
    if args.show_case is not None:
        show_case(args.seed, args.show_case, Path(args.out))
        return 0
    s = supervise(args, Path(__file__).resolve())
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    print(report(s))
    bad = s["defects"] or s["crashes"] or s["hangs"] or s.get("worker_failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
