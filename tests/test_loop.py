"""Issue 36: the LoRA loop as an mlx-lm user expects it. Report lines every --report-every steps
and one per validation and checkpoint, their figures those of events.jsonl; validation batches
cut to their longest row; toymlx-generate rendering the prompt through the chat template."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_lora import events_of, mlx_lm_folder, tiny_gguf, tok_meta  # noqa: F401
from toymlx_cli.train import main as train_main

from toymlx.data.chat import SFTData
from toymlx.tokenizer import Tokenizer

REPORT = re.compile(r"step (\d+)/(\d+): train loss (\S+), lr (\S+), (\S+) steps/s, (\S+) "
                    r"tokens/s, (\d+) tokens trained, peak memory (\S+) MB \(MLX\), (\S+) MB "
                    r"\(RSS\)")
VALIDATION = re.compile(r"step (\d+): val_loss (\S+) \((\S+) s\)")
CHECKPOINT = re.compile(r"step (\d+): checkpoint (\S+)")


def test_a_60_step_run_reports_every_10_steps_and_every_validation(tiny_gguf, tmp_path,  # noqa: F811
                                                                   capsys):
    data = mlx_lm_folder(tmp_path / "data", n_train=24, n_valid=6, n_test=0)
    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--data.path", str(data),
                       "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "60",
                       "--batch-size", "2", "--seq-len", "32", "--eval-every", "20",
                       "--eval-batches", "2", "--checkpoint-every", "30", "--no-progress",
                       "--no-compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    events = events_of(tmp_path / "r")
    steps = {e["step"]: e for e in events if e["kind"] == "step"}
    # what was trained on, counted apart: the target tokens of each step's batch
    tok = Tokenizer.from_metadata(tok_meta())
    rows = SFTData.from_file(data, tok, 32, pack=True)
    counted = np.cumsum([int(rows.batch(s, 0, 2)["mask"].sum()) for s in range(60)])
    assert [steps[s]["trained_tokens"] for s in range(1, 61)] == counted.tolist()

    reports = [m for m in map(REPORT.fullmatch, lines) if m]
    assert [int(m[1]) for m in reports] == [10, 20, 30, 40, 50, 60]
    for m in reports:
        n = int(m[1])
        window = [steps[s] for s in range(n - 9, n + 1)]
        seconds = sum(e["step_time_s"] for e in window)
        last = steps[n]
        before = steps[n - 10]["trained_tokens"] if n > 10 else 0
        assert int(m[2]) == 60
        assert m[3] == f"{np.mean([e['loss'] for e in window]):.4f}"
        assert m[4] == f"{last['lr']:.3e}"
        assert m[5] == f"{10 / seconds:.3f}"
        assert m[6] == f"{(last['trained_tokens'] - before) / seconds:.1f}"
        assert int(m[7]) == last["trained_tokens"]
        assert float(m[8]) == last["peak_memory_mb"] > 0
        assert float(m[9]) == last["peak_rss_mb"] > float(m[8])

    evals = [e for e in events if e["kind"] == "eval"]
    shown = [m for m in map(VALIDATION.fullmatch, lines) if m]
    assert [int(m[1]) for m in shown] == [e["step"] for e in evals] == [20, 40, 60]
    for m, e in zip(shown, evals):
        assert (m[2], m[3]) == (f"{e['val_loss']:.4f}", f"{e['seconds']:.2f}")
        assert e["seconds"] > 0
    saved = [m for m in map(CHECKPOINT.fullmatch, lines) if m]
    assert [(int(m[1]), m[2]) for m in saved] == [
        (e["step"], str(tmp_path / "r" / e["path"])) for e in events if e["kind"] == "checkpoint"]
    assert [int(m[1]) for m in saved] == [30, 60] and all(Path(m[2]).is_file() for m in saved)
    # in the order they happened: a step's report, then its validation, then its checkpoint
    order = [x for x in lines if REPORT.fullmatch(x) or VALIDATION.fullmatch(x)
             or CHECKPOINT.fullmatch(x)]
    assert order.index(reports[1][0]) < order.index(shown[0][0])
    assert order[-3:] == [reports[-1][0], shown[-1][0], saved[-1][0]]
