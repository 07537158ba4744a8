"""GGUF models named where people keep them: `ollama:NAME[:TAG]` and `lmstudio:...`.

Every option that takes a GGUF model file (`--base`, `--donor`, `--model`) goes through
`resolve_model`, which returns a plain path unchanged and turns a store name into the file:

- `ollama:qwen2.5:0.5b`, `ollama:user/model:tag`, `ollama:host/ns/model:tag` (tag default
  `latest`): Ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`, and on Linux system
  installs `/usr/share/ollama/.ollama/models`) holds `manifests/HOST/NAMESPACE/MODEL/TAG`, a
  Docker distribution v2 manifest whose layer of media type `application/vnd.ollama.image.model`
  names the GGUF as `blobs/sha256-HEX`. The blob's SHA-256 is checked against its name (once
  per process), so a damaged or swapped file is refused rather than trained on.
- `lmstudio:PUBLISHER/REPO`, `lmstudio:PUBLISHER/REPO/FILE.gguf` or `lmstudio:SUBSTRING` (of
  a file name): LM Studio's models folder (`$LMSTUDIO_MODELS`, else `downloadsFolder` of
  `~/.lmstudio/settings.json`, `~/.lmstudio/models`, `~/.cache/lm-studio/models`) holds plain
  GGUFs at `PUBLISHER/REPO/FILE.gguf`; `mmproj-*.gguf` (vision projectors) are not models.

A name that is not there is a one-line `ModelStoreError` naming the folder searched and listing
what it holds. This module reads only JSON and file names (and hashes blobs): no MLX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
LAYER_PREFIX = "application/vnd.ollama.image."
"""Media types of an Ollama manifest's layers: PREFIX + model, template, params, system,
adapter, projector, license, messages."""
MAX_LISTED = 20
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # Ollama's name parts (no '/', no '..')
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


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

    def record(self, key: str) -> dict[str, Any]:
        """What to write in a run's config: `{key}_file` (absolute), and for a store name
        `{key}_store`, `{key}_sha256`."""
        out: dict[str, Any] = {f"{key}_file": str(self.path.absolute())}
        if self.store:
            out[f"{key}_store"] = f"{self.store}:{self.name}"
        if self.digest:
            out[f"{key}_sha256"] = self.digest.split(":", 1)[1]
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
    return (isinstance(spec, str) and spec.startswith((OLLAMA, LMSTUDIO))
            and not Path(spec).exists())


def resolve_model(spec: str | os.PathLike, flag: str = "--model") -> Path:
    """The GGUF file `spec` names: a path as given, or the file of a store name."""
    return resolve(spec, flag).path


def resolve(spec: str | os.PathLike, flag: str = "--model", with_adapter: bool = False
            ) -> Resolved:
    """`resolve_model` with the provenance; ModelStoreError (one line, naming `flag`). An
    Ollama model with an ADAPTER layer is refused by name unless the caller applies that
    adapter (`with_adapter`: `Resolved.adapter`); the bare base would be another model."""
    if not is_store_name(spec):
        return Resolved(str(spec), Path(spec))
    spec = str(spec)
    found = (_resolve_ollama if spec.startswith(OLLAMA) else _resolve_lmstudio)(spec, flag)
    if found.adapter is not None and not with_adapter:
        raise ModelStoreError(f"{flag} {spec}: expected a model without an ADAPTER layer (this "
                              f"command would use its base {found.path} alone), found the "
                              f"adapter {found.adapter}; toymlx-generate --model {spec} applies "
                              f"it, or fuse it: toymlx-export --base {found.path} --adapter "
                              f"{found.adapter} --fuse --out FILE.gguf")
    return found


def _listing(names: list[str]) -> str:
    names = sorted(names)
    if not names:
        return "it holds no models"
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return "it has: " + ", ".join(names[:MAX_LISTED]) + more


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
    _check_blob(model_blob, digest, flag, spec)
    _check_gguf(model_blob, "model", flag, spec)
    if len(adapters) > 1:
        raise ModelStoreError(f"{flag} {spec}: {manifest}: expected at most one ADAPTER layer, "
                              f"found {len(adapters)} ({', '.join(str(b) for b, _ in adapters)})")
    adapter = None
    for adapter, adapter_digest in adapters:
        if not adapter.is_file():
            raise ModelStoreError(f"{flag} {spec}: {adapter}: expected the blob of its ADAPTER "
                                  f"layer ({adapter_digest} in the manifest), found nothing; "
                                  "`ollama pull` it again")
        _check_blob(adapter, adapter_digest, flag, spec)
        _check_gguf(adapter, "ADAPTER", flag, spec)
    return Resolved(spec, model_blob, "ollama", short, digest, blobs, adapter)


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


def _check_gguf(blob: Path, layer: str, flag: str, spec: str) -> None:
    """ModelStoreError naming the model and the blob unless the blob starts as a GGUF does."""
    with open(blob, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelStoreError(f"{flag} {spec}: {blob}: expected a GGUF file (its {layer} layer), "
                              f"found a file starting {magic!r}; this Ollama model is not "
                              "stored in a form toymlx can read")


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
    """Every language-model GGUF in an LM Studio folder, as `PUBLISHER/REPO/FILE.gguf`."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gguf")
                  if p.is_file() and not p.name.lower().startswith("mmproj"))


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
                                  f"{root}: {', '.join(hits[:MAX_LISTED])}"
                                  + (f" and {len(hits) - MAX_LISTED} more" if len(hits) >
                                     MAX_LISTED else "")
                                  + f"; name one, e.g. lmstudio:{hits[0]}")
    listed = "; ".join(f"{r}: {_listing(list_lmstudio(r))}" if len(present) > 1
                       else _listing(list_lmstudio(r)) for r in present)
    where = " or ".join(map(str, present))
    raise ModelStoreError(f"{flag} {spec}: not in LM Studio's models folder {where}; {listed}")
