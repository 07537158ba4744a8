"""mlx-lm's lora config files read by `toymlx-train -c` with mlx-lm's meaning: every key mapped,
mlx-lm's defaults for the keys left out (checked against mlx_lm/lora.py's own CONFIG_DEFAULTS),
its schedules and LoRA scale checked against mlx-lm's own code, the table printed at start, a
key toymlx cannot honour as one line, and toymlx's own files untouched."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
import yaml
from cli_errors import error_line
from mlx import nn
from mlx_lm import lora as mlx_lm_lora
from mlx_lm.tuner.lora import LoRALinear as MlxLmLoRALinear
from mlx_lm.tuner.utils import build_schedule
from toymlx_cli.config_file import ConfigFileError
from toymlx_cli.mlx_lm_config import (
    MLX_LM_DEFAULTS,
    is_mlx_lm_config,
    mlx_lm_options,
    mlx_lm_table,
)
from toymlx_cli.train import main

from toymlx.bundle.events import read_events
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import write_llama
from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import LoRALinear
from toymlx.recipes import lora
from toymlx.training import optimizers

CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    mx.random.seed(3)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    meta = byte_tokenizer().to_metadata()
    meta["tokenizer.chat_template"] = CHATML
    write_llama(path, Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                 context=256)), meta, name="tiny test llama")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A data folder in mlx-lm's layout (WikiSQL's shape: prompt/completion rows)."""
    root = tmp_path_factory.mktemp("wikisql")
    for split, n in (("train", 12), ("valid", 4), ("test", 4)):
        rows = [{"prompt": f"table: t{i}\nQ: how many rows in t{i}?",
                 "completion": f"SELECT COUNT(*) FROM t{i}"} for i in range(n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_the_defaults_are_mlx_lm_s_own():
    for key, value in MLX_LM_DEFAULTS.items():
        assert mlx_lm_lora.CONFIG_DEFAULTS[key] == value, key


def test_a_config_run_trains_as_mlx_lm_reads_it(tmp_path, base, data, capsys):
    cfg = {"model": str(base), "train": True, "data": str(data), "iters": 3, "batch_size": 2,
           "learning_rate": 1e-4, "num_layers": 1, "steps_per_eval": 3, "val_batches": 1,
           "max_seq_length": 64, "save_every": 3, "test_batches": 2,
           "adapter_path": str(tmp_path / "runs" / "r"),
           "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0,
                               "keys": ["self_attn.q_proj", "mlp.down_proj"]}}
    path = tmp_path / "mlx_lm_lora_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    assert "test_batches" not in err  # test is false: unused, as in mlx-lm
    lines = out.splitlines()
    assert lines[0] == f"{path}: read as mlx-lm's lora config:"
    assert lines[1].split() == ["mlx-lm", "key", "toymlx", "option", "value", "from"]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[2:]}
    assert rows[("learning_rate", "--lr")] == ["0.0001", "file"]
    assert rows[("lora_parameters.scale", "--lora.alpha")] == ["40.0", "file"]
    assert rows[("mask_prompt", "--data.mask-prompt")] == ["false", "mlx-lm", "default"]
    assert rows[("(none)", "--grad-clip")] == ["0.0", "mlx-lm's,", "fixed"]
    assert rows[("(none)", "--data.train-turns")] == ["last", "mlx-lm's,", "fixed"]
    assert rows[("(none)", "--weight-decay-scope")] == ["all", "mlx-lm's,", "fixed"]
    assert rows[("(none)", "--eval-at-start")] == ["true", "mlx-lm's,", "fixed"]
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    want = {"steps": 3, "lr": 1e-4, "batch_size": 2, "seq_len": 63, "eval_every": 3,
            "eval_batches": 1, "checkpoint_every": 3, "report_every": 10, "seed": 0,
            "optimizer": "adam", "lr_schedule": "constant", "beta1": 0.9, "beta2": 0.999,
            "warmup": 0, "grad_clip": 0.0, "weight_decay": 0.0, "grad_accum": 1,
            "fine_tune_type": "lora", "base": str(base), "test": False,
            "weight_decay_scope": "all", "eval_at_start": True}
    assert {k: saved[k] for k in want} == want
    assert saved["lora"] == {"rank": 4, "alpha": 40.0, "dropout": 0.0, "targets": "q,down",
                             "layers": 1, "init_adapter": None}
    assert saved["data"]["pack"] is False and saved["data"]["mask_prompt"] is False
    assert saved["data"]["train_turns"] == "last"
    events = read_events(tmp_path / "runs" / "r")
    assert [e["lr"] for e in events if e["kind"] == "step"] == pytest.approx([1e-4] * 3,
                                                                            rel=1e-6)
    assert [e["step"] for e in events if e["kind"] == "eval"] == [0, 3]


def test_the_table_shows_what_the_command_line_gives_over_the_file(tmp_path, base, data,
                                                                   capsys):
    """`toymlx-train --base GGUF -c F` with F's `model:` an mlx-lm folder (the side-by-side
    benchmark's file): the table names the GGUF that is trained, not the file's folder."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(tmp_path / "mlx_model"), "data": str(data),
                                    "iters": 1, "batch_size": 2, "max_seq_length": 64,
                                    "num_layers": 1, "val_batches": 1}))
    assert main(["--base", str(base), "-c", str(path), "--steps=1", "--no-progress",
                 "--no-compile", "--runs-root", str(tmp_path / "runs"), "--run-id", "r"]) == 0
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in capsys.readouterr().out.splitlines()}
    assert rows[("model", "--base")] == [str(base), "command", "line,", "over", "the", "file"]
    assert rows[("iters", "--steps")] == ["1", "command", "line,", "over", "the", "file"]
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    assert saved["base"] == str(base)


def test_a_rank_given_over_the_file_keeps_mlx_lm_s_scale(tmp_path, base, data, capsys):
    """`-c F --lora.rank 2` over the file's scale 10 (or mlx-lm's default 20): alpha is scale x
    2, so the update is scaled by the file's scale, as mlx-lm's scale is whatever the rank;
    alpha was the file's rank's (4 x 10 = 40: a scale of 20 at rank 2)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 1,
                                    "batch_size": 2, "max_seq_length": 64, "num_layers": 1,
                                    "val_batches": 1, "lora_parameters": {
                                        "rank": 4, "scale": 10.0, "dropout": 0.0}}))
    assert main(["-c", str(path), "--lora.rank", "2", "--no-progress", "--no-compile",
                 "--runs-root", str(tmp_path / "runs"), "--run-id", "r"]) == 0
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in capsys.readouterr().out.splitlines()}
    assert rows[("lora_parameters.rank", "--lora.rank")] == ["2", "command", "line,", "over",
                                                            "the", "file"]
    assert rows[("lora_parameters.scale", "--lora.alpha")] == ["20.0", "file", "scale", "10",
                                                              "x", "--lora.rank", "2"]
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    assert (saved["lora"]["rank"], saved["lora"]["alpha"]) == (2, 20.0)
    # --lora.alpha given too is toymlx's alpha, as it is typed
    assert main(["-c", str(path), "--lora.rank=2", "--lora.alpha", "7", "--no-progress",
                 "--no-compile", "--runs-root", str(tmp_path / "runs"), "--run-id", "r2"]) == 0
    saved = json.loads((tmp_path / "runs" / "r2" / "config.json").read_text())["config"]
    assert (saved["lora"]["rank"], saved["lora"]["alpha"]) == (2, 7.0)


def test_adapter_path_says_what_the_folder_holds_and_what_reads_it():
    """mlx-lm's adapter_path is the run folder, whose GGUF adapters mlx_lm.generate
    --adapter-path does not read (it looks for adapter_config.json): a note says what does."""
    options, _, notes = mlx_lm_options({"model": "m.gguf", "iters": 1,
                                        "adapter_path": "out/adapters"}, "f.yaml")
    assert (options["runs_root"], options["run_id"]) == ("out", "adapters")
    assert notes == [("f.yaml: key 'adapter_path': out/adapters is the run's folder; its "
                      "adapters are llama.cpp's GGUFs (weights/adapter_step_N.gguf), not "
                      "mlx-lm's adapters.safetensors: toymlx-generate --model out/adapters, or "
                      "toymlx-export --adapter out/adapters --fuse --out FILE.gguf "
                      "(mlx_lm.fuse's)")]
    # a full fine-tune's checkpoints are whole models: toymlx-export --adapter RUN refuses
    # them (before, the note sent the user there)
    _, _, notes = mlx_lm_options({"model": "m.gguf", "iters": 1, "fine_tune_type": "full",
                                  "adapter_path": "out/full"}, "f.yaml")
    assert notes == [("f.yaml: key 'adapter_path': out/full is the run's folder; its checkpoints "
                      "are whole models in llama.cpp's GGUF (weights/step_N.gguf), not mlx-lm's "
                      "adapters.safetensors: toymlx-generate --model out/full, or toymlx-export "
                      "--base out/full --out FILE.gguf (mlx_lm.fuse's)")]


def test_a_relative_path_is_read_from_the_current_directory_and_named(tmp_path,
                                                                     monkeypatch):
    """model and data relative to the file's folder, run from elsewhere: as in mlx-lm, read from
    the current directory, and the line says so and names the file's folder's path (before:
    "d: cannot read data file (No such file or directory)", no key); a data folder found
    nowhere is named by its key."""
    folder = tmp_path / "cfg"
    (folder / "d").mkdir(parents=True)
    (folder / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    source = str(Path("cfg") / "c.yaml")
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"model": "/abs/m.gguf", "data": "d", "iters": 1}, source)
    assert str(e.value) == (
        "cfg/c.yaml: key 'data': expected a data folder (train.jsonl, valid.jsonl, test.jsonl), "
        f"found nothing at d (a relative path is read from the current directory, {tmp_path}, "
        "as mlx-lm reads it, not from the file's folder; give cfg/d, or run from cfg)")
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"model": "m.gguf", "iters": 1}, source)
    assert str(e.value) == (
        "cfg/c.yaml: key 'model': expected a GGUF file or a model name, found nothing at m.gguf "
        f"(a relative path is read from the current directory, {tmp_path}, as mlx-lm reads it, "
        "not from the file's folder; give cfg/m.gguf, or run from cfg)")
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"data": "/no/such/data", "iters": 1}, source)
    assert str(e.value) == ("cfg/c.yaml: key 'data': expected a data folder (train.jsonl, "
                            "valid.jsonl, test.jsonl), found nothing at /no/such/data")
    # from the file's folder, or with --base and --data.path given over them, they are read
    monkeypatch.chdir(folder)
    options, _, _ = mlx_lm_options({"model": "m.gguf", "data": "d", "iters": 1}, "c.yaml")
    assert (options["base"], options["data.path"]) == ("m.gguf", "d")
    monkeypatch.chdir(tmp_path)
    options, _, _ = mlx_lm_options({"model": "m.gguf", "data": "d", "iters": 1}, source,
                                   frozenset({"--base", "--data.path"}))
    assert (options["base"], options["data.path"]) == ("m.gguf", "d")


def test_a_missing_folder_named_with_a_slash_is_no_hugging_face_name(tmp_path, monkeypatch):
    """`data: data/` (mlx-lm's own default) or `./data`, not there: a missing data folder,
    named so; `data/` was taken for the Hugging Face dataset 'data/' (and `hf download
    --repo-type dataset data/` offered), `model: ./model` for the repository hf:./model. A
    USER/REPO name is still one."""
    monkeypatch.chdir(tmp_path)
    for data in ("data/", "./data"):
        with pytest.raises(ConfigFileError) as e:
            mlx_lm_options({"data": data, "iters": 1}, "c.yaml")
        assert str(e.value) == (
            "c.yaml: key 'data': expected a data folder (train.jsonl, valid.jsonl, test.jsonl), "
            f"found nothing at {data} (a relative path is read from the current directory, "
            f"{tmp_path}, as mlx-lm reads it, not from the file's folder)")
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"data": "user/set", "iters": 1}, "c.yaml")
    assert "found the dataset name 'user/set'" in str(e.value)
    bases = [mlx_lm_options({"model": m, "iters": 1}, "c.yaml")[0]["base"]
             for m in ("./model", "models/", "user/repo")]
    assert bases == ["./model", "models/", "hf:user/repo"]


def test_num_layers_past_the_base_s_blocks_adapts_every_block(tmp_path, base, data, capsys):
    """mlx-lm's default 16 on this 2-block base (and any larger count) is every block, where it
    was refused as "--lora.layers: expected 1..2"; the note says mlx-lm 0.32 refuses it (it
    said mlx-lm adapts layers[-16:], but train_model raises past the model's blocks); toymlx's
    own --lora.layers keeps its check."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 1,
                                    "batch_size": 2, "max_seq_length": 32, "val_batches": 1}))
    runs = ["--runs-root", str(tmp_path / "runs"), "--no-progress", "--no-compile"]
    assert main(["-c", str(path), *runs, "--run-id", "r"]) == 0
    assert (f"toymlx-train: {path}: num_layers 16: every block of the base's 2 (mlx-lm refuses "
            "more than the base's 2)") in capsys.readouterr().err.splitlines()
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    assert saved["lora"]["layers"] is None
    (start,) = [e for e in read_events(tmp_path / "runs" / "r") if e["kind"] == "run_start"]
    assert start["model"]["lora_layers"] == 2
    assert main(["-c", str(path), *runs, "--run-id", "t", "--lora.layers", "16"]) == 2
    assert error_line(capsys) == ("toymlx-train: error: --lora.layers: expected 1..2 (the "
                                  "base's block count) or unset for all, found 16")


@pytest.mark.parametrize("num_layers,trained,note", [
    (None, [0, 1], ("num_layers 16: every block of the base's 2 trained, the embeddings, "
                    "final norm and head frozen (mlx-lm refuses more than the base's 2)")),
    (-1, [0, 1], ("num_layers -1: every block of the base's 2 trained, the embeddings, final "
                  "norm and head frozen (mlx-lm trains every block for -1)")),
    (0, [0, 1], ("num_layers 0: every block of the base's 2 trained, the embeddings, final "
                 "norm and head frozen (mlx-lm trains every block for 0)")),
    (1, [1], None),
])
def test_a_full_fine_tune_trains_mlx_lm_s_blocks(tmp_path, base, data, capsys, num_layers,
                                                 trained, note):
    """fine_tune_type full trains what mlx-lm's does, `layers[-max(num_layers, 0):]` of the
    base's blocks (its default 16, clamped as for LoRA): those blocks' tensors move, the
    embeddings, the final norm and every other block stay the base's bit for bit. It was refused
    unless num_layers was -1 (toymlx's full trained every weight)."""
    from toymlx.gguf.reader import GGUFFile

    cfg = {"model": str(base), "data": str(data), "fine_tune_type": "full", "iters": 2,
           "batch_size": 2, "max_seq_length": 32, "val_batches": 1, "learning_rate": 1e-3,
           **({"num_layers": num_layers} if num_layers is not None else {})}
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs"), "--run-id", "r",
                 "--no-progress", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in out.splitlines()}
    assert rows[("num_layers", "--full.layers")][0] == str(16 if num_layers is None else num_layers)
    notes = [x for x in err.splitlines() if "num_layers" in x]
    assert notes == ([f"toymlx-train: {path}: {note}"] if note else [])
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    assert saved["fine_tune_type"] == "full" and saved["full"] == {"layers": len(trained)}
    b = GGUFFile(base)
    c = GGUFFile(tmp_path / "runs" / "r" / "weights" / "step_2.gguf")
    moved = {n for n in b.tensors if not np.array_equal(b.load(n, np.float32),
                                                        c.load(n, np.float32))}
    assert moved == {n for n in b.tensors if n.startswith(tuple(f"blk.{i}." for i in trained))}
    assert {"token_embd.weight", "output_norm.weight"} & moved == set()


def test_the_lora_scale_is_mlx_lm_s_scale():
    """mlx-lm's `scale` 20 with rank 8 is toymlx's alpha 160: the same layer output."""
    mx.random.seed(0)
    lin = nn.Linear(16, 12, bias=False)
    ours = LoRALinear.from_base(lin, rank=8, alpha=20.0 * 8)
    theirs = MlxLmLoRALinear.from_base(lin, r=8, scale=20.0)
    a, b = mx.random.normal((8, 16)) * 0.1, mx.random.normal((12, 8)) * 0.1
    ours.lora_a, ours.lora_b = a, b
    theirs.lora_a, theirs.lora_b = a.T, b.T  # mlx-lm keeps them (in, r) and (r, out)
    x = mx.random.normal((3, 16))
    np.testing.assert_allclose(np.array(ours(x)), np.array(theirs(x)), rtol=1e-5, atol=1e-6)


def _cfg(**kw) -> lora.Config:
    options, _, _ = mlx_lm_options({"model": "m.gguf", **kw}, "f.yaml")
    cfg = lora.Config()
    for key, value in options.items():
        holder = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            holder = getattr(holder, p)
        setattr(holder, leaf, tuple(value) if isinstance(value, list) else value)
    return cfg


def test_schedules_are_mlx_lm_s():
    sched = {"name": "cosine_decay", "warmup": 5, "warmup_init": 1e-7,
             "arguments": [1e-5, 100, 1e-7]}
    ours, theirs = lora.schedule(_cfg(lr_schedule=sched)), build_schedule(sched)
    for step in (0, 1, 4, 5, 6, 50, 104, 200):
        assert float(ours(mx.array(step))) == float(theirs(mx.array(step))), step
    const = lora.schedule(_cfg(learning_rate=3e-4))
    assert [float(const(mx.array(s))) for s in (0, 99)] == [float(np.float32(3e-4))] * 2


def test_a_learning_rate_beside_a_schedule_is_noted_as_unused():
    """mlx-lm takes lr_schedule over learning_rate without a word; so did toymlx (its --lr row
    replaced in the table): a note now names the key and the lr the schedule sets."""
    sched = {"name": "cosine_decay", "arguments": [1e-4, 100]}
    options, _, notes = mlx_lm_options({"model": "m.gguf", "iters": 1, "learning_rate": 1e-3,
                                        "lr_schedule": sched}, "f.yaml")
    assert options["lr"] == 1e-4
    assert notes == [("f.yaml: key 'learning_rate': 0.001 not used: lr_schedule sets the lr "
                      "(its first argument, 0.0001), as in mlx-lm")]
    _, _, notes = mlx_lm_options({"model": "m.gguf", "iters": 1, "learning_rate": 1e-4,
                                  "lr_schedule": sched}, "f.yaml")
    assert notes == []  # the same lr: nothing lost


def test_trust_remote_code_false_is_not_called_unhonoured():
    """mlx-lm's adapter_config.json (and a file copied from CONFIG_DEFAULTS) says
    trust_remote_code: false, which toymlx honours by running no repository code: it was noted
    "not honoured" all the same; true still is."""
    base = {"model": "m.gguf", "iters": 1}
    assert mlx_lm_options({**base, "trust_remote_code": False}, "f.yaml")[2] == []
    assert mlx_lm_options({**base, "trust_remote_code": True}, "f.yaml")[2] == [(
        "f.yaml: key 'trust_remote_code': not honoured (toymlx runs no model code from a "
        "repository)")]


def test_an_older_mlx_lm_adapter_config_reads_as_mlx_lm_0_32_reads_it():
    """An adapter_config.json of older mlx-lm (its ORPO era: CONFIG_DEFAULTS had training_mode
    normal, beta 0.1, reward_scaling 1.0 and lora_parameters alpha 16 beside scale 10, all
    saved) was refused: 'training_mode', an unknown key; then lora_parameters.alpha. mlx-lm
    0.32 ignores those keys and scales its LoRA layers by scale alone; toymlx reads them so:
    training_mode normal (supervised, what toymlx trains) and the ORPO settings at their saved
    values quietly, alpha beside scale noted as not used, another training_mode refused."""
    import mlx.nn as mlx_nn
    from mlx_lm.tuner.utils import linear_to_lora_layers

    params = {"rank": 8, "alpha": 16, "dropout": 0.0, "scale": 10.0}
    old = {"model": "m.gguf", "train": True, "iters": 2, "training_mode": "normal", "beta": 0.1,
           "reward_scaling": 1.0, "lora_parameters": params}
    options, _, notes = mlx_lm_options(old, "adapter_config.json")
    assert (options["lora.rank"], options["lora.alpha"]) == (8, 80.0)  # scale 10 x rank 8
    assert notes == [("adapter_config.json: key 'lora_parameters.alpha': not used (mlx-lm "
                      "scales the update by scale, 10.0, and ignores alpha, 16; toymlx's "
                      "--lora.alpha is scale x rank)")]

    class Block(mlx_nn.Module):  # mlx-lm 0.32's own LoRA layers on such a file: scale alone
        def __init__(self):
            super().__init__()
            self.q_proj = mlx_nn.Linear(4, 4)

    class Model(mlx_nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block()]

    model = Model()
    linear_to_lora_layers(model, 1, {**params, "keys": ["q_proj"]})
    assert model.layers[0].q_proj.scale == options["lora.alpha"] / options["lora.rank"]
    assert mlx_lm_options({**old, "beta": 0.5}, "f.yaml")[2][0] == (
        "f.yaml: key 'beta': not used (older mlx-lm's ORPO setting, which mlx-lm 0.32 ignores)")
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({**old, "training_mode": "orpo"}, "f.yaml")
    assert str(e.value) == (
        "f.yaml: key 'training_mode': expected normal (older mlx-lm's supervised training, what "
        "toymlx trains; it has no DPO or ORPO, and mlx-lm 0.32 reads no training_mode), found "
        "\"orpo\"")


def test_clear_cache_threshold_zero_is_not_called_unhonoured():
    """mlx-lm's adapter_config.json saves clear_cache_threshold: 0 (its flag's default: never
    clear the cache), which toymlx does too: every run from such a file was noted "not
    honoured"; a threshold still is."""
    base = {"model": "m.gguf", "iters": 1}
    assert mlx_lm_lora.build_parser().parse_args([]).clear_cache_threshold == 0
    assert mlx_lm_options({**base, "clear_cache_threshold": 0}, "f.yaml")[2] == []
    assert mlx_lm_options({**base, "clear_cache_threshold": 1000000}, "f.yaml")[2] == [(
        "f.yaml: key 'clear_cache_threshold': not honoured (toymlx manages MLX's cache itself)")]


def test_the_optimizers_are_mlx_lm_s():
    opt = lora.make_optimizer(_cfg())
    # MLX's Adam, its update computed as three one-output kernels (toymlx.training.optimizers)
    assert type(opt) is optimizers.Adam and isinstance(opt, optim.Adam)
    assert opt.betas == [0.9, 0.999] and opt.eps == 1e-8
    adamw = lora.make_optimizer(_cfg(optimizer="adamw"))
    assert [o.weight_decay for o in adamw.optimizers] == [0.01, 0.0]  # MLX's AdamW default
    tuned = _cfg(optimizer="adamw", optimizer_config={"adamw": {"betas": [0.8, 0.9],
                                                                "weight_decay": 0.05}})
    assert (tuned.beta1, tuned.beta2, tuned.weight_decay) == (0.8, 0.9, 0.05)
    for name, cls in (("sgd", optim.SGD), ("adafactor", optim.Adafactor), ("muon", optim.Muon)):
        assert type(lora.make_optimizer(_cfg(optimizer=name))) is cls
    assert _cfg().lora.targets == "mlx-lm-default" and _cfg().lora.layers == 16
    assert _cfg(num_layers=-1).lora.layers is None


@pytest.mark.parametrize("extra,line", [
    ({"data": "mlx-community/WikiSQL"},
     ("f.yaml: key 'data': expected a local folder with train.jsonl (toymlx reads no Hugging "
      "Face datasets, and needs no network), found the dataset name 'mlx-community/WikiSQL'; "
      "download it where there is a network (hf download --repo-type dataset "
      "mlx-community/WikiSQL --local-dir DIR) and give data: DIR")),
    ({"hf_dataset": {"path": "mlx-community/WikiSQL", "train_split": "train[:80%]"}},
     ("f.yaml: key 'hf_dataset': expected a local folder with train.jsonl (toymlx reads no "
      "Hugging Face datasets, and needs no network), found the dataset name "
      "'mlx-community/WikiSQL'; download it where there is a network (hf download --repo-type "
      "dataset mlx-community/WikiSQL --local-dir DIR) and give data: DIR")),
    ({"lr": 0.1}, ("f.yaml: key 'lr': expected a key of mlx-lm's lora config (the file is read "
                   "as mlx-lm's, for its 'iters'), found an unknown key")),
    ({"lora_parameters": {"rank": 8, "alpha": 16, "dropout": 0.0}},
     ("f.yaml: key 'lora_parameters.alpha': expected rank, scale, dropout or keys (mlx-lm's), "
      "found 'alpha'")),
    ({"lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0,
                          "keys": ["self_attn.q_proj", "lm_head"]}},
     ("f.yaml: key 'lora_parameters.keys': expected module paths of a block (self_attn.q_proj, "
      "self_attn.k_proj, self_attn.v_proj, self_attn.qkv_proj, self_attn.o_proj, "
      "linear_attn.in_proj_qkv, linear_attn.in_proj_z, linear_attn.in_proj_b, "
      "linear_attn.in_proj_a, linear_attn.out_proj, mlp.gate_proj, mlp.up_proj, "
      "mlp.gate_up_proj, mlp.down_proj, mlp.gate, mlp.switch_mlp.gate_proj, "
      "mlp.switch_mlp.up_proj, mlp.switch_mlp.down_proj, block_sparse_moe.gate, "
      "block_sparse_moe.switch_mlp.gate_proj, block_sparse_moe.switch_mlp.up_proj, "
      "block_sparse_moe.switch_mlp.down_proj, per_layer_input_gate, per_layer_projection), "
      "found \"lm_head\"")),
    ({"optimizer": "sgd", "optimizer_config": {"sgd": {"momentum": 0.9}}},
     ("f.yaml: key 'optimizer_config.sgd.momentum': expected no arguments (what toymlx's sgd "
      "takes), found 'momentum'; remove it")),
    # a misspelt key names mlx-lm's closest, as toymlx's own files name the closest flag
    ({"learning_rte": 1e-5}, ("f.yaml: key 'learning_rte': expected a key of mlx-lm's lora "
     "config (the file is read as mlx-lm's, for its 'iters'), found an unknown key; did you "
     "mean learning_rate?")),
    ({"lora_paramters": {"rank": 8}}, ("f.yaml: key 'lora_paramters': expected a key of "
     "mlx-lm's lora config (the file is read as mlx-lm's, for its 'iters'), found an unknown "
     "key; did you mean lora_parameters?")),
    # older mlx-lm's names, which mlx-lm 0.32 ignores (lora_layers: 4 trained 16 blocks), named
    # with today's key, not the closest by spelling (lora_layers: lora_parameters)
    ({"lora_layers": 4}, ("f.yaml: key 'lora_layers': expected a key of mlx-lm's lora config "
     "(the file is read as mlx-lm's, for its 'iters'), found an unknown key; it is older "
     "mlx-lm's, which mlx-lm now ignores: write num_layers")),
    ({"use_dora": True}, ("f.yaml: key 'use_dora': expected a key of mlx-lm's lora config "
     "(the file is read as mlx-lm's, for its 'iters'), found an unknown key; it is older "
     "mlx-lm's, which mlx-lm now ignores: write fine_tune_type: dora")),
    # mlx-lm's data-key names: a key name each, one row key named once
    ({"text_feature": 3}, ("f.yaml: key 'text_feature': expected the name of the rows' key "
     "holding the text, found 3")),
    ({"prompt_feature": "q", "completion_feature": "q"}, ("f.yaml: key 'completion_feature': "
     "expected a row key of its own, found \"q\", which 'prompt_feature' names too")),
])
def test_a_key_toymlx_cannot_honour_is_one_line(extra, line):
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"iters": 10, **extra}, "f.yaml")
    assert str(e.value) == line


def test_data_key_names_are_the_run_s_data_keys():
    """prompt_feature, completion_feature, text_feature and chat_feature name the rows' keys, as
    mlx-lm reads them: --data.keys (they were refused, saying to rename the rows)."""
    opts, rows, _ = mlx_lm_options({"iters": 5, "prompt_feature": "question",
                                    "completion_feature": "answer", "chat_feature": "messages",
                                    "text_feature": "body"}, "f.yaml")
    assert opts["data.keys"] == ["prompt=question", "completion=answer", "text=body"]
    assert ("prompt_feature, completion_feature, text_feature, chat_feature", "--data.keys",
            ["prompt=question", "completion=answer", "text=body"], "file") in rows


def test_a_data_key_name_that_is_toymlx_s_own_changes_nothing():
    """prompt_feature: prompt (mlx-lm's default, as its saved adapter_config.json may hold it)
    names the key toymlx reads: the file maps as without it."""
    names = {"prompt_feature": "prompt", "completion_feature": "completion",
             "text_feature": "text", "chat_feature": "messages"}
    assert mlx_lm_options({"iters": 5, **names}, "f.yaml") == mlx_lm_options({"iters": 5},
                                                                             "f.yaml")


@pytest.mark.parametrize("text,found", [("", "no key"), ("model: null\n", "null")])
def test_a_file_without_a_model_is_one_line_naming_the_key(tmp_path, data, base, capsys, text,
                                                           found):
    """No `model` (or `model: null`, mlx-lm's default) and no --base: one line naming the file's
    key; it was a TypeError traceback from the model store (`mlx_lm_layers`). --base on the
    command line gives the base: the run goes on to its next check."""
    path = tmp_path / "c.yaml"
    path.write_text(f"train: true\ndata: {data}\niters: 1\n{text}")
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'model': expected the path of a GGUF to "
        f"adapter-train, found {found} (mlx-lm's default, Qwen/Qwen3-0.6b, is a Hugging Face "
        f"model, not a GGUF); set model: PATH.gguf in {path} (or pass --base PATH.gguf)")
    assert main(["-c", str(path), "--base", str(base), "--steps", "0", "--runs-root",
                 str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == "toymlx-train: error: --steps: expected >= 1, found 0"
    path.write_text(f"{path.read_text()}modle: {base}\n")  # misspelt: named so, not as no model
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'modle': expected a key of mlx-lm's lora config (the "
        "file is read as mlx-lm's, for its 'iters'), found an unknown key; did you mean model?")


@pytest.mark.parametrize("taken,argv,line", [
    ("others", [], ("{path}: key 'adapter_path' (toymlx's --runs-root and --run-id): {run}: "
     "expected a new or empty folder for the run, found a folder that is not a run bundle, "
     "holding notes.txt; set another adapter_path in {path}")),
    ("file", [], ("{path}: key 'adapter_path' (toymlx's --runs-root and --run-id): {run}: "
     "expected a folder (new or existing), found a file; set another adapter_path in {path}")),
    # the folder the command line names: its flags, as without a file
    ("others", ["--run-id", "r"], ("{run}: expected a new or empty folder for the run, found a "
     "folder that is not a run bundle, holding notes.txt; choose another --run-id or "
     "--runs-root")),
])
def test_an_adapter_path_already_taken_is_named_by_the_file_s_key(tmp_path, base, data, capsys,
                                                                  taken, argv, line):
    """adapter_path sets --runs-root and --run-id: a folder already taken was advised as
    "choose another --run-id or --runs-root", flags the file does not have."""
    run = tmp_path / "runs" / "r"
    if taken == "file":
        run.parent.mkdir()
        run.write_text("")
    else:
        run.mkdir(parents=True)
        (run / "notes.txt").write_text("mine")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 1,
                                    "adapter_path": str(run)}))
    assert main(["-c", str(path), "--no-progress", *argv]) == 2
    assert error_line(capsys) == "toymlx-train: error: " + line.format(path=path, run=run)


def test_a_finished_run_s_file_run_again_names_the_one_command_that_resumes_it(
        tmp_path, base, data, capsys):
    """`-c FILE` run again on its finished run said "pass --resume RUN", and `-c FILE --resume
    RUN` is refused (a resume keeps its saved options): two tries. The refusal now gives the
    whole command, which resumes the run as typed."""
    run = tmp_path / "runs" / "r"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 1,
                                    "batch_size": 2, "max_seq_length": 32, "val_batches": 1,
                                    "adapter_path": str(run)}))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    capsys.readouterr()
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'adapter_path' (toymlx's --runs-root and --run-id): "
        f"{run}: run bundle already exists; continue it with toymlx-train --resume {run}, pass "
        f"--overwrite to replace it, or set another adapter_path in {path}")
    assert main(["--resume", str(run), "--steps", "2", "--no-progress", "--no-compile"]) == 0
    assert [e["step"] for e in read_events(run) if e["kind"] == "step"] == [1, 2]


def test_toymlx_s_own_files_keep_their_meaning(tmp_path, capsys):
    assert not is_mlx_lm_config({"lr": 1e-3, "lora": {"rank": 4}, "data": {"path": "x"},
                                 "seed": 1, "batch_size": 2, "optimizer": "adam"})
    # a lora run's own config.json holds --lr-schedule (a benchmark reads one back with -c)
    assert not is_mlx_lm_config({"lr_schedule": "warmup-cosine", "lr_schedule_args": []})
    assert is_mlx_lm_config({"iters": 5})
    # one mlx-lm key among toymlx's: a toymlx file, its mlx-lm key refused naming toymlx's
    assert not is_mlx_lm_config({"base": "b.gguf", "steps": 1, "learning_rate": 1e-3}, True)
    assert is_mlx_lm_config({"iters": 1, "learning_rate": 1e-3, "model": "m", "lr": 1}, True)
    f = tmp_path / "c.yaml"
    f.write_text("recipe: lora\nbase: some.gguf\nsteps: 1\nlearning_rate: 1e-3\n")
    assert main(["-c", str(f)]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {f}: key 'learning_rate': expected an "
                                  "option of toymlx-train --recipe lora, found an unknown key; "
                                  "mlx-lm's learning_rate is toymlx's lr")
    assert mlx_lm_options({"model": "u/r"}, "f")[0]["base"] == "hf:u/r"


def test_adam_on_an_mlx_schedule_resumes_exactly(tmp_path, base):
    """A run with mlx-lm's optimizer and schedule, stopped at its checkpoint and resumed, logs
    the straight run's losses and learning rates bit for bit."""
    common = ["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path), "--steps",
              "4", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
              "--checkpoint-every", "2", "--no-progress", "--no-compile", "--optimizer", "adam",
              "--lr-schedule", "cosine_decay", "--lr-schedule-args", "1e-3", "4", "--warmup",
              "1"]
    assert main([*common, "--run-id", "a"]) == 0
    assert main([*common, "--run-id", "b", "--stop-at", "2"]) == 0
    assert main(["--resume", str(tmp_path / "b"), "--no-progress"]) == 0

    def steps(run: str) -> list[tuple]:
        return [(e["step"], e["loss"], e["lr"]) for e in read_events(tmp_path / run)
                if e["kind"] == "step"]
    assert steps("a") == steps("b")
    # warm-up from 0 for 1 step, then MLX's cosine_decay(1e-3, 4) from its step 0 (float32)
    assert [s[2] for s in steps("a")] == pytest.approx(
        [0.0, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + np.cos(np.pi / 4))], rel=1e-6)


class _AsHuggingFace:
    """toymlx's tokenizer behind the calls mlx-lm's datasets make on a Hugging Face one:
    `encode` (its special tokens, as HF's add_special_tokens=True), `eos_token_id`, and
    `apply_chat_template` (HF's defaults: no generation prompt, ids without BOS)."""

    def __init__(self, tok):
        self.tok, self.eos_token_id = tok, tok.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False,
                            return_dict=False) -> list[int]:
        text = self.tok.apply_chat_template(list(messages),
                                            add_generation_prompt=add_generation_prompt)
        return list(self.tok.encode(text, add_bos=False))


@pytest.mark.parametrize("renamed", [False, True])
@pytest.mark.parametrize("shape", ["text", "completions"])
def test_a_data_folder_trains_mlx_lm_s_own_token_ids(tmp_path, shape, renamed):
    """The ids and trained targets toymlx's rows hold for an mlx-lm data folder equal those of
    mlx-lm's own dataset (mlx_lm.tuner.datasets.load_local_dataset: EOS appended to text rows,
    a completion's chat template with --mask-prompt's offset), row for row in file order; the
    one target mlx-lm's default_loss counts past a row's end (the pad id after EOS) is the only
    difference, and it is left out (docs/RESULTS.md, session 16). Rows under other keys, named
    by mlx-lm's text_feature, prompt_feature and completion_feature (`--data.keys`), as
    mlx-lm reads them; a row's own "prompt" beside them is not read, as mlx-lm does not."""
    from mlx_lm.tuner.datasets import load_local_dataset

    from toymlx.data.chat import SFTData, row_keys
    from toymlx.data.tokenizer import Tokenizer, byte_metadata

    features = ({"text_feature": "body", "prompt_feature": "question",
                 "completion_feature": "answer"} if renamed else {})
    keys = row_keys(mlx_lm_options({"iters": 1, **features}, "f.yaml")[0].get("data.keys", ()))
    assert keys == ({"text": "body", "prompt": "question", "completion": "answer"}
                    if renamed else {})

    meta = byte_metadata()
    meta["tokenizer.chat_template"] = CHATML
    tok = Tokenizer(meta, source="test")
    rows = [("table: 1-10015132-11\ncolumns: Player, No., Nationality\nQ: Who is number 21?",
             "SELECT Player FROM 1-10015132-11 WHERE No. = '21'"),
            ("table: t\ncolumns: Städte, Größe\nQ: Wie groß ist Köln?", "SELECT Größe FROM t"),
            ("Q: one", "A")]
    for split in ("train", "valid", "test"):
        recs = ([{"text": f"{p}\nA: {c}"} for p, c in rows] if shape == "text" else
                [{"prompt": p, "completion": c} for p, c in rows])
        if renamed:
            recs = [{keys.get(k, k): v for k, v in r.items()} | {"prompt": "not read"}
                    for r in recs]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    mask_prompt = shape == "completions"
    import argparse

    theirs, _, _ = load_local_dataset(tmp_path, _AsHuggingFace(tok),
                                      argparse.Namespace(mask_prompt=mask_prompt, **features))
    ours = SFTData.from_file(tmp_path, tok, 256, mask_prompt=mask_prompt, pack=False,
                             keys=keys).train
    assert len(ours["inputs"]) == len(theirs) == len(rows)
    for r in range(len(rows)):
        ids, offset = theirs.process(theirs[r])
        n = len(ids)
        assert ids[-1] == tok.eos_id
        got = [int(ours["inputs"][r, 0])] + ours["targets"][r, :n - 1].tolist()
        assert got == ids, r
        # mlx-lm trains token i for offset <= i <= n - 1 (and its pad at n); toymlx's mask is
        # on targets: target j is token j + 1
        trained = [j + 1 for j in np.flatnonzero(ours["mask"][r])]
        assert trained == list(range(max(offset, 1), n)), r


def test_grad_accumulation_counts_mlx_lm_s_micro_batches(tmp_path, base, data, capsys):
    """mlx-lm's iters, steps_per_eval, steps_per_report and save_every count micro-batches (its
    loop's `it`, an update at `it % grad_accumulation_steps == 0`); toymlx's count optimizer
    steps. A file with grad_accumulation_steps 2 and iters 7 made 7 optimizer steps of 2
    micro-batches (14 batches, twice mlx-lm's run, on a schedule read 7 steps far); it makes
    mlx-lm's 3 updates, at mlx-lm's learning rates."""
    accum, iters = 2, 7
    sched = {"name": "cosine_decay", "warmup": 1, "arguments": [1e-3, 3, 1e-5]}
    cfg = {"model": str(base), "data": str(data), "iters": iters, "batch_size": 2,
           "grad_accumulation_steps": accum, "steps_per_eval": 4, "save_every": 4,
           "steps_per_report": 3, "val_batches": 1, "max_seq_length": 33, "num_layers": 1,
           "lr_schedule": sched}
    path = tmp_path / "accum.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs"), "--run-id", "r",
                 "--no-progress", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    updates = [it // accum for it in range(1, iters + 1) if it % accum == 0]  # mlx-lm's loop
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["config"]
    assert (saved["steps"], saved["grad_accum"]) == (len(updates), accum) == (3, 2)
    assert (saved["eval_every"], saved["checkpoint_every"], saved["report_every"]) == (2, 2, 1)
    events = read_events(tmp_path / "runs" / "r")
    assert [e["lr"] for e in events if e["kind"] == "step"] == pytest.approx(
        [float(build_schedule(sched)(mx.array(u - 1))) for u in updates], rel=1e-6)
    assert [e["step"] for e in events if e["kind"] == "eval"] == [0, 2, 3]
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in out.splitlines()}
    assert rows[("iters", "--steps")] == ["3", "file", "/", "grad_accumulation_steps", "2"]
    assert [x for x in err.splitlines() if "micro-batch" in x] == [
        (f"toymlx-train: {path}: key 'grad_accumulation_steps': the 2 micro-batches' gradients "
         "are averaged over their targets together (mlx-lm averages each micro-batch's mean)"),
        (f"toymlx-train: {path}: key 'iters': 7 micro-batches are 3 optimizer steps of 2; "
         "mlx-lm's last 1 micro-batch updates nothing and is not drawn"),
        (f"toymlx-train: {path}: key 'steps_per_report': every 3 micro-batches falls inside an "
         "accumulation of 2; toymlx's --report-every is every 1 optimizer step (2 "
         "micro-batches)")]
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"iters": 3, "grad_accumulation_steps": 4}, "f.yaml")
    assert str(e.value) == ("f.yaml: key 'iters': expected an integer >= grad_accumulation_steps "
                            "4 (mlx-lm's iters counts micro-batches: fewer make no update), "
                            "found 3")


def test_a_micro_batch_note_on_a_key_left_out_says_it_is_mlx_lm_s_default():
    """grad_accumulation_steps 3 and nothing else: mlx-lm's defaults iters 1000, steps_per_eval
    200, steps_per_report 10 and save_every 100 fall mid-accumulation. The notes named them as
    `key 'steps_per_report'`, a key the user looks for in the file and does not find; they say
    it is mlx-lm's default, not in the file (a key the file holds is named as before)."""
    _, _, notes = mlx_lm_options({"model": "m.gguf", "grad_accumulation_steps": 3,
                                  "save_every": 7}, "f.yaml")
    assert [n for n in notes if "micro-batches" in n and "averaged" not in n] == [
        ("f.yaml: key 'iters' (mlx-lm's default, not in the file): 1000 micro-batches are 333 "
         "optimizer steps of 3; mlx-lm's last 1 micro-batch updates nothing and is not drawn"),
        ("f.yaml: key 'steps_per_eval' (mlx-lm's default, not in the file): every 200 "
         "micro-batches falls inside an accumulation of 3; toymlx's --eval-every is every 66 "
         "optimizer steps (198 micro-batches)"),
        ("f.yaml: key 'steps_per_report' (mlx-lm's default, not in the file): every 10 "
         "micro-batches falls inside an accumulation of 3; toymlx's --report-every is every 3 "
         "optimizer steps (9 micro-batches)"),
        ("f.yaml: key 'save_every': every 7 micro-batches falls inside an accumulation of 3; "
         "toymlx's --checkpoint-every is every 2 optimizer steps (6 micro-batches)")]


def test_max_seq_length_cuts_rows_where_mlx_lm_does(tmp_path):
    """mlx-lm's iterate_batches cuts a row to max_seq_length tokens, so trains max_seq_length - 1
    targets of it; toymlx's --seq-len counts targets. max_seq_length 40 was --seq-len 40 (41
    tokens, one target more than mlx-lm trains on every cut row); it is --seq-len 39."""
    import argparse

    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import iterate_batches

    from toymlx.data.chat import SFTData
    from toymlx.data.tokenizer import Tokenizer, byte_metadata

    tok = Tokenizer(byte_metadata(), source="test")
    texts = ["a short row", "x" * 100, "y" * 39, "z" * 38]
    for split in ("train", "valid"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                         for t in texts))
    max_seq = 40
    theirs, _, _ = load_local_dataset(tmp_path, _AsHuggingFace(tok),
                                      argparse.Namespace(mask_prompt=False))
    # batch 1, in length order: each row's (offset, length) after mlx-lm's cut
    lengths = sorted(int(b[1][0, 1]) for b, _ in zip(
        iterate_batches(CacheDataset(theirs), 1, max_seq), range(len(texts))))
    seq_len = mlx_lm_options({"iters": 1, "max_seq_length": max_seq}, "f.yaml")[0]["seq_len"]
    ours = SFTData.from_file(tmp_path, tok, seq_len, mask_prompt=False, pack=False).train
    # a row's length - 1 targets (mlx-lm's one past an uncut row's end, its pad, left out as in
    # the test above; a cut row has no column past its end)
    assert sorted(int(m.sum()) for m in ours["mask"]) == [n - 1 for n in lengths]
    assert lengths[-2:] == [max_seq, max_seq] and seq_len == max_seq - 1


@pytest.mark.parametrize("extra,line", [
    ({"resume_adapter_file": ["adapters.safetensors"]},
     ("f.yaml: key 'resume_adapter_file': expected an adapter file (mlx-lm's "
      "adapters.safetensors, or an adapter GGUF), found [\"adapters.safetensors\"]")),
    ({"report_to": "wandb,swanlab"},
     ("f.yaml: key 'report_to': expected a comma list of tensorboard, wandb, or all or none, "
      "found 'swanlab'")),
    ({"report_to": "tb"},
     ("f.yaml: key 'report_to': expected a comma list of tensorboard, wandb, or all or none, "
      "found 'tb' (did you mean tensorboard?)")),
    ({"report_to": "all,wandb"},
     ("f.yaml: key 'report_to': all stands alone; expected all or a comma list of "
      "tensorboard, wandb")),
])
def test_a_bad_adapter_key_and_services_are_refused_by_key(extra, line):
    """swanlab was refused naming --report-to; now it is refused as the file is read, naming its
    key, as is a resume_adapter_file that is no path."""
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"iters": 10, **extra}, "f.yaml")
    assert str(e.value) == line


def test_a_run_resumes_mlx_lm_s_own_adapters(tmp_path, base, data, capsys):
    """resume_adapter_file: adapters/adapters.safetensors (mlx-lm's, adapter_config.json beside
    it) was refused; now its adapters start the run: step 1's loss is the base + that adapter's
    (read into toymlx's layout, q/k rows permuted: tests/test_mlx_lm_adapter.py checks its
    logits against mlx-lm's) on step 1's batch, not the base's."""
    from mlx_lm_adapters import lora_config, make_adapter

    from toymlx.data.chat import SFTData
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.llama import load_llama
    from toymlx.gguf.reader import GGUFFile
    from toymlx.models.losses import lm_loss
    from toymlx.training.adapter import apply_adapter

    folder = make_adapter(base, tmp_path / "adapters", lora_config(2, 4, 2.0))
    cfg = {"model": str(base), "train": True, "data": str(data), "iters": 1, "batch_size": 2,
           "learning_rate": 1e-4, "num_layers": 2, "steps_per_eval": 1, "val_batches": 1,
           "max_seq_length": 64, "save_every": 1, "adapter_path": str(tmp_path / "runs" / "r"),
           "resume_adapter_file": str(folder / "adapters.safetensors"),
           "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
    path = tmp_path / "mlx_lm_lora_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    rows = {tuple(line.split()[:2]): line.split()[2:]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows[("resume_adapter_file", "--lora.init-adapter")] == [
        str(folder / "adapters.safetensors"), "file"]
    events = read_events(tmp_path / "runs" / "r")
    first = next(e["loss"] for e in events if e["kind"] == "step")
    tok = Tokenizer.from_metadata(GGUFFile(base).metadata)
    batch = SFTData.from_file(data, tok, 63, False, False).batch(0, 0, 2)
    batch = {k: mx.array(v[0]) for k, v in batch.items()}
    model, _ = load_llama(base)
    plain = lm_loss(model, batch)[0].item()
    adapted = lm_loss(apply_adapter(model, folder), batch)[0].item()
    assert first == pytest.approx(adapted, abs=1e-5) and abs(adapted - plain) > 1e-2


class _Scaled(nn.Module):
    """A matrix and a vector (a DoRA magnitude's shape, or a norm's)."""

    def __init__(self):
        super().__init__()
        self.w = mx.arange(16, dtype=mx.float32).reshape(4, 4) / 16
        self.m = mx.array([1.0, 2.0, 3.0, 4.0])

    def __call__(self, x):
        return (x @ self.w.T) * self.m


def test_an_mlx_lm_model_folder_as_the_model_says_to_pass_its_gguf(tmp_path, data, capsys):
    """model: mlx-lm's model folder (what its --model takes) was "found a directory"; now the line
    says it is a Hugging Face model folder and to pass the same model's GGUF as --base."""
    folder = tmp_path / "smol-mlx"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(folder), "data": str(data), "iters": 1}))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'model' (toymlx's --base): {folder}: expected an "
        "existing GGUF file, found a Hugging "
        "Face model folder (config.json, as mlx-lm's --model takes); pass the same model's GGUF "
        "as --base (on the command line it overrides an mlx-lm config's model; adapters mlx-lm "
        "trained on the folder are read for it)")
    assert not (tmp_path / "runs").exists()


def _one_step(make_opt) -> dict[str, np.ndarray]:
    """The weights after one compiled toymlx step (`step.make_step`) with `make_opt()`."""
    from toymlx.training.step import make_step

    model = _Scaled()

    def loss_fn(m, batch):
        return (m(batch["x"]) ** 2).mean(), mx.array(1)

    opt = make_opt()
    step = make_step(model, loss_fn, opt, grad_clip=0.0, compile=True)
    mx.eval(step({"x": mx.linspace(-1, 1, 12).reshape(1, 3, 4)}), model.state, opt.state)
    return {k: np.array(v) for k, v in model.parameters().items()}


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_mlx_lm_s_example_optimizer_config_trains_as_mlx_s_optimizer(name):
    """mlx-lm's own example config (mlx_lm/examples/lora_config.yaml) sets optimizer_config
    adamw {betas: [0.9, 0.98], eps: 1e-6, weight_decay: 0.05, bias_correction: true}: eps was
    refused unless 1e-8 and bias_correction as no argument of toymlx's adamw, so the file did not
    run. They are --adam-eps and --bias-correction now, and one compiled step moves the weights
    as MLX's optimizer given them does (mlx-lm's `opt_class(learning_rate=lr, **config)`)."""
    conf = {"betas": [0.9, 0.98], "eps": 1e-6, "bias_correction": True,
            **({"weight_decay": 0.05} if name == "adamw" else {})}
    options, rows, notes = mlx_lm_options({"model": "m.gguf", "iters": 2, "optimizer": name,
                                           "optimizer_config": {name: conf}}, "f.yaml")
    assert (options["adam_eps"], options["bias_correction"], notes) == (1e-6, True, [])
    assert (f"optimizer_config.{name}.bias_correction", "--bias-correction", True,
            "file") in rows
    cfg = _cfg(optimizer=name, learning_rate=1e-2, optimizer_config={name: conf})
    cls = optim.AdamW if name == "adamw" else optim.Adam

    def mlx_s(**kw):
        return cls(learning_rate=1e-2, **{**conf, **kw})

    ours, theirs = _one_step(lambda: lora.make_optimizer(cfg)), _one_step(mlx_s)
    for k in theirs:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=0)
    # without them (before: the file refused, the keys removed) another step
    plain = _one_step(lambda: mlx_s(eps=1e-8, bias_correction=False))
    assert np.abs(plain["m"] - theirs["m"]).max() > 1e-3
    for bad, line in ((0, "expected a number > 0, found 0"),
                      ("yes", 'expected true or false, found "yes"')):
        key = "eps" if bad == 0 else "bias_correction"
        with pytest.raises(ConfigFileError, match=f"key 'optimizer_config.{name}.{key}': {line}"):
            mlx_lm_options({"iters": 2, "optimizer": name,
                            "optimizer_config": {name: {key: bad}}}, "f.yaml")


def test_adamw_decays_every_trained_array_as_mlx_lm_s():
    """mlx-lm's adamw is MLX's AdamW on every trained array: the file maps it to
    --weight-decay-scope all, and one compiled step moves a vector (a DoRA magnitude, a full
    run's norm) as MLX's AdamW does; toymlx's default (matrices) leaves it undecayed, which the
    file used to do with a note."""
    cfg = _cfg(optimizer="adamw", fine_tune_type="dora", learning_rate=1e-2,
               optimizer_config={"adamw": {"weight_decay": 0.1}})
    assert cfg.weight_decay_scope == "all" and lora.Config().weight_decay_scope == "matrices"

    def mlx_s():
        return optim.AdamW(learning_rate=1e-2, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1)

    ours, theirs = _one_step(lambda: lora.make_optimizer(cfg)), _one_step(mlx_s)
    np.testing.assert_allclose(ours["m"], theirs["m"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-6, atol=0)
    import dataclasses

    matrices = _one_step(lambda: lora.make_optimizer(
        dataclasses.replace(cfg, weight_decay_scope="matrices")))
    # decoupled decay: MLX's AdamW takes lr * wd * m off the vector besides its Adam update
    np.testing.assert_allclose(theirs["m"] - matrices["m"], -1e-3 * np.array([1, 2, 3, 4]),
                               rtol=1e-3)
    np.testing.assert_array_equal(matrices["w"], ours["w"])
    assert mlx_lm_options({"iters": 2, "optimizer": "adamw", "fine_tune_type": "dora"},
                          "f.yaml")[2] == []


def test_mask_prompt_on_a_conversation_trains_mlx_lm_s_last_message():
    """mlx-lm's ChatDataset with mask_prompt trains from the offset of the last message only;
    toymlx's default trains every assistant turn. The file maps mask_prompt to
    --data.train-turns last, whose trained positions are mlx-lm's own (its ChatDataset run on
    the same template and tokenizer); it used to be a note."""
    from mlx_lm.tuner.datasets import ChatDataset

    from toymlx.data.chat import Example, tokenize_example
    from toymlx.data.tokenizer import Tokenizer, byte_metadata

    meta = byte_metadata()
    meta["tokenizer.chat_template"] = CHATML
    tok = Tokenizer(meta, source="test")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "two"}]
    ids, offset = ChatDataset([{"messages": msgs}], _AsHuggingFace(tok),
                              mask_prompt=True).process({"messages": msgs})
    cfg = _cfg(mask_prompt=True)
    assert cfg.data.mask_prompt is True and cfg.data.train_turns == "last"
    ours, mask = tokenize_example(Example(messages=tuple(msgs), source="t"), tok, True,
                                  turns=cfg.data.train_turns)
    assert list(ours) == ids
    assert [i for i, m in enumerate(mask) if m] == list(range(offset, len(ids)))
    assert ids[offset:] == tok.encode("two</s>", add_bos=False)
    _, every = tokenize_example(Example(messages=tuple(msgs), source="t"), tok, True)
    assert [t for t, m in zip(ours, every) if m] == tok.encode("one</s>two</s>", add_bos=False)
    assert lora.Config().data.train_turns == "assistant"
    assert not any("mask_prompt" in n for n in mlx_lm_options({"iters": 2, "mask_prompt": True},
                                                                "f.yaml")[2])


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """A data folder of 2-turn conversations."""
    root = tmp_path_factory.mktemp("chats")
    for split, n in (("train", 8), ("valid", 5)):
        rows = [{"messages": [{"role": "user", "content": f"hi {i}"},
                              {"role": "assistant", "content": f"one {i * 7}"},
                              {"role": "user", "content": "again?"},
                              {"role": "assistant", "content": f"two {i * 3}"}]}
                for i in range(n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_drop_tools_trains_and_scores_chats_whose_tools_the_template_never_reads(
        tmp_path, base, chats, capsys):
    """Chat rows with "tools" on a base whose template never reads them (CHATML) were refused,
    the way on only editing the data; mlx-lm drops them unsaid. The refusal names
    --data.drop-tools; with it the run trains, one line saying how many were left out, and
    toymlx-eval scores the run's validation rows as its eval did (config.json keeps it)."""
    from toymlx_cli.eval import main as eval_main

    folder = tmp_path / "tools"
    folder.mkdir()
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for split in ("train", "valid"):
        rows = [json.loads(line) for line in (chats / f"{split}.jsonl").read_text().splitlines()]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({**r, "tools": [tool]}) + "\n"
                                                       for r in rows))
    path = tmp_path / "c.yaml"
    run = tmp_path / "runs" / "t"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(folder), "iters": 2, "batch_size": 2,
        "num_layers": 1, "steps_per_eval": 2, "val_batches": -1, "max_seq_length": 64,
        "adapter_path": str(run)}))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 2
    assert error_line(capsys) == (
        f'toymlx-train: error: {folder / "train.jsonl"}:1: "tools": expected a chat template that '
        "renders tools, found one that never reads them (mlx-lm drops them unsaid); give "
        "--data.drop-tools to leave every example's \"tools\" out (a line says how many), or use "
        "a base whose template takes tools")
    assert main(["-c", str(path), "--data.drop-tools", "--no-progress", "--no-compile"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (f'toymlx: {folder / "train.jsonl"} + {folder / "valid.jsonl"}: --data.drop-tools: '
            'the "tools" (function schemas) of 13 examples left out, not rendered by the chat '
            "template") in err
    last = [e for e in read_events(run) if e["kind"] == "eval"][-1]
    capsys.readouterr()
    assert eval_main(["--model", str(run), "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["val_loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    # the base outside a run: refused naming toymlx-eval's --data.drop-tools, which scores the
    # rows of the examples without tools
    assert eval_main(["--model", str(base), "--data.path", str(folder), "--json"]) == 2
    assert "give --data.drop-tools to leave every example's" in error_line(capsys, "toymlx-eval")
    assert eval_main(["--model", str(base), "--data.path", str(folder), "--json",
                      "--data.drop-tools"]) == 0
    out, err = capsys.readouterr()
    assert (f'toymlx-eval: {folder / "train.jsonl"} + {folder / "valid.jsonl"}: '
            '--data.drop-tools: the "tools" (function schemas) of 13 examples left out, not '
            "rendered by the chat template") in err.splitlines()  # --split all: no test.jsonl
    assert eval_main(["--model", str(base), "--data.path", str(chats), "--json"]) == 0
    assert json.loads(out)["val_loss"] == json.loads(capsys.readouterr().out)["val_loss"]


def test_a_config_run_validates_the_base_before_step_1_once(tmp_path, base, chats, capsys):
    """mlx-lm validates at iteration 1, before any update: the file turns --eval-at-start on,
    whose step-0 eval event holds the base's val loss, the one toymlx-eval scores for the base
    on the run's validation rows; a resume, from a checkpoint or from step_0 (which keeps the
    step-0 event), does not repeat it."""
    from toymlx_cli.eval import Args, evaluate_chat

    from toymlx.runner.bundle import Bundle

    run = tmp_path / "runs" / "r"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(chats), "iters": 4, "batch_size": 2, "mask_prompt": True,
        "learning_rate": 1e-3, "num_layers": 1, "steps_per_eval": 2, "val_batches": -1,
        "max_seq_length": 64, "save_every": 2, "adapter_path": str(run)}))
    assert main(["-c", str(path), "--no-progress", "--stop-at", "2"]) == 0
    evals = [e for e in read_events(run) if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    steps = [e for e in read_events(run) if e["kind"] == "step"]
    assert evals[0]["t"] < steps[0]["t"]
    cfg = Bundle.open(run).config
    assert (cfg.eval_at_start, cfg.data.train_turns, cfg.eval_batches) == (True, "last", -1)
    base_loss = evaluate_chat(Args(model=str(base), split="val"), cfg)["val_loss"]
    assert evals[0]["val_loss"] == pytest.approx(base_loss, abs=1e-5)
    assert abs(evals[1]["val_loss"] - base_loss) > 1e-3  # step 2's: trained
    assert main(["--resume", str(run), "--no-progress"]) == 0
    assert [e["step"] for e in read_events(run) if e["kind"] == "eval"] == [0, 2, 4]
    assert main(["--resume", str(run), "--from", "step_0", "--no-progress"]) == 0
    again = [e for e in read_events(run) if e["kind"] == "eval"]
    assert [e["step"] for e in again] == [0, 2, 4]
    assert again[0] == evals[0]  # the kept event, not a second pass
    capsys.readouterr()


def test_a_run_on_renamed_keys_is_scored_and_resumed_on_them(tmp_path, base, data, capsys):
    """A file's prompt_feature and completion_feature ({"question", "answer"} rows) train the
    rows mlx-lm reads: the run's step-0 val loss is the base's on the same rows under toymlx's
    own keys, and toymlx-eval reads the run's rows again through the keys the run kept."""
    from toymlx_cli.eval import Args, evaluate_chat

    from toymlx.runner.bundle import Bundle

    renamed = tmp_path / "qa"
    renamed.mkdir()
    for split in ("train", "valid"):
        rows = [json.loads(x) for x in (data / f"{split}.jsonl").read_text().splitlines()]
        (renamed / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": r["prompt"], "answer": r["completion"]}) + "\n"
            for r in rows))
    run = tmp_path / "runs" / "r"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(renamed), "iters": 2, "batch_size": 2,
        "mask_prompt": True, "num_layers": 1, "steps_per_eval": 2, "val_batches": -1,
        "max_seq_length": 64, "adapter_path": str(run), "prompt_feature": "question",
        "completion_feature": "answer"}))
    assert main(["-c", str(path), "--no-progress"]) == 0
    cfg = Bundle.open(run).config
    assert cfg.data.keys == ("prompt=question", "completion=answer")
    evals = [e for e in read_events(run) if e["kind"] == "eval"]
    own = replace(cfg, data=replace(cfg.data, path=str(data), keys=()))
    base_loss = evaluate_chat(Args(model=str(base), split="val"), own)["val_loss"]
    assert evals[0]["val_loss"] == pytest.approx(base_loss, abs=1e-5)
    assert evaluate_chat(Args(model=str(base), split="val"), cfg)["val_loss"] == pytest.approx(
        base_loss, abs=1e-6)
    capsys.readouterr()
    assert main(["--recipe", "lora", "--base", str(base), "--data.path", str(renamed),
                 "--data.keys", "answer=answer", "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys) == (
        "toymlx-train: error: --data.keys: expected KEY=NAME with KEY one of prompt, "
        "completion, text, messages (a row's NAME read as its KEY), found 'answer=answer'")


def test_val_batches_minus_one_is_toymlx_s_eval_batches_minus_one():
    """mlx-lm's val_batches -1 (every validation batch) was shown in the table, and recorded in
    config.json, as --eval-batches 2147483647; it is now toymlx's own spelling of every batch,
    --eval-batches -1 (toymlx-eval's, and toymlx-train's)."""
    from types import SimpleNamespace

    from toymlx_cli.export import eval_rows

    options, rows, _ = mlx_lm_options({"iters": 2, "val_batches": -1}, "f.yaml")
    assert options["eval_batches"] == -1
    assert ("val_batches", "--eval-batches", -1, "file") in rows
    line = next(x for x in mlx_lm_table(rows).splitlines() if x.startswith("val_batches"))
    assert line.split() == ["val_batches", "--eval-batches", "-1", "file"]
    assert mlx_lm_options({"iters": 2, "val_batches": 3}, "f.yaml")[0]["eval_batches"] == 3
    # toymlx-export --fuse's held-out line names the rows such a run scores
    assert eval_rows(SimpleNamespace(eval_batches=-1, batch_size=4)) == (
        "all of them, --eval-batches -1")
    assert eval_rows(SimpleNamespace(eval_batches=8, batch_size=4)) == (
        "the first --eval-batches 8 x --batch-size 4")


def _mlx_lm_validations(lengths: list[int], batch_size: int, val_batches: int,
                        draws: int = 4) -> list[list[int]]:
    """The examples (by index) each of `draws` validations of mlx-lm scores on examples of
    `lengths` tokens: its evaluate's `val_batches` batches of its own iterate_batches."""
    import itertools

    from mlx_lm.tuner.trainer import iterate_batches

    np.random.seed(0)  # mlx_lm.lora's run seeds numpy's global draws with its seed
    dataset = [([i + 1] * n, 0) for i, n in enumerate(lengths)]
    scored = []
    for _ in range(draws):
        batches = itertools.islice(iterate_batches(dataset, batch_size, 2048),
                                   None if val_batches == -1 else val_batches)
        scored.append(sorted(int(b[r, 0]) - 1 for b, _ in batches for r in range(b.shape[0])))
    return scored


def test_a_note_says_where_mlx_lm_validates_on_other_examples(tmp_path, base, data, capsys):
    """mlx-lm's val_batches are whole batches of examples sorted by length, drawn in a random
    order at each validation (its iterate_batches): -1 leaves out the len % batch_size longest,
    N < the batches holds other examples at each validation, fewer examples than batch_size are
    refused. toymlx validates on the first N x batch_size examples in the file's order (all
    with -1), the same each time, and its --test scores all of test.jsonl: the val and test
    losses were of other examples without a word."""
    from types import SimpleNamespace

    from mlx_lm.tuner.trainer import iterate_batches
    from toymlx_cli.mlx_lm_config import mlx_lm_held_out_rows

    def note(lengths, batch_size, val_batches, test=False):
        folder = tmp_path / f"d{len(lengths)}"
        folder.mkdir(exist_ok=True)
        for split, n in (("train", 2), ("valid", len(lengths)), ("test", len(lengths))):
            (folder / f"{split}.jsonl").write_text("".join(
                json.dumps({"text": "x" * k}) + "\n" for k in lengths[:n]))
        cfg = SimpleNamespace(data=SimpleNamespace(path=str(folder)), batch_size=batch_size,
                              eval_batches=val_batches, test=test)
        notes = mlx_lm_held_out_rows(cfg, "f.yaml", -1)
        assert len(notes) == 1 + test or not notes
        return notes[-1] if notes else None

    five = [9, 3, 7, 5, 4]
    theirs = _mlx_lm_validations(five, 2, -1)
    assert theirs == [[1, 2, 3, 4]] * 4  # all but the longest, example 0
    assert note(five, 2, -1) == (
        f"f.yaml: key 'val_batches': {tmp_path}/d5/valid.jsonl holds 5 examples: mlx-lm's whole "
        "batches of 2 leave out the 1 longest, toymlx validates on all 5")
    six = [9, 3, 7, 5, 4, 8]
    theirs = _mlx_lm_validations(six, 2, 1)
    assert {len(s) for s in theirs} == {2} and len({tuple(s) for s in theirs}) > 1
    assert note(six, 2, 1) == (
        f"f.yaml: key 'val_batches': {tmp_path}/d6/valid.jsonl holds 6 examples: mlx-lm "
        "validates on 1 of its 3 batches of 2 examples alike in length (2 examples), drawn anew "
        "at each validation; toymlx on the first 2 in the file's order, the same each time")
    with pytest.raises(ValueError, match="at least batch_size=2"):
        next(iterate_batches([([1, 2], 0)], 2, 2048))
    assert note([4], 2, -1) == (
        f"f.yaml: key 'batch_size': {tmp_path}/d1/valid.jsonl holds 1 example, fewer than "
        "batch_size 2: mlx-lm refuses it (its batches are whole), toymlx validates on it")
    # mlx_lm.lora --test's one pass over test.jsonl likewise (evaluate_model)
    assert note(five, 2, -1, test=True) == (
        f"f.yaml: key 'test_batches': {tmp_path}/d5/test.jsonl holds 5 examples: mlx-lm's whole "
        "batches of 2 leave out the 1 longest, toymlx scores all 5")
    # the same examples: no note
    assert _mlx_lm_validations(six[:4], 2, -1)[0] == [0, 1, 2, 3]
    assert note(six[:4], 2, -1) is None and note(six, 2, 3) is None
    # a run says it (the data folder's 4 validation examples in batches of 3)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(data), "iters": 1, "batch_size": 3, "num_layers": 1,
        "max_seq_length": 64, "adapter_path": str(tmp_path / "runs" / "r")}))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    assert (f"toymlx-train: {path}: key 'val_batches': {data}/valid.jsonl holds 4 examples: "
            "mlx-lm's whole batches of 3 leave out the 1 longest, toymlx validates on all 4"
            ) in capsys.readouterr().err.splitlines()


def test_the_val_loss_of_an_iteration_is_noted_as_one_update_apart():
    """mlx-lm validates at iteration N before that iteration's update, toymlx after step N: the
    same count is one update apart, said where the file sets steps_per_eval."""
    _, _, notes = mlx_lm_options({"iters": 4, "steps_per_eval": 2}, "f.yaml")
    assert notes == [
        ("f.yaml: key 'steps_per_eval': mlx-lm's val loss at iteration N is the model's before "
         "update N; toymlx's at step N is after it (one update later; the first, "
         "--eval-at-start's, is the same)")]
    assert mlx_lm_options({"iters": 4}, "f.yaml")[2] == []


def test_a_null_key_takes_mlx_lm_s_default_and_train_false_is_refused():
    """mlx-lm fills a key whose value is null with its default (adapter_config.json saves
    lr_schedule, report_to, resume_adapter_file ... as null): such a file maps as if the keys
    were left out; it was refused ("key 'lr_schedule': expected a mapping with name and
    arguments, found null"). `train: false` (mlx-lm: test only, no training) is refused, where
    toymlx-train trained 1000 steps under a note; `train: true` is honoured, with no note."""
    nulls = {"lr_schedule": None, "num_layers": None, "report_to": None, "config": None,
             "resume_adapter_file": None, "project_name": None, "optimizer_config": None,
             "lora_parameters": None, "learning_rate": None}
    assert mlx_lm_options({"iters": 5, **nulls}, "f.yaml") == mlx_lm_options({"iters": 5},
                                                                             "f.yaml")
    assert mlx_lm_options({"iters": 5, "train": True}, "f.yaml")[2] == []
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"iters": 5, "train": False}, "f.yaml")
    assert str(e.value) == ("f.yaml: key 'train': expected true (toymlx-train trains; a run's "
                            "test.jsonl is scored by toymlx-eval --model RUN --split test), "
                            "found false")


def test_data_given_on_the_command_line_wins_over_the_file_s_dataset_name(tmp_path, base, data,
                                                                          capsys):
    """`data: mlx-community/WikiSQL` (mlx-lm's default, saved in its adapter_config.json) with
    `--data.path DIR`: the flag wins, as mlx-lm's --data does; the file's name was refused
    before the flag was read."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": "mlx-community/WikiSQL",
                                    "iters": 1, "batch_size": 2, "max_seq_length": 32,
                                    "val_batches": 1, "num_layers": 2}))
    assert main(["-c", str(path), "--data.path", str(data), "--runs-root", str(tmp_path),
                 "--run-id", "r", "--no-progress", "--no-compile"]) == 0
    rows = [x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("data ")]
    assert rows == [["data", "--data.path", str(data), "command", "line,", "over", "the", "file"]]
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["config"]
    assert saved["data"]["path"] == str(data)


@pytest.mark.parametrize("extra,line", [
    ("mask_prompt: yes", ("key 'mask_prompt' (toymlx's --data.mask-prompt): expected true or "
     "false, found \"yes\" (a string)")),
    ("lr_schedule: {name: cosine_decay, arguments: [1.0e-4, 10], warmup: 2.5}",
     "key 'lr_schedule.warmup' (toymlx's --warmup): expected an integer, found 2.5 (a number)"),
    ("seed: x", "key 'seed': expected an integer, found \"x\" (a string)"),
])
def test_a_bad_value_is_named_by_the_file_s_own_key(tmp_path, base, capsys, extra, line):
    """A value of the wrong type is one line naming the mlx-lm key the file holds; it named
    toymlx's option ("key 'data.mask_prompt'", "key 'warmup'"), which the file does not have."""
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {base}\niters: 2\n{extra}\n")
    assert main(["-c", str(path), "--runs-root", str(tmp_path), "--no-progress"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {path}: {line}; fix it, or remove the "
                                  "key to take its default")


@pytest.mark.parametrize("extra,argv,line", [
    ({"iters": 0}, [], "{path}: key 'iters' (toymlx's --steps): expected >= 1, found 0"),
    ({"batch_size": 0}, [],
     "{path}: key 'batch_size' (toymlx's --batch-size): expected >= 1, found 0"),
    ({"learning_rate": 0}, [], ("{path}: key 'learning_rate' (toymlx's --lr): expected > 0, "
     "found 0.0")),
    ({"lora_parameters": {"rank": 4, "scale": 20, "dropout": 1.5}}, [],
     ("{path}: key 'lora_parameters.dropout' (toymlx's --lora.dropout): expected in [0, 1), "
     "found 1.5")),
    ({"lora_parameters": {"rank": 0, "scale": 20, "dropout": 0}}, [],
     "{path}: key 'lora_parameters.rank': expected an integer >= 1, found 0"),
    ({"batch_size": 100}, [],
     ("{path}: key 'batch_size' (toymlx's --batch-size): expected at most 12 (the training split "
     "of {data}/train.jsonl holds 12 rows), found 100; use --batch-size "
     "12 or less, or more data")),
    ({"batch_size": None, "data": "{small}"}, [],
     ("{path}: key 'batch_size' (mlx-lm's default, not in the file; toymlx's --batch-size): "
     "expected at most 3 (the training split of {small}/train.jsonl holds "
     "3 rows), found 4; use --batch-size 3 or less, or more data")),
    ({"model": "{tmp}/nope.gguf"}, [],
     ("{path}: key 'model' (toymlx's --base): {tmp}/nope.gguf: expected an existing GGUF file, "
     "found nothing at that path")),
    ({"lr_schedule": {"name": "cosine_decay", "arguments": [1e-5]}}, [],
     ("{path}: key 'lr_schedule.arguments' (toymlx's --lr-schedule-args): expected the "
     "arguments of MLX's cosine_decay, found [1e-05] (cosine_decay() missing 1 required "
     "positional argument: 'decay_steps')")),
    ({}, ["--steps", "0"], "--steps: expected >= 1, found 0"),  # the flag's value: the flag
    ({}, ["--lr-schedule", "cosine_decay", "--lr-schedule-args", "1e-5"],
     ("--lr-schedule-args: expected the arguments of MLX's cosine_decay, found [1e-05] "
     "(cosine_decay() missing 1 required positional argument: 'decay_steps')")),
])
def test_a_value_refused_after_the_file_is_read_is_named_by_the_file_s_key(
        tmp_path, base, data, capsys, extra, argv, line):
    """A value the file's mapping passes on and a later check refuses (the recipe's, the
    trainer's, the data's) is one line naming the file and its mlx-lm key, with toymlx's flag in
    brackets; it named only toymlx's flag (`--steps: expected >= 1, found 0` for `iters: 0`;
    `--lr-schedule-args [1e-05]: ...` for `lr_schedule.arguments` MLX's schedule refuses)."""
    small = tmp_path / "small"
    small.mkdir()
    (small / "train.jsonl").write_text("".join((data / "train.jsonl").read_text()
                                               .splitlines(keepends=True)[:3]))
    (small / "valid.jsonl").write_text((data / "valid.jsonl").read_text())
    cfg = {"model": str(base), "data": str(data), "iters": 2, "batch_size": 2,
           "max_seq_length": 32, "val_batches": 1, "num_layers": 2, **extra}
    cfg = {k: v.format(small=small, tmp=tmp_path) if isinstance(v, str) else v
           for k, v in cfg.items()}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs"), "--no-progress",
                 *argv]) == 2
    assert error_line(capsys) == "toymlx-train: error: " + line.format(
        path=path, data=data, small=small, tmp=tmp_path)
    assert not list((tmp_path / "runs").glob("*/config.json"))  # no run left behind


@pytest.mark.parametrize("argv, line", [
    (["--lr", "-1"], "--lr: expected > 0, found -1.0"),  # the command line's parse
    (["--lora.rank", "0"], "--lora.rank: expected >= 1, found 0"),
    (["--steps", "0"], "--steps: expected >= 1, found 0"),  # the run's preparation
])
def test_a_refused_mlx_lm_config_run_says_its_one_error_line_and_no_note(
        tmp_path, base, data, capsys, argv, line):
    """The file's notes (adapter_path's, num_layers') come once the run goes ahead: a refused
    run's stderr is its one error line; the adapter_path and num_layers notes came before it."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 1,
                                    "batch_size": 2, "max_seq_length": 32, "val_batches": 1,
                                    "adapter_path": str(tmp_path / "runs" / "a")}))
    assert main(["-c", str(path), "--no-progress", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"toymlx-train: error: {line}"]
    assert not (tmp_path / "runs" / "a").exists()
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0  # said when it runs
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith(f"toymlx-train: "
                                                                            f"{path}: ")]
    assert [x.split(": ")[2] for x in notes] == ["key 'adapter_path'", "num_layers 16",
                                                 "key 'val_batches'"]


def test_data_given_on_the_command_line_wins_over_the_file_s_hf_dataset(tmp_path, base, data,
                                                                        capsys):
    """`hf_dataset` (mlx-lm's hub datasets) with `--data.path DIR`: the flag gives the data and
    one note says the file's hf_dataset is not used; it was refused as without the flag."""
    hub = {"path": "mlx-community/WikiSQL", "train_split": "train[:80%]"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "hf_dataset": hub, "iters": 1,
                                    "batch_size": 2, "max_seq_length": 32, "val_batches": 1,
                                    "num_layers": 2}))
    assert main(["-c", str(path), "--data.path", str(data), "--runs-root", str(tmp_path),
                 "--run-id", "r", "--no-progress", "--no-compile"]) == 0
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if "hf_dataset" in x] == [
        (f"toymlx-train: {path}: key 'hf_dataset': not used (--data.path on the command line "
        "gives the data; mlx-lm would read the Hugging Face dataset instead)")]
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["config"]
    assert saved["data"]["path"] == str(data)
    with pytest.raises(ConfigFileError) as e:  # without the flag: refused, naming the dataset
        mlx_lm_options({"iters": 1, "hf_dataset": hub}, "f.yaml", frozenset({"--steps"}))
    assert str(e.value).startswith("f.yaml: key 'hf_dataset': expected a local folder with "
                                   "train.jsonl (toymlx reads no Hugging Face datasets")


def test_report_to_takes_the_command_line_s_values(monkeypatch):
    """report_to in an mlx-lm file is read by --report-to's parser: none and all were refused
    ("expected a comma list of tensorboard, wandb ..., found 'none'; remove it")."""
    import importlib

    monkeypatch.setattr(importlib, "import_module", lambda name: None)  # both extras "there"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    for value in ("none", "all", "None", "tensorboard,wandb"):
        assert mlx_lm_options({"iters": 5, "report_to": value}, "f.yaml")[0]["report_to"] == value


def test_test_batches_is_honoured_at_minus_one_and_noted_where_it_would_cap():
    """test_batches was noted as not honoured whatever it was; -1 (mlx-lm: every batch) is
    toymlx's --test exactly, another count with test: true is noted (toymlx's test pass has no
    cap; it was refused, though it changes what is scored, not what is trained, so an mlx-lm
    file with test_batches: 20 did not run), and so is a test: true file that leaves it out
    (mlx-lm's default is 500)."""
    assert mlx_lm_options({"iters": 5, "test": True, "test_batches": -1}, "f.yaml")[2] == []
    assert mlx_lm_options({"iters": 5, "test_batches": 20}, "f.yaml")[2] == []  # test false
    options, _, notes = mlx_lm_options({"iters": 5, "test": True, "test_batches": 20}, "f.yaml")
    assert options["test"] is True
    assert notes == [("f.yaml: key 'test_batches': toymlx's --test scores all of test.jsonl; "
                      "mlx-lm scores at most 20 of its batches, drawn at random (-1 is every "
                      "batch)")]
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"iters": 5, "test_batches": 0}, "f.yaml")
    assert str(e.value) == ("f.yaml: key 'test_batches': expected an integer >= 1, or -1 (every "
                            "batch), found 0")
    assert mlx_lm_options({"iters": 5, "test": True}, "f.yaml")[2] == [
        # not its first 500 (before): mlx-lm's iterate_batches draws them in a random order
        ("f.yaml: key 'test': toymlx's --test scores all of test.jsonl; mlx-lm scores at most "
         "500 of its batches, drawn at random (test_batches' default; -1 is every batch)")]
    assert _mlx_lm_validations([5, 6, 7, 8, 9, 10], 2, 1, draws=1) != [[0, 1]]  # not the first


def test_project_name_is_the_w_and_b_project_and_the_config_records_it(tmp_path, base, data,
                                                                        capsys, monkeypatch):
    """project_name was noted as not used (W&B's project came from WANDB_PROJECT only); it is
    --wandb-project now, which the reporter passes to wandb.init and config.json records.
    Without report_to wandb, mlx-lm does not read it: a note, and no --wandb-project (which
    toymlx-train refuses without --report-to wandb, where it would go unused unsaid)."""
    pytest.importorskip("wandb", reason="the wandb extra (toymlx[wandb]) is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    options, rows, notes = mlx_lm_options({"iters": 5, "project_name": "sql-lora",
                                           "report_to": "wandb"}, "f.yaml")
    assert options["wandb_project"] == "sql-lora"
    assert ("project_name", "--wandb-project", "sql-lora", "file") in rows and notes == []
    options, rows, notes = mlx_lm_options({"iters": 5, "project_name": "sql-lora"}, "f.yaml")
    assert "wandb_project" not in options and notes == [(
        "f.yaml: key 'project_name': not used (no report_to: wandb; mlx-lm reads it only for "
        "W&B)")]
    assert mlx_lm_options({"iters": 5, "project_name": "p"}, "f.yaml", frozenset(
        {"--report-to"}))[0]["wandb_project"] == "p"
    cfg = {"model": str(base), "data": str(data), "iters": 1, "batch_size": 2, "num_layers": 1,
           "max_seq_length": 64, "val_batches": 1, "project_name": "sql-lora",
           "report_to": "wandb", "adapter_path": str(tmp_path / "runs" / "r")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    assert saved["format"] >= 7 and saved["config"]["wandb_project"] == "sql-lora"


def test_mask_prompt_on_text_data_is_refused_as_mlx_lm_refuses_it(tmp_path, base, capsys):
    """mask_prompt: true on {"text": ...} rows trained every token without a word; mlx-lm
    raises "Prompt masking not supported for text dataset": one line naming file, key, data."""
    root = tmp_path / "text"
    root.mkdir()
    for split in ("train", "valid"):
        (root / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": f"row {i} of some text"}) + "\n" for i in range(6)))
    cfg = {"model": str(base), "data": str(root), "iters": 1, "batch_size": 2, "num_layers": 1,
           "max_seq_length": 64, "mask_prompt": True,
           "adapter_path": str(tmp_path / "runs" / "r")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["-c", str(path), "--no-progress"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'mask_prompt': expected false for text data "
        f"({root / 'train.jsonl'} holds {{'text': ...}} rows, no prompt and completion or "
        "messages; mlx-lm refuses prompt masking on a text dataset), found true")
    assert not (tmp_path / "runs" / "r").exists()
    # the command line's --data.no-mask-prompt wins over the file, as mlx-lm's flags do
    assert main(["-c", str(path), "--no-progress", "--no-compile", "--data.no-mask-prompt"]) == 0


def _text_folder(root: Path) -> Path:
    """An mlx-lm data folder of {"text": ...} rows: train, valid and test."""
    root.mkdir()
    for split in ("train", "valid", "test"):
        (root / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": f"row {i} of some text"}) + "\n" for i in range(6)))
    return root


def _masks_nothing(file: Path, scored: str = "trains") -> str:
    return ("--data.mask-prompt: expected prompt and completion or messages rows (a prompt to "
            f"mask), found {{'text': ...}} rows in {file} (nothing to mask: every token "
            f"{scored}; mlx-lm refuses prompt masking on a text dataset); drop it")


def test_data_mask_prompt_given_on_text_rows_is_refused_by_train_eval_and_sweep(
        tmp_path, base, capsys):
    """--data.mask-prompt given on a folder of {"text": ...} rows was taken and masked nothing
    (every token trained, or was scored); mlx-lm's create_dataset refuses mask_prompt on a text
    dataset. toymlx-train (flags, or the flag over an mlx-lm file, which skipped the file's
    check), toymlx-eval and toymlx-sweep's pre-check refuse it in one line naming the file; a
    run that does not give it (toymlx's default, masked) still trains on text rows."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.sweep import main as sweep_main

    root = _text_folder(tmp_path / "text")
    runs = tmp_path / "runs"
    flags = ["--recipe", "lora", "--base", str(base), "--data.path", str(root), "--steps", "1",
             "--batch-size", "2", "--seq-len", "32", "--no-progress", "--no-compile",
             "--runs-root", str(runs)]
    assert main([*flags, "--run-id", "given", "--data.mask-prompt"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {_masks_nothing(root / 'train.jsonl')}"
    assert main([*flags, "--run-id", "default"]) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["default"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(root), "iters": 1,
                                    "batch_size": 2, "num_layers": 1, "max_seq_length": 64}))
    assert main(["-c", str(path), "--data.mask-prompt", "--runs-root", str(runs), "--run-id",
                 "c", "--no-progress"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {_masks_nothing(root / 'train.jsonl')}"
    assert eval_main(["--model", str(base), "--data.path", str(root), "--data.mask-prompt",
                      "--no-progress"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {_masks_nothing(root / 'test.jsonl', 'is scored')}")
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root",
                       str(tmp_path / "s"), "--sweep-id", "m", "--no-progress", "--no-report",
                       "--", "--data.mask-prompt"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run lr=0.0001: {_masks_nothing(root / 'train.jsonl')}; no run "
        "was started")
    assert not (tmp_path / "s").exists()


def test_data_train_turns_given_on_text_rows_is_refused_by_train_and_sweep(tmp_path, base,
                                                                            capsys):
    """--data.train-turns given on a folder of {"text": ...} rows was taken and picked no turn
    (every token trained); refused as --data.mask-prompt is there, in one line naming the file:
    by toymlx-train (a flag, or a toymlx config file's key) and toymlx-sweep's pre-check. Not
    given (its default; an mlx-lm file's mask_prompt: false, which fixes it at last), the run
    still trains; toymlx-eval takes no --data.train-turns (a run's own)."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.sweep import main as sweep_main

    root = _text_folder(tmp_path / "text")
    runs = tmp_path / "runs"
    flags = ["--recipe", "lora", "--base", str(base), "--data.path", str(root), "--steps", "1",
             "--batch-size", "2", "--seq-len", "32", "--no-progress", "--no-compile",
             "--runs-root", str(runs)]
    no_turns = ("--data.train-turns: expected messages rows (the turns it picks from), found "
                f"{{'text': ...}} rows in {root / 'train.jsonl'} (no turns to pick: every token "
                "trains); drop it")
    for given, typed in ((["--data.train-turns", "last"], "--data.train-turns"),
                         (["--data.train-turns=assistant"], "--data.train-turns"),
                         (["--data.no-mask-prompt", "--data.train_turns", "last"],
                          "--data.train_turns")):  # named as typed
        assert main([*flags, "--run-id", "given", *given]) == 2
        assert error_line(capsys) == ("toymlx-train: error: "
                                      + no_turns.replace("--data.train-turns", typed))
    toymlx_file = tmp_path / "t.yaml"
    toymlx_file.write_text(yaml.safe_dump({"recipe": "lora", "data": {"train_turns": "last"}}))
    assert main(["-c", str(toymlx_file), *flags[2:], "--run-id", "file"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {toymlx_file}: key "
                                  f"'data: {{train_turns}}': {no_turns.partition(': ')[2]}")
    assert not runs.exists()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(root), "iters": 1,
                                    "batch_size": 2, "num_layers": 1, "max_seq_length": 64}))
    assert main(["-c", str(path), "--runs-root", str(runs), "--run-id", "mlx-lm",
                 "--no-progress", "--no-compile"]) == 0
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root",
                       str(tmp_path / "s"), "--sweep-id", "m", "--no-progress", "--no-report",
                       "--", "--data.train-turns", "last"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run lr=0.0001: {no_turns}; no run was started")
    assert not (tmp_path / "s").exists()
    assert eval_main(["--model", str(base), "--data.path", str(root), "--data.train-turns",
                      "last"]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        "toymlx-eval: error: --data.train-turns: expected an option of toymlx-eval, got an "
        "unknown one")


def test_chat_options_on_text_rows_end_in_the_words_the_user_gave_them(tmp_path, base, capsys):
    """The refusal of --data.mask-prompt or --data.train-turns on {"text": ...} rows ended
    "drop --data.mask-prompt", a flag, where a toymlx config file's key set it (from the command
    and from `toymlx.train(config=...)`) or `train`'s keyword did: it ends "drop it" now, its
    head naming the key in the file, or the keyword."""
    import toymlx

    root = _text_folder(tmp_path / "text")
    runs = tmp_path / "runs"
    file = tmp_path / "t.yaml"
    file.write_text(yaml.safe_dump({"recipe": "lora", "base": str(base), "steps": 1,
                                    "seq_len": 32, "data": {"path": str(root),
                                                            "mask_prompt": True}}))
    said = (f"{file}: key 'data: {{mask_prompt}}': expected prompt and completion or messages "
            f"rows (a prompt to mask), found {{'text': ...}} rows in {root / 'train.jsonl'} "
            "(nothing to mask: every token trains; mlx-lm refuses prompt masking on a text "
            "dataset); drop it")
    assert main(["-c", str(file), "--runs-root", str(runs), "--no-progress"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {said}"
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train(config=str(file), runs_root=str(runs), echo=False)
    assert str(caught.value) == f"toymlx-train: error: {said}"
    with pytest.raises(toymlx.OptionError) as caught:
        toymlx.train("lora", base=str(base), data={"path": str(root), "train_turns": "last"},
                     steps=1, seq_len=32, runs_root=str(runs), echo=False)
    assert str(caught.value) == (
        'toymlx-train: error: data={"train_turns": ...}: expected messages rows (the turns it '
        f"picks from), found {{'text': ...}} rows in {root / 'train.jsonl'} (no turns to pick: "
        "every token trains); drop it")
    assert not runs.exists()


def test_the_mask_prompt_check_reads_train_jsonl_s_first_example_only(tmp_path, base, chats,
                                                                      monkeypatch):
    """The check that mask_prompt: true has no text data read all of train.jsonl, and the
    recipe then read it again: a large file was read twice before step 1. Now the check reads
    its first example (`first_kind`) and train.jsonl is loaded once."""
    from toymlx.data import chat

    loaded, load = [], chat.load_examples
    monkeypatch.setattr(chat, "load_examples",
                        lambda p, keys=None: loaded.append(Path(p)) or load(p, keys))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(chats), "iters": 1, "batch_size": 2, "num_layers": 1,
        "max_seq_length": 64, "mask_prompt": True, "val_batches": 1,
        "adapter_path": str(tmp_path / "runs" / "r")}))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    assert loaded == [chats / "train.jsonl", chats / "valid.jsonl"]


def test_a_hugging_face_model_the_hub_cannot_give_is_named_by_the_file_s_key(
        tmp_path, data, capsys, monkeypatch):
    """`model: USER/REPO` (mlx-lm's Hugging Face folder, read as hf:) that is in no cache and
    cannot be fetched: the line names the file and its key 'model', toymlx's --base in brackets,
    as a missing GGUF path is; it began `--base hf:USER/REPO: ...`, naming a flag the user never
    typed, and its closing advice names the file's key as well (it said `--base PATH.gguf`)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("LLAMA_CACHE", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": "someone/NoSuchModel", "data": str(data),
                                    "iters": 1, "batch_size": 2, "max_seq_length": 32}))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "runs"), "--no-progress"]) == 2
    line = error_line(capsys)
    assert line.startswith(
        f"toymlx-train: error: {path}: key 'model' (toymlx's --base): hf:someone/NoSuchModel: "
        f"not in the Hugging Face cache {tmp_path / 'hub'} and HF_HUB_OFFLINE is set"), line
    assert line.endswith(f"or give the GGUF file itself: set model: PATH.gguf in {path} (or "
                         "pass --base PATH.gguf)"), line


def _mlx_lm_default(model) -> list[set[str]]:
    """The module paths mlx-lm's linear_to_lora_layers wraps in each block of `model` when its
    config gives no keys."""
    from mlx_lm.tuner.lora import LoRALinear as MlxLmLoRA
    from mlx_lm.tuner.lora import LoRASwitchLinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 2, "scale": 1.0, "dropout": 0.0})
    return [{p for p, m in block.named_modules() if isinstance(m, (MlxLmLoRA, LoRASwitchLinear))}
            for block in model.layers]


def _mlx_lm_models() -> list[tuple[str, nn.Module, object]]:
    """(name, mlx-lm's tiny model, toymlx's LlamaArgs of the same shape) for each architecture
    whose mlx-lm names `toymlx.models.lora.MLX_LM_KEYS` reads: llama, phi3, qwen3_5 (its
    linear-attention blocks and its full-attention one), qwen3_moe, mixtral, qwen2_moe, and
    gemma4 as E2B (per-layer embeddings, a shared-KV tail: arch_files.gemma4_args) and as 31B
    (no per-layer embeddings, the full blocks' values their keys')."""
    from arch_files import gemma4_args
    from mlx_lm.models import gemma4_text, llama, mixtral, phi3, qwen2_moe, qwen3_5, qwen3_moe

    from toymlx.models.llama import LlamaArgs

    small = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
             "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
             "vocab_size": 300}
    dense = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)
    moe = {"num_experts": 4, "num_experts_per_tok": 2}
    qwen35 = LlamaArgs(arch="qwen35", attn_out_gate=True, qk_norm=True, rope_neox=True,
                       n_layers=4, linear_layers=(True, True, True, False), ssm_head_dim=16,
                       ssm_k_heads=2, ssm_v_heads=4)
    gemma4 = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6,
              "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16,
              "global_head_dim": 32, "num_key_value_heads": 1, "vocab_size": 300,
              "vocab_size_per_layer_input": 300,
              "layer_types": ["sliding_attention", "full_attention"] * 3}
    return [
        ("llama", llama.Model(llama.ModelArgs(model_type="llama", **small)), dense),
        ("phi3", phi3.Model(phi3.ModelArgs(model_type="phi3", **small)),
         replace(dense, arch="phi3", fused_qkv=True, fused_gate_up=True)),
        ("qwen3_5", qwen3_5.TextModel(qwen3_5.TextModelArgs(
            model_type="qwen3_5", **{**small, "num_hidden_layers": 4}, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16)), qwen35),
        ("qwen3_moe", qwen3_moe.Model(qwen3_moe.ModelArgs(
            model_type="qwen3_moe", **small, **moe, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=32, head_dim=16, rope_theta=1e6, tie_word_embeddings=True,
            max_position_embeddings=256, norm_topk_prob=True)),
         replace(dense, arch="qwen3moe", n_experts=4, n_experts_used=2)),
        ("mixtral", mixtral.Model(mixtral.ModelArgs(
            model_type="mixtral", **small, num_local_experts=4, num_experts_per_tok=2)),
         replace(dense, n_experts=4, n_experts_used=2)),
        ("qwen2_moe", qwen2_moe.Model(qwen2_moe.ModelArgs(
            model_type="qwen2_moe", **small, **moe, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)),
         replace(dense, arch="qwen2moe", n_experts=4, n_experts_used=2,
                 shared_expert_ffn_dim=32)),
        ("gemma4 E2B", gemma4_text.Model(gemma4_text.ModelArgs(
            **gemma4, num_kv_shared_layers=2, hidden_size_per_layer_input=8)), gemma4_args()),
        ("gemma4 31B", gemma4_text.Model(gemma4_text.ModelArgs(
            **gemma4, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
            attention_k_eq_v=True)),
         replace(gemma4_args(), k_eq_v=True, shared_kv_layers=0, per_layer_dim=0,
                 ffn_dims_per_block=None)),
    ]


def test_mlx_lm_s_module_paths_are_each_block_s_as_mlx_lm_builds_it():
    """`mlx_lm_modules`, per block, is the set of modules mlx-lm's own linear_to_lora_layers
    wraps in that block when its config gives no keys, on mlx-lm's own model of each
    architecture (qwen3_5's linear_attn.* in its linear-attention blocks, self_attn.* in its
    full-attention one; a mixture of experts' router and switch_mlp experts, mixtral's under
    block_sparse_moe, qwen2_moe's shared expert too; gemma4 E2B's per_layer_input_gate and
    per_layer_projection in every block, its shared-KV tail without k and v, 31B's full blocks
    without v); every path MLX_LM_KEYS names is one of them; and --lora.targets mlx-lm-default
    is what those paths map to (before: all-linear, which leaves the router out, and qwen3_5's
    and MoE keys were refused; gemma4's per-layer-input pair was left out)."""
    from toymlx.models.lora import MLX_LM_KEYS, mlx_lm_modules, resolve_targets

    seen: set[str] = set()
    for name, model, a in _mlx_lm_models():
        theirs = _mlx_lm_default(model)
        ours = [mlx_lm_modules(a, i) for i in range(a.n_layers)]
        assert theirs == [set(m) for m in ours], name
        seen |= set().union(*theirs)
        if name != "qwen2_moe":  # its shared expert: no --lora.targets name (refused)
            mapped = {t for m in ours for t in m.values()}
            assert set(resolve_targets("mlx-lm-default", a)) == mapped, name
    assert seen == set(MLX_LM_KEYS)


MLX_LM_MAPPING = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o",
    "linear_attn.in_proj_qkv": "qkv", "linear_attn.in_proj_z": "z",
    "linear_attn.in_proj_b": "beta", "linear_attn.in_proj_a": "alpha",
    "linear_attn.out_proj": "out", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
    "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down", "mlp.gate": "router",
    "mlp.switch_mlp.gate_proj": "gate", "mlp.switch_mlp.up_proj": "up",
    "mlp.switch_mlp.down_proj": "down", "block_sparse_moe.gate": "router",
    "block_sparse_moe.switch_mlp.gate_proj": "gate", "block_sparse_moe.switch_mlp.up_proj": "up",
    "block_sparse_moe.switch_mlp.down_proj": "down", "per_layer_input_gate": "ple_gate",
    "per_layer_projection": "ple_proj"}
"""Each mlx-lm module path toymlx adapts -> its --lora.targets name (qwen35's linear-attention
projections: toymlx.models.gated_delta's qkv, z (attn_gate), beta, alpha, out (ssm_out); a MoE's
router ffn_gate_inp, its experts' gate, up and down their 3-D tensors; gemma4's per-layer-input
gate and projection, blk.N.inp_gate and blk.N.proj)."""


@pytest.mark.parametrize("key,target", MLX_LM_MAPPING.items())
def test_each_mlx_lm_key_maps_to_its_target(key, target):
    options, rows, _ = mlx_lm_options({"model": "m.gguf", "lora_parameters": {
        "rank": 8, "scale": 20.0, "dropout": 0.0, "keys": [key]}}, "f.yaml")
    assert options["lora.targets"] == target
    assert ("lora_parameters.keys", "--lora.targets", target, "file") in rows


@pytest.mark.parametrize("key", ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                                 "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"])
def test_qwen2_moe_s_shared_expert_key_alone_is_refused(key):
    """toymlx has no target for qwen2_moe's shared expert: that key is one line naming it and
    the paths toymlx can adapt; the router and experts' keys beside it map."""
    with pytest.raises(ConfigFileError) as e:
        mlx_lm_options({"lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0,
                                            "keys": ["mlp.gate", key]}}, "f.yaml")
    assert str(e.value) == (
        f"f.yaml: key 'lora_parameters.keys': expected module paths toymlx can adapt "
        f"({', '.join(MLX_LM_MAPPING)}), found \"{key}\": qwen2_moe's shared expert, which no "
        "--lora.targets adapts")


def test_without_keys_is_mlx_lm_default_and_the_table_says_the_router(tmp_path):
    """An mlx-lm config without lora_parameters.keys: --lora.targets mlx-lm-default, its row
    saying that a mixture of experts' router is adapted too; toymlx's own all-linear keeps its
    meaning (router out) where the command line gives it."""
    options, rows, _ = mlx_lm_options({"model": "m.gguf"}, "f.yaml")
    assert options["lora.targets"] == "mlx-lm-default"
    assert ("lora_parameters.keys", "--lora.targets", "mlx-lm-default",
            "mlx-lm default (every linear layer of a block, a mixture of experts' router too)"
            ) in rows


def test_a_config_without_keys_on_qwen35_trains_its_linear_blocks_projections(tmp_path, capsys):
    """An mlx-lm config without lora_parameters.keys on a qwen35 base: the table says
    mlx-lm-default, config.json keeps it as given, run_start records what it resolved to on this
    base (q,k,v,o of the full-attention block; qkv,z,beta,alpha,out of the 3 linear-attention
    ones; the MLP's in all 4), and the adapter holds a pair for each of those 31 projections."""
    from test_archs import qwen35_gguf

    from toymlx.training.adapter import load_adapter

    path = _one_step_config(tmp_path, qwen35_gguf(tmp_path / "q.gguf"))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in capsys.readouterr().out.splitlines()}
    assert rows[("lora_parameters.keys", "--lora.targets")][:3] == [
        "mlx-lm-default", "mlx-lm", "default"]
    run = tmp_path / "runs" / "r"
    assert json.loads((run / "config.json").read_text())["config"]["lora"]["targets"] == (
        "mlx-lm-default")
    start = read_events(run)[0]
    every = "q,k,v,qkv,o,gate,up,down,z,beta,alpha,out"
    assert start["config"]["lora_targets_resolved"] == every
    assert start["model"]["lora_targets"] == every and start["model"]["lora_blocks_reached"] == 4
    pairs = load_adapter(run).pairs
    assert len(pairs) == 3 * 8 + 7
    assert {n for n in pairs if n.startswith("blk.0.")} == {
        f"blk.0.{t}.weight" for t in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha",
                                      "ssm_out", "ffn_gate", "ffn_up", "ffn_down")}


def test_a_config_without_keys_on_gemma4_trains_its_per_layer_input_pair(tmp_path, capsys):
    """An mlx-lm config without lora_parameters.keys on a gemma4 E2B-shaped base: run_start
    records mlx-lm's default as it resolves there, the per-layer-input gate and projection of
    every block included (before: left out, where mlx-lm adapts them; and the memory estimate
    had no size for them), and the adapter holds their pairs under llama.cpp's names
    (blk.N.inp_gate, blk.N.proj) beside the 7 projections of each of the 4 blocks with keys and
    values and the 5 of the 2 shared-KV blocks."""
    from arch_files import gemma4_gguf

    from toymlx.training.adapter import load_adapter

    path = _one_step_config(tmp_path, gemma4_gguf(tmp_path / "g.gguf"))
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    capsys.readouterr()
    start = read_events(tmp_path / "runs" / "r")[0]
    every = "q,k,v,o,gate,up,down,ple_gate,ple_proj"
    assert start["config"]["lora_targets_resolved"] == every
    assert start["model"]["lora_targets"] == every and start["model"]["lora_blocks_reached"] == 6
    pairs = load_adapter(tmp_path / "runs" / "r").pairs
    assert len(pairs) == 4 * 9 + 2 * 7
    assert {n for n in pairs if n.startswith("blk.5.")} == {
        f"blk.5.{t}.weight" for t in ("attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                      "inp_gate", "proj")}


def _one_step_config(tmp_path: Path, model: Path, **extra) -> Path:
    """An mlx-lm config training `model` one iteration on 8 text rows (its run: runs/r)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split, n in (("train", 8), ("valid", 2)):
        (data / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": f"row {i}: the number {i * 7 % 10} follows {i}"}) + "\n"
            for i in range(n)))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(model), "data": str(data), "iters": 1,
        "batch_size": 2, "max_seq_length": 48, "val_batches": 1, "steps_per_eval": 1,
        "adapter_path": str(tmp_path / "runs" / "r"), **extra}))
    return path


def _moe_config(tmp_path: Path, **extra) -> Path:
    """`_one_step_config` on the tiny qwen3moe file (tests/mlx_lm_adapters.py)."""
    from mlx_lm_adapters import qwen3moe_gguf

    return _one_step_config(tmp_path, qwen3moe_gguf(tmp_path / "moe.gguf"), **extra)


def test_a_config_without_keys_on_a_mixture_of_experts_trains_its_router(tmp_path, capsys):
    """An mlx-lm config without lora_parameters.keys on a qwen3moe base adapts what mlx-lm's
    default does there, the router (ffn_gate_inp) among it: the table's row says so, run_start's
    lora_targets_resolved lists router, and the adapter holds its pairs (before: all-linear,
    the router left out, so such a file trained less than mlx-lm would)."""
    from toymlx.training.adapter import load_adapter

    path = _moe_config(tmp_path)
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 0
    rows = {tuple(x.split()[:2]): " ".join(x.split()[2:])
            for x in capsys.readouterr().out.splitlines()}
    assert rows[("lora_parameters.keys", "--lora.targets")] == (
        "mlx-lm-default mlx-lm default (every linear layer of a block, a mixture of experts' "
        "router too)")
    run = tmp_path / "runs" / "r"
    start = read_events(run)[0]
    assert start["config"]["lora_targets_resolved"] == "q,k,v,o,gate,up,down,router"
    assert set(load_adapter(run).pairs) == {f"blk.{i}.{t}.weight" for i in (0, 1) for t in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
        "ffn_up_exps", "ffn_down_exps")}


@pytest.mark.parametrize("key", ["mlp.gate_proj", "block_sparse_moe.gate",
                                 "linear_attn.in_proj_z"])
def test_a_key_the_base_s_blocks_lack_is_one_line(tmp_path, capsys, key):
    """A key naming a module no block of the base has, which mlx-lm would adapt nothing for
    (its keys match module paths): a dense MLP's mlp.gate_proj on a mixture of experts (toymlx's
    gate there is its experts' tensor), mixtral's router name on qwen3_moe, qwen3_5's
    linear-attention z on another base: one line naming the file's key and the base's paths,
    before any training."""
    path = _moe_config(tmp_path, lora_parameters={"rank": 4, "scale": 2.0, "dropout": 0.0,
                                                  "keys": ["self_attn.q_proj", key]})
    assert main(["-c", str(path), "--no-progress", "--no-compile"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: key 'lora_parameters.keys': expected module paths this "
        "qwen3moe base's blocks have (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
        "self_attn.o_proj, mlp.gate, mlp.switch_mlp.gate_proj, mlp.switch_mlp.up_proj, "
        f"mlp.switch_mlp.down_proj), found \"{key}\", which mlx-lm would adapt in none of them")
    assert not (tmp_path / "runs" / "r").exists()
    # --lora.targets on the command line replaces the file's keys, with toymlx's meaning
    assert main(["-c", str(path), "--no-progress", "--no-compile", "--lora.targets", "q,router"]
                ) == 0


def _evals(run: Path) -> list[float]:
    return [e["val_loss"] for e in read_events(run) if e["kind"] == "eval"]


def _said(err: str, prog: str) -> list[str]:
    """The notes `prog` printed (`prog: F: key ...`), less its name."""
    return [x.removeprefix(f"{prog}: ") for x in err.splitlines() if x.startswith(f"{prog}: ")
            and ": key '" in x]


def test_a_sweep_over_an_mlx_lm_config_runs_what_toymlx_train_runs(tmp_path, base, data,
                                                                   capsys):
    """`toymlx-sweep -c F --grid ...` over mlx-lm's lora config: each run is `toymlx-train -c F`
    with its grid values as flags (the same resolved options, a --lora.rank over the file
    keeping mlx-lm's scale, the same losses), and the keys toymlx does not honour are told in
    the same words; adapter_path gives way to the sweep's folder for each run, as to
    --runs-root and --run-id given to toymlx-train."""
    from toymlx_cli.sweep import main as sweep_main

    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(base), "data": str(data), "iters": 2, "batch_size": 2,
        "learning_rate": 1e-3, "num_layers": 1, "steps_per_eval": 2, "val_batches": 1,
        "max_seq_length": 64, "trust_remote_code": True, "adapter_path": "adapters",
        "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}}))
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4", "--grid", "lora.rank=2,8",
                       "--runs-root", str(tmp_path / "sweeps"), "--sweep-id", "s",
                       "--no-progress", "--no-report", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    assert "mlx-lm" not in out  # stdout: the sweep's final table alone
    assert err.startswith(f"{path}: read as mlx-lm's lora config:\n")
    rows = {tuple(x.split()[:2]): x.split()[2:] for x in err.splitlines()}
    assert rows[("learning_rate", "--lr")] == ["1e-4", "the", "sweep's", "grid,", "over", "the",
                                               "file"]
    swept = _said(err, "toymlx-sweep")
    assert f"{path}: key 'trust_remote_code': not honoured (toymlx runs no model code from a " \
           "repository)" in swept
    for rank in (2, 8):
        run = tmp_path / "sweeps" / "s" / f"lr=0.0001_lora.rank={rank}"
        assert main(["-c", str(path), "--lr", "0.0001", "--lora.rank", str(rank),
                     "--no-progress", "--no-compile", "--runs-root", str(tmp_path / "runs"),
                     "--run-id", f"r{rank}"]) == 0
        trained = _said(capsys.readouterr().err, "toymlx-train")
        assert trained == swept  # the notes, word for word
        alone = tmp_path / "runs" / f"r{rank}"
        got, want = (json.loads((d / "config.json").read_text()) for d in (run, alone))
        for saved in (got, want):
            del saved["config"]["runs_root"], saved["config"]["run_id"]
        assert got == want
        assert got["config"]["lora"]["alpha"] == 10.0 * rank  # mlx-lm's scale, at any rank
        assert _evals(run) == _evals(alone) and len(_evals(run)) == 2


@pytest.mark.parametrize("key, value", [
    ("hf_dataset", {"path": "mlx-community/wikisql"}),  # refused: it changes what is trained
    ("train", False),
])
def test_an_mlx_lm_key_toymlx_cannot_honour_is_refused_by_the_sweep_as_by_toymlx_train(
        tmp_path, base, data, capsys, key, value):
    from toymlx_cli.sweep import main as sweep_main

    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 2,
                                    "max_seq_length": 64, key: value}))
    assert main(["-c", str(path), "--lr", "1e-4", "--runs-root", str(tmp_path / "r")]) == 2
    trained = error_line(capsys).removeprefix("toymlx-train: error: ")
    assert trained.startswith(f"{path}: key {key!r}: expected ")
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root",
                       str(tmp_path / "s")]) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {trained}"
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()


def test_a_folder_without_valid_jsonl_trains_on_every_example_as_mlx_lm(tmp_path, base, data,
                                                                          capsys):
    """mlx-lm trains on all of train.jsonl where a folder has no valid.jsonl and validates
    nothing ("Validation set not found or empty"); an mlx-lm file held back its last tenth, as
    toymlx's own default does. Now the file's meaning: every example trained on, no validation,
    one line saying so and how to hold back a tenth; --data.val-fraction over the file keeps
    toymlx's, and toymlx's own options its tenth."""
    folder = tmp_path / "no_valid"
    folder.mkdir()
    (folder / "train.jsonl").write_text((data / "train.jsonl").read_text())
    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(folder), "iters": 2,
                                    "batch_size": 4, "max_seq_length": 64, "num_layers": 1,
                                    "steps_per_eval": 1}))
    note = (f"{folder}: no valid.jsonl: every example of train.jsonl is trained on and none "
            "validates, as in mlx-lm (its \"Validation set not found or empty\"); "
            "--data.val-fraction 0.1 holds back its last tenth to validate on")
    runs = tmp_path / "runs"
    assert main(["-c", str(path), "--no-progress", "--no-compile", "--runs-root", str(runs),
                 "--run-id", "all"]) == 0
    out, err = capsys.readouterr()
    assert f"toymlx-train: {note}" in err.splitlines()
    assert "no valid.jsonl: the last" not in err
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()}
    assert rows[("(none)", "--data.val-fraction")] == ["0.0", "mlx-lm's,", "fixed"]
    saved = json.loads((runs / "all" / "config.json").read_text())["config"]
    assert saved["data"]["val_fraction"] == 0.0
    events = read_events(runs / "all")
    assert not [e for e in events if e["kind"] == "eval"]
    start = next(e for e in events if e["kind"] == "run_start")["config"]
    assert (start["train_rows"], start["val_rows"]) == (12, 0)  # one example a row, all 12
    assert main(["-c", str(path), "--data.val-fraction", "0.1", "--no-progress",
                 "--no-compile", "--runs-root", str(runs), "--run-id", "tenth"]) == 0
    err = capsys.readouterr().err
    assert note not in err and f"{folder}: no valid.jsonl: the last 1 of train.jsonl's 12" in err
    assert [e["step"] for e in read_events(runs / "tenth") if e["kind"] == "eval"] == [0, 1, 2]


def test_an_empty_valid_jsonl_trains_on_every_example_as_mlx_lm(tmp_path, base, data, capsys):
    """mlx-lm trains with a valid.jsonl without examples as without one ("Validation set not
    found or empty"); an mlx-lm file on it was refused ("empty file"). Now it trains on every
    example and validates none, one line saying so; a resume reads the same split."""
    folder = tmp_path / "empty_valid"
    folder.mkdir()
    (folder / "train.jsonl").write_text((data / "train.jsonl").read_text())
    (folder / "valid.jsonl").write_text("\n\n")
    path = tmp_path / "lora_config.yaml"
    run = tmp_path / "runs" / "r"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(folder), "iters": 2,
                                    "batch_size": 4, "max_seq_length": 64, "num_layers": 1,
                                    "save_every": 1, "adapter_path": str(run)}))
    assert main(["-c", str(path), "--no-progress", "--no-compile", "--stop-at", "1"]) == 0
    err = capsys.readouterr().err
    assert (f"toymlx-train: {folder / 'valid.jsonl'}: no examples: every example of train.jsonl "
            "is trained on and none validates, as in mlx-lm (its \"Validation set not found or "
            "empty\"); write examples into it to validate on them") in err.splitlines()
    start = next(e for e in read_events(run) if e["kind"] == "run_start")["config"]
    assert (start["train_rows"], start["val_rows"]) == (12, 0)
    assert main(["--resume", str(run), "--no-progress", "--no-compile"]) == 0
    assert [e["step"] for e in read_events(run) if e["kind"] == "step"] == [1, 2]
    assert not [e for e in read_events(run) if e["kind"] == "eval"]


def test_a_sweep_says_once_what_each_run_says_of_a_folder_without_valid_jsonl(
        tmp_path, base, data, capsys):
    """Each run trains on all of train.jsonl and validates nothing, as mlx-lm (it validated on
    train.jsonl's last tenth, not trained on): said once by the sweep and in each run's log."""
    from toymlx_cli.sweep import main as sweep_main

    folder = tmp_path / "no_valid"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text((data / f"{split}.jsonl").read_text())
    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(folder), "iters": 1,
                                    "batch_size": 2, "max_seq_length": 64}))
    root = tmp_path / "s"
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root", str(root),
                       "--sweep-id", "nv", "--no-progress", "--no-report"]) == 0
    note = (f"{folder}: no valid.jsonl: every example of train.jsonl is trained on and none "
            "validates, as in mlx-lm (its \"Validation set not found or empty\"); "
            "--data.val-fraction 0.1 holds back its last tenth to validate on")
    err = capsys.readouterr().err.splitlines()
    assert err.count(f"toymlx-sweep: {note}") == 1
    assert err.index(f"toymlx-sweep: {note}") < next(
        i for i, line in enumerate(err) if line.startswith(f"sweep {root / 'nv'}: "))
    for run in ("lr=0.0001", "lr=0.0003"):  # the runs' own words
        assert f"toymlx-train: {note}" in (root / "nv" / "logs" / f"{run}.log").read_text()


def test_a_sweep_refuses_an_unreadable_example_before_any_run(tmp_path, base, data, capsys):
    """A row that is not JSON failed every run, each a second into its start (after its base
    was read); the examples are now read with the options, before any run."""
    from toymlx_cli.sweep import main as sweep_main

    folder = tmp_path / "cut"
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text((data / f"{split}.jsonl").read_text())
    with open(folder / "train.jsonl", "a") as f:
        f.write('{"prompt": "x"\n')
    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(folder), "iters": 1}))
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root",
                       str(tmp_path / "s")]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run lr=0.0001: {folder / 'train.jsonl'}:13: bad JSON (Expecting "
        "',' delimiter at column 15, where the text ends: cut short?); expected one object per "
        'line {"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}; no run '
        "was started")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("row, said", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
     "'messages' examples need a chat template, and {base} has none"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
     ("\"conversations\" (ShareGPT's, read as 'messages'): expected a tokenizer with a chat "
     "template")),
])
def test_a_sweep_refuses_chat_rows_on_a_base_without_a_template_before_any_run(
        tmp_path, capsys, row, said):
    """Every run failed a second into its start, each with the same line, the base read by
    each; now the line is toymlx-train's, once, and no run starts."""
    from toymlx_cli.sweep import main as sweep_main

    base = tmp_path / "plain.gguf"
    write_llama(base, Llama(tiny(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48,
                                 context=64)), byte_tokenizer().to_metadata(), name="plain")
    folder = tmp_path / "chat"
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(folder), "iters": 1,
                                    "max_seq_length": 32}))
    assert main(["-c", str(path), "--runs-root", str(tmp_path / "r"), "--run-id", "one"]) == 2
    trained = error_line(capsys).removeprefix("toymlx-train: error: ")
    assert trained.startswith(f"{folder / 'train.jsonl'}:1: " + said.format(base=base))
    assert sweep_main(["-c", str(path), "--grid", "lr=1e-4,3e-4", "--runs-root",
                       str(tmp_path / "s")]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run lr=0.0001: {trained}; no run was started")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("grid, line", [
    # the closest option by spelling was named first: "(did you mean test?)", then --steps
    ("iters=10,20", ("--grid iters: expected an option of recipe lora, found no option --iters; "
     "mlx-lm's iters is toymlx's --steps")),
    ("num_layers=2,4", ("--grid num_layers: expected an option of recipe lora, found no option "
     "--num-layers; mlx-lm's num_layers is toymlx's --lora.layers (--full.layers for a full "
     "fine-tune)")),
    # lora_parameters' keys were named with no toymlx option (scale), or the closest by spelling
    ("lora_parameters.scale=10,20", ("--grid lora_parameters.scale: expected an option of recipe "
     "lora, found no option --lora-parameters.scale; mlx-lm's lora_parameters.scale is toymlx's "
     "--lora.alpha at scale x rank (rank 8, scale 20: --lora.alpha 160)")),
    ("lora_parameters.rank=4,8", ("--grid lora_parameters.rank: expected an option of recipe "
     "lora, found no option --lora-parameters.rank; mlx-lm's lora_parameters.rank is toymlx's "
     "--lora.rank (--grid lora.rank keeps the file's scale: alpha = scale x rank)")),
    # not mlx-lm's: the closest option by spelling, as before
    ("lrr=1e-3", ("--grid lrr: expected an option of recipe lora, found no option --lrr (did you "
     "mean lr?)")),
])
def test_a_sweep_grid_flag_spelt_as_mlx_lm_s_key_names_its_toymlx_option_alone(
        tmp_path, base, data, capsys, grid, line):
    from toymlx_cli.sweep import main as sweep_main

    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 2}))
    assert sweep_main(["-c", str(path), "--grid", grid, "--runs-root", str(tmp_path / "s")]) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {line}"
    assert not (tmp_path / "s").exists()


def test_a_sweep_grid_key_spelt_as_mlx_lm_s_names_toymlx_s_option(tmp_path, base, data,
                                                                   capsys):
    """A sweep file's `grid: {learning_rate: ...}` names toymlx's option as the grid key to
    write there (lr; it named the flag --lr)."""
    from toymlx_cli.sweep import main as sweep_main

    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump({"model": str(base), "data": str(data), "iters": 2,
                                    "grid": {"learning_rate": [1e-4, 3e-4]}}))
    assert sweep_main(["-c", str(path), "--runs-root", str(tmp_path / "s")]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {path}: key 'grid.learning_rate': expected an option of recipe "
        "lora, found no option --learning-rate; mlx-lm's learning_rate is toymlx's lr")
    assert not (tmp_path / "s").exists()
