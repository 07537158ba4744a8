"""Model names in Ollama's and LM Studio's stores (fake stores laid out as each tool lays them
out), the commands that take them, and the Ollama Modelfile of a LoRA run."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from toymlx_cli import export as export_cli
from toymlx_cli import generate as generate_cli
from toymlx_cli.train import main as train_main

from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.bundle.model_store import (
    MODEL_LAYER,
    ModelStoreError,
    is_store_name,
    list_ollama,
    parse_ollama_name,
    resolve,
    resolve_model,
)
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import load_llama, write_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import write_gguf
from toymlx.interop.modelfile import parse_modelfile, quote, write_modelfile
from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import apply_lora
from toymlx.training.adapter import write_adapter

MEDIA = "application/vnd.ollama.image."
TEMPLATE = "{{ if .System }}<|system|>{{ .System }}</s>{{ end }}<|user|>{{ .Prompt }}</s>\n" \
           "<|assistant|>{{ .Response }}</s>"
PARAMS = {"stop": ["<|user|>"], "temperature": 0.5}
CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def add_blob(root: Path, data: bytes) -> str:
    """Store `data` as Ollama does (blobs/sha256-<hex of data>); its digest."""
    hexd = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{hexd}").write_bytes(data)
    return f"sha256:{hexd}"


def add_model(root: Path, name: str, gguf: bytes | None, extra: dict[str, bytes] | None = None,
              host: str = "registry.ollama.ai") -> Path:
    """A manifest as `ollama pull` writes it: manifests/HOST/NS/MODEL/TAG, schema 2."""
    _, ns, model, tag = parse_ollama_name(name)
    layers = []
    for kind, data in ([("model", gguf)] if gguf is not None else []) + list((extra or {}).items()):
        layers.append({"mediaType": MEDIA + kind, "digest": add_blob(root, data),
                       "size": len(data)})
    config = b'{"model_format":"gguf","model_family":"llama"}'
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      "digest": add_blob(root, config), "size": len(config)},
           "layers": layers}
    path = root / "manifests" / host / ns / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def ollama(tmp_path, stories_path, monkeypatch) -> Path:
    root = tmp_path / "ollama" / "models"
    data = stories_path.read_bytes()
    extra = {"template": TEMPLATE.encode(), "params": json.dumps(PARAMS).encode(),
             "license": b"MIT"}
    add_model(root, "stories", data, extra)
    add_model(root, "stories:260k", data)
    add_model(root, "alice/tiny:v1", data)
    add_model(root, "nomodel", None, {"template": b"{{ .Prompt }}"})
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


@pytest.fixture
def lmstudio(tmp_path, stories_path, monkeypatch) -> Path:
    root = tmp_path / "lmstudio" / "models"
    for rel in ("lmstudio-community/stories-GGUF/stories260K-Q8_0.gguf",
                "bob/multi-GGUF/multi-Q4_0.gguf", "bob/multi-GGUF/multi-Q8_0.gguf",
                "bob/multi-GGUF/mmproj-multi-f16.gguf"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stories_path, root / rel)
    monkeypatch.setenv("LMSTUDIO_MODELS", str(root))
    return root


def blob_of(root: Path, data: bytes) -> Path:
    return root / "blobs" / f"sha256-{hashlib.sha256(data).hexdigest()}"


def test_ollama_names_resolve_to_the_model_blob(ollama, stories_path):
    blob = blob_of(ollama, stories_path.read_bytes())
    for spec in ("ollama:stories", "ollama:stories:latest", "ollama:stories:260k",
                 "ollama:alice/tiny:v1", "ollama:registry.ollama.ai/alice/tiny:v1",
                 "ollama:Stories:LATEST"):
        assert resolve_model(spec) == blob, spec
    r = resolve("ollama:stories", "--base")
    assert r.store == "ollama" and r.name == "stories:latest"
    assert r.digest == "sha256:" + hashlib.sha256(stories_path.read_bytes()).hexdigest()
    assert r.layer_text("template") == TEMPLATE and json.loads(r.layer_text("params")) == PARAMS
    assert r.layer_text("system") is None
    assert r.record("base") == {"base_file": str(blob), "base_store": "ollama:stories:latest",
                                "base_sha256": r.digest[7:]}
    assert resolve("ollama:alice/tiny:v1").name == "alice/tiny:v1"
    assert sorted(list_ollama(ollama)) == ["alice/tiny:v1", "nomodel:latest", "stories:260k",
                                           "stories:latest"]
    # the one "file or run folder -> weights" resolver takes them too
    assert checkpoint_file("ollama:stories:260k") == blob


def test_ollama_not_found_lists_the_store(ollama, tmp_path, monkeypatch):
    with pytest.raises(ModelStoreError) as e:
        resolve_model("ollama:qwen2.5:7b", "--base")
    assert str(e.value) == (f"--base ollama:qwen2.5:7b: not in Ollama's store {ollama}; it has: "
                            "alice/tiny:v1, nomodel:latest, stories:260k, stories:latest")
    with pytest.raises(ModelStoreError, match="not an Ollama model name"):
        resolve_model("ollama:../../etc/passwd")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelStoreError, match=f"no Ollama store at {tmp_path / 'nowhere'}; "):
        resolve_model("ollama:stories")


def test_ollama_listing_is_cut_at_twenty(tmp_path, monkeypatch):
    root = tmp_path / "models"
    for i in range(23):
        add_model(root, f"m{i:02d}", None)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    with pytest.raises(ModelStoreError) as e:
        resolve_model("ollama:x")
    assert str(e.value).endswith("m18:latest, m19:latest and 3 more")


def test_lmstudio_hits_are_cut_at_twenty(tmp_path, monkeypatch):
    repo = tmp_path / "models" / "pub" / "many-GGUF"
    repo.mkdir(parents=True)
    for i in range(23):
        (repo / f"m{i:02d}.gguf").write_bytes(b"")
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "models"))
    with pytest.raises(ModelStoreError) as e:
        resolve_model("lmstudio:pub/many-GGUF", "--base")
    assert str(e.value).endswith("pub/many-GGUF/m18.gguf, pub/many-GGUF/m19.gguf and 3 more; "
                                 "name one, e.g. lmstudio:pub/many-GGUF/m00.gguf")
    assert ": names 23 GGUFs in LM Studio's folder " in str(e.value)


def test_ollama_manifest_without_model_layer_and_damaged_blob(ollama, stories_path):
    with pytest.raises(ModelStoreError) as e:
        resolve_model("ollama:nomodel", "--model")
    assert (f"--model ollama:nomodel: {ollama / 'manifests/registry.ollama.ai/library/nomodel'}"
            f"/latest: expected a layer of media type {MODEL_LAYER}") in str(e.value)
    assert "found ['application/vnd.ollama.image.template']" in str(e.value)
    (ollama / "manifests/registry.ollama.ai/library/broken").mkdir()
    (ollama / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")
    with pytest.raises(ModelStoreError, match="expected an Ollama manifest"):
        resolve_model("ollama:broken")
    # a blob whose bytes are not what its name says is refused
    data = stories_path.read_bytes()
    add_model(ollama, "tampered", data)
    blob = blob_of(ollama, data)
    good = blob.read_bytes()
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ModelStoreError) as e:
        resolve_model("ollama:tampered")
    assert f"{blob}: expected SHA-256 {blob.name[7:]} (its name), found " in str(e.value)
    blob.unlink()
    with pytest.raises(ModelStoreError, match="expected the model's blob"):
        resolve_model("ollama:tampered")


def test_lmstudio_names(lmstudio):
    one = lmstudio / "lmstudio-community/stories-GGUF/stories260K-Q8_0.gguf"
    for spec in ("lmstudio:lmstudio-community/stories-GGUF",
                 "lmstudio:lmstudio-community/stories-GGUF/stories260K-Q8_0.gguf",
                 "lmstudio:stories260K", "lmstudio:stories260k-q8_0.gguf"):
        assert resolve_model(spec) == one, spec
    assert resolve_model("lmstudio:bob/multi-GGUF/multi-Q8_0.gguf") == \
        lmstudio / "bob/multi-GGUF/multi-Q8_0.gguf"
    assert resolve_model("lmstudio:multi-Q4") == lmstudio / "bob/multi-GGUF/multi-Q4_0.gguf"
    r = resolve("lmstudio:multi-Q4")
    assert r.store == "lmstudio" and r.digest is None
    assert r.record("donor") == {"donor_file": str(lmstudio / "bob/multi-GGUF/multi-Q4_0.gguf"),
                                 "donor_store": "lmstudio:bob/multi-GGUF/multi-Q4_0.gguf"}
    with pytest.raises(ModelStoreError) as e:  # a repo of several GGUFs: the name picks one
        resolve_model("lmstudio:bob/multi-GGUF", "--base")
    assert str(e.value) == (f"--base lmstudio:bob/multi-GGUF: names 2 GGUFs in LM Studio's folder "
                            f"{lmstudio}: bob/multi-GGUF/multi-Q4_0.gguf, bob/multi-GGUF/"
                            "multi-Q8_0.gguf; name one, e.g. lmstudio:bob/multi-GGUF/"
                            "multi-Q4_0.gguf")
    with pytest.raises(ModelStoreError) as e:
        resolve_model("lmstudio:qwen", "--base")
    assert str(e.value) == (f"--base lmstudio:qwen: not in LM Studio's models folder {lmstudio}; "
                            "it has: bob/multi-GGUF/multi-Q4_0.gguf, bob/multi-GGUF/"
                            "multi-Q8_0.gguf, lmstudio-community/stories-GGUF/"
                            "stories260K-Q8_0.gguf")
    with pytest.raises(ModelStoreError, match="not in LM Studio"):  # projectors are no models
        resolve_model("lmstudio:mmproj")


def test_lmstudio_missing_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("LMSTUDIO_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelStoreError) as e:
        resolve_model("lmstudio:x/y")
    assert str(e.value) == (f"--model lmstudio:x/y: no LM Studio models folder at "
                            f"{tmp_path}/.lmstudio/models nor {tmp_path}/.cache/lm-studio/models;"
                            " set LMSTUDIO_MODELS to the folder LM Studio keeps models in")


def test_plain_paths_pass_through(tmp_path, monkeypatch):
    assert resolve_model("some/file.gguf") == Path("some/file.gguf")
    assert resolve("x.gguf").record("base") == {"base_file": str(Path("x.gguf").absolute())}
    monkeypatch.chdir(tmp_path)
    Path("ollama:odd.gguf").write_bytes(b"")  # an existing file of that name stays a file
    assert not is_store_name("ollama:odd.gguf") and is_store_name("ollama:stories")
    assert resolve_model("ollama:odd.gguf") == Path("ollama:odd.gguf")



def test_a_missing_user_repo_path_suggests_its_hf_name(tmp_path, monkeypatch, capsys):
    """mlx-lm's habit, a Hugging Face repository as the model (`--base USER/REPO`), read "found
    nothing at that path" alone: now it names hf:USER/REPO, in every command that takes a model;
    not where the name is a path (a .gguf, or into a folder here such as runs/)."""
    monkeypatch.chdir(tmp_path)
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    hint = f"found nothing at that path; did you mean hf:{repo}?"
    assert train_main(["--recipe", "lora", "--base", repo, "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-train: error: {repo}: --base: expected an existing GGUF file, {hint}\n")
    assert generate_cli.main(["--model", repo, "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-generate: error: {repo}: --model: expected a GGUF file or a run directory, "
        f"{hint}\n")
    assert export_cli.main(["--base", repo, "--adapter", "a.gguf", "--out", "o.gguf"]) == 2
    assert capsys.readouterr().err.endswith(f"--base: expected a GGUF file or a run directory, "
                                            f"{hint}\n")
    Path("runs").mkdir()
    for path in ("runs/mine", "models/x.gguf"):
        with pytest.raises(FileNotFoundError) as e:
            checkpoint_file(path)
        assert str(e.value).endswith("found nothing at that path"), path
    assert list(tmp_path.iterdir()) == [tmp_path / "runs"]

def test_generate_from_ollama_equals_the_plain_path(ollama, stories_path, capsys):
    outs = []
    for model in (str(stories_path), "ollama:stories"):
        rc = generate_cli.main(["--model", model, "--prompt", "Once upon a time",
                                "--max-tokens", "5", "--temperature", "0"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "5 new tokens" in err
        # ollama run applies the manifest's template and params; this command says it does not
        assert ("toymlx-generate: ollama:stories: its Ollama layers TEMPLATE (the GGUF's "
                "tokenizer.chat_template is used), PARAMETER (the sampling flags given here are "
                "used) are not applied\n" in err) == (model == "ollama:stories")
        outs.append(out)
    assert outs[0] == outs[1] and outs[0].strip()
    rc = generate_cli.main(["--model", "ollama:nothere", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("toymlx-generate: error: --model ollama:nothere: not in "
                                      f"Ollama's store {ollama}; it has: alice/tiny:v1")


def test_modelfile_from_ollama_and_from_a_path(ollama, stories_path, tmp_path):
    model, g = load_llama(stories_path)
    g.close()
    apply_lora(model, ("q", "v"), None, 4, 8.0, 0.0)
    adapter = tmp_path / "ad.gguf"
    write_adapter(adapter, model, {"general.architecture": "llama"}, {})

    path, base, ad, _ = write_modelfile(tmp_path / "out", adapter, "ollama:stories")
    cmds = parse_modelfile(path.read_text())
    blob = blob_of(ollama, stories_path.read_bytes())
    assert cmds[0] == ("FROM", str(blob)) and cmds[1] == ("ADAPTER", str(adapter.resolve()))
    assert Path(cmds[0][1]).is_file() and Path(cmds[1][1]).is_file()
    assert ("TEMPLATE", TEMPLATE) in cmds
    stops = [v for k, v in cmds if k == "PARAMETER stop"]
    assert stops == ["<|user|>", "</s>"]  # the layer's, then the tokenizer's eos
    assert ("PARAMETER temperature", "0.5") in cmds
    assert base.digest and ad == adapter.resolve()

    path, base, _, _ = write_modelfile(tmp_path / "out2", adapter, str(stories_path))
    text = path.read_text()
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "")
    # stories260K has no chat template: Ollama then passes the prompt as it is ({{ .Prompt }})
    assert ("# No TEMPLATE: the GGUF has no tokenizer.chat_template, so Ollama passes the "
            "prompt as it is\n") in text
    assert parse_modelfile(text)[:2] == [("FROM", str(stories_path.absolute())),
                                         ("ADAPTER", str(adapter.resolve()))]
    g = GGUFFile(stories_path)
    chat = tmp_path / "stories-chat.gguf"
    write_gguf(chat, {**g.metadata, "tokenizer.chat_template": CHATML},
               {n: g.load(n) for n in g.tensors}, types=dict(g.metadata_types))
    g.close()
    text = write_modelfile(tmp_path / "out3", adapter, str(chat))[0].read_text()
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "")
    assert "# No TEMPLATE: Ollama uses the GGUF's tokenizer.chat_template\n" in text
    assert quote(" a ") == '" a "' and quote('x\n"y"') == '"""x\n"y""""' and quote("<s>") == "<s>"


def test_commands_refuse_their_output_and_flags_before_hashing_an_ollama_model(
        ollama, stories_path, tmp_path, capsys, monkeypatch):
    """The SHA-256 of an Ollama model's blob (a read of the whole file) comes after what a
    command refuses cheaply: export's --out that is a folder, --exact-size without --fuse, a
    Modelfile folder that is a file; toymlx-eval's --plot for a language model; toymlx-generate's
    --top-k past the vocabulary. An export that goes ahead checks the blob, once."""
    from toymlx_cli.eval import main as eval_main

    from toymlx.bundle import model_store

    hashed = []
    real = model_store.file_sha256
    monkeypatch.setattr(model_store, "file_sha256",
                        lambda path: hashed.append(Path(path)) or real(path))
    adapter = _adapter(stories_path, tmp_path / "ad.gguf")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("")
    for argv, found in (
            (["--base", "ollama:stories", "--out", str(tmp_path / "a-folder")],
             "expected a file name, found a folder"),
            (["--base", "ollama:stories", "--adapter", str(adapter), "--exact-size", "--out",
              str(tmp_path / "x.gguf")], "--exact-size: expected with --fuse"),
            (["--format", "modelfile", "--adapter", str(adapter), "--base", "ollama:stories",
              "--out", str(tmp_path / "a-file")], "expected a folder (new or existing)")):
        assert export_cli.main(argv) == 2
        assert found in capsys.readouterr().err
    assert eval_main(["--model", "ollama:stories", "--plot", str(tmp_path / "c.png")]) == 2
    assert f"--plot {tmp_path / 'c.png'}: expected a ViT model" in capsys.readouterr().err
    assert generate_cli.main(["--model", "ollama:stories", "--prompt", "x", "--top-k",
                              "100000"]) == 2
    assert "--top-k: expected 0 (off) or below 512" in capsys.readouterr().err
    assert hashed == []
    assert export_cli.main(["--format", "modelfile", "--adapter", str(adapter), "--base",
                            "ollama:stories", "--out", str(tmp_path / "mf")]) == 0
    assert hashed == [blob_of(ollama, stories_path.read_bytes())]


QUOTED = ('{{ if .System }}<|system|>{{ .System }}</s>{{ end }}<|user|>"""{{ .Prompt }}""" '
          '</s>\n<|assistant|>"{{ .Response }}"')
"""A chat template holding \"\"\" mid-line (no line but the last ends in it) and ending in a
quote: Ollama's parser holds it in \"\"\"...\"\"\"."""


def test_a_template_and_system_holding_triple_quotes_round_trip_as_ollama_reads_them(
        ollama, stories_path, tmp_path):
    """A TEMPLATE or SYSTEM holding \"\"\" is written in \"\"\"...\"\"\" and read back as Ollama's
    parser reads it (a \"\"\" value ends at the first line break after which it ends in
    \"\"\"); one Ollama cannot hold is one line naming its line. toymlx refused every \"\"\", wrote
    a value starting with a quote bare (`"x"`, which Ollama reads as x), and read back neither a
    closing \"\"\" followed by spaces nor a CR LF as Ollama does."""
    model, g = load_llama(stories_path)
    g.close()
    apply_lora(model, ("q",), None, 4, 8.0, 0.0)
    adapter = tmp_path / "ad.gguf"
    write_adapter(adapter, model, {"general.architecture": "llama"}, {})
    add_model(ollama, "quoted", stories_path.read_bytes(),
              {"template": QUOTED.encode(),
               "system": b'Answer in """quotes""", briefly.\nThen stop.'})
    path, _, _, _ = write_modelfile(tmp_path / "out", adapter, "ollama:quoted")
    text = path.read_text()
    assert f'TEMPLATE """{QUOTED}"""\n' in text
    assert 'SYSTEM """Answer in """quotes""", briefly.\nThen stop."""\n' in text
    cmds = parse_modelfile(text)
    assert ("TEMPLATE", QUOTED) in cmds
    assert ("SYSTEM", 'Answer in """quotes""", briefly.\nThen stop.') in cmds
    assert quote('"x"') == '""""x""""' and quote('"x') == '""""x"""'
    assert parse_modelfile('FROM a\nSYSTEM """one\ntwo"""  \nPARAMETER stop "x"\n') == [
        ("FROM", "a"), ("SYSTEM", "one\ntwo"), ("PARAMETER stop", "x")]
    assert parse_modelfile('FROM a\r\nSYSTEM """one\r\ntwo"""\r\n') == [
        ("FROM", "a"), ("SYSTEM", "one\r\ntwo")]
    with pytest.raises(ValueError) as e:
        quote('Say """hi"""\nnow', triple=True)
    assert str(e.value) == ("Modelfile value 'Say \"\"\"hi\"\"\"\\nnow': expected no line but the "
                            "last ending in '\"\"\"' (Ollama's parser ends the value there), found "
                            "line 1 'Say \"\"\"hi\"\"\"'")
    with pytest.raises(ValueError) as e:
        quote("a\x1bb")
    assert str(e.value) == ("Modelfile value 'a\\x1bb': expected printable characters (Ollama's "
                            "parser drops the others), found '\\x1b'")


def test_lora_run_on_an_ollama_base_then_modelfile(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    mx.random.seed(3)
    src = tmp_path / "tiny.gguf"
    meta = byte_tokenizer().to_metadata()
    meta["tokenizer.chat_template"] = CHATML
    write_llama(src, Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                context=256)), meta, name="tiny test llama")
    add_model(root, "tiny:1", src.read_bytes(), {"template": TEMPLATE.encode()})
    rc = train_main(["--recipe", "lora", "--base", "ollama:tiny:1", "--runs-root",
                     str(tmp_path / "runs"), "--run-id", "r", "--steps", "3", "--batch-size",
                     "2", "--seq-len", "64", "--warmup", "1", "--eval-every", "0",
                     "--checkpoint-every", "1", "--stop-at", "1", "--no-progress",
                     "--no-compile"])
    assert rc == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "r"
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    blob = blob_of(root, src.read_bytes())
    assert start["config"]["base"] == "ollama:tiny:1"
    assert start["config"]["base_file"] == str(blob)
    assert start["config"]["base_sha256"] == blob.name[7:] == start["model"]["base_sha256"]
    with GGUFFile(run / "weights" / "latest") as g:
        assert g.metadata["toy.base"] == "ollama:tiny:1"

    # a folder with a space: the command printed is one a shell runs as it is
    rc = export_cli.main(["--format", "modelfile", "--adapter", str(run), "--out",
                          str(tmp_path / "m f")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.splitlines()[-1].endswith(
        f"; create the Ollama model with: ollama create NAME -f '{tmp_path}/m f/Modelfile'")
    cmds = parse_modelfile((tmp_path / "m f" / "Modelfile").read_text())
    assert cmds[0] == ("FROM", str(blob))
    assert cmds[1] == ("ADAPTER", str((run / "weights" / "adapter_step_1.gguf").resolve()))
    assert ("TEMPLATE", TEMPLATE) in cmds

    # the tag now names another model, the run's blob still in the store (as Ollama keeps it
    # until pruned): commands and the resume read the run's blob, and say so (they were
    # refused: "put the run's base back", which was there)
    mx.random.seed(4)
    write_llama(src, Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                context=256)), meta, name="tiny test llama")
    add_model(root, "tiny:1", src.read_bytes())
    told = (f"{blob} (the run's --base ollama:tiny:1, which now names another model; this "
            "file, where it led, still has the recorded SHA-256)")
    rc = generate_cli.main(["--model", str(run), "--prompt", "ab", "--max-tokens", "2",
                            "--temperature", "0"])
    err = capsys.readouterr().err
    assert rc == 0 and err.splitlines()[0] == (
        f"toymlx-generate: model {told} + adapter {run / 'weights' / 'adapter_step_1.gguf'}"), err
    rc = train_main(["--resume", str(run), "--stop-at", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0 and told in err, err
    # pruned: refused, naming the new blob and the record
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(blob, copy)
    blob.unlink()
    rc = export_cli.main(["--adapter", str(run), "--fuse", "--out", str(tmp_path / "f.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--base: expected the run's base, recorded as {blob} (sha256 " \
        f"{blob.name[7:19]}), found other contents" in err, err
    assert "the store name now names another model" in err, err
    # the same GGUF given by its path: the resume reads it (it was refused: "model
    # base_sha256: expected '...' (the run's), found None", the digest a store name records)
    rc = train_main(["--resume", str(run), "--base", str(copy), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0 and (f"--base from {copy} (moved; same contents as the run's ollama:tiny:1)"
                        in err), err
    # a blob with the run's bytes under another digest's name: one line, the refusal (the
    # "moved; same contents" line came first)
    wrong = "b" * 64
    shutil.copyfile(copy, root / "blobs" / f"sha256-{wrong}")
    manifest = add_model(root, "bad:1", b"GGUF")
    doc = json.loads(manifest.read_text())
    doc["layers"][0]["digest"] = f"sha256:{wrong}"
    manifest.write_text(json.dumps(doc))
    rc = export_cli.main(["--adapter", str(run), "--base", "ollama:bad:1", "--out",
                          str(tmp_path / "g.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and err == (
        f"toymlx-export: error: --base ollama:bad:1: {root / 'blobs' / ('sha256-' + wrong)}: "
        f"expected SHA-256 {wrong} (its name), found {blob.name[7:]}; the blob is damaged or "
        "was replaced: `ollama rm` and `ollama pull` the model again\n"), err


# ---- an Ollama model's ADAPTER layer, damaged blobs, DoRA in a fused Modelfile -------------
def _adapter(base: Path, path: Path, kind: str = "lora", seed: int = 5) -> Path:
    """A LoRA (or DoRA) adapter GGUF for `base` whose B matrices are not zero, so that applying
    it changes what the model says."""
    from toymlx.models.lora import lora_layers

    model, g = load_llama(base)
    g.close()
    mx.random.seed(seed)
    apply_lora(model, ("q", "v", "down"), None, 4, 32.0, 0.0, kind=kind)
    for layer in lora_layers(model).values():
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.5
    return write_adapter(path, model, {"general.architecture": "llama"}, {})


def _greedy(capsys, *args: str) -> str:
    rc = generate_cli.main([*args, "--prompt", "Once upon a time", "--max-tokens", "8",
                            "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_an_ollama_adapter_layer_is_applied_or_refused_by_name(ollama, stories_path, tmp_path,
                                                               capsys):
    """`ollama create` with an ADAPTER line stores the adapter as a layer of its own: generate
    applies it (the words of base + --adapter, not the bare base's); the commands that would
    use the base alone (train, eval, export, a Modelfile) refuse the name, naming the adapter."""
    from toymlx_cli.eval import main as eval_main

    adapter = _adapter(stories_path, tmp_path / "ad.gguf")
    add_model(ollama, "tuned", stories_path.read_bytes(), {"adapter": adapter.read_bytes()})
    model_blob, adapter_blob = blob_of(ollama, stories_path.read_bytes()), \
        blob_of(ollama, adapter.read_bytes())
    bare = _greedy(capsys, "--model", str(stories_path))
    by_hand = _greedy(capsys, "--model", str(stories_path), "--adapter", str(adapter))
    assert by_hand != bare
    assert _greedy(capsys, "--model", "ollama:tuned") == by_hand
    resolved = resolve("ollama:tuned", with_adapter=True)
    assert (resolved.path, resolved.adapter) == (model_blob, adapter_blob)

    def refused(flag: str) -> str:
        return (f"{flag} ollama:tuned: expected a model without an ADAPTER layer (this command "
                f"would use its base {model_blob} alone), found the adapter {adapter_blob}; "
                "toymlx-generate --model ollama:tuned applies it, or fuse it: toymlx-export "
                f"--base {model_blob} --adapter {adapter_blob} --fuse --out FILE.gguf")

    runs = tmp_path / "runs"
    for prog, main, argv, flag in (
            ("toymlx-train", train_main, ["--recipe", "lora", "--base", "ollama:tuned",
                                          "--runs-root", str(runs), "--steps", "1",
                                          "--no-progress"], "--base"),
            ("toymlx-eval", eval_main, ["--model", "ollama:tuned"], "--model"),
            ("toymlx-export", export_cli.main, ["--base", "ollama:tuned", "--out",
                                                str(tmp_path / "x.gguf")], "--base"),
            ("toymlx-export", export_cli.main, ["--format", "modelfile", "--adapter",
                                                str(adapter), "--base", "ollama:tuned",
                                                "--out", str(tmp_path / "mf")], "--base")):
        assert main(argv) == 2, prog
        assert capsys.readouterr().err == f"{prog}: error: {refused(flag)}\n"
    assert not runs.exists() and not (tmp_path / "x.gguf").exists() \
        and not (tmp_path / "mf").exists()
    # the store's own adapter and one more: one adapter is all toymlx applies
    assert generate_cli.main(["--model", "ollama:tuned", "--adapter", str(adapter),
                              "--prompt", "x"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-generate: error: {adapter}: --adapter: expected one adapter on ollama:tuned, "
        f"found ollama:tuned carries one already ({adapter_blob}; give its base as --model)\n")


@pytest.mark.parametrize("layer, data, found", [
    ("template", b"\xff\xfe{{ .Prompt }}",
     ("found bytes that are not UTF-8 (invalid start byte at byte 0); `ollama pull` the model "
      "again")),
    ("template", None, "found nothing; `ollama pull` the model again"),
    ("system", b"caf\xe9", ("found bytes that are not UTF-8 (unexpected end of data at byte 3); "
                           "`ollama pull` the model again")),
    ("params", b"\xff{", ("found bytes that are not UTF-8 (invalid start byte at byte 0); "
                         "`ollama pull` the model again")),
    ("params", b"{temperature", ("found Expecting property name enclosed in double quotes: "
                                 "line 1 column 2 (char 1)")),
], ids=["template-not-utf8", "template-missing", "system-not-utf8", "params-not-utf8",
        "params-not-json"])
def test_a_bad_layer_blob_names_the_model_and_the_blob(ollama, stories_path, tmp_path, capsys,
                                                       layer, data, found):
    adapter = _adapter(stories_path, tmp_path / "ad.gguf")
    content = data if data is not None else b"{{ .Prompt }} (removed below)"
    add_model(ollama, "bad", stories_path.read_bytes(), {layer: content})
    blob = blob_of(ollama, content)
    if data is None:
        blob.unlink()
    rc = export_cli.main(["--format", "modelfile", "--adapter", str(adapter), "--base",
                          "ollama:bad", "--out", str(tmp_path / "mf")])
    what = (f"expected the JSON of its params layer, {found}" if layer == "params" and
            data.startswith(b"{") else f"expected the text of its {layer} layer, {found}")
    assert rc == 2
    assert capsys.readouterr().err == f"toymlx-export: error: ollama:bad: {blob}: {what}\n"
    assert not (tmp_path / "mf" / "Modelfile").exists()


def test_a_model_blob_that_is_not_a_gguf_names_the_model(ollama, capsys):
    add_model(ollama, "notgguf", b"hello, not a GGUF")
    blob = blob_of(ollama, b"hello, not a GGUF")
    assert generate_cli.main(["--model", "ollama:notgguf", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-generate: error: --model ollama:notgguf: {blob}: expected a GGUF file (its "
        "model layer), found a file starting b'hell'; this Ollama model is not stored in a form "
        "toymlx can read\n")


def test_modelfile_fuse_exports_a_dora_adapter_as_plain_fuse_does(stories_path, tmp_path,
                                                                  capsys):
    """A DoRA adapter (toymlx's own format, which Ollama cannot load) is fused into the
    Modelfile's FROM model: the same bytes as `toymlx-export --fuse`; without --fuse it is
    refused, saying to add it."""
    dora = _adapter(stories_path, tmp_path / "dora.gguf", kind="dora")
    assert export_cli.main(["--base", str(stories_path), "--adapter", str(dora), "--fuse",
                            "--out", str(tmp_path / "fused.gguf")]) == 0
    capsys.readouterr()
    assert export_cli.main(["--format", "modelfile", "--fuse", "--adapter", str(dora),
                            "--base", str(stories_path), "--out", str(tmp_path / "mf")]) == 0
    err = capsys.readouterr().err
    fused = tmp_path / "mf" / "fused-f32.gguf"
    assert f"FROM {fused} (" in err
    cmds = parse_modelfile((tmp_path / "mf" / "Modelfile").read_text())
    assert cmds[0] == ("FROM", str(fused)) and not [c for c, _ in cmds if c == "ADAPTER"]
    assert fused.read_bytes() == (tmp_path / "fused.gguf").read_bytes()
    assert export_cli.main(["--format", "modelfile", "--adapter", str(dora), "--base",
                            str(stories_path), "--out", str(tmp_path / "mf2")]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-export: error: {dora}: metadata keys 'general.type'/'adapter.type': expected "
        "'adapter'/'lora' (a LoRA adapter GGUF; a DoRA adapter only with --fuse), found "
        "'adapter'/'dora'\n")


def test_modelfile_refuses_an_adapter_with_a_nan(stories_path, tmp_path, capsys):
    """A Modelfile only names its adapter, so the adapter's matrices were never read: one with
    a NaN (a damaged copy) got a Modelfile, and Ollama would serve the NaN. Now it is refused
    as every other command refuses it, naming the tensor, and no Modelfile is written."""
    import struct

    ad = _adapter(stories_path, tmp_path / "nan.gguf")
    with GGUFFile(ad) as g:
        info = g.tensors["blk.1.attn_v.weight.lora_b"]
    with open(ad, "r+b") as f:
        f.seek(info.offset + 4 * 3)
        f.write(struct.pack("<f", float("nan")))
    rc = export_cli.main(["--format", "modelfile", "--adapter", str(ad), "--base",
                          str(stories_path), "--out", str(tmp_path / "mf")])
    assert rc == 2
    assert capsys.readouterr().err == (
        f"toymlx-export: error: {ad}: tensor 'blk.1.attn_v.weight.lora_b' (block 1): expected "
        f"finite values, found NaN in 1 of {info.n_elements} (the first, nan, at "
        f"(0, 3)); the file is damaged or was written from a model that diverged: use another "
        "copy of it\n")
    assert not (tmp_path / "mf").exists()


def test_ollama_model_layer_with_a_path_for_a_digest_is_named(ollama):
    """A digest of `../` once read "expected a layer of media type X, found ['X']"."""
    path = ollama / "manifests/registry.ollama.ai/library/evil/latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"layers": [{"mediaType": MODEL_LAYER, "size": 10,
                                            "digest": "sha256:../../../etc/passwd"}]}))
    with pytest.raises(ModelStoreError) as e:
        resolve_model("ollama:evil", "--model")
    assert str(e.value) == (f"--model ollama:evil: {path}: a {MODEL_LAYER} layer's digest: "
                            "expected sha256: and 64 hexadecimal digits, found "
                            "'sha256:../../../etc/passwd'; the manifest is damaged: `ollama pull` "
                            "the model again")


def test_a_modelfile_that_cannot_be_written_leaves_no_folder_it_made(stories_path, tmp_path,
                                                                    capsys, monkeypatch):
    """`--format modelfile --out DIR` on a full disk: the error, exit 2, and DIR (and a parent
    it made) gone again, where it was left behind empty; a folder that was there is kept."""
    import errno

    from toymlx.backend import atomic

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    adapter = _adapter(stories_path, tmp_path / "ad.gguf")
    monkeypatch.setattr(atomic, "write_text", full)
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new" / "mf", tmp_path / "kept"):
        assert export_cli.main(["--format", "modelfile", "--adapter", str(adapter), "--base",
                                str(stories_path), "--out", str(out)]) == 2
        assert capsys.readouterr().err == ("toymlx-export: error: [Errno 28] No space left on "
                                           f"device: '{out / 'Modelfile'}'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad.gguf", "kept"]
    assert not list((tmp_path / "kept").iterdir())
