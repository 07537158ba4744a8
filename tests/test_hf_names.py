"""`hf:USER/REPO[:QUANT]` and `hf:USER/REPO/FILE.gguf`: resolved offline (HF_HUB_OFFLINE=1) from
a cache in huggingface_hub's own layout, which its `scan_cache_dir` and `try_to_load_from_cache`
read back; the file llama.cpp's `-hf` would pick; llama.cpp's own `-hf` caches; what a user
without a network sees; a lora run on `hf:` recording the repo, revision and file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from gguf_split import split_gguf
from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache
from toymlx_cli.train import main as train_main

from toymlx.bundle.model_store import ModelStoreError, parse_hf_name, pick_hf_file, resolve
from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.llama import write_llama
from toymlx.models.llama import Llama, tiny

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def put_in_hf_cache(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT,
                    ref: str = "main") -> Path:
    """A repository snapshot laid out as huggingface_hub's downloads leave it: content-addressed
    blobs (SHA-256 for LFS files), snapshots/<commit>/<file> symlinks to them, refs/<ref>."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir / "snapshots" / commit


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """HF_HOME in tmp_path, HF_HUB_OFFLINE=1 (as huggingface_hub reads it), no llama.cpp cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama.cpp"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf" / "hub"


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    mx.random.seed(3)
    src = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    meta = byte_tokenizer().to_metadata()
    meta["tokenizer.chat_template"] = CHATML
    write_llama(src, Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                context=256)), meta, name="tiny test llama")
    return src.read_bytes()


REPO_FILES = ["README.md", "tiny-F16.gguf", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf",
              "mmproj-tiny-Q4_K_M.gguf", "tiny-Q2_K.gguf"]


def test_the_file_picked_is_llama_cpp_s():
    assert pick_hf_file(REPO_FILES, None) == "tiny-Q4_K_M.gguf"
    assert pick_hf_file(REPO_FILES, "q8_0") == "tiny-Q8_0.gguf"
    assert pick_hf_file(REPO_FILES, "IQ4_XS") is None
    assert pick_hf_file(["a-Q8_0.gguf", "a-F16.gguf"], None) == "a-Q8_0.gguf"
    assert pick_hf_file(["mmproj-F16.gguf", "b-F16.gguf", "a-BF16.gguf"], None) == "a-BF16.gguf"
    split = ["Q4_K_M/big-Q4_K_M-00002-of-00003.gguf", "Q4_K_M/big-Q4_K_M-00001-of-00003.gguf"]
    assert pick_hf_file(split, None) == "Q4_K_M/big-Q4_K_M-00001-of-00003.gguf"
    assert parse_hf_name("bartowski/SmolLM2-GGUF:Q8_0") == ("bartowski/SmolLM2-GGUF", None,
                                                           "Q8_0", None)
    assert parse_hf_name("u/r@v1.0/sub/f-Q4_0.gguf") == ("u/r", "v1.0", None, "sub/f-Q4_0.gguf")
    with pytest.raises(ValueError, match="expected hf:USER/REPO"):
        parse_hf_name("justarepo")


def test_offline_names_resolve_from_huggingface_hub_s_cache(offline, tiny_bytes):
    files = {n: (tiny_bytes + n.encode() if n.endswith(".gguf") else b"# tiny\n")
             for n in REPO_FILES}
    snap = put_in_hf_cache(offline, "alice/tiny-GGUF", files)
    # huggingface_hub reads it as its own
    (repo,) = scan_cache_dir(offline).repos
    assert repo.repo_id == "alice/tiny-GGUF" and {r.commit_hash for r in repo.revisions} == {
        COMMIT}
    assert try_to_load_from_cache("alice/tiny-GGUF", "tiny-Q8_0.gguf",
                                  cache_dir=offline) == str(snap / "tiny-Q8_0.gguf")
    r = resolve("hf:alice/tiny-GGUF", "--base")
    assert r.path == snap / "tiny-Q4_K_M.gguf" and r.store == "hf"
    assert r.source == {"hf_repo": "alice/tiny-GGUF", "hf_revision": COMMIT,
                        "hf_file": "tiny-Q4_K_M.gguf"}
    assert resolve("hf:alice/tiny-GGUF:Q8_0").path == snap / "tiny-Q8_0.gguf"
    assert resolve("hf:alice/tiny-GGUF/tiny-F16.gguf").path == snap / "tiny-F16.gguf"
    assert resolve(f"hf:alice/tiny-GGUF@{COMMIT}:Q2_K").path == snap / "tiny-Q2_K.gguf"


def test_what_a_user_without_network_sees(offline, tiny_bytes):
    put_in_hf_cache(offline, "alice/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_bytes})
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:bob/other-GGUF:Q4_K_M", "--base")
    assert str(e.value) == (f"--base hf:bob/other-GGUF:Q4_K_M: not in the Hugging Face cache "
                            f"{offline} nor {offline.parent.parent / 'llama.cpp'} and "
                            "HF_HUB_OFFLINE is set, so its files are not known: expected a "
                            "repository of GGUF files (a model's own safetensors repository has "
                            "none; name a GGUF conversion of it, often USER/NAME-GGUF); for a GGUF "
                            "one, download it where there is a network: hf download bob/other-GGUF "
                            "--include '*Q4_K_M*'; or give the GGUF file itself: --base PATH.gguf")
    with pytest.raises(ModelStoreError) as e:  # a file named: the command fetches just it
        resolve("hf:bob/other-GGUF/o-Q8_0.gguf", "--base")
    assert str(e.value).endswith("HF_HUB_OFFLINE is set; download it where there is a network: "
                                 "hf download bob/other-GGUF o-Q8_0.gguf; or give the GGUF file "
                                 "itself: --base PATH.gguf")
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:alice/tiny-GGUF:Q5_K_M", "--base")
    assert str(e.value) == (f"--base hf:alice/tiny-GGUF:Q5_K_M: alice/tiny-GGUF: expected a GGUF "
                            f"of quantization Q5_K_M in its snapshot {COMMIT[:12]} in {offline}, "
                            "found tiny-Q8_0.gguf (HF_HUB_OFFLINE is set); name one as "
                            "hf:USER/REPO/FILE.gguf or "
                            "hf:USER/REPO:QUANT")


def test_a_revision_or_copy_the_cache_does_not_hold_is_named(offline, tiny_bytes):
    """`hf:REPO@REV` with REPO cached at another revision was "not in the Hugging Face cache ...
    so its files are not known: expected a repository of GGUF files (a model's own safetensors
    repository ...)", and its `hf download` fetched main; a copy whose blob was deleted, which
    huggingface_hub leaves out of its scan, was "not in the cache" too."""
    put_in_hf_cache(offline, "alice/tiny-GGUF", {"tiny-Q8_0.gguf": tiny_bytes})
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:alice/tiny-GGUF@v2", "--base")
    assert str(e.value) == (f"--base hf:alice/tiny-GGUF@v2: not in the Hugging Face cache "
                            f"{offline} nor {offline.parent.parent / 'llama.cpp'} ({offline}: it "
                            f"holds alice/tiny-GGUF at main ({COMMIT[:12]}), not revision v2) and "
                            "HF_HUB_OFFLINE is set; download it where there is a network: hf "
                            "download alice/tiny-GGUF --revision v2 --include '*Q4_K_M*'; or give "
                            "the GGUF file itself: --base PATH.gguf")
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:bob/other-GGUF@v3/o-Q8_0.gguf", "--base")
    assert "hf download bob/other-GGUF --revision v3 o-Q8_0.gguf;" in str(e.value)
    snap = put_in_hf_cache(offline, "carol/gone-GGUF", {"g-Q4_K_M.gguf": tiny_bytes})
    blob = (snap / "g-Q4_K_M.gguf").resolve()
    blob.unlink()
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:carol/gone-GGUF", "--base")
    assert str(e.value) == (f"--base hf:carol/gone-GGUF: not in the Hugging Face cache {offline} "
                            f"nor {offline.parent.parent / 'llama.cpp'} ({offline}: it holds a "
                            "copy of carol/gone-GGUF huggingface_hub reads as damaged: Blob "
                            f"missing (broken symlink): {blob}) and HF_HUB_OFFLINE is set; "
                            "download it where there is a network: hf download carol/gone-GGUF "
                            "--include '*Q4_K_M*'; or give the GGUF file itself: --base PATH.gguf")


def test_a_cached_safetensors_model_is_named_as_one(offline):
    """mlx-lm's users hold mlx-community's (and transformers') models in the cache: one named
    was told "found no GGUF files; name one as hf:USER/REPO/FILE.gguf", a GGUF it has not."""
    put_in_hf_cache(offline, "mlx-community/tiny-4bit", {
        "config.json": b"{}", "model.safetensors": b"x", "tokenizer.json": b"{}"})
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:mlx-community/tiny-4bit", "--base")
    assert str(e.value) == (
        f"--base hf:mlx-community/tiny-4bit: mlx-community/tiny-4bit: expected a model GGUF "
        f"(Q4_K_M, Q8_0 or any) in its snapshot {COMMIT[:12]} in {offline}, found safetensors "
        "and no GGUF files: a Hugging Face or MLX model's own weights, which toymlx does not read "
        "(HF_HUB_OFFLINE is set); name a GGUF conversion of it (often USER/NAME-GGUF), or give "
        "the GGUF file itself: --base PATH.gguf")


def test_a_repository_of_many_ggufs_says_how_many_it_left_out(offline):
    """A snapshot of 23 GGUFs, none the quantization asked for: the line listed 20 of them as if
    they were all; now it says "and 3 more", as every such list does (`shortlist`)."""
    names = [f"m-{i:02d}.Q8_0.gguf" for i in range(23)]
    put_in_hf_cache(offline, "carol/many-GGUF", {n: n.encode() for n in names})
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:carol/many-GGUF:Q5_K_M", "--base")
    assert f"found {', '.join(names[:20])} and 3 more (HF_HUB_OFFLINE is set);" in str(e.value)


def test_an_unreachable_hub_fails_fast_with_the_clear_line(offline, monkeypatch):
    """Without HF_HUB_OFFLINE, huggingface_hub retried an unreachable Hub five times (about
    25 s, "Retrying in 8s [Retry 5/5]") before the caches were searched; a connect check now
    answers at once (here a port nothing listens on)."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    t0 = time.monotonic()
    with pytest.raises(ModelStoreError) as e:
        resolve("hf:HuggingFaceTB/SmolLM2-135M-Instruct", "--base")
    assert time.monotonic() - t0 < 5
    assert (" and the Hub could not be reached (ConnectionRefusedError: [Errno 111] Connection "
            "refused), so its files are not known: expected a repository of GGUF files") \
        in str(e.value)


def test_llama_cpp_s_caches_are_searched(offline, tmp_path, monkeypatch, tiny_bytes):
    # today's llama.cpp: the Hugging Face layout, in LLAMA_CACHE
    llama = tmp_path / "llama.cpp"
    snap = put_in_hf_cache(llama, "carol/m-GGUF", {"m-Q4_K_M.gguf": tiny_bytes})
    assert resolve("hf:carol/m-GGUF").path == snap / "m-Q4_K_M.gguf"
    # older llama.cpp: flat USER_REPO_FILE names
    flat = tmp_path / "old"
    flat.mkdir()
    (flat / "dave_n-GGUF_n-Q8_0.gguf").write_bytes(tiny_bytes)
    monkeypatch.setenv("LLAMA_CACHE", str(flat))
    r = resolve("hf:dave/n-GGUF")
    assert r.path == flat / "dave_n-GGUF_n-Q8_0.gguf"
    assert r.source == {"hf_repo": "dave/n-GGUF", "hf_file": "n-Q8_0.gguf",
                        "hf_cache": str(flat)}


def test_a_multi_part_gguf_trains_whole_and_is_recorded(offline, tmp_path, tiny_bytes,
                                                       capsys):
    (tmp_path / "big-Q4_K_M.gguf").write_bytes(tiny_bytes)
    split = split_gguf(tmp_path / "big-Q4_K_M.gguf", tmp_path / "big-Q4_K_M.gguf", per_part=8)
    parts = {f"Q4_K_M/{p.name}": p.read_bytes() for p in split}
    assert len(parts) == 3
    snap = put_in_hf_cache(offline, "erin/big-GGUF", parts)
    first = snap / "Q4_K_M" / "big-Q4_K_M-00001-of-00003.gguf"
    assert resolve("hf:erin/big-GGUF").path == first
    rc = train_main(["--recipe", "lora", "--base", "hf:erin/big-GGUF", "--runs-root",
                     str(tmp_path / "runs"), "--run-id", "r", "--steps", "2", "--batch-size",
                     "2", "--seq-len", "64", "--warmup", "1", "--eval-every", "0",
                     "--checkpoint-every", "0", "--no-progress", "--no-compile"])
    assert rc == 0, capsys.readouterr().err
    rec = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["model_files"]["base"]
    assert (rec["file"], rec["hf_file"]) == (str(first), "Q4_K_M/big-Q4_K_M-00001-of-00003.gguf")
    assert [(Path(p["file"]).name, p["sha256"]) for p in rec["parts"]] == [
        (Path(name).name, hashlib.sha256(data).hexdigest()) for name, data in parts.items()]
    (snap / "Q4_K_M" / "big-Q4_K_M-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelStoreError, match="expected every part of Q4_K_M/big-Q4_K_M-00001"):
        resolve("hf:erin/big-GGUF")


def test_lora_on_an_hf_name_records_repo_revision_and_file(offline, tmp_path, tiny_bytes,
                                                            capsys):
    snap = put_in_hf_cache(offline, "alice/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny_bytes,
                                                        "tiny-Q8_0.gguf": tiny_bytes + b"x"})
    rc = train_main(["--recipe", "lora", "--base", "hf:alice/tiny-GGUF:Q4_K_M", "--runs-root",
                     str(tmp_path / "runs"), "--run-id", "r", "--steps", "2", "--batch-size",
                     "2", "--seq-len", "64", "--warmup", "1", "--eval-every", "0",
                     "--checkpoint-every", "0", "--no-progress", "--no-compile"])
    assert rc == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    rec = saved["model_files"]["base"]
    assert rec["path"] == "hf:alice/tiny-GGUF:Q4_K_M"
    assert rec["file"] == str(snap / "tiny-Q4_K_M.gguf")
    assert rec["sha256"] == hashlib.sha256(tiny_bytes).hexdigest()
    assert (rec["hf_repo"], rec["hf_revision"], rec["hf_file"]) == (
        "alice/tiny-GGUF", COMMIT, "tiny-Q4_K_M.gguf")
