"""mlx-lm's WikiSQL LoRA tutorial, side by side: one mlx-lm config file given unchanged to
`mlx_lm lora -c F` and to `toymlx-train --recipe lora --base GGUF -c F` (issue 48).

What it does, in fresh processes (this one only reads their output):
- the model mlx-lm loads: the GGUF dequantized exactly (`load_llama(weights="float32")`, the
  values toymlx's lora recipe computes with on a CPU, where its base is held as the file's own
  blocks decoded to float32), put into mlx-lm's own llama (`mlx_lm_step.build_peer`) and saved
  with mlx-lm's `save_model`/`save_config`, float32; the tokenizer built by transformers from
  the GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, needs the `gguf` package) and
  saved beside it. Cached in ~/.cache/toymlx/mlx-lm.
- checks before training (`check_child`), each one a SystemExit when it fails:
  - same tokens: every row of train/valid/test as mlx-lm's own dataset code reads the folder
    (`mlx_lm.tuner.datasets.load_local_dataset`, its tokenizer: EOS appended) equals the ids
    toymlx trains on (`toymlx.data.chat.tokenize_example`, the GGUF's tokenizer);
  - same function: mlx-lm's model (loaded by `mlx_lm.utils.load`) and toymlx's lora base
    (`load_llama`, blocks) give the same logits on the first rows (relative error <= 1e-4).
- the config file: mlx-lm's example LoRA config shape (lora_config.yaml in mlx-lm's examples),
  every key the same for both tools; `model:` is the mlx-lm folder (toymlx is given the GGUF by
  `--base`, which a command-line option gives over the file).
- the two runs, as a user types them, one after the other (never at the same time, so each has
  the cores): `python -m mlx_lm lora -c F` and `toymlx-train --recipe lora --base GGUF -c F`.
  mlx-lm's validation and test losses are parsed from its printed lines (3 decimals), toymlx's
  from the run's events.jsonl.
- mlx-lm rescored (`rescore_child`): mlx-lm's `default_loss` counts one target past each row's
  end (`steps <= lengths`: predicting the pad id 0 after EOS; mlx-lm PR #1697), which toymlx does
  not train or score. mlx-lm's own saved adapters (`save_every` = `steps_per_eval`; the final
  ones for test) are scored on every batch of mlx-lm's own `iterate_batches`, one forward each,
  with `default_loss`'s mask (its figure: the test loss must reproduce the printed one) and
  with the mask cut at the row's end (the targets toymlx scores). The ratio toymlx / mlx-lm is
  given against both; the run passes when every ratio is <= --max-ratio (1.02).
- step times: toymlx's median `step_time_s` of its step events (steps 2..N); mlx-lm's median
  over its train reports (`steps_per_report` steps each, no validation inside: mlx-lm's own
  `train_time`), recovered from its printed tok/s and trained-token count.

    python benchmarks/mlx_lm_side_by_side.py --data /tmp/wikisql [--base GGUF] [--iters 200]
        [--steps-per-eval 50] [--work DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = Path.home() / ".cache" / "toymlx" / "mlx-lm"
RESULT = "mlx_lm_side_by_side result: "
"""A child's last stdout line starts with this, then its JSON."""
LOGITS_ROWS, LOGITS_RTOL = 4, 1e-4


def model_folder(gguf: Path, cache: Path = CACHE) -> Path:
    """The mlx-lm model folder of `gguf` (float32 weights, config.json, tokenizer files), written
    now by a child process unless already in `cache`."""
    out = cache / f"{gguf.stem}.mlx-f32"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{out.name}.tmp{os.getpid()}"
    _child("--convert-child", str(gguf), str(tmp))
    tmp.rename(out)
    return out


def _child(*args: str) -> dict[str, Any]:
    """Run this script's child mode; its result line's JSON (RuntimeError with its output)."""
    p = subprocess.run([sys.executable, str(Path(__file__)), *args], cwd=REPO,
                       capture_output=True, text=True, check=False)
    lines = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{args[0]} failed ({p.returncode}): "
                           f"{(p.stdout + p.stderr).strip()[-2000:]}")
    return json.loads(lines[-1][len(RESULT):])


def convert_child(gguf: Path, out: Path) -> dict[str, Any]:
    """In the child: the GGUF's exact float32 values in mlx-lm's llama, saved as mlx-lm saves a
    model, and transformers' tokenizer of the GGUF beside it."""
    from mlx_lm.utils import save_config, save_model
    from mlx_lm_step import build_peer, model_config
    from toymlx_step import weights_np
    from transformers import AutoTokenizer

    import toymlx  # noqa: F401  (binds OpenBLAS before mlx loads)
    from toymlx.gguf.llama import load_llama

    model, g = load_llama(gguf, weights="float32")
    g.close()
    args, weights = model.args, weights_np(model)
    del model
    peer = build_peer(args, weights)
    out.mkdir(parents=True)
    save_model(out, peer)
    save_config(model_config(args), out / "config.json")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return {"folder": str(out)}


def check_child(folder: Path, gguf: Path, data: Path) -> dict[str, Any]:
    """In the child: the same token ids on every row of every split, and the same logits."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.tuner.datasets import load_local_dataset
    from mlx_lm.utils import load

    import toymlx  # noqa: F401
    from toymlx.data.chat import load_examples, tokenize_example
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.llama import load_llama

    peer, hf_tok = load(str(folder))
    with_ids = argparse.Namespace(mask_prompt=False)
    splits = dict(zip(("train", "valid", "test"), load_local_dataset(data, hf_tok, with_ids)))
    model, g = load_llama(gguf, weights="blocks")  # the lora recipe's base on a CPU
    tok = Tokenizer.from_metadata(dict(g.metadata))
    g.close()
    rows: dict[str, int] = {}
    first: list[list[int]] = []
    for split, ds in splits.items():
        examples = load_examples(data / f"{split}.jsonl")
        if len(examples) != len(ds):
            raise SystemExit(f"{split}: mlx-lm reads {len(ds)} rows, toymlx {len(examples)}")
        for i, ex in enumerate(examples):
            theirs, offset = ds.process(ds[i])
            ours, mask = tokenize_example(ex, tok, mask_prompt=False)
            if list(theirs) != list(ours) or offset != 0 or not all(mask):
                raise SystemExit(f"{data / split}.jsonl row {i + 1}: mlx-lm's ids {theirs[:12]}"
                                 f"... (offset {offset}) differ from toymlx's {ours[:12]}...")
            if split == "valid" and len(first) < LOGITS_ROWS:
                first.append(list(ours))
        rows[split] = len(examples)
    if hf_tok.eos_token_id != tok.eos_id:
        raise SystemExit(f"EOS: mlx-lm's {hf_tok.eos_token_id}, toymlx's {tok.eos_id}")
    worst = 0.0
    for ids in first:
        x = mx.array([ids])
        a = np.array(peer(x).astype(mx.float32))
        b = np.array(model(x).astype(mx.float32))
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    if worst > LOGITS_RTOL:
        raise SystemExit(f"logits: mlx-lm's model differs from toymlx's by {worst:.2e} "
                         f"(relative to the largest logit), expected <= {LOGITS_RTOL}")
    return {"rows": rows, "eos_id": tok.eos_id, "logits_max_rel_err": worst,
            "logits_rows": len(first)}


def rescore_child(folder: Path, data: Path, adapters: Path, config: Path) -> dict[str, Any]:
    """In the child: mlx-lm's saved adapters (and the base: step 0) scored by mlx-lm's
    `evaluate` on its own batches, with `default_loss` and with its mask cut at the row's end."""
    import mlx.core as mx
    import yaml
    from mlx import nn
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import iterate_batches
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    import toymlx  # noqa: F401

    cfg = yaml.safe_load(config.read_text())
    model, tok = load(str(folder))
    model.freeze()
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"])
    _, valid, test = load_local_dataset(data, tok, argparse.Namespace(mask_prompt=False))

    size, max_seq = cfg["batch_size"], cfg.get("max_seq_length", 2048)

    def score(ds) -> dict[str, float]:
        """Every batch of mlx-lm's own `iterate_batches` (as `evaluate` with -1), one forward
        each, scored with default_loss's mask (`steps <= lengths`) and with it cut at the
        row's end (`steps < lengths`, PR #1697's fix)."""
        sums = {"mlx_lm_loss": [0.0, 0], "in_row_loss": [0.0, 0]}
        model.eval()
        for batch, lengths in iterate_batches(CacheDataset(ds), size, max_seq):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            ce = nn.losses.cross_entropy(model(inputs), targets).astype(mx.float32)
            steps = mx.arange(1, targets.shape[1] + 1)
            for name, end in (("mlx_lm_loss", steps <= lengths[:, 1:]),
                              ("in_row_loss", steps < lengths[:, 1:])):
                mask = mx.logical_and(steps >= lengths[:, 0:1], end)
                sums[name][0] += float((ce * mask).sum().item())
                sums[name][1] += int(mask.sum().item())
        return {k: total / n for k, (total, n) in sums.items()}

    out: dict[str, Any] = {"valid": {}, "test": None}
    for f in sorted(adapters.glob("[0-9]*_adapters.safetensors")):
        model.load_weights(str(f), strict=False)
        out["valid"][str(int(f.name.split("_")[0]))] = score(valid)
    model.load_weights(str(adapters / "adapters.safetensors"), strict=False)
    out["test"] = score(test)
    return out


def write_config(path: Path, folder: Path, data: Path, iters: int, steps_per_eval: int) -> dict:
    """mlx-lm's example LoRA config (examples/lora_config.yaml's keys and values), with
    `iters` cut, steps_per_eval/save_every set so there are several validation points and a
    saved adapter at each, and `test: true`."""
    import yaml

    cfg = {"model": str(folder), "train": True, "fine_tune_type": "lora", "optimizer": "adam",
           "data": str(data), "seed": 0, "num_layers": 16, "batch_size": 4, "iters": iters,
           "val_batches": 25, "learning_rate": 1e-5, "steps_per_report": 10,
           "steps_per_eval": steps_per_eval, "save_every": steps_per_eval, "test": True,
           "test_batches": 100, "max_seq_length": 2048, "grad_checkpoint": False,
           "lora_parameters": {"keys": ["self_attn.q_proj", "self_attn.v_proj"], "rank": 8,
                               "scale": 20.0, "dropout": 0.0}}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


_VAL = re.compile(r"^\s*(\d+)\s+val\s+([0-9.]+)")
_TRAIN = re.compile(r"^\s*(\d+)\s+([0-9.]+)\s+\S\s+([0-9,]+)\s+([0-9.]+)k")
_TEST = re.compile(r"Test loss ([0-9.]+)")


_OPENBLAS_FIRST = ("import sys; from toymlx.backend.device import bind_blas; "
                   "assert bind_blas()['name'] == 'openblas', 'OpenBLAS not bound'; "
                   "sys.argv[0] = 'mlx_lm'; from mlx_lm.cli import main; main()")
"""`python -m mlx_lm` with MLX's CPU BLAS pointed at OpenBLAS first, as toymlx's commands have
it: MLX's reference BLAS, which `python -m mlx_lm` gets on Linux, is many times slower."""


def run_mlx_lm(config: Path, cwd: Path, blas: str = "openblas", reuse: bool = False
               ) -> dict[str, Any]:
    """`python -m mlx_lm lora -c F` as a user runs it (`blas` openblas: with OpenBLAS bound
    first); its printed losses and report times."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "-c", str(config)]
    if blas == "openblas":  # mlx-lm's own command line, run after toymlx bound OpenBLAS
        cmd[1:3] = ["-c", _OPENBLAS_FIRST]
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    log = cwd / "stdout.txt"
    if not (reuse and (cwd / "adapters" / "adapters.safetensors").is_file() and log.is_file()):
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
        log.write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            raise RuntimeError(f"mlx_lm lora failed ({p.returncode}): "
                               f"{(p.stdout + p.stderr).strip()[-2000:]}")
    val, reports, test = {}, [], None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()).splitlines():
        if m := _VAL.match(line):
            # printed at iteration `it` before its step: the loss after it - 1 steps
            # (it = 1: the base model, 0 steps)
            val[int(m[1]) - 1] = float(m[2])
        elif m := _TRAIN.match(line):
            reports.append((int(m[1]), float(m[2]), float(m[3].replace(",", "")),
                            float(m[4]) * 1000))
        elif m := _TEST.search(line):
            test = float(m[1])
    step_s = []
    for (it0, _, _, tok0), (it1, _, tps, tok1) in zip([(0, 0, 0, 0.0)] + reports, reports):
        step_s.append((tok1 - tok0) / tps / (it1 - it0))  # train_time / steps of the report
    return {"command": "python -m mlx_lm lora -c " + config.name, "blas": blas, "val": val,
            "test": test, "train": [r[:2] for r in reports], "step_times_s": step_s,
            "median_step_s": statistics.median(step_s[1:] or step_s),
            "wall_s": round(time.perf_counter() - t0, 1)}


def run_toymlx(config: Path, gguf: Path, root: Path) -> dict[str, Any]:
    """`toymlx-train --recipe lora --base GGUF -c F` as a user runs it; its events."""
    from toymlx.bundle.events import read_events

    exe = Path(sys.executable).with_name("toymlx-train")
    cmd = [str(exe) if exe.exists() else "toymlx-train", "--recipe", "lora", "--base",
           str(gguf), "-c", str(config), "--runs-root", str(root), "--run-id", "toymlx",
           "--no-progress"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    root.mkdir(parents=True, exist_ok=True)
    (root / "stdout.txt").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"toymlx-train failed ({p.returncode}): "
                           f"{(p.stdout + p.stderr).strip()[-2000:]}")
    events = read_events(root / "toymlx")
    val = {e["step"]: e["val_loss"] for e in events if e["kind"] == "eval" and "val_loss" in e}
    test = next((e["test_loss"] for e in events if "test_loss" in e), None)
    times = [e["step_time_s"] for e in events if e["kind"] == "step"]
    return {"command": "toymlx-train --recipe lora --base " + gguf.name + " -c " + config.name,
            "val": val, "test": test, "step_times_s": times,
            "median_step_s": statistics.median(times[1:] or times),
            "first_step_s": times[0] if times else None,
            "wall_s": round(time.perf_counter() - t0, 1)}


def table(ours: dict[str, Any], theirs: dict[str, Any], rescored: dict[str, Any]) -> list[dict]:
    """One row per validation point and the test: toymlx, mlx-lm printed, mlx-lm rescored on
    toymlx's targets, and the two ratios."""
    rows = []
    for step in sorted(ours["val"]):
        printed = theirs["val"].get(step, theirs["val"].get(step - 1))
        r = rescored["valid"].get(str(step), {})
        rows.append({"point": f"val @ {step}", "toymlx": ours["val"][step],
                     "mlx_lm_printed": printed, "mlx_lm_printed_at": next(
                         (s for s in (step, step - 1) if s in theirs["val"]), None),
                     "mlx_lm_in_row": r.get("in_row_loss"),
                     "mlx_lm_default_loss": r.get("mlx_lm_loss")})
    rows.append({"point": "test", "toymlx": ours["test"], "mlx_lm_printed": theirs["test"],
                 "mlx_lm_printed_at": None,
                 "mlx_lm_in_row": rescored["test"]["in_row_loss"],
                 "mlx_lm_default_loss": rescored["test"]["mlx_lm_loss"]})
    for r in rows:
        for k in ("printed", "in_row"):
            ref = r[f"mlx_lm_{k}"]
            r[f"ratio_{k}"] = None if not ref or r["toymlx"] is None else r["toymlx"] / ref
    return rows


def _f(v: Any, d: int = 4) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path[:0] = [str(HERE), str(REPO)]  # this checkout's toymlx, not an installed one
    children = {"--convert-child": convert_child, "--check-child": check_child,
                "--rescore-child": rescore_child}
    if argv[:1] and argv[0] in children:
        rec = children[argv[0]](*map(Path, argv[1:]))
        print(RESULT + json.dumps(rec), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True,
                   help="mlx-lm's WikiSQL folder (train/valid/test.jsonl, {'text': ...} rows)")
    p.add_argument("--base", type=Path, help="the GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--steps-per-eval", type=int, default=50)
    p.add_argument("--work", type=Path, default=Path("/tmp/mlx-lm-side-by-side"),
                   help="folder for the config file and both runs (emptied first)")
    p.add_argument("--max-ratio", type=float, default=1.02)
    p.add_argument("--mlx-lm-blas", choices=("openblas", "reference"), default="openblas",
                   help="reference: `python -m mlx_lm` exactly as typed (MLX's own BLAS on "
                        "Linux); openblas: the same command with OpenBLAS bound first")
    p.add_argument("--reuse", action="store_true",
                   help="keep --work's finished mlx-lm run (its printed log and adapters)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for split in ("train", "valid", "test"):
        if not (args.data / f"{split}.jsonl").is_file():
            p.error(f"--data: expected {args.data / split}.jsonl (mlx-lm's data folder layout)")
    from user_paths import host_info, host_line, smollm_gguf

    gguf = (args.base or smollm_gguf()).resolve()
    data = args.data.resolve()
    host = host_info()
    print(host_line(host), flush=True)
    folder = model_folder(gguf)
    checks = _child("--check-child", str(folder), str(gguf), str(data))
    print(f"same tokens: {checks['rows']} rows, EOS {checks['eos_id']}; logits of "
          f"{checks['logits_rows']} rows: max relative error {checks['logits_max_rel_err']:.1e}",
          flush=True)
    import shutil

    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    config = args.work / "lora_config.yaml"
    cfg = write_config(config, folder, data, args.iters, args.steps_per_eval)
    theirs = run_mlx_lm(config, args.work / "mlx-lm", args.mlx_lm_blas, args.reuse)
    print(f"mlx-lm: {theirs['wall_s']} s, median step {theirs['median_step_s']:.3f} s", flush=True)
    shutil.rmtree(args.work / "toymlx-runs", ignore_errors=True)
    ours = run_toymlx(config, gguf, args.work / "toymlx-runs")
    print(f"toymlx: {ours['wall_s']} s, median step {ours['median_step_s']:.3f} s", flush=True)
    rescored = _child("--rescore-child", str(folder), str(data),
                      str(args.work / "mlx-lm" / "adapters"), str(config))
    if theirs["test"] is not None and abs(rescored["test"]["mlx_lm_loss"] - theirs["test"]) > 6e-4:
        raise SystemExit(f"rescoring: mlx-lm's adapters score {rescored['test']['mlx_lm_loss']:.4f} "
                         f"on test with default_loss, mlx-lm printed {theirs['test']}")
    rows = table(ours, theirs, rescored)
    print(f"\n{'point':<10} {'toymlx':>8} {'mlx-lm':>8} {'ratio':>7} {'mlx-lm*':>8} {'ratio*':>7}")
    for r in rows:
        print(f"{r['point']:<10} {_f(r['toymlx'])} {_f(r['mlx_lm_printed'], 3):>8} "
              f"{_f(r['ratio_printed'])} {_f(r['mlx_lm_in_row'])} {_f(r['ratio_in_row'])}")
    print("mlx-lm: as printed (its val line at iteration it: after it - 1 steps); mlx-lm*: its "
          "saved adapters after `step` steps, scored on the targets toymlx scores (no pad "
          "target)")
    print(f"median step: toymlx {ours['median_step_s']:.3f} s, mlx-lm {theirs['median_step_s']:.3f}"
          f" s ({ours['median_step_s'] / theirs['median_step_s']:.2f}x)")
    worst = max(r["ratio_in_row"] for r in rows if r["ratio_in_row"] is not None)
    ok = worst <= args.max_ratio and all(
        r["ratio_printed"] is None or r["ratio_printed"] <= args.max_ratio for r in rows)
    print(f"{'PASS' if ok else 'FAIL'}: worst ratio {worst:.4f} (limit {args.max_ratio})")
    if args.json:
        args.json.write_text(json.dumps({
            "host": host, "config": cfg, "checks": checks, "mlx_lm": theirs, "toymlx": ours,
            "rescored": rescored, "rows": rows, "pass": ok,
            "commands": [theirs["command"], ours["command"]]}, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
