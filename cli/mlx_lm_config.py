"""mlx-lm's LoRA config files (`mlx_lm lora -c F`), read unchanged by `toymlx-train -c F`.

A file is mlx-lm's when it has keys only mlx-lm's lora command reads (`MLX_LM_ONLY`: iters,
learning_rate, num_layers, lora_parameters, ...), no fewer than keys only toymlx reads
(`is_mlx_lm_config`). Its keys are mapped to the lora recipe's options with mlx-lm's meaning,
and the keys it leaves out take mlx-lm's defaults (`MLX_LM_DEFAULTS`, as mlx_lm/lora.py's
CONFIG_DEFAULTS has them; mlx-lm 0.32), as do the settings mlx-lm fixes without a key
(`MLX_LM_FIXED`: no gradient clipping, one example a row, LoRA on every linear layer, Adam's
beta2 0.999, no warm-up, AdamW's decay on every trained array, a conversation's last message
trained under mask_prompt, a validation pass before the first step). lora_parameters.keys, mlx-lm's
module paths, are read by `toymlx.models.lora.MLX_LM_KEYS` and checked against the base by
`mlx_lm_keys`; without keys, mlx-lm's default is --lora.targets mlx-lm-default (every linear
layer of a block, a mixture of experts' router too). `mlx_lm_options` returns
the options and the table printed at start (mlx-lm key, toymlx option, value, where it came
from). A key toymlx cannot honour is one line
naming it: refused where it changes what is trained, noted where it does not. toymlx's own
config files are not read here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from toymlx_cli.config_file import FLAG_LINE, ConfigFileError, closest_key

from toymlx.backend.files import counted
from toymlx.bundle.model_store import is_hf_repo
from toymlx.models.lora import MLX_LM_DEFAULT, MLX_LM_KEYS, mlx_lm_modules
from toymlx.runner.api import called_by_train, caller_option, caller_text

MLX_LM_ONLY = frozenset({
    "train", "iters", "learning_rate", "num_layers", "lora_parameters", "optimizer_config", "steps_per_eval", "steps_per_report", "val_batches", "test_batches",
    "save_every", "adapter_path", "resume_adapter_file", "max_seq_length", "hf_dataset",
    "grad_accumulation_steps", "clear_cache_threshold", "project_name", "trust_remote_code",
    "prompt_feature", "completion_feature", "text_feature", "chat_feature"})
"""Keys that make a config file mlx-lm's: its lora command reads them, toymlx has none (its
`model`, `data`, `seed`, ... are read as mlx-lm's in such a file, as toymlx's in another;
`lr_schedule` and `optimizer` are toymlx's lora options too, so a toymlx config.json with
them is not mlx-lm's)."""
MLX_LM_DEFAULTS: dict[str, Any] = {
    "fine_tune_type": "lora", "optimizer": "adam", "seed": 0, "num_layers": 16,
    "batch_size": 4, "iters": 1000, "val_batches": 25, "learning_rate": 1e-5,
    "steps_per_report": 10, "steps_per_eval": 200, "save_every": 100, "test": False,
    "max_seq_length": 2048, "grad_checkpoint": False, "grad_accumulation_steps": 1,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0}, "mask_prompt": False,
}
"""mlx_lm/lora.py's CONFIG_DEFAULTS for the keys that change what is trained."""
MLX_LM_FIXED: dict[str, Any] = {"grad_clip": 0.0, "data.pack": False, "beta1": 0.9,
                                "beta2": 0.999, "warmup": 0, "weight_decay": 0.0,
                                "lr_schedule": "constant", "weight_decay_scope": "all",
                                "data.train_turns": "last", "eval_at_start": True,
                                "data.val_fraction": 0.0}
"""What mlx-lm trains with and has no key for (its trainer does not clip, batches one
example a row, validates at iteration 1 before any update; MLX's Adam betas, and its AdamW's
decay on every trained array; mask_prompt trains a conversation's last message; a data folder
without valid.jsonl trains on every example and validates none, mlx_lm/tuner/datasets.py's
"Validation set not found or empty"), where toymlx's lora recipe has another default."""
_NOTED = {
    "clear_cache_threshold": "toymlx manages MLX's cache itself",
    "trust_remote_code": "toymlx runs no model code from a repository",
    "config": "the file itself",
}
"""Keys toymlx reads but does not honour, because they do not change what is trained."""
_RENAMED = {"iters": "steps", "learning_rate": "lr",
            "grad_accumulation_steps": "grad_accum", "steps_per_eval": "eval_every",
            "steps_per_report": "report_every", "save_every": "checkpoint_every",
            "batch_size": "batch_size", "seed": "seed", "test": "test",
            "grad_checkpoint": "grad_checkpoint", "fine_tune_type": "fine_tune_type",
            "mask_prompt": "data.mask_prompt", "resume_adapter_file": "lora.init_adapter",
            "optimizer": "optimizer"}


_AS_TOYMLX = {"trust_remote_code": False, "clear_cache_threshold": 0}
"""_NOTED's keys at the value that asks for what toymlx does anyway (no repository code, no
cache clearing: mlx-lm's defaults, which its adapter_config.json saves): not noted."""


_OLD_MLX_LM = {"lora_layers": "num_layers", "use_dora": "fine_tune_type: dora"}
"""Keys older mlx-lm read -> what mlx-lm reads now; mlx-lm 0.32 ignores them without a word
(a file's `lora_layers: 4` trains its default 16 blocks), and their closest key by spelling
(`lora_layers`: lora_parameters) is not what they meant."""
_ORPO_ERA = {"training_mode": "normal", "beta": 0.1, "reward_scaling": 1.0}
"""Keys of older mlx-lm's lora (its ORPO training, CONFIG_DEFAULTS' values, which its
adapter_config.json saved) that mlx-lm 0.32 ignores: training_mode normal is supervised
training, what toymlx does; beta and reward_scaling were ORPO's alone."""
_SHARED = {"model", "data", "report_to", "recipe", "lr_schedule", *_ORPO_ERA}
"""Keys an mlx-lm file may hold besides MLX_LM_ONLY, MLX_LM_DEFAULTS and _NOTED's."""
_FEATURES = {"prompt_feature": "prompt", "completion_feature": "completion",
             "text_feature": "text", "chat_feature": "messages"}
"""mlx-lm's keys naming the key of a data row its prompt, completion, text or messages are
read from (mlx_lm/tuner/datasets.py's create_dataset) -> the part of a row it names, as
--data.keys names it (`toymlx.data.chat.row_keys`)."""
_MLX_LM_MODEL = "Qwen/Qwen3-0.6b"
"""mlx-lm's default `model` (mlx_lm/lora.py's CONFIG_DEFAULTS, mlx-lm 0.32): a Hugging Face
repository of safetensors, which toymlx, reading GGUFs and no network, cannot take."""


def is_mlx_lm_config(options: dict[str, Any], recipe_key: bool = False) -> bool:
    """Whether a config file's options are mlx-lm's: it has keys only mlx-lm reads
    (`MLX_LM_ONLY`), at least as many as keys only toymlx reads (`base`, `steps`, ...; a
    `recipe` key, `recipe_key`, is one). One mlx-lm key in a toymlx file (`learning_rate`
    beside `base` and `steps`) is then refused naming toymlx's option, not the file read as
    mlx-lm's for it."""
    mlx_lm = sum(k in MLX_LM_ONLY for k in options)
    toymlx = sum(_toymlx_only(k) for k in options) + recipe_key
    return mlx_lm > 0 and mlx_lm >= toymlx


def mlx_lm_model(data: dict[str, Any], source: str, flags: frozenset[str]) -> None:
    """ConfigFileError (one line naming the file's `model`) for an mlx-lm config without a
    model, or with `model: null`, and no --base on the command line: mlx-lm's default in its
    place is no GGUF (`_MLX_LM_MODEL`), and the base left unset failed later, unnamed."""
    if data.get("model") is None and "--base" not in flags:
        raise ConfigFileError(
            f"{source}: key 'model': expected the path of a GGUF to adapter-train, found "
            f"{'null' if 'model' in data else 'no key'} (mlx-lm's default, {_MLX_LM_MODEL}, "
            f"is a Hugging Face model, not a GGUF); set model: PATH.gguf in {source} (or pass "
            "--base PATH.gguf)")


def _toymlx_only(key: str) -> bool:
    return key not in MLX_LM_ONLY | set(MLX_LM_DEFAULTS) | set(_NOTED) | _SHARED


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _want(source: str, key: str, ok: bool, expected: str, found: Any) -> None:
    if not ok:
        raise ConfigFileError(f"{source}: key {key!r}: expected {expected}, found "
                              f"{json.dumps(found)}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mlx_lm_options(data: dict[str, Any], source: str, flags: frozenset[str] = frozenset()
                   ) -> tuple[dict[str, Any], list[tuple[str, str, Any, str]], list[str]]:
    """(toymlx options as dotted keys, the table's rows (mlx-lm key, toymlx option, value,
    "file" or "mlx-lm default"), one note a key not honoured) of an mlx-lm config; ConfigFileError
    (one line naming the key) for one toymlx cannot honour that changes what is trained.
    `flags`: the options the command line gives (`--data.path`), which win over the file's keys
    as mlx-lm's flags do, so a file key they replace is not refused."""
    # mlx-lm fills every key whose value is null with its default (`mlx_lm lora`'s main), and
    # saves null for the keys it left unset (adapter_config.json: lr_schedule, report_to, ...)
    data = {k: v for k, v in data.items() if v is not None}
    keys = set(data)
    unknown = sorted(k for k in keys if _toymlx_only(k))
    if unknown:
        why = min(keys & MLX_LM_ONLY, default="keys")
        close = closest_key(unknown[0], (k for k in MLX_LM_ONLY | set(MLX_LM_DEFAULTS)
                                         | set(_NOTED) | _SHARED if k != "config"))
        hint = (f"; it is older mlx-lm's, which mlx-lm now ignores: write "
                f"{_OLD_MLX_LM[unknown[0]]}" if unknown[0] in _OLD_MLX_LM
                else f"; did you mean {close}?" if close else "")
        raise ConfigFileError(f"{source}: key {unknown[0]!r}: expected a key of mlx-lm's lora "
                              f"config (the file is read as mlx-lm's, for its {why!r}), found "
                              f"an unknown key{hint}")
    given = {**MLX_LM_DEFAULTS, **data}
    _want(source, "train", data.get("train", True) is True, "true (toymlx-train trains; a run's "
          "test.jsonl is scored by toymlx-eval --model RUN --split test)", data.get("train"))
    out: dict[str, Any] = {}
    rows: list[tuple[str, str, Any, str]] = []
    # trust_remote_code false and clear_cache_threshold 0 (never clear: mlx-lm's default, and
    # what its adapter_config.json saves) are what toymlx does: noted only where a file asks
    # for the code or the clearing
    notes = [f"{source}: key {k!r}: not honoured ({why})" for k, why in _NOTED.items()
             if k in data and not (k in _AS_TOYMLX and type(data[k]) is type(_AS_TOYMLX[k])
                                   and data[k] == _AS_TOYMLX[k])]

    def put(mlx_key: str, option: str, value: Any, origin: str | None = None) -> None:
        if option in out:  # set again by a key that overrides another (lr_schedule over lr)
            rows[:] = [r for r in rows if r[1] != _flag(option)]
        out[option] = value
        rows.append((mlx_key, _flag(option), value, origin or (
            "file" if mlx_key.split(".")[0] in data else "mlx-lm default")))

    if isinstance(given["optimizer"], str):
        given["optimizer"] = given["optimizer"].lower()
    for key, option in _RENAMED.items():
        if key in given:
            put(key, option, given[key])
    _want(source, "max_seq_length", _int(given["max_seq_length"]) and given["max_seq_length"] >= 2,
          "an integer >= 2 (tokens a row holds, its first input to its last target)",
          given["max_seq_length"])
    # mlx-lm cuts a row to max_seq_length tokens, max_seq_length - 1 targets: toymlx's
    # --seq-len counts targets (a row holds seq_len + 1 tokens)
    put("max_seq_length", "seq_len", given["max_seq_length"] - 1)
    notes += _micro_steps(given, set(data), source, put)
    if "steps_per_eval" in data:
        notes.append(f"{source}: key 'steps_per_eval': mlx-lm's val loss at iteration N is "
                     "the model's before update N; toymlx's at step N is after it (one update "
                     "later; the first, --eval-at-start's, is the same)")
    _want(source, "num_layers", _int(given["num_layers"]) and given["num_layers"] >= -1,
          "an integer >= -1 (-1: every block)", given["num_layers"])
    if given["fine_tune_type"] == "full":
        # mlx-lm freezes the model, then unfreezes the last num_layers blocks: toymlx's
        # --full.layers (-1 and counts past the base's blocks resolved by `mlx_lm_layers`)
        put("num_layers", "full.layers", given["num_layers"])
    else:
        put("num_layers", "lora.layers",
            None if given["num_layers"] == -1 else given["num_layers"])
    if "val_batches" in given:
        vb = given["val_batches"]
        _want(source, "val_batches", _int(vb) and (vb >= 1 or vb == -1),
              "an integer >= 1, or -1 (every batch)", vb)
        put("val_batches", "eval_batches", vb)  # -1: every batch, as toymlx spells it too
    notes += _orpo_era(data, source)
    if given["fine_tune_type"] != "full":
        notes += _lora(given["lora_parameters"], source, put)
    if "lr_schedule" in data:
        _schedule(data["lr_schedule"], source, put)
        if "learning_rate" in data and data["learning_rate"] != out["lr"]:
            # mlx-lm's optimizer takes the schedule over learning_rate, without a word
            notes.append(f"{source}: key 'learning_rate': {data['learning_rate']} not used: "
                         f"lr_schedule sets the lr (its first argument, {out['lr']:g}), as in "
                         "mlx-lm")
    _optimizer_config(data.get("optimizer_config"), given["optimizer"], source, put)
    if "model" in data:
        put("model", "base", data["model"] if "--base" in flags else _model(data["model"], source))
    if "hf_dataset" in data and "--data.path" in flags:
        notes.append(f"{source}: key 'hf_dataset': not used (--data.path on the command line "
                     "gives the data; mlx-lm would read the Hugging Face dataset instead)")
    elif "hf_dataset" in data:
        _hf_dataset(data["hf_dataset"], source)
    renamed = _features(data, source)
    if renamed:
        put(", ".join(k for k in _FEATURES if k in data), "data.keys", list(renamed), "file")
    if "data" in data:
        put("data", "data.path", data["data"] if "--data.path" in flags
            else _data(data["data"], source))
    if "adapter_path" in data:
        p = data["adapter_path"]
        _want(source, "adapter_path", isinstance(p, str) and p.strip("/") != "",
              "a folder name", p)
    if "adapter_path" in data and {"--runs-root", "--run-id"} <= flags:  # a sweep's runs too
        notes.append(f"{source}: key 'adapter_path': not used (--runs-root and --run-id, "
                     "given, name the run's folder)")
    elif "adapter_path" in data:
        put("adapter_path", "runs_root", str(Path(p).parent))
        put("adapter_path", "run_id", Path(p).name)
        # mlx_lm.generate --adapter-path would fail on it: "No such file or directory:
        # 'adapters/adapter_config.json'"
        if given["fine_tune_type"] == "full":  # its checkpoints are whole models
            notes.append(f"{source}: key 'adapter_path': {p} is the run's folder; its "
                         "checkpoints are whole models in llama.cpp's GGUF "
                         "(weights/step_N.gguf), not mlx-lm's adapters.safetensors: "
                         f"toymlx-generate --model {p}, or toymlx-export --base {p} --out "
                         "FILE.gguf (mlx_lm.fuse's)")
        else:
            notes.append(f"{source}: key 'adapter_path': {p} is the run's folder; its adapters "
                         "are llama.cpp's GGUFs (weights/adapter_step_N.gguf), not mlx-lm's "
                         f"adapters.safetensors: toymlx-generate --model {p}, or toymlx-export "
                         f"--adapter {p} --fuse --out FILE.gguf (mlx_lm.fuse's)")
    if data.get("report_to"):
        put("report_to", "report_to", _report_to(data["report_to"], source))
    if "project_name" in data:
        p = data["project_name"]
        _want(source, "project_name", isinstance(p, str) and p.strip() != "",
              "a W&B project name", p)
        from toymlx.bundle.reporters import parse_report_to

        if "--report-to" in flags or "wandb" in parse_report_to(out.get("report_to")):
            put("project_name", "wandb_project", p)
        else:  # mlx-lm reads it only for report_to wandb
            notes.append(f"{source}: key 'project_name': not used (no report_to: wandb; "
                         "mlx-lm reads it only for W&B)")
    notes += _test_batches(data, given["test"], source)
    if data.get("resume_adapter_file") is not None:
        _resume_adapter(data["resume_adapter_file"], source)
    for option, value in MLX_LM_FIXED.items():
        if option not in out:
            put("(none)", option, value, "mlx-lm's, fixed")
    if "lora.targets" not in out and given["fine_tune_type"] != "full":
        # mlx-lm's every linear layer of a block, as the lora recipe resolves mlx-lm-default
        # against the base (`toymlx.models.lora.mlx_lm_default`): qwen35's linear-attention
        # blocks' qkv,z,beta,alpha,out too; a mixture of experts' router too, which toymlx's
        # own all-linear leaves out
        put("lora_parameters.keys", "lora.targets", MLX_LM_DEFAULT,
            "mlx-lm default (every linear layer of a block, a mixture of experts' router too)")
    return out, rows, notes


def _micro_steps(given: dict[str, Any], in_file: set[str], source: str, put
                 ) -> list[str]:
    """iters, steps_per_eval, steps_per_report and save_every count mlx-lm's micro-batches (one
    `it` a batch, an update every grad_accumulation_steps of them); toymlx's --steps, --eval-every,
    --report-every and --checkpoint-every count optimizer steps. Divided here, a note a key
    whose count falls mid-accumulation or leaves micro-batches that update nothing."""
    accum = given["grad_accumulation_steps"]
    _want(source, "grad_accumulation_steps", _int(accum) and accum >= 1, "an integer >= 1", accum)
    if accum == 1:
        return []
    iters = given["iters"]
    _want(source, "iters", _int(iters) and iters >= accum, f"an integer >= grad_accumulation_steps "
          f"{accum} (mlx-lm's iters counts micro-batches: fewer make no update)", iters)
    origin = f"/ grad_accumulation_steps {accum}"
    notes = [(f"{source}: key 'grad_accumulation_steps': the {accum} micro-batches' gradients "
              "are averaged over their targets together (mlx-lm averages each micro-batch's "
              "mean)")]
    def key_named(key: str) -> str:  # a default the file leaves out is not looked for in it
        return f"key {key!r}" + ("" if key in in_file else " (mlx-lm's default, not in the file)")

    if left := iters % accum:
        notes.append(f"{source}: {key_named('iters')}: {iters} micro-batches are "
                     f"{counted(iters // accum, 'optimizer step')} of {accum}; mlx-lm's last "
                     f"{counted(left, 'micro-batch', 'micro-batches')} "
                     f"{'updates' if left == 1 else 'update'} nothing and "
                     f"{'is' if left == 1 else 'are'} not drawn")
    put("iters", "steps", iters // accum, _origin("iters" in in_file, origin))
    for key, option in (("steps_per_eval", "eval_every"), ("steps_per_report", "report_every"),
                        ("save_every", "checkpoint_every")):
        n = given[key]
        _want(source, key, _int(n) and n >= 1, "an integer >= 1", n)
        every = max(n // accum, 1)
        if n % accum:
            notes.append(f"{source}: {key_named(key)}: every "
                         f"{counted(n, 'micro-batch', 'micro-batches')} falls inside an "
                         f"accumulation of {accum}; toymlx's --{option.replace('_', '-')} is "
                         f"every {counted(every, 'optimizer step')} ({every * accum} "
                         "micro-batches)")
        put(key, option, every, _origin(key in in_file, origin))
    return notes


def _origin(in_file: bool, how: str) -> str:
    return f"{'file' if in_file else 'mlx-lm default'} {how}"


def mlx_lm_layers_flag(cfg: Any) -> str:
    """The lora recipe's flag that num_layers sets: --full.layers for a full fine-tune, else
    --lora.layers (given on the command line, it keeps toymlx's meaning)."""
    return "--full.layers" if cfg.fine_tune_type == "full" else "--lora.layers"


def mlx_lm_layers(cfg: Any) -> tuple[Any, str | None]:
    """(cfg, a note or None): num_layers with mlx-lm's meaning, `layers[-max(num_layers, 0):]`:
    -1, 0 or the base's block count is every block, where toymlx's --lora.layers and
    --full.layers refuse -1 and 0 as typos; a count past the base's blocks (mlx-lm's default 16
    on a 5-block model), which mlx-lm refuses, is every block too, the note says so. LoRA's
    every block is an unset --lora.layers; a full fine-tune's is --full.layers at the block
    count, which keeps the embeddings, the final norm and the head frozen as mlx-lm does (unset,
    toymlx's full trains them too). A base that cannot be read is left to the recipe, which
    names what is wrong with it."""
    import dataclasses

    from toymlx.bundle.model_store import resolve_model
    from toymlx.gguf.reader import read_metadata

    full = cfg.fine_tune_type == "full"
    n = cfg.full.layers if full else cfg.lora.layers
    if n is None:
        return cfg, None
    try:
        meta = read_metadata(resolve_model(cfg.base, "--base", check_digest=False))  # a header
        blocks = meta[f"{meta.get('general.architecture', 'llama')}.block_count"]
    except (ValueError, OSError, KeyError):
        return cfg, None
    if not isinstance(blocks, int) or 0 < n < blocks:
        return cfg, None
    # mlx-lm 0.32's train_model raises for a count past the model's blocks ("Requested to
    # train 16 layers but the model only has 5 layers"), its default 16 included
    verb = "trains" if full else "adapts"
    rule = (f"mlx-lm {verb} layers[-{n}:]" if 0 < n <= blocks else f"mlx-lm {verb} every block "
            f"for {n}" if n <= 0 else f"mlx-lm refuses more than the base's {blocks}")
    if full:
        note = (f"num_layers {n}: every block of the base's {blocks} trained, the embeddings, "
                f"final norm and head frozen ({rule})")
        return dataclasses.replace(cfg, full=dataclasses.replace(cfg.full, layers=blocks)), note
    note = f"num_layers {n}: every block of the base's {blocks} ({rule})"
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, layers=None)), note


def mlx_lm_keys(cfg: Any, keys: Any, source: str) -> None:
    """ConfigFileError (one line naming lora_parameters.keys) for a key that no block of the base
    has (`toymlx.models.lora.mlx_lm_modules`): mlx-lm matches keys to module paths and adapts
    nothing for such a key, without a word, where toymlx's target of that name would adapt
    another projection (mlp.gate_proj on a mixture of experts: its experts' tensors, mlx-lm's
    mlp.switch_mlp.gate_proj) or be refused naming a flag the file does not have. Checked once
    the base is known (a flag may give it); a base that cannot be read is left to the recipe."""
    from toymlx.bundle.model_store import resolve_model
    from toymlx.gguf.llama import args_from_gguf
    from toymlx.gguf.reader import GGUFFile

    if not isinstance(keys, list) or cfg.fine_tune_type == "full":
        return
    try:
        with GGUFFile(resolve_model(cfg.base, "--base", check_digest=False)) as g:
            a = args_from_gguf(g)
    except (ValueError, OSError, KeyError):
        return
    have: dict[str, str | None] = {}
    for i in range(a.n_layers):
        have.update(mlx_lm_modules(a, i))
    for k in keys:
        if k not in have:
            raise ConfigFileError(
                f"{source}: key 'lora_parameters.keys': expected module paths this {a.arch} "
                f"base's blocks have ({', '.join(m for m, t in have.items() if t is not None)}), "
                f"found {json.dumps(k)}, which mlx-lm would adapt in none of them")


def mlx_lm_rank_given(options: dict[str, Any], rows: list[tuple[str, str, Any, str]],
                      rank: Any) -> tuple[dict[str, Any], list[tuple[str, str, Any, str]]]:
    """(options, rows) with --lora.alpha following a --lora.rank the command line gives over the
    file (`rank`: its text; None when not given, or with --lora.alpha given too): mlx-lm's
    `scale` multiplies the update whatever the rank, toymlx's alpha / rank does, so alpha is
    the file's scale (or mlx-lm's default 20) x the given rank, as the file's alpha was x its
    rank. Left as it is, --lora.rank 2 over mlx-lm's rank 8 would scale the update by 80."""
    if rank is None or "lora.alpha" not in options:
        return options, rows
    try:
        r = int(rank)
    except ValueError:  # refused by the parser, naming --lora.rank
        return options, rows
    scale = options["lora.alpha"] / options["lora.rank"]
    alpha = scale * r
    rows = [(k, o, alpha, f"{f} scale {scale:g} x --lora.rank {r}") if o == "--lora.alpha"
            else (k, o, v, f) for k, o, v, f in rows]
    return {**options, "lora.alpha": alpha}, rows


def _orpo_era(data: dict[str, Any], source: str) -> list[str]:
    """Notes for older mlx-lm's `_ORPO_ERA` keys (none at the values its adapter_config.json
    saved); ConfigFileError for a training_mode other than normal (DPO, ORPO: preference
    training, which toymlx does not do and mlx-lm 0.32 no longer reads)."""
    mode = data.get("training_mode", "normal")
    _want(source, "training_mode", mode == "normal", "normal (older mlx-lm's supervised "
          "training, what toymlx trains; it has no DPO or ORPO, and mlx-lm 0.32 reads no "
          "training_mode)", mode)
    return [f"{source}: key {k!r}: not used (older mlx-lm's ORPO setting, which mlx-lm 0.32 "
            "ignores)" for k in ("beta", "reward_scaling")
            if k in data and data[k] != _ORPO_ERA[k]]


def _lora(params: Any, source: str, put) -> list[str]:
    """lora_parameters: rank, scale (toymlx's alpha = scale x rank: the same update), dropout,
    keys. mlx-lm takes the mapping whole (no key falls back to a default) and requires scale;
    older mlx-lm's alpha beside it (its adapter_config.json saved both), which mlx-lm 0.32's
    LoRA layers ignore, is noted as not used."""
    _want(source, "lora_parameters", isinstance(params, dict), "a mapping of rank, scale, "
          "dropout[, keys]", params)
    notes = []
    if "alpha" in params and "scale" in params:
        notes.append(f"{source}: key 'lora_parameters.alpha': not used (mlx-lm scales the update "
                     f"by scale, {params['scale']}, and ignores alpha, {params['alpha']}; "
                     "toymlx's --lora.alpha is scale x rank)")
        params = {k: v for k, v in params.items() if k != "alpha"}
    other = sorted(set(params) - {"rank", "scale", "dropout", "keys"})
    if other:
        raise ConfigFileError(f"{source}: key 'lora_parameters.{other[0]}': expected rank, scale, "
                              f"dropout or keys (mlx-lm's), found {other[0]!r}")
    for k in ("rank", "scale", "dropout"):
        if k not in params:
            raise ConfigFileError(f"{source}: key 'lora_parameters.{k}': expected it (mlx-lm "
                                  "requires rank, scale and dropout when lora_parameters is "
                                  "given), found no key")
    rank, scale = params["rank"], params["scale"]
    _want(source, "lora_parameters.rank", _int(rank) and rank >= 1, "an integer >= 1", rank)
    _want(source, "lora_parameters.scale", _number(scale) and scale > 0, "a number > 0", scale)
    put("lora_parameters.rank", "lora.rank", rank)
    put("lora_parameters.scale", "lora.alpha", float(scale) * rank)
    put("lora_parameters.dropout", "lora.dropout", params["dropout"])
    if params.get("keys") is not None:
        keys = params["keys"]
        _want(source, "lora_parameters.keys", isinstance(keys, list) and keys, "a list of module "
              "paths such as self_attn.q_proj", keys)
        can = [k for k, t in MLX_LM_KEYS.items() if t is not None]
        for k in keys:
            if k in MLX_LM_KEYS and MLX_LM_KEYS[k] is None:
                raise ConfigFileError(f"{source}: key 'lora_parameters.keys': expected module "
                                      f"paths toymlx can adapt ({', '.join(can)}), found "
                                      f"{json.dumps(k)}: qwen2_moe's shared expert, which no "
                                      "--lora.targets adapts")
            if k not in MLX_LM_KEYS:
                raise ConfigFileError(f"{source}: key 'lora_parameters.keys': expected module "
                                      f"paths of a block ({', '.join(can)}), found "
                                      f"{json.dumps(k)}")
        # each path's own target; whether the base's blocks have it is `mlx_lm_keys`'s check
        put("lora_parameters.keys", "lora.targets",
            ",".join(dict.fromkeys(MLX_LM_KEYS[k] for k in keys)))
    return notes


def _schedule(sched: Any, source: str, put) -> None:
    """lr_schedule: {name, arguments, warmup, warmup_init}; the first argument is the peak lr."""
    from toymlx.recipes.lora import SCHEDULES

    _want(source, "lr_schedule", isinstance(sched, dict) and "name" in sched
          and "arguments" in sched, "a mapping with name and arguments", sched)
    other = sorted(set(sched) - {"name", "arguments", "warmup", "warmup_init"})
    if other:
        raise ConfigFileError(f"{source}: key 'lr_schedule.{other[0]}': expected name, arguments, "
                              f"warmup or warmup_init (mlx-lm's), found {other[0]!r}")
    name, args = sched["name"], sched["arguments"]
    _want(source, "lr_schedule.name", name in SCHEDULES[1:], "one of MLX's schedules "
          + ", ".join(SCHEDULES[1:]), name)
    _want(source, "lr_schedule.arguments", isinstance(args, list) and args
          and all(_number(a) for a in args), "a list of numbers, the first the initial lr", args)
    put("lr_schedule.name", "lr_schedule", name)
    put("lr_schedule.arguments", "lr_schedule_args", [float(a) for a in args])
    put("lr_schedule.arguments[0]", "lr", float(args[0]))
    put("lr_schedule.warmup", "warmup", sched.get("warmup", 0))
    put("lr_schedule.warmup_init", "warmup_init", float(sched.get("warmup_init", 0.0)))


def _optimizer_config(conf: Any, name: Any, source: str, put) -> None:
    """optimizer_config.<name>: adam and adamw's betas, eps and bias_correction (MLX's
    defaults 1e-8 and false; mlx-lm's example config sets 1e-6 and true), adamw's weight_decay
    (MLX's default 0.01); the other optimizers run with MLX's defaults."""
    conf = {} if conf is None else conf
    conf = (conf.get(name) or {}) if isinstance(conf, dict) else conf
    key = f"optimizer_config.{name}"
    _want(source, key, isinstance(conf, dict), "a mapping of the optimizer's arguments", conf)
    adam = {"betas", "eps", "bias_correction"}
    allowed = {"adam": adam, "adamw": adam | {"weight_decay"}}.get(name, set())
    for k, v in conf.items():
        if k not in allowed:
            raise ConfigFileError(f"{source}: key '{key}.{k}': expected "
                                  + (", ".join(sorted(allowed)) if allowed else "no arguments")
                                  + f" (what toymlx's {name} takes), found {k!r}; remove it")
        if k == "eps":
            _want(source, f"{key}.eps", _number(v) and v > 0, "a number > 0", v)
            put(f"{key}.eps", "adam_eps", float(v))
        if k == "bias_correction":
            _want(source, f"{key}.bias_correction", isinstance(v, bool), "true or false", v)
            put(f"{key}.bias_correction", "bias_correction", v)
        if k == "betas":
            _want(source, f"{key}.betas", isinstance(v, list) and len(v) == 2
                  and all(_number(b) for b in v), "[beta1, beta2]", v)
            put(f"{key}.betas", "beta1", float(v[0]))
            put(f"{key}.betas", "beta2", float(v[1]))
    if name == "adamw":
        wd = conf.get("weight_decay", 0.01)
        _want(source, f"{key}.weight_decay", _number(wd) and wd >= 0, "a number >= 0", wd)
        put(f"{key}.weight_decay", "weight_decay", float(wd),
            None if "weight_decay" in conf else "MLX's AdamW default")


def _features(data: dict[str, Any], source: str) -> tuple[str, ...]:
    """prompt_feature, completion_feature, text_feature, chat_feature as --data.keys' KEY=NAME
    pairs (the run's config keeps them, so toymlx-eval and toymlx-export read the rows as the
    run did); one naming its own part (mlx-lm's default) gives none. ConfigFileError (one line)
    for a value that is not a key name, or one row key named by two of them."""
    pairs, by_name = [], {}
    for key, part in _FEATURES.items():
        if key not in data:
            continue
        value = data[key]
        _want(source, key, isinstance(value, str) and value.strip() != "",
              f"the name of the rows' key holding the {part}", value)
        if value in by_name:
            raise ConfigFileError(f"{source}: key {key!r}: expected a row key of its own, found "
                                  f"{json.dumps(value)}, which {by_name[value]!r} names too")
        by_name[value] = key
        if value != part:
            pairs.append(f"{part}={value}")
    return tuple(pairs)


def _model(model: Any, source: str) -> str:
    """model: a GGUF path, a store name (ollama:, lmstudio:, hf:), or USER/REPO (hf:USER/REPO:
    its Q4_K_M GGUF, as llama.cpp's -hf)."""
    _want(source, "model", isinstance(model, str) and model, "a GGUF file or a model name",
          model)
    if ":" in model or Path(model).exists():
        return model
    if (Path(source).parent / model).exists() and not Path(model).is_absolute():
        raise _not_found(source, "model", model, "a GGUF file or a model name")
    if model.lower().endswith(".gguf"):  # refused by the recipe, named by this key
        return model
    if is_hf_repo(model):
        return "hf:" + model
    return model


def _data(data: Any, source: str) -> str:
    """data: a local folder in mlx-lm's layout (train.jsonl, valid.jsonl, test.jsonl)."""
    _want(source, "data", isinstance(data, str) and data, "a data folder", data)
    if Path(data).exists():
        return data
    # a folder named with a slash (mlx-lm's default `data/`) is no dataset name
    if is_hf_repo(data) and not (Path(source).parent / data).exists():
        raise _hub_dataset(source, "data", data)
    raise _not_found(source, "data", data, "a data folder (train.jsonl, valid.jsonl, test.jsonl)")


def _not_found(source: str, key: str, value: str, expected: str) -> ConfigFileError:
    """A path in the file that names nothing: a relative one is read from the current
    directory, as mlx-lm reads it, not from the file's folder (named when it holds one)."""
    where = "" if Path(value).is_absolute() else (
        f" (a relative path is read from the current directory, {Path.cwd()}, as mlx-lm reads "
        "it, not from the file's folder")
    beside = Path(source).parent / value
    if where and beside.exists() and Path(source).parent.resolve() != Path.cwd().resolve():
        where += f"; give {beside}, or run from {Path(source).parent}"
    return ConfigFileError(f"{source}: key {key!r}: expected {expected}, found nothing at "
                           f"{value}{where + ')' if where else ''}")


def _hf_dataset(value: Any, source: str) -> None:
    """hf_dataset: mlx-lm's Hugging Face datasets ({path, ...} or a list of them), which toymlx
    does not download: refused, naming the first dataset's path (unless --data.path is given:
    a note, in `mlx_lm_options`)."""
    first = value[0] if isinstance(value, list) and value else value
    path = first.get("path") if isinstance(first, dict) else None
    _want(source, "hf_dataset", isinstance(path, str) and path, "a mapping with path (a "
          "Hugging Face dataset name), or a list of them", value)
    raise _hub_dataset(source, "hf_dataset", path)


def _report_to(value: Any, source: str) -> str:
    """report_to: mlx-lm's comma list (wandb, swanlab), read by --report-to's own parser (the
    same names: tensorboard, wandb, all, none)."""
    from toymlx.bundle.reporters import parse_report_to

    _want(source, "report_to", isinstance(value, str), "a comma list of services", value)
    try:
        parse_report_to(value, f"{source}: key 'report_to'")
    except ValueError as e:
        raise ConfigFileError(str(e)) from None
    return value


def _test_batches(data: dict[str, Any], test: Any, source: str) -> list[str]:
    """test_batches: mlx-lm's test pass scores N of its batches, drawn at random (its
    iterate_batches; -1: all of them); toymlx's --test has no cap and scores all of test.jsonl.
    -1 is honoured; another N, or the file leaving it to mlx-lm's default (500), is noted when
    test is true (unused otherwise, as in mlx-lm): it changes what is scored, not what is
    trained, so the file runs as it is."""
    n = data.get("test_batches", -1)
    _want(source, "test_batches", _int(n) and (n >= 1 or n == -1),
          "an integer >= 1, or -1 (every batch)", n)
    if test is not True or ("test_batches" in data and n == -1):
        return []
    key, n = ("test_batches", n) if "test_batches" in data else ("test", 500)
    return [f"{source}: key {key!r}: toymlx's --test scores all of test.jsonl; mlx-lm scores at "
            f"most {n} of its batches, drawn at random ("
            + ("test_batches' default; " if key == "test" else "") + "-1 is every batch)"]


def mlx_lm_mask_prompt(cfg: Any, source: str) -> None:
    """ConfigFileError (one line) for mask_prompt true on text data ({"text": ...} rows, or a
    plain-text file): mlx-lm refuses it ("Prompt masking not supported for text dataset"),
    where toymlx's lora recipe would train every token of it. Each split file's first example
    alone is read (`text_rows_file`): the recipe reads all of train.jsonl once, after this."""
    from toymlx.data.chat import row_keys, text_rows_file

    if not cfg.data.mask_prompt or not cfg.data.path:
        return
    text = text_rows_file(cfg.data.path, row_keys(cfg.data.keys),
                          ("train", "valid", "test") if cfg.test else ("train", "valid"))
    if text is not None:
        raise ConfigFileError(f"{source}: key 'mask_prompt': expected false for text data "
                              f"({text} holds {{'text': ...}} rows, no prompt and completion "
                              "or messages; mlx-lm refuses prompt masking on a text dataset), "
                              "found true")


def _resume_adapter(value: Any, source: str) -> None:
    """resume_adapter_file: mlx-lm's adapters.safetensors (adapter_config.json beside it), an
    adapter GGUF (toymlx's or llama.cpp's) or a toymlx run folder: --lora.init-adapter, whose
    loader reads and checks it against the base and the run's rank, scale and keys."""
    _want(source, "resume_adapter_file", isinstance(value, str) and value, "an adapter file "
          "(mlx-lm's adapters.safetensors, or an adapter GGUF)", value)


def _hub_dataset(source: str, key: str, name: str) -> ConfigFileError:
    """The one line for a Hugging Face dataset named in `key`: give a local folder instead."""
    return ConfigFileError(
        f"{source}: key {key!r}: expected a local folder with train.jsonl (toymlx reads no "
        f"Hugging Face datasets, and needs no network), found the dataset name {name!r}; "
        f"download it where there is a network (hf download --repo-type dataset {name} "
        f"--local-dir DIR) and give data: DIR")


_FLAG_VALUE_LINE = re.compile(r"(?P<flag>--[a-z][a-z0-9.-]*) (?P<value>\S+?)(?P<rest>: .*)",
                              re.DOTALL)
"""A line refusing an option's value, named after the flag: `--base hf:USER/REPO: not in the
Hugging Face cache ...` (a `model` the file gives as a Hugging Face repository)."""
_RUN_FOLDER_ADVICE = re.compile(r"choose another (?:--run-id(?: or --runs-root)?|--runs-root/"
                                r"--run-id)$")
"""The advice closing a line that refuses the run's folder (`toymlx.bundle.folder`: `runs/x:
run bundle already exists; ..., or choose another --run-id`): the flags adapter_path sets."""


def flags_given(argv: list[str]) -> dict[str, Any]:
    """The command line's flags and their values as text (`--steps 2`, `--steps=2`; True for
    a flag without one)."""
    given: dict[str, Any] = {}
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag.startswith("--"):
            given[flag] = value if eq else (argv[i + 1] if i + 1 < len(argv)
                                            and not argv[i + 1].startswith("--") else True)
    return given


def over_the_file(rows: list[tuple], given: dict[str, Any],
                  origin: str = "command line, over the file") -> list[tuple]:
    """The mlx-lm table's rows with the options the command line also gives (`given`) shown as
    given there (`--base GGUF -c F`: the GGUF, not the file's `model:`), as tyro will apply
    them; `origin`: what the table says gave them."""
    return [(k, o, given[o], origin) if o in given else (k, o, v, f) for k, o, v, f in rows]


def mlx_lm_read(in_file: dict[str, Any], source: str, argv: list[str]
                ) -> tuple[dict[str, Any], list[tuple[str, str, Any, str]], list[str]]:
    """What `toymlx-train -c SOURCE ARGV` reads from an mlx-lm file before it parses the
    options: (toymlx options as dotted keys, the table's rows with ARGV's flags over the file,
    the notes), as `mlx_lm_options`, `mlx_lm_model` and `mlx_lm_rank_given` give them. One
    reading for toymlx-train and for each run of toymlx-sweep -c SOURCE (ARGV: the run's
    flags, its grid values among them), so that a sweep's run is that command's."""
    flags = frozenset(a.partition("=")[0] for a in argv if a.startswith("--"))
    options, rows, notes = mlx_lm_options(in_file, source, flags)
    # after the keys' own checks: `modle` named as a misspelt key, not as no model
    mlx_lm_model(in_file, source, flags)
    given = flags_given(argv)
    options, rows = mlx_lm_rank_given(options, rows, None if "--lora.alpha" in given
                                      else given.get("--lora.rank"))
    return options, over_the_file(rows, given), notes


def mlx_lm_parsed(cfg: Any, in_file: dict[str, Any], source: str, argv: list[str]
                  ) -> tuple[Any, list[str]]:
    """(cfg, notes) of an mlx-lm file's options once parsed with ARGV over them (`mlx_lm_read`):
    num_layers with mlx-lm's meaning against the base (`mlx_lm_layers`; a --lora.layers or
    --full.layers flag keeps toymlx's), then mask_prompt and lora_parameters.keys checked against
    the data and the base (ConfigFileError), where ARGV does not give their options."""
    notes = []
    flags = flags_given(argv)
    if mlx_lm_layers_flag(cfg) not in flags:
        cfg, note = mlx_lm_layers(cfg)  # the file's num_layers
        if note:
            notes.append(f"{source}: {note}")
    if not {"--data.mask-prompt", "--data.no-mask-prompt"} & set(flags):
        mlx_lm_mask_prompt(cfg, source)
    if "--lora.targets" not in flags:  # else the flag's meaning
        params = in_file.get("lora_parameters")
        mlx_lm_keys(cfg, params.get("keys") if isinstance(params, dict) else None, source)
    if "--eval-batches" not in flags:
        notes += mlx_lm_held_out_rows(cfg, source, in_file.get("test_batches", 500))
    if "--data.val-fraction" not in flags:
        notes += mlx_lm_no_validation(cfg)
    return cfg, notes


def mlx_lm_no_validation(cfg: Any) -> list[str]:
    """The line for a data folder without valid.jsonl, or with one without examples, run from
    an mlx-lm file: every example of its training file is trained on and none validates, as
    mlx-lm does it (`MLX_LM_FIXED`'s --data.val-fraction 0, where toymlx's own default holds
    back a tenth, and refuses an empty valid.jsonl)."""
    from toymlx.data.chat import blank_file, data_files

    path = cfg.data.path
    if cfg.data.val_fraction != 0 or not path or not Path(path).is_dir():
        return []
    try:
        files = data_files(path)
    except ValueError:  # left to the reader, which names it
        return []
    if files.valid is None:
        return [(f"{path}: no valid.jsonl: every example of {files.train.name} is trained on and "
                 "none validates, as in mlx-lm (its \"Validation set not found or empty\"); "
                 "--data.val-fraction 0.1 holds back its last tenth to validate on")]
    if not blank_file(files.valid):
        return []
    return [(f"{files.valid}: no examples: every example of {files.train.name} is trained on "
             "and none validates, as in mlx-lm (its \"Validation set not found or empty\"); "
             "write examples into it to validate on them")]


def mlx_lm_held_out_rows(cfg: Any, source: str, test_batches: Any = 500) -> list[str]:
    """Notes where mlx-lm scores other examples of valid.jsonl (and test.jsonl, with --test)
    than toymlx does. mlx-lm's evaluate (mlx_lm/tuner/trainer.py's iterate_batches) sorts the
    examples by length into whole batches of batch_size (the len % batch_size longest in none;
    fewer examples than batch_size: refused) and scores val_batches of them drawn in a random
    order, anew at each validation; toymlx scores the first val_batches x batch_size in the
    file's order (`toymlx.data.chat.sft_val_batches`), every one with -1, the same at each, and
    all of test.jsonl. `test_batches`: the file's (mlx-lm's default 500; more batches than it
    are said by `_test_batches`' note)."""
    from toymlx.data.chat import data_files

    bs, cap = cfg.batch_size, cfg.eval_batches
    if not cfg.data.path or not Path(cfg.data.path).is_dir() or bs < 1 or (
            cap < 1 and cap != -1):  # a bad count is refused later, naming the key
        return []
    try:
        files = data_files(cfg.data.path)
    except ValueError:  # left to the reader, which names it
        return []
    notes = []
    for split, file, most, verb in (("val_batches", files.valid, cap, "validates on"),
                                    ("test_batches", files.test if cfg.test else None,
                                     test_batches, "scores")):
        if file is None or file.suffix != ".jsonl":
            continue
        try:
            with open(file, "rb") as f:
                n = sum(1 for line in f if line.strip())
        except OSError:
            continue
        whole = n // bs
        drawn = whole if most == -1 else min(most, whole)
        if drawn * bs == n or (split == "test_batches" and drawn < whole):
            continue
        if whole == 0:
            notes.append(f"{source}: key 'batch_size': {file} holds {counted(n, 'example')}, "
                         f"fewer than batch_size {bs}: mlx-lm refuses {'it' if n == 1 else 'them'}"
                         f" (its batches are whole), toymlx {verb} "
                         f"{'it' if n == 1 else f'all {n}'}")
            continue
        head = f"{source}: key {split!r}: {file} holds {counted(n, 'example')}"
        if drawn == whole:
            notes.append(f"{head}: mlx-lm's whole batches of {bs} leave out the {n - whole * bs} "
                         f"longest, toymlx {verb} all {n}")
            continue
        notes.append(f"{head}: mlx-lm validates on {drawn} of its {whole} batches of {bs} "
                     f"examples alike in length ({drawn * bs} examples), drawn anew at each "
                     f"validation; toymlx on the first {min(n, cap * bs)} in the file's order, "
                     "the same each time")
    return notes


def mlx_lm_error(message: str, rows: list[tuple[str, str, Any, str]], source: str) -> str:
    """An error on a toymlx option an mlx-lm key of the file set, naming that key as the file
    has it: a config-file error (`key 'data.mask_prompt'` -> `key 'mask_prompt' (toymlx's
    --data.mask-prompt)`) or a later check's (`--steps: ...` -> `F: key 'iters' (toymlx's
    --steps): ...`; a key the file leaves out is named as mlx-lm's default; a run folder taken,
    `adapter_path`'s, advised as that key, not as the flags). Errors on options no key set, or
    that the command line gives over the file, are unchanged."""
    head = f"{source}: key '"
    path = None
    folder = [r for r in rows if r[0] == "adapter_path" and r[3] == "file"]
    if len(folder) == 2 and (m := _RUN_FOLDER_ADVICE.search(message)):
        said = message[:m.start()].replace(": --runs-root/--run-id:", ":", 1)
        return (f"{source}: key 'adapter_path' (toymlx's --runs-root and --run-id): {said}"
                f"set another adapter_path in {source}")
    if message.startswith(head):
        option, _, rest = message[len(head):].partition("'")
        flag = _flag(option)
    elif m := FLAG_LINE.fullmatch(message):
        option, flag, path, rest = "", m["flag"], m["path"], m["rest"]
    elif (m := _FLAG_VALUE_LINE.fullmatch(message)) and any(
            r[1] == m["flag"] and r[2] == m["value"] for r in rows):
        option, flag, path, rest = "", m["flag"], m["value"], m["rest"]
    else:
        return message
    row = next((r for r in rows if r[1] == flag and r[0] != "(none)"), None)
    if row is None or row[0] == option or (row[3] == "command line, over the file"
                                           and not option):  # the flag's value was refused
        return message
    key, origin = row[0], row[3]
    hint = f"{flag} PATH.gguf"  # the model store's closing advice, in the file's own terms
    if rest.endswith(hint) and origin == "file":
        rest = rest[: -len(hint)] + f"set {key}: PATH.gguf in {source} (or pass {hint})"
    where = (f"mlx-lm's default, not in the file; toymlx's {flag}"
             if origin.startswith("mlx-lm default") else f"toymlx's {flag}")
    return f"{source}: key {key!r} ({where}){': ' + path if path else ''}{rest}"


def mlx_lm_table(rows: list[tuple[str, str, Any, str]]) -> str:
    """The table printed at start: mlx-lm key, toymlx option, value, and where it came from, in
    the caller's words: a `toymlx.train` call's keywords and Python values (`called_by_train`:
    `lora={"alpha": ...}  40.0`, True, "keywords, over the file"), else the flags and JSON
    values (`--lora.alpha  40.0`, true, "command line, over the file")."""
    python = called_by_train()
    head = ("mlx-lm key", "toymlx option", "value", "from")
    cells = [head] + [(a, caller_option(b), c if isinstance(c, str) else
                       repr(c) if python else json.dumps(c), caller_text(d, "lora"))
                      for a, b, c, d in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip()
                     for a, b, c, d in cells)
