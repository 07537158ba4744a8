"""An Ollama Modelfile for a LoRA run, so `ollama create NAME -f DIR/Modelfile` serves the base
GGUF with the run's adapter (the llama.cpp LoRA GGUF a lora run writes as its checkpoints), or
the fused model (`fuse=True`: `DIR/fused-TYPE.gguf`, the base's own type by default, written by
`toymlx.interop.merge.write_merged`).

The file holds `FROM` (the base GGUF, absolute), `ADAPTER` (the adapter GGUF, absolute) or
instead `FROM` the fused GGUF, and
when the base came from Ollama's store its `TEMPLATE`, `SYSTEM` and `PARAMETER` layers;
otherwise no TEMPLATE, so Ollama derives one from the GGUF's `tokenizer.chat_template`.
`PARAMETER stop` lists the tokenizer's end-of-generation tokens. Values are quoted the way
Ollama's own `ollama show --modelfile` quotes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.backend.files import special_kind
from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.bundle.model_store import Resolved, is_store_name, resolve
from toymlx.bundle.outputs import check_output
from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.quantize import export_type
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.runner.bundle import run_base

MODELFILE = "Modelfile"


def quote(value: str) -> str:
    """A Modelfile value as Ollama's parser reads it back (its `quote`, plus refusing what it
    cannot hold)."""
    if '"""' in value:
        raise ValueError(f'Modelfile value {value[:40]!r}...: expected no \'"""\' (Ollama\'s '
                         "parser cannot hold it), found one")
    if "\n" in value or value != value.strip():
        return f'"""{value}"""' if '"' in value else f'"{value}"'
    return value


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
            out_dim, in_dim = g.tensors[weight].shape
            want = in_dim if half == "lora_a" else out_dim
            got = info.shape[1] if half == "lora_a" else info.shape[0]
            if got != want:
                raise GGUFError(f"{adapter_file}: tensor {name!r} shape: expected {want} "
                                f"{'columns' if half == 'lora_a' else 'rows'} (the base "
                                f"{weight} is {out_dim} x {in_dim}), found {info.shape}")
            ad.load(name)  # GGUFError on a NaN or Inf: Ollama would serve it as it is
    return meta


def stop_tokens(base: Path) -> list[str]:
    """The texts of the base tokenizer's end-of-generation tokens (eos, <|im_end|>, ...)."""
    with GGUFFile(base) as g:
        if "tokenizer.ggml.tokens" not in g.metadata:
            return []
        tok = Tokenizer.from_metadata(g.metadata, source=base)
    return [tok.token_text(i) for i in sorted(tok.eog_ids)]


def modelfile_text(base: Resolved, adapter_file: Path, stops: list[str],
                   fused: Path | None = None) -> str:
    """The Modelfile for `base` + `adapter_file` (absolute paths), or FROM `fused` (the two
    fused into one GGUF)."""
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
        lines.append(f'TEMPLATE """{template}"""' if '"""' not in template else
                     f"TEMPLATE {quote(template)}")
    else:
        lines.append("# No TEMPLATE: Ollama uses the GGUF's tokenizer.chat_template")
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
                    progress: bool = False) -> tuple[Path, Resolved, Path, Path | None]:
    """Write `out_dir/Modelfile` for a LoRA run or adapter GGUF; (its path, the base, the
    adapter file, the fused GGUF or None). `base` defaults to the run's `--base`; with `fuse`,
    `out_dir/fused-TYPE.gguf` (`write_merged`: type `dtype`, default the file that keeps the
    fine-tune, named after the base's own type) is written first."""
    adapter_file = checkpoint_file(adapter, "--adapter").resolve()
    base = base or lora_run_base(adapter, adapter_file)
    if not base:
        raise ValueError(f"--base: expected the GGUF {adapter_file} was trained on (not "
                         "recorded by its run), found none; pass --base")
    src = resolve(base, "--base")
    if not src.path.is_file():
        raise FileNotFoundError(f"{base}: --base: expected an existing GGUF file, found "
                                f"{'a directory' if src.path.is_dir() else special_kind(src.path) or 'nothing'}")
    check_adapter(adapter_file, src.path, fuse)
    inputs = [("--adapter", adapter), ("--adapter", adapter_file), ("--base", src.path)]
    check_output(out_dir, inputs, folder=True)
    path = check_output(Path(out_dir) / MODELFILE, inputs)
    fused = None
    if fuse:
        from toymlx.interop.merge import write_merged  # MLX only when a model is fused

        with GGUFFile(src.path) as g:
            name = dtype or export_type(g)
        fused = write_merged(check_output(Path(out_dir) / f"fused-{name}.gguf", inputs),
                             src.path, adapter_file, dtype, progress)
    text = modelfile_text(src, adapter_file, stop_tokens(src.path), fused)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)
    return path, src, adapter_file, fused


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(command, value) pairs of a Modelfile, values unquoted; PARAMETER lines give
    ('PARAMETER name', value). Enough of Ollama's grammar to read back what toymlx writes."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].lstrip()
        i += 1
        if not line or line.startswith("#"):
            continue
        cmd, _, rest = line.partition(" ")
        cmd = cmd.upper()
        if cmd == "PARAMETER":
            key, _, rest = rest.strip().partition(" ")
            cmd = f"PARAMETER {key}"
        rest = rest.lstrip()
        for q in ('"""', '"'):
            if rest.startswith(q):
                rest = rest.rstrip() if rest.rstrip().endswith(q) else rest
                while not (len(rest) >= 2 * len(q) and rest.endswith(q)) and i < len(lines):
                    rest += "\n" + lines[i]
                    i += 1
                if not rest.endswith(q) or len(rest) < 2 * len(q):
                    raise ValueError(f"Modelfile {cmd}: expected a closing {q}, found the end")
                rest = rest[len(q): -len(q)]
                break
        else:
            rest = rest.rstrip()
        out.append((cmd, rest))
    return out
