"""An Ollama Modelfile for a LoRA run, so `ollama create NAME -f DIR/Modelfile` serves the base
GGUF with the run's adapter (the llama.cpp LoRA GGUF a lora run writes as its checkpoints), or
the fused model (`fuse=True`: `DIR/fused-TYPE.gguf`, the base's own type by default, written by
`toymlx.interop.merge.write_merged`).

The file holds `FROM` (the base GGUF, absolute), `ADAPTER` (the adapter GGUF, absolute) or
instead `FROM` the fused GGUF, and
when the base came from Ollama's store its `TEMPLATE`, `SYSTEM` and `PARAMETER` layers;
otherwise no TEMPLATE, so Ollama derives one from the GGUF's `tokenizer.chat_template`, or,
where the GGUF has none (a from-scratch base), passes the prompt as it is (`{{ .Prompt }}`).
`PARAMETER stop` lists the tokenizer's end-of-generation tokens. Values are quoted the way
Ollama's own `ollama show --modelfile` quotes them, and read back (`parse_modelfile`) by the
rules of Ollama's parser (parser/parser.go), which the writer checks each value against: a
\"\"\" inside a TEMPLATE or SYSTEM is held unless a line but the last ends in it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.backend.files import not_a_file
from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.bundle.model_store import (
    Resolved,
    check_digests,
    hf_name_hint,
    is_store_name,
    resolve,
)
from toymlx.bundle.outputs import check_output
from toymlx.data.tokenizer import Tokenizer
from toymlx.data.vocab import K_TEMPLATE
from toymlx.gguf.quantize import export_type
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.runner.bundle import run_base

MODELFILE = "Modelfile"


def quote(value: str, triple: bool = False) -> str:
    """A Modelfile value as Ollama's parser reads it back: bare, in "..." or, where it holds a
    quote (or `triple`), in \"\"\"...\"\"\" (Ollama's `quote`, plus a leading quote or a
    carriage return); ValueError naming what Ollama's parser cannot hold (`_held`)."""
    text = value
    if (triple or value != value.strip() or value.startswith('"')
            or any(c in value for c in "\r\n")):
        q = '"""' if triple or '"' in value else '"'
        text = f"{q}{value}{q}"
    _held(value, text)
    return text


def _held(value: str, text: str) -> None:
    """ValueError unless Ollama's parser reads `text` back as `value`: a \"\"\" value ends at
    the first line break after which its text so far, trailing spaces aside, ends in
    \"\"\"; characters other than printable ones, spaces, tabs and line breaks are dropped."""
    _, got = _value(text, 0)
    if got == value:
        return
    head = f"Modelfile value {value[:40]!r}{'...' if len(value) > 40 else ''}"
    bad = next((c for c in value if not (c.isprintable() or c in _KEPT)), None)
    if bad is not None:
        raise ValueError(f"{head}: expected printable characters (Ollama's parser drops the "
                         f"others), found {bad!r}")
    lines = re.split(r"[\r\n]", value)
    k = next((k for k, line in enumerate(lines[:-1]) if line.rstrip(" \t").endswith('"""')), None)
    if k is not None:
        raise ValueError(f'{head}: expected no line but the last ending in \'"""\' (Ollama\'s '
                         f"parser ends the value there), found line {k + 1} "
                         f"{lines[k][-40:]!r}")
    raise ValueError(f"{head}: expected a value Ollama's parser reads back unchanged, found it "
                     f"read as {got[:40]!r}")


_KEPT = " \t\r\n"
"""The characters other than printable ones that Ollama's parser keeps in a value."""


def _unquote(text: str) -> str | None:
    """A value's text unquoted as Ollama's parser does, or None while a quote is still open."""
    for q in ('"""', '"'):
        if text.startswith(q):
            return text[len(q):-len(q)] if len(text) >= 2 * len(q) and text.endswith(q) else None
    return text


def _value(text: str, i: int) -> tuple[int, str | None]:
    """(where the value starting at `text[i]` ends, the value, or None where a quote is still
    open at the end) by Ollama's rules: the value ends at the first line break (a carriage
    return or a newline) where the text read so far, spaces trimmed, is complete (bare, or its
    quotes closed); characters other than printable ones, spaces, tabs and line breaks are
    dropped (Go's strconv.IsPrint, as Python's str.isprintable)."""
    kept: list[str] = []
    while i < len(text):
        c = text[i]
        i += 1
        if c in "\r\n":
            value = _unquote("".join(kept).strip(_KEPT))
            if value is not None:
                return i, value
        if c in _KEPT or c.isprintable():
            kept.append(c)
    return i, _unquote("".join(kept).strip(_KEPT))


def lora_run_base(adapter: str | os.PathLike, adapter_file: Path) -> str | None:
    """The base a LoRA adapter was trained on: its run's `--base`, else the adapter's
    `toy.base` where that is a store name or an existing file."""
    for path in (adapter, adapter_file):
        found = run_base(path, "--adapter")
        if found is not None:
            return found[0]
    with GGUFFile(adapter_file) as g:
        base = g.metadata.get("toy.base")
    if isinstance(base, str) and (is_store_name(base) or Path(base).is_file()):
        return base
    return None


def check_adapter(adapter_file: Path, base: Path, fuse: bool = False) -> dict[str, Any]:
    """The adapter's metadata, after checking that it is a llama.cpp LoRA for `base` (with
    `fuse`, toymlx's DoRA too: it is fused, never handed to Ollama): the same architecture and,
    for every adapted weight, the base's (out, in) shape, and finite values (the adapter's
    matrices are read; the base's weights are not)."""
    kinds = ("lora", "dora") if fuse else ("lora",)
    with GGUFFile(adapter_file) as ad, GGUFFile(base) as g:
        meta = dict(ad.metadata)
        if meta.get("general.type") != "adapter" or meta.get("adapter.type") not in kinds:
            want = "'lora' or 'dora' (a LoRA or DoRA adapter GGUF)" if fuse else (
                "'lora' (a LoRA adapter GGUF; a DoRA adapter only with --fuse)")
            raise GGUFError(f"{adapter_file}: metadata keys 'general.type'/'adapter.type': "
                            f"expected 'adapter'/{want}, found "
                            f"{meta.get('general.type')!r}/{meta.get('adapter.type')!r}")
        arch, base_arch = meta.get("general.architecture"), g.metadata.get(
            "general.architecture")
        if arch != base_arch:
            raise GGUFError(f"{adapter_file}: metadata key 'general.architecture': expected "
                            f"{base_arch!r} (the base {base}'s), found {arch!r}")
        for name, info in ad.tensors.items():
            weight, _, half = name.rpartition(".")
            if half not in ("lora_a", "lora_b"):
                continue
            if weight not in g.tensors:
                raise GGUFError(f"{adapter_file}: tensor {name!r}: expected a base weight "
                                f"{weight!r} in {base}, found none (another base model?)")
            # a matrix (out, in) and its (r, in), (out, r) pair; experts' 3-D (E, out, in) and
            # a pair per expert, (E, r, in) and (E, out, r), as llama.cpp's loader takes them
            *lead, out_dim, in_dim = g.tensors[weight].shape
            *got_lead, rows, cols = info.shape
            want = in_dim if half == "lora_a" else out_dim
            got = cols if half == "lora_a" else rows
            if got != want or got_lead != lead:
                experts = f"{lead[0]} experts of " if lead else ""
                raise GGUFError(f"{adapter_file}: tensor {name!r} shape: expected {want} "
                                f"{'columns' if half == 'lora_a' else 'rows'}"
                                f"{f' for each of {lead[0]} experts' if lead else ''} (the base "
                                f"{weight} is {experts}{out_dim} x {in_dim}), found {info.shape}")
            ad.load(name)  # GGUFError on a NaN or Inf: Ollama would serve it as it is
    return meta


def stop_tokens(base: Path) -> list[str]:
    """The texts of the base tokenizer's end-of-generation tokens (eos, <|im_end|>, ...)."""
    with GGUFFile(base) as g:
        if "tokenizer.ggml.tokens" not in g.metadata:
            return []
        tok = Tokenizer.from_metadata(g.metadata, source=base)
    return [tok.token_text(i) for i in sorted(tok.eog_ids)]


def has_chat_template(base: Path) -> bool:
    """Whether the GGUF carries a `tokenizer.chat_template` (Ollama derives its TEMPLATE
    from it)."""
    with GGUFFile(base) as g:
        return bool(g.metadata.get(K_TEMPLATE))


def modelfile_text(base: Resolved, adapter_file: Path, stops: list[str],
                   fused: Path | None = None, chat_template: bool = True) -> str:
    """The Modelfile for `base` + `adapter_file` (absolute paths), or FROM `fused` (the two
    fused into one GGUF); `chat_template`: whether the base GGUF has one (`has_chat_template`),
    which the comment standing for a missing TEMPLATE says."""
    lines = ["# Written by toymlx-export; create the model with: ollama create NAME -f Modelfile",
             f"# base: {base.spec}" + (f" ({base.digest})" if base.digest else "")]
    if fused is None:
        lines += [f"FROM {quote(str(base.path.absolute()))}",
                  f"ADAPTER {quote(str(adapter_file.absolute()))}"]
    else:
        lines += [f"# fused with the adapter {adapter_file.absolute()}",
                  f"FROM {quote(str(fused.absolute()))}"]
    template = base.layer_text("template")
    if template is not None:
        lines.append(f"TEMPLATE {quote(template, triple=True)}")
    elif chat_template:
        lines.append("# No TEMPLATE: Ollama uses the GGUF's tokenizer.chat_template")
    else:
        lines.append("# No TEMPLATE: the GGUF has no tokenizer.chat_template, so Ollama passes "
                     "the prompt as it is")
    system = base.layer_text("system")
    if system:
        lines.append(f"SYSTEM {quote(system)}")
    params: dict[str, Any] = {}
    text = base.layer_text("params")
    if text:
        try:
            params = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{base.spec}: {base.layers['params']}: expected the JSON of its "
                             f"params layer, found {e}") from None
    stop = list(params.pop("stop", []) if isinstance(params.get("stop", []), list) else [])
    stop += [s for s in stops if s not in stop]
    for s in stop:
        lines.append(f"PARAMETER stop {quote(s)}")
    for key, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            v = json.dumps(v) if isinstance(v, bool) else str(v)
            lines.append(f"PARAMETER {key} {quote(v)}")
    return "\n".join(lines) + "\n"


def write_modelfile(out_dir: str | os.PathLike, adapter: str | os.PathLike,
                    base: str | None = None, fuse: bool = False, dtype: str | None = None,
                    progress: bool = False, overwrite: bool = False
                    ) -> tuple[Path, Resolved, Path, Path | None]:
    """Write `out_dir/Modelfile` for a LoRA run or adapter GGUF; (its path, the base, the
    adapter file, the fused GGUF or None). `base` defaults to the run's `--base`; with `fuse`,
    `out_dir/fused-TYPE.gguf` (`write_merged`: type `dtype`, default the file that keeps the
    fine-tune, named after the base's own type) is written first, and removed again if the
    Modelfile then fails (nothing of a failed export stays in `out_dir`). Either file there
    already is refused unless `overwrite` (toymlx-export --overwrite)."""
    adapter_file = checkpoint_file(adapter, "--adapter").resolve()
    base = base or lora_run_base(adapter, adapter_file)
    if not base:
        raise ValueError(f"--base: expected the GGUF {adapter_file} was trained on (not "
                         "recorded by its run), found none; pass --base")
    # an Ollama blob's SHA-256 (a read of the whole base) after the cheap refusals below
    src = resolve(base, "--base", check_digest=False)
    if not src.path.is_file():
        raise FileNotFoundError(f"{base}: --base: expected an existing GGUF file, found "
                                f"{not_a_file(src.path)}{hf_name_hint(base)}")
    check_adapter(adapter_file, src.path, fuse)
    inputs = [("--adapter", adapter), ("--adapter", adapter_file), ("--base", src.path)]
    check_output(out_dir, inputs, folder=True)
    path = check_output(Path(out_dir) / MODELFILE, inputs, overwrite=overwrite)
    fused_out = None
    if fuse:  # both files checked before the work
        with GGUFFile(src.path) as g:
            name = dtype or export_type(g)
        fused_out = check_output(Path(out_dir) / f"fused-{name}.gguf", inputs,
                                 overwrite=overwrite)
    check_digests(src, "--base")
    fused = None
    with atomic.output_folder(out_dir):  # a failed write leaves no empty folder it made
        try:
            if fused_out is not None:
                from toymlx.interop.merge import write_merged  # MLX only when a model is fused

                fused = write_merged(fused_out, src.path, adapter_file, dtype, progress)
            text = modelfile_text(src, adapter_file, stop_tokens(src.path), fused,
                                  has_chat_template(src.path))
            atomic.write_text(path, text)
        except BaseException:
            # all or nothing: a Modelfile that cannot be written (a full disk) takes the fused
            # GGUF written for it along, so --out holds nothing of this export
            if fused is not None:
                atomic.discard(fused)
            raise
    return path, src, adapter_file, fused


_COMMAND = re.compile(r"([A-Za-z]+)[ \t]")
"""A Modelfile command (FROM, TEMPLATE, ...) and the space after it."""
_NAME = re.compile(r"([A-Za-z0-9_]+)[ \t]")
"""A PARAMETER's or MESSAGE's name and the space after it."""


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(command, value) pairs of a Modelfile, values unquoted as Ollama's parser reads them
    (`_value`); PARAMETER and MESSAGE lines give ('PARAMETER name', value). Command names are
    not checked against Ollama's list."""
    out: list[tuple[str, str]] = []
    text = text.removeprefix("\ufeff")
    i = 0
    while i < len(text):
        c = text[i]
        if c in _KEPT:
            i += 1
            continue
        if c == "#":  # a comment runs to the line break
            i = min((j for j in (text.find("\n", i), text.find("\r", i)) if j >= 0),
                    default=len(text))
            continue
        m = _COMMAND.match(text, i)
        if not m:
            line = text[i:].splitlines()[0] if text[i:] else ""
            raise ValueError(f"Modelfile line {text.count(chr(10), 0, i) + 1}: expected a "
                             f"command and a space (FROM x), found {line[:40]!r}")
        cmd, i = m[1].upper(), m.end()
        if cmd in ("PARAMETER", "MESSAGE"):
            m = _NAME.match(text, i)
            if not m:
                raise ValueError(f"Modelfile {cmd}: expected a name and a space, found "
                                 f"{text[i:i + 40]!r}")
            cmd, i = f"{cmd} {m[1]}", m.end()
        i, value = _value(text, i)
        if value is None:
            raise ValueError(f"Modelfile {cmd}: expected its quote closed, found the end")
        out.append((cmd, value))
    return out
