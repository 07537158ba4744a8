"""Pieces the language-model recipes share: model options, text data, and the Llama task."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from toymlx.backend import notice
from toymlx.data.chat import (
    TABLES,
    data_files,
    is_plain_text,
    load_examples,
    split_files_read,
    table_header,
    test_file,
    text_folder_files,
    text_folder_note,
)
from toymlx.data.text import DataError, TokenData
from toymlx.models.checks import ArgsError
from toymlx.models.llama import PRESETS, Llama, LlamaArgs
from toymlx.models.losses import lm_loss
from toymlx.training.task import (
    Task,
    TrainConfig,
    eval_batch_limit,
    model_error,
    preset_overrides,
)

DEFAULT_CORPUS = "python-docs"


@dataclass
class LlamaOptions:
    """Shape of the Llama to train: a preset, with any field overridden."""

    preset: Literal["tiny", "smollm2-135m", "smollm2-360m"] = "tiny"
    """Starting shape: tiny (4x256), or the SmolLM2-135M / 360M shapes."""
    d_model: int | None = None
    """Hidden width (default: the preset's)."""
    n_layers: int | None = None
    """Number of blocks (default: the preset's)."""
    n_heads: int | None = None
    """Query heads (default: the preset's)."""
    n_kv_heads: int | None = None
    """Key/value heads, < n_heads for GQA (default: the preset's)."""
    ffn_dim: int | None = None
    """SwiGLU width (default: the preset's)."""
    context: int | None = None
    """Context length written into checkpoints (llama.context_length, what llama.cpp, Ollama
    and LM Studio take as the model's; default: --seq-len, the window it trains on: no
    position past it is ever trained)."""
    rope_base: float | None = None
    """RoPE base (default: the preset's)."""
    tie_embeddings: bool | None = None
    """Share the embedding and output matrices (default: the preset's)."""

    def build_args(self, vocab_size: int) -> LlamaArgs:
        """The preset's LlamaArgs with the fields given, checked (`LlamaArgs.validate`; its error
        names the flags, `model_error`)."""
        args = PRESETS[self.preset](vocab_size=vocab_size, **preset_overrides(self))
        try:
            args.validate()
        except ArgsError as e:
            raise model_error(e, self) from None
        return args


@dataclass
class TextData:
    """Text to train on."""

    path: str | None = None
    """A UTF-8 text file, a .jsonl file of {"text": ...} records (a .csv or .tsv: its text
    column), a folder in mlx-lm's layout: train.jsonl, optional valid.jsonl and test.jsonl
    (--test) of such records (or .csv, .tsv files of those names), each file's texts joined by
    blank lines, or a folder of text files (.txt, .md, .text, .markdown, .rst, its subfolders'
    too) read as one text in path order, each file ended by the tokenizer's EOS; default: the
    Python documentation topics that CPython ships."""
    val_fraction: float = 0.1
    """Fraction of the tokens, taken from the end, held out for validation (not used when a
    data folder has valid.jsonl)."""
    read_as: Literal["records", "text"] | None = None
    """How a single --data.path file is read: records (the texts of its {"text": ...} records)
    or text (its characters as they are, JSON and all); default: records for a .jsonl, .json,
    .csv or .tsv file, text for any other. A data folder's files are always records. A run
    records the one it takes in config.json, so a resume reads its data as it started."""

    @staticmethod
    def reads_only(path: str, test: bool) -> tuple[str, ...] | None:
        """The names of the files read in the data folder `path` by a run of --test `test`
        (`chat.split_files_read`): what the run's record of its data (config.json's
        data_files) covers."""
        return split_files_read(path, test)


def file_reading(path: Path) -> Literal["records", "text"]:
    """How a single data file is read unless --data.read-as says: as its records where
    `load_examples` reads it so (`is_plain_text`), else as text."""
    return "text" if is_plain_text(path) else "records"


def settle_reading(cfg: Any) -> None:
    """A text recipe's `settle` (from-scratch, warm-start): give --data.read-as, where not
    given, the reading the file's name takes (`file_reading`) as a new run starts: config.json
    then records how the run reads its file, and a resume reads it so whatever the name of the
    file it is found in."""
    data = cfg.data
    if data.read_as is None and data.path is not None and not Path(data.path).is_dir():
        data.read_as = file_reading(Path(data.path))


def settle_context(cfg: Any) -> None:
    """A text recipe's (from-scratch, warm-start) new run: give --model.context, where not
    given, the run's --seq-len. Its blocks start from random init, so no RoPE position past the
    window is ever trained, and its checkpoints' llama.context_length (llama.cpp's n_ctx_train,
    the context Ollama cuts num_ctx to) says so rather than the preset's 1,024. config.json
    records the value taken, so a resume, and a run recorded before it (the preset's then),
    keeps its own."""
    if cfg.model.context is None:
        cfg.model.context = cfg.seq_len


def settle_text_run(cfg: Any) -> None:
    """A text recipe's `settle`: the reading of its file (`settle_reading`) and its model's
    context (`settle_context`), as a new run starts."""
    settle_reading(cfg)
    settle_context(cfg)


def default_corpus() -> tuple[str, str]:
    """Real human-written text present on every Python install: pydoc's topic pages."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text, "python-docs (pydoc_data.topics, the Python documentation's topic pages)"


FINE_TUNE_HINT = ("such records fine-tune a model: toymlx-train --recipe lora --base MODEL.gguf "
                  "--data.path {path}")
"""What to do with an example file of records this recipe does not train on."""


def records_text(path: Path) -> str:
    """The {"text": ...} records of one JSONL file (or .json, .csv, .tsv) joined by blank lines:
    the stream a text file of those paragraphs gives; DataError naming the first record of
    another shape, or a table's columns where it has no "text" column (`check_text_column`)."""
    check_text_column(path)
    examples = load_examples(path)
    other = next((e for e in examples if e.kind != "text"), None)
    if other is not None:
        raise DataError(f"{other.source}: expected a {{\"text\": ...}} record (this recipe trains "
                        f"on plain text), found a {other.kind} record; "
                        + FINE_TUNE_HINT.format(path=path))
    return "\n\n".join(e.text for e in examples)


def check_text_column(path: Path) -> None:
    """DataError (one line) where `path` is a .csv or .tsv file whose header has no "text"
    column, naming the columns it has: read as records, its other columns give no text to
    train on (a prompt/completion table would be refused at row 2 as a record, a table of
    other columns as a record shape this recipe never trains on)."""
    if path.suffix.lower() not in TABLES or (found := table_header(path)) is None:
        return
    row, columns = found
    if "text" in columns:
        return
    records = any(c in columns for c in ("prompt", "completion", "instruction", "output"))
    raise DataError(f'{path}: row {row} (the header): expected a column "text" (this recipe '
                    f"trains on plain text; other columns are ignored), found columns "
                    f"{', '.join(c or '(unnamed)' for c in columns)}"
                    + ("; " + FINE_TUNE_HINT.format(path=path) if records else ""))


def load_token_data(data: TextData, tokenizer, seq_len: int, test: bool = False,
                    windows: bool = True, progress: bool = True) -> TokenData:
    """The token ids of --data.path: the default corpus or a file, its records' texts or its
    text as `data.read_as` says (validation: the last val_fraction), a folder of text files as
    one text (`TokenData.from_files`; validation: as a file's), or an mlx-lm data folder
    (validation: valid.jsonl, else the last val_fraction of train.jsonl; with `test`,
    test.jsonl as the test ids). `windows`: `TokenData.from_ids`'s
    (training's check that each split holds a window; toymlx-eval checks the one it scores);
    `progress`: `TokenData.from_file`'s (--no-progress: False)."""
    if data.path is None:
        text, source = default_corpus()
        return TokenData.from_ids(tokenizer.encode(text), seq_len, data.val_fraction, source,
                                  windows)
    if not Path(data.path).is_dir():
        if (data.read_as or file_reading(Path(data.path))) == "records":  # read as a data
            # folder's train.jsonl is: their texts, never the JSON around them
            return TokenData.from_ids(tokenizer.encode(records_text(Path(data.path))), seq_len,
                                      data.val_fraction, str(data.path), windows)
        return TokenData.from_file(data.path, tokenizer, seq_len, data.val_fraction, windows,
                                   progress)
    if (texts := text_folder_files(data.path)) is not None:
        if note := text_folder_note(data.path, texts):
            notice.warn(note)
        return TokenData.from_files(data.path, texts, tokenizer, seq_len, data.val_fraction,
                                    windows, progress)
    files = data_files(data.path)
    ids = tokenizer.encode(records_text(files.train))
    if files.valid is None:
        td = TokenData.from_ids(ids, seq_len, data.val_fraction, str(files.train), windows)
    else:
        td = replace(TokenData.from_ids(ids, seq_len, 0.0, f"{files.train} + {files.valid}",
                                        windows),
                     val=np.asarray(tokenizer.encode(records_text(files.valid)), np.int32))
    if not test:
        return td
    f = test_file(data.path)
    return replace(td, test=np.asarray(tokenizer.encode(records_text(f)), np.int32),
                   test_source=str(f))


def check_reading(data: TextData) -> None:
    """ValueError unless --data.read-as fits --data.path: a single file, and records only of a
    file read as records (.jsonl, .json, .csv, .tsv)."""
    if data.read_as is None:
        return
    if data.path is None or Path(data.path).is_dir():
        found = "no --data.path (the default data)" if data.path is None else \
            f"{data.path}, a data folder (mlx-lm's files are always read as records, text " \
            "files as text)"
        raise ValueError(f"--data.read-as: expected a single --data.path file, found {found}")
    if data.read_as == "records" and file_reading(Path(data.path)) == "text":
        raise ValueError(f"--data.read-as records: expected a .jsonl, .json, .csv or .tsv "
                         f"--data.path (a file of records), found {data.path}; any other file "
                         "is read as text")


def check_test_folder(path: str | None, flag: str = "--test") -> None:
    """`flag` (--test, or toymlx-eval's --split test) scores a data folder's test.jsonl: a
    ValueError naming it unless `path` is such a folder (no test set is split off a single
    file or the default data)."""
    texts = path is not None and text_folder_files(path) is not None
    if path is not None and Path(path).is_dir() and not texts and \
            data_files(path).test is not None:
        return
    give = "give a folder with train.jsonl and test.jsonl, mlx-lm's layout"
    found = (f"no --data.path (the default data has no test split: {give})" if path is None else
             f"{path}, a single file with no test split ({give})" if Path(path).is_file() else
             f"{path}, a folder of text files, one text with no test split ({give})" if texts
             else str(path))
    raise ValueError(f"{flag}: expected --data.path to be a data folder with test.jsonl, "
                     f"found {found}")


def llama_model_info(args: LlamaArgs) -> dict[str, Any]:
    info = {"arch": args.arch, "vocab": args.vocab_size}
    info.update({k: v for k, v in asdict(args).items() if k not in ("vocab_size", "arch")})
    info["head_dim"] = args.head_dim
    return info


def check_seq_len(seq_len: int, context: int | None, whose: str = "") -> None:
    """--seq-len within 1..`context` tokens, the context named by `whose` (" (--model.context)");
    None: no bound above."""
    if seq_len < 1 or (context is not None and seq_len > context):
        want = ">= 1" if context is None else f"1..{context}"
        raise ValueError(f"--seq-len: expected {want}{whose}, found {seq_len}")


def check_text_seq_len(cfg: Any) -> None:
    """A text recipe's (from-scratch, warm-start) --seq-len, before `settle_context` makes it the
    context where --model.context is not given: then only >= 1 (checked after, the context was
    --seq-len's own value, and a --seq-len 0 was told "expected 1..0"). A resume's is its run's,
    checked as it started: another is refused as a change to the run (`Bundle.resume_run`)."""
    if cfg.resume:
        return
    context = cfg.model.context
    check_seq_len(cfg.seq_len, context, "" if context is None else " (--model.context)")


def lm_task(recipe: str, cfg: TrainConfig, seq_len: int, model: Llama, data: TokenData,
            save, load, config_info: dict[str, Any], model_info: dict[str, Any]) -> Task:
    """A Task training `model` on `data` with next-token cross-entropy."""
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size: expected >= 1, found {cfg.batch_size}")
    limit = eval_batch_limit(cfg.eval_batches)  # None: every window
    val = data.val_batches(cfg.batch_size, seq_len, limit if limit is None else max(limit, 1))
    test = {"test_source": data.test_source, "test_tokens": int(data.test.size)} \
        if data.test is not None else {}
    return Task(
        recipe=recipe, model=model, loss_fn=lm_loss,
        train_batch=lambda s: data.batch(s, cfg.seed, cfg.batch_size, seq_len, cfg.grad_accum),
        val_batches=val, save=save, load=load, model_info=model_info,
        config_info={"context": seq_len, "seq_len": seq_len, "data_source": data.source,
                     "train_tokens": int(data.train.size), "val_tokens": int(data.val.size),
                     **test, **config_info},
        unit="tokens", count=lambda b: int(np.sum(b["mask"])),
        test_batches=data.test_batches(cfg.batch_size, seq_len))
