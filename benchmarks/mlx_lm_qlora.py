"""The peer of benchmarks/memory.py's toymlx rows: mlx-lm's own QLoRA on the same weights, its
own trainer, one child process per row; the row's peak RSS (the child's, from `wait4`), MLX's
peak (`mx.get_peak_memory()` in the child), the median iteration time (the first skipped) and
tokens per second.

What the child runs, as mlx-lm's commands do it:
- the model: the real SmolLM2-135M-Instruct Q4_1 GGUF dequantized exactly
  (`load_llama(path, weights="float32")`), put into mlx-lm's own llama model
  (`mlx_lm_step.build_peer`), quantized by `mlx_lm.utils.quantize_model` with
  `mlx_lm convert -q`'s defaults (affine, 4 bits, group 64, every Linear and the Embedding whose
  input width is a multiple of 64: all of SmolLM2's; the tied output head is the quantized
  embedding), and saved with `save_model`/`save_config` as `convert` saves it. That is done
  once, in a child of its own, into a cache folder (`converted`); each row loads the saved
  model with `mlx_lm.utils.load_model`, as `mlx_lm lora` loads a converted model, so the float32
  staging is not in the row's peak. No Hugging Face config exists for a GGUF, so `convert`'s
  cast to the config's `torch_dtype` does not happen: norms, scales and biases stay float32.
- LoRA as `mlx_lm lora` sets it up (`freeze`, `linear_to_lora_layers`, mlx-lm's defaults:
  rank 8, dropout 0, scale 20) but on q only (`self_attn.q_proj`, toymlx's default targets)
  and on every block (toymlx's default; mlx-lm's `--num-layers` default is 16); Adam at lr 2e-4;
  trained by `mlx_lm.tuner.trainer.train` (its own compiled step, its own `iterate_batches`)
  for `iters` iterations, with no validation and no checkpoint before the last iteration.
- OpenBLAS is loaded before MLX: toymlx is imported first (it preloads OpenBLAS), and the
  child refuses to run if `toymlx.backend.device.backend_info()` names another BLAS.

Data shapes (a row each):
- `packed`: the benchmark's LoRA shape: toymlx's packed training rows of the lora recipe's
  default data (`SFTData` at seq 256, packed, the recipe's defaults), each given to mlx-lm as
  one 257-token sequence (256 inputs + the last target; `max_seq_length` 257), batch 4. mlx-lm
  has no per-token loss mask, so it trains every token of those rows (toymlx masks the
  prompts): the same tokens through the model, the same work.
- `chat`: the mlx-lm user's unpacked rows: the recipe's default data file (its training split,
  the examples toymlx trains on) read as `mlx_lm.tuner.datasets.create_dataset` reads a
  train.jsonl (prompt/completion records: its CompletionsDataset, the chat template applied,
  `--mask-prompt`), batch 4, `max_seq_length` 256; `iterate_batches` pads each batch to its
  longest row + 1, rounded up to 32 + 1.

    python benchmarks/mlx_lm_qlora.py [--shapes packed chat] [--iters 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = Path.home() / ".cache" / "toymlx" / "mlx-lm"
SHAPES = ("packed", "chat")
BATCH, SEQ = 4, 256
"""The benchmark's LoRA shape (memory.py's smollm2 rows)."""
LORA = {"rank": 8, "dropout": 0.0, "scale": 20.0}
"""mlx-lm lora's lora_parameters defaults (CONFIG_DEFAULTS)."""
TARGETS = ("q",)
LR = 2e-4
SEED = 0
"""mlx-lm lora's --seed default."""
RESULT = "mlx_lm_qlora result: "
"""The child's last stdout line starts with this, then its JSON."""


def converted(gguf: Path, cache: Path = CACHE) -> Path:
    """The folder of `gguf`'s weights as `mlx_lm convert -q` writes them (config.json +
    model.safetensors), written now by a child process unless already in `cache`."""
    out = cache / f"{gguf.stem}.mlx-q4-g64"
    if (out / "config.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{out.name}.tmp{os.getpid()}"
    p = subprocess.run([sys.executable, str(Path(__file__)), "--convert-child", str(gguf),
                        str(tmp)], cwd=REPO, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"converting {gguf.name} for mlx-lm failed ({p.returncode}): "
                           f"{p.stderr.strip()[-1000:]}")
    tmp.rename(out)
    return out


def openblas_first() -> str:
    """Import toymlx before mlx (it preloads OpenBLAS, else MLX uses its reference BLAS) and
    return the BLAS MLX uses; SystemExit if it is not OpenBLAS (the comparison would be
    unfair)."""
    from toymlx.backend.device import backend_info

    blas = backend_info().get("blas")
    if blas != "openblas":
        raise SystemExit(f"mlx_lm_qlora: expected MLX on OpenBLAS, found BLAS {blas!r}")
    return blas


def convert_child(gguf: Path, out: Path) -> None:
    """In the child: the GGUF dequantized exactly, in mlx-lm's llama, quantized and saved as
    `mlx_lm convert -q` does (`quantize_model` with no group size or bits: its defaults)."""
    openblas_first()
    from mlx_lm.utils import quantize_model, save_config, save_model
    from mlx_lm_step import build_peer, model_config
    from toymlx_step import weights_np

    from toymlx.gguf.llama import load_llama

    model, g = load_llama(gguf, weights="float32")
    g.close()
    args, weights = model.args, weights_np(model)
    del model
    peer = build_peer(args, weights)
    del weights
    peer, config = quantize_model(peer, model_config(args), None, None)
    save_model(out, peer)
    save_config(config, out / "config.json")


class ChatTemplateTokenizer:
    """The part of a Hugging Face tokenizer mlx-lm's datasets use, on toymlx's tokenizer of the
    GGUF (there is no Hugging Face tokenizer here): `apply_chat_template` renders the GGUF's
    template and encodes the text without adding BOS, as `tokenize=True` does."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.eos_token_id = tok.eos_id

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None,
                            add_generation_prompt: bool = False, return_dict: bool = False
                            ) -> list[int]:
        extra = {"tools": tools} if tools else {}
        text = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            **extra)
        return list(self.tok.encode(text, add_bos=False))


class PackedRows:
    """toymlx's packed training rows as an mlx-lm dataset (`CacheDataset` calls `process`):
    each row's 256 inputs + its last target, loss from the first token (offset 0)."""

    def __init__(self, rows: dict[str, Any]):
        import numpy as np

        self.rows = np.concatenate([rows["inputs"], rows["targets"][:, -1:]], axis=1)

    def __getitem__(self, idx: int) -> list[int]:
        return self.rows[idx].tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def process(self, d: list[int]) -> tuple[list[int], int]:
        return d, 0


def dataset(shape: str, gguf: Path) -> tuple[Any, int]:
    """The row's training data as mlx-lm reads it, and its max_seq_length."""
    from toymlx.data.chat import SFTData, load_examples, split_examples
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.reader import GGUFFile
    from toymlx.recipes.lora import DEFAULT_DATA, ChatDataOptions

    with GGUFFile(gguf) as g:
        tok = Tokenizer.from_metadata(dict(g.metadata))
    opts = ChatDataOptions()  # the recipe's data defaults
    if shape == "packed":
        data = SFTData.from_file(DEFAULT_DATA, tok, SEQ, opts.mask_prompt, True,
                                 opts.val_fraction)
        return PackedRows(data.train), SEQ + 1
    from mlx_lm.tuner.datasets import create_dataset

    train, _ = split_examples(load_examples(DEFAULT_DATA), opts.val_fraction)
    records = [{"prompt": e.prompt, "completion": e.completion} for e in train]
    config = argparse.Namespace(mask_prompt=True)  # mlx-lm's --mask-prompt
    return create_dataset(records, ChatTemplateTokenizer(tok), config), SEQ


def row_child(shape: str, gguf: Path, model_dir: Path, iters: int) -> dict[str, Any]:
    """In the child: mlx-lm's QLoRA for `iters` iterations; its times, tokens and MLX peak."""
    blas = openblas_first()
    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.tuner import trainer
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model
    from mlx_lm_step import lora_keys
    from scratch import scratch_folder

    np.random.seed(SEED)  # as mlx_lm lora's run()
    t0 = time.perf_counter()
    model, _ = load_model(model_dir)
    data, max_seq = dataset(shape, gguf)
    load_s = time.perf_counter() - t0
    mx.random.seed(SEED)  # as mlx_lm lora's train_model()
    model.freeze()
    n_layers = len(model.layers)
    linear_to_lora_layers(model, n_layers, {**LORA, "keys": lora_keys(TARGETS)})
    widths: list[int] = []

    def batches(**kw: Any):  # mlx-lm's own batching; the widths it made, recorded
        for batch, lengths in trainer.iterate_batches(**kw):
            widths.append(int(batch.shape[1]))
            yield batch, lengths

    class Times(TrainingCallback):
        def __init__(self) -> None:
            self.reports: list[dict[str, Any]] = []

        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            self.reports.append(info)

    times = Times()
    with scratch_folder("mlx-lm-qlora-") as tmp:
        args = trainer.TrainingArgs(batch_size=BATCH, iters=iters, steps_per_report=1,
                                    steps_per_eval=iters + 1, steps_per_save=iters + 1,
                                    max_seq_length=max_seq,
                                    adapter_file=str(tmp / "adapters.safetensors"))
        trainer.train(model=model, optimizer=optim.Adam(learning_rate=LR), args=args,
                      train_dataset=CacheDataset(data), val_dataset=None,
                      iterate_batches=batches, training_callback=times)
    # steps_per_report 1: each report's train_time is that one iteration's
    step_s = [1.0 / r["iterations_per_second"] for r in times.reports]
    trained = [r["tokens_per_second"] / r["iterations_per_second"] for r in times.reports]
    timed = slice(1, None) if len(step_s) > 1 else slice(None)
    positions = [BATCH * (w - 1) for w in widths[:len(step_s)]]
    return {"iters": len(step_s), "step_times_s": [round(t, 3) for t in step_s],
            "step_s": round(statistics.median(step_s[timed]), 3),
            "tokens_per_s": round(sum(positions[timed]) / sum(step_s[timed]), 1),
            "trained_tokens_per_s": round(sum(trained[timed]) / sum(step_s[timed]), 1),
            "input_shapes": [f"{BATCH}x{w - 1}" for w in widths[:len(step_s)]],
            "loss": [round(r["train_loss"], 4) for r in times.reports],
            "mlx_peak_gb": round(mx.get_peak_memory() / 1e9, 3), "load_s": round(load_s, 1),
            "lora_layers": n_layers, "blas": blas}


def measure(shape: str, iters: int = 4, gguf: Path | None = None) -> dict[str, Any]:
    """One row: `row_child` in a child process; its peak RSS from wait4."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, found {shape!r}")
    if gguf is None:
        sys.path.insert(0, str(HERE))
        from user_paths import smollm_gguf

        gguf = smollm_gguf()
    model_dir = converted(gguf)
    cmd = [sys.executable, str(Path(__file__)), "--row-child", shape, str(gguf), str(model_dir),
           str(iters)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    rec: dict[str, Any] = {
        "row": f"mlx-lm-{shape}", "runner": "mlx-lm", "file": gguf.name,
        "file_mb": round(gguf.stat().st_size / 1e6, 1), "data": shape,
        "shape": f"{BATCH}x{SEQ}", "targets": ",".join(TARGETS), "base": "mlx-lm affine q4 g64",
        "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),
        "command": "python benchmarks/mlx_lm_qlora.py --shapes " + shape + f" --iters {iters}"}
    result = [x for x in out.splitlines() if x.startswith(RESULT)]
    if rc != 0 or not result:
        rec["error"] = out.strip().splitlines()[-1] if out.strip() else ""
        return rec
    rec.update(json.loads(result[-1][len(RESULT):]))
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path[:0] = [str(HERE), str(REPO)]  # this checkout's toymlx, not an installed one
    if argv[:1] == ["--convert-child"]:
        convert_child(Path(argv[1]), Path(argv[2]))
        return 0
    if argv[:1] == ["--row-child"]:
        rec = row_child(argv[1], Path(argv[2]), Path(argv[3]), int(argv[4]))
        print(RESULT + json.dumps(rec), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--iters", type=int, default=4, help="training iterations per row (>= 2)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.iters < 2:
        p.error(f"--iters: expected >= 2 (the first is not timed), found {args.iters}")
    from user_paths import host_info, host_line

    host = host_info()
    print(host_line(host), flush=True)
    rows = []
    for shape in args.shapes:
        rec = measure(shape, args.iters)
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    if args.json:
        args.json.write_text(json.dumps({"host": host, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
