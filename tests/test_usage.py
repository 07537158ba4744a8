"""A command line tyro refuses (cli/usage.py): one line `PROG: error: FLAG: expected ..., got ...`
on stderr and exit status 2, for every toymlx command that parses with tyro; `--help` is still
tyro's full help."""

from __future__ import annotations

import pytest
from toymlx_cli.train import main

LORA = "toymlx-train --recipe lora"


def only_line(capsys) -> str:
    """The whole of stderr, which must be one line (no box, no traceback)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err[:-1]


@pytest.mark.parametrize("args,want", [
    # a mistyped value
    (["--steps", "abc"], "--steps: expected an integer, got 'abc'"),
    (["--steps=abc"], "--steps: expected an integer, got 'abc'"),
    (["--steps", "1", "--steps", "x"], "--steps: expected an integer, got 'x'"),  # tyro: last
    (["--lr", "1e-4x"], "--lr: expected a number, got '1e-4x'"),
    (["--lora.layers", "q"], "--lora.layers: expected an integer or None, got 'q'"),
    # an unknown flag, with the flag tyro would suggest
    (["--stpes", "3"], (f"--stpes: expected an option of {LORA}, got an unknown one; did you "
                        "mean --steps?")),
    (["--rank", "4"], (f"--rank: expected an option of {LORA}, got an unknown one; did you mean "
                       "--lora.rank?")),
    # llama.cpp's --lora (before: "did you mean --lr?") and -ngl, --ctx-size
    (["--lora", "a.gguf", "-ngl", "99", "--ctx-size", "512"],
     (f"--lora: expected an option of {LORA}, got an unknown one; llama.cpp's --lora FILE is "
      f"--lora.init-adapter FILE here (the run's adapters start from it); -ngl: expected an "
      f"option of {LORA}, got an unknown one; llama.cpp's -ngl is --device gpu here (the whole "
      f"model on MLX's GPU; --device cpu: none of it); --ctx-size: expected an option of "
      f"{LORA}, got an unknown one; llama.cpp's --ctx-size is --seq-len here")),
    # llama.cpp's --lora-scaled FILE S (both values its own), and mlx-lm's or PEFT's users'
    # spelling of the LoRA scale (before: "did you mean --lr-schedule?", then FILE and S each
    # named as a value no option takes)
    *((args, (f"{args[0].partition('=')[0]}: expected an option of {LORA}, got an unknown one; llama.cpp's "
              "--lora-scaled FILE S and mlx-lm's LoRA scale are the adapters' scale, here "
              "--lora.alpha / --lora.rank (scale 20 at rank 8: --lora.alpha 160); "
              "--lora.init-adapter FILE starts them from a file"))
      for args in (["--lora-scaled", "a.gguf", "0.5"], ["--lora-scale", "20"],
                   ["--lora_scale=20"])),
    (["--stpes=3", "--lrr", "1"], (f"--stpes: expected an option of {LORA}, got an unknown one; "
                                   f"did you mean --steps?; --lrr: expected an option of {LORA}, "
                                   "got an unknown one; did you mean --lr?")),
    (["--zzzzzz"], f"--zzzzzz: expected an option of {LORA}, got an unknown one"),
    (["stray"], f"'stray': expected an option of {LORA}, got a value no option takes"),
    (["--lora.targets", "q", "k"], (f"'k': expected an option of {LORA}, got a value no option "
                                    "takes (after --lora.targets q)")),
    # HF Trainer's --report_to takes a list of words; --report-to takes one comma list
    (["--report_to", "tensorboard", "wandb"], (
        f"'wandb': expected an option of {LORA}, got a value no option takes (after --report_to "
        "tensorboard); --report-to takes one comma list: --report-to tensorboard,wandb")),
    (["--report-to", "tensorboard", "foo"], (f"'foo': expected an option of {LORA}, got a value "
                                             "no option takes (after --report-to tensorboard)")),
    # a missing value
    (["--steps"], "--steps: expected an integer after it, got nothing"),
    (["--steps", "--lr", "1e-4"], "--steps: expected an integer after it, got the option --lr"),
    # a bad choice of a Literal
    (["--fine-tune-type", "fulll"], ("--fine-tune-type: expected one of lora, dora, full, got "
                                     "'fulll'")),
    (["--optimizer", "adamx"], ("--optimizer: expected one of adamw, adam, sgd, adafactor, "
                                "muon, got 'adamx'")),
    (["--data.train-turns", "first"], ("--data.train-turns: expected one of assistant, last, "
                                       "got 'first'")),
    (["--weight-decay-scope", "vectors"], ("--weight-decay-scope: expected one of matrices, "
                                           "all, got 'vectors'")),
    # a bad bool: a flag given a value, either spelling
    (["--compile=maybe"], ("--compile: expected no value (a flag; --no-compile sets it false), "
                           "got 'maybe'")),
    (["--compile", "maybe"], ("--compile: expected no value (a flag; --no-compile sets it "
                              "false), got 'maybe'")),
    (["--no-compile=yes"], ("--no-compile: expected no value (a flag; --compile sets it true), "
                            "got 'yes'")),
    # the value refused is --compile's, not --steps' 1 (before: "'1': ... (after --steps)")
    (["--steps", "1", "--compile=1"], ("--compile: expected no value (a flag; --no-compile sets "
                                       "it false), got '1'")),
    # `--flag=VALUE` gives the first of the flag's values, not its only one (before: "got '1'",
    # a number, and "(after 3 --lora.targets=q)", --steps' 3 shown as the context)
    (["--lr-schedule-args", "1", "x"], "--lr-schedule-args: expected numbers, got '1 x'"),
    (["--lr-schedule-args=1", "x"], "--lr-schedule-args: expected numbers, got '1 x'"),
    (["--steps", "3", "--lora.targets=q", "k"], (f"'k': expected an option of {LORA}, got a value "
                                                 "no option takes (after --lora.targets=q)")),
    # a flag's `=VALUE` is found only in a flag's token (before: --seed=3's 3 taken for the
    # refused '3', which was named with no option before it, and --compile's not named)
    (["--steps=3", "3"], (f"'3': expected an option of {LORA}, got a value no option takes "
                          "(after --steps=3)")),
    (["--seed=3", "--compile=3"], ("--compile: expected no value (a flag; --no-compile sets it "
                                   "false), got '3'")),
    # an unknown flag's value is the token right after it, not one after another option (before:
    # 'stray' taken as --zzzz's value and not named)
    (["--zzzz", "--steps", "3", "stray"], (f"--zzzz: expected an option of {LORA}, got an "
                                           f"unknown one; 'stray': expected an option of {LORA}, "
                                           "got a value no option takes (after --steps 3)")),
])
def test_a_refused_lora_command_line_is_one_line(capsys, tmp_path, monkeypatch, args, want):
    monkeypatch.chdir(tmp_path)  # ./runs, the default --runs-root
    assert main(["--recipe", "lora", *args]) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []  # refused before any run folder


def test_a_file_named_like_an_option_after_a_flag_is_told_how_to_pass(capsys, tmp_path,
                                                                     monkeypatch):
    """`--base -m.gguf` (a file whose name starts with -) read "expected a value or None after
    it, got the option -m.gguf", with no way out named; `./-m.gguf` is one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-m.gguf").write_bytes(b"")
    assert main(["--recipe", "lora", "--base", "-m.gguf"]) == 2
    assert only_line(capsys) == (
        "toymlx-train: error: --base: expected a value or None after it, got the option "
        "-m.gguf; for the file -m.gguf, write --base ./-m.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["-m.gguf"]



@pytest.mark.parametrize("recipe,hint", [
    ("loraa", "; did you mean lora?"), ("LoRA", "; did you mean lora?"),
    ("vit", "; did you mean vit-tiny?"), ("from_scratch", "; did you mean from-scratch?"),
    ("zzz", ""),
])
def test_a_misspelt_recipe_names_the_closest(capsys, tmp_path, monkeypatch, recipe, hint):
    """--recipe loraa listed the recipes without the one meant."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", recipe, "--steps", "1"]) == 2
    assert only_line(capsys) == ("toymlx-train: error: --recipe: expected one of from-scratch, "
                                 f"warm-start, lora, vit-tiny; found {recipe!r}{hint}")
    assert list(tmp_path.iterdir()) == []

def test_a_bad_bool_value_names_its_choices(capsys, tmp_path):
    """A `bool | None` option takes True or False; its None, the default left unset, is not
    listed as a value to type (toymlx-eval --split listed "val, all, test, None")."""
    assert main(["--recipe", "vit-tiny", "--runs-root", str(tmp_path),
                 "--data.augment", "maybe"]) == 2
    assert only_line(capsys) == ("toymlx-train: error: --data.augment: expected one of True, "
                                 "False, got 'maybe'")


def test_help_is_still_tyros_full_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "lora", "--help"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"usage: {LORA}" in out
    for flag in ("--steps INT", "--fine-tune-type {lora,dora,full}", "--lora.rank INT",
                 "--compile, --no-compile"):
        assert flag in out, flag
    assert "Optimizer steps to train for" in out  # the field docstrings, as help


def test_grad_accum_s_help_says_the_gradients_are_averaged(capsys):
    """HF Trainer's gradient_accumulation_steps averages over the step's tokens, and so does
    toymlx's step (`make_update`: the sums divided by the count); the help said "summed", which
    reads as a step --grad-accum times larger."""
    with pytest.raises(SystemExit):
        main(["--recipe", "lora", "--help"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert ("--grad-accum INT Micro-batches per optimizer step, their gradients averaged as one "
            "batch of --batch-size x --grad-accum rows (over every scored token or image of the "
            "step). (default: 1)") in out


def test_mlx_lm_s_ways_are_options_with_help(capsys):
    """What an mlx-lm config file sets for mlx-lm's meaning is an option of its own, with its
    choices, default and docstring in --help: the turns a conversation trains, what AdamW
    decays, the validation before step 1."""
    with pytest.raises(SystemExit):
        main(["--recipe", "lora", "--help"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for text in (("--data.train-turns {assistant,last} With --data.mask-prompt, which messages "
                  "of a `messages` record train: assistant: every assistant turn; last: the "
                  "last message only"),
                 "(default: assistant)",
                 ("--weight-decay-scope {matrices,all} What AdamW's --weight-decay falls on: "
                  "matrices (not norms, biases or DoRA magnitudes) or all (every trained "
                  "array, as MLX's AdamW and mlx-lm's adamw decay). (default: matrices)"),
                 ("--eval-at-start, --no-eval-at-start Also validate before the first step: "
                  "the untrained model's figures, as the step-0 eval event (mlx-lm's "
                  "iteration-1 val loss); a resume past step 0 does not repeat it. "
                  "(default: False)")):
        assert text in out, text


SCRATCH = "toymlx-train --recipe from-scratch"


def test_nanogpts_settings_name_toymlxs_options(capsys, tmp_path, monkeypatch):
    """nanoGPT's README command for a CPU, as a nanoGPT user types it: each setting named with
    toymlx's option (before: block_size -> "did you mean --batch-size?", n_embd, max_iters,
    log_interval, lr_decay_iters and dropout with no hint)."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "from-scratch", "--device=cpu", "--eval_iters=20",
                 "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
                 "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000",
                 "--dropout=0.0", "--init_from=resume"]) == 2
    unknown = f"expected an option of {SCRATCH}, got an unknown one; nanoGPT's"
    assert only_line(capsys).split("; --") == [
        f"toymlx-train: error: --eval_iters: {unknown} eval_iters is toymlx's --eval-batches",
        f"log_interval: {unknown} log_interval is toymlx's --report-every",
        (f"block_size: {unknown} block_size is toymlx's --seq-len (the model's longest: "
         "--model.context)"),
        f"n_layer: {unknown} n_layer is toymlx's --model.n-layers",
        f"n_head: {unknown} n_head is toymlx's --model.n-heads",
        f"n_embd: {unknown} n_embd is toymlx's --model.d-model",
        f"max_iters: {unknown} max_iters is toymlx's --steps",
        (f"lr_decay_iters: {unknown} lr_decay_iters is toymlx's --steps (the cosine decays "
         "over the whole run)"),
        f"dropout: {unknown} dropout has no toymlx option (its Llama has no dropout)",
        f"init_from: {unknown} init_from 'resume' is toymlx's --resume RUN_FOLDER"]
    assert list(tmp_path.iterdir()) == []


def test_a_nanogpt_setting_spelt_with_hyphens_is_named_too(capsys, tmp_path, monkeypatch):
    """`flag_hint` looks nanoGPT's settings up by name, `--block-size` as `--block_size`."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "from-scratch", "--block-size=64"]) == 2
    assert only_line(capsys) == (
        f"toymlx-train: error: --block-size: expected an option of {SCRATCH}, got an unknown "
        "one; nanoGPT's block_size is toymlx's --seq-len (the model's longest: --model.context)")


def test_unsloths_notebook_settings_name_toymlxs_options(capsys, tmp_path, monkeypatch):
    """Unsloth's LoRA notebook's settings (PEFT's LoraConfig, HF Trainer's TrainingArguments),
    typed as flags on the lora recipe: each named with toymlx's option (before: warmup_steps
    "did you mean --warmup-init?", random_state "--from-step?", target_modules,
    per_device_train_batch_size and load_in_4bit no hint, gradient_accumulation_steps
    "nanoGPT's")."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "lora", "--load-in-4bit", "--lora_alpha=16",
                 "--target-modules", "q_proj,k_proj", "--per_device_train_batch_size=2",
                 "--gradient-accumulation-steps", "4", "--warmup_steps=5", "--max-steps", "60",
                 "--lr_scheduler_type=linear", "--random-state", "3407",
                 "--use-rslora"]) == 2
    unknown = f"expected an option of {LORA}, got an unknown one;"
    assert only_line(capsys).split("; --") == [
        (f"toymlx-train: error: --load-in-4bit: {unknown} Unsloth's load_in_4bit is a 4-bit "
         "--base GGUF (Q4_K_M, Q4_1) with --base-dtype blocks (its own blocks in memory; auto "
         "holds them where memory is short)"),
        (f"lora_alpha: {unknown} PEFT's lora_alpha is toymlx's --lora.alpha (the adapters scaled "
         "by alpha / rank, as PEFT's)"),
        (f"target-modules: {unknown} PEFT's target_modules is toymlx's --lora.targets, in short "
         "names (q_proj, ..., down_proj: q,k,v,o,gate,up,down; all-linear as PEFT's: every "
         "linear projection of the base's blocks)"),
        (f"per_device_train_batch_size: {unknown} HF Trainer's per_device_train_batch_size is "
         "toymlx's --batch-size"),
        (f"gradient-accumulation-steps: {unknown} HF Trainer's gradient_accumulation_steps is "
         "toymlx's --grad-accum"),
        f"warmup_steps: {unknown} HF Trainer's warmup_steps is toymlx's --warmup",
        f"max-steps: {unknown} HF Trainer's max_steps is toymlx's --steps",
        (f"lr_scheduler_type: {unknown} HF Trainer's lr_scheduler_type is toymlx's "
         "--lr-schedule, whose default warmup-cosine decays to --min-lr-ratio (0.1) x --lr: "
         "HF's cosine is --min-lr-ratio 0, its linear --lr-schedule linear_schedule "
         "--lr-schedule-args LR 0 STEPS-WARMUP (2e-4 0 55 for --steps 60 --warmup 5), its "
         "constant_with_warmup --lr-schedule constant"),
        f"random-state: {unknown} Unsloth's random_state is toymlx's --seed",
        (f"use-rslora: {unknown} PEFT's use_rslora has no toymlx option: the adapters are scaled "
         "by --lora.alpha / rank (rsLoRA's alpha / sqrt(rank): --lora.alpha alpha x "
         "sqrt(rank))")]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe,args,want", [
    # Hugging Face's names are said to a fine-tune; a from-scratch run keeps nanoGPT's texts
    ("from-scratch", ["--gradient_accumulation_steps=4"],
     "nanoGPT's gradient_accumulation_steps is toymlx's --grad-accum"),
    # Unsloth's GGUF export: the run's --fuse-at-end, toymlx-export's --dtype
    ("lora", ["--quantization-method", "q4_k_m"],
     ("Unsloth's quantization_method is toymlx's --fuse-at-end TYPE (or toymlx-export --fuse "
      "--dtype TYPE)")),
    # HF Trainer's own names of toymlx's options
    ("lora", ["--output_dir", "outputs"],
     "HF Trainer's output_dir is toymlx's --runs-root and --run-id (runs/RUN_ID)"),
    ("lora", ["--save-steps", "10"], "HF Trainer's save_steps is toymlx's --checkpoint-every"),
    ("lora", ["--eval_steps", "10"], "HF Trainer's eval_steps is toymlx's --eval-every"),
    # before: adam_epsilon "did you mean --adam-eps?" at best, adam_beta1 no hint
    ("lora", ["--adam_epsilon", "1e-6"], "HF Trainer's adam_epsilon is toymlx's --adam-eps"),
    ("lora", ["--adam-beta1=0.9"], "HF Trainer's adam_beta1 is toymlx's --beta1"),
    ("lora", ["--packing", "False"],
     "TRL's packing is toymlx's --data.pack, on by default (packing False: --data.no-pack)"),
    # PEFT's (Unsloth's) r: argparse's abbreviations took it for --recipe or --resume
    # ("ambiguous option: --r could match --recipe, --resume")
    ("lora", ["--r", "16"], "PEFT's r is toymlx's --lora.rank"),
    ("lora", ["--r=16"], "PEFT's r is toymlx's --lora.rank"),
    ("lora", ["--lora_dropout", "0.05"], "PEFT's lora_dropout is toymlx's --lora.dropout"),
])
def test_hf_s_names_are_said_where_a_base_is_fine_tuned(capsys, tmp_path, monkeypatch, recipe,
                                                         args, want):
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", recipe, *args]) == 2
    assert only_line(capsys) == (
        f"toymlx-train: error: {args[0].partition('=')[0]}: expected an option of toymlx-train "
        f"--recipe {recipe}, got an unknown one; {want}")
    assert list(tmp_path.iterdir()) == []


def test_unsloths_gguf_quantization_is_toymlx_export_s_dtype(capsys):
    from toymlx_cli.export import main as export

    assert export(["--adapter", "runs/x", "--fuse", "--out", "x.gguf",
                   "--quantization_method", "q4_k_m"]) == 2
    assert only_line(capsys) == (
        "toymlx-export: error: --quantization_method: expected an option of toymlx-export, got "
        "an unknown one; Unsloth's quantization_method is toymlx-export's --dtype (with --fuse: "
        "--dtype q4_k_m)")


@pytest.mark.parametrize("command,flag,want", [
    # mlx_lm.fuse's and mlx_lm.generate's --adapter-path reads adapters (before, toymlx-export:
    # "is toymlx's --runs-root and --run-id", the training flags; toymlx-eval: "did you mean
    # --data-path?")
    ("export", "--adapter-path", ("mlx-lm's --adapter-path is toymlx-export's --adapter (the run "
     "folder; mlx-lm's adapter folder with --base)")),
    ("generate", "--adapter-path", ("mlx-lm's --adapter-path is toymlx-generate's --model (the "
     "run folder: its base with its adapter; --adapter RUN over another --model)")),
    ("eval", "--adapter-path", ("mlx-lm's --adapter-path is toymlx-eval's --model (the run "
     "folder: its base with its adapter)")),
    ("export", "--save-path", "mlx-lm's --save-path is toymlx-export's --out"),
    # mlx_lm.fuse's --dequantize (before: "did you mean --exact-size?", which keeps the base's
    # quantized size) and --upload-repo, mlx_lm.generate's --verbose (before: no hint)
    ("export", "--dequantize", ("mlx-lm's --dequantize is toymlx-export's --dtype f16 (every "
     "weight matrix written at F16; f32 for F32)")),
    ("export", "--upload-repo", ("mlx-lm's --upload-repo has no toymlx-export option: "
     "toymlx-export writes local files only; upload them with hf upload REPO FILE")),
    # max_seq_length counts a row's tokens, --seq-len its targets (before: "is toymlx's
    # --seq-len", one more target than mlx-lm's row holds)
    ("eval", "--max-seq-length", ("mlx-lm's --max-seq-length is toymlx-eval's --seq-len at "
     "max_seq_length - 1 (it counts a row's targets, mlx-lm its tokens)")),
    ("export", "--max-seq-length", ("mlx-lm's --max-seq-length is toymlx-train's --seq-len at "
     "max_seq_length - 1 (it counts a row's targets, mlx-lm its tokens)")),
    ("generate", "--verbose", ("mlx-lm's --verbose has no toymlx-generate option: "
     "toymlx-generate always prints its model and speed lines on stderr, the text alone on "
     "stdout; drop it")),
    # mlx_lm.generate's --max-kv-size, --extra-eos-token, --draft-model (before: no hint;
    # --draft-model "did you mean --model?")
    ("generate", "--max-kv-size", ("mlx-lm's --max-kv-size has no toymlx-generate option: "
     "toymlx-generate's cache holds the model's whole window; where the text reaches it, "
     "--context-shift (the default) drops the older half and goes on, --no-context-shift "
     "stops; drop it")),
    ("generate", "--extra-eos-token", ("mlx-lm's --extra-eos-token has no toymlx-generate "
     "option: toymlx-generate stops at the GGUF's end-of-generation tokens (eos and end-of-turn, "
     "as llama.cpp) or at --max-tokens, no other token or text; drop it and cut the printed "
     "text where you want")),
    ("generate", "--draft-model", ("mlx-lm's --draft-model has no toymlx-generate option: "
     "toymlx-generate has no speculative decoding (the one --model predicts every token); drop "
     "it")),
    ("generate", "--num-draft-tokens", ("mlx-lm's --num-draft-tokens has no toymlx-generate "
     "option: toymlx-generate has no speculative decoding (no --draft-model); drop it")),
    ("eval", "--test", "mlx-lm's --test is toymlx-eval's --split test"),
    # toymlx-eval's own options (before: "is toymlx-train's --data.mask-prompt" and
    # "toymlx-train's --eval-batches", as if eval took neither)
    ("eval", "--mask-prompt", ("mlx-lm's --mask-prompt is toymlx-eval's --data.mask-prompt (the "
     "last message alone scored, as mlx-lm's)")),
    ("eval", "--val-batches", ("mlx-lm's --val-batches is toymlx-eval's --eval-batches (a run's "
     "own validation split; -1: every row)")),
    # the rest of mlx_lm.generate's flags (before: no hint, or the closest spelling: "did you
    # mean --ignore-chat-template?" for --chat-template-config, "--no-ignore-chat-template?"
    # for --use-default-chat-template)
    ("generate", "--chat-template-config", ("mlx-lm's --chat-template-config has no "
     "toymlx-generate option: toymlx-generate renders the chat template with no extra arguments "
     "(no enable_thinking); drop it")),
    ("generate", "--use-default-chat-template", ("mlx-lm's --use-default-chat-template has no "
     "toymlx-generate option: toymlx-generate renders the GGUF's own chat template "
     "(tokenizer.chat_template) and has no default one: a GGUF without a template continues "
     "--prompt as raw text; drop it")),
    ("generate", "--prefill-response", ("mlx-lm's --prefill-response has no toymlx-generate "
     "option: toymlx-generate starts the reply itself; to start it with your text, give the "
     "rendered conversation ending with it as --prompt with --ignore-chat-template; drop it")),
    ("generate", "--xtc-threshold", ("mlx-lm's --xtc-threshold has no toymlx-generate option: "
     "toymlx-generate has no XTC sampling (its samplers: --temp, --top-p, --top-k, --min-p, "
     "--repetition-penalty); drop it")),
    ("generate", "--min-tokens-to-keep", ("mlx-lm's --min-tokens-to-keep has no toymlx-generate "
     "option: toymlx-generate's --min-p always keeps the most likely token (mlx-lm's default, "
     "1); drop it")),
    ("generate", "--kv-bits", ("mlx-lm's --kv-bits has no toymlx-generate option: "
     "toymlx-generate's KV cache is not quantized; drop it")),
    ("generate", "--prefill-step-size", ("mlx-lm's --prefill-step-size has no toymlx-generate "
     "option: toymlx-generate puts the prompt through 2048 tokens at a time (mlx-lm's default), "
     "not set by a flag; drop it")),
    ("generate", "--pipeline", ("mlx-lm's --pipeline has no toymlx-generate option: "
     "toymlx-generate runs the model in one process (no pipeline across machines); drop it")),
    # a flag of no toymlx command is named as this command's lack (not toymlx-train's)
    ("generate", "--trust-remote-code", ("mlx-lm's --trust-remote-code has no toymlx-generate "
     "option: toymlx runs no code from a model's repository (a GGUF holds none); drop it")),
    # a training flag elsewhere is toymlx-train's, not the command's
    ("export", "--iters", "mlx-lm's --iters is toymlx-train's --steps"),
    ("eval", "--learning-rate", "mlx-lm's --learning-rate is toymlx-train's --lr"),
])
def test_mlx_lm_s_flags_are_named_as_each_command_takes_them(capsys, command, flag, want):
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.export import main as export_main
    from toymlx_cli.generate import main as generate_main

    run = {"export": export_main, "generate": generate_main, "eval": eval_main}[command]
    assert run(["--model", "runs/x", flag, "x"]) == 2
    prog = f"toymlx-{command}"
    assert only_line(capsys) == (f"{prog}: error: {flag}: expected an option of {prog}, got an "
                                 f"unknown one; {want}")


def test_a_peft_key_in_a_config_file_is_named_as_its_key_is(capsys, tmp_path, monkeypatch):
    """PEFT's `r: 16` in a lora -c file (before: "did you mean --run-id?" or nothing), toymlx's
    option named as the file's key (it named the flag --lora.rank)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("r: 16\n")
    assert main(["--recipe", "lora", "-c", "c.yaml"]) == 2
    assert only_line(capsys) == (
        "toymlx-train: error: c.yaml: key 'r': expected an option of toymlx-train --recipe lora, "
        "found an unknown key; PEFT's r is toymlx's lora.rank")


@pytest.mark.parametrize("recipe,flag,want", [
    ("vit-tiny", "--block_size=64", (
        "nanoGPT's block_size is toymlx's --seq-len, which vit-tiny does not take: its sequence "
        "is the image's patches, (--data.image-size / --model.patch-size)^2 of them")),
    ("lora", "--n_layer=4", (
        "nanoGPT's n_layer is toymlx's --model.n-layers, which a fine-tune does not take: the "
        "--base GGUF's own (--lora.layers N adapts its last N)")),
    ("from-scratch", "--start=hi", (
        "nanoGPT's start is toymlx's --prompt TEXT (a file: --prompt - < FILE); not an option "
        "of toymlx-train --recipe from-scratch")),
    ("lora", "--drop-path=0.1", (
        "timm's --drop-path is a flag for images (toymlx-train --recipe vit-tiny); not an "
        "option of toymlx-train --recipe lora")),
])
def test_a_peer_flag_another_recipe_takes_is_not_matched_by_spelling(capsys, tmp_path,
                                                                     monkeypatch, recipe, flag,
                                                                     want):
    """A nanoGPT or timm flag whose counterpart the recipe lacks was matched by spelling to an
    unrelated option (before: vit-tiny --block_size "did you mean --batch-size?", --start
    "--eval-at-start?", --drop-path "--stop-at?"); now what it is, and that this recipe does
    not take it."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", recipe, flag]) == 2
    assert only_line(capsys) == (
        f"toymlx-train: error: {flag.partition('=')[0]}: expected an option of toymlx-train "
        f"--recipe {recipe}, got an unknown one; {want}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module,args,want", [
    # the command alone: the option it needs, and the command as it is typed
    ("export", [], ("toymlx-export: error: --out: expected a value (it is required), got none; "
                    "e.g. toymlx-export --adapter runs/RUN_ID --fuse --out FILE.gguf "
                    "(toymlx-export --help lists every option)")),
    # README's Ollama export without --out: the example is a modelfile export's, not --fuse's
    *[("export", ["--adapter", "runs/chat", *given],
       ("toymlx-export: error: --out: expected a value (it is required), got none; e.g. "
        "toymlx-export --format modelfile --adapter runs/RUN_ID --out FOLDER (toymlx-export "
        "--help lists every option)")) for given in (["--format", "modelfile"],
                                                      ["--format=modelfile"])],
    ("eval", [], ("toymlx-eval: error: --model: expected a value (it is required), got none; "
                  "e.g. toymlx-eval --model runs/RUN_ID (toymlx-eval --help lists every "
                  "option)")),
    ("classify", [], ("toymlx-classify: error: --model: expected a value (it is required), got "
                      "none; e.g. toymlx-classify --model runs/RUN_ID IMAGE (toymlx-classify "
                      "--help lists every option)")),
    ("eval", ["--model", "m", "--batch-size", "x"],
     "toymlx-eval: error: --batch-size: expected an integer or None, got 'x'"),
    # mlx-lm's words: --split valid is taken (val), --test named as --split test
    ("eval", ["--model", "m", "--split", "validation"],
     "toymlx-eval: error: --split: expected one of val, all, test, valid, got 'validation'"),
    ("eval", ["--model", "m", "--test"],
     ("toymlx-eval: error: --test: expected an option of toymlx-eval, got an unknown one; "
      "mlx-lm's --test is toymlx-eval's --split test")),
    ("eval", ["--data-path"],
     "toymlx-eval: error: --data-path: expected a value or None after it, got nothing"),
    ("generate", ["--model", "m", "--temperatur", "0.5"],
     ("toymlx-generate: error: --temperatur: expected an option of toymlx-generate, got an "
      "unknown one; did you mean --temperature?")),
    ("generate", ["--model", "m", "--temp", "x"],  # mlx-lm's spelling, an alias: named as typed
     "toymlx-generate: error: --temp: expected a number, got 'x'"),
    # llama.cpp's short flags: -p, -n taken; -m named with toymlx's, not "--model ... is
    # required" (-m is mlx_lm.generate's --max-tokens: both named, neither taken)
    ("generate", ["-m", "m.gguf", "-p", "hi", "-n", "3"],
     ("toymlx-generate: error: -m: expected an option of toymlx-generate, got an unknown one; "
      "llama.cpp's -m is --model here, mlx_lm.generate's -m is --max-tokens")),
    ("generate", ["--model", "m", "-n", "x"],  # an alias: named as typed
     "toymlx-generate: error: -n: expected an integer, got 'x'"),
    # llama-cli's -sp and -ngl are not -s p and -n gl (argparse runs one-letter flags together)
    ("generate", ["--model", "m", "-sp", "-ngl", "99"],
     ("toymlx-generate: error: -sp: expected an option of toymlx-generate, got an unknown one; "
      "-ngl: expected an option of toymlx-generate, got an unknown one; llama.cpp's -ngl is "
      "--device gpu here (the whole model on MLX's GPU; --device cpu: none of it)")),
    ("generate", ["--model", "m.gguf", "-m", "100"],
     ("toymlx-generate: error: -m: expected an option of toymlx-generate, got an unknown one; "
      "llama.cpp's -m is --model here, mlx_lm.generate's -m is --max-tokens")),
    ("eval", ["-m", "m.gguf"],  # no --max-tokens: llama.cpp's meaning alone
     ("toymlx-eval: error: -m: expected an option of toymlx-eval, got an unknown one; did you "
      "mean --model?")),
    ("generate", ["--model", "m", "--n-predict", "3"],
     ("toymlx-generate: error: --n-predict: expected an option of toymlx-generate, got an "
      "unknown one; did you mean --max-tokens?")),
    # llama.cpp's flags for an adapter, the GPU, a conversation, the context: toymlx's named
    # (-sys is taken: --system)
    ("generate", ["--model", "b.gguf", "--lora", "a.gguf", "-ngl", "99", "-cnv", "-sys", "hi"],
     ("toymlx-generate: error: --lora: expected an option of toymlx-generate, got an unknown "
      "one; llama.cpp's --lora FILE is --adapter FILE here (or the run's folder); -ngl: "
      "expected an option of toymlx-generate, got an unknown one; llama.cpp's -ngl is --device "
      "gpu here (the whole model on MLX's GPU; --device cpu: none of it); -cnv: expected an "
      "option of toymlx-generate, got an unknown one; llama.cpp's -cnv is --chat here")),
    ("generate", ["--model", "m", "--ctx-size", "512", "-f", "p.txt"],
     ("toymlx-generate: error: --ctx-size: expected an option of toymlx-generate, got an "
      "unknown one; llama.cpp's --ctx-size has no counterpart here: the model's own context is "
      "read (a from-scratch run's --seq-len), the text shifted past it (--no-context-shift "
      "stops there); -f: expected an option of toymlx-generate, got an unknown one; "
      "llama.cpp's -f FILE is --prompt - < FILE here")),
    ("eval", ["--model", "b.gguf", "--lora", "a.gguf", "--ctx-size", "128"],
     ("toymlx-eval: error: --lora: expected an option of toymlx-eval, got an unknown one; "
      "llama.cpp's --lora FILE: here --model takes the LoRA run's folder (its base and "
      "adapter), or a fused GGUF; --ctx-size: expected an option of toymlx-eval, got an "
      "unknown one; llama.cpp's --ctx-size is --seq-len here")),
    ("export", ["--base", "b.gguf", "--lora", "a.gguf", "--out", "f.gguf"],
     ("toymlx-export: error: --lora: expected an option of toymlx-export, got an unknown one; "
      "llama.cpp's --lora FILE is --adapter FILE here (or the run's folder)")),
    # llama.cpp's --lora-scaled FILE S (before: no hint): the adapter at its own scale
    *((module, [*args, "--lora-scaled", "a.gguf", "0.5"],
       (f"toymlx-{module}: error: --lora-scaled: expected an option of toymlx-{module}, got an "
        f"unknown one; llama.cpp's --lora-scaled FILE S{said}, at the scale it was trained "
        f"with (S 1{more})"))
      for module, args, said, more in (
          ("generate", ["--model", "b.gguf"], " is --adapter FILE here (or the run's folder)",
           "; no option scales it"),
          ("export", ["--base", "b.gguf", "--out", "f.gguf"],
           " is --adapter FILE here (or the run's folder)", "; no option scales it"),
          ("eval", ["--model", "b.gguf"], (": here --model takes the LoRA run's folder (its "
                                           "base and adapter)"), ""))),
    # nanoGPT's sample.py settings
    ("generate", ["--out_dir=runs/lm", "--start=hi", "--max_new_tokens=5"],
     ("toymlx-generate: error: --out_dir: expected an option of toymlx-generate, got an unknown "
      "one; nanoGPT's out_dir is toymlx's --model RUN_FOLDER; --start: expected an option of "
      "toymlx-generate, got an unknown one; nanoGPT's start is toymlx's --prompt TEXT (a file: "
      "--prompt - < FILE); --max_new_tokens: expected an option of toymlx-generate, got an "
      "unknown one; nanoGPT's max_new_tokens is toymlx's --max-tokens")),
    ("generate", ["--prompt", "hi"],
     ("toymlx-generate: error: --model: expected a value (it is required), got none; e.g. "
      "toymlx-generate --model runs/RUN_ID --prompt TEXT (toymlx-generate --help lists every "
      "option)")),
    ("classify", ["--model", "m", "--top-k", "three"],
     "toymlx-classify: error: --top-k: expected an integer, got 'three'"),
])
def test_the_forward_only_commands_refuse_in_one_line(capsys, module, args, want):
    import importlib

    assert importlib.import_module(f"toymlx_cli.{module}").main(args) == 2
    assert only_line(capsys) == want


def test_a_sweep_names_the_run_whose_options_are_refused(capsys, tmp_path):
    from toymlx_cli.sweep import main as sweep_main

    assert sweep_main(["--recipe", "lora", "--runs-root", str(tmp_path), "--grid",
                       "lr=1e-4,3e-4", "--", "--stpes", "3"]) == 2
    line = only_line(capsys)
    assert line.startswith("toymlx-sweep: error: run ")
    assert line.endswith(f": --stpes: expected an option of {LORA}, got an unknown one; did "
                         "you mean --steps?; no run was started")


@pytest.mark.parametrize("args,want", [
    (["--recipe", "from-scratch", "--run-id", ""],
     ("--run-id: expected a non-empty folder name, got an empty string; omit --run-id for its "
      "default (<timestamp>-<recipe>)")),
    (["--recipe", "from-scratch", "--runs-root="],
     ("--runs-root: expected a non-empty path, got an empty string; omit --runs-root for its "
     "default (runs)")),
    (["--recipe", "from-scratch", "--data.path", ""],
     ("--data.path: expected a non-empty path, got an empty string; omit --data.path for its "
     "default")),
    (["--recipe", "lora", "--lora.targets", ""],
     ("--lora.targets: expected a non-empty list of layer names, got an empty string; omit "
      "--lora.targets for its default (q)")),
    (["--resume", ""], "--resume: expected a non-empty run folder (runs/<id>), got an empty string"),
    (["--recipe", "from-scratch", "--resume="],
     "--resume: expected a non-empty run folder (runs/<id>), got an empty string"),
])
def test_an_empty_text_option_is_refused_not_a_default(capsys, tmp_path, monkeypatch, args, want):
    """An empty --run-id started a run under the default id, an empty --data.path read the
    current folder, an empty --resume started a new run: each is refused in one line."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_text_option_from_a_config_file_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("run_id: ''\n")
    assert main(["--recipe", "from-scratch", "-c", "c.yaml"]) == 2
    assert only_line(capsys).startswith("toymlx-train: error: --run-id: expected a non-empty "
                                        "folder name, got an empty string")
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


@pytest.mark.parametrize("module,args,want", [
    ("export", ["--model", "m", "--out", ""], ("--out: expected a non-empty path, got an empty "
                                              "string")),
    ("eval", ["--model", ""], "--model: expected a non-empty path, got an empty string"),
    ("eval", ["--model", "m", "--plot="], ("--plot: expected a non-empty path, got an empty "
                                           "string; omit --plot for its default")),
])
def test_the_forward_only_commands_refuse_an_empty_path(capsys, module, args, want):
    import importlib

    assert importlib.import_module(f"toymlx_cli.{module}").main(args) == 2
    assert only_line(capsys) == f"toymlx-{module}: error: {want}"


def test_an_empty_prompt_is_still_taken():
    """An option whose own default is the empty string (toymlx-generate's --prompt) keeps it."""
    from toymlx_cli.generate import Args
    from toymlx_cli.usage import parse_options

    assert parse_options(Args, ["--model", "m", "--prompt", ""], "toymlx-generate").prompt == ""


def test_a_type_name_in_llama_quantize_s_capitals_is_the_offered_type(tmp_path):
    """`toymlx-export --dtype Q4_K_M` (llama-quantize lists its types in capitals and takes any
    case) was refused, "expected one of ..., q4_k_m, ..., got 'Q4_K_M'"; on the command line as
    `--dtype=IQ4_XS`, and in a -c file, it is the type offered. A name no type has is still
    refused, and `none` is not the unset default."""
    from toymlx_cli.config_file import file_defaults
    from toymlx_cli.export import Args
    from toymlx_cli.usage import UsageError, parse_options

    def dtype(*argv: str) -> str | None:
        return parse_options(Args, ["--out", "x.gguf", *argv], "toymlx-export").dtype

    assert (dtype("--dtype", "Q4_K_M"), dtype("--dtype=IQ4_XS"), dtype("--dtype", "F16"),
            dtype("--dtype", "q8_0")) == ("q4_k_m", "iq4_xs", "f16", "q8_0")
    for bad in ("Q4_K_X", "none"):
        with pytest.raises(UsageError, match=f"^--dtype: expected one of f32, .*, got '{bad}'$"):
            dtype("--dtype", bad)
    path = tmp_path / "x.yaml"
    path.write_text("dtype: Q5_K_M\n")
    defaults, _ = file_defaults(Args, ["-c", str(path), "--out", "x.gguf"], "toymlx-export")
    assert defaults.dtype == "q5_k_m"


VIT = "toymlx-train --recipe vit-tiny"


@pytest.mark.parametrize("args,want", [
    # timm's train.py flags: toymlx's name for each, not the closest spelling (before: --epochs
    # had no hint, --opt "did you mean --stop-at?", --amp "did you mean --warmup?")
    (["--epochs", "2"], (f"--epochs: expected an option of {VIT}, got an unknown one; timm's "
                         "--epochs is --steps here: optimizer steps, an epoch being the training "
                         "images / --batch-size")),
    (["--data-dir", "x"], (f"--data-dir: expected an option of {VIT}, got an unknown one; "
                           "timm's --data-dir is --data.path here (class subfolders, or train/ "
                           "and val/ of them)")),
    (["--opt", "adamw"], (f"--opt: expected an option of {VIT}, got an unknown one; this recipe "
                          "trains with AdamW only (--lr, --weight-decay, --beta1, --beta2)")),
    (["--amp"], (f"--amp: expected an option of {VIT}, got an unknown one; timm's --amp is "
                 "--dtype bfloat16 here (float16: with a loss scale)")),
    (["-b", "16"], (f"-b: expected an option of {VIT}, got an unknown one; timm's -b is "
                   "--batch-size here")),
    # timm's flag's own three values are its own (before: each '32' named as a value no option
    # takes, and before that the first '32' twice); a fourth is a stray, named at its place
    (["--input-size", "3", "32", "32"], (
        f"--input-size: expected an option of {VIT}, got an unknown one; timm's --input-size C "
        "H W is --data.image-size H here (square images; --data.channels C)")),
    (["--input-size", "3", "32", "32", "32"], (
        f"--input-size: expected an option of {VIT}, got an unknown one; timm's --input-size C "
        "H W is --data.image-size H here (square images; --data.channels C); '32': expected an "
        f"option of {VIT}, got a value no option takes (after 32 32)")),
    (["--scale", "0.08", "1.0"], (
        f"--scale: expected an option of {VIT}, got an unknown one; timm's --scale MIN MAX is "
        "--data.crop-scale MIN here")),
    # `--flag=VALUE` is the first of the flag's values, said in the same one line as with a
    # space (before: each later value named as a value no option takes, "(after --input-size=3)")
    (["--input-size=3", "32", "32"], (
        f"--input-size: expected an option of {VIT}, got an unknown one; timm's --input-size C "
        "H W is --data.image-size H here (square images; --data.channels C)")),
    (["--input-size=3", "32", "32", "99"], (
        f"--input-size: expected an option of {VIT}, got an unknown one; timm's --input-size C "
        "H W is --data.image-size H here (square images; --data.channels C); '99': expected an "
        f"option of {VIT}, got a value no option takes (after 32 32)")),
    (["--scale=0.08", "1.0"], (
        f"--scale: expected an option of {VIT}, got an unknown one; timm's --scale MIN MAX is "
        "--data.crop-scale MIN here")),
    (["--scale", "0.08", "1.0", "7"], (
        f"--scale: expected an option of {VIT}, got an unknown one; timm's --scale MIN MAX is "
        f"--data.crop-scale MIN here; '7': expected an option of {VIT}, got a value no option "
        "takes (after 0.08 1.0)")),
    (["--scale=0.08", "1.0", "7"], (
        f"--scale: expected an option of {VIT}, got an unknown one; timm's --scale MIN MAX is "
        f"--data.crop-scale MIN here; '7': expected an option of {VIT}, got a value no option "
        "takes (after --scale=0.08 1.0)")),
    # its values stop at the next option (before: '99' taken as --scale's second and not named)
    (["--scale", "0.08", "--steps", "3", "99"], (
        f"--scale: expected an option of {VIT}, got an unknown one; timm's --scale MIN MAX is "
        f"--data.crop-scale MIN here; '99': expected an option of {VIT}, got a value no option "
        "takes (after --steps 3)")),
    (["--stpes", "3"], (f"--stpes: expected an option of {VIT}, got an unknown one; did you mean "
                       "--steps?")),
    # timm's flags whose closest spelling is another idea (before: --drop "did you mean
    # --model.drop-path?", --channels-last "--data.channels?", --model-ema "--model.n-heads?",
    # --initial-checkpoint "--grad-checkpoint?", --eval-metric "--eval-every?", --ratio
    # "--min-lr-ratio?"), or that had no hint (--mean's three values each named as a stray)
    (["--drop", "0.1"], (f"--drop: expected an option of {VIT}, got an unknown one; timm's --drop "
                         "(dropout) has no counterpart here; the regularizer is --model.drop-path "
                         "(timm's --drop-path)")),
    (["--channels-last"], (f"--channels-last: expected an option of {VIT}, got an unknown one; "
                           "timm's --channels-last (PyTorch's memory layout) has no counterpart "
                           "here; --data.channels is the images' channel count (1 or 3)")),
    (["--model-ema"], (f"--model-ema: expected an option of {VIT}, got an unknown one; timm's "
                       "--model-ema has no counterpart here (no weight averaging): each "
                       "checkpoint holds the trained weights")),
    (["--initial-checkpoint", "x.pth"], (
        f"--initial-checkpoint: expected an option of {VIT}, got an unknown one; timm's "
        "--initial-checkpoint has no counterpart here: vit-tiny starts from random init "
        "(--resume RUN goes on with a run of toymlx's)")),
    (["--eval-metric", "top1"], (f"--eval-metric: expected an option of {VIT}, got an unknown "
                                 "one; timm's --eval-metric has no counterpart here: --keep-best "
                                 "N keeps the N checkpoints of lowest val_loss")),
    (["--checkpoint-hist", "3"], (f"--checkpoint-hist: expected an option of {VIT}, got an "
                                  "unknown one; timm's --checkpoint-hist is --keep-last here "
                                  "(--keep-best N: the N of lowest val_loss)")),
    (["--ratio", "0.75", "1.33"], (
        f"--ratio: expected an option of {VIT}, got an unknown one; timm's --ratio has no "
        "counterpart here: --data.crop resized draws the aspect ratio in timm's default range, "
        "3/4 to 4/3")),
    (["--warmup-lr", "1e-6"], (f"--warmup-lr: expected an option of {VIT}, got an unknown one; "
                               "timm's --warmup-lr has no counterpart here: the warm-up rises "
                               "linearly from --lr / --warmup to --lr")),
    (["--lr-base", "5e-4"], (f"--lr-base: expected an option of {VIT}, got an unknown one; "
                             "timm's --lr-base has no counterpart here: --lr is the peak rate as "
                             "given, not scaled by --batch-size / 256")),
    (["--log-interval", "5"], (f"--log-interval: expected an option of {VIT}, got an unknown "
                               "one; timm's --log-interval is --report-every here")),
    (["--val-split", "validation"], (
        f"--val-split: expected an option of {VIT}, got an unknown one; timm's --train-split and "
        "--val-split are the folders train/ and val/ (or validation/) under --data.path here, or "
        "--data.path TRAIN --data.val-path VAL")),
    (["--class-map", "m.txt"], (f"--class-map: expected an option of {VIT}, got an unknown one; "
                                "timm's --class-map has no counterpart here: the classes are the "
                                "class folders in sorted order (toymlx-export writes "
                                "class_map.txt for timm)")),
    (["--mean", "0.5", "0.5", "0.5", "--std", "0.2", "0.2", "0.2"], (
        f"--mean: expected an option of {VIT}, got an unknown one; timm's --mean and --std have "
        "no counterpart here: each channel is standardised by the training split's own mean and "
        f"std (in the checkpoint); --std: expected an option of {VIT}, got an unknown one; timm's "
        "--mean and --std have no counterpart here: each channel is standardised by the training "
        "split's own mean and std (in the checkpoint)")),
    (["--interpolation", "bilinear"], (
        f"--interpolation: expected an option of {VIT}, got an unknown one; timm's "
        "--interpolation has no counterpart here: images are resized bicubic, as timm's "
        "vit_tiny_patch16_224")),
    (["--crop-pct", "0.9"], (f"--crop-pct: expected an option of {VIT}, got an unknown one; "
                             "timm's --crop-pct has no counterpart here: the shorter side is "
                             "resized to --data.image-size and centre-cropped (crop_pct 1.0)")),
])
def test_timm_s_flags_are_named_with_toymlx_s(capsys, tmp_path, monkeypatch, args, want):
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "vit-tiny", *args]) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe,flag,want", [
    # timm's texts are vit-tiny's (before: from-scratch's --model "is --model.preset vit-tiny
    # here", --epochs on a text recipe "an epoch being the training images / --batch-size")
    ("from-scratch", "--model", ("timm's --model is a flag for images (toymlx-train --recipe "
     "vit-tiny); not an option of toymlx-train --recipe from-scratch")),
    ("from-scratch", "--epochs", ("timm's --epochs is a flag for images (toymlx-train --recipe "
     "vit-tiny); not an option of toymlx-train --recipe from-scratch")),
    ("lora", "--epochs", ("timm's --epochs is a flag for images (toymlx-train --recipe "
     "vit-tiny); not an option of toymlx-train --recipe lora")),
    # other trainers' optimizer flags: lora's --optimizer, the others' one optimizer (before:
    # lora's --opt "a flag for images (toymlx-train --recipe vit-tiny)", which has no --opt
    # either, from-scratch's --optim no hint)
    ("lora", "--opt", "timm's and mlx_lm.lora's --opt is --optimizer here"),
    ("lora", "--optim", ("HF Trainer's --optim is --optimizer here (its adamw_torch and "
     "adamw_8bit: adamw, whose moments are float32)")),
    ("from-scratch", "--opt", ("this recipe trains with AdamW only (--lr, --weight-decay, "
     "--beta1, --beta2)")),
    ("warm-start", "--optim", ("this recipe trains with AdamW only (--lr, --weight-decay, "
     "--beta1, --beta2)")),
    # one text recipe's model flag given to another (before: "got an unknown one", no more)
    ("warm-start", "--tokenizer", ("warm-start's tokenizer is its --donor's (the table's rows "
     "are its tokens); another GGUF's tokenizer from random init: --recipe from-scratch "
     "--tokenizer FILE")),
    ("from-scratch", "--donor", ("--donor is warm-start's (a GGUF's token table and tokenizer): "
     "--recipe warm-start --donor FILE; here --tokenizer FILE takes a GGUF's tokenizer alone")),
    ("from-scratch", "--base", ("--base is lora's (fine-tunes that GGUF): --recipe lora --base "
     "FILE; here --tokenizer FILE takes its tokenizer alone")),
    ("warm-start", "--base", ("--base is lora's (fine-tunes that GGUF): --recipe lora --base "
     "FILE; here --donor FILE takes its token table and tokenizer")),
    # mlx_lm.lora's flags on the lora recipe (before: --model "is a flag for images", --iters
    # no hint)
    ("lora", "--model", "mlx-lm's --model is toymlx's --base"),
    ("lora", "--iters", "mlx-lm's --iters is toymlx's --steps"),
    ("lora", "--learning-rate", "mlx-lm's --learning-rate is toymlx's --lr"),
    # before: "mlx-lm's --train is toymlx's nothing (toymlx-train always trains)"
    ("lora", "--train", ("mlx-lm's --train has no toymlx option: toymlx-train always trains; "
     "drop it")),
    # before: "--test-batches is toymlx's --test scores all of test.jsonl; drop it" (a text
    # read as a flag); --project-name, --clear-cache-threshold and --trust-remote-code no hint
    ("lora", "--test-batches", ("mlx-lm's --test-batches has no toymlx option: toymlx scores all "
     "of test.jsonl, every batch (--test; its first N examples: toymlx-eval --model RUN --split "
     "test --limit N); drop it")),
    ("lora", "--project-name", ("mlx-lm's --project-name is toymlx's --wandb-project (with "
     "--report-to wandb, the only service mlx-lm reads it for)")),
    ("lora", "--clear-cache-threshold", ("mlx-lm's --clear-cache-threshold has no toymlx option: "
     "toymlx manages MLX's cache itself; drop it")),
    ("lora", "--trust-remote-code", ("mlx-lm's --trust-remote-code has no toymlx option: toymlx "
     "runs no code from a model's repository (a GGUF holds none); drop it")),
    # nanoGPT's, each recipe its own (before: vit-tiny's --dataset "a text file", --dropout
    # and --bias "its Llama")
    ("from-scratch", "--dataset", ("nanoGPT's dataset is toymlx's --data.path (a text file, not "
     "prepare.py's .bin)")),
    # timm's --dataset where the recipe trains images (before: nanoGPT's, without CIFAR)
    ("vit-tiny", "--dataset", ("timm's --dataset is --data.path here (class folders, CIFAR's "
     "python batches, MNIST's IDX files or a .npz; no torch/ or hfds/ names)")),
    ("from-scratch", "--dropout", ("nanoGPT's dropout has no toymlx option (its Llama has no "
     "dropout)")),
    ("vit-tiny", "--dropout", ("nanoGPT's dropout has no toymlx option (vit-tiny's regularizer "
     "is --model.drop-path, stochastic depth)")),
    ("lora", "--bias", "nanoGPT's bias has no toymlx option (its Llama has no biases)"),
    ("vit-tiny", "--bias", ("nanoGPT's bias has no toymlx option (vit-tiny's ViT has biases, as "
     "timm's)")),
])
def test_each_recipe_gets_the_peer_table_of_what_it_trains(capsys, tmp_path, monkeypatch,
                                                           recipe, flag, want):
    """timm's table only where the command trains images (it has --data.image-size), mlx-lm's
    only where it fine-tunes a --base, nanoGPT's texts by the recipe's model."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", recipe, flag, "x"]) == 2
    assert only_line(capsys) == (f"toymlx-train: error: {flag}: expected an option of "
                                 f"toymlx-train --recipe {recipe}, got an unknown one; {want}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,tool", [
    (["--nproc_per_node", "2"], "torchrun's"),
    (["--nproc-per-node=2"], "torchrun's"),
    (["--num_processes", "2"], "accelerate launch's"),
    (["-np", "2"], "mpirun's"),
])
def test_another_launcher_s_rank_count_names_toymlx_launch(capsys, tmp_path, monkeypatch, args,
                                                           tool):
    """`toymlx-train --nproc_per_node 2`, as `torchrun --nproc_per_node 2 train.py` reads (before:
    "unknown one" and no hint, --num_processes "did you mean --no-progress?")."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "from-scratch", *args]) == 2
    flag = args[0].partition("=")[0]
    assert only_line(capsys) == (
        f"toymlx-train: error: {flag}: expected an option of {SCRATCH}, got an unknown one; "
        f"{tool} {flag} is toymlx-launch's -n: toymlx-launch -n N -- toymlx-train ...")
    assert list(tmp_path.iterdir()) == []


def help_text(monkeypatch, capsys, module: str, args: list[str], columns: int) -> str:
    """A command's `--help` as printed with the terminal `columns` wide."""
    import importlib

    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"toymlx_cli.{module}").main(args)
    assert e.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("module,args", [
    ("train", ["--recipe", "lora", "--help"]), ("eval", ["--help"]), ("generate", ["--help"]),
    ("export", ["--help"]), ("classify", ["--help"]), ("sweep", ["--help"]),
    ("report", ["--help"]), ("launch", ["--help"])])
def test_help_on_a_narrow_terminal_is_wrapped_at_80_columns(monkeypatch, capsys, module, args):
    """COLUMNS=20 (a narrow pane): every command's help is its 80-column help (before:
    toymlx-eval's came out one character a line, 1,046 lines); COLUMNS is left as it was."""
    import os

    narrow = help_text(monkeypatch, capsys, module, args, 20)
    assert os.environ["COLUMNS"] == "20"
    assert narrow == help_text(monkeypatch, capsys, module, args, 80)


def test_a_wide_terminal_keeps_its_width(monkeypatch, capsys):
    """tyro's table of options spans the terminal: 80 columns under COLUMNS=20, 120 under 120
    (the -c/--config paragraph is the description's, not wrapped)."""
    for columns, width in ((20, 80), (120, 120)):
        out = help_text(monkeypatch, capsys, "eval", ["--help"], columns)
        assert max(len(line) for line in out.splitlines() if "-c/--config" not in line) == width


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_train_s_from_given_to_a_command_that_reads_a_run_names_the_checkpoint_file(
        capsys, tmp_path, monkeypatch, command):
    """`toymlx-eval --model runs/x --from step_10` (toymlx-train's way to pick a checkpoint)
    was an unknown option with no hint, or "did you mean --prompt?" (generate), "--format?"
    (export). Now the checkpoint's own file, given where the run folder goes."""
    import importlib

    monkeypatch.chdir(tmp_path)
    run_main = importlib.import_module(f"toymlx_cli.{command}").main
    assert run_main(["--from", "step_10"]) == 2
    prog = f"toymlx-{command}"
    assert only_line(capsys) == (
        f"{prog}: error: --from: expected an option of {prog}, got an unknown one; --from is "
        "toymlx-train's (the checkpoint a resume goes on from); here give that checkpoint's file "
        "where you give the run folder: RUN/weights/step_N.gguf (a LoRA run's: "
        "RUN/weights/adapter_step_N.gguf)")


TORCH_GPU = "is gpu here: MLX's GPU, Metal on a Mac, CUDA elsewhere"


@pytest.mark.parametrize("module,args,want", [
    # PyTorch's device names, as nanoGPT's device='cuda' (or a Mac's 'mps') is typed (before:
    # "expected one of auto, gpu, cpu" alone, not saying which of them cuda is)
    ("train", ["--recipe", "from-scratch", "--device", "cuda"], (
        f"--device: expected one of auto, gpu, cpu, got 'cuda'; PyTorch's cuda (nanoGPT's "
        f"device) {TORCH_GPU}")),
    ("train", ["--recipe", "vit-tiny", "--device=cuda:1"], (
        f"--device: expected one of auto, gpu, cpu, got 'cuda:1'; PyTorch's cuda:1 (nanoGPT's "
        f"device) {TORCH_GPU}")),
    ("generate", ["--model", "m.gguf", "--device", "mps"], (
        f"--device: expected one of auto, cpu, gpu, got 'mps'; PyTorch's mps (nanoGPT's device) "
        f"{TORCH_GPU}")),
    ("train", ["--recipe", "from-scratch", "--device", "tpu"],
     "--device: expected one of auto, gpu, cpu, got 'tpu'"),
])
def test_pytorch_s_gpu_device_names_are_toymlx_s_gpu(capsys, tmp_path, monkeypatch, module,
                                                     args, want):
    import importlib

    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(f"toymlx_cli.{module}").main(args) == 2
    assert only_line(capsys) == f"toymlx-{module}: error: {want}"
    assert list(tmp_path.iterdir()) == []


def test_pytorch_s_gpu_device_name_in_a_config_file_is_toymlx_s_gpu(capsys, tmp_path):
    """nanoGPT's config key `device: cuda` in a -c file: the same hint, before the file's fix."""
    conf = tmp_path / "c.yaml"
    conf.write_text("device: cuda\n")
    assert main(["--recipe", "from-scratch", "-c", str(conf)]) == 2
    assert only_line(capsys) == (
        f"toymlx-train: error: {conf}: key 'device': expected one of \"auto\", \"gpu\", \"cpu\", "
        f"found \"cuda\" (a string); PyTorch's cuda (nanoGPT's device) {TORCH_GPU}; fix it, or "
        "remove the key to take its default")


@pytest.mark.parametrize("args,want", [
    # tyro hands back every token after an unknown option where the command takes positionals:
    # the images were named as strays (before: "--topk: ... did you mean --top-k?; 'a.png':
    # expected an option of toymlx-classify, got a value no option takes (after --topk 2)")
    (["--model", "m", "--topk", "2", "a.png", "b.png"], (
        "--topk: expected an option of toymlx-classify, got an unknown one; did you mean "
        "--top-k?")),
    (["--model", "m", "--dtype=float32", "a.png", "-"], (
        "--dtype: expected an option of toymlx-classify, got an unknown one")),
    # images before the unknown option, two unknown options: as before
    (["--model", "m", "a.png", "--topk", "2", "--jsn"], (
        "--topk: expected an option of toymlx-classify, got an unknown one; did you mean "
        "--top-k?; --jsn: expected an option of toymlx-classify, got an unknown one; did you "
        "mean --json?")),
])
def test_an_unknown_option_before_the_images_names_no_image_as_a_stray(capsys, tmp_path,
                                                                       monkeypatch, args, want):
    from toymlx_cli.classify import main as classify_main

    monkeypatch.chdir(tmp_path)
    assert classify_main(args) == 2
    assert only_line(capsys) == f"toymlx-classify: error: {want}"


@pytest.mark.parametrize("args,want", [
    # sample.py's dtype and compile, toymlx-train's options, that toymlx-generate chooses itself
    # (before: "got an unknown one" alone)
    (["--dtype=float32"], (
        "--dtype: expected an option of toymlx-generate, got an unknown one; nanoGPT's dtype "
        "has no toymlx-generate option: it holds the model's weights as float32 on a CPU where "
        "memory allows, else as the file's blocks")),
    (["--compile=False"], (
        "--compile: expected an option of toymlx-generate, got an unknown one; nanoGPT's "
        "compile has no toymlx-generate option: on a CPU its one-token steps are traced with "
        "mx.compile already")),
])
def test_sample_py_s_dtype_and_compile_are_named_to_generate(capsys, tmp_path, monkeypatch,
                                                             args, want):
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.generate import main as generate_main

    monkeypatch.chdir(tmp_path)
    assert generate_main(["--model", "m.gguf", "--prompt", "x", *args]) == 2
    assert only_line(capsys) == f"toymlx-generate: error: {want}"
    # said to toymlx-generate alone: not "...; not an option of toymlx-eval"
    flag = args[0].partition("=")[0]
    assert eval_main(["--model", "m.gguf", *args]) == 2
    assert only_line(capsys) == (
        f"toymlx-eval: error: {flag}: expected an option of toymlx-eval, got an unknown one")


@pytest.mark.parametrize("value,want", [
    # timm's model names as the preset (before: the choices alone, no word of timm's)
    ("vit_tiny_patch16_224", "; timm's vit_tiny_patch16_224 is vit-tiny here"),
    ("vit_small_patch16_224", (
        "; timm's vit_small_patch16_224 is vit-tiny's ViT at its size here: --model.d-model 384 "
        "--model.n-heads 6 --model.n-layers 12 --model.ffn-dim 1536 --model.patch-size 16 "
        "--data.image-size 224")),
    ("timm/vit_base_patch32_384.augreg_in21k", (
        "; timm's timm/vit_base_patch32_384.augreg_in21k is vit-tiny's ViT at its size here: "
        "--model.d-model 768 --model.n-heads 12 --model.n-layers 12 --model.ffn-dim 3072 "
        "--model.patch-size 32 --data.image-size 384")),
    ("vit-small", ""),
])
def test_timm_s_model_names_as_the_preset_say_vit_tiny_s_options(capsys, tmp_path, monkeypatch,
                                                                  value, want):
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "vit-tiny", "--model.preset", value]) == 2
    assert only_line(capsys) == (
        "toymlx-train: error: --model.preset: expected one of auto, vit-tiny, vit-tiny-28, "
        f"vit-tiny-8, got {value!r}{want}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, want", [
    (["--weight_decay=-1"], "--weight_decay: expected >= 0, found -1.0"),
    (["--batch_size", "0"], "--batch_size: expected >= 1, found 0"),
    (["--eval_every", "-1"], "--eval_every: expected >= 0, found -1"),
    (["--run_id", ""], ("--run_id: expected a non-empty folder name, got an empty string; omit "
                        "--run-id for its default (<timestamp>-<recipe>)")),
    (["--weight_decay", "abc"], "--weight_decay: expected a number, got 'abc'"),
    (["--learning_rate", "-1"], (f"--learning_rate: expected an option of {LORA}, got an unknown "
                                 "one; mlx-lm's --learning_rate is toymlx's --lr")),
])
def test_a_train_refusal_names_an_underscored_flag_as_typed(args, want, capsys, tmp_path,
                                                            monkeypatch):
    """HF's and mlx-lm's users type --weight_decay, --batch_size (tyro takes them as
    --weight-decay); a value the recipe's checks refuse (`check_config`, after tyro's parse)
    was named --weight-decay, a flag they never typed. Now as typed, as tyro's own refusals
    were; nothing is written."""
    monkeypatch.chdir(tmp_path)
    assert main(["--recipe", "lora", *args]) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, want", [
    (["--recipe", "from-scratch", "--seq_len", "0"], "--seq_len: expected >= 1, found 0"),
    (["--recipe", "from-scratch", "--seq-len", "-3"], "--seq-len: expected >= 1, found -3"),
    (["--recipe", "warm-start", "--seq_len", "0"], "--seq_len: expected >= 1, found 0"),
    (["--recipe", "from-scratch", "--model.context", "0"],
     "--model.context: expected > 0, found 0"),
    (["--recipe", "from-scratch", "--model.context", "64", "--seq-len", "128"],
     "--seq-len: expected 1..64 (--model.context), found 128"),
    (["--recipe", "lora", "--base", "BASE", "--seq_len", "0"],
     "--seq_len: expected >= 1, found 0"),
    (["--recipe", "lora", "--base", "BASE", "--seq-len", "4096"],
     "--seq-len: expected 1..2048 (the context of --base BASE), found 4096"),
])
def test_a_seq_len_refusal_states_the_range_it_takes(args, want, capsys, tmp_path, monkeypatch,
                                                      stories_path):
    """A text run's context, where --model.context is not given, is --seq-len's own
    (`settle_context`): --seq-len 0 was told "expected 1..0 (the model context)", -3 "1..-3",
    and --model.context 0 blamed --seq-len 256 with "1..0". Each now states the range it takes
    and where its top comes from (--model.context, or lora's --base); nothing is written."""
    monkeypatch.chdir(tmp_path)
    args = [str(stories_path) if a == "BASE" else a for a in args]
    assert main(args) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want.replace('BASE', str(stories_path))}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("line, argv, want", [
    ("--max-tokens: expected a count >= 0, found -1", ["-n", "5", "--max-tokens", "-1"],
     "--max-tokens: expected a count >= 0, found -1"),
    ("--max-tokens: expected a count >= 0, found -1", ["--max-tokens", "5", "-n=-1"],
     "-n: expected a count >= 0, found -1"),
    ("--prompt -: stdin: expected text", ["-p", "-"], "-p -: stdin: expected text"),
    ("F.gguf: --model: expected a GGUF", ["--model", "F.gguf"], "F.gguf: --model: expected a GGUF"),
    ("--temperature: expected > 0", [], "--temperature: expected > 0"),
    ("--temperature: expected > 0", ["--temp", "0"], "--temp: expected > 0"),
    ("--top-k: expected >= 0", ["--temp", "0", "--top-k", "-1"], "--top-k: expected >= 0"),
    ("a line on --temperature: none", ["--temp", "0"], "a line on --temp: none"),
    # a second flag, typed short or with underscores, named as typed too
    ("--num-samples 2: expected a --prompt, found none", ["-p", "", "--num_samples", "2"],
     "--num_samples 2: expected a -p, found none"),
    # the advice after "; " names options by their own flags, as --help lists them
    ("--temperature: expected > 0 with --num-samples 2; drop --num-samples",
     ["--temp", "0", "--num_samples", "2"],
     "--temp: expected > 0 with --num_samples 2; drop --num-samples"),
    # not inside a path or another word; a flag not given stays
    ("runs/--seed/x: --top-k-ish, --seed", ["-s", "1"], "runs/--seed/x: --top-k-ish, -s"),
])
def test_a_refusal_names_its_flags_as_typed(line, argv, want):
    """`line_as_typed` renames each flag of a refusal (after a path, if any; before the advice
    after "; ") to its spelling at its last use on the command line (a second one named -p's
    --prompt, typed -p); a flag not given stays as it is."""
    from toymlx_cli.generate import Args
    from toymlx_cli.usage import line_as_typed

    assert line_as_typed(line, argv, Args) == want
