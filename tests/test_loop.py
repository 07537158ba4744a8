"""Issue 36: the LoRA loop as an mlx-lm user expects it. Report lines every --report-every steps
and one per validation and checkpoint, their figures those of events.jsonl; validation batches
cut to their longest row; toymlx-generate rendering the prompt through the chat template."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from smollm import smollm_gguf  # noqa: F401  (session fixture)
from test_generate import chat_path  # noqa: F401  (fixture)
from test_lora import events_of, mlx_lm_folder, tiny_gguf, tok_meta  # noqa: F401
from toymlx_cli.train import main as train_main

from toymlx.data.chat import SFTData
from toymlx.data.tokenizer import Tokenizer

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


def test_a_negative_report_every_is_one_line(tiny_gguf, tmp_path, capsys):  # noqa: F811
    from cli_errors import error_line

    assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--report-every", "-1"]) == 2
    assert error_line(capsys) == ("toymlx-train: error: --report-every: expected >= 0 (0: no "
                                  "report lines), found -1")
    assert not any(tmp_path.iterdir())


# ---- validation at the speed of a forward pass -----------------------------------------------
def _lora_model(path: Path):
    """The tiny base with LoRA on q and v, B random (so the adapter counts), computing with the
    training step's CPU kernels."""
    import mlx.core as mx

    from toymlx.gguf.llama import load_llama
    from toymlx.models.lora import apply_lora, lora_layers
    from toymlx.models.ops import Ops

    model, g = load_llama(path, Ops(kernels="vectorised"))
    g.close()
    apply_lora(model, "q,v", rank=4, alpha=8.0)
    mx.random.seed(5)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.3
    mx.eval(model.parameters())
    return model


def _held_out_rows(seq_len: int = 128) -> dict:
    """Unpacked prompt/completion rows of different lengths, all far shorter than seq_len."""
    from toymlx.data.chat import Example, held_out_rows

    examples = [Example(f"f:{i}", prompt=f"question {i}" + "?" * (i % 5),
                        completion="answer " * (1 + i % 7)) for i in range(11)]
    return held_out_rows(examples, Tokenizer.from_metadata(tok_meta()), seq_len, True, False)


def _task(model, batches, **kw):
    from toymlx.models.losses import lm_loss
    from toymlx.training.task import Task

    return Task("t", model, lm_loss, lambda s: {}, batches, None, None, {}, **kw)


def test_validation_cut_to_the_longest_row_scores_as_padded_to_seq_len(tiny_gguf):  # noqa: F811
    from toymlx.data.chat import sft_val_batches
    from toymlx.models.losses import lm_held_out_sums
    from toymlx.training.evaluate import Evaluator

    model = _lora_model(tiny_gguf)
    rows = _held_out_rows(128)
    cut = sft_val_batches(rows, 4, 10)
    # rows in order of length (their last trained target), each batch as wide as its furthest
    # trained target, rounded up to 32 (not 128)
    last = np.array([int(np.flatnonzero(m)[-1]) + 1 for m in rows["mask"]])
    order = np.argsort(last, kind="stable")
    assert [b["inputs"][0, :, 0].tolist() for b in cut] == [
        rows["inputs"][order[i:i + 4], 0].tolist() for i in (0, 4, 8)]
    last, trained = last[order], rows["mask"].sum(axis=1)[order]
    want_w = [-(-max(last[i:i + 4]) // 32) * 32 for i in (0, 4, 8)]
    assert [b["inputs"].shape for b in cut] == [(1, 4, want_w[0]), (1, 4, want_w[1]),
                                                (1, 3, want_w[2])]
    assert max(want_w) < 128
    assert [b["positions"].shape[-1] for b in cut] == [
        -(-int(max(trained[i:i + 4])) // 32) * 32 for i in (0, 4, 8)]
    # as before issue 36: every row padded to --seq-len, the loss over every position
    n = len(rows["inputs"])
    padded = [{k: v[i:i + 4][None] for k, v in rows.items()} for i in range(0, n, 4)]
    assert padded[0]["inputs"].shape == (1, 4, 128)
    want = Evaluator(_task(model, padded), compile=False)()["val_loss"]
    for compile_, streams in ((True, 2), (True, 1), (False, 2)):
        got = Evaluator(_task(model, cut, metrics_fn=lm_held_out_sums), compile_, streams)()
        assert abs(got["val_loss"] - want) <= 1e-6, (compile_, streams, got, want)
    # and the test split the same way
    got = Evaluator(_task(model, [], test_batches=cut, metrics_fn=lm_held_out_sums))(
        split="test")
    assert abs(got["test_loss"] - want) <= 1e-6


def test_a_commands_pass_draws_its_bar_on_a_terminal_only(tiny_gguf, monkeypatch):  # noqa: F811
    """`toymlx-eval` on a whole data folder ran minutes with no word; its pass now draws a bar
    of the rows it scores (11 here, in 3 micro-batches) on a terminal's stderr, and none into a log or a pipe, nor
    for a run's own pass (no name), with the same loss."""
    import io

    from toymlx.data.chat import sft_val_batches
    from toymlx.models.losses import lm_held_out_sums
    from toymlx.training.evaluate import Evaluator

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    model = _lora_model(tiny_gguf)
    cut = sft_val_batches(_held_out_rows(128), 4, 10)
    losses = {}
    for name, stream in (("eval", Terminal()), ("eval", io.StringIO()), (None, Terminal())):
        monkeypatch.setattr(sys, "stderr", stream)
        ev = Evaluator(_task(model, cut, metrics_fn=lm_held_out_sums), False, 1, progress=name)
        losses[name, stream.isatty()] = ev()["val_loss"]
        drawn = stream.getvalue()
        if name is not None and stream.isatty():
            # the 11 rows scored (3 micro-batches of 4, the last padded); tqdm's refresh is timed
            assert re.search(r"eval: +\d+%.*\d/11 \[.*row/s", drawn), drawn
        else:
            assert drawn == "", drawn
    assert len(set(losses.values())) == 1, losses


def test_a_pass_of_one_call_says_so_instead_of_a_bar_at_0(tiny_gguf, monkeypatch):  # noqa: F811
    """A split a held-out call takes whole (11 rows in one call of 16 here, as toymlx-eval
    batches a small split) drew a bar that sat at 0/11 until the call ended, then jumped to
    11/11; it now says what it is doing, "scoring 11 rows in one pass", with no percentage, and
    the loss is the bar's (the batches, and so the numbers, are the same)."""
    import io

    from toymlx.data.chat import sft_val_batches
    from toymlx.models.losses import lm_held_out_sums
    from toymlx.training.evaluate import Evaluator

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    model = _lora_model(tiny_gguf)
    rows = _held_out_rows(128)
    losses = []
    for per, said in ((16, "eval: scoring 11 rows in one pass"), (4, "eval: ")):
        monkeypatch.setattr(sys, "stderr", Terminal())
        cut = sft_val_batches(rows, 4, 10, per)
        losses.append(Evaluator(_task(model, cut, metrics_fn=lm_held_out_sums), False, 1,
                                progress="eval")()["val_loss"])
        drawn = sys.stderr.getvalue()
        assert said in drawn, drawn
        assert ("%" in drawn) == (per == 4) and ("0/11" in drawn) == (per == 4), drawn
    # the same rows in one call or in three: the same loss, to float32 sums' rounding
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_validation_is_traced_once_per_batch_shape_and_reads_the_current_weights(
        tiny_gguf):  # noqa: F811
    import mlx.core as mx

    from toymlx.data.chat import sft_val_batches
    from toymlx.models.lora import lora_layers
    from toymlx.models.losses import lm_held_out_sums
    from toymlx.training.evaluate import Evaluator, evaluate

    model = _lora_model(tiny_gguf)
    batches = sft_val_batches(_held_out_rows(128), 4, 10)
    traced: list[tuple] = []

    def counted(m, b):  # runs when mx.compile traces, never when it reuses a trace
        traced.append((b["inputs"].shape, b["positions"].shape))
        return lm_held_out_sums(m, b)

    ev = Evaluator(_task(model, batches, metrics_fn=counted), compile=True, n_streams=2)
    first = ev()
    # each stream traces each shape of its share of the rows once (4 rows: 2 + 2; 3: 1 + 2)
    shares = {(j, (b - a, x["inputs"].shape[-1]), (b - a, x["positions"].shape[-1]))
              for x in batches for j, (a, b) in enumerate(
                  [(0, x["inputs"].shape[1] // 2), (x["inputs"].shape[1] // 2,
                                                    x["inputs"].shape[1])])}
    assert sorted(traced) == sorted((i, p) for _, i, p in shares)
    assert len(traced) < 2 * len(batches)  # batches of one shape share their traces
    n_traced = len(traced)
    for m in lora_layers(model).values():  # the weights move, as between two validations
        m.lora_b = m.lora_b * 2.0
    mx.eval(model.parameters())
    second = ev()
    assert len(traced) == n_traced  # no new trace
    assert second["val_loss"] != first["val_loss"]
    want = evaluate(_task(model, batches, metrics_fn=lm_held_out_sums))["val_loss"]
    assert abs(second["val_loss"] - want) <= 1e-6


# ---- toymlx-generate: the chat template by default ------------------------------------------
def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    from toymlx_cli.generate import main as generate_main

    rc = generate_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_prompt_goes_through_the_chat_template_by_default(chat_path, capsys):  # noqa: F811
    """A GGUF with a chat template (stories260K with ChatML): --prompt alone answers as --chat
    does, token for token; --ignore-chat-template continues the raw text instead."""
    flags = ["--model", str(chat_path), "--prompt", "Tell me a story", "--temperature", "0",
             "--max-tokens", "12"]
    plain, chat, raw = (_generate(capsys, *flags, *more)
                        for more in ([], ["--chat"], ["--ignore-chat-template"]))
    assert plain[0] == chat[0] == raw[0] == 0
    assert plain[1] == chat[1] and plain[1].strip()
    count = re.compile(r"(\d+) prompt \+ (\d+) new tokens")
    assert count.search(plain[2]).groups() == count.search(chat[2]).groups()
    n_chat, n_raw = int(count.search(chat[2])[1]), int(count.search(raw[2])[1])
    assert n_chat > n_raw  # the template's turn markers
    assert raw[1] != plain[1]
    # contradictory flags are one line each
    rc, _, err = _generate(capsys, *flags, "--chat", "--ignore-chat-template")
    assert rc == 2 and err.strip() == ("toymlx-generate: error: --ignore-chat-template: expected "
                                       "without --chat (a chat renders the chat template), "
                                       "found both")
    rc, _, err = _generate(capsys, *flags, "--ignore-chat-template", "--system", "Be brief")
    assert rc == 2 and err.strip() == ("toymlx-generate: error: --system: expected a prompt "
                                       "rendered through a chat template, found "
                                       "--ignore-chat-template")


def test_zero_new_tokens_say_why(chat_path, stories_path, capsys, monkeypatch):  # noqa: F811
    from toymlx.generation import generate as gen

    flags = ["--model", str(chat_path), "--prompt", "Tell me a story", "--temperature", "0"]
    rc, out, err = _generate(capsys, *flags, "--max-tokens", "0")
    assert rc == 0 and out == ""
    assert err.splitlines()[-1] == "toymlx-generate: 0 new tokens: --max-tokens is 0"
    # the model ending at once: its first token is the end of sequence
    monkeypatch.setattr(gen, "decode", lambda *a, **k: iter([2, 5, 6]))
    rc, out, err = _generate(capsys, *flags)
    assert rc == 0 and out == ""
    assert err.splitlines()[-1] == (
        "toymlx-generate: 0 new tokens: the model ended at once (its first token was the "
        "end-of-sequence token 2); the prompt was rendered through the GGUF's chat template")
    _, _, err = _generate(capsys, *flags, "--ignore-chat-template")
    assert err.splitlines()[-1] == (
        "toymlx-generate: 0 new tokens: the model ended at once (its first token was the "
        "end-of-sequence token 2); the prompt was raw text (--ignore-chat-template), which an "
        "instruct model often ends at once: drop --ignore-chat-template")
    _, _, err = _generate(capsys, "--model", str(stories_path), "--prompt", "Once")
    assert err.splitlines()[-1] == (
        "toymlx-generate: 0 new tokens: the model ended at once (its first token was the "
        f"end-of-sequence token 2); the prompt was raw text ({stories_path} has no "
        "tokenizer.chat_template)")


@pytest.mark.smollm
def test_the_instruct_smollm2_run_answers_through_its_template(smollm_gguf, tmp_path,  # noqa: F811
                                                                capsys):
    """Issue 36's case: `toymlx-generate --model RUN --prompt "What is the capital of
    France?"` on a LoRA run of the instruct SmolLM2 answers with no flag, the tokens --chat
    gives; the raw prompt ends at once, and says so."""
    assert train_main(["--recipe", "lora", "--base", str(smollm_gguf), "--runs-root",
                       str(tmp_path), "--run-id", "r", "--steps", "1", "--batch-size", "1",
                       "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
                       "--no-progress", "--no-compile"]) == 0
    capsys.readouterr()
    flags = ["--model", str(tmp_path / "r"), "--prompt", "What is the capital of France?",
             "--temperature", "0", "--max-tokens", "16"]
    plain, chat, raw = (_generate(capsys, *flags, *more)
                        for more in ([], ["--chat"], ["--ignore-chat-template"]))
    count = re.compile(r"(\d+) prompt \+ (\d+) new tokens")
    assert plain[1] == chat[1] and "Paris" in plain[1]
    assert count.search(plain[2]).groups() == count.search(chat[2]).groups()
    assert int(count.search(plain[2])[2]) > 0
    assert raw[1] == "" and "0 new tokens: the model ended at once" in raw[2]
