"""`-c/--config FILE`: a command's options from a YAML or JSON file, command-line flags on top.

Keys are spelled as the flags are (`batch_size` or `batch-size` for `--batch-size`; nested
`lora: {rank: 8}` or dotted `lora.rank: 8` for `--lora.rank`). The file's values, each checked
against the option's type, become the defaults tyro parses the command line over (tyro's own
support for defaults), so any flag given overrides the file. A run bundle's `config.json`
(`{"recipe": ..., "config": {...}}`) is such a file too: `toymlx-train -c runs/<id>/config.json`
starts a new run with that run's settings, less the options that only name or steer that run
(`RUN_NAMING`). `toymlx-sweep -c FILE` reads one file as the whole sweep (`sweep_config`): its
own options, its grid, and the options every run takes as toymlx-train -c takes them. Bad input
is one line naming the file and the key; an unknown key names the closest flag (and the toymlx
flag for an mlx-lm key). Nothing is read quietly as something else: a key given twice in one
mapping (`_Loader`, `_json_pairs`) or under two spellings (`_flatten`, `_once`) names both;
plain YAML scalars follow YAML 1.2's core schema (`_Loader`); values JSON cannot hold are
refused by name (`plain_json`); a run's config.json beside other options is refused
(`is_run_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from toymlx.backend.files import json_fault, special_kind
from toymlx.runner.api import caller_text

CONFIG_FLAGS = ("-c", "--config")
CONFIG_HELP = ("-c/--config FILE: options from a YAML or JSON file, keys spelled as the flags "
               "(lora.rank or lora: {rank: ...}); flags given override the file.")
RUN_NAMING = frozenset({"run_id", "resume", "from_step", "overwrite", "stop_at"})
"""Options of a run's config.json that a new run started from it does not take over: they
name that run's bundle or steer that one process."""

MLX_LM_KEYS = {
    "model": "--base", "data": "--data.path", "fine_tune_type": "--fine-tune-type",
    "iters": "--steps", "learning_rate": "--lr",
    "num_layers": "--lora.layers (--full.layers for a full fine-tune)",
    "lora_parameters": "--lora.rank, --lora.alpha (scale x rank), --lora.dropout and "
                       "--lora.targets (for keys)",
    # a sweep's grid names them so (`--grid lora_parameters.scale=10,20`)
    "lora_parameters.rank": "--lora.rank (--grid lora.rank keeps the file's scale: alpha = "
                            "scale x rank)",
    "lora_parameters.scale": "--lora.alpha at scale x rank (rank 8, scale 20: --lora.alpha 160)",
    "lora_parameters.dropout": "--lora.dropout",
    "lora_parameters.keys": "--lora.targets (self_attn.q_proj: q)",
    # --seq-len counts a row's targets, max_seq_length its tokens (`mlx_lm_options`)
    "max_seq_length": "--seq-len at max_seq_length - 1 (it counts a row's targets, mlx-lm its "
                      "tokens)",
    "grad_accumulation_steps": "--grad-accum",
    "steps_per_eval": "--eval-every", "val_batches": "--eval-batches",
    "save_every": "--checkpoint-every", "resume_adapter_file": "--lora.init-adapter",
    "adapter_path": "--runs-root and --run-id (the run folder holds the adapters)",
    "mask_prompt": "--data.mask-prompt (with --data.train-turns last, as mlx-lm)",
    "train": "toymlx-train always trains; drop it",
    "steps_per_report": "--report-every",
    # not an option: toymlx-train's --test has no cap (a text starting `--` reads as one)
    "test_batches": "toymlx scores all of test.jsonl, every batch (--test; its first N "
                    "examples: toymlx-eval --model RUN --split test --limit N); drop it",
    "project_name": "--wandb-project (with --report-to wandb, the only service mlx-lm reads it "
                    "for)",
    "clear_cache_threshold": "toymlx manages MLX's cache itself; drop it",
    "trust_remote_code": "toymlx runs no code from a model's repository (a GGUF holds none); "
                         "drop it",
    "optimizer": "--optimizer (the lora recipe)",
    **{f"{part}_feature": f"--data.keys {key}=NAME (a row's NAME read as its {key})"
       for part, key in (("prompt", "prompt"), ("completion", "completion"), ("text", "text"),
                         ("chat", "messages"))},
}
"""mlx_lm.lora's config keys -> toymlx-train's flags (a text not starting with `--`: what to do
instead, there being none), named when such a key is unknown here."""
MLX_LM_COMMAND_KEYS = {
    "toymlx-export": {  # mlx_lm.fuse's
        "adapter_path": "--adapter (the run folder; mlx-lm's adapter folder with --base)",
        "save_path": "--out", "gguf_path": "--out (with --fuse, the fused GGUF)",
        "export_gguf": "toymlx-export writes a GGUF (--fuse: the fused model); drop it",
        # mlx_lm.fuse --dequantize writes every weight unquantized (F16 in its --export-gguf)
        "dequantize": "--dtype f16 (every weight matrix written at F16; f32 for F32)",
        "upload_repo": "toymlx-export writes local files only; upload them with hf upload "
                       "REPO FILE"},
    "toymlx-generate": {  # mlx_lm.generate's
        "adapter_path": "--model (the run folder: its base with its adapter; --adapter RUN "
                        "over another --model)",
        # mlx-lm's rotating cache keeps the newest max_kv_size tokens; toymlx's context shift
        # keeps the newer half of the window, its size not set by a flag
        "max_kv_size": "toymlx-generate's cache holds the model's whole window; where the text "
                       "reaches it, --context-shift (the default) drops the older half and goes "
                       "on, --no-context-shift stops; drop it",
        "extra_eos_token": "toymlx-generate stops at the GGUF's end-of-generation tokens (eos "
                           "and end-of-turn, as llama.cpp) or at --max-tokens, no other token "
                           "or text; drop it and cut the printed text where you want",
        "draft_model": "toymlx-generate has no speculative decoding (the one --model predicts "
                       "every token); drop it",
        "num_draft_tokens": "toymlx-generate has no speculative decoding (no --draft-model); "
                            "drop it",
        "verbose": "toymlx-generate always prints its model and speed lines on stderr, the "
                   "text alone on stdout; drop it",
        # the rest of mlx_lm.generate's flags (mlx-lm 0.32); before, no hint, or a misleading
        # closest spelling (--chat-template-config: "did you mean --ignore-chat-template?")
        "prefill_response": "toymlx-generate starts the reply itself; to start it with your "
                            "text, give the rendered conversation ending with it as --prompt "
                            "with --ignore-chat-template; drop it",
        "use_default_chat_template": "toymlx-generate renders the GGUF's own chat template "
                                     "(tokenizer.chat_template) and has no default one: a GGUF "
                                     "without a template continues --prompt as raw text; drop it",
        "chat_template_config": "toymlx-generate renders the chat template with no extra "
                                "arguments (no enable_thinking); drop it",
        **{k: "toymlx-generate has no XTC sampling (its samplers: --temp, --top-p, --top-k, "
              "--min-p, --repetition-penalty); drop it"
           for k in ("xtc_probability", "xtc_threshold")},
        "min_tokens_to_keep": "toymlx-generate's --min-p always keeps the most likely token "
                              "(mlx-lm's default, 1); drop it",
        "image": "toymlx-generate reads text models alone (no image input); drop it",
        "prompt_cache_file": "toymlx-generate computes the prompt anew each call (no saved "
                             "cache; --num-samples draws several texts from one prompt); drop it",
        **{k: "toymlx-generate's KV cache is not quantized; drop it"
           for k in ("kv_bits", "kv_group_size", "quantized_kv_start")},
        "prefill_step_size": "toymlx-generate puts the prompt through 2048 tokens at a time "
                             "(mlx-lm's default), not set by a flag; drop it",
        "quantize_activations": "toymlx-generate computes activations unquantized; drop it",
        # mlx_lm.chat's (toymlx-generate --chat stands in for it)
        "pipeline": "toymlx-generate runs the model in one process (no pipeline across "
                    "machines); drop it"},
    "toymlx-eval": {  # mlx_lm.lora --test's
        "adapter_path": "--model (the run folder: its base with its adapter)",
        "data": "--data.path", "test": "--split test",
        "max_seq_length": "--seq-len at max_seq_length - 1 (it counts a row's targets, mlx-lm "
                          "its tokens)",
        "test_batches": "--limit (examples: mlx-lm's batches x --batch-size; its -1, every "
                        "batch, is the default)",
        # toymlx-eval's own (before: "is toymlx-train's --data.mask-prompt", as if eval had none)
        "mask_prompt": "--data.mask-prompt (the last message alone scored, as mlx-lm's)",
        "val_batches": "--eval-batches (a run's own validation split; -1: every row)"},
}
"""mlx-lm's flags and keys whose toymlx counterpart depends on the command: the mlx-lm command
it stands in for takes them with another meaning than mlx_lm.lora's (`adapter_path` is the
adapters to read, not the folder training writes), or toymlx-train's flag is the command's own
too (toymlx-eval's --data.path). Others are named as toymlx-train's (`MLX_LM_KEYS`)."""


def mlx_lm_hint(key: str, prog: str, in_file: bool = False) -> str | None:
    """What `prog` (toymlx-export, or toymlx-train --recipe lora) takes for mlx-lm's `key`
    (`iters`, or its flag `--iters`): the command's own counterpart (`MLX_LM_COMMAND_KEYS`),
    else toymlx-train's; None for a key mlx-lm does not have. `in_file`: `key` is a config
    file's, whose hint names the file's keys (`file_words`), not the caller's."""
    name = _norm(key)
    command = prog.split()[0]
    own = MLX_LM_COMMAND_KEYS.get(command, {})
    text = own.get(name) or MLX_LM_KEYS.get(name)
    if text is None:
        return None
    whose = ("toymlx" if command == "toymlx-train" else command if name in own
             else "toymlx-train")
    # toymlx's side in the caller's words: a `toymlx.train` call's keywords, as its relay
    # leaves this clause, another tool's, unchanged (`caller_text`)
    said = caller_text(text, prog.rpartition(" ")[2]) if whose == "toymlx" and not in_file \
        else text
    if not text.startswith("--"):  # no option of this command (`--trust-remote-code`)
        return f"mlx-lm's {key} has no {'toymlx' if whose == 'toymlx' else command} option: {said}"
    return f"mlx-lm's {key} is {whose}'s {said}"


class ConfigFileError(ValueError):
    """A config file that cannot be used; one line naming the file and the key."""


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the -c/--config FILE, the other arguments); ConfigFileError for a -c without a file or
    given twice."""
    path, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # what follows is another command's (toymlx-launch, toymlx-sweep)
            rest += argv[i:]
            break
        value = None
        if a in CONFIG_FLAGS:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ConfigFileError(f"{a}: expected a YAML or JSON file after it, found "
                                      f"{'nothing' if i + 1 >= len(argv) else argv[i + 1]}")
            value, i = argv[i + 1], i + 2
        elif a.startswith("--config="):
            value, i = a.partition("=")[2], i + 1
        else:
            rest.append(a)
            i += 1
            continue
        if path is not None:
            raise ConfigFileError(f"-c/--config: expected one config file, found {path} and "
                                  f"{value}")
        path = value
    return path, rest


class DuplicateKey(yaml.YAMLError):
    """A mapping in a YAML file that gives one key twice."""

    def __init__(self, key: str, first: int, second: int):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading plain scalars by YAML 1.2's core schema, as JSON and mlx-lm
    read numbers: `1e-5` is a number, while YAML 1.1's other forms stay strings (`1:0`, `010`,
    `1_000`, `yes`, `on`), so an option that wants a number or true/false refuses them with what
    was found instead of reading 60, 8, 1000 or true. Dates and timestamps are still recognised,
    to be refused by name (`plain_json`) rather than taken as text the user may not have meant.
    A key given twice in one mapping is a `DuplicateKey`."""

    yaml_implicit_resolvers: typing.ClassVar[dict] = {}  # its own, not SafeLoader's

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges keys that the mapping's own may override
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(str(key), seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        try:
            return int(text, 0)  # decimal, 0o17, 0x1F (YAML 1.2); no 1.1 octal or sexagesimal
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"{text!r}, which is not a YAML 1.2 integer",
                node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
for _tag, _pattern, _first in [
        ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
        ("tag:yaml.org,2002:int", r"^(?:[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+)$",
         list("-+0123456789")),
        ("tag:yaml.org,2002:float",
         (r"^(?:[-+]?(?:(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
          r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789.")),
        ("tag:yaml.org,2002:timestamp",
         (r"^(?:[0-9]{4}-[0-9]{2}-[0-9]{2}|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt]|[ \t]+)"
          r"[0-9]{1,2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]*)?"
          r"(?:[ \t]*(?:Z|[-+][0-9]{1,2}(?::[0-9]{2})?))?)$"), list("0123456789")),
        ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"])]:
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), _first)


_JSON_KINDS = {dict: "a mapping", list: "a list", str: "a string", bool: "true or false",
               type(None): "null", int: "a number", float: "a number"}
_YAML_KINDS = {"date": "a date", "datetime": "a timestamp", "bytes": "binary data (!!binary)",
               "set": "a set (!!set)", "tuple": "pairs (!!omap or !!pairs)"}


def plain_json(value: Any, source: str, key: str = "") -> None:
    """ConfigFileError naming the key unless `value` holds only what JSON holds (mappings with
    string keys, lists, strings, numbers, true/false, null): every option, config.json and
    run-options.json are JSON."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigFileError(f"{source}: key {f'{key}.' if key else ''}{k!r}: expected "
                                      f"a string key, found {_plain_kind(k)} ({k!r}); quote it")
            plain_json(v, source, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            plain_json(v, source, f"{key}[{i}]")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": no UTF-8 file or name can hold it
            raise ConfigFileError(f"{source}: key {key!r}: expected UTF-8 text, found a lone "
                                  f"surrogate U+{ord(value[e.start]):04X} at character "
                                  f"{e.start}") from None
    elif type(value) not in _JSON_KINDS:
        text = str(value) if not isinstance(value, (bytes, set, tuple)) else repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise ConfigFileError(f"{source}: key {key!r}: expected a JSON value (a string, number, "
                              f"true/false, null, list or mapping), found {_plain_kind(value)}: "
                              f"{text}" + ("; quote it for a string" if type(value).__name__
                                             in ("date", "datetime") else ""))


def _plain_kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value)) or _YAML_KINDS.get(type(value).__name__,
                                                           type(value).__name__)


def _json_pairs(source: str):
    """json.loads' object_pairs_hook refusing a key given twice in one object."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ConfigFileError(f"{source}: key {k!r}: expected once in its object, found "
                                      "twice; keep one")
            out[k] = v
        return out
    return pairs


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} (not a JSON number)")


def read_config_file(path: str) -> dict[str, Any]:
    """The file as a mapping: JSON for `.json`, else YAML (`_Loader`: YAML 1.2's numbers); one
    line for a file that is not a regular UTF-8 file, a key given twice in one mapping, or a
    value JSON cannot hold (`plain_json`)."""
    p = Path(path)
    if p.is_dir() or (kind := special_kind(p)):
        # a run folder's options are its config.json (`-c runs/x` for the run's settings)
        run = (f"a run folder; its options are -c {p / 'config.json'}"
               if (p / "config.json").is_file() else None)
        raise ConfigFileError(f"{p}: -c/--config: expected a YAML or JSON file, found "
                              f"{run or ('a directory' if p.is_dir() else kind)}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        what = getattr(e, "strerror", None) or e
        if isinstance(e, UnicodeDecodeError) and e.object[:4] == b"GGUF":  # `-c model.gguf`
            what = "a GGUF model file (a model is --base, --donor or --model)"
        elif path.isdigit() and not p.exists():  # llama.cpp's `-c 4096`
            what = (f"{what} (llama.cpp's -c is its context size; here -c names a config file: "
                    "--seq-len sets a row's tokens, and generation reads the model's context)")
        raise ConfigFileError(f"{p}: -c/--config: expected a readable UTF-8 YAML or JSON file, "
                              f"found {what}") from None
    if p.suffix.lower() == ".py":  # as YAML, `block_size = 256` lines read as one string
        raise ConfigFileError(f"{p}: -c/--config: expected a YAML or JSON file, found a Python "
                              "file (nanoGPT's config/*.py are not run); write its settings as "
                              "YAML, one `option: value` a line (block_size = 256: seq_len: 256)")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_json_pairs(str(p)),
                              parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"{p}: expected JSON, found {json_fault(e)}") from None
        except ConfigFileError:
            raise
        except ValueError as e:  # NaN, Infinity
            raise ConfigFileError(f"{p}: expected JSON, found {e}") from None
        except RecursionError:
            raise ConfigFileError(f"{p}: expected JSON, found objects or arrays nested too "
                                  "deeply") from None
    else:
        try:
            data = yaml.load(text, Loader=_Loader)
        except DuplicateKey as e:
            raise ConfigFileError(f"{p}: key {e.key!r}: expected once in its mapping, found it "
                                  f"twice (lines {e.first} and {e.second}); keep one") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
            problem = str(getattr(e, "problem", None) or e)
            problem = problem.removeprefix("found ")  # "found character '\t' that ..."
            raise ConfigFileError(f"{p}: expected YAML, found {problem}{where}") from None
        except RecursionError:  # deeply nested flow collections
            raise ConfigFileError(f"{p}: expected YAML, found mappings or lists nested too "
                                  "deeply") from None
    if data is None or data == {}:  # with --recipe, the run went on with every default
        found = ("an empty file" if not text.strip() else "only comments" if data is None
                 else "an empty mapping")
        raise ConfigFileError(f"{p}: expected a mapping of options, found {found}")
    if not isinstance(data, dict):
        raise ConfigFileError(f"{p}: expected a mapping of option: value, found "
                              f"{_plain_kind(data)}")
    check_bounds(data, str(p))
    plain_json(data, str(p))
    return data


MAX_DEPTH = 32
"""Mappings and lists a config file may nest: options nest two or three deep."""
MAX_VALUES = 100_000
"""Values a config file may hold once its YAML aliases are expanded: a file of options holds
hundreds; nine nested aliases of nine uses each make 387 million."""


def check_bounds(data: Any, source: str) -> None:
    """ConfigFileError (one line) for a loaded file nested deeper than MAX_DEPTH (a YAML alias
    that holds itself nests without end) or holding more than MAX_VALUES values with its
    aliases expanded (an alias bomb); counted without expanding anything, before any walk."""
    todo, seen = [(data, 1, "")], 0
    while todo:
        value, depth, key = todo.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ConfigFileError(f"{source}: expected at most {MAX_VALUES:,} values, found more "
                                  "(YAML aliases expand at each use); write the options out")
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ConfigFileError(f"{source}: key {key!r}: expected mappings and lists "
                                      f"nested at most {MAX_DEPTH} deep, found deeper (or a "
                                      "YAML alias used inside itself)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            todo += [(v, depth + 1, key or str(k)) for k, v in items]  # key: the top option


def is_run_config(data: dict[str, Any], source: str) -> bool:
    """Whether a config file is a run bundle's config.json (`{"recipe": ..., "config": {...}}`);
    ConfigFileError for one with other options beside them, which would be half read."""
    from toymlx.bundle.folder import CONFIG_KEYS

    if not (isinstance(data.get("config"), dict) and isinstance(data.get("recipe"), str)):
        return False
    other = sorted(str(k) for k in data if k not in CONFIG_KEYS)
    if other:
        raise ConfigFileError(f"{source}: key {other[0]!r}: expected a run's config.json "
                              f"(keys {', '.join(sorted(CONFIG_KEYS))}) or a file of options, "
                              "found both (a 'config' mapping beside other options); move the "
                              "options into one of them")
    return True


def run_config(data: dict[str, Any], source: str) -> tuple[str | None, dict[str, Any]]:
    """(recipe, options) of a config file: a run's config.json (less RUN_NAMING), or a plain
    mapping whose `recipe` key, if any, names the recipe (toymlx-train)."""
    if is_run_config(data, source):
        return data["recipe"], {k: v for k, v in data["config"].items() if k not in RUN_NAMING}
    data = dict(data)
    recipe = data.pop("recipe", None)
    return (str(recipe) if recipe is not None else None), data


# ---- options of a dataclass, as flags ------------------------------------------------------
def _norm(key: str) -> str:
    return key.lstrip("-").replace("-", "_")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _spellings(cls: type, f: dataclasses.Field) -> list[str]:
    """A field's own name and the names tyro gives it (`tyro.conf.arg(name=..., aliases=...)`),
    less a short flag (toymlx-generate's -p): a command line's, not a file key or an option to
    suggest (`short_flags`)."""
    names = [f.name]
    for meta in getattr(typing.get_type_hints(cls, include_extras=True)[f.name],
                        "__metadata__", ()):
        names += [n for n in [getattr(meta, "name", None)] if isinstance(n, str)]
        names += [a for a in getattr(meta, "aliases", None) or ()
                  if isinstance(a, str) and not _is_short(a)]
    return [_norm(n) for n in names]


def _is_short(flag: str) -> bool:
    return flag.startswith("-") and not flag.startswith("--")


def short_flags(cls: type) -> dict[str, str]:
    """{short flag: field} of `cls`'s one-dash aliases (toymlx-generate's -p, -n, -s, -sys: the
    flags mlx_lm.generate's and llama-cli's users type)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {a: f.name for f in dataclasses.fields(cls) if f.init
            for meta in getattr(hints[f.name], "__metadata__", ())
            for a in getattr(meta, "aliases", None) or () if isinstance(a, str) and _is_short(a)}


def option_table(cls: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """Every option of `cls` under each of its spellings (dotted, underscores) -> field path."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out.update({k: (f.name, *p) for k, p in option_table(hints[f.name], f"{prefix}{f.name}.")
                        .items()})
            continue
        for name in _spellings(cls, f):
            out[f"{prefix}{name}"] = (f.name,)
    return out


def _spelled(path: list[str]) -> str:
    """A key as the file spells it: `lora.rank`, or `lora: {rank}` for a nested one."""
    return path[0] if len(path) == 1 else f"{path[0]}: {{{_spelled(path[1:])}}}"


def _flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    """{dotted key with underscores: value} of a (nested) mapping; ConfigFileError naming both
    spellings where two give one key (`batch-size` and `batch_size`, `lora.rank` and
    `lora: {rank}`)."""
    return _flatten_spelled(data, source)[0]


def _flatten_spelled(data: dict[str, Any], source: str
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """(`_flatten`'s mapping, {its key: the key as the file spells it (`_spelled`)})."""
    out: dict[str, Any] = {}
    spelling: dict[str, str] = {}

    def walk(node: dict[str, Any], prefix: str, path: list[str]) -> None:
        for k, v in node.items():
            key = prefix + _norm(str(k))
            if isinstance(v, dict):
                walk(v, key + ".", [*path, str(k)])
                continue
            here = _spelled([*path, str(k)])
            if key in out:
                raise ConfigFileError(f"{source}: keys {spelling[key]!r} and {here!r}: expected "
                                      f"one of them (both set {_flag(key)}), found both; keep "
                                      "one")
            out[key], spelling[key] = v, here
    walk(data, "", [])
    return out, spelling


def file_flags(cls: type, options: dict[str, Any], source: str) -> dict[str, str]:
    """{flag: the key as the file spells it} of the options a config file of options sets
    (`--lora.rank`: `lora: {rank}`), for the options `cls` has: given, as the command line's
    flags are, so an option set where it does not apply is refused even at its default (the
    lora recipe's `check_applies`), and a later check's line on it names the file's key
    (`file_key_error`). Not for a run's config.json, which lists every option of its run."""
    from toymlx.bundle.options import flag_name

    table = option_table(cls)
    return {flag_name(".".join(table[key])): spelled
            for key, spelled in _flatten_spelled(options, source)[1].items() if key in table}


def under_the_flags(keys: dict[str, str], argv: list[str]) -> dict[str, str]:
    """`keys` (`file_flags`) less the options the command line `argv` gives over the file
    (`--lora.init_adapter` or `--lora.init-adapter`; `--no-compile` over `compile:`)."""
    flags = set()
    for a in argv:
        flag = a.partition("=")[0].replace("_", "-")
        if flag.startswith("--"):
            group, dot, leaf = flag[2:].rpartition(".")
            flags |= {flag, f"--{group}{dot}{leaf.removeprefix('no-')}"}
    return {f: k for f, k in keys.items() if f not in flags}


FLAG_LINE = re.compile(r"(?:(?P<path>.*?): )?(?P<flag>--[a-z][a-z0-9.-]*)(?P<rest>: .*)",
                       re.DOTALL)
"""A line refusing an option after the file was read: `--steps: expected >= 1, found 0`, or
`PATH: --base: expected an existing GGUF file, ...` for an option that names a path."""


def file_key_error(message: str, keys: dict[str, str], source: str) -> str:
    """A later check's line on an option a config file set (`keys`: `file_flags`, less the flags
    the command line gives over it) naming the file and its key, the one to change
    (`--lr: expected > 0, found -0.001` -> `F: key 'lr': expected > 0, found -0.001`); any other
    line unchanged."""
    m = FLAG_LINE.fullmatch(message)
    if m is None or m["flag"] not in keys:
        return message
    return f"{source}: key {keys[m['flag']]!r}{': ' + m['path'] if m['path'] else ''}{m['rest']}"


def _once(source: str, given: dict[Any, str], target: Any, key: str, flag: str) -> None:
    """ConfigFileError naming both keys where two keys of a file set one option (`flag`;
    aliases: toymlx-eval's `data_path` and `data.path`, toymlx-sweep's `random_seed` and
    `random-seed`)."""
    if target in given:
        raise ConfigFileError(f"{source}: keys {given[target]!r} and {key!r}: expected one of "
                              f"them (both set {flag}), found both; keep one")
    given[target] = key


def closest_key(key: str, keys: Iterable[str]) -> str | None:
    """The key among `keys` (dotted, underscores) closest to a misspelt `key`, or None where
    none is close: a key that begins or ends one (`rank`, `temp`) names it, as tyro's own
    suggestions do; else the closest by difflib."""
    key, keys = _norm(key), list(keys)
    part = [k for k in keys if len(key) >= 3 and (k.endswith(key) or k.rpartition(".")[2]
                                                  .startswith(key))]
    close = difflib.get_close_matches(key, part or keys, n=1, cutoff=0 if part else 0.6)
    return close[0] if close else None


def closest_option(key: str, keys: Iterable[str]) -> str | None:
    """The flag (`--lora.rank`) of the option among `keys` (spelled as `option_table` spells
    them) closest to a misspelt `key` (`closest_key`), or None where none is close."""
    close = closest_key(key, keys)
    return _flag(close) if close else None


FILE_FLAG = re.compile(r"(?<![\w./-])--([a-z][a-z0-9._-]*[a-z0-9])")
"""A flag named in a hint (`--lora.rank`), not inside a path or another word."""


def file_words(text: str, table: Mapping[str, Any]) -> str:
    """`text`, a hint that names the command's options by their flags, in a config file's words:
    each of the options of `table` (`option_table`, `_parser_table`) as its key (`--steps` is
    `steps`, `--lora.rank` `lora.rank`), another flag (a peer's, another command's) as it is."""
    return FILE_FLAG.sub(lambda m: _norm(m[1]) if _norm(m[1]) in table else m[0], text)


def _unknown(source: str, key: str, table: dict[str, Any], prog: str) -> str:
    """Why a config file's `key` is refused: no option of `prog` (`table`), and what the user
    meant, named as the file's keys (`file_words`): mlx-lm's `iters` is `steps`, not --steps."""
    from toymlx_cli.usage import flag_hint  # usage imports this module

    # a nanoGPT or timm setting as its flag names it, else the closest option by spelling
    said = flag_hint(key, dict.fromkeys(table, False), prog)
    hint = f"; {said}" if said else ""
    group = sorted(k for k in table if k.startswith(key + "."))
    if group:  # a section given a value (`lora: 8`), not a misspelt option
        more = ", ..." if len(group) > 3 else ""
        hint = (f"; {key} is a group of options ({', '.join(_flag(k) for k in group[:3])}{more}):"
                f" write it as a mapping, e.g. {key}: {{{group[0].split('.', 1)[1]}: ...}}")
    if not group and (said := mlx_lm_hint(key, prog, in_file=True)):  # a plain mlx-lm key;
        # `model.n_layerz` in a recipe with --model.* options is a misspelt option of that group
        hint = f"; {said}"
    return (f"{source}: key {key!r}: expected an option of {prog}, found an unknown key"
            f"{file_words(hint, table)}")


def defaults_from_file(cls: type, options: dict[str, Any], source: str, prog: str) -> Any:
    """An instance of the options dataclass `cls` holding the file's values (each checked
    against its option's type) and every other option's default, for `tyro.cli(default=...)`;
    required options the file leaves out stay required (`tyro.MISSING`)."""
    import tyro

    from toymlx.bundle.options import RunError, config_from_dict

    table = option_table(cls)
    nested: dict[str, Any] = {}
    given: dict[Any, str] = {}
    for key, value in _flatten(options, source).items():
        if key not in table:
            raise ConfigFileError(_unknown(source, key, table, prog))
        _once(source, given, table[key], key, _flag(".".join(table[key])))
        if key in ("resume", "from", "from_step"):
            raise ConfigFileError(f"{source}: key {key!r}: expected on the command line "
                                  f"({_flag(key)}), found it in a config file")
        *parents, leaf = table[key]
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    # the file's values checked as a saved config is (types, one line naming the key); only the
    # keys it gives are set, so a required option it leaves out stays required
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    given = dataclasses.make_dataclass(cls.__name__, [(f.name, hints[f.name],
                                                       dataclasses.field(default=None))
                                                      for f in fields])
    try:
        checked = config_from_dict(given, nested, source, prefix="", complete=False)
    except RunError as e:
        raise ConfigFileError(str(e)) from None
    kw = {f.name: getattr(checked, f.name) if f.name in nested else
          (tyro.MISSING if f.default is dataclasses.MISSING
           and f.default_factory is dataclasses.MISSING else
           f.default if f.default is not dataclasses.MISSING else f.default_factory())
          for f in fields}
    return cls(**kw)


def given_file_keys(cls: type, argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """(the -c file of `argv` or None, {flag: the key as the file spells it} of the options of
    `cls` it sets that `argv` does not give over it by any spelling, an alias too (`--temp` over
    `temperature:`, `-sys`): `file_flags`), for a forward-only command's lines on them
    (`file_key_error`; toymlx-eval's `limit:`). Call it after `file_defaults` read the file
    (which refuses a bad one)."""
    path, rest = split_config(argv)
    if path is None:
        return None, {}
    table, short = option_table(cls), short_flags(cls)
    given = set()
    for a in rest:
        name = a.partition("=")[0]
        if name in short:
            given.add((short[name],))
        elif name.startswith("--"):
            group, dot, leaf = _norm(name).rpartition(".")
            given |= {table.get(f"{group}{dot}{leaf}"), table.get(f"{group}{dot}"
                                                                    f"{leaf.removeprefix('no_')}")}
    keys = file_flags(cls, read_config_file(path), path)
    return path, {f: k for f, k in keys.items() if table.get(_norm(f)) not in given}


def file_defaults(cls: type, argv: list[str], prog: str) -> tuple[Any, list[str]]:
    """(tyro's default instance from `-c FILE`, or None without one; the other arguments)."""
    path, rest = split_config(argv)
    if path is None:
        return None, rest
    return defaults_from_file(cls, read_config_file(path), path, prog), rest


def _parser_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """An argparse command's options under each of their spellings (underscores)."""
    return {_norm(o): a for a in parser._actions for o in a.option_strings
            if a.dest not in ("help", "version", "config")}


def _set_default(action: argparse.Action, key: str, value: Any, path: str) -> None:
    """A file's value as the default of an argparse option (flags given override it), checked
    against the option's type."""
    many = isinstance(action, argparse._AppendAction)
    items = value if many and isinstance(value, list) else [value]
    kind = action.type or (bool if action.nargs == 0 else str)
    want = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    for v in items:
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
              isinstance(v, kind) and (kind is bool or not isinstance(v, bool)))
        if not ok:
            raise ConfigFileError(f"{path}: key {key!r}: expected "
                                  f"{want.get(kind, kind.__name__)}"
                                  f"{' or a list of them' if many else ''}, found "
                                  f"{json.dumps(v)}")
    if action.nargs == 0 and value != (action.const is True):
        raise ConfigFileError(f"{path}: key {key!r}: expected "
                              f"{json.dumps(action.const is True)} (the flag's only "
                              f"setting), found {json.dumps(value)}")
    action.default = [str(v) for v in items] if many else value
    action.required = False


def parser_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`-c FILE` for an argparse command (toymlx-report, toymlx-launch): the file's values become
    its options' defaults (argparse's own `default`), checked against each option's type;
    returns the other arguments."""
    path, rest = split_config(argv)
    if path is None:
        return rest
    table = _parser_table(parser)
    given: dict[Any, str] = {}
    for key, value in _flatten(read_config_file(path), path).items():
        if key not in table:
            raise ConfigFileError(_unknown(path, key, table, parser.prog))
        _once(path, given, table[key].dest, key, table[key].option_strings[-1])
        _set_default(table[key], key, value, path)
    return rest


SWEEP_RUN_KEYS = frozenset({"seed"})
"""Keys of a sweep file that are the runs' although the sweep has a flag of that name: `seed`
seeds every run's training, as in toymlx-train -c (the sweep's --seed, the seed of its --random
draws, is `random_seed` in a file)."""


def sweep_config(parser: argparse.ArgumentParser, data: dict[str, Any], path: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`toymlx-sweep -c FILE`: (grid, run options) of the file, its sweep keys set on `parser`.

    The sweep's own keys (its flags, spelled as `parser_defaults` reads them, less
    `SWEEP_RUN_KEYS`) become the parser's defaults, so flags given override them; `grid`, a
    mapping of option: [values] or "log:LO:HI" (uniform:, int:), is returned as it is, dotted
    keys with underscores, for the command line's --grid to replace key by key. Every other key
    is returned for the runs, which take it as toymlx-train -c does; a run's config.json gives
    its recipe and all of its options to the runs."""
    from toymlx.bundle.options import BUNDLE_PICK, flag_name

    recipe, options = run_config(data, path)
    table = _parser_table(parser)
    if recipe is not None:
        _set_default(table["recipe"], "recipe", recipe, path)
    if is_run_config(data, path):
        return {}, options
    _flatten(options, path)  # two spellings of one key: refused here, before either is used
    grid: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    given: dict[Any, str] = {}
    for key, value in options.items():
        name = _norm(str(key))
        if name in table and name not in SWEEP_RUN_KEYS:
            _once(path, given, table[name].dest, str(key), table[name].option_strings[-1])
        if name == "grid":
            if not isinstance(value, dict):
                raise ConfigFileError(f"{path}: key 'grid': expected a mapping of option: [values] "
                                      f"or \"log:LO:HI\", found {json.dumps(value)}")
            _check_not_wandb_grid(value, path)
            grid = _flatten(value, f"{path}: key 'grid'")
        elif name in table and name not in SWEEP_RUN_KEYS:
            _set_default(table[name], name, value, path)
        elif name in BUNDLE_PICK or name == "from":  # run_id, resume, from, overwrite
            flag = flag_name("from_step" if name == "from" else name)
            raise ConfigFileError(f"{path}: key {key!r}: expected no {flag} in a sweep file "
                                  f"(the sweep sets it for each run), found {json.dumps(value)}; "
                                  "remove it")
        else:
            runs[key] = value
    # the grid's values went to the runs as flags over the file's own value, which was
    # silently unused (on the command line, `--grid lr=... --lr 0.01` is refused)
    values, spelled = _flatten_spelled(runs, path)
    for key in grid:
        if key in values:
            raise ConfigFileError(f"{path}: keys {spelled[key]!r} and 'grid.{key}': expected "
                                  f"{_flag(key)} once, as every run's option or in the grid, "
                                  f"found both ({json.dumps(values[key], default=str)} and "
                                  f"{json.dumps(grid[key], default=str)}); keep one")
    return grid, runs


def sweep_file_flags(parser: argparse.ArgumentParser, data: dict[str, Any], argv: list[str]
                     ) -> dict[str, str]:
    """{flag: the file's key} of the sweep's own options (not its grid) a -c file sets and
    `argv` does not give over it, for `file_key_error`: a later check's line names the file's
    key (`sweep.yaml: key 'workers': expected >= 1, found 0`; it named --workers, a flag not
    typed)."""
    table = _parser_table(parser)
    given = {a.partition("=")[0] for a in argv if a.startswith("--")}
    out: dict[str, str] = {}
    for key in data:
        name = _norm(str(key))
        action = table.get(name)
        if (action is None or name in SWEEP_RUN_KEYS or name == "grid"
                or given & set(action.option_strings)):
            continue
        out.update(dict.fromkeys(action.option_strings, str(key)))
    return out


WANDB_PARAMETER_KEYS = {"values", "value", "min", "max", "distribution"}
"""The keys of a W&B sweep parameter ({values: [...]}, {min, max, distribution})."""


def _check_not_wandb_grid(grid: dict[Any, Any], path: str) -> None:
    """ConfigFileError for a grid key given as a W&B sweep parameter (lr: {values: [1e-3]}):
    flattened as options, it was refused as `no option --lr.values`, which says nothing of the
    spelling that is wanted."""
    for key, value in grid.items():
        if isinstance(value, dict) and value and set(map(str, value)) <= WANDB_PARAMETER_KEYS:
            raise ConfigFileError(
                f"{path}: key 'grid.{key}': expected a list of values or a \"log:LO:HI\" "
                f"range (uniform:, int:), found {json.dumps(value)}: W&B's form; write "
                f"{key}: [V1, V2] for values, {key}: \"log:MIN:MAX\" with random: N for a "
                "distribution")


def sweep_key_near(parser: argparse.ArgumentParser, cls: type, key: str) -> str | None:
    """The sweep's own key (`workers`) that `key` (`worker`, `--wrokers`) is a typo of, where
    `key` is no option of the runs (`cls`), else None: such a key would be passed to every run
    and refused there, named with the closest run option's hint, or none."""
    runs = option_table(cls)
    name = _norm(key)
    if name in runs or any(k.startswith(name + ".") for k in runs):
        return None
    own = sorted(k for k in _parser_table(parser) if k not in SWEEP_RUN_KEYS)
    close = difflib.get_close_matches(name, own, n=1, cutoff=0.75)
    return close[0] if close else None


def check_sweep_typos(parser: argparse.ArgumentParser, cls: type, run_options: dict[str, Any],
                      path: str) -> None:
    """ConfigFileError for a key of a sweep file that is no option of the runs (`cls`) but
    close to one of the sweep's own (`gird`, `worker`): it would be read as a run option and
    named without a hint, with the closest run option's, or none."""
    for key in run_options:
        close = sweep_key_near(parser, cls, str(key))
        if close:
            raise ConfigFileError(f"{path}: key {key!r}: expected a key of toymlx-sweep or an "
                                  f"option of its runs, found an unknown key; did you mean "
                                  f"{close} (toymlx-sweep's {_flag(close)})?")


def check_sweep_flag_typos(parser: argparse.ArgumentParser, cls: type, flags: list[str]
                           ) -> None:
    """ValueError for a flag given to toymlx-sweep before any `--` that is no option of the
    runs (`cls`) but close to one of the sweep's own (`--wrokers 2`): it went to every run,
    whose toymlx-train named only its own options (`--wrokers: expected an option of
    toymlx-train --recipe from-scratch`), not the sweep flag meant."""
    for arg in flags:
        if not arg.startswith("--"):
            continue
        flag = arg.partition("=")[0]
        close = sweep_key_near(parser, cls, flag)
        if close:
            raise ValueError(f"{flag}: expected an option of toymlx-sweep or of its runs, found "
                             f"an unknown one; did you mean {_flag(close)} (toymlx-sweep's)?")
