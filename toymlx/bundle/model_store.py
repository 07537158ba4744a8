"""GGUF models named where people keep them: `ollama:NAME[:TAG]` and `lmstudio:...`.

Every option that takes a GGUF model file (`--base`, `--donor`, `--model`) goes through
`resolve_model`, which returns a plain path unchanged and turns a store name into the file:

- `ollama:qwen2.5:0.5b`, `ollama:user/model:tag`, `ollama:host/ns/model:tag` (tag default
  `latest`): Ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`, and on Linux system
  installs `/usr/share/ollama/.ollama/models`) holds `manifests/HOST/NAMESPACE/MODEL/TAG`, a
  Docker distribution v2 manifest whose layer of media type `application/vnd.ollama.image.model`
  names the GGUF as `blobs/sha256-HEX`. The blob's SHA-256 is checked against its name (once
  per process; `check_digests`, after a caller's cheap refusals), so a damaged or swapped file
  is refused rather than trained on.
- `hf:USER/REPO[@REVISION][:QUANT]` or `hf:USER/REPO[@REVISION]/FILE.gguf`: a GGUF of a Hugging
  Face repository, through `huggingface_hub` (its cache, HF_HOME/HF_HUB_CACHE, HF_HUB_OFFLINE,
  the user's token, revisions, its download progress bar); the file chosen as llama.cpp's `-hf`
  chooses it, and llama.cpp's own `-hf` cache searched too (`_resolve_hf`).
- `lmstudio:PUBLISHER/REPO`, `lmstudio:PUBLISHER/REPO/FILE.gguf` or `lmstudio:SUBSTRING` (of
  a file name): LM Studio's models folder (`$LMSTUDIO_MODELS`, else `downloadsFolder` of
  `~/.lmstudio/settings.json`, `~/.lmstudio/models`, `~/.cache/lm-studio/models`) holds plain
  GGUFs at `PUBLISHER/REPO/FILE.gguf`; `mmproj-*.gguf` (vision projectors) are not models.

A name that is not there is a one-line `ModelStoreError` naming the folder searched and listing
what it holds. A multi-part GGUF (llama.cpp's `NAME-00001-of-0000N.gguf` parts) is named by its
first part; `gguf_parts` lists the files it is made of. This module reads only JSON, file names
and GGUF headers (and hashes files): no MLX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toymlx.backend.files import shortlist
from toymlx.gguf.reader import GGUFError, GGUFFile, split_name, split_part_name

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
HF = "hf:"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
LAYER_PREFIX = "application/vnd.ollama.image."
"""Media types of an Ollama manifest's layers: PREFIX + model, template, params, system,
adapter, projector, license, messages."""
MAX_LISTED = 20
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # Ollama's name parts (no '/', no '..')
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
_HF_REPO = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*/[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class ModelStoreError(ValueError):
    """A store name that does not lead to a usable GGUF; one line naming what was searched."""


@dataclass(frozen=True)
class Resolved:
    """What a model name stands for: the file, and where it came from."""

    spec: str
    path: Path
    store: str | None = None
    """'ollama', 'lmstudio', or None for a plain path."""
    name: str | None = None
    """The store's own name for it: `qwen2.5:0.5b`, `publisher/repo/file.gguf`."""
    digest: str | None = None
    """`sha256:HEX` of the file (Ollama blobs, checked against the name)."""
    layers: dict[str, Path] = field(default_factory=dict)
    """Ollama: the manifest's other layers by kind (`template`, `params`, `system`, ...)."""
    adapter: Path | None = None
    """Ollama: the blob of the manifest's ADAPTER layer (a llama.cpp LoRA GGUF, checked against
    its digest), which the model is made of as much as of `path`; None without one."""
    adapter_digest: str | None = None
    """`sha256:HEX` of `adapter` (its name in the manifest)."""
    source: dict[str, Any] = field(default_factory=dict)
    """Hugging Face: {"hf_repo", "hf_revision" (the commit), "hf_file"}, recorded beside the
    file's SHA-256 in config.json."""

    def record(self, key: str) -> dict[str, Any]:
        """What to write in a run's config: `{key}_file` (absolute), for a store name
        `{key}_store`, `{key}_sha256`, and for a multi-part GGUF `{key}_parts` (each part's
        absolute file and SHA-256)."""
        out: dict[str, Any] = {f"{key}_file": str(self.path.absolute())}
        if self.store:
            out[f"{key}_store"] = f"{self.store}:{self.name}"
        if self.digest:
            out[f"{key}_sha256"] = self.digest.split(":", 1)[1]
        out.update({f"{key}_{k}": v for k, v in self.source.items()})
        parts = gguf_parts(self.path)
        if len(parts) > 1:
            out[f"{key}_parts"] = [{"file": str(p.absolute()), "sha256": file_sha256(p)}
                                   for p in parts]
        return out

    def layer_text(self, kind: str) -> str | None:
        """The text of an Ollama layer (`template`, `system`, `params`), or None;
        ModelStoreError naming the model and the blob where it is missing or not UTF-8."""
        p = self.layers.get(kind)
        if p is None:
            return None
        try:
            return p.read_text(encoding="utf-8")
        except FileNotFoundError:
            found = "nothing"
        except UnicodeDecodeError as e:
            found = f"bytes that are not UTF-8 ({e.reason} at byte {e.start})"
        except OSError as e:
            found = f"an unreadable file ({e.strerror or type(e).__name__})"
        raise ModelStoreError(f"{self.spec}: {p}: expected the text of its {kind} layer, found "
                              f"{found}; `ollama pull` the model again")


def is_store_name(spec: str | os.PathLike) -> bool:
    """Whether `spec` names a model in a store (and is not an existing path of that name)."""
    return (isinstance(spec, str) and spec.startswith((OLLAMA, LMSTUDIO, HF))
            and not Path(spec).exists())


def gguf_parts(path: Path) -> list[Path]:
    """The files the GGUF model at `path` is made of: every part, in order, where `path` is the
    first part of a multi-part GGUF that opens whole (`GGUFFile`), else `path` alone (a reader
    names what is wrong with a file when it loads it)."""
    path = Path(path)
    split = split_name(path.name)
    if split is None or split[1:] == (1, 1) or split[1] != 1 or not path.is_file():
        return [path]
    try:
        with GGUFFile(path) as g:
            return [Path(p) for p in g.paths]
    except GGUFError:
        return [path]


def resolve_model(spec: str | os.PathLike, flag: str = "--model", check_digest: bool = True
                  ) -> Path:
    """The GGUF file `spec` names: a path as given, or the file of a store name (`resolve`)."""
    return resolve(spec, flag, check_digest=check_digest).path


def resolve(spec: str | os.PathLike, flag: str = "--model", with_adapter: bool = False,
            check_digest: bool = True) -> Resolved:
    """`resolve_model` with the provenance; ModelStoreError (one line, naming `flag`). An
    Ollama model with an ADAPTER layer is refused by name unless the caller applies that
    adapter (`with_adapter`: `Resolved.adapter`); the bare base would be another model.
    `check_digest=False`: an Ollama blob's SHA-256 (a read of the whole file) is left to
    `check_digests`, for a caller that reads headers and refuses cheaply (a run too large for
    memory, a bad flag, an output it cannot write) before it reads the weights."""
    if not is_store_name(spec):
        return Resolved(str(spec), Path(spec))
    spec = str(spec)
    found = (_resolve_ollama if spec.startswith(OLLAMA) else _resolve_hf if spec.startswith(HF)
             else _resolve_lmstudio)(spec, flag)
    if found.adapter is not None and not with_adapter:
        raise ModelStoreError(f"{flag} {spec}: expected a model without an ADAPTER layer (this "
                              f"command would use its base {found.path} alone), found the "
                              f"adapter {found.adapter}; toymlx-generate --model {spec} applies "
                              f"it, or fuse it: toymlx-export --base {found.path} --adapter "
                              f"{found.adapter} --fuse --out FILE.gguf")
    if check_digest:
        check_digests(found, flag)
    return found


def _listing(names: list[str]) -> str:
    names = sorted(names)
    if not names:
        return "it holds no models"
    return "it has: " + shortlist(names, MAX_LISTED)


# ---- Ollama ---------------------------------------------------------------------------------
def ollama_roots() -> list[Path]:
    """The folders Ollama keeps models in, in the order searched."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    roots = [Path.home() / ".ollama" / "models"]
    if os.name == "posix":  # the Linux installer's service user keeps its store here
        roots.append(Path("/usr/share/ollama/.ollama/models"))
    return roots


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of `model`, `ns/model:tag`, `host/ns/model:tag`, the way
    Ollama parses them (a ':' after the last '/' starts the tag)."""
    tag = OLLAMA_TAG
    if name.rfind(":") > name.rfind("/"):
        name, tag = name.rsplit(":", 1)
    parts = name.split("/")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"expected [HOST/][NAMESPACE/]MODEL[:TAG], found {len(parts)} parts")
    host, ns, model = [OLLAMA_HOST, OLLAMA_NAMESPACE][: 3 - len(parts)] + parts
    for kind, part in (("host", host), ("namespace", ns), ("model", model), ("tag", tag)):
        if not _PART.fullmatch(part.replace(":", "_") if kind == "host" else part) \
                or ".." in part:
            raise ValueError(f"{kind} {part!r}: expected letters, digits, '_', '-', '.'")
    return host, ns, model, tag


def short_ollama_name(host: str, ns: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it: default host and namespace left out."""
    if host.lower() != OLLAMA_HOST:
        return f"{host}/{ns}/{model}:{tag}"
    return f"{model}:{tag}" if ns.lower() == OLLAMA_NAMESPACE else f"{ns}/{model}:{tag}"


def list_ollama(root: Path) -> dict[str, Path]:
    """Every model in an Ollama store: short name -> manifest."""
    out = {}
    for p in (root / "manifests").glob("*/*/*/*"):
        if p.is_file():
            host, ns, model, tag = p.relative_to(root / "manifests").parts
            out[short_ollama_name(host, ns, model, tag)] = p
    return out


def _resolve_ollama(spec: str, flag: str) -> Resolved:
    name = spec[len(OLLAMA):]
    try:
        host, ns, model, tag = parse_ollama_name(name)
    except ValueError as e:
        raise ModelStoreError(f"{flag} {spec}: not an Ollama model name: {e}") from None
    roots = ollama_roots()
    present = [r for r in roots if r.is_dir()]
    if not present:
        where = " nor ".join(map(str, roots))
        raise ModelStoreError(f"{flag} {spec}: no Ollama store at {where}; pull the model with "
                              "`ollama pull`, or set OLLAMA_MODELS to the folder Ollama keeps "
                              "models in")
    short = short_ollama_name(host, ns, model, tag)
    for root in present:
        manifest = root / "manifests" / host / ns / model / tag
        if not manifest.is_file():  # Ollama matches names case-insensitively
            manifest = next((p for n, p in list_ollama(root).items()
                             if n.lower() == short.lower()), manifest)
        if manifest.is_file():
            return _from_manifest(spec, flag, root, manifest, short)
    listed = "; ".join(f"{r}: {_listing(list(list_ollama(r)))}" if len(present) > 1
                       else _listing(list(list_ollama(r))) for r in present)
    where = " or ".join(map(str, present))
    raise ModelStoreError(f"{flag} {spec}: not in Ollama's store {where}; {listed}")


def _from_manifest(spec: str, flag: str, root: Path, manifest: Path, short: str) -> Resolved:
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        layers = doc["layers"]
        if not isinstance(layers, list):
            raise TypeError("'layers' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelStoreError(f"{flag} {spec}: {manifest}: expected an Ollama manifest (JSON "
                              f"with 'layers'), found {type(e).__name__}: {e}") from None
    except RecursionError:
        raise ModelStoreError(f"{flag} {spec}: {manifest}: expected an Ollama manifest (JSON "
                              "with 'layers'), found JSON nested too deeply to read") from None
    blobs, model_blob, digest, adapters = {}, None, None, []
    for layer in layers:
        media = layer.get("mediaType", "") if isinstance(layer, dict) else ""
        m = _DIGEST.fullmatch(str(layer.get("digest", "")) if isinstance(layer, dict) else "")
        if media in (MODEL_LAYER, ADAPTER_LAYER) and m is None:  # never a path to follow
            raise ModelStoreError(f"{flag} {spec}: {manifest}: a {media} layer's digest: "
                                  "expected sha256: and 64 hexadecimal digits, found "
                                  f"{str(layer.get('digest'))[:80]!r}; the manifest is damaged: "
                                  "`ollama pull` the model again")
        if not media.startswith(LAYER_PREFIX) or m is None:
            continue
        blob = _blob(root, m.group(1).lower())
        if media == MODEL_LAYER and model_blob is None:
            model_blob, digest = blob, f"sha256:{m.group(1).lower()}"
        elif media == ADAPTER_LAYER:
            adapters.append((blob, f"sha256:{m.group(1).lower()}"))
        else:
            blobs.setdefault(media[len(LAYER_PREFIX):], blob)
    if model_blob is None:
        kinds = sorted(str(la.get("mediaType")) for la in layers if isinstance(la, dict))
        raise ModelStoreError(f"{flag} {spec}: {manifest}: expected a layer of media type "
                              f"{MODEL_LAYER} (a GGUF), found {kinds or 'no layers'}; this "
                              "Ollama model is not stored as a GGUF toymlx can read")
    if not model_blob.is_file():
        raise ModelStoreError(f"{flag} {spec}: {model_blob}: expected the model's blob ({digest} "
                              "in the manifest), found nothing; `ollama pull` it again")
    _check_gguf(model_blob, digest, "model", flag, spec)
    if len(adapters) > 1:
        raise ModelStoreError(f"{flag} {spec}: {manifest}: expected at most one ADAPTER layer, "
                              f"found {len(adapters)} ({', '.join(str(b) for b, _ in adapters)})")
    adapter, adapter_digest = None, None
    for adapter, adapter_digest in adapters:
        if not adapter.is_file():
            raise ModelStoreError(f"{flag} {spec}: {adapter}: expected the blob of its ADAPTER "
                                  f"layer ({adapter_digest} in the manifest), found nothing; "
                                  "`ollama pull` it again")
        _check_gguf(adapter, adapter_digest, "ADAPTER", flag, spec)
    return Resolved(spec, model_blob, "ollama", short, digest, blobs, adapter, adapter_digest)


def _blob(root: Path, hexdigest: str) -> Path:
    blob = root / "blobs" / f"sha256-{hexdigest}"
    old = root / "blobs" / f"sha256:{hexdigest}"  # stores written before Ollama 0.1.3x
    return old if not blob.exists() and old.exists() else blob


_VERIFIED: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (hex), remembered per (path, size, mtime) in this process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _VERIFIED:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _VERIFIED[key] = h.hexdigest()
    return _VERIFIED[key]


def _check_gguf(blob: Path, digest: str, layer: str, flag: str, spec: str) -> None:
    """ModelStoreError naming the model and the blob unless the blob starts as a GGUF does (a
    blob damaged since its download said to be damaged: `_check_blob`)."""
    with open(blob, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        _check_blob(blob, digest, flag, spec)
        raise ModelStoreError(f"{flag} {spec}: {blob}: expected a GGUF file (its {layer} layer), "
                              f"found a file starting {magic!r}; this Ollama model is not "
                              "stored in a form toymlx can read")


def check_digests(found: Resolved, flag: str) -> None:
    """ModelStoreError (one line naming `flag`, the model and the blob) unless each Ollama blob
    of `found` (its model and ADAPTER layers) has the SHA-256 its name gives: a read of each
    whole file, once per process (`file_sha256`); nothing to check for other stores."""
    if found.store != "ollama":
        return
    _check_blob(found.path, str(found.digest), flag, found.spec)
    if found.adapter is not None:
        _check_blob(found.adapter, str(found.adapter_digest), flag, found.spec)


def _check_blob(blob: Path, digest: str, flag: str, spec: str) -> None:
    found = file_sha256(blob)
    if f"sha256:{found}" != digest:
        raise ModelStoreError(f"{flag} {spec}: {blob}: expected SHA-256 {digest[7:]} (its name), "
                              f"found {found}; the blob is damaged or was replaced: `ollama rm` "
                              "and `ollama pull` the model again")


# ---- LM Studio ------------------------------------------------------------------------------
def lmstudio_roots() -> list[Path]:
    """The folders LM Studio keeps models in, in the order searched."""
    env = os.environ.get("LMSTUDIO_MODELS")
    if env:
        return [Path(env).expanduser()]
    home = Path.home()
    roots = []
    try:  # a models folder moved in LM Studio's settings
        moved = json.loads((home / ".lmstudio" / "settings.json").read_text(encoding="utf-8"))
        if isinstance(moved, dict) and isinstance(moved.get("downloadsFolder"), str):
            roots.append(Path(moved["downloadsFolder"]).expanduser())
    except (OSError, ValueError):
        pass
    return roots + [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def list_lmstudio(root: Path) -> list[str]:
    """Every language-model GGUF in an LM Studio folder, as `PUBLISHER/REPO/FILE.gguf` (a
    multi-part one by its first part)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gguf")
                  if p.is_file() and not p.name.lower().startswith("mmproj")
                  and (split_name(p.name) or ("", 1))[1] == 1)


def _resolve_lmstudio(spec: str, flag: str) -> Resolved:
    name = spec[len(LMSTUDIO):].strip("/")
    roots = lmstudio_roots()
    present = [r for r in roots if r.is_dir()]
    if not present:
        where = " nor ".join(map(str, roots))
        raise ModelStoreError(f"{flag} {spec}: no LM Studio models folder at {where}; set "
                              "LMSTUDIO_MODELS to the folder LM Studio keeps models in")
    if not name or ".." in name.split("/"):
        raise ModelStoreError(f"{flag} {spec}: expected lmstudio:PUBLISHER/REPO[/FILE.gguf] or "
                              "lmstudio:PART-OF-A-FILE-NAME")
    for root in present:
        files = list_lmstudio(root)
        if "/" in name:  # a repo folder, or a file in one
            hits = [f for f in files if f.lower() == name.lower()
                    or f.lower().startswith(name.lower().rstrip("/") + "/")]
        else:
            exact = [f for f in files if Path(f).name.lower() in (name.lower(),
                                                                   name.lower() + ".gguf")]
            hits = exact or [f for f in files if name.lower() in Path(f).name.lower()]
        if len(hits) == 1:
            return Resolved(spec, root / hits[0], "lmstudio", hits[0])
        if len(hits) > 1:
            raise ModelStoreError(f"{flag} {spec}: names {len(hits)} GGUFs in LM Studio's folder "
                                  f"{root}: {shortlist(hits, MAX_LISTED)}; name one, e.g. "
                                  f"lmstudio:{hits[0]}")
    listed = "; ".join(f"{r}: {_listing(list_lmstudio(r))}" if len(present) > 1
                       else _listing(list_lmstudio(r)) for r in present)
    where = " or ".join(map(str, present))
    raise ModelStoreError(f"{flag} {spec}: not in LM Studio's models folder {where}; {listed}")


# ---- Hugging Face ---------------------------------------------------------------------------
HF_DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
"""What llama.cpp's `-hf USER/REPO` looks for without a `:QUANT`, in this order; then the first
model GGUF of the repository."""
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
"""Parts of a file name that mark a GGUF as a companion, not a model (llama.cpp's list)."""


def is_hf_repo(name: str) -> bool:
    """Whether `name` is spelt as a Hugging Face repository, USER/REPO: letters, digits, '_',
    '-' and '.' on both sides of its one '/', neither side empty, no '..' (`data/` and
    `./model` are paths, not repositories)."""
    return _HF_REPO.fullmatch(name) is not None and ".." not in name


def gpt2_hint(spec: str | os.PathLike, flag: str) -> str:
    """"; nanoGPT's gpt2 ... is llama.cpp's ggml-vocab-gpt-2.gguf" where --tokenizer names
    GPT-2's tokenizer by nanoGPT's name (tiktoken's `gpt2`), else '' (a --donor needs weights,
    which a vocab-only file lacks)."""
    if flag != "--tokenizer" or str(spec).lower() not in ("gpt2", "gpt-2", "r50k_base"):
        return ""
    return ("; nanoGPT's gpt2 (tiktoken's) is in llama.cpp's vocab-only "
            "models/ggml-vocab-gpt-2.gguf: --tokenizer ggml-vocab-gpt-2.gguf")


def hf_name_hint(spec: str | os.PathLike) -> str:
    """"; did you mean hf:USER/REPO?" for a model option that names nothing at a path spelt as a
    Hugging Face repository (mlx-lm's --model habit): one '/', no .gguf suffix, no folder of its
    first part here (`runs/NAME` is a path into runs/); else ''."""
    text = str(spec)
    if (not is_hf_repo(text) or text.lower().endswith(".gguf") or Path(text).exists()
            or Path(text.split("/")[0]).is_dir()):
        return ""
    return f"; did you mean {HF}{text}?"


def parse_hf_name(name: str) -> tuple[str, str | None, str | None, str | None]:
    """(repo, revision, quant, file) of `USER/REPO[@REV][:QUANT]` or `USER/REPO[@REV]/FILE.gguf`;
    ValueError saying what is expected."""
    parts = name.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError("expected hf:USER/REPO[:QUANT] or hf:USER/REPO/FILE.gguf")
    user, rest, path = parts[0], parts[1], "/".join(parts[2:])
    quant = None
    if not path and ":" in rest:
        rest, quant = rest.split(":", 1)
    revision = None
    if "@" in rest:
        rest, revision = rest.split("@", 1)
    repo = f"{user}/{rest}"
    if not is_hf_repo(repo):
        raise ValueError(f"repository {repo!r}: expected USER/REPO of letters, digits, '_', '-', "
                         "'.'")
    if path and (not path.lower().endswith(".gguf") or ".." in path.split("/")):
        raise ValueError(f"file {path!r}: expected a .gguf file of the repository")
    if quant is not None and not re.fullmatch(r"[A-Za-z0-9_]+", quant):
        raise ValueError(f"quant {quant!r}: expected a quantization type such as Q4_K_M")
    if revision is not None and not revision:
        raise ValueError("expected a revision after '@'")
    return repo, revision, quant or None, path or None


def pick_hf_file(files: list[str], quant: str | None) -> str | None:
    """The GGUF llama.cpp's `-hf REPO[:QUANT]` picks from a repository's files (sorted): the
    first model GGUF whose path has QUANT followed by '.' or '-' (any case; no QUANT: Q4_K_M,
    then Q8_0, then any model GGUF), the first part of a multi-part one; None if none fits."""
    models = [f for f in sorted(files) if f.lower().endswith(".gguf")
              and not any(k in f.rsplit("/", 1)[-1] for k in _NOT_MODELS)
              and (split_name(f) is None or split_name(f)[1] == 1)]
    for q in (quant,) if quant else HF_DEFAULT_QUANTS:
        pattern = re.compile(re.escape(q) + r"[.\-]", re.IGNORECASE)
        hit = next((f for f in models if pattern.search(f)), None)
        if hit:
            return hit
    return models[0] if models and not quant else None


def hf_parts(files: list[str], first: str) -> list[str]:
    """Every part of the multi-part GGUF whose first part is `first` (just `first` for one
    file)."""
    split = split_name(first)
    if split is None:
        return [first]
    prefix, _, count = split
    return [split_part_name(prefix, i, count) for i in range(1, count + 1)]


def hf_cache_dirs() -> list[Path]:
    """The Hugging Face-layout caches searched: huggingface_hub's (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub), then llama.cpp's `-hf` cache where LLAMA_CACHE
    moves it elsewhere (llama.cpp keeps its downloads in the same layout)."""
    from huggingface_hub import constants

    env = os.environ
    hub = (env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
           or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
           or constants.HF_HUB_CACHE)
    dirs = [Path(hub).expanduser()]
    if env.get("LLAMA_CACHE") and Path(env["LLAMA_CACHE"]).expanduser() not in dirs:
        dirs.append(Path(env["LLAMA_CACHE"]).expanduser())
    return dirs


def llama_cpp_legacy_dir() -> Path:
    """llama.cpp's `-hf` cache before it took the Hugging Face layout: flat files named
    `USER_REPO_FILE.gguf` in LLAMA_CACHE, else ~/.cache/llama.cpp."""
    env = os.environ.get("LLAMA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llama.cpp"


def hf_offline() -> bool:
    """Whether the Hub is not to be asked (HF_HUB_OFFLINE, as huggingface_hub reads it)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) or os.environ.get(
        "HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


HUB_CONNECT_S = 3.0
"""Seconds the Hub's host gets to accept a connection before the caches are searched without
it: huggingface_hub retries an unreachable Hub five times, about 25 s, before it gives up."""


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (its host unknown, refusing, or silent for HUB_CONNECT_S),
    or None; not checked behind a proxy (HTTPS_PROXY, ALL_PROXY), which huggingface_hub goes
    through instead."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(constants.ENDPOINT)
    if not url.hostname:
        return None  # huggingface_hub names a malformed HF_ENDPOINT itself
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        socket.create_connection((url.hostname, port), timeout=HUB_CONNECT_S).close()
    except (OSError, ValueError) as e:
        return f"the Hub could not be reached ({type(e).__name__}: {' '.join(str(e).split())})"
    return None


def _cached_snapshot(cache: Path, repo: str, revision: str | None
                     ) -> tuple[tuple[str, dict[str, Path]] | None, str | None]:
    """((commit, {file: path}) of a repository's snapshot in a Hugging Face-layout cache, as
    huggingface_hub's `scan_cache_dir` sees it, or None where the cache does not hold it; and
    then what it holds of the repository instead (other revisions, or a copy huggingface_hub
    reads as damaged), or None."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return None, None
    for r in info.repos:
        if r.repo_type != "model" or r.repo_id.lower() != repo.lower():
            continue
        want = revision or "main"
        for rev in sorted(r.revisions, key=lambda x: x.last_modified, reverse=True):
            if want in rev.refs or rev.commit_hash == want or (
                    revision is None and not any("main" in x.refs for x in r.revisions)):
                return (rev.commit_hash, {f.file_path.relative_to(rev.snapshot_path).as_posix():
                                          f.file_path for f in rev.files}), None
        held = sorted(f"{', '.join(sorted(rev.refs))} ({rev.commit_hash[:12]})" if rev.refs
                      else rev.commit_hash[:12] for rev in r.revisions)
        return None, (f"it holds {r.repo_id} at {', '.join(held)}, not revision {want}"
                      if held else f"it holds no snapshot of {r.repo_id}")
    # a copy huggingface_hub cannot read (a blob deleted under its snapshot's link) is left out
    # of `info.repos` and named in `info.warnings`
    folder = re.compile(re.escape(f"models--{repo.replace('/', '--')}".lower()) + r"([/\\]|$)")
    damaged = next((w for w in info.warnings if folder.search(str(w).lower())), None)
    if damaged is not None:
        return None, f"it holds a copy of {repo} huggingface_hub reads as damaged: {damaged}"
    return None, None


def _resolve_hf(spec: str, flag: str) -> Resolved:
    try:
        repo, revision, quant, file = parse_hf_name(spec[len(HF):])
    except ValueError as e:
        raise ModelStoreError(f"{flag} {spec}: not a Hugging Face model name: "
                              f"{e}{gpt2_hint(spec[len(HF):], flag)}") from None
    why = "HF_HUB_OFFLINE is set" if hf_offline() else hub_unreachable()
    if why is None:  # the Hub's own listing, then huggingface_hub's download (bar, token, cache)
        try:
            return _hf_download(spec, flag, repo, revision, quant, file)
        except ModelStoreError:
            raise
        except Exception as e:  # noqa: BLE001 -- no network, a refused token: try the caches
            why = f"the Hub could not be reached ({type(e).__name__}: {' '.join(str(e).split())})"
    rev, held = f" --revision {revision}" if revision else "", []
    for cache in hf_cache_dirs():
        found, note = _cached_snapshot(cache, repo, revision)
        if found is None:
            held += [(cache, note)] if note else []
            continue
        commit, files = found
        name = file or pick_hf_file(list(files), quant)
        if name is None or name not in files:
            raise ModelStoreError(_no_file(spec, flag, repo, quant, file, list(files),
                                           f"its snapshot {commit[:12]} in {cache}", why))
        parts = hf_parts(list(files), name)
        missing = [p for p in parts if p not in files]
        if missing:
            raise ModelStoreError(f"{flag} {spec}: {cache}: expected every part of {name}, found "
                                  f"{missing[0]} missing ({why}); download it with: hf download "
                                  f"{repo}{rev} {' '.join(parts)}")
        return _hf_resolved(spec, repo, commit, name, [files[p] for p in parts])
    legacy = _legacy_llama_cpp(spec, repo, quant, file)
    if legacy is not None:
        return legacy
    where = " nor ".join(str(c) for c in hf_cache_dirs())
    fetch = file or f"--include '*{quant or 'Q4_K_M'}*'"
    if file or held:  # what to download is known: the file, or a repository held otherwise
        caches = len(hf_cache_dirs())
        held_note = "".join(f" ({c}: {n})" if caches > 1 else f" ({n})" for c, n in held)
        raise ModelStoreError(f"{flag} {spec}: not in the Hugging Face cache {where}{held_note} "
                              f"and {why}; download it where there is a network: hf download "
                              f"{repo}{rev} {fetch}; or give the GGUF file itself: {flag} PATH.gguf")
    # the repository's files are not known here: it may be a model's own safetensors one
    raise ModelStoreError(f"{flag} {spec}: not in the Hugging Face cache {where} and {why}, so "
                          f"its files are not known: expected a repository of GGUF files (a "
                          f"model's own safetensors repository has none; name a GGUF conversion "
                          f"of it, often USER/NAME-GGUF); for a GGUF one, download it where there "
                          f"is a network: hf download {repo}{rev} {fetch}"
                          f"; or give the GGUF file itself: {flag} PATH.gguf")


def _no_file(spec: str, flag: str, repo: str, quant: str | None, file: str | None,
             files: list[str], where: str, why: str | None = None) -> str:
    """The line for a repository (or its cached snapshot, with `why` the Hub was not asked)
    that holds no file the name picks."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    want = file or (f"a GGUF of quantization {quant}" if quant else
                    f"a model GGUF ({', '.join(HF_DEFAULT_QUANTS)} or any)")
    if not ggufs and any(f.lower().endswith(".safetensors") for f in files):
        # a model's own weights (transformers', mlx-lm's mlx-community conversions): there is
        # no GGUF in it to name, so "name one as hf:USER/REPO/FILE.gguf" would send the user
        # looking for one
        return (f"{flag} {spec}: {repo}: expected {want} in {where}, found safetensors and no "
                "GGUF files: a Hugging Face or MLX model's own weights, which toymlx does not "
                "read" + (f" ({why})" if why else "") + "; name a GGUF conversion of it (often "
                f"USER/NAME-GGUF), or give the GGUF file itself: {flag} PATH.gguf")
    return (f"{flag} {spec}: {repo}: expected {want} in {where}, found "
            + (shortlist(ggufs, MAX_LISTED) or "no GGUF files")
            + (f" ({why})" if why else "")
            + "; name one as hf:USER/REPO/FILE.gguf or hf:USER/REPO:QUANT")


def _hf_download(spec: str, flag: str, repo: str, revision: str | None, quant: str | None,
                 file: str | None) -> Resolved:
    from huggingface_hub import HfApi, hf_hub_download

    files = HfApi().list_repo_files(repo, revision=revision)
    name = file if file in files else None if file else pick_hf_file(files, quant)
    if name is None:
        raise ModelStoreError(_no_file(spec, flag, repo, quant, file, files,
                                       f"the repository (revision {revision or 'main'})"))
    paths = [Path(hf_hub_download(repo, p, revision=revision)) for p in hf_parts(files, name)]
    commit = paths[0].parents[len(Path(name).parts) - 1].name  # snapshots/<commit>/<file>
    return _hf_resolved(spec, repo, commit, name, paths)


def _hf_resolved(spec: str, repo: str, commit: str, name: str, paths: list[Path]) -> Resolved:
    """A Hugging Face file as resolved: `paths` are its parts (their first opens them all)."""
    return Resolved(spec, paths[0], "hf", f"{repo}/{name}",
                    source={"hf_repo": repo, "hf_revision": commit, "hf_file": name})


def _legacy_llama_cpp(spec: str, repo: str, quant: str | None, file: str | None
                      ) -> Resolved | None:
    """The file in llama.cpp's older flat `-hf` cache (`llama_cpp_legacy_dir`), if there."""
    root = llama_cpp_legacy_dir()
    prefix = repo.replace("/", "_") + "_"
    if not root.is_dir():
        return None
    files = {p.name[len(prefix):]: p for p in root.iterdir()
             if p.name.startswith(prefix) and p.is_file()}
    name = file.replace("/", "_") if file else pick_hf_file(list(files), quant)
    if name is None or name not in files:
        return None
    parts = hf_parts(list(files), name)
    if any(p not in files for p in parts):
        return None
    return Resolved(spec, files[name], "hf", f"{repo}/{name}",
                    source={"hf_repo": repo, "hf_file": name, "hf_cache": str(root)})
